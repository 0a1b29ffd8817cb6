"""CPU compile tests for k3fast.kernels.router_down_topk: every compile key the layer runs at the K3 shapes (each
compiled once, with its PTX kept for the structure checks), plus host-side input checks."""
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


needs_dsl = pytest.mark.skipif(not _have_dsl(), reason="cutlass DSL / tvm-ffi not importable")

CONFIGS = {"k3_rank16": lambda: k3_rank(16), "k3_rank8": lambda: k3_rank(8), "full": k3}
LAYER_BATCHES = range(1, 65)        # every batch the layer runs


def _shape(cfg):
    return dict(n_experts=cfg.num_experts, latent=cfg.routed_expert_hidden_size, hidden=cfg.hidden_size,
                top_k=cfg.num_experts_per_token)


def test_buckets_and_paths():
    assert [rdt.bucket_m(m) for m in (1, 2, 3, 4)] == [1, 2, 4, 4]
    for bad in (0, 5, 64):
        with pytest.raises(ValueError, match="M="):
            rdt.bucket_m(bad)
    # the fused kernel serves M <= 4; the cuBLAS front + TopkFromLogits everything above
    assert [rdt.kernel_path(m) for m in (1, 2, 3, 4, 5, 8, 16, 64)] == ["fma"] * 4 + ["cublas"] * 4
    with pytest.raises(ValueError):
        rdt.kernel_path(0)


def test_compile_keys_are_the_layers():
    """Three fused buckets and one TopkFromLogits key cover every batch; fast-front0 (fused=False) needs only the
    latter. The router and W_down are replicated on every TP rank, so only the shared width differs by preset."""
    keys = rdt.compile_keys(384, LAYER_BATCHES)
    assert keys == sorted([("router_down_topk", mb, 896, 3584, 7168, 16, 384) for mb in (1, 2, 4)]
                          + [("router_topk_from_logits", 896, 3584, 16, 384)])
    assert rdt.compile_keys(384, (1, 2), fused=False) == [("router_topk_from_logits", 896, 3584, 16, 384)]
    assert rdt.compile_keys(768, (1,)) == [("router_down_topk", 1, 896, 3584, 7168, 16, 768)]
    with pytest.raises(ValueError, match="shared"):
        rdt.compile_keys(0, (1,))


_PTX: dict = {}


def _compiled_ptx(key, compile_fn):
    """PTX text of the kernel under ``key``, compiled once through the compile cache with --keep-ptx. Where another
    test file compiled the key first without it, the kernel is built again outside the cache for its PTX."""
    if key not in _PTX:
        from k3fast.kernels._dsl import TVM_FFI
        from k3fast.measure.ptxcheck import compiled_ptx
        old = rdt.TVM_FFI
        rdt.TVM_FFI = TVM_FFI + " --keep-ptx"
        try:
            ptx = compiled_ptx(compile_fn)
            if not isinstance(ptx, str) or ".entry" not in ptx:
                mb, shared = (0, key[-1]) if key[0] == "router_topk_from_logits" else (key[1], key[-1])
                ptx = compiled_ptx(lambda: rdt._build(mb, 896, 3584, 7168, 16, shared))
        finally:
            rdt.TVM_FFI = old
        _PTX[key] = ptx
    return _PTX[key]


def _key_ptx(key):
    if key[0] == "router_topk_from_logits":
        return _compiled_ptx(key, lambda: rdt.get_topk_kernel(key[-1], *key[1:4]))
    return _compiled_ptx(key, lambda: rdt.get_kernel(key[1], key[-1], *key[2:6]))


@needs_dsl
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_compile_layer_keys(cfg_name):
    cfg = CONFIGS[cfg_name]()
    sh = _shape(cfg)
    assert (sh["n_experts"], sh["latent"], sh["hidden"], sh["top_k"]) == (896, 3584, 7168, 16)
    keys = rdt.compile_keys(cfg.shared_intermediate, LAYER_BATCHES, **sh)
    assert len(keys) == 4
    for key in keys:
        assert ".entry" in _key_ptx(key)
    assert rdt.warmup(cfg.shared_intermediate, LAYER_BATCHES, **sh) == keys     # all cached: compiles nothing
    assert rdt.get_kernel(1, cfg.shared_intermediate, **sh) is rdt.get_kernel(1, cfg.shared_intermediate, **sh)


def test_bad_shape_params():
    with pytest.raises(ValueError, match="n_experts"):
        rdt.get_kernel(1, 384, n_experts=900)
    with pytest.raises(ValueError, match="top_k"):
        rdt.get_kernel(1, 384, top_k=33)
    with pytest.raises(ValueError, match="hidden"):
        rdt.get_kernel(1, 384, hidden=7000)
    with pytest.raises(ValueError, match="buckets"):
        rdt.get_kernel(8, 384)
    for bad in (0, 6, -4, 384.0):
        with pytest.raises(ValueError, match="shared"):
            rdt.get_kernel(1, bad)
        with pytest.raises(ValueError, match="shared"):
            rdt.get_topk_kernel(bad)


@needs_dsl
@pytest.mark.parametrize("key", rdt.compile_keys(384, LAYER_BATCHES), ids=lambda k: f"{k[0]}-{k[1]}")
def test_topk_loads_issue_before_the_first_sigmoid(key):
    """The top-k reads its logits (ld.global.cg: written by other CTAs or by the GEMM) and biases before the first
    sigmoid's ex2: 28 of each per thread in the fused kernel's one-warp top-k, 7 in TopkFromLogits' four-warp
    one. Interleaved, every load sat behind the previous IEEE division's slow-path branch and ptxas issued them one
    L2 round trip at a time (~14 us of TopkFromLogits with the L2 warm). TopkFromLogits' z vectors are all loaded
    before its first store, for the same reason."""
    from_logits = key[0] == "router_topk_from_logits"
    per_thread = 896 // 32 // (4 if from_logits else 1)
    lines = [ln.strip() for ln in _key_ptx(key).splitlines()]
    first_ex2 = next(i for i, ln in enumerate(lines) if ln.startswith("ex2."))
    logits = [i for i, ln in enumerate(lines) if ln.startswith("ld.global.cg.")]
    assert len(logits) == per_thread, len(logits)
    assert max(logits) < first_ex2, (max(logits), first_ex2)
    plain = [i for i, ln in enumerate(lines[:first_ex2]) if re.match(r"ld\.global\.(b32|f32)\b", ln)]
    assert len(plain) >= per_thread, f"only {len(plain)} bias loads before the first ex2"
    if from_logits:
        # the four-warp top-k's rounds and merge are warp max / min reductions (redux.sync)
        assert "redux.sync.max.u32" in "\n".join(lines) and "redux.sync.min.u32" in "\n".join(lines)
        first_st = next(i for i, ln in enumerate(lines) if ln.startswith("st.global"))
        vec = [i for i, ln in enumerate(lines) if ln.startswith("ld.global.v4")]
        assert len(vec) >= 3584 // 4 // 128 and sorted(vec)[3584 // 4 // 128 - 1] < first_st


# ------------------------------------------------------------------ host checks (CPU tensors; no kernel runs)

def _args(m=1, shared=384):
    x = torch.randn(m, 7168).to(torch.bfloat16)
    w = torch.randn(4480 + 2 * shared, 7168).to(torch.bfloat16)
    b = torch.zeros(896)
    return x, w, b


def test_rejects_cpu_tensors():
    x, w, b = _args()
    with pytest.raises(ValueError, match="CUDA"):
        rdt.router_down_topk(x, w, b, shared=384)


def test_rejects_wrong_dtype():
    x, w, b = _args()
    with pytest.raises(TypeError, match="x"):
        rdt.router_down_topk(x.float(), w, b, shared=384)
    with pytest.raises(TypeError, match="x"):
        rdt.router_down_topk_cublas(x.float(), w, b, shared=384)


def test_rejects_wrong_rank():
    x, w, b = _args()
    with pytest.raises(ValueError, match="x"):
        rdt.router_down_topk(x[0], w, b, shared=384)


def test_rejects_non_contiguous():
    x, w, b = _args(4)
    with pytest.raises(ValueError, match="contiguous"):
        rdt.router_down_topk(x.t().contiguous().t(), w, b, shared=384)


def test_shared_is_required_and_checked():
    x, w, b = _args()
    with pytest.raises(TypeError, match="shared"):
        rdt.router_down_topk(x, w, b)                      # noqa: the missing keyword is the point
    with pytest.raises(ValueError, match="shared"):
        rdt.router_down_topk_cublas(x, w, b, shared=6)


def test_topk_from_logits_rejects_bad_input():
    y = torch.randn(3, 4480 + 768)
    b = torch.zeros(896)
    with pytest.raises(ValueError, match="CUDA"):
        rdt.topk_from_logits(y, b, shared=384)
    with pytest.raises(TypeError, match="y"):
        rdt.topk_from_logits(y.double(), b, shared=384)
    with pytest.raises(ValueError, match="y"):
        rdt.topk_from_logits(y[0], b, shared=384)


def test_prepare_front_shared_weight():
    wr, wd, wg, wu = (torch.randn(n, 64).to(torch.bfloat16) for n in (896, 3584, 32, 32))
    p = rdt.prepare_front_shared_weight(wr, wd, wg, wu)
    assert p.shape == (4480 + 64, 64) and p.is_contiguous()
    assert torch.equal(p[:896], wr) and torch.equal(p[896:4480], wd)
    assert torch.equal(p[4480:4512], wg) and torch.equal(p[4512:], wu)
    with pytest.raises(TypeError, match="w_router"):
        rdt.prepare_front_shared_weight(wr.float(), wd, wg, wu)
    with pytest.raises(ValueError, match="w_down"):
        rdt.prepare_front_shared_weight(wr, wd[:, :32], wg, wu)
    with pytest.raises(ValueError, match="differ"):
        rdt.prepare_front_shared_weight(wr, wd, wg, wu[:16])


def test_import_without_cutlass_side_effects():
    # importing the module must not import cutlass (it is imported lazily inside _build)
    import importlib
    mod = importlib.reload(rdt)
    assert hasattr(mod, "router_down_topk")
    assert "cutlass" not in mod.__dict__
