"""Routed experts of Kimi K3's Stable LatentMoE on H200: MXFP4 w1/w3 -> SiTU-GLU -> w2 -> late routing weight
-> deterministic FP32 combine, in one CuTe DSL kernel (sm_90a).

Replaces (k3-spec.md section 11, the routed half of the latent MoE; section 10 step 5 for the late weights):

    for e in T(m):  a = bf16(z W1_e^T), c = bf16(z W3_e^T), h = bf16(SiTU(a, c)), y_e = bf16(h W2_e^T)
    r[m] = bf16( sum_j topk_w[m, j] * fp32(y_{ids[m, j]}) )           (j in slot order 0..15)

with SiTU(a, c) = [4 tanh(a/4) sigmoid(a)] * [25 tanh(c/25)] in FP32 (section 9), MXFP4 weights (section 11.1).

Version log
  v1  one persistent, clustered kernel.  Every CTA redoes a tiny counting sort of the M*16 (token, slot) pairs by
      expert in shared memory (deterministic: a column's result does not depend on its position inside the MMA),
      clusters of C CTAs take whole active experts (each expert's weights are read exactly once per pass of <= 8*GMAX
      pairs); inside a cluster CTA rank c owns 1/C of the w13 rows and 1/C of the w2 rows, h (I values per pair)
      is exchanged through DSMEM between the two phases (two cluster barriers per pass), FC2 writes bf16 y rows to a
      [M*16, dL] workspace and the last of the 16 slot-CTAs of (token, row chunk) sums them in slot order
      (acq_rel counter, self-resetting, so CUDA-graph replays need no memset).  Weights are MXFP4 decoded in
      registers with a PRMT lookup table straight into mma.sync m16n8k16 bf16 A fragments (weights = M side,
      pairs = N side); the E8M0 scale is applied once per 32-block on the fp32 partial of the two MMAs of that
      block.  Compiled on CPU (sm_90a) only; NOT yet run on a GPU.  ptxas (remarks{ptx}), 256 threads/CTA:
      rank16 M1/M8 142 regs, M64 150; rank8 M4 127, M64 200; full M1 154, M64 198; 0 spill bytes everywhere
      -> 1 CTA per SM, grid = 132 // C clusters of C CTAs (C = 8 for M <= 8, else 4), ring depth D = 8.
      Expected: ~2.7 ALU ops per weight (17 for the 8-code decode, 2 scale, 1/8 MMA...) -> issue ceiling ~6 TB/s of
      MXFP4, so HBM-bound; guess 70-80 % of 4.3 TB/s at batch >= 8, 50-60 % at batch 1 (prologue + 2 cluster
      barriers + pipeline fill on 5 us of work).
  v2  fix: H200 tests failed for every M >= 3 (rel-RMSE 0.12-0.37 uniform, 0.67-0.83 ties, 0.87-1.16 shared routing;
      M = 1, 2 passed).  Cause: each CTA's counting sort ordered an expert's pairs by smem-atomic arrival, and with
      P = 16 M > 32 the pairs of one expert come from several warps whose arrival order differs between the CTAs of a
      cluster; h columns are exchanged by position (DSMEM) and y rows written by position, so a y row mixed h chunks
      of different pairs (finite, counters fine, values wrong).  Found by reading the code and a CPU emulation of the
      index math with a per-CTA random warp order (reproduced the error pattern per routing; 0 after the fix).  Now
      each expert segment is re-ranked by pair index after the atomic placement (O(pairs per expert) per pair; one
      extra [PMAX] smem array and barrier).  Registers unchanged (rank16 142/150, rank8 127/200, full 154/198), 0 spills.
      Measured on the H200 (traces/h200/kernels-6316bd2.json, L2 flushed by a write): correct everywhere it ran,
      but slow: rank16 b1/b8/b64 45.9 / 260 / 1386 us = 0.51 / 0.67 / 0.64 TB/s (Marlin 37.5 / 104 / 409 us);
      full b1/b8/b64 263 / 1763 / 9550 us (~1.1 TB/s).  Per-warp cost is ~0.7-0.9 us per 512-byte weight step
      at every batch, ~1300 cycles: far above the decode ALU (~130 instructions) and what a D = 8 register ring
      should leave of the HBM latency.  Reading of the code: each FC1 step loads its z (B operand) fragments from
      global memory right before the MMAs, and the weight loads (default caching) stream ~180 KB per CTA and
      expert through L1, evicting z; so every step waits one L2 round trip under full HBM load, and 8 warps per
      SM (1 CTA, 140-200 registers) cannot hide it.  FC2 reads h from smem and does not have this problem.
  v3  z of the pass staged in shared memory with cp.async (overlapped with the weight ring's first loads; it
      shares the h region, which other CTAs write only after cluster barrier A), FC1's B operand read from smem;
      weight loads marked L1::no_allocate; each expert's weight streams based with a 64-bit byte offset (at full
      width w13 is 9.9 GB; v2 relied on 32-bit element arithmetic).  ptxas: rank16 M1/M8 141, M64 196; rank8 M4
      160, M64 188; full M1 210, M64 189 registers; 0 spills.
      Prediction: if the L2 round trip per FC1 step is the cost, FC1 steps drop to ~150-250 cycles and the kernel
      becomes ring/HBM-bound: rank16 b1 ~15 us (from 45.9), b8 ~60-70 us (from 260), b64 ~300-350 us (from 1386);
      i.e. 2-3x better than v2 and on par with or better than Marlin.  If it does not move, the per-step cost is
      elsewhere (MMA/decode dependency chain at 2 warps per scheduler) and the next step is more warps per SM.
      Measured (traces/h200/kernels-11595c4.json, v2 and v3 on the same inputs in one run, L2 flushed by a read):
      rank16 b1/b8/b64 38.0 / 220 / 922 us (v2 38.6 / 223 / 1078; Marlin 36.4 / 103 / 408), full b1/b8/b64
      234 / 1588 / 8908 us (v2 271 / 1844 / 9856; Marlin 133 / 798 / 3990).  Correct (GPU tests 32/32, full-width
      layer test passed).  PREDICTION MISSED: 1-15 % instead of 2-3x, so the z round trip was not the main cost.
      What the numbers say instead: every CTA streams ~6-7 GB/s at every batch and shape (b1: 183 KB per CTA in
      ~33 us; b8: 7.4 experts per cluster at ~30 us each; b64: 18.5 experts per cluster at ~50 us each), ~1/5 of
      the ~30 GB/s per SM the copy reaches, and the PTX FC1 loop is 134 instructions per 512-byte step (an issue
      ceiling near 3.5 TB/s).  The v2 row of this run (with v3's 64-bit per-expert base, i.e. simpler address
      arithmetic) is 22 % faster than v2 in the 6316bd2 run at b64, so the step is sensitive to per-step integer
      work.  Open candidates, to separate with k3fast.measure.bench_experts in one run: the 33 clusters of 4 at b64 not
      all co-resident (GPCs hold floor(SMs / 4) clusters: 32 on 8 GPCs would leave one cluster for a second
      wave), per-pass fixed costs (ring fill twice per expert, two cluster barriers, DSMEM exchange, the gpu-scope
      fence before the combine), or the loop being latency-bound at 8 warps per SM (D and the stream probe tell).
  v4  (default since the H200 run below) The register ring was not what it looked like. In each step v3 read a
      slot's words, issued the slot's refill and only then decoded the old words. So the old and the new values were
      live together, and the loop-carried slot needed a copy: the v3 PTX FC1 loop has 135 mov.b32 per 8 steps, among
      them a copy of each of the 40 ring registers (8 slots x 4 words + scale) at the loop head. A mov of a register whose load is still in flight waits for that load, so once per D
      steps every warp stalls for the newest load: a full loaded-HBM round trip, whatever D is. That stall matches
      a per-CTA rate that does not move with batch or shape. v4 consumes the slot first (decode and scale factors),
      then issues the weight refill before the MMAs, and refills the scale word after its last use. The PTX loops
      now carry no ring copies: the loads write the registers the next pass reads. Same MMAs in the same order, so the
      output must be bit-identical to v3 (tests/gpu: test_v4_matches_v3_and_reference). ptxas (after the row-index helper
      refactor): rank16 M1 128 registers with 40 B of spills, M64 140; rank8 M64 150; full M1 128 with 24 B of
      spills, M64 146. ptxas chooses the 128 cap for M1 itself; the spills are not visible in the PTX, so where
      they land is for a SASS dump (nvdisasm >= 13.4) to show.  (A first draft
      of this change left FC2's y store inside the v4-only branch; caught by re-reading the code before any GPU run,
      v2/v3/v4 paths re-checked.)
      Prediction: if this is the main cost, per-CTA streaming goes from 6-7 GB/s to 15-25 GB/s, i.e. rank16 b64
      922 -> ~300-450 us and b8 220 -> ~80-120 us (Marlin 408 / 103). If it barely moves, the stream probe and the
      W16 variants of k3fast.measure.bench_experts are the next evidence.
      Measured (traces/h200/experts-ea0c850.json, k3fast.measure.bench_experts, one run, L2 read-flushed): bit-identical to
      v3 at every batch (max |diff| 0).  rank16 b1/b8/b64 at the then-default clusters (C = 8, 8, 4): v3 41.0 /
      239.4 / 1044.6 us, v4 29.9 / 167.8 / 953.5 us (Marlin 36.4 / 101.1 / 405.4).  PREDICTION PARTLY MISSED: b8
      moved 1.4x (predicted 2-3x), b64 9 % (predicted 2-3x).  The cluster-size rows found the main cost instead:
                       b1      b8       b64      (us; v3 unless named)
        C = 2         45.1     87.5    484.8
        C = 4         30.8    154.3   1044.8
        C = 8         41.3    240.5   1472.6
        v4, C = 2     49.2     94.2    478.5
      At b64 the time per expert pass is ~52-56 us at both C = 2 and C = 4 although a C = 2 pass streams twice the
      bytes per CTA: the C = 4 grid (33 clusters) does not fit at once, and the 33rd cluster runs its 18 experts
      after the others (GPCs of 16-18 SMs hold 4 clusters of 4 each: 32).  C = 8 (16 clusters) shows the same at
      b1/b8.  C = 2 clusters are TPC pairs and all 66 fit.  The stream probe (no decode, no MMA) at the old
      clusters was 19.6 / 99.6 / 575.6 us, i.e. itself bound by the same second wave.
      Default from then on: version 4, C = 2 for MB >= 4, C = 4 for MB <= 2 (default_cluster).  Predicted: rank16
      b8 ~90 us, b64 ~480 us (1.85 TB/s, 44 % of copy: still under the 75 % target, and Marlin's 2.2 TB/s at b64),
      b1 ~28-31 us.  What remains at C = 2 is ~14 GB/s per SM with 32 KB of loads in flight per SM (8 warps x D = 8
      x 512 B): either the loop's issue rate at 2 warps per scheduler (~150 instructions per 512 B step) or the
      in-flight depth.  bench_experts' C = 2 rows (probe, D = 4/12, 16 warps) separate the two.
      Measured (traces/h200/experts-e44cd14.json, one run, copy 4.21 TB/s; GPU tests of the new default passed,
      logs/gpu-junit-e44cd14.xml): rank16 b1/b8/b64 31.1 / 94.4 / 481.8 us = 0.75 / 1.81 / 1.85 TB/s (Marlin 36.6 /
      102.3 / 407.0), i.e. the prediction held (~28-31 / ~88-94 / ~480).  Faster than Marlin at b1 and b8, 18 %
      slower at b64.  What bounds it now, from the C = 2 rows of the same run:
                       b1      b8       b64     (us)
        default       31.1     94.4    481.8    (W = 8, D = 8: 40 KB of loads in flight per SM)
        probe         20.6     54.9    264.1    (no decode / MMA: 1.13 / 3.12 / 3.37 TB/s)
        Dprobe4       22.4     67.9    333.7    (probe with half the loads in flight)
        D4            33.3    105.4    568.7
        D12           30.1     99.8    547.4    (ptxas: 255 registers + 96 B of spills at MB 64)
        W16D8         30.1     82.4    433.2    (16 warps; 128-register cap, 44-48 B of spills)
      The load structure alone reaches 80 % of the copy bandwidth at b64 (the probe), and depth matters to it
      (Dprobe4 is 26 % slower).  The full kernel takes 1.55-1.82x the probe's time (D = 4, 8), and 16 warps per SM
      recover 10-13 %.  So the decode + MMA instruction stream is the bound (~150 instructions per 512-byte step at
      8 warps, where ~2 IPC gives ~14 GB/s per SM), not HBM.  The next version has to cut instructions per step
      (decode through shift + LOP3 + one bf16x2 multiply per register instead of the PRMT table, or fewer
      scale multiplies) and run 16 warps.  W16D8 is bit-identical to the default on these inputs, but the GPU tests
      have not run it, so it is not the default yet.
      Skewed routing (24 hot experts) got slower with C = 2: b64 170.9 -> 232.6 us.  With ~24 active experts only
      24 clusters have work, i.e. 48 SMs at C = 2 against 96 at C = 4.  Work items of one pass (expert, <= NT
      pairs) instead of one expert would spread those passes over all 66 clusters (v5).
  v5  (2026-11-29; opt-in until session 31, the default above batch bucket 2 since, below) v4 with single passes
      as work items.
      The prologue's block scan also counts passes (packed as passes << 21 | active << 11 | pairs: <= 1024, <= 896
      and <= 1024 fit), every CTA writes each active expert's first pass (a pass_off[] table until v5.1, below),
      and cluster q takes items q, q + Q, ..., finding its expert by an 11-step binary search over those first
      passes.  Same MMAs on the same pass boundaries, so
      the output must be bit-identical to v4 (tests/gpu: test_v5_matches_v4_and_reference; the index math is
      replayed on CPU by tests/compile: test_v5_pass_items_cover_every_pass_once).  ptxas: rank16 M1 152, M8 146,
      M64 142 registers, 0 spills (v4: 128 with 28 B of spills at M1/M8, 142 at M64).
      Prediction: skewed rank16 b64 (24 hot experts, ~3 passes each, 72 items over 66 clusters) 232.6 -> ~90-120
      us, the kernel bench's moe_mxfp4_experts@v5:skewed row; uniform routing unchanged within noise (about one
      pass per expert).
      Measured (kernels-50b6243.json / experts-50b6243.json, one run, L2 flushed): skewed rank16 b64 190.2 -> 110.3
      us (inside the range; Marlin 114.5); uniform b1 / b8 / b64 25.9 / 66.8 / 344.7 against the default's 25.2 /
      66.1 / 347.8 (within 1 %). Bit-identical to v4 on the GPU (test_v5_matches_v4_and_reference, 23 of 23 at
      1f10ff5, logs/gpu-junit-1f10ff5-s27t.xml).
      It stayed opt-in until the layer measured it: session 31's s105 / s105b (records-8d292c7-s105*.json, skewed
      routing, one run per step beside stock) put the default (v4) below stock at every b64 cell, MoE half rank16 /
      rank8 / full 246.3 / 324.2 / 1154.3 us against stock's 188.5 / 230.3 / 1040.1, and v5 at 167.1 / 208.4 /
      823.2 (1.13x / 1.11x / 1.26x stock); b8 the same as v4 (85.6 / 101.9 / 384.0 against 85.8 / 101.8 / 382.2).
      So v5 above bucket 2 (DEFAULT_VERSION; buckets <= 2 keep v7 / v8). What it leaves: full width b8 (~24 hot
      experts, one pass each: 24 items on 66 clusters) stays below stock (382 against 317 us); only a split of
      each item by parts of I (v7's, at larger buckets, with the part count chosen from the item count on the
      device) would fill the idle clusters there.
  v5.1 (2026-12-06, session 32; the default v5 from here) v5's pass offsets packed into act_e's high half (expert
      id < 2^16 low, first pass <= 1024 high; the totals in scr[32] as #active | #passes << 16) instead of a
      pass_off[PMAX + 4] table. Why: the table was v5's only cost (+2.8 % / +3.1 % at uniform rank8 b64 in s106b /
      s106c, H100; rank16 equal), and it was neither the search nor the build. ptxas 12.9 (Triton's wheel):
      rank8 M 64 v4 / v5 128 / 124 registers, 0 spill bytes, SASS per loop turn FC1 690 / 685, FC2 614 / 612. It
      was the 4 KB: rank8 b64's CTA went from 195,600 B (80 B under sm_90's 196 KB carve-out step with its 1 KB
      reserve: 60 KB of L1) to 199,712 B (the 228 KB step: 28 KB of L1), while this kernel keeps 16 warps x 32
      lanes x 7 x 16 B = 56 KB of weight loads in flight per SM, whose data lands in L1 on its way to the
      registers. rank16 (141 / 145 KB) and full width (185 / 189 KB) b64 stayed inside their steps. Now v5's
      shared memory is v4's at every key (tests/compile test_smem_fits_and_v5_keeps_v4s_carveout; the carve-out
      model is k3fast.kernels._dsl.carveout_kb / l1_kb, KernelCfg.l1_kb). v4's PTX is unchanged (compared); v5.1 rank8 M
      64: 128 registers, 0 spills, FC1 / FC2 685 / 612 per turn. Bit-identical to v5 and v4 by construction (the
      same items in the same order). The diagnostic KernelCfg.smem_pad (bench_experts "pad<KB>") asks for shared
      memory nobody uses, to time what a carve-out step costs on any key.
      Prediction (s107): bench rank8 b64 v5.1 within +-1 % of v4, pad4 / v4pad4 (28 KB of L1) 2-4 % slower;
      rank16 b64 pad4 within +-1 % (no step), pad24 (92 -> 60 KB of L1, under its 64 KB in flight) 3-10 % slower,
      its stream probe too; MoE half uniform rank8 b64 fast (v5.1) within +-1 % of fast-s13 (v4).
      Measured (s107 at c3bd739 on an H100, traces/h100/experts- and records-c3bd739-s107.json, copy 2.98 TB/s; GPU
      tests 24 passed, v5.1 bit-identical to v4): MoE half rank8 b64 v5.1 / v4 599.3 / 594.3 us (+0.8 %, was +2.8 %
      / +3.1 %), rank16 434.6 / 433.0 (+0.4 %): as predicted. Bench rank8 b64 v5.1 / v4 577.2 / 571.5 (+1.0 %),
      pad4 584.3 and v4pad4 582.2 (the 28 KB L1 costs 1.2-1.9 %, under the 2-4 % predicted; the probe 5.0 %);
      rank16 b64 pad24 (60 KB of L1) +0.9 %, probe +0.8 %: MISSED (3-10 % predicted), 60 KB is enough there. What
      is left of v5's cost, ~1 % in the bench at both shapes, is its own bookkeeping (LOG, session 32).
  v5.2 (2026-12-06, session 33; the default at buckets 4 / 8) v5's kernel also carries v7's items (KernelCfg
      alt_parts = 2 parts of I, the part reduction) and takes them when alt_parts x #passes <= Q, i.e. when every
      part of every pass gets a cluster in one round. Why: at skewed routing (24 hot experts) b4-b16 run 24 passes
      on 66 clusters of 2, so 84 of 132 SMs idle. Two fixes were measured first (s107b-d, H100 kernel bench): v7's
      halves and clusters of 4 over 30 co-resident clusters (C4N120) each took 7-38 % off the skewed cells and
      added 4-47 % at uniform routing (C4N120: 13-15 % at rank16 / rank8 b8, 3.6 % at full b8), and a launch-time
      choice cannot see the routing. One branch per launch, on the pass count every CTA computed: the items loop is
      a @cute.jit method instantiated for each cfg, the shared-memory regions are each the larger of the two (both
      keys keep 156 KB of L1), the grid is v7's Q (66, >= v5's), and v5's y rows move to the bf16 rows mYb so that
      mY holds v7's fp32 parts. The v7 branch is bit-identical to v7 itself (same items, act_e read through a
      mask), the v5 branch to v5.1. Buckets >= 16 keep v5.1: v7's part counters stop at 128 pairs at C = 2.
      Prediction (s108, H100): uniform b4 / b8 within +-1.5 % of v5.1, skewed within +-3 % of v7.
      Measured (s108 / s108b / s108c at bde780b on an H100, traces/h100/*-bde780b-s108*.json; GPU tests 38 passed,
      each branch bit-identical to its twin): kernel skewed rank16 b4 / b8 and full b8 33.5 / 38.6 / 166.8 us (v5.1
      39.4 / 42.8 / 272.9, v7 33.2 / 37.7 / 165.5, Marlin 46.5 / 47.9 / 189.7); uniform -0.6 to +1.2 % of v5.1 except
      rank16 b8, +4.3 % (83.2 against 79.7: MISSED, not explained; LOG, session 33). MoE half b8 skewed rank16 /
      rank8 95.3 / 106.3 us against v5.1's 99.5 / 117.5 (stock 125.5 / 136.1); uniform +3.6 % / +1.2 %.
  rot layout (2026-11-29; the default for v4/v5 when every E8M0 scale is <= 128, CPU-compiled, not yet run on a
      GPU).  The instruction cut that v4's measurements asked for, by layout rather than by a new version: the
      words are packed so that register j of a word is (rotl(w, r) & mask) over one piece (j = 0, 1, 2: r = 0, 4,
      10) or two (j = 3: r = 6 and 14), 9 ALU ops per word, giving code * 2^-126 as bf16 (e1 e0 in the exponent
      lsbs, m in the mantissa msb, so code 0.5 is a subnormal).  One mul.rn.bf16x2 by 2^(E-1) (= 2^126 * scale,
      built from the E8M0 byte by one PRMT and one IMAD) makes the exact dequantised bf16 weight, so the MMAs
      accumulate straight into acc: no fresh fp32 partial and no 4 scale FFMAs per block and n-group.  The
      nibble layout's decode was 8 PRMTs (4 of them table look-ups whose table word ptxas re-materialised from a
      uniform register each time: 4 extra IMAD.U32) + 3 shifts + 5 LOP3 per word.  The FC1/FC2 step indices are
      also split once per D steps (step_split) instead of dividing by KS1 = 56 twice per step.
      SASS of the main loops (ptxas 12.9 from the PTX, nvdisasm: `python -m k3fast.measure.ptxcheck`, recorded in
      traces/cpu/ptxcheck-b70965984d93.json; k3_rank16, C = 2, D = 8, W = 8; instructions per 8-step loop
      body, FC1 / FC2; at W = 16 rot 720 / 679 and 933 / 893, nibble 1098 / 972 and 1367 / 1164):     nibble          rot
                                  M 8   1097 / 935     727 / 636   (-34 % / -32 %)
                                  M 64  1371 / 1119    912 / 839   (-33 % / -25 %)
      ptxas: 128 registers at M 8 (12 B of spills outside the loops; nibble: 28 B), 138 at M 64, 0 spills.
      Numerics: the same exact weights as the nibble layout, accumulated in one fp32 chain per k16 MMA instead
      of per-block partials, so the output may differ from the nibble layout's in the last bits (GPU test
      test_rot_and_nibble_layouts_agree), never from the reference by more than the tolerance.  Scales 0 are
      exact here (2^-127; the nibble layout maps them to 0); scales > 128 would overflow the multiplier, and
      prepare_mxfp4_experts(layout="auto") then keeps the nibble layout.
      Prediction (issue bound, time ~ instructions; the probe is the floor of this structure): rank16 b1 / b8 / b64
      31.1 / 94.4 / 481.8 -> ~28-31 / ~65-72 / ~330-370 us; the bench rows moe_mxfp4_experts@nibble and
      bench_experts' "nibble" variant time the old layout on the same inputs.
      Measured (experts-e384fbf.json, copy 4.19 TB/s; GPU tests 67 passed, logs/gpu-junit-e384fbf-rot.xml):
      rank16 b1 / b8 / b64 26.6 / 77.3 / 419.9 us against nibble 31.1 / 94.9 / 482.7 on the same inputs (-15 /
      -19 / -13 %): b1 held, b8 and b64 MISSED (25-34 % fewer SASS instructions bought 13-19 %; the loop is not
      purely issue bound, the probe is 55.2 / 265.8 us).  16 warps per CTA (W16D8): 25.6 / 66.8 / 348.4 us
      (2.56 TB/s at b8 and b64, 61 % of copy; Marlin 36.7 / 102.3 / 409.1), bit-identical to W = 8, so
      DEFAULT_WARPS = 16 from here (ptxas caps 512-thread CTAs at 128 registers: 24-52 B of spills outside
      the main loops).
  v6  (2026-11-29, session 5; opt-in, version=6, batch buckets <= 2 only; CPU-compiled, not yet run on a GPU) v4
      with each expert split over two clusters by the intermediate dimension: work item wi = (expert wi // 2, half
      wi % 2). A half's cluster computes h for its I/2 outputs (its w13 tiles [hI I/16, (hI+1) I/16)), exchanges
      them inside the cluster, and runs FC2 over the matching I/2 K steps of every w2 tile (the SiTU is elementwise
      in I, so the split is exact). It stores the fp32 partial y_half in a workspace [2 x pairs, dL] (the bf16 y
      workspace's memory, viewed as fp32). The combine fires at 32 arrivals per (token, rank), not 16, and forms
      bf16(y_0 + y_1) per slot before the weighted sum: the reference's single rounding of y_e. Two fp32 chains
      over I/2 instead of one over I, so v6 is close to v4 but not bit-identical (GPU test at 2e-3 against v4, the
      table's tolerance against the reference).
      Why: at b1 the 16 experts x C = 4 keep 64 of the 132 SMs streaming (the stream probe: 17.6 us for 23 MB,
      experts-50b6243.json). C = 8 would use 128, but only 15 clusters of 8 are co-resident. 32 clusters of 4
      are: the grid is 32 clusters, even at MB 2 (the 33rd would be a second wave). The CPU tier replays the
      FC1/FC2 row arithmetic over both halves, every rank, warp and step: each w13 and w2 row is read exactly once
      (test_v6_index_math_covers_every_weight_row_once). The v3/v4/v5 PTX is unchanged (md5 of the PTX at M 1, 8
      and 64). ptxas 12.9 (traces/cpu/ptxcheck-07cd715093d7.json): 128 registers, 14 local-memory instructions (v4: 12),
      SASS 46.4 KB (43.6).
      Prediction: rank16 b1 experts 25.2 -> ~14-17 us in the kernel bench (bench_experts v6 / v6probe), MoE half
      b1 -6 to -9 us in the layer (fast-v6). b2 similar. If the probe halves but the kernel does not, the fixed
      costs per item (prologue sort, two cluster barriers, the combine) dominate at this size.
  v7  (2026-11-30, session 8; the default at batch buckets <= 2 since its H200 run, below) v6
      generalised to NH parts of I per expert (default_parts: the most parts, each a multiple of 64 outputs, whose
      items all get a cluster at once; rank16 b1 4, b2 2; rank8 b1 3) over clusters of C = 2 (V7_CLUSTER). Why:
      at b1 the default keeps 64 SMs streaming (16 experts x C = 4); v6 put 32 clusters of 4 on 128 SMs and its
      stream probe got slower (25.9 against 17.8 us), which fits a second wave of the clusters of 4 that do not fit
      (a GPC with fewer than 16 free SMs holds 3): C = 4 grids above ~30 clusters are not all co-resident, while the
      66 TPC pairs are. v7 at rank16 b1 is 64 clusters of 2 = 128 SMs, each CTA reading 1/8 of an expert (183 KB
      instead of 365 KB). The combine changes too: in v6 the last of the 32 arrivals per (token, rank) read all 32
      fp32 half rows of its rank (115 KB per CTA at C = 4); at NH = 4, C = 2 that would be 458 KB through one SM.
      v7 adds a part reduction: the NH-th arrival per (pair, rank) (counters at PART_COUNTERS) adds the parts in
      part order, rounds y_e to bf16 once and writes it to a bf16 y region behind the partials, then arrives for
      the combine, which is v4's (16 bf16 rows per token). The reductions are spread over whichever CTAs finish a
      pair last. NH fp32 chains over I / NH: close to v4, not bit-identical (GPU test at 2e-3 against v4 and the
      table's tolerance against the reference; bit-identical run to run). CPU tier: the row arithmetic over every
      part, rank, warp and step reads each w13 / w2 row once (test_v7_index_math_covers_every_weight_row_once).
      ptxas 12.9: rank16 M1 128 registers, 72 B of spills, 27 local-memory instructions (v4: 24 B, 12), 2808 SASS
      instructions (v4 2784); M2 0 spills.
      Prediction: the probe at rank16 b1 17.8 -> ~10-12 us (half the bytes per SM, one more round trip for the
      part reduction); the kernel 25.5 -> ~15-18 us (half the decode per SM); MoE half b1 -6 to -9 us (fast-v7).
      b2 (2 parts, 64 clusters of 2): about v4's. If the probe does not drop, the v6 loss was not co-residency.
      Bench rows: bench_experts v7 / v7probe / v7P2 (2 parts: the split's cost at 64 SMs).
      Measured (experts-ab2cffe-s13.json, records-ab2cffe-s13.json, one run, copy in the records; GPU tests 15
      passed, 0 failed, logs/gpu-junit-ab2cffe-s13.xml):
                        default (v4)   probe     v6     v6probe    v7     v7probe   v7P2    marlin   (us)
        rank16 b1          25.3        17.6     33.6     25.8     20.9     17.7     26.3     36.4
        rank16 b2          45.2        30.7     59.5     44.0     27.7     23.1     27.6     48.3
        rank8  b1          38.0        23.6     49.1     32.4     27.0     21.0     39.5     41.5
        rank8  b2          70.7        43.0     90.5     56.2     41.4     28.8     41.6     58.2
      MoE half (fast -> fast-v7, same run): rank16 b1 63.1 -> 60.0 us (stock 102.8), b2 83.8 -> 65.8 (115.7);
      rank8 b1 85.5 -> 74.8 (111.7), b2 119.7 -> 90.7 (129.8). The kernel prediction held at b1 (~15-18 predicted,
      20.9 measured: near), the probe one did not: at rank16 b1 the v7 probe takes what v4's does (17.7 / 17.6)
      with half the bytes per SM. So at b1 the load structure is a latency chain (wait, routing sort, two ring
      fills, two cluster barriers, part reduction, combine), not per-SM bandwidth; v7 wins by halving each SM's
      decode + MMA (v4's kernel - probe 7.7 us, v7's 3.2). The layer gained 3.1 us at rank16 b1, under the -6 to -9
      predicted, and 18-29 us at b2 and rank8, where v4 ran 2 passes per cluster. v7P2 (64 SMs) matches v4 at b1:
      the split and the part reduction cost nothing measurable. The default for buckets <= 2 from here
      (default_version; "fast-s13" is the A/B with v4 everywhere).
      Its b1 chain by stage (experts-6ec1427-s15.json; stream probes stopped after a stage, PROBES): the routing
      sort 6.0 us (launch and PDL wait included), FC1 with the barriers and the h exchange +6.9, FC2 +1.6, the
      part reduction and the combine +3.3, decode and MMA +2.9 (kernel 20.8).
  gridcomb (2026-11-30, session 8; measured slower on the H200 (s16) and removed; the code is at 26465c5) v7's
      part reduction and combine as one grid-wide arrival: every CTA arrived once after its last pass (release
      add, then an acquire spin until all Q * C had arrived; all resident, one per SM, which the key checked),
      then CTA b combined 32 (token, 8-column vector) jobs, 16 threads each, with v7's sums in v7's order
      (bit-identical to v7). Two counters at the end of the workspace; the last CTA to depart reset both.
      Prediction: the stage probes put 3.3 us of the rank16 b1 chain in v7's two rounds of last-arriver work; one
      round instead: kernel 20.8 -> ~19-19.5 us, MoE half b1 -1 to -1.5 us. Bench rows G1 / G1probe; layer A/B
      fast-gridcomb.
      Measured (experts-26465c5-s16.json, one run, copy 4.194 TB/s; bit-identical, GPU tests passed,
      logs/gpu-junit-26465c5-s16.xml): rank16 b1 / b2 kernel 21.2 / 27.8 us (v7) against 24.7 / 30.4 (G1); the
      stream probe 18.0 against 21.5 at b1, so the grid-wide arrival itself costs ~3.5 us (128 CTAs arriving on
      one counter, then every CTA waits for the slowest), where v7's per-pair arrivals let early pairs combine;
      rank8 b1 27.2 against 30.2. MoE half (records-26465c5-s16.json, fast -> fast-gridcomb, one run, copy
      4.197 TB/s) rank16 b1 60.2 -> 63.4 us, b2 66.1 -> 69.4. MISSED: +3.2 / +3.3 us instead of -1 to -1.5.
      Removed with its bench rows, impl and tests. The same run's ring-depth rows (bench_experts D12 D16 W8D16
      W8D28) were all slower than D = 8 at rank16 b1 / b2 and rank8 b1 (rank16 b1: D12 22.3, D16 21.8, W8D16
      22.1, W8D28 23.2 against 21.2); only rank8 b2 D12 was under it (40.4 against 41.4, one run).
  xpf (2026-11-30, session 8; measured slower and removed in the same session; the code is at 3960ffc) FC1's
      last D steps refill their ring slots with FC2's first D weight rows (they do not depend on h), so those
      loads are in flight during cluster barrier A, the K-split reduction, the h exchange and barrier B; the FC2
      loop reads step j from slot (j + NS1 % D) % D. Without it, each pass's FC2 starts with an empty ring, one
      loaded HBM round trip after barrier B. Same MMAs in the same order: bit-identical (GPU test
      test_fc2_prefetch_is_bit_identical; CPU replay of the slot formulas, test_fc2_prefetch_ring_slots). The
      PTX of every key without it is unchanged (instruction multisets compared). ptxas 12.9, 128 registers: rank16
      M1 (v7) 68 B of spills (72 without), M8 16 (24), M64 36 (52); rank8 M1 8 (44).
      Prediction: one round trip (~1-1.5 us) less per pass: rank16 b1 20.9 -> ~19.5-20 us, b8 66.8 -> ~64-65 (two
      passes per cluster), b64 348 -> ~335-340 (~9). Bench rows X1 / X1probe (k3fast.measure.bench_experts).
      Measured (experts-3960ffc-s14.json, one run, copy 4.205 TB/s; bit-identical, GPU tests passed,
      logs/gpu-junit-3960ffc-s14.xml): rank16 b1 / b8 / b64 21.1 / 66.0 / 373.2 us against the default's 20.9 /
      66.3 / 346.8; probes 18.2 / 52.4 / 249.8 against 17.9 / 52.6 / 236.0. MISSED: no gain at b1 / b8, 7.6 %
      slower at b64, the probe too (+5.8 %). So the FC2 ring fill after barrier B was not a cost worth a round
      trip: at b1 the v7 chain is elsewhere, and at b64 the probe already streams at 3.78 TB/s (90 % of copy)
      and the extra per-step branches and the early FC2 lines only reorder a saturated stream. Removed with its
      bench rows and tests.

  route1 (2026-11-30, session 10; route_direct / ROUTE_DIRECT, the default at batch bucket 1 since session 11;
      impl "fast-s21exp" and bench_experts S1 / S1probe / S1sortprobe are the sorted kernel; measured by
      h200_next s21b) At batch bucket 1 the routing needs no sort:
      the one token's 16 (token, slot) pairs become 16 segments of one pair each, read straight from the ids
      (act_e[p] = ids[0, p], act_off[p] = p, sorted_s[p] = p). A repeated expert becomes two segments instead of one
      segment of two pairs. This replaces the counting sort that runs after the PDL wait: zeroing 896 counts,
      shared atomics, the block scan, the re-rank and two more reads of the ids, with five CTA barriers between
      them. In the PTX: no shared atomics, 8 CTA barriers instead of 13, 3681 lines instead of 4071 (rank16). The
      other keys' PTX is unchanged (hashes compared).
      Bit-identical by construction. A segment's weights, z row, K order and MMAs do not depend on which CTA
      computes it. The part reduction adds parts in part order and the combine adds the 16 slots in slot order
      (GPU test test_route1_is_bit_identical, also with a repeated expert).
      Why: the stage probes (experts-6ec1427-s15.json) put 6.0 us of the 20.8 us b1 kernel before FC1 (launch,
      wait and sort). In the layer the launch and the wait overlap the front, so the sort's chain is what remains
      after the ids arrive.
      Prediction: kernel rank16 b1 -0.7 to -1.5 us (R1 against default, R1sortprobe against sortprobe); MoE half
      b1 the same (fast-route1).
      Measured (s21b at 5f1f620, experts-/records-5f1f620-s21b.json, one run): kernel rank16 b1 20.90 -> 19.94 us,
      rank8 26.82 -> 25.76; stage probe (sortprobe -> R1sortprobe) 5.95 -> 5.22 / 5.73 -> 4.86; MoE half b1
      59.6 -> 57.7 (rank16), 66.8 -> 65.6 (rank8). Met (rank16's MoE half -1.9, past the top of the range: the
      layer's replay also lost the 0.6 us of sort that the bench's probe difference shows as 0.7). Bit-identical
      (GPU tests at 5f1f620, logs/gpu-junit-5f1f620-s21.xml). The default at batch bucket 1 since session 11.
  xl2 (2026-11-30, session 10; opt-in l2_prefetch, impls "fast-xl2" / "fast-r1xl2", bench_experts L2 / L2probe /
      R1L2, all removed after their measurement by h200_next s21b) Once a work item's expert is known, its CTA
      prefetches into L2 every weight row it will read after the ring's first D loads: FC1 steps D..NS1 and all
      FC2 steps, one prefetch.global.L2 per 128-byte line (lanes 0 / 8 / 16 / 24 of a 512-byte row) and one per
      row's scale words. Bit-identical by construction: prefetches only (GPU test test_xl2_is_bit_identical; the
      PTX keeps the default's global loads, MMAs and stores, CPU test test_xl2_adds_only_l2_prefetches). ptxas
      12.9: 128 registers as before, spills 72 -> 64 B (rank16 M1), 44 -> 16 (rank8 M1).
      Why: at rank16 b1 each warp's 14 FC1 steps run as two turns of the D = 8 register ring, each waiting a
      loaded HBM round trip. FC2's ring starts only after cluster barrier B, one more HBM round trip. The expert is
      known well before either. Deeper register rings spilled and were slower (D12 / D16, s16). xpf, FC2's first
      loads issued from FC1's last steps, gained nothing at b1 (its loads still went to HBM after FC1's). Here the
      whole item's remaining bytes (~120 KB per CTA at rank16 b1) are requested at once, and the later turns and
      FC2's first loads should find them in L2.
      Risk: four in-kernel L2 prefetch designs of other kernels were measured slower (bulk prefetches queued
      behind or ahead of demand loads; ../shared/vllm-k3-decode.md's L2 row). This one uses per-line prefetches of
      bytes the CTA reads within a few microseconds, and asks for none of them twice.
      Prediction: kernel rank16 b1 -1 to -2 us (L2 against default; L2probe against probe), b8 / b64 within +-3 %
      (the rings there are already saturated); MoE half b1 the same (fast-xl2; fast-r1xl2 with route1).
      Measured (s21b at 5f1f620): MISSED, slower everywhere. Kernel rank16 b1 / b8 / b64 20.9 / 66.5 / 345.6 ->
      22.2 / 81.7 / 411.9 us, rank8 26.8 / 118.1 / 630.9 -> 30.1 / 145.0 / 774.1; the stream probe too (rank16
      17.7 / 52.8 / 236.9 -> 18.8 / 65.5 / 315.4). MoE half rank16 b1 / b8 / b64 59.6 / 110.4 / 384.1 -> 60.9 /
      126.0 / 446.7. The fifth in-kernel L2 prefetch design measured slower: even per-line prefetches of bytes
      the CTA reads within microseconds cost more than they hide. Each prefetch is an instruction per 128-byte
      line from 16 warps (~1000 per CTA at b1) issued before the ring's first loads can retire, and at b8 / b64
      each CTA's item count multiplies them while the rings are already saturated. Removed in session 11 (the
      code is at 5f1f620).
  ring_fit (2026-11-30, session 12, written as the opt-in "fast-ringfit"; the default since session 13, A/B
      "fast-noringfit" / bench_experts NRF / NRFprobe; versions 4 / 5 only, i.e. batch buckets > 2) Each weight
      loop's register ring gets its own depth: the deepest d <= D for which step_split needs no per-step division
      (K % d == 0 or d % K == 0), D1 for FC1 (K = KS1 steps per unit) and D2 for FC2 (K = NKB2H). At rank16 (KS1 =
      56, NKB2H = 4) that is D = 8 for both and the PTX is the default's. At rank8 (I = 384, W = 16: S = 2, KS1 =
      28, NKB2H = 6) it is 7 and 6, where D = 8 divides every step: unit and K step are recomputed per step, with
      the signed-division fix-ups, for the step, its refill and the z / h reads.
      Why: the session-11 SASS of the rank8 b64 kernel had 478 of the FC1 loop's 1063 instructions per 8 steps in
      index work, and rank8's loops ran 121 / 116 (b8) and 133 / 147 (b64) SASS instructions per step in FC1 / FC2
      against rank16's 90 / 85 and 117 / 112. The kernel is issue-bound there: 630.9 us against its stream probe's
      399.4 at b64, 118.1 against 81.4 at b8 (experts-5f1f620-s21b.json), and Marlin took 564.7 at b64. The
      session-11 attempts (a carried divmod, a shift for S) cut at most 8.5 % and added spills.
      CPU (ptxas 12.9 from Triton's wheel; python -m k3fast.measure.ptxcheck, traces/cpu/ptxcheck-*.json rows "ring_fit"):
      SASS per step rank8 b64 FC1 133 -> 98.6 (690 per 7 steps), FC2 147 -> 102 (614 per 6 steps); b8 FC1 121 ->
      85, FC2 116 -> 77 (460 per 6); 128 registers, spill stores 16 -> 0 bytes (b64), 36 -> 20 (b8). PTX
      instructions per MMA in the two loops -29 to -35 % (tests/compile test_ring_fit_cuts_the_index_work). Bit-identical by construction
      (a step multiplies the same rows in the same K order; only when each row is loaded changes; GPU test
      test_ring_fit_is_bit_identical).
      Risk: 7 and 6 loads in flight per lane instead of 8 (-12.5 % / -25 % bytes in flight) where the loop is
      latency-bound; RFprobe against probe measures that alone.
      Prediction (bench_experts rank8, RF against default): b64 631 -> 560-600 us, b8 118 -> 105-113; RFprobe
      within +-5 % of probe; rank16 unchanged (same PTX). MoE half rank8 (fast-ringfit against fast) b64 -30 to
      -70 us, b8 -5 to -13.
      Measured (s26 at 2667c16, s27 at 1f10ff5; experts-1f10ff5-s27.json): rank8 b8 118.9 -> 92.4 us, b64 633.3
      -> 518.0 (Marlin 134.5 / 561.2); probe 82.4 -> 75.1, 396.0 -> 349.3 (the probe shares the ring addressing,
      so it gained too: the +-5 % was wrong); rank16 66.1 / 346.5 either way. MoE half rank8 b8 168.5 -> 141.5,
      b64 643.1 -> 541.1 (stock 210.0 / 599.6). Bit-identical on the GPU (s26). The default since session 13.
  ring_fit at v7 (2026-11-30, session 13; the default since session 14's H200 run, below: RING_FIT covers
      RING_FIT_VERSIONS = 4 / 5 / 7; as run it was the opt-in RING_FIT_V7, impl "fast-ringfit7", bench_experts
      RF7 / RF7probe at fdcdffc; the A/B is now fast-noringfit / NRF, which set the full ring at every version) The same
      fitted rings for v7, whose loops the session-12 entry assumed to wait on loads rather than on issue. At b1 /
      b2 FC1 has 14 or 28 K steps per unit (rank16 b1 14, b2 28; rank8 b1 28, b2 14), so D = 8 divides per step
      there as well; FC2 has 1-3 (rank8 b2: 3, ring 6). SASS per step (ptxcheck-b4ca3b6f65a9.json, ptxas 12.9):
      FC1 rank8 b1 93.0 -> 74.9, rank8 b2 126.4 -> 85.7, rank16 b2 92.5 -> 74.6; FC2 rank8 b2 128.0 -> 87.5;
      rank16 b1 has no separate FC1 loop in SASS and its pass loop moves 2074 / 60 MMAs -> 1992 / 56 (no gain per
      MMA). Spill stores rank8 b1 24 -> 44 B, b2 60 -> 36, rank16 b1 56 -> 48, b2 0 -> 0. The evidence that the b1
      loops are not purely load-bound: the stream probe (loads and the same ring addressing, no decode / MMA) took
      17.1 against the kernel's 19.9 us at rank16 b1 (experts-5f1f620-s21b.json, R1probe / R1).
      Prediction (bench_experts, RF7 against default): rank8 b2 -8 to -15 %, rank8 b1 and rank16 b2 -3 to -8 %,
      rank16 b1 within +-3 %; RF7probe below probe by a similar share (the probe shares the addressing, as s27
      showed at v4). MoE half (fast-ringfit7 against fast): rank8 b2 -3 to -6 us (82.7), rank8 b1 -1 to -2 (65.8),
      rank16 b1 within +-0.5 (57.9).
      Measured (s29 at fdcdffc, one run; experts-fdcdffc-s29.json, copy 4.19 TB/s; records-fdcdffc-s29.json, copy
      4.07): bench RF7 against default rank8 b2 41.4 -> 33.4 us (-19 %: beyond the -8 to -15 % predicted), rank8
      b1 26.4 -> 24.8 (-6 %), rank16 b2 27.9 -> 26.7 (-4 %), rank16 b1 19.7 -> 19.9 (+0.6 %): each inside or past
      its range. RF7probe against probe -6.7 / -2.7 / -2.6 / +1.3 % (same order). MoE half rank8 b2 82.6 -> 74.3
      us (-8.3: past the -3 to -6 predicted; stock 129.8, 1.57x -> 1.75x), rank8 b1 65.8 -> 65.4 (-0.4: under the
      -1 to -2 predicted; the kernel's 1.6 us gain is mostly hidden behind the front, which the experts overlap
      by PDL), rank16 b1 58.0 -> 57.7, rank16 b2 65.2 -> 64.2. b8 / b64 (v4, unchanged) within +-0.6 us.
      Bit-identical to the full ring on the GPU (s29t: test_ring_fit_at_v7_is_bit_identical, M 1 / 2, I 256 / 384,
      uniform and skewed). The default since session 14.
  stage_fc1 (2026-11-30, session 14; opt-in STAGE_FC1, impl "fast-stagefc1", bench_experts SF1 / SF1probe; measured
      slower by session 15's s38 and removed; the code is at 592860e) Right after the routing each lane copied its
      FC1 rows (16 B, cp.async.cg) and scale words (4 B, cp.async.ca) into shared memory, one commit group per
      step: all 14 steps at once at rank16 b1, a ring of 14-15 slots of 28-42 at rank16 b2 and rank8 b1 / b2
      (214-232 KB of shared memory per CTA). Why: overlap_probe's fill moved the experts' 23.4 MB into shared
      memory in 7.0 us of kernel time, against ~11-12 us of v7's register-ring streaming (estimated from its
      stream probe). Bit-identical (s38t: 13 passed). Predicted: bench rank16 b1 19.9 -> ~17-18 us, MoE half
      57.7 -> ~55-56; the other b1 / b2 cells -1 to -3 us on the bench.
      Measured (s38 at 592860e, experts-592860e-s38.json, copy 4.22 TB/s; records-592860e-s38.json, copy 4.21):
      slower at all four cells. Bench SF1 against default rank16 b1 19.5 -> 22.0 us, b2 26.8 -> 29.4, rank8 b1
      24.8 -> 27.2, b2 33.7 -> 35.1; the stream probes too (probe -> SF1probe 16.7 -> 17.4, 22.7 -> 23.9, 19.1 ->
      21.4, 28.9 -> 30.9). MoE half rank16 b1 57.7 -> 59.8, b2 64.2 -> 68.0, rank8 b1 65.0 -> 67.6, b2 75.1 ->
      77.3. Why the estimate was wrong: it set the fill's CUPTI kernel time (7.0 us) against graph-replay times
      of the experts. As a graph replay the fill alone takes 10.5 us (overlap-592860e-s39.json), about what v7's
      probe spends streaming, so moving the bytes through shared memory had nothing to gain, and the unrolled
      step bodies (35 -> 42-83 KB of SASS, fetched cold after each L2 flush) and the loads issued after the
      routing instead of spread over the loop cost the rest.
  carveout (2026-11-30, session 15; opt-in CARVEOUT, impls "fast-xco" (with 8 warps) / "fast-xc100" / "fast-xcot3";
      measured by s40, no gain, and removed; the code is at 4d82a0d)
      The launch asks for the largest shared-memory carveout (preferred_smem_carveout = 100). Why: in the layer's
      rank16 b1 timeline (records-592860e-s38.json, replay_timeline) the tail's grid is launched by PDL 3.2 us
      after the experts start, but its CTAs find no room: v7's 128 CTAs of 512 threads x 128 registers fill the
      register file of 128 SMs, so only the 4 idle SMs run tail CTAs early, and the tail ends 15.6 us after the
      experts for its ~57 MB. During the experts the HBM is ~27 % busy (ncu1). With 8 warps (256 threads x 128
      registers, 66.9 KB of shared memory, ptxas 12.9) an SM keeps room for two tail CTAs (256 threads x 48
      registers, 32 KB ring each at moe_tail's depth 2, 48 KB at 3), but only if the SM's split gives shared
      memory 68 + 2 x 33 KB: the driver's own choice for a 67 KB CTA need not. So the experts ask for the largest
      carveout, as moe_tail and the router front already do. The tail's CTAs then issue their first ring stages
      before their PDL wait during the experts. Arithmetic unchanged (the warps change the K order of FC1's
      split: 8 warps is the configuration the kernel ran until e384fbf, tested against the reference).
      Measured (s40 at 380f788, records-380f788-s40.json, one run beside stock): MoE half rank16 b1 58.0 -> 58.3 us
      (fast-xco), 57.9 (fast-xcot3), rank16 b2 64.6 -> 66.3, rank8 b1 65.2 -> 67.3, b2 74.9 -> 80.6 (predicted
      ~56-57 at rank16 b1). The carveout alone changed nothing (fast-xc100 within -0.9..+0.3 us; bench CO within
      0.6 %). In the replay timeline the tail ended 0.5 us sooner after the experts, about a fifth of the ~2.4 us
      predicted, and the 8-warp experts lost 1.1-6.1 us on the bench. The tail's ring of 3 alone (fast-t3) looked
      0.4-0.8 us faster in s40 but not in s41's repeat (-0.8..+0.3); 4 (fast-t4) was 4.5-7 us slower.
  park probe (2026-11-30, session 17; KernelCfg.park, bench_experts PARK / PARK<KB>; CPU-compiled, not yet run on a
      GPU, h200_next s51 measures it) A diagnostic, not a version: after the CTA's first FC2, thread 0 bulk-copies
      park bytes (16 KB cp.async.bulk chunks; park_max fills what the kernel leaves: 144 KB at b1, 128-144 KB at
      b2) of a w13 range that the item does not read into shared memory that nothing reads, on one mbarrier that the CTA
      waits on before it exits. The outputs are the default's bit for bit (GPU test test_park_probe_keeps_the_output);
      the default keys' PTX is the same instruction sequence as before (register numbering differs at M = 1).
      Why: LOG session 17, next steps, item 3. The tail's weights could be parked in the experts kernel's idle
      shared memory (~18 MB over 128 CTAs) while the post-FC2 stage leaves the HBM idle, and the tail run in the
      same kernel after a grid barrier (MoE half rank16 b1 ~58 -> ~53.5 us, estimated). This probe measures that
      design's first risk: what the copies cost the experts' own chain.
      Prediction / decision rule: bench PARK against default at rank16 b1 within +0.5 us (the copies land while the
      CTA waits on the part reduction and the combine) -> build the fused kernel; +2 us or more -> the idle window
      is not idle enough, and the estimate above does not hold. (The PARK rows' bytes and TB/s count the experts'
      bytes only.)
      Measured (s51b at 1a2a533, experts-1a2a533-s51b.json, one run, copy 4.207 TB/s; GPU test
      test_park_probe_keeps_the_output 4 passed in s51, logs/gpu-tests-085894c-s51.log): default / PARK (144 KB) /
      PARK64 rank16 b1 19.26 / 23.52 / 20.90 us, b2 26.46 / 30.72 / 27.20; rank8 b1 24.83 / 28.67 / 26.05, b2 33.76
      / 37.76 / 34.46. PARK costs +4.3 us at rank16 b1, the 18.4 MB it moves at ~4.3 TB/s: none of it hides behind
      the post-FC2 stage; PARK64 (8.4 MB) +1.6 against 2.0 at the copy rate. Past the +2 us of the rule: the fused
      experts + tail kernel is not built (its ~4.5 us gain assumed the parking free; at +4.3 it nets ~0).
  v8  (2026-11-30, session 18; opt-in, version=8, impl "fast-v8", bench_experts v8 / v8probe / v8fc1probe; batch
      buckets <= 2) v7's parts of I for FC1 (the same work items, clusters of 2, h columns per CTA), but FC2 split
      by output rows: the RB = NH x C CTAs of an expert's items each compute dL / (16 RB) whole w2 tiles over all of
      I, so y_e leaves FC2 complete, rounded to bf16 once, and v7's part reduction (fp32 partials out, an arrival
      per (pair, rank), the last arrival reading NH rows back and writing y_e) is gone. What it needs instead is all
      of h in every CTA of the expert: each CTA publishes its h columns to hG (global, [pairs, I] bf16) and arrives
      on the segment's counter (H_COUNTERS + u, release), issues FC2's first ring loads (they do not depend on h),
      spins (thread 0, acquire) until all RB arrived, reads hG from L2 and departs; the last departure re-arms the
      counter. The cluster barriers and DSMEM stores go (the PTX has none). The spin needs every CTA of an expert
      resident: v7's grid already is (one CTA per SM, <= 128 CTAs; a PDL dependent launches only after all of them
      ran their trigger). The combine is v4's, per (token, row block), RB chunks instead of C. (dL / 16) % RB must
      be 0, so rank8 b1 takes 2 parts (v7: 3; default_parts with dL).
      (Added after the runs: KernelCfg refuses Q < NH, where a cluster would hold two items of one segment and its
      spin would wait on itself; on a 132-SM H200 Q is 64 against NH <= 4.)
      Numerics: FC1's K split and FC2's tiles and K order equal v4's at clusters of RB (tests/compile
      test_v8_index_math_and_its_v4_twin): every output bit must equal that v4's (GPU test
      test_v8_is_v4_at_its_row_blocks), i.e. v8 is v4's arithmetic with the 8-CTA "cluster" that the H200 cannot
      co-schedule (15 clusters of 8 fit, version log v4) replaced by one through global memory. The other keys'
      PTX is unchanged (md5 of v7 rank16 b1 / b2, rank8 b1, v4 rank16 b8). ptxas 12.9: 128 registers, spill stores
      0 B at rank16 b1 (v7: 48), 28 at b2 (v7: 0), 16 at rank8 b1 (v7: 44).
      Why: the stage probes put the part reduction and the combine at ~3.3 us of the rank16 b1 chain (s15) and the
      bench's default - fc2probe at 5.5 us (s51b); session 17's LOG, next steps item 2.
      Prediction (bench, v8 against default): rank16 b1 19.3 -> ~17.8-18.5 us, b2 26.5 -> ~25.5-26; rank8 b2
      33.8 -> ~32.5-33.3 (same parts); rank8 b1 24.8 -> 24-26.5 (64 CTAs instead of v7's 96: may lose). v8fc1probe
      within +-0.5 us of fc1probe (the spin replaces barrier B; hG's round trip replaces the DSMEM stores). MoE
      half (fast-v8 against fast) rank16 b1 58.0 -> ~56.5-57.3 (2x stock needs <= 51.9). If the kernel gains and
      the layer does not, the tail's start was not set by the experts' last CTA.
      Measured (s52 at 3fe6f56, experts-3fe6f56-s52.json, one run, copy 4.133 TB/s; GPU tests 14 passed,
      logs/gpu-junit-3fe6f56-s52.xml: bit-identical to v4 at clusters of RB in all 10 cases incl. ties, shared
      routing and I = 3072, graph replay): default (v7) / v8 rank16 b1 19.52 / 19.23 us, b2 26.69 / 26.72, rank8
      b1 25.15 / 31.84 (2 parts), b2 33.92 / 34.14. Missed: -0.3 us at rank16 b1 against the -0.8 to -1.5
      predicted, none at b2, rank8 b1 +6.7. The stage probes say where it went: the stream probe gained 0.8 us
      (17.02 -> 16.19: the part reduction's round is gone), but the one stopped after FC1 and the h exchange lost
      2.2 (fc1probe 12.42 -> v8fc1probe 14.66). v8's exchange had five serial gpu-scope round trips (a fence in
      every thread, the arrival, the spin, a fence, hG's loads, the departure's result before a barrier) where v7
      has two cluster barriers.
  v8.1 (session 18, the same opt-in) The exchange with three round trips: the CTA barrier alone orders the h stores
      before thread 0's release arrival (no per-thread fence), the acquire spin needs no fence after it, and the
      departure (whose result re-arms the counter) moves after FC2, where the last thread's wait overlaps warp 0's
      combine arrivals. Bit-identical to v8 (the same arithmetic; GPU test test_v8_is_v4_at_its_row_blocks).
      Prediction: v8fc1probe 14.66 -> ~13-13.5 us (1-1.5 of the 2.2 back), the kernel rank16 b1 19.23 -> ~18-18.5
      (v7 19.52), b2 -0.5 to -1; MoE half rank16 b1 -0.5 to -1.5 (fast-v8 against fast, s53).
      Measured (s53 at a9a7327, experts- and records-a9a7327-s53.json, one run, copy in the records; GPU tests 11
      passed: v8.1 bit-identical to v4 at clusters of RB in the 10 cases, the MoE half at b1 against the reference):
      kernel default (v7) / v8.1 rank16 b1 19.49 / 18.24 us (predicted ~18-18.5: met), b2 26.78 / 25.50 (-1.3,
      past the -0.5 to -1), rank8 b2 33.98 / 33.54, rank8 b1 25.02 / 30.72 (2 parts, as expected). v8fc1probe
      14.66 -> 14.02 (predicted ~13-13.5: the exchange still costs 1.6 us over v7's cluster barriers at rank16 b1;
      at b2 it is 1.8 us cheaper than v7's). MoE half fast / fast-v8 rank16 b1 58.3 / 56.7 us (-1.6: met), b2 64.0
      / 64.6, rank8 b2 75.0 / 74.9 (stock did not run: vLLM was not staged). v8 becomes the default where its
      parts equal v7's (default_version; rank16 b1 / b2, rank8 b2, full width), v7 stays at rank8 b1; "fast-v7" is
      the A/B (s54 measures both beside stock).
      Measured (s54 at a060c7f, records-a060c7f-s54.json, one run beside stock; its GPU test ids named two cases
      that do not exist, so no test ran): MoE half stock / fast (v8) / fast-v7 rank16 b1 103.0 / 56.6 / 57.9 us
      (1.82x / 1.78x), b2 115.8 / 64.1 / 63.7, rank8 b2 129.3 / 74.4 / 74.7 (rank8 b1 is v7 either way: 112.3 /
      64.9 / 65.4). In the rank16 b1 replay timeline the experts end 2.1 us sooner (36.2 against 38.2 us) and the
      tail 1.9 (51.9 / 53.8). At rank16 b2 the timeline has v8's experts ending 1.0 us sooner and the tail 0.6, but
      the replay median is 0.4 us slower (0.6 in s53): inside the noise, not a gain. So the default is v8 at bucket
      1 only (default_version), v7 at bucket 2; s55 repeats all four cells beside stock.
      Measured (s55 at f1f7f22, records-f1f7f22-s55.json, one run beside stock; 7 GPU tests of the default path
      passed): MoE half stock / fast (v8 at b1, v7 at b2) / fast-v7 / fast-v8 rank16 b1 104.0 / 58.0 / 58.8 / 58.0
      (1.80x), b2 116.8 / 63.9 / 64.9 / 64.7, rank8 b2 130.3 / 75.6 / 75.2 / 74.8. v8 at b1 over s53-s55: -1.6, -1.3,
      -0.8 us against v7. At b2 the same v7 kernel ran 1.0 us apart in two rows of one run, which is v8's whole
      difference there. The default stays v8 at bucket 1 only.
  v8.2 (session 18, opt-in at rank8 b1: fast-v8 / bench v8) Uneven row blocks: where RB does not divide the dL / 16
      w2 tiles, CTA rbi takes tiles [rbi T / RB, (rbi + 1) T / RB) (rank8 b1: NH = 3 as v7, RB = 6, 37 or 38 of
      224; T2 is the larger share and the tile count a runtime value), and its combine chunk is exactly those rows.
      So v8 takes v7's parts everywhere (default_parts no longer asks RB to divide the tiles). The even keys' PTX
      is unchanged (md5 of rank16 b1 / b2, rank8 b2). ptxas 12.9 at rank8 b1: 128 registers, 0 spills. No v4 twin
      (C = 6 does not divide the tiles): the GPU test holds it to v7 (2e-3) and the reference.
      Prediction (s56, bench and layer without stock): kernel rank8 b1 25.0 -> ~23.5-24 us (v8.1's ~1.3 us at
      rank16 b1, the same 96 CTAs as v7 here); MoE half rank8 b1 -0.8 to -1.5 (fast-v8 against fast). If it does,
      default_version takes v8 at every bucket-1 key.
      Measured (s56 at f46bbcf, experts- and records-f46bbcf-s56.json, one run, no stock; GPU tests 3 passed:
      rank8 v8.2 against v7 and the reference at b1, the twin at b2): kernel rank8 b1 24.58 -> 24.26 us (missed:
      -0.3 against -1 to -1.5), MoE half 64.9 -> 64.4 (under the -0.8 to -1.5), and in the replay timeline the
      experts end 0.5 us later and the tail at the same 60.2 us. The exchange costs more here than at rank16:
      v8fc1probe 18.43 against fc1probe 16.13 (+2.3; rank16 +1.6). Not the default: v7 stays at rank8 b1, v8.2
      remains the opt-in path there (fast-v8).
  v8.3 (session 18, written after the runs; opt-in tagged=True, impl "fast-v8tag", bench_experts v8tag /
      v8tagfc1probe; CPU-compiled, not yet run on a GPU) v8's h exchange without a counter: each h word travels as
      one 64-bit word (tag << 32) | word, stored relaxed at gpu scope (aligned, so single-copy atomic), and the
      readers poll those words until they carry this launch's tag. The poll's last load brings the data, so the
      release arrival, the acquire poll of the counter and the separate hG load (one round trip each, in series)
      become one polled load. The tag is epoch + 1; the epoch (workspace.hg[0, 0], zeroed once by make_workspace)
      is read after the PDL wait and advanced by the launch's last poller (an arrival per item and CTA on H_LAUNCH,
      re-armed by the last). hg is its own buffer, never y: other versions write arbitrary bits into y, and a stale
      word must never carry a future tag. A tag repeats after 2^32 launches. The same arithmetic as v8, so
      bit-identical (GPU test test_v8_tagged_is_v8, also checks the epoch's +1 per launch and graph replays).
      ptxas 12.9: 128 registers; spill stores 20 B at rank16 b1 (v8: 0), 28 at b2, 8 at rank8 b1. v8's PTX is
      unchanged by the option (md5).
      Prediction: v8tagfc1probe -0.5 to -0.8 us against v8fc1probe at rank16 b1 (one to one and a half round trips
      of the ~1.6 us that v8's exchange costs over v7's cluster barriers); kernel rank16 b1 18.2 -> ~17.6-17.9;
      MoE half b1 -0.3 to -0.6 (fast-v8tag against fast). Below -0.3 on the kernel it is not worth its buffer.
      Measured (s57 at 377caf5, experts- and records-377caf5-s57.json, one run, copy 4.111 TB/s, no stock; GPU tests
      11 passed with lean_arrive's: bit-identical to v8, epoch +1 per launch, graph replays). v8tagfc1probe 12.70
      against v8fc1probe 13.79 (-1.1: past the prediction, the exchange got shorter), but the kernel rank16 b1
      18.46 -> 18.62 (+0.2) and the MoE half 56.5 -> 56.5. At b2 the kernel 25.95 (v8) -> 25.38 (v7, the default
      there: 26.91), the MoE half 63.7 -> 63.6; rank8 b1 (v8.2 tagged against v7) 64.4 -> 63.7, inside the ~1 us by
      which two rows of one kernel differ in these runs. MISSED: the exchange ends sooner, the kernel does not. So
      FC2's end is set by its w2 stream, not by when h arrives: its ring loads were already issued before the
      spin, and the tiles behind them come at the HBM's pace. Not the default (the rule: under -0.3 on the kernel);
      it stays opt-in.
  lean_arrive (session 18, written after the runs; opt-in LEAN_ARRIVE / lean_arrive=True, impl "fast-xlean",
      bench_experts LEAN; CPU-compiled, not yet run on a GPU) Before the combine's arrivals (and v7's part
      reduction's) every thread fenced at gpu scope, which waits for that thread's own y stores, and then met the
      CTA barrier; the arrivals are acq_rel atomics after that barrier, which order the other threads' stores by
      cumulativity (CUTLASS's barrier arrivals rely on the same; v8.1's exchange measured it: 0.6 us of v8's
      exchange went with its fences). lean_arrive drops those fences. Same arithmetic: bit-identical (GPU test
      test_lean_arrive_is_bit_identical).
      Prediction: kernel rank16 b1 (v8) -0.2 to -0.5 us, v7 keys (two rounds) -0.4 to -0.8; MoE half b1 -0.2 to -0.5.
      Measured (s57 at 377caf5, same run as v8.3; GPU tests passed, bit-identical): kernel rank16 b1 (v8) 18.46 ->
      18.59 (+0.1), b2 (v7) 26.91 -> 26.40 / 26.53 (LEAN / v7LEAN, the same build there: -0.4 to -0.5, met); MoE
      half (fast-xlean against fast) rank16 b1 56.5 -> 56.4, b2 63.7 -> 63.8, rank8 b1 64.4 -> 63.7. MISSED at b1 and
      in the layer: the v7 kernel's gain at b2 does not reach the MoE half, whose end is the tail's. Stays opt-in
      (a weaker ordering argument is not worth carrying for no measured gain in the layer).
      (bench_experts' rank8 rows did not run in s57: its 100 s timeout ended the bench after rank16 b2.)
  v7 at buckets 4 / 8 (2026-12-05, session 31; opt-in through version=7, impl "fast-v7"; CPU-compiled, not yet run
      on a GPU) v7 served buckets <= 2 only. Nothing in its kernel needs that: its items already loop over an
      expert's passes, and at buckets <= 8 a pass holds NT = 8 pairs, one token's at most, so an expert is one pass.
      What bounded it was bookkeeping: the part counters (PART_COUNTERS + pair * C + rank) fit the workspace's 512
      counters up to 128 pairs at C = 2, i.e. bucket 8 (SPLIT_MAX_MB), and the fp32 partials plus the bf16 y_e rows
      (2 NH + 1 rows of dL per pair, 16-bit units) fit workspace.y's 1024 rows up to NH = 3 at bucket 8. There
      default_parts takes MID_BATCH_PARTS = 2: with n active experts on Q = 66 clusters, the items go from n whole
      experts in ceil(n / 66) rounds to 2 n halves in ceil(2 n / 66) half rounds.
      Why: session 31's s105b (records-8d292c7-s105b.json, skewed routing, 24 hot experts) put the full-width b8
      MoE half at 382.2 us against stock's 317.3: its experts kernel ran 272 us (24 items on 66 clusters, 48 SMs
      busy) against Marlin's 168 (109 + 59). Uniform b8 (~120 active) keeps 2 rounds of wholes -> 4 of halves.
      Prediction (layer, fast-v7 against fast, one run): skewed b8 experts about halved -> MoE half full 382 ->
      ~250-290 us (1.1-1.25x stock), rank16 85.8 -> ~70-78, rank8 101.8 -> ~80-90; uniform b8 within +-3 % (the
      same rounds; per item one more part-reduction arrival and NH fp32 partial rows, ~2-3 MB at rank16). If
      uniform b8 loses more than 3 %, the fixed costs per item dominate and v7 stays opt-in above bucket 2.
      Measured on an H100 (the device pool gave no H200 for it; s106 / s106b at d9027da, traces/h100/records-
      d9027da-s106*.json, copy 2.98 / 2.61 TB/s; ratios within one run): GPU tests 90 passed (v7 within 2e-3 of v4
      and inside the reference tolerance at M 3 / 5 / 8, every routing kind; logs/gpu-junit-d9027da-s106b.xml).
      MoE half, fast -> fast-v7: skewed b8 full 430.2 -> 325.6 us (stock 363.6: 0.85x -> 1.12x), rank16 101.1 ->
      95.9 (stock 126.1), rank8 119.2 -> 108.1 (136.8); uniform b8 rank16 136.2 -> 154.0 (+13 %), rank8 175.8 ->
      193.1 (+10 %), full 866.0 -> 898.3 (+4 %). MISSED both ways (the prediction was in H200 us; as shares): the
      skewed gains are -5 % at rank16 against -9 to -18 %, -9 % at rank8 against -12 to -21 %, -24 % at full
      width against -24 to -35 % (the low end), and uniform b8 lost 4-13 % against +-3 %. Each half item repeats an item's fixed chain (the z staging, both
      cluster barriers, the h exchange, FC2's ring fill) and adds the part reduction's round trip, and at rank16 /
      rank8 an item is small (1.5 / 2.2 MB per expert) against that chain. So v7 stays opt-in above bucket 2:
      uniform routing is the common case. The evidence points to a part count chosen on the device from the
      number of active experts (halves only when 2 n <= Q, i.e. one round either way), which needs IH, the tiles
      per CTA and the part reduction as runtime values: not built.

Bytes that must be read (MXFP4 data + E8M0 scales, distinct experts only; MB = 1e6 B) and floors at 4.3 TB/s:

  per expert: w13 2*I*dL/2 * (1 + 1/16), w2 dL*I/2 * (1 + 1/16)
  config      I     per expert   batch 1 (16)        batch 8 (~119)       batch 64 (~610)
  k3_rank16   256   1.462 MB     23.4 MB -> 5.4 us   174 MB -> 40.4 us    892 MB -> 207 us
  k3_rank8    384   2.193 MB     35.1 MB -> 8.2 us   261 MB -> 60.7 us    1338 MB -> 311 us
  full (TP1)  3072  17.55 MB     281 MB -> 65 us     2088 MB -> 486 us    10.7 GB -> 2.49 ms
  Target (issue): >= 75 % of 4.3 TB/s at batch 8 and 64 (rank16: <= 54 us and <= 276 us).
  Activations (z, h, y workspace, r) add < 8 MB at batch 64 and live in L2.

Layout (prepare_mxfp4_experts, once at load time; "nibble" layout described here, "rot" in the version log):
weights are tiled in 16-row MMA tiles; for w13 a tile holds 8 w1
rows and the 8 w3 rows of the same outputs (rows g and g+8 of the fragment: a thread owns a and c of an output).
For each (expert, tile, 64-wide K step) the 32 lanes each load 16 contiguous bytes = the A fragments of 4 MMAs
(2 MXFP4 blocks x 2 k16 steps); the K index inside a block is permuted identically on the A and B sides, so a lane's
B operand is 16 contiguous bytes of z (or h).  One 32-bit word = 8 codes = one A fragment; nibble n holds a 3-bit
magnitude, and its bit 3 holds the sign of a *different* code chosen so that (word << 4j) & 0x80008000 are the two
signs of output register j.  Scales: per (expert, tile, K step) 8 words, word g = bytes
(row g, block 0), (row g+8, block 0), (row g, block 1), (row g+8, block 1).

Numerics: decoded magnitudes are exact bf16; MMA accumulates fp32; the power-of-two scale multiplies the fp32
partial of each block (exact).  E8M0 byte 0 is treated as scale 0 (2^-127 is not an fp32 normal; it only matters for
all-zero blocks); 255 (NaN) is not special-cased.  a, c, h, y are rounded to bf16 where the stock model rounds.
The combine is deterministic (fixed slot order, no float atomics); the bf16 output is bit-reproducible run to run.

Contracts: launched with PDL; everything (ids, weights, z) is read after griddepcontrol.wait, because the routing
decides which weights to read.  The workspace's counters must start at zero (make_workspace) and stay owned by one
stream at a time.  A token may list the same expert twice (both slots are computed and summed).
"""
from __future__ import annotations

import math
import dataclasses
import functools
from dataclasses import dataclass

import torch

from ._dsl import (SMEM_PER_CTA_MAX, TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, import_cute,
                   l1_kb, weight_load_atom)

E2M1_MAG = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# bf16 bytes of the 8 magnitudes (hi = sign/exponent byte, lo = exponent lsb + mantissa byte), little-endian words
_LUT_HI = (0x3F3F3F00, 0x40404040)   # magnitudes 0..3, 4..7
_LUT_LO = (0xC0800000, 0xC0804000)
# nibble n of a stored word carries (bit 3) the sign of code _SIGN_OF_NIBBLE[n]
_SIGN_HOLDER = (3, 7, 2, 6, 1, 5, 0, 4)          # code c -> nibble whose bit 3 holds its sign
_SIGN_OF_NIBBLE = tuple(_SIGN_HOLDER.index(n) for n in range(8))
# nibble n <- (row half hr, kk) : n = 4*(kk//2) + 2*hr + kk%2
_NIB_HR = tuple((n // 2) % 2 for n in range(8))
_NIB_KK = tuple(2 * (n // 4) + n % 2 for n in range(8))

# "rot" layout (2026-11-29): a stored word is decoded to its 4 bf16x2 A registers by rotations and masks alone.
# Register j's bits at ROT_S (signs 15/31, e1 e0 m at 8..6 / 24..22) are (rotl(word, r) & mask) over the pieces of
# ROT_PIECES[j]; the four images tile ROT_S and the sources tile the 32 bits (a search over all rotation sets:
# at most three full translates of ROT_S are disjoint, so one register needs two pieces; 9 ALU ops per word).
# The result is code * 2^-126 as a bf16 (codes 0.5 are subnormals); one bf16x2 multiply by 2^(E-1) = 2^126 * the
# E8M0 scale then gives the exact dequantised weight, which needs E <= 128 (scale <= 2): prepare_mxfp4_experts
# falls back to the "nibble" layout when a checkpoint has a larger scale.
ROT_S = 0x81C081C0
ROT_PIECES = (((0, 0x81C081C0),), ((4, 0x81C081C0),), ((10, 0x81C081C0),), ((6, 0x80C080C0), (14, 0x01000100)))
ROT_MAX_SCALE = 128
LAYOUTS = ("nibble", "rot")
# target bit (mod 16) -> code bit: sign, e1, e0, m
_ROT_CODE_BIT = {15: 3, 8: 2, 7: 1, 6: 0}

# warps per CTA of the default kernel: 16 since the rot-layout run (experts-e384fbf.json: W16D8 66.8 / 348.4 us
# against 77.3 / 419.9 at W = 8, rank16 b8 / b64, bit-identical; GPU tests test_16_warps_match_reference passed)
DEFAULT_WARPS = 16

M_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_M = 64
# diagnostic probes (KernelCfg.probe; wrong output): "stream" loads the weights and XOR-folds them instead of the
# decode + MMA; "sort", "fc1" and "fc2" are the stream probe stopped after a stage, to time the b1 latency chain
PROBES = ("", "stream", "sort", "fc1", "fc2")
PARK_CHUNK = 16384      # bytes per cp.async.bulk of the park probe (KernelCfg.park)
PARK_OVERHEAD = 128 + 16    # its region's alignment and its mbarrier
PROBES_WITH_COMBINE = ("", "stream")
TOPK = 16
# v7's part-reduction counters (pair * C + rank) sit after the combine's (token * C + rank < 64 * 4) in the
# workspace's MAX_M * 8 counters; v7 serves buckets <= 8 at C = 2, so pair * C + rank < 128 * 2 fits. At buckets
# 4 / 8 they overlap v8's h-exchange counters below: harmless, because every counter is back at 0 when its launch
# ends (the last arrival re-arms it) and launches sharing a workspace run in stream order
PART_COUNTERS = 256
# v8's h-exchange counters (one per expert segment u < 32 at buckets <= 2: arrivals, then departures) follow them
H_COUNTERS = 320
# v8.3 (tagged): one arrival per (work item, CTA) after its poll; the last re-arms it and advances the epoch
H_LAUNCH = H_COUNTERS + 32
HG_MAX_WORDS = 2048     # workspace.hg: the epoch, then [32 pairs, I/2 <= 2048] tagged h words (I <= 4096)
SPLIT_VERSIONS = (6, 7, 8)      # an expert split over several clusters by parts of I
SPLIT_MAX_MB = {6: 2, 7: 8, 8: 2}   # the largest batch bucket each serves (v7: its part counters, above)


# ----------------------------------------------------------------------------------------------- host-side layout

@dataclass(frozen=True)
class PreparedExperts:
    """Kernel layout of the routed experts (see module docstring).  All int32, contiguous."""
    w13q: torch.Tensor     # [E, I/8, dL/64, 32, 4]
    w13s: torch.Tensor     # [E, I/8, dL/64, 8]
    w2q: torch.Tensor      # [E, dL/16, I/64, 32, 4]
    w2s: torch.Tensor      # [E, dL/16, I/64, 8]
    layout: str = "nibble" # how a word holds its 8 codes: "nibble" (PRMT-table decode) or "rot" (see ROT_PIECES)

    @property
    def dims(self) -> tuple[int, int, int]:
        E, t1, kb1 = self.w13q.shape[:3]
        return E, 8 * t1, 64 * kb1          # E, I, dL


def _unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] codes 0..15 (low nibble = even column)."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _rot_word(nib_codes: torch.Tensor) -> torch.Tensor:
    """[..., 8] codes in register order (code 2j + h -> half h of A register j) -> int64 words of the rot layout."""
    word = torch.zeros(nib_codes.shape[:-1], dtype=torch.int64, device=nib_codes.device)
    for j, pieces in enumerate(ROT_PIECES):
        for r, mask in pieces:
            for q in range(32):
                if mask >> q & 1:
                    bit = (nib_codes[..., 2 * j + q // 16] >> _ROT_CODE_BIT[q % 16]) & 1
                    word |= bit << ((q - r) % 32)
    return word


def _rot_codes(word: torch.Tensor) -> torch.Tensor:
    """Inverse of _rot_word: int64 words -> [..., 8] codes in register order."""
    codes = torch.zeros(*word.shape, 8, dtype=torch.int64, device=word.device)
    for j, pieces in enumerate(ROT_PIECES):
        for r, mask in pieces:
            for q in range(32):
                if mask >> q & 1:
                    bit = (word >> ((q - r) % 32)) & 1
                    codes[..., 2 * j + q // 16] |= bit << _ROT_CODE_BIT[q % 16]
    return codes


def rot_decode_reference(word: torch.Tensor) -> torch.Tensor:
    """The kernel's rot-layout decode, step for step on int64 (CPU tests): [...] words -> [..., 4] bf16x2 bit
    patterns (code * 2^-126 in each half)."""
    w = word & 0xFFFFFFFF
    outs = []
    for pieces in ROT_PIECES:
        o = torch.zeros_like(w)
        for r, mask in pieces:
            rot = ((w << r) | (w >> ((32 - r) % 32))) & 0xFFFFFFFF if r else w
            o |= rot & mask
        outs.append(o)
    return torch.stack(outs, dim=-1)


def _pack_tiles(codes: torch.Tensor, scales: torch.Tensor, layout: str = "nibble"):
    """codes [E, T, 16, K] uint8 (0..15), scales [E, T, 16, K/32] uint8 -> (q [E,T,K/64,32,4] i32, s [E,T,K/64,8] i32)."""
    E, T, R, K = codes.shape
    assert R == 16 and K % 64 == 0
    KB = K // 64
    c = codes.to(torch.int64).reshape(E, T, 2, 8, KB, 2, 4, 2, 4)        # hr g kb bb t s2 kk
    c = c.permute(0, 1, 4, 3, 6, 5, 7, 2, 8)                              # E T kb g t bb s2 hr kk
    nib_codes = torch.stack([c[..., _NIB_HR[n], _NIB_KK[n]] for n in range(8)], dim=-1)   # [..., 8]
    if layout == "rot":
        word = _rot_word(nib_codes)
    else:
        mag = nib_codes & 7
        sign = nib_codes >> 3
        word = torch.zeros(nib_codes.shape[:-1], dtype=torch.int64, device=codes.device)
        for n in range(8):
            nib = mag[..., n] | (sign[..., _SIGN_OF_NIBBLE[n]] << 3)
            word |= nib << (4 * n)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    q = word.reshape(E, T, KB, 32, 4).contiguous()                       # lane = 4g + t, word = 2bb + s2
    s = scales.to(torch.int64).reshape(E, T, 2, 8, KB, 2)                 # hr g kb bb
    s = s.permute(0, 1, 4, 3, 5, 2)                                       # E T kb g bb hr  (byte = 2bb + hr)
    sw = s[..., 0, 0] | (s[..., 0, 1] << 8) | (s[..., 1, 0] << 16) | (s[..., 1, 1] << 24)
    sw = torch.where(sw >= 2 ** 31, sw - 2 ** 32, sw).to(torch.int32).contiguous()
    return q, sw


def _unpack_tiles(q: torch.Tensor, sw: torch.Tensor, layout: str = "nibble"):
    """Inverse of _pack_tiles: -> codes [E, T, 16, K] uint8, scales [E, T, 16, K/32] uint8."""
    E, T, KB = q.shape[:3]
    w = q.to(torch.int64) & 0xFFFFFFFF
    w = w.reshape(E, T, KB, 8, 4, 2, 2)                                   # kb g t bb s2
    if layout == "rot":
        codes_n = _rot_codes(w)
    else:
        nibs = torch.stack([(w >> (4 * n)) & 0xF for n in range(8)], dim=-1)
        codes_n = torch.empty_like(nibs)
        for n in range(8):
            holder = _SIGN_HOLDER[n]                                      # code n's sign sits in nibble `holder`
            codes_n[..., n] = (nibs[..., n] & 7) | (nibs[..., holder] & 8)
    out = torch.empty(E, T, KB, 8, 4, 2, 2, 2, 4, dtype=torch.int64, device=q.device)     # ... hr kk
    for n in range(8):
        out[..., _NIB_HR[n], _NIB_KK[n]] = codes_n[..., n]
    out = out.permute(0, 1, 7, 3, 2, 5, 4, 6, 8).reshape(E, T, 16, KB * 64)   # E T hr g kb bb t s2 kk
    s = sw.to(torch.int64) & 0xFFFFFFFF
    sb = torch.stack([(s >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(E, T, KB, 8, 2, 2)  # bb hr
    sb = sb.permute(0, 1, 5, 3, 2, 4).reshape(E, T, 16, KB * 2)          # E T hr g kb bb
    return out.to(torch.uint8), sb.to(torch.uint8)


def prepare_mxfp4_experts(w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                          layout: str = "auto") -> PreparedExperts:
    """Checkpoint layout -> kernel layout (run once at load time; CPU or GPU tensors, result on the same device).

    w1/w3_packed [E, I, dL/2] u8, w1/w3_scale [E, I, dL/32] u8, w2_packed [E, dL, I/2] u8, w2_scale [E, dL, I/32] u8.
    layout: "rot" (the default kernel's), "nibble" (kernel versions 2-3 and the A/B runs) or "auto": "rot" when every
    E8M0 scale byte is <= ROT_MAX_SCALE (the rot decode's multiplier 2^(E-1) must be a finite bf16), else "nibble".
    """
    if layout not in LAYOUTS + ("auto",):
        raise ValueError(f"layout must be one of {LAYOUTS + ('auto',)}, got {layout!r}")
    for n, t in [("w1_packed", w1_packed), ("w1_scale", w1_scale), ("w3_packed", w3_packed),
                 ("w3_scale", w3_scale), ("w2_packed", w2_packed), ("w2_scale", w2_scale)]:
        check_tensor(n, t, dtype=torch.uint8, contiguous=False, align=0)
        if t.dim() != 3:
            raise ValueError(f"{n}: expected 3 dims, got {list(t.shape)}")
    E, I, half = w1_packed.shape
    dL = 2 * half
    if I % 64 or dL % 64:
        raise ValueError(f"I={I} and dL={dL} must be multiples of 64")
    for n, t, shp in [("w1_scale", w1_scale, (E, I, dL // 32)), ("w3_packed", w3_packed, (E, I, dL // 2)),
                      ("w3_scale", w3_scale, (E, I, dL // 32)), ("w2_packed", w2_packed, (E, dL, I // 2)),
                      ("w2_scale", w2_scale, (E, dL, I // 32))]:
        if tuple(t.shape) != shp:
            raise ValueError(f"{n}: expected shape {list(shp)}, got {list(t.shape)}")
    max_scale = max(int(t.max()) for t in (w1_scale, w3_scale, w2_scale))
    if layout == "auto":
        layout = "rot" if max_scale <= ROT_MAX_SCALE else "nibble"
    elif layout == "rot" and max_scale > ROT_MAX_SCALE:
        raise ValueError(f"layout 'rot' needs every E8M0 scale byte <= {ROT_MAX_SCALE} (scale <= 2), got {max_scale}: "
                         f"use layout='nibble' or 'auto'")
    # chunks of experts keep the int64 temporaries small; runs on the tensors' device (GPU: ~1 s for K3)
    q13, s13, q2, s2 = [], [], [], []
    step = max(1, (1 << 24) // (I * dL))
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        n = e1 - e0
        c1 = _unpack_codes(w1_packed[e0:e1]).reshape(n, I // 8, 8, dL)
        c3 = _unpack_codes(w3_packed[e0:e1]).reshape(n, I // 8, 8, dL)
        sc1 = w1_scale[e0:e1].reshape(n, I // 8, 8, dL // 32)
        sc3 = w3_scale[e0:e1].reshape(n, I // 8, 8, dL // 32)
        q, s = _pack_tiles(torch.cat([c1, c3], dim=2), torch.cat([sc1, sc3], dim=2), layout)
        q13.append(q)
        s13.append(s)
        c2 = _unpack_codes(w2_packed[e0:e1]).reshape(n, dL // 16, 16, I)
        sc2 = w2_scale[e0:e1].reshape(n, dL // 16, 16, I // 32)
        q, s = _pack_tiles(c2, sc2, layout)
        q2.append(q)
        s2.append(s)
    outs = [torch.cat(x).contiguous() for x in (q13, s13, q2, s2)]
    return PreparedExperts(*outs, layout=layout)


def dequant_checkpoint(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exact MXFP4 dequant of a checkpoint tensor [..., R, K/2] + [..., R, K/32] -> float32 [..., R, K]."""
    codes = _unpack_codes(packed).to(torch.int64)
    mag = torch.tensor(E2M1_MAG, dtype=torch.float32, device=packed.device)[codes & 7]
    val = torch.where((codes & 8) != 0, -mag, mag)
    sc = torch.exp2(scale.to(torch.float32) - 127.0)
    return val * sc.repeat_interleave(32, dim=-1)


def dequant_prepared(prep: PreparedExperts):
    """Exact float32 dequant of the kernel layout -> (w1 [E,I,dL], w3 [E,I,dL], w2 [E,dL,I]) (for tests)."""
    E, I, dL = prep.dims
    c13, s13 = _unpack_tiles(prep.w13q, prep.w13s, prep.layout)          # [E, I/8, 16, dL]
    c2, s2 = _unpack_tiles(prep.w2q, prep.w2s, prep.layout)              # [E, dL/16, 16, I]

    def val(c, s):
        c = c.to(torch.int64)
        mag = torch.tensor(E2M1_MAG, dtype=torch.float32, device=c.device)[c & 7]
        v = torch.where((c & 8) != 0, -mag, mag)
        return v * torch.exp2(s.to(torch.float32) - 127.0).repeat_interleave(32, dim=-1)

    w13 = val(c13, s13)
    w1 = w13[:, :, :8].reshape(E, I, dL)
    w3 = w13[:, :, 8:].reshape(E, I, dL)
    w2 = val(c2, s2).reshape(E, dL, I)
    return w1, w3, w2


def expert_bytes(dL: int, I: int) -> int:
    """MXFP4 data + E8M0 scale bytes of one expert (w1, w3, w2)."""
    return 3 * (I * dL // 2 + I * dL // 32)


def distinct_expert_bytes(topk_ids: torch.Tensor, cfg_dims) -> int:
    """Bytes of expert weights that must be read for this routing: distinct experts x expert_bytes.

    cfg_dims: (dL, I) or a K3Config (uses routed_expert_hidden_size and expert_intermediate).  CPU ok; syncs.
    """
    if hasattr(cfg_dims, "routed_expert_hidden_size"):
        dL, I = cfg_dims.routed_expert_hidden_size, cfg_dims.expert_intermediate
    else:
        dL, I = cfg_dims
    n = int(torch.unique(topk_ids.reshape(-1)).numel())
    return n * expert_bytes(dL, I)


# ----------------------------------------------------------------------------------------------- configuration

def m_bucket(M: int) -> int:
    for b in M_BUCKETS:
        if M <= b:
            return b
    raise ValueError(f"batch M={M} exceeds {MAX_M}")


def default_cluster(MB: int) -> int:
    """Cluster size by batch bucket, from the H200 measurement in the version log (v4, measured).

    The kernel is persistent with a static assignment (cluster q takes active experts q, q + Q, ...), so a cluster
    that is not co-resident with the others runs its whole share after them and doubles the time.  Clusters of C
    CTAs must fit inside one GPC; the GPCs of a 132-SM part hold 16-18 SMs, so only C = 2 (TPC pairs) is always
    fully co-resident (66 clusters).  At C = 4 the 33rd cluster was measured as a second wave (rank16 b64 1045 us
    against 485 us at C = 2).  C = 4 stays for MB <= 2: at most 32 active experts, so no cluster beyond the 32nd
    ever has work, and each expert is split over 4 SMs instead of 2 (64 busy SMs at batch 1).
    """
    return 4 if MB <= 2 else 2


def cluster_before_20261129(MB: int) -> int:
    """The rule default_cluster replaced (kept for the layer-level A/B ``fast-prev``): whole-expert work items over
    132 / C clusters with the last wave >= 93 % full, which assumed every cluster co-resident."""
    return 8 if MB <= 8 else 4


# v5 (single passes as work items) above batch bucket 2 since session 31: the same MMAs on the same pass boundaries as
# v4 (bit-identical), as fast at uniform routing (experts-50b6243.json, rank16 b8 / b64 66.8 / 344.7 us against v4's
# 66.1 / 347.8), and where few experts are hot it spreads their passes over every cluster instead of leaving most
# idle (records-8d292c7-s105 / s105b, skewed: MoE half rank16 b64 246.3 -> 167.1 us, rank8 324.2 -> 208.4, full
# 1154.3 -> 823.2; stock 188.5 / 230.3 / 1040.1). "fast-s13" (v4 at every bucket) is the A/B. Confirmed as the
# default on an H100 (traces/h100/records-d9027da-s106*.json): skewed b64 rank16 / rank8 / full 265.2 / 343.0 /
# 1187.0 -> 184.2 / 227.7 / 867.1 us; uniform b64 rank16 440.2 -> 439.1, rank8 609.3 -> 626.1 (+2.8 %; +3.1 % again
# in s106c). Most of that rank8 cost was v5's 4 KB table taking the CTA over the 196 KB carve-out step; v5.1 packs
# it away (version log): uniform b64 against v4 +0.8 % at rank8, +0.4 % at rank16 (s107, H100).
DEFAULT_VERSION = 5
# v7 serves batch buckets <= 2 by default since its H200 run (experts-ab2cffe-s13.json: rank16 b1 / b2 25.3 / 45.2 ->
# 20.9 / 27.7 us, rank8 38.0 / 70.7 -> 27.0 / 41.4; version log)
SMALL_BATCH_VERSION = 7
SMALL_BATCH_MAX_MB = 2
# route1 (the default since session 11; "fast-s21exp" is the A/B with the sort): at batch bucket 1 each of the
# token's 16 (token, slot) pairs is its own expert segment, read straight from the ids, instead of the in-CTA
# counting sort (version log; s21b: MoE half rank16 b1 59.6 -> 57.7 us, rank8 66.8 -> 65.6)
ROUTE_DIRECT = True
# ring_fit (the default since session 13 at v4 / v5, since session 14 at v7 too; "fast-noringfit" is the A/B at
# the full depth): each loop's ring depth fitted to its K steps per unit (version log; s26: MoE half rank8 b64
# 643.8 -> 540.2 us, b8 167.6 -> 141.2; s29, v7: rank8 b2 82.6 -> 74.3)
RING_FIT = True
# lean_arrive (opt-in; s57, session 19: no gain in the layer; "fast-xlean" / bench_experts LEAN): version log
LEAN_ARRIVE = False
RING_FIT_VERSIONS = (4, 5, 7, 8)   # the versions whose loops take a fitted ring (v2 / v3 / v6 keep the full one)
# v5.2 (the default at buckets 4 / 8 since session 33; "fast-v51" is the A/B, bench_experts "A0"): v5's kernel also
# carries v7's items with ALT_PARTS parts of I and runs them when ALT_PARTS x #passes <= Q, i.e. when few experts
# hold every pair (skewed routing: 24 passes on 66 clusters of 2). Measured before it was built (s107c / s107d, H100
# kernel bench): v7 skewed b4 / b8 0.62-0.93x of v5.1, uniform 1.04-1.18x. Measured (s108, H100): skewed at v7's
# speed (full b8 272.9 -> 166.8 us), uniform within 1.2 % of v5.1 except rank16 b8 (+4.3 %, not explained).
ALT_PARTS = 2


# v8 (FC2 split by output rows; version log v8 / v8.1) at batch bucket 1 wherever its row blocks split the w2 tiles
# evenly, since session 18: MoE half rank16 b1 58.3 -> 56.7 us (s53), 57.9 -> 56.6 (s54), 58.8 -> 58.0 (s55; fast-v7
# the A/B). Not at bucket 2, where the kernel gains on the bench (rank16 26.8 -> 25.5) but the layer's replay median
# did not (rank16 b2 +0.6 / +0.4 in s53 / s54, inside s55's 1.0 us between two rows of one kernel); not at rank8 b1,
# whose uneven row blocks (v8.2) gained 0.5 us in the MoE half and nothing at the tail's end (s56).
SMALL_BATCH_ROWSPLIT = True


def default_version(MB: int, I: int | None = None, dL: int | None = None, nsm: int = 132) -> int:
    """The kernel version the layer runs at batch bucket MB: DEFAULT_VERSION above SMALL_BATCH_MAX_MB; at bucket 1
    v8 where (I, dL given) its NH x C row blocks split the dL / 16 w2 tiles evenly (SMALL_BATCH_ROWSPLIT: rank16,
    full width); else v7 (SMALL_BATCH_VERSION)."""
    if MB > SMALL_BATCH_MAX_MB:
        return DEFAULT_VERSION
    if SMALL_BATCH_ROWSPLIT and MB == 1 and I is not None and dL is not None \
            and (dL // 16) % (default_parts(I, MB, V7_CLUSTER, nsm) * V7_CLUSTER) == 0:
        return 8
    return SMALL_BATCH_VERSION


@dataclass(frozen=True)
class KernelCfg:
    E: int
    dL: int
    I: int
    MB: int          # batch bucket (max M this binary accepts)
    C: int           # cluster size (CTAs per expert)
    D: int = 8       # register ring depth (16-byte weight loads in flight per lane)
    W: int = 8       # warps per CTA
    nsm: int = 132
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    version: int = DEFAULT_VERSION  # 2: z from global; 3: z staged in smem; 4: + copy-free ring; 5: + pass items;
    #                                 6: v4 with each expert split over two clusters by I (MB <= 2); 7: NH parts
    #                                 of I, part reduction; 8: NH parts of I for FC1, FC2 split by output rows
    probe: str = ""   # diagnostics only (wrong output): "stream" = weights loaded and XOR-folded, no decode / MMA;
    #                   the stage probes stop the stream probe early: "sort" after the routing sort, "fc1" after FC1
    #                   and the h exchange (no FC2), "fc2" after FC2 (no part reduction, no combine)
    layout: str = "nibble"  # the PreparedExperts layout it decodes; "rot" needs version >= 4
    parts: int = 1    # v7: work items per expert (parts of I); v6 is 2 by construction, other versions 1
    route_direct: bool = False  # route1 (MB = 1 only): pair p is segment p, no counting sort
    ring_fit: bool = False      # each loop's ring depth fitted to its K steps per unit (D1, D2 <= D; compile_key
    #                             sets it from RING_FIT, on by default at versions 4 / 5 / 7)
    park: int = 0     # probe (v7 only, bench_experts "PARK<KB>"; outputs unchanged): after its first item's FC2
    #                   each CTA bulk-copies this many bytes of weights nobody reads into shared memory nothing else
    #                   uses: what parking the tail's weights there costs the chain (k3fast/LOG.md, session 17)
    tagged: bool = False  # v8.3 (v8 only, opt-in): h exchanged as 64-bit words tagged with the launch's epoch, polled
    #                       directly; no arrival counter (version log v8.3; workspace.hg holds them)
    lean_arrive: bool = False  # opt-in (LEAN_ARRIVE; version log "lean_arrive"): no gpu-scope fence per thread before
    #                            the part reduction's and the combine's arrivals
    smem_pad: int = 0  # diagnostic (bench_experts "pad<KB>"; outputs unchanged): bytes of shared memory the CTA asks
    #                    for and never touches, to move it to a larger carve-out and time the L1 it takes away
    #                    (version log v5.1)
    alt_parts: int = 0  # v5.2 (v5 at buckets <= SPLIT_MAX_MB[7]; compile_key sets ALT_PARTS at buckets 4 / 8): when
    #                     alt_parts x #passes <= Q the launch runs v7's items (alt_parts parts of I per expert and
    #                     the part reduction) instead of v5's passes. The routing is known only on the device, so
    #                     the kernel carries both item loops and every CTA takes the same branch (version log v5.2)

    def __post_init__(self):
        if (self.version not in (7, 8) and self.parts != 1) or self.parts < 1 or self.I % (64 * self.parts):
            raise ValueError(f"parts={self.parts}: versions 7 / 8 split I = {self.I} into parts of a multiple of 64 "
                             f"(other versions take parts=1), version {self.version}")
        if self.dL % 64 or self.I % 64:
            raise ValueError("dL and I must be multiples of 64")
        if self.IH % (8 * self.C) or (self.dL // 16) % self.C or self.IH % 64:
            raise ValueError(f"cluster size {self.C} does not divide the tiles (I={self.I}, dL={self.dL}"
                             + (f", v{self.version}: I/{self.NH} per work item)" if self.NH > 1 else ")"))
        if self.E > 1024 * 4:
            raise ValueError("E too large for the in-CTA routing sort")
        if self.NKB1 % self.S:
            raise ValueError("K split does not divide the FC1 K steps")
        if self.version not in (2, 3, 4, 5, 6, 7, 8):
            raise ValueError(f"version must be 2, 3, 4, 5, 6, 7 or 8, got {self.version}")
        if self.version in SPLIT_VERSIONS and self.MB > SPLIT_MAX_MB[self.version]:
            raise ValueError(f"version {self.version} (an expert split over several clusters) serves batch buckets "
                             f"<= {SPLIT_MAX_MB[self.version]}, got {self.MB}")
        if self.tagged and self.version != 8:
            raise ValueError(f"tagged (v8.3's exchange) is a version 8 option, got version {self.version}")
        if self.version == 8 and self.Q < self.NH:
            # v8's spin waits for all NH items of a segment at once: a cluster holding two of them would wait on
            # itself. Q >= NH also keeps the grid (Q C <= nsm CTAs, one per SM) co-resident, which the spin needs.
            raise ValueError(f"version 8 needs a cluster per part of an expert: Q = {self.Q} clusters < NH = "
                             f"{self.NH} parts (nsm = {self.nsm})")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "rot" and self.version < 4:
            raise ValueError(f"the rot layout is decoded by versions >= 4 only, got version {self.version}")
        if self.probe not in PROBES:
            raise ValueError(f"probe must be one of {PROBES}, got {self.probe!r}")
        if self.park and (self.version != 7 or self.park % PARK_CHUNK or self.park < 0):
            raise ValueError(f"park: a multiple of {PARK_CHUNK} bytes, version 7 only; got park={self.park}, "
                             f"version {self.version}")
        if (self.park or self.smem_pad) and self.smem_bytes > SMEM_PER_CTA_MAX:
            raise ValueError(f"park={self.park}, smem_pad={self.smem_pad}: {self.smem_bytes} B of shared memory per "
                             f"CTA, over {SMEM_PER_CTA_MAX}")
        if self.smem_pad < 0 or self.smem_pad % 16:
            raise ValueError(f"smem_pad: a multiple of 16 bytes >= 0, got {self.smem_pad}")
        if self.alt_parts and (self.version != 5 or self.alt_parts < 2 or self.MB > SPLIT_MAX_MB[7]
                               or self.probe or self.park):
            raise ValueError(f"alt_parts={self.alt_parts}: v7's items as v5's alternative need version 5, >= 2 parts, "
                             f"batch bucket <= {SPLIT_MAX_MB[7]} and no probe; got version {self.version}, "
                             f"MB={self.MB}, probe={self.probe!r}")
        if self.route_direct and self.MB != 1:
            raise ValueError(f"route_direct serves batch bucket 1 only (one token: its 16 pairs are the segments), "
                             f"got MB={self.MB}")

    def _fit(self, K: int) -> int:
        """The deepest ring <= D that step_split divides once per ring turn or never (K % d == 0 or d % K == 0),
        with ring_fit at RING_FIT_VERSIONS; else D (the other versions keep the full ring: a cfg derived from a
        ring_fit key by another version, e.g. dataclasses.replace(key, version=3), builds the full-ring kernel)."""
        if not self.ring_fit or self.version not in RING_FIT_VERSIONS:
            return self.D
        return next(d for d in range(self.D, 0, -1) if K % d == 0 or d % K == 0)

    @property
    def D1(self):           # FC1's ring depth (K steps per unit: KS1)
        return self._fit(self.KS1)

    @property
    def D2(self):           # FC2's ring depth (K steps per work item: NKB2H)
        return self._fit(self.NKB2H)

    @property
    def NH(self):           # work items per expert: the parts of I (v6: two halves; v7 / v8: ``parts``)
        return 2 if self.version == 6 else self.parts

    @property
    def IH(self):           # intermediate outputs per work item: I, or I / NH in v6 / v7 (each part is an item)
        return self.I // self.NH

    @property
    def T1(self):           # FC1 tiles (16 rows = 8 outputs) per CTA
        return self.IH // (8 * self.C)

    @property
    def S(self):            # FC1 K-split so that T1 * S is a multiple of W
        return self.W // math.gcd(self.T1, self.W)

    @property
    def U1(self):
        return self.T1 * self.S // self.W

    @property
    def NKB1(self):
        return self.dL // 64

    @property
    def KS1(self):
        return self.NKB1 // self.S

    @property
    def RB(self):           # row blocks of w2 (and of y, the combine's chunks): one per CTA of an expert's item
        return self.NH * self.C if self.version == 8 else self.C

    @property
    def T2(self):           # w2 tiles (16 rows) per CTA; v8 where RB does not divide them: the larger share
        return -(-(self.dL // 16) // self.RB)

    @property
    def T2_EVEN(self):      # every CTA takes T2 tiles (always so except at v8, e.g. rank8 b1: 224 over 6 CTAs)
        return (self.dL // 16) % self.RB == 0

    @property
    def U2(self):
        return -(-self.T2 // self.W)

    @property
    def NKB2(self):         # 64-wide K steps of a whole w2 row (the stride of the w2 stream's tiles)
        return self.I // 64

    @property
    def NKB2H(self):        # FC2 K steps of one work item (v6 / v7: its part's; v8: all, K = I)
        return self.I // 64 if self.version == 8 else self.IH // 64

    @property
    def GMAX(self):         # 8-column MMA groups per pass
        return 1 if self.MB <= 8 else 2

    @property
    def NT(self):           # pairs per pass
        return 8 * self.GMAX

    @property
    def PMAX(self):
        return TOPK * self.MB

    @functools.cached_property       # (computed once per key: Q, regions and the host's workspace views read it)
    def alt(self) -> "KernelCfg | None":    # v5.2: the v7 items this launch runs instead when the passes are few
        if not self.alt_parts:
            return None
        return dataclasses.replace(self, version=7, parts=self.alt_parts, alt_parts=0)

    @property
    def Q(self):            # clusters in the grid
        if self.alt_parts:
            return self.alt.Q   # >= v5's (NH x PMAX >= PMAX): v5's items stride over the same grid
        if self.version == 6:
            # two work items per expert; an even cluster count, because at C = 4 the 33rd cluster of a 132-SM
            # H200 is not co-resident (the version log, v4 measured)
            return max(1, min(2 * self.PMAX, self.nsm // self.C // 2 * 2))
        if self.version in (7, 8):
            # NH work items per expert over every cluster that fits (at C = 2, the 66 TPC pairs are all co-resident)
            return max(1, min(self.NH * self.PMAX, self.nsm // self.C))
        return max(1, min(self.PMAX, self.nsm // self.C))

    @property
    def HW(self):           # h row stride in 32-bit words (64 B pad: conflict-free 16 B loads); v8: all of I
        return (self.I if self.version == 8 else self.IH) // 2 + 16

    @property
    def ZW(self):           # staged z row stride in 32-bit words (64 B pad: conflict-free 16 B loads)
        return self.dL // 2 + 16

    @property
    def threads(self):
        return 32 * self.W

    # shared memory carve-up (bytes, all 16-aligned)
    @property
    def n_part(self):       # K-split partials (fp32 words)
        return self.T1 * self.S * self.GMAX * 32 * 4 if self.S > 1 else 4

    @property
    def n_stage(self):      # this CTA's h columns (int32 words)
        return self.NT * (self.IH // self.C) // 2

    @property
    def n_hz(self):         # v3: the pass's z rows are staged in the h region (z is only read in FC1, h only written
        #                     after cluster barrier A, i.e. after every CTA of the cluster finished FC1)
        return max(self.NT * self.HW, self.NT * self.ZW) if self.version >= 3 else self.NT * self.HW

    @property
    def regions(self) -> tuple[int, int, int]:
        """(n_hz, n_stage, n_part): the item loops' shared-memory regions, each the larger of v5's and v7's at v5.2
        (one branch runs per launch, so they share the same bytes)."""
        own = (self.n_hz, self.n_stage, self.n_part)
        if not self.alt_parts:
            return own
        a = self.alt
        return tuple(max(x, y) for x, y in zip(own, (a.n_hz, a.n_stage, a.n_part)))

    @property
    def smem_bytes(self):
        n_hz, n_stage, n_part = self.regions
        sizes = [4 * self.E, 4 * self.PMAX, 4 * (self.PMAX + 4),
                 4 * self.PMAX, 4 * self.PMAX, 4 * self.PMAX, 4 * 64, 4 * n_hz, 4 * n_stage,
                 4 * n_part]
        park = self.park + PARK_OVERHEAD if self.park else 0
        return sum(-(-b // 16) * 16 for b in sizes) + 256 + park + self.smem_pad

    @property
    def l1_kb(self):        # the L1 the driver's carve-out leaves beside one CTA per SM (the grid's residency)
        return l1_kb(self.smem_bytes)


# ----------------------------------------------------------------------------------------------- the kernel

def _build_kernel_class():
    cutlass, cute = import_cute()
    from cutlass import Float32, Int32, Int64, BFloat16, const_expr
    from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_shared_cluster_global
    from cutlass.cutlass_dsl import T
    from cutlass._mlir.dialects import llvm

    def _i(x):
        return Int32(x).ir_value()

    def prmt(a, b, sel):
        return Int32(llvm.inline_asm(T.i32(), [_i(a), _i(b), _i(sel)], "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
                                     has_side_effects=False, is_align_stack=False,
                                     asm_dialect=llvm.AsmDialect.AD_ATT))

    def mma(a, b0, b1, c):
        """mma.sync m16n8k16 bf16 -> fp32; a: 4 x i32 (bf16x2), b0/b1: i32, c: 4 x f32."""
        st = llvm.StructType.get_literal([T.f32()] * 4)
        r = llvm.inline_asm(
            st, [_i(a[0]), _i(a[1]), _i(a[2]), _i(a[3]), _i(b0), _i(b1)] + [Float32(x).ir_value() for x in c],
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
            "{$10,$11,$12,$13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT)
        return [Float32(llvm.extractvalue(T.f32(), r, [i])) for i in range(4)]

    def st_cluster_v4(local_addr, rank, v):
        llvm.inline_asm(None, [_i(local_addr), _i(rank), _i(v[0]), _i(v[1]), _i(v[2]), _i(v[3])],
                        "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, $0, $1;\n"
                        "st.shared::cluster.v4.b32 [ra], {$2, $3, $4, $5};\n}",
                        "r,r,r,r,r,r", has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT)

    def expert_ptr(m, ex, bytes_per_expert, align):
        """Int32 pointer to expert ``ex``'s slice of ``m``: 64-bit byte arithmetic, alignment restated."""
        addr = m.iterator.toint() + cutlass.Int64(ex) * bytes_per_expert
        return cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=align)

    def decode8(w, lut):
        """8 stored codes -> 4 bf16x2 A registers (see module docstring for the bit layout)."""
        m = w & 0x77777777
        mh = (m >> 16) & 0xFFFF
        hA = prmt(lut[0], lut[1], m)
        lA = prmt(lut[2], lut[3], m)
        hB = prmt(lut[0], lut[1], mh)
        lB = prmt(lut[2], lut[3], mh)
        sm = Int32(-2147450880)     # 0x80008000
        o0 = prmt(lA, hA, 0x5140) | (w & sm)
        o1 = prmt(lA, hA, 0x7362) | ((w << 4) & sm)
        o2 = prmt(lB, hB, 0x5140) | ((w << 8) & sm)
        o3 = prmt(lB, hB, 0x7362) | ((w << 12) & sm)
        return [o0, o1, o2, o3]

    def shf_rot(x, r):
        return Int32(llvm.inline_asm(T.i32(), [_i(x), _i(x)], f"shf.l.wrap.b32 $0, $1, $2, {r};", "=r,r,r",
                                     has_side_effects=False, is_align_stack=False,
                                     asm_dialect=llvm.AsmDialect.AD_ATT))

    def mul_bf16x2(a, b):
        return Int32(llvm.inline_asm(T.i32(), [_i(a), _i(b)], "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r",
                                     has_side_effects=False, is_align_stack=False,
                                     asm_dialect=llvm.AsmDialect.AD_ATT))

    def decode_rot(w):
        """rot layout: 8 stored codes -> 4 bf16x2 A registers holding code * 2^-126 (ROT_PIECES): 9 ALU ops."""
        outs = []
        for pieces in ROT_PIECES:
            o = None
            for r, mask in reversed(pieces):
                v = (w if r == 0 else shf_rot(w, r)) & Int32(mask - (1 << 32) if mask >= 1 << 31 else mask)
                o = v if o is None else o | v
            outs.append(o)
        return outs

    def rot_multiplier(sw, byte):
        """E8M0 byte ``byte`` of the scale word -> bf16x2 2^(E-1) in both halves, i.e. 2^126 * scale: the byte
        moved to bits 0-7 (PRMT with a zero register), then one IMAD: E * 0x00800080 + (126 << 7) * 0x00010001.
        E <= ROT_MAX_SCALE keeps it a finite bf16 (prepare_mxfp4_experts)."""
        e = prmt(sw, Int32(0), 0x4440 + byte)
        return e * Int32(0x00800080) + Int32(0x3F003F00)

    def scale_f32(sw, j):
        """E8M0 byte j of the scale word -> fp32 2^(s-127) (bits s << 23)."""
        if const_expr(j == 3):
            bits = (sw >> 1) & 0x7F800000
        else:
            bits = (sw << (23 - 8 * j)) & 0x7F800000
        return bits.bitcast(Float32) if hasattr(bits, "bitcast") else Int32(bits).bitcast(Float32)

    @cute.jit
    def last_arrival(mCnt, idx, arrivals: cutlass.Constexpr):
        """One acq_rel gpu-scope arrival on counter idx: True for the arrivals-th of this launch, which resets the
        counter to 0 for the next launch / graph replay (no memset between replays)."""
        old = cute.arch.atomic_add(mCnt.iterator + idx, Int32(1), sem="acq_rel", scope="gpu")
        last = old == arrivals - 1
        if last:
            mCnt[idx] = Int32(0)
        return last

    def stream_probe(wv, sv, acc):
        """Diagnostic (probe="stream"): consume the loaded words with one XOR fold instead of decode + MMA, so the
        time is that of the load pipeline, barriers and combine alone (the output is garbage)."""
        x = wv[0] ^ wv[1] ^ wv[2] ^ wv[3] ^ sv
        acc[0] = acc[0] + (x & 1).to(Float32)

    def fc1_row(c, warp, t1_base, s_):
        """16-byte-row index (per lane: * 32 + lane) of FC1 step s_ of this warp: unit uu = warp + W*i, i = s_ // KS1
        (tile uu // S, K part uu % S), K step s_ - i*KS1 within the part."""
        i_ = s_ // c.KS1
        uu_ = warp + c.W * i_
        return (t1_base + uu_ // c.S) * c.NKB1 + (uu_ % c.S) * c.KS1 + (s_ - i_ * c.KS1)

    def fc2_row(c, warp, t2_base, s_, koff=0, t2n=None):
        """The same for FC2 step s_: tile warp + W*i (clamped to the last tile, of T2 or of t2n where v8's row
        blocks are uneven; its results are not stored). A work item takes NKB2H of a tile's NKB2 K steps, from step
        koff (v6: the half's; else all of them from 0)."""
        i_ = s_ // c.NKB2H
        return (t2_base + cutlass.min(warp + c.W * i_, (c.T2 if t2n is None else t2n) - 1)) * c.NKB2 + koff \
            + (s_ - i_ * c.NKB2H)

    def load_slot(c, wld, eWq, eWs, row_, lane, g, ringW, ringS, d, scale=True):
        """Fill ring slot d from 16-byte weight row row_: one 16-byte load per lane (L1::no_allocate from v3 on)
        and, when ``scale``, the slot's E8M0 word (v4 refills that word later, after its last use)."""
        if const_expr(c.version >= 3):
            cute.copy(wld, eWq[row_ * 32 + lane, None], ringW[d, None])
        else:
            cute.autovec_copy(eWq[row_ * 32 + lane, None], ringW[d, None])
        if const_expr(scale):
            ringS[d] = eWs[row_ * 8 + g]

    def fc2_fill(c, wld, eW2q, eW2s, warp, t2_base, koff, t2n, NS2, lane, g, ringW, ringS):
        """FC2's first ring turn: slots d < min(D2, NS2) from the warp's first steps (t2n: the CTA's tile count,
        used where v8's row blocks are uneven)."""
        for d in range(min(c.D2, NS2)):      # trace-time constants (helpers are not preprocessed)
            row_ = fc2_row(c, warp, t2_base, d, koff, None if c.T2_EVEN else t2n)
            load_slot(c, wld, eW2q, eW2s, row_, lane, g, ringW, ringS, d)

    def consume_slot(c, lut, wv, sv, acc, early, a=None, sf=None):
        """Decode a ring slot's words and scales: before its refill is issued in v4 (early=True), after it in v2/v3
        (early=False). v4's order leaves the slot's old values dead when the refill lands, so the ring needs no
        register copies at the loop's back edge (module docstring, v4). The rot layout returns the A registers
        already multiplied by their block's 2^126 * scale (word w is k16 half w % 2 of block w // 2; register j
        is row g for even j, g + 8 for odd j), and no separate scale factors."""
        if const_expr(early != (c.version >= 4)):
            return a, sf
        if const_expr(c.probe != ""):
            stream_probe(wv, sv, acc)
            return [], []
        if const_expr(c.layout == "rot"):
            mult = [rot_multiplier(sv, b) for b in range(4)]       # byte 2 * bb + hr
            return [[mul_bf16x2(o, mult[2 * (w // 2) + j % 2]) for j, o in enumerate(decode_rot(wv[w]))]
                    for w in range(4)], []
        return [decode8(wv[j], lut) for j in range(4)], [scale_f32(sv, j) for j in range(4)]

    def mma_block_any(c, a, bv, sf, bb, acc, gi):
        """The two k16 MMAs of MXFP4 block bb into acc: through a fresh fp32 partial and its scale factors
        (nibble layout), or straight into acc with pre-scaled A registers (rot layout)."""
        if const_expr(c.layout == "rot"):
            for h in range(2):
                r = mma(a[2 * bb + h], bv[2 * h], bv[2 * h + 1], [acc[gi * 4 + x] for x in range(4)])
                for x in range(4):
                    acc[gi * 4 + x] = r[x]
        else:
            mma_block_scaled(a, bv, sf[2 * bb], sf[2 * bb + 1], bb, acc, gi)

    def step_split(s0, d, K, D):
        """(i, k) = divmod(s0 + d, K) for s0 a multiple of D and d < D a trace-time constant, with one division per
        D steps (the compiler shares s0 // K between the D unrolled steps) or none, where K and D allow it."""
        if const_expr(K % D == 0):
            i = s0 // K
            return i, s0 - i * K + d
        if const_expr(D % K == 0):
            return s0 // K + d // K, d % K
        i = (s0 + d) // K
        return i, s0 + d - i * K

    def mma_block(a, bv, sv, bb, acc, gi):
        """The two k16 MMAs of MXFP4 block bb (fresh fp32 partial), then acc += partial * 2^(scale - 127)."""
        mma_block_scaled(a, bv, scale_f32(sv, 2 * bb), scale_f32(sv, 2 * bb + 1), bb, acc, gi)

    def mma_block_scaled(a, bv, fg, fg8, bb, acc, gi):
        """mma_block with the block's two scale factors (rows g and g+8) already decoded."""
        zero = [Float32(0.0)] * 4
        tmp = mma(a[2 * bb], bv[0], bv[1], zero)
        tmp = mma(a[2 * bb + 1], bv[2], bv[3], tmp)
        acc[gi * 4 + 0] = acc[gi * 4 + 0] + tmp[0] * fg
        acc[gi * 4 + 1] = acc[gi * 4 + 1] + tmp[1] * fg
        acc[gi * 4 + 2] = acc[gi * 4 + 2] + tmp[2] * fg8
        acc[gi * 4 + 3] = acc[gi * 4 + 3] + tmp[3] * fg8

    def emit_h(stage_bf, hcols, c, tile, gg, tt, gi, a0, a1, c0, c1):
        """h = bf16(SiTU(bf16(a), bf16(c))) for local output 8*tile+gg, pair columns 8gi+2tt(+1) -> stage."""
        for q in range(2):
            av = (a0 if q == 0 else a1).to(BFloat16).to(Float32)
            cv = (c0 if q == 0 else c1).to(BFloat16).to(Float32)
            act = (c.situ_beta * cute.math.tanh(av * (1.0 / c.situ_beta))) / (1.0 + cute.math.exp(-av))
            up = c.situ_linear_beta * cute.math.tanh(cv * (1.0 / c.situ_linear_beta))
            stage_bf[(gi * 8 + 2 * tt + q) * hcols + tile * 8 + gg] = (act * up).to(BFloat16)

    class MoeMxfp4Experts:
        def __init__(self, cfg: KernelCfg):
            self.cfg = cfg
            c = cfg
            self.EPT = -(-c.E // c.threads)
            self.n_hz, self.n_stage, self.n_part = c.regions
            self.smem_bytes = c.smem_bytes
            if self.smem_bytes > SMEM_PER_CTA_MAX:
                raise ValueError(f"{cfg}: {self.smem_bytes} B of shared memory per CTA, over {SMEM_PER_CTA_MAX}")

        @cute.jit
        def __call__(self, mZ, mIds, mTw, mW13q, mW13s, mW2q, mW2s, mY, mYb, mCnt, mOut, stream):
            c = self.cfg
            self.kernel(mZ, mIds, mTw, mW13q, mW13s, mW2q, mW2s, mY, mYb, mCnt, mOut).launch(
                grid=[c.Q * c.C, 1, 1], block=[c.threads, 1, 1], cluster=[c.C, 1, 1],
                smem=self.smem_bytes, stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, mZ, mIds, mTw, mW13q, mW13s, mW2q, mW2s, mY, mYb, mCnt, mOut):
            c = self.cfg
            W, NT = c.W, c.NT
            tid, _, _ = cute.arch.thread_idx()
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            P = cute.size(mZ, mode=[0]) * TOPK

            smem = cutlass.memory.SmemAllocator()
            cnt_s = smem.allocate_tensor(Int32, cute.make_layout(c.E), 16)
            act_e = smem.allocate_tensor(Int32, cute.make_layout(c.PMAX), 16)
            act_off = smem.allocate_tensor(Int32, cute.make_layout(c.PMAX + 4), 16)
            slot_s = smem.allocate_tensor(Int32, cute.make_layout(c.PMAX), 16)
            sorted_s = smem.allocate_tensor(Int32, cute.make_layout(c.PMAX), 16)
            tmp_s = smem.allocate_tensor(Int32, cute.make_layout(c.PMAX), 16)
            scr = smem.allocate_tensor(Int32, cute.make_layout(64), 16)
            hz_s = smem.allocate_tensor(Int32, cute.make_layout(self.n_hz), 16)
            stage_s = smem.allocate_tensor(Int32, cute.make_layout(self.n_stage), 16)
            part_s = smem.allocate_tensor(Float32, cute.make_layout(self.n_part), 16)
            park_s = park_bar = None
            if const_expr(c.park > 0):
                park_bar = smem.allocate_array(Int64, 1)
                park_s = smem.allocate_tensor(Int32, cute.make_layout(c.park // 4), 128)
                if tid == 0:
                    cute.arch.mbarrier_init(park_bar, 1)
                    cute.arch.mbarrier_init_fence()

            # ---------------------------------------------------------------- routing: counting sort by expert
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
            if const_expr(c.route_direct):
                # route1: one token, so pair p = slot p is segment p of expert ids[0, p] (a repeated expert is two
                # segments of one pair each). The sort below would order the segments by expert id; which CTA
                # computes a segment does not change its arithmetic, and the part reduction and the combine sum in
                # part and slot order, so the output keeps every bit.
                if tid < TOPK:
                    ex0 = mIds[0, tid]
                    if const_expr(c.version == 5):
                        ex0 = ex0 | (tid << 16)         # v5: one pair, one pass: pass offset tid
                    act_e[tid] = ex0
                    act_off[tid] = tid
                    sorted_s[tid] = tid
                if tid == TOPK:
                    act_off[TOPK] = Int32(TOPK)
                cute.arch.barrier()
                n_active = Int32(TOPK)
                n_pass = Int32(TOPK)
            else:
                for e in cutlass.range(tid, c.E, c.threads):
                    cnt_s[e] = Int32(0)
                cute.arch.barrier()
                for p in cutlass.range(tid, P, c.threads):
                    ex = mIds[p // TOPK, p % TOPK]
                    slot_s[p] = cute.arch.atomic_add(cnt_s.iterator + ex, Int32(1), scope="cta")
                cute.arch.barrier()
                # block scan over experts: thread owns experts [tid*EPT, tid*EPT+EPT); packs (#active << 16 | #pairs),
                # from v5 (#passes << 21 | #active << 11 | #pairs): pairs <= 1024 and passes <= 1024 take 11 bits each,
                # active experts <= 896 take 10
                loc = Int32(0)
                for k in cutlass.range_constexpr(self.EPT):
                    e = tid * self.EPT + k
                    if e < c.E:
                        n = cnt_s[e]
                        if const_expr(c.version == 5):
                            loc = loc + n + ((n > 0).to(Int32) << 11) + (((n + NT - 1) // NT) << 21)
                        else:
                            loc = loc + n + ((n > 0).to(Int32) << 16)
                incl = loc
                for sh in cutlass.range_constexpr(5):
                    o = cute.arch.shuffle_sync_up(incl, 1 << sh)
                    if lane >= (1 << sh):
                        incl = incl + o
                if lane == 31:
                    scr[warp] = incl
                cute.arch.barrier()
                base = Int32(0)
                for w2 in cutlass.range_constexpr(W):
                    if w2 < warp:
                        base = base + scr[w2]
                excl = base + incl - loc
                if const_expr(c.version == 5):
                    ua = (excl >> 11) & 0x3FF
                    pa = excl & 0x7FF
                    qa = (excl >> 21) & 0x7FF
                else:
                    ua = excl >> 16
                    pa = excl & 0xFFFF
                    qa = Int32(0)
                for k in cutlass.range_constexpr(self.EPT):
                    e = tid * self.EPT + k
                    if e < c.E:
                        n = cnt_s[e]
                        if n > 0:
                            if const_expr(c.version == 5):
                                # v5: the expert's first pass in the high half (e < 2^16, passes <= 1024); packed
                                # here rather than in a table of its own, whose 4 KB put rank8 b64 over the 196 KB
                                # carve-out step (version log, v5.1)
                                act_e[ua] = e | (qa << 16)
                                qa = qa + (n + NT - 1) // NT
                            else:
                                act_e[ua] = e
                            act_off[ua] = pa
                            cnt_s[e] = pa + (n << 16)           # segment offset | length (both <= 1024)
                            ua = ua + 1
                            pa = pa + n
                if tid == c.threads - 1:
                    if const_expr(c.version == 5):
                        scr[32] = ua | (qa << 16)               # v5: #active | #passes << 16
                    else:
                        scr[32] = ua
                    act_off[ua] = pa
                cute.arch.barrier()
                # The atomics above order an expert's pairs by arrival, which differs between the CTAs of a cluster
                # once pairs of one expert come from different warps (P > 32).  Every CTA of a cluster must put the
                # same pair in the same column (h columns are exchanged by position through DSMEM and y rows are
                # written by position), so each segment is re-ranked by pair index: deterministic, CTA-independent.
                for p in cutlass.range(tid, P, c.threads):
                    ex = mIds[p // TOPK, p % TOPK]
                    tmp_s[(cnt_s[ex] & 0xFFFF) + slot_s[p]] = p
                cute.arch.barrier()
                for p in cutlass.range(tid, P, c.threads):
                    ex = mIds[p // TOPK, p % TOPK]
                    seg = cnt_s[ex]
                    o = seg & 0xFFFF
                    rk = Int32(0)
                    for k in cutlass.range(o, o + (seg >> 16)):
                        rk = rk + (tmp_s[k] < p).to(Int32)
                    sorted_s[o + rk] = p
                n_active = scr[32]
                n_pass = n_active
                if const_expr(c.version == 5):
                    n_active = scr[32] & 0xFFFF
                    n_pass = scr[32] >> 16
                cute.arch.barrier()

            # ---------------------------------------------------------------- the work items
            weights = (mZ, mTw, mW13q, mW13s, mW2q, mW2s)
            tables = (mCnt, mOut, act_e, act_off, sorted_s, scr, hz_s, stage_s, part_s, park_s, park_bar, n_active,
                      n_pass)
            if const_expr(c.alt_parts > 0):
                # v5.2: every CTA counted the same passes, so the whole grid takes one branch (the cluster barriers
                # and the arrival counters need that). v5's y rows go to the bf16 rows mYb; mY holds v7's fp32 parts.
                if n_pass * c.alt_parts <= c.Q:
                    self.items(c.alt, True, *weights, mY, mYb, *tables)
                else:
                    self.items(c, True, *weights, mYb, mYb, *tables)
            else:
                self.items(c, c.version == 5, *weights, mY, mYb, *tables)

        @cute.jit
        def items(self, c: cutlass.Constexpr, packed: cutlass.Constexpr, mZ, mTw, mW13q, mW13s, mW2q, mW2s, mY, mYb,
                  mCnt, mOut, act_e, act_off, sorted_s, scr, hz_s, stage_s, part_s, park_s, park_bar, n_active,
                  n_pass):
            """The work items of one launch under cfg c, after the routing sort: FC1, the h exchange, FC2, the part
            reduction (v7) and the combine. packed: act_e holds each expert's first pass in its high half (v5's
            routing, also when v7's items run it at v5.2)."""
            W, D, GMAX, NT, C = c.W, c.D, c.GMAX, c.NT, c.C
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            g = lane // 4
            t = lane % 4
            rank = bid % C
            qid = bid // C
            M = cute.size(mZ, mode=[0])
            h_s = cute.make_tensor(hz_s.iterator, cute.make_layout((NT, c.HW), stride=(c.HW, 1)))
            z_s = cute.make_tensor(hz_s.iterator, cute.make_layout((NT, c.ZW), stride=(c.ZW, 1)))
            lut = [Int32(_LUT_HI[0]), Int32(_LUT_HI[1]), Int32(-1065353216), Int32(-1065336832)]
            # (0xC0800000, 0xC0804000 as signed int32)

            # views: 16-byte rows of the weight streams, 4-word chunks of z / h, 8-wide bf16 chunks of y / out
            gZ = cute.flat_divide(mZ, (1, 4))            # (1, 4, M, dL/8)
            gH = cute.flat_divide(h_s, (1, 4))           # (1, 4, NT, HW/4)
            gZs = cute.flat_divide(z_s, (1, 4))          # (1, 4, NT, ZW/4)
            wld = weight_load_atom(Int32)
            zcp = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                                      Int32, num_bits_per_copy=128)
            gY = cute.flat_divide(mY, (1, 8))            # (1, 8, rows, dL/8)
            gYb = cute.flat_divide(mYb, (1, 8))          # v7: the bf16 y_e rows the part reduction writes
            gO = cute.flat_divide(mOut, (1, 8))
            # y rows were written by other CTAs during this launch: read them from L2 (.cg), never from L1
            ycg = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128,
                                      load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)
            # v6: y holds fp32 half partials, rows 2 pair + half
            ycg32 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128,
                                        load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)
            gY4 = cute.flat_divide(mY, (1, 4))           # (1, 4, rows, dL/4); v8: (1, 4, pairs, I/8) of hG
            gHG = gY4                                    # v8: mY is hG, the pairs' h rows as bf16x2 words
            hcg = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Int32, num_bits_per_copy=128,
                                      load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)
            h4 = cute.make_rmem_tensor(cute.make_layout(4), Int32)
            y4a = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            y4b = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            ARRIVALS = 2 * TOPK if c.version == 6 else TOPK    # arrivals per (token, row chunk) and launch
            NH = c.NH

            stage_bf = cute.recast_tensor(stage_s, BFloat16)
            ringW = cute.make_rmem_tensor(cute.make_layout((D, 4), stride=(4, 1)), Int32)
            ringS = cute.make_rmem_tensor(cute.make_layout(D), Int32)
            acc = cute.make_rmem_tensor(cute.make_layout(GMAX * 4), Float32)
            zrow = cute.make_rmem_tensor(cute.make_layout(GMAX), Int32)
            ypair = cute.make_rmem_tensor(cute.make_layout(GMAX * 2), Int32)
            bv = cute.make_rmem_tensor(cute.make_layout(4), Int32)

            # ---------------------------------------------------------------- expert loop
            h_base = h_s.iterator.toint()
            h_flat = cute.make_tensor(h_s.iterator, cute.make_layout(NT * c.HW))
            hcols = c.IH // C
            NS1 = c.U1 * c.KS1
            D1, D2 = c.D1, c.D2     # the loops' ring depths (<= D; below D only with ring_fit)
            NS1_pad = -(-NS1 // D1) * D1
            NS2 = c.U2 * c.NKB2H if c.probe != "fc1" else 0      # the "fc1" stage probe stops before FC2
            NS2_pad = -(-NS2 // D2) * D2
            NV = c.dL // 8 // c.RB                      # 8-wide y / r vectors per row block (the combine's chunk)
            s8 = cute.make_rmem_tensor(cute.make_layout(8), Float32)
            ry = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            ro = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            R13 = c.I // 8 * c.NKB1                      # 16-byte rows of one expert's w13 stream / 32
            R2 = c.dL // 16 * c.NKB2
            # Work items: whole active experts (v2-v4; a cluster runs all passes of its expert), or from v5 single
            # passes (expert, <= NT pairs), so that a few experts shared by many tokens (skewed routing) spread their
            # passes over every cluster.  Each pass reads the expert's weights once either way.
            n_work = n_pass if const_expr(c.version == 5) else n_active
            if const_expr(c.version in SPLIT_VERSIONS):
                n_work = NH * n_active              # items (expert, part of I): wi = NH u + hI
            if const_expr(c.probe == "sort"):
                n_work = Int32(0)                   # the stage probe that stops after the routing sort
            epoch = Int64(0)
            tag = Int32(0)
            if const_expr(c.tagged):
                # v8.3: this launch's tag; the previous launch's last poller advanced the epoch (read after the PDL
                # wait, so that launch is complete). Epoch 0 of a zeroed workspace.hg never matches: tags start at 1
                epoch = cute.arch.load(mY.iterator, Int64, sem="relaxed", scope="gpu")
                tag = (epoch + 1).to(Int32)
            for wi in cutlass.range(qid, n_work, c.Q):
                u = wi
                hI = Int32(0)
                if const_expr(c.version in SPLIT_VERSIONS):
                    u = wi // NH
                    hI = wi - NH * u
                if const_expr(c.version == 5):
                    # the expert whose passes contain item wi: first(lo) <= wi < first(hi), first(u) = act_e[u] >> 16
                    # (mid < hi <= n_active: the search never reads past the last active expert)
                    lo = Int32(0)
                    hi = n_active
                    for _ in cutlass.range_constexpr(11):   # n_active <= 1024
                        mid = (lo + hi) // 2
                        if (act_e[mid] >> 16) <= wi:
                            lo = mid
                        else:
                            hi = mid
                    u = lo
                ex = act_e[u]
                if const_expr(packed):
                    ex = act_e[u] & 0xFFFF
                off = act_off[u]
                n_e = act_off[u + 1] - off
                pb0 = Int32(0)
                pb1 = n_e
                if const_expr(c.version == 5):
                    pb0 = (wi - (act_e[u] >> 16)) * NT
                    pb1 = pb0 + 1
                # This expert's streams, based with a 64-bit offset: at full width w13 is 9.9 GB, past the reach
                # of a 32-bit element index (v2 computed ex * rows in int32 and read out of bounds there).
                eW13q = cute.make_tensor(expert_ptr(mW13q, ex, R13 * 32 * 4 * 4, 16),
                                         cute.make_layout((R13 * 32, 4), stride=(4, 1)))
                eW13s = cute.make_tensor(expert_ptr(mW13s, ex, R13 * 8 * 4, 4), cute.make_layout(R13 * 8))
                eW2q = cute.make_tensor(expert_ptr(mW2q, ex, R2 * 32 * 4 * 4, 16),
                                        cute.make_layout((R2 * 32, 4), stride=(4, 1)))
                eW2s = cute.make_tensor(expert_ptr(mW2s, ex, R2 * 8 * 4, 4), cute.make_layout(R2 * 8))
                for pb in cutlass.range(pb0, pb1, NT):
                    npass = cutlass.min(n_e - pb, NT)
                    # this lane's B-operand rows (pair column g of each group) and y columns (2t, 2t+1)
                    for gi in cutlass.range_constexpr(GMAX):
                        nn = cutlass.min(gi * 8 + g, npass - 1)
                        if const_expr(c.version >= 3):
                            zrow[gi] = nn                               # row of the staged z
                        else:
                            zrow[gi] = sorted_s[off + pb + nn] // TOPK  # token row of z in global memory
                        for q in cutlass.range_constexpr(2):
                            n2 = gi * 8 + 2 * t + q
                            ypair[gi * 2 + q] = Int32(-1)
                            if n2 < npass:
                                ypair[gi * 2 + q] = sorted_s[off + pb + n2]

                    # ======================= FC1: CTA-local tiles [0, T1) of w13 (global rank*T1 + tile), K = dL.
                    # Warp w streams units uu = w + W*i (tile = uu // S, K part ks = uu % S), KS1 steps each; the
                    # 16-byte loads of step s + D are issued before step s is decoded (register ring).
                    if const_expr(c.version >= 3):
                        # v3: the pass's z rows -> smem (cp.async, overlapped with the weight ring's first loads).
                        # Safe to overwrite: this CTA's FC2 of the previous pass is behind the combine barriers,
                        # and the other CTAs write h here only after cluster barrier A of this pass.
                        for idx in cutlass.range(tid, npass * (c.dL // 8), c.threads):
                            n_ = idx // (c.dL // 8)
                            v_ = idx - n_ * (c.dL // 8)
                            tok = sorted_s[off + pb + n_] // TOPK
                            cute.copy(zcp, gZ[0, None, tok, v_], gZs[0, None, n_, v_])
                        cute.arch.cp_async_commit_group()
                    t1_base = rank * c.T1
                    if const_expr(c.version in SPLIT_VERSIONS):
                        t1_base = hI * (c.IH // 8) + rank * c.T1     # w13 tiles of part hI: [hI IH/8, (hI+1) IH/8)
                    # FC2: CTA-local tiles [0, T2) of w2 (rows 16*(rank*T2 + tile)), K = I; v6 / v7: the part's K;
                    # v8: row block rbi = hI C + rank of the expert's NH C, all of K
                    rbi = rank
                    if const_expr(c.version == 8):
                        rbi = hI * C + rank
                    t2_base = rbi * c.T2
                    t2n = c.T2                  # this CTA's w2 tiles: T2, or at uneven v8 row blocks 37 or 38 of 224
                    if const_expr(not c.T2_EVEN):
                        t2_base = (rbi * (c.dL // 16)) // c.RB
                        t2n = ((rbi + 1) * (c.dL // 16)) // c.RB - t2_base
                    koff = 0
                    if const_expr(c.version in (6, 7)):
                        koff = hI * c.NKB2H                          # the part's K steps of each w2 tile
                    for d in cutlass.range_constexpr(D1):
                        if const_expr(d < NS1):
                            row_ = fc1_row(c, warp, t1_base, d)
                            load_slot(c, wld, eW13q, eW13s, row_, lane, g, ringW, ringS, d)
                    if const_expr(c.version >= 3):
                        cute.arch.cp_async_wait_group(0)
                        cute.arch.barrier()
                    for s0 in cutlass.range(0, NS1_pad, D1):
                        for d in cutlass.range_constexpr(D1):
                            s = s0 + d
                            if s < NS1:
                                wv = [ringW[d, j] for j in range(4)]
                                sv = ringS[d]
                                if const_expr(c.layout == "rot"):
                                    i, kk = step_split(s0, d, c.KS1, D1)
                                else:
                                    i = s // c.KS1
                                    kk = s - i * c.KS1
                                uu = warp + W * i
                                tile = uu // c.S
                                kb = (uu - tile * c.S) * c.KS1 + kk
                                if kk == 0:
                                    acc.fill(0.0)
                                a, sf = consume_slot(c, lut, wv, sv, acc, True)
                                if const_expr(c.layout == "rot"):
                                    i_, k_ = step_split(s0 + D1, d, c.KS1, D1)
                                    uu_ = warp + W * i_
                                    row_ = (t1_base + uu_ // c.S) * c.NKB1 + (uu_ % c.S) * c.KS1 + k_
                                else:
                                    row_ = fc1_row(c, warp, t1_base, s + D1)     # the refill of this slot
                                if s + D1 < NS1:
                                    load_slot(c, wld, eW13q, eW13s, row_, lane, g, ringW, ringS, d,
                                              scale=c.version < 4)
                                a, sf = consume_slot(c, lut, wv, sv, acc, False, a, sf)
                                if const_expr(c.probe == ""):
                                    for gi in cutlass.range_constexpr(GMAX):
                                        if gi * 8 < npass:
                                            for bb in cutlass.range_constexpr(2):
                                                if const_expr(c.version >= 3):
                                                    cute.autovec_copy(gZs[0, None, zrow[gi], kb * 8 + bb * 4 + t], bv)
                                                else:
                                                    cute.autovec_copy(gZ[0, None, zrow[gi], kb * 8 + bb * 4 + t], bv)
                                                mma_block_any(c, a, bv, sf, bb, acc, gi)
                                if const_expr(c.version >= 4):
                                    # v4: the scale word is refilled after its last use (the MMAs' scale factors)
                                    if s + D1 < NS1:
                                        ringS[d] = eW13s[row_ * 8 + g]
                                if kk == c.KS1 - 1:
                                    if const_expr(c.S > 1):
                                        for x in cutlass.range_constexpr(GMAX * 4):
                                            part_s[(uu * GMAX * 32 + lane) * 4 + (x // 4) * 128 + x % 4] = acc[x]
                                    else:
                                        for gi in cutlass.range_constexpr(GMAX):
                                            emit_h(stage_bf, hcols, c, tile, g, t, gi, acc[gi * 4 + 0],
                                                   acc[gi * 4 + 1], acc[gi * 4 + 2], acc[gi * 4 + 3])

                    # cluster barrier A: every CTA of the cluster finished reading h_s of the previous pass (v8:
                    # this CTA's warps finished FC1, whose z rows share h_s's region; h goes through global memory)
                    if const_expr(C == 1 or c.version == 8):
                        cute.arch.barrier()
                    else:
                        cute.arch.cluster_arrive()
                        cute.arch.cluster_wait()
                    if const_expr(c.S > 1):
                        # deterministic K-split reduction (fixed ks order), then SiTU
                        for idx in cutlass.range(tid, c.T1 * GMAX * 32, c.threads):
                            ln = idx % 32
                            gi_r = (idx // 32) % GMAX
                            tile_r = idx // (32 * GMAX)
                            s4 = [Float32(0.0)] * 4
                            for ks in cutlass.range_constexpr(c.S):
                                uu_r = tile_r * c.S + ks
                                for x in cutlass.range_constexpr(4):
                                    s4[x] = s4[x] + part_s[((uu_r * GMAX + gi_r) * 32 + ln) * 4 + x]
                            emit_h(stage_bf, hcols, c, tile_r, ln // 4, ln % 4, gi_r, s4[0], s4[1], s4[2], s4[3])
                        cute.arch.barrier()
                    if const_expr(c.tagged):
                        # v8.3: one 64-bit word per h word, (tag << 32) | word, stored relaxed at gpu scope: an
                        # aligned 64-bit store is single-copy atomic, so a reader that sees this launch's tag sees the
                        # word with it. No barrier, fence or counter before the poll; the poll's last load brings h.
                        for idx in cutlass.range(tid, npass * c.T1 * 4, c.threads):
                            x = idx % 4
                            ch = (idx // 4) % c.T1
                            n = idx // (4 * c.T1)
                            pr = sorted_s[off + pb + n]
                            w = stage_s[n * (c.T1 * 4) + ch * 4 + x]
                            word = (tag.to(Int64) << 32) | (w.to(Int64) & Int64(0xFFFFFFFF))
                            cute.arch.store(mY.iterator + ((pr + 1) * (c.I // 2) + hI * (c.IH // 2)
                                                           + rank * (hcols // 2) + ch * 4 + x),
                                            word, sem="relaxed", scope="gpu")
                        fc2_fill(c, wld, eW2q, eW2s, warp, t2_base, koff, t2n, NS2, lane, g, ringW, ringS)
                        # the spin needs every CTA of the expert's items resident: as in v8 (KernelCfg checks Q >= NH)
                        for idx in cutlass.range(tid, npass * (c.I // 2), c.threads):
                            wc = idx % (c.I // 2)
                            n = idx // (c.I // 2)
                            pr = sorted_s[off + pb + n]
                            hp = mY.iterator + ((pr + 1) * (c.I // 2) + wc)
                            hv = cute.arch.load(hp, Int64, sem="relaxed", scope="gpu")
                            while (hv >> 32).to(Int32) != tag:
                                hv = cute.arch.load(hp, Int64, sem="relaxed", scope="gpu")
                            h_flat[n * c.HW + wc] = (hv & Int64(0xFFFFFFFF)).to(Int32)
                        cute.arch.barrier()
                    elif const_expr(c.version == 8):
                        # v8: the expert's h is exchanged through global memory between all NH C CTAs of its items
                        # (a cluster of NH C = 8 is not co-resident on the H200; these CTAs are, one per SM). Each
                        # publishes its h columns of every pair (rows of hG, bf16 [pairs, I]) and arrives on the
                        # segment's counter; FC2's first ring loads do not depend on h and go out before the spin.
                        for idx in cutlass.range(tid, npass * c.T1, c.threads):
                            ch = idx % c.T1
                            n = idx // c.T1
                            pr = sorted_s[off + pb + n]
                            src = n * (c.T1 * 4) + ch * 4
                            for x in cutlass.range_constexpr(4):
                                mY[pr, hI * (c.IH // 2) + rank * (hcols // 2) + ch * 4 + x] = stage_s[src + x]
                        # release: the barrier orders every thread's h stores before thread 0's release arrival
                        # (cumulative; v8 at 3fe6f56 also fenced in every thread and after the spin: s52 put the
                        # exchange at +2.2 us over v7's cluster barriers, so each serial round trip counts)
                        cute.arch.barrier()
                        if tid == 0:
                            cute.arch.atomic_add(mCnt.iterator + H_COUNTERS + u, Int32(1), sem="release", scope="gpu")
                        fc2_fill(c, wld, eW2q, eW2s, warp, t2_base, koff, t2n, NS2, lane, g, ringW, ringS)
                        if tid == 0:
                            # every CTA of the segment's items is resident (one per SM, grid <= SMs; a PDL dependent
                            # launches only once all of them ran their trigger), so the spin ends. Departures count
                            # on past NH C after FC2; the last one re-arms the counter for the next launch / replay.
                            hc = cute.arch.load(mCnt.iterator + H_COUNTERS + u, Int32, sem="acquire", scope="gpu")
                            while hc < NH * C:
                                hc = cute.arch.load(mCnt.iterator + H_COUNTERS + u, Int32, sem="acquire",
                                                    scope="gpu")
                        cute.arch.barrier()
                        # hG was written by other CTAs during this launch: read it from L2 (.cg), never from L1
                        for idx in cutlass.range(tid, npass * (c.I // 8), c.threads):
                            ch = idx % (c.I // 8)
                            n = idx // (c.I // 8)
                            pr = sorted_s[off + pb + n]
                            cute.copy(hcg, gHG[0, None, pr, ch], h4)
                            cute.autovec_copy(h4, gH[0, None, n, ch])
                        cute.arch.barrier()

                    else:
                        # this CTA's h columns -> every CTA of the cluster (16-byte DSMEM stores)
                        for idx in cutlass.range(tid, NT * c.T1 * C, c.threads):
                            dst = idx % C
                            ch = (idx // C) % c.T1
                            n = idx // (C * c.T1)
                            src = n * (c.T1 * 4) + ch * 4
                            v = [stage_s[src + x] for x in range(4)]
                            dword = n * c.HW + rank * (hcols // 2) + ch * 4
                            if const_expr(C == 1):
                                for x in cutlass.range_constexpr(4):
                                    h_flat[dword + x] = v[x]
                            else:
                                st_cluster_v4(h_base + dword * 4, dst, v)
                        # cluster barrier B: h complete in every CTA
                        if const_expr(C == 1):
                            cute.arch.barrier()
                        else:
                            cute.arch.cluster_arrive()
                            cute.arch.cluster_wait()

                    # ======================= FC2: CTA-local tiles [0, T2) of w2 (rows 16*(rank*T2 + tile)), K = I.
                    # the ring restarts here, one loaded HBM round trip after barrier B (issuing these loads from
                    # FC1's last steps instead was measured: no gain, slower at b64; version log, xpf)
                    if const_expr(c.version != 8):
                        fc2_fill(c, wld, eW2q, eW2s, warp, t2_base, koff, t2n, NS2, lane, g, ringW, ringS)
                    for s0 in cutlass.range(0, NS2_pad, D2):
                        for d in cutlass.range_constexpr(D2):
                            s = s0 + d
                            if s < NS2:
                                wv = [ringW[d, j] for j in range(4)]
                                sv = ringS[d]
                                if const_expr(c.layout == "rot"):
                                    i, kb = step_split(s0, d, c.NKB2H, D2)
                                else:
                                    i = s // c.NKB2H
                                    kb = s - i * c.NKB2H
                                tile = warp + W * i
                                if kb == 0:
                                    acc.fill(0.0)
                                a, sf = consume_slot(c, lut, wv, sv, acc, True)
                                if const_expr(c.layout == "rot"):
                                    i_, k_ = step_split(s0 + D2, d, c.NKB2H, D2)
                                    row_ = (t2_base + cutlass.min(warp + W * i_, t2n - 1)) * c.NKB2 + koff + k_
                                else:
                                    row_ = fc2_row(c, warp, t2_base, s + D2, koff)     # the refill of this slot
                                if s + D2 < NS2:
                                    load_slot(c, wld, eW2q, eW2s, row_, lane, g, ringW, ringS, d,
                                              scale=c.version < 4)
                                a, sf = consume_slot(c, lut, wv, sv, acc, False, a, sf)
                                if tile < t2n:
                                    if const_expr(c.probe == ""):
                                        for gi in cutlass.range_constexpr(GMAX):
                                            if gi * 8 < npass:
                                                for bb in cutlass.range_constexpr(2):
                                                    cute.autovec_copy(gH[0, None, gi * 8 + g, kb * 8 + bb * 4 + t], bv)
                                                    mma_block_any(c, a, bv, sf, bb, acc, gi)
                                    if kb == c.NKB2H - 1:
                                        r0 = (t2_base + tile) * 16 + g
                                        for gi in cutlass.range_constexpr(GMAX):
                                            for q in cutlass.range_constexpr(2):
                                                pr = ypair[gi * 2 + q]
                                                if pr >= 0:
                                                    if const_expr(c.version == 8):
                                                        # y_e over all of I: rounded once, as v4 does
                                                        mYb[pr, r0] = acc[gi * 4 + q].to(BFloat16)
                                                        mYb[pr, r0 + 8] = acc[gi * 4 + 2 + q].to(BFloat16)
                                                    elif const_expr(c.version in (6, 7)):
                                                        # the part's fp32 partial: y_e is rounded once, after the
                                                        # NH parts are added (v6: in the combine; v7: by the part
                                                        # reduction below)
                                                        mY[pr * NH + hI, r0] = acc[gi * 4 + q]
                                                        mY[pr * NH + hI, r0 + 8] = acc[gi * 4 + 2 + q]
                                                    else:
                                                        mY[pr, r0] = acc[gi * 4 + q].to(BFloat16)
                                                        mY[pr, r0 + 8] = acc[gi * 4 + 2 + q].to(BFloat16)
                                if const_expr(c.version >= 4):
                                    # v4: the scale word is refilled after its last use (the MMAs' scale factors)
                                    if s + D2 < NS2:
                                        ringS[d] = eW2s[row_ * 8 + g]

                    if const_expr(c.park > 0):
                        # park probe: after the CTA's first FC2, a w13 range of an expert this item does not read
                        # (one per part: ex + E/2 + 7 hI; the ranks take disjoint ranges) into shared memory that
                        # nothing reads, during the part reduction and the combine. Such an expert is rarely one
                        # of the launch's 16, so the bytes come from HBM. The kernel waits for them before it exits
                        if wi == qid:
                            if pb == pb0:
                                if tid == 0:
                                    n_chunks = c.park // PARK_CHUNK
                                    span = R13 * 32 * 16 // PARK_CHUNK - n_chunks + 1   # chunk offsets that fit
                                    first = (rank * n_chunks) % span
                                    ex2 = (ex + c.E // 2 + 7 * hI) % c.E
                                    src0 = (mW13q.iterator.toint() + Int64(ex2) * (R13 * 32 * 16)
                                            + Int64(first) * PARK_CHUNK)
                                    cute.arch.mbarrier_arrive_and_expect_tx(park_bar, c.park)
                                    for k in cutlass.range_constexpr(n_chunks):
                                        src = cute.make_ptr(Int32, src0 + k * PARK_CHUNK, cute.AddressSpace.gmem,
                                                            assumed_align=16)
                                        cp_async_bulk_shared_cluster_global(park_s.iterator + k * (PARK_CHUNK // 4),
                                                                            src, park_bar, PARK_CHUNK)
                    if const_expr(c.version == 8):
                        # v8: depart from the h exchange (every CTA passed its spin long ago). The last thread does
                        # it, so its wait for the atomic's result overlaps warp 0's combine arrivals below.
                        if tid == c.threads - 1:
                            if const_expr(c.tagged):
                                # v8.3: one arrival per (item, CTA); the last of the launch knows every poll is
                                # over, re-arms the counter and advances the epoch for the next launch
                                old = cute.arch.atomic_add(mCnt.iterator + H_LAUNCH, Int32(1), sem="relaxed",
                                                           scope="gpu")
                                if old == n_work * C - 1:
                                    cute.arch.store(mCnt.iterator + H_LAUNCH, Int32(0), sem="relaxed", scope="gpu")
                                    cute.arch.store(mY.iterator, epoch + 1, sem="relaxed", scope="gpu")
                            else:
                                old = cute.arch.atomic_add(mCnt.iterator + H_COUNTERS + u, Int32(1),
                                                           sem="relaxed", scope="gpu")
                                if old == 2 * NH * C - 1:
                                    cute.arch.store(mCnt.iterator + H_COUNTERS + u, Int32(0), sem="relaxed",
                                                    scope="gpu")
                    if const_expr(c.probe in PROBES_WITH_COMBINE):
                        # (the stage probes 'fc1' / 'fc2' stop before the part reduction and the combine)
                        # lean_arrive: no fence per thread; the barrier and the arrivals' acq_rel order the y stores
                        if const_expr(not c.lean_arrive):
                            cute.arch.fence_acq_rel_gpu()
                        cute.arch.barrier()
                        if const_expr(c.version == 7):
                            # ======================= v7 part reduction: the NH-th arrival of (pair, row chunk) adds the
                            # parts' fp32 partials in part order and rounds y_e to bf16 once (the reference's rounding),
                            # then arrives for the combine in its place. Spread over the CTAs that finish a pair last,
                            # so no single CTA reads all NH x 16 partial rows of a token (v6's combine does that).
                            if tid < npass:
                                pr = sorted_s[off + pb + tid]
                                lastp = Int32(-1)
                                if last_arrival(mCnt, PART_COUNTERS + pr * C + rank, NH):
                                    lastp = pr
                                scr[41 + tid] = lastp
                            cute.arch.barrier()
                            for n in cutlass.range(0, npass):
                                pr = scr[41 + n]
                                if pr >= 0:
                                    for v in cutlass.range(tid, NV, c.threads):
                                        vv = rank * NV + v
                                        s8.fill(0.0)
                                        for hp in cutlass.range_constexpr(NH):
                                            for q in cutlass.range_constexpr(2):
                                                cute.copy(ycg32, gY4[0, None, pr * NH + hp, 2 * vv + q], y4a)
                                                for x in cutlass.range_constexpr(4):
                                                    s8[4 * q + x] = s8[4 * q + x] + y4a[x]
                                        ro.store(s8.load().to(BFloat16))
                                        cute.autovec_copy(ro, gYb[0, None, pr, vv])
                            if const_expr(not c.lean_arrive):
                                cute.arch.fence_acq_rel_gpu()
                            cute.arch.barrier()
                        # ======================= combine: the 16th arrival of (token, row chunk) sums the slots in order
                        if tid < npass:
                            pr = sorted_s[off + pb + tid]
                            if const_expr(c.version == 7):
                                pr = scr[41 + tid]              # only the pairs this CTA reduced arrive (-1: none)
                            last = Int32(-1)
                            if pr >= 0:
                                m = pr // TOPK
                                if last_arrival(mCnt, m * c.RB + rbi, ARRIVALS):
                                    last = m
                            scr[33 + tid] = last
                        cute.arch.barrier()
                        for n in cutlass.range(0, npass):
                            m = scr[33 + n]
                            if m >= 0:
                                nv = NV
                                vb = rbi * NV
                                if const_expr(not c.T2_EVEN):
                                    nv = 2 * t2n                # the rows of this CTA's row block, 2 vectors per row pair
                                    vb = 2 * t2_base
                                for v in cutlass.range(tid, nv, c.threads):
                                    vv = vb + v
                                    s8.fill(0.0)
                                    if const_expr(c.version == 6):
                                        # y_e = bf16(y_half0 + y_half1): the reference's single rounding of y_e
                                        for j in cutlass.range_constexpr(TOPK):
                                            wj = mTw[m, j]
                                            for q in cutlass.range_constexpr(2):
                                                cute.copy(ycg32, gY4[0, None, (m * TOPK + j) * 2, 2 * vv + q], y4a)
                                                cute.copy(ycg32, gY4[0, None, (m * TOPK + j) * 2 + 1, 2 * vv + q], y4b)
                                                for x in cutlass.range_constexpr(4):
                                                    ye = (y4a[x] + y4b[x]).to(BFloat16).to(Float32)
                                                    s8[4 * q + x] = s8[4 * q + x] + ye * wj
                                    elif const_expr(c.version in (7, 8)):
                                        for j in cutlass.range_constexpr(TOPK):
                                            wj = mTw[m, j]
                                            cute.copy(ycg, gYb[0, None, m * TOPK + j, vv], ry)
                                            s8.store(s8.load() + ry.load().to(Float32) * wj)
                                    else:
                                        for j in cutlass.range_constexpr(TOPK):
                                            wj = mTw[m, j]
                                            cute.copy(ycg, gY[0, None, m * TOPK + j, vv], ry)
                                            s8.store(s8.load() + ry.load().to(Float32) * wj)
                                    ro.store(s8.load().to(BFloat16))
                                    cute.autovec_copy(ro, gO[0, None, m, vv])
                    cute.arch.barrier()
            if const_expr(c.park > 0):
                # the park probe's copies land in this CTA's shared memory: it may not exit before they complete
                if qid < n_work:
                    if tid == 0:
                        cute.arch.mbarrier_wait(park_bar, 0)

    return MoeMxfp4Experts


# ----------------------------------------------------------------------------------------------- host entry points

_KERNEL_CLASS = None


def _kernel_class():
    global _KERNEL_CLASS
    if _KERNEL_CLASS is None:
        _KERNEL_CLASS = _build_kernel_class()
    return _KERNEL_CLASS


def _compile(cfg: KernelCfg, options: str = TVM_FFI):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32, Int64
    obj = _kernel_class()(cfg)
    M = cute.sym_int()
    R13, R2, S13, S2, RY, RYB = (cute.sym_int() for _ in range(6))
    args = (
        fake_tensor(Int32, (M, cfg.dL // 2)),                  # z as bf16x2 words
        fake_tensor(Int32, (M, TOPK), align=4),                # topk_ids
        fake_tensor(Float32, (M, TOPK), align=4),              # topk_w
        fake_tensor(Int32, (R13, 4)),                          # w13q rows of 16 B
        fake_tensor(Int32, (S13,), align=4),                   # w13s words
        fake_tensor(Int32, (R2, 4)),
        fake_tensor(Int32, (S2,), align=4),
        # y workspace [>= M*16 (v6 / v7 / v5.2: NH M*16 fp32), dL]; v8: hG, the pairs' h as bf16x2 words [>= M*16, I/2]
        fake_tensor(Int64 if cfg.tagged else Float32 if cfg.alt_parts else
                    {6: Float32, 7: Float32, 8: Int32}.get(cfg.version, BFloat16),
                    (RY, cfg.I // 2 if cfg.version == 8 else cfg.dL)),
        fake_tensor(BFloat16, (RYB, cfg.dL)),                  # v7 / v8 / v5.2: bf16 y_e rows [>= M*16, dL]
        fake_tensor(Int32, (MAX_M * 8,), align=4),             # combine counters
        fake_tensor(BFloat16, (M, cfg.dL)),                    # r
    )
    return cute.compile(obj, *args, fake_stream(), options=options)


def park_max(cfg: KernelCfg) -> int:
    """The park probe's largest size for a key: the shared memory the kernel leaves free, in whole PARK_CHUNKs."""
    free = SMEM_PER_CTA_MAX - dataclasses.replace(cfg, park=0).smem_bytes - PARK_OVERHEAD
    return free // PARK_CHUNK * PARK_CHUNK


MID_BATCH_PARTS = 2     # v7's parts of I at buckets 4 / 8 (default_parts)


def default_parts(I: int, MB: int, C: int, nsm: int = 132) -> int:
    """v7's (and v8's) parts of I per expert: the most parts (each a multiple of 64 outputs) whose work items, one per
    part of each of the bucket's 16 MB experts, all get a cluster of C at once: rank16 (I = 256) b1 4 (64 clusters
    of 2 = 128 SMs), b2 2; rank8 (I = 384) b1 3.

    Above bucket 2 no part count gives every possible expert a cluster, and the active ones are known only on the
    device. There v7 takes MID_BATCH_PARTS: with n active experts over Q clusters the rounds go from ceil(n / Q)
    whole experts to ceil(2 n / Q) halves, never more time for the weights (ceil(2n/Q) <= 2 ceil(n/Q)), and half
    when few experts are hot (skewed routing: 24 experts on 66 clusters)."""
    if MB > SMALL_BATCH_MAX_MB:
        return MID_BATCH_PARTS if I % (64 * MID_BATCH_PARTS) == 0 else 1
    best = 1
    for p in range(1, I // 64 + 1):
        if I % (64 * p) == 0 and p * TOPK * MB * C <= nsm:
            best = p
    return best


V7_CLUSTER = 2      # v7's clusters: TPC pairs, all 66 co-resident (C = 4 grids above 32 clusters are not)


def compile_key(E: int, dL: int, I: int, M: int, *, C: int | None = None, D: int = 8, nsm: int = 132,
                situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                version: int | None = None, layout: str | None = None, W: int | None = None,
                parts: int | None = None, route_direct: bool | None = None,
                ring_fit: bool | None = None, tagged: bool = False, lean_arrive: bool | None = None,
                alt_parts: int | None = None) -> KernelCfg:
    """layout None: "rot" for versions >= 4 (the default kernel), "nibble" for 2-3.  W None: DEFAULT_WARPS for
    versions >= 4 (measured, version log "rot layout"), 8 for 2-3.  C None: default_cluster, V7_CLUSTER for v7.
    parts None: default_parts for v7 / v8 (1 for the other versions).  version None: default_version(MB, I, dL).
    route_direct None: ROUTE_DIRECT at batch bucket 1 (route1; other buckets always sort).
    ring_fit None: RING_FIT at RING_FIT_VERSIONS (4 / 5 / 7); True / False: the same explicitly; other versions
    never. alt_parts None: alt_parts_rule (v5.2's device-chosen v7 items at buckets 4 / 8); 0: v5.1."""
    MB = m_bucket(M)
    if version is None:
        version = default_version(MB, I, dL, nsm)
    if layout is None:
        layout = "rot" if version >= 4 else "nibble"
    if W is None:
        W = DEFAULT_WARPS if version >= 4 else 8
    if C is None:
        C = V7_CLUSTER if version in (7, 8) else default_cluster(MB)
    if parts is None:
        parts = default_parts(I, MB, C, nsm) if version in (7, 8) else 1
    direct = (ROUTE_DIRECT if route_direct is None else bool(route_direct)) and MB == 1
    if alt_parts is None:
        alt_parts = alt_parts_rule(version, MB, I, C)
    return KernelCfg(E=E, dL=dL, I=I, MB=MB, C=C, D=D, W=W, nsm=nsm,
                     situ_beta=float(situ_beta), situ_linear_beta=float(situ_linear_beta), version=version,
                     layout=layout, parts=parts, route_direct=direct,
                     ring_fit=ring_fit_rule(ring_fit, version), tagged=bool(tagged) and version == 8,
                     lean_arrive=LEAN_ARRIVE if lean_arrive is None else bool(lean_arrive), alt_parts=alt_parts)


def alt_parts_rule(version: int, MB: int, I: int, C: int) -> int:
    """v5.2's parts of I (0: v5.1): ALT_PARTS at v5's buckets that v7's part counters serve (4 / 8), with v7's
    clusters of 2 (a key with other clusters keeps v5.1: v7's items over clusters of 4 were never measured)."""
    if version != 5 or not SMALL_BATCH_MAX_MB < MB <= SPLIT_MAX_MB[7] or C != V7_CLUSTER \
            or I % (64 * ALT_PARTS) or not ALT_PARTS:
        return 0
    return ALT_PARTS


def ring_fit_rule(ring_fit: bool | None, version: int) -> bool:
    """Whether a kernel of this version fits its rings, given compile_key's ring_fit argument (its docstring)."""
    return (RING_FIT if ring_fit is None else bool(ring_fit)) and version in RING_FIT_VERSIONS


def compile_keys(cfg_or_dims, batches=M_BUCKETS, *, nsm: int = 132) -> list[KernelCfg]:
    """All compile keys one K3 config (or (E, dL, I)) needs for the given batch sizes."""
    if hasattr(cfg_or_dims, "num_experts"):
        E, dL, I = cfg_or_dims.num_experts, cfg_or_dims.routed_expert_hidden_size, cfg_or_dims.expert_intermediate
        sb, slb = cfg_or_dims.situ_beta, cfg_or_dims.situ_linear_beta
    else:
        (E, dL, I), sb, slb = cfg_or_dims, 4.0, 25.0
    keys = []
    for M in batches:
        k = compile_key(E, dL, I, M, nsm=nsm, situ_beta=sb, situ_linear_beta=slb)
        if k not in keys:
            keys.append(k)
    return keys


def get_kernel(key: KernelCfg):
    return compile_cached(("moe_mxfp4_experts", key), lambda: _compile(key))


def warmup(cfg_or_dims, batches=M_BUCKETS, *, nsm: int | None = None) -> list[KernelCfg]:
    """Compile every key needed before CUDA-graph capture."""
    if nsm is None:
        nsm = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    keys = compile_keys(cfg_or_dims, batches, nsm=nsm)
    for k in keys:
        get_kernel(k)
    return keys


@dataclass
class MoeWorkspace:
    y: torch.Tensor          # [64*16, dL] bf16: per-(token, slot) expert outputs
    counters: torch.Tensor   # [64*8] int32, zero between launches (self-resetting)
    # [33, HG_MAX_WORDS] int64, v8.3 only: [0, 0] the launch epoch, rows 1.. the tagged h words. Zeroed once and
    # never shared with y: a tag must never be met by chance, and y holds whatever other versions leave there.
    hg: torch.Tensor | None = None


def make_workspace(dL: int, device) -> MoeWorkspace:
    return MoeWorkspace(y=torch.empty(MAX_M * TOPK, dL, dtype=torch.bfloat16, device=device),
                        counters=torch.zeros(MAX_M * 8, dtype=torch.int32, device=device),
                        hg=torch.zeros(33, HG_MAX_WORDS, dtype=torch.int64, device=device))


_NSM: dict = {}


def _num_sms(device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NSM:
        _NSM[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NSM[idx]


def _validate(z, topk_ids, topk_w, prep: PreparedExperts):
    E, I, dL = prep.dims
    check_tensor("z", z, dtype=torch.bfloat16)
    if z.dim() != 2 or z.shape[1] != dL:
        raise ValueError(f"z: expected shape [M, {dL}], got {list(z.shape)}")
    M = z.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"z: batch M={M} outside [1, {MAX_M}]")
    dev = z.device
    check_tensor("topk_ids", topk_ids, dtype=torch.int32, shape=(M, TOPK), device=dev, align=4)
    check_tensor("topk_w", topk_w, dtype=torch.float32, shape=(M, TOPK), device=dev, align=4)
    for n, t in [("w13q", prep.w13q), ("w13s", prep.w13s), ("w2q", prep.w2q), ("w2s", prep.w2s)]:
        check_tensor(n, t, dtype=torch.int32, device=dev)
    if tuple(prep.w2q.shape) != (E, dL // 16, I // 64, 32, 4) or tuple(prep.w13s.shape) != (E, I // 8, dL // 64, 8):
        raise ValueError("prepared expert tensors have inconsistent shapes")
    return E, I, dL, M


def moe_mxfp4_experts(z, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, *,
                      situ_beta: float = 4.0, situ_linear_beta: float = 25.0, out=None, workspace=None,
                      version: int | None = None, cluster: int | None = None,
                      kernel_cfg: KernelCfg | None = None, layout: str | None = None, warps: int | None = None,
                      route_direct: bool | None = None, ring_fit: bool | None = None, tagged: bool = False,
                      lean_arrive: bool | None = None, alt_parts: int | None = None):
    """Routed-expert output r [M, dL] bf16 (see module docstring).

    w13_packed / w13_scale / w2_packed / w2_scale are the four tensors of prepare_mxfp4_experts (a PreparedExperts
    may also be passed as w13_packed with the other three None; the four tensors alone need ``layout``).  topk_ids
    values must lie in [0, E) (not checked:
    that would need a host sync).  workspace: MoeWorkspace from make_workspace (allocated per call if None).
    route_direct: at M = 1, the 16 pairs as segments without the counting sort (route1; None = ROUTE_DIRECT).
    ring_fit: each loop's ring depth fitted to its K steps (None = RING_FIT, on; version log "ring_fit").
    alt_parts: v5.2's v7 items, taken on the device when the passes are few (None = alt_parts_rule; 0 = v5.1).
    """
    if isinstance(w13_packed, PreparedExperts):
        prep = w13_packed
        if layout is not None and layout != prep.layout:
            raise ValueError(f"layout={layout!r} given for experts prepared with layout {prep.layout!r}")
    else:
        if layout not in LAYOUTS:
            raise ValueError(f"moe_mxfp4_experts with the four prepared tensors needs layout= one of {LAYOUTS} "
                             f"(PreparedExperts.layout), got {layout!r}")
        prep = PreparedExperts(w13_packed, w13_scale, w2_packed, w2_scale, layout=layout)
    if prep.layout == "rot" and version is not None and version < 4:
        raise ValueError(f"experts prepared with layout 'rot' need kernel version >= 4, got {version}; prepare them "
                         f"with layout='nibble' for versions 2-3")
    E, I, dL, M = _validate(z, topk_ids, topk_w, prep)
    if not z.is_cuda:
        raise ValueError("moe_mxfp4_experts runs on CUDA tensors only")
    if out is None:
        out = torch.empty(M, dL, dtype=torch.bfloat16, device=z.device)
    check_tensor("out", out, dtype=torch.bfloat16, shape=(M, dL), device=z.device)
    if workspace is None:
        workspace = make_workspace(dL, z.device)
    check_tensor("workspace.y", workspace.y, dtype=torch.bfloat16, device=z.device)
    check_tensor("workspace.counters", workspace.counters, dtype=torch.int32, shape=(MAX_M * 8,), device=z.device)
    if workspace.y.dim() != 2 or workspace.y.shape[1] != dL or workspace.y.shape[0] < M * TOPK:
        raise ValueError(f"workspace.y: expected [>= {M * TOPK}, {dL}], got {list(workspace.y.shape)}")
    if version is None:
        version = default_version(m_bucket(M), I, dL, _num_sms(z.device))
    if version in SPLIT_VERSIONS and m_bucket(M) > SPLIT_MAX_MB[version]:
        version = DEFAULT_VERSION       # v6-v8 split each expert over clusters where few experts leave SMs idle
    key = compile_key(E, dL, I, M, C=cluster, nsm=_num_sms(z.device), situ_beta=situ_beta,
                      situ_linear_beta=situ_linear_beta, version=version, layout=prep.layout, W=warps,
                      route_direct=route_direct, ring_fit=ring_fit, tagged=tagged, lean_arrive=lean_arrive,
                      alt_parts=alt_parts)
    if kernel_cfg is not None:          # benchmarks of other tile / cluster / ring choices (k3fast.measure.bench_experts)
        if (kernel_cfg.E, kernel_cfg.dL, kernel_cfg.I) != (E, dL, I) or kernel_cfg.MB < M \
                or kernel_cfg.layout != prep.layout:
            raise ValueError(f"kernel_cfg {kernel_cfg} does not fit E={E}, dL={dL}, I={I}, M={M}")
        key = kernel_cfg
    fn = get_kernel(key)
    y = yb = workspace.y
    if key.version == 8:
        # hG, the pairs' h rows (bf16 as int32 words, [16 MB, I/2]), then the bf16 y_e rows [M 16, dL]; v8.3: hG is
        # workspace.hg (the epoch at [0, 0], the tagged words of pair p in row p + 1)
        n_h = key.PMAX * I
        flat = workspace.y.view(-1)
        yb = flat[n_h: n_h + M * TOPK * dL].view(M * TOPK, dL)
        if not key.tagged:
            y = flat[:n_h].view(torch.int32).view(key.PMAX, I // 2)
        else:
            hg = workspace.hg
            if hg is None or hg.dtype != torch.int64 or hg.device != z.device or hg.dim() != 2 \
                    or hg.shape[0] < key.PMAX + 1 or hg.shape[1] < I // 2 or not hg.is_contiguous():
                raise ValueError(f"tagged (v8.3) needs workspace.hg: a contiguous int64 tensor of at least "
                                 f"[{key.PMAX + 1}, {I // 2}] on {z.device}, zeroed once (make_workspace), got "
                                 f"{None if hg is None else (hg.dtype, list(hg.shape), hg.device)}")
            y = hg.view(-1)[: (key.PMAX + 1) * (I // 2)].view(key.PMAX + 1, I // 2)
    elif key.version in (6, 7) or key.alt_parts:
        # the parts' fp32 partials, rows NH pair + part: NH x M x 16 x dL x 4 B, inside the bf16 workspace's
        # MAX_M x 16 x dL x 2 B (MB <= 8, NH <= 3); v7's bf16 y_e rows follow them (v5.2: v5's y rows too)
        split = key.alt or key
        n32 = split.NH * M * TOPK * dL
        flat = workspace.y.view(-1)
        y = flat.view(torch.float32)[:n32].view(split.NH * M * TOPK, dL)
        if 2 * n32 + (M * TOPK * dL if split.version == 7 else 0) > flat.numel():
            raise ValueError(f"version {split.version} with {split.NH} parts at M={M} needs more than the workspace's "
                             f"{flat.numel()} y elements: use at most {flat.numel() // (2 * M * TOPK * dL) - 1} parts")
        if split.version == 7:
            yb = flat[2 * n32: 2 * n32 + M * TOPK * dL].view(M * TOPK, dL)
    fn(z.view(torch.int32), topk_ids, topk_w, prep.w13q.view(-1, 4), prep.w13s.view(-1), prep.w2q.view(-1, 4),
       prep.w2s.view(-1), y, yb, workspace.counters, out)
    return out
