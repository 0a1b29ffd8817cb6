"""Stock MLA decode core for Hopper: what vLLM 0.33 runs for Kimi K3's Gated MLA on an H200.

vLLM's backend priority on SM90 (``platforms/cuda.py``) is FLASH_ATTN_MLA, then FLASHMLA, then FLASHINFER_MLA, then
TRITON_MLA. FlashMLA's dense BF16 decode kernel ships in the vLLM 0.33 wheel (``vllm._flashmla_C``); the
FA3-MLA build is not in our staged wheel, so FlashMLA is what a competent Hopper user gets. The decode step follows
``vllm/models/kimi_k3/nvidia/mla.py``:

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
