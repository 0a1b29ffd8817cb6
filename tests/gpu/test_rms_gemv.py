"""k3fast.kernels.rms_gemv on the GPU against a plain fp32 torch reference (attnres_cases.ref_attnres).

Reference (k3-spec.md section 6, vLLM semantics): p' = bf16(p + delta); sources = blocks[:n_blocks] then p';
r_i = rsqrt(mean v_i^2 + eps); s_i = r_i * <v_i, u>; alpha = softmax(s); m = sum alpha_i v_i (fp32);
x = w_ln * m * rsqrt(mean m^2 + eps) (fp32); y = F.linear(x, w) in fp32. The kernels round x to bf16 before
the dot; the tolerance (relative RMSE <= 1e-2) covers that and the bf16 output rounding."""
import pytest
import torch
import torch.nn.functional as F

from attnres_cases import EPS, K, N_FULL, N_RANK8, N_RANK16, make_inputs, make_w, ref_attnres, rel_rmse

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def R():
    from k3fast.kernels import rms_gemv
    return rms_gemv


# ----------------------------------------------------------------------------- plain gemv

@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 8, 16, 33, 64])
@pytest.mark.parametrize("N,Kw", [(N_RANK16, K), (7168, 768), (768, 7168), (7168, 384), (64, 1552)])
def test_gemv(R, seed, M, N, Kw):
    x = torch.randn(M, Kw, device="cuda").to(torch.bfloat16)
    w = make_w(N, Kw)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = R.gemv(x, w, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert not y.isnan().any()
    ref = F.linear(x.float(), w.float())
    assert rel_rmse(y, ref) <= 1e-2


def test_gemv_rows_beyond_M_untouched(R, seed):
    # a [7, N] view of a bigger buffer: row 7 (bucket padding) must never be written
    big = torch.full((8, 512), 7.0, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(7, 1024, device="cuda").to(torch.bfloat16)
    w = make_w(512, 1024)
    R.gemv(x, w, out=big[:7])
    assert (big[7] == 7.0).all()
    assert rel_rmse(big[:7], F.linear(x.float(), w.float())) <= 1e-2


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
                               out=out, partial_out=pout)
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


@pytest.mark.parametrize("M", [1, 2, 3, 4])
def test_fused_vs_unfused(R, seed, M):
    """The fused kernel (forced for M <= 4) and attnres_rmsnorm + gemv agree closely."""
    blocks, p, delta, u, w_ln = make_inputs(M, 5, True)
    w = make_w(N_RANK16)
    y1, p1 = R.attnres_rms_gemv(blocks, 5, p, delta, u, w_ln, w, fuse_max_m=4)
    y2, p2 = R.attnres_rms_gemv(blocks, 5, p, delta, u, w_ln, w, fuse_max_m=0)
    torch.cuda.synchronize()
    assert torch.equal(p1, p2)
    assert rel_rmse(y1, y2) <= 2e-3
    x_ref, _ = ref_attnres(blocks, 5, p, delta, u, w_ln)
    assert rel_rmse(y1, F.linear(x_ref, w.float())) <= 1e-2


# Opt-in builds that must not change a bit of the output: (keyword, default value, opt-in value, batches).
#   fused_groups=2 (v3): the same operations per row group, two groups per loop iteration.
#   pin_loads=True (v6): + 0 * (sum of the batch's first weights) in each weight scale, fused (M <= 2) and through
#                        attnres_rmsnorm + the plain FMA GEMV (M = 3, 4).
#   prefetch_groups=3 (v7): L2 prefetches only, 3 row groups ahead instead of 1 (fused, M <= 2).
BITWISE_OPTIONS = [("fused_groups", 1, 2, (1, 2)), ("pin_loads", False, True, (1, 2, 3, 4)),
                   ("prefetch_groups", 1, 3, (1, 2))]


@pytest.mark.parametrize("N", [N_RANK16, N_RANK8, N_FULL])
@pytest.mark.parametrize("option,off,on,M", [(o, a, b, m) for o, a, b, ms in BITWISE_OPTIONS for m in ms])
def test_opt_in_builds_are_bitwise(R, seed, option, off, on, M, N):
    blocks, p, delta, u, w_ln = make_inputs(M, 5, True)
    w = make_w(N)
    y1, p1 = R.attnres_rms_gemv(blocks, 5, p, delta, u, w_ln, w, **{option: off})
    y2 = torch.full_like(y1, float("nan"))
    _, p2 = R.attnres_rms_gemv(blocks, 5, p, delta, u, w_ln, w, out=y2, **{option: on})
    torch.cuda.synchronize()
    assert torch.equal(y1, y2) and torch.equal(p1, p2)


@pytest.mark.parametrize("M", [1, 3, 16, 64])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cluster", [1, 4])
def test_attnres_rmsnorm(R, seed, M, w_dtype, cluster):
    blocks, p, delta, u, w_ln = make_inputs(M, 4, True)
    w_ln = w_ln.to(w_dtype)
    x_ref, p2_ref = ref_attnres(blocks, 4, p, delta, u, w_ln)
    out = torch.full((M, K), float("nan"), device="cuda", dtype=torch.bfloat16)
    blocks[:, 4].fill_(float("nan"))
    x, po = R.attnres_rmsnorm(blocks, 4, p, delta, u, w_ln, out=out, block_write=4, cluster=cluster)
    torch.cuda.synchronize()
    assert not x.isnan().any()
    assert rel_rmse(x, x_ref) <= 1e-2
    # x is bf16(x_ref) up to fp32 summation order: elementwise within 2 bf16 ulps
    assert ((x.float() - x_ref).abs() <= 2 ** -7 * x_ref.abs() + 1e-6).float().mean() > 0.999
    assert torch.equal(po, p2_ref) and torch.equal(blocks[:, 4], p2_ref)


@pytest.mark.parametrize("cluster", [2, 8])
@pytest.mark.parametrize("n_blocks,has_delta", [(0, False), (7, True)])
def test_attnres_rmsnorm_cluster(R, seed, cluster, n_blocks, has_delta):
    """v15's cluster build at every cluster size against the reference, and deterministic: two calls, the same
    bits; with one CTA per token it agrees to fp32 summation order (the statistics are split differently)."""
    M = 9
    blocks, p, delta, u, w_ln = make_inputs(M, n_blocks, has_delta)
    x_ref, p2_ref = ref_attnres(blocks, n_blocks, p, delta, u, w_ln)
    outs = []
    for _ in range(2):
        out = torch.full((M, K), float("nan"), device="cuda", dtype=torch.bfloat16)
        po = torch.full((M, K), float("nan"), device="cuda", dtype=torch.bfloat16)
        x, po = R.attnres_rmsnorm(blocks, n_blocks, p, delta, u, w_ln, out=out, partial_out=po, cluster=cluster)
        outs.append((x, po))
    x1, _ = R.attnres_rmsnorm(blocks, n_blocks, p, delta, u, w_ln, cluster=1)
    torch.cuda.synchronize()
    x, po = outs[0]
    assert not x.isnan().any()
    assert torch.equal(outs[1][0], x) and torch.equal(outs[1][1], po)
    assert torch.equal(po, p2_ref)
    assert rel_rmse(x, x_ref) <= 1e-2
    assert ((x.float() - x_ref).abs() <= 2 ** -7 * x_ref.abs() + 1e-6).float().mean() > 0.999
    assert ((x.float() - x1.float()).abs() <= 2 ** -7 * x1.float().abs()).all()


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
    xg = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    out2 = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    from k3fast.measure.trace import capture

    def step():
        R.attnres_rms_gemv(blocks, 3, p, delta, u, w_ln, w, out=out, partial_out=pout, block_write=3)
        R.gemv(xg, w, out=out2)
    g = capture(step, warmup=1)            # the warm-up compiles, outside the capture
    for _ in range(3):
        nb, npp, nd, nu, nwl = make_inputs(M, 3, True)
        blocks.copy_(nb); p.copy_(npp); delta.copy_(nd); u.copy_(nu); w_ln.copy_(nwl)
        xg.copy_(torch.randn(M, K, device="cuda"))
        out.fill_(float("nan")); out2.fill_(float("nan")); pout.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        x_ref, p2_ref = ref_attnres(nb, 3, npp, nd, nu, nwl)
        assert torch.equal(pout, p2_ref) and torch.equal(blocks[:, 3], p2_ref)
        assert torch.equal(blocks[:, :3], nb[:, :3]) and torch.equal(blocks[:, 4:], nb[:, 4:])
        assert rel_rmse(out, F.linear(x_ref, w.float())) <= 1e-2
        assert rel_rmse(out2, F.linear(xg.float(), w.float())) <= 1e-2


def test_deterministic(R, seed):
    for M in (1, 8, 64):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        w = make_w(768)
        a = R.gemv(x, w)
        b = R.gemv(x, w)
        assert torch.equal(a, b)
