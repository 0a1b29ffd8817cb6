"""Stock and compiled agree with the reference (GPU; run on the H200). The trace sweep records the same
comparison for every configuration it measures (rel_err_vs_ref); this test covers small shapes quickly."""
import pytest
import torch

from k3ref import k3_rank
from k3ref.weights import random_layer
from k3fast.measure.impls import make_impl, make_io
from tolerances import assert_close

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("impl,layer,batch", [("stock", 1, 1), ("stock", 1, 3), ("stock", 1, 8), ("stock", 3, 1),
                                              ("stock", 3, 8), ("compiled", 1, 3), ("compiled", 3, 3)])
def test_impl_matches_ref(impl, layer, batch):
    _needs_vllm_for_stock(impl)
    cfg = k3_rank(16)
    w = random_layer(cfg, layer, seed=5, device="cuda")
    outs, mods = {}, {}
    for name in ("ref", impl):
        io = make_io(cfg, layer, batch, context=64, seed=9)
        io.x_mlp.fill_(float("nan"))
        io.out.fill_(float("nan"))
        m = mods[name] = make_impl(name, cfg, w, max_batch=batch) if name == "stock" else make_impl(name, cfg, w)
        m.layer(io)
        torch.cuda.synchronize()
        outs[name] = (io.x_mlp.clone(), io.out.clone(), io.partial.clone(), io)
    assert_close("x_mlp", outs[impl][0], outs["ref"][0], "bf16_kernel")
    assert_close("partial", outs[impl][2], outs["ref"][2], "bf16_kernel")
    if same_routing(outs[impl][0], outs["ref"][0], w, cfg):
        assert_close("layer out", outs[impl][1], outs["ref"][1], "bf16_kernel")
    else:
        # A 1-ulp difference in x_mlp flipped an expert between near-tied router scores: the outputs are no
        # longer comparable element-wise. Compare the MoE half on the reference's own MLP input instead.
        io = outs[impl][3]
        io.x_mlp.copy_(outs["ref"][0])
        io.out.fill_(float("nan"))
        mods[impl].moe(io)
        torch.cuda.synchronize()
        assert_close("layer out (MoE on the reference x_mlp)", io.out, outs["ref"][1], "bf16_kernel")


def _needs_vllm_for_stock(impl):
    """stock is vLLM's own layer (its Marlin MXFP4 MoE at least): without vLLM there is nothing to compare."""
    if impl == "stock":
        pytest.importorskip("vllm", reason="the stock layer runs vLLM's kernels")


def same_routing(x_a, x_b, w, cfg):
    """Whether the reference router picks the same experts for both MLP inputs (dense layers: trivially)."""
    from k3ref import Precision
    from k3ref.moe import route
    from k3ref.weights import MoEWeights
    if not isinstance(w.mlp, MoEWeights):
        return True
    ids_a, _ = route(x_a, w.mlp, cfg, Precision.model())
    ids_b, _ = route(x_b, w.mlp, cfg, Precision.model())
    return torch.equal(ids_a.sort(-1).values, ids_b.sort(-1).values)


@pytest.mark.parametrize("impl", ["stock", "compiled"])
@pytest.mark.parametrize("batch", [16, 64])
def test_moe_half_on_the_reference_input(impl, batch):
    """At large batch a 1-ulp difference in x_mlp can flip an expert between near-tied sigmoid scores,
    which moves a token's output by O(1): the layer outputs are then not comparable element-wise. The
    MoE half run on the reference's own MLP input isolates the arithmetic (same routing up to ties in
    the router's own FP32 logits)."""
    _needs_vllm_for_stock(impl)
    cfg = k3_rank(16)
    w = random_layer(cfg, 1, seed=6, device="cuda")
    ref = make_impl("ref", cfg, w)
    io = make_io(cfg, 1, batch, seed=10)
    ref.attn(io)
    x = io.x_mlp.clone()
    ref.moe(io)
    want = io.out.clone()
    m = make_impl(impl, cfg, w, max_batch=batch) if impl == "stock" else make_impl(impl, cfg, w)
    io.x_mlp.copy_(x)
    io.out.fill_(float("nan"))
    m.moe(io)
    torch.cuda.synchronize()
    assert_close("moe out", io.out, want, "bf16_kernel")
