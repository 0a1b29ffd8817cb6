"""What the plug-in supports, checked once at engine start: one error that lists every unsupported setting.

``engine_facts(vllm_config)`` reads the settings off a live vLLM config (on the GPU worker); ``problems(facts)`` is
plain Python over that dict, so the rules and their messages are tested without vLLM or a GPU.
"""
from __future__ import annotations

from typing import Any

# Kimi K3's MoE, as vLLM's config spells it: (hidden_act, situ beta, situ linear beta, experts, top-k, expert groups,
# top-k groups, router activation)
K3_MOE = ("situ", 4.0, 25.0, 896, 16, 1, 1, "sigmoid")


class UnsupportedEngine(ValueError):
    """The engine asked for the plug-in with settings it does not handle; the message lists all of them."""


def problems(f: dict[str, Any]) -> list[str]:
    """Every unsupported setting in the facts ``f`` (engine_facts' keys), as one sentence each."""
    out = []

    def need(ok: bool, msg: str):
        if not ok:
            out.append(msg)

    need(tuple(f["capability"]) == (9, 0), f"GPU compute capability {tuple(f['capability'])}: the fused kernels are "
                                           "built for sm_90a (H100 / H200)")
    need(f["dtype"] == "bfloat16", f"model dtype {f['dtype']}: the fused kernels take bfloat16 activations")
    need(f["experts_quant"] == "mxfp4", f"routed experts quantised as {f['experts_quant']}: the fused experts kernel "
                                        "reads MXFP4 (compressed-tensors mxfp4-pack-quantized) weights")
    need(f["tensor_parallel_size"] == 1, f"tensor_parallel_size={f['tensor_parallel_size']}: the fused layer holds "
                                         "one rank's shard and runs no collectives; run one GPU (TP-rank shapes come "
                                         "from the config's head and expert counts)")
    need(f["pipeline_parallel_size"] == 1, f"pipeline_parallel_size={f['pipeline_parallel_size']}")
    need(not f["expert_parallel"], "enable_expert_parallel")
    need(f["data_parallel_size"] == 1, f"data_parallel_size={f['data_parallel_size']}")
    need(not f["ubatching"], "dual-batch overlap (ubatching)")
    need(not f["lora"], "LoRA")
    need(not f["sleep_mode"], "sleep mode (the fused layer keeps re-laid copies of some weights)")
    need(f["v2_model_runner"], "the V1 model runner: the plug-in prepares its kernels in Model Runner V2's model "
                               "state")
    need(not f["stock_torch_compile"], "compilation mode STOCK_TORCH_COMPILE (a compiled forward would trace the "
                                       "fused layer)")
    need(f["decode_graph_mode"] in ("FULL", "NONE"), f"decode CUDA-graph mode {f['decode_graph_mode']}: the fused "
                                                     "layer runs in FULL decode graphs (cudagraph_mode "
                                                     "FULL_DECODE_ONLY / FULL_AND_PIECEWISE) or eagerly")
    need(f["speculative_method"] is None, f"speculative decoding ({f['speculative_method']}): the fused KDA step "
                                          "runs one token per request")
    need(tuple(f["kda_state_dtypes"]) == ("bfloat16", "float32"),
         f"KDA state dtypes {tuple(f['kda_state_dtypes'])}: the fused step keeps a bfloat16 conv state and a float32 "
         "recurrent state (mamba_cache_dtype / mamba_ssm_cache_dtype auto)")
    need(not f["replay_or_recover_ssm"], "ReplaySSM / RecoverSSM")
    need(f["conv_state_layout"] == "DS", f"conv state layout {f['conv_state_layout']}: the fused step reads the "
                                         "dim-first layout; start the engine with VLLM_SSM_CONV_STATE_LAYOUT=DS")
    need(tuple(f["moe"]) == K3_MOE, f"MoE {tuple(f['moe'])}: only Kimi K3's {K3_MOE} is fused")
    need(f["hidden_size"] == 7168, f"hidden_size={f['hidden_size']}: the fused kernels are built for 7168")
    need(f["latent_moe"], "a MoE without the latent projections and routed_expert_norm (routed_expert_hidden_size, "
                          "latent_moe_use_norm)")
    need(f["full_rank_kda_gate"], "KDA without the full-rank output gate (use_full_rank_gate): that is Kimi-Linear, "
                                  "not Kimi K3")
    need(f["kda_head_dim"] == 128, f"KDA head_dim={f['kda_head_dim']}: the fused step is built for 128")
    need(f["attn_res_blocks"] is not None and 1 <= f["attn_res_blocks"] <= 8,
         f"AttnRes blocks {f['attn_res_blocks']}: the fused AttnRes reads at most 8 blocks of 12 layers")
    need(f.get("in_proj_rows_ok", True), f"KDA in_proj_qkvgfab rows {f.get('in_proj_rows')}: expected the packed "
                                         "[q|k|v|g|f_a|b] width padded to 16 rows")
    if f.get("mla_fused"):
        # asked for by the plan (mla_attention="fused"): what FusedMLA reads of vLLM's MLA layers
        need(f.get("kv_cache_dtype") in ("auto", "bfloat16"),
             f"kv_cache_dtype={f.get('kv_cache_dtype')} with the fused MLA half: it reads a bfloat16 latent cache "
             "(or leave mla_attention at 'stock')")
        need(f.get("mla_front_ok", False), "MLA layers without fused_qkv_a_g_proj (K3's q-LoRA front with the output "
                                           "gate) with the fused MLA half")
        need(f.get("decode_context_parallel_size", 1) == 1,
             f"decode_context_parallel_size={f.get('decode_context_parallel_size')} with the fused MLA half")
    return out


def check(f: dict[str, Any]) -> None:
    """Raise UnsupportedEngine listing every problem, or return."""
    p = problems(f)
    if p:
        raise UnsupportedEngine("k3fast cannot run this engine (additional_config['k3fast'] is set); unsupported: "
                                + "; ".join(f"({i + 1}) {m}" for i, m in enumerate(p))
                                + ". Remove additional_config['k3fast'] to run stock vLLM.")


def engine_facts(vllm_config, model, options=None) -> dict[str, Any]:
    """The settings problems() rules on, read off a vLLM 0.33 config, the constructed KimiLinearForCausalLM and the
    plug-in's options (k3fast.vllm.config.PluginOptions; its plan says whether the MLA half is fused)."""
    import torch
    from vllm.config import CompilationMode
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    text = vllm_config.model_config.hf_text_config
    par, cache, comp = vllm_config.parallel_config, vllm_config.cache_config, vllm_config.compilation_config
    spec = vllm_config.speculative_config
    from .weights import routed_experts
    lin = getattr(text, "linear_attn_config", None) or {}
    quant = set()
    rows = set()
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None and hasattr(moe, "experts"):
            qm = type(getattr(routed_experts(moe), "quant_method", None)).__name__
            quant.add("mxfp4" if qm == "CompressedTensorsW4A4Mxfp4MoEMethod" else qm)
        w = getattr(getattr(layer.self_attn, "in_proj_qkvgfab", None), "weight", None)
        if w is not None:
            rows.add(int(w.shape[0]))
    from ..kernels.kda_conv_gate_step import proj_width
    heads = lin.get("num_heads", 0) // max(par.tensor_parallel_size, 1)
    graphs = comp.cudagraph_mode
    block = getattr(text, "attn_res_block_size", None)
    return {
        "capability": torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0),
        "dtype": str(vllm_config.model_config.dtype).replace("torch.", ""),
        "experts_quant": ",".join(sorted(quant)) or "none",
        "tensor_parallel_size": par.tensor_parallel_size,
        "pipeline_parallel_size": par.pipeline_parallel_size,
        "expert_parallel": bool(par.enable_expert_parallel),
        "data_parallel_size": par.data_parallel_size,
        "ubatching": bool(getattr(par, "use_ubatching", False)),
        "lora": getattr(vllm_config, "lora_config", None) is not None,
        "sleep_mode": bool(getattr(vllm_config.model_config, "enable_sleep_mode", False)),
        "v2_model_runner": bool(getattr(vllm_config, "use_v2_model_runner", False)),
        "stock_torch_compile": comp.mode == CompilationMode.STOCK_TORCH_COMPILE,
        "decode_graph_mode": "NONE" if graphs is None else graphs.decode_mode().name,
        "speculative_method": None if spec is None else spec.method,
        "kda_state_dtypes": tuple(str(t).replace("torch.", "") for t in type(model).get_mamba_state_dtype_from_config(
            vllm_config)),
        "replay_or_recover_ssm": bool(getattr(cache, "use_replayssm", False)
                                      or getattr(cache, "use_kda_recoverssm", False)),
        "conv_state_layout": get_conv_state_layout(),
        "moe": tuple(getattr(text, n, None) for n in ("hidden_act", "activation_situ_beta",
                                                       "activation_situ_linear_beta", "num_experts",
                                                       "num_experts_per_token", "num_expert_group", "topk_group",
                                                       "moe_router_activation_func")),
        "hidden_size": text.hidden_size,
        "latent_moe": getattr(text, "routed_expert_hidden_size", None) is not None
        and bool(getattr(text, "latent_moe_use_norm", False)),
        "full_rank_kda_gate": bool(lin.get("use_full_rank_gate", False)),
        "kda_head_dim": lin.get("head_dim"),
        "attn_res_blocks": None if block is None else -(-text.num_hidden_layers // block),
        "in_proj_rows": sorted(rows),
        "in_proj_rows_ok": rows <= {proj_width(heads)},
        "mla_fused": options is not None and options.fuse == "all"
        and options.decode_plan().mla_attention == "fused",
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", "auto")),
        "mla_front_ok": all(getattr(l.self_attn, "fused_qkv_a_g_proj", None) is not None for l in model.model.layers
                            if type(l.self_attn).__name__ == "KimiK3MLA"),
        "decode_context_parallel_size": getattr(par, "decode_context_parallel_size", 1),
    }
