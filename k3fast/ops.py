"""The fused kernels as torch custom ops (``torch.ops.k3fast.*``), so they compose with torch.compile, FX graphs
and other libraries' ops.

Each op calls the same stage functions as the fused decode step (k3fast.layer: validation, compile-once cache,
TVM-FFI launch on torch's current stream) with the shipped DecodePlan's batch dispatch, so a layer written with the
ops gives FastImpl's bits at every batch. Each op has a fake
(meta) implementation that gives output shapes and dtypes without a GPU. Importing this module registers the ops
and needs neither a GPU nor the CuTe DSL: the kernels are imported when an op first runs on CUDA tensors.

    op                                   replaces (docs/k3-layer.md)                               writes in place
    k3fast::attnres_rms_gemv             AttnRes #1 + input RMSNorm + packed KDA in_proj      partial_out, blocks
    k3fast::kda_conv_gate_step           conv, decay gate, delta rule, gated norm (section 7) conv_state, rec_state
    k3fast::oproj_attnres                o_proj + partial sum + AttnRes #2 + post-attn norm   -
    k3fast::router_down_topk             router logits + latent down + top-k + the shared     -
                                         experts' gate/up + SiTU (sections 10-11)
    k3fast::moe_mxfp4_experts            routed MXFP4 experts + weighted combine (section 11) -
    k3fast::moe_tail                     routed norm + latent up + shared down + add          -

Contracts beyond the shapes: the router's and the experts' small workspaces (logit buffer, arrival counters)
are per device and self-resetting. Two of these ops must not run at once on different streams of one device.
Padded KDA slots (< 0) are neither read nor written.
"""
from __future__ import annotations

import torch

HIDDEN = 7168
KDA_HEAD_DIM = 128

_EXPERT_WS: dict = {}


def _experts_workspace(dL: int, device: torch.device):
    from .kernels.moe_mxfp4_experts import make_workspace
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dL)
    if key not in _EXPERT_WS:
        _EXPERT_WS[key] = make_workspace(dL, device)
    return _EXPERT_WS[key]


# ------------------------------------------------------------------------------------------ attention half

@torch.library.custom_op("k3fast::attnres_rms_gemv", mutates_args=("blocks", "partial_out"))
def attnres_rms_gemv(blocks: torch.Tensor, n_blocks: int, partial: torch.Tensor, delta: torch.Tensor,
                     u: torch.Tensor, w_ln: torch.Tensor, w: torch.Tensor, eps: float, block_write: int,
                     partial_out: torch.Tensor) -> torch.Tensor:
    from .layer import attnres_in_proj
    y, _ = attnres_in_proj(blocks, n_blocks, partial, delta, u, w_ln, w, eps=eps, block_write=block_write,
                           partial_out=partial_out)
    return y


@attnres_rms_gemv.register_fake
def _(blocks, n_blocks, partial, delta, u, w_ln, w, eps, block_write, partial_out):
    return partial.new_empty((partial.shape[0], w.shape[0]))


@torch.library.custom_op("k3fast::kda_conv_gate_step", mutates_args=("conv_state", "rec_state"))
def kda_conv_gate_step(proj: torch.Tensor, w_fb: torch.Tensor, conv_w: torch.Tensor, a_log: torch.Tensor,
                       dt_bias: torch.Tensor, o_norm: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor,
                       slots: torch.Tensor, heads: int, T: int, lower_bound: float, eps: float) -> torch.Tensor:
    from .kernels.kda_conv_gate_step import kda_conv_gate_step as impl
    # no host check of the slot indices: a compiled graph calls the op every step, and a host sync there would cost
    # more than the step; the kernel's own guard holds (a slot past the pool writes nothing, its rows are NaN)
    return impl(proj, w_fb, conv_w, a_log, dt_bias, o_norm, conv_state, rec_state, slots, heads=heads, T=T,
                lower_bound=lower_bound, eps=eps, early_trigger=True, check_slots=False)


@kda_conv_gate_step.register_fake
def _(proj, w_fb, conv_w, a_log, dt_bias, o_norm, conv_state, rec_state, slots, heads, T, lower_bound, eps):
    return proj.new_empty((proj.shape[0], heads * KDA_HEAD_DIM), dtype=torch.bfloat16)


@torch.library.custom_op("k3fast::oproj_attnres", mutates_args=())
def oproj_attnres(y: torch.Tensor, w_o: torch.Tensor, blocks: torch.Tensor, n_blocks: int, partial: torch.Tensor,
                  u_mlp: torch.Tensor, w_post: torch.Tensor, eps: float,
                  boundary: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from .layer import oproj_attnres_any
    return oproj_attnres_any(y, w_o, blocks, n_blocks, partial, u_mlp, w_post, eps=eps, boundary=boundary)


@oproj_attnres.register_fake
def _(y, w_o, blocks, n_blocks, partial, u_mlp, w_post, eps, boundary):
    shape = (y.shape[0], w_o.shape[0])
    return y.new_empty(shape, dtype=torch.bfloat16), y.new_empty(shape, dtype=torch.bfloat16)


# ------------------------------------------------------------------------------------------------ MoE half

@torch.library.custom_op("k3fast::router_down_topk", mutates_args=())
def router_down_topk(x: torch.Tensor, w_packed: torch.Tensor, e_bias: torch.Tensor, n_experts: int, top_k: int,
                     scaling: float,
                     shared: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits + latent down + top-k + the shared experts' gate/up + SiTU from one pass over x: w_packed is
    k3fast.kernels.router_down_topk.prepare_front_shared_weight's [W_r; W_down; shared gate/up] and shared = Is."""
    from .layer import router_front
    return router_front(x, w_packed, e_bias, shared=shared, n_experts=n_experts, top_k=top_k, scaling=scaling)


@router_down_topk.register_fake
def _(x, w_packed, e_bias, n_experts, top_k, scaling, shared):
    m = x.shape[0]
    return (x.new_empty((m, w_packed.shape[0] - n_experts - 2 * shared), dtype=torch.bfloat16),
            x.new_empty((m, top_k), dtype=torch.int32), x.new_empty((m, top_k), dtype=torch.float32),
            x.new_empty((m, shared), dtype=torch.bfloat16))


@torch.library.custom_op("k3fast::moe_mxfp4_experts", mutates_args=())
def moe_mxfp4_experts(z: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, w13q: torch.Tensor,
                      w13s: torch.Tensor, w2q: torch.Tensor, w2s: torch.Tensor, situ_beta: float,
                      situ_linear_beta: float, layout: str) -> torch.Tensor:
    from .kernels.moe_mxfp4_experts import moe_mxfp4_experts as impl
    return impl(z, topk_ids, topk_w, w13q, w13s, w2q, w2s, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
                workspace=_experts_workspace(z.shape[1], z.device), layout=layout)


@moe_mxfp4_experts.register_fake
def _(z, topk_ids, topk_w, w13q, w13s, w2q, w2s, situ_beta, situ_linear_beta, layout):
    return z.new_empty(z.shape, dtype=torch.bfloat16)


@torch.library.custom_op("k3fast::moe_tail", mutates_args=())
def moe_tail(r: torch.Tensor, w_norm: torch.Tensor, w_up: torch.Tensor, h: torch.Tensor, w_sd: torch.Tensor,
             eps: float) -> torch.Tensor:
    from .layer import moe_tail_any
    return moe_tail_any(r, w_norm, w_up, h, w_sd, eps=eps)


@moe_tail.register_fake
def _(r, w_norm, w_up, h, w_sd, eps):
    return r.new_empty((r.shape[0], w_up.shape[0]), dtype=torch.bfloat16)


OPS = ("attnres_rms_gemv", "kda_conv_gate_step", "oproj_attnres", "router_down_topk", "moe_mxfp4_experts", "moe_tail")
