"""The plug-in's executor: which vLLM layers run the fused halves, when, and on which of vLLM's tensors.

Granularity is vLLM's decoder layer ("layer mode"): the layer loop of KimiLinearModel is plain Python, captured
whole by vLLM's FULL decode CUDA graphs, so each decoder layer's ``forward`` is replaced per instance:

* every MoE layer's ``mlp`` becomes FusedKimiMoE for every step (prefill too: each token is independent, and the
  fused MoE runs any row count in chunks of 64). vLLM's Marlin copy of the experts is never made: the experts are
  re-laid into the fused kernel's tiles from the checkpoint layout while vLLM loads them;
* every KDA layer decodes on FusedKDA (AttnRes + in_proj, the KDA step, o_proj + AttnRes) when the step is a
  planned pure-decode step (``Step``); any other step (prefill, mixed, speculative, a width not prepared) runs
  vLLM's own attention on the same conv / recurrent state;
* MLA layers keep vLLM's attention half.

The fused AttnRes kernels read the block rows as [M, 8, d] (the 8 blocks of 12 layers of the full model), vLLM
keeps [M, ceil(L / 12), d]. In a planned step the first layer swaps vLLM's block tensor for a view of an [M, 8, d]
one, which vLLM's own AttnRes kernel reads through its strides.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..layer import FusedKDA, FusedMoE

log = logging.getLogger("k3fast.vllm")
MAX_BLOCKS = 8


@dataclasses.dataclass
class Step:
    """A planned pure-decode step: its width, the requests' KDA state slots and the [M, 8, d] block rows."""
    rows: int
    slots: torch.Tensor | None
    blocks: torch.Tensor | None = None


class FusedKimiMoE(torch.nn.Module):
    """KimiMoE.forward's contract (hidden [M, d] -> the MoE output [M, d]) on the fused MoE half. Row counts that are
    not a prepared batch size run padded with zero rows to the next one (eager steps only: every CUDA-graph size is
    prepared), so nothing compiles after the engine starts."""

    def __init__(self, fused: FusedMoE, sizes: tuple[int, ...], layer_idx: int):
        super().__init__()
        self.fused, self.sizes, self.layer_idx = fused, tuple(sorted(sizes)), layer_idx

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        n = hidden_states.shape[0]
        out = torch.empty_like(hidden_states)
        for i in range(0, n, FusedMoE.MAX_ROWS):
            x = hidden_states[i:i + FusedMoE.MAX_ROWS]
            m = x.shape[0]
            M = next(s for s in self.sizes if s >= m)
            if M == m:
                self.fused(x, out=out[i:i + m])
            else:
                xp = x.new_zeros(M, x.shape[1])
                xp[:m] = x
                out[i:i + m] = self.fused(xp)[:m]
        return out


class K3FastDecode:
    """Built by the model at construction (options and the expert hooks), prepared by the model state once the
    weights are loaded (``prepare``), consulted by the model's forward (``plan`` / ``finish``)."""

    def __init__(self, model, options, vllm_config):
        from .weights import k3_config
        self.model, self.options, self.vllm_config = model, options, vllm_config
        self.cfg = k3_config(vllm_config.model_config.hf_text_config)
        self.plan_choices = options.decode_plan()
        self.layers = model.model.layers
        self.kda_layers = [l.layer_idx for l in self.layers if type(l.self_attn).__name__ == "KimiK3DeltaAttention"]
        self.moe_layers = [l.layer_idx for l in self.layers if getattr(l, "is_moe_layer", False)]
        self.experts: dict[int, object] = {}
        self.batches: tuple[int, ...] = ()
        self.moe_sizes: tuple[int, ...] = ()
        self.step: Step | None = None
        self.kda_prefix = self.layers[self.kda_layers[0]].self_attn.prefix if self.kda_layers else None
        self.report: dict = {}
        self._hook_experts()

    # ------------------------------------------------------------------------------------------ loading
    def _hook_experts(self) -> None:
        """Take each MoE layer's experts in the checkpoint layout as vLLM finishes loading them: re-lay them into
        the fused kernel's tiles and free vLLM's copies, instead of vLLM's repack for Marlin."""
        from .weights import routed_experts
        self.expert_modules = {}
        for layer in self.layers:
            if getattr(layer, "is_moe_layer", False):
                experts = routed_experts(layer.block_sparse_moe)
                self.expert_modules[id(experts)] = layer.layer_idx
                # set on the quant method object (shared or not, the taker finds the layer by the module it gets)
                experts.quant_method.process_weights_after_loading = _ExpertsTaker(self)

    def take_experts(self, layer_idx: int, experts) -> None:
        from ..kernels.moe_mxfp4_experts import prepare_mxfp4_experts
        from .weights import split_w13
        (w1, s1), (w3, s3) = split_w13(experts.w13_weight_packed, experts.w13_weight_scale)
        self.experts[layer_idx] = prepare_mxfp4_experts(w1, s1, w3, s3, experts.w2_weight_packed,
                                                        experts.w2_weight_scale)
        for name in ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale"):
            p = getattr(experts, name)
            setattr(experts, name, torch.nn.Parameter(p.new_empty(0), requires_grad=False))

    # ------------------------------------------------------------------------------------------ prepare
    def prepare(self, capture_sizes) -> None:
        """After loading, before memory profiling and graph capture: build the fused halves over vLLM's parameters,
        swap the layers' forwards and compile every kernel key the prepared batch sizes run."""
        from ..kernels.moe_mxfp4_experts import make_workspace
        from ..layer import warmup
        from .weights import layer_weights, moe_weights
        cfg, dev = self.cfg, torch.device("cuda", torch.cuda.current_device())
        torch.cuda.synchronize()
        mem0 = torch.cuda.memory_allocated()
        self.batches = self.options.prepared_batches(capture_sizes)
        # prefill and other widths pad to these row counts (64: the kernels' widest bucket and the chunk size)
        self.moe_sizes = tuple(sorted(set(self.batches) | {FusedMoE.MAX_ROWS}))
        workspace = make_workspace(cfg.routed_expert_hidden_size, dev)
        layouts = set()
        for layer in self.layers:
            l = layer.layer_idx
            if l in self.moe_layers:
                if l not in self.experts:
                    raise RuntimeError(f"layer {l}: its experts were not taken at load time (was the model loaded "
                                       "through vLLM's loader?)")
                fused = FusedMoE(cfg, moe_weights(layer.block_sparse_moe), plan=self.plan_choices,
                                 experts=self.experts.pop(l), workspace=workspace)
                layouts.add(fused.experts.layout)
                layer.mlp = FusedKimiMoE(fused, self.moe_sizes, l)
            kda = None
            if self.options.fuse == "all" and l in self.kda_layers:
                w, in_proj = layer_weights(layer, cfg)
                kda = FusedKDA(cfg, w, plan=self.plan_choices, in_proj=in_proj, null_slot=True, check_slots=False)
            layer.forward = _LayerForward(self, layer, kda)
        torch.cuda.synchronize()
        t = time.time()
        n, nsm = 0, torch.cuda.get_device_properties(dev).multi_processor_count
        fused_kda = [l for l in self.kda_layers if self.options.fuse == "all"]
        moe_only = [s for s in self.moe_sizes if s not in self.batches]
        for layout in layouts or {"rot"}:
            n += warmup(cfg, fused_kda, self.batches, plan=self.plan_choices, nsm=nsm, device=dev, null_slot=True,
                        experts_layout=layout)
            if moe_only:
                n += warmup(cfg, [], moe_only, plan=self.plan_choices, nsm=nsm, device=dev, experts_layout=layout)
        self.report = {
            "fused_attention_layers": [l for l in self.kda_layers if self.options.fuse == "all"],
            "fused_moe_layers": list(self.moe_layers),
            "decode_batches": list(self.batches), "moe_row_sizes": list(self.moe_sizes),
            "kernels_compiled": n, "compile_s": round(time.time() - t, 1),
            "extra_weight_bytes": torch.cuda.memory_allocated() - mem0,
        }
        log.warning("k3fast: fused attention in KDA layers %s at decode batches %s; fused MoE in layers %s (any "
                    "step); %d kernels compiled in %.1f s; %.1f MiB more weights than vLLM's own after re-laying "
                    "(the experts replace vLLM's Marlin copy)", _ranges(self.report["fused_attention_layers"]),
                    list(self.batches), _ranges(self.moe_layers), n, self.report["compile_s"],
                    self.report["extra_weight_bytes"] / 2**20)

    # ------------------------------------------------------------------------------------------ per step
    def plan(self, positions: torch.Tensor) -> Step | None:
        """The step the forward in flight will take: a planned decode Step when every row is one decode token of a
        prepared width and vLLM's KDA metadata gives the state slots, else None (vLLM's own attention)."""
        self.step = None
        n = int(positions.shape[0])
        if self.options.fuse != "all" or not self.kda_layers or n not in self.batches:
            return None
        from vllm.forward_context import get_forward_context, is_forward_context_available
        if not is_forward_context_available():
            return None
        md = get_forward_context().attn_metadata
        m = md.get(self.kda_prefix) if isinstance(md, dict) else None
        if m is None or m.num_prefills or m.num_spec_decodes or not m.num_decodes:
            return None
        idx = m.non_spec_state_indices_tensor
        if idx is None or idx.dim() != 1 or idx.shape[0] < n or idx.dtype != torch.int32:
            return None
        slots = idx[:n]
        if not slots.is_contiguous():       # eager steps index vLLM's block table (a column view)
            slots = slots.contiguous()
        self.step = Step(rows=n, slots=slots)
        return self.step

    def finish(self) -> None:
        self.step = None


class _ExpertsTaker:
    """Stands in for the experts' quant_method.process_weights_after_loading(module)."""

    def __init__(self, decode: K3FastDecode):
        self.decode = decode

    def __call__(self, module) -> None:
        self.decode.take_experts(self.decode.expert_modules[id(module)], module)


class _LayerForward:
    """KimiDecoderLayer.forward's contract (positions, hidden_states = the previous layer's MoE output, residual =
    the AttnRes block rows, prefix_sum = the block's partial sum) -> (MoE output, prefix_sum, residual), with
    prefix_sum and the block rows updated in place as vLLM's AttnRes op updates them."""

    def __init__(self, decode: K3FastDecode, layer, kda: FusedKDA | None):
        self.decode, self.stock, self.kda, self.layer = decode, layer.forward, kda, layer
        self.boundary = decode.cfg.is_block_boundary(layer.layer_idx)

    def __call__(self, positions, hidden_states, residual, prefix_sum=None, **kw):
        step = self.decode.step
        if step is None:
            return self.stock(positions, hidden_states, residual, prefix_sum, **kw)
        if step.blocks is None:
            # the step's first layer: vLLM's [M, ceil(L/12), d] block rows -> a view of [M, 8, d] rows (nothing is
            # in them yet: the first layer writes block 0)
            step.blocks = residual.new_empty(residual.shape[0], MAX_BLOCKS, residual.shape[2])
            residual = step.blocks[:, :residual.shape[1]]
        if self.kda is None:
            return self.stock(positions, hidden_states, residual, prefix_sum, **kw)
        conv, rec = self.layer.self_attn.kv_cache[:2]
        x = torch.empty_like(prefix_sum)
        # a block-closing layer starts a new partial sum, in a new tensor as vLLM's does (the old one may be the
        # embedding output); elsewhere the partial sum is updated in place, as vLLM's AttnRes op updates it
        p = torch.empty_like(prefix_sum) if self.boundary else prefix_sum
        self.kda(step.blocks, prefix_sum, hidden_states, conv, rec, step.slots, x, partial_out=p)
        return self.layer.mlp(x), p, residual


def _ranges(xs) -> str:
    xs = sorted(xs)
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out) or "none"
