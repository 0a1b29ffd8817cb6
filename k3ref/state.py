"""Per-layer decode state (docs/k3-layer.md §7.3 and §8.4) and its allocation.

A pool of ``slots`` per layer: request n of a batch uses slot ``slots[n]``; a slot < 0 marks a
padded row (no read, no write). Other requests' slots are never touched by a step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import K3Config
from .precision import Precision


@dataclass
class KDAState:
    conv: torch.Tensor        # [S, 3P, K-1] BF16: raw q|k|v projections at t-3, t-2, t-1 (oldest first)
    recurrent: torch.Tensor   # [S, H, V, K] FP32: S[v, k], k contiguous

    @staticmethod
    def allocate(cfg: K3Config, slots: int, P: Precision = Precision.model(), device="cpu") -> "KDAState":
        Pw, H, D = cfg.kda_proj, cfg.kda_heads, cfg.kda_head_dim
        return KDAState(conv=torch.zeros(slots, 3 * Pw, cfg.short_conv_kernel_size - 1, dtype=P.io_dtype, device=device),
                        recurrent=torch.zeros(slots, H, D, D, dtype=P.state_dtype, device=device))

    def clone(self) -> "KDAState":
        return KDAState(self.conv.clone(), self.recurrent.clone())

    @property
    def num_slots(self) -> int:
        return self.conv.shape[0]


@dataclass
class MLACache:
    kv: torch.Tensor          # [S, Lmax, 576] BF16 rows [c_kv | k_pe]
    lengths: torch.Tensor     # [S] int64: tokens cached per slot

    @staticmethod
    def allocate(cfg: K3Config, slots: int, max_len: int, P: Precision = Precision.model(), device="cpu") -> "MLACache":
        return MLACache(kv=torch.zeros(slots, max_len, cfg.kv_cache_dim, dtype=P.io_dtype, device=device),
                        lengths=torch.zeros(slots, dtype=torch.int64, device=device))

    def clone(self) -> "MLACache":
        return MLACache(self.kv.clone(), self.lengths.clone())

    @property
    def num_slots(self) -> int:
        return self.kv.shape[0]


def allocate_state(cfg: K3Config, layer: int, slots: int, *, max_len: int = 0, P: Precision = Precision.model(),
                   device="cpu"):
    """The state object a layer of this kind needs: KDAState or MLACache."""
    if cfg.is_kda_layer(layer):
        return KDAState.allocate(cfg, slots, P, device)
    if max_len <= 0:
        raise ValueError("an MLA layer needs max_len > 0 cache rows per slot")
    return MLACache.allocate(cfg, slots, max_len, P, device)
