"""How two implementations' outputs are compared (the metric of tests/tolerances.py and the traces)."""
from __future__ import annotations

import torch


def rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_2 / ||ref||_2 in fp64 (fla's ratio). NaN anywhere gives NaN, which fails every bound."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))
