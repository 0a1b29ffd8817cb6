"""Weights of one K3 decoder layer: typed containers, checkpoint names, random init, TP slicing.

Every field is named after its checkpoint tensor (docs/k3-layer.md §12) under
``language_model.model.layers.{l}.``. Shapes are ``[out, in]``; dtypes are the checkpoint's: BF16
except the FP32 conv weights, ``A_log``, ``dt_bias``, ``o_norm`` and ``e_score_correction_bias``, and
the uint8 MXFP4 experts (stacked here over the expert axis; the checkpoint stores one tensor per
expert).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import torch

from .config import K3Config

BF16, F32, U8 = torch.bfloat16, torch.float32, torch.uint8
PREFIX = "language_model.model.layers.{l}."


@dataclass
class AttnResSite:
    norm: torch.Tensor          # *_res_norm.weight [d] BF16 (the score's key norm gamma)
    proj: torch.Tensor          # *_res_proj.weight [1, d] BF16 (the pseudo-query pi)


@dataclass
class KDAWeights:
    q_proj: torch.Tensor        # [P, d]
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    g_proj: torch.Tensor        # [P, d] full-rank output gate
    f_a_proj: torch.Tensor      # [128, d] decay gate, low-rank down (replicated under TP)
    f_b_proj: torch.Tensor      # [P, 128]
    b_proj: torch.Tensor        # [H, d] beta logits
    q_conv: torch.Tensor        # q_conv1d.weight [P, 1, 4] FP32
    k_conv: torch.Tensor
    v_conv: torch.Tensor
    A_log: torch.Tensor         # [H] FP32 (the checkpoint's [128] zero-padded tensor, first 96 used)
    dt_bias: torch.Tensor       # [P] FP32
    o_norm: torch.Tensor        # [D] FP32, shared by all heads
    o_proj: torch.Tensor        # [d, P]


@dataclass
class MLAWeights:
    q_a_proj: torch.Tensor              # [1536, d]
    q_a_layernorm: torch.Tensor         # [1536]
    q_b_proj: torch.Tensor              # [H*192, 1536], per head [q_nope 128 | q_pe 64]
    kv_a_proj_with_mqa: torch.Tensor    # [576, d] = [c_kv 512 | k_pe 64]
    kv_a_layernorm: torch.Tensor        # [512]
    kv_b_proj: torch.Tensor             # [H*256, 512], per head [k_nope 128 | v 128]
    g_proj: torch.Tensor                # [H*128, d] output gate
    o_proj: torch.Tensor                # [d, H*128]


@dataclass
class MoEWeights:
    gate: torch.Tensor                  # router [E, d] BF16
    e_score_correction_bias: torch.Tensor   # [E] FP32
    down: torch.Tensor                  # routed_expert_down_proj [dL, d]
    norm: torch.Tensor                  # routed_expert_norm [dL]
    up: torch.Tensor                    # routed_expert_up_proj [d, dL]
    w1_packed: torch.Tensor             # [E, I, dL/2] uint8 (E2M1, low nibble first)
    w1_scale: torch.Tensor              # [E, I, dL/32] uint8 (E8M0)
    w3_packed: torch.Tensor
    w3_scale: torch.Tensor
    w2_packed: torch.Tensor             # [E, dL, I/2]
    w2_scale: torch.Tensor              # [E, dL, I/32]
    shared_gate: torch.Tensor           # shared_experts.gate_proj [Is, d]
    shared_up: torch.Tensor             # [Is, d]
    shared_down: torch.Tensor           # [d, Is]


@dataclass
class DenseMLPWeights:
    gate: torch.Tensor                  # mlp.gate_proj [I, d]
    up: torch.Tensor                    # mlp.up_proj [I, d]
    down: torch.Tensor                  # mlp.down_proj [d, I]


@dataclass
class LayerWeights:
    layer: int
    input_layernorm: torch.Tensor       # [d]
    post_attention_layernorm: torch.Tensor
    attn_res: AttnResSite               # self_attention_res_*
    mlp_res: AttnResSite                # mlp_res_*
    attn: KDAWeights | MLAWeights
    mlp: MoEWeights | DenseMLPWeights

    def tensors(self):
        """(field path, tensor) pairs of every tensor, for byte counts and device moves."""
        def walk(obj, prefix):
            for f in fields(obj):
                v = getattr(obj, f.name)
                if isinstance(v, torch.Tensor):
                    yield prefix + f.name, v
                elif dataclasses.is_dataclass(v):
                    yield from walk(v, prefix + f.name + ".")
        return list(walk(self, ""))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors())

    def to(self, device) -> "LayerWeights":
        return _map(self, lambda t: t.to(device))


def _map(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: _map(getattr(obj, f.name), fn) for f in fields(obj)
                                           if isinstance(getattr(obj, f.name), torch.Tensor) or dataclasses.is_dataclass(getattr(obj, f.name))})
    return obj


# ------------------------------------------------------------------------------------------ checkpoint names

def checkpoint_spec(cfg: K3Config, layer: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of layer ``layer`` in a full-width (TP1) HF checkpoint: name -> (shape, dtype).
    The experts are listed one tensor per expert, as the released safetensors store them."""
    if cfg.tp != 1:
        raise ValueError("checkpoint_spec describes the full-width checkpoint; pass a tp=1 config")
    d = cfg.hidden_size
    p = PREFIX.format(l=layer)
    s: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
        s[p + n + ".weight"] = ((d,), BF16)
    for n in ("self_attention_res_proj", "mlp_res_proj"):
        s[p + n + ".weight"] = ((1, d), BF16)
    a = p + "self_attn."
    if cfg.is_kda_layer(layer):
        P, H, D = cfg.kda_proj, cfg.kda_heads, cfg.kda_head_dim
        for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
            s[a + n + ".weight"] = ((P, d), BF16)
        s[a + "f_a_proj.weight"] = ((D, d), BF16)
        s[a + "f_b_proj.weight"] = ((P, D), BF16)
        s[a + "b_proj.weight"] = ((H, d), BF16)
        for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
            s[a + n + ".weight"] = ((P, 1, cfg.short_conv_kernel_size), F32)
        s[a + "A_log"] = ((_a_log_len(cfg),), F32)
        s[a + "dt_bias"] = ((P,), F32)
        s[a + "o_norm.weight"] = ((D,), F32)
        s[a + "o_proj.weight"] = ((d, P), BF16)
    else:
        H = cfg.mla_heads
        s[a + "q_a_proj.weight"] = ((cfg.q_lora_rank, d), BF16)
        s[a + "q_a_layernorm.weight"] = ((cfg.q_lora_rank,), BF16)
        s[a + "q_b_proj.weight"] = ((H * cfg.qk_head_dim, cfg.q_lora_rank), BF16)
        s[a + "kv_a_proj_with_mqa.weight"] = ((cfg.kv_cache_dim, d), BF16)
        s[a + "kv_a_layernorm.weight"] = ((cfg.kv_lora_rank,), BF16)
        s[a + "kv_b_proj.weight"] = ((H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), BF16)
        s[a + "g_proj.weight"] = ((H * cfg.v_head_dim, d), BF16)
        s[a + "o_proj.weight"] = ((d, H * cfg.v_head_dim), BF16)
    if cfg.is_moe_layer(layer):
        m = p + "block_sparse_moe."
        E, dL, I, Is = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate
        s[m + "gate.weight"] = ((E, d), BF16)
        s[m + "gate.e_score_correction_bias"] = ((E,), F32)
        s[m + "routed_expert_down_proj.weight"] = ((dL, d), BF16)
        s[m + "routed_expert_norm.weight"] = ((dL,), BF16)
        s[m + "routed_expert_up_proj.weight"] = ((d, dL), BF16)
        s[m + "shared_experts.gate_proj.weight"] = ((Is, d), BF16)
        s[m + "shared_experts.up_proj.weight"] = ((Is, d), BF16)
        s[m + "shared_experts.down_proj.weight"] = ((d, Is), BF16)
        g = cfg.mxfp4_group
        for e in range(E):
            for n, (rows, cols) in (("w1", (I, dL)), ("w3", (I, dL)), ("w2", (dL, I))):
                s[f"{m}experts.{e}.{n}.weight_packed"] = ((rows, cols // 2), U8)
                s[f"{m}experts.{e}.{n}.weight_scale"] = ((rows, cols // g), U8)
    else:
        I = cfg.intermediate_size
        s[p + "mlp.gate_proj.weight"] = ((I, d), BF16)
        s[p + "mlp.up_proj.weight"] = ((I, d), BF16)
        s[p + "mlp.down_proj.weight"] = ((d, I), BF16)
    return s


def _a_log_len(cfg: K3Config) -> int:
    """The release stores A_log as [128] with entries 96..127 exactly zero (section 16 item 1)."""
    return 128 if cfg.kda_num_heads == 96 else cfg.kda_num_heads


class CheckpointError(ValueError):
    """A checkpoint that does not match the layer: lists every problem at once."""


def validate_checkpoint(tensors: dict[str, torch.Tensor], cfg: K3Config, layers) -> None:
    """Raise ONE CheckpointError listing every missing, unexpected, wrongly shaped or typed tensor."""
    want: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for l in layers:
        want.update(checkpoint_spec(cfg, l))
    problems = []
    for name, (shape, dtype) in want.items():
        t = tensors.get(name)
        if t is None:
            problems.append(f"missing: {name} (expected {list(shape)} {dtype})")
            continue
        if tuple(t.shape) != shape:
            problems.append(f"wrong shape: {name} is {list(t.shape)}, expected {list(shape)}")
        if t.dtype != dtype:
            problems.append(f"wrong dtype: {name} is {t.dtype}, expected {dtype}")
    prefixes = tuple(PREFIX.format(l=l) for l in layers)
    for name in tensors:
        if name not in want and name.startswith(prefixes):
            problems.append(f"unexpected: {name}")
    if problems:
        raise CheckpointError(f"checkpoint does not match {cfg.name} layers {list(layers)}: {len(problems)} problem(s):\n  "
                              + "\n  ".join(problems))


def layer_from_checkpoint(tensors: dict[str, torch.Tensor], cfg: K3Config, layer: int) -> LayerWeights:
    """Build a full-width LayerWeights from checkpoint tensors (validated first)."""
    validate_checkpoint(tensors, cfg, [layer])
    p = PREFIX.format(l=layer)
    t = lambda n: tensors[p + n]
    site = lambda n: AttnResSite(norm=t(f"{n}_res_norm.weight"), proj=t(f"{n}_res_proj.weight"))
    a = "self_attn."
    if cfg.is_kda_layer(layer):
        attn = KDAWeights(q_proj=t(a + "q_proj.weight"), k_proj=t(a + "k_proj.weight"), v_proj=t(a + "v_proj.weight"),
                          g_proj=t(a + "g_proj.weight"), f_a_proj=t(a + "f_a_proj.weight"), f_b_proj=t(a + "f_b_proj.weight"),
                          b_proj=t(a + "b_proj.weight"), q_conv=t(a + "q_conv1d.weight"), k_conv=t(a + "k_conv1d.weight"),
                          v_conv=t(a + "v_conv1d.weight"), A_log=t(a + "A_log")[:cfg.kda_num_heads].contiguous(),
                          dt_bias=t(a + "dt_bias"), o_norm=t(a + "o_norm.weight"), o_proj=t(a + "o_proj.weight"))
    else:
        attn = MLAWeights(**{f.name: t(a + f.name + ".weight") for f in fields(MLAWeights)})
    if cfg.is_moe_layer(layer):
        m = "block_sparse_moe."
        stack = lambda n: torch.stack([t(f"{m}experts.{e}.{n}") for e in range(cfg.num_experts)])
        mlp = MoEWeights(gate=t(m + "gate.weight"), e_score_correction_bias=t(m + "gate.e_score_correction_bias"),
                         down=t(m + "routed_expert_down_proj.weight"), norm=t(m + "routed_expert_norm.weight"),
                         up=t(m + "routed_expert_up_proj.weight"),
                         w1_packed=stack("w1.weight_packed"), w1_scale=stack("w1.weight_scale"),
                         w3_packed=stack("w3.weight_packed"), w3_scale=stack("w3.weight_scale"),
                         w2_packed=stack("w2.weight_packed"), w2_scale=stack("w2.weight_scale"),
                         shared_gate=t(m + "shared_experts.gate_proj.weight"), shared_up=t(m + "shared_experts.up_proj.weight"),
                         shared_down=t(m + "shared_experts.down_proj.weight"))
    else:
        mlp = DenseMLPWeights(gate=t("mlp.gate_proj.weight"), up=t("mlp.up_proj.weight"), down=t("mlp.down_proj.weight"))
    return LayerWeights(layer=layer, input_layernorm=t("input_layernorm.weight"),
                        post_attention_layernorm=t("post_attention_layernorm.weight"),
                        attn_res=site("self_attention"), mlp_res=site("mlp"), attn=attn, mlp=mlp)


def layer_to_checkpoint(w: LayerWeights, cfg: K3Config) -> dict[str, torch.Tensor]:
    """The inverse of ``layer_from_checkpoint``: checkpoint names -> tensors (experts unstacked)."""
    p = PREFIX.format(l=w.layer)
    out = {p + "input_layernorm.weight": w.input_layernorm, p + "post_attention_layernorm.weight": w.post_attention_layernorm}
    for n, site in (("self_attention", w.attn_res), ("mlp", w.mlp_res)):
        out[p + f"{n}_res_norm.weight"] = site.norm
        out[p + f"{n}_res_proj.weight"] = site.proj
    a = p + "self_attn."
    if isinstance(w.attn, KDAWeights):
        k = w.attn
        for n in ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj"):
            out[a + n + ".weight"] = getattr(k, n)
        for n in ("q", "k", "v"):
            out[a + f"{n}_conv1d.weight"] = getattr(k, f"{n}_conv")
        n_log = _a_log_len(cfg)
        out[a + "A_log"] = torch.cat([k.A_log, k.A_log.new_zeros(n_log - k.A_log.shape[0])])
        out[a + "dt_bias"] = k.dt_bias
        out[a + "o_norm.weight"] = k.o_norm
    else:
        for f in fields(MLAWeights):
            out[a + f.name + ".weight"] = getattr(w.attn, f.name)
    if isinstance(w.mlp, MoEWeights):
        m, mw = p + "block_sparse_moe.", w.mlp
        out[m + "gate.weight"] = mw.gate
        out[m + "gate.e_score_correction_bias"] = mw.e_score_correction_bias
        out[m + "routed_expert_down_proj.weight"] = mw.down
        out[m + "routed_expert_norm.weight"] = mw.norm
        out[m + "routed_expert_up_proj.weight"] = mw.up
        out[m + "shared_experts.gate_proj.weight"] = mw.shared_gate
        out[m + "shared_experts.up_proj.weight"] = mw.shared_up
        out[m + "shared_experts.down_proj.weight"] = mw.shared_down
        for e in range(mw.w1_packed.shape[0]):
            for n in ("w1", "w3", "w2"):
                out[f"{m}experts.{e}.{n}.weight_packed"] = getattr(mw, f"{n}_packed")[e].contiguous()
                out[f"{m}experts.{e}.{n}.weight_scale"] = getattr(mw, f"{n}_scale")[e].contiguous()
    else:
        out[p + "mlp.gate_proj.weight"] = w.mlp.gate
        out[p + "mlp.up_proj.weight"] = w.mlp.up
        out[p + "mlp.down_proj.weight"] = w.mlp.down
    return out


# ------------------------------------------------------------------------------------------ random weights

def random_mxfp4(shape_rows_cols, n_lead: int, target_rms: float, g: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 tensors [n_lead, rows, cols/2] + scales [n_lead, rows, cols/32] whose dequantised
    values have RMS ~ target_rms: uniform random codes (RMS 2.93 in code units) times a per-block
    exponent drawn around log2(target_rms / 2.93) (+-1)."""
    rows, cols = shape_rows_cols
    # drawn as uint8 directly: the same values as an int32 draw (one 32-bit draw per element either way; compared on
    # the CPU), without a 4-byte transient per code byte (18 GB for a full-width layer's experts)
    packed = torch.randint(0, 256, (n_lead, rows, cols // 2), generator=g, device=device, dtype=U8)
    e0 = round(torch.log2(torch.tensor(target_rms / 2.93)).item())
    scale = (127 + e0 + torch.randint(-1, 2, (n_lead, rows, cols // 32), generator=g, device=device, dtype=torch.int32)).to(U8)
    return packed, scale


def random_layer(cfg: K3Config, layer: int, *, seed: int = 0, device="cpu") -> LayerWeights:
    """Random weights of layer ``layer`` at ``cfg``'s (per-rank) shapes, with realistic scales:
    projections ~ N(0, 1/in), norm weights ~ 1 + N(0, 0.05^2), A_log = log U(1, 16), dt_bias small,
    conv taps ~ N(0, 0.5^2), AttnRes pseudo-queries ~ N(0, (4/sqrt(d))^2) so mixture logits differ
    by O(1), routed experts MXFP4 with RMS ~ 1/sqrt(in). Deterministic for (cfg, layer, seed, device)."""
    g = torch.Generator(device=device).manual_seed(seed * 1000 + layer)
    d = cfg.hidden_size

    def lin(o, i, dtype=BF16):
        return (torch.randn(o, i, generator=g, device=device) * i ** -0.5).to(dtype)

    def ones(n, dtype=BF16):
        return (1.0 + 0.05 * torch.randn(n, generator=g, device=device)).to(dtype)

    def site():
        return AttnResSite(norm=ones(d), proj=(torch.randn(1, d, generator=g, device=device) * 4 * d ** -0.5).to(BF16))

    if cfg.is_kda_layer(layer):
        P, H, D = cfg.kda_proj, cfg.kda_heads, cfg.kda_head_dim
        conv = lambda: (0.5 * torch.randn(P, 1, cfg.short_conv_kernel_size, generator=g, device=device)).float()
        attn = KDAWeights(q_proj=lin(P, d), k_proj=lin(P, d), v_proj=lin(P, d), g_proj=lin(P, d), f_a_proj=lin(D, d),
                          f_b_proj=lin(P, D), b_proj=lin(H, d), q_conv=conv(), k_conv=conv(), v_conv=conv(),
                          A_log=torch.log(torch.empty(H, device=device).uniform_(1, 16, generator=g)).float(),
                          dt_bias=(0.5 * torch.randn(P, generator=g, device=device)).float(), o_norm=ones(D, F32),
                          o_proj=lin(d, P))
    else:
        H = cfg.mla_heads
        attn = MLAWeights(q_a_proj=lin(cfg.q_lora_rank, d), q_a_layernorm=ones(cfg.q_lora_rank),
                          q_b_proj=lin(H * cfg.qk_head_dim, cfg.q_lora_rank), kv_a_proj_with_mqa=lin(cfg.kv_cache_dim, d),
                          kv_a_layernorm=ones(cfg.kv_lora_rank),
                          kv_b_proj=lin(H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                          g_proj=lin(H * cfg.v_head_dim, d), o_proj=lin(d, H * cfg.v_head_dim))
    if cfg.is_moe_layer(layer):
        E, dL, I, Is = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.expert_intermediate, cfg.shared_intermediate
        w1p, w1s = random_mxfp4((I, dL), E, dL ** -0.5, g, device)
        w3p, w3s = random_mxfp4((I, dL), E, dL ** -0.5, g, device)
        w2p, w2s = random_mxfp4((dL, I), E, cfg.moe_intermediate_size ** -0.5, g, device)
        Iv = cfg.expert_intermediate_valid
        if Iv < I:   # vLLM's zero padding of the rank's expert slice: zero codes in the padded rows/columns
            for t in (w1p, w3p):
                t[:, Iv:] = 0
            w2p[:, :, Iv // 2:] = 0
        mlp = MoEWeights(gate=lin(E, d), e_score_correction_bias=(0.02 * torch.randn(E, generator=g, device=device)).float(),
                         down=lin(dL, d), norm=ones(dL), up=lin(d, dL),
                         w1_packed=w1p, w1_scale=w1s, w3_packed=w3p, w3_scale=w3s, w2_packed=w2p, w2_scale=w2s,
                         shared_gate=lin(Is, d), shared_up=lin(Is, d), shared_down=lin(d, Is))
    else:
        I = cfg.dense_intermediate
        mlp = DenseMLPWeights(gate=lin(I, d), up=lin(I, d), down=lin(d, I))
    return LayerWeights(layer=layer, input_layernorm=ones(d), post_attention_layernorm=ones(d),
                        attn_res=site(), mlp_res=site(), attn=attn, mlp=mlp)
