# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 — Stable LatentMoE with MXFP4 experts on a GPU that has no FP4 instructions
#
# **Reference ops replaced** (k3-spec.md sections 9, 11, 11.1): for each of the 16 routed experts of each token,
# dequantise w1/w3 (E2M1 codes, one E8M0 scale per 32), `SiTU(z W1ᵀ, z W3ᵀ)`, `· W2ᵀ`, the late routing weight and the
# FP32 combine; then `routed_expert_norm`, the latent up-projection, the shared experts and the sum.
#
# **The trick.** sm_90 has no FP4 conversion, so codes are decoded with integer/byte-permute operations in registers,
# straight into tensor-core operands; the scale multiplies each 32-value partial once. Experts picked by several
# tokens are read once per step (deduplicated), and the combine is summed in slot order (bit-reproducible).

# %%
import torch

from k3ref import Precision, k3, k3_rank, random_layer, tiny
from k3ref.bytes import expected_distinct_experts, expert_bytes, floor_us
from k3ref.moe import latent_moe, routed_experts, routed_experts_loop, route
from k3ref.quant import dequant_mxfp4, unpack_e2m1
from k3fast.measure import nbtools

cfg, P = tiny(), Precision.exact()
w = random_layer(cfg, 1, seed=0).mlp

# %% [markdown]
# ## 1. MXFP4, exactly: every byte holds two codes, low nibble first

# %%
b = torch.tensor([[0x2F, 0x97]], dtype=torch.uint8)
print(unpack_e2m1(b).tolist(), "<- 0x2F = (-6, 1), 0x97 = (4, -0.5)")
W1 = dequant_mxfp4(w.w1_packed[0], w.w1_scale[0], torch.float64)
print("expert 0 w1:", tuple(W1.shape), "exact in bf16:", torch.equal(W1.bfloat16().double(), W1))

# %% [markdown]
# ## 2. The whole MoE half, vectorised vs the per-token per-expert specification

# %%
x = torch.randn(3, cfg.hidden_size, dtype=torch.float64)
ids, ws = route(x, w, cfg, P)
z = x @ w.down.double().T
vec_vs_loop = float((routed_experts(z, ids, ws, w, cfg, P) - routed_experts_loop(z, ids, ws, w, cfg, P)).norm())
print(f"vectorised vs loop (fp64): {vec_vs_loop:.1e}; f = {tuple(latent_moe(x, w, cfg, P).shape)}")

# %% [markdown]
# ## 3. Bytes and floor: the experts dominate as the batch grows

# %%
for name, c in (("k3_rank16", k3_rank(16)), ("k3_rank8", k3_rank(8)), ("full", k3())):
    for bsz in (1, 8, 64):
        nb = expected_distinct_experts(c, bsz) * expert_bytes(c)
        print(f"{name:10s} batch {bsz:3d}: {expected_distinct_experts(c, bsz):6.1f} distinct experts, "
              f"{nb / 1e6:8.1f} MB, floor {floor_us(nb, 4.3):7.1f} µs")

# %% [markdown]
# ## 4. The fused kernels (`k3fast/moe_mxfp4_experts.py`, `k3fast/moe_tail.py`)

# %%
from k3fast.kernels import moe_mxfp4_experts as mx
from k3fast.kernels import moe_tail as mt
print(mx.__doc__.split("\n\n")[0])
print(nbtools.compile_on_cpu(mx.warmup, k3_rank(16), [1], nsm=132))
print(nbtools.compile_on_cpu(mt.warmup, k3_rank(16).shared_intermediate, [1]))

# %% [markdown]
# ## 5. Against the reference (recorded on the H200) and the time

# %%
for mod in ("test_moe_mxfp4_experts", "test_moe_tail"):
    rec = nbtools.recorded_gpu_tests(mod)
    print(f"{mod}: {rec['passed']} passed, {rec['failed']} failed ({rec['source']})")
print(nbtools.bench_table(nbtools.recorded_kernel_bench("moe_mxfp4_experts")))

# %% [markdown]
# ## 6. Reading the PTX: why v3 streamed only 6-7 GB/s per SM
# The routed-experts kernel keeps a *ring* of D = 8 weight loads in flight per lane: at step s it issues the
# load for step s + 8. On the H200, v3 read each CTA's weights at 6-7 GB/s, whatever the batch or shape. An SM
# needs ~30 GB/s to saturate HBM. Version 3 read a slot, issued its refill, and only then decoded the old words.
# The old and new values were then alive together, so the compiler copied every ring register at the loop head.
# A copy of a register with a load in flight waits for that load: once every D steps, a full HBM round trip.
# Version 4 decodes the slot first, then refills it. `k3fast.measure.ptxcheck` counts such copies in the compiled PTX, so
# the bug is visible on a CPU. On the H200 v4 was bit-identical to v3 and 1.4x faster at batch 8, but only 9 %
# at batch 64: the copies were a cost, not *the* cost (section 7).

# %%
import dataclasses
from k3fast.kernels._dsl import dsl_available
from k3fast.measure.ptxcheck import compiled_ptx, loop_copies_of_loads
if dsl_available():
    key = mx.compile_key(56, 3584, 256, 1, version=4)
    for v in (3, 4):
        ptx = compiled_ptx(lambda: mx._compile(dataclasses.replace(key, version=v, layout="nibble"),
                                               options="--enable-tvm-ffi --keep-ptx"))
        for st in loop_copies_of_loads(ptx):
            if st.global_loads >= 8:
                print(f"v{v} loop {st.label}: {st.instructions} PTX instructions, {st.global_loads} global loads, "
                      f"{st.copies_of_loads} copies of in-flight loads")
else:
    print("CuTe DSL not installed: PTX check skipped")

# %% [markdown]
# ## 7. What the H200 said: clusters that do not fit at once
# `python -m k3fast.measure.bench_experts` times design variants of the kernel on the same inputs in one run. The kernel
# is persistent: cluster q takes active experts q, q + Q, ... A cluster of C CTAs must fit inside one GPC (16-18
# SMs), so a grid of 33 clusters of 4 does not fit at once, and the 33rd cluster runs its whole share after the
# others: the time doubles. Clusters of 2 are TPC pairs, and all 66 fit. The `probe` rows replace decode and MMA
# with an XOR of the loaded words: the load pipeline alone. Since this run the default is v4 with C = 2 (C = 4 at
# M <= 2); since e384fbf it is also the rot layout (section 8) with 16 warps per CTA. The rows below come from the
# 50b6243 run (section 9 has the runs after it).

# %%
src, table = nbtools.recorded_experts_probe("k3_rank16", "traces/h200/experts-50b6243.json")
print(f"k3_rank16, median µs per launch ({src})")
batches = sorted({b for row in table.values() for b in row})
print(f"{'variant':10s}" + "".join(f"{'b' + str(b):>10s}" for b in batches))
for variant, row in table.items():
    print(f"{variant:10s}" + "".join(f"{row.get(b, float('nan')):10.1f}" for b in batches))

# %% [markdown]
# ## 8. Fewer instructions per byte: a decode by rotations
# The probe above said the kernel was bound by its instruction stream, and the PTX of the FC1 loop said two thirds
# of it was decode. The old ("nibble") layout decoded 8 codes with a PRMT table (8 PRMTs, 3 shifts, 5 LOP3s per
# word, plus one fp32 FMA per accumulator and block for the scale). The "rot" layout packs the bits of a word so
# that each bf16x2 register is `rotl(word, r) & mask` (one piece, or two for the last register): 9 ALU ops per
# word. The result is code * 2^-126 as a bf16 (the exponent lsbs hold e1 e0 and the mantissa msb holds m, so the
# code 0.5 becomes a subnormal), and one exact bf16x2 multiply by 2^(E-1) = 2^126 * scale gives the dequantised
# weight. Below, the decode runs bit for bit on the CPU against the exact dequant, then the H200 run that put the
# two layouts side by side on the same inputs.

# %%
print("register pieces (rotation, mask):", [[(r, hex(m)) for r, m in p] for p in mx.ROT_PIECES])
codes = torch.randint(0, 16, (1, 1, 16, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(11))
scales = torch.full((1, 1, 16, 2), 121, dtype=torch.uint8)
q_rot, _ = mx._pack_tiles(codes, scales, "rot")
pat = mx.rot_decode_reference(q_rot.to(torch.int64))                  # [..., 4 registers] bf16x2 bit patterns
halves = torch.stack([pat & 0xFFFF, pat >> 16], dim=-1).to(torch.int32).to(torch.int16).view(torch.bfloat16)
decoded = halves.double() * 2.0 ** (121 - 1)                          # the kernel's bf16x2 multiply, exactly
want = torch.tensor(mx.E2M1_MAG, dtype=torch.float64)[(mx._rot_codes(q_rot.to(torch.int64) & 0xFFFFFFFF) & 7)]
want = torch.where((mx._rot_codes(q_rot.to(torch.int64) & 0xFFFFFFFF) & 8) != 0, -want, want) * 2.0 ** (121 - 127)
rot_decode_exact = torch.equal(decoded.reshape(want.shape), want)
print("rot decode exact on every code:", rot_decode_exact)

# %%
src, table = nbtools.recorded_experts_probe("k3_rank16", "traces/h200/experts-50b6243.json")
if "nibble" in table:
    print(f"k3_rank16, median µs per launch ({src}): rot layout (default) against the nibble layout")
    for b in sorted(table["default"]):
        print(f"  b{b:<3d} rot {table['default'][b]:7.1f}   nibble {table['nibble'][b]:7.1f}   "
              f"ratio {table['nibble'][b] / table['default'][b]:.2f}x   marlin {table.get('marlin', {}).get(b, float('nan')):7.1f}")

# %% [markdown]
# ## 9. Batch 1 and 2: every SM on a few experts (v7)
# At b1 the 16 routed experts kept 64 of the 132 SMs busy (clusters of 4, one expert each). v6 split each expert
# over two clusters of 4 by I and got slower: a grid of 32 clusters of 4 does not all fit at once (section 7's
# co-residency again). v7 splits each expert into NH parts of I over clusters of 2, which all fit (66 TPC pairs):
# at rank16 b1, 4 parts x 16 experts = 64 clusters = 128 SMs, each CTA reading 1/8 of an expert. Each part
# writes an fp32 partial of y_e; the last part of a pair to arrive adds the NH partials in part order and rounds
# y_e to bf16 once (the reference's rounding), then arrives for the combine. Below: the index arithmetic checked
# on the CPU (each weight row read once), the H200 run that measured it (`v7P2` is 2 parts on 64 SMs), the MoE
# half's A/B in one run (`fast-s13` keeps v4), and the b1 chain by stage (stream probes stopped after a stage).

# %%
from collections import Counter
c7 = mx.compile_key(896, 3584, 256, 1, version=7)
fc1 = Counter()
for hI in range(c7.NH):
    for rank in range(c7.C):
        for warp in range(c7.W):
            for s_ in range(c7.U1 * c7.KS1):
                i_ = s_ // c7.KS1
                uu = warp + c7.W * i_
                fc1[(hI * (c7.IH // 8) + rank * c7.T1 + uu // c7.S) * c7.NKB1 + (uu % c7.S) * c7.KS1 + s_ - i_ * c7.KS1] += 1
v7_rows_once = fc1 == Counter(range(256 // 8 * c7.NKB1))
print(f"v7 at rank16 b1: {c7.NH} parts, clusters of {c7.C}, {c7.Q} clusters = {c7.Q * c7.C} CTAs; "
      f"every w13 row read exactly once: {v7_rows_once}")
for shape in ("k3_rank16", "k3_rank8"):
    src, table = nbtools.recorded_experts_probe(shape, "traces/h200/experts-ab2cffe-s13.json")
    print(f"{shape}, median µs per launch ({src})")
    for variant in ("marlin", "default", "probe", "v6", "v6probe", "v7", "v7probe", "v7P2"):
        print(f"  {variant:9s}" + "".join(f"{table[variant].get(b, float('nan')):9.1f}" for b in (1, 2)))
print(nbtools.ab_table("traces/h200/records-ab2cffe-s13.json", "moe", ["stock", "fast", "fast-v7"]))
print(nbtools.replay_timeline("traces/h200/records-3960ffc-kdaall2.json", "moe", "fast"))
src, table = nbtools.recorded_experts_probe("k3_rank16", "traces/h200/experts-6ec1427-s15.json")
print(f"the b1 chain by stage, v7 ({src}):")
for variant in ("sortprobe", "fc1probe", "fc2probe", "probe", "default"):
    print(f"  {variant:10s}{table[variant][1]:7.1f} µs")

# %% [markdown]
# ## 10. Two rounds of arrivals or one? And what the kernels wait on (session 9)
# The stage probes above put 3.3 µs of the b1 chain in v7's two rounds of gpu-scope arrivals (the part reduction,
# then the combine). `gridcomb` (bench row G1, removed) made them one grid-wide arrival, after which every CTA
# combined a slice. It was bit-identical, but slower: 24.7 against 21.2 µs at rank16 b1. The stream probes (G1probe
# against probe) show the arrival itself costs ~3.5 µs: 128 CTAs arrive on one counter, then every CTA waits for
# the slowest. v7's per-pair arrivals let the early pairs combine while the late ones still stream.
#
# Nsight Compute (one launch each, caches flushed) then shows what each kernel of the MoE half waits on, in
# cycles per issued instruction. At b1 the experts wait on CTA barriers and loads, and the tail on loads alone
# (33 of 39 cycles: each warp has one register stage in flight ahead of the one it multiplies). At b64 the
# experts' stalls are short (`wait`, `not_selected`, `math_pipe_throttle`), so the issue rate is the limit, as the
# stream probe said. `moe_tail`'s v5 (section 11) moves the tail's weight stages into a shared-memory ring filled
# by cp.async.

# %%
src, table = nbtools.recorded_experts_probe("k3_rank16", "traces/h200/experts-26465c5-s16.json")
print(f"rank16, median µs per launch ({src})")
for variant in ("default", "probe", "G1", "G1probe"):
    print(f"  {variant:9s}" + "".join(f"{table[variant].get(b, float('nan')):9.1f}" for b in (1, 2)))
print(nbtools.ab_table("traces/h200/records-26465c5-s16.json", "moe", ["stock", "fast", "fast-gridcomb"]))
moe_ncu = [f"traces/h200/ncu-5446d13-ncu1/ncu-{c}.txt" for c in
           ("experts_shape_k3_rank16_batch_1", "tail_shape_k3_rank16_batch_1", "experts_shape_k3_rank16_batch_64")]
print(nbtools.ncu_table(moe_ncu))
tail_b1 = nbtools.recorded_ncu(moe_ncu[1])

# %% [markdown]
# ## 11. The tail's weights through shared memory (moe_tail v5, session 10)
# The ncu rows above show the tail waiting on loads. Each warp had one register stage in flight ahead of the one
# it multiplied, and more register stages spilled. v5 streams the same 16-byte fragments through a ring of D
# stages per warp in shared memory, filled by cp.async; the first D stages are issued before the PDL wait. Each
# thread reads back only the chunks it copied, so `cp.async.wait_group` orders them without a CTA barrier. The MMAs
# see the same registers, so the output is bit-identical (GPU test). Depth 2 is the default: D = 3 and 4 need more
# shared memory per CTA, which costs CTAs per SM (a second wave at D = 4).
#
# The gain depends on the shape. At rank8 b1 the v1 tail ran at ~2.1 TB/s and v5 takes it from 29.3 to 21.8 µs.
# At rank16 b1 the gain is only 21.1 -> 20.0. There ncu shows the long-scoreboard stalls halved (34.3 -> 18.1 cycles
# per issue) with DRAM still ~63 % busy, so the waiting moved elsewhere. The MoE half follows the kernel: rank8 b1
# 74.8 -> 66.9 µs, rank16 b1 60.3 -> 59.5 (`fast-s19tail` is v1).

# %%
tail_rows, tail_ab = nbtools.kernel_ab("traces/h200/kernels-226990a-s20b.json", "moe_tail", "moe_tail@v1", (1, 8, 16))
print(tail_ab)
print(nbtools.ncu_table([f"traces/h200/ncu-2674eff-ncu2/ncu-tail_shape_k3_rank16_batch_1{s}.txt" for s in ("", "_ring_3")]))
for shape in ("k3_rank16", "k3_rank8"):
    print(nbtools.ab_table("traces/h200/records-226990a-s20b.json", "moe", ["stock", "fast", "fast-s19tail"], shape=shape))

# %% [markdown]
# ## 12. A ring as deep as the K steps allow (ring_fit, sessions 12-13)
# At batch buckets above 2 the experts kernel is issue-bound (section 10: its stalls are short, and the stream
# probe is much faster than the kernel). At rank8 (I = 384) it was worse than at rank16: a work unit of FC1 has 28
# K steps and a tile of FC2 has 6, and a ring of D = 8 register stages divides neither. So each step recomputed its
# unit and K index, for the step itself, its refill and the z / h reads, each with a division. `ring_fit` gives
# each loop the deepest ring <= D that divides its steps or is divided by them: 7 and 6 at rank8. At rank16 (56
# and 4 steps) that is 8 and 8, so the PTX does not change. The price is 7 / 6 loads in flight per lane instead of 8
# where a loop waits on loads. Only when each row is loaded changes, so the outputs are bit-identical (GPU test).
# The SASS counts below come from `k3fast.measure.ptxcheck`'s CPU record (ptxas from Triton's wheel).

# %%
import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

for name, I_ in (("k3_rank16", 256), ("k3_rank8", 384)):
    k = mx.compile_key(896, 3584, I_, 64)
    k0 = dataclasses.replace(k, ring_fit=False)
    print(f"{name}: FC1 {k.KS1} K steps per unit, ring {k0.D1} -> {k.D1}; FC2 {k.NKB2H} per tile, ring {k0.D2} -> {k.D2}")
per_mma, newest = {}, ""           # from the newest ptxcheck record that has ring_fit rows
for path in glob.glob(os.path.join(nbtools.ROOT, "traces", "cpu", "ptxcheck-*.json")):
    with open(path) as f:
        doc = json.load(f)
    rows = [r for r in doc["records"] if r.get("sass") and "ring_fit" in r["kernel"] and r.get("mma")]
    if rows and doc["environment"].get("date", "") >= newest:
        per_mma, newest = {}, doc["environment"].get("date", "")
        for r in rows:
            per_mma.setdefault((r["config"], r["M"], r["kernel"], os.path.basename(path)), []).append(
                (r["instructions"], r["mma"]))
def ring_fit_tables(small: bool, record: str, variants: tuple, batches: tuple, ab: list) -> dict:
    """SASS per MMA of FC1's and FC2's loops (the two smallest loops with MMAs) at batch buckets <= 2 (small, v7)
    or above (v4 / v5), the bench_experts medians of ``variants`` from ``record``, and the layer A/B ``ab``."""
    for (shape, M, kern, src), loops in sorted(per_mma.items()):
        if (M <= 2) == small:
            fc = sorted(loops)[:2]
            print(f"{src}: {shape} b{M:<3d} {kern.split(' ', 1)[1]:30s} SASS per MMA "
                  + " / ".join(f"{n / m:.1f}" for n, m in fc))
    tables = {}
    for shape in ("k3_rank8", "k3_rank16"):
        src, tables[shape] = nbtools.recorded_experts_probe(shape, record)
        print(f"{shape}, median µs per launch ({src})")
        for variant in variants:
            print(f"  {variant:9s}" + "".join(f"{tables[shape][variant].get(b, float('nan')):9.1f}" for b in batches))
    for shape in ("k3_rank8", "k3_rank16"):
        print(nbtools.ab_table(record.replace("experts-", "records-"), "moe", ab, shape=shape))
    return tables


rf = ring_fit_tables(False, "traces/h200/experts-1f10ff5-s27.json", ("marlin", "default", "NRF", "probe", "NRFprobe"),
                     (8, 64), ["stock", "fast", "fast-noringfit"])

# %% [markdown]
# Predicted: rank8 b64 631 -> 560-600 µs, b8 118 -> 105-113. Measured: 633 -> 518 and 119 -> 92, past the
# optimistic end, and rank8 b64 now beats Marlin. The prediction also said that the stream probe would not move,
# since it has no decode or MMA. It moved by 9-12 %: the probe runs the same ring addressing, so it paid the same
# divisions. The MoE half at rank8 went from 0.93x to 1.11x stock at b64. ring_fit is the default since session 13
# (`fast-noringfit` is the A/B).
#
# ## 13. The cuBLAS tail's norm in one kernel (session 13)
# Above M = 16 the tail is torch: RMSNorm, two GEMMs, an add. Its norm took three kernels: an FP32 copy of r, the
# norm, and a BF16 copy. One torch RMSNorm on the BF16 r does the same arithmetic in FP32 and rounds once, as k3ref
# does; only its reduction order differs, within one BF16 ulp (CPU and GPU tests). There are two launches fewer
# per replay (`fast-s27tail` is the three-kernel A/B; this run had no stock path).

# %%
for shape in ("k3_rank16", "k3_rank8"):
    print(nbtools.ab_table("traces/h200/records-52f028f-s28.json", "moe", ["fast", "fast-s27tail"], shape=shape))

# %% [markdown]
# ## 14. The fitted rings at batch 1 and 2 too (v7, sessions 13-14)
# At batch buckets <= 2 the layer runs experts v7 (section 9), whose FC1 units have 14 or 28 K steps: a ring of 8
# divides them per step as well. Session 12 left v7 at the full ring, assuming that its loops wait on loads; the
# SASS said otherwise (below: per MMA, full ring against fitted). The s29 run measured the fitted rings as an
# opt-in (`RF7` in bench_experts, `fast-ringfit7` in the layer, both at fdcdffc) and they became the default; the
# A/B is now `NRF` / `fast-noringfit`, which turns the fitted rings off at every version.

# %%
# RF7 = the fitted rings (today's default); "default" here is the full ring, v7's default when s29 ran
rf7 = ring_fit_tables(True, "traces/h200/experts-fdcdffc-s29.json", ("marlin", "default", "RF7", "probe", "RF7probe"),
                      (1, 2), ["stock", "fast", "fast-ringfit7"])

# %% [markdown]
# Predicted (bench): rank8 b2 -8 to -15 %, rank8 b1 and rank16 b2 -3 to -8 %, rank16 b1 within +-3 %. Measured:
# -19 %, -6 %, -4 %, +0.6 %. In the MoE half the kernel's gain shows in full only at rank8 b2 (82.6 -> 74.3 µs,
# 1.57x -> 1.75x stock): at b1 the experts start under the front's PDL tail, so most of rank8 b1's 1.6 µs is hidden
# (65.8 -> 65.4). Bit-identical to the full ring on the GPU (`test_ring_fit_at_v7_is_bit_identical`, s29t).

# %% [markdown]
# ## 15. Would the tail's weights wait in L2? (`k3fast.l2probe`, session 14)
# At rank16 b1 the tail streams 57 MB after the routed experts (15.7 µs, 1.13x its byte floor), while during the
# experts the HBM moves only ~23 MB. Four designs tried to pull weights into L2 during another kernel, and all four
# cost more than they hid. `k3fast.l2probe` asks the question on plain buffers. A range X is read once after one
# of these: nothing (cold), X itself (warm), a prefetch by 4 or 132 CTAs (bulk `cp.async.bulk.prefetch.L2` or
# per-line `prefetch.global.L2`, with or without `L2::evict_last`), that prefetch and then ~50 µs of waiting
# (settled), or that prefetch beside a 23 MB stream Y. Two readers: 528 CTAs with 64 KB of loads in flight per SM
# (bandwidth-bound, like the tail: 57 MB at 3.6 TB/s) and 132 CTAs with 16 KB (latency-bound).

# %%
l2 = {}
with open(os.path.join(nbtools.ROOT, "traces", "h200", "l2probe-18b80c4-s32.json")) as f:
    l2doc = json.load(f)
for r in l2doc["records"]:
    l2[(r["reader_ctas"], r["scenario"], r["x_mb"])] = r["x_read"]["us_median"]
sizes = sorted({k[2] for k in l2})
pf_rows = sorted({k[1] for k in l2 if k[1].startswith("pf_")})
print(f"traces/h200/l2probe-18b80c4-s32.json, copy {l2doc['copy_tbps']:.2f} TB/s; median µs of the read of X")
for rc in (528, 132):
    best = {mb: min(l2[(rc, sc, mb)] for sc in pf_rows if "beside" not in sc) for mb in sizes}
    best_beside = {mb: min(l2[(rc, sc, mb)] for sc in pf_rows if "beside" in sc) for mb in sizes}
    print(f"reader {rc} CTAs   " + "".join(f"{mb:>7d} MB" for mb in sizes))
    for name, row in (("cold", {mb: l2[(rc, "cold", mb)] for mb in sizes}),
                      ("warm", {mb: l2[(rc, "warm", mb)] for mb in sizes}),
                      ("best prefetch", best), ("best beside Y", best_beside)):
        print(f"  {name:15s}" + "".join(f"{row[mb]:10.1f}" for mb in sizes))
y_cost = {r["scenario"]: r["y_beside"]["us_median"] / r["y_alone"]["us_median"]
          for r in l2doc["records"] if r.get("y_beside") and r["reader_ctas"] == 528 and r["x_mb"] == 24}
print("Y (23 MB) beside a 24 MB prefetch, time against Y alone: "
      + ", ".join(f"{k[3:-14]} {v:.2f}x" for k, v in sorted(y_cost.items())))

# %% [markdown]
# What the H200 said:
# * For the bandwidth-bound reader, the best prefetch saved 7-10 % of the read at 16-48 MB, and that is with
#   nothing else running. Beside the 23 MB stream, no prefetch row read faster than cold at >= 16 MB. The stream
#   itself got slower beside every prefetch: 1.18-1.22x from 4 CTAs, 1.19-1.59x from 132, at 24 MB. About 1.1 µs
#   of that is there at 2 MB too, so it is the cost of running beside another kernel at all, not of the bytes.
# * The latency-bound reader gains more (up to a quarter at 48 MB), but the tail is not latency-bound: it streams
#   at 3.6 TB/s.
# * Read twice, a range of 16 MB or more is hardly faster the second time, so the usable L2 for a range that every
#   SM reads is well below its 50 MB.
#
# So at b1 an L2 prefetch of the tail's weights could save about 10 % of 15.7 µs, and only if it cost the experts
# nothing, which it does not. Issue 5's 2x needs 6.2 µs. The lead that remains keeps bytes on the chip, not in L2:
# the experts' 23 MB in shared memory while the front's down-projection streams (LOG.md, "Where the remaining targets
# stand").

# %% [markdown]
# ## 16. The experts' bytes in shared memory, beside a stream (`k3fast.overlap_probe`, session 14)
# If L2 cannot carry bytes from one kernel to the next, shared memory can. At rank16 b1 the experts' 23.4 MB fits
# in 128 SMs' shared memory (183 KB each). In the probe, 128 CTAs copy it in, every cp.async in flight at once,
# beside a 51.4 MB stream (the front's down-projection). It asks two questions. Do the two add up to copy rate?
# And how fast can the experts' bytes arrive when nothing else limits them?

# %%
ov = []
for path in sorted(glob.glob(os.path.join(nbtools.ROOT, "traces", "h200", "overlap-*.json"))):
    with open(path) as f:
        for r in json.load(f)["records"]:
            if r["stream_bytes"] == 51_400_000 and r["fill_ctas"] == 128 and r.get("timing") != "graph":
                ov.append((os.path.basename(path), r))
print(f"{'record':34s} {'order':13s} {'carveout':>8s} {'fill':>6s} {'stream':>7s} {'one after':>9s} {'beside':>7s}  (µs)")
for name, r in ov:
    order = "stream first" if r.get("stream_first") else "fill first"
    print(f"{name:34s} {order:13s} {str(r.get('stream_carveout')):>8s} {r['fill']['us_median']:6.1f} "
          f"{r['stream']['us_median']:7.1f} {r['fill_then_stream']['us_median']:9.1f} "
          f"{r['fill_beside_stream']['us_median']:7.1f}")
spans = [(k[0], k[2]) for _, r in ov for k in r.get("beside_timeline") or []]
fill_k = sorted(d for n, d in spans if n == "fill")
stream_k = sorted(d for n, d in spans if n == "stream")
print(f"kernel durations (CUPTI): fill {fill_k[len(fill_k) // 2]:.1f} µs for 23.4 MB, "
      f"stream {stream_k[len(stream_k) // 2]:.1f} µs for 51.4 MB")

# %% [markdown]
# Side by side, the pair took as long as one after the other, whichever kernel was launched first and whichever
# shared-memory split the stream asked for. The profiled spans (eager launches) show one kernel after the other,
# but the CPU's launch gaps sit between them. Whether the block scheduler would run the two grids at once stays
# open until a CUDA-graph run (`overlap_probe --graph`). Either way the kernels themselves set the ceiling. The
# stream runs at copy rate, and the fill moves 23.4 MB in ~7 µs, so perfect overlap would buy under 2 µs here.
#
# The second answer looked like it mattered more: experts v7 streams the same bytes in ~11-12 µs at rank16 b1 (its
# stream probe less its routing), against the fill's ~7 µs. Section 17 measures both claims again, as graph replays.

# %% [markdown]
# ## 17. Two grids at once as graph replays, and the FC1 rows through shared memory (sessions 14-15)
# `overlap_probe --graph` captures the two-stream fork in a CUDA graph, so no CPU gap sits between the launches, and
# profiles one replay for the spans. `stage_fc1` (session 14's opt-in `fast-stagefc1`, bench `SF1`) took experts v7's
# FC1 rows through shared memory by cp.async, all 14 steps at once at rank16 b1, the way the fill does.

# %%
gr = []
for path in sorted(glob.glob(os.path.join(nbtools.ROOT, "traces", "h200", "overlap-*.json"))):
    with open(path) as f:
        gr += [(os.path.basename(path), r) for r in json.load(f)["records"] if r.get("timing") == "graph"]
for name, r in gr:
    order = "stream first" if r["stream_first"] else "fill first"
    tl = {n: (t0, d) for n, t0, d in r["beside_timeline"]}
    print(f"{name:36s} {order:12s} fill {r['fill']['us_median']:5.1f}  stream {r['stream']['us_median']:5.1f}  "
          f"one after {r['fill_then_stream']['us_median']:5.1f}  beside {r['fill_beside_stream']['us_median']:5.1f}  "
          f"(floor {r['floor_us_both']:.1f})  spans: " + ", ".join(f"{n} {t0:.1f}+{d:.1f}" for n, (t0, d) in tl.items()))
sf = {sh: nbtools.recorded_experts_probe(sh, "traces/h200/experts-592860e-s38.json")[1]
      for sh in ("k3_rank16", "k3_rank8")}
print(f"{'':10s} {'default':>8s} {'SF1':>6s} {'probe':>6s} {'SF1probe':>8s}  (µs, experts-592860e-s38.json)")
for sh in ("k3_rank16", "k3_rank8"):
    for b in (1, 2):
        print(f"{sh} b{b} " + " ".join(f"{sf[sh][v][b]:7.1f}" for v in ("default", "SF1", "probe", "SF1probe")))

# %% [markdown]
# * The block scheduler does run the two grids at once. With the fill launched first, the stream's first CTAs start
#   0.2-0.9 µs after it, on the SMs and in the room the fill's 128 CTAs leave; the pair takes 21.4 µs against 23.6
#   one after the other (floor 17.9). With the stream launched first, its 528 CTAs hold every SM and the fill's
#   184 KB CTAs start only when they drain (11.7 µs into a 14.1 µs stream).
# * As a graph replay the fill alone takes 10.5 µs, not the 7 µs of its CUPTI kernel time: launch and ramp are in
#   every replay. v7's stream probe spends about that on the same bytes. So the comparison behind `stage_fc1` set a
#   kernel time against replay times, and `stage_fc1` lost at every cell (SF1 above default, SF1probe above probe).
#   It was removed (code at 592860e).
# * What the first point does leave: a kernel launched after the experts can run beside them if the experts leave
#   room on their SMs. Section 18 tries that with the tail.

# %% [markdown]
# ## 18. The tail's CTAs beside the experts (session 15)
# In the layer the tail is launched by PDL about 3 µs after the experts start, and its CTAs issue their first ring
# stages before their dependency wait. But at b1 experts v7's 128 CTAs of 512 threads x 128 registers hold the whole
# register file of 128 SMs, so only the 4 idle SMs take tail CTAs early; the tail then ends ~15 µs after the
# experts. The opt-in `fast-xco` ran the experts at 8 warps and the largest shared-memory carveout, leaving room for
# two tail CTAs per SM. Controls: `fast-w8` (8 warps only), `fast-xc100` (the carveout only), `fast-t3` (the tail's
# ring of 3 stages instead of 2, so more of it starts early), `fast-xcot3` (both). Session 15 repeated the ring
# depths (and 4) in a second run, `s41`.

# %%
s40, s41 = "traces/h200/records-380f788-s40.json", "traces/h200/records-4d82a0d-s41.json"
for shape in ("k3_rank16", "k3_rank8"):
    print(nbtools.ab_table(s40, "moe", ["stock", "fast", "fast-w8", "fast-xco", "fast-xcot3", "fast-xc100", "fast-t3"],
                           shape=shape))
    print(nbtools.ab_table(s41, "moe", ["stock", "fast", "fast-t3", "fast-t4"], shape=shape))


def moe_cells(path):
    with open(os.path.join(nbtools.ROOT, path)) as f:
        return {(r["shape"], r["batch"], r["impl"]): r for r in json.load(f)["records"] if r["part"] == "moe"}


c40, c41 = moe_cells(s40), moe_cells(s41)
for impl in ("fast", "fast-xco", "fast-xcot3"):
    ks = {k[0]: (k[1], k[2]) for k in c40[("k3_rank16", 1, impl)]["replay_timeline"]["kernels"]}
    (e0, ed), (t0, td) = [v for n, v in ks.items() if "experts" in n][0], [v for n, v in ks.items() if "tail" in n][0]
    print(f"rank16 b1 {impl:11s} experts {e0:5.1f} + {ed:4.1f} µs, tail from {t0:5.1f}, ends {t0 + td - e0 - ed:4.1f} µs "
          "after the experts")

# %% [markdown]
# Predicted: rank16 b1 57.7 -> ~56-57 µs with `fast-xco`, ~55-56 with `fast-xcot3`. Measured: no gain. The tail ended
# ~0.5 µs sooner after the experts, a fifth of what was predicted, while 8 warps cost the experts 1-6 µs on their own
# (more at b2 and rank8). The carveout alone changed nothing. The ring of 3 looked 0.4-0.8 µs faster in s40 and not
# in s41 (within the replays' p10-p90 spread); the ring of 4 is 4.5-7 µs slower (3 CTAs per SM: a second wave).
# All of them were removed again; `k3fast/LOG.md` ("Fifteenth H200 session") has the numbers.

# %%
assert table["G1"][1] > table["default"][1] and table["G1probe"][1] > table["probe"][1]
assert tail_b1["stalls"][0][0] == "long_scoreboard" and tail_b1["stalls"][0][1] > 0.8 * tail_b1["cycles_per_issue"]
assert all(tail_rows[("moe_tail", sh, b)] < tail_rows[("moe_tail@v1", sh, b)] for sh in ("k3_rank16", "k3_rank8") for b in (1, 8, 16))
assert v7_rows_once
assert all(rf["k3_rank8"]["default"][b] < 0.9 * rf["k3_rank8"]["NRF"][b] for b in (8, 64))
assert all(abs(rf["k3_rank16"]["default"][b] / rf["k3_rank16"]["NRF"][b] - 1) < 0.03 for b in (8, 64))
assert rf7["k3_rank8"]["RF7"][2] < 0.85 * rf7["k3_rank8"]["default"][2]
assert abs(rf7["k3_rank16"]["RF7"][1] / rf7["k3_rank16"]["default"][1] - 1) < 0.03
assert all(l2[(528, sc, mb)] > 0.89 * l2[(528, "cold", mb)] for sc in pf_rows for mb in sizes if mb >= 16)
assert all(l2[(528, sc, mb)] >= l2[(528, "cold", mb)] for sc in pf_rows if "beside" in sc for mb in sizes if mb >= 16)
assert all(v > 1.05 for v in y_cost.values())
assert all(l2[(528, "warm", mb)] > 0.9 * l2[(528, "cold", mb)] for mb in sizes if mb >= 16)
assert len(ov) >= 6 and all(abs(r["fill_beside_stream"]["us_median"] - r["fill_then_stream"]["us_median"]) < 1.3
                           for _, r in ov)
assert 6.5 < fill_k[len(fill_k) // 2] < 7.5 and stream_k[len(stream_k) // 2] < 13.0
first = [r for _, r in gr if not r["stream_first"]]
assert first and all(dict((n, t0) for n, t0, _ in r["beside_timeline"])["stream"] < 1.0 for r in first)
assert all(r["fill_beside_stream"]["us_median"] < r["fill_then_stream"]["us_median"] - 1.5 for r in first)
assert all(dict((n, t0) for n, t0, _ in r["beside_timeline"])["fill"] > 10.0 for _, r in gr if r["stream_first"])
assert all(r["fill"]["us_median"] > 9.5 for _, r in gr)
assert all(sf[sh]["SF1" + v][b] > sf[sh][v or "default"][b]
           for sh in ("k3_rank16", "k3_rank8") for b in (1, 2) for v in ("", "probe"))
assert all(c40[("k3_rank16", 1, i)]["replay_us_median"] > c40[("k3_rank16", 1, "fast")]["replay_us_median"] - 0.5
           for i in ("fast-xco", "fast-xcot3"))
assert all(abs(c40[(sh, b, "fast-xc100")]["replay_us_median"] - c40[(sh, b, "fast")]["replay_us_median"]) < 1.0
           for sh in ("k3_rank16", "k3_rank8") for b in (1, 2))
assert all(c41[(sh, b, "fast-t4")]["replay_us_median"] > c41[(sh, b, "fast")]["replay_us_median"] + 3.0
           for sh in ("k3_rank16", "k3_rank8") for b in (1, 2, 8))
assert all(abs(c41[(sh, b, "fast-t3")]["replay_us_median"] - c41[(sh, b, "fast")]["replay_us_median"]) < 1.0
           for sh in ("k3_rank16", "k3_rank8") for b in (1, 2, 8))
assert rot_decode_exact
assert vec_vs_loop < 1e-10
assert torch.equal(W1.bfloat16().double(), W1)
print("ok")

# %% [markdown]
# ## 19. Where the experts kernel's b1 time goes after its weights (Nsight Compute, session 16)
# The stage probes (`moe_mxfp4_experts.PROBES`, section 10) stop the kernel after a stage. `ncu6` ran the kernel
# and each probe under Nsight Compute at rank16 b1, one profiled launch each, and read the busiest SM's active
# cycles (`sm__cycles_active.max`) beside the duration: a probe that stops after FC2 has read every weight byte, so what the full kernel adds to it
# is the routing weight, the part reduction and the combine.

# %%
import os
import re
ncu6 = {case: os.path.join("traces/h200/ncu-6874cfa-ncu6", f"ncu-experts_shape_k3_rank16_batch_1{suffix}.txt")
        for case, suffix in (("kernel", ""), ("sort", "_probe_sort"), ("fc1", "_probe_fc1"), ("fc2", "_probe_fc2"),
                             ("stream", "_probe_stream"))}
busiest = {}
for case, path in ncu6.items():
    with open(os.path.join(nbtools.ROOT, path)) as f:
        busiest[case] = float(re.search(r"sm__cycles_active\.max\s+cycle\s+([\d,]+)", f.read()).group(1).replace(",", ""))
    r = nbtools.recorded_ncu(path)
    print(f"{case:7s} {r['duration_us']:6.2f} us  busiest SM {busiest[case] / 1e3:5.1f} k cycles  DRAM {r['dram_pct']:5.1f} %")
print(f"after FC2: {(busiest['kernel'] - busiest['fc2']) / 1e3:.1f} k cycles of the busiest SM")

# %% [markdown]
# About 9.5 k of the busiest SM's 28 k cycles (~4.8 µs) come after FC2, when no weight bytes are left to read; the
# stream probe (every load, no decode or MMA) carries ~7 k of them too. That stage, not the weight stream, is the
# largest term left in the kernel at b1, and the one the persistent-MoE lead (k3fast/LOG.md, session 15) has to
# shorten.

# %%
assert busiest["kernel"] - busiest["fc2"] > 8e3 and busiest["stream"] - busiest["fc2"] > 5e3
assert busiest["sort"] < busiest["fc1"] < busiest["fc2"] < busiest["kernel"]
print("ok (ncu6)")

# %% [markdown]
# ## 20. The MoE half at b1, term by term (session 17)
# Where the 2x target's missing ~6 µs would have to come from. The s49 run at today's defaults (`records-5f15bc1-s49.json`)
# times the three kernels of the rank16 b1 MoE half in one flushed replay; `k3ref.bytes` gives each kernel's bytes
# (the front reads the router, the latent down-projection and the shared gate/up; the tail reads the latent
# up-projection and the shared down; the shared experts' three matrices are equal in size). Each kernel's time
# after its predecessor ends is set against its bytes at the copy bandwidth measured in the same run.

# %%
from k3ref.bytes import layer_bytes
S49 = "traces/h200/records-5f15bc1-s49.json"
print(nbtools.replay_timeline(S49, "moe", "fast", 1, "k3_rank16"))
with open(os.path.join(nbtools.ROOT, S49)) as f:
    moe49 = {(r["impl"], r["batch"], r["shape"]): r for r in json.load(f)["records"] if r["part"] == "moe"}
rec = moe49[("fast", 1, "k3_rank16")]
sb = {s.stage: s.weights + s.state + s.activations
      for s in layer_bytes(k3_rank(16), "kda_moe", 1, context=0, layer=1, distinct_experts=rec["distinct_experts"])}
shared_third = sb["k3.moe.shared"] / 3
part_bytes = {"front": sb["k3.router"] + sb["k3.moe.down"] + 2 * shared_third, "experts": sb["k3.moe.experts"],
              "tail": sb["k3.moe.up"] + shared_third}
ks = rec["replay_timeline"]["kernels"]
ends = [start + dur for _, start, dur in ks]
after = {"front": ends[0], "experts": ends[1] - ends[0], "tail": ends[2] - ends[1]}
bw = rec["copy_tbps"]
print(f"{'kernel':8s} {'MB':>6s} {'us after its predecessor':>26s} {'at copy rate':>13s} {'excess':>7s}")
for k in ("front", "experts", "tail"):
    at_copy = part_bytes[k] / bw / 1e6
    print(f"{k:8s} {part_bytes[k] / 1e6:6.1f} {after[k]:26.1f} {at_copy:13.1f} {after[k] - at_copy:7.1f}")
stock_us, fast_us = moe49[("stock", 1, "k3_rank16")]["replay_us_median"], rec["replay_us_median"]
print(f"replay median {fast_us:.1f} µs against stock {stock_us:.1f} ({stock_us / fast_us:.2f}x); 2x needs "
      f"{stock_us / 2:.1f}")

# %% [markdown]
# The front and the tail stream within ~3 µs of their bytes at the copy rate. The experts kernel reads 23 MB in
# ~17 µs, about 11 µs over what its bytes cost: a latency chain (routing, two ring fills, cluster barriers, the
# part reduction and the combine, section 19), during which the HBM is mostly idle. The 2x target needs ~6 µs of
# those 11 µs back. Two routes are left (k3fast/LOG.md, session 17): make the chain shorter (the post-FC2 stage), or
# fill the idle HBM with the tail's bytes, which only the experts kernel's own idle shared memory (~20 MB over 128
# SMs) can hold while it runs.

# %%
assert abs(sum(part_bytes.values()) - rec["bytes"]) < 0.01 * rec["bytes"]      # the three kernels cover the half
excess = {k: after[k] - part_bytes[k] / bw / 1e6 for k in after}
assert excess["experts"] > 2 * max(excess["front"], excess["tail"])
assert fast_us > stock_us / 2
print("ok (the MoE b1 budget)")

# %% [markdown]
# ## 21. Parking the tail's weights, and FC2 split by output rows (v8, session 18)
# Two leads from section 20. **Parking:** after its first FC2 each experts CTA bulk-copies up to 144 KB of weights
# into its idle shared memory (the park probe, `KernelCfg.park`; nothing reads them, the outputs keep every bit).
# If the copies were free, the tail's weights could wait there and the tail run in the same kernel. The decision
# rule was written before the run: within +0.5 µs of the default at rank16 b1, build the fused kernel; +2 µs or
# more, drop it. **v8:** v7 splits each expert's FC2 by I, so every pair's y_e leaves as NH fp32 partials that a
# last-arriving CTA adds and rounds. v8 keeps v7's parts for FC1 but hands each of the expert's NH x C CTAs whole
# w2 rows over all of I. h then has to reach every one of those CTAs, through global memory: publish, arrive, spin.
# v7's part reduction disappears. By construction v8 is v4's arithmetic at clusters of NH x C, which the GPU test
# checks bit for bit.

# %%
src, park = nbtools.recorded_experts_probe("k3_rank16", "traces/h200/experts-1a2a533-s51b.json")
print(f"park probe ({src}), rank16, median µs per launch")
for v in ("default", "PARK64", "PARK", "fc2probe"):
    print(f"  {v:9s}" + "".join(f"{park[v][b]:9.2f}" for b in (1, 2)))
v8_rows = {}
for rec_file in ("traces/h200/experts-3fe6f56-s52.json", "traces/h200/experts-a9a7327-s53.json"):
    for shape in ("k3_rank16", "k3_rank8"):
        src, t = nbtools.recorded_experts_probe(shape, rec_file)
        v8_rows[(rec_file, shape)] = t
        print(f"{shape} ({src})" + "".join(f"{v:>12s}" for v in ("default", "v8", "fc1probe", "v8fc1probe")))
        for b in (1, 2):
            print(f"  b{b:<9d}" + "".join(f"{t[v][b]:12.2f}" for v in ("default", "v8", "fc1probe", "v8fc1probe")))

# %% [markdown]
# The park probe costs +4.3 µs at rank16 b1. That is the 18 MB it moves at ~4.3 TB/s: none of it hides behind the
# post-FC2 stage, so the fused experts + tail kernel is not built. The first v8 (3fe6f56, s52) gained 0.3 µs. Its
# stage probes show why. The stream probe gained 0.8 µs (the part reduction's round is gone), while the h exchange
# alone lost 2.2 µs against v7's two cluster barriers (`v8fc1probe` against `fc1probe`): five serial gpu-scope round trips.
# v8.1 (a9a7327, s53) keeps three of them: one release arrival after the CTA barrier, the acquire spin, and hG's
# loads. The departure, whose result re-arms the counter, moves after FC2. The kernel then gains 1.25 µs at rank16
# b1 and 1.3 at b2. rank8 b1 loses 5.7: there v8's row blocks allow 2 parts instead of v7's 3, so fewer SMs stream.

# %%
for f in ("traces/h200/records-a060c7f-s54.json", "traces/h200/records-f1f7f22-s55.json"):
    print(nbtools.ab_table(f, "moe", ["stock", "fast", "fast-v7", "fast-v8"]))
print(nbtools.replay_timeline("traces/h200/records-a060c7f-s54.json", "moe", "fast", 1, "k3_rank16"))
print(nbtools.replay_timeline("traces/h200/records-a060c7f-s54.json", "moe", "fast-v7", 1, "k3_rank16"))

# %% [markdown]
# In the layer, "fast" runs v8 at b1 (s54, s55) and v7 at b2 (s55; s54 ran v8 there). Three runs put v8's MoE
# half at b1 1.6, 1.3 and 0.8 µs under v7's. In the b1 timeline the experts end 2.1 µs sooner and the tail 1.9.
# At b2 the kernel's gain does not reach the replay median at rank16: +0.6 µs (s53) and +0.4 (s54). In s55 it is
# +0.8 against "fast" and -0.2 against "fast-v7", two rows that run the same kernel and differ by 1.0 µs. So v8
# is the default at bucket 1 only, where its row blocks split the w2 tiles evenly (rank16, full width), and v7
# stays at bucket 2. The 2x target at rank16 b1 is still missed, at 1.80-1.82x.

# %% [markdown]
# v8.2 lets v8 keep v7's 3 parts at rank8 b1: 6 row blocks of 37 or 38 of the 224 w2 tiles, with the tile count
# and the combine's chunk decided at run time there. It gained 0.3 µs on the bench and 0.5 in the MoE half
# (s56, no stock), and the tail still ends at the same time, so it stays opt-in.

# %%
src, r8 = nbtools.recorded_experts_probe("k3_rank8", "traces/h200/experts-f46bbcf-s56.json")
print(f"k3_rank8 b1 ({src}): " + ", ".join(f"{v} {r8[v][1]:.2f}" for v in ("default", "v8", "fc1probe", "v8fc1probe")))
print(nbtools.ab_table("traces/h200/records-f46bbcf-s56.json", "moe", ["fast", "fast-v8"], shape="k3_rank8"))

# %%
def moe_us(f, impl, batch=1, shape="k3_rank16"):
    with open(os.path.join(nbtools.ROOT, f)) as fh:
        return next(r["replay_us_median"] for r in json.load(fh)["records"]
                    if (r["part"], r["impl"], r["batch"], r["shape"]) == ("moe", impl, batch, shape))
assert park["PARK"][1] - park["default"][1] > 2.0                      # the rule's "drop it" branch
s52, s53 = (v8_rows[(f, "k3_rank16")] for f in ("traces/h200/experts-3fe6f56-s52.json",
                                                "traces/h200/experts-a9a7327-s53.json"))
assert s52["v8fc1probe"][1] - s52["fc1probe"][1] > 1.5                 # v8's exchange cost (five round trips)
assert s53["v8"][1] < s53["default"][1] - 1.0                          # v8.1 at rank16 b1 on the bench
assert moe_us("traces/h200/records-a060c7f-s54.json", "fast") < moe_us("traces/h200/records-a060c7f-s54.json", "fast-v7")
assert moe_us("traces/h200/records-f1f7f22-s55.json", "fast") < moe_us("traces/h200/records-f1f7f22-s55.json", "fast-v7")
stock55 = moe_us("traces/h200/records-f1f7f22-s55.json", "stock")
assert moe_us("traces/h200/records-f1f7f22-s55.json", "fast") > stock55 / 2    # 2x at rank16 b1: still missed
print("ok (park probe, v8)")

# %% [markdown]
# ## 22. A few hot experts: the skewed routing, v5 as the default above batch 2, v7 at bucket 8 (session 31)
# Every record up to here used the router on random inputs: at b64 ~560 distinct experts, so whole experts as work
# items (v4) fill the 66 clusters many times over. Real traffic can be skewed. `k3fast.measure.trace --routing skewed` adds
# a +8 selection-only bias to 24 hot experts, so every token picks 16 of the same 24. Then v4 has 24 work items for
# 66 clusters, and at b64 each of them is ~3 passes of <= 16 pairs that one cluster runs in a row. v5 hands out the
# passes instead (~72 items), with the same MMAs on the same pass boundaries, so bit-identical to v4.
# The first table is the H200 run that found it (v4 the default then, `fast-v5` beside it); the second is the run
# after v5 became the default, on an H100 (the pool gave no H200 that time; compare ratios inside one run only).

# %%
for shape in ("k3_rank16", "k3_rank8", "full"):
    print(nbtools.ab_table("traces/h200/records-8d292c7-s105.json" if shape != "full"
                           else "traces/h200/records-8d292c7-s105b.json", "moe", ["stock", "fast", "fast-v5"], shape=shape))
for shape in ("k3_rank16", "k3_rank8", "full"):
    print(nbtools.ab_table("traces/h100/records-d9027da-s106.json", "moe", ["stock", "fast", "fast-s13", "fast-v7"],
                           shape=shape))

# %% [markdown]
# At b64 v4 was slower than stock at every shape (0.77x / 0.71x / 0.90x on the H200) and v5 is faster (1.13x /
# 1.11x / 1.26x). On the uniform routing v5 costs nothing at rank16 b64 and 2.8 % at rank8 b64 (H100,
# `records-d9027da-s106b.json`), so it is the default above batch 2. At b8 a token's pairs are one pass, so v5's
# items are v4's: 24 items, and full width stays below stock (0.83x). Splitting each expert in two parts of I (v7,
# now allowed up to bucket 8) gives 48 items and fixes that cell (1.12x), but on the uniform routing every half
# repeats an item's fixed chain (z staging, two cluster barriers, the h exchange, the part reduction), and b8 gets
# 4-13 % slower. A part count chosen on the device from the number of active experts would keep both; it is not
# built, so v7 stays opt-in above batch 2.

# %%
def moe_cell(f, impl, batch, shape):
    with open(os.path.join(nbtools.ROOT, f)) as fh:
        return next(r["replay_us_median"] for r in json.load(fh)["records"]
                    if (r["part"], r["impl"], r["batch"], r["shape"]) == ("moe", impl, batch, shape))
s105, s106, s106b = ("traces/h200/records-8d292c7-s105.json", "traces/h100/records-d9027da-s106.json",
                     "traces/h100/records-d9027da-s106b.json")
for shape in ("k3_rank16", "k3_rank8"):
    assert moe_cell(s105, "fast", 64, shape) > moe_cell(s105, "stock", 64, shape)      # v4 below stock, skewed b64
    assert moe_cell(s105, "fast-v5", 64, shape) < moe_cell(s105, "stock", 64, shape)   # v5 above it
    assert moe_cell(s106, "fast", 64, shape) < moe_cell(s106, "fast-s13", 64, shape)   # the new default, H100
    assert moe_cell(s106b, "fast", 8, shape) < moe_cell(s106b, "fast-v7", 8, shape)    # v7's halves lose, uniform
assert moe_cell(s106, "fast-v7", 8, "full") < moe_cell(s106, "stock", 8, "full") < moe_cell(s106, "fast", 8, "full")
print("ok (skewed routing: v5 default above batch 2, v7 at bucket 8 opt-in)")

# %% [markdown]
# ## 23. Four kilobytes of shared memory, and the L1 they cost (v5.1, session 32)
# Section 22's one loss, v5 2.8-3.1 % slower than v4 at uniform rank8 b64 (two H100 runs), was neither v5's binary
# search (~100 shared-memory loads per cluster) nor its build: ptxas gives both 124-128 registers, no spills, and
# loop bodies within 1 % of each other (`traces/cpu/ptxcheck-*.json`, rows "b64 default key"). What changed was the
# shared memory. An SM's 256 KB are split between shared memory and L1 in fixed steps, and the driver takes the
# smallest step that holds the resident CTAs plus 1 KB each. v5's pass-offset table (4 KB) took rank8 b64 from 80 B
# under the 196 KB step to 32 B over it: L1 60 -> 28 KB, in a kernel that keeps ~56 KB of weight loads in flight per
# SM, whose data lands in L1 on the way to the registers. v5.1 packs the offsets into a table the kernel already had.

# %%
from k3fast.kernels import moe_mxfp4_experts as mx
from k3fast.kernels._dsl import SMEM_CARVEOUTS_KB, carveout_kb
print("sm_90 carve-out steps (KB of shared memory):", SMEM_CARVEOUTS_KB)
print(f"{'shape':10} {'bucket':>6} {'version':>7} {'smem B':>8} {'carve-out':>9} {'L1 KB':>6} {'v5 table +4 KB -> L1':>21}")
for shape, cfg in (("k3_rank16", k3_rank(16)), ("k3_rank8", k3_rank(8)), ("full", k3())):
    for key in mx.compile_keys(cfg):
        old_v5 = key.smem_bytes + 4 * (key.PMAX + 4) if key.version == 5 else None
        print(f"{shape:10} {key.MB:>6} {key.version:>7} {key.smem_bytes:>8} {carveout_kb(key.smem_bytes):>9} "
              f"{key.l1_kb:>6} {'' if old_v5 is None else mx.l1_kb(old_v5):>21}")
k8 = mx.compile_key(896, 3584, 384, 64)
assert (k8.l1_kb, mx.l1_kb(k8.smem_bytes + 4 * (k8.PMAX + 4))) == (60, 28)

# %% [markdown]
# Measured (s107, on an H100: the pool gave no H200; compare inside the run only). `pad<KB>` asks the same kernel for
# KB of shared memory it never touches, so only the carve-out changes. At rank8 b64, 28 KB of L1 costs the kernel
# 1.2-1.9 % and its stream probe (loads only) 5 %. At rank16 b64, 60 KB instead of 92 costs under 1 %. v5.1 is v4
# plus ~1 % of its own bookkeeping, and in the layer it is within 0.4-0.8 % of v4.

# %%
with open(os.path.join(nbtools.ROOT, "traces/h100/experts-c3bd739-s107.json")) as fh:
    s107 = {(r["shape"], r["variant"]): r for r in json.load(fh)["records"]}
print(f"{'shape':10} {'variant':12} {'L1 KB':>6} {'us':>8}")
for (shape, variant), r in s107.items():
    print(f"{shape:10} {variant:12} {str(r.get('l1_kb', '')):>6} {r['us_median']:8.1f}")
us = lambda shape, v: s107[(shape, v)]["us_median"]
assert us("k3_rank8", "v4pad4") > us("k3_rank8", "v4") and us("k3_rank8", "pad4") > us("k3_rank8", "default")
assert us("k3_rank8", "pad24probe") > 1.03 * us("k3_rank8", "probe")      # the stream needs the L1 room
assert us("k3_rank16", "pad24") < 1.02 * us("k3_rank16", "default")       # 60 KB is enough at rank16
s107l = "traces/h100/records-c3bd739-s107.json"
print(nbtools.ab_table(s107l, "moe", ["stock", "fast", "fast-s13"], shape="k3_rank8"))
assert moe_cell(s107l, "fast", 64, "k3_rank8") < 1.01 * moe_cell(s107l, "fast-s13", 64, "k3_rank8")
assert moe_cell(s106b, "fast", 64, "k3_rank8") > 1.02 * moe_cell(s106b, "fast-s13", 64, "k3_rank8")  # v5, before
print("ok (v5.1: v5's table no longer costs the L1)")

# %% [markdown]
# ## 24. The part count chosen on the device (v5.2, session 33)
# At b4-b16 under the skewed routing there are ~24 passes for 66 clusters of 2, so most SMs idle. Two launch-time
# fixes were measured first (s107b-d, kernel bench, H100): clusters of 4 on 30 co-resident clusters (`C4N120`) and
# v7's two parts of I per expert. Both win the skewed cells and lose the uniform ones, and a launch cannot see the
# routing. v5.2 is one kernel that routes as v5 and then branches, in every CTA alike, on the pass count it just
# computed: v7's items when `alt_parts x #passes <= Q`, else v5's. The items loop is a `@cute.jit` method
# instantiated once per configuration; the shared-memory regions are each the larger of the two.

# %%
print(f"{'shape':10} {'bucket':>6} {'alt_parts':>9} {'Q':>3} {'smem B':>7} {'v5.1 smem B':>11} {'L1 KB':>6}")
for shape, cfg in (("k3_rank16", k3_rank(16)), ("k3_rank8", k3_rank(8)), ("full", k3())):
    for key in mx.compile_keys(cfg):
        if key.alt_parts:
            v51 = dataclasses.replace(key, alt_parts=0)
            print(f"{shape:10} {key.MB:>6} {key.alt_parts:>9} {key.Q:>3} {key.smem_bytes:>7} {v51.smem_bytes:>11} "
                  f"{key.l1_kb:>6}")
            assert key.l1_kb == v51.l1_kb and key.alt.version == 7

# %% [markdown]
# Measured (s108, H100, one run per routing). Skewed, v5.2 runs at v7's speed; uniform, at v5.1's, except rank16
# b8, which is 4.3 % slower and not explained yet (the LOG lists what differs in the binary). The full-width skewed
# b8 cell, the one below stock, goes from 0.70x to 1.14x of Marlin in the kernel.

# %%
def bench_rows(f):
    with open(os.path.join(nbtools.ROOT, f)) as fh:
        return {(r["shape"], r["batch"], r["variant"]): r["us_median"] for r in json.load(fh)["records"]}
s108 = {"skewed": {**bench_rows("traces/h100/experts-bde780b-s108-skewed.json"),
                   **bench_rows("traces/h100/experts-bde780b-s108-full-skewed.json")},
        "uniform": {**bench_rows("traces/h100/experts-bde780b-s108.json"),
                    **bench_rows("traces/h100/experts-bde780b-s108-full.json")}}
print(f"{'routing':8} {'shape':10} {'b':>2} {'marlin':>7} {'v5.2':>7} {'v5.1':>7} {'v7':>7} {'v5.2/v5.1':>9}")
for routing, rows in s108.items():
    for (shape, b, v), t in rows.items():
        if v == "default":
            print(f"{routing:8} {shape:10} {b:>2} {rows[(shape, b, 'marlin')]:7.1f} {t:7.1f} "
                  f"{rows[(shape, b, 'A0')]:7.1f} {rows[(shape, b, 'v7')]:7.1f} {t / rows[(shape, b, 'A0')]:9.3f}")
sk, un = s108["skewed"], s108["uniform"]
for k in (("k3_rank16", 4), ("k3_rank16", 8), ("full", 8)):
    assert sk[k + ("default",)] < 0.92 * sk[k + ("A0",)] and sk[k + ("default",)] < 1.03 * sk[k + ("v7",)]
assert sk[("full", 8, "default")] < sk[("full", 8, "marlin")] < sk[("full", 8, "A0")]
for k in (("k3_rank16", 4), ("k3_rank8", 4), ("k3_rank8", 8), ("full", 8)):
    assert un[k + ("default",)] < 1.015 * un[k + ("A0",)]
assert un[("k3_rank16", 8, "default")] > 1.03 * un[("k3_rank16", 8, "A0")]    # the miss, kept in view
s108b, s108c = "traces/h100/records-bde780b-s108b.json", "traces/h100/records-bde780b-s108c.json"
for shape in ("k3_rank16", "k3_rank8"):
    print(nbtools.ab_table(s108b, "moe", ["stock", "fast", "fast-v51"], shape=shape))
    assert moe_cell(s108b, "fast", 8, shape) < moe_cell(s108b, "fast-v51", 8, shape) < moe_cell(s108b, "stock", 8, shape)
    assert moe_cell(s108c, "fast", 8, shape) < 1.04 * moe_cell(s108c, "fast-v51", 8, shape)
print("ok (v5.2: v7's items on the device when the passes are few)")

# %% [markdown]
# ## 25. The shared memory or the code? (A0pad8, session 34)
# v5.2 asks for 74,768 B of shared memory where v5.1 asks for 66,592, and at rank16 b8 that is the one difference
# in the launch. `A0pad8` is v5.1's kernel padded by 8,192 B to 74,784 B, 16 B over v5.2. If the shared memory were
# the cause, A0pad8 would sit with the default; it sits with v5.1 (s110a, H100, one run per routing), so the
# uniform rank16 b8 cost comes with v7's item path in the binary. The skewed rows show what that path buys.

# %%
s110 = {r: bench_rows(f"traces/h100/experts-340beb3-s110a{'-skewed' if r == 'skewed' else ''}.json")
        for r in ("uniform", "skewed")}
print(f"{'routing':8} {'shape':10} {'marlin':>7} {'v5.2':>7} {'v5.1':>7} {'A0pad8':>7} {'v5.2/v5.1':>9}")
for routing, rows in s110.items():
    for shape in ("k3_rank16", "k3_rank8"):
        d, a0, pad = (rows[(shape, 8, v)] for v in ("default", "A0", "A0pad8"))
        print(f"{routing:8} {shape:10} {rows[(shape, 8, 'marlin')]:7.1f} {d:7.1f} {a0:7.1f} {pad:7.1f} {d / a0:9.3f}")
        assert abs(pad / a0 - 1) < 0.01                  # the padding alone moves nothing
un, sk = s110["uniform"], s110["skewed"]
assert un[("k3_rank16", 8, "default")] > 1.03 * un[("k3_rank16", 8, "A0pad8")]     # the miss is the code's
assert sk[("k3_rank8", 8, "default")] < 0.9 * sk[("k3_rank8", 8, "A0")]           # and the code's gain
print("ok (A0pad8 = v5.1: the shared memory is ruled out)")
