"""K3Config: the released Kimi K3 text configuration and the presets this repository runs.

Values are from the published ``text_config`` (docs/k3-layer.md §1). A config describes the
tensors that ONE process holds: ``tp`` is the tensor-parallel degree the shapes are sliced for
(docs/k3-layer.md §13). ``k3()`` is the whole layer (TP1), ``k3_rank(t)`` is what one rank of t
holds and computes between its collectives, ``tiny()`` is for CPU tests and ``mini()`` is a small
whole model for end-to-end runs on one GPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class K3Config:
    # --- trunk (docs/k3-layer.md §1) ---
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    vocab_size: int = 163840
    rms_norm_eps: float = 1e-5
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    intermediate_size: int = 33792          # dense SiTU-GLU MLP of layer 0
    first_k_dense_replace: int = 1
    # --- latent MoE (sections 10, 11) ---
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584   # the latent width d_L
    routed_scaling_factor: float = 1.0
    mxfp4_group: int = 32
    # vLLM pads the per-rank expert intermediate to this minimum (KimiMoE.__init__, section 13.1).
    min_moe_intermediate_per_partition: int = 256
    # --- Gated MLA (section 8) ---
    num_attention_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # --- KDA (section 7) ---
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    # --- Attention Residuals (section 6) ---
    attn_res_block_size: int = 12
    # 0-indexed Gated-MLA layers (section 2): every 4th layer from 3, plus the last layer.
    mla_layers: tuple[int, ...] = field(default=tuple(range(3, 93, 4)) + (92,))
    # --- this process's slice ---
    tp: int = 1
    name: str = "k3"

    def __post_init__(self) -> None:
        problems = []
        if self.tp < 1:
            problems.append(f"tp must be >= 1, got {self.tp}")
        for what, n in [("kda_num_heads", self.kda_num_heads), ("num_attention_heads", self.num_attention_heads),
                        ("num_shared_experts*moe_intermediate_size", self.num_shared_experts * self.moe_intermediate_size),
                        ("intermediate_size", self.intermediate_size)]:
            if self.tp >= 1 and n % self.tp:
                problems.append(f"{what}={n} is not divisible by tp={self.tp}")
        if self.routed_expert_hidden_size % self.mxfp4_group or self.moe_intermediate_size % self.mxfp4_group:
            problems.append("the expert widths must be multiples of the MXFP4 group of 32")
        if self.num_experts_per_token > self.num_experts:
            problems.append("num_experts_per_token > num_experts")
        if not (-5.0 <= self.gate_lower_bound < 0.0):
            problems.append(f"gate_lower_bound must lie in [-5, 0) (vLLM requires it), got {self.gate_lower_bound}")
        if any(not (0 <= l < self.num_hidden_layers) for l in self.mla_layers):
            problems.append("mla_layers holds an index outside [0, num_hidden_layers)")
        if problems:
            raise ValueError("invalid K3Config: " + "; ".join(problems))

    # ------------------------------------------------------------------ layer schedule (section 2)
    def is_kda_layer(self, layer: int) -> bool:
        self._check_layer(layer)
        return layer not in self.mla_layers

    def is_moe_layer(self, layer: int) -> bool:
        self._check_layer(layer)
        return layer >= self.first_k_dense_replace

    def is_block_boundary(self, layer: int) -> bool:
        """Layers whose pre-attention AttnRes closes a block (layer % block_size == 0)."""
        self._check_layer(layer)
        return layer % self.attn_res_block_size == 0

    def num_blocks_before(self, layer: int) -> int:
        """Completed blocks B visible to the pre-attention mix of ``layer`` (B[0] = embedding)."""
        self._check_layer(layer)
        return -(-layer // self.attn_res_block_size)       # ceil(l / 12): 0 at l = 0

    @property
    def max_blocks(self) -> int:
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    def _check_layer(self, layer: int) -> None:
        if not (0 <= layer < self.num_hidden_layers):
            raise ValueError(f"layer index {layer} outside [0, {self.num_hidden_layers})")

    # ------------------------------------------------------------------ derived widths, per rank
    @property
    def kda_heads(self) -> int:                 # heads held by this rank
        return self.kda_num_heads // self.tp

    @property
    def kda_proj(self) -> int:                  # P/t: width of one of q, k, v, g on this rank
        return self.kda_heads * self.kda_head_dim

    @property
    def mla_heads(self) -> int:
        return self.num_attention_heads // self.tp

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:              # [c_kv | k_pe] = 576
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate(self) -> int:       # fused shared experts, this rank's slice
        return self.num_shared_experts * self.moe_intermediate_size // self.tp

    @property
    def expert_intermediate(self) -> int:
        """Routed-expert intermediate on this rank, padded to vLLM's minimum at high TP (192 -> 256 at TP16)."""
        if self.tp == 1:
            return self.moe_intermediate_size
        return max(self.moe_intermediate_size // self.tp, self.min_moe_intermediate_per_partition)

    @property
    def expert_intermediate_valid(self) -> int:
        """Rows of the rank's expert slice that hold real weights (the rest are vLLM's zero padding)."""
        return self.moe_intermediate_size // self.tp

    @property
    def dense_intermediate(self) -> int:
        return self.intermediate_size // self.tp

    def with_(self, **kw) -> "K3Config":
        return dataclasses.replace(self, **kw)

    def describe(self) -> str:
        return (f"{self.name}: d={self.hidden_size} tp={self.tp} KDA {self.kda_heads}x{self.kda_head_dim} "
                f"MLA {self.mla_heads} heads, experts {self.num_experts} (top-{self.num_experts_per_token}) "
                f"{self.routed_expert_hidden_size}->{self.expert_intermediate}, shared {self.shared_intermediate}")


# ---------------------------------------------------------------------- presets

def k3() -> K3Config:
    """The released model, full width (what TP1 holds)."""
    return K3Config()


def k3_rank(tp: int) -> K3Config:
    """What one rank of a TP-``tp`` vLLM deployment holds (docs/k3-layer.md §13.1): attention heads,
    shared experts, expert intermediate and the dense MLP are sliced; AttnRes, norms, f_a, MLA
    q_a/kv_a, the router and the latent projections are replicated."""
    if tp not in (1, 2, 4, 8, 16):
        raise ValueError(f"k3_rank supports tp in (1, 2, 4, 8, 16), got {tp}")
    return K3Config(tp=tp, name=f"k3_rank{tp}")


def tiny(tp: int = 1) -> K3Config:
    """A small layer for CPU tests. Every structural feature of K3 is kept (head dims that are not
    equal, an odd number of latent groups, top-k > 1 of many experts, AttnRes blocks of 2 layers)."""
    return K3Config(
        hidden_size=128, num_hidden_layers=6, vocab_size=512, intermediate_size=192,
        num_experts=24, num_experts_per_token=4, num_shared_experts=2, moe_intermediate_size=128,
        routed_expert_hidden_size=96, min_moe_intermediate_per_partition=64,
        num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, kda_num_heads=4, kda_head_dim=16, attn_res_block_size=2,
        mla_layers=(3, 5), tp=tp, name=f"tiny{'' if tp == 1 else f'_rank{tp}'}")


def mini() -> K3Config:
    """A small whole model that fits one GPU: full per-layer widths, 8 layers (dense layer 0, KDA
    and MLA MoE layers, two AttnRes block boundaries), 64 experts, a 32K vocabulary."""
    return K3Config(num_hidden_layers=8, vocab_size=32768, num_experts=64, attn_res_block_size=4,
                    mla_layers=(3, 7), name="mini")


PRESETS = {"k3": k3, "k3_rank8": lambda: k3_rank(8), "k3_rank16": lambda: k3_rank(16), "tiny": tiny, "mini": mini}


def preset(name: str) -> K3Config:
    """Look a preset up by the names used in trace records (``full`` is an alias of ``k3``)."""
    key = {"full": "k3"}.get(name, name)
    if key not in PRESETS:
        raise ValueError(f"unknown config preset {name!r}; expected one of {sorted(PRESETS) + ['full']}")
    return PRESETS[key]()
