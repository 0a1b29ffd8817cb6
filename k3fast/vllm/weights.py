"""vLLM's Kimi K3 modules seen as k3ref's config and weights: the plug-in's fused halves read vLLM's own loaded
parameters through these views (no copies), except what a kernel needs re-laid (the experts' tiles, the packed
router front), which k3fast.layer makes once.

Only attribute access on the modules: no vLLM import, so the mapping is tested on CPU with stand-in modules.
"""
from __future__ import annotations

import torch

from k3ref import K3Config
from k3ref.weights import AttnResSite, KDAWeights, LayerWeights, MLAWeights, MoEWeights


def k3_config(text) -> K3Config:
    """K3Config of the process's shard from vLLM's hf_text_config (a KimiLinearConfig). The plug-in runs TP1, so
    the config's head and expert counts are what the GPU holds: a TP16-rank model is a config with 6 KDA heads,
    6 MLA heads and a 256-wide expert intermediate."""
    lin = text.linear_attn_config or {}
    L = text.num_hidden_layers
    full = lin.get("full_attn_layers")
    kda = lin.get("kda_layers")
    if full is not None:
        mla = tuple(int(i) - 1 for i in full)           # vLLM's configs number layers from 1
    else:
        mla = tuple(i for i in range(L) if (i + 1) not in set(kda or ()))
    return K3Config(
        hidden_size=text.hidden_size, num_hidden_layers=L, vocab_size=text.vocab_size, rms_norm_eps=text.rms_norm_eps,
        situ_beta=float(getattr(text, "activation_situ_beta", 4.0)),
        situ_linear_beta=float(getattr(text, "activation_situ_linear_beta", 25.0)),
        intermediate_size=text.intermediate_size, first_k_dense_replace=text.first_k_dense_replace,
        num_experts=text.num_experts, num_experts_per_token=text.num_experts_per_token,
        num_shared_experts=text.num_shared_experts or 0, moe_intermediate_size=text.moe_intermediate_size,
        routed_expert_hidden_size=text.routed_expert_hidden_size,
        routed_scaling_factor=float(text.routed_scaling_factor),
        num_attention_heads=text.num_attention_heads, q_lora_rank=text.q_lora_rank or 0,
        kv_lora_rank=text.kv_lora_rank, qk_nope_head_dim=text.qk_nope_head_dim,
        qk_rope_head_dim=text.qk_rope_head_dim, v_head_dim=text.v_head_dim,
        kda_num_heads=lin.get("num_heads", 0), kda_head_dim=lin.get("head_dim", 128),
        short_conv_kernel_size=lin.get("short_conv_kernel_size", 4),
        gate_lower_bound=float(lin.get("gate_lower_bound", -5.0)),
        attn_res_block_size=text.attn_res_block_size, mla_layers=mla, tp=1, name="vllm")


def _site(norm_module, proj_module) -> AttnResSite:
    return AttnResSite(norm=norm_module.weight, proj=proj_module.weight)


def kda_weights(attn, cfg: K3Config) -> tuple[KDAWeights, torch.Tensor]:
    """(KDAWeights as views of a KimiK3DeltaAttention's parameters, its packed in_proj_qkvgfab weight). vLLM packs
    the projection rows as [q | k | v | g | f_a | b | pad to 16], the layout the fused in_proj reads."""
    P, H, D = cfg.kda_proj, cfg.kda_heads, cfg.kda_head_dim
    w = attn.in_proj_qkvgfab.weight
    q, k, v, g, fa, b = torch.split(w[:4 * P + D + H], [P, P, P, P, D, H])
    conv = attn.conv1d.weight                       # [3P, 1, 4] fp32
    qc, kc, vc = torch.split(conv, [P, P, P])
    return KDAWeights(q_proj=q, k_proj=k, v_proj=v, g_proj=g, f_a_proj=fa, f_b_proj=attn.f_b_proj.weight,
                      b_proj=b, q_conv=qc, k_conv=kc, v_conv=vc, A_log=attn.A_log, dt_bias=attn.dt_bias,
                      o_norm=attn.o_norm.weight, o_proj=attn.o_proj.weight), w


def mla_weights(attn, cfg: K3Config) -> tuple[MLAWeights, torch.Tensor]:
    """(MLAWeights as views of a KimiK3MLA's parameters, its packed fused_qkv_a_g_proj weight). vLLM packs K3's
    q-LoRA front as [q_a (q_lora_rank) | kv_a (kv_lora_rank + rope) | g (heads x v_head_dim)], the fused in_proj's
    layout; kv_b_proj stays whole (k3ref splits it into W_UK / W_UV)."""
    fused = getattr(attn, "fused_qkv_a_g_proj", None)
    if fused is None:
        raise ValueError("MLA layer without fused_qkv_a_g_proj (q-LoRA with an output gate): the fused MLA half "
                         "covers Kimi K3's layout only")
    w = fused.weight
    qa, kva, g = torch.split(w, [cfg.q_lora_rank, cfg.kv_cache_dim, cfg.mla_heads * cfg.v_head_dim])
    return MLAWeights(q_a_proj=qa, q_a_layernorm=attn.q_a_layernorm.weight, q_b_proj=attn.q_b_proj.weight,
                      kv_a_proj_with_mqa=kva, kv_a_layernorm=attn.kv_a_layernorm.weight,
                      kv_b_proj=attn.kv_b_proj.weight, g_proj=g, o_proj=attn.o_proj.weight), w


def moe_weights(moe) -> MoEWeights:
    """MoEWeights as views of a KimiMoE's dense parameters. The routed experts are not here: the plug-in takes
    them in their checkpoint layout while vLLM loads them (k3fast.vllm.runtime), so these fields stay None."""
    gate_up = moe.shared_experts.gate_up_proj.weight
    Is = gate_up.shape[0] // 2
    return MoEWeights(gate=moe.gate.weight, e_score_correction_bias=moe.gate.e_score_correction_bias,
                      down=moe.routed_expert_down_proj.weight, norm=moe.routed_expert_norm.weight,
                      up=moe.routed_expert_up_proj.weight, w1_packed=None, w1_scale=None, w3_packed=None,
                      w3_scale=None, w2_packed=None, w2_scale=None, shared_gate=gate_up[:Is], shared_up=gate_up[Is:],
                      shared_down=moe.shared_experts.down_proj.weight)


def layer_weights(layer, cfg: K3Config) -> tuple[LayerWeights, torch.Tensor | None]:
    """(LayerWeights of a KimiDecoderLayer's attention (KDA or MLA), AttnRes sites and norms, its packed in_proj)."""
    if cfg.is_kda_layer(layer.layer_idx):
        attn, in_proj = kda_weights(layer.self_attn, cfg)
    else:
        attn, in_proj = mla_weights(layer.self_attn, cfg)
    return LayerWeights(layer=layer.layer_idx, input_layernorm=layer.input_layernorm.weight,
                        post_attention_layernorm=layer.post_attention_layernorm.weight,
                        attn_res=_site(layer.self_attention_res_norm, layer.self_attention_res_proj),
                        mlp_res=_site(layer.mlp_res_norm, layer.mlp_res_proj), attn=attn, mlp=None), in_proj


def routed_experts(moe):
    """The module that owns a KimiMoE's expert parameters and their quant_method: vLLM 0.33's ``moe.experts`` is a
    MoE runner holding it as ``routed_experts``."""
    e = moe.experts
    return getattr(e, "routed_experts", e)


def split_w13(w13_packed: torch.Tensor, w13_scale: torch.Tensor):
    """vLLM's stacked [E, 2I, .] expert tensors -> (w1, w3) halves (gate first, as its loader stacks them)."""
    I = w13_packed.shape[1] // 2
    return (w13_packed[:, :I], w13_scale[:, :I]), (w13_packed[:, I:], w13_scale[:, I:])
