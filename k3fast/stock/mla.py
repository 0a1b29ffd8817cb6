"""Stock MLA decode core for Hopper: what vLLM 0.33 runs for Kimi K3's Gated MLA on an H200.

vLLM's backend priority on SM90 (``platforms/cuda.py``) is FLASH_ATTN_MLA, then FLASHMLA, then FLASHINFER_MLA, then
TRITON_MLA. Inside a vLLM 0.33 engine on an H100 the K3 MLA layers run FLASH_ATTN_MLA: FlashAttention-3's split-KV
forward and combine (the engine run traces/index.json names as ``vllm_e2e``). ``FA3MLADecodeCore`` runs that path
with vLLM's own functions (the "vllm-layer" stock variant); ``FlashMLADecodeCore`` runs FlashMLA's dense BF16 decode
(``vllm._flashmla_C``; the "vllm-ops" variant). The decode step follows ``vllm/models/kimi_k3/nvidia/mla.py``:

    q_lat,h = q_nope,h W_UK,h            (BMM1: absorb kv_b_proj's k rows, 128 -> 512 per head)
    Q_h     = [q_lat,h | q_pe,h]          (576 = the cache row width: 512 latent + 64 rope/pe part)
    append the new cache rows; o_lat = FlashMLA(Q, paged cache, causal, scale 192^-1/2)   (BF16 out)
    o_h     = o_lat,h W_UV,h^T            (BMM2: 512 -> 128 per head)

k3ref.mla.mla_core is the specification (section 8.3). It attends over each slot's whole cache window with a mask,
which copies [N, Lmax, 576]: correct, and ~10x slower than a paged kernel at 8K tokens. This module reads only
the pages a request has.

The cache pool [S, Lmax, 576] is viewed as pages of 64 tokens, so Lmax must be a multiple of 64 (k3fast.measure.impls.make_io
rounds it). Page p of slot s is block s * Lmax/64 + p. Padded requests (slot < 0) attend over one row of slot 0,
a read inside the pool, and their output rows are zeroed. They write nothing.
"""
from __future__ import annotations

import torch

PAGE = 64


def flashmla_available() -> tuple[bool, str]:
    """(True, "") when vLLM's dense FlashMLA decode can run here (Hopper, vLLM 0.33 with _flashmla_C)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        from vllm.v1.attention.ops.flashmla import is_flashmla_dense_supported
    except Exception as ex:                      # vLLM absent or broken: say why, the caller falls back
        return False, f"import vllm flashmla failed: {type(ex).__name__}: {str(ex)[:200]}"
    ok, why = is_flashmla_dense_supported()
    return bool(ok), why or ""


class FlashMLADecodeCore:
    """``mla_core``'s contract (q [N, H, 192], rows [N, 576] -> o [N, H*128] bf16, cache appended in place) on
    FlashMLA. T = 1 (one token per request; the verify width is not wired here)."""

    def __init__(self, cfg, w):
        from k3ref.mla import _split_kv_b
        self.cfg = cfg
        W_UK, W_UV = _split_kv_b(w, cfg)                                  # [H, 128, 512] each
        self.W_UK = W_UK.contiguous()                                     # q_nope [H, N, 128] @ W_UK -> [H, N, 512]
        self.W_UV_T = W_UV.transpose(1, 2).contiguous()                   # o_lat [H, N, 512] @ W_UV^T -> [H, N, 128]
        self.scale = cfg.qk_head_dim ** -0.5

    def __call__(self, q, rows, kv_cache, lengths, slots):
        from vllm.v1.attention.ops.flashmla import FlashMLASchedMeta, flash_mla_with_kvcache
        cfg = self.cfg
        N, H = slots.shape[0], cfg.mla_heads
        S, Lmax, width = kv_cache.shape
        if Lmax % PAGE:
            raise ValueError(f"kv_cache: FlashMLA pages are {PAGE} tokens; the pool's Lmax={Lmax} is not a multiple")
        if width != cfg.kv_lora_rank + cfg.qk_rope_head_dim:
            raise ValueError(f"kv_cache: expected rows of {cfg.kv_lora_rank + cfg.qk_rope_head_dim}, got {width}")
        valid = slots >= 0
        idx = slots.clamp_min(0).long()
        L0 = lengths[idx]
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and bool((valid & (L0 + 1 > Lmax)).any()):
            raise ValueError(f"MLA cache overflow: a slot would need more than its {Lmax} rows")
        # append: padded rows rewrite the first valid request's row (a no-op write), as in k3ref.mla.mla_core
        first = torch.argmax(valid.to(torch.int32))
        src = torch.where(valid, torch.arange(N, device=q.device), first)
        pos = L0[src].clamp(max=Lmax - 1)
        kv_cache[idx[src], pos] = torch.where(valid[src][:, None], rows[src].to(kv_cache.dtype), kv_cache[idx[src], pos])
        lengths.index_copy_(0, idx[src], torch.where(valid[src], L0[src] + 1, L0[src]))
        # absorbed query
        q_nope, q_pe = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.W_UK).transpose(0, 1)           # [N, H, 512] bf16
        Q = torch.cat([q_lat, q_pe], dim=-1).unsqueeze(1).contiguous()                    # [N, 1, H, 576]
        pages = Lmax // PAGE
        k_cache = kv_cache.view(S * pages, PAGE, 1, width)
        block_table = (idx[:, None] * pages + torch.arange(pages, device=q.device)[None, :]).to(torch.int32)
        seqlens = torch.where(valid, L0 + 1, torch.ones_like(L0)).to(torch.int32)
        o_lat, _ = flash_mla_with_kvcache(Q, k_cache, block_table, seqlens, cfg.kv_lora_rank, FlashMLASchedMeta(),
                                          softmax_scale=self.scale, causal=True)          # [N, 1, H, 512]
        o = torch.bmm(o_lat[:, 0].transpose(0, 1), self.W_UV_T).transpose(0, 1)         # [N, H, 128]
        o = o * valid[:, None, None].to(o.dtype)
        return o.reshape(N, H * cfg.v_head_dim).contiguous()


def fa3_mla_available() -> tuple[bool, str]:
    """(True, "") when vLLM's FLASH_ATTN_MLA decode pieces import here: FlashAttention-3's varlen entry and scheduler,
    and K3's fused decode query-concat + cache-insert op."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        from vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache import (  # noqa: F401
            fused_mla_decode_q_concat_kv_cache_insert)
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata  # noqa: F401
        from vllm.vllm_flash_attn import flash_attn_interface as fai
    except Exception as ex:                      # vLLM absent or built without FA3: say why, the caller falls back
        return False, f"vLLM's FA3 MLA decode does not import: {type(ex).__name__}: {str(ex)[:200]}"
    if not getattr(fai, "FA3_AVAILABLE", False):
        return False, f"FlashAttention-3 unavailable: {getattr(fai, 'FA3_UNAVAILABLE_REASON', '?')}"
    return True, ""


class FA3MLADecodeCore:
    """vLLM 0.33's own MLA decode on Hopper (KimiK3MLA._attention -> FlashAttnMLAImpl.forward_mqa), from the RMSNormed
    latent row to o: the W_UK bmm, K3's fused decode query-concat + cache insert, FlashAttention-3's split-KV
    forward + combine over the paged cache (q = the 64 rope dims, q_v = the 512 latent dims, as forward_mqa calls
    it), the W_UV bmm. T = 1.

    The per-step metadata (slot mapping, block table, sequence lengths: k3fast.layer_io.MLAStep; FA3's scheduler
    metadata with at most 32 splits, flash_attn_max_num_splits_for_cuda_graph's default) is what vLLM's attention
    builder prepares once per step for all layers: given a step, it is read (the scheduler metadata derived once, on
    the step's first, eager call), not rebuilt in the layer; without one it is built here and the lengths advanced."""

    MAX_SPLITS = 32

    def __init__(self, cfg, w):
        from k3ref.mla import _split_kv_b
        self.cfg = cfg
        W_UK, W_UV = _split_kv_b(w, cfg)
        self.W_UK = W_UK.contiguous()                                     # [H, 128, 512]
        self.W_UV_T = W_UV.transpose(1, 2).contiguous()                   # [H, 512, 128]
        self.scale = cfg.qk_head_dim ** -0.5

    def _schedule(self, N, Lmax, seqlens, cu_q, dtype):
        from vllm.vllm_flash_attn import get_scheduler_metadata
        cfg = self.cfg
        return get_scheduler_metadata(batch_size=N, max_seqlen_q=1, max_seqlen_k=Lmax, num_heads_q=cfg.mla_heads,
                                      num_heads_kv=1, headdim=cfg.qk_rope_head_dim, cache_seqlens=seqlens,
                                      qkv_dtype=dtype, headdim_v=cfg.kv_lora_rank, page_size=PAGE,
                                      cu_seqlens_q=cu_q, causal=True, num_splits=self.MAX_SPLITS)

    def __call__(self, q, kv_normed, k_pe, kv_cache, lengths, slots, step=None):
        """q [N, H, 192] bf16, kv_normed [N, 512] (c_kv after kv_a_layernorm), k_pe [N, 64], the pool [S, Lmax, 576]
        with lengths [S], slots [N] (< 0: padding), ``step`` (k3fast.layer_io.MLAStep or None) -> o [N, H * 128]
        bf16. A padded request's row is what vLLM leaves there (attention over one row of the null page), unmasked
        as in the engine: nothing downstream reads it."""
        from vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache import (
            fused_mla_decode_q_concat_kv_cache_insert)
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        from k3ref.state import MLACache

        from ..layer_io import advance_lengths, mla_step
        cfg = self.cfg
        N = slots.shape[0]
        R = cfg.kv_lora_rank
        Lmax = kv_cache.shape[1]
        if step is None:
            step = mla_step(MLACache(kv_cache, lengths), slots)
            advance_lengths(MLACache(kv_cache, lengths), slots)
        meta = step.backend.get("fa3")
        if meta is None:
            # FA3 reads at least one row: a padded request (seqlen 0) attends over row 0 of its table (its output row
            # is not read downstream)
            seqlens = step.seqlens.clamp_min(1)
            cu_q = torch.arange(N + 1, dtype=torch.int32, device=q.device)
            meta = (seqlens, cu_q, self._schedule(N, Lmax, seqlens, cu_q, step.pages.dtype))
            if not torch.cuda.is_current_stream_capturing():
                step.backend["fa3"] = meta
        seqlens, cu_q, sched = meta
        paged, block_table = step.pages, step.block_table
        ql_nope = torch.bmm(q[..., :cfg.qk_nope_head_dim].transpose(0, 1), self.W_UK).transpose(0, 1)
        mqa_q = fused_mla_decode_q_concat_kv_cache_insert(ql_nope, q[..., cfg.qk_nope_head_dim:], kv_normed, k_pe,
                                                          paged, step.slot_mapping)
        q_nope, q_pe = mqa_q.split([R, cfg.qk_rope_head_dim], dim=-1)
        o_lat = flash_attn_varlen_func(q=q_pe, k=paged[..., R:].unsqueeze(-2), v=paged[..., :R].unsqueeze(-2),
                                       q_v=q_nope, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=Lmax,
                                       seqused_k=seqlens, block_table=block_table, softmax_scale=self.scale,
                                       causal=True, fa_version=3, scheduler_metadata=sched,
                                       num_splits=self.MAX_SPLITS)                 # [N, H, 512]
        # W_UV written transposed straight into the [N, H, 128] output, as vLLM's _v_up_proj does (no copy)
        o = torch.empty(N, cfg.mla_heads * cfg.v_head_dim, dtype=o_lat.dtype, device=o_lat.device)
        torch.bmm(o_lat.transpose(0, 1), self.W_UV_T, out=o.view(N, cfg.mla_heads, cfg.v_head_dim).transpose(0, 1))
        return o
