"""Gated MLA: NoPE multi-head latent attention with a sigmoid output gate (docs/k3-layer.md §8).

The latent cache row of a token is C_s = [c_kv (512, after kv_a_layernorm) | k_pe (64, raw)] in BF16.
``mla_naive`` is the un-absorbed form as written in the HF model; ``mla_absorbed`` is the decode
form vLLM runs (queries moved into the latent space). In exact arithmetic they are equal; a test
checks it in fp64. No rotary embedding is applied anywhere (``mla_use_nope``): the 64 "rope" dims
are a position-independent key channel shared by all heads.

Cache layout for the reference: ``kv [slots, max_len, 576]`` plus ``lengths [slots]`` (tokens cached
so far). vLLM pages the same rows; the maths is identical.
"""
from __future__ import annotations

import torch

from .norms import rms_norm
from .precision import Precision


def mla_latents(x: torch.Tensor, w, cfg, P: Precision):
    """x [N, d] -> (q [N, H, 192] BF16, cache rows [N, 576] BF16, gate logits [N, H*128] BF16).

    c_q = RMSNorm_{q_a_ln}(x W_qa^T) (1536), q = c_q W_qb^T split per head into [q_nope 128 | q_pe 64];
    [c~_kv | k_pe] = x W_kva^T; c_kv = RMSNorm_{kv_a_ln}(c~_kv); k_pe is neither normalised nor rotated.
    Both layer norms use rms_norm_eps = 1e-5 (vLLM; HF defaults to 1e-6: difference D2)."""
    H = cfg.mla_heads
    cq = P.rnd(rms_norm(P.f(P.linear(x, w.q_a_proj)), w.q_a_layernorm, cfg.rms_norm_eps))
    q = P.linear(cq, w.q_b_proj).view(-1, H, cfg.qk_head_dim)
    kv = P.linear(x, w.kv_a_proj_with_mqa)
    c_kv = P.rnd(rms_norm(P.f(kv[:, :cfg.kv_lora_rank]), w.kv_a_layernorm, cfg.rms_norm_eps))
    row = torch.cat([c_kv, kv[:, cfg.kv_lora_rank:]], dim=-1)
    return q, row, P.linear(x, w.g_proj)


def _split_kv_b(w, cfg):
    """kv_b_proj [H*(128+128), 512] -> W_UK [H, 128, 512] (k_nope rows), W_UV [H, 128, 512] (v rows)."""
    wkv = w.kv_b_proj.view(cfg.mla_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return wkv[:, :cfg.qk_nope_head_dim], wkv[:, cfg.qk_nope_head_dim:]


def _causal_logits_mask(q_pos: torch.Tensor, L: int) -> torch.Tensor:
    """[N, T, 1, L] True where key position l is visible to the query at absolute position q_pos."""
    return (torch.arange(L, device=q_pos.device)[None, None, :] <= q_pos[:, :, None])[:, :, None, :]


def mla_naive(q: torch.Tensor, cache: torch.Tensor, q_pos: torch.Tensor, w, cfg, P: Precision) -> torch.Tensor:
    """Un-absorbed attention (section 8.2), batched over requests.

    q: [N, T, H, 192]; cache: [N, L, 576] rows of positions 0..L-1 (rows beyond a request's length are
    masked, whatever they hold); q_pos: [N, T] absolute position of each query (causal mask: keys
    l <= q_pos). k_nope and v are re-expanded from the latent with kv_b_proj (BF16 GEMM outputs).
    Returns o: [N, T, H, 128] (compute dtype)."""
    N, L = cache.shape[0], cache.shape[1]
    H, dn = cfg.mla_heads, cfg.qk_nope_head_dim
    kvb = P.linear(cache[..., :cfg.kv_lora_rank], w.kv_b_proj).view(N, L, H, dn + cfg.v_head_dim)
    k_nope, v = P.f(kvb[..., :dn]), P.f(kvb[..., dn:])
    k_pe = P.f(cache[..., cfg.kv_lora_rank:])                                  # [N, L, 64], shared by heads
    qf = P.f(q)
    logits = (torch.einsum("nthd,nlhd->nthl", qf[..., :dn], k_nope)
              + torch.einsum("nthd,nld->nthl", qf[..., dn:], k_pe)) * cfg.qk_head_dim ** -0.5
    logits = logits.masked_fill(~_causal_logits_mask(q_pos, L), float("-inf"))
    return torch.einsum("nthl,nlhd->nthd", torch.softmax(logits, dim=-1), v)


def mla_absorbed(q: torch.Tensor, cache: torch.Tensor, q_pos: torch.Tensor, w, cfg, P: Precision) -> torch.Tensor:
    """Absorbed decode form (section 8.3): the same function as ``mla_naive``, same arguments.

    q_lat,h = W_UK,h^T q_nope,h (512, a BF16 bmm output), Q_h = [q_lat,h | q_pe,h] (576);
    l_{h,s} = Q_h . C_s * 192^-1/2 (FP32); o_lat,h = softmax(l_h) . c_kv (512, rounded to BF16 like the
    attention kernel's output); o_h = W_UV,h o_lat,h (128)."""
    L = cache.shape[1]
    W_UK, W_UV = _split_kv_b(w, cfg)
    q_nope, q_pe = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
    if P.is_model:
        q_lat = torch.einsum("nthd,hdc->nthc", q_nope.to(P.act), W_UK.to(P.act))         # BF16 bmm
    else:
        q_lat = torch.einsum("nthd,hdc->nthc", P.f(q_nope), P.f(W_UK))
    Q = torch.cat([P.f(q_lat), P.f(q_pe)], dim=-1)                                       # [N, T, H, 576]
    logits = torch.einsum("nthc,nlc->nthl", Q, P.f(cache)) * cfg.qk_head_dim ** -0.5
    logits = logits.masked_fill(~_causal_logits_mask(q_pos, L), float("-inf"))
    o_lat = P.rnd(torch.einsum("nthl,nlc->nthc", torch.softmax(logits, dim=-1), P.f(cache[..., :cfg.kv_lora_rank])))
    if P.is_model:
        return P.f(torch.einsum("nthc,hdc->nthd", o_lat, W_UV.to(P.act)))               # BF16 bmm output
    return torch.einsum("nthc,hdc->nthd", o_lat, P.f(W_UV))


@torch.compiler.disable
def _check_cache_room(valid: torch.Tensor, need: torch.Tensor, Lmax: int) -> None:
    """Raise if a valid slot would need more than Lmax cache rows. A host-side check (it syncs), so it is skipped
    while a CUDA graph is being captured; kept out of torch.compile's graph so that the compiled code does not
    depend on the capture state (a guard on it recompiled inside the capture and invalidated it)."""
    if need.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if bool((valid & (need > Lmax)).any()):
        raise ValueError(f"MLA cache overflow: a slot would need more than its {Lmax} rows")


def mla_core(q: torch.Tensor, rows: torch.Tensor, w, kv_cache: torch.Tensor, lengths: torch.Tensor,
             slots: torch.Tensor, T: int, cfg, P: Precision, *, absorbed: bool = True) -> torch.Tensor:
    """Append the new cache rows at ``slots`` and attend: q [N*T, H, 192], rows [N*T, 576] (from
    ``mla_latents``) -> o [N*T, H*128] (BF16 in the model), zero rows for padding.

    kv_cache [S, Lmax, 576]; lengths [S] (int64), advanced by T for valid slots; slots [N], < 0 is
    padding (no read, no write). No host synchronisation (CUDA-graph capturable): every request
    attends over the whole Lmax window with a causal mask, which is what a paged kernel computes on
    its valid pages."""
    N, H, Lmax = slots.shape[0], cfg.mla_heads, kv_cache.shape[1]
    valid = slots >= 0
    idx = slots.clamp_min(0).long()
    q, rows = q.view(N, T, H, -1), rows.view(N, T, -1)
    L0 = lengths[idx]                                                          # [N]
    q_pos = L0[:, None] + torch.arange(T, device=q.device)[None, :]            # [N, T]
    _check_cache_room(valid, L0 + T, Lmax)
    # append the new rows at valid slots (padding writes nothing): each padded request repeats the
    # first valid request's (slot, position, row), or rewrites slot idx[0]'s current rows if none is valid
    first = torch.argmax(valid.to(torch.int32))
    src = torch.where(valid, torch.arange(N, device=q.device), first)
    pos_w = q_pos[src].clamp(max=Lmax - 1)
    old_rows = kv_cache[idx[src][:, None], pos_w]
    new_rows = torch.where(valid[src][:, None, None], rows[src].to(kv_cache.dtype), old_rows)
    kv_cache[idx[src][:, None], pos_w] = new_rows
    lengths.index_copy_(0, idx[src], torch.where(valid[src], (L0 + T)[src], L0[src]))
    cache = kv_cache[idx].to(rows.dtype)                                       # [N, Lmax, 576]
    # rows past a request's length hold whatever the pool held: zero them so 0-probability x garbage
    # (NaN, say) cannot leak into the output
    seen = torch.arange(Lmax, device=q.device)[None, :] < (L0 + T)[:, None]
    cache = torch.where(seen[..., None], cache, torch.zeros((), dtype=cache.dtype, device=q.device))
    attend = mla_absorbed if absorbed else mla_naive
    o = attend(q, cache, q_pos.clamp(max=Lmax - 1), w, cfg, P)                 # [N, T, H, 128]
    o = o * valid[:, None, None, None].to(o.dtype)
    return P.rnd(o.reshape(N * T, H * cfg.v_head_dim))


def mla_output(o: torch.Tensor, g: torch.Tensor, w, P: Precision) -> torch.Tensor:
    """Output gate then o_proj: a = (o * sigmoid(g)) W_o^T (the gate multiplies the raw attention output)."""
    return P.linear(P.rnd(P.f(o) * torch.sigmoid(P.f(g))), w.o_proj)


def mla_attention(x: torch.Tensor, w, kv_cache: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                  T: int, cfg, P: Precision, *, absorbed: bool = True) -> torch.Tensor:
    """Gated MLA for N requests of T new tokens each (x [N*T, d], request-major), appending to the
    cache in place. Returns a = o_proj output [N*T, d] (a TP rank's partial sum)."""
    q, rows, g = mla_latents(x, w, cfg, P)
    o = mla_core(q, rows, w, kv_cache, lengths, slots, T, cfg, P, absorbed=absorbed)
    return mla_output(o, g, w, P)
