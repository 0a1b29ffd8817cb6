"""Router, Stable LatentMoE with MXFP4 experts, shared experts, and the dense layer-0 MLP
(docs/k3-layer.md §9, §10, §11).

    z      = x W_down^T                                   latent, 7168 -> 3584, no norm before the experts
    a, c   = z W1_e^T, z W3_e^T ;  y_e = SiTU(a, c) W2_e^T  16 routed MXFP4 experts in the latent
    r      = bf16( sum_e w_e * fp32(y_e) )                late routing weights, FP32 accumulation
    routed = RMSNorm_{routed_expert_norm}(r) W_up^T        after the full combine (and the TP all-reduce)
    shared = SiTU(x W_sg^T, x W_su^T) W_sd^T               on the FULL hidden state x
    f      = routed + shared

Under tensor parallelism (section 13) the routed and shared parts are partial sums: ``latent_moe``
takes an ``all_reduce`` callable (identity on one process) at the two places the model sums.
"""
from __future__ import annotations

from typing import Callable

import torch

from .norms import rms_norm, situ_glu
from .precision import Precision
from .quant import dequant_mxfp4


def route(x: torch.Tensor, w, cfg, P: Precision) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with a selection-only correction bias (section 10).

    x: [N, d] MLP input. logits = x W_r^T in FP32; s = sigmoid(logits); the top-k experts are chosen
    on s + e_score_correction_bias, but weighted by the UNBIASED s, renormalised over the chosen
    (+1e-20) and scaled by routed_scaling_factor. Ties in s + bias pick the lower expert index
    (a stable sort; the model's torch.topk leaves tie order unspecified).
    Returns ids [N, k] int64 ordered by descending biased score, weights [N, k] (compute dtype)."""
    logits = P.linear_f32(x, w.gate)
    s = torch.sigmoid(logits)
    biased = s + w.e_score_correction_bias.to(s.dtype)
    order = torch.sort(biased, dim=-1, descending=True, stable=True).indices
    ids = order[:, :cfg.num_experts_per_token]
    ws = s.gather(-1, ids)
    ws = ws / (ws.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    return ids, ws.to(P.compute)


def expert_ffn(z: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, cfg, P: Precision) -> torch.Tensor:
    """One routed expert on its tokens: z [n, dL] -> y [n, dL] (BF16 GEMM outputs, FP32 SiTU).

    w1, w3: [I, dL], w2: [dL, I], already dequantised (exact in BF16)."""
    h = P.rnd(situ_glu(P.f(P.linear(z, w1)), P.f(P.linear(z, w3)), cfg.situ_beta, cfg.situ_linear_beta))
    return P.linear(h, w2)


def routed_experts_loop(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w, cfg, P: Precision) -> torch.Tensor:
    """The specification of the routed combine: for each token, for each of its k experts in slot
    order, dequantise the expert and accumulate w_e * y_e in FP32; round once. z: [N, dL]."""
    dq = P.io_dtype
    out = []
    for n in range(z.shape[0]):
        acc = torch.zeros(z.shape[1], dtype=P.compute, device=z.device)
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            w1 = dequant_mxfp4(w.w1_packed[e], w.w1_scale[e], dq)
            w3 = dequant_mxfp4(w.w3_packed[e], w.w3_scale[e], dq)
            w2 = dequant_mxfp4(w.w2_packed[e], w.w2_scale[e], dq)
            acc = acc + weights[n, j] * P.f(expert_ffn(z[n:n + 1], w1, w3, w2, cfg, P)[0])
        out.append(acc)
    return P.rnd(torch.stack(out))


def routed_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w, cfg, P: Precision) -> torch.Tensor:
    """Vectorised routed combine, same result as ``routed_experts_loop`` (same per-(token, expert)
    arithmetic, same slot order of the FP32 sum); no host synchronisation, so it can be captured in a
    CUDA graph. Each slot j gathers the packed weights of ids[:, j] for all tokens and dequantises
    them: simple, and heavy (a reference, not a kernel)."""
    dq = P.io_dtype
    acc = torch.zeros(z.shape, dtype=P.compute, device=z.device)
    zb = z.unsqueeze(1)                                                         # [N, 1, dL]
    for j in range(ids.shape[1]):
        e = ids[:, j]
        w1 = dequant_mxfp4(w.w1_packed[e], w.w1_scale[e], dq)                   # [N, I, dL]
        w3 = dequant_mxfp4(w.w3_packed[e], w.w3_scale[e], dq)
        w2 = dequant_mxfp4(w.w2_packed[e], w.w2_scale[e], dq)                   # [N, dL, I]
        if P.is_model:
            a, c = zb.to(P.act) @ w1.transpose(1, 2), zb.to(P.act) @ w3.transpose(1, 2)
            h = P.rnd(situ_glu(P.f(a), P.f(c), cfg.situ_beta, cfg.situ_linear_beta))
            y = h @ w2.transpose(1, 2)
        else:
            a, c = P.f(zb) @ P.f(w1).transpose(1, 2), P.f(zb) @ P.f(w3).transpose(1, 2)
            y = situ_glu(a, c, cfg.situ_beta, cfg.situ_linear_beta) @ P.f(w2).transpose(1, 2)
        acc = acc + weights[:, j:j + 1] * P.f(y[:, 0])
    return P.rnd(acc)


def shared_experts(x: torch.Tensor, w, cfg, P: Precision) -> torch.Tensor:
    """The two shared experts, fused into one SiTU-GLU MLP of width 6144 (this rank's slice)."""
    h = P.rnd(situ_glu(P.f(P.linear(x, w.shared_gate)), P.f(P.linear(x, w.shared_up)),
                       cfg.situ_beta, cfg.situ_linear_beta))
    return P.linear(h, w.shared_down)


def latent_moe(x: torch.Tensor, w, cfg, P: Precision, *, all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
               loop: bool = False) -> torch.Tensor:
    """Stable LatentMoE for x [N, d] (the post-attention RMSNorm output) -> f [N, d] BF16.

    ``all_reduce`` marks the two TP sums (section 13.2): the routed latent r (before its RMSNorm)
    and the shared-expert output. The router and the latent down/up projections are replicated."""
    ids, weights = route(x, w, cfg, P)
    z = P.linear(x, w.down)
    r = (routed_experts_loop if loop else routed_experts)(z, ids, weights, w, cfg, P)
    r = all_reduce(r)
    routed = P.linear(P.rnd(rms_norm(P.f(r), w.norm, cfg.rms_norm_eps)), w.up)
    shared = all_reduce(shared_experts(x, w, cfg, P))
    return P.rnd(P.f(routed) + P.f(shared))


def dense_mlp(x: torch.Tensor, w, cfg, P: Precision, *, all_reduce=lambda t: t) -> torch.Tensor:
    """Layer 0's dense SiTU-GLU MLP (section 9): SiTU(x W_g^T, x W_u^T) W_d^T, intermediate 33792."""
    h = P.rnd(situ_glu(P.f(P.linear(x, w.gate)), P.f(P.linear(x, w.up)), cfg.situ_beta, cfg.situ_linear_beta))
    return all_reduce(P.linear(h, w.down))
