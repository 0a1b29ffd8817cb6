"""k3fast.stock.vllm_ops on CPU: the module imports without vLLM, and the plain-torch twins of vLLM's fused ops
(the arithmetic and rounding points of the kernels StockImpl(ops="vllm") runs) agree with k3ref. The real
vLLM kernels are checked against these twins on the H200 (tests/gpu/test_stock_vllm_ops.py)."""
import warnings

import pytest
import torch

from k3ref import Precision, ResidualStream, random_layer, tiny
from k3ref.attnres import pre_attention, pre_mlp
from k3ref.moe import route
from k3ref.norms import rms_norm, situ_glu
from k3fast.stock import vllm_ops as V
from tolerances import assert_close

pytestmark = pytest.mark.ref

CFG = tiny()
P = Precision.model()


def _io(layer, rows=3):
    d = CFG.hidden_size
    blocks = torch.randn(rows, CFG.max_blocks, d).bfloat16()
    partial = torch.randn(rows, d).bfloat16()
    delta = None if layer == 0 else (0.5 * torch.randn(rows, d)).bfloat16()
    return blocks, partial, delta


def test_imports_without_vllm():
    ok, why = V.vllm_available()
    if not torch.cuda.is_available():
        assert not ok and why


@pytest.mark.parametrize("layer", [0, 1, 2, 3])          # tiny: blocks of 2 layers, so 0 and 2 are boundaries
def test_attn_res_twin_matches_k3ref(seed, layer):
    w = random_layer(CFG, layer, seed=seed)
    eps, bs = CFG.rms_norm_eps, CFG.attn_res_block_size
    boundary, nb = CFG.is_block_boundary(layer), CFG.num_blocks_before(layer)
    blocks, partial, delta = _io(layer)
    s = ResidualStream(blocks.clone(), partial.clone(), None if delta is None else delta.clone())
    x_ref = pre_attention(s, layer, w.attn_res, w.input_layernorm, CFG, P)
    b2, p2 = blocks.clone(), partial.clone()
    x = V.attn_res_emulated(b2, nb, p2, delta, w.attn_res.norm, w.attn_res.proj, w.input_layernorm, eps,
                            layer // bs if boundary else -1)
    assert_close("x (attn)", x, x_ref, "bf16_kernel")
    assert_close("p += delta (in place)", p2, s.partial, "exact")
    assert_close("blocks (write)", b2, s.blocks, "exact")

    a = torch.randn_like(partial, dtype=torch.float32).bfloat16()
    y_ref = pre_mlp(s, layer, a, w.mlp_res, w.post_attention_layernorm, CFG, P)
    out = torch.empty_like(partial)
    if boundary:
        p2.copy_(a)
        V.attn_res_emulated(b2, nb + 1, p2, None, w.mlp_res.norm, w.mlp_res.proj, w.post_attention_layernorm,
                            eps, -1, out=out)
    else:
        V.attn_res_emulated(b2, nb, p2, a, w.mlp_res.norm, w.mlp_res.proj, w.post_attention_layernorm, eps, -1,
                            out=out)
    assert_close("x (mlp)", out, y_ref, "bf16_kernel")
    assert_close("p (mlp)", p2, s.partial, "exact")


def test_attn_res_twin_premultiplied_u(seed):
    w = random_layer(CFG, 1, seed=seed)
    blocks, partial, delta = _io(1)
    u = w.attn_res.norm.float() * w.attn_res.proj.float().view(-1)
    x1 = V.attn_res_emulated(blocks.clone(), 1, partial.clone(), delta, w.attn_res.norm, w.attn_res.proj,
                             w.input_layernorm, CFG.rms_norm_eps)
    x2 = V.attn_res_emulated(blocks.clone(), 1, partial.clone(), delta, None, u, w.input_layernorm,
                             CFG.rms_norm_eps)
    assert_close("u form", x2, x1, "exact")


def test_situ_rmsnorm_twins_match_k3ref(seed):
    ac = (3 * torch.randn(5, 2 * 64)).bfloat16()
    h = V.situ_and_mul_emulated(ac, CFG.situ_beta, CFG.situ_linear_beta)
    h_ref = situ_glu(ac[:, :64].float(), ac[:, 64:].float(), CFG.situ_beta, CFG.situ_linear_beta).bfloat16()
    assert_close("situ", h, h_ref, "bf16_kernel")
    x, wn = torch.randn(5, 96).bfloat16(), (1 + 0.05 * torch.randn(96)).bfloat16()
    assert_close("rms_norm", V.rms_norm_emulated(x, wn, 1e-5), rms_norm(x.float(), wn, 1e-5).bfloat16(),
                 "bf16_kernel")


def test_router_twin_matches_k3ref(seed):
    w = random_layer(CFG, 1, seed=seed)
    x = torch.randn(7, CFG.hidden_size).bfloat16()
    ids, ws = V.router_topk_emulated(x, w.mlp.gate, w.mlp.e_score_correction_bias, CFG.num_experts_per_token,
                                     CFG.routed_scaling_factor)
    ids_ref, ws_ref = route(x, w.mlp, CFG, P)
    assert ids.dtype == torch.int32 and ws.dtype == torch.float32
    assert torch.equal(ids.long(), ids_ref)
    assert_close("routing weights", ws, ws_ref.float(), "fp32_reformulation")


def test_stock_impl_falls_back_without_vllm():
    if V.vllm_available()[0]:
        pytest.skip("vLLM ops are available here")
    from k3fast.measure.impls import StockImpl
    w = random_layer(CFG, 0, seed=1)                      # dense layer: no Marlin experts to build
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        impl = StockImpl(CFG, w, ops="vllm")
    assert impl.ops == "torch" and impl.variant == "torch-glue" and impl.ops_fallback
    assert StockImpl(CFG, w, ops="torch").variant == "torch-glue"
    with pytest.raises(ValueError):
        StockImpl(CFG, w, ops="nope")
