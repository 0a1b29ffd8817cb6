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
# # 04 — o_proj + partial-sum update + AttnRes #2 + post-attention RMSNorm
#
# **Reference ops replaced** (k3-spec.md sections 4.3, 6, 7.2 step 9): `a = y W_oᵀ` (row-parallel: on a TP rank a
# partial sum, all-reduced in the model; the collective is absent on one GPU), `p := p + a` (or `p := a` at a block
# boundary), the pre-MLP softmax mix over the blocks and `p`, and the post-attention RMSNorm that makes the MLP input.
#
# **The trick.** The mix needs the whole 7168-wide row of `a`, spread over every CTA of the GEMV. The GEMV CTAs
# publish their rows and bump a counter; one epilogue CTA per token, launched in the same grid, has already
# computed the statistics of the completed blocks (they come from earlier layers, so before the PDL wait) and only
# waits for `a` to finish the mix. The last epilogue CTA resets the counter, so graph replays need no memset.

# %%
import torch

from k3ref import Precision, ResidualStream, k3_rank, random_layer, tiny
from k3ref.attnres import attn_res_mix, attn_res_u, pre_mlp

from k3fast.measure import nbtools

cfg, P = tiny(), Precision.exact()
w = random_layer(cfg, 3, seed=0)

# %% [markdown]
# ## 1. The reference ops, and the split the kernel relies on

# %%
N = 2
s = ResidualStream.from_embeddings(torch.randn(N, cfg.hidden_size, dtype=torch.float64), cfg.max_blocks)
s.blocks[:, :2] = torch.randn(N, 2, cfg.hidden_size, dtype=torch.float64)
y = torch.randn(N, cfg.mla_heads * cfg.v_head_dim, dtype=torch.float64)
a = y @ w.attn.o_proj.double().T
p0 = s.partial.clone()
x_mlp = pre_mlp(s, 3, a, w.mlp_res, w.post_attention_layernorm, cfg, P)
# block statistics (independent of a) + the partial's statistics (after a) give the same scores
u = attn_res_u(w.mlp_res, P)
blocks = s.blocks[:, :2]
pre = (torch.rsqrt(blocks.pow(2).mean(-1) + cfg.rms_norm_eps) * (blocks @ u))           # before the wait
p = p0 + a
post = torch.rsqrt(p.pow(2).mean(-1) + cfg.rms_norm_eps) * (p @ u)                      # after it
alpha = torch.softmax(torch.cat([pre, post[:, None]], 1), -1)
m = torch.einsum("nk,nkd->nd", alpha, torch.cat([blocks, p[:, None]], 1))
split_err = float((m - attn_res_mix(torch.cat([blocks, p[:, None]], 1), u, cfg.rms_norm_eps)).norm() / m.norm())
print(f"pre/post split of the AttnRes statistics vs the one-shot mix: {split_err:.1e}")

# %% [markdown]
# ## 2. Bytes and floor

# %%
print(nbtools.stage_floors(("k3.o_proj", "k3.attn_res_mlp")))

# %% [markdown]
# ## 3. The fused kernel (`k3fast/oproj_attnres.py`)

# %%
from k3fast.kernels import oproj_attnres as om
print(om.__doc__.split("\n\n")[0])
print(nbtools.compile_on_cpu(om.warmup, [768], [2], [1]))

# %% [markdown]
# ## 4-5. Against the reference (recorded on the H200) and the time

# %%
rec = nbtools.recorded_gpu_tests("test_oproj_attnres")
print(f"recorded H200 parity tests: {rec['passed']} passed, {rec['failed']} failed ({rec['source']})")
if rec["failed"]:
    print("failing cases (being fixed; see the module's version log):", rec["failures"][:8], "...")
print(nbtools.bench_table(nbtools.recorded_kernel_bench("oproj_attnres")))

# %% [markdown]
# ## 6. Loads that wait for stores (v1.2)
# The epilogue's last loop writes x = bf16(w_post * m * rstd) vector by vector. In the SASS it read load, store,
# load, store: each store waits for its load, and ptxas does not hoist the next load over a store to memory it
# cannot prove disjoint. w_post is a weight, so nothing stops the kernel from reading it before the PDL wait,
# which takes the four round trips off the attention half's critical path. Below, the bench rows (the "@v1.1"
# row times the epilogue before the change on the same inputs; "@wpost" is its first measurement as an opt-in) and
# the layer A/B of the run that measured it (`fast-wpost`, the default since).

# %%
print(nbtools.bench_table(nbtools.recorded_kernel_bench("oproj_attnres@wpost")))
print(nbtools.ab_table("traces/h200/records-84291ed-s9perf.json", "attn", ["stock", "fast", "fast-wpost"]))

# %%
assert split_err < 1e-12
assert rec["source"] is None or rec["passed"] + rec["failed"] > 0
print("ok")

# %% [markdown]
# ## 7. The whole slice before the wait (v1.3, v1.4): measured at `s47` and `s50`, removed
# The GEMV CTAs issue their first register stages before the PDL wait, so the weights stream while the KDA step
# runs. At rank16 those stages hold a CTA's whole 64-row slice; at rank8 (Kp = 1536) only its first half, and the
# second half is loaded after the wait. s46's timelines showed what that seemed to cost: o_proj ended 5.0 µs after
# the KDA step at rank16 and 8-12 µs after it at rank8. v1.3 (`fast-opstage`) copied the rest of the slice into
# shared memory with one `cp.async.bulk` per row before the wait (bit-identical by construction, and so measured).
# It was predicted to take the rank8 attention half b1 from 45.8 to ~42-43.5 µs. `s47` ran it beside stock, fast
# and `fast-ringlate` (the in_proj ring's PDL trigger at its end instead of after its wait). The lesson is in the
# table: v1.3 gained nothing at b1 and lost 3.7 µs at b2. The ring's late trigger, the other change in the same
# run, gained 2.3 µs at rank8 b1 and is the default since (oproj_attnres' version log keeps v1.3's account; its
# code is at 8574eb7).

# %%
import json
import os
S47 = "traces/h200/records-8574eb7-s47.json"
for shape in ("k3_rank8", "k3_rank16"):
    print(nbtools.ab_table(S47, "attn", ["stock", "fast", "fast-opstage", "fast-ringlate", "fast-opstagelate"], shape))
with open(os.path.join(nbtools.ROOT, S47)) as f:
    s47 = {(r["shape"], r["batch"], r["impl"]): r for r in json.load(f)["records"] if r["part"] == "attn"}
for impl in ("fast", "fast-opstage", "fast-ringlate"):
    print(nbtools.replay_timeline(S47, "attn", impl, 1, "k3_rank8"))

# %%
us = {k: r["replay_us_median"] for k, r in s47.items()}
assert us[("k3_rank8", 1, "fast-opstage")] > us[("k3_rank8", 1, "fast")] - 0.5      # no gain at b1
assert us[("k3_rank8", 2, "fast-opstage")] > us[("k3_rank8", 2, "fast")]            # a loss at b2
assert us[("k3_rank8", 1, "fast-ringlate")] < us[("k3_rank8", 1, "fast")] - 1.0     # the late trigger's gain
assert all(r["rel_err_vs_ref"] < 1e-2 for r in s47.values())
print("ok (v1.3 measured slower and removed; v12.1 the default)")

# %% [markdown]
# v1.4 (`fast-oppf`, `s50`) tried the same rest through L2 instead: one `cp.async.bulk.prefetch.L2` per row before
# the wait, nothing landing in the CTA, so shared memory and residency stay as they are. It was slower too, and the
# timeline shows how: the KDA step, running while the 11 MB came in, took 1.5 µs longer, and o_proj ended as long
# after it as before. Two ways of moving the rest's bytes earlier have not shortened o_proj's time after the rank8
# KDA step; what sets it is the next thing to measure (Nsight Compute on this kernel at rank8 against rank16).

# %%
S50 = "traces/h200/records-ff51150-s50.json"
print(nbtools.ab_table(S50, "attn", ["stock", "fast", "fast-oppf"], "k3_rank8"))
for impl in ("fast", "fast-oppf"):
    print(nbtools.replay_timeline(S50, "attn", impl, 1, "k3_rank8"))

# %%
with open(os.path.join(nbtools.ROOT, S50)) as f:
    s50 = {(r["batch"], r["impl"]): r for r in json.load(f)["records"] if r["part"] == "attn"}
kt = {i: s50[(1, i)]["replay_timeline"]["kernels"] for i in ("fast", "fast-oppf")}
kda_us = {i: kt[i][1][2] for i in kt}
after = {i: (kt[i][2][1] + kt[i][2][2]) - (kt[i][1][1] + kt[i][1][2]) for i in kt}
assert all(s50[(b, "fast-oppf")]["replay_us_median"] > s50[(b, "fast")]["replay_us_median"] for b in (1, 2))
assert kda_us["fast-oppf"] > kda_us["fast"] + 1.0 and abs(after["fast-oppf"] - after["fast"]) < 0.5
print(f"KDA step {kda_us['fast']:.1f} -> {kda_us['fast-oppf']:.1f} µs; o_proj after it "
      f"{after['fast']:.1f} -> {after['fast-oppf']:.1f} µs")
print("ok (v1.4 measured slower and removed)")

# %% [markdown]
# ## 8. The arrival chain without extra fences (v1.5, the default) and 32-row CTAs (v1.6, opt-in)
# After its p' stores every GEMV thread used to fence at gpu scope (which waits for that thread's own stores) before
# the CTA barrier and thread 0's release arrival; the epilogue fenced again after its acquire spin and waited for
# its departure atomic before a barrier. The barrier plus the release's cumulativity already order the stores (the
# same argument CUTLASS's barrier arrivals rest on), so v1.5 drops both fences and departs after the stores of x.
# Nsight Compute per SASS instruction (`ncu10`, the v1.4 build) put 7 % of the GEMV warps' stall samples on that
# fence; most of the rest wait for the one wave of weight loads or for room in the load queue. `s58` measured v1.5
# as an opt-in (`fast-oplean`), `s59` as the default against `fast-opfence` (the fences back).

# %%
import csv
import gzip
NCU10 = "traces/h200/ncu-377caf5-ncu10/oproj16-sass.csv.gz"     # gzipped in session 23 (the device's carry limit)
with gzip.open(os.path.join(nbtools.ROOT, NCU10), "rt") as f:
    rows = list(csv.reader(f))[1:]
hdr, body = rows[0], rows[1:]
col = {h: i for i, h in enumerate(hdr)}
samples = [(int(r[col["Warp Stall Sampling (All Samples)"]] or 0), int(r[col["Instructions Executed"]] or 0),
            r[col["Source"]].strip()) for r in body]
total = sum(s for s, _, _ in samples)
print(f"ncu10: {total} warp-stall samples over {len(samples)} SASS instructions; the five largest:")
for s, n, src in sorted(samples, reverse=True)[:5]:
    print(f"  {s:4d} ({100 * s / total:4.1f} %)  executed {n:4d}x  {src[:60]}")
fence = sum(s for s, _, src in samples if src.startswith(("MEMBAR", "ERRBAR", "CGAERRBAR", "CCTL")))
print(f"fence / barrier-error instructions: {fence} samples ({100 * fence / total:.0f} %)")

# %%
S58, S59, S60 = ("traces/h200/records-377caf5-s58.json", "traces/h200/records-54bd858-s59.json",
                 "traces/h200/records-f253411-s60.json")
for shape in ("k3_rank16", "k3_rank8"):
    print(nbtools.ab_table(S58, "attn", ["stock", "fast", "fast-oplean"], shape))
    print(nbtools.ab_table(S59, "attn", ["stock", "fast", "fast-opfence"], shape))
print(nbtools.kernel_ab("traces/h200/kernels-377caf5-s58.json", "oproj_attnres", "oproj_attnres@lean", (1, 2))[1])

# %%
def attn_us(path):
    with open(os.path.join(nbtools.ROOT, path)) as f:
        return {(r["shape"], r["batch"], r["impl"]): r for r in json.load(f)["records"] if r["part"] == "attn"}
s58, s59 = attn_us(S58), attn_us(S59)
cells = [(sh, b) for sh in ("k3_rank16", "k3_rank8") for b in (1, 2)]
assert all(s58[c + ("fast-oplean",)]["replay_us_median"] < s58[c + ("fast",)]["replay_us_median"] for c in cells)
assert all(s59[c + ("fast",)]["replay_us_median"] < s59[c + ("fast-opfence",)]["replay_us_median"] for c in cells)
assert fence < 0.15 * total
print("ok (v1.5 faster in every b1 / b2 cell of s58 and s59; the default since 54bd858)")

# %% [markdown]
# v1.6 (`fast-op32`, `s60`) tried the rank8 rest once more, by halving the rows per GEMV CTA: 224 CTAs of 32 rows,
# each warp again with all 12 of its chunks in flight before the wait, two CTAs per SM at 128 registers. o_proj then
# ended 5.4 µs after the KDA step, as at rank16, instead of 9.1; but the KDA step, now running beside twice the bytes
# in flight, took 2.6 µs longer. The third design to bring the rest forward, and the third time the KDA step paid
# for it (v1.4: +1.5 µs). The attention half moved -0.4 / -1.1 µs at b1 / b2; v1.6 stays opt-in.

# %%
print(nbtools.ab_table(S60, "attn", ["stock", "fast", "fast-op32"], "k3_rank8"))
for impl in ("fast", "fast-op32"):
    print(nbtools.replay_timeline(S60, "attn", impl, 1, "k3_rank8"))
s60 = attn_us(S60)
kt = {i: s60[("k3_rank8", 1, i)]["replay_timeline"]["kernels"] for i in ("fast", "fast-op32")}
kda_us = {i: kt[i][1][2] for i in kt}
after = {i: (kt[i][2][1] + kt[i][2][2]) - (kt[i][1][1] + kt[i][1][2]) for i in kt}
print(f"KDA step {kda_us['fast']:.1f} -> {kda_us['fast-op32']:.1f} µs; o_proj after it "
      f"{after['fast']:.1f} -> {after['fast-op32']:.1f} µs")
assert after["fast-op32"] < after["fast"] - 2.0 and kda_us["fast-op32"] > kda_us["fast"] + 1.5
assert all(r["rel_err_vs_ref"] < 1e-2 for r in s60.values())
print("ok (v1.6: o_proj's tail shorter, the KDA step longer; opt-in)")

# %% [markdown]
# Was it o_proj's stream that lengthened the KDA step? `s61` moved the KDA kernel's PDL trigger from right after its
# wait to after its first exchange (KDA v8, `fast-kdamid`, with 32 rows `fast-op32mid`; removed after this run, the
# code is at e3ab9f1). The KDA step got shorter, so yes; but o_proj then started later and ended later by about as
# much. The bytes read in the KDA step's window are a trade, not a gain. No stock in this run: the A/B is in one run.

# %%
S61 = "traces/h200/records-e3ab9f1-s61.json"
impls61 = ["fast", "fast-op32", "fast-kdamid", "fast-op32mid"]
print(nbtools.ab_table(S61, "attn", impls61, "k3_rank8"))
s61 = attn_us(S61)
for impl in impls61:
    k = s61[("k3_rank8", 1, impl)]["replay_timeline"]["kernels"]
    kda_end = k[1][1] + k[1][2]
    print(f"{impl:13s} KDA step {k[1][2]:4.1f} µs, o_proj ends {k[2][1] + k[2][2] - kda_end:4.1f} µs after it")

# %%
kda61 = {i: s61[("k3_rank8", 1, i)]["replay_timeline"]["kernels"][1][2] for i in impls61}
assert kda61["fast-kdamid"] < kda61["fast"] - 1.0 and kda61["fast-op32mid"] < kda61["fast-op32"] - 2.0
assert all(s61[("k3_rank8", 1, i)]["replay_us_median"] > s61[("k3_rank8", 1, "fast")]["replay_us_median"]
           for i in ("fast-kdamid", "fast-op32mid"))
print("ok (the later trigger: a shorter KDA step, a longer attention half; removed)")

# %% [markdown]
# ## At full width the fused kernel is the wrong tool (session 23)
# Every measurement above is at rank16 / rank8, where o_proj's weight is 11 / 22 MB. At full width (one rank holding
# the whole layer, K = 12288) it is 176 MB, and the fused kernel's one wave of register stages covers a small part of
# each CTA's slice: s75 timed it at 61.5 µs at b1 and 168.0 µs at b8 (1.0 TB/s), where stock's cuBLAS o_proj + its
# AttnRes kernel took ~53 / ~59. Since session 23 the layer and the torch op take the fused kernel only up to
# K = 1536 (`fast.oproj_fused`, `OPROJ_FUSED_MAX_KP`); above, cuBLAS + the AttnRes #2 norm kernel. `fast-opfull` is
# the A/B. Predicted at full width b8: ~270-280 µs for the attention half.

# %%
S76 = "traces/h200/records-e8c9c17-s76.json"
print(nbtools.ab_table(S76, "attn", ["stock", "fast", "fast-opfull"], "full"))
s76 = attn_us(S76)
print(f"full b8: fused {s76[('full', 8, 'fast-opfull')]['replay_us_median']:.1f} -> "
      f"cuBLAS + norm {s76[('full', 8, 'fast')]['replay_us_median']:.1f} µs "
      f"(floor {s76[('full', 8, 'fast')]['floor_us']:.1f})")
assert s76[("full", 8, "fast")]["replay_us_median"] < s76[("full", 8, "stock")]["replay_us_median"] \
    < s76[("full", 8, "fast-opfull")]["replay_us_median"]
from k3fast.layer import oproj_fused
assert oproj_fused(8, 1536) and not oproj_fused(8, 12288) and not oproj_fused(9, 768)


# %% [markdown]
# ## Batch 16 (session 26): the same trade again
# Above batch 8, o_proj runs as cuBLAS + the AttnRes #2 kernel: at rank8 b16 that is 12.8 µs after the KDA step, and
# the attention half needs ~3 µs less for 1.8x stock. `fast-opm16` runs this kernel up to M = 16 instead (no new
# code: its M = 16 build is tested). Predicted: rank8 b16 59.1 -> ~56-57 µs. Measured in s90c: 60.6. o_proj now ends
# 11.9 µs after the KDA step, but its CTAs start during it and the KDA step takes 15.2 µs instead of 11.8: the trade
# v1.3, v1.4 and v1.6 measured. Not the default.

# %%
S90C = "traces/h200/records-111bb49-s90c.json"
print(nbtools.ab_table(S90C, "attn", ["stock", "fast", "fast-opm16"], "k3_rank8"))
print(nbtools.replay_timeline(S90C, "attn", "fast-opm16", shape="k3_rank8", batch=16))
s90c = attn_us(S90C)
assert s90c[("k3_rank8", 16, "fast-opm16")]["replay_us_median"] > s90c[("k3_rank8", 16, "fast")]["replay_us_median"]
assert oproj_fused(16, 1536, max_m=16) and not oproj_fused(16, 1536)

# %% [markdown]
# What did help at rank8 is the other half of the idea: keep o_proj apart from the norm, but run it on the WGMMA GEMM
# of notebook 02 (`fast-opwg`). Its weight is requested before its PDL wait and it launches the norm kernel from its
# cluster barrier instead of at its end. The timelines show why the gain is smaller than predicted (-2.5 to -4.5 µs):
# at b64 the KDA step's CTAs fill the SMs' shared memory, so the GEMM's CTAs land only as they leave and most of W
# still streams after the KDA step. What is left is the norm's earlier launch and one gap: -1.5 to -1.9 µs at rank8 in
# two runs (s90e, s90f), even at rank16. So since session 26 `fast.oproj_wide_choice` picks it at rank8's width only.

# %%
S90E = "traces/h200/records-833d5e0-s90e.json"
print(nbtools.ab_table(S90E, "attn", ["stock", "fast", "fast-opwg", "fast-opwgd3", "fast-opwgd2"], "k3_rank8"))
print(nbtools.ab_table(S90E, "attn", ["stock", "fast", "fast-opwg", "fast-opwgd3", "fast-opwgd2"]))
print(nbtools.replay_timeline(S90E, "attn", "fast-opwg", shape="k3_rank16", batch=64))
s90e, s90f = attn_us(S90E), attn_us("traces/h200/records-f3d976a-s90f.json")
for runs in (s90e, s90f):
    for b in (16, 64):
        assert runs[("k3_rank8", b, "fast-opwg")]["replay_us_median"] < runs[("k3_rank8", b, "fast")]["replay_us_median"]
from k3fast.layer import oproj_wide_choice
assert oproj_wide_choice(1536) == "wgmma" and oproj_wide_choice(768) == "cublas"
assert oproj_wide_choice(768, None, 16) == "cublas" and oproj_wide_choice(768, None, 64) == "wgmma"

# %% [markdown]
# Session 28 added rank16 above M = 16. There the in_proj now runs on the same GEMM (notebook 02, section 20), which
# launches the KDA step early, and o_proj's WGMMA GEMM had been 0.5-0.9 µs ahead of cuBLAS at rank16 b64 in every run
# (s90e / s90f / s92 / s97). At b16 it was mixed, so rank16 b9..16 stays on cuBLAS (`fast.OPROJ_WIDE_MIN_M_NARROW`).

# %%
S98 = "traces/h200/records-eb247aa-s98.json"
print(nbtools.ab_table(S98, "attn", ["stock", "fast", "fast-inwgoff", "fast-inwgoff-opwgoff"]))
print(nbtools.replay_timeline(S98, "attn", "fast", shape="k3_rank16", batch=64))
s98 = attn_us(S98)
assert (s98[("k3_rank16", 64, "fast-inwgoff")]["replay_us_median"]
        < s98[("k3_rank16", 64, "fast-inwgoff-opwgoff")]["replay_us_median"])
