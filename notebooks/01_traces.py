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
# # 01 — Reading a decode trace
#
# A trace record answers four questions about one decode step of one layer:
# * how many kernels ran;
# * how long the GPU spent in each NVTX stage (`k3.kda.in_proj`, `k3.moe.experts`, ...);
# * how long a CUDA-graph replay took end to end (the median of many, with the L2 flushed before each);
# * how that compares with the **floor**: the bytes the step must move over the copy bandwidth measured in the
#   same run.
#
# `python -m k3fast.measure.trace` writes the records on a GPU, under `traces/<card>/`. This notebook reads them on
# any machine. It uses the latest full sweep per card, named in one place: `nbtools.SWEEPS`.

# %%
import glob
import os

import torch

from k3fast.measure import nbtools

print(nbtools.SWEEPS)
recs = nbtools.sweep()
print(len(recs), "records")

# %% [markdown]
# ## 1. One record
# Every record carries its provenance: the GPU, the driver, the library versions and the commit it measured.
# `part` says what was timed: the whole `layer`, the attention half `attn` (layer input to MLP input) or the
# MoE half `moe`. `impl` is `stock` or `fast` (this repository's fused kernels). In the sweeps below `stock` is
# `stock_variant` "vllm-ops": our composition of library kernels (cuBLAS, fla's Triton KDA kernels, vLLM's fused
# ops and Marlin MXFP4 MoE). Section 2b puts `fast` beside "vllm-layer", vLLM's own layer kernel for kernel, now
# the default `stock`.

# %%
r = nbtools.one(recs, card="H100", shape="k3_rank16", batch=1, part="layer", impl="fast", routing="uniform")
for k in ("gpu", "driver", "torch", "cutlass", "commit", "copy_tbps", "l2", "routing", "kernels",
          "replay_us_median", "replay_us_p10", "replay_us_p90", "bytes", "floor_us", "rel_err_vs_ref", "perfetto"):
    print(f"{k:18s} {r[k]}")

# %% [markdown]
# ## 2. The whole layer, per card
# One row per cell: stock and fast from the same run, the number of kernels in brackets.
# `stock/fast` is the speed-up. `fast/floor` says how far the fused path is from what the bytes allow.

# %%
layer = nbtools.part_rows("layer", recs)
nbtools.show(layer)

# %% [markdown]
# ## 2b. Against vLLM's own layer
# The stock that matters to a vLLM user is vLLM's own layer. `--stock-ops vllm-layer` calls vLLM 0.33's kernels
# the way its Kimi K3 layer calls them; stock vLLM's own engine, run on the same machine just before
# (`scripts/device_vllm_e2e.sh layers`: a 4-layer model per width), measured that layer inside vLLM. Each stock
# record carries the engine's figure for the same layer kind, shape, batch and card (`vllm_layer_kernel_us`,
# `report --engine-match`): summed kernel time within 5 % at every width the engine fits (full width's does not
# fit 80 GB), and beside it the fused layer's speed-up over that stock. MLA layers are matched where the engine
# profiles them, at ~24 cached tokens.

# %%
from k3fast.measure.report import load_records

# each shape from its latest run (TP8's after stock took K3's low-latency GEMM table on every projection it lists)
runs = {shape: load_records(os.path.join(nbtools.ROOT, path))
        for shape, path in nbtools.INDEX["vllm_layer_check_h100"].items()}
matched = [(r, vl) for shape, vl in runs.items() for r in vl if r["shape"] == shape and r["impl"] == "stock"
           and r["part"] == "layer" and r.get("vllm_layer_kernel_us")]
for s_, vl in matched:
    f_ = nbtools.one(vl, layer_kind=s_["layer_kind"], shape=s_["shape"], batch=s_["batch"], context=s_["context"],
                     part="layer", impl="fast")
    print(f"{s_['layer_kind']} {s_['shape']:9s} b{s_['batch']:<2d}: stock {s_['kernels']:.0f} kernels "
          f"{s_['kernel_us_sum']:6.1f} µs | vLLM in engine {s_['vllm_layer_kernels']:.0f} kernels "
          f"{s_['vllm_layer_kernel_us']:6.1f} µs ({100 * (s_['kernel_us_sum'] / s_['vllm_layer_kernel_us'] - 1):+.1f} %)"
          f" | replay stock {s_['replay_us_median']:.1f} fast {f_['replay_us_median']:.1f} µs: "
          f"{s_['replay_us_median'] / f_['replay_us_median']:.2f}x")
    assert abs(s_["kernel_us_sum"] / s_["vllm_layer_kernel_us"] - 1) <= 0.05
    assert s_["kernels"] == s_["vllm_layer_kernels"]
assert {(r["layer_kind"], r["shape"]) for r, _ in matched} == {(k, s) for k in ("kda_moe", "mla_moe")
                                                           for s in ("k3_rank16", "k3_rank8")}

# %% [markdown]
# ## 3. Where the time goes: the stages
# Each record also holds the same step run eagerly inside NVTX ranges: kernels and GPU µs per stage.
# A fused kernel covers several stages; the fast path books it under the first one.
# So we compare the two paths per **fusion** (`nbtools.FUSIONS`), each with the floor of its own bytes.
#
# One booking differs. At batch <= 4 the fused MoE front also computes the shared experts' gate/up, which
# stock books under `k3.moe.shared` (counted here in `experts_tail`).

# %%
cell = nbtools.fusion_rows(recs, "k3_rank16", 1)
for row in cell:
    print(f"{row['card']}  {row['label']:13s} stock {row['stock_us']:6.1f} µs ({row['stock_kernels']:2d} kernels)"
          f"  fast {row['fast_us']:6.1f} µs ({row['fast_kernels']} kernels)  floor {row['floor_us']:5.1f} µs")

# %% [markdown]
# A stage can come out a little *under* its floor. The floor uses the copy bandwidth, and a copy both reads
# and writes. A kernel that only reads can stream somewhat faster. The replayed parts never do (section 7).

# %% [markdown]
# ## 4. One replay, kernel by kernel
# `replay_timeline` is one graph replay after the same L2 flush as the timed ones: each kernel's start and
# duration. With PDL (programmatic dependent launch) the next fused kernel starts before the previous one ends.

# %%
st, fa = (nbtools.one(recs, card="H100", shape="k3_rank16", batch=1, part="layer", impl=i, routing="uniform")
          for i in ("stock", "fast"))
for k in nbtools.replay_kernels(fa):
    print(f"  {nbtools.short_name(k['name']):20s} {str(k['stage']):15s} {k['start']:6.1f} -> {k['start'] + k['dur']:6.1f} µs")
print(f"stock: {len(nbtools.replay_kernels(st))} kernels in {st['replay_timeline']['span_us']:.1f} µs, "
      f"idle between them {st['replay_timeline']['idle_us']:.1f} µs")

# %% [markdown]
# ## 5. The Perfetto trace
# At batch 1 each record also keeps a Perfetto trace of the eager step with its NVTX ranges
# (`perfetto-*/…json.gz` beside the records file). Open it at https://ui.perfetto.dev.
# With Nsight Systems, `nsys profile -t cuda,nvtx python -m k3fast.measure.trace ...` captures the same ranges.
#
# The eager step is not the replay: each launch waits for Python. The stages and the kernel order are the same.

# %%
ev = nbtools.perfetto_events(fa)
print(os.path.relpath(nbtools.perfetto_path(fa), nbtools.ROOT))
print(sorted({e.get("cat") for e in ev if e.get("cat")}))
for e in sorted((e for e in ev if e.get("cat") == "gpu_user_annotation"), key=lambda e: e["ts"]):
    print(f"  {e['name']:16s} {e['dur']:7.1f} µs on the GPU")

# %% [markdown]
# ## 6. What a target allows: stock over its floor
# No implementation can beat stock by more than `stock / floor` in a cell: the **ceiling**.
# The H100's copy bandwidth is ~0.7x the H200's. Byte-bound time grows on the slower card while stock's
# launch costs do not, so every ceiling is lower there.
#
# Stock's Triton kernels autotune once per process. fla's conv kernel is keyed without the batch, so the first
# batch a process ran used to set its speed at every later batch. Every stock record says how the autotuners
# were reset before its cell (`stock_autotune`).

# %%
attn = nbtools.part_rows("attn", recs)
for row in attn:
    print(f"{row['card']} attention half {row['shape']:9s} b{row['batch']:<3d} "
          f"stock/fast {row['stock_us'] / row['fast_us']:.2f}x   ceiling {row['stock_us'] / row['floor_us']:.2f}x")
print({r["stock_autotune"] for r in recs if r["impl"] == "stock"})

# %% [markdown]
# ## 7. The assertion cell
# Executing this notebook is a test. The assertions are structural, so a new sweep within a few per cent passes:
# * every replayed part takes at least its floor, stock and fast;
# * the fused layer is faster than stock in every cell, by 1.3x or more at batch 1;
# * per rank, the fused attention half is 3 launches at batch 1, against 17 or more for stock;
# * the attention half matches the reference (the records' relative error against `k3ref`).

# %%
from k3fast.measure.report import validate  # noqa: E402

assert not validate(recs), validate(recs)[:5]
for rec in recs:
    assert rec["replay_us_median"] >= rec["floor_us"], (rec["card"], rec["shape"], rec["batch"], rec["impl"])
for row in layer:
    assert row["fast_us"] < row["stock_us"], row
    if row["batch"] == 1:
        assert 1.15 <= row["stock_us"] / row["fast_us"] <= 2.6, row
for row in attn:
    assert row["rel_err_vs_ref"] < 1e-2, row
    if row["batch"] == 1 and row["shape"] != "full":
        assert row["fast_kernels"] <= 3 < 17 <= row["stock_kernels"], row
print("ok")

# %% [markdown]
# ## 8. A live trace (GPU only)

# %%
if torch.cuda.is_available():
    from k3fast.measure import trace
    trace.main(["--kinds", "kda_moe", "--shapes", "k3_rank16", "--batches", "1", "--impls", "stock", "fast",
                "--replays", "20", "--out", "traces/live"])
else:
    print("no GPU here: the recorded traces above are the evidence")

# %% [markdown]
# ## 9. Pictures
# First, one replay at rank16 batch 1 on each card, stock above fast, each kernel coloured by its NVTX stage
# (from the Perfetto trace). Stock runs ~35 small kernels; fast runs 6, overlapped by PDL.

# %%
plt = nbtools.pyplot()
fig, axes = plt.subplots(len(nbtools.SWEEPS), 1, figsize=(12, 2.6 * len(nbtools.SWEEPS)), squeeze=False)
for ax, card in zip(axes[:, 0], nbtools.SWEEPS):
    pair = [nbtools.one(recs, card=card, shape="k3_rank16", batch=1, part="layer", impl=i, routing="uniform")
            for i in ("stock", "fast")]
    nbtools.plot_timelines([(f"{p['impl']} ({p['kernels']:g})", nbtools.replay_kernels(p)) for p in pair],
                           f"one graph replay, kda_moe rank16 b1, {card}", ax=ax)
fig.tight_layout()

# %% [markdown]
# The Perfetto trace itself, on its own time axis: the eager step. Here the host sets the pace.
# Each stock launch waits for Python, which is one reason serving stacks replay CUDA graphs.

# %%
nbtools.plot_timelines([(f"{p['impl']} (eager)", nbtools.perfetto_kernels(p)) for p in (st, fa)],
                       "the Perfetto trace: one eager step, kda_moe rank16 b1, H100");

# %% [markdown]
# Per fusion at rank16 batch 1: stock and fast GPU µs against the floor of the same bytes.

# %%
nbtools.plot_stage_bars(cell, "rank16 b1 by fusion");

# %% [markdown]
# Over batch, per card: the bandwidth each path achieves (the layer's bytes over its replay) and the speed-up.
# The fused path's edge is largest at small batch, where stock's launches and small kernels weigh most.

# %%
nbtools.plot_over_batch(layer, "the layer");

# %% [markdown]
# ## 10. A kernel profile (Nsight Compute through nsight-python)
# `python -m k3fast.measure.profile` runs Nsight Compute on every kernel of each half, stock beside fast, on a GPU.
# It writes `traces/<card>/profile-*.json`, drawn here on any machine: each kernel alone with the caches flushed,
# its time and the DRAM bandwidth it reached. The trace above shows the overlap; the profile shows each kernel.

# %%
profiles = sorted(glob.glob(os.path.join(nbtools.ROOT, "traces", "*", "profile-*.json")))
if profiles:
    from k3fast.measure.profile import load_profile, plot_profile, profile_table
    prof = load_profile(profiles[-1])
    print(os.path.relpath(profiles[-1], nbtools.ROOT))
    print(profile_table(prof))
    plot_profile(prof)
else:
    print("no nsight-python profile recorded yet (traces/<card>/profile-*.json)")
