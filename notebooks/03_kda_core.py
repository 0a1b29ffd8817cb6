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
# # 03 — The KDA core in one kernel
#
# **Reference ops replaced** (k3-spec.md section 7.2 steps 2-8): the width-4 causal conv + SiLU with its state, the
# f_b up-projection of the decay gate and `λ = −5·σ(e^A (f + dt))`, β = σ(b), the q/k L2 norms, the gated delta
# rule on the FP32 state `[slots, H, V, K]` in place (padded slots untouched), the read `o = S q`, and the gated
# output RMSNorm. A verify width T ≤ 8 runs T recurrence steps inside the kernel.
#
# **The trick.** At batch 1 a rank has 6 heads × 64 KB of state: far too little work for 132 SMs. The kernel splits
# each head's 128 value rows over a cluster of up to 8 CTAs, loads its state rows into registers *before* the PDL
# wait (they were written by the previous token, not by the previous kernel), and exchanges the decay factors and
# the per-head sum of o² through distributed shared memory.

# %%
import copy
import glob
import os

import torch

from k3ref import Precision, k3, k3_rank, random_layer, tiny
from k3ref.bytes import floor_us, layer_bytes
from k3ref.kda import gated_delta_rule_chunked, gated_delta_rule_recurrent, kda_core, kda_projections
from k3ref.state import KDAState
from k3fast.measure import nbtools

# %% [markdown]
# ## 1. The reference ops: one token through the core (tiny, fp64)

# %%
cfg, P = tiny(), Precision.exact()
w = random_layer(cfg, 1, seed=0).attn
st = KDAState.allocate(cfg, 4, P)
st.recurrent.normal_(0, 0.1)
x = torch.randn(2, cfg.hidden_size, dtype=torch.float64)
before = copy.deepcopy(st)
y = kda_core(kda_projections(x, w, P), w, st.conv, st.recurrent, torch.tensor([3, -1]), 1, cfg, P)
print("y", tuple(y.shape), "| padded row is zero:", bool((y[1] == 0).all()),
      "| untouched slots bit-identical:", all(torch.equal(st.recurrent[i], before.recurrent[i]) for i in (0, 1, 2)))

# %% [markdown]
# The recurrence is the specification as a token loop; the chunked (prefill) form gives the same state.

# %%
N, T, H, D = 1, 20, 2, 16
q = torch.nn.functional.normalize(torch.randn(N, T, H, D, dtype=torch.float64), dim=-1) * D ** -0.5
k = torch.nn.functional.normalize(torch.randn(N, T, H, D, dtype=torch.float64), dim=-1)
v, lam, beta = torch.randn(N, T, H, D, dtype=torch.float64), -torch.rand(N, T, H, D, dtype=torch.float64), torch.rand(N, T, H, dtype=torch.float64)
S0 = torch.zeros(N, H, D, D, dtype=torch.float64)
o1, S1 = gated_delta_rule_recurrent(q, k, v, lam, beta, S0)
o2, S2 = gated_delta_rule_chunked(q, k, v, lam, beta, S0)
loop_vs_chunk = float((S1 - S2).norm() / S1.norm())
print(f"token loop vs chunked state: {loop_vs_chunk:.1e}")

# %% [markdown]
# ## 2. Bytes and floor: the state is read and written once per step

# %%
for name, c in (("k3_rank16", k3_rank(16)), ("k3_rank8", k3_rank(8)), ("full", k3())):
    for b in (1, 64):
        core = {x.stage: x for x in layer_bytes(c, "kda_moe", b)}["k3.kda.core"]
        print(f"{name:10s} batch {b:3d}: {core.total / 1e6:7.2f} MB (state {core.state / 1e6:6.2f}) floor {floor_us(core.total, 4.3):6.2f} µs")

# %% [markdown]
# ## 3. The fused kernel (`k3fast/kda_conv_gate_step.py`)

# %%
from k3fast.kernels import kda_conv_gate_step as kmod
print(kmod.__doc__.split("\n\n")[0])
print(nbtools.compile_on_cpu(kmod.warmup, 6, [1]))

# %% [markdown]
# ## 4-5. Against the reference (recorded on the H200; live with a GPU) and the time

# %%
rec = nbtools.recorded_gpu_tests("test_kda_conv_gate_step")
print(f"recorded H200 parity tests: {rec['passed']} passed, {rec['failed']} failed ({rec['source']})")
print(nbtools.bench_table(nbtools.recorded_kernel_bench("kda_conv_gate_step")))

# %% [markdown]
# ## 6. Two measured changes, one kept
# * **v3, the proj loads right after the wait (kept).** At T = 1 the beta logit and the f_a vector were loaded
#   behind the conv sigmoids' division branches, and the output gate after the last cluster barrier. Loading them
#   all right after the PDL wait is bit-identical, and took the step 0.5-0.8 µs shorter at b1-8 (bench), and the
#   attention half at b1 36.7 -> 36.1 µs (`fast-kdapre`, the default since).
# * **nsplit 8 at large batch (not kept).** v1's log named splitting each head's value rows 8 ways at b64 too (twice
#   the CTAs, 64 registers) as the alternative to try. Measured, it is slower: the step took 34.0 against 30.9 µs in
#   the bench at rank16 b64, and the attention half 68.3 against 65.2 µs (`fast-kdans8`). The q/k/W_fb re-reads,
#   which double with the split, cost more than the extra CTAs hide. So `choose_nsplit` stays as it was.

# %%
print(nbtools.ab_table("traces/h200/records-84291ed-s9perf.json", "attn", ["stock", "fast", "fast-kdapre"]))
print(nbtools.bench_table(nbtools.recorded_kernel_bench("kda_conv_gate_step@ns8")))
print(nbtools.ab_table("traces/h200/records-0bc90c0-s11.json", "attn", ["stock", "fast", "fast-kdans8"]))

# %% [markdown]
# ## 7. Reading a stall breakdown: one change removed, one kept (session 9)
# * **v4, a persistent request loop (removed).** At rank16 b64 the 1536 CTAs of the one-request grid run in ~2.3
#   waves. v4 launched only the clusters that fit and looped each over requests, with the next request's state in
#   flight in shared memory. It was slower everywhere (rank16 b64 30.9 -> 37.6 µs in the bench). Per SM, one
#   CTA-request cost ~2.7 µs in the one-request grid and 3.2 µs in v4: the step is bound by each CTA's chain of
#   dependent steps, not by waves of state loads.
# * **What the chain waits on: Nsight Compute.** One profiled launch per case (`scripts/h200_ncu.sh`). Each row
#   below gives the cycles a warp waits per issued instruction, split by reason. "membar" is a memory barrier. On
#   sm_90 a cluster barrier's arrive (release semantics) compiles to `MEMBAR.ALL.GPU`, and the kernel ended with a
#   gpu-scope fence before its PDL trigger, which waited for the 16 KB of state each CTA had just stored.
# * **v5, the write-backs after the last cluster barrier and no end fence behind the early trigger (kept).** In the
#   layer the trigger already fired right after the wait, so the fence ordered nothing for the dependent, and the
#   grid's completion drains the stores anyway. The result is bit-identical. With the layer's early trigger the
#   step is 9 % shorter at b64 (28.1 against 30.9 µs), and the attention half takes 62.1 against 64.7 µs
#   (`fast-s17kda`). At b1 it is unchanged: there the dependent waits for the grid's completion, which drains the
#   stores as the fence did.

# %%
ncu_files = sorted(os.path.relpath(p, nbtools.ROOT) for p in glob.glob(os.path.join(nbtools.ROOT, "traces", "h200", "ncu-*", "ncu-kda_*.txt")))
print(nbtools.ncu_table(ncu_files))
v3 = nbtools.recorded_ncu("traces/h200/ncu-ee5c807-s18/ncu-kda_shape_k3_rank16_batch_64_late_0_trig_1.txt")
v5 = nbtools.recorded_ncu("traces/h200/ncu-ee5c807-s18/ncu-kda_shape_k3_rank16_batch_64_late_1_trig_1.txt")
print(v5["meta"].splitlines()[0])
for label, row in (("v3's store order, with the layer's early trigger", "kda_conv_gate_step@v3trig"),
                   ("v5, with the layer's early trigger", "kda_conv_gate_step@trig")):
    print(label)
    print(nbtools.bench_table(nbtools.recorded_kernel_bench(row)))
print(nbtools.ab_table("traces/h200/records-ee5c807-s18.json", "attn", ["stock", "fast", "fast-s17kda"]))

# %%
assert dict(v3["stalls"])["membar"] > 2 * dict(v5["stalls"])["membar"] and v5["duration_us"] < v3["duration_us"]
assert loop_vs_chunk < 1e-10
assert bool((y[1] == 0).all())
assert rec["source"] is None or rec["failed"] == 0
print("ok")

# %% [markdown]
# ## 8. Exchanges without cluster barriers (v6, session 10)
# v5 still crossed two cluster barriers after the start: one to share each CTA's alpha values, one to share its
# partial sums of o^2 for the output norm. A cluster barrier's arrive is `MEMBAR.ALL.GPU` on sm_90, so each one
# waits for the CTA's outstanding memory operations. v6 sends the same values with `st.async`. Each store goes
# to a peer CTA's shared memory and completes 4 bytes of a transaction on that CTA's mbarrier. Each CTA waits until
# its mbarrier has counted every byte its peers send. A CTA writes its own values with plain stores (st.async to
# the executing CTA is undefined in PTX) and orders them with a CTA barrier. The values and their slots are the
# same, so the output is bit-identical to v5 (GPU test). The table below is one run (`kernels-226990a-s20b.json`),
# with the layer's early trigger in both rows. At rank16 the step gets 0.2-0.9 µs shorter at every batch. At rank8
# the result is mixed (b16 is 1.1 µs slower). The attention half at rank16 gains 0.5-0.7 µs at b1 and b8, and
# nothing at b64. The predicted gain was 0.5-0.9 µs at b1, because ncu had counted ~1.2 µs of membar stalls there.

# %%
kda_rows, kda_ab = nbtools.kernel_ab("traces/h200/kernels-226990a-s20b.json", "kda_conv_gate_step@trig",
                                    "kda_conv_gate_step@v5trig", (1, 8, 16, 64), digits=2)
print(kda_ab)
print(nbtools.ab_table("traces/h200/records-226990a-s20b.json", "attn", ["stock", "fast", "fast-s19kda"]))

# %%
assert all(kda_rows[("kda_conv_gate_step@trig", "k3_rank16", b)] < kda_rows[("kda_conv_gate_step@v5trig", "k3_rank16", b)]
           for b in (1, 8, 16, 64))
print("ok")


# %% [markdown]
# ## 9. One CTA per request and head, the state through shared memory (v9 / v9.1, session 22)
# At b64 the cluster build (nsplit 4: 4 CTAs per head, 32 rows each, the state in registers) ran at 2.2x its byte
# floor, and three ways to more concurrency inside it had lost (v4's request loop above, an occupancy hint, nsplit
# 8). v9 changes the design. A CTA of 8 warps owns a whole (request, head): thread 0 bulk-copies the 64 KB of
# state into shared memory before the PDL wait, the head's conv and decay gate are computed once instead of four
# times, and no cluster exchange is left. Every row, channel and reduction is computed as nsplit 4 computes it
# (the norm's sum as its four 32-row partials in order), so the outputs are the same bits (GPU test).
#
# v9 as first written gained only 8 % at rank16 b64 (25.3 against 27.4 µs). Nsight Compute (`ncu-8f943aa-s70/`,
# per-SASS stall samples) showed why: the 384 CTAs are one wave, so they all loaded, then all computed, then all
# stored, in lockstep. A third of the samples sat at the first use of the conv windows, whose loads had been
# issued after the 25 MB of bulk copies. v9.1 splits the state into four 16 KB chunks, each on its own mbarrier:
# a chunk's two warps start when it lands and bulk-store it when done, while the other chunks still stream. The
# small loads go out before the bulk copies.

# %%
v91_rows, v91_ab = nbtools.kernel_ab("traces/h200/kernels-7a01a10-s71.json", "kda_conv_gate_step@ns1trig",
                                     "kda_conv_gate_step@trig", (8, 16, 64))
print(v91_ab)
print(nbtools.ab_table("traces/h200/records-9daeda3-s72.json", "attn", ["stock", "fast", "fast-s22kda"]))
print(nbtools.ab_table("traces/h200/records-9daeda3-s72.json", "attn", ["stock", "fast", "fast-s22kda"],
                       shape="k3_rank8"))
print("v9.1 from", kmod.HEAD_CTA_MIN, "request-heads:",
      {f"{name} b{b}": kmod.choose_nsplit(b, h) for name, h in (("rank16", 6), ("rank8", 12)) for b in (8, 16, 32, 64)})

# %%
for shape in ("k3_rank16", "k3_rank8"):
    assert v91_rows[("kda_conv_gate_step@ns1trig", shape, 64)] < 0.85 * v91_rows[("kda_conv_gate_step@trig", shape, 64)]
assert kmod.choose_nsplit(64, 6) == 1 and kmod.choose_nsplit(16, 12) == 1     # 384 and 192 request-heads
assert kmod.choose_nsplit(8, 12) == 4 and kmod.choose_nsplit(16, 6) == 4      # 96: the cluster build
print("ok")

# %% [markdown]
# ## 10. Reading where the warps wait, and moving the state's copies behind the projections (v9.2, session 24)
# v9.1 still ran at 1.7x its byte floor at rank16 b64 (21 µs in the kernel bench, cold L2). Nsight Compute's
# source page (`ncu-c22210d-s80/`, one report of v9.1 alone) charges every warp-stall sample to the instruction that
# waits to issue. `nbtools.sass_hotspots` reads it back: a quarter of the samples sit right after the CTA barrier
# that ends phase A (warps done with their conv and gate work waiting for the slowest), the next ones at the exit
# (the bulk stores draining) and on register loads that were issued before the PDL wait. The state's chunk
# mbarriers were already complete when phase B began, so phase A's loads, all returning while 25 MB of state
# streamed in, set phase B's start, not the stream.
#
# A plan written the session before (rows spread over lane groups, to shorten phase B's shuffle chains) would have
# traded a busier shared-memory pipe for chains that hold ~11 % of the samples: not written. v9.2 instead requests
# the first token's projections right after the wait, then a CTA barrier, then issues the state's bulk copies.

# %%
hot = nbtools.sass_hotspots("traces/h200/ncu-c22210d-s80/kdav91-sass.csv.gz")
print(f"{hot['source']}: {hot['total_samples']} samples over {hot['instructions']} SASS instructions")
for t in hot["top"]:
    print(f"  #{t['index']:<5d} {t['share']:6.1%}  {t['reason']:10s} {'(after a BAR) ' if t['after_barrier'] else ''}"
          f"{t['sass']}")
assert hot["top"][0]["reason"] == "barrier" and hot["top"][0]["after_barrier"] and hot["top"][0]["share"] > 0.2

# %% [markdown]
# Predicted before the run: the KDA step at rank16 b64 in the layer 17.5 -> ~13-15.5 µs, the attention half -2 to
# -4.5 µs there, -3 to -6 at rank8 b64, -1 to -2 at rank8 b16. Measured (s84, one run): the kernel -0.5 to -1.9 µs,
# the attention half -0.7 / -2.9 / 0. A miss, but faster or even in every cell, so the default (`fast-s24kda` is
# v9.1). The rest of the barrier's quarter is phase A's own latency (its loads, the f_b reductions, alpha through
# shared memory) and, after phase B, the store drain of a one-wave grid.

# %%
pf_rows, pf_ab = nbtools.kernel_ab("traces/h200/kernels-92d0ab6-s84.json", "kda_conv_gate_step@ns1pftrig",
                                   "kda_conv_gate_step@ns1trig", (16, 64))
print(pf_ab)
for shape in ("k3_rank16", "k3_rank8"):
    print(nbtools.ab_table("traces/h200/records-92d0ab6-s84.json", "attn", ["stock", "fast", "fast-kdapf"], shape))
for shape in ("k3_rank16", "k3_rank8"):
    assert pf_rows[("kda_conv_gate_step@ns1pftrig", shape, 64)] < pf_rows[("kda_conv_gate_step@ns1trig", shape, 64)]
assert kmod.HEAD_PROJ_FIRST and "proj_first" in kmod.kernel_key(6, 1, 1)
print("ok")
