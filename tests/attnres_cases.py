"""AttnRes + RMSNorm cases shared by the rms_gemv and rms_gemv_ring tests (CPU compile tier and GPU tier).

The GPU reference (docs/k3-layer.md §6, vLLM semantics): p' = bf16(p + delta); sources = blocks[:n_blocks] then
p'; r_i = rsqrt(mean v_i^2 + eps); s_i = r_i * <v_i, u>; alpha = softmax(s); m = sum alpha_i v_i (fp32);
x = w_ln * m * rsqrt(mean m^2 + eps) (fp32)."""
import torch


def k3_attnres_variants(cfg):
    """(n_blocks, has_delta, block_write) of every pre-attention AttnRes site in the K3 layer schedule."""
    out = set()
    for l in range(cfg.num_hidden_layers):
        nb = cfg.num_blocks_before(l)
        bw = l // cfg.attn_res_block_size if cfg.is_block_boundary(l) else -1
        out.add((nb, l > 0, bw))
    return sorted(out)


def k3_attnres2_variants(cfg):
    """(n_blocks, has_delta, block_write) of every AttnRes #2 site (after o_proj: the blocks before the layer plus the
    one a boundary layer starts; delta = o_proj's output; no block write)."""
    return sorted({(cfg.num_blocks_before(l) + int(cfg.is_block_boundary(l)), True, -1)
                   for l in range(cfg.num_hidden_layers)})


# The corners of the schedule for the compile tier (the other sites change only unrolled trip counts): no blocks and
# no delta with a write of block 0; one block; the rms_gemv_ring joint prologue's last site at M = 2 (3 blocks) and the
# first it leaves to the token-by-token prologue (4); all 8 blocks.
CORNER_SITES = [(0, False, 0), (1, True, -1), (3, True, 3), (4, True, 4), (8, True, -1)]


EPS = 1e-5
K = 7168
N_RANK16, N_RANK8, N_FULL = 3216, 6288, 49376


def rel_rmse(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def ref_attnres(blocks, n_blocks, p, delta, u, w_ln):
    p2 = p if delta is None else (p.float() + delta.float()).to(torch.bfloat16)
    src = torch.cat([blocks[:, :n_blocks].float(), p2.float()[:, None]], dim=1)      # [M, S, K]
    r = torch.rsqrt(src.pow(2).mean(-1) + EPS)
    s = r * (src @ u.float())
    a = torch.softmax(s, dim=-1)
    m = torch.einsum("ms,msk->mk", a, src)
    x = w_ln.float() * m * torch.rsqrt(m.pow(2).mean(-1, keepdim=True) + EPS)
    return x, p2


def make_inputs(M, n_blocks, with_delta, dev="cuda"):
    # realistic scales: blocks/partial O(1) with per-token spread, small u (gamma*pi), w_ln ~ 1
    blocks = (torch.randn(M, 8, K, device=dev) * (0.5 + torch.rand(M, 8, 1, device=dev))).to(torch.bfloat16)
    p = (torch.randn(M, K, device=dev) * 2.0).to(torch.bfloat16)
    delta = (torch.randn(M, K, device=dev) * 0.5).to(torch.bfloat16) if with_delta else None
    u = torch.randn(K, device=dev) * 0.05
    w_ln = (1.0 + 0.1 * torch.randn(K, device=dev)).to(torch.bfloat16)
    return blocks, p, delta, u, w_ln


def make_w(N, Kw=K, dev="cuda"):
    return (torch.randn(N, Kw, device=dev) * Kw ** -0.5).to(torch.bfloat16)


def check_norm_then_gemm_in_a_graph(M, gemm, label, **pins):
    """The layer's in_proj above M = 2 (rms_gemv.attnres_rmsnorm with its trigger after its wait, then ``gemm(x, w,
    **pins)``: rms_gemv_ring.gemv_ring_mma or gemm_wgmma_splitk.gemm_wgmma) against k3ref's AttnRes + RMSNorm: p'
    exact, y against the fp32 reference ("bf16_kernel") and equal to the norm with its trigger at its end + the same
    GEMM (the trigger placement changes no bit); then captured once and replayed on new inputs, each replay (its y
    poisoned first) equal to an eager call, p' included. Returns (call, inputs, w): call(partial_out) runs the pair on
    the inputs as they are now."""
    import torch.nn.functional as F
    from k3fast.kernels import rms_gemv as R
    from tolerances import assert_close
    n_blocks = 3
    blocks, p, delta, u, w_ln = make_inputs(M, n_blocks, True)
    w = make_w(N_RANK8)
    pout = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)

    def call(po):
        x, po = R.attnres_rmsnorm(blocks, n_blocks, p, delta, u, w_ln, eps=EPS, block_write=-1, partial_out=po,
                                  early_trigger=True)
        return gemm(x, w, **pins), po

    y, po = call(pout)
    x_ref, p2_ref = ref_attnres(blocks, n_blocks, p, delta, u, w_ln)
    torch.cuda.synchronize()
    assert_close("p'", po, p2_ref, "exact")
    assert_close(label, y, F.linear(x_ref, w.float()), "bf16_kernel")
    x_n, p_n = R.attnres_rmsnorm(blocks, n_blocks, p, delta, u, w_ln, eps=EPS)
    assert torch.equal(p_n, po)
    assert torch.equal(gemm(x_n, w, **pins), y)             # the norm's trigger placement changes no bit
    holder = {}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        holder["y"], _ = call(pout)
    for _ in range(3):
        b2, p2, d2, _, _ = make_inputs(M, n_blocks, True)
        blocks.copy_(b2), p.copy_(p2), delta.copy_(d2)
        holder["y"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        y_e, p_e = call(torch.empty_like(pout))
        torch.cuda.synchronize()
        assert torch.equal(holder["y"], y_e) and torch.equal(pout, p_e)
    return call, (blocks, n_blocks, p, delta, u, w_ln), w
