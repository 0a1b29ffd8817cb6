"""The bytes one decode step of one layer must move through HBM, stage by stage (docs/k3-layer.md §14).

"Must move": every weight the step touches read once, every recurrent/conv state read and written
once, the MLA latent cache read once per request, the routed experts that at least one token picked
read once (deduplicated), and the activations entering and leaving each stage. The floor of a stage
is its bytes over the copy bandwidth measured on the same machine.

Stage names are the NVTX range names every implementation uses (k3fast.nvtx), so a trace and this
model line up row by row.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import K3Config

BF16, F32 = 2, 4


def expert_bytes(cfg: K3Config) -> int:
    """One routed expert on this rank: w1, w3 [I, dL] and w2 [dL, I] at 4 bits + one E8M0 byte per 32."""
    I, dL, g = cfg.expert_intermediate, cfg.routed_expert_hidden_size, cfg.mxfp4_group
    per_matrix = I * dL // 2 + I * dL // g
    return 3 * per_matrix


def expected_distinct_experts(cfg: K3Config, batch: int) -> float:
    """Expected number of distinct experts picked by ``batch`` tokens under uniform routing."""
    E, k = cfg.num_experts, cfg.num_experts_per_token
    return E * (1.0 - (1.0 - k / E) ** batch)


@dataclass
class StageBytes:
    stage: str
    weights: int
    state: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.state + self.activations


def layer_bytes(cfg: K3Config, kind: str, batch: int, *, context: int = 0, distinct_experts: float | None = None,
                layer: int | None = None) -> list[StageBytes]:
    """Per-stage bytes of one decode step (T = 1) of a ``kind`` layer ("kda_moe", "mla_moe", "kda_dense")
    for ``batch`` requests. ``context``: cached tokens per request (MLA). ``distinct_experts``: the
    number of distinct routed experts the step reads (default: the uniform-routing expectation).
    ``layer``: the layer index, which sets how many AttnRes blocks are read (default: a mid-block layer
    of the second block, 2 sources before attention)."""
    if kind not in ("kda_moe", "mla_moe", "kda_dense"):
        raise ValueError(f"kind must be kda_moe, mla_moe or kda_dense, got {kind!r}")
    d, b = cfg.hidden_size, batch
    act = lambda n: n * b * BF16
    nb = 1 if layer is None else cfg.num_blocks_before(layer)
    st: list[StageBytes] = []
    # AttnRes #1: read nb blocks + p + delta, write p and x
    st.append(StageBytes("k3.attn_res", 2 * d * BF16 * 2, 0, act(d) * (nb + 4)))
    if kind.startswith("kda"):
        P, H, D = cfg.kda_proj, cfg.kda_heads, cfg.kda_head_dim
        in_rows = 4 * P + D + H
        st.append(StageBytes("k3.kda.in_proj", in_rows * d * BF16, 0, act(d) + act(in_rows)))
        core_w = P * D * BF16 + 3 * P * cfg.short_conv_kernel_size * F32 + H * F32 + P * F32 + D * F32
        rec = H * D * D * F32 * b
        conv = 3 * P * (cfg.short_conv_kernel_size - 1) * BF16 * b
        st.append(StageBytes("k3.kda.core", core_w, 2 * (rec + conv), act(4 * P + D + H) + act(P)))
        o_in = P
    else:
        H = cfg.mla_heads
        a_rows = cfg.q_lora_rank + cfg.kv_cache_dim + H * cfg.v_head_dim
        st.append(StageBytes("k3.mla.in_proj", a_rows * d * BF16 + (cfg.q_lora_rank + cfg.kv_lora_rank) * BF16, 0,
                             act(d) + act(a_rows)))
        st.append(StageBytes("k3.mla.q_b", H * cfg.qk_head_dim * cfg.q_lora_rank * BF16, 0,
                             act(cfg.q_lora_rank) + act(H * cfg.qk_head_dim)))
        cache = (context * cfg.kv_cache_dim * BF16 + cfg.kv_cache_dim * BF16) * b     # read the history, write the new row
        wkv = H * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank * BF16
        st.append(StageBytes("k3.mla.core", wkv, cache, act(H * cfg.qk_head_dim) + act(2 * H * cfg.v_head_dim)))
        o_in = H * cfg.v_head_dim
    st.append(StageBytes("k3.o_proj", d * o_in * BF16, 0, act(o_in) + act(d)))
    st.append(StageBytes("k3.attn_res_mlp", 2 * d * BF16 * 2, 0, act(d) * (nb + 4)))
    if kind.endswith("moe"):
        E, dL = cfg.num_experts, cfg.routed_expert_hidden_size
        st.append(StageBytes("k3.router", E * d * BF16 + E * F32, 0, act(d) + b * 16 * 8))
        st.append(StageBytes("k3.moe.down", dL * d * BF16, 0, act(dL)))
        n_exp = expected_distinct_experts(cfg, b) if distinct_experts is None else distinct_experts
        st.append(StageBytes("k3.moe.experts", int(round(n_exp * expert_bytes(cfg))), 0, act(dL) * 2))
        st.append(StageBytes("k3.moe.up", dL * BF16 + d * dL * BF16, 0, act(dL) + act(d)))
        Is = cfg.shared_intermediate
        st.append(StageBytes("k3.moe.shared", 3 * Is * d * BF16, 0, act(d) * 2))
    else:
        I = cfg.dense_intermediate
        st.append(StageBytes("k3.mlp.dense", 3 * I * d * BF16, 0, act(d) * 2))
    return st


ATTN_STAGES = ("k3.attn_res", "k3.kda.in_proj", "k3.kda.core", "k3.mla.in_proj", "k3.mla.q_b", "k3.mla.core",
               "k3.o_proj", "k3.attn_res_mlp")


def part_bytes(stages: list[StageBytes], part: str) -> int:
    """Total bytes of ``part``: "layer", "attn" (layer input -> MLP input) or "moe" (MLP input -> output)."""
    if part == "layer":
        return sum(s.total for s in stages)
    if part == "attn":
        return sum(s.total for s in stages if s.stage in ATTN_STAGES)
    if part == "moe":
        return sum(s.total for s in stages if s.stage not in ATTN_STAGES)
    raise ValueError(f"part must be layer, attn or moe, got {part!r}")


def floor_us(nbytes: float, copy_tbps: float) -> float:
    """The byte floor in microseconds at ``copy_tbps`` TB/s (10^12 B/s)."""
    return nbytes / (copy_tbps * 1e12) * 1e6
