"""Precision policy: where the released model rounds, and how tests switch rounding off.

K3 keeps activations in BF16 between kernels and does its reductions, gates, softmaxes and
recurrent state in FP32 (docs/k3-layer.md §15). The reference writes every one of those rounding
points as an explicit ``P.act(x)`` call, so the same code runs

* ``Precision.model()``: BF16 GEMMs with FP32 accumulation and BF16 outputs, FP32 elementwise
  math, BF16 activations; this is the ``ref`` implementation measured on the GPU;
* ``Precision.exact(torch.float64)`` (or float32): every op in one wide dtype and no rounding at
  all, used by tests that compare two algebraically equal formulations (token loop vs chunked,
  naive vs absorbed MLA, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype          # dtype of elementwise math, reductions, state
    act: torch.dtype | None       # activation dtype at the model's rounding points (None: never round)

    @staticmethod
    def model() -> "Precision":
        return Precision(compute=torch.float32, act=torch.bfloat16)

    @staticmethod
    def exact(dtype: torch.dtype = torch.float64) -> "Precision":
        return Precision(compute=dtype, act=None)

    @property
    def is_model(self) -> bool:
        return self.act is not None

    @property
    def io_dtype(self) -> torch.dtype:
        """dtype of activations handed between ops (BF16 in model mode)."""
        return self.act if self.act is not None else self.compute

    @property
    def state_dtype(self) -> torch.dtype:
        """The KDA recurrent state: FP32 in the model, the wide dtype in exact mode."""
        return self.compute

    def rnd(self, x: torch.Tensor) -> torch.Tensor:
        """A rounding point: ``P.rnd(x)`` marks "the model rounds to BF16 here" (a no-op cast to
        the wide dtype in exact mode)."""
        return x.to(self.io_dtype)

    def f(self, x: torch.Tensor) -> torch.Tensor:
        """Up-cast to the compute dtype for elementwise math."""
        return x.to(self.compute)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` as K3 runs it: BF16 operands, FP32 accumulation, BF16 output (model mode);
        one wide dtype, no rounding (exact mode). No Linear in K3 has a bias."""
        if self.is_model:
            return F.linear(x.to(self.act), w.to(self.act))
        return F.linear(x.to(self.compute), w.to(self.compute))

    def linear_f32(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A Linear whose output stays FP32 (the router logits, section 10): BF16 x BF16 products
        accumulated in FP32 (vLLM GateLinear(out_dtype=float32))."""
        if self.is_model:
            return F.linear(x.to(self.act).float(), w.to(self.act).float())
        return F.linear(x.to(self.compute), w.to(self.compute))
