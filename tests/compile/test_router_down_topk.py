"""CPU compile tests for k3fast.kernels.router_down_topk: every compile key for the K3 shapes, plus host-side input checks."""
import re

import pytest
import torch

from k3fast.kernels import router_down_topk as rdt
from k3ref.config import k3, k3_rank

pytestmark = pytest.mark.compile


def _have_dsl():
    try:
        from k3fast.kernels._dsl import dsl_available
        return dsl_available()
    except Exception:
        return False


CONFIGS = {"k3_rank16": lambda: k3_rank(16), "k3_rank8": lambda: k3_rank(8), "full": k3}
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _shape(cfg):
    return dict(n_experts=cfg.num_experts, latent=cfg.routed_expert_hidden_size, hidden=cfg.hidden_size,
                top_k=cfg.num_experts_per_token)


def test_buckets():
    assert [rdt.bucket_m(m) for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64)] == [1, 2, 4, 4, 8, 8, 8, 16, 16, 32,
                                                                                  64, 64]
    for bad in (0, 65):
        with pytest.raises(ValueError):
            rdt.bucket_m(bad)


def test_kernel_paths():
    # M > 4 runs the tensor-core path; the register log must show no spills for any bucket
    assert [rdt.kernel_path(m) for m in (1, 2, 3, 4, 5, 8, 16, 32, 64)] == ["fma"] * 4 + ["mma"] * 5
    assert set(rdt.MMA_CONFIG) == {8, 16, 32, 64}
    assert all(spill == 0 for _, spill in rdt.REGISTER_LOG.values())


@pytest.mark.skipif(not _have_dsl(), reason="cutlass DSL / tvm-ffi not importable")
def test_fma_occupancy_hint_reaches_ptx():
    """The A/B mechanism of v2.2 (bench row router_down_topk@minb9): an explicit min_blocks reaches ptxas as
    .minnctapersm; the defaults (v2.3: no hint, measured faster) and the mma path carry none."""
    from k3fast.kernels._dsl import TVM_FFI
    from k3fast.measure.ptxcheck import compiled_ptx
    import k3fast.kernels.router_down_topk as m
    old = m.TVM_FFI
    m.TVM_FFI = TVM_FFI + " --keep-ptx"
    try:
        hint = m.FMA_MIN_BLOCKS_TRIED[1]
        ptx1h = compiled_ptx(lambda: m._build(1, 896, 3584, 7168, 16, m.fma_unroll(1), hint))
        ptx1 = compiled_ptx(lambda: m._build(1, 896, 3584, 7168, 16, m.fma_unroll(1), m.fma_min_blocks(1)))
        ptx8 = compiled_ptx(lambda: m._build(8, 896, 3584, 7168, 16, m.fma_unroll(8), m.fma_min_blocks(8)))
    finally:
        m.TVM_FFI = old
    assert f".minnctapersm {hint}" in ptx1h
    assert ".minnctapersm" not in ptx1 and ".minnctapersm" not in ptx8
    for mb, (rtw, ks, _) in rdt.MMA_CONFIG.items():
        assert 896 % (16 * rtw) == 0 and 3584 % (16 * rtw) == 0 and (7168 // 32) % ks == 0
        assert -(-mb // ks) <= 896 // (16 * rtw)          # top-k CTAs <= router CTAs


def test_compile_keys_cover_batches():
    keys = rdt.compile_keys((1, 2, 3, 4, 7, 8, 16, 64))
    assert {k[1] for k in keys} == {1, 2, 4, 8, 16, 64}


@pytest.mark.skipif(not _have_dsl(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("mb", BUCKETS)
def test_compile(cfg_name, mb):
    cfg = CONFIGS[cfg_name]()
    sh = _shape(cfg)
    # the router and W_down are replicated on every TP rank: the same key at every preset
    assert (sh["n_experts"], sh["latent"], sh["hidden"], sh["top_k"]) == (896, 3584, 7168, 16)
    fn = rdt.get_kernel(mb, **sh)
    assert fn is not None
    assert fn is rdt.get_kernel(mb, **sh)            # cached: compiled once per key


def test_bad_shape_params():
    with pytest.raises(ValueError):
        rdt.get_kernel(1, n_experts=900)
    with pytest.raises(ValueError):
        rdt.get_kernel(1, top_k=33)
    with pytest.raises(ValueError):
        rdt.get_kernel(1, hidden=7000)
    with pytest.raises(ValueError, match="M bucket 64"):
        rdt.get_kernel(64, latent=3584 + 16)               # not a multiple of 32 rows (RTW=2 tiles)


# ------------------------------------------------------------------ host checks (CPU tensors; no kernel runs)

def _args(m=1):
    x = torch.randn(m, 7168).to(torch.bfloat16)
    w = torch.randn(4480, 7168).to(torch.bfloat16)
    b = torch.zeros(896)
    return x, w, b


def test_rejects_cpu_tensors():
    x, w, b = _args()
    with pytest.raises(ValueError, match="CUDA"):
        rdt.router_down_topk(x, w, b)


def test_rejects_wrong_dtype():
    x, w, b = _args()
    with pytest.raises(TypeError, match="x"):
        rdt.router_down_topk(x.float(), w, b)


def test_rejects_wrong_rank():
    x, w, b = _args()
    with pytest.raises(ValueError, match="x"):
        rdt.router_down_topk(x[0], w, b)


def test_rejects_non_contiguous():
    x, w, b = _args(4)
    with pytest.raises(ValueError, match="contiguous"):
        rdt.router_down_topk(x.t().contiguous().t(), w, b)


def test_topk_from_logits_rejects_bad_input():
    y = torch.randn(3, 4480)
    b = torch.zeros(896)
    with pytest.raises(ValueError, match="CUDA"):
        rdt.topk_from_logits(y, b)
    with pytest.raises(TypeError, match="y"):
        rdt.topk_from_logits(y.double(), b)
    with pytest.raises(ValueError, match="y"):
        rdt.topk_from_logits(y[0], b)


@pytest.mark.skipif(not _have_dsl(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("shape", ["k3_rank16", "full"])
def test_topk_from_logits_compiles(shape):
    """The top-k after the cuBLAS front (M > FRONT_DSL_MAX_M): one key per (experts, latent, top_k), any M."""
    cfg = CONFIGS[shape]()
    sh = _shape(cfg)
    assert rdt.get_topk_kernel(sh["n_experts"], sh["latent"], sh["top_k"]) is not None


_PTX: dict = {}


def _topk_ptx(mb, rolled):
    """PTX of the front (mb >= 1; "1s": bucket 1 with the shared gate/up folded in, v2.7) or of TopkFromLogits (mb 0,
    shared gate/up folded in; "0s": with the top-k split over the 4 warps, v2.8), compiled once per test run."""
    if (mb, rolled) not in _PTX:
        from k3fast.kernels._dsl import TVM_FFI
        from k3fast.measure.ptxcheck import compiled_ptx
        b, shared = {"1s": (1, 384), "0s": (0, 384)}.get(mb, (mb, 384 * (mb == 0)))
        old = rdt.TVM_FFI
        rdt.TVM_FFI = TVM_FFI + " --keep-ptx"
        try:
            _PTX[mb, rolled] = compiled_ptx(lambda: rdt._build(b, 896, 3584, 7168, 16, rdt.fma_unroll(max(b, 1)), 0,
                                                               shared=shared, rolled=rolled, split=mb == "0s"))
        finally:
            rdt.TVM_FFI = old
    return _PTX[mb, rolled]


@pytest.mark.skipif(not _have_dsl(), reason="cutlass DSL / tvm-ffi not importable")
def test_split_topk_compiles_under_its_own_key():
    """v2.8: TopkFromLogits with the top-k over its 4 warps compiles (with and without the shared fold), under a key
    of its own; it is an unrolled build, and the expert count must split into 4 warps of whole lanes."""
    for shared in (0, 384):
        fn = rdt.get_topk_kernel(shared=shared, split=True, rolled=False)
        assert fn is not None and fn is not rdt.get_topk_kernel(shared=shared, split=False, rolled=False)
    with pytest.raises(ValueError, match="unrolled"):
        rdt.get_topk_kernel(split=True, rolled=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        rdt.get_topk_kernel(n_experts=928, split=True, rolled=False)


@pytest.mark.skipif(not _have_dsl(), reason="cutlass DSL / tvm-ffi not importable")
def test_split_topk_compiles_smaller():
    """v2.8: the per-warp rounds and the merge are warp max / min reductions over unsigned keys and expert indices
    (redux.sync), and the kernel is well under the unsplit one's size (7 keys per lane per round instead of 28).
    Its results are checked bit for bit against the unsplit kernel on the GPU (test_split_topk_matches_bitwise)."""
    split, unsplit = _topk_ptx("0s", False), _topk_ptx(0, False)
    assert "redux.sync.max.u32" in split and "redux.sync.min.u32" in split
    n = [sum(1 for ln in p.splitlines() if ln.strip().endswith(";")) for p in (split, unsplit)]
    assert n[0] < 0.6 * n[1], n


@pytest.mark.skipif(not _have_dsl(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("mb", [1, 2, 4])
def test_fused_front_with_shared_compiles(mb):
    """v2.7: the FMA buckets compile with the shared gate/up rows folded in, under their own key; the grid grows by
    2 Is / 4 CTAs (the rows' count, k3_rank(16): Is = 384)."""
    fn = rdt.get_kernel(mb, shared=384)
    assert fn is not None and fn is rdt.get_kernel(mb, shared=384) and fn is not rdt.get_kernel(mb)


def test_fused_front_with_shared_rejects_bad_keys():
    with pytest.raises(ValueError, match="FMA front"):
        rdt.get_kernel(8, shared=384)
    with pytest.raises(ValueError, match="multiple of 4"):
        rdt.get_kernel(1, shared=6)


@pytest.mark.skipif(not _have_dsl(), reason="cutlass DSL / tvm-ffi not importable")
def test_fused_front_with_shared_writes_h_from_shared_memory():
    """v2.7: the SiTU pairs meet in shared memory (each warp's lane 0 stores its row's sum; one barrier), and h is
    stored as bf16; the front without the fold has neither the extra barrier nor a 16-bit global store."""
    plain, fold = _topk_ptx(1, False), _topk_ptx("1s", False)
    n_bar = [sum(1 for ln in p.splitlines() if ln.strip().startswith("bar.sync")) for p in (plain, fold)]
    assert n_bar[1] == n_bar[0] + 1, n_bar
    n_b16 = [len(re.findall(r"st\.global\.b16\b", p)) for p in (plain, fold)]    # z (plain), z and h (fold)
    assert n_b16[1] == n_b16[0] + 1, n_b16


@pytest.mark.skipif(not _have_dsl(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("mb", [0, 1, 8, 64])
def test_rolled_topk_compiles_smaller(mb):
    """v2.4: the rolled top-k compiles for the fused kernel's FMA and mma buckets and for TopkFromLogits (mb 0),
    and its PTX is much shorter than the unrolled one's."""
    n = {rolled: sum(1 for line in _topk_ptx(mb, rolled).splitlines() if line.strip().endswith(";"))
         for rolled in (False, True)}
    assert n[True] < 0.6 * n[False], n


@pytest.mark.skipif(not _have_dsl(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("mb", [0, "0s", 1, "1s", 8, 64])
@pytest.mark.parametrize("rolled", [False, True])
def test_topk_loads_issue_before_the_first_sigmoid(mb, rolled):
    """v2.5: the top-k reads its 28 logits (ld.global.cg: written by other CTAs or by the GEMM) and 28 biases before
    the first sigmoid's ex2 (7 of each per thread in v2.8's split top-k). Interleaved, every load sat behind the
    previous division's slow-path branch and ptxas issued them one L2 round trip at a time (~14 us of
    TopkFromLogits with the L2 warm)."""
    if mb == "0s" and rolled:
        pytest.skip("the split top-k is built unrolled")
    per_thread = 896 // 32 // (4 if mb == "0s" else 1)
    lines = [ln.strip() for ln in _topk_ptx(mb, rolled).splitlines()]
    first_ex2 = next(i for i, ln in enumerate(lines) if ln.startswith("ex2."))
    logits = [i for i, ln in enumerate(lines) if ln.startswith("ld.global.cg.")]
    assert len(logits) == per_thread, len(logits)
    assert max(logits) < first_ex2, (max(logits), first_ex2)
    plain = [i for i, ln in enumerate(lines[:first_ex2]) if re.match(r"ld\.global\.(b32|f32)\b", ln)]
    assert len(plain) >= per_thread, f"only {len(plain)} bias loads before the first ex2"
    if mb in (0, "0s"):
        # TopkFromLogits' z = bf16(y[:, NE:]): a thread's 7 vector loads all come before its first store
        first_st = next(i for i, ln in enumerate(lines) if ln.startswith("st.global"))
        vec = [i for i, ln in enumerate(lines) if ln.startswith("ld.global.v4")]
        assert len(vec) >= 3584 // 4 // 128 and sorted(vec)[3584 // 4 // 128 - 1] < first_st


def test_prepare_front_weight():
    wr = torch.randn(896, 64).to(torch.bfloat16)
    wd = torch.randn(3584, 64).to(torch.bfloat16)
    p = rdt.prepare_front_weight(wr, wd)
    assert p.shape == (4480, 64) and p.is_contiguous()
    assert torch.equal(p[:896], wr) and torch.equal(p[896:], wd)
    with pytest.raises(TypeError):
        rdt.prepare_front_weight(wr.float(), wd)
    with pytest.raises(ValueError):
        rdt.prepare_front_weight(wr, wd[:, :32])


def test_import_without_cutlass_side_effects():
    # importing the module must not import cutlass (it is imported lazily inside _build)
    import importlib
    import sys
    mod = importlib.reload(rdt)
    assert hasattr(mod, "router_down_topk")
    assert "cutlass" not in mod.__dict__
    del sys


def test_route_from_logits_is_k3ref_route():
    """route_from_logits, the torch statement of the top-k contract that TopkFromLogits (the cuBLAS front's
    kernel, FastImpl above FRONT_DSL_MAX_M) and the fused kernel implement, is k3ref's route on the same logits:
    same ids in the same order (ties: lower index), same weights."""
    from k3ref import tiny
    from k3ref.moe import route
    from k3ref.precision import Precision
    from k3ref.weights import random_layer
    cfg = tiny()
    w = random_layer(cfg, 1, seed=3).mlp
    P = Precision.model()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, cfg.hidden_size, generator=g).bfloat16()
    w.gate[5] = w.gate[2]                           # an exact tie in the logits of every token
    logits = P.linear_f32(x, w.gate)
    ids_ref, ws_ref = route(x, w, cfg, P)
    ids, ws = rdt.route_from_logits(logits, w.e_score_correction_bias.float(), top_k=cfg.num_experts_per_token,
                                    scaling=cfg.routed_scaling_factor)
    assert ids.dtype == torch.int32 and ws.dtype == torch.float32
    assert torch.equal(ids.long(), ids_ref)
    assert torch.equal(ws, ws_ref.float())
    sel = ids.tolist()
    for row in sel:
        if 2 in row and 5 in row:
            assert row.index(2) < row.index(5)
