"""GPU tests for k3fast.kernels.router_down_topk's two fronts (the fused kernel at M <= 4, the cuBLAS GEMM +
TopkFromLogits at every M) against a plain-torch reference written here (docs/k3-layer.md sections 10-12).

Reference: logits = F.linear(x.float(), W_r.float()) (fp32, no TF32), s = sigmoid, selection = stable descending
sort of s + e_bias (ties: lower expert index first), weights from the unbiased s, z = bf16(F.linear fp32),
h = bf16(SiTU-GLU(bf16(x W_sg^T), bf16(x W_su^T))). Tolerances (tests/tolerances.py): z and h "bf16_kernel", the
weights and the fp32 logits "fp32_reformulation"; ids exact except for near-ties (NEAR_TIE below), and exact ties
must follow the lower-index rule.
"""
import pytest
import torch
import torch.nn.functional as F

from tolerances import TOLERANCES, assert_close

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from k3fast.kernels import router_down_topk as rdt  # noqa: E402

NE, DL, D, K = 896, 3584, 7168, 16
IS = 384                     # shared experts' intermediate width at k3_rank(16)
FUSED_BATCHES = (1, 2, 3, 4)
CUBLAS_BATCHES = (1, 3, 5, 8, 17, 32, 64)
FP32_TOL = TOLERANCES["fp32_reformulation"][1]
DEV = torch.device("cuda")


def reference(x, wr, wd, bias, top_k=K, scaling=1.0):
    logits = F.linear(x.float(), wr.float())
    s = torch.sigmoid(logits)
    biased = s + bias
    ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]
    sel = s.gather(1, ids)
    w = sel / (sel.sum(-1, keepdim=True) + 1e-20) * scaling
    z = F.linear(x.float(), wd.float()).to(torch.bfloat16)
    return z, ids.to(torch.int32), w, logits


def reference_h(x, wg, wu):
    """h against fp64 dot products: a and c may round to a neighbouring bf16 where the kernel's fp32 sum order
    differs, hence a relative-RMSE bound rather than equality."""
    a = F.linear(x.double(), wg.double()).to(torch.bfloat16).double()
    c = F.linear(x.double(), wu.double()).to(torch.bfloat16).double()
    return (4.0 * torch.tanh(a / 4.0) * torch.sigmoid(a) * (25.0 * torch.tanh(c / 25.0))).to(torch.bfloat16)


@pytest.fixture(scope="module")
def weights():
    """(W_r, W_down, W_sg, W_su, e_bias); every key the tests run compiled first."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device=DEV).manual_seed(0)
    wr = (torch.randn(NE, D, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    wd = (torch.randn(DL, D, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    wg = (torch.randn(IS, D, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    wu = (torch.randn(IS, D, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    bias = torch.randn(NE, device=DEV, generator=g) * 0.01
    rdt.warmup(IS, FUSED_BATCHES + CUBLAS_BATCHES, device=DEV)
    return wr, wd, wg, wu, bias


# Biased scores closer than this may come out in either order: the kernels' fp32 logits (FMA lanes, a cuBLAS GEMM
# whose algorithm depends on N) and the reference's F.linear sum in different orders, ~1e-6 apart at K = 7168.
# Exact ties, which must follow the lower-index rule, have their own test (test_exact_ties).
NEAR_TIE = 1e-5


def assert_same_routing(ids, idr, biased):
    """ids equal the reference's idr, except for neighbours whose reference biased scores lie within NEAR_TIE (an
    order flip, or the 16th / 17th expert exchanged); every such exception is checked against the scores."""
    if torch.equal(ids, idr):
        return
    b = biased.gather(1, ids.long())
    assert (b[:, 1:] <= b[:, :-1] + NEAR_TIE).all(), f"ids not in descending biased-score order:\n{ids}"
    left_out = biased.scatter(1, ids.long(), float("-inf")).max(-1).values
    assert (left_out <= b[:, -1] + NEAR_TIE).all(), "an expert left out scores above the selection"
    gap = (b - biased.gather(1, idr.long())).abs()
    assert (gap[ids != idr] <= NEAR_TIE).all(), f"ids differ beyond a near-tie:\n{ids}\n{idr}"


def poisoned_outputs(M):
    return dict(out_z=torch.full((M, DL), float("nan"), dtype=torch.bfloat16, device=DEV),
                out_ids=torch.full((M, K), -7, dtype=torch.int32, device=DEV),
                out_w=torch.full((M, K), float("nan"), dtype=torch.float32, device=DEV),
                out_h=torch.full((M, IS), float("nan"), dtype=torch.bfloat16, device=DEV))


def run_front(front, x, w_packed, bias, scaling=1.0):
    """(z, ids, w, h) of the front ``front`` ("fused" or "cublas") into NaN / -7 poisoned outputs."""
    out = poisoned_outputs(x.shape[0])
    if front == "fused":
        got = rdt.router_down_topk(x, w_packed, bias, shared=IS, scaling=scaling, **out)
    else:       # the layer's path above M = 4: the GEMM, then TopkFromLogits into the same outputs
        y = torch.mm(x, w_packed.t(), out_dtype=torch.float32)
        got = rdt.topk_from_logits(y, bias, shared=IS, scaling=scaling, **out)
    assert all(a is b for a, b in zip(got, out.values())), "outputs must be written in place"
    torch.cuda.synchronize()
    return got


def run_checked(front, x, wr, wd, wg, wu, bias, scaling=1.0):
    z, ids, w, h = run_front(front, x, rdt.prepare_front_shared_weight(wr, wd, wg, wu), bias, scaling)
    zr, idr, _, logits = reference(x, wr, wd, bias, scaling=scaling)
    assert z.dtype == torch.bfloat16 and ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ((ids >= 0) & (ids < NE)).all(), "topk_ids has unwritten elements"
    assert_same_routing(ids, idr, torch.sigmoid(logits) + bias)
    s = torch.sigmoid(logits).gather(1, ids.long())          # the weights of the experts this routing picked
    assert_close("topk_w", w, s / (s.sum(-1, keepdim=True) + 1e-20) * scaling, "fp32_reformulation")
    assert (w.sum(-1) - scaling).abs().max().item() <= FP32_TOL * max(1.0, scaling)
    assert_close("z", z, zr, "bf16_kernel")
    assert_close("h", h, reference_h(x, wg, wu), "bf16_kernel")
    return z, ids, w, h


@pytest.mark.parametrize("M", FUSED_BATCHES)
def test_fused_front(weights, M):
    # two calls: the second sees the arrival counter the first reset
    for scaling in (1.0, 2.5):
        run_checked("fused", torch.randn(M, D, device=DEV).to(torch.bfloat16), *weights, scaling=scaling)
    assert rdt.get_workspace(DEV)[1][0].item() == 0, "the arrival counter must be back at 0 after every launch"


@pytest.mark.parametrize("M", CUBLAS_BATCHES)
def test_cublas_front(weights, M):
    """The cuBLAS GEMM + TopkFromLogits (the layer above M = 4; fast-front0 runs it from M = 1); the host wrapper
    router_down_topk_cublas gives the same bits as the two steps."""
    wr, wd, wg, wu, bias = weights
    x = torch.randn(M, D, device=DEV).to(torch.bfloat16)
    got = run_checked("cublas", x, *weights, scaling=2.5)
    again = rdt.router_down_topk_cublas(x, rdt.prepare_front_shared_weight(wr, wd, wg, wu), bias, shared=IS,
                                        scaling=2.5)
    for a, b in zip(got, again):
        assert torch.equal(a, b)


def test_fused_front_rejects_larger_batches(weights):
    wr, wd, wg, wu, bias = weights
    wps = rdt.prepare_front_shared_weight(wr, wd, wg, wu)
    with pytest.raises(ValueError, match="router_down_topk_cublas"):
        rdt.router_down_topk(torch.randn(5, D, device=DEV).to(torch.bfloat16), wps, bias, shared=IS)


FRONT_CASES = [("fused", m) for m in (1, 3, 4)] + [("cublas", m) for m in (1, 8, 16, 64)]


@pytest.mark.parametrize("front,M", FRONT_CASES, ids=[f"{f}-M{m}" for f, m in FRONT_CASES])
def test_exact_ties(weights, front, M):
    """Identical router rows give bit-identical logits on both fronts, so exact ties in s + e_bias: inside the
    selection across TopkFromLogits' four warps (experts 10 / 500 / 700, ranked by four different warps), between
    neighbours of one warp (128 / 129), and at the 16th / 17th place across warps 0 and 1 (200 must win over
    300). The lower expert index wins every tie."""
    wr, wd, wg, wu, _ = weights
    wr = wr.clone()
    bias = torch.zeros(NE, device=DEV)
    forced = [10, 500, 700, 3, 895, 64, 128, 129, 130, 400, 401, 33, 600, 601, 602]        # 15 experts
    wr[500] = wr[10]
    wr[700] = wr[10]                       # three identical logits inside the selection
    wr[129] = wr[128]
    bias[forced] = 2.0
    wr[300] = wr[200]                      # the 16th/17th place is an exact tie: 200 must win over 300
    bias[200] = 1.0
    bias[300] = 1.0
    x = torch.randn(M, D, device=DEV).to(torch.bfloat16)
    _, _, _, logits = reference(x, wr, wd, bias)
    assert torch.equal(logits[:, 10], logits[:, 500]) and torch.equal(logits[:, 200], logits[:, 300])
    _, ids, _, _ = run_checked(front, x, wr, wd, wg, wu, bias)
    for m in range(M):
        row = ids[m].tolist()
        assert set(row) == set(forced) | {200}
        assert row[-1] == 200
        assert row.index(10) < row.index(500) < row.index(700)
        assert row.index(10) + 2 == row.index(700)
        assert row.index(128) + 1 == row.index(129)


@pytest.mark.parametrize("front,M", [("fused", 1), ("fused", 4), ("cublas", 16), ("cublas", 64)],
                         ids=["fused-M1", "fused-M4", "cublas-M16", "cublas-M64"])
@pytest.mark.parametrize("hi,lo", ((10.0, 5.0), (40.0, 10.0)), ids=("step0.33", "step2"))
def test_bias_forces_experts(weights, front, M, hi, lo):
    # A large bias forces experts 880..895 into the selection. Their ORDER follows s + bias: with steps of
    # 0.33 the sigmoid (logit std ~1.7 here, so s spans most of (0, 1)) reorders neighbours, and only with
    # steps of 2.0 > max |s_i - s_j| (< 1) does the bias alone fix the listed order.
    wr, wd, wg, wu, bias = weights
    bias = bias.clone()
    want = list(range(880, 896))
    bias[want] = torch.linspace(hi, lo, K, device=DEV)
    x = torch.randn(M, D, device=DEV).to(torch.bfloat16)
    _, ids, _, _ = run_checked(front, x, wr, wd, wg, wu, bias)
    logits = reference(x, wr, wd, bias)[3]
    key = (torch.sigmoid(logits) + bias).tolist()       # fp32 keys, exactly as the kernels compare them
    for m, row in enumerate(ids.tolist()):
        assert set(row) == set(want)
        assert row == sorted(want, key=lambda e: (-key[m][e], e)), "order must be (-(s + bias), index)"
        if (hi - lo) / (K - 1) > 1.0:
            assert row == want, "bias steps > 1 must decide the order alone"


@pytest.mark.parametrize("M", (1, 4))
def test_logits_workspace_fp32(weights, M):
    """The fused kernel's router logits (its fp32 workspace) are the unrounded fp32 dot products: a different
    summation order over K = 7168 than F.linear's (measured 1.8e-6), where bf16 rounding would be ~1e-3."""
    wr, wd, wg, wu, bias = weights
    x = torch.randn(M, D, device=DEV).to(torch.bfloat16)
    run_checked("fused", x, *weights)
    ws = rdt.get_workspace(DEV)[0][:M].clone()
    assert_close("logits", ws, reference(x, wr, wd, bias)[3], "fp32_reformulation")
    assert (ws != ws.to(torch.bfloat16).float()).float().mean().item() > 0.9, "logits look bf16-rounded"


@pytest.mark.parametrize("front,M", [("fused", 1), ("fused", 4), ("cublas", 8), ("cublas", 64)],
                         ids=["fused-M1", "fused-M4", "cublas-M8", "cublas-M64"])
def test_cuda_graph_replay(weights, front, M):
    """Replays with new x in the captured buffer give the reference's routing, weights, z and h each time; the
    fused kernel's arrival counter is back at 0 after every replay."""
    wr, wd, wg, wu, bias = weights
    wps = rdt.prepare_front_shared_weight(wr, wd, wg, wu)
    x = torch.randn(M, D, device=DEV).to(torch.bfloat16)
    out = poisoned_outputs(M)
    fn = rdt.router_down_topk if front == "fused" else rdt.router_down_topk_cublas
    kw = out if front == "fused" else {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x, wps, bias, shared=IS, **kw)                  # warm (compiled already)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = fn(x, wps, bias, shared=IS, **kw)
    z, ids, w, h = got
    for _ in range(3):
        x.copy_(torch.randn(M, D, device=DEV).to(torch.bfloat16))
        for t in (z, w, h):
            t.fill_(float("nan"))
        ids.fill_(-1)
        g.replay()
        torch.cuda.synchronize()
        zr, idr, _, logits = reference(x, wr, wd, bias)
        assert_same_routing(ids, idr, torch.sigmoid(logits) + bias)
        sel = torch.sigmoid(logits).gather(1, ids.long())
        assert_close("topk_w", w, sel / (sel.sum(-1, keepdim=True) + 1e-20), "fp32_reformulation")
        assert_close("z", z, zr, "bf16_kernel")
        assert_close("h", h, reference_h(x, wg, wu), "bf16_kernel")
        if front == "fused":
            assert rdt.get_workspace(DEV)[1][0].item() == 0


@pytest.mark.parametrize("front", ["fused", "cublas"])
def test_nan_input_does_not_pass(weights, front):
    wr, wd, wg, wu, bias = weights
    x = torch.randn(2, D, device=DEV).to(torch.bfloat16)
    x[1, 5] = float("nan")
    z, ids, w, h = run_front(front, x, rdt.prepare_front_shared_weight(wr, wd, wg, wu), bias)
    assert torch.isnan(z[1].float()).any() and torch.isnan(h[1].float()).any()
    assert torch.isfinite(z[0].float()).all() and torch.isfinite(h[0].float()).all()
    assert torch.isfinite(w[0]).all()
    assert not torch.isfinite(w[1]).all()        # NaN scores must surface in the weights, not vanish
