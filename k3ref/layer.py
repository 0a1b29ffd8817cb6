"""One K3 decoder layer: AttnRes -> KDA or Gated MLA -> AttnRes -> LatentMoE or dense MLP
(docs/k3-layer.md §4).

    x      = RMSNorm_in( Mix(B, p + delta) )            pre_attention  (block write at boundaries)
    a      = Attn_l(x)                                  KDA or Gated MLA; a TP rank's partial sum
    x_mlp  = RMSNorm_post( Mix(B, p + a) )              pre_mlp        (p := a at a boundary)
    delta' = MLP_l(x_mlp)                               LatentMoE (layers >= 1) or dense MLP (layer 0)

The layer is split at the MLP input into two halves, ``attn_half`` and ``mlp_half``: the traces
time them separately (parts ``attn`` and ``moe``) and the fused kernels replace them one at a time.

Rows are request-major: N requests of T tokens each give N*T rows (T = 1 for a decode step,
T <= 8 for a speculative verify step, T = the prompt length for prefill).
"""
from __future__ import annotations

from typing import Callable

import torch

from .attnres import ResidualStream, pre_attention, pre_mlp
from .config import K3Config
from .kda import kda_attention
from .mla import mla_attention
from .moe import dense_mlp, latent_moe
from .precision import Precision
from .state import KDAState, MLACache
from .weights import DenseMLPWeights, KDAWeights, LayerWeights, MLAWeights, MoEWeights

Identity = lambda t: t


class K3DecoderLayer:
    """A decoder layer over explicit state. ``decode_step`` runs one token per request with the
    token-loop KDA and absorbed MLA; ``prefill`` runs T tokens per request with chunked KDA and the
    naive MLA. Both update the state in place at ``slots`` and update ``stream`` in place."""

    def __init__(self, cfg: K3Config, weights: LayerWeights, precision: Precision | None = None):
        self.cfg, self.w, self.P = cfg, weights, precision or Precision.model()
        self.layer = weights.layer
        self.kind = ("kda" if cfg.is_kda_layer(self.layer) else "mla") + ("_moe" if cfg.is_moe_layer(self.layer) else "_dense")
        expect_attn = KDAWeights if cfg.is_kda_layer(self.layer) else MLAWeights
        expect_mlp = MoEWeights if cfg.is_moe_layer(self.layer) else DenseMLPWeights
        if not isinstance(weights.attn, expect_attn) or not isinstance(weights.mlp, expect_mlp):
            raise ValueError(f"layer {self.layer} of {cfg.name} is {self.kind}: expected {expect_attn.__name__} and "
                             f"{expect_mlp.__name__}, got {type(weights.attn).__name__} and {type(weights.mlp).__name__}")

    # ----------------------------------------------------------------------------- the two halves
    def attn_half(self, stream: ResidualStream, state, slots: torch.Tensor, T: int = 1, *, prefill: bool = False,
                  all_reduce: Callable = Identity) -> torch.Tensor:
        """From the layer input (stream) to the MLP input x_mlp [N*T, d]. Updates stream and state."""
        cfg, w, P = self.cfg, self.w, self.P
        self._check(stream, state, slots, T)
        x = pre_attention(stream, self.layer, w.attn_res, w.input_layernorm, cfg, P)
        if isinstance(w.attn, KDAWeights):
            a = kda_attention(x, w.attn, state.conv, state.recurrent, slots, T, cfg, P, chunked=prefill)
        else:
            a = mla_attention(x, w.attn, state.kv, state.lengths, slots, T, cfg, P, absorbed=not prefill)
        a = all_reduce(a)
        return pre_mlp(stream, self.layer, a, w.mlp_res, w.post_attention_layernorm, cfg, P)

    def mlp_half(self, x_mlp: torch.Tensor, *, all_reduce: Callable = Identity, loop: bool = False) -> torch.Tensor:
        """From the MLP input to the layer output delta' (the MLP output, added to p by the next layer)."""
        if isinstance(self.w.mlp, MoEWeights):
            return latent_moe(x_mlp, self.w.mlp, self.cfg, self.P, all_reduce=all_reduce, loop=loop)
        return dense_mlp(x_mlp, self.w.mlp, self.cfg, self.P, all_reduce=all_reduce)

    # ----------------------------------------------------------------------------- whole steps
    def decode_step(self, stream: ResidualStream, state, slots: torch.Tensor, T: int = 1) -> ResidualStream:
        """One decode (T = 1) or verify (T <= 8) step. Returns the stream with delta = the MLP output."""
        x_mlp = self.attn_half(stream, state, slots, T)
        stream.delta = self.mlp_half(x_mlp)
        return stream

    def prefill(self, stream: ResidualStream, state, slots: torch.Tensor, T: int) -> ResidualStream:
        """T prompt tokens per request (chunked KDA, naive MLA); leaves the state ready for decode."""
        x_mlp = self.attn_half(stream, state, slots, T, prefill=True)
        stream.delta = self.mlp_half(x_mlp)
        return stream

    # ----------------------------------------------------------------------------- input checks
    def _check(self, stream: ResidualStream, state, slots: torch.Tensor, T: int) -> None:
        cfg, P = self.cfg, self.P
        problems = []
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"slots must be a 1-D int32/int64 tensor, got "
                            f"{getattr(slots, 'dtype', type(slots).__name__)} {list(getattr(slots, 'shape', []))}")
        if T < 1:
            problems.append(f"T must be >= 1, got {T}")
        N, d = slots.shape[0], cfg.hidden_size
        rows = N * T
        if stream.partial.shape != (rows, d):
            problems.append(f"partial must be [{rows}, {d}] ({N} requests x {T} tokens), got {list(stream.partial.shape)}")
        need = cfg.num_blocks_before(self.layer) + int(cfg.is_block_boundary(self.layer))
        if stream.blocks.dim() != 3 or stream.blocks.shape[0] != rows or stream.blocks.shape[2] != d \
                or stream.blocks.shape[1] < need:
            problems.append(f"blocks must be [{rows}, >= {need}, {d}], got {list(stream.blocks.shape)}")
        if stream.delta is not None and stream.delta.shape != (rows, d):
            problems.append(f"delta must be [{rows}, {d}] or None, got {list(stream.delta.shape)}")
        for name, t in (("partial", stream.partial), ("blocks", stream.blocks), ("delta", stream.delta)):
            if t is not None and t.dtype != P.io_dtype:
                problems.append(f"{name} must be {P.io_dtype} under this precision policy, got {t.dtype}")
        dev = self.w.input_layernorm.device
        for name, t in (("partial", stream.partial), ("slots", slots)):
            if t.device != dev:
                problems.append(f"{name} is on {t.device} but the layer's weights are on {dev}")
        if isinstance(self.w.attn, KDAWeights):
            if not isinstance(state, KDAState):
                problems.append(f"layer {self.layer} is a KDA layer: state must be a KDAState, got {type(state).__name__}")
            else:
                Pw, H, D = cfg.kda_proj, cfg.kda_heads, cfg.kda_head_dim
                if state.conv.shape[1:] != (3 * Pw, cfg.short_conv_kernel_size - 1):
                    problems.append(f"conv state must be [S, {3 * Pw}, {cfg.short_conv_kernel_size - 1}], got {list(state.conv.shape)}")
                if state.recurrent.shape[1:] != (H, D, D):
                    problems.append(f"recurrent state must be [S, {H}, {D}, {D}], got {list(state.recurrent.shape)}")
                if state.recurrent.dtype != P.state_dtype:
                    problems.append(f"recurrent state must be {P.state_dtype}, got {state.recurrent.dtype}")
        else:
            if not isinstance(state, MLACache):
                problems.append(f"layer {self.layer} is an MLA layer: state must be an MLACache, got {type(state).__name__}")
            elif state.kv.shape[2] != cfg.kv_cache_dim:
                problems.append(f"MLA cache rows must hold {cfg.kv_cache_dim} values, got {state.kv.shape[2]}")
        if not problems and not (slots.is_cuda and torch.cuda.is_current_stream_capturing()):
            n_slots = state.num_slots
            bad = slots[(slots >= n_slots)]
            if bad.numel():
                problems.append(f"slot index {int(bad[0])} out of range: the state holds {n_slots} slots (use < 0 for padding)")
            live = slots[slots >= 0]
            if live.numel() != live.unique().numel():
                problems.append("two requests of one step share a slot")
        if problems:
            raise ValueError(f"K3DecoderLayer {self.layer} ({self.kind}): " + "; ".join(problems))
