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
# # 08 — Can a serving engine trust the fused layer?
#
# A parity test checks one step on well-behaved inputs. A serving engine runs the layer for thousands of steps,
# with requests that join and leave, padding rows, and now and then a request whose activations are garbage. Four
# questions, each answered by a test in `tests/gpu/test_reliability.py` (the GPU tier) and, where it produces
# numbers, by a record under `traces/`:
#
# 1. **Drift.** Over 2,000 decode steps, does the fused layer's state wander away from the reference?
# 2. **Isolation.** Does one hostile request (NaN, Inf, huge values, a router row where all 896 scores tie, a slot at
#    the edge of the pool) change anything, by a single bit, for the other requests of its batch?
# 3. **Refusal.** Are malformed arguments refused before any kernel runs, with the argument named?
# 4. **Graphs.** Do CUDA graphs that share scratch buffers, replayed with new inputs and slots, still give the eager
#    result bit for bit?
#
# Plus the sanitizer tier (`scripts/device_sanitize.sh`), whose state is at the end.

# %%
import json
import os

import matplotlib.pyplot as plt

from k3fast.measure.nbtools import INDEX
from k3fast.measure.reliability import long_decode, summarize

# pytest tests/gpu/test_reliability.py on an H100 with K3_RECORD_DIR set: the latest run (KDA layers on the shipped
# plan, an MLA layer on FusedMLA) and the last run of the MLA layer with vLLM's own attention half
SANITIZER = INDEX["sanitizer"]
runs = {}
for key in ("long_decode", "long_decode_mla_stock"):
    data = json.load(open(INDEX[key]))
    print(key, {k: data["environment"][k] for k in ("gpu", "driver", "torch", "cutlass", "commit")})
    for r in data["records"]:
        runs.setdefault((r["layer_kind"], r["batch"], r["impl"]), r)
print(sorted(runs))

# %% [markdown]
# ## 1. Drift over 2,000 steps: what to compare against
#
# An absolute bound is the wrong yardstick for a long decode. The fused kernels round to BF16 where the model
# rounds, so after any number of steps they differ from fp64 arithmetic by roughly what the model itself differs
# by. The instrument (`k3fast.measure.reliability.long_decode`) therefore runs **three copies** of one layer on the
# same fresh random inputs each step, each with its own state:
#
# | copy | arithmetic | role |
# |---|---|---|
# | `exact` | k3ref in fp64, no rounding | the truth |
# | `model` | k3ref in model precision (BF16 activations, FP32 state) — Hugging Face's arithmetic | the error a deployment already accepts |
# | `impl` | the fused layer (`fast`) | under test |
#
# Requests join at different steps (at batch 8: steps 0, 125, …, 875), so the batch holds requests of every length;
# before its start a request is a padding row (slot −1) and the instrument asserts, every step, that its state slot
# is still all zeros. The same instrument runs on a CPU with k3ref standing in for the fused layer — a few steps
# here, to show what a record holds:

# %%
demo = long_decode("k3_rank16", 1, 2, 6, impl="ref", starts=[0, 3], every=2, every_out=3, device="cpu")
for c in demo["curve"]:
    print(c["step"], c["active"], {k: f"{v:.1e}" for k, v in c.items() if k.startswith("impl")})

# %% [markdown]
# ## 2. The recorded run (H100): error against fp64, step by step
#
# Solid: the fused layer; dashed: k3ref's own model-precision path. Left: the MoE input (the attention half's
# output), middle: the state (KDA recurrent state; for the MLA layer the cache rows written so far), right: the
# layer output, recorded every 200 steps.

# %%
fig, axes = plt.subplots(1, 3, figsize=(15, 4))
colors = dict(zip(sorted(runs), ("C0", "C1", "C2", "C3", "C4", "C5")))
label = lambda key: f"{key[0]} b{key[1]} " + ("FusedMLA" if key[2] == "fast-mla" else "fused")
for ax, q, title in zip(axes, ("x_mlp", "state", "out"), ("MoE input", "state / cache rows", "layer output")):
    for key, r in runs.items():
        pts = [c for c in r["curve"] if f"impl_{q}" in c]
        steps = [c["step"] for c in pts]
        ax.plot(steps, [c[f"impl_{q}"] for c in pts], color=colors[key], label=label(key))
        ax.plot(steps, [c[f"model_{q}"] for c in pts], color=colors[key], ls="--", alpha=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("decode step")
    ax.set_title(f"{title}: rel. RMS error vs fp64")
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# What the figure says:
#
# - **No drift.** The state error settles within the first few dozen steps and stays flat for 2,000: the KDA
#   recurrence forgets (every step multiplies the state by a decay below 1), so rounding errors do not pile up;
#   the MLA cache rows are written once and never revisited.
# - **The fused layer follows the model path.** Worst errors over the run, fused against model:

# %%
rows = []
for key, r in sorted(runs.items()):
    s = summarize(r)
    rows.append((label(key),) + tuple(f"{s[q]['impl_max']:.2e} / {s[q]['model_max']:.2e}"
                                      if q in s else "—" for q in ("x_mlp", "state", "conv", "out")))
print(f"{'layer':16s} {'x_mlp':>22s} {'state':>22s} {'conv':>22s} {'out':>22s}")
for row in rows:
    print(f"{row[0]:16s} " + " ".join(f"{v:>22s}" for v in row[1:]))
for key, r in runs.items():
    for q, s in summarize(r).items():
        assert s["impl_max"] <= 2.0 * s["model_max"], (key, q)       # the GPU test's bound, on the recorded run

# %% [markdown]
# - **The layer output is the exception, for both paths.** Its error jumps to 0.1–0.4 at some steps, equally
#   for the model path: where a token's top-16 router scores hold a near-tie, one BF16 rounding swaps an expert and
#   that token's output moves by O(1). That is a property of K3's discrete routing, not of the kernels, which is why
#   the test bounds the continuous quantities by the tolerance table's `bf16_layer` (3e-2) and the output only
#   against the model path (at most 2x its worst error).
#
# ## 3. Isolation, refusal and graphs
#
# These are pass / fail. The GPU tier's latest run on the H100 (`traces/index.json`, key `gpu_tier_h100`), read
# here test by test:

# %%
import xml.etree.ElementTree as ET
from collections import Counter
from k3fast.measure.nbtools import ROOT
tier = ET.parse(os.path.join(ROOT, INDEX["gpu_tier_h100"])).getroot()
outcome, why = Counter(), {}
for case in tier.iter("testcase"):
    if "test_reliability" not in (case.get("classname") or ""):
        continue
    test = case.get("name").split("[")[0]
    bad = case.find("failure") if case.find("failure") is not None else case.find("error")
    outcome[test, "skipped" if case.find("skipped") is not None else "failed" if bad is not None else "passed"] += 1
    if bad is not None:
        why[case.get("name")] = (bad.get("message") or "").splitlines()[0][:100]
for test in sorted({t for t, _ in outcome}):
    print(f"{test:72s} " + "  ".join(f"{o} {outcome[test, o]}" for o in ("passed", "failed") if outcome[test, o]))
for name, msg in why.items():
    print(f"  failed: {name}: {msg}")

# %% [markdown]
# The two failures are the MLA layer's long decodes with vLLM's own attention half: that run had no vLLM staged,
# and the layer then built stock's MoE half too (vLLM's Marlin experts), which it never uses beside the fused MoE
# half; it builds the attention half alone now. Their last record is the one drawn above (`mla b1 / b8 fused`).
#
# | test | what it checks |
# |---|---|
# | `test_hostile_request_leaves_the_others_bit_identical` | 5 kinds × batch 2 / 8 / 64: one request's NaN, ±Inf, ±bf16max/4 activations, an all-tied router row, or the pool's last slot; every other request's output, MoE input, partial sum and state slot equal a healthy run's **bit for bit**, unowned slots untouched |
# | `test_slot_past_the_pool_inside_a_graph_writes_nothing` | inside a graph there is no host check: a slot index past the pool writes no state and poisons only its own rows with NaN |
# | `test_bad_arguments_are_refused_by_name[kda]` | 18 malformed arguments (bad slots, dtypes, shapes, devices, strides, mismatched pools): each raises before any launch, naming the argument, and leaves every buffer as it was |
# | `test_hostile_request_in_an_mla_batch_leaves_the_others_bit_identical` | the same for a Gated-MLA layer on FusedMLA, 15 cases: NaN, ±Inf or huge activations, NaN in the request's own cached rows, the pool's last cache slot; other requests' outputs, MoE inputs, partial sums and cache rows bit-identical, the padded request writes nothing |
# | `test_bad_arguments_are_refused_by_name[mla]` | 11 malformed FusedMLA arguments (pages, block table, lengths past the table, pages outside the pool, two requests appending to one row, ...) refused by name before any launch |
# | `test_two_layers_sharing_scratch_in_one_graph_and_two_captures` | two layers in one graph share the experts workspace and arrival counters; a second graph on the same scratch; replays with new inputs, slots and padding equal the eager chain bit for bit |
#
# Why isolation holds bit for bit: every kernel of the layer computes each token's rows from that token's inputs
# alone (GEMVs and GEMMs reduce over K, never over tokens), the router's top-k always returns valid expert indices
# (a NaN score is an ordinary key to it), and the experts' combine sums each token's 16 slots in slot order.
#
# ## 4. The sanitizer tier
#
# `scripts/device_sanitize.sh` runs every shipped kernel key once under `compute-sanitizer`'s memcheck, racecheck,
# synccheck and initcheck, one process per tool and part of the launch set. Its runs so far are **incomplete**
# (`traces/index.json`, key `sanitizer`: the latest record, with the earlier runs it carries):

# %%
san = json.load(open(SANITIZER))
print(san["status"])
print(san["what_was_covered"])
print(san["what_stopped_it"])
for run in san["runs"]:
    print(run["commit"], run.get("gpu", ""), run["mode"])
    for tool, t in run["tools"].items():
        print(f"  {tool:10s} cells {t['cells']}  kernel keys {t['kernel_keys']}  errors {t['errors']}"
              + (f" (failed API calls {t['api_errors']})" if t.get("api_errors") else ""))

# %% [markdown]
# Each report, where it falls and what it means. initcheck's all concern buffers a cuBLAS GEMM wrote just before
# the read (one reader is torch's own add kernel), and the paths' parity tests pass. racecheck, given one kernel at
# a time, completed `KdaConvGateStep` at batch 1: its 1,540 warnings all fall on the kernel's two mbarriers, at the
# instructions where thread 0 alone initialises them, so they are the tool's view of that initialisation, not a race.
# On `RingMmaGemv`, `MoeMxfp4Experts` and `MlaLatentDecode` the tool itself failed ("failed to handle a hardware
# exception"); earlier, without the filter, it reported WAR hazards on shared memory rings ordered by mbarriers (in
# cuBLAS's own GEMM too), a chain it does not follow. The tier is not clean until racecheck completes every kernel.

# %%
for f in san.get("findings", []):
    print(f"{f['tool']} ({f['count']:,}) [{f['status']}]\n  where: {f['where']}\n  why: {f['explanation']}\n")
# every initcheck report the latest run printed is in one of the three readers of a cuBLAS GEMM's output
latest = next(r["commit"] for r in san["runs"] if "initcheck" in r["tools"])
init = [r for r in san["runs"] if r["commit"] == latest and "initcheck" in r["tools"]]
readers = ("TopkFromLogits", "MlaLatentDecode", "CUDAFunctor_add")
assert init and all(any(x in k for x in readers) for r in init for k in r["tools"]["initcheck"]["flagged_kernels"])
