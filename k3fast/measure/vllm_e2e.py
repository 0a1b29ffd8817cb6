"""End-to-end decode in a vLLM 0.33 engine: stock vLLM against the k3fast plug-in, same GPU, same weights.

    python -m k3fast.measure.vllm_e2e both --depth 36 --batches 1 8 64 --out traces/<card>/vllm-e2e-<tag>.json
    python -m k3fast.measure.vllm_e2e run --engine k3fast --depth 4 --batches 1 8 --out FILE --parity --fidelity
    python -m k3fast.measure.vllm_e2e compare FILE          # parity of the two engines recorded in FILE

The model is Kimi K3 at TP16-rank shapes on one GPU (hidden 7168, 6 KDA heads with the full-rank gate, 6 MLA heads,
896 MXFP4 experts top-16 with a 256-wide intermediate, two shared experts, a dense layer 0, MLA every fourth layer
and last, AttnRes blocks of 12), ``--depth`` layers deep, vocabulary 10240 (a rank's slice of the 163840-entry head).
Weights come from the plug-in's ``k3-random`` load format: k3ref.model.random_model(cfg, seed), whose scales route
tokens realistically (the records carry the distinct experts per step). One engine per process (``run``); ``both``
runs stock then k3fast in two processes, back to back, into one file.

Per engine and batch the record holds decode TPOT and tok/s with vLLM's FULL decode CUDA graphs (TPOT = the time of
N more decode steps over N, from two generates that differ only in length), the GPU time of one graph replay (the
step's kernels; ``engine_outside_gpu_ms`` = TPOT minus that span), and a per-layer breakdown (kernels and kernel
time per layer kind) from torch.profiler over eagerly run decode steps, each kernel attributed to the decoder layer
whose forward launched it. Both engines run with VLLM_SSM_CONV_STATE_LAYOUT=DS (the layout the fused KDA step reads).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

RANK_VOCAB = 10240
PARITY_TOKENS = 32
PROMPT_LEN = 16


# ---------------------------------------------------------------------------------------------------- the model

# tensor-parallel ranks of each engine shape (the trace's shapes: one rank's slice of the model, or all of it)
ENGINE_TP = {"k3_rank16": 16, "k3_rank8": 8, "full": 1}


def engine_config(depth: int, shape: str = "k3_rank16", vocab: int = RANK_VOCAB) -> dict:
    """config.json of a ``depth``-layer Kimi K3 at one tensor-parallel rank's shapes (``shape``: k3_rank16, k3_rank8
    or full), the released layer pattern, MXFP4 experts (compressed-tensors, as the released checkpoint quantises
    them). The engine runs it on one GPU (TP1), so its head and expert widths are the rank's."""
    if depth < 4:
        raise ValueError(f"depth must be >= 4 (a dense layer, KDA layers and an MLA layer), got {depth}")
    if shape not in ENGINE_TP:
        raise ValueError(f"shape must be one of {sorted(ENGINE_TP)}, got {shape!r}")
    tp = ENGINE_TP[shape]
    mla = sorted({l for l in range(depth) if l % 4 == 3} | {depth - 1})
    kda = [l for l in range(depth) if l not in mla]
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "torch_dtype": "bfloat16",
        "vocab_size": vocab, "hidden_size": 7168, "intermediate_size": 33792 // tp, "num_hidden_layers": depth,
        "num_attention_heads": 96 // tp, "num_key_value_heads": 96 // tp, "head_dim": 128, "hidden_act": "situ",
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "mla_use_output_gate": True,
        # moe_intermediate_size: a rank's 3072 / tp expert rows; a TP16 rank's 192 padded to vLLM's minimum of 256
        "num_experts": 896, "num_experts_per_token": 16, "moe_intermediate_size": max(3072 // tp, 256),
        "num_shared_experts": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
        "attn_res_block_size": 12, "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "linear_attn_config": {"kda_layers": [l + 1 for l in kda], "full_attn_layers": [l + 1 for l in mla],
                               "num_heads": 96 // tp, "head_dim": 128, "short_conv_kernel_size": 4,
                               "use_full_rank_gate": True, "gate_lower_bound": -5.0},
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["re:.*block_sparse_moe\\.experts\\..*"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                            "dynamic": False, "scale_dtype": "torch.uint8"},
                "input_activations": None, "output_activations": None, "format": "mxfp4-pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None},
    }


def prompts(n: int, vocab: int = RANK_VOCAB) -> list[list[int]]:
    return [[(7919 * i + 104729 * j + 1) % vocab for j in range(PROMPT_LEN)] for i in range(n)]


# ---------------------------------------------------------------------------------------------------- profiling

def install_layer_ranges(model):
    """record_function ranges around every decoder layer's forward ("K3L|layer|kind|rows") and the model's."""
    import torch
    rf = torch.profiler.record_function
    lm = model.get_language_model() if hasattr(model, "get_language_model") else model
    for layer in lm.model.layers:
        kind = "kda" if type(layer.self_attn).__name__ == "KimiK3DeltaAttention" else "mla"
        kind += "_moe" if getattr(layer, "is_moe_layer", False) else "_dense"

        def wrap(orig, i=layer.layer_idx, kind=kind):
            def fwd(positions, *a, **kw):
                with rf(f"K3L|{i}|{kind}|{int(positions.shape[0])}"):
                    return orig(positions, *a, **kw)
            return fwd
        layer.forward = wrap(layer.forward)
    return True


def per_layer(trace_path: str, rows: int) -> dict:
    """Median kernels and kernel time per layer kind over the decode steps of ``rows`` rows in a chrome trace."""
    with open(trace_path) as f:
        ev = json.load(f)["traceEvents"]
    launch = {}
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = (e.get("args") or {}).get("correlation")
            if c is not None:
                launch[c] = (e.get("pid"), e.get("tid"), e["ts"])
    ranges = [e for e in ev if e.get("cat") == "user_annotation" and e.get("ph") == "X"
              and str(e.get("name", "")).startswith("K3L|")]
    by_thread = collections.defaultdict(list)
    for a in ranges:
        a["_k"] = []
        by_thread[(a.get("pid"), a.get("tid"))].append(a)
    for g in ev:
        if g.get("cat") != "kernel" or g.get("ph") != "X":
            continue
        L = launch.get((g.get("args") or {}).get("correlation"))
        if L is None:
            continue
        for a in by_thread.get((L[0], L[1]), []):
            if a["ts"] <= L[2] <= a["ts"] + a["dur"]:
                a["_k"].append(g)
    per_kind = collections.defaultdict(list)
    names = {}
    for a in ranges:
        _, i, kind, n = a["name"].split("|")
        if int(n) != rows or not a["_k"]:
            continue
        per_kind[kind].append((sum(k["dur"] for k in a["_k"]), len(a["_k"])))
        names.setdefault(kind, [k["name"][:90] for k in sorted(a["_k"], key=lambda k: k["ts"])])
    return {kind: {"layer_us": round(statistics.median(v[0] for v in vs), 2),
                   "layer_kernels": statistics.median(v[1] for v in vs), "samples": len(vs),
                   "kernel_names": names[kind]} for kind, vs in per_kind.items()}


def graph_steps(trace_path: str) -> list[dict]:
    """Per CUDA-graph replay in a chrome trace: its kernels, their summed time and its GPU span."""
    with open(trace_path) as f:
        ev = json.load(f)["traceEvents"]
    graph_corr = {(e.get("args") or {}).get("correlation") for e in ev
                  if e.get("cat") in ("cuda_runtime", "cuda_driver") and "GraphLaunch" in str(e.get("name", ""))}
    steps = collections.defaultdict(list)
    for g in ev:
        if g.get("cat") == "kernel" and g.get("ph") == "X":
            c = (g.get("args") or {}).get("correlation")
            if c in graph_corr:
                steps[c].append(g)
    out = []
    for ks in steps.values():
        out.append({"kernels": len(ks), "kernel_us": sum(k["dur"] for k in ks),
                    "span_us": max(k["ts"] + k["dur"] for k in ks) - min(k["ts"] for k in ks)})
    return out


# ---------------------------------------------------------------------------------------------------- one engine

def _model_info(model):
    import torch
    lm = model.get_language_model() if hasattr(model, "get_language_model") else model
    backends = set()
    for layer in lm.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None:
            continue
        if type(layer.mlp).__name__ == "FusedKimiMoE":
            backends.add("k3fast moe_mxfp4_experts")
            continue
        from k3fast.vllm.weights import routed_experts
        qm = routed_experts(moe).quant_method
        kernel = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
        backends.add(f"{type(qm).__name__}/{type(kernel).__name__}")
    dec = getattr(lm, "k3fast", None)
    return {"moe_backend": ",".join(sorted(backends)), "plugin": None if dec is None else dec.report,
            "weights_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
            "layers": len(lm.model.layers)}


_ROUTING: list[tuple[int, int]] = []      # (rows, distinct experts) per MoE call, filled in the engine's process


def _take_routing(model):
    out = list(_ROUTING)
    del _ROUTING[:]
    return out


def _distinct_experts(model):
    """Forward pre-hooks on each MoE that count the distinct experts the router picks per step (k3ref's routing on
    the MoE input; for the records only, never inside a timed or profiled window)."""
    import torch
    from k3ref.moe import route
    from k3ref.precision import Precision
    from k3fast.vllm.weights import k3_config, moe_weights
    lm = model.get_language_model() if hasattr(model, "get_language_model") else model
    cfg = k3_config(lm.config)
    hooks = []
    for layer in lm.model.layers:
        if not getattr(layer, "is_moe_layer", False):
            continue
        w = moe_weights(layer.block_sparse_moe)

        def pre(mod, args, w=w):
            ids, _ = route(args[0], w, cfg, Precision.model())
            _ROUTING.append((int(args[0].shape[0]), int(torch.unique(ids).numel())))
        hooks.append(layer.mlp.register_forward_pre_hook(pre))
    return len(hooks)


def run_engine(a, flush=lambda recs: None) -> list[dict]:
    """One engine's records; ``flush(records)`` after each phase, so a run cut short keeps what it measured."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import k3fast.vllm
    from .trace import environment
    k3fast.vllm.register()
    env = environment()
    d = tempfile.mkdtemp(prefix="k3-e2e-")
    cfg_json = engine_config(a.depth, a.shape)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg_json, f)
    batches = sorted(set(a.batches))
    plugin = {"batches": batches, **({"plan": json.loads(a.plan)} if a.plan else {})}
    extra = {"additional_config": {"k3fast": plugin}} if a.engine == "k3fast" else {}
    t0 = time.time()
    llm = LLM(model=d, skip_tokenizer_init=True, load_format="k3-random", model_loader_extra_config={"seed": a.seed},
              dtype="bfloat16", max_model_len=1024, max_num_seqs=max(batches), max_num_batched_tokens=2048,
              gpu_memory_utilization=a.util, seed=0, enable_prefix_caching=False,
              compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                  "cudagraph_capture_sizes": batches}, **extra)
    init_s = round(time.time() - t0, 1)
    print(f"[{a.engine}] engine up in {init_s} s", flush=True)
    info = llm.apply_model(_model_info)[0]
    vcfg = getattr(llm.llm_engine, "vllm_config", None)
    graph_mode = str(vcfg.compilation_config.cudagraph_mode) if vcfg is not None else "FULL_DECODE_ONLY (requested)"
    gen = lambda ps, n, **kw: llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps],
                                           SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                          detokenize=False, **kw), use_tqdm=False)
    base = {**{k: env[k] for k in ("gpu", "driver", "torch", "cutlass", "commit", "date")},
            "vllm": __import__("vllm").__version__, "kind": "vllm_e2e", "engine": a.engine,
            "model": {"depth": a.depth, "shape": a.shape, "experts": 896, "top_k": 16, "vocab": RANK_VOCAB,
                      "weights": f"k3-random seed {a.seed}"},
            "plugin_options": plugin if a.engine == "k3fast" else None,
            "moe_backend": info["moe_backend"],
            # vLLM prefers humming-kernels' MXFP4 MoE to Marlin on SM90 when the package is importable
            "humming_installed": importlib.util.find_spec("humming") is not None,
            "cudagraph_mode": graph_mode, "engine_init_s": init_s,
            "weights_gib": info["weights_gib"], "plugin": info["plugin"], "conv_state_layout": "DS"}
    recs = []

    # parity first, in a fresh engine, so both engines decode the parity prompts from the same start
    if a.parity:
        par = {"kind": "vllm_parity", "engine": a.engine, **{k: base[k] for k in ("gpu", "commit", "model")}}
        for b in (1, 8):
            if b > max(batches):
                continue
            outs = gen(prompts(b), PARITY_TOKENS, logprobs=1)
            par[f"b{b}"] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                            "logprobs": [[float(lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids,
                                                                                 o.outputs[0].logprobs)]
                                         for o in outs]}
        recs.append(par)
        flush(recs)
        print(f"[{a.engine}] parity b1 tokens {par.get('b1', {}).get('tokens')}", flush=True)

    # decode speed under FULL decode graphs
    for b in batches:
        ps = prompts(b)
        gen(ps, 8)
        short, long_ = [], []
        for _ in range(a.repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            gen(ps, 8)
            short.append(time.perf_counter() - t)
            t = time.perf_counter()
            gen(ps, 8 + a.steps)
            long_.append(time.perf_counter() - t)
        tpot = (statistics.median(long_) - statistics.median(short)) / a.steps
        recs.append({**base, "batch": b, "tpot_ms_median": round(tpot * 1e3, 3), "tok_s": round(b / tpot, 1),
                     "tok_s_per_user": round(1 / tpot, 1), "decode_steps_timed": a.steps, "repeats": a.repeats})
        print(f"[{a.engine}] b{b}: TPOT {tpot * 1e3:.3f} ms, {b / tpot:.1f} tok/s", flush=True)
        flush(recs)

    # one profiled pass with graphs (GPU time of a replay), one eager (per-layer attribution)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for b in batches:
        with torch.profiler.profile(activities=acts) as prof:
            gen(prompts(b), 8)
        tp = os.path.join(tempfile.gettempdir(), f"k3e2e-{a.engine}-graph-b{b}.json")
        prof.export_chrome_trace(tp)
        steps = graph_steps(tp)
        rec = next(r for r in recs if r.get("batch") == b and r["kind"] == "vllm_e2e")
        if steps:
            rec["graph_step_kernels"] = statistics.median(s["kernels"] for s in steps)
            rec["graph_step_kernel_us"] = round(statistics.median(s["kernel_us"] for s in steps), 1)
            rec["graph_step_span_us"] = round(statistics.median(s["span_us"] for s in steps), 1)
            rec["engine_outside_gpu_ms"] = round(rec["tpot_ms_median"] - rec["graph_step_span_us"] / 1e3, 3)
    flush(recs)
    import vllm.v1.worker.gpu.model_runner as runner
    dispatch = runner.dispatch_cg_and_sync_dp
    runner.dispatch_cg_and_sync_dp = lambda *x, **kw: dispatch(*x, **{**kw, "need_eager": True})
    llm.apply_model(install_layer_ranges)
    llm.apply_model(_distinct_experts)
    for b in batches:
        llm.apply_model(_take_routing)
        gen(prompts(b), 6)
        dec = [e for n, e in llm.apply_model(_take_routing)[0] if n == b]
        rec = next(r for r in recs if r.get("batch") == b and r["kind"] == "vllm_e2e")
        rec["distinct_experts_per_layer_step"] = round(statistics.median(dec), 1) if dec else None
    llm.apply_model(_remove_pre_hooks)
    if a.probe and a.engine == "k3fast":
        llm.apply_model(_install_probe)
        rows = []
        for b in batches:
            gen(prompts(b), 3)
            llm.apply_model(_probe_on)                  # module-level functions: nothing captured by value
            gen(prompts(b), 4)
            llm.apply_model(_probe_off)
            rows += llm.apply_model(_take_probe)[0]
        keys = ("partial", "rec_state", "conv_state", "cache_rows", "blocks", "layer_out")
        summary = {f"b{b}": {k: {"median": statistics.median(r[k] for r in rows if r["rows"] == b and k in r),
                                 "max": max(r[k] for r in rows if r["rows"] == b and k in r)}
                             for k in keys if any(r["rows"] == b and k in r for r in rows)}
                   for b in batches if any(r["rows"] == b for r in rows)}
        recs.append({"kind": "vllm_layer_parity", "engine": a.engine, "gpu": base["gpu"], "commit": base["commit"],
                     "model": base["model"], "what": "fused attention layers (KDA, and MLA when fused) vs vLLM's own "
                     "layer, same inputs and state, "
                     "inside the engine (eager decode steps); relative L2 differences", "summary": summary,
                     "all_finite": all(r["finite"] for r in rows), "samples": len(rows), "rows": rows})
        print(f"[{a.engine}] layer parity {json.dumps(summary)}", flush=True)
        flush(recs)
    for b in batches:
        gen(prompts(b), 4)                              # eager warm-up of this width
        with torch.profiler.profile(activities=acts) as prof:
            gen(prompts(b), 10)
        tp = os.path.join(tempfile.gettempdir(), f"k3e2e-{a.engine}-eager-b{b}.json")
        prof.export_chrome_trace(tp)
        rec = next(r for r in recs if r.get("batch") == b and r["kind"] == "vllm_e2e")
        rec["per_layer"] = per_layer(tp, b)
        # the cache each request holds while profiled: the prompt, then the 10 decode steps above (an MLA layer's time
        # depends on it; report.engine_layer_figure compares MLA cells only inside this range)
        rec["per_layer_context"] = [PROMPT_LEN, PROMPT_LEN + 10]
        for kind, v in rec["per_layer"].items():
            rec[f"layer_us_{kind}"] = v["layer_us"]
            rec[f"layer_kernels_{kind}"] = v["layer_kernels"]
        print(f"[{a.engine}] b{b} per layer: " + ", ".join(f"{k} {v['layer_kernels']} kernels {v['layer_us']} us"
                                                         for k, v in rec["per_layer"].items()), flush=True)
        flush(recs)
    runner.dispatch_cg_and_sync_dp = dispatch

    if a.fidelity and a.parity:
        try:
            recs[0]["fidelity"] = fidelity(a, recs[0])
        except Exception as e:                  # e.g. no GPU memory left beside the engine: say so in the record
            recs[0]["fidelity"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(f"[{a.engine}] fidelity {recs[0]['fidelity']}", flush=True)
    return recs


_PROBE: dict = {"on": False, "rows": []}


def _install_probe(model):
    """Wrap each fused attention layer so that, while _PROBE["on"], a planned decode step runs vLLM's own layer first
    on copies of the layer's inputs and state rows, restores the state, runs the fused layer, and records the
    relative differences: the partial sum after the attention half (AttnRes + attention + o_proj, no MoE in it), the
    state the step writes (KDA: the recurrent and conv state rows of the step's requests; MLA: the latent cache rows
    of the step's new tokens), the block rows, and the layer output (both sides run the same fused MoE half on their
    own MoE input)."""
    import torch
    lm = model.get_language_model() if hasattr(model, "get_language_model") else model
    dec = lm.k3fast
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
    n = 0
    for layer in lm.model.layers:
        is_kda = layer.layer_idx in dec.kda_layers
        if not is_kda and getattr(layer.forward, "mla", None) is None:
            continue

        def state_rows(layer, step, is_kda):
            """(read, write) of the rows of this layer's state the step touches."""
            if is_kda:
                conv, rec = layer.self_attn.kv_cache[:2]
                valid = step.slots.long()[step.slots > 0]
                return (lambda: (conv[valid].clone(), rec[valid].clone()),
                        lambda v: (conv.__setitem__(valid, v[0]), rec.__setitem__(valid, v[1])))
            from vllm.forward_context import get_forward_context
            attn = layer.self_attn
            sm = get_forward_context().slot_mapping[attn.layer_name][:step.rows]
            live = sm[sm >= 0].long()
            flat = attn.kv_cache.view(-1, attn.kv_cache.shape[-1])
            return (lambda: (flat[live].clone(),), lambda v: flat.__setitem__(live, v[0]))

        # vLLM calls each decoder layer with keyword arguments: the names must be forward's own
        def probe(positions, hidden_states, residual, prefix_sum=None, fused=layer.forward, layer=layer,
                  is_kda=is_kda, **kw):
            h = hidden_states
            step = dec.step
            if step is None or not _PROBE["on"]:
                return fused(positions, h, residual, prefix_sum, **kw)
            read, write = state_rows(layer, step, is_kda)
            before = read()
            dec.step = None
            out_s, p_s, res_s = fused(positions, None if h is None else h.clone(), residual.clone(),
                                      prefix_sum.clone(), **kw)
            dec.step = step
            stock_state = read()
            write(before)
            out_f, p_f, res_f = fused(positions, h, residual, prefix_sum, **kw)
            fused_state = read()
            nb = res_s.shape[1]
            row = {"layer": layer.layer_idx, "kind": "kda" if is_kda else "mla", "rows": int(positions.shape[0]),
                   "partial": rel(p_f, p_s), "blocks": rel(res_f[:, :nb], res_s), "layer_out": rel(out_f, out_s),
                   "finite": bool(torch.isfinite(out_f).all() and torch.isfinite(p_f).all())}
            if is_kda:
                row["conv_state"] = rel(fused_state[0].float(), stock_state[0].float())
                row["rec_state"] = rel(fused_state[1], stock_state[1])
            else:
                row["cache_rows"] = rel(fused_state[0].float(), stock_state[0].float())
            _PROBE["rows"].append(row)
            return out_f, p_f, res_f
        layer.forward = probe
        n += 1
    return n


def _take_probe(model):
    out = list(_PROBE["rows"])
    del _PROBE["rows"][:]
    return out


def _probe_on(model):
    _PROBE["on"] = True
    return True


def _probe_off(model):
    _PROBE["on"] = False
    return False


def _remove_pre_hooks(model):
    lm = model.get_language_model() if hasattr(model, "get_language_model") else model
    for layer in lm.model.layers:
        layer.mlp._forward_pre_hooks.clear()
    return True


def fidelity(a, par: dict) -> dict:
    """k3ref (model precision, on the GPU) teacher-forced on the b1 prompt and the engine's greedy tokens, one layer
    of weights at a time (k3ref.model.sequence_logits): does it pick the same tokens, and how far are the
    log-probabilities of the engine's tokens from k3ref's?"""
    import torch
    from k3ref.model import random_globals, sequence_logits
    from k3ref.weights import random_layer
    from k3fast.vllm.weights import k3_config

    class Text:                                   # config.json read as attributes, as vLLM's config object reads it
        def __init__(self, c):
            self.__dict__.update(c)
    cfg = k3_config(Text(engine_config(a.depth, a.shape)))
    toks = prompts(1)[0] + par["b1"]["tokens"][0]
    with torch.no_grad():
        logits = sequence_logits(cfg, random_globals(cfg, seed=a.seed, device="cuda"),
                                 lambda l: random_layer(cfg, l, seed=a.seed, device="cuda"), toks[:-1])
    lp = torch.log_softmax(logits[PROMPT_LEN - 1:].double(), -1)
    nxt = torch.tensor(toks[PROMPT_LEN:], device=lp.device)
    agree = (lp.argmax(-1) == nxt).tolist()
    dlp = (lp.gather(1, nxt[:, None])[:, 0].cpu() - torch.tensor(par["b1"]["logprobs"][0], dtype=torch.float64)).abs()
    return {"reference": "k3ref.model.sequence_logits, model precision (bf16 I/O, fp32 compute)",
            "steps": len(agree), "greedy_agree": int(sum(agree)),
            "first_disagreement": next((i for i, x in enumerate(agree) if not x), None),
            "max_abs_dlogprob": round(float(dlp.max()), 4), "median_abs_dlogprob": round(float(dlp.median()), 4)}


# ---------------------------------------------------------------------------------------------------- driver

ENV_KEYS = ("gpu", "driver", "torch", "vllm", "cutlass", "commit", "date")


def write(out: str, recs: list[dict]) -> None:
    """{"environment", "command", "records"}, as every file under traces/ has them."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    env = next(({k: r.get(k) for k in ENV_KEYS} for r in recs if r.get("kind") == "vllm_e2e"), {})
    with open(out + ".tmp", "w") as f:
        json.dump({"environment": env, "command": "python -m k3fast.measure.vllm_e2e " + " ".join(sys.argv[1:]),
                   "records": recs}, f, indent=1, default=str)
    os.replace(out + ".tmp", out)


def merge(out: str, parts: list[str]) -> None:
    """One file of records from several runs (e.g. the two engines of one machine)."""
    recs = []
    for p in parts:
        with open(p) as f:
            recs += json.load(f)["records"]
    write(out, recs)


def compare(path: str) -> dict:
    """Parity of the engines recorded in one file: greedy tokens, the first divergence per request, and the largest
    log-probability difference before it."""
    with open(path) as f:
        recs = json.load(f)["records"]
    par = {r["engine"]: r for r in recs if r["kind"] == "vllm_parity"}
    if not {"stock", "k3fast"} <= set(par):
        raise SystemExit(f"{path}: needs parity records of both engines, has {sorted(par)}")
    s, k = par["stock"], par["k3fast"]
    res = {}
    for b in ("b1", "b8"):
        if b not in s or b not in k:
            continue
        firsts = []
        for ts, tk in zip(s[b]["tokens"], k[b]["tokens"]):
            diff = [i for i, (x, y) in enumerate(zip(ts, tk)) if x != y]
            firsts.append(diff[0] if diff else None)
        same = sum(f is None for f in firsts)
        n = [PARITY_TOKENS if f is None else f for f in firsts]
        lp = [max(abs(x - y) for x, y in zip(ls[:m], lk[:m]))
              for ls, lk, m in zip(s[b]["logprobs"], k[b]["logprobs"], n) if m > 0]
        res[b] = {"requests": len(firsts), "identical": same, "first_divergence": firsts,
                  "max_abs_dlogprob_before_divergence": round(max(lp), 4) if lp else None,
                  "first_token_logprob": {"stock": [x[0] for x in s[b]["logprobs"]],
                                          "k3fast": [x[0] for x in k[b]["logprobs"]]}}
    return res


def sensitivity(depths, tokens: int, seed: int = 0) -> dict:
    """How far k3ref moves from itself between two precisions (model: bf16 I/O, fp32 compute; exact: fp32
    throughout) on the e2e model's weights and prompt: greedy agreement and |dlogprob| at the model-precision argmax
    per position. The scale against which the engines' token parity is read. CPU, one layer at a time."""
    import torch
    from k3ref.model import random_globals, sequence_logits
    from k3ref.precision import Precision
    from k3ref.weights import random_layer
    from k3fast.vllm.weights import k3_config

    class Text:
        def __init__(self, c):
            self.__dict__.update(c)
    runs = []
    for depth in depths:
        cfg = k3_config(Text(engine_config(depth)))
        toks = prompts(1)[0][:tokens]
        lp = {}
        for name, P in (("model", Precision.model()), ("exact32", Precision.exact(torch.float32))):
            with torch.no_grad():
                lg = sequence_logits(cfg, random_globals(cfg, seed=seed), lambda l: random_layer(cfg, l, seed=seed),
                                     toks, P)
            lp[name] = torch.log_softmax(lg.double(), -1)
        a, b = lp["model"], lp["exact32"]
        top = a.argmax(-1)[:, None]
        runs.append({"depth": depth, "tokens": tokens, "argmax_agree": (a.argmax(-1) == b.argmax(-1)).tolist(),
                     "dlogprob_at_model_argmax": (a.gather(1, top) - b.gather(1, top))[:, 0].abs().tolist(),
                     "max_abs_dlogprob_all": float((a - b).abs().max()),
                     "top1_logprob_model": a.max(-1).values.tolist()})
        print(json.dumps(runs[-1]), flush=True)
    return {"what": sensitivity.__doc__.split("\n\n")[0], "seed": seed, "torch": torch.__version__, "runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3fast.measure.vllm_e2e", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "both"):
        p = sub.add_parser(name)
        if name == "run":
            p.add_argument("--engine", choices=("stock", "k3fast"), required=True)
        p.add_argument("--depth", type=int, default=36)
        p.add_argument("--shape", choices=sorted(ENGINE_TP), default="k3_rank16",
                       help="one tensor-parallel rank's widths (the engine runs them on one GPU)")
        p.add_argument("--plan", default=None,
                       help='k3fast engine: DecodePlan overrides as JSON, e.g. \'{"mla_attention": "fused"}\'')
        p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
        p.add_argument("--out", required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--util", type=float, default=0.9, help="gpu_memory_utilization")
        p.add_argument("--steps", type=int, default=64, help="decode steps timed per generate pair")
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--parity", action="store_true", help="record greedy tokens and their log-probabilities")
        p.add_argument("--fidelity", action="store_true", help="also teacher-force k3ref on the b1 tokens")
        p.add_argument("--probe", action="store_true",
                       help="k3fast: fused KDA layers against vLLM's own, inside the engine, per decode step")
    p = sub.add_parser("compare")
    p.add_argument("file")
    p = sub.add_parser("sensitivity", help="k3ref against itself in two precisions (CPU)")
    p.add_argument("--depths", type=int, nargs="+", default=[4, 36])
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "sensitivity":
        from .trace import environment
        res = {**{k: v for k, v in environment().items() if k in ("commit", "date", "python")},
               **sensitivity(a.depths, a.tokens)}
        write_json = json.dumps(res, indent=1)
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(write_json)
        return 0
    if a.cmd == "compare":
        print(json.dumps(compare(a.file), indent=1))
        return 0
    if a.cmd == "run":
        recs = run_engine(a, flush=lambda r: write(a.out, r))
        write(a.out, recs)
        print(f"wrote {len(recs)} records to {a.out}", flush=True)
        os._exit(0)
    rc, parts = 0, []
    for engine in ("stock", "k3fast"):
        parts.append(f"{a.out}.{engine}")
        args = [sys.executable, "-m", "k3fast.measure.vllm_e2e", "run", "--engine", engine, "--depth", str(a.depth),
                "--batches", *map(str, a.batches), "--out", parts[-1], "--seed", str(a.seed), "--util", str(a.util),
                "--steps", str(a.steps), "--repeats", str(a.repeats)] + (["--parity"] if a.parity else []) \
            + (["--fidelity"] if a.fidelity else []) + (["--probe"] if a.probe else [])
        rc |= subprocess.call(args)
    merge(a.out, [p for p in parts if os.path.exists(p)])
    return rc


if __name__ == "__main__":
    sys.exit(main())
