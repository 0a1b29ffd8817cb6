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
# # 02 — AttnRes + input RMSNorm folded into the packed input projection
#
# **Reference ops replaced** (k3-spec.md sections 4.3, 6, 7.2 step 1, 7.4): `p += δ` (BF16), the block write at a
# boundary, the AttnRes softmax mix over the blocks and `p`, the input RMSNorm, and the six KDA projections
# q, k, v, g, f_a, b, packed into one `[4P + 128 + H (+pad to 16), 7168]` weight.
#
# **The trick.** RMSNorm is a per-token scale: `y = rstd · ((m ⊙ w_ln) Wᵀ)`, so the normalisation never needs a
# second pass over the weights. The mix coefficients need the whole 7168-wide token, so every CTA recomputes
# them from L2-resident data while its first weight tiles are already in flight (issued before the PDL wait).

# %%
import torch

from k3ref import Precision, ResidualStream, k3_rank, random_layer, tiny
from k3ref.attnres import pre_attention
from k3ref.kda import kda_projections

from k3fast.measure import nbtools

P = Precision.exact()
cfg = tiny()
w = random_layer(cfg, 1, seed=0)

# %% [markdown]
# ## 1. The reference ops (tiny, fp64 on the CPU)

# %%
N = 3
s = ResidualStream.from_embeddings(torch.randn(N, cfg.hidden_size, dtype=torch.float64), cfg.max_blocks)
s.blocks[:, 0] = torch.randn(N, cfg.hidden_size, dtype=torch.float64)
s.delta = 0.5 * torch.randn(N, cfg.hidden_size, dtype=torch.float64)
s_copy = s.clone()
x = pre_attention(s, 1, w.attn_res, w.input_layernorm, cfg, P)
pr = kda_projections(x, w.attn, P)
print({k: tuple(v.shape) for k, v in pr.items()})

# %% [markdown]
# The fusion's algebra: normalise-then-project equals project-the-unnormalised-mix-then-scale per token.

# %%
from k3ref.attnres import attn_res_mix, attn_res_u
src = torch.cat([s_copy.blocks[:, :1], (s_copy.partial + s_copy.delta)[:, None]], 1)
m = attn_res_mix(src, attn_res_u(w.attn_res, P), cfg.rms_norm_eps)
rstd = torch.rsqrt(m.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
W = torch.cat([w.attn.q_proj, w.attn.k_proj]).double()
folded = rstd * ((m * w.input_layernorm.double()) @ W.T)
err = float((folded - torch.cat([pr["zq"], pr["zk"]], -1)).norm() / folded.norm())
print(f"folded-norm GEMV vs normalise-then-GEMV (fp64): {err:.2e}")

# %% [markdown]
# ## 2. Bytes and floor (batch 1; the projection weight dominates)

# %%
print(nbtools.stage_floors(("k3.kda.in_proj", "k3.attn_res")))

# %% [markdown]
# ## 3. The fused kernel (`k3fast/rms_gemv.py`)
# M <= 2: one persistent launch (AttnRes prologue per CTA + warp-per-row FMA GEMV with 16-byte loads);
# larger M: `attnres_rmsnorm` + a tensor-core (mma.sync m16n8k16, weights as the M side) GEMV, chained with PDL.
# Since session 16 the layer runs section 13's kernel at M <= 2 instead (`k3fast/rms_gemv_ring.py`: the same
# prologue, the weights through a bulk-copy shared-memory ring); sections 3-12 are the FMA kernel's story.

# %%
from k3fast.kernels import rms_gemv
print(rms_gemv.__doc__.split("\n\n")[0])
c16 = k3_rank(16)
from k3fast.kernels import kda_conv_gate_step as kmod
N16 = kmod.proj_width(c16.kda_heads)
print(nbtools.compile_on_cpu(rms_gemv.warmup, [(N16, 7168)], [1], attnres_K=7168, attnres_N=(N16,), n_blocks=[1],
                             block_write=(-1,), deltas=(True,)))

# %% [markdown]
# ### What the compiled loop issues
# A weight-streaming GEMV is fast only if each warp keeps several 16-byte loads in flight. At rank16 the
# persistent kernel splits each 7168-wide row over 8 warps: 112 vectors, 3.5 per lane, and 13 row groups per CTA.
# v1 wrote the slice as `range(..., unroll=4)`. With a trip count that short and known only at run time, the work
# fell into the loop's remainder, which issues one load, waits for it, and only then issues the next. v2 writes
# the slice as predicated batches. Below: the order of global loads (`L`) and FMAs (`f`) in the compiled PTX loop.
# The measured effect is a question for the next H200 run (`k3fast/LOG.md`).

# %%
from k3fast.kernels._dsl import dsl_available
from k3fast.measure.ptxcheck import loop_issue_order
if dsl_available():
    print("fused config (rows per CTA pass, k-slices, grid):", rms_gemv._fused_config(N16, 7168))
    for label, seq in loop_issue_order(rms_gemv.fused_ptx(N16), min_loads=2):
        print(f"loop {label}: {seq[:80]}")
else:
    print("CuTe DSL not installed: PTX view skipped")


# %% [markdown]
# ## 4. Against the reference, and 5. the measured time
# On the H200 the kernel is compared with k3ref for batches 1-64 and the three shapes (`tests/gpu/test_rms_gemv.py`);
# here, the recorded outcome. With a GPU present, a live check and timing follow.

# %%
rec = nbtools.recorded_gpu_tests("test_rms_gemv")
print(f"recorded H200 parity tests: {rec['passed']} passed, {rec['failed']} failed ({rec['source']})")
print(nbtools.bench_table(nbtools.recorded_kernel_bench("attnres_rms_gemv")))
if torch.cuda.is_available():
    cg = k3_rank(16)
    wg = random_layer(cg, 1, seed=0, device="cuda")
    from k3fast.measure.impls import make_io
    io = make_io(cg, 1, 1)
    rows = torch.cat([wg.attn.q_proj, wg.attn.k_proj, wg.attn.v_proj, wg.attn.g_proj, wg.attn.f_a_proj, wg.attn.b_proj])
    Win = torch.cat([rows, rows.new_zeros(N16 - rows.shape[0], 7168)]).contiguous()
    u = attn_res_u(wg.attn_res, Precision.model()).float()
    pout = torch.empty_like(io.partial)
    y, _ = rms_gemv.attnres_rms_gemv(io.blocks, 1, io.partial, io.delta, u, wg.input_layernorm, Win, partial_out=pout)
    s2 = ResidualStream(io.blocks.clone(), io.partial.clone(), io.delta.clone())
    xr = pre_attention(s2, 1, wg.attn_res, wg.input_layernorm, cg, Precision.model())
    live_err = float((y.float() - (xr.float() @ Win.float().T)).norm() / (xr.float() @ Win.float().T).norm())
    print(f"live: rel err vs k3ref {live_err:.2e}; "
          f"{nbtools.time_live(lambda: rms_gemv.attnres_rms_gemv(io.blocks, 1, io.partial, io.delta, u, wg.input_layernorm, Win, partial_out=pout)):.1f} µs")
    assert live_err < 1e-2

# %% [markdown]
# ## 6. A fusion that lost: the tensor-core path at batch 64
# Above batch 4 the in_proj runs on tensor cores (`_MmaGemv`): each warp owns 16 weight rows and a slice of K,
# and reads its activations (the MMA's B operand) from L2 at every 32-wide k step. At M = 64 that is 4-8 times
# the weight bytes again, from L2. `k3fast/gemv_splitk.py` stages x once per CTA in shared memory and splits K
# across CTAs instead, with the last CTA of each row block summing the partials in order. It was predicted to
# reach cuBLAS's time. The H200 said otherwise: a little faster at batch 8, much slower at batch 64. Its
# version log lists what was not measured yet. A prediction written before the run makes a miss visible, and
# the recorded rows below keep it.

# %%
plain = {(r["shape"], r["batch"]): r for r in nbtools.recorded_kernel_bench("gemv_in_proj_plain")}
split = {(r["shape"], r["batch"]): r for r in nbtools.recorded_kernel_bench("gemv_in_proj_plain@splitk")}
print("shape      batch   floor µs  _MmaGemv µs  gemv_splitk µs  cuBLAS µs")
for key in sorted(split):
    p, q = plain.get(key, {}), split[key]
    print(f"{key[0]:10s} {key[1]:5d} {q['floor_us']:10.1f} {p.get('fast_us_median', float('nan')):12.1f} "
          f"{q['fast_us_median']:15.1f} {q['stock_us_median']:10.1f}")

# %% [markdown]
# ## 7. What the layer does with that: dispatch by batch
# A fused kernel earns its place per batch, by measurement. `k3fast.layer` keeps this kernel at M <= 4 (fused
# prologue + FMA GEMV, one launch at M <= 2), and above `GEMV_DSL_MAX_M` it runs the same prologue followed by
# cuBLAS, because both of our tensor-core GEMVs lost to it there (rows above; at b8 the layer A/B `fast-gemv0`
# measured the attention half at 41.9 us against 46.7 with ours, records-cd4a730-s5perf.json). The same rule
# sends o_proj, the router front and the MoE tail to cuBLAS at larger batches. `impl="fast-alldsl"` keeps every
# CuTe kernel at every batch, so the choice is an A/B in one run.

# %%
from k3fast import layer as fast_mod
print("in_proj: fused ring up to M = 2 | M 3..8:", fast_mod.INPROJ_MID, "GEMV after attnres_rmsnorm | above: cuBLAS")
print("o_proj fused (oproj_attnres) up to M =", fast_mod.GEMV_DSL_MAX_M, "| router front up to M =",
      fast_mod.FRONT_DSL_MAX_M, "| MoE tail up to M =", fast_mod.TAIL_DSL_MAX_M)

# %% [markdown]
# ## 8. The PTX order is not the issue order
# At batch 1 this kernel streams its 46 MB at ~2.2 TB/s: 20.3 µs in the layer against an 11.1 µs floor
# (records-c90da94-kdaall.json, flushed timeline). Each warp loads its slice of a row group as one batch of 7
# 16-byte vectors per lane, then does the FMAs, and the PTX says exactly that. v3 put two groups, 14 loads, in
# each batch and measured no gain, so the loads must be issued differently. The SASS, which ptxas writes, shows
# how: 4 loads, then the FMAs of the first vector (these wait for its data), then the other 3 loads, into the
# registers the first ones freed. That is two to three round trips per group instead of one.
#
# v6 (`pin_loads=True`, impl `fast-gemvpin`, opt-in until the H200 measures it) ties the batch together. Each
# weight scale gets `+ 0 * (w_0 + ... + w_6)` (the first weight of each vector): exactly 0 for finite weights, so
# the output is bit-identical, but now every FMA depends on all 7 loads. ptxas then issues them together, at 128
# registers instead of 82. `k3fast.measure.ptxcheck` counts such "loads behind a use" for every kernel. Below, its record
# for this kernel, then (where a ptxas and nvdisasm are found) the loop's issue order compiled here:
# L = global load, f = FFMA.

# %%
import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402

from k3fast import ptxcheck  # noqa: E402

recs, newest = [], ""
for path in glob.glob(os.path.join(nbtools.ROOT, "traces", "cpu", "ptxcheck-*.json")):
    with open(path) as f:
        doc = json.load(f)
    rows = [r for r in doc["records"] if "loads_behind_use" in r and "in_proj" in r["kernel"]]
    if rows and doc["environment"].get("date", "") >= newest:
        recs, newest = [(os.path.basename(path), r) for r in rows], doc["environment"].get("date", "")
for src, r in recs:
    print(f"{src}: {r['kernel']:44s} {r['config'][10:]:5s} {r['registers']:3d} registers, "
          f"{r['global_loads']} loads, {r['loads_behind_use']} behind a use")
tools = ptxcheck.find_sass_tools()
if tools is not None and dsl_available():
    for pin in (False, True):
        _, sass = ptxcheck._assemble(rms_gemv.fused_ptx(3216, pin=pin), tools[0], "sm_90a", tools[1], ("-c",))
        ops = "".join("L" if "LDG.E.NA" in ln else "f" if "FFMA" in ln else "" for ln in sass.splitlines())
        print(f"pin={pin!s:5s} loop: {re.search(r'L[Lf]*', ops).group(0)[:48]}")
else:
    print("no ptxas / nvdisasm here (k3fast.measure.ptxcheck.find_sass_tools): the recorded counts above are the evidence")

# %% [markdown]
# Measured (session 7, one run): the pinned loads are bit-identical, and they took the fused kernel from 23.9 to
# 23.1 µs at b1 in the bench, and the attention half from 36.7 to 35.7 µs (`fast-gemvpin` below, since made the
# default). That is less than predicted: once the loads issue together, the ~2 TB/s that each SM streams is
# what remains, and neither 14 loads in flight (v3) nor a bulk L2 prefetch (v4) moved it.
#
# ## 9. Where the FMA GEMV stops: M = 3-4 goes to cuBLAS
# The fused prologue serves M <= 2 (`FUSE_MAX_M`, section 6). At M = 3-4 the AttnRes + RMSNorm kernel runs on its
# own, and the GEMV behind it needs no fusion, so the only question is which GEMV is fastest. At b4 the FMA kernel
# took 37.7 µs in the bench, against cuBLAS's 19.7 (why the FMA kernel slows from 23 µs at b1 to 38 at b4 is not
# analysed yet). So `k3fast.layer.INPROJ_DSL_MAX_M = 2`, and `fast-s10` is the A/B with the FMA kernel at M = 3-4. o_proj keeps its fused kernel to M = 4: there the fusion saves a launch and an AttnRes pass.

# %%
print(nbtools.ab_table("traces/h200/records-84291ed-s9perf.json", "attn", ["stock", "fast", "fast-gemvpin"]))
print(nbtools.ab_table("traces/h200/records-0bc90c0-s11.json", "attn", ["stock", "fast", "fast-s10"]))
print(nbtools.replay_timeline("traces/h200/records-0bc90c0-s11.json", "attn", "fast-s10", 4))
print(nbtools.replay_timeline("traces/h200/records-0bc90c0-s11.json", "attn", "fast", 4))

# %% [markdown]
# ## 10. Counting the loop's instructions (v8, session 10; opt-in, measured in section 11)
# Nsight Compute put the fused in_proj at 0.43 issued instructions per cycle per scheduler, with 4 warps each, and
# only a third of its stall cycles waiting on loads (`traces/h200/ncu-2674eff-ncu2/`). So the loop's own chain
# of instructions costs time too. The SASS of one batch (7 weight vectors of 16 bytes per lane) shows where it
# goes. Each vector's 8 weights are widened (SHF / PRMT) and multiplied by a mask scale (FMUL): 1 inside the
# slice, 0 for the lanes past its end, which re-read the last vector. The x vector from shared memory is widened
# again for every row group, though it is the same x.
#
# v8 (`x_fp32=True`, impl `fast-inxf`) widens x once into fp32 shared memory, with one zero vector past its end,
# and the past-the-end lanes read that zero vector instead of multiplying their weights by 0. v6's pin, which
# keeps the 7 loads issued together, then joins each accumulator once per batch (`acc + 0`) instead of each
# weight's scale. The table is from `python -m k3fast.measure.ptxcheck` (ptxas 12.9, recorded under `traces/cpu/`).

# %%
sass_rows, sass_src, newest = [], "", ""
for path in glob.glob(os.path.join(nbtools.ROOT, "traces", "cpu", "ptxcheck-*.json")):
    with open(path) as f:
        doc = json.load(f)
    rows = [r for r in doc["records"] if r.get("sass") and "fused in_proj" in r["kernel"]]
    # (section 11 reads v9 / v10 from the same record; v9 has no k-batch loop to set beside these)
    rows = [r for r in rows if "v6" in r["kernel"] or "v8" in r["kernel"]]
    # the newest record that has v8's loop (records after its removal in session 11 hold v6 only)
    if any("v8" in r["kernel"] for r in rows) and doc["environment"].get("date", "") >= newest:
        sass_rows, sass_src, newest = rows, os.path.basename(path), doc["environment"].get("date", "")
loop = {}
for r in sass_rows:          # per build, the innermost loop with weight loads: one batch of 7 vectors per lane
    k = (r["kernel"], r["M"])
    if r["opcodes"].get("LDG", 0) and (k not in loop or r["instructions"] < loop[k]["instructions"]):
        loop[k] = r
print(sass_src)
for (kern, M), r in sorted(loop.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    top = ", ".join(f"{op} {n}" for op, n in list(r["opcodes"].items())[:8])
    print(f"M={M} {kern[len('attnres_rms_gemv (fused in_proj, '):-1]:24s} {r['instructions']:4d} per batch, "
          f"{r['registers']} registers: {top}")

# %% [markdown]
# ## 11. What the H200 said: fewer instructions did not buy time (v8, v9)
# `scripts/h200_next.sh s21b` measured v8 (bench row `attnres_rms_gemv@xf`) and `s22` measured v9
# (`attnres_rms_gemv@xr`, impl `fast-inxr`). v9 goes further than v8. At M = 1 a lane's 7 x vectors are the same
# for every row group, so v9 loads them once from v8's fp32 staging into 56 registers. The row-group loop is
# then the weight loads, their widening and the FMAs. Its next-group L2 prefetch takes one line per lane, without
# the general helper's index division (~200 instructions per group in v6). A first try widened x from bf16
# registers inside the kernel, and ptxas re-derived the widened, masked x inside the loop to stay under 128
# registers. Loading the fp32 values leaves it nothing to re-derive.
#
# Per row group (4 rows, 7 vectors per lane) in SASS, from the same ptxcheck record:

# %%
group_loop, newest = {}, ""
for path in glob.glob(os.path.join(nbtools.ROOT, "traces", "cpu", "ptxcheck-*.json")):
    with open(path) as f:
        doc = json.load(f)
    rows = [r for r in doc["records"] if r.get("sass") and "fused in_proj" in r["kernel"] and r["M"] == 1]
    if not any("v9" in r["kernel"] for r in rows) or doc["environment"].get("date", "") < newest:
        continue                 # the newest record that has v9's loop
    group_loop, newest = {}, doc["environment"].get("date", "")
    for r in rows:
        k = r["kernel"][len("attnres_rms_gemv (fused in_proj, "):-1].split(",")[0]
        if k not in group_loop or r["instructions"] > group_loop[k]["instructions"]:   # the outer loop
            group_loop[k] = dict(r, source=os.path.basename(path))
for k, r in sorted(group_loop.items(), key=lambda kv: int(kv[0][1:].split()[0])):
    print(f"{k:22s} {r['instructions']:4d} SASS instructions per row group, {r['registers']} registers, "
          f"LDG {r['opcodes'].get('LDG', 0)}, LDS {r['opcodes'].get('LDS', 0)}, FMUL {r['opcodes'].get('FMUL', 0)}"
          f"  ({r['source']})")

# %% [markdown]
# Measured, each row against the default in one run (kernel bench with L2 flushed, then the attention half of
# the layer at b1, then Nsight Compute on the kernel alone):

# %%
_, xf_ab = nbtools.kernel_ab("traces/h200/kernels-5f1f620-s21b.json", "attnres_rms_gemv", "attnres_rms_gemv@xf",
                             (1, 2))
xr_rows, xr_ab = nbtools.kernel_ab("traces/h200/kernels-c1bb65a-s22.json", "attnres_rms_gemv",
                                   "attnres_rms_gemv@xr", (1,))
print(xf_ab)
print(xr_ab)
print(nbtools.ab_table("traces/h200/records-c1bb65a-s22.json", "attn", ["stock", "fast", "fast-inxr"]))
in_ncu = ["traces/h200/ncu-5f1f620-ncu3/ncu-bench_kernel_attnres_rms_gemv_shape_k3_rank16_batch_1.txt",
          "traces/h200/ncu-5f1f620-ncu3/ncu-bench_kernel_attnres_rms_gemv@xf_shape_k3_rank16_batch_1.txt",
          "traces/h200/ncu-c1bb65a-s22/ncu-bench_kernel_attnres_rms_gemv@xr_shape_k3_rank16_batch_1.txt"]
print(nbtools.ncu_table(in_ncu))

# %% [markdown]
# v9 halves the instructions per row group, and the kernel takes the same 20.8-20.9 µs. The warps now wait 14
# cycles per issued instruction instead of 9.2, mostly on loads (long scoreboard) and at the reduction's barrier.
# v8 was slower: it doubled the loop's shared-memory reads of x. With v3 (twice the loads in flight per
# round trip, section 6's version log) and v4 / v7 (deeper L2 prefetch), this rules out issue, round trips and
# prefetch depth as the limit. What is left is the bytes each SM streams. The kernel moves ~25 GB/s per busy SM,
# about what the router front reaches per SM, and 17 of the 132 SMs are idle: 804 groups of 4 rows take 7 rounds
# either way, so the grid is 115 CTAs of 7 groups. v10 (`even_rows`, impls `fast-inev` / `fast-inev126`) gave
# every SM 24-25 rows instead of 28 on 115, bit-identical by construction. `scripts/h200_next.sh s23` measured it
# at 0e81145 (`kernels-0e81145-s23.json`, `records-0e81145-s23.json`): no gain. Bench rank16 b1 22.98 µs default
# against 23.39 (132 CTAs) / 23.23 (126), rank8 b1 33.50 against 33.92 / 34.24; attention half rank16 b1 33.2
# against 33.3 / 33.6 µs, rank8 b1 47.3 against 47.9 / 48.0. Fewer rows on the busiest SM did not shorten the
# kernel. Its busiest CTAs still run 7 rounds of row groups (the last a single row), which suggests the rounds,
# not the rows, set the time.
# v8 and v9 were removed from `k3fast/rms_gemv.py` after these runs (their code is at commits 5f1f620 and c1bb65a),
# and v10 after s23 (its code is at 0e81145); the records above keep what they measured.

# %% [markdown]
# ## 12. Taking the prologue out again (v11, session 15), and the k split once more
# If the loop's time were the prologue's fault, the fix would be to let the weights stream while the prologue runs.
# v11 (`fast-insplit1` / `fast-insplit3`) ran the prologue as its own one-CTA kernel (`attnres_rmsnorm`, which
# triggers its PDL dependent right after its wait) and let the GEMV's CTAs copy their first 1 or 3 row groups into
# shared memory before their own wait. Bit-identical to the fused kernel (GPU tests passed). `s42` measured it
# beside the fused kernel and stock; the replay timeline shows when each kernel started.

# %%
import json
s42 = "traces/h200/records-b2bc614-s42.json"
print(nbtools.ab_table(s42, "attn", ["stock", "fast", "fast-insplit1", "fast-insplit3"], shape="k3_rank16"))
print(nbtools.ab_table(s42, "attn", ["stock", "fast", "fast-insplit1", "fast-insplit3"], shape="k3_rank8"))
with open(os.path.join(nbtools.ROOT, s42)) as f:
    attn42 = {(r["shape"], r["batch"], r["impl"]): r for r in json.load(f)["records"] if r["part"] == "attn"}
for impl in ("fast", "fast-insplit1", "fast-insplit3"):
    ks_ = attn42[("k3_rank16", 1, impl)]["replay_timeline"]["kernels"]
    print(f"rank16 b1 {impl:14s} " + " | ".join(f"{k[0].split('_build')[0][28:]} {k[1]:.1f}+{k[2]:.1f}" for k in ks_))
kern43 = {}
with open(os.path.join(nbtools.ROOT, "traces/h200/kernels-a0dda2a-s43.json")) as f:
    for r in json.load(f)["records"]:
        kern43[(r["kernel"], r["shape"], r["batch"])] = r
print(f"{'(bench, µs)':28s}" + "".join(f"{sh[3:]} b{b:<6d}" for sh in ("k3_rank16", "k3_rank8") for b in (1, 2)))
for name in ("attnres_rms_gemv", "attnres_rms_gemv@ks1", "attnres_rms_gemv@ks2", "attnres_rms_gemv@ks8",
             "gemv_in_proj_plain"):
    print(f"{name:28s}" + "".join(f"{kern43[(name, sh, b)]['fast_us_median']:12.1f}"
                                  for sh in ("k3_rank16", "k3_rank8") for b in (1, 2)))
print(f"{'cuBLAS (torch F.linear)':28s}" + "".join(f"{kern43[('gemv_in_proj_plain', sh, b)]['stock_us_median']:12.1f}"
                                                for sh in ("k3_rank16", "k3_rank8") for b in (1, 2)))

# %% [markdown]
# v11 lost everywhere, and the timeline says why: the GEMV's first CTA started 3.8 µs after the prologue kernel,
# when that kernel ended. `attnres_rmsnorm` triggered its dependents at its end, not after its wait, and the design
# had assumed the early trigger without checking. So nothing was staged while the prologue ran, and s42 did not test
# the idea. (In the layer's timelines a dependent arrives ~0.6-1 µs after its primary's trigger: the tail after
# the experts' wait.) v11.1 adds the early trigger to the prologue kernel, for session 16 to measure (`s44`).
#
# The same timeline separates the in_proj's parts for the first time. Without its prologue the GEMV took 17.7 µs
# (x from L2) against the fused kernel's 19.6 with it. So the prologue costs ~2 µs, and the loop's pace (~2.7 TB/s)
# is the rest. The k split (s43, bench) stays at 4: ks 1 / 2 / 8 are all slower. cuBLAS's GEMV alone is faster
# than our plain FMA GEMV (19.9 against 22.4 µs at rank16 b1), so the loop itself is the next thing to change.

# %%
nc = {os.path.basename(p).split("rms_gemv")[1].split("_shape")[0] or "default": nbtools.recorded_ncu(p)
      for p in in_ncu}
# the claims above, read back from the records: v9 at least halves the loop, and moves the time by under 3 %
assert group_loop["v9 x in registers"]["instructions"] <= 0.55 * group_loop["v6 pinned"]["instructions"]
assert abs(xr_rows[("attnres_rms_gemv@xr", "k3_rank16", 1)] / xr_rows[("attnres_rms_gemv", "k3_rank16", 1)] - 1) < 0.03
assert abs(nc["@xr"]["duration_us"] / nc["default"]["duration_us"] - 1) < 0.03
assert nc["@xr"]["cycles_per_issue"] > 1.4 * nc["default"]["cycles_per_issue"]
print("ok (v9)")

# %%
assert err < 1e-12
assert rec["source"] is None or rec["failed"] == 0
assert recs, "traces/cpu has no ptxcheck record with serial-load counts"
print("ok")
v6 = {M: r for (k, M), r in loop.items() if "v6" in k}
v8 = {M: r for (k, M), r in loop.items() if "v8" in k}
assert v6 and all(v8[M]["instructions"] <= 0.75 * v6[M]["instructions"] for M in v6)
assert all(v8[M]["opcodes"].get("FMUL", 0) == 0 < v6[M]["opcodes"]["FMUL"] for M in v6)
print("ok (v8)")
assert all(attn42[(sh, b, i)]["replay_us_median"] > attn42[(sh, b, "fast")]["replay_us_median"]
           for sh in ("k3_rank16", "k3_rank8") for b in (1, 2) for i in ("fast-insplit1", "fast-insplit3"))
tl = {k[0]: k for k in attn42[("k3_rank16", 1, "fast-insplit3")]["replay_timeline"]["kernels"]}
first, second = sorted(tl.values(), key=lambda k: k[1])[:2]
assert second[1] > 0.9 * (first[1] + first[2])          # the GEMV arrived as the prologue kernel ended
assert all(kern43[(f"attnres_rms_gemv@ks{k}", sh, b)]["fast_us_median"] > kern43[("attnres_rms_gemv", sh, b)]["fast_us_median"]
           for k in (1, 2, 8) for sh in ("k3_rank16", "k3_rank8") for b in (1, 2))
print("ok (v11, k split)")

# %% [markdown]
# ## 13. A different engine: the weights through a bulk-copy ring (v12, session 16)
# First, v11.1 (`s44`): the prologue kernel now launched the GEMV right after its wait, so the GEMV's CTAs did copy
# their first row groups while the prologue ran. It was slower again. The prologue kernel stretched while the
# copies ran, and the GEMV still ended where the fused kernel does: staging the first groups does not speed up the
# loop after them. v11 is gone (its code is at 6874cfa).
#
# Then Nsight Compute on the question s43 left (`ncu5`): what does cuBLAS's GEMV do on the same x and weights? It
# is `nvjet_sm90_tst_64x8…`, a TMA + WGMMA kernel: ~100 CTAs of 384 threads, each with a 164 KB shared-memory
# pipeline, and a fifth of our instructions. The TMA unit keeps a whole pipeline of weights in flight per SM without
# a register or a load instruction per 16 bytes, which is what sessions 10-12 could not buy with register loads.

# %%
ncu5 = ["traces/h200/ncu-b845cf5-ncu5/ncu-bench_kernel_gemv_in_proj_plain_shape_k3_rank8.txt",
        "traces/h200/ncu-b845cf5-ncu5/ncu-bench_kernel_gemv_in_proj_plain_shape_k3_rank8_stock_1.txt",
        "traces/h200/ncu-b845cf5-ncu5/ncu-bench_kernel_gemv_in_proj_plain_shape_k3_rank16.txt",
        "traces/h200/ncu-b845cf5-ncu5/ncu-bench_kernel_gemv_in_proj_plain_shape_k3_rank16_stock_1.txt"]
print(nbtools.ncu_table(ncu5))
with open(os.path.join(nbtools.ROOT, ncu5[1])) as f:
    print([ln.strip() for ln in f if ln.strip().startswith("nvjet")][0][:90])

# %% [markdown]
# `k3fast/rms_gemv_ring.py` does that without a tensor map. One CTA per SM owns a contiguous run of weight rows, so
# its bytes are one contiguous range. A producer warp copies two rows (28 KB) at a time with `cp.async.bulk` into a
# ring of 6-8 shared-memory slots; each slot has a "full" mbarrier (the copy's byte count completes it) and an
# "empty" one (each of the 14 consumer warps arrives once it has read the slot). A consumer warp takes a seventh of
# a row's K, with its x values in registers, so the loop reads only weights from shared memory. The first slots fill
# before the PDL wait. The AttnRes prologue (rms_gemv's code, unchanged) stages its source rows in the ring's later
# slots, which the producer fills after the prologue's last read, behind a proxy fence.

# %%
from k3fast.kernels import rms_gemv_ring
print("grid, busiest CTA's chunks (rank16 / rank8):", [(rms_gemv_ring.grid_for(n), rms_gemv_ring.chunks_max(n))
                                                      for n in (3216, 6288)])
print("ring slots, filled before the prologue (M = 1, n_blocks = 1 / 8):",
      [rms_gemv_ring.ring_plan(1, 7168, nb, rms_gemv_ring.chunks_max(6288), True) for nb in (1, 8)])
if dsl_available():
    ring_ptx = [ln.strip() for ln in rms_gemv_ring.ring_ptx(N16).splitlines()]
    first = lambda pat: next(i for i, ln in enumerate(ring_ptx) if pat in ln)   # noqa: E731
    print("PTX line of the first bulk copy / the PDL wait / the proxy fence:",
          first("cp.async.bulk.shared::cluster.global"), first("griddepcontrol.wait"),
          first("fence.proxy.async.shared::cta"))

# %% [markdown]
# `s45` measured it beside the FMA kernels and cuBLAS (kernel bench, L2 flushed, one run), then the attention half
# with it (`fast-inring`) beside stock; `s46` repeated the layer A/B with the ring as the default (`fast-infma` is
# the FMA kernel).

# %%
kern45 = {}
with open(os.path.join(nbtools.ROOT, "traces/h200/kernels-afcdadf-s45.json")) as f:
    for r in json.load(f)["records"]:
        kern45[(r["kernel"], r["shape"], r["batch"])] = r
cells = [(sh, b) for sh in ("k3_rank16", "k3_rank8") for b in (1, 2)]
print(f"{'(bench, µs)':28s}" + "".join(f"{sh[3:]} b{b:<6d}" for sh, b in cells))
for name in ("gemv_in_proj_plain", "gemv_in_proj_plain@ring", "attnres_rms_gemv", "attnres_rms_gemv@ring"):
    print(f"{name:28s}" + "".join(f"{kern45[(name, sh, b)]['fast_us_median']:12.1f}" for sh, b in cells))
print(f"{'cuBLAS (torch F.linear)':28s}" + "".join(f"{kern45[('gemv_in_proj_plain', sh, b)]['stock_us_median']:12.1f}"
                                                for sh, b in cells))
print(nbtools.ncu_table(["traces/h200/ncu-afcdadf-ncu7/ncu-bench_kernel_gemv_in_proj_plain@ring_shape_k3_rank8.txt",
                         "traces/h200/ncu-afcdadf-ncu7/ncu-bench_kernel_attnres_rms_gemv@ring_shape_k3_rank16.txt",
                         "traces/h200/ncu-afcdadf-ncu7/ncu-bench_kernel_attnres_rms_gemv_shape_k3_rank16.txt"]))
s46 = "traces/h200/records-d9e6f60-s46.json"
for sh in ("k3_rank16", "k3_rank8"):
    print(nbtools.ab_table(s46, "attn", ["stock", "fast", "fast-infma"], shape=sh))
with open(os.path.join(nbtools.ROOT, "traces/h200/records-afcdadf-s45.json")) as f:
    attn45 = {(r["shape"], r["batch"], r["impl"]): r for r in json.load(f)["records"] if r["part"] == "attn"}
for impl in ("fast", "fast-inring"):
    ks_ = attn45[("k3_rank8", 1, impl)]["replay_timeline"]["kernels"]
    print(f"rank8 b1 {impl:12s} " + " | ".join(f"{k[0].split('_build')[0][28:]} {k[1]:.1f}+{k[2]:.1f}" for k in ks_))

# %% [markdown]
# The bare ring reads the rank8 in_proj at 3.45 TB/s, 82 % of the copy bandwidth measured in the same run, where
# the FMA GEMV reaches 2.63 and cuBLAS 3.0; with the prologue it is 4-6 µs faster than the fused FMA kernel at every
# cell. In the attention half it gains 2 µs at b1 and ~4 at b2: rank16 b1 is 2.08x stock, b2 2.16x. Rank8 b1 stays
# at 1.69x. The timeline says where the rest went: the KDA step's CTAs, launched by the ring's early trigger, sit
# beside the ring's CTAs from 2.5 µs, and after the ring ends the KDA step and o_proj take ~3 µs longer than they do
# after the FMA kernel. `fast-ringlate` (the ring's trigger at its end) is written to test that (`s47`).

# %%
assert all(kern45[("gemv_in_proj_plain@ring", sh, b)]["fast_us_median"]
           < min(kern45[("gemv_in_proj_plain", sh, b)]["fast_us_median"],
                 kern45[("gemv_in_proj_plain", sh, b)]["stock_us_median"]) for sh, b in cells)
assert all(kern45[("attnres_rms_gemv@ring", sh, b)]["fast_us_median"]
           < kern45[("attnres_rms_gemv", sh, b)]["fast_us_median"] - 3 for sh, b in cells)
with open(os.path.join(nbtools.ROOT, s46)) as f:
    attn46 = {(r["shape"], r["batch"], r["impl"]): r for r in json.load(f)["records"] if r["part"] == "attn"}
assert all(attn46[(sh, b, "fast")]["replay_us_median"] < attn46[(sh, b, "fast-infma")]["replay_us_median"]
           for sh, b in cells)
assert all(attn46[(sh, b, "stock")]["replay_us_median"] / attn46[(sh, b, "fast")]["replay_us_median"] > 1.8
           for sh in ("k3_rank16",) for b in (1, 2))
tl = attn45[("k3_rank8", 1, "fast-inring")]["replay_timeline"]["kernels"]
assert tl[1][1] < 0.2 * tl[0][2]          # the KDA step arrived early in the ring's run
print("ok (v12)")

# %% [markdown]
# ## 14. When the ring lets its dependent in, and both tokens at once (v12.1, v12.2; session 17)
# Two changes to the ring, each measured beside stock and beside the other setting in the same run:
# * v12.1 launches the KDA step at the ring's end instead of right after its wait (`fast-ringlate` in `s47`; the
#   default since, `fast-ringearly` is the A/B). The early trigger had been a win for every other kernel of the
#   chain, because their dependents do little before their own wait. Here the KDA CTAs took room on the ring's
#   SMs for the ring's whole 25 µs, and the chain after it ran slower.
# * v12.2 runs the AttnRes prologue of both tokens phase by phase in one pass (`rms_gemv._attnres_tokens`): one
#   round of source loads and one CTA barrier per reduction instead of one per token, and w_ln loaded with u. Each
#   token's arithmetic is unchanged, so it is bit-identical (GPU test), and the one-token prologue is the same code
#   called with one token (the PTX of every earlier kernel is unchanged). `fast-injoint` in `s48`, the default
#   since `s49` (`fast-nojoint` the A/B).

# %%
for rec_file, impls in (("traces/h200/records-8574eb7-s47.json", ["stock", "fast", "fast-ringlate"]),
                        ("traces/h200/records-d8196e2-s48.json", ["stock", "fast", "fast-ringearly", "fast-injoint"]),
                        ("traces/h200/records-5f15bc1-s49.json", ["stock", "fast", "fast-nojoint"])):
    for sh in ("k3_rank8", "k3_rank16"):
        print(nbtools.ab_table(rec_file, "attn", impls, shape=sh))
print(nbtools.replay_timeline("traces/h200/records-8574eb7-s47.json", "attn", "fast", 1, "k3_rank8"))
print(nbtools.replay_timeline("traces/h200/records-8574eb7-s47.json", "attn", "fast-ringlate", 1, "k3_rank8"))
kern48 = {}
with open(os.path.join(nbtools.ROOT, "traces/h200/kernels-d8196e2-s48.json")) as f:
    for r in json.load(f)["records"]:
        kern48[(r["kernel"], r["shape"], r["batch"])] = r["fast_us_median"]
print(f"{'(bench, µs)':28s}" + "".join(f"{sh[3:]} b{b:<6d}" for sh, b in cells))
for name in ("gemv_in_proj_plain@ring", "attnres_rms_gemv@ring", "attnres_rms_gemv@ringjoint"):
    print(f"{name:28s}" + "".join(f"{kern48[(name, sh, b)]:12.1f}" for sh, b in cells))

# %% [markdown]
# The late trigger is worth 0.6-3.3 µs in every b1 / b2 cell, most at rank8 b1, where the KDA step now takes 6.0 µs
# after the ring instead of 7.2. The joint prologue gained 0.2-1.0 µs, half of the 1.5-2.5 predicted at b2: the
# other half of the second token's cost is not its latency chain. The bare ring is still 2-3 µs under the fused one;
# what the rest of the prologue's cost is has not been measured. With both, rank8's attention half sits on the 1.8x
# line (1.76-1.85x at b1 over three runs; the stock half moves by 3 µs between runs, ours by 0.4).

# %%
def attn_us(rec_file):
    with open(os.path.join(nbtools.ROOT, rec_file)) as f:
        return {(r["shape"], r["batch"], r["impl"]): r["replay_us_median"] for r in json.load(f)["records"]
                if r["part"] == "attn"}
a47, a48, a49 = (attn_us(f"traces/h200/records-{t}.json") for t in ("8574eb7-s47", "d8196e2-s48", "5f15bc1-s49"))
assert a47[("k3_rank8", 1, "fast-ringlate")] < a47[("k3_rank8", 1, "fast")] - 1.5
assert all(a48[(sh, b, "fast-ringearly")] > a48[(sh, b, "fast")] for sh, b in cells)
assert all(a48[(sh, b, "fast-injoint")] < a48[(sh, b, "fast")] for sh, b in cells)
assert all(a49[(sh, b, "fast")] < a49[(sh, b, "fast-nojoint")] for sh, b in cells)
assert all(kern48[("attnres_rms_gemv@ringjoint", sh, 2)] < kern48[("attnres_rms_gemv@ring", sh, 2)]
           for sh in ("k3_rank16", "k3_rank8"))
print("ok (v12.1, v12.2)")

# %% [markdown]
# ## 15. Batch 3-8: a tensor-core consumer on the same ring (v13, session 20) and a tiled weight (v14, session 21)
# Above M = 2 the AttnRes + RMSNorm prologue runs as its own kernel (`attnres_rmsnorm`, one CTA per token), and the
# GEMV behind it was cuBLAS's nvjet 64x8, which is not PDL-launched. v13 (`gemv_ring_mma`) keeps the bulk-copy ring
# and replaces the FMA consumer by eight mma.sync warps, x staged once in shared memory; the norm kernel launches it
# right after its wait, so the ring fills while the norm's M CTAs run. Each ring chunk is one 16-row tile x 512
# columns, fetched as 16 row pieces of 1 KB. v14 re-lays the weight once (`mma_tile_weight`) so that a chunk is one
# contiguous 16 KB copy, already in the order the consumer lanes read their fragments; the arithmetic is v13's, so
# the result is the same bits (GPU test). It is opt-in (`fast-intiled`): the layer would then hold the in_proj
# twice, because the M <= 2 ring and cuBLAS read it row-major.
#
# Predicted for v14: the bare GEMV at rank8 b8 29.3 -> ~26.5 µs (v12's pace on the same bytes). Measured (s66,
# below): 29.5 -> 28.6. The request size was a third of the gap; the rest of it is not understood yet.

# %%
kern66 = {}
with open(os.path.join(nbtools.ROOT, "traces/h200/kernels-2c88954-s66.json")) as f:
    for r in json.load(f)["records"]:
        kern66[(r["kernel"], r["shape"], r["batch"])] = (r["fast_us_median"], r["stock_us_median"], r["floor_us"])
mid_cells = [("k3_rank16", 8), ("k3_rank8", 4), ("k3_rank8", 8)]
print(f"{'(bench, µs; cuBLAS / floor)':34s}" + "".join(f"{sh[3:]} b{b:<6d}" for sh, b in mid_cells))
for name in ("gemv_in_proj_plain@ringmma", "gemv_in_proj_plain@ringmmatiled"):
    print(f"{name:34s}" + "".join(f"{kern66[(name, sh, b)][0]:12.1f}" for sh, b in mid_cells))
print(f"{'cuBLAS F.linear':34s}" + "".join(f"{kern66[('gemv_in_proj_plain@ringmma', sh, b)][1]:12.1f}" for sh, b in mid_cells))
print(f"{'floor':34s}" + "".join(f"{kern66[('gemv_in_proj_plain@ringmma', sh, b)][2]:12.1f}" for sh, b in mid_cells))
for rec_file in ("traces/h200/records-2c88954-s66.json", "traces/h200/records-561d389-s68.json"):
    print(nbtools.ab_table(rec_file, "attn", ["stock", "fast", "fast-intiled"], shape="k3_rank8"))
assert all(kern66[("gemv_in_proj_plain@ringmmatiled", sh, b)][0] < kern66[("gemv_in_proj_plain@ringmma", sh, b)][0]
           for sh, b in mid_cells)
print("ok (v14 faster than v13 in the bench at each cell)")

# %% [markdown]
# ## 16. The norm kernel as a cluster of 4 CTAs per token (v15, session 23)
# Above M = 2 the AttnRes + RMSNorm prologue runs as its own kernel, one CTA of 16 warps per token. Its statistics need
# the whole 7168-wide token, which is why one CTA owned it. With a thread-block cluster, four CTAs can each take a
# quarter of the columns and still agree on the statistics: each pushes its partial sums (per source `Σv²` and
# `⟨v, u⟩`, then `Σm²`) into every CTA's shared memory with `st.shared::cluster`, a cluster barrier publishes them,
# and every CTA adds the four rows in rank order, so all four compute the same `α` and `rstd` bit for bit.
#
# The numerics in one picture: the same statistics summed as four quarter sums differ from the one-CTA sums only by
# fp32 order (the GPU test holds the two builds within 1 bf16 ulp of each other; below, the same split in fp32 on the
# CPU).

# %%
torch.manual_seed(23)
src = (torch.randn(5, 7168) * (0.5 + torch.rand(5, 1))).float()        # 4 blocks + p', one token
u = torch.randn(7168) * 0.05
whole = torch.stack([(src * src).sum(-1), src @ u], -1)
quarters = sum(torch.stack([(q * q).sum(-1), q @ uq], -1)
               for q, uq in zip(src.split(1792, -1), u.split(1792)))      # 4 CTAs x 1792 columns, added in rank order
print("max relative difference of the statistics:", ((quarters - whole).abs() / whole.abs()).max().item())
assert ((quarters - whole).abs() <= 1e-5 * whole.abs() + 1e-6).all()

# %% [markdown]
# Predicted (before the run): the two norms in the layer 3.8 + 4.7 -> ~2 + ~2.5 µs, the attention half -3.5 to -4.5
# µs at b16 / b64. Measured (s73, `fast-normc1` is one CTA per token): the norms moved by ~0.8 µs at b16 and hardly at
# b64, the attention half by -0.7 to -1.5 µs. A quarter of the bytes per CTA did not shorten the kernel much: its
# 3-4 µs is the chain (launch, the sources' DRAM round trip, two reductions, the stores), not one SM's bytes. Still
# faster in every cell, so the default from M = 3.

# %%
for shape in ("k3_rank16", "k3_rank8"):
    print(nbtools.ab_table("traces/h200/records-934c387-s73.json", "attn",
                           ["stock", "fast", "fast-normc1", "fast-normc3"], shape))
with open(os.path.join(nbtools.ROOT, "traces/h200/records-934c387-s73.json")) as f:
    rec73 = {(r["shape"], r["batch"], r["impl"]): r for r in json.load(f)["records"] if r["part"] == "attn"}
for (shape, batch, impl), r in sorted(rec73.items()):
    if impl in ("fast", "fast-normc1") and (shape, batch, "fast-normc1") in rec73:
        norms = [k[2] for k in r["replay_timeline"]["kernels"] if "AttnResNorm" in k[0]]
        print(f"{shape:10s} b{batch:<3d} {impl:12s} norms " + " + ".join(f"{t:.1f}" for t in norms) + " µs")
assert all(rec73[(s, b, "fast")]["replay_us_median"] < rec73[(s, b, "fast-normc1")]["replay_us_median"]
           for (s, b, i) in rec73 if i == "fast-normc1")
print("ok (the clusters faster than one CTA per token in every cell of s73)")

# %% [markdown]
# ## 17. Above batch 8: which cuBLAS kernel (session 24)
# Above M = 8 the in_proj is one library GEMM after the norm kernel. Which kernel cuBLAS runs depends on how it is
# called. `python -m k3fast.blas_probe` times the same product through torch's entry points on cold weights (two
# GEMMs per CUDA graph, L2 flushed before each replay). At every shape of the attention half both BLAS libraries
# pick the same kernel, except the rank16 in_proj at M = 64: cublas splits K over a 64x64-tile kernel and adds a
# reduce kernel, cublasLt runs one 64x32 kernel over all of K. So the layer calls this one GEMM with cublasLt
# preferred (`fast.INPROJ_BLAS`, `fast.blas_library`): a launch fewer, the in_proj 1.6 µs shorter in the layer, the
# attention half -1.25 µs at rank16 b64 (s82; `fast-inmm` is torch's default library). Still 1.5x the GEMM's
# byte floor: the next tool to build, not to pick.

# %%
with open(os.path.join(nbtools.ROOT, "traces/h200/blasprobe-7e1a15e-s81.json")) as f:
    probe = json.load(f)
print(f"blasprobe-7e1a15e-s81.json, copy {probe['copy_tbps']:.3f} TB/s: in_proj µs per GEMM (kernels)")
cells = {(r["shape"], r["M"], r["form"]): r for r in probe["records"] if r["gemm"] == "in_proj"}
for (shape, M, form), r in sorted(cells.items()):
    if form in ("mm", "lt"):
        names = ", ".join(n.split("_v_")[0].split("_h_")[0] for n in r["kernel_names"])
        print(f"  {shape:10s} M={M:<3d} {form:3s} {r['us_median']:6.2f} ({r['kernels_per_gemm']:.0f})  floor "
              f"{r['floor_us']:5.2f}  {names}")
assert cells[("k3_rank16", 64, "mm")]["kernels_per_gemm"] == 2 and cells[("k3_rank16", 64, "lt")]["kernels_per_gemm"] == 1
assert all(set(cells[(s, m, "mm")]["kernel_names"]) == set(cells[(s, m, "lt")]["kernel_names"])
           for (s, m, f) in cells if f == "mm" and (s, m) != ("k3_rank16", 64))
from k3fast import layer as fast_mod
assert fast_mod.INPROJ_BLAS == "cublaslt"
print(nbtools.ab_table("traces/h200/records-3b5c7d3-s82.json", "attn", ["stock", "fast", "fast-inmm"]))

# %% [markdown]
# ## 18. Writing that tool: a WGMMA GEMM with a cluster K split (session 25; opt-in)
# `k3fast/gemm_wgmma_splitk.py` turns the skinny product around: the tokens are WGMMA's m64 (x's rows past M are
# zero-filled by the TMA unit), and a CTA's BN rows of W are its n. Both operands come through one TMA ring of
# 128-byte-swizzled stages. One warp produces; one warpgroup consumes. At M = 64 one W tile per SM would be ~24 rows,
# so x (917 KB) would be re-read from L2 for every 24 rows. Instead the K range is split over a cluster of S CTAs.
# Their fp32 partials are added in rank order through distributed shared memory, so every run gives the same bits.
# W does not depend on the norm kernel before it, so the whole ring of W is requested before the PDL wait.
#
# The plan picks S and BN so that every cluster is co-resident in one wave: 15 clusters of 8 x 224 rows at rank16,
# 29 of 4 x 224 at rank8 (31 of 4 x 208 until session 26, when `k3fast.cluster_probe` measured 30 co-resident
# clusters of 4 where the table said 32).

# %%
from k3fast.kernels import gemm_wgmma_splitk as gw
for tp, N in ((16, N16), (8, kmod.proj_width(k3_rank(8).kda_heads))):
    BN, S, D, BK = gw.plan(N, 7168)
    print(f"rank{tp}: N = {N}: {-(-N // BN)} clusters of S = {S} CTAs, BN = {BN} rows, a ring of {D} x "
          f"{gw.stage_bytes(BN, BK) // 1024} KB; per CTA {BN} rows x {7168 // S} columns")
if dsl_available():
    lines = [ln.strip() for ln in gw.gemm_ptx(N16).splitlines()]
    wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
    print("TMA copies before the producer's PDL wait:", sum(ln.startswith("cp.async.bulk.tensor") for ln in lines[:wait]),
          "(the W prefetch loop); WGMMAs per stage:", sum(ln.startswith("wgmma.mma_async") for ln in lines),
          "; remote loads in the epilogue:", sum(ln.startswith("ld.shared::cluster") for ln in lines))
else:
    print("CuTe DSL not installed: PTX view skipped")

# %% [markdown]
# The prediction was 11.5-13 µs for the bare GEMM at rank16 b64 (3.3-3.4 TB/s; the M <= 2 ring streams at 3.45).
# On the H200 it streams at ~2.5-2.7 TB/s at every batch and width. Each row below is one kernel-bench run, with
# cublasLt in the same run:
# * v1: 64-wide stages, 6 of them.
# * v1.1: 128-wide stages, so each W row arrives 256 bytes at a time; 3 of them.
# * Rings small enough for two CTAs per SM (`d3`, `d2`).
# * Fewer clusters than the wave allows (`8bn256`: 13 clusters of 8; `4bn128`: 26 of 4).
#
# The row `wgmma` is the default build of its commit: v1 in s86, v1.1 in s88 (where `wgmmak64` has v1's stages), and
# in s89 v1's stages again, with v1.1's epilogue.

# %%
for f in ("kernels-076be23-s86.json", "kernels-24cb2aa-s88.json", "kernels-40ec5cc-s89.json",
          "kernels-81d3be3-s90q.json"):
    with open(os.path.join(nbtools.ROOT, "traces/h200", f)) as fh:
        doc = json.load(fh)
    print(f"{f} (copy {doc['copy_tbps']:.2f} TB/s): bare GEMM µs / TB/s, cublasLt in the same run")
    for r in doc["records"]:
        if r["kernel"].startswith("gemm_in_proj_plain@wgmma"):
            print(f"  {r['kernel'][19:]:16s} {r['shape']:10s} b{r['batch']:<3d} {r['fast_us_median']:6.1f} "
                  f"{r['achieved_tbps']:5.2f}   cublasLt {r['stock_us_median']:6.1f}")

# %% [markdown]
# What the variants rule out:
# * x's re-reads: b16 and b64 take the same time.
# * The piece size: 256-byte pieces (v1.1) are no faster.
# * The wave at rank16: fewer clusters change nothing.
#
# At rank8, a ring small enough for two CTAs per SM gains 5 µs, so not all 31 clusters of 4 fit at one CTA per SM.
# In the layer only one cell gains, rank16 b16, where cuBLAS runs split-K plus a reduce kernel. The timelines
# below are from the records of s87. The epilogue is short: with v1.1's trigger after the cluster barrier, the KDA
# step starts ~1.6 µs before the GEMM ends (records-24cb2aa-s88.json). So the main loop itself is slow.
#
# v2 reads the weight from its tiled copy (`tile_weight`), so each stage's W tile is one contiguous run. s90q (the
# last block of rows above) ran it: no faster (`tiled`, `tiledd3`). Neither are cuBLAS's own tilings without a K
# split (`1bn32`, `1bn64`). And the ring with its WGMMAs taken out (`nomma`) is as slow as the GEMM: the memory side
# sets the pace, not the tensor cores. §19 has what Nsight Compute added.

# %%
print(nbtools.ab_table("traces/h200/records-076be23-s87.json", "attn", ["stock", "fast", "fast-inwg", "fast-inwglate"]))
print(nbtools.ab_table("traces/h200/records-076be23-s87.json", "attn", ["stock", "fast", "fast-inwg"], shape="k3_rank8"))
for impl in ("fast", "fast-inwg"):
    print(nbtools.replay_timeline("traces/h200/records-076be23-s87.json", "attn", impl, batch=16))
rec = nbtools.recorded_gpu_tests("test_gemm_wgmma_splitk")
print(f"recorded H200 tests of the GEMM: {rec['passed']} passed, {rec['failed']} failed ({rec['source']})")
assert rec["failed"] == 0 and rec["passed"] > 0
if torch.cuda.is_available():
    xg = torch.randn(64, 7168, device="cuda").to(torch.bfloat16)
    wgt = (torch.randn(N16, 7168, device="cuda") * 7168 ** -0.5).to(torch.bfloat16)
    yg = gw.gemm_wgmma(xg, wgt)
    ref = xg.float() @ wgt.float().T
    err = float((yg.float() - ref).norm() / ref.norm())
    print(f"live: rel err vs fp32 {err:.2e}; {nbtools.time_live(lambda: gw.gemm_wgmma(xg, wgt)):.1f} µs (warm L2)")
    assert err < 1e-2

# %% [markdown]
# ## 19. Where it stands, and the one place it is the default (session 26)
# Nsight Compute at rank16 b64 (s91, each kernel alone, cold caches): this GEMM 19.6 µs with DRAM 52 % busy, its
# ring without WGMMAs 18.3 µs (56 %), cublasLt's kernel 16.7 µs (62 %). Half of this kernel's warp-stall samples are
# its consumers waiting for a full stage, and its producer finds all six stages still in flight ~40 % of its time: the
# ring depth binds while the DRAM is half busy. Each stage carries x's tile too (22 % of its bytes); cuBLAS's tiling
# (by inference from its name and grid) shares each W tile between two CTAs by multicast. Both are leads, not
# measurements of a fix.
#
# Where it already wins is rank16 at batch 9..16: there cuBLAS runs split-K plus a reduce kernel, and this kernel's
# prefetch overlaps the norm. Four runs put it ahead there (38.8 / 40.1 / 39.9 / 40.1 µs against 42.7 / 43.1 / 42.1 /
# 42.2), so since session 26 `fast.inproj_wide_choice` picks it at M 9..16 for widths up to 4096.
#
# Session 27 found what cuBLAS's tiling had over it at rank8's width. Each ring stage used to load a 64-row x box,
# and at M = 16 the TMA unit zero-fills 48 of those rows. Tilings whose x box is large next to their W tile ran 30 %
# slower at M = 16 than at M = 64. v3 (`xrows="auto"`) loads only the token bucket's rows. The WGMMA still reads 64
# rows, but the extra rows only make output rows that are never stored. With 66 clusters of 2 x 96 rows, the bare GEMM
# at rank8 b16 went 33.1 -> 29.4 µs (cublasLt 28.5). Since its weights stream while the norm runs, the rule now takes
# it at rank8 for M 9..64 too (`fast.INPROJ_WIDE_PINS_WIDE`). `fast-inwgoff` is the A/B (cuBLAS at every M > 8).

# %%
from k3fast.layer import inproj_wide_choice
print({M: inproj_wide_choice(M, N16) for M in (9, 16, 17, 64)},
      {M: inproj_wide_choice(M, kmod.proj_width(k3_rank(8).kda_heads)) for M in (9, 16, 64)})
assert inproj_wide_choice(16, N16) == "wgmma" and inproj_wide_choice(64, N16) == "wgmma"
assert inproj_wide_choice(16, kmod.proj_width(k3_rank(8).kda_heads)) == "wgmma"
S96 = "traces/h200/records-51eab9f-s96.json"
print(nbtools.ab_table(S96, "attn", ["stock", "fast", "fast-inwgoff"], shape="k3_rank8"))
S90D = "traces/h200/records-ce064f2-s90d.json"
print(nbtools.ab_table(S90D, "attn", ["stock", "fast", "fast-inwgoff"]))
print(nbtools.ab_table(S90D, "attn", ["stock", "fast", "fast-inwg"], shape="k3_rank8"))
hot = nbtools.sass_hotspots("traces/h200/ncu-84e377e-s91/wgmmav1-sass.csv.gz", 3)
for t in hot["top"]:
    print(f"{t['share']:5.1%}  {t['sass']:40s} {t['reason']}")
with open(os.path.join(nbtools.ROOT, "traces/h200/records-ce064f2-s90d.json")) as fh:
    s90d = {(r["shape"], r["batch"], r["impl"]): r["replay_us_median"] for r in json.load(fh)["records"]
            if r["part"] == "attn"}
assert s90d[("k3_rank16", 16, "fast")] < s90d[("k3_rank16", 16, "fast-inwgoff")]

# %% [markdown]
# ## 20. Where the GEMM starts, and what it launches (session 28)
# Session 27's rule left rank16 above M = 16 on cuBLAS: there the plan's GEMM was even with cuBLAS in every run. Its
# old timelines held the reason, unread until session 28: at b64 the AttnRes norm is 256 CTAs in clusters of 4, and the
# plan's clusters of 8 started only as the norm ended (3.3-3.5 µs), although the norm launches them right after its
# wait. s97 placed variants beside the norm: clusters of 2 started at 1.3-1.4 µs, clusters of 4 and 8 at ~3.5, whatever
# their ring (a 144 KB ring started as late as a 222 KB one). So the scheduler's cluster placement, not shared memory,
# decides whether W moves during the norm.
#
# And an early start did not end the in_proj sooner: every build ends it at 20.5-21 µs, as cuBLAS does. What moved the
# attention half is the KDA step, launched from the GEMM's cluster barrier ~1.5 µs before the GEMM ends (cuBLAS
# launches it at its end), with everything after it moving up by as much. Since session 28 the rule runs the in_proj
# at rank16 M 17..64 on 29 clusters of 4 x 112 rows (`fast.INPROJ_WIDE_PINS_LARGE_M`) and o_proj there on the same
# GEMM (`fast.oproj_wide_choice`, notebook 04). `fast-inwgoff-opwgoff` is the A/B.
#
# One account of the GEMM's ~2.2-2.4 TB/s (bare) was x's re-reads: 26 MB of x ride the 4 x 112-row rings beside 46 MB
# of W. The diagnostic ring with W only (`diag="nox"`, s99) is at most 0.9 µs faster, so that is not it, and a cluster
# sharing x by multicast (cuBLAS's shape, by inference) would not pay.

# %%
S97, S98, S100 = ("traces/h200/records-f8eaa2c-s97.json", "traces/h200/records-eb247aa-s98.json",
                  "traces/h200/records-0be53b5-s100.json")
print(nbtools.ab_table(S97, "attn", ["stock", "fast", "fast-opwg", "fast-inwg2bn96x-opwg", "fast-inwg2bn64x-opwg",
                                     "fast-inwg4bn112x-opwg", "fast-inwgd4-opwg"]))
print(nbtools.replay_timeline(S97, "attn", "fast-inwg2bn96x-opwg", batch=64))
print(nbtools.replay_timeline(S97, "attn", "fast-inwg4bn112x-opwg", batch=64))
print(nbtools.ab_table(S98, "attn", ["stock", "fast", "fast-inwgoff", "fast-inwgoff-opwgoff"]))
print(nbtools.ab_table(S100, "attn", ["stock", "fast"]))
s99, text = nbtools.kernel_ab("traces/h200/kernels-5dfaf5c-s99.json", "gemm_in_proj_plain@wgmma4bn112nox",
                              "gemm_in_proj_plain@wgmma4bn112", [16, 64], shapes=("k3_rank16",))
print(text)
from k3fast.layer import inproj_wide_pins, oproj_wide_choice
print(inproj_wide_pins(N16, None, None, 64), oproj_wide_choice(768, None, 64))
assert inproj_wide_pins(N16, None, None, 64) == {"ksplit": 4, "bn": 112, "xrows": "auto"}
s97 = {(r["impl"], r["batch"]): r for r in json.load(open(os.path.join(nbtools.ROOT, S97)))["records"]
       if r["part"] == "attn" and r["shape"] == "k3_rank16"}
start = {i: next(k[1] for k in s97[(i, 64)]["replay_timeline"]["kernels"] if "gemm_wgmma" in k[0])
         for i in ("fast-inwg2bn96x-opwg", "fast-inwg4bn112x-opwg", "fast-inwgd4-opwg")}
print({i: f"GEMM starts at {t:.2f} µs" for i, t in start.items()})
assert start["fast-inwg2bn96x-opwg"] < 2 < 3 < start["fast-inwg4bn112x-opwg"] and start["fast-inwgd4-opwg"] > 3
assert s97[("fast-inwg4bn112x-opwg", 64)]["replay_us_median"] < s97[("fast-opwg", 64)]["replay_us_median"]
# the ring without x: under 1 µs faster at b64, where the x tiles are largest
assert s99[("gemm_in_proj_plain@wgmma4bn112", "k3_rank16", 64)] - s99[("gemm_in_proj_plain@wgmma4bn112nox",
                                                                         "k3_rank16", 64)] < 1.0

# %% [markdown]
# ## 21. The copy mode: a TMA box against one 1-D bulk copy (session 29; opt-in)
# What is left of the ring's ~2.5 TB/s against the v12 ring's 3.45 (§13)? One difference is how W arrives: here a TMA
# box through a tensor map, which also applies the 128-byte swizzle; there one 1-D `cp.async.bulk` of a contiguous
# run. v4 (`bulk`) keeps everything but that copy. `tile_weight(w, swizzle=True)` stores each stage's tile as one
# contiguous run, with row n's eight 16-byte chunks already in the order the swizzle would put them (chunk p at
# p ^ (n % 8)). One bulk copy then leaves the same shared-memory image as the box, and the same WGMMAs read it: the
# GPU tests find the same bits, partial last tiles included.
#
# The prediction: if the tensor-map path were the limit, the bare rank16 b64 GEMM would go from 20.6 to ~16-17.5 µs.
# It went 20.9 -> 20.5. The copy mode is not what holds the ring; the grid (clusters of ~220 KB CTAs) and the stage size
# (14 KB of W per barrier, against v12's 28 KB copies) are what no run has separated yet. In the layer bulk is
# 0.3-0.8 µs faster. It stays opt-in (`fast-inwgbulk`): the GEMVs at M <= 8 read the row-major weight, so the layer
# would hold the in_proj twice.

# %%
order = gw.swizzle128_chunks(torch.arange(4))
print(order, "<- rows 0-3: the chunk each 16-byte position of the pre-swizzled copy holds")
assert order[3].tolist() == [p ^ 3 for p in range(8)]
S103 = "traces/h200/kernels-3da9419-s103.json"
s103, text = nbtools.kernel_ab(S103, "gemm_in_proj_plain@wgmmabulk4bn112", "gemm_in_proj_plain@wgmma4bn112", [16, 64],
                               shapes=("k3_rank16",), digits=2)
print(text)
_, text = nbtools.kernel_ab(S103, "gemm_in_proj_plain@wgmmabulk2bn96xa", "gemm_in_proj_plain@wgmma2bn96xa", [16, 64],
                           digits=2)
print(text)
S103B = "traces/h200/records-3da9419-s103b.json"
print(nbtools.ab_table(S103B, "attn", ["stock", "fast", "fast-inwgbulk"]))
print(nbtools.ab_table(S103B, "attn", ["fast", "fast-inwgbulk"], shape="k3_rank8"))
# the bulk build moved the bare rank16 b64 GEMM by less than 1.5 us, not the 3-4.5 us the tensor-map account needed
box, blk = s103[("gemm_in_proj_plain@wgmma4bn112", "k3_rank16", 64)], \
    s103[("gemm_in_proj_plain@wgmmabulk4bn112", "k3_rank16", 64)]
assert 0 <= box - blk < 1.5, (box, blk)
rec = nbtools.recorded_gpu_tests("test_gemm_wgmma_splitk")
print(f"recorded H200 tests of the GEMM: {rec['passed']} passed, {rec['failed']} failed ({rec['source']})")
assert rec["failed"] == 0 and rec["passed"] > 0
