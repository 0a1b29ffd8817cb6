"""The static buffers of one layer's decode step, shared by every implementation (ref, compiled, stock, fast).

Every implementation exposes ``attn(io)`` (layer input -> MLP input), ``moe(io)`` (MLP input -> layer output) and
``layer(io)``, each reading and writing only ``io``'s static tensors, so each half can be captured as its own CUDA
graph and replayed.
"""
from __future__ import annotations

import dataclasses

import torch

from k3ref import K3Config, ResidualStream
from k3ref.state import KDAState, MLACache


@dataclasses.dataclass
class LayerIO:
    """Static buffers of one decode step: the AttnRes stream in, the state, the MLP input, the output.
    ``reset()`` restores the inputs that a step mutates (p, the block rows, the MLA lengths) so a
    replayed graph sees the same step each time; the KDA state is left to evolve (bounded decay)."""
    cfg: K3Config
    layer: int
    blocks: torch.Tensor
    partial: torch.Tensor
    delta: torch.Tensor | None
    state: KDAState | MLACache
    slots: torch.Tensor
    x_mlp: torch.Tensor
    out: torch.Tensor
    # MLA layers: the step's paging metadata when a scheduler built it outside the layer (mla_step); None: the layer
    # derives it and advances the lengths itself (mla_paged_view)
    mla_step: MLAStep | None = None
    # KDA layers: the step's state slots as vLLM's metadata carries them (padding = its null slot 0), when a
    # scheduler built them outside the layer (kda_state_indices); None: a layer that needs them derives them
    state_indices: torch.Tensor | None = None
    _saved: dict = dataclasses.field(default_factory=dict)

    def stream(self) -> ResidualStream:
        return ResidualStream(self.blocks, self.partial, self.delta)

    def snapshot(self) -> None:
        self._saved = {"partial": self.partial.clone(), "blocks": self.blocks.clone()}
        if isinstance(self.state, MLACache):
            self._saved["lengths"] = self.state.lengths.clone()

    def reset(self) -> None:
        self.partial.copy_(self._saved["partial"])
        self.blocks.copy_(self._saved["blocks"])
        if "lengths" in self._saved:
            self.state.lengths.copy_(self._saved["lengths"])


def make_io(cfg: K3Config, layer: int, batch: int, *, context: int = 0, device="cuda", seed: int = 0,
            slots: int | None = None) -> LayerIO:
    """Fresh random inputs for one decode step of layer ``layer`` (never zeros): embeddings-scale
    blocks and partial sums, an MLP-output-scale delta, a random KDA state (or an MLA cache filled with
    ``context`` random rows per request). The state pool holds ``slots`` (default ``batch``) request slots after
    the spare slot 0; request i uses slot i + 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    d = cfg.hidden_size
    # requests take slots 1..batch; slot 0 stays spare: vLLM's null block (NULL_BLOCK_ID), where vLLM's metadata
    # puts padding rows: its Triton KDA kernels skip it, its native fused KDA decode (12 / 96 heads) writes it
    n_slots = (slots or batch) + 1
    rnd = lambda *s, std=1.0: (torch.randn(*s, generator=g, device=device) * std).to(torch.bfloat16)
    blocks = rnd(batch, cfg.max_blocks, d)
    partial = rnd(batch, d)
    delta = rnd(batch, d, std=0.5) if layer > 0 else None
    if cfg.is_kda_layer(layer):
        state = KDAState.allocate(cfg, n_slots, device=device)
        state.conv.copy_(rnd(*state.conv.shape))
        state.recurrent.normal_(0, 0.05, generator=g)
    else:
        # room for 16 more tokens, rounded to whole 64-token pages (the page size of the stock FlashMLA path)
        state = MLACache.allocate(cfg, n_slots, -(-(context + 16) // 64) * 64, device=device)
        state.kv[:, :context] = rnd(n_slots, context, cfg.kv_cache_dim)
        state.lengths.fill_(context)
    io = LayerIO(cfg, layer, blocks, partial, delta, state,
                 slots=torch.arange(1, batch + 1, device=device, dtype=torch.int32),
                 x_mlp=torch.empty(batch, d, dtype=torch.bfloat16, device=device),
                 out=torch.empty(batch, d, dtype=torch.bfloat16, device=device))
    io.snapshot()
    return io


MLA_PAGE = 64      # rows per page of the paged view (vLLM's block size for the latent cache)


def kda_state_indices(slots: torch.Tensor) -> torch.Tensor:
    """The harness's slots (-1: padding) as vLLM's KDA metadata carries them: padding on the null slot 0, which
    vLLM reserves and never reads (its Triton KDA kernels skip it; its native fused decode writes the padding row
    there), so the harness keeps slot 0 spare. Built once per step, outside the layers."""
    return slots.clamp_min(0).to(torch.int32)


@dataclasses.dataclass
class MLAStep:
    """One decode step's paging metadata, shared by every MLA layer of the step, as a serving engine's scheduler
    builds it once per step outside the layers (vLLM's attention-metadata builder): the cache pool as pages
    [S * Lmax / 64, 64, 576] (a view), block_table [M, Lmax / 64] int32 (page p of slot s is s * Lmax / 64 + p),
    seqlens [M] int32 (the rows each request attends over once this step's row is appended; 0 for a padded request),
    slot_mapping [M] int64 (the flat row the new token is written to; -1 for a padded request). ``backend`` holds what
    an attention backend derives from these once per step (e.g. FlashAttention-3's split schedule), from their values
    at the step's first use: a step whose lengths change is a new MLAStep."""
    pages: torch.Tensor
    block_table: torch.Tensor
    seqlens: torch.Tensor
    slot_mapping: torch.Tensor
    backend: dict = dataclasses.field(default_factory=dict)


def mla_step(state: MLACache, slots: torch.Tensor) -> MLAStep:
    """The step's MLAStep from the cache's lengths before the step; changes nothing. Refuses (outside a CUDA-graph
    capture) a step that would overflow a slot."""
    S, Lmax, width = state.kv.shape
    if Lmax % MLA_PAGE:
        raise ValueError(f"state.kv: the paged view needs Lmax a multiple of {MLA_PAGE}, got {Lmax}")
    valid = slots >= 0
    idx = slots.clamp_min(0).long()
    L0 = state.lengths[idx]
    capturing = slots.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and bool((valid & (L0 + 1 > Lmax)).any()):
        raise ValueError(f"state.kv: a slot would need more than its {Lmax} rows")
    per = Lmax // MLA_PAGE
    table = (idx[:, None] * per + torch.arange(per, device=slots.device)[None, :]).to(torch.int32)
    seqlens = torch.where(valid, L0 + 1, torch.zeros_like(L0)).to(torch.int32)
    slot_mapping = torch.where(valid, idx * Lmax + L0.long(), torch.full_like(idx, -1))
    return MLAStep(state.kv.view(S * per, MLA_PAGE, width), table, seqlens, slot_mapping)


def mla_paged_view(state: MLACache, slots: torch.Tensor):
    """(pages, block_table, seqlens) of mla_step for a layer that runs its own step (no scheduler around it), with
    ``state.lengths`` advanced by one for each request, as the scheduler does once per step."""
    step = mla_step(state, slots)
    advance_lengths(state, slots)
    return step.pages, step.block_table, step.seqlens


def advance_lengths(state: MLACache, slots: torch.Tensor) -> None:
    """The scheduler's end of a step: each live request's cache holds one more row."""
    state.lengths.index_add_(0, slots.clamp_min(0).long(), (slots >= 0).to(state.lengths.dtype))
