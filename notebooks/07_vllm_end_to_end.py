# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 — The fused layer inside vLLM, end to end
#
# Notebooks 02–06 built and measured one decoder layer in our own harness. Here the same kernels run inside a
# vLLM 0.33 engine through the out-of-tree plug-in `k3fast.vllm` (the design: [docs/vllm-plugin.md](../docs/vllm-plugin.md)):
#
# 1. how the plug-in hooks in, and the switch and the guard it adds (runs here, no vLLM needed);
# 2. the run: a 36-layer Kimi K3 at TP16-rank shapes, stock vLLM and plug-in on the same GPU, the same weights;
# 3. decode tokens per second, batch 1 / 8 / 64;
# 4. per layer: kernels and kernel time of vLLM's own layer beside the fused one, and beside our own trace;
# 5. parity: what the two engines and k3ref agree on, and why greedy tokens part early on this model.

# %%
import json

import matplotlib.pyplot as plt

from k3fast.measure.nbtools import INDEX
from k3fast.vllm import config as plugin_config
from k3fast.vllm import guards

E2E = INDEX["vllm_e2e"]                  # python -m k3fast.measure.vllm_e2e, stock then k3fast
OUR_TRACE = INDEX["fast_layer_h100"]     # the fused layer in our harness, same card
CHAOS = INDEX["k3ref_precision"]         # k3ref against itself in two precisions (section 5)

recs = json.load(open(E2E))["records"]
speed = {(r["engine"], r["batch"]): r for r in recs if r["kind"] == "vllm_e2e"}
parity = {r["engine"]: r for r in recs if r["kind"] == "vllm_parity"}
r0 = speed[("k3fast", 1)]
print({k: r0[k] for k in ("gpu", "driver", "torch", "vllm", "cutlass", "commit", "cudagraph_mode", "model")})

# %% [markdown]
# ## 1. How it hooks in
#
# | when | vLLM's hook | the plug-in |
# |---|---|---|
# | every process starts | the `vllm.general_plugins` entry point | `register()`: the architecture `KimiLinearForCausalLM` now names our subclass (lazily, by string) |
# | model construction | `KimiLinearForCausalLM.__init__` | reads `additional_config["k3fast"]`; absent: nothing else happens. Present: the guard, and a hook on each MoE layer's `process_weights_after_loading` |
# | weight loading | the loader's post-processing | the MXFP4 experts are re-laid into the fused kernel's tiles; vLLM's Marlin repack never runs |
# | Model Runner V2's model state | `get_model_state_cls()` | the fused halves are built over vLLM's own parameters, every kernel is compiled, before memory profiling and CUDA-graph capture |
# | each forward | `forward()` | one decision per step: a pure-decode step of a prepared width runs the fused KDA chain (baked into the FULL decode graph at capture) |
# | each layer | the layer loop | KDA layers: fused chain on vLLM's conv / recurrent state pools; MoE: fused in every step; MLA attention: vLLM's, or FusedMLA with the plan's `mla_attention="fused"` (below) |
#
# The switch is one key of `additional_config`; bad options are refused at engine start, with the key named:

# %%
print(plugin_config.parse({"k3fast": {"batches": [1, 8, 64]}}))
print(plugin_config.parse({}))                           # no key: stock vLLM
try:
    plugin_config.parse({"k3fast": {"max_batch": 128}})
except ValueError as e:
    print("refused:", e)

# %% [markdown]
# The guard reads the engine's settings into a dict of facts and lists **every** unsupported one in one error.
# Here, an engine with tensor parallelism, speculative decoding and vLLM's default conv-state layout:

# %%
facts = {"capability": (9, 0), "dtype": "bfloat16", "experts_quant": "mxfp4", "tensor_parallel_size": 8,
         "pipeline_parallel_size": 1, "expert_parallel": False, "data_parallel_size": 1, "ubatching": False,
         "lora": False, "sleep_mode": False, "v2_model_runner": True, "stock_torch_compile": False,
         "decode_graph_mode": "FULL", "speculative_method": "dspark", "kda_state_dtypes": ("bfloat16", "float32"),
         "replay_or_recover_ssm": False, "conv_state_layout": "SD", "moe": guards.K3_MOE, "hidden_size": 7168,
         "latent_moe": True, "full_rank_kda_gate": True, "kda_head_dim": 128, "attn_res_blocks": 3}
problems = guards.problems(facts)
for p in problems:
    print("-", p)
assert len(problems) == 3

# %% [markdown]
# ### MLA layers, fused (written, not yet run in an engine)
#
# With `{"k3fast": {"plan": {"mla_attention": "fused"}}}` the MLA layers' attention half runs `FusedMLA` (notebook
# 09) over vLLM's own latent cache in planned decode steps. One detail decides how it reads that cache: in a hybrid
# KDA / MLA model vLLM gives every layer's pages the same byte size, so an MLA block holds as many 576-wide bf16
# rows as it takes to reach one KDA state page, rounded up to a multiple of 128 rows (`platforms/interface.py`).
# The fused kernel streams 64-row pages, so the plug-in expands the step's block table once, for every MLA layer
# of the step (`k3fast.vllm.runtime.page_table`): row t of a request lies in 64-row page t // 64 of the expanded
# table, exactly where vLLM's block table puts it.

# %%
import torch
from k3ref import k3_rank
from k3fast.vllm.runtime import page_table

c16 = k3_rank(16)
kda_page = c16.kda_heads * c16.kda_head_dim ** 2 * 4 + 3 * c16.kda_proj * 3 * 2     # fp32 state + bf16 conv state
row = c16.kv_cache_dim * 2
B = 128 * -(-kda_page // (128 * row))
print(f"KDA state page {kda_page:,} B, MLA row {row} B -> vLLM's MLA block {B} rows = {B // 64} pages of 64")
bt = torch.tensor([[7, 2], [1, 5]], dtype=torch.int32)                    # two requests, two blocks each
table = page_table(bt, B)
print(table)
rows = torch.arange(4 * 2 * B).view(-1, 1)                                 # a toy cache of 8 blocks: row id
cache = rows.view(-1, B, 1)
t = B + 70                                                                 # request 1, row B + 70
assert cache.view(-1, 64, 1)[table[1, t // 64], t % 64, 0] == cache[bt[1, t // B], t % B, 0]

# %% [markdown]
# ## 2. The run
#
# `python -m k3fast.measure.vllm_e2e` (one engine per process): a Kimi K3 of 36 layers at one TP16 rank's shapes
# (6 KDA heads, 6 MLA heads, 896 MXFP4 experts top-16 of width 256, 2 shared experts, a dense layer 0, MLA every
# fourth layer and last, AttnRes blocks of 12), loaded with the `k3-random` format: the weights of
# `k3ref.model.random_model`, whose scales route tokens the way trained weights spread them. The records carry
# the distinct experts the router picks per layer and step (of 16 × batch picks):

# %%
for b in (1, 8, 64):
    print(f"batch {b:2d}: distinct experts per layer step {speed[('stock', b)]['distinct_experts_per_layer_step']}"
          f" of {min(16 * b, 896)} possible; MoE backend stock = {speed[('stock', b)]['moe_backend']}")
print("plug-in:", {k: r0["plugin"][k] for k in ("decode_batches", "kernels_compiled", "compile_s")},
      f"extra weight memory {r0['plugin']['extra_weight_bytes'] / 2**30:.2f} GiB (the packed router fronts)")

# %% [markdown]
# ## 3. Decode speed
# TPOT comes from two generates that differ only in length (their time difference over the extra decode steps), so
# prefill and request set-up cancel; FULL decode CUDA graphs on, the same machine, one engine after the other.

# %%
print(f"{'batch':>5} {'stock ms':>9} {'plug-in ms':>10} {'stock tok/s':>11} {'plug-in tok/s':>13} {'speed-up':>8}")
ratios = {}
for b in (1, 8, 64):
    s, k = speed[("stock", b)], speed[("k3fast", b)]
    ratios[b] = k["tok_s"] / s["tok_s"]
    print(f"{b:5d} {s['tpot_ms_median']:9.3f} {k['tpot_ms_median']:10.3f} {s['tok_s']:11.1f} {k['tok_s']:13.1f} "
          f"{ratios[b]:7.2f}x")
assert all(r > 1.0 for r in ratios.values())           # faster at every batch on this card

fig, ax = plt.subplots(figsize=(7, 3.2))
xs = range(3)
ax.bar([x - 0.2 for x in xs], [speed[("stock", b)]["tok_s"] for b in (1, 8, 64)], 0.4, label="stock vLLM 0.33")
ax.bar([x + 0.2 for x in xs], [speed[("k3fast", b)]["tok_s"] for b in (1, 8, 64)], 0.4, label="k3fast plug-in")
for x, b in zip(xs, (1, 8, 64)):
    ax.text(x + 0.2, speed[("k3fast", b)]["tok_s"], f"{ratios[b]:.2f}x", ha="center", va="bottom")
ax.set_xticks(list(xs), ["batch 1", "batch 8", "batch 64"])
ax.set_yscale("log")
ax.set_ylabel("decode tok/s (all requests)")
ax.set_title(f"36-layer K3 at TP16-rank shapes, {r0['gpu']}")
ax.legend()
plt.show()

# %% [markdown]
# ## 4. Per layer
# Kernel time per decoder layer, from torch.profiler over eagerly run decode steps (each kernel attributed to the
# layer whose forward launched it), median over layers and steps. `kda_moe` is 26 of the 36 layers, `mla_moe` 9,
# `kda_dense` is layer 0. The fused KDA chain replaces vLLM's attention half; the MoE half is fused in every layer;
# the MLA layers keep vLLM's attention half, which is why they gain less.

# %%
kinds = ("kda_moe", "mla_moe", "kda_dense")
print(f"{'batch':>5} {'layer':>10} {'stock':>16} {'plug-in':>16} {'ratio':>6}")
for b in (1, 8, 64):
    for kind in kinds:
        s, k = speed[("stock", b)]["per_layer"][kind], speed[("k3fast", b)]["per_layer"][kind]
        print(f"{b:5d} {kind:>10} {s['layer_kernels']:4.0f} k {s['layer_us']:7.1f} us {k['layer_kernels']:4.0f} k "
              f"{k['layer_us']:7.1f} us {s['layer_us'] / k['layer_us']:5.2f}x")

ours = {r["batch"]: r for r in json.load(open(OUR_TRACE))["records"]
        if r["part"] == "layer" and r["shape"] == "k3_rank16" and r["impl"] == "fast"}
print("\nthe fused KDA + MoE layer, in the engine against our own harness (same card):")
for b in (1, 8, 64):
    k = speed[("k3fast", b)]["per_layer"]["kda_moe"]
    print(f"  batch {b:2d}: engine {k['layer_us']:6.1f} us ({k['layer_kernels']:.0f} kernels), our trace "
          f"{ours[b]['replay_us_median']:6.1f} us replay ({ours[b]['kernels']:.0f} kernels)")
    assert k["layer_kernels"] == ours[b]["kernels"]
    assert abs(k["layer_us"] / ours[b]["replay_us_median"] - 1) < 0.10

fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
for ax, b in zip(axes, (1, 8, 64)):
    s = [speed[("stock", b)]["per_layer"][k]["layer_us"] for k in kinds]
    f = [speed[("k3fast", b)]["per_layer"][k]["layer_us"] for k in kinds]
    ax.bar([i - 0.2 for i in range(3)], s, 0.4, label="vLLM's layer")
    ax.bar([i + 0.2 for i in range(3)], f, 0.4, label="plug-in")
    ax.axhline(ours[b]["replay_us_median"], color="k", lw=0.8, ls="--", label="our trace, fused KDA+MoE")
    ax.set_xticks(range(3), kinds)
    ax.set_title(f"batch {b}")
    ax.set_ylabel("kernel time per layer (µs)")
axes[0].legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# Kernel by kernel, one KDA + MoE layer at batch 1: vLLM's own layer on Hopper (AttnRes in Triton, the in_proj and
# f_b GEMMs on cuBLAS with a split-K reduce, the conv update, the packed-decode recurrence and the gated norm in
# Triton, vLLM's CuTe skinny GEMM for o_proj and the latent projections, its CuTe router dot product, then top-k,
# align, sort, two Marlin MXFP4 GEMMs with SiTU between them, the sum, the RMSNorm, the up-projection and the add)
# against the six fused launches.

# %%
def short(n):
    if "k3fastkernels" in n:
        return n.split("kernels")[1].split("_build")[0].split("_kernel")[0]
    if "cute_dsl_" in n:
        return "vllm cute " + n.split("cute_dsl_")[1].split("Cute")[0].split("LL")[0].rstrip("_")
    return n.replace("void ", "").split("<")[0].split("(")[0].split("::")[-1][:40]
for eng in ("stock", "k3fast"):
    names = speed[(eng, 1)]["per_layer"]["kda_moe"]["kernel_names"]
    print(f"{eng} ({len(names)}):", " | ".join(short(n) for n in names), "\n")

# %% [markdown]
# Where the batch-1 step goes, from the graph replay's GPU span and the per-layer figures: the 26 KDA + MoE layers
# carry most of the saving; the 9 MLA layers' attention halves are vLLM's and are the next gap (the fused MLA chain).

# %%
counts = {"kda_moe": 26, "mla_moe": 9, "kda_dense": 1}
for eng in ("stock", "k3fast"):
    r = speed[(eng, 1)]
    parts = {k: counts[k] * r["per_layer"][k]["layer_us"] for k in kinds}
    print(f"{eng:7s} graph step span {r['graph_step_span_us']:7.0f} us; sum of per-layer kernel time "
          f"{sum(parts.values()):7.0f} us = " + " + ".join(f"{k} {v:.0f}" for k, v in parts.items()))

# %% [markdown]
# What the 1.5x at batch 1 would take, from the same figures: the step must lose `need` more µs. The 9 MLA
# layers' attention halves are the largest part still on vLLM's kernels; their time in the engine is the MLA
# layer's minus our fused MoE half (our trace, same card), and their byte floor (k3ref.bytes, a 24-token cache as
# in the engine) says what a fused chain could reach at best.

# %%
from k3ref.bytes import floor_us, layer_bytes
moe_half = {r["batch"]: r for r in json.load(open(OUR_TRACE))["records"]
            if r["part"] == "moe" and r["shape"] == "k3_rank16" and r["impl"] == "fast"}[1]
need = 1000 * (speed[("k3fast", 1)]["tpot_ms_median"] - speed[("stock", 1)]["tpot_ms_median"] / 1.5)
mla_attn = speed[("k3fast", 1)]["per_layer"]["mla_moe"]["layer_us"] - moe_half["replay_us_median"]
attn_stages = ("k3.attn_res", "k3.mla.in_proj", "k3.mla.q_b", "k3.mla.core", "k3.o_proj", "k3.attn_res_mlp")
mla_floor = floor_us(sum(st.total for st in layer_bytes(k3_rank(16), "mla_moe", 1, context=24)
                         if st.stage in attn_stages), moe_half["copy_tbps"])
print(f"1.5x needs {need:.0f} us less per step; the MLA attention half takes ~{mla_attn:.0f} us in the engine, "
      f"floor {mla_floor:.0f} us; all 9 at the floor would give {9 * (mla_attn - mla_floor):.0f} us")
print(f"from the MLA halves alone, each would have to run at {mla_attn - need / 9:.0f} us "
      f"({(mla_attn - need / 9) / mla_floor:.2f}x its floor)")
assert 9 * (mla_attn - mla_floor) > need > 0

# %% [markdown]
# So the fused MLA half alone reaches 1.5x only at ~1.1x of its floor, which no fused attention half here comes
# near at batch 1 (the KDA half runs at ~1.8x of its floor, notebook 02-04): the rest has to come from the 26
# KDA + MoE layers (about 1.35x their floor today), a few µs each.

# %% [markdown]
# ## 5. Parity
# Greedy tokens of the two engines, and of k3ref teacher-forced on each engine's tokens (one layer of weights at a
# time, `k3ref.model.sequence_logits`):

# %%
for eng in ("stock", "k3fast"):
    p = parity[eng]
    print(f"{eng:7s} b1 tokens {p['b1']['tokens'][0][:8]} ... first-token logprob {p['b1']['logprobs'][0][0]:.2f};"
          f" vs k3ref: {p['fidelity']['greedy_agree']}/{p['fidelity']['steps']} greedy tokens agree, "
          f"median |dlogprob| {p['fidelity']['median_abs_dlogprob']}")
same = [i for i, (a, b) in enumerate(zip(parity["stock"]["b8"]["tokens"], parity["k3fast"]["b8"]["tokens"]))
        if a[0] == b[0]]
print("b8 requests whose first token the engines share:", same)

# %% [markdown]
# The engines part at the first token, and neither follows k3ref's greedy path. On this model that is not, by
# itself, a sign of a wrong kernel: the random head spreads probability thinly (the top token holds about
# e^-6 ≈ 0.25 %), so the top logits sit a few hundredths apart, and 36 layers of bf16 arithmetic with 35 top-16
# router selections (a near-tie that flips one expert moves that layer's MoE output by a finite step) are enough to
# reorder them. Where both engines pick the same first token, its log-probability agrees to 0.016.
#
# k3ref against itself shows the scale of that effect: the same weights and tokens in model precision (bf16 I/O,
# fp32 compute) and in fp32 throughout, on the CPU:

# %%
chaos = json.load(open(CHAOS))
for r in chaos["runs"]:
    agree = sum(r["argmax_agree"])
    print(f"depth {r['depth']:2d}: {agree}/{len(r['argmax_agree'])} argmax agree, |dlogprob| at the argmax "
          f"{[round(x, 3) for x in r['dlogprob_at_model_argmax']]}")

# %% [markdown]
# What this run does not yet show, and the issue keeps open: layer-level parity inside the engine (the
# `--probe` of `vllm_e2e` runs the fused KDA layer and vLLM's own on the same inputs and state rows, per step) and
# a model on which greedy decoding is not this sensitive (the 4-layer model, or trained weights).
