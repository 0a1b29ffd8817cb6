"""The vLLM plug-in's parts that need neither vLLM nor a GPU: the additional_config switch, the engine guard's rules
and message, the view of vLLM's modules as k3ref weights, the MoE wrapper's chunking and padding, the first layer's
block-row swap, the registration (against a stand-in vLLM), and the end-to-end tool's model config and trace
parsing. The plug-in inside a real engine is the GPU tier's (k3fast.measure.vllm_e2e)."""
import json
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

from k3fast.vllm import config as pc
from k3fast.vllm import guards
from k3fast.vllm.weights import k3_config, kda_weights, layer_weights, moe_weights, split_w13

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------- additional_config

def test_absent_key_leaves_the_engine_stock():
    assert pc.parse(None) is None
    assert pc.parse({}) is None
    assert pc.parse({"decode_backend": "auto"}) is None


@pytest.mark.parametrize("raw", [{}, True, None])
def test_defaults(raw):
    o = pc.parse({"k3fast": raw})
    assert o == pc.PluginOptions() and o.fuse == "all" and o.max_batch == 64 and o.batches is None
    assert o.prepared_batches([1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256]) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert o.prepared_batches(None) == (64,)


def test_options():
    o = pc.parse({"k3fast": {"fuse": "moe", "max_batch": 16, "batches": [8, 1, 8], "plan": {"tail_fused_max_m": 8}}})
    assert o.fuse == "moe" and o.max_batch == 16 and o.prepared_batches([1, 2]) == (1, 8)
    assert o.decode_plan().tail_fused_max_m == 8
    assert pc.parse({"k3fast": {"batches": "capture", "max_batch": 8}}).prepared_batches([1, 4, 16]) == (1, 4, 8)


@pytest.mark.parametrize("raw,needle", [
    ({"fuse": "attention"}, "['fuse']: expected one of"),
    ({"max_batch": 65}, "['max_batch']: expected an int in 1..64"),
    ({"max_batch": True}, "['max_batch']"),
    ({"batches": [0, 8]}, "['batches']"),
    ({"batches": [1, 128]}, "['batches']"),
    ({"batches": []}, "['batches']"),
    ({"batches": 8}, "['batches']: expected \"capture\" or a list"),
    ({"plan": {"nope": 1}}, "unknown DecodePlan fields ['nope']"),
    ({"plan": {"front_fused_max_m": 9}}, "front_fused_max_m must be in 0..4"),
    ({"plan": [1]}, "['plan']: expected a dict"),
    ({"max_bacth": 8}, "unknown options ['max_bacth']"),
])
def test_bad_options_are_named(raw, needle):
    with pytest.raises(ValueError) as e:
        pc.parse({"k3fast": raw})
    assert needle in str(e.value)


def test_not_a_dict():
    with pytest.raises(ValueError, match="expected a dict of options"):
        pc.parse({"k3fast": "on"})


# ------------------------------------------------------------------------------------------------- the guard

def good_facts():
    return {"capability": (9, 0), "dtype": "bfloat16", "experts_quant": "mxfp4", "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1, "expert_parallel": False, "data_parallel_size": 1, "ubatching": False,
            "lora": False, "sleep_mode": False, "v2_model_runner": True, "stock_torch_compile": False,
            "decode_graph_mode": "FULL", "speculative_method": None, "kda_state_dtypes": ("bfloat16", "float32"),
            "replay_or_recover_ssm": False, "conv_state_layout": "DS", "moe": guards.K3_MOE, "hidden_size": 7168,
            "latent_moe": True, "full_rank_kda_gate": True, "kda_head_dim": 128, "attn_res_blocks": 3,
            "in_proj_rows": [3216], "in_proj_rows_ok": True}


def test_a_supported_engine_passes():
    assert guards.problems(good_facts()) == []
    guards.check(good_facts())
    assert guards.problems({**good_facts(), "decode_graph_mode": "NONE"}) == []


BAD = {"capability": (10, 0), "dtype": "float16", "experts_quant": "UnquantizedFusedMoEMethod",
       "tensor_parallel_size": 8, "pipeline_parallel_size": 2, "expert_parallel": True, "data_parallel_size": 2,
       "ubatching": True, "lora": True, "sleep_mode": True, "v2_model_runner": False, "stock_torch_compile": True,
       "decode_graph_mode": "PIECEWISE", "speculative_method": "dspark", "kda_state_dtypes": ("bfloat16", "bfloat16"),
       "replay_or_recover_ssm": True, "conv_state_layout": "SD", "moe": ("silu",) + guards.K3_MOE[1:],
       "hidden_size": 2304, "latent_moe": False, "full_rank_kda_gate": False, "kda_head_dim": 64,
       "attn_res_blocks": 9, "in_proj_rows_ok": False}


@pytest.mark.parametrize("key", sorted(BAD))
def test_each_unsupported_setting_is_named(key):
    p = guards.problems({**good_facts(), key: BAD[key]})
    assert len(p) == 1, p


def test_the_fused_mla_half_adds_its_own_rules():
    """With the plan's mla_attention="fused": a bfloat16 latent cache, K3's fused q-LoRA + gate front, no decode
    context parallelism; without it the same settings pass (vLLM's MLA runs)."""
    mla = {"kv_cache_dtype": "fp8", "mla_front_ok": False, "decode_context_parallel_size": 2}
    assert guards.problems({**good_facts(), **mla}) == []
    p = guards.problems({**good_facts(), **mla, "mla_fused": True})
    assert len(p) == 3 and "kv_cache_dtype=fp8" in p[0] and "fused_qkv_a_g_proj" in p[1] and "=2" in p[2]
    assert guards.problems({**good_facts(), "mla_fused": True, "kv_cache_dtype": "auto", "mla_front_ok": True}) == []


def test_one_error_lists_every_problem():
    with pytest.raises(guards.UnsupportedEngine) as e:
        guards.check({**good_facts(), **BAD})
    msg = str(e.value)
    assert msg.count("; (") == len(BAD) - 1          # every problem, numbered, in one message
    for needle in ("sm_90a", "tensor_parallel_size=8", "VLLM_SSM_CONV_STATE_LAYOUT=DS", "speculative decoding",
                   "Remove additional_config['k3fast']"):
        assert needle in msg


# --------------------------------------------------------------------------------------- vLLM's modules as k3ref

class Mod(types.SimpleNamespace):
    pass


def W(t):
    return Mod(weight=t)


def test_k3_config_from_vllms_config():
    from k3fast.measure.vllm_e2e import engine_config
    cfg = k3_config(Mod(**engine_config(36)))
    assert (cfg.tp, cfg.hidden_size, cfg.num_hidden_layers, cfg.kda_heads, cfg.mla_heads) == (1, 7168, 36, 6, 6)
    assert cfg.mla_layers == (3, 7, 11, 15, 19, 23, 27, 31, 35) and cfg.first_k_dense_replace == 1
    assert (cfg.expert_intermediate, cfg.shared_intermediate, cfg.routed_expert_hidden_size) == (256, 512, 3584)
    assert cfg.is_kda_layer(0) and not cfg.is_moe_layer(0) and cfg.max_blocks == 3


def test_released_pattern_of_the_e2e_model():
    from k3fast.measure.vllm_e2e import engine_config
    c = engine_config(40)
    lin = c["linear_attn_config"]
    assert sorted(lin["kda_layers"] + lin["full_attn_layers"]) == list(range(1, 41))
    assert lin["full_attn_layers"] == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    with pytest.raises(ValueError, match="depth must be >= 4"):
        engine_config(3)


def test_engine_configs_are_the_traces_shapes():
    """The engine's model at each trace shape has the k3ref preset's widths (a TP16 rank's expert rows padded to vLLM's
    minimum of 256), so its per-layer figures stand beside the trace's cells of the same shape."""
    from k3ref import preset
    from k3fast.measure.vllm_e2e import engine_config
    for shape in ("k3_rank16", "k3_rank8", "full"):
        cfg, ref = k3_config(Mod(**engine_config(8, shape))), preset(shape)
        assert (cfg.kda_heads, cfg.mla_heads, cfg.hidden_size) == (ref.kda_heads, ref.mla_heads, ref.hidden_size), shape
        assert cfg.expert_intermediate == max(ref.expert_intermediate, 256), shape
    with pytest.raises(ValueError, match="shape must be one of"):
        engine_config(8, "k3_rank4")


def vllm_like_layer(cfg, l, seed=0):
    """A stand-in KimiDecoderLayer holding k3ref's random weights in vLLM's packed layouts."""
    from k3fast.kernels.kda_conv_gate_step import proj_width
    from k3ref.weights import random_layer
    w = random_layer(cfg, l, seed=seed)
    a, m = w.attn, w.mlp
    if cfg.is_kda_layer(l):
        rows = torch.cat([a.q_proj, a.k_proj, a.v_proj, a.g_proj, a.f_a_proj, a.b_proj])
        in_proj = torch.cat([rows, torch.zeros(proj_width(cfg.kda_heads) - rows.shape[0], rows.shape[1],
                                               dtype=rows.dtype)])
        attn = Mod(in_proj_qkvgfab=W(in_proj), conv1d=W(torch.cat([a.q_conv, a.k_conv, a.v_conv])),
                   f_b_proj=W(a.f_b_proj), A_log=a.A_log, dt_bias=a.dt_bias, o_norm=W(a.o_norm), o_proj=W(a.o_proj))
    else:           # KimiK3MLA: q-LoRA front packed [q_a | kv_a | g] in fused_qkv_a_g_proj
        attn = Mod(fused_qkv_a_g_proj=W(torch.cat([a.q_a_proj, a.kv_a_proj_with_mqa, a.g_proj])),
                   q_a_layernorm=W(a.q_a_layernorm), q_b_proj=W(a.q_b_proj), kv_a_layernorm=W(a.kv_a_layernorm),
                   kv_b_proj=W(a.kv_b_proj), o_proj=W(a.o_proj))
    moe = Mod(gate=Mod(weight=m.gate, e_score_correction_bias=m.e_score_correction_bias),
              routed_expert_down_proj=W(m.down), routed_expert_norm=W(m.norm), routed_expert_up_proj=W(m.up),
              shared_experts=Mod(gate_up_proj=W(torch.cat([m.shared_gate, m.shared_up])), down_proj=W(m.shared_down)))
    layer = Mod(layer_idx=l, self_attn=attn, block_sparse_moe=moe, input_layernorm=W(w.input_layernorm),
                post_attention_layernorm=W(w.post_attention_layernorm),
                self_attention_res_norm=W(w.attn_res.norm), self_attention_res_proj=W(w.attn_res.proj),
                mlp_res_norm=W(w.mlp_res.norm), mlp_res_proj=W(w.mlp_res.proj))
    return w, layer


def test_layer_weights_are_views_of_vllms_parameters():
    from k3ref import tiny
    cfg = tiny()
    w, layer = vllm_like_layer(cfg, 1)
    got, in_proj = layer_weights(layer, cfg)
    assert in_proj is layer.self_attn.in_proj_qkvgfab.weight
    for f in ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj", "f_b_proj", "q_conv", "k_conv", "v_conv",
              "A_log", "dt_bias", "o_norm", "o_proj"):
        assert torch.equal(getattr(got.attn, f), getattr(w.attn, f)), f
    assert got.attn.q_proj.data_ptr() == in_proj.data_ptr()          # a view, no copy
    assert torch.equal(got.attn_res.proj, w.attn_res.proj) and torch.equal(got.mlp_res.norm, w.mlp_res.norm)
    m = moe_weights(layer.block_sparse_moe)
    for f in ("gate", "e_score_correction_bias", "down", "norm", "up", "shared_gate", "shared_up", "shared_down"):
        assert torch.equal(getattr(m, f), getattr(w.mlp, f)), f
    assert m.w1_packed is None                    # the experts arrive re-laid, never through these views


def test_mla_layer_weights_are_views_of_vllms_parameters():
    from k3ref import tiny
    cfg = tiny()
    l = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i) and cfg.is_moe_layer(i))
    w, layer = vllm_like_layer(cfg, l)
    got, in_proj = layer_weights(layer, cfg)
    assert in_proj is layer.self_attn.fused_qkv_a_g_proj.weight
    for f in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj",
              "o_proj"):
        assert torch.equal(getattr(got.attn, f), getattr(w.attn, f)), f
    assert got.attn.g_proj.data_ptr() == in_proj[cfg.q_lora_rank + cfg.kv_cache_dim:].data_ptr()   # a view
    # the fused MLA half reads vLLM's packed front in place (no copy) and refuses a front of the wrong layout
    from k3fast.layer import FusedMLA
    fused = FusedMLA(cfg, got, in_proj=in_proj)
    assert fused.in_proj is in_proj
    with pytest.raises(ValueError, match="in_proj: expected a contiguous"):
        FusedMLA(cfg, got, in_proj=in_proj[:-16])
    layer.self_attn.fused_qkv_a_g_proj = None
    with pytest.raises(ValueError, match="fused_qkv_a_g_proj"):
        layer_weights(layer, cfg)


def test_kda_weights_reject_nothing_silently():
    from k3ref import tiny
    cfg = tiny()
    _, layer = vllm_like_layer(cfg, 1)
    layer.self_attn.in_proj_qkvgfab.weight = layer.self_attn.in_proj_qkvgfab.weight[:10]
    with pytest.raises(RuntimeError):
        kda_weights(layer.self_attn, cfg)


def test_split_w13_gate_first():
    w13 = torch.arange(2 * 6 * 4, dtype=torch.uint8).view(2, 6, 4)
    scale13 = torch.arange(2 * 6 * 1, dtype=torch.uint8).view(2, 6, 1)
    (w1, s1), (w3, s3) = split_w13(w13, scale13)
    assert torch.equal(w1, w13[:, :3]) and torch.equal(w3, w13[:, 3:]) and torch.equal(s3, scale13[:, 3:])


# ------------------------------------------------------------------------------------------- the runtime glue

class RowsTimesTwo:
    """Stands in for FusedMoE: records the row counts it is called with."""
    def __init__(self):
        self.calls = []

    def __call__(self, x, out=None):
        self.calls.append(x.shape[0])
        y = x * 2
        if out is not None:
            out.copy_(y)
            return out
        return y


@pytest.mark.parametrize("n,calls", [(1, [1]), (5, [8]), (8, [8]), (9, [64]), (64, [64]), (130, [64, 64, 8]),
                                     (0, [])])
def test_moe_wrapper_pads_to_prepared_sizes_and_chunks(n, calls):
    from k3fast.vllm.runtime import FusedKimiMoE
    f = RowsTimesTwo()
    mod = FusedKimiMoE(f, (1, 8, 64), layer_idx=1)
    x = torch.randn(n, 16)
    y = mod(x)
    assert f.calls == calls and torch.equal(y, x * 2)


def test_the_first_layer_swaps_the_block_rows_in_a_planned_step():
    from k3fast.vllm.runtime import MAX_BLOCKS, Step, _LayerForward
    seen = []

    def stock(positions, hidden, residual, prefix_sum=None, **kw):
        seen.append(residual)
        return hidden, prefix_sum, residual

    decode = Mod(step=None, cfg=Mod(is_block_boundary=lambda l: l % 12 == 0))
    layers = [Mod(forward=stock, layer_idx=i) for i in range(3)]
    fwd = [_LayerForward(decode, layer, None) for layer in layers]
    res = torch.zeros(2, 3, 8)
    pos = torch.zeros(2, dtype=torch.long)
    # not planned: vLLM's tensors pass through untouched
    out = fwd[0](pos, None, res, torch.zeros(2, 8))
    assert out[2] is res and seen[-1] is res
    decode.step = Step(rows=2, slots=None)
    h, p, r = None, torch.zeros(2, 8), res
    for f in fwd:
        h, p, r = f(pos, h, r, p)
    blocks = decode.step.blocks
    assert blocks.shape == (2, MAX_BLOCKS, 8)
    assert all(s.shape == (2, 3, 8) and s.data_ptr() == blocks.data_ptr() for s in seen[1:])
    assert r.stride() == (MAX_BLOCKS * 8, 8, 1)


def test_an_mla_layer_runs_fusedmla_on_the_steps_paging_or_falls_back():
    """A planned step's MLA layer: FusedMLA on the paging the decode object gives (the block rows, vLLM's partial
    sum, the previous layer's MoE output as delta), then the layer's MLP on its output; a block-closing layer writes
    a new partial-sum tensor. Where the paging is refused (None), vLLM's own layer runs."""
    from k3fast.vllm.runtime import Step, _LayerForward
    calls = []

    class FakeMLA:
        def __call__(self, blocks, partial, delta, pages, table, seqlens, x_mlp, partial_out=None):
            calls.append((blocks, partial, delta, pages, table, seqlens, partial_out))
            x_mlp.copy_(delta + 1)
            if partial_out is not None:
                partial_out.copy_(partial)

    stock_calls = []

    def stock(positions, hidden, residual, prefix_sum=None, **kw):
        stock_calls.append(hidden)
        return hidden, prefix_sum, residual

    paging = ("pages", "table", "seqlens")
    decode = Mod(step=Step(rows=2, slots=None), cfg=Mod(is_block_boundary=lambda l: l == 12),
                 mla_paging=lambda attn: paging if attn == "mla-attn" else None)
    layer = Mod(forward=stock, layer_idx=3, self_attn="mla-attn", mlp=lambda x: 2 * x)
    fwd = _LayerForward(decode, layer, None, FakeMLA())
    res, p, h = torch.zeros(2, 3, 8), torch.zeros(2, 8), torch.ones(2, 8)
    out, p_out, r = fwd(None, h, res, p)
    assert len(calls) == 1 and calls[0][3:6] == paging and calls[0][2] is h and calls[0][1] is p
    assert calls[0][0] is decode.step.blocks and calls[0][6] is p           # not a boundary: p updated in place
    assert torch.equal(out, 2 * (h + 1)) and p_out is p and not stock_calls
    boundary = _LayerForward(decode, Mod(forward=stock, layer_idx=12, self_attn="mla-attn", mlp=lambda x: x),
                             None, FakeMLA())
    _, p_new, _ = boundary(None, h, r, p)
    assert p_new is not p and calls[-1][6] is p_new                         # a boundary starts a new partial sum
    refused = _LayerForward(decode, Mod(forward=stock, layer_idx=7, self_attn="other", mlp=None), None, FakeMLA())
    refused(None, h, r, p)
    assert stock_calls == [h] and len(calls) == 2


# ---------------------------------------------------------------------------------------------- registration

def fake_vllm(monkeypatch):
    calls = {"models": [], "loaders": []}
    vllm = types.ModuleType("vllm")
    vllm.ModelRegistry = types.SimpleNamespace(register_model=lambda a, c: calls["models"].append((a, c)))
    ml = types.ModuleType("vllm.model_executor.model_loader")
    ml.register_model_loader = lambda fmt: (lambda cls: calls["loaders"].append((fmt, cls.__name__)) or cls)
    base = types.ModuleType("vllm.model_executor.model_loader.base_loader")
    base.BaseModelLoader = type("BaseModelLoader", (), {"__init__": lambda self, cfg: None})
    wu = types.ModuleType("vllm.model_executor.model_loader.weight_utils")
    wu.initialize_single_dummy_weight = lambda p, name="": None
    for name, mod in {"vllm": vllm, "vllm.model_executor": types.ModuleType("vllm.model_executor"),
                      "vllm.model_executor.model_loader": ml,
                      "vllm.model_executor.model_loader.base_loader": base,
                      "vllm.model_executor.model_loader.weight_utils": wu}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "k3fast.vllm.loader", raising=False)
    return calls


def test_register_is_idempotent_and_touches_no_model_code(monkeypatch):
    import k3fast.vllm as plugin
    calls = fake_vllm(monkeypatch)
    monkeypatch.setattr(plugin, "_registered", False)
    plugin.register()
    plugin.register()
    assert calls["models"] == [("KimiLinearForCausalLM", "k3fast.vllm.model:K3FastKimiLinearForCausalLM")]
    assert calls["loaders"] == [("k3-random", "K3RandomLoader")]
    assert "k3fast.vllm.model" not in sys.modules and not torch.cuda.is_initialized()


def test_entry_point_and_extra_are_declared():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["vllm.general_plugins"] == {"k3fast": "k3fast.vllm:register"}
    assert any(r.startswith("vllm==0.33") for r in meta["project"]["optional-dependencies"]["vllm"])
    assert "k3fast.vllm" in meta["tool"]["setuptools"]["packages"]


# ------------------------------------------------------------------------------------- the end-to-end tool

def chrome(events):
    return {"traceEvents": events}


def test_per_layer_attribution(tmp_path):
    from k3fast.measure.vllm_e2e import graph_steps, per_layer
    ev = []
    t = 0
    for step in range(3):
        for i, kind in ((1, "kda_moe"), (2, "kda_moe"), (3, "mla_moe")):
            ev.append({"cat": "user_annotation", "ph": "X", "name": f"K3L|{i}|{kind}|8", "ts": t, "dur": 50,
                       "pid": 1, "tid": 1})
            for k in range(2 if kind == "kda_moe" else 3):
                c = 1000 * step + 10 * i + k
                ev.append({"cat": "cuda_runtime", "ph": "X", "name": "cudaLaunchKernel", "ts": t + 1 + k, "dur": 1,
                           "pid": 1, "tid": 1, "args": {"correlation": c}})
                ev.append({"cat": "kernel", "ph": "X", "name": f"k{k}", "ts": t + 100 + k * 10, "dur": 4.0 + k,
                           "pid": 0, "tid": 7, "args": {"correlation": c}})
            t += 60
    ev.append({"cat": "cuda_runtime", "ph": "X", "name": "cudaGraphLaunch", "ts": t, "dur": 1, "pid": 1, "tid": 1,
               "args": {"correlation": 99}})
    for k in range(4):
        ev.append({"cat": "kernel", "ph": "X", "name": "g", "ts": t + 10 * k, "dur": 2.0, "pid": 0, "tid": 7,
                   "args": {"correlation": 99}})
    p = tmp_path / "t.json"
    p.write_text(json.dumps(chrome(ev)))
    got = per_layer(str(p), 8)
    assert got["kda_moe"]["layer_kernels"] == 2 and got["kda_moe"]["layer_us"] == 9.0
    assert got["mla_moe"]["layer_kernels"] == 3 and got["mla_moe"]["layer_us"] == 15.0
    assert got["kda_moe"]["samples"] == 6 and per_layer(str(p), 1) == {}
    assert graph_steps(str(p)) == [{"kernels": 4, "kernel_us": 8.0, "span_us": 32.0}]


def test_compare_finds_the_first_divergence(tmp_path):
    from k3fast.measure.vllm_e2e import compare
    mk = lambda eng, toks: {"kind": "vllm_parity", "engine": eng,
                            "b1": {"tokens": [toks], "logprobs": [[-1.0] * len(toks)]}}
    p = tmp_path / "e.json"
    p.write_text(json.dumps({"records": [mk("stock", [1, 2, 3, 4]), mk("k3fast", [1, 2, 9, 4])]}))
    r = compare(str(p))
    assert r["b1"]["first_divergence"] == [2] and r["b1"]["identical"] == 0
    assert r["b1"]["max_abs_dlogprob_before_divergence"] == 0.0
    p.write_text(json.dumps({"records": [mk("stock", [1, 2]), mk("k3fast", [5, 2])]}))
    assert compare(str(p))["b1"]["first_divergence"] == [0]
    assert compare(str(p))["b1"]["max_abs_dlogprob_before_divergence"] is None
    with pytest.raises(SystemExit):
        p.write_text(json.dumps({"records": [mk("stock", [1])]}))
        compare(str(p))


def test_the_layer_probe_takes_vllms_keyword_call():
    """vLLM 0.33 calls each decoder layer as layer(positions=, hidden_states=, prefix_sum=, residual=): the in-engine
    parity probe's wrapper must accept exactly that call and pass it through when the probe is off."""
    import types
    from k3fast.measure.vllm_e2e import _install_probe
    seen = []
    layer = types.SimpleNamespace(layer_idx=1, forward=lambda *a, **kw: seen.append((a, kw)) or ("out", "p", "res"))
    lm = types.SimpleNamespace(model=types.SimpleNamespace(layers=[layer]),
                               k3fast=types.SimpleNamespace(kda_layers={1}, step=None))
    assert _install_probe(lm) == 1
    assert layer.forward(positions="pos", hidden_states="h", prefix_sum="ps", residual="r") == ("out", "p", "res")
    assert seen == [(("pos", "h", "r", "ps"), {})]
    # an MLA layer is probed where its forward runs the fused MLA half, left alone where it is vLLM's own
    fused_mla = types.SimpleNamespace(layer_idx=3, forward=types.SimpleNamespace(mla=object()))
    stock_mla = types.SimpleNamespace(layer_idx=7, forward=lambda *a, **kw: None)
    lm.model.layers = [fused_mla, stock_mla]
    assert _install_probe(lm) == 1 and callable(fused_mla.forward) and not hasattr(fused_mla.forward, "mla")


def test_page_table_reads_vllms_blocks_as_64_row_pages():
    """A hybrid model's MLA blocks hold a multiple of 128 rows; the fused MLA half reads 64-row pages: row t of a
    request lies in page table[t // 64], row t % 64, exactly where vLLM's block table puts it."""
    from k3fast.vllm.runtime import page_table
    B = 384
    bt = torch.tensor([[7, 2, 0], [1, 5, 3]], dtype=torch.int32)
    cache = torch.arange(10 * B, dtype=torch.float32).view(10, B, 1)        # row id = block * B + row
    table = page_table(bt, B)
    assert table.shape == (2, 3 * B // 64) and table.dtype == torch.int32
    pages = cache.view(-1, 64, 1)
    for req in range(2):
        for t in (0, 63, 64, 383, 384, 700, 3 * B - 1):
            assert pages[table[req, t // 64], t % 64, 0] == cache[bt[req, t // B], t % B, 0]
    with pytest.raises(ValueError, match="multiple of 64"):
        page_table(bt, 96)


def test_mla_step_paging_from_vllms_metadata():
    """The fused MLA half's view of a decode step: vLLM's 384-row blocks as 64-row pages, a padded row of the graph
    batch (slot mapping -1) at length 0 whatever its stale length, and every reason to fall back named."""
    from k3fast.vllm.runtime import mla_step_paging
    B, n = 384, 3
    cache = torch.zeros(6, B, 576, dtype=torch.bfloat16)
    dec = Mod(block_table=torch.tensor([[4, 1], [2, 0], [5, 3], [9, 9]], dtype=torch.int32),
              seq_lens=torch.tensor([500, 17, 999, 3], dtype=torch.int32))
    m = Mod(num_prefills=0, num_decode_tokens=2, decode=dec)
    slot = torch.tensor([1 * B + 115, 2 * B + 16, -1, -1])               # row 499 of request 0: block 1
    pages, table, seqlens = mla_step_paging(m, slot, cache, n, 576)
    assert pages.shape == (6 * B // 64, 64, 576) and pages.data_ptr() == cache.data_ptr()
    assert table.shape == (n, 2 * B // 64) and seqlens.tolist() == [500, 17, 0]
    # the new token's row (seqlen - 1) lies where vLLM's slot mapping writes it
    for i in range(2):
        t = int(seqlens[i]) - 1
        assert int(table[i, t // 64]) * 64 + t % 64 == int(slot[i])
    assert "pure decode" in mla_step_paging(Mod(num_prefills=1, num_decode_tokens=2, decode=dec), slot, cache, n, 576)
    assert "no MLA metadata" in mla_step_paging(None, slot, cache, n, 576)
    assert "fewer than" in mla_step_paging(m, slot[:2], cache, n, 576)
    assert "bf16" in mla_step_paging(m, slot, cache.float(), n, 576)
    assert "bf16" in mla_step_paging(m, slot, torch.zeros(6, 96, 576, dtype=torch.bfloat16), n, 576)
