"""k3fast.kernels.rms_gemv on the GPU against a plain fp32 torch reference (attnres_cases.ref_attnres).

Reference (docs/k3-layer.md section 6, vLLM semantics): p' = bf16(p + delta); sources = blocks[:n_blocks] then p';
r_i = rsqrt(mean v_i^2 + eps); s_i = r_i * <v_i, u>; alpha = softmax(s); m = sum alpha_i v_i (fp32);
x = w_ln * m * rsqrt(mean m^2 + eps) (fp32); y = F.linear(x, w) in fp32. The kernels round x to bf16 before
the dot; the tolerance (relative RMSE <= 1e-2) covers that and the bf16 output rounding. attnres_rms_gemv is the
fused FMA kernel at M <= 2 (the layer's contender there) and the norm kernel + cuBLAS above."""
import pytest
import torch
import torch.nn.functional as F

from attnres_cases import EPS, K, N_FULL, N_RANK8, N_RANK16, make_inputs, make_w, ref_attnres, rel_rmse

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def R():
    from k3fast.kernels import rms_gemv
    return rms_gemv


# ----------------------------------------------------------------------------- AttnRes + RMSNorm (+ GEMV)

CASES = [(N_RANK16, M) for M in (1, 2, 3, 4, 7, 8, 16, 64)] + [(N_RANK8, M) for M in (1, 2, 4, 8, 64)] \
    + [(N_FULL, 1), (N_FULL, 8)]


@pytest.mark.parametrize("N,M", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("n_blocks,with_delta,block_write", [(0, False, 0), (1, True, -1), (3, True, -1),
                                                             (3, False, 3), (8, True, -1)])
def test_attnres_rms_gemv(R, seed, N, M, n_blocks, with_delta, block_write):
    if N == N_FULL and (n_blocks, with_delta) not in ((8, True), (0, False)):
        pytest.skip("full width: two variants are enough (708 MB weight)")
    blocks, p, delta, u, w_ln = make_inputs(M, n_blocks, with_delta)
    w = make_w(N)
    blocks0, p0 = blocks.clone(), p.clone()
    d0 = None if delta is None else delta.clone()
    x_ref, p2_ref = ref_attnres(blocks, n_blocks, p, delta, u, w_ln)
    y_ref = F.linear(x_ref, w.float())
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    pout = torch.full((M, K), float("nan"), device="cuda", dtype=torch.bfloat16)
    y, po = R.attnres_rms_gemv(blocks, n_blocks, p, delta, u, w_ln, w, eps=EPS, block_write=block_write,
                               out=out, partial_out=pout, early_trigger=True)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr() and po.data_ptr() == pout.data_ptr()
    assert not y.isnan().any()
    assert torch.equal(po, p2_ref)                                   # exact bf16(p + delta)
    assert rel_rmse(y, y_ref) <= 1e-2
    assert torch.equal(p, p0) and (delta is None or torch.equal(delta, d0))
    expect = blocks0.clone()
    if block_write >= 0:
        expect[:, block_write] = p2_ref
    assert torch.equal(blocks, expect)                               # written row exact, others untouched


@pytest.mark.parametrize("M", [1, 2, 3, 9])
@pytest.mark.parametrize("n_blocks,with_delta", [(0, False), (3, True)])
def test_strided_partial_reads_a_column_slice(R, seed, M, n_blocks, with_delta):
    """The p_strided builds (fused at M <= FUSE_MAX_M, the norm kernel + cuBLAS above): p a column slice of a wider
    tensor (MLA's q_a inside its packed projection output, 2880 wide at rank16), the same bits as on a compact copy,
    the tensor around the slice untouched."""
    blocks, p, delta, u, w_ln = make_inputs(M, n_blocks, with_delta)
    wide = torch.randn(M, K + 1344, device="cuda").to(torch.bfloat16)
    wide[:, :K] = p
    around = wide[:, K:].clone()
    w = make_w(N_RANK16)
    assert R.p_strided(wide[:, :K]) and not R.p_strided(p)
    y1, p1 = R.attnres_rms_gemv(blocks.clone(), n_blocks, wide[:, :K], delta, u, w_ln, w)
    y2, p2 = R.attnres_rms_gemv(blocks.clone(), n_blocks, p, delta, u, w_ln, w)
    torch.cuda.synchronize()
    assert torch.equal(y1, y2) and torch.equal(p1, p2)
    assert torch.equal(wide[:, K:], around) and torch.equal(wide[:, :K], p)
    odd = torch.zeros(M, K + 4, device="cuda", dtype=torch.bfloat16)[:, :K]     # rows 8 bytes apart from aligned
    if M > 1:
        with pytest.raises(ValueError, match="row stride"):
            R.attnres_rms_gemv(blocks, n_blocks, odd, delta, u, w_ln, w)
    else:
        # one row: its stride never matters (the kernels read row 0 only), so the call is taken
        odd.copy_(p)
        y3, p3 = R.attnres_rms_gemv(blocks.clone(), n_blocks, odd, delta, u, w_ln, w)
        torch.cuda.synchronize()
        assert torch.equal(y3, y2) and torch.equal(p3, p2)


@pytest.mark.parametrize("M", [1, 2])
def test_fused_vs_unfused(R, seed, M):
    """The fused kernel and attnres_rmsnorm + cuBLAS on the same inputs agree closely (the same bf16 x, different K
    orders), p' exactly."""
    blocks, p, delta, u, w_ln = make_inputs(M, 5, True)
    w = make_w(N_RANK16)
    y1, p1 = R.attnres_rms_gemv(blocks, 5, p, delta, u, w_ln, w, early_trigger=True)
    x2, p2 = R.attnres_rmsnorm(blocks, 5, p, delta, u, w_ln)
    y2 = F.linear(x2, w)
    torch.cuda.synchronize()
    assert torch.equal(p1, p2)
    assert rel_rmse(y1, y2) <= 2e-3
    x_ref, _ = ref_attnres(blocks, 5, p, delta, u, w_ln)
    assert rel_rmse(y1, F.linear(x_ref, w.float())) <= 1e-2


@pytest.mark.parametrize("N", [N_RANK16, N_RANK8, N_FULL])
@pytest.mark.parametrize("M", [1, 2])
def test_trigger_placement_is_bitwise(R, seed, M, N):
    """The fused kernel's PDL trigger after its wait (the layer's) or after its last store: the same bits, and a
    token's result does not depend on the other token of its batch (its own accumulators, the same K split)."""
    blocks, p, delta, u, w_ln = make_inputs(M, 5, True)
    w = make_w(N)
    y1, p1 = R.attnres_rms_gemv(blocks, 5, p, delta, u, w_ln, w)
    y2 = torch.full_like(y1, float("nan"))
    _, p2 = R.attnres_rms_gemv(blocks, 5, p, delta, u, w_ln, w, out=y2, early_trigger=True)
    torch.cuda.synchronize()
    assert torch.equal(y1, y2) and torch.equal(p1, p2)
    y_last, _ = R.attnres_rms_gemv(blocks[-1:].contiguous(), 5, p[-1:].contiguous(), delta[-1:].contiguous(), u,
                                   w_ln, w, early_trigger=True)
    torch.cuda.synchronize()
    assert torch.equal(y_last[0], y1[-1])


@pytest.mark.parametrize("M", [1, 3, 16, 64])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_attnres_rmsnorm(R, seed, M, w_dtype):
    """One CTA per token at M <= 2, a cluster of NORM_CLUSTER CTAs per token above."""
    blocks, p, delta, u, w_ln = make_inputs(M, 4, True)
    w_ln = w_ln.to(w_dtype)
    x_ref, p2_ref = ref_attnres(blocks, 4, p, delta, u, w_ln)
    out = torch.full((M, K), float("nan"), device="cuda", dtype=torch.bfloat16)
    blocks[:, 4].fill_(float("nan"))
    x, po = R.attnres_rmsnorm(blocks, 4, p, delta, u, w_ln, out=out, block_write=4)
    torch.cuda.synchronize()
    assert not x.isnan().any()
    assert rel_rmse(x, x_ref) <= 1e-2
    # x is bf16(x_ref) up to fp32 summation order: elementwise within 2 bf16 ulps
    assert ((x.float() - x_ref).abs() <= 2 ** -7 * x_ref.abs() + 1e-6).float().mean() > 0.999
    assert torch.equal(po, p2_ref) and torch.equal(blocks[:, 4], p2_ref)


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("n_blocks,has_delta", [(0, False), (7, True)])
def test_attnres_rmsnorm_cluster(R, seed, early, n_blocks, has_delta):
    """The cluster build (M >= NORM_CLUSTER_MIN_M) against the reference, deterministic (two calls, the same bits),
    its trigger placement changing no bit, and within 1 bf16 ulp of one CTA per token (each token alone, M = 1: the
    statistics are split differently) plus 2^-12 of the row's rms: with blocks, the softmax over the sources turns
    an fp32 reordering of the scores into absolute differences that near a zero of the mix are several bf16 ulps
    (tests/ref/test_attnres_rounding.py measures it on these inputs)."""
    M = 9
    blocks, p, delta, u, w_ln = make_inputs(M, n_blocks, has_delta)
    x_ref, p2_ref = ref_attnres(blocks, n_blocks, p, delta, u, w_ln)
    outs = []
    for et in (early, not early, early):
        out = torch.full((M, K), float("nan"), device="cuda", dtype=torch.bfloat16)
        po = torch.full((M, K), float("nan"), device="cuda", dtype=torch.bfloat16)
        outs.append(R.attnres_rmsnorm(blocks, n_blocks, p, delta, u, w_ln, out=out, partial_out=po, early_trigger=et))
    x1 = torch.cat([R.attnres_rmsnorm(blocks[m:m + 1].contiguous(), n_blocks, p[m:m + 1].contiguous(),
                                      None if delta is None else delta[m:m + 1].contiguous(), u, w_ln)[0]
                    for m in range(M)])
    torch.cuda.synchronize()
    x, po = outs[0]
    assert not x.isnan().any()
    assert all(torch.equal(o[0], x) and torch.equal(o[1], po) for o in outs[1:])
    assert torch.equal(po, p2_ref)
    assert rel_rmse(x, x_ref) <= 1e-2
    assert ((x.float() - x_ref).abs() <= 2 ** -7 * x_ref.abs() + 1e-6).float().mean() > 0.999
    rms = x1.float().pow(2).mean(-1, keepdim=True).sqrt()
    bad = ((x.float() - x1.float()).abs() > 2 ** -7 * x1.float().abs() + 2 ** -12 * rms).nonzero().tolist()
    assert not bad, (f"{len(bad)} of {x.numel()} elements differ from the one-CTA build by more than 1 bf16 ulp; "
                     "first (m, k, cluster, one CTA, fp32 ref): "
                     + "; ".join(f"{m},{k},{x[m, k].item():.6g},{x1[m, k].item():.6g},{x_ref[m, k].item():.6g}"
                                 for m, k in bad[:8]))


def test_attnres_rmsnorm_in_place(R, seed):
    blocks, p, delta, u, w_ln = make_inputs(4, 2, True)
    x_ref, p2_ref = ref_attnres(blocks, 2, p, delta, u, w_ln)
    x, po = R.attnres_rmsnorm(blocks, 2, p, delta, u, w_ln, partial_out=p)     # vLLM updates p in place
    torch.cuda.synchronize()
    assert po.data_ptr() == p.data_ptr() and torch.equal(p, p2_ref)
    assert rel_rmse(x, x_ref) <= 1e-2


def test_nan_propagates(R, seed):
    blocks, p, delta, u, w_ln = make_inputs(1, 2, True)
    p[0, 123] = float("nan")
    y, _ = R.attnres_rms_gemv(blocks, 2, p, delta, u, w_ln, make_w(256))
    torch.cuda.synchronize()
    assert y.isnan().all()                                           # NaN never turns into a finite value


# ----------------------------------------------------------------------------- CUDA graphs

@pytest.mark.parametrize("M", [1, 4, 8, 64])
def test_cuda_graph_replay(R, seed, M):
    N = N_RANK16
    blocks, p, delta, u, w_ln = make_inputs(M, 3, True)
    w = make_w(N)
    pout = torch.empty_like(p)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    from k3fast.measure.trace import capture

    def step():
        R.attnres_rms_gemv(blocks, 3, p, delta, u, w_ln, w, out=out, partial_out=pout, block_write=3,
                           early_trigger=True)
    g = capture(step, warmup=1)            # the warm-up compiles, outside the capture
    for _ in range(3):
        nb, npp, nd, nu, nwl = make_inputs(M, 3, True)
        blocks.copy_(nb); p.copy_(npp); delta.copy_(nd); u.copy_(nu); w_ln.copy_(nwl)
        out.fill_(float("nan")); pout.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        x_ref, p2_ref = ref_attnres(nb, 3, npp, nd, nu, nwl)
        assert torch.equal(pout, p2_ref) and torch.equal(blocks[:, 3], p2_ref)
        assert torch.equal(blocks[:, :3], nb[:, :3]) and torch.equal(blocks[:, 4:], nb[:, 4:])
        assert rel_rmse(out, F.linear(x_ref, w.float())) <= 1e-2


def test_deterministic(R, seed):
    for M in (1, 2, 8, 64):
        blocks, p, delta, u, w_ln = make_inputs(M, 3, True)
        w = make_w(768)
        a, pa = R.attnres_rms_gemv(blocks, 3, p, delta, u, w_ln, w, early_trigger=True)
        b, pb = R.attnres_rms_gemv(blocks, 3, p, delta, u, w_ln, w, early_trigger=True)
        assert torch.equal(a, b) and torch.equal(pa, pb)
