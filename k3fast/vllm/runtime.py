"""The plug-in's executor: which vLLM layers run the fused halves, when, and on which of vLLM's tensors.

Granularity is vLLM's decoder layer ("layer mode"): the layer loop of KimiLinearModel is plain Python, captured
whole by vLLM's FULL decode CUDA graphs, so each decoder layer's ``forward`` is replaced per instance:

* every MoE layer's ``mlp`` becomes FusedKimiMoE for every step (prefill too: each token is independent, and the
  fused MoE runs any row count in chunks of 64). vLLM's Marlin copy of the experts is never made: the experts are
  re-laid into the fused kernel's tiles from the checkpoint layout while vLLM loads them;
* every KDA layer decodes on FusedKDA (AttnRes + in_proj, the KDA step, o_proj + AttnRes) when the step is a
  planned pure-decode step (``Step``); any other step (prefill, mixed, speculative, a width not prepared) runs
  vLLM's own attention on the same conv / recurrent state;
* MLA layers keep vLLM's attention half, or, with the plan's ``mla_attention="fused"``, decode planned steps on
  FusedMLA over vLLM's own paged latent cache. vLLM's cache blocks hold a multiple of 128 rows in a hybrid
  KDA / MLA model (the attention page is sized up to the KDA state's page), so each block is read as whole 64-row
  pages: the step's first MLA layer expands vLLM's block table into a 64-row page table once, for every MLA layer
  of the step.

The fused AttnRes kernels read the block rows as [M, 8, d] (the 8 blocks of 12 layers of the full model), vLLM
keeps [M, ceil(L / 12), d]. In a planned step the first layer swaps vLLM's block tensor for a view of an [M, 8, d]
one, which vLLM's own AttnRes kernel reads through its strides.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..kernels.mla_latent_decode import PAGE
from ..layer import FusedKDA, FusedMLA, FusedMoE

log = logging.getLogger("k3fast.vllm")
MAX_BLOCKS = 8


@dataclasses.dataclass
class Step:
    """A planned pure-decode step: its width, the requests' KDA state slots and the [M, 8, d] block rows."""
    rows: int
    slots: torch.Tensor | None
    blocks: torch.Tensor | None = None
    # the MLA layers' paging for this step: (pages, 64-row page table, seqlens), built by the first MLA layer
    mla_paging: tuple | None = None


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
        # MLA layers with an MoE half (the dense layer 0 is a KDA layer in K3's pattern)
        self.mla_layers = [l.layer_idx for l in self.layers if type(l.self_attn).__name__ == "KimiK3MLA"
                           and l.layer_idx in self.moe_layers]
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
        nsm = torch.cuda.get_device_properties(dev).multi_processor_count
        fuse_mla = self.options.fuse == "all" and self.plan_choices.mla_attention == "fused"
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
            kda = mla = None
            if self.options.fuse == "all" and l in self.kda_layers:
                w, in_proj = layer_weights(layer, cfg)
                kda = FusedKDA(cfg, w, plan=self.plan_choices, in_proj=in_proj, null_slot=True, check_slots=False)
            elif fuse_mla and l in self.mla_layers:
                w, in_proj = layer_weights(layer, cfg)
                mla = FusedMLA(cfg, w, plan=self.plan_choices, in_proj=in_proj, nsm=nsm, check_paging=False)
            layer.forward = _LayerForward(self, layer, kda, mla)
        torch.cuda.synchronize()
        t = time.time()
        n = 0
        fused_attn = [l for l in self.kda_layers if self.options.fuse == "all"]
        fused_attn += [l for l in self.mla_layers if fuse_mla]
        moe_only = [s for s in self.moe_sizes if s not in self.batches]
        for layout in layouts or {"rot"}:
            n += warmup(cfg, fused_attn, self.batches, plan=self.plan_choices, nsm=nsm, device=dev, null_slot=True,
                        experts_layout=layout)
            if moe_only:
                n += warmup(cfg, [], moe_only, plan=self.plan_choices, nsm=nsm, device=dev, experts_layout=layout)
        self.report = {
            "fused_attention_layers": sorted(fused_attn),
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

    def mla_paging(self, attn) -> tuple | None:
        """(pages [P, 64, 576], page table [M, MAXB * B / 64] int32, seqlens [M] int32) of the planned step for an MLA
        layer, from vLLM's metadata for ``attn`` (its block table of B-row blocks, its sequence lengths with the
        step's token counted) and its cache [blocks, B, 576]; None where the fused MLA half cannot read them (that
        layer then runs vLLM's own attention)."""
        step = self.step
        if step.mla_paging is not None:
            return step.mla_paging
        from vllm.forward_context import get_forward_context
        ctx = get_forward_context()
        md, sm = ctx.attn_metadata, ctx.slot_mapping
        m = md.get(attn.layer_name) if isinstance(md, dict) else None
        slot = sm.get(attn.layer_name) if isinstance(sm, dict) else None
        paging = mla_step_paging(m, slot, attn.kv_cache, step.rows, self.cfg.kv_cache_dim)
        if isinstance(paging, str):
            if not getattr(self, "_mla_paging_refused", False):
                self._mla_paging_refused = True
                log.warning("k3fast: MLA layers run vLLM's attention in this step: %s", paging)
            return None
        step.mla_paging = paging
        return paging

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

    def __init__(self, decode: K3FastDecode, layer, kda: FusedKDA | None, mla: FusedMLA | None = None):
        self.decode, self.stock, self.kda, self.mla, self.layer = decode, layer.forward, kda, mla, layer
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
        paging = self.decode.mla_paging(self.layer.self_attn) if self.mla is not None else None
        if self.kda is None and paging is None:
            return self.stock(positions, hidden_states, residual, prefix_sum, **kw)
        x = torch.empty_like(prefix_sum)
        # a block-closing layer starts a new partial sum, in a new tensor as vLLM's does (the old one may be the
        # embedding output); elsewhere the partial sum is updated in place, as vLLM's AttnRes op updates it
        p = torch.empty_like(prefix_sum) if self.boundary else prefix_sum
        if self.kda is not None:
            conv, rec = self.layer.self_attn.kv_cache[:2]
            self.kda(step.blocks, prefix_sum, hidden_states, conv, rec, step.slots, x, partial_out=p)
        else:
            self.mla(step.blocks, prefix_sum, hidden_states, *paging, x, partial_out=p)
        return self.layer.mlp(x), p, residual


def mla_step_paging(m, slot, cache: torch.Tensor, n: int, row_width: int) -> tuple | str:
    """The fused MLA half's view of one decode step from vLLM's: ``m`` its MLA metadata for the layer (``decode``'s
    block table and sequence lengths, the step's token counted), ``slot`` its slot mapping, ``cache`` the layer's
    latent cache [blocks, B, row_width], ``n`` the step's rows. Returns (pages [blocks * B / 64, 64, row_width],
    64-row page table [n, MAXB * B / 64] int32, seqlens [n] int32), or why it cannot (a string)."""
    if m is None or slot is None:
        return "no MLA metadata or slot mapping for the layer"
    if m.num_prefills or m.decode is None or m.num_decode_tokens > n:
        return f"not a pure decode step of at most {n} rows"
    if slot.shape[0] < n or m.decode.block_table.shape[0] < n or m.decode.seq_lens.shape[0] < n:
        return f"metadata for fewer than the step's {n} rows"
    if (cache.dim() != 3 or cache.dtype != torch.bfloat16 or cache.shape[1] % PAGE or cache.shape[2] != row_width
            or not cache.is_contiguous()):
        return (f"the cache is {tuple(cache.shape)} {cache.dtype}: the fused half reads a contiguous bf16 "
                f"[blocks, B, {row_width}] cache with B a multiple of {PAGE}")
    table = page_table(m.decode.block_table[:n], cache.shape[1])
    # a padded row of a CUDA-graph batch (slot mapping -1, vLLM's PAD_SLOT_ID) gets length 0: the kernel writes no
    # cache row for it and attends over nothing, whatever stale length or table row the buffers hold there
    seqlens = torch.where(slot[:n] >= 0, m.decode.seq_lens[:n], 0).to(torch.int32)
    return cache.view(-1, PAGE, cache.shape[2]), table, seqlens


def page_table(block_table: torch.Tensor, block_rows: int) -> torch.Tensor:
    """vLLM's block table [M, MAXB] (blocks of ``block_rows`` cache rows, a multiple of 64) -> the table of 64-row
    pages [M, MAXB * block_rows / 64] int32 over the cache viewed as [blocks * block_rows / 64, 64, 576]: page j of a
    request is 64-row page j % r of block j // r, r = block_rows / 64."""
    if block_rows % PAGE:
        raise ValueError(f"block_rows: expected a multiple of {PAGE}, got {block_rows}")
    r = block_rows // PAGE
    n = block_table.shape[0]
    return (block_table.to(torch.int32)[:, :, None] * r
            + torch.arange(r, dtype=torch.int32, device=block_table.device)).reshape(n, -1)


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
