"""Skinny GEMV family for Kimi K3 decode (H200, sm_90a), with AttnRes mix + input RMSNorm in the prologue.

Version log
  v1: FMA warp-per-row GEMV (M = 1..4), mma.sync m16n8k16 swap-AB GEMV (M buckets 8..64), AttnRes+RMSNorm
      prologue shared by `attnres_rmsnorm` (one CTA per token) and the fused `attnres_rms_gemv` (M <= 4).
      K split across the warps of a CTA (deterministic in-order smem reduction, no workspace, no atomics).
      Weights are prefetched into L2 (prefetch.global.L2) before griddepcontrol_wait, and the fused
      persistent kernel prefetches its next row group while it computes the current one.
      ptxas (CUTE_DSL_COMPILER_OPT="remarks{ptx}", sm_90a, DSL 4.8.1), 0 spill bytes in every kernel below:
        fma (8 warps) M=1/2/3/4: 56/80/80/98 regs; mma (8 warps) M=8/16: 47/64, M=32: 90 (RTW=1) / 156 (RTW=2),
        M=64: 158 (RTW=1) / 186 (RTW=2); attnres_rmsnorm (16 warps, n_blocks=8): 89; fused (16 warps,
        n_blocks=8) M=1/2/4: 78/84/92. (v1 first kept the sources in registers: ptxas kept their fp32
        copies live and spilled 300-1600 B at the 128-register cap; they are now staged in smem.)
      Measured later (traces/h200/kernels-11595c4.json, single-kernel graph replays, L2 read-flushed, 4.22 TB/s copy):
      fused attnres_rms_gemv on the packed in_proj: rank16 b1/b8/b64 34.5 / 30.1 / 44.1 us (floor 10.9-11.8; cuBLAS's
      bare GEMV without the prologue 19.8 / 19.7 / 21.8); full b1/b8/b64 204 / 359 / 412 us (floor 168; cuBLAS 178 /
      176 / 182).  Missed: ~1.2x floor at 708 MB but 3.2x at 46 MB (a ~15-20 us fixed cost), and the mma path at
      M >= 8 is 2-2.3x slower than cuBLAS (B fragments from global at every k step, x re-read per row tile).
      v2 (not yet run on a GPU). (a) The FMA loop is written as batches of U vectors per lane: U loads, then their
      FMAs, with the last batch predicated (past-the-end lanes re-read the slice's last vector with weight 0).
      v1's `range(..., unroll=4)` had a runtime trip count, and its remainder iterations issue one load per round
      trip. U = 8 at M = 1 and 4 at M >= 2, so a 16-warp SM has 64 KB in flight instead of 32 KB (~21 GB/s per SM
      at ~1.5 us loaded latency is what our plain GEMVs reach: moe_tail b1 2.7 TB/s). The PTX loop of the plain
      M = 1 GEMV is now 9 loads, then FMAs. Prediction for the full-width in_proj (ks = 2: 14 vectors per lane):
      204 -> ~180-185 us (cuBLAS 178). Shared gate/up b1 (ks = 2, 14 per lane: 5 round trips in v1, 2 now): 11.7 ->
      ~8-9 us.
      (b) The fused kernel's heuristic picks ks = 8 for the rank16 in_proj: 13 row-group iterations per CTA, each
      with 112 vectors per warp, i.e. 3.5 per lane. A runtime-trip-count loop that short runs in its remainder: one
      load, then its FMAs wait, then the next load. That is ~3-4 round trips per iteration, ~45 in all, which
      explains most of the 34.5 us. When a slice is <= 8 vectors per lane, U is the whole slice: the PTX loop is
      now LLLL then 32 FMAs, one round trip per iteration. Registers: fused 62-86, plain 52-74. ptxas now spills
      4-16 B in the AttnRes prologue of some fused keys (at 62-64 registers); the loops do not spill.
      Prediction: rank16 in_proj b1 34.5 -> ~20-25 us, and the attention half 50.5 -> ~38-42 us. The bench rows
      gemv_in_proj_plain, attnres_rms_gemv@unfused and @ks1/4/8 separate the prologue from the iteration count.
      Registers at M = 1: 48-88, 0 spills (ptxas 4.8.1, remarks{ptx}). Also in v2: the tensor-core path unrolls its
      k32 loop 4 (was 2) for MB <= 16 (40-66 registers, 0 spills), i.e. twice the fragments in flight; predicted
      to bring oproj / shared gate-up / tail at b8 within ~1.2x of cuBLAS (they are 1.1-1.6x slower at b8 now).
      Expected then: plain gemv M=1 ~1.05-1.15x floor on in_proj; fused M=1 ~1.1-1.25x
      (prologue partly hidden behind the L2 prefetch); mma M=8..16 ~1.1-1.3x, M=64 likely >1.3x (x re-read
      from L2 per row tile: 2x the weight bytes at RTW=2).

      Measured (kernels-ea0c850.json): in_proj rank16 b1 26.7 us, attention half 42.4 us (near the top of the range).
  v3 (2026-11-29, session 5; CPU-compiled only, opt-in: fused_groups=2 / FUSED_GROUPS / impl "fast-gemvg2") The
      fused kernel's loop takes two row groups per iteration and issues both groups' weight loads before the first
      FMA: 14 16-byte loads per lane in flight instead of 7 (ks = 4, K = 7168). Why: in the layer at rank16 b1 the
      fused in_proj takes 17.2 us against an 11 us floor (records-cd4a730-s5perf.json timeline). Its 115 CTAs each
      run 7 row groups, and each group is one batch of 7 loads followed by a warp reduction, a CTA barrier and the
      store: 7 serial round trips to L2 (the next group is L2-prefetched) per CTA. Per group, the FMAs, reduction
      and store are the same operations in the same order, so the outputs are bit-identical to v2
      (tests/gpu test_opt_in_builds_are_bitwise, fused_groups). The v2 path's PTX is unchanged. ptxas 12.9 (traces/cpu/ptxcheck-07cd715093d7.json): M = 1 98 registers
      (v2 82), M = 2 104 (82), no local memory; SASS 31.5 / 45.8 KB (23.0 / 34.8).
      Prediction: in_proj at b1 17.2 -> ~13-14 us in the layer, so the attention half 39.6 -> ~36 us (1.8x stock
      is 35.8 us). If it does not move, the round trips are not the cost, and the 46 MB read itself is: cuBLAS
      takes 19.2 us in the same bench, where the copy-bandwidth floor is 11.2 us. Bench row attnres_rms_gemv@G2.
      Measured (kernels-31884ea.json, records-31884ea-s6perf.json): no gain. Bench b1 24.2 us against v2's 23.7;
      attention half b1 39.4 against 39.8 us. The round trips are not the cost. Stays opt-in.
  v4 (2026-11-29, session 6; measured slower, then removed: the record below is what ran at 1214f05) The
      fused kernel's weight prefetch becomes bulk L2 requests: before the PDL wait, warp 0 of each CTA issues one
      cp.async.bulk.prefetch.L2 per weight row of its first `win` row groups (win = BULK_L2_BYTES = 36 MB over one
      round of the grid's groups: 5 of the 7 at rank16), and each loop iteration requests the group `win` ahead.
      v2 prefetched only the next group, with one prefetch.global.L2 per 128-byte line. Why: v3 showed that
      round trips are not the cost, and the kernel streams at ~2 TB/s (bench b1 23.7 us for 46 MB). The weights
      need not wait for the AttnRes prologue (n_blocks + 1 source rows from L2, three CTA reductions) nor for the
      register loads, which cap what each SM keeps in flight. The TMA unit can keep the HBM busy on its own.
      Arithmetic unchanged: bit-identical to v2 (GPU test, removed with it). Prediction: bench b1 23.7 ->
      ~14-16 us; in_proj in the layer (flushed timeline) ~ -6 us, so the attention half b1 39.8 -> ~33-35 us
      (1.8x stock is 35.6). At rank8 (90 MB > L2) the window keeps ~36 MB ahead of use; expect a smaller gain.
      Risk: the prologue's own L2 reads queue behind the bulk stream.
      Measured (kernels-1214f05.json, records-1214f05-s7perf.json): slower. Bench b1 26.9 against 24.8 us; the
      attention half b1 41.9 against 39.5. LOG.md (session 6) has the likely mechanism. Removed after the
      session's review (no further use; moe_tail keeps its bulk mode for the queueing-against-eviction A/B).
  v5 (2026-11-29, session 6; early_trigger=True, FastImpl attn_early_trigger, the default since 001a431) The fused
      kernel launches its PDL dependents right after its wait instead of after its last row group. In the rank16
      b1 chain (records-c90da94-kdaall.json, flushed) the KDA step starts at 20.8 us, after this kernel ends at
      20.4, so its pre-wait loads (the FP32 state of the batch's slots, W_fb, conv weights) never overlap.
      Safe under the chain rule (the dependent reads nothing this kernel writes before its own wait). Prediction,
      together with kda_conv_gate_step v2: attention half b1 -3 to -4 us. Measured: -3.1 us (39.6 -> 36.5,
      records-001a431-s8.json; kda_conv_gate_step v2 has the timeline).
  v6 (2026-11-29, session 6; PIN_LOADS, the default since session 7; "fast-s8" is the A/B without it) Each
      batch's U weight loads are tied together. Why, from the SASS (ptxas 12.9) of the fused in_proj at rank16 M = 1:
      the PTX issues 7 loads then the FMAs, but ptxas issues 4 loads, then the FMAs of the first (which wait for its
      data), then the other 3 into registers the first ones freed. That is 2-3 round trips per row group instead
      of one. It explains why v3 (14 loads per lane in the PTX) changed nothing, and why the kernel sits at 82
      registers. The tie: every weight scale gets + 0 * (the sum of the batch's first weights). That is exactly
      0 for finite weights, so outputs are bit-identical; a NaN weight poisons only its own row's dot product,
      which it poisons anyway. ptxas then issues all 7 loads first (CPU test
      test_pinned_loads_issue_together_in_sass, run where ptxas / nvdisasm are found; loads behind a use 3 -> 0 in
      traces/cpu/ptxcheck-cb84e2ba91f3.json). Cost: 128 registers (the
      cap at 512 threads), so an in_proj CTA fills its SM's register file, and the early-triggered KDA CTAs (v5)
      fit only on the ~17 SMs without one. Prediction: fused in_proj at b1 (flushed timeline) 20.3 -> ~16-17 us;
      attention half b1 36.5 -> ~33-35 us, where the KDA step's lost overlap (+1-2 us) is the uncertain part.
      Bench rows attnres_rms_gemv@pin and gemv_in_proj_plain@pin (@v5 since it is the default); GPU test
      test_opt_in_builds_are_bitwise (pin_loads).
      Measured (kernels-84291ed.json, records-84291ed-s9perf.json, one run; bit-identical in the GPU tests): fused
      in_proj bench b1 23.9 -> 23.1 us, b2 28.9 -> 27.6; plain GEMV b1 23.1 -> 22.3, b2 24.1 -> 24.4, b4 37.7 ->
      37.8; attention half b1 36.7 -> 35.7 us (fast-gemvpin). Missed at the kernel (-0.8 us, not -3 to -4): the
      loads now issue together, so the round trips per group were only part of the cost; the rest is the ~2 TB/s
      per-SM streaming rate that v3 and v4 did not move either. Kept as the default for the -1 us in the layer
      (PIN_LOADS = True since session 7; "fast-s8" keeps v5).
  v7 (2026-11-30, session 10; opt-in prefetch_groups / PREFETCH_GROUPS, impls "fast-inpf2" / "fast-inpf3";
      CPU-compiled, measured by h200_next s21) Each CTA of the fused kernel issues the L2 prefetches of its first
      pf row groups before the PDL wait (v2-v6: one group), and its loop prefetches the group pf ahead. Only
      prefetches change, so the output is bit-identical (GPU test test_opt_in_builds_are_bitwise). The PTX after
      the wait has the same loads and FMAs (CPU test test_fused_prefetch_depth).
      Why: at rank16 b1 the fused in_proj takes 19.4 us in the layer for 46 MB, i.e. 2.4 TB/s
      (records-226990a-s20b.json). The router front, an FMA GEMV of 75 MB with no prologue, streams at 3.5 TB/s in
      the same replay. ncu (ncu-2674eff-ncu2/) shows 115 CTAs, DRAM 47.7 % busy and SMs active 74 % of the elapsed
      cycles. Before its wait each CTA asks for one group: 57 KB at ks = 4, 6.6 MB over the grid, ~1.6 us of HBM
      time. Its AttnRes prologue then runs for ~3 us (n_blocks + 1 source rows from L2, three CTA reductions). At
      pf = 3 the pre-wait requests cover 20 MB.
      Risk: v3 (two groups per iteration, prefetching 2-3 groups ahead) and v4 (bulk L2 prefetch, 36 MB) did not
      gain. So the prologue's own L2 reads may queue behind the prefetch stream, or the per-SM rate may not depend
      on prefetch depth at all.
      Prediction: bench b1 -0.5 to -1.5 us at pf = 3; attention half b1 -0.5 to -1.5 us. If nothing moves, the
      in_proj's remaining cost is the prologue's latency itself, and the next step is to stop recomputing x in
      every CTA.
  v8 (2026-11-30, session 10; opt-in x_fp32, impl "fast-inxf", bench row attnres_rms_gemv@xf; removed in session
      11 after the measurement below, the code is at 5f1f620;
      CPU-compiled, measured by h200_next s21b) The fused kernel's loop did two things per 16-byte weight vector
      that it need not:
      - it widened the same bf16 x vector to fp32 once per row group (8 cvt per vector, 7 times per CTA at rank16);
      - it multiplied every weight by a mask scale. The scale is 1 + 0 * pin inside the slice and 0 past it, so
        that past-the-end lanes, which re-read the slice's last vector, add zero.
      v8 keeps x in shared memory as fp32 (the bf16-rounded x, widened exactly once in the prologue), with one zero
      vector past its end. Past-the-end lanes multiply their re-read weights by that zero vector. The pin (v6)
      joins each accumulator once per batch as acc + 0 instead of each weight's scale. That is enough to keep the
      batch's loads issued together: each accumulator's first FMA of the batch depends on every load (CPU SASS
      test).
      SASS, ptxas 12.9, rank16 in_proj: the loop shrinks from 365 to 239 instructions per 7-vector batch at M = 1
      (no FMUL, 59 SHF / PRMT instead of 126) and from 512 to 317 at M = 2. Registers 128 -> 110 at M = 1; no
      spills (test_fp32_x_shrinks_the_loop).
      Output: the same FMAs on the same values. acc + (+-0) leaves acc unchanged, and a past-the-end lane adds an
      exact zero either way. So the output is bit-identical up to the sign of an exactly zero sum
      (test_opt_in_builds_are_bitwise).
      Why: ncu2 shows the fused in_proj issuing 7.1 M warp instructions, ~79 per 512-byte warp load of weights. It
      issues at 0.43 per cycle per scheduler with 4 warps each, and long-scoreboard waits are only 3.3 of its 9.3
      cycles per issue. So the loop's own instruction chain is a large part of each row group's time.
      Prediction: in_proj bench b1 -1 to -3 us; attention half b1 -1 to -2.5 us (fast-inxf); b2 similar. If it does
      not move, the chain is the loads' round trips after all, and v7's depth is the lever.
      Measured (s21b at 5f1f620, kernels-/records-5f1f620-s21b.json, one run): MISSED, slower. Bench rank16 b1 /
      b2 23.1 / 27.9 -> 24.5 / 32.8 us, rank8 33.2 / 38.6 -> 34.4 / 47.0; attention half rank16 b1 33.8 -> 34.5,
      rank8 47.4 -> 48.1. ncu (ncu-5f1f620-ncu3/): 20.9 -> 22.0 us, short-scoreboard stalls 0.66 -> 2.60 and long
      scoreboard 3.26 -> 4.69 cycles per issue. The fp32 x doubles the loop's shared-memory reads (14 LDS.128 per
      batch instead of 7), and each of a CTA's four row warps of one k-slice reads the same x. v7 (pf = 2 / 3) was
      slower too (bench rank16 b1 25.2 / 25.8 us; attention half 36.1 at pf = 3): deeper L2 prefetch queues
      ahead of the demand loads, as v4's did.
  v9 (2026-11-30, session 11; opt-in x_regs, impl "fast-inxr", bench row attnres_rms_gemv@xr; removed after the
      measurement below, the code is at c1bb65a; CPU-compiled,
      measured by h200_next s22) At M = 1 with a one-batch slice (7 vectors per lane at K = 7168, ks = 4) a lane's
      x vectors are the same for every row group. v9 reads them once, after the prologue, from v8's fp32 staging
      into 56 registers (the zero vector past the end for past-the-end lanes). The row-group loop is then the 7
      weight loads, v8's pin, 56 widenings of the weights and 56 FMAs. Its next-group L2 prefetch takes one line
      per lane without the general helper's index division.
      Reading the SASS of v6 showed where its 626 instructions per row group go (ptxas 12.9, rank16 in_proj, M =
      1): 365 in the k-loop (7 LDS, 126 SHF / PRMT of x and w, 56 FMUL of the mask, 63 FFMA), ~200 in the
      next-group prefetch, which divides by the runtime line count for each line, and the rest in the reduction.
      A first v9 widened x from bf16 registers. ptxas then re-derived the widened, masked x inside the loop to
      stay under 128 registers (48 FMUL + ~56 SHF / PRMT per group, 561 in all). Loading the fp32 values from
      shared memory leaves nothing to re-derive.
      SASS: 626 -> 309 instructions per row group, 7 LDG issued together, no FMUL, one LDS (the reduction's); 126
      registers, no spills (CPU test test_x_regs_loop_is_loads_and_fmas).
      Output: the same FMAs on the same values in the same order as v6 (x * (w * 1) there, x * w here); a
      past-the-end lane adds an exact zero. Bit-identical up to the sign of an exactly zero sum, as v8 (GPU test
      test_opt_in_builds_are_bitwise).
      Why: ncu3 (ncu-5f1f620-ncu3/) puts the in_proj at 9.2 cycles per issued instruction with 4 warps per
      scheduler: issue-active ~43 %, long scoreboard only 3.3 of the 9.2. With 7 groups per CTA, each group is a
      round trip, then ~2.5 k issue cycles per scheduler of loop and prefetch before the next group's loads
      leave. v8 cut the k-loop but added shared-memory reads and lost. v9 removes both the widening and the
      reads, and the prefetch's division, which v8 kept.
      Prediction: in_proj bench rank16 b1 23.1 -> ~19.5-21.5 us, rank8 33.2 -> ~29-31.5; attention half b1 -1.5
      to -3 us at both ranks (fast-inxr). If it does not move, the in_proj is bound by per-SM load latency and
      the 7 serial groups, not by issue, and the remaining lever is more bytes in flight per group.
      Measured (s22 at c1bb65a, kernels-/records-c1bb65a-s22.json, ncu-c1bb65a-s22/): MISSED, no change. Bench
      rank16 b1 23.14 -> 23.20 us, rank8 33.54 -> 34.05; attention half rank16 33.8 -> 33.4, rank8 47.5 -> 48.1.
      ncu rank16 b1 20.90 -> 20.83 us with half the instructions: 14.1 cycles per issued instruction instead of
      9.2, long scoreboard 3.3 -> 5.8, barrier 1.1 -> 2.4. Bit-identical (GPU test). So the in_proj is not bound
      by issue (v8, v9), nor by round trips per group (v3), nor by L2 prefetch depth (v4, v7). What is left is
      the per-SM streaming rate (~25 GB/s per SM in the loop, ~2.8 TB/s over 115 SMs, like the router front's
      per-SM rate) and the work per SM: 7 groups of 4 rows on each of 115 SMs, 17 SMs idle, against 6.1 groups
      on average over 132 (ncu4: busiest SM active 37.9 k cycles, mean of the 115 busy ones 35.9 k). v10 spreads
      the rows.
  v10 (2026-11-30, session 11; opt-in even_rows, impls "fast-inev" / "fast-inev126", bench rows
      attnres_rms_gemv@ev / @ev126; removed in session 12 after the measurement below, the code is at 0e81145;
      CPU-compiled, measured by h200_next s23) The persistent grid was sized so that no CTA runs more row
      groups than another: at rank16, 804 groups of 4 rows take 7 rounds on 132 SMs, so 115 CTAs run 7 groups
      each and 17 SMs stay idle. v10 launches one CTA per SM and gives CTA b the rows [b N / 132, (b + 1) N /
      132), in groups of 4 whose last may be partial. A warp whose row is past its CTA's range loads nothing and
      adds zeros to the k-slice reduction, and its row is not stored. At rank16 that is 24 or 25 rows per CTA:
      6 full groups plus, on 48 CTAs, one group of a single row. The work on the busiest SM falls from 28 rows to
      25. At rank8 (N = 6288: 47-48 rows, 12 groups, against 12 groups on 131 CTAs now) and at full width (374-375
      rows, 94 groups either way) nothing changes, so the prediction is rank16 only.
      Bit-identical by construction: a row's dot product, its k-slices and their reduction order do not depend on
      which CTA or warp slot computes it (GPU test test_opt_in_builds_are_bitwise, every width ending some CTA on
      a partial group). SASS: 128 registers, no spills, 639 instructions per group against v6's 626 (the row
      bound and the guarded store; CPU test test_even_rows_compiles_without_spills).
      The AttnRes prologue now runs in 132 CTAs instead of 115: 15 % more of its L2 reads, which overlap the
      first group's prefetch as before.
      Risk, in the layer: an in_proj CTA holds a whole SM's registers (512 threads x 128), so the KDA step's
      early-triggered CTAs (48 at rank16 b1, 64 registers x 128 threads each) start their pre-wait state loads
      only on SMs the in_proj leaves free: 17 today, none at 132 CTAs. even_rows also takes a CTA count: 126
      leaves 6 SMs, enough for the 48 KDA CTAs at 8 per SM, at 25-26 rows per CTA (fast-inev126; at rank8,
      whose 96 KDA CTAs would need 12 SMs, 126 CTAs cost rows: 49-50 against 48 today).
      Prediction: bench rank16 b1 23.1 -> ~21.5-22.5 us (the loop's ~16.5 us scaled by 25 / 28, less the single-
      row group's latency); attention half rank16 b1 / b2 -0.8 to -1.8 us at 126 CTAs, -0 to -1.5 at 132 (the
      KDA overlap it gives up); rank8 within +-0.5 us at 132, +0.5 to +1.5 at 126. If rank16's bench does not
      move, the loop's time is set by the wave of round trips per group rather than the bytes per SM, and the
      single-row group costs as much as a full one.
      Measured (s23 at 0e81145, kernels-/records-0e81145-s23.json): MISSED, no gain beyond one run's noise
      (<= 0.2 us) anywhere, and rank8 slower. Bench (default vs @ev at 132 CTAs / @ev126): rank16 b1 22.98 vs
      23.39 / 23.23 us, b2 27.71 vs 27.55 / 27.62; rank8 b1 33.50 vs 33.92 / 34.24, b2 38.27 vs 38.75 / 39.52.
      Attention half (fast vs fast-inev / fast-inev126): rank16 b1 33.2 vs 33.3 / 33.6 us, b2 37.5 vs 37.6 /
      37.4; rank8 b1 47.3 vs 47.9 / 48.0, b2 52.7 vs 52.9 / 53.8.
      Fewer rows on the busiest SM (25 against 28) did not shorten the kernel, nor did leaving 6 SMs free for the
      KDA step's early CTAs (126). Read as the prediction's fallback says: the loop's time follows the rounds of
      row groups (7 on the busiest CTAs either way at rank16, the last a single row) rather than the rows per SM.
      Removed in session 12 (the code is at 0e81145).
  v11 (2026-11-30, session 15; opt-in split_stage / SPLIT_STAGE, impls "fast-insplit1" / "fast-insplit3";
      removed in session 16 after s44, the code is at 6874cfa;
      CPU-compiled, measured by h200_next s42) At M <= FUSE_MAX_M the prologue leaves the fused kernel again:
      attnres_rmsnorm (one CTA of 16 warps per token) computes x, and launches its PDL dependent right after its
      own wait. The dependent is the fused kernel's GEMV (16 warps, the same rpc / ks / grid, U = the whole slice,
      pinned loads, one L2 prefetch group ahead), which copies the first split_stage row groups of its CTA into
      shared memory by cp.async (16 B, .cg) before its wait: 57 KB per group at K = 7168, so 1-3 groups (the
      largest shared-memory carveout). After the wait it takes those groups from shared memory, then loads the
      rest as the fused kernel does, and reads x from L2 (the plain kernel's path).
      Why: with the prologue in every CTA, each CTA has one row group in L2 prefetch (57 KB) and U vectors per
      lane in flight while it runs the AttnRes mix and the norm (n_blocks + 1 rows from L2, three block
      reductions), so the HBM idles for most of the prologue; ncu2 had the in_proj at 47.7 % DRAM busy and SMs
      active 74 % of the time. v3, v4, v7 (more loads in flight, deeper L2 prefetch) did not help because they
      changed the loop, not the prologue. Here the prologue runs on one SM, and the other CTAs stream 3 groups
      (~20 MB at rank16, 115 CTAs) into shared memory meanwhile. Costs: a second launch (the attention half at
      b1 becomes 4 launches, over issue 4's 3: this is a measurement first, a fold back into one kernel would
      follow a win), and x read from L2 in the loop instead of shared memory.
      Bit-identical to the fused kernel by construction: attnres_rmsnorm runs the same prologue code on the same
      512 threads, and the GEMV the same K split, batch and FMA order (GPU tests test_opt_in_builds_are_bitwise,
      test_split_stage_in_a_graph). ptxas 12.9: 128 registers, 0 spills at M = 1, 24 B at M = 2 (the fused
      kernel: 128, 0).
      Prediction (attention half, s42 beside stock): rank16 b1 33.9 -> ~29-30 us with 3 groups (the in_proj 19.6
      -> ~14-15: prologue ~3.5 us while ~14-20 MB stream in, then 27 MB at the loop's ~2.9 TB/s), -1 to -2 with
      1 group; rank8 b1 47.6 -> ~44-45 (the prologue's ~3-4 us hidden; 75 MB left to stream); b2 about the same
      gains less the second token's prologue. If the in_proj does not move, the loop's pace, not the prologue,
      sets its time.
      Measured (s42 at b2bc614, records-b2bc614-s42.json, one run beside stock; bit-identical, GPU tests 22
      passed): slower everywhere, and not a test of the idea. Attention half fast / insplit1 / insplit3: rank16 b1
      33.8 / 35.5 / 38.9 us, b2 38.4 / 39.6 / 44.7; rank8 b1 47.7 / 49.2 / 53.5, b2 53.2 / 55.5 / 63.6. The replay
      timeline has the GEMV's first CTA at 3.8 us, as the prologue kernel ends (4.0): attnres_rmsnorm triggers its
      dependents at its end, not after its wait, which the design had assumed without checking. So nothing was
      staged during the prologue, and the copies ran at the GEMV's start, ahead of its first FMA (3 groups cost
      more than 1). What the run did measure: without its prologue the GEMV took 17.7 us at rank16 b1 (x from L2, 1
      group staged) against the fused kernel's 19.6 with it, so the prologue costs the fused kernel ~2 us and the
      loop's pace (~2.7 TB/s on 115 CTAs) is the rest.
  v11.1 (2026-11-30, session 15; the same opt-in, CPU-compiled, not yet run: `scripts/h200_next.sh s44`) The
      prologue kernel launches its dependent right after its wait when it serves v11 (attnres_rmsnorm
      early_trigger, a compile key of its own; the M > 4 path keeps the trigger at the end). In the layer's
      timelines a dependent's first CTA arrives ~0.6-1 us after its primary's trigger (the tail after the experts'
      wait: s41 rank16 b1 layer, experts from 48.9 while the front ends at 49.5, tail at 50.1), so the GEMV's CTAs
      should be copying from ~1 us into the ~4 us prologue.
      Prediction (attention half): rank16 b1 33.8 -> ~31-32 us with 3 groups (~12 MB land during the prologue;
      the 3 staged groups then take ~0.5 us each instead of a round of the loop; bounded by the ~2 us the
      prologue costs plus the staged groups' share of the loop), -0.5 to -1.5 with 1 group; rank8 b1 within -2 us
      (13 groups per CTA, 3 staged). If insplit3 is not below fast, the fused kernel's prologue is already hidden
      as well as staging can hide it, and v11 goes.
      Measured (s44 at 6874cfa, records-6874cfa-s44.json, one run beside stock; GPU tests 22 passed,
      bit-identical): slower again, and now a valid test. Attention half replay median, fast / fast-insplit1 /
      fast-insplit3: rank16 b1 33.5 / 34.7 / 35.6 us, b2 38.4 / 37.8 / 41.6; rank8 b1 47.6 / 48.1 / 50.7, b2 53.1 /
      54.1 / 60.4. Timeline (rank16 b1): the GEMV's first CTA now arrives at 1.0-1.3 us (the early trigger works),
      but the one-CTA prologue kernel stretches from ~4 to 6.5 us (insplit1) / 7.3 us (insplit3) while the staged
      copies run, and the GEMV still ends at ~21 us against the fused kernel's 20.0: the staged groups do not
      shorten the loop that follows the prologue, whose pace (~2.7 TB/s on 115 CTAs) sets the in_proj's time.
      Removed in session 16 (the code is at 6874cfa).
  v12 (2026-11-30, session 16; k3fast/rms_gemv_ring.py, its own module and version log; the layer's in_proj at M <= 2
      since s46) The fused kernel's chain with the weights streamed by cp.async.bulk into a shared-memory ring of
      ~200 KB per SM (one CTA per SM, a producer warp, 14 consumer warps). ncu5 showed cuBLAS's M = 1 GEMV (a TMA +
      WGMMA kernel) reading the in_proj's bytes 3-6 us faster than this module's register-load loop, which v3-v10
      could not speed up. The ring takes the rank8 in_proj at 3.45 TB/s in the kernel bench (the FMA GEMV 2.63,
      cuBLAS 3.0) and the attention half rank16 b1 33.5 -> 31.5 us. This module's fused kernel still serves
      "fast-infma" and the opt-ins above; its plain and tensor-core GEMVs serve M >= 3.
  v15 (2026-12-01, session 23; attnres_rmsnorm's cluster build, NORM_CLUSTER / NORM_CLUSTER_MIN_M; "fast-normc1" is
      the A/B, "fast-normc9" the clusters above M = 8 only, s73's first rule) Why: above M = 8 the layer's two AttnRes
      norms run as their own kernels before cuBLAS GEMVs (the in_proj's, and o_proj's AttnRes #2), one CTA of 16 warps
      per token. In s72's timelines they take 3.8 and 4.7 us at both b16 and b64 (rank16 and rank8 alike), 8.5 us of
      the attention half (rank16 b64 55.7 us, the 1.8x target needs 52; rank8 b16 60.0, needs 56.3), against ~1.5 us
      of bytes at b64: each token's chain (its sources' L2 / DRAM round trip, two CTA reductions, the second pass and
      the stores) runs on one SM with ~130 KB to move, whatever the batch. Design: a cluster of C CTAs per token (grid
      [C, M], cluster [C, 1, 1]), each over K / C of the columns with one thread per 16-byte vector (C = 4 at K =
      7168: 224 threads, its sources' 28 KB staged in shared memory instead of 129 KB). Each CTA's two statistics
      rounds (per source: sum v^2 and <v, u>; then sum m^2) are summed over its warps in warp order, pushed by
      st.shared::cluster into row ``rank`` of every CTA's exchange buffer, and summed in rank order after a cluster
      barrier, so every CTA computes the same alphas and rstd (deterministic; not bit-identical to one CTA, whose
      per-warp partials split K differently: GPU test within 1 bf16 ulp). A relaxed cluster arrive at the start and
      its wait before the first push make sure no CTA writes a peer's shared memory before that peer runs. Prediction
      (written before any GPU run; s73): kernel bench attnres_rmsnorm@nb8 cl1 -> cl4 at b16 / b64 ~3.5-4.5 -> ~1.8-2.5
      us; in the layer the two norms 3.8 + 4.7 -> ~2 + ~2.5 us, so the attention half -3.5 to -4.5 us at b16 and b64
      (rank16 b64 55.7 -> ~51.5, 1.8x of s72's stock; rank8 b64 83.8 -> ~79.5; rank8 b16 60.0 -> ~56). If the norms
      stay above 3 us, their time is not the per-token chain but the launch and PDL edges around them. Measured (s73
      at 934c387, kernels- / records-934c387-s73.json, copy 4.14 TB/s; GPU tests 62 passed, the cluster builds 2 / 4 /
      8 against the reference, deterministic, in place, with their one-CTA results within 1 bf16 ulp). Kernel bench
      (L2 flushed, each row a graph of the norm alone): nb8 cl1 -> cl4 11.3 -> 9.3 us at b8 / b16, 11.3 -> 11.9 at
      b64; nb1 7.1-7.6 -> 6.8-7.4. In the layer (fast against fast-normc1, one run each): the norms at b16 4.0 + 4.8
      -> 3.0 + 4.0 us (rank8; rank16 3.9 + 4.4 -> 3.1 + 3.6), at b64 3.8 + 4.8 -> 3.8 + 4.6 (rank16); attention half
      rank16 b64 56.1 -> 55.4, rank8 b64 84.5 -> 83.6, rank8 b16 60.5 -> 59.1, rank16 b16 43.8 -> 42.3; with the
      clusters also at M 3..8 (fast-normc3) rank8 b8 53.1 -> 51.6, rank16 b8 35.7 -> 34.7. MISSED (-0.7 to -1.5 us
      against -3.5 to -4.5), as the rule written before the run named: the norms stay at 3-4 us, set by the chain
      around them (launch, the DRAM round trip of the sources, the reductions and the stores) and not by the bytes one
      SM moves. Still faster in every cell, so the default, from M = 3 since s74 (s74 at 8f4e39e: fast-normc9 +0.2 /
      +0.5 us at rank16 / rank8 b8, fast-normc1 +1.1 / +0.4 at b64; records-8f4e39e-s74.json).
  v16 (session 26, written after its last device run; opt-in pre_blocks, FastImpl norm2_pre, impls "fast-n2pre" /
      "fast-opwg-n2pre"; measured by s92 in session 27 and removed, the code is at 2009964) attnres_rmsnorm read the
      first pre_blocks blocks (those earlier layers wrote) before its PDL wait and the partial / delta after it: the
      same statistics in the same order, bit-identical (GPU test, passed in s92), the default build's PTX unchanged.
      Why: with o_proj on gemm_wgmma_splitk the norm is launched from the GEMM's cluster barrier and sat at its wait
      ~2.6 us, then took ~5 us after o_proj's end (s90e), its chain starting with the blocks' loads.
      Prediction: the norm after its predecessor's end 5.0 -> ~3.5-4 us; attention half rank16 b64 with fast-opwg-n2pre
      52.6 -> ~51.5 us, rank8 b16 with fast-n2pre 58.5 -> ~57.5.
      Measured (s92 at 2009964, records-2009964-s92.json, one run beside stock, copy 4.07 TB/s; GPU tests 22 passed):
      attention half rank16 b64 fast-opwg / fast-opwg-n2pre 52.6 / 52.5 us (fast 53.5, fast-n2pre 53.7; stock 91.6),
      rank8 b16 fast / fast-n2pre 58.4 / 58.6 (stock 102.8), rank8 b64 80.1 / 80.0, rank16 b16 40.0 / 40.3. MISSED: no
      median moved by more than 0.3 us. The one profiled replay per cell (replay_timeline) has the norm ending after
      o_proj's end by 5.0 -> 3.7 us at rank16 b64 with the WGMMA o_proj, 4.2 -> 3.5 at rank8 b64, 3.2 -> 3.1 at rank8
      b16, 3.8 -> 4.3 at rank16 b16 and 5.0 -> 5.0 behind cuBLAS: where the norm waits beside a still-running o_proj
      the reads may take a little off its tail, but the medians of 50 replays do not show it, and the rest of the
      norm's chain after the wait (p and a, its two cluster reductions, the stores) is what remains. Removed with its
      impls and tests.

Reference ops replaced (k3-spec.md):
  * section 6 + section 4.3 "attn_res #1": p' = bf16(p + delta); optional block write B[bw] = p'; the softmax
    mix over {B[0..n_blocks-1], p'} with u = gamma*pi; section 5 input_layernorm RMSNorm of the FP32 mix
    (vLLM semantics: m is NOT rounded before the norm). x = bf16(w_ln * m * rstd(m)) is rounded to BF16
    before the dot product (identical in the fused and the unfused path; matches a bf16 GEMM input).
  * section 7.2 step 1 / 7.4: the packed KDA in_proj_qkvgfab GEMV (and every other bf16 Linear: o_proj,
    router+latent down, latent up, shared gate_up/down) -- y = x @ W^T, fp32 accumulate, bf16 out.

Bytes / floor at 4.3 TB/s (weights only; activations are L2-resident and < 1 MB):
  in_proj (K=7168):   k3_rank16 N=3216  46.1 MB -> 10.7 us | k3_rank8 N=6288 90.1 MB -> 21.0 us |
                      full N=49376 (4*12288+128+96, already a multiple of 16) 707.9 MB -> 164.6 us
  o_proj (N=7168):    K=768 11.0 MB -> 2.6 us | K=1536 22.0 MB -> 5.1 us | K=12288 176 MB -> 41 us
  shared gate_up:     N=768/1536/12288, K=7168: 11.0 / 22.0 / 176 MB; shared down N=7168 K=384/768/6144
  router+latent down: N=4480 K=7168 64.2 MB -> 14.9 us; latent up N=7168 K=3584 51.4 MB -> 12.0 us
  AttnRes prologue reads (n_blocks+1..3) x 7168 x 2 B per token (<= 143 KB, L2) and writes 14 KB per token.

Design
  * M <= 4 (`_FmaGemv`): one warp per output row (RPC rows x KS k-slices per 8-warp CTA), 16-byte weight
    loads (L1::no_allocate), 8-wide fp32 FMA accumulators per token, butterfly reduce, k-slices summed in a
    fixed order through smem. KS grows until N*KS >= 2112 warps (16 per SM) so small-N shapes still keep
    enough 16-byte loads in flight.
  * M in 5..64 (`_MmaGemv`, buckets 8/16/32/64): swap-AB mma.sync m16n8k16 -- weights are the MMA "M" side
    (16 rows per warp tile), tokens are N=8 columns per MMA. A and B fragments come straight from global
    with 16-byte loads: K is permuted inside each 32-wide chunk (thread c of a quad loads k = 8c..8c+7 of
    its row and feeds k 8c..8c+3 to the first MMA, 8c+4..8c+7 to the second), identically for A and B, so
    the dot product is unchanged and every load is 128-bit. Token rows >= M are clamped to row M-1 for the
    loads (never read out of bounds) and never stored. K split across warps, in-order smem reduction.
  * `attnres_rmsnorm`: one CTA (16 warps) per token; the token's n_blocks+1 sources are read once from L2
    and staged in smem (<= 129 KB), two block reductions (source stats, then sum m^2). In-place
    partial_out = partial is allowed here (each thread reads its elements before writing them). From
    NORM_CLUSTER_MIN_M tokens (v15): a cluster of NORM_CLUSTER CTAs per token, each over K / NORM_CLUSTER columns,
    the two reductions' per-CTA sums exchanged through distributed shared memory.
  * `attnres_rms_gemv` (fused, M <= fuse_max_m): a persistent FMA GEMV whose CTAs (<= 132, 16 warps) first
    prefetch their first row group into L2, then run the same prologue for every token into smem, then
    stream weights. Cost estimate that sets the default fuse_max_m = 2: each CTA re-reads M x 129 KB
    (n_blocks=8) from L2, so 132 CTAs read 17 MB per token (~1.5-2 us of L2 time at M=1, overlapped with
    the ~30 MB of weights the CTAs already prefetched into L2), against ~2 us for a separate single-CTA
    prologue kernel + launch. At M = 3..4 the per-CTA prologue (serial over tokens, ~1 us each) costs more
    than the 4-CTA separate kernel, so the host uses attnres_rmsnorm + gemv there (both are PDL launches).
  * Every launch uses PDL: weights are prefetched to L2 before griddepcontrol_wait; activations after it.
"""


import math

from ._dsl import (TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, gemv_operands, import_cute,
                   st_shared_cluster_f32, swapab_a_fragment, swapab_c_fragment_to, weight_load_atom)

NUM_SMS = 132
NB_MAX = 8
M_BUCKETS = (1, 2, 3, 4, 8, 16, 32, 64)
FMA_WARPS = 8
MMA_WARPS = 8
NORM_WARPS = 16
# v15 (session 23): attnres_rmsnorm as a cluster of NORM_CLUSTER CTAs per token from NORM_CLUSTER_MIN_M tokens
# (where it runs as its own kernel: before v13's ring GEMV at M 3..8, before cuBLAS GEMVs above); below that one CTA
# per token (version log v15; s73 measured 9, then 3)
NORM_CLUSTER = 4
NORM_CLUSTER_MIN_M = 3
NORM_CLUSTERS = (1, 2, 4, 8)
FUSED_WARPS = 16
FUSE_MAX_M = 2
FUSED_GROUPS = 1    # v3 (opt-in; measured no faster): 2 row groups per iteration of the fused kernel's loop
PIN_LOADS = True    # v6 (the default since session 7): tie each batch of the FMA loop's weight loads together
PREFETCH_GROUPS = 1  # v7 (opt-in, "fast-inpf2" / "fast-inpf3"): row groups of the fused kernel in L2 prefetch ahead
# (v11 / v11.1, the prologue as attnres_rmsnorm with the GEMV's first row groups staged in shared memory, were
# measured in sessions 15 / 16 and removed in session 16, the code is at 6874cfa: version log)
# (v8, x in fp32 shared memory, and v9, x in registers, were measured and removed in session 11; v10, rows split
# evenly over the SMs, in session 12: version log)


def _vectors_per_lane(K: int, ks: int) -> int:
    """16-byte weight vectors per lane of one warp's k-slice (K split into ks slices, 32 lanes each)."""
    return -(-(-(-(K // 8) // ks)) // 32)


def bucket_m(M: int) -> int:
    for b in M_BUCKETS:
        if M <= b:
            return b
    raise ValueError(f"M={M} outside 1..64")


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


# ----------------------------------------------------------------------------- launch configs (host heuristics)

def _fma_config(N: int, K: int) -> tuple[int, int]:
    """(rows per CTA, k-slices) for the 8-warp FMA kernel."""
    ks = 1
    nvec = K // 8
    while N * ks < 16 * NUM_SMS and ks < FMA_WARPS and nvec // (ks * 2) >= 64:
        ks *= 2
    return FMA_WARPS // ks, ks


def _mma_config(N: int, K: int, MB: int) -> tuple[int, int, int]:
    """(row tiles of 16 per warp RTW, warp row-groups per CTA RT, k-slices KS); RT*KS = 8 warps."""
    tiles = N // 16
    # at M >= 32 the x fragments (L2 hits) cost more than the weights unless each is reused by 2 row tiles
    rtw = 2 if (MB >= 32 and tiles >= 2) else 1
    wt = -(-tiles // rtw)
    ks = 1
    while wt * ks < 12 * NUM_SMS and ks < MMA_WARPS and (K // 32) // (ks * 2) >= 4:
        ks *= 2
    return rtw, MMA_WARPS // ks, ks


def _fused_config(N: int, K: int) -> tuple[int, int, int]:
    """(rows per CTA iteration, k-slices, grid) for the persistent fused kernel.

    ks = 4 where K allows (>= 64 16-byte vectors per slice).  v2's rule balanced row groups over the SMs and
    picked ks = 8 at rank16 and ks = 2 at full width; the H200 bench at ea0c850 timed every choice on the same
    inputs (traces/h200/kernels-ea0c850.json): rank16 b1 ks 1/4/8 = 26.2 / 24.1 / 27.1 us, full b1 ks 1/4/8 =
    229.1 / 210.7 / 276.8 us against 225.8 us for ks = 2; ks = 4 was the fastest at both."""
    ks = 4
    while ks > 1 and (K // 8) // ks < 64:
        ks //= 2
    rpc = FUSED_WARPS // ks
    groups = N // rpc
    iters = -(-groups // NUM_SMS)
    return rpc, ks, -(-groups // iters)


# ----------------------------------------------------------------------------- K3 shapes

def k3_gemv_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(N, K) of every bf16 GEMV of one K3 layer for a K3Config (k3ref.config)."""
    d = cfg.hidden_size
    P = cfg.kda_proj
    return {
        "in_proj": (_round16(4 * P + cfg.kda_head_dim + cfg.kda_heads), d),
        "o_proj": (d, P),
        "router_latent_down": (cfg.num_experts + cfg.routed_expert_hidden_size, d),
        "latent_up": (d, cfg.routed_expert_hidden_size),
        "shared_gate_up": (2 * cfg.shared_intermediate, d),
        "shared_down": (d, cfg.shared_intermediate),
    }


# ----------------------------------------------------------------------------- device code

def _build_kernels():
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32, const_expr

    ADD = cute.ReductionOp.ADD

    @cute.jit
    def _prefetch_rows(gWv, row0, nrows, kv0, kv1, lane):
        # prefetch.global.L2 of rows [row0, row0+nrows) x 16B-vectors [kv0, kv1): one prefetch per 128 B line
        lpr = (kv1 - kv0 + 7) // 8
        for idx in cutlass.range(lane, nrows * lpr, 32):
            r = idx // lpr
            l = idx - r * lpr
            cute.arch.prefetch(gWv[0, None, row0 + r, kv0 + 8 * l].iterator.llvm_ptr, cache_level="L2")


    def _vec(self, split, vl, nvec):
        """(global vector, its sV column, in range) of this thread's vl-th vector. Without a split: vl itself,
        clamped to the last vector (a thread past the end re-reads it with weight 0). In a cluster CTA: vector
        rank * vpc + vl, where a thread past the CTA's range re-reads the range's last vector, so that any thread that
        stages a vector in sV stages the value its owner stages."""
        if const_expr(split is None):
            v = cutlass.min(vl, nvec - 1)
            return v, v, vl < nvec
        v0 = split[0] * self.vpc
        v = cutlass.min(v0 + cutlass.min(vl, self.vpc - 1), nvec - 1)
        return v, v - v0, (vl < self.vpc) & (v0 + vl < nvec)

    @cute.jit
    def _cluster_sum(self, split, sX, vals, col0, tid, first: cutlass.Constexpr = False):
        """Cluster-wide sums of ``vals`` (this CTA's partials, identical in all of its threads): thread i pushes
        vals[i] into row ``rank`` of every cluster CTA's sX at column col0 + i; after a cluster barrier every thread
        adds the cl rows in rank order. ``first``: the cluster's first exchange, which first waits for the start
        barrier (every CTA of the cluster running, so its shared memory may be written)."""
        rank = split[0]
        if const_expr(first):
            cute.arch.cluster_wait()
        for i in cutlass.range_constexpr(len(vals)):
            if tid == i:
                for c in cutlass.range_constexpr(self.cl):
                    st_shared_cluster_f32(sX.iterator + ((rank * sX.shape[1]) + col0 + i), vals[i], c)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        out = []
        for i in cutlass.range_constexpr(len(vals)):
            acc = sX[0, col0 + i]
            for c in cutlass.range_constexpr(1, self.cl):
                acc = acc + sX[c, col0 + i]
            out.append(acc)
        return out

    @cute.jit
    def _attnres_token(self, m, mBlocks, mP, mD, mPout, mU, mWln, dst, sV, sRedA, sRedB, tid, warp, lane,
                       is_writer):
        """AttnRes mix + RMSNorm of token m by the whole CTA; dst (flat-divided (1,8) view, row m) gets
        bf16(w_ln * m * rstd). Every thread ends with identical statistics (fixed reduction order)."""
        _attnres_tokens(self, (m,), mBlocks, mP, mD, mPout, mU, mWln, dst, sV, sRedA, sRedB, tid, warp, lane,
                        is_writer)

    @cute.jit
    def _attnres_tokens(self, ms, mBlocks, mP, mD, mPout, mU, mWln, dst, sV, sRedA, sRedB, tid, warp, lane,
                        is_writer, hoist_wln: cutlass.Constexpr = False, split=None):
        """The AttnRes mix + RMSNorm of the tokens ``ms`` (a tuple, one entry per token; _attnres_token's is
        ``(m,)``) by the whole CTA, jointly: each phase runs for every token before the next phase, so the tokens
        share one round of source loads and one CTA barrier per reduction instead of one each (rms_gemv_ring
        v12.2's joint prologue at M = 2). Each token's arithmetic, and its order, is the one-token prologue's, so the
        results are bit-identical to calling it token by token. sV [len(ms) * NS, K], sRedA [warps, len(ms) * 2 NS],
        sRedB [warps, len(ms)]. hoist_wln: w_ln (a weight) is loaded with u at the start instead of after the
        second reduction, so its round trip is not on the chain.

        split (v15, the norm kernel's cluster build): None, this CTA takes all of K; or (rank, sX, sY) for CTA
        ``rank`` of a cluster of self.cl CTAs per token, which takes the self.vpc 16-byte vectors from rank * vpc
        (sV then holds only those) and adds its statistics to the cluster's: each CTA's per-warp sums, added in warp
        order, are pushed into every CTA's sX [cl, len(ms) * 2 NS] / sY [cl, len(ms)] at row ``rank`` and summed in
        rank order after a cluster barrier, so that every CTA of the cluster computes the same alphas and rstd.

        The sources are staged in smem sV (a thread in range re-reads only what it wrote; one past the end reads
        its owner's vector after the reduction's barrier): holding them in registers made ptxas keep their fp32
        copies live across the reduction and spill at the 128-register cap of a 512-thread CTA."""
        NS = self.nb + 1
        NM = len(ms)
        VPT = self.vpt
        NT = self.nthreads
        nvec = self.K // 8
        gB = cute.flat_divide(mBlocks, (1, 1, 8))
        gP = cute.flat_divide(mP, (1, 8))
        gPo = cute.flat_divide(mPout, (1, 8))
        gU = cute.flat_divide(mU, (8,))
        sVv = cute.flat_divide(sV, (1, 8))
        gWl = cute.flat_divide(mWln, (8,))
        rT = cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), BFloat16)
        rD = cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), BFloat16)
        rUj = cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), Float32)
        rWl = None
        if const_expr(hoist_wln):
            rWl = cute.make_rmem_tensor(cute.make_layout((8, VPT), stride=(1, 8)), mWln.element_type)
            for j in cutlass.range_constexpr(VPT):
                cute.autovec_copy(gWl[None, _vec(self, split, tid + j * NT, nvec)[0]], rWl[None, j])
        stats = [[Float32(0.0)] * (2 * NS) for _ in range(NM)]
        for j in cutlass.range_constexpr(VPT):
            # threads past the end re-read the last vector (in bounds) with weight 0 and write nothing
            v, sl, inb = _vec(self, split, tid + j * NT, nvec)
            wgt = Float32(1.0)
            if const_expr(split is not None or nvec % NT != 0):
                wgt = cutlass.select_(inb, Float32(1.0), Float32(0.0))
            cute.autovec_copy(gU[None, v], rUj)
            uv = rUj.load() * wgt
            for mi in cutlass.range_constexpr(NM):
                m = ms[mi]
                for i in cutlass.range_constexpr(NS):
                    if const_expr(i < self.nb):
                        cute.autovec_copy(gB[0, 0, None, m, i, v], rT)
                    else:
                        cute.autovec_copy(gP[0, None, m, v], rT)
                        if const_expr(self.has_delta):
                            gD = cute.flat_divide(mD, (1, 8))
                            cute.autovec_copy(gD[0, None, m, v], rD)
                            # bf16(p + delta): fp32 add, one round to nearest-even (torch's bf16 add)
                            rT.store((rT.load().to(Float32) + rD.load().to(Float32)).to(BFloat16))
                        if is_writer:
                            if inb:
                                cute.autovec_copy(rT, gPo[0, None, m, v])
                                if const_expr(self.bw >= 0):
                                    cute.autovec_copy(rT, gB[0, 0, None, m, self.bw, v])
                    # only the owner stages a vector: a thread past the end re-reads its owner's vector, which with
                    # partial_out = partial (in place) the owner may already have overwritten with p'
                    if inb:
                        cute.autovec_copy(rT, sVv[0, None, mi * NS + i, sl])
                    vf = rT.load().to(Float32)
                    stats[mi][2 * i] = stats[mi][2 * i] + (vf * vf).reduce(ADD, Float32(0.0), 0) * wgt
                    stats[mi][2 * i + 1] = stats[mi][2 * i + 1] + (vf * uv).reduce(ADD, Float32(0.0), 0)
        for mi in cutlass.range_constexpr(NM):
            for q in cutlass.range_constexpr(2 * NS):
                t = cute.arch.warp_reduction_sum(stats[mi][q])
                if lane == 0:
                    sRedA[warp, mi * 2 * NS + q] = t
        cute.arch.sync_threads()
        inv_k = 1.0 / self.K
        alphas = []
        for mi in cutlass.range_constexpr(NM):
            tot = []
            for q in cutlass.range_constexpr(2 * NS):
                acc = Float32(0.0)
                for w in cutlass.range_constexpr(self.nwarps):
                    acc = acc + sRedA[w, mi * 2 * NS + q]
                tot.append(acc)
            if const_expr(split is not None):
                tot = _cluster_sum(self, split, split[1], tot, mi * 2 * NS, tid, first=(mi == 0))
            scores = []
            for i in cutlass.range_constexpr(NS):
                r = cute.math.rsqrt(tot[2 * i] * inv_k + self.eps)
                scores.append(r * tot[2 * i + 1])
            mx = scores[0]
            for i in cutlass.range_constexpr(1, NS):
                mx = cute.math.max(mx, scores[i])
            es = []
            den = Float32(0.0)
            for i in cutlass.range_constexpr(NS):
                e = cute.math.exp(scores[i] - mx)
                es.append(e)
                den = den + e
            rden = 1.0 / den
            alphas.append([e * rden for e in es])
        # mix of the raw sources in fp32 (sources order: blocks, then p'), kept until rstd is known
        rM = [cute.make_rmem_tensor(cute.make_layout((8, VPT), stride=(1, 8)), Float32) for _ in range(NM)]
        msq = [Float32(0.0)] * NM
        for j in cutlass.range_constexpr(VPT):
            _, sl, inb = _vec(self, split, tid + j * NT, nvec)
            for mi in cutlass.range_constexpr(NM):
                cute.autovec_copy(sVv[0, None, mi * NS, sl], rT)
                mv = rT.load().to(Float32) * alphas[mi][0]
                for i in cutlass.range_constexpr(1, NS):
                    cute.autovec_copy(sVv[0, None, mi * NS + i, sl], rT)
                    mv = mv + rT.load().to(Float32) * alphas[mi][i]
                rM[mi][None, j].store(mv)
                part = (mv * mv).reduce(ADD, Float32(0.0), 0)
                if const_expr(split is not None or nvec % NT != 0):
                    part = cutlass.select_(inb, part, Float32(0.0))
                msq[mi] = msq[mi] + part
        for mi in cutlass.range_constexpr(NM):
            t2 = cute.arch.warp_reduction_sum(msq[mi])
            if lane == 0:
                sRedB[warp, mi] = t2
        cute.arch.sync_threads()
        msums = []
        for mi in cutlass.range_constexpr(NM):
            msum = Float32(0.0)
            for w in cutlass.range_constexpr(self.nwarps):
                msum = msum + sRedB[w, mi]
            msums.append(msum)
        if const_expr(split is not None):
            msums = _cluster_sum(self, split, split[2], msums, 0, tid)
        rstd = [cute.math.rsqrt(msum * inv_k + self.eps) for msum in msums]
        rO = cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), BFloat16)
        rWt = cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), mWln.element_type)
        for j in cutlass.range_constexpr(VPT):
            v, _, inb = _vec(self, split, tid + j * NT, nvec)
            if inb:
                if const_expr(hoist_wln):
                    wl = rWl[None, j].load().to(Float32)
                else:
                    cute.autovec_copy(gWl[None, v], rWt)
                    wl = rWt.load().to(Float32)
                for mi in cutlass.range_constexpr(NM):
                    rO.store((rM[mi][None, j].load() * wl * rstd[mi]).to(BFloat16))
                    cute.autovec_copy(rO, dst[0, None, ms[mi], v])

    # ------------------------------------------------------------------ FMA GEMV (M <= 4), optionally fused
    class _FmaGemv:
        """y[m, n] = sum_k x[m, k] w[n, k]; warps = rpc rows x ks k-slices; persistent over row groups
        (grid-stride) so the fused AttnRes prologue is paid once per CTA."""

        def __init__(self, MB, rpc, ks, nwarps, fused=False, K=0, nb=0, has_delta=False, bw=-1, eps=1e-5, G=1,
                     early_trigger=False, pin=False, pf=1):
            self.MB, self.rpc, self.ks, self.nwarps = MB, rpc, ks, nwarps
            # v7 (opt-in, fused G = 1 only): pf row groups of L2 prefetches ahead instead of one; pf before the PDL
            # wait, so the HBM streams during the AttnRes prologue (the version log says why)
            self.pf = pf
            assert pf == 1 or (fused and G == 1)
            # v5 (opt-in, fused only): launch the PDL dependents (the KDA step) right after the wait, so their
            # pre-wait state and weight loads overlap this kernel's weight stream instead of following it
            self.early_trigger = early_trigger
            assert not (early_trigger and not fused)
            # v6 (the default; G = 1 loop): tie each batch's U weight loads together so ptxas cannot sink some of them
            # below the FMAs of the others (the version log has the SASS)
            self.pin = pin
            # v3 (opt-in, fused only): G row groups per loop iteration, all their weight loads issued together (G x U
            # vectors per lane in flight, one round trip per G groups instead of one per group). v2 at rank16 b1
            # runs 7 groups per CTA, each a single batch of 7 loads followed by its reduction: 7 serial round trips.
            self.G = G
            self.fused, self.K, self.nb, self.has_delta, self.bw, self.eps = fused, K, nb, has_delta, bw, eps
            self.nthreads = 32 * nwarps
            self.vpt = -(-(K // 8) // self.nthreads) if fused else 0
            # v2: 16-byte weight loads in flight per lane = the unroll (ptxas issues an unrolled body's loads
            # together, then waits once). 8 at M = 1 (v1: 4 everywhere); at M >= 2 the x vectors of 8 iterations
            # would not fit the 128-register cap of a 16-warp CTA.
            self.unroll = 8 if MB == 1 else 4
            # v2, fused path: when a warp's k-slice is only a few vectors per lane (the rank16 in_proj runs
            # ks = 8: 112 vectors = 3.5 per lane), a runtime-trip-count loop runs in its remainder, one load per
            # round trip. There, the slice is unrolled completely and predicated (nper loads issued together).
            self.U = self.unroll
            if fused:
                per_lane = _vectors_per_lane(K, ks)
                if per_lane <= 8:
                    self.U = per_lane           # the whole slice in one batch
            if G != 1 and not (fused and G == 2 and self.U == per_lane):
                raise ValueError(f"G = {G}: only the fused kernel with a one-batch slice takes G = 2 (U {self.U})")

        @cute.jit
        def __call__(self, mX, mW, mY, mBlocks, mP, mD, mPout, mU, mWln, grid_x: Int32, stream):
            self.kernel(mX, mW, mY, mBlocks, mP, mD, mPout, mU, mWln).launch(
                grid=[grid_x, 1, 1], block=[self.nthreads, 1, 1], stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, mX, mW, mY, mBlocks, mP, mD, mPout, mU, mWln):
            tid = cute.arch.thread_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bid = cute.arch.block_idx()[0]
            nblk = cute.arch.grid_dim()[0]
            N = cute.size(mW, mode=[0])
            K = cute.size(mW, mode=[1])
            nvec = K // 8
            r = warp // self.ks
            s = warp - r * self.ks
            chunk = (nvec + self.ks - 1) // self.ks
            kv0 = s * chunk
            kv1 = cutlass.min(kv0 + chunk, nvec)
            n_groups = N // self.rpc
            gW = cute.flat_divide(mW, (1, 8))
            w_atom = weight_load_atom(mW.element_type)

            smem = cutlass.memory.SmemAllocator()
            sRed = smem.allocate_tensor(Float32, cute.make_layout((2, self.nwarps, self.MB),
                                                                  stride=(self.nwarps * self.MB, self.MB, 1)), 16)
            # weights do not depend on the producer: start their HBM stream before the PDL wait
            for ahead in cutlass.range_constexpr(self.pf):
                if bid + ahead * nblk < n_groups:
                    _prefetch_rows(gW, (bid + ahead * nblk) * self.rpc + r, 1, kv0, kv1, lane)
            if const_expr(self.fused):
                sX = smem.allocate_tensor(BFloat16, cute.make_layout((self.MB, self.K), stride=(self.K, 1)), 16)
                sRedA = smem.allocate_tensor(Float32, cute.make_layout((self.nwarps, 2 * (self.nb + 1)),
                                                                       stride=(2 * (self.nb + 1), 1)), 16)
                sRedB = smem.allocate_tensor(Float32, cute.make_layout((self.nwarps, 1), stride=(1, 1)), 16)
                sV = smem.allocate_tensor(BFloat16, cute.make_layout((self.nb + 1, self.K), stride=(self.K, 1)), 16)
                cute.arch.griddepcontrol_wait()
                if const_expr(self.early_trigger):
                    cute.arch.griddepcontrol_launch_dependents()
                gXs = cute.flat_divide(sX, (1, 8))
                for m in cutlass.range_constexpr(self.MB):
                    _attnres_token(self, m, mBlocks, mP, mD, mPout, mU, mWln, gXs, sV, sRedA, sRedB, tid, warp,
                                   lane, bid == 0)
                cute.arch.sync_threads()
                gX = gXs
            else:
                cute.arch.griddepcontrol_wait()
                gX = cute.flat_divide(mX, (1, 8))

            rX = cute.make_rmem_tensor(cute.make_layout((8, self.MB), stride=(1, 8)), BFloat16)
            acc = cute.make_rmem_tensor(cute.make_layout((8, self.MB), stride=(1, 8)), Float32)
            rWs = [cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), mW.element_type)
                   for _ in range(self.U)]
            buf = Int32(0)
            if const_expr(self.G == 2):
                rWa = cute.make_rmem_tensor(cute.make_layout((8, self.U), stride=(1, 8)), mW.element_type)
                rWb = cute.make_rmem_tensor(cute.make_layout((8, self.U), stride=(1, 8)), mW.element_type)
                kvb = kv0 + lane                # the slice is one batch: lanes cover [kv0, kv0 + 32 U) >= [kv0, kv1)
                for grp in cutlass.range(bid, n_groups, 2 * nblk):
                    g2 = grp + nblk
                    rowa = grp * self.rpc + r
                    rowb = cutlass.min(g2, n_groups - 1) * self.rpc + r     # past the end: re-read, never stored
                    for ahead in cutlass.range_constexpr(2, 4):
                        nxt = grp + ahead * nblk
                        if nxt < n_groups:
                            _prefetch_rows(gW, nxt * self.rpc + r, 1, kv0, kv1, lane)
                    for u in cutlass.range_constexpr(self.U):
                        cute.copy(w_atom, gW[0, None, rowa, cutlass.min(kvb + 32 * u, kv1 - 1)], rWa[None, u])
                    for u in cutlass.range_constexpr(self.U):
                        cute.copy(w_atom, gW[0, None, rowb, cutlass.min(kvb + 32 * u, kv1 - 1)], rWb[None, u])
                    self.group_out(rWa, kvb, kv1, gX, acc, rX, sRed, 0, grp * self.rpc, mY, warp, lane, tid)
                    if g2 < n_groups:
                        self.group_out(rWb, kvb, kv1, gX, acc, rX, sRed, 1, g2 * self.rpc, mY, warp, lane, tid)
            else:
                for grp in cutlass.range(bid, n_groups, nblk):
                    base = grp * self.rpc
                    row = base + r
                    if const_expr(self.fused):
                        nxt = grp + self.pf * nblk
                        if nxt < n_groups:
                            _prefetch_rows(gW, nxt * self.rpc + r, 1, kv0, kv1, lane)
                    acc.fill(0.0)
                    # batches of U vectors per lane: U loads issued together, then their FMAs. Predicated instead of a
                    # remainder loop (a runtime-trip-count remainder issues one load per round trip); past-the-end
                    # lanes re-read the slice's last vector (in bounds) and weight it 0.
                    for kvb in cutlass.range(kv0 + lane, kv1, 32 * self.U):
                        for u in cutlass.range_constexpr(self.U):
                            kvc = cutlass.min(kvb + 32 * u, kv1 - 1)
                            cute.copy(w_atom, gW[0, None, row, kvc], rWs[u])
                        self.fma_batch(rWs, kvb, kv1, gX, acc, rX)
                    self.reduce_store(acc, sRed, buf, base, mY, warp, lane, tid)
                    buf = 1 - buf
            if const_expr(not self.early_trigger):
                cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def fma_batch(self, rWs, kvb, kv1, gX, acc, rX):
            """One batch of U loaded vectors per lane (slice positions kvb + 32 u) into the fp32 accumulators."""
            # v6 (pin): every FMA's weight scale also depends on all U loaded vectors, as 0 * (their sum):
            # exactly 0 for finite weights (the scale and the outputs are unchanged), and a NaN weight
            # poisons only this lane's slice of its own row, whose dot product it poisons anyway
            pin = Float32(0.0)
            if const_expr(self.pin):
                for u in cutlass.range_constexpr(self.U):
                    pin = pin + rWs[u][0].to(Float32)
                pin = pin * Float32(0.0)
            for u in cutlass.range_constexpr(self.U):
                kv = kvb + 32 * u
                kvc = cutlass.min(kv, kv1 - 1)
                scale = cutlass.select_(kv < kv1, Float32(1.0), Float32(0.0))
                if const_expr(self.pin):
                    scale = scale + pin
                wv = rWs[u].load().to(Float32) * scale
                for m in cutlass.range_constexpr(self.MB):
                    cute.autovec_copy(gX[0, None, m, kvc], rX[None, m])
                    acc[None, m].store(acc[None, m].load() + rX[None, m].load().to(Float32) * wv)

        @cute.jit
        def group_out(self, rW, kvb, kv1, gX, acc, rX, sRed, sbuf, row0, mY, warp, lane, tid):
            """v3 (G = 2): one row group's FMAs from the U loaded vectors rW[:, u], the k-slice reduction through
            sRed[sbuf] and the store: the same operations in the same order as the G = 1 loop body, so the results
            are bit-identical to it."""
            acc.fill(0.0)
            self.fma_batch([rW[None, u] for u in range(self.U)], kvb, kv1, gX, acc, rX)   # no pin at G = 2
            self.reduce_store(acc, sRed, sbuf, row0, mY, warp, lane, tid)

        @cute.jit
        def reduce_store(self, acc, sRed, sbuf, row0, mY, warp, lane, tid):
            """A row group's warp sums -> sRed[sbuf] -> the k-slices added in a fixed order -> y[:, row0 + rr]
            (deterministic)."""
            for m in cutlass.range_constexpr(self.MB):
                t = cute.arch.warp_reduction_sum(acc[None, m].load().reduce(ADD, Float32(0.0), 0))
                if lane == 0:
                    sRed[sbuf, warp, m] = t
            cute.arch.sync_threads()
            if tid < self.rpc * self.MB:
                rr = tid // self.MB
                mm = tid - rr * self.MB
                tot = Float32(0.0)
                for q in cutlass.range_constexpr(self.ks):
                    tot = tot + sRed[sbuf, rr * self.ks + q, mm]
                mY[mm, row0 + rr] = tot.to(mY.element_type)

    # ------------------------------------------------------------------ tensor-core GEMV (M buckets 8..64)
    class _MmaGemv:
        """Swap-AB mma.sync: warp = RTW tiles of 16 weight rows x one k-slice; CTA = RT row groups x KS."""

        def __init__(self, MB, rtw, rt, ks):
            self.MB, self.rtw, self.rt, self.ks = MB, rtw, rt, ks
            self.nt = MB // 8
            self.nwarps = rt * ks
            # v2: k32 steps whose loads are issued together (the unrolled body is one basic block): 2 in v1;
            # 4 where the fragments are few (MB <= 16), 2 above (M = 32/64 already use 90-186 registers)
            self.unroll = 4 if MB <= 16 else 2

        @cute.jit
        def __call__(self, mX, mW, mY, stream):
            N = cute.size(mW, mode=[0])
            tiles = N // 16
            per_cta = self.rt * self.rtw
            self.kernel(mX, mW, mY).launch(grid=[(tiles + per_cta - 1) // per_cta, 1, 1],
                                           block=[32 * self.nwarps, 1, 1], stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, mX, mW, mY):
            tid = cute.arch.thread_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bid = cute.arch.block_idx()[0]
            M = cute.size(mX, mode=[0])
            N = cute.size(mW, mode=[0])
            K = cute.size(mW, mode=[1])
            tiles = N // 16
            g = lane // 4
            c = lane - 4 * g
            rt = warp // self.ks
            s = warp - rt * self.ks
            nk = K // 32
            chunk = (nk + self.ks - 1) // self.ks
            k0 = s * chunk
            k1 = cutlass.min(k0 + chunk, nk)
            tile0 = (bid * self.rt + rt) * self.rtw
            gW = cute.flat_divide(mW, (1, 8))
            gX = cute.flat_divide(mX, (1, 8))
            w_atom = weight_load_atom(mW.element_type)
            atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))

            smem = cutlass.memory.SmemAllocator()
            sRed = smem.allocate_tensor(
                Float32, cute.make_layout((self.ks, self.rt * 16, self.MB),
                                          stride=(self.rt * 16 * self.MB, self.MB, 1)), 16)

            # clamp invalid row tiles onto the last valid one (loads stay in bounds, stores are skipped)
            rowb = []
            for t in cutlass.range_constexpr(self.rtw):
                rowb.append(cutlass.min(tile0 + t, tiles - 1) * 16)
            if tile0 < tiles:
                for t in cutlass.range_constexpr(self.rtw):
                    _prefetch_rows(gW, rowb[t], 16, k0 * 4, k1 * 4, lane)
            cute.arch.griddepcontrol_wait()
            xrow = []
            for j in cutlass.range_constexpr(self.nt):
                xrow.append(cutlass.min(8 * j + g, M - 1))

            accs = []
            for t in cutlass.range_constexpr(self.rtw):
                for j in cutlass.range_constexpr(self.nt):
                    a = cute.make_rmem_tensor(cute.make_layout((4, 1, 1), stride=(1, 0, 0)), Float32)
                    a.fill(0.0)
                    accs.append(a)
            rA = cute.make_rmem_tensor(cute.make_layout((8, 2 * self.rtw), stride=(1, 8)), mW.element_type)
            rX = cute.make_rmem_tensor(cute.make_layout((8, self.nt), stride=(1, 8)), BFloat16)
            fa = cute.make_rmem_tensor(cute.make_layout((8, 1, 1), stride=(1, 0, 0)), BFloat16)
            fb = cute.make_rmem_tensor(cute.make_layout((4, 1, 1), stride=(1, 0, 0)), BFloat16)

            for kk in cutlass.range(k0, k1, 1, unroll=self.unroll):
                kv = kk * 4 + c
                for t in cutlass.range_constexpr(self.rtw):
                    cute.copy(w_atom, gW[0, None, rowb[t] + g, kv], rA[None, 2 * t])
                    cute.copy(w_atom, gW[0, None, rowb[t] + g + 8, kv], rA[None, 2 * t + 1])
                for j in cutlass.range_constexpr(self.nt):
                    cute.autovec_copy(gX[0, None, xrow[j], kv], rX[None, j])
                for h in cutlass.range_constexpr(2):
                    for t in cutlass.range_constexpr(self.rtw):
                        swapab_a_fragment(fa, rA, h, t)
                        for j in cutlass.range_constexpr(self.nt):
                            for e in cutlass.range_constexpr(4):
                                fb[e] = rX[4 * h + e, j]
                            cute.gemm(atom, accs[t * self.nt + j], fa, fb, accs[t * self.nt + j])

            # K % 32 == 16 tail: one k16 step (8-byte loads, same permutation), done by the last k-slice
            if K - nk * 32 > 0:
                if s == self.ks - 1:
                    gW4 = cute.flat_divide(mW, (1, 4))
                    gX4 = cute.flat_divide(mX, (1, 4))
                    kv4 = nk * 8 + c
                    rA4 = cute.make_rmem_tensor(cute.make_layout((4, 2 * self.rtw), stride=(1, 4)), mW.element_type)
                    rX4 = cute.make_rmem_tensor(cute.make_layout((4, self.nt), stride=(1, 4)), BFloat16)
                    for t in cutlass.range_constexpr(self.rtw):
                        cute.autovec_copy(gW4[0, None, rowb[t] + g, kv4], rA4[None, 2 * t])
                        cute.autovec_copy(gW4[0, None, rowb[t] + g + 8, kv4], rA4[None, 2 * t + 1])
                    for j in cutlass.range_constexpr(self.nt):
                        cute.autovec_copy(gX4[0, None, xrow[j], kv4], rX4[None, j])
                    for t in cutlass.range_constexpr(self.rtw):
                        fa[0] = rA4[0, 2 * t]
                        fa[1] = rA4[1, 2 * t]
                        fa[2] = rA4[0, 2 * t + 1]
                        fa[3] = rA4[1, 2 * t + 1]
                        fa[4] = rA4[2, 2 * t]
                        fa[5] = rA4[3, 2 * t]
                        fa[6] = rA4[2, 2 * t + 1]
                        fa[7] = rA4[3, 2 * t + 1]
                        for j in cutlass.range_constexpr(self.nt):
                            for e in cutlass.range_constexpr(4):
                                fb[e] = rX4[e, j]
                            cute.gemm(atom, accs[t * self.nt + j], fa, fb, accs[t * self.nt + j])
            cute.arch.griddepcontrol_launch_dependents()

            # epilogue, one round per warp row tile: fragments -> smem [ks, rows, tokens] -> in-order k sum
            for t in cutlass.range_constexpr(self.rtw):
                for j in cutlass.range_constexpr(self.nt):
                    swapab_c_fragment_to(sRed, s, accs[t * self.nt + j], rt * 16 + g, 8 * j + 2 * c)
                cute.arch.sync_threads()
                # output index o = token * (rt*16) + local row: consecutive threads write consecutive n
                for o in cutlass.range(tid, self.MB * self.rt * 16, 32 * self.nwarps):
                    tok = o // (self.rt * 16)
                    rl = o - tok * (self.rt * 16)
                    rg = rl // 16
                    tile = (bid * self.rt + rg) * self.rtw + t
                    if tok < M and tile < tiles:
                        tot = Float32(0.0)
                        for q in cutlass.range_constexpr(self.ks):
                            tot = tot + sRed[q, rl, tok]
                        mY[tok, tile * 16 + (rl - rg * 16)] = tot.to(mY.element_type)
                cute.arch.sync_threads()

    # ------------------------------------------------------------ AttnRes + RMSNorm, one CTA (or cluster) per token
    class _AttnResNorm:
        def __init__(self, K, nb, has_delta, bw, eps, early_trigger=False, cl=1):
            self.K, self.nb, self.has_delta, self.bw, self.eps = K, nb, has_delta, bw, eps
            self.early_trigger = early_trigger
            self.cl = cl
            nvec = K // 8
            # v15: a cluster of cl CTAs per token, each over vpc vectors with one thread per vector (up to 16 warps)
            self.vpc = -(-nvec // cl)
            self.nthreads = 32 * NORM_WARPS if cl == 1 else min(32 * NORM_WARPS, 32 * -(-self.vpc // 32))
            self.nwarps = self.nthreads // 32
            self.vpt = -(-(nvec if cl == 1 else self.vpc) // self.nthreads)

        @cute.jit
        def __call__(self, mBlocks, mP, mD, mPout, mU, mWln, mX, stream):
            M = cute.size(mP, mode=[0])
            if cutlass.const_expr(self.cl == 1):
                self.kernel(mBlocks, mP, mD, mPout, mU, mWln, mX).launch(
                    grid=[M, 1, 1], block=[self.nthreads, 1, 1], stream=stream, use_pdl=True)
            else:
                self.kernel(mBlocks, mP, mD, mPout, mU, mWln, mX).launch(
                    grid=[self.cl, M, 1], block=[self.nthreads, 1, 1], cluster=[self.cl, 1, 1], stream=stream,
                    use_pdl=True)

        @cute.kernel
        def kernel(self, mBlocks, mP, mD, mPout, mU, mWln, mX):
            tid = cute.arch.thread_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            m = cute.arch.block_idx()[0]
            split = None
            cols = self.K
            if cutlass.const_expr(self.cl > 1):
                m = cute.arch.block_idx()[1]
                cols = self.vpc * 8
            smem = cutlass.memory.SmemAllocator()
            sRedA = smem.allocate_tensor(Float32, cute.make_layout((self.nwarps, 2 * (self.nb + 1)),
                                                                   stride=(2 * (self.nb + 1), 1)), 16)
            sRedB = smem.allocate_tensor(Float32, cute.make_layout((self.nwarps, 1), stride=(1, 1)), 16)
            sV = smem.allocate_tensor(BFloat16, cute.make_layout((self.nb + 1, cols), stride=(cols, 1)), 16)
            if cutlass.const_expr(self.cl > 1):
                sX = smem.allocate_tensor(Float32, cute.make_layout((self.cl, 2 * (self.nb + 1)),
                                                                    stride=(2 * (self.nb + 1), 1)), 16)
                sY = smem.allocate_tensor(Float32, cute.make_layout((self.cl, 1), stride=(1, 1)), 16)
                split = (cute.arch.block_idx()[0], sX, sY)
                # the cluster's start barrier (waited for before the first push into a peer's shared memory)
                cute.arch.cluster_arrive_relaxed()
            cute.arch.griddepcontrol_wait()
            if cutlass.const_expr(self.early_trigger):
                # the dependent's pre-wait work (a ring GEMV's weight chunks) runs on the SMs this grid leaves idle
                cute.arch.griddepcontrol_launch_dependents()
            _attnres_tokens(self, (m,), mBlocks, mP, mD, mPout, mU, mWln, cute.flat_divide(mX, (1, 8)), sV,
                            sRedA, sRedB, tid, warp, lane, True, split=split)
            if cutlass.const_expr(not self.early_trigger):
                cute.arch.griddepcontrol_launch_dependents()

    _AttnResNorm.prologue = staticmethod(_attnres_token)   # also run by rms_gemv_ring (v12) over its own CTA
    _AttnResNorm.prologue_tokens = staticmethod(_attnres_tokens)    # rms_gemv_ring v12.2's joint prologue
    return cutlass, cute, _FmaGemv, _MmaGemv, _AttnResNorm


_KERNELS = None


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _build_kernels()
    return _KERNELS


# ----------------------------------------------------------------------------- compile (fake tensors)

def _dt(name):
    cutlass, _ = import_cute()
    return {"bf16": cutlass.BFloat16, "fp32": cutlass.Float32}[name]


def _compile_fma(MB, rpc, ks, pin=False):
    def build():
        cutlass, cute, Fma, _, _ = _kernels()
        BF = cutlass.BFloat16
        N, K = cute.sym_int(divisibility=16), cute.sym_int(divisibility=16)
        x = fake_tensor(BF, (MB, K))
        w = fake_tensor(BF, (N, K))
        y = fake_tensor(BF, (MB, N), align=2)
        return cute.compile(Fma(MB, rpc, ks, FMA_WARPS, pin=pin), x, w, y, None, None, None, None, None, None,
                            cutlass.Int32(1), fake_stream(), options=TVM_FFI)
    return compile_cached(("rms_gemv.fma", MB, rpc, ks) + (("pin",) if pin else ()), build)


def _compile_mma(MB, rtw, rt, ks):
    def build():
        cutlass, cute, _, Mma, _ = _kernels()
        BF = cutlass.BFloat16
        M, N, K = cute.sym_int(), cute.sym_int(divisibility=16), cute.sym_int(divisibility=16)
        x = fake_tensor(BF, (M, K))
        w = fake_tensor(BF, (N, K))
        y = fake_tensor(BF, (M, N), align=2)
        return cute.compile(Mma(MB, rtw, rt, ks), x, w, y, fake_stream(), options=TVM_FFI)
    return compile_cached(("rms_gemv.mma", MB, rtw, rt, ks), build)


def _attn_fakes(cute, BF, M, K, has_delta, wln):
    blocks = fake_tensor(BF, (M, NB_MAX, K))
    p = fake_tensor(BF, (M, K))
    d = fake_tensor(BF, (M, K)) if has_delta else None
    po = fake_tensor(BF, (M, K))
    u = fake_tensor(_dt("fp32"), (K,))
    wl = fake_tensor(_dt(wln), (K,))
    return blocks, p, d, po, u, wl


def norm_compile_key(K, nb, has_delta, bw, wln, eps, early_trigger=False, cluster=1) -> tuple:
    return (("rms_gemv.norm", K, nb, has_delta, bw, wln, eps) + (("early",) if early_trigger else ())
            + ((f"cl{cluster}",) if cluster > 1 else ()))


def _compile_norm(K, nb, has_delta, bw, wln, eps, early_trigger=False, cluster=1, options=TVM_FFI):
    def build():
        cutlass, cute, _, _, Norm = _kernels()
        BF = cutlass.BFloat16
        M = cute.sym_int()
        blocks, p, d, po, u, wl = _attn_fakes(cute, BF, M, K, has_delta, wln)
        x = fake_tensor(BF, (M, K))
        return cute.compile(Norm(K, nb, has_delta, bw, eps, early_trigger, cluster), blocks, p, d, po, u, wl, x,
                            fake_stream(), options=options)
    if options != TVM_FFI:
        return build()
    return compile_cached(norm_compile_key(K, nb, has_delta, bw, wln, eps, early_trigger, cluster), build)


def _build_fused(MB, K, nb, has_delta, bw, wln, eps, rpc, ks, options=TVM_FFI, G=1, early_trigger=False, pin=False,
                 pf=1):
    cutlass, cute, Fma, _, _ = _kernels()
    BF = cutlass.BFloat16
    N = cute.sym_int(divisibility=16)
    blocks, p, d, po, u, wl = _attn_fakes(cute, BF, MB, K, has_delta, wln)
    w = fake_tensor(BF, (N, K))
    y = fake_tensor(BF, (MB, N), align=2)
    obj = Fma(MB, rpc, ks, FUSED_WARPS, fused=True, K=K, nb=nb, has_delta=has_delta, bw=bw, eps=eps, G=G,
              early_trigger=early_trigger, pin=pin, pf=pf)
    return cute.compile(obj, None, w, y, blocks, p, d, po, u, wl, cutlass.Int32(1), fake_stream(), options=options)


def _compile_fused(MB, K, nb, has_delta, bw, wln, eps, rpc, ks, G=1, early_trigger=False, pin=False, pf=1):
    key = (("rms_gemv.fused", MB, K, nb, has_delta, bw, wln, eps, rpc, ks) + ((G,) if G != 1 else ())
           + (("early_trigger",) if early_trigger else ()) + (("pin",) if pin else ())
           + ((("pf", pf),) if pf != 1 else ()))
    return compile_cached(key, lambda: _build_fused(MB, K, nb, has_delta, bw, wln, eps, rpc, ks, G=G,
                                                    early_trigger=early_trigger, pin=pin, pf=pf))


def fused_ptx(N: int, K: int = 7168, M: int = 1, n_blocks: int = 1, G: int = 1, early_trigger: bool = False,
              pin: bool = False, pf: int = 1) -> str:
    """PTX of the fused AttnRes + RMSNorm + GEMV kernel for an [N, K] weight at batch M (uncached; for reading,
    see k3fast.measure.ptxcheck and notebook 02)."""
    from ..measure.ptxcheck import compiled_ptx
    rpc, ks, _ = _fused_config(N, K)
    return compiled_ptx(lambda: _build_fused(M, K, n_blocks, True, -1, "bf16", 1e-5, rpc, ks,
                                             options=TVM_FFI + " --keep-ptx", G=G,
                                             early_trigger=early_trigger, pin=pin, pf=pf))


# ----------------------------------------------------------------------------- host entry points

def _check_2d(name, t, M, K, dev):
    import torch
    check_tensor(name, t, dtype=torch.bfloat16, shape=(M, K), device=dev)


def gemv(x, w, out=None, *, mma: str = "v2", pin_loads=None):
    """y[M, N] = x[M, K] @ w[N, K]^T (bf16 in/out, fp32 accumulate), M = 1..64, N and K multiples of 16.

    mma: the kernel for M > 4: "v2" (`_MmaGemv`, K split among a CTA's warps), "splitk" (k3fast.gemv_splitk:
    x staged in shared memory, K split across CTAs; opt-in, slower at b64 in its first H200 run (its version
    log); used only where gemv_splitk.applicable says so) or "cublas" (torch.mm at every M: where ours lose, see
    k3fast.layer.GEMV_DSL_MAX_M and INPROJ_DSL_MAX_M). pin_loads: the FMA path's v6 (None = PIN_LOADS)."""
    M, N, K, out = gemv_operands(x, w, out)
    if mma not in ("v2", "splitk", "cublas"):
        raise ValueError(f"mma must be 'v2', 'splitk' or 'cublas', got {mma!r}")
    MB = bucket_m(M)
    if mma == "cublas":
        import torch
        return torch.mm(x, w.t(), out=out)
    if MB <= 4:
        rpc, ks = _fma_config(N, K)
        pin = PIN_LOADS if pin_loads is None else bool(pin_loads)
        _compile_fma(MB, rpc, ks, pin)(x, w, out, None, None, None, None, None, None, N // rpc)
    elif mma == "splitk" and _splitk().applicable(N, K, M):
        _splitk().gemv_splitk(x, w, out=out)
    else:
        _compile_mma(MB, *_mma_config(N, K, MB))(x, w, out)
    return out


def _splitk():
    from . import gemv_splitk
    return gemv_splitk


def _check_attnres(blocks, n_blocks, partial, delta, u, w_ln, block_write, partial_out, fused):
    import torch
    check_tensor("partial", partial, dtype=torch.bfloat16)
    if partial.dim() != 2:
        raise ValueError(f"partial: expected [M, K], got {list(partial.shape)}")
    M, K = partial.shape
    dev = partial.device
    if not 1 <= M <= 64:
        raise ValueError(f"partial: M must be in 1..64, got {M}")
    if K % 8:
        raise ValueError(f"K={K} must be a multiple of 8")
    check_tensor("blocks", blocks, dtype=torch.bfloat16, shape=(M, NB_MAX, K), device=dev)
    if delta is not None:
        _check_2d("delta", delta, M, K, dev)
    check_tensor("u", u, dtype=torch.float32, shape=(K,), device=dev)
    if w_ln.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"w_ln: expected bfloat16 or float32, got {w_ln.dtype}")
    check_tensor("w_ln", w_ln, shape=(K,), device=dev)
    if not isinstance(n_blocks, int) or not 0 <= n_blocks <= NB_MAX:
        raise ValueError(f"n_blocks must be a Python int in 0..{NB_MAX}, got {n_blocks!r}")
    if not isinstance(block_write, int) or not -1 <= block_write < NB_MAX:
        raise ValueError(f"block_write must be an int in -1..{NB_MAX - 1}, got {block_write!r}")
    if block_write >= 0 and block_write < n_blocks:
        raise ValueError(f"block_write={block_write} would overwrite a mixed source (n_blocks={n_blocks})")
    if partial_out is None:
        partial_out = torch.empty_like(partial)
    else:
        _check_2d("partial_out", partial_out, M, K, dev)
        # attnres_rmsnorm: each thread reads p/delta before writing the same elements, so in place is
        # fine. Fused: every CTA reads p/delta while CTA 0 writes p', so aliasing would race.
        if fused:
            for name, t in (("partial", partial), ("delta", delta)):
                if t is not None and partial_out.data_ptr() == t.data_ptr():
                    raise ValueError(f"partial_out must not alias {name} in the fused kernel")
    return M, K, "bf16" if w_ln.dtype == torch.bfloat16 else "fp32", partial_out


def norm_cluster(M: int, min_m: int | None = None) -> int:
    """CTAs per token of attnres_rmsnorm at M tokens: NORM_CLUSTER from ``min_m`` (None = NORM_CLUSTER_MIN_M)."""
    return NORM_CLUSTER if M >= (NORM_CLUSTER_MIN_M if min_m is None else min_m) else 1


def attnres_rmsnorm(blocks, n_blocks, partial, delta, u, w_ln, *, eps=1e-5, block_write=-1, out=None,
                    partial_out=None, early_trigger=False, cluster=None):
    """x = bf16(RMSNorm_{w_ln}(AttnRes mix over {blocks[:, :n_blocks], p'})), p' = bf16(p + delta).

    Returns (x [M, K] bf16, partial_out); blocks[:, block_write] = p' when block_write >= 0.
    early_trigger: launch the PDL dependent right after the wait instead of at the end (for a dependent that reads
    none of this call's outputs before its own wait: rms_gemv_ring's tensor-core GEMV, v13).
    cluster: CTAs per token, 1, 2, 4 or 8 (None = norm_cluster(M)); above 1 each takes K / cluster of the columns
    and the statistics are summed over the cluster (v15; deterministic, not bit-identical to one CTA: its sums are
    split differently)."""
    import torch
    M, K, wln, partial_out = _check_attnres(blocks, n_blocks, partial, delta, u, w_ln, block_write, partial_out,
                                            False)
    cl = norm_cluster(M) if cluster is None else cluster
    if cl not in NORM_CLUSTERS or K // 8 < cl:
        raise ValueError(f"cluster must be one of {NORM_CLUSTERS} (CTAs per token, at most K / 8 = {K // 8}), "
                         f"got {cluster!r}")
    if out is None:
        out = torch.empty(M, K, dtype=torch.bfloat16, device=partial.device)
    else:
        _check_2d("out", out, M, K, partial.device)
    fn = _compile_norm(K, n_blocks, delta is not None, block_write, wln, float(eps), bool(early_trigger), cl)
    fn(blocks, partial, delta, partial_out, u, w_ln, out)
    return out, partial_out


def _check_groups(G) -> int:
    if G not in (1, 2):
        raise ValueError(f"fused_groups must be 1 or 2, got {G}")
    return G


def _check_prefetch(pf) -> int:
    if isinstance(pf, bool) or not isinstance(pf, int) or not 1 <= pf <= 4:
        raise ValueError(f"prefetch_groups must be an int in 1..4 (row groups in L2 prefetch ahead), got {pf!r}")
    return pf


def _fused_args(M, K, N, n_blocks, has_delta, block_write, wln, eps, fused_ks=None, fused_groups=None,
                early_trigger=False, pin_loads=None, prefetch_groups=None):
    """(the arguments of _compile_fused, grid) for the fused kernel these options run: one rule for the host entry
    and compile_keys, so warmup compiles exactly the builds the calls use."""
    rpc, ks, grid = _fused_config(N, K)
    if fused_ks is not None:            # benchmarks of the k-split choice (k3fast.measure.bench)
        if fused_ks not in (1, 2, 4, 8) or (K // 8) // fused_ks < 64:
            raise ValueError(f"fused_ks must be 1, 2, 4 or 8 with >= 64 vectors per slice, got {fused_ks}")
        rpc, ks = FUSED_WARPS // fused_ks, fused_ks
        groups = N // rpc
        grid = -(-groups // -(-groups // NUM_SMS))
    G = _check_groups(FUSED_GROUPS if fused_groups is None else fused_groups)
    if G == 2 and _vectors_per_lane(K, ks) > 8:
        G = 1                           # a slice of more than 8 vectors per lane: no one-batch groups to pair
    pin = (PIN_LOADS if pin_loads is None else bool(pin_loads)) and G == 1
    pf = _check_prefetch(PREFETCH_GROUPS if prefetch_groups is None else prefetch_groups) if G == 1 else 1
    return (M, K, n_blocks, bool(has_delta), block_write, wln, float(eps), rpc, ks, G, bool(early_trigger), pin,
            pf), grid


def attnres_rms_gemv(blocks, n_blocks, partial, delta, u, w_ln, w, *, eps=1e-5, block_write=-1, out=None,
                     partial_out=None, fuse_max_m=FUSE_MAX_M, fused_ks=None, mma="v2", fused_groups=None,
                     early_trigger=False, pin_loads=None, prefetch_groups=None, norm_cluster=None):
    """y = RMSNorm_{w_ln}(AttnRes mix) @ w^T, plus p' = bf16(p + delta) into partial_out (and blocks).

    fused_groups: row groups per loop iteration of the fused kernel (None = FUSED_GROUPS; 2 = v3, opt-in).
    early_trigger: the fused kernel launches its PDL dependents right after its wait (v5, opt-in), for a dependent
    whose pre-wait reads do not include this call's outputs (the KDA step).
    pin_loads: tie each batch of weight loads together (v6; None = PIN_LOADS, on by default; fused kernel, G = 1).
    prefetch_groups: row groups of each CTA in L2 prefetch ahead of its loads, all of them issued before the PDL
    wait (v7; None = PREFETCH_GROUPS = 1; fused kernel, G = 1; 1..4). Bit-identical: prefetches change no value.

    M <= fuse_max_m (<= 4): one launch (prologue recomputed in every CTA of a persistent grid); otherwise
    attnres_rmsnorm (its ``cluster`` = norm_cluster) + gemv (two PDL launches). x is rounded to bf16 before the dot
    in both paths."""
    import torch
    _check_prefetch(PREFETCH_GROUPS if prefetch_groups is None else prefetch_groups)
    fused = partial.dim() == 2 and partial.shape[0] <= min(fuse_max_m, 4)
    M, K, wln, partial_out = _check_attnres(blocks, n_blocks, partial, delta, u, w_ln, block_write, partial_out,
                                            fused)
    check_tensor("w", w, dtype=torch.bfloat16, device=partial.device)
    if w.dim() != 2 or w.shape[1] != K or w.shape[0] % 16 or w.shape[0] == 0:
        raise ValueError(f"w: expected [N (multiple of 16), {K}], got {list(w.shape)}")
    N = w.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=torch.bfloat16, device=partial.device)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(M, N), device=partial.device, align=2)
    if fused and K % 16 == 0:
        args, grid = _fused_args(M, K, N, n_blocks, delta is not None, block_write, wln, eps, fused_ks, fused_groups,
                                 early_trigger, pin_loads, prefetch_groups)
        _compile_fused(*args)(None, w, out, blocks, partial, delta, partial_out, u, w_ln, grid)
        return out, partial_out
    x, partial_out = attnres_rmsnorm(blocks, n_blocks, partial, delta, u, w_ln, eps=eps,
                                     block_write=block_write, partial_out=partial_out, cluster=norm_cluster)
    gemv(x, w, out=out, mma=mma, pin_loads=pin_loads)
    return out, partial_out


# ----------------------------------------------------------------------------- warm-up

def compile_keys(shapes, batches, *, attnres_K=None, attnres_N=(), n_blocks=range(NB_MAX + 1),
                 block_write=(-1, "n"), deltas=(False, True), wln="bf16", eps=1e-5, fuse_max_m=FUSE_MAX_M,
                 early_trigger=False):
    """Every (kind, config) a set of GEMV shapes [(N, K)] and batch sizes needs with the module's default options
    (PIN_LOADS, FUSED_GROUPS, PREFETCH_GROUPS); attnres_N lists the projection widths
    that run fused after AttnRes (K = attnres_K), with early_trigger as the caller passes it (the layer's in_proj:
    True). block_write "n" means = n_blocks."""
    keys = set()
    for (N, K) in shapes:
        for M in batches:
            MB = bucket_m(M)
            keys.add(("fma", MB) + _fma_config(N, K) + (PIN_LOADS,) if MB <= 4
                     else ("mma", MB) + _mma_config(N, K, MB))
    if attnres_K is not None:
        for nb in n_blocks:
            for bw in block_write:
                b = nb if bw == "n" else bw
                if b >= NB_MAX or (b >= 0 and b < nb):
                    continue
                for hd in deltas:
                    for cl in sorted({norm_cluster(M) for M in batches if M > min(fuse_max_m, 4)} | {1}):
                        keys.add(("norm", attnres_K, nb, hd, b, wln, float(eps)) + ((False, cl) if cl > 1 else ()))
                    for N in attnres_N:
                        for M in batches:
                            if M <= min(fuse_max_m, 4):
                                keys.add(("fused",) + _fused_args(M, attnres_K, N, nb, hd, b, wln, eps,
                                                                  early_trigger=early_trigger)[0])
    return sorted(keys, key=str)


def warmup(shapes, batches, **kw):
    """Compile every key compile_keys(...) returns (call before CUDA-graph capture)."""
    for key in compile_keys(shapes, batches, **kw):
        kind = key[0]
        if kind == "fma":
            _compile_fma(*key[1:])
        elif kind == "mma":
            _compile_mma(*key[1:])
        elif kind == "norm":
            _compile_norm(*key[1:])
        else:
            _compile_fused(*key[1:])
