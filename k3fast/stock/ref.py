"""The reference as an implementation: k3ref run stage by stage on the GPU in model precision (``ref``), and
``torch.compile`` of the same halves (``compiled``, inductor "default" mode, captured in a CUDA graph by the
harness). They are the specification and the "what a compiler gives you" peer, not built for speed."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3ref import K3Config, Precision, ResidualStream
from k3ref.attnres import pre_attention, pre_mlp
from k3ref.kda import kda_core, kda_projections
from k3ref.mla import mla_core, mla_latents, mla_output
from k3ref.moe import route, routed_experts, shared_experts
from k3ref.norms import rms_norm, situ_glu
from k3ref.state import KDAState, MLACache
from k3ref.weights import KDAWeights, LayerWeights, MoEWeights

from ..layer_io import LayerIO
from ..nvtx import stage


class RefImpl:
    """k3ref in model precision, stage by stage (the same functions as K3DecoderLayer)."""
    name = "ref"

    def __init__(self, cfg: K3Config, w: LayerWeights):
        self.cfg, self.w, self.P = cfg, w, Precision.model()

    def attn(self, io: LayerIO) -> None:
        cfg, w, P = self.cfg, self.w, self.P
        s = ResidualStream(io.blocks, io.partial, io.delta)
        with stage("k3.attn_res"):
            x = pre_attention(s, io.layer, w.attn_res, w.input_layernorm, cfg, P)
        if isinstance(w.attn, KDAWeights):
            with stage("k3.kda.in_proj"):
                pr = kda_projections(x, w.attn, P)
            with stage("k3.kda.core"):
                y = kda_core(pr, w.attn, io.state.conv, io.state.recurrent, io.slots, 1, cfg, P)
            with stage("k3.o_proj"):
                a = P.linear(y, w.attn.o_proj)
        else:
            with stage("k3.mla.in_proj"):
                q, rows, g = mla_latents(x, w.attn, cfg, P)
            with stage("k3.mla.core"):
                o = mla_core(q, rows, w.attn, io.state.kv, io.state.lengths, io.slots, 1, cfg, P)
            with stage("k3.o_proj"):
                a = mla_output(o, g, w.attn, P)
        with stage("k3.attn_res_mlp"):
            io.x_mlp.copy_(pre_mlp(s, io.layer, a, w.mlp_res, w.post_attention_layernorm, cfg, P))
        io.partial.copy_(s.partial)

    def moe(self, io: LayerIO) -> None:
        cfg, w, P = self.cfg, self.w.mlp, self.P
        x = io.x_mlp
        with stage("k3.router"):
            ids, weights = route(x, w, cfg, P)
        with stage("k3.moe.down"):
            z = P.linear(x, w.down)
        with stage("k3.moe.experts"):
            r = routed_experts(z, ids, weights, w, cfg, P)
        with stage("k3.moe.shared"):
            shared = shared_experts(x, w, cfg, P)
        with stage("k3.moe.up"):
            routed = P.linear(P.rnd(rms_norm(P.f(r), w.norm, cfg.rms_norm_eps)), w.up)
            io.out.copy_(P.rnd(P.f(routed) + P.f(shared)))

    def layer(self, io: LayerIO) -> None:
        self.attn(io)
        self.moe(io)


class CompiledImpl(RefImpl):
    """torch.compile of the reference halves (inductor "default" mode); the harness
    captures the compiled code in a CUDA graph. NVTX ranges are graph breaks, so they are left out."""
    name = "compiled"

    # One compiled function per half, shared by every CompiledImpl: dynamo guards on the config's
    # integers (one graph per shape and layer kind) and lifts the weight tensors as inputs, and the
    # default automatic-dynamic policy makes the batch symbolic after the first recompile.
    _compiled: dict = {}

    def __init__(self, cfg: K3Config, w: LayerWeights):
        super().__init__(cfg, w)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        if not CompiledImpl._compiled:
            CompiledImpl._compiled["attn"] = torch.compile(CompiledImpl._attn_body, mode="default")
            CompiledImpl._compiled["moe"] = torch.compile(CompiledImpl._moe_body, mode="default")
        self._attn = lambda *a: CompiledImpl._compiled["attn"](self, *a)
        self._moe = lambda *a: CompiledImpl._compiled["moe"](self, *a)

    def _attn_body(self, blocks, partial, delta, conv_or_kv, rec_or_len, slots):
        cfg, w, P = self.cfg, self.w, self.P
        s = ResidualStream(blocks, partial, delta)
        x = pre_attention(s, self.layer_idx, w.attn_res, w.input_layernorm, cfg, P)
        if isinstance(w.attn, KDAWeights):
            y = kda_core(kda_projections(x, w.attn, P), w.attn, conv_or_kv, rec_or_len, slots, 1, cfg, P)
            a = P.linear(y, w.attn.o_proj)
        else:
            q, rows, g = mla_latents(x, w.attn, cfg, P)
            a = mla_output(mla_core(q, rows, w.attn, conv_or_kv, rec_or_len, slots, 1, cfg, P), g, w.attn, P)
        x_mlp = pre_mlp(s, self.layer_idx, a, w.mlp_res, w.post_attention_layernorm, cfg, P)
        return x_mlp, s.partial

    def _moe_body(self, x):
        cfg, w, P = self.cfg, self.w.mlp, self.P
        ids, weights = route(x, w, cfg, P)
        r = routed_experts(P.linear(x, w.down), ids, weights, w, cfg, P)
        routed = P.linear(P.rnd(rms_norm(P.f(r), w.norm, cfg.rms_norm_eps)), w.up)
        return P.rnd(P.f(routed) + P.f(shared_experts(x, w, cfg, P)))

    def attn(self, io: LayerIO) -> None:
        self.layer_idx = io.layer
        st = io.state
        a, b = (st.conv, st.recurrent) if isinstance(st, KDAState) else (st.kv, st.lengths)
        with stage("k3.attn"):
            x_mlp, partial = self._attn(io.blocks, io.partial, io.delta, a, b, io.slots)
            io.x_mlp.copy_(x_mlp)
            io.partial.copy_(partial)

    def moe(self, io: LayerIO) -> None:
        with stage("k3.moe"):
            io.out.copy_(self._moe(io.x_mlp))
