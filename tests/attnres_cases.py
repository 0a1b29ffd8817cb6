"""AttnRes + RMSNorm cases shared by the rms_gemv and rms_gemv_ring tests (CPU compile tier and GPU tier).

The GPU reference (k3-spec.md section 6, vLLM semantics): p' = bf16(p + delta); sources = blocks[:n_blocks] then
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
