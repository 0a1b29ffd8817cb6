"""Norms and the SiTU-GLU activation (docs/k3-layer.md §5 and §9).

All statistics are computed in the compute dtype (FP32 in the model). Each function returns the
compute dtype; the caller rounds (``P.rnd``) where the model stores a BF16 activation.
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm_w(x) = w * x / sqrt(mean(x^2) + eps) over the last axis (section 5).

    x: [..., n] any float dtype; weight: [n]. Statistics and the product in ``x``'s dtype after the
    caller's up-cast; one rounding at the end by the caller (the model's vLLM kernels normalise and
    multiply in FP32, then round once: section 15, difference D7 with HF)."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * r * weight.to(x.dtype)


def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm (section 7.2 step 8): y = w * o / sqrt(mean(o^2) + eps) * sigmoid(g).

    o: [..., D] per head (norm over D), weight: [D] shared across heads, gate: [..., D].
    The norm comes first and the sigmoid gate second; the gate is sigmoid, not silu (the HF torch
    fallback uses silu: difference D1 in docs/k3-layer.md §18, an HF bug)."""
    return rms_norm(o, weight, eps) * torch.sigmoid(gate.to(o.dtype))


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """KDA q/k normalisation: x / sqrt(sum(x^2) + 1e-6) over the head dim. Not an RMSNorm (section 7.2 step 4)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def situ_glu(a: torch.Tensor, c: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU (section 9): [beta*tanh(a/beta) * sigmoid(a)] * [linear_beta*tanh(c/linear_beta)].

    a is the gate branch (gate_proj / w1), c the up branch (up_proj / w3). Both soft-clip: the gate
    saturates at +-4 times a sigmoid, the up branch at +-25."""
    return (beta * torch.tanh(a / beta) * torch.sigmoid(a)) * (linear_beta * torch.tanh(c / linear_beta))
