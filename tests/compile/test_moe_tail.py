"""Compile every k3fast.kernels.moe_tail key the layer runs on the CPU for sm_90a (each once, its PTX kept for the
structure check), and check the host-side input validation.

The compile tests skip only when the CuTe DSL is not importable; the validation tests need neither a GPU nor
cutlass (the checks run before any kernel is looked up)."""
import pytest
import torch

from k3fast.kernels import moe_tail as mt
from k3fast.kernels._dsl import dsl_available

pytestmark = pytest.mark.compile

SHAPES = {"k3_rank16": 384, "k3_rank8": 768, "k3": 6144}
LAYER_BATCHES = range(1, 17)                # the layer runs moe_tail at M <= 16 (cuBLAS above)

needs_dsl = pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm_ffi not importable")


def test_shared_intermediate_matches_config():
    from k3ref.config import k3, k3_rank
    assert k3_rank(16).shared_intermediate == SHAPES["k3_rank16"]
    assert k3_rank(8).shared_intermediate == SHAPES["k3_rank8"]
    assert k3().shared_intermediate == SHAPES["k3"]
    assert k3().hidden_size == mt.HIDDEN and k3().routed_expert_hidden_size == mt.LATENT


def test_buckets_and_keys():
    assert [mt.n_tiles(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [1, 1, 2, 2, 4, 4, 8, 8]
    for bad in (0, 65, -1):
        with pytest.raises(ValueError, match="batch M"):
            mt.n_tiles(bad)
    # the shared-memory ring at the layer's batches, two register stages above them (the fast-taildsl contender)
    assert [mt.tail_cfg(nt)[3] for nt in (1, 2, 4, 8)] == [mt.RING_DEPTH, mt.RING_DEPTH, 0, 0]
    assert mt.compile_keys(384, LAYER_BATCHES) == [("moe_tail", 1, 384), ("moe_tail", 2, 384)]
    assert mt.compile_keys(384, (1, 64)) == [("moe_tail", 1, 384), ("moe_tail", 8, 384)]
    assert mt.compile_keys(768, (3,)) == [("moe_tail", 1, 768)]
    with pytest.raises(ValueError, match="multiple of 32"):
        mt.compile_keys(100, (1,))


_PTX: dict = {}


def _key_ptx(key):
    """PTX text of ``key``, compiled once through the compile cache with --keep-ptx (built again outside the cache
    where another test file compiled the key first without it)."""
    if key not in _PTX:
        from k3fast.kernels._dsl import TVM_FFI
        from k3fast.measure.ptxcheck import compiled_ptx
        old = mt.TVM_FFI
        mt.TVM_FFI = TVM_FFI + " --keep-ptx"
        try:
            ptx = compiled_ptx(lambda: mt._get(key))
            if not isinstance(ptx, str) or ".entry" not in ptx:
                ptx = compiled_ptx(lambda: mt._build_tail(key[1], key[2]))
        finally:
            mt.TVM_FFI = old
        _PTX[key] = ptx
    return _PTX[key]


@needs_dsl
@pytest.mark.parametrize("shape", list(SHAPES))
def test_compile_layer_keys(shape):
    inter = SHAPES[shape]
    keys = mt.compile_keys(inter, LAYER_BATCHES)
    assert len(keys) == 2
    for k in keys:
        assert ".entry" in _key_ptx(k)
    assert mt.warmup(inter, LAYER_BATCHES) == keys          # all cached: compiles nothing
    assert mt._get(keys[0]) is mt._get(keys[0])


@needs_dsl
@pytest.mark.parametrize("nt", [4, 8])
def test_compile_contender_keys(nt):
    """fast-taildsl runs moe_tail above M = 16 too: the register-stage builds, at rank16's width."""
    assert ".entry" in _key_ptx(("moe_tail", nt, 384))


@needs_dsl
@pytest.mark.parametrize("nt", [1, 2])
def test_ring_streams_weights_through_shared_memory(nt):
    """The weight fragments arrive by cp.async (RING_DEPTH stages in flight before the PDL wait, none by a register
    load), the activations stay plain loads, and (with ptxas) the build fits 4 CTAs per SM in registers."""
    import shutil
    from k3fast.measure.ptxcheck import ptxas_resources
    ptx = _key_ptx(("moe_tail", nt, 384))
    lines = [ln.strip() for ln in ptx.splitlines()]
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    cp_before = sum(1 for ln in lines[:wait] if ln.startswith("cp.async.cg.shared.global"))
    commits_before = sum(1 for ln in lines[:wait] if ln.startswith("cp.async.commit_group"))
    _, wk, u, depth = mt.tail_cfg(nt)
    assert depth == mt.RING_DEPTH
    assert cp_before == 2 * u * depth and commits_before == depth
    # no 16-byte weight load into registers: the only v4 global loads are the activations' (U chunks x NT
    # n-tiles in each of the two segments) and w_norm's (U chunks, first segment)
    wide = [ln for ln in lines if ln.startswith("ld.global") and ".v4" in ln]
    assert len(wide) == u * (1 + 2 * nt), wide
    trig = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
    assert len(trig) == 1 and trig[0] > wait           # dependents launch after the main loop
    ptxas = shutil.which("ptxas")
    if ptxas is not None:
        res = ptxas_resources(ptx, ptxas)
        assert res["registers"] <= 64 and res["spill_store_bytes"] == 0, res
    kern = mt._kernel_class()(nt, 384)
    assert kern.ring_bytes == 16 * 32 * 2 * u * depth * wk == 32 * 1024


# ------------------------------------------------------------------------------------------ host validation
def _tail_args(m=2, inter=384, dtype=torch.bfloat16):
    return dict(r=torch.randn(m, mt.LATENT, dtype=dtype), w_norm=torch.ones(mt.LATENT, dtype=dtype),
                w_up=torch.zeros(mt.HIDDEN, mt.LATENT, dtype=dtype), h=torch.randn(m, inter, dtype=dtype),
                w_sd=torch.zeros(mt.HIDDEN, inter, dtype=dtype))


def _call_tail(a, **kw):
    return mt.moe_tail(a["r"], a["w_norm"], a["w_up"], a["h"], a["w_sd"], **kw)


def test_tail_rejects_cpu_tensors():
    with pytest.raises(ValueError, match="CUDA"):
        _call_tail(_tail_args())


@pytest.mark.parametrize("bad,err", [
    (torch.randn(2, mt.LATENT, dtype=torch.float32), TypeError),
    (torch.randn(2, 3000, dtype=torch.bfloat16), ValueError),
    (torch.randn(65, mt.LATENT, dtype=torch.bfloat16), ValueError),              # above MAX_M
    (torch.randn(mt.LATENT, 2, dtype=torch.bfloat16).t(), ValueError),           # non-contiguous
], ids=["fp32", "width", "m65", "strided"])
def test_tail_rejects_bad_r(bad, err):
    a = _tail_args()
    a["r"] = bad
    with pytest.raises(err, match="r"):
        _call_tail(a)


@pytest.mark.parametrize("field,bad,err", [
    ("w_norm", torch.ones(mt.LATENT, dtype=torch.float32), TypeError),
    ("w_norm", torch.ones(mt.LATENT + 8, dtype=torch.bfloat16), ValueError),
    ("w_up", torch.zeros(mt.LATENT, mt.HIDDEN, dtype=torch.bfloat16), ValueError),     # transposed
    ("w_up", torch.zeros(mt.HIDDEN, mt.LATENT, dtype=torch.float16), TypeError),
    ("h", torch.randn(3, 384, dtype=torch.bfloat16), ValueError),                      # M mismatch
    ("h", torch.randn(2, 400, dtype=torch.bfloat16), ValueError),                      # Is % 32
    ("w_sd", torch.zeros(mt.HIDDEN, 768, dtype=torch.bfloat16), ValueError),           # Is mismatch
], ids=["w_norm-fp32", "w_norm-width", "w_up-transposed", "w_up-fp16", "h-rows", "h-width", "w_sd-width"])
def test_tail_rejects_bad_weights(field, bad, err):
    a = _tail_args()
    a[field] = bad
    with pytest.raises(err):
        _call_tail(a)


def test_tail_rejects_bad_eps_and_out():
    a = _tail_args()
    for eps in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="eps"):
            _call_tail(a, eps=eps)
    with pytest.raises(ValueError, match="out"):
        _call_tail(a, out=torch.empty(3, mt.HIDDEN, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out"):
        _call_tail(a, out=torch.empty(2, mt.HIDDEN, dtype=torch.float32))
