"""torch.ops.k3fast.* on the GPU: the ops give bit-for-bit what the direct calls (FastImpl) give, eagerly and
under torch.compile(fullgraph=True), and write the KDA state in place like the direct kernel."""
import pytest
import torch

from k3ref import k3_rank
from k3ref.weights import random_layer
import k3fast.ops  # noqa: F401  (registers torch.ops.k3fast.*)
from k3fast.measure.impls import make_impl, make_io

pytestmark = pytest.mark.gpu


def _op_layer(fast, io):
    ops = torch.ops.k3fast
    cfg, w, l = fast.cfg, fast.w, io.layer
    boundary = cfg.is_block_boundary(l)
    nb = cfg.num_blocks_before(l)
    p1 = torch.empty_like(io.partial)
    kda = fast.kda
    proj = ops.attnres_rms_gemv(io.blocks, nb, io.partial, io.delta, kda.u_attn, w.input_layernorm, kda.in_proj,
                                cfg.rms_norm_eps, (l // cfg.attn_res_block_size) if boundary else -1, p1)
    y = ops.kda_conv_gate_step(proj, w.attn.f_b_proj, kda.conv_w, w.attn.A_log, w.attn.dt_bias, w.attn.o_norm,
                               io.state.conv, io.state.recurrent, io.slots, cfg.kda_heads, 1, cfg.gate_lower_bound,
                               cfg.rms_norm_eps)
    x, p = ops.oproj_attnres(y, w.attn.o_proj, io.blocks, nb + int(boundary), p1, kda.u_mlp,
                             w.post_attention_layernorm, cfg.rms_norm_eps, boundary)
    m = w.mlp
    moe = fast.fused_moe
    z, ids, tw, h = ops.router_down_topk(x, moe.front, moe.e_bias, cfg.num_experts, cfg.num_experts_per_token,
                                         cfg.routed_scaling_factor, moe.shared)
    e = moe.experts
    r = ops.moe_mxfp4_experts(z, ids, tw, e.w13q, e.w13s, e.w2q, e.w2s, cfg.situ_beta, cfg.situ_linear_beta,
                              e.layout)
    return x, p, ops.moe_tail(r, m.norm, m.up, h, m.shared_down, cfg.rms_norm_eps)


# 1: every fused kernel; 3: the AttnRes norm + the ring's tensor-core GEMV; 8: the cuBLAS front too; 16: the
# in_proj's GEMM on gemm_wgmma_splitk; 64: the cuBLAS tail too (DecodePlan.stages says which path runs where)
@pytest.mark.parametrize("impl", ["fast"])
@pytest.mark.parametrize("batch", [1, 3, 8, 16, 64])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_ops_match_the_direct_calls(batch, compiled, impl):
    if compiled and batch in (3, 16, 64):
        pytest.skip("torch.compile runs the same ops: batches 1 and 8 cover it")
    cfg = k3_rank(16)
    w = random_layer(cfg, 1, seed=31, device="cuda")
    fast = make_impl(impl, cfg, w, max_batch=batch)
    io_direct = make_io(cfg, 1, batch, seed=32)
    fast.layer(io_direct)
    io_ops = make_io(cfg, 1, batch, seed=32)
    fn = torch.compile(_op_layer, fullgraph=True) if compiled else _op_layer
    x, p, out = fn(fast, io_ops)
    torch.cuda.synchronize()
    assert torch.equal(x, io_direct.x_mlp)
    assert torch.equal(p, io_direct.partial)
    assert torch.equal(out, io_direct.out)
    assert torch.equal(io_ops.state.recurrent, io_direct.state.recurrent)
    assert torch.equal(io_ops.state.conv, io_direct.state.conv)
