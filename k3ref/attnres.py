"""Attention Residuals: K3 has no ordinary residual stream (docs/k3-layer.md §4 and §6).

Every sublayer output is added into a per-token partial block sum p; each sublayer's input is a
learned softmax mixture over the completed blocks B and p, followed by the usual pre-norm:

    r_i = 1 / sqrt(mean(v_i^2) + eps)          (FP32)
    s_i = r_i * sum_d v_i[d] u[d]               u = res_norm.weight * res_proj.weight
    a   = softmax_i(s_i)                        over the sources: blocks first, p last
    m   = sum_i a_i v_i                         the RAW (un-normalised) sources, FP32
    out = RMSNorm_{w_ln}(m)                     vLLM normalises the FP32 m (HF rounds m to BF16 first)

``ResidualStream`` carries (B, p, delta) between layers in vLLM's factorisation (section 4.3): the
previous layer's MLP output delta is added to p at the start of the next layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .norms import rms_norm
from .precision import Precision


@dataclass
class ResidualStream:
    """Per-token AttnRes state flowing between layers (nothing persists across tokens).

    blocks: [N, max_blocks, d] completed blocks (B[0] = token embedding), only the first
    ``cfg.num_blocks_before(l)`` rows valid at layer l; partial: [N, d] the block's partial sum p;
    delta: [N, d] the previous layer's MLP output, not yet added to p (None before layer 0)."""
    blocks: torch.Tensor
    partial: torch.Tensor
    delta: torch.Tensor | None = None

    @staticmethod
    def from_embeddings(emb: torch.Tensor, max_blocks: int) -> "ResidualStream":
        blocks = torch.zeros(emb.shape[0], max_blocks, emb.shape[1], dtype=emb.dtype, device=emb.device)
        return ResidualStream(blocks=blocks, partial=emb.clone(), delta=None)

    def clone(self) -> "ResidualStream":
        return ResidualStream(self.blocks.clone(), self.partial.clone(), None if self.delta is None else self.delta.clone())

    def hidden(self) -> torch.Tensor:
        """HF's p_out: the partial sum with the pending MLP output folded in."""
        return self.partial if self.delta is None else (self.partial.double() + self.delta.double()).to(self.partial.dtype)


def attn_res_mix(sources: torch.Tensor, u: torch.Tensor, eps: float) -> torch.Tensor:
    """sources: [N, n, d] (blocks first, partial last) -> m [N, d] in the sources' dtype (compute).

    u: [d] = gamma * pi. The score key is the RMS-normalised source; the mixed value is the raw one."""
    r = torch.rsqrt(sources.pow(2).mean(-1) + eps)                      # [N, n]
    s = r * (sources @ u.to(sources.dtype))                               # [N, n]
    alpha = torch.softmax(s, dim=-1)
    return torch.einsum("nk,nkd->nd", alpha, sources)


def attn_res_u(site, P: Precision) -> torch.Tensor:
    """u = res_norm.weight * res_proj.weight in the compute dtype (only the product is ever used)."""
    return P.f(site.norm) * P.f(site.proj.view(-1))


def pre_attention(stream: ResidualStream, layer: int, site, ln_weight: torch.Tensor, cfg, P: Precision) -> torch.Tensor:
    """AttnRes #1 of layer l (section 4.3), updating ``stream`` in place; returns the attention input x.

    p := bf16(p + delta); at a block boundary (l % block == 0) B[l / block] := p; the mix runs over
    {B[0 .. ceil(l/block) - 1], p}; x = RMSNorm_{input_layernorm}(m). At l = 0 the mix has one
    source (p = the embedding) so x = RMSNorm(embedding)."""
    if stream.delta is not None:
        stream.partial = P.rnd(P.f(stream.partial) + P.f(stream.delta))
        stream.delta = None
    if cfg.is_block_boundary(layer):
        stream.blocks[:, layer // cfg.attn_res_block_size] = stream.partial.to(stream.blocks.dtype)
    nb = cfg.num_blocks_before(layer)
    src = torch.cat([P.f(stream.blocks[:, :nb]), P.f(stream.partial)[:, None]], dim=1)
    m = attn_res_mix(src, attn_res_u(site, P), cfg.rms_norm_eps)
    return P.rnd(rms_norm(m, ln_weight, cfg.rms_norm_eps))


def pre_mlp(stream: ResidualStream, layer: int, a: torch.Tensor, site, ln_weight: torch.Tensor, cfg, P: Precision) -> torch.Tensor:
    """AttnRes #2 of layer l: add the attention output a into p (or restart p := a at a boundary),
    mix over {B[0 .. ceil(l/block) - 1 + boundary], p}, RMSNorm_{post_attention_layernorm}. No block write."""
    boundary = cfg.is_block_boundary(layer)
    stream.partial = P.rnd(a) if boundary else P.rnd(P.f(stream.partial) + P.f(a))
    nb = cfg.num_blocks_before(layer) + int(boundary)
    src = torch.cat([P.f(stream.blocks[:, :nb]), P.f(stream.partial)[:, None]], dim=1)
    m = attn_res_mix(src, attn_res_u(site, P), cfg.rms_norm_eps)
    return P.rnd(rms_norm(m, ln_weight, cfg.rms_norm_eps))


def final_mix(stream: ResidualStream, site, cfg, P: Precision) -> torch.Tensor:
    """After the last layer: mix over all blocks and p_out (no norm inside; model.norm follows)."""
    p = stream.hidden()
    src = torch.cat([P.f(stream.blocks[:, :cfg.max_blocks]), P.f(p)[:, None]], dim=1)
    return attn_res_mix(src, attn_res_u(site, P), cfg.rms_norm_eps)
