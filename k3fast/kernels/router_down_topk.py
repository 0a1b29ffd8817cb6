"""MoE front of a Kimi K3 decode step: router logits + latent down-projection + top-16 routing, ONE launch.

Version log
  v1  One kernel, M-bucketed (1, 2, 4 FMA path; 8, 16, 32, 64 also FMA in v1/v1.1, tensor cores since v2).
      Warp per packed weight row, 128-bit weight loads (L1::no_allocate), the first PRE=4 vectors of each
      warp's row issued before griddepcontrol_wait; router CTAs come first in the grid and count their arrival
      on a device counter; the last T router arrivers (T = ceil(M/4)) each run the top-16 of 4 tokens (one
      warp per token) from the fp32 logits workspace. Registers (ptxas 4.8.1, sm_90a, remarks{ptx}):
      M=1: 80, 2: 93, 4: 116, 8: 128, 16: 162, 32: 198, no spills; M=64: 255 + 420 B spill stores (slow path
      anyway). Weight vectors in flight per lane: 4 (M <= 8), 2 (M=16), 1 (M >= 32).
      Expected: M=1 ~16-17 us (floor 14.9 us), M=2 ~17 us, M=4 ~22 us (FMA issue bound, 2.9 TB/s), M=8 ~40 us, M=16 ~90 us, M=64 ~350 us (FMA issue bound: the
      tensor-core swap-AB path for M > 4 is NOT in v1).
  v1.1 No kernel logic change. cutlass.memory.SmemAllocator (cutlass.utils one is deprecated); the per-token loops
      are cutlass.range(mb, unroll_full=True) (fully unrolled by the compiler, so acc stays in registers: no stack
      frame at M <= 32). Registers: 1: 80, 2: 93, 4: 116, 8: 128, 16: 158, 32: 198, no spills; M=64 STILL SPILLS:
      255 regs + 372 B spill stores / 400 B loads (v1: 420 B stores). Fix belongs to the mma path (M > 4), not
      here. H200 run e5c7220: 16/19 GPU tests passed; the 3 failures were the test's expected order (bias steps of
      0.33 < sigmoid spread), the kernel matched the (-(s + bias), index) reference in all of them.
  v2  M > 4 (buckets 8, 16, 32, 64) -> tensor-core path `FrontMma`: swap-AB mma.sync m16n8k16 bf16 -> fp32
      (weights = 16-row A tiles, tokens = 8-wide N tiles; fragment scheme and K permutation from
      k3fast/rms_gemv.py _MmaGemv). Warp = RTW 16-row tiles x one K slice, CTA = KS warps covering all of K
      of its RTW*16 rows; per-slice sums go through smem and are added in slice order (deterministic, no
      atomics); router rows store fp32 logits (unrounded), latent rows bf16 z. The first MMA_PF=8 k32 chunks
      of every warp are L2-prefetched before griddepcontrol_wait. Same arrival/top-k stage, KS tokens per
      top-k CTA. M <= 4 FMA path unchanged. Config (RTW, KS, unroll) and ptxas regs (remarks{ptx}, sm_90a,
      4.8.1), 0 spill bytes everywhere now: M=8 (1, 8, 2) 80 regs, 280 CTAs x 256 thr, 3 CTAs/SM fit (65536 /
      (256 x 80)) -> one wave; M=16 (1, 4, 4) 96 regs, 280 x 128, 5/SM; M=32 (2, 4, 4) 118 regs, 140 x 128,
      4/SM; M=64 (2, 4, 2) 190 regs, 140 x 128, 2/SM (264 slots >= 140: one wave). FMA keys: 1: 80, 2: 93,
      4: 116. (8 warps at M=16 took 116 regs -> 2 CTAs/SM = 264 slots < 280 CTAs: a second wave, so KS=4.)
      Measured (kernels-11595c4.json, floor 15.2 us at 4.22 TB/s): b1/b8/b64 32.1 / 41.9 / 66.3 us against the stock
      router + latent GEMMs + top-k 49.7 / 52.6 / 58.8 us (1.55x / 1.25x / 0.89x).  Correct (GPU tests 29/30; the
      one failure was a too-tight fp32-logits bound, since 1e-5).
  v2.1 (2026-11-29, CPU-compiled) FMA path at M <= 2: 8 weight vectors per lane in flight after the 4-vector
      prologue (was 4): 28 vectors per lane take 1 + 3 round trips instead of 1 + 6.  ptxas M=1: 96 registers
      (80 before), M=2: 114; 0 spills; 5 CTAs of 4 warps per SM instead of 6.  Predicted b1 31.4 -> ~24-27 us;
      the bench row router_down_topk@U4 times the old choice on the same inputs.
      Measured (kernels-e44cd14.json, one run): U = 8 33.9 us, U = 4 31.8 us.  PREDICTION MISSED, the other way:
      the extra 16 registers cost a CTA per SM (24 -> 20 warps), i.e. as many bytes in flight per SM as the
      deeper unroll adds, plus fewer warps to hide the FMA chains.  Reverted to U = 4; the loop keeps the
      prologue-offset form (identical indices at U = 4) and the `fma_unroll` argument for such A/Bs.
      Expected (floor 64.23 MB / 4.3 TB/s = 14.9 us; need ~4.3 TB/s x ~0.8 us = 3.4 MB in flight):
        M=8:  W in flight 2240 warps x 2 (unroll) x 1 KB = 4.6 MB -> DRAM bound; per k32 chunk a warp issues
              3 loads + 2 mma; top-k = 1 CTA x 8 tokens after the last router arrival (~1-2 us tail)
              -> ~16.5-17.5 us (1.1-1.2x).
        M=16: 1120 warps x 4 x 1 KB = 4.6 MB in flight; x re-read from L2 = 1x W bytes (64 MB); 4 top-k
              CTAs in parallel -> ~17-18 us (1.15-1.2x).
        M=64: 560 warps x 2 x 2 KB = 2.3 MB W in flight (below 3.4 MB: ~3-3.5 TB/s), x from L2 = 2x W
              (128 MB), MMA work 2 x 64 x 4480 x 7168 = 4.1 GFLOP (~7 us at ~600 TFLOPS mma.sync, overlapped)
              -> ~19-22 us (1.3-1.5x; was ~350 us in v1.1). M=32: ~17-18 us.
  v2.2 (2026-11-29, CPU-compiled only) FMA path occupancy: FMA_MIN_BLOCKS asks ptxas for 9 resident CTAs per SM at
      M = 1 (56 registers; the 20 B of spills sit in the top-k, not the main loop, per the SASS) and 7 at M = 2 (72
      registers, no spills), with the largest shared-memory carveout so that 9 x 14.4 KB of sS fit. M = 1 was 1.41
      waves of 3168 resident warps over 4480 warp-rows: the last 1312 rows streamed with a third of the loads in
      flight while most SMs idled. Prediction: b1 30.7 -> ~20-23 us in the layer (kernel bench 33.3 -> ~22-25);
      the bench row router_down_topk@minb0 times the old occupancy on the same inputs.
      Measured (kernels-50b6243.json): 39.3 us with the hint against 33.2 us without (router_down_topk@minb0); in the
      layer the stage went 30.7 -> 37.5 us (records-50b6243-rotperf.json). PREDICTION MISSED, the other way.
  v2.3 (2026-11-29, session 5) No hint (FMA_MIN_BLOCKS = {}; the A/B row is router_down_topk@minb9). New:
      TopkFromLogits, the top-k stage alone over a library GEMM's fp32 output y = x [W_r; W_down (; W_sg; W_su)]^T,
      one CTA per token; warp 0 runs this kernel's own top-k code, so ties and weights match it exactly. It serves
      the cuBLAS front (router_down_topk_cublas, FastImpl above FRONT_DSL_MAX_M) in place of route_from_logits'
      ~12 torch kernels, and with the shared experts' gate/up rows in the same GEMM it also writes their SiTU
      output h (one launch fewer). Measured (records-cd4a730-s5perf.json, rank16): MoE half b64 453.5 -> 398.1 us
      (without the shared fold: 420.9); kernels per replay 23 -> 10. But TopkFromLogits itself takes 15.7-17.5 us
      at every M (~3-5 expected), and the cuBLAS front at M = 1 (GEMM + top-k) 39.7 us against this kernel's 31.7.
  v2.4 (2026-11-29, CPU-compiled only; opt-in: TOPK_ROLLED / rolled=True / impl "fast-rolled") The top-k's 16
      selection rounds as a dynamic loop over a register tensor of keys instead of unrolled code. Why: the
      unrolled top-k is most of each kernel's SASS (ptxas 12.9, sm_90a): TopkFromLogits 3648 instructions = 57 KB,
      the FMA front at M = 1 4040 = 63 KB, the mma front at M = 8 3864 = 60 KB. One warp per token runs it once,
      from an instruction cache that the replay's L2 flush leaves cold, and a constant ~16 us at every M looks like
      instruction fetch, not arithmetic (16 rounds x ~200 dependent cycles is ~2 us). Rolled: 1640 / 1680 / 1568
      instructions (25-26 KB), registers 95 -> 72 / 80 -> 56 / 80 -> 48, no local memory, no spills. At 56
      registers the M = 1 grid fits 9 CTAs per SM without v2.2's cap. Predictions: TopkFromLogits 16 -> ~5-7 us;
      the fused front at b1 30.1 -> ~20-24 us in the layer; MoE half b1 80.4 -> ~70-74, b8 125 -> ~115, b64 398 ->
      ~388. If TopkFromLogits stays near 16 us the fetch hypothesis is wrong and the next suspect is the 28 cold
      global loads of e_bias plus the logits per lane (ld.cg from L2 after the GEMM). Bench rows:
      router_down_topk@rolled, router_down_topk_cublas+shared@rolled; GPU tests: every router test runs both ways,
      and test_rolled_matches_unrolled_bitwise.
      Measured (kernels-31884ea.json, records-31884ea-s6perf.json): the hypothesis is wrong. TopkFromLogits alone
      at b1: 21.3 us flushed, 14.1 us with the L2 warm; rolled 21.9 / 14.4. The fused front at b1 got slower
      rolled (33.6 -> 37.2 us bench, MoE half 80.5 -> 84.0 us). Stays opt-in.
  v2.5 (2026-11-29, session 6) The top-k loads all 28 logits and 28 biases per lane before the first sigmoid. The
      SASS of every top-k (ptxas 12.9) showed the real cause: each logit's ld.global.cg sat behind the previous
      logit's IEEE-division slow-path branch (div.rn.f32: MUFU.RCP, a range check, a CALL), and ptxas does not
      hoist a load over a branch, so the 28 loads ran one L2 round trip at a time: 28 x ~0.5 us = the ~14 us warm
      figure. v2.5 changes only the order (the arithmetic and the tie rule are the same, so results are bit-identical
      to v2.3); the CPU test test_topk_loads_issue_before_the_first_sigmoid checks it in the PTX of both forms and
      of all buckets. Predictions: TopkFromLogits alone 21.3 -> ~7-9 us flushed, 14.1 -> ~3-4 us warm; in the
      layer 15.7-17.5 -> ~4-5 us; the fused front's top-k stage (same code, last arriver) drops by about the same
      ~10 us, so router_down_topk b1 33.6 -> ~22-24 us (bench) and the MoE half b1 80.5 -> ~69-71 us, b64 (cuBLAS
      front + TopkFromLogits) 398.9 -> ~388 us.
      Measured (records-1214f05-s7perf.json, kernels-1214f05.json): router_down_topk b1 33.6 -> 23.6 us (bench);
      MoE half b1 80.5 -> 69.9 us, b64 398.9 -> 390.3; TopkFromLogits alone 21.3 -> 13.1 us flushed, 14.1 -> 10.4
      warm (predicted ~7-9 / ~3-4: missed). Its SASS then showed the z copy as load, store, load, store: each
      store waits for its load, and ptxas does not hoist the next load over a store to memory it cannot prove
      disjoint (7 round trips per thread). TopkFromLogits now loads all of a thread's z vectors right after the
      wait, before warp 0's top-k, and stores them after (the CPU test checks the order). Prediction:
      TopkFromLogits in the layer (flushed timeline, records-c90da94-kdaall.json: 8.4-8.8 us) -> ~5-6 us, i.e.
      the MoE half at b8 / b64 -3 us.
      Measured (records-001a431-s8.json, kernels-001a431.json): TopkFromLogits alone 13.1 -> 10.5 us flushed,
      10.4 -> 9.4 warm; in the layer 8.4 / 8.8 -> 7.4 / 8.0 us at b8 / b64; MoE half b8 115.6 -> 115.1, b64 390.0 ->
      389.2 (predicted -3: about a third of it). What is left at ~9 us warm for one CTA per token is the 28
      divisions' slow-path branches in series and the 16 selection rounds; not analysed further yet.
  v2.6 (2026-11-29, session 6; measured slower, then removed: the record below is what ran at 1214f05) On
      the FMA path (M <= 4), lane 0 of each warp requests its whole weight row (14 KB) into L2 with one
      cp.async.bulk.prefetch before the PDL wait. The register loads keep PRE + U vectors per lane in flight, and
      the kernel streams at ~1.9 TB/s (bench b1 33.6 us for 64 MB). The bulk request keeps the HBM busy
      independently of the registers, at least for the ~1 wave of CTAs that is resident. Bit-identical outputs
      (GPU test test_bulk_l2_matches_default_bitwise). Prediction: the GEMV part of the b1 front (v2.5 bench minus
      its ~4 us top-k) 30 -> ~20-22 us, i.e. the bench row router_down_topk@pf ~6-9 us below router_down_topk.
      Also measured by fast-frontpf and fast-pf, the layer A/B.
      Measured (kernels-1214f05.json, records-1214f05-s7perf.json): slower. Bench b1 29.3 against 23.6 us; MoE
      half b1 75.8 against 69.9. Removed after the session's review.
  v2.7 (2026-11-29, session 7; the default in FastImpl at M <= 4, A/B "fast-s9front") The FMA front also computes
      the shared experts' gate/up + SiTU in the same pass over x (shared=Is, router_down_topk returns h as a fourth
      output). Its grid grows by 2 Is / 4 CTAs after the latent ones; shared CTA c reads gate and up rows of h
      columns 2c and 2c + 1 from the cuBLAS front's packing [W_r; W_down; W_sg; W_su] (so FastImpl keeps one packed
      weight and the front without the fold reads its first rows), and the pairs meet in shared memory. Why: in the
      rank16 b1 timeline (records-001a431-s8.json) the separate gate/up kernel ended 7.7 us after the router and the
      experts, which wait for it, started only then; its 11 MB streamed at ~1 TB/s. The router and latent rows run
      unchanged code (bit-identical to v2.5: GPU test test_fused_front_with_shared_matches); h rounds a and c to
      bf16 as the separate kernel does, from a different fp32 sum order. ptxas 12.9 at M 1: 80 registers with and
      without the fold, no spills, 4088 SASS instructions against 3992 (traces/cpu/ptxcheck-c8b0b167e9a4.json).
      Prediction: the front's bench row at b1 23.6 -> ~25-27 us
      (router_down_topk+shared; +11 MB); MoE half b1 70.3 -> ~66-68 us in 3 launches instead of 4 (the experts
      start ~2-4 us earlier), and the same at b2-4; b8 / b64 unchanged (the cuBLAS front already folds it).
      Measured (records-9ac30a0-s10perf.json, kernels-9ac30a0.json, one run; GPU tests passed,
      logs/gpu-junit-9ac30a0-s10tests.xml): MoE half b1 69.9 -> 63.6 us (fast-s9front -> fast), b4 93.3 -> 86.9, in
      3 launches; b8 / b64 unchanged; the front's bench b1 23.1 -> 24.4 us (+shared). Beaten: the front still
      ends at 20.3 us in the layer, because the shared rows stream while the last router CTA runs the top-k, and
      the experts start at 19.4 instead of 26.3 us.
  v2.8 (2026-11-29, session 7; TOPK_SPLIT, the default since session 8; "fast-s12" is the A/B without it)
      TopkFromLogits' top-k over the CTA's 4 warps (topk_split). Why: one warp ran the 16 selection rounds over 28
      keys per lane while the other 3 warps only copied z. TopkFromLogits alone still took 10.5 us flushed and 9.4
      warm at b1 (kernels-001a431.json), and 7.4-8.0 us in the layer at b8 / b64 (records-001a431-s8.json), after
      v2.5 removed the serial loads. Each round is a dependent chain: a 28-key compare tree, two warp reductions and
      28 selects, ~150 instructions, so 16 rounds are ~2400. Now each warp ranks its 224 experts (7 keys per lane)
      and keeps its top-16 in shared memory, and warp 0 merges the 64 candidates (2 per lane). That is 16 rounds of
      ~40 and 16 of ~20 instructions, and 7 sigmoids per thread instead of 28. The global top-16 is inside the
      union of the per-warp top-16s under the same order (larger key, then lower expert), and the merge keeps that
      order: slot 0 of a lane holds the lower experts, and the max / umin reductions are as before. So the outputs
      are bit-identical to v2.5 (GPU test test_split_topk_matches_bitwise, random logits and exact ties across
      warps). ptxas 12.9: 76 registers against 96, 1680 SASS instructions against 3952, no spills
      (traces/cpu/ptxcheck-d0088ed0d49f.json). Only TopkFromLogits, i.e. M > 4. The fused front's top-k runs in
      its last CTAs and is hidden behind the down/shared streaming at b1 (the front ends at 20.3 us either way).
      Prediction: TopkFromLogits alone at b1 10.5 -> ~5-6 us flushed (9.4 -> ~4 warm); in the layer 7.4 / 8.0 ->
      ~4 us at b8 / b64, so the MoE half b8 113.8 -> ~110-111 us and b64 389.6 -> ~386. Bench rows
      topk_from_logits@split (and ~warm), router_down_topk_cublas+shared@split; layer A/B fast-topk4.
      Measured (records-5d32223-s12.json, kernels-5d32223-s12.json, one run; GPU tests 80 passed, 0 failed,
      logs/gpu-junit-5d32223-s12.xml, with the bitwise test against the unsplit kernel): TopkFromLogits alone
      b1 11.0 -> 8.6 us flushed (9.6 -> 7.5 warm), b8 11.3 -> 8.8, b64 11.8 -> 9.3; the cuBLAS front + top-k
      31.2 -> 29.6 us at b1, 31.6 -> 29.2 at b8, 34.7 -> 31.9 at b64. MoE half b8 114.5 -> 111.9 us, b64 388.0 ->
      385.9 (fast -> fast-topk4, same run), b1 63.5 / 63.3 (the same kernels). The layer prediction (-3 to -4 us)
      is nearly met (-2.6 / -2.1); the kernel one (5-6 us) is missed: the selection rounds were ~2.4 us of it.
      The ~7.5 us warm that remain are not the top-k's arithmetic (1680 SASS instructions over 4 warps is
      well under 1 us at 1.7 GHz); they are the launch and the serial dependency of the CTA's phases (logit load
      -> rank -> merge -> z copy / h epilogue), not analysed further. The default since session 8.      Numerics: tensor-core fp32 accumulation within one m16n8k16 differs from cuBLAS/FMA order by ~1 ulp;
      identical weight rows still give bit-identical logits (same lanes/k order for every row).

What it replaces (k3-spec.md sections 10 and 11):
  l   = x W_r^T                (fp32; bf16 products, fp32 accumulate, never rounded)        section 10.1
  s   = sigmoid(l)             (fp32)                                                        section 10.2
  T   = top-16(s + e_bias)     (ties: the LOWER expert index wins; output order = descending
                                biased score, ties by ascending index)                       section 10.3
  w_e = s_e / (sum_T s + 1e-20) * routed_scaling_factor                                      section 10.4
  z   = bf16(x W_down^T)       (latent down-projection, plain Linear)                       section 11
  Both GEMVs read the same x, so W_r and W_down are packed once into W = [W_r; W_down] ([4480, 7168] bf16,
  router rows first: `prepare_front_weight`), and one pass over W produces both (vllm-k3-decode.md B row 10).

Bytes and floor (4.3 TB/s measured H200 copy bandwidth). The router and W_down are REPLICATED on every TP rank
(k3-spec.md section 13.1), so the per-rank bytes are the same at k3_rank(16), k3_rank(8) and full width (TP1):
  W: 4480 x 7168 x 2 B = 64.23 MB  -> 14.9 us.   x (M x 14 KB), z (M x 7 KB), logits (M x 3.5 KB) are < 2 MB
  even at M = 64 (+0.4 us).  Targets: M=1 within 1.15x (17.1 us); M <= 64 within 1.3x (the v2 mma path).

Contracts
  * The top-k needs all 896 logits of a token, which are spread over 224 router CTAs. Each router CTA writes
    its logits to an fp32 workspace, fences, then does an acq_rel atomic add on a device counter. The CTA whose
    add returns R-1 (the last arriver) resets the counter to 0 (so CUDA-graph replays and the next layer start
    clean) and bumps an epoch word with a release store; the T-1 arrivers just before it spin (acquire) on the
    epoch. These T CTAs then read the logits (ld.global.cg) and each run the top-16 for 4 tokens (FMA path;
    mma path: KS tokens, one per warp, R = 896 / (16 RTW)). Spinning is deadlock-free: at most T-1 <= 15 CTAs
    spin, every other CTA can always be scheduled (and every mma grid fits in one wave).
  * All counter/workspace accesses come after griddepcontrol_wait, so a PDL-overlapped next launch of this
    kernel (the next layer) cannot see a half-reset counter.
  * The workspace and counter are per device and shared by all calls: at most ONE call may be in flight per
    device at a time (the decode step is one stream). Pass ``workspace=`` to use a private one.
  * Router CTAs are the lowest block indices, so they are scheduled first and (when the grid exceeds one wave)
    the top-k overlaps the down-projection streaming of the remaining CTAs.
"""


import math

from k3fast.kernels._dsl import (TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, import_cute, sigmoid, situ_glu,
                         swapab_a_fragment, swapab_c_fragment_to, weight_load_atom)

HIDDEN = 7168
N_EXPERTS = 896
LATENT = 3584
TOP_K = 16
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
M_MAX = 64
WARPS = 4          # warps per CTA = rows per CTA = tokens per top-k CTA
PRE = 4            # 16-byte weight vectors per lane issued before griddepcontrol_wait
UNROLL = 4


# FMA path: resident CTAs per SM asked of ptxas (0 = no hint). v2.2 asked for 9 at M = 1 (56 registers) and 7 at
# M = 2 so that the M = 1 grid ran as one wave instead of 1.41; measured slower (kernels-50b6243.json: 39.3 us with
# the hint against 33.2 without; in the layer the stage went 30.7 -> 37.5 us), so no bucket asks for it now. The
# mechanism stays for the A/B (bench row router_down_topk@minb9); the version log has the analysis.
FMA_MIN_BLOCKS: dict = {}
# v2.4 (opt-in; measured no faster, see the version log): the top-k's 16 selection rounds as a loop, not unrolled
# code; the compile key carries it. k3fast.layer's router_rolled / impl "fast-rolled" flip it.
TOPK_ROLLED = False
# v2.8 (the default since session 8; impl "fast-s12" is the A/B without it): TopkFromLogits' top-k over its 4 warps
# (a top-16 of each warp's 224 experts, then warp 0 merges the 64 candidates); the version log says why and what it
# measured. The compile key carries it.
TOPK_SPLIT = True
FMA_MIN_BLOCKS_TRIED = {1: 9, 2: 7}


def fma_min_blocks(mb: int) -> int:
    return FMA_MIN_BLOCKS.get(mb, 0)


def fma_unroll(mb: int) -> int:
    """16-byte weight vectors per lane in flight in the FMA path (after the PRE issued before the PDL wait); fewer
    where M x accumulator registers grow.  8 at M <= 2 was tried and measured slower (version log, v2.1)."""
    return UNROLL if mb <= 8 else (2 if mb <= 16 else 1)

# tensor-core path (M > 4): bucket -> (16-row tiles per warp RTW, k-slices KS = warps per CTA, k-loop unroll)
MMA_CONFIG = {8: (1, 8, 2), 16: (1, 4, 4), 32: (2, 4, 4), 64: (2, 4, 2)}
MMA_PF = 8         # k32 chunks per warp prefetched into L2 before griddepcontrol_wait

# ptxas report for the CPU compile (CUTE_DSL_COMPILER_OPT="remarks{ptx}", sm_90a): bucket -> (regs, spill bytes)
# (v2.2 tried M = 1 and 2 under register caps: 56 registers + 20 B of top-k spills and 72, ptxas 12.9,
# traces/cpu/ptxcheck-1202b4ba7c81.json; v2.3 is back to no cap)
REGISTER_LOG = {1: (80, 0), 2: (93, 0), 4: (116, 0), 8: (80, 0), 16: (96, 0), 32: (118, 0), 64: (190, 0)}

_WORKSPACES: dict = {}


def bucket_m(m: int) -> int:
    if m < 1:
        raise ValueError(f"router_down_topk supports 1 <= M <= {M_MAX}, got M={m}")
    for b in M_BUCKETS:
        if m <= b:
            return b
    raise ValueError(f"router_down_topk supports 1 <= M <= {M_MAX}, got M={m}")


def kernel_path(m: int) -> str:
    """"mma" (tensor-core swap-AB, buckets 8..64) or "fma" (warp-per-row, buckets 1..4) for batch m."""
    return "mma" if bucket_m(m) in MMA_CONFIG else "fma"


def compile_keys(batches=(1, 2, 3, 4, 7, 8, 16, 64), *, n_experts=N_EXPERTS, latent=LATENT, hidden=HIDDEN,
                 top_k=TOP_K):
    return sorted({("router_down_topk", bucket_m(b), n_experts, latent, hidden, top_k) for b in batches})


def _check_shapes(n_experts, latent, hidden, top_k, mb=1):
    if n_experts % 32 or n_experts % WARPS:
        raise ValueError(f"n_experts must be a multiple of 32, got {n_experts}")
    if not (1 <= top_k <= 32 and top_k <= n_experts):
        raise ValueError(f"top_k must lie in [1, min(32, n_experts)], got {top_k}")
    if latent % WARPS:
        raise ValueError(f"latent width must be a multiple of {WARPS}, got {latent}")
    if hidden % (8 * 32 * UNROLL) or hidden // 256 < PRE:
        raise ValueError(f"hidden size must be a multiple of {8 * 32 * UNROLL}, got {hidden}")
    if mb in MMA_CONFIG:
        rtw, ks, _ = MMA_CONFIG[mb]
        if n_experts % (16 * rtw) or latent % (16 * rtw) or (hidden // 32) % ks:
            raise ValueError(f"M bucket {mb}: n_experts and latent must be multiples of {16 * rtw} and "
                             f"hidden/32 a multiple of {ks}, got {n_experts}, {latent}, {hidden}")


def _occupancy_hint(min_blocks: int) -> dict:
    """Launch options asking ptxas for ``min_blocks`` resident CTAs per SM (nvvm.minctasm, i.e. a register cap of
    65536 / (min_blocks * threads)) and the largest shared-memory carveout, so that the CTAs' shared memory fits
    too (the carveout is given explicitly: without it the DSL asks the driver for the SM's shared memory at
    compile time, which the CPU compile cannot)."""
    return {} if not min_blocks else {"min_blocks_per_mp": min_blocks, "preferred_smem_carveout": 100}


def _build(mb: int, n_experts: int, latent: int, hidden: int, top_k: int, unroll: int, min_blocks: int = 0,
           shared: int = 0, rolled: bool = False, split: bool = False):
    """Trace and compile one M bucket (called through compile_cached)."""
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32, Uint32, const_expr

    NE, NL, K, TOPK = n_experts, latent, hidden, top_k
    N = NE + NL
    KV = K // 8                      # 16-byte vectors per row
    ITERS = KV // 32                 # per lane
    J = NE // 32                     # logits per lane in the top-k
    R = NE // WARPS                  # router CTAs
    T = (max(mb, 1) + WARPS - 1) // WARPS    # top-k CTAs (the last T router arrivers)
    U = unroll
    MINB = min_blocks
    # shared experts' intermediate width folded into the same pass over x: TopkFromLogits' GEMM columns (mb = 0), or
    # the FMA front's last 2 IS / WARPS CTAs (v2.7, mb <= 4)
    IS = shared
    S0 = N // WARPS                  # FMA front: the first shared gate/up CTA
    NZ = -(-(NL // 4) // (32 * WARPS))   # TopkFromLogits: z vectors per thread
    ROLLED = rolled                  # v2.4 opt-in: the top-k selection rounds as a loop (see topk)
    SPLIT = split                    # v2.8 opt-in, TopkFromLogits only: the top-k over its 4 warps (topk_split)
    assert not (SPLIT and (mb != 0 or ROLLED)), "the split top-k is a TopkFromLogits (mb 0), unrolled build"
    assert not SPLIT or NE % (32 * WARPS) == 0
    assert (ITERS - PRE) % U == 0, f"unroll {U} must divide the {ITERS - PRE} vectors per lane after the prologue"
    assert T <= R
    assert not (IS and mb in MMA_CONFIG), "the shared gate/up fold is built for TopkFromLogits and the FMA front"
    assert IS % 2 == 0
    if mb in MMA_CONFIG:
        RTW, KS, UM = MMA_CONFIG[mb]
        NT = mb // 8                       # 8-token N tiles
        CH = (K // 32) // KS               # k32 chunks per warp
        PF = min(MMA_PF, CH)
        RM = NE // (16 * RTW)              # router CTAs (the lowest block indices)
        TM = (mb + KS - 1) // KS           # top-k CTAs, KS tokens each
        assert TM <= RM and NE % (16 * RTW) == 0 and NL % (16 * RTW) == 0 and (K // 32) % KS == 0

    def orderable(v):
        # fp32 -> u32 whose unsigned order is the float order (-0 never occurs: s > 0 or s = +0, and x + -x = +0)
        u = v.bitcast(Uint32)
        neg = Uint32(0) - (u >> Uint32(31))
        return u ^ (neg | Uint32(0x80000000))

    def usel(c, a, b):
        return Uint32(cutlass.select_(c, a, b))

    def fsel(c, a, b):
        return Float32(cutlass.select_(c, a, b))

    def local_best(keys):
        # this lane's best (largest key, lowest slot on ties): a tree whose left operand is always the lower
        # slot, so ">" keeps the lower expert index on equal keys. Plain Python: unrolled at trace time.
        cur = [(keys[j], Uint32(j)) for j in range(len(keys))]
        while len(cur) > 1:
            nxt = []
            for p in range(0, len(cur) - 1, 2):
                (ka, ja), (kb, jb) = cur[p], cur[p + 1]
                take_b = kb > ka
                nxt.append((usel(take_b, kb, ka), usel(take_b, jb, ja)))
            if len(cur) % 2:
                nxt.append(cur[-1])
            cur = nxt
        return cur[0]

    def remove(keys, gidx, first):
        # the owner lane of expert gidx drops its key (0 is below every real key); the lane's key j belongs to
        # expert first + 32 j
        for j in range(len(keys)):
            keys[j] = usel(gidx == first + Uint32(32 * j), Uint32(0), keys[j])

    def warp_best(bk, expert):
        """(largest key of the warp, the lowest expert index among the lanes holding it), from each lane's best key
        and its expert."""
        gmax = cute.arch.warp_redux_sync(bk, "umax")
        return gmax, cute.arch.warp_redux_sync(usel(bk == gmax, expert, Uint32(0xFFFFFFFF)), "umin")

    def biased_keys(mWs, mBias, row, first, n, sS, col):
        """The n keys orderable(s + e_bias) of this lane's experts first + 32 j, from the fp32 logits at mWs[row + e];
        s = sigmoid(logit) goes to sS[e, col]. v2.5: every logit and bias is loaded before the first sigmoid.
        Interleaved (v2.4 and earlier), each IEEE division's slow-path branch kept ptxas from hoisting the next load
        above it, so the 28 loads ran as 28 serial L2 round trips (~14 us with the L2 warm, kernels-31884ea.json);
        a CPU test checks the order in the PTX."""
        lgs = [cute.arch.load(mWs.iterator + (row + first + 32 * j), Float32, cop="cg") for j in range(n)]
        bs = [mBias[first + 32 * j] for j in range(n)]
        keys = []
        for j in range(n):
            s = sigmoid(lgs[j])
            sS[first + 32 * j, col] = s
            keys.append(orderable(s + bs[j]))
        return keys

    def select_round(keys, r, lane, lane_u, sS, warp, my_id, my_s):
        """One of the top-k's TOPK rounds: the warp's best remaining key (largest; the lowest expert index among
        equal keys), removed from its owner lane's keys (in place); lane r keeps its expert id and unbiased score."""
        bk, bj = local_best(keys)
        _, gidx = warp_best(bk, lane_u + Uint32(32) * bj)
        remove(keys, gidx, lane_u)
        s_sel = sS[Int32(gidx), warp]          # written by the owner lane of this warp
        mine = lane == r
        return usel(mine, gidx, my_id), fsel(mine, s_sel, my_s)

    class FrontFma:
        n_arrive, n_topk, per_cta = R, T, WARPS      # router CTAs, top-k CTAs, tokens per top-k CTA
        ws_stride = NE                               # fp32 elements between two tokens' logits in mWs

        @cute.jit
        def __call__(self, mX, mW, mBias, mZ, mIds, mWt, mWs, mCnt, mH, scaling: Float32, stream):
            w_atom = weight_load_atom(BFloat16)
            self.kernel(mX, mW, mBias, mZ, mIds, mWt, mWs, mCnt, mH, scaling, w_atom).launch(
                grid=[(N + 2 * IS) // WARPS, 1, 1], block=[32 * WARPS, 1, 1], stream=stream, use_pdl=True,
                **_occupancy_hint(MINB))

        @cute.kernel
        def kernel(self, mX, mW, mBias, mZ, mIds, mWt, mWs, mCnt, mH, scaling: Float32, w_atom: cute.CopyAtom):
            tid = cute.arch.thread_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bid = cute.arch.block_idx()[0]
            n = bid * WARPS + warp
            if const_expr(IS > 0):
                # v2.7: shared CTA c computes h columns 2c and 2c + 1. Its warps 2p and 2p + 1 take the gate and the
                # up row of column 2c + p, so the SiTU pairs meet in this CTA's shared memory. The rows are read
                # from [W_r; W_down; W_sg; W_su] (prepare_front_shared_weight, the cuBLAS front's packing).
                n = Int32(cutlass.select_(bid >= S0, N + (warp % 2) * IS + 2 * (bid - S0) + warp // 2, n))
            M = cute.size(mX, mode=[0])

            smem = cutlass.memory.SmemAllocator()
            sArr = smem.allocate_tensor(Int32, cute.make_layout((2,)), 16)
            # sigmoid scores of the top-k CTA's tokens (keeps 28 fp32 per lane out of the register file)
            sS = smem.allocate_tensor(Float32, cute.make_layout((NE, WARPS)), 16)
            if const_expr(IS > 0):
                sG = smem.allocate_tensor(Float32, cute.make_layout((WARPS, mb), stride=(mb, 1)), 16)

            gW = cute.flat_divide(mW, (1, 8))           # (1, 8, N, KV)
            gX = cute.flat_divide(mX, (1, 8))           # (1, 8, M, KV)
            rW = cute.make_rmem_tensor(cute.make_layout((PRE, 8), stride=(8, 1)), BFloat16)
            rV = cute.make_rmem_tensor(cute.make_layout((U, 8), stride=(8, 1)), BFloat16)
            rX = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
            acc = cute.make_rmem_tensor(cute.make_layout((mb,)), Float32)
            acc.fill(0.0)

            # Weights do not depend on the previous kernel: start streaming them before the PDL wait.
            for i in cutlass.range_constexpr(PRE):
                cute.copy(w_atom, gW[0, None, n, lane + 32 * i], rW[i, None])
            cute.arch.griddepcontrol_wait()

            for i in cutlass.range_constexpr(PRE):
                w = rW[i, None].load().to(Float32)
                for m in cutlass.range(mb, unroll_full=True):
                    # rows m >= M read the last valid row (never stored): no branch, no out-of-bounds load
                    mm = cutlass.min(Int32(m), M - 1)
                    cute.autovec_copy(gX[0, None, mm, lane + 32 * i], rX)
                    acc[m] += (rX.load().to(Float32) * w).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            for it in cutlass.range(0, (ITERS - PRE) // U, 1):
                for u in cutlass.range_constexpr(U):
                    cute.copy(w_atom, gW[0, None, n, lane + 32 * (PRE + it * U + u)], rV[u, None])
                for u in cutlass.range_constexpr(U):
                    w = rV[u, None].load().to(Float32)
                    for m in cutlass.range(mb, unroll_full=True):
                        mm = cutlass.min(Int32(m), M - 1)
                        cute.autovec_copy(gX[0, None, mm, lane + 32 * (PRE + it * U + u)], rX)
                        acc[m] += (rX.load().to(Float32) * w).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)

            is_router = bid < R
            for m in cutlass.range(mb, unroll_full=True):
                tot = cute.arch.warp_reduction_sum(acc[m])
                if lane == 0:
                    if Int32(m) < M:
                        if is_router:
                            mWs[m, n] = tot
                        else:
                            if const_expr(IS > 0):
                                if bid >= S0:
                                    sG[warp, m] = tot
                                else:
                                    mZ[m, n - NE] = tot.to(BFloat16)
                            else:
                                mZ[m, n - NE] = tot.to(BFloat16)

            if is_router:
                self.arrive_then_topk(tid, warp, lane, M, mCnt, sArr, mBias, mIds, mWt, mWs, sS, scaling)
            if const_expr(IS > 0):
                if bid >= S0:
                    self.shared_situ(tid, bid, M, sG, mH)
            cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def shared_situ(self, tid, bid, M, sG, mH):
            """v2.7, shared CTAs: h = bf16(SiTU-GLU(bf16(a), bf16(c))) for the CTA's two columns and every token, the
            expression of TopkFromLogits and moe_tail's gate/up kernel (a and c rounded as a bf16 Linear would)."""
            cute.arch.sync_threads()                    # sG is written by lane 0 of each warp
            if tid < 2 * mb:
                p = tid // mb
                m = tid - p * mb
                if m < M:
                    a = sG[2 * p, m].to(BFloat16).to(Float32)
                    c = sG[2 * p + 1, m].to(BFloat16).to(Float32)
                    mH[m, 2 * (bid - S0) + p] = situ_glu(a, c).to(BFloat16)

        @cute.jit
        def arrive_then_topk(self, tid, warp, lane, M, mCnt, sArr, mBias, mIds, mWt, mWs, sS, scaling: Float32):
            """Router CTAs only: count this CTA's arrival; the last ``n_topk`` arrivers (the last one after
            resetting the counter for the next launch / graph replay) each run the top-16 of ``per_cta``
            tokens, one per warp. The spinners wait only on CTAs that already arrived: no deadlock."""
            NA, NT_, PC = self.n_arrive, self.n_topk, self.per_cta
            # Make this CTA's logits visible at GPU scope before its arrival is counted.
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tid == 0:
                cnt_ptr = mCnt.iterator
                ep_ptr = mCnt.iterator + 1
                e0 = cute.arch.load(ep_ptr, Int32, sem="relaxed", scope="gpu")
                old = cute.arch.atomic_add(cnt_ptr, Int32(1), sem="acq_rel", scope="gpu")
                if old == NA - 1:
                    # last arriver: reset for the next launch / graph replay, then release the spinners
                    cute.arch.store(cnt_ptr, Int32(0), sem="relaxed", scope="gpu")
                    cute.arch.store(ep_ptr, e0 + 1, sem="release", scope="gpu")
                else:
                    if old >= NA - NT_:
                        ep = cute.arch.load(ep_ptr, Int32, sem="acquire", scope="gpu")
                        while ep == e0:
                            ep = cute.arch.load(ep_ptr, Int32, sem="acquire", scope="gpu")
                sArr[0] = old
            cute.arch.sync_threads()
            slot = sArr[0] - (NA - NT_)
            if slot >= 0:
                cute.arch.fence_acq_rel_gpu()
                tok = slot * PC + warp
                if tok < M:
                    self.topk(tok, warp, lane, mBias, mIds, mWt, mWs, sS, scaling)

        @cute.jit
        def topk(self, tok, warp, lane, mBias, mIds, mWt, mWs, sS, scaling: Float32):
            keys = biased_keys(mWs, mBias, tok * self.ws_stride, lane, J, sS, warp)
            cute.arch.sync_warp()          # sS is read below by other lanes of this warp
            lane_u = Uint32(lane)
            if const_expr(ROLLED):
                # v2.4 (opt-in, `rolled`): the TOPK selection rounds as a loop instead of unrolled code. Unrolled,
                # the top-k is ~2800 of the TopkFromLogits kernel's 3648 SASS instructions (58 KB, ptxas 12.9), run
                # once by one warp. Cold instruction fetch was suspected for TopkFromLogits' 15.7-17.5 us; measured,
                # rolled is no faster (kernels-31884ea.json: the serial loads above were the cost). The keys live in
                # a register tensor indexed only by trace-time constants, so they stay in registers across the loop.
                rK = cute.make_rmem_tensor(cute.make_layout((J,)), Uint32)
                for j in cutlass.range_constexpr(J):
                    rK[j] = keys[j]
                rId = cute.make_rmem_tensor(cute.make_layout((1,)), Uint32)
                rSel = cute.make_rmem_tensor(cute.make_layout((1,)), Float32)
                rId[0] = Uint32(0)
                rSel[0] = Float32(0.0)
                for r in cutlass.range(0, TOPK, 1, unroll=1):
                    cur = [rK[j] for j in range(J)]
                    rId[0], rSel[0] = select_round(cur, r, lane, lane_u, sS, warp, rId[0], rSel[0])
                    for j in cutlass.range_constexpr(J):
                        rK[j] = cur[j]
                my_id = rId[0]
                my_s = rSel[0]
            else:
                my_id = Uint32(0)
                my_s = Float32(0.0)
                for r in cutlass.range_constexpr(TOPK):
                    my_id, my_s = select_round(keys, r, lane, lane_u, sS, warp, my_id, my_s)
            # 1e-20 and the scaling exactly as HF's gate (k3-spec.md 10.4); unbiased scores
            part = fsel(lane < TOPK, my_s, Float32(0.0))
            tot = cute.arch.warp_reduction_sum(part)
            if lane < TOPK:
                mIds[tok, lane] = Int32(my_id)
                mWt[tok, lane] = my_s / (tot + Float32(1e-20)) * scaling

    class FrontMma(FrontFma):
        """M > 4: swap-AB mma.sync m16n8k16 (weights = 16-row A tiles, tokens = 8-wide N tiles), fp32 accumulate.

        Warp = RTW row tiles x one k-slice; CTA = KS warps = the whole K of its RTW*16 rows; router CTAs first.
        Fragment scheme copied from k3fast/rms_gemv.py (_MmaGemv): lane (g, c) = (lane // 4, lane % 4) loads
        k = 8c..8c+7 of rows g and g+8 (and of tokens 8j+g) with one 16-byte load each, and feeds k 8c..8c+3
        to the first m16n8k16 of the 32-wide chunk, 8c+4..8c+7 to the second. A and B use the same K
        permutation, so every dot product is unchanged."""

        n_arrive, n_topk, per_cta = (RM, TM, KS) if mb in MMA_CONFIG else (R, T, WARPS)

        @cute.jit
        def __call__(self, mX, mW, mBias, mZ, mIds, mWt, mWs, mCnt, mH, scaling: Float32, stream):
            w_atom = weight_load_atom(BFloat16)
            self.kernel(mX, mW, mBias, mZ, mIds, mWt, mWs, mCnt, scaling, w_atom).launch(
                grid=[N // (16 * RTW), 1, 1], block=[32 * KS, 1, 1], stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, mX, mW, mBias, mZ, mIds, mWt, mWs, mCnt, scaling: Float32, w_atom: cute.CopyAtom):
            tid = cute.arch.thread_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bid = cute.arch.block_idx()[0]
            M = cute.size(mX, mode=[0])
            g = lane // 4
            c = lane - 4 * g
            row0 = bid * (16 * RTW)
            k0 = warp * CH

            smem = cutlass.memory.SmemAllocator()
            sArr = smem.allocate_tensor(Int32, cute.make_layout((2,)), 16)
            sS = smem.allocate_tensor(Float32, cute.make_layout((NE, KS)), 16)
            # per-k-slice partial sums, reduced in k-slice order (deterministic, no atomics)
            sRed = smem.allocate_tensor(
                Float32, cute.make_layout((KS, 16 * RTW, mb), stride=(16 * RTW * mb, mb, 1)), 16)

            gW = cute.flat_divide(mW, (1, 8))           # (1, 8, N, KV)
            gX = cute.flat_divide(mX, (1, 8))           # (1, 8, M, KV)
            atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))

            # Weights do not depend on the previous kernel: pull this warp's first chunks into L2 before the
            # PDL wait (only MMA_PF of CH chunks: all 64 MB would not fit the 60 MB L2 next to x).
            lpr = PF * 4 // 8                                  # 128-byte lines per row
            for idx in cutlass.range(lane, 16 * RTW * lpr, 32):
                r = idx // lpr
                l = idx - r * lpr
                cute.arch.prefetch(gW[0, None, row0 + r, k0 * 4 + 8 * l].iterator.llvm_ptr, cache_level="L2")
            cute.arch.griddepcontrol_wait()

            xrow = []
            for j in cutlass.range_constexpr(NT):
                # token rows >= M read row M-1 (in bounds, never stored)
                xrow.append(cutlass.min(8 * j + g, M - 1))
            accs = []
            for t in cutlass.range_constexpr(RTW):
                for j in cutlass.range_constexpr(NT):
                    a = cute.make_rmem_tensor(cute.make_layout((4, 1, 1), stride=(1, 0, 0)), Float32)
                    a.fill(0.0)
                    accs.append(a)
            rA = cute.make_rmem_tensor(cute.make_layout((8, 2 * RTW), stride=(1, 8)), BFloat16)
            rX = cute.make_rmem_tensor(cute.make_layout((8, NT), stride=(1, 8)), BFloat16)
            fa = cute.make_rmem_tensor(cute.make_layout((8, 1, 1), stride=(1, 0, 0)), BFloat16)
            fb = cute.make_rmem_tensor(cute.make_layout((4, 1, 1), stride=(1, 0, 0)), BFloat16)

            for kk in cutlass.range(k0, k0 + CH, 1, unroll=UM):
                kv = kk * 4 + c
                for t in cutlass.range_constexpr(RTW):
                    cute.copy(w_atom, gW[0, None, row0 + 16 * t + g, kv], rA[None, 2 * t])
                    cute.copy(w_atom, gW[0, None, row0 + 16 * t + g + 8, kv], rA[None, 2 * t + 1])
                for j in cutlass.range_constexpr(NT):
                    cute.autovec_copy(gX[0, None, xrow[j], kv], rX[None, j])
                for h in cutlass.range_constexpr(2):
                    for t in cutlass.range_constexpr(RTW):
                        swapab_a_fragment(fa, rA, h, t)
                        for j in cutlass.range_constexpr(NT):
                            for e in cutlass.range_constexpr(4):
                                fb[e] = rX[4 * h + e, j]
                            cute.gemm(atom, accs[t * NT + j], fa, fb, accs[t * NT + j])

            # accumulator (row g / g+8 of tile t, tokens 8j+2c, 8j+2c+1) -> smem, then an in-order k-slice sum
            for t in cutlass.range_constexpr(RTW):
                for j in cutlass.range_constexpr(NT):
                    swapab_c_fragment_to(sRed, warp, accs[t * NT + j], 16 * t + g, 8 * j + 2 * c)
            cute.arch.sync_threads()
            is_router = bid < RM
            # o = token * rows + local row: consecutive threads store consecutive n
            for o in cutlass.range(tid, mb * 16 * RTW, 32 * KS):
                tk = o // (16 * RTW)
                rl = o - tk * (16 * RTW)
                if tk < M:
                    tot = Float32(0.0)
                    for q in cutlass.range_constexpr(KS):
                        tot = tot + sRed[q, rl, tk]
                    n = row0 + rl
                    if is_router:
                        mWs[tk, n] = tot                       # fp32, never rounded (k3-spec 10.1)
                    else:
                        mZ[tk, n - NE] = tot.to(BFloat16)

            if is_router:
                self.arrive_then_topk(tid, warp, lane, M, mCnt, sArr, mBias, mIds, mWt, mWs, sS, scaling)
            cute.arch.griddepcontrol_launch_dependents()

    class TopkFromLogits(FrontFma):
        """The front's second half after a library GEMM: y = x [W_r; W_down (; W_sg; W_su)]^T in fp32
        ([M, NE + NL (+ 2 IS)]). One CTA per token: warp 0 runs the same top-16 as the fused kernel on y[tok, :NE]
        (so the tie order and the weights are bit-identical to it on the same logits), and all warps round the
        latent block to z = bf16(y[tok, NE:NE+NL]) (the GEMM's single rounding of z, k3-spec.md section 11).
        With IS > 0 the shared experts' gate and up rows ride in the same GEMM, and h = bf16(SiTU-GLU(bf16(a),
        bf16(c))) is formed here: a and c rounded to bf16 as a bf16 Linear would (k3-spec.md section 12), SiTU in
        fp32 (the same expression as moe_tail's shared gate/up kernel). No counter, no workspace."""
        ws_stride = N + 2 * IS

        @cute.jit
        def __call__(self, mY, mBias, mZ, mIds, mWt, mH, scaling: Float32, grid_x: Int32, stream):
            self.kernel(mY, mBias, mZ, mIds, mWt, mH, scaling).launch(
                grid=[grid_x, 1, 1], block=[32 * WARPS, 1, 1], stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, mY, mBias, mZ, mIds, mWt, mH, scaling: Float32):
            tid = cute.arch.thread_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tok = cute.arch.block_idx()[0]
            smem = cutlass.memory.SmemAllocator()
            sS = smem.allocate_tensor(Float32, cute.make_layout((NE, WARPS)), 16)
            gY = cute.flat_divide(mY, (1, 4))           # (1, 4, M, ws_stride / 4)
            gZ = cute.flat_divide(mZ, (1, 4))           # (1, 4, M, NL / 4)
            rY = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
            rC = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
            rZ = cute.make_rmem_tensor(cute.make_layout((4,)), BFloat16)
            cute.arch.griddepcontrol_wait()             # y is the previous kernel's output
            # v2.5: every z vector of this thread is loaded before the first store (and, in warp 0, before the
            # top-k). As a loop, each store waited for its load and the next load was not hoisted above the store
            # (y and z may alias as far as ptxas knows): NZ serial L2 round trips.
            rYz = cute.make_rmem_tensor(cute.make_layout((4, NZ), stride=(1, 4)), Float32)
            for i in cutlass.range_constexpr(NZ):
                vc = cutlass.min(tid + i * 32 * WARPS, NL // 4 - 1)   # past the end: re-read, never stored
                cute.autovec_copy(gY[0, None, tok, NE // 4 + vc], rYz[None, i])
            if const_expr(SPLIT):
                sK = smem.allocate_tensor(Uint32, cute.make_layout((WARPS * TOPK,)), 16)
                sI = smem.allocate_tensor(Uint32, cute.make_layout((WARPS * TOPK,)), 16)
                self.topk_split(tok, warp, lane, mBias, mIds, mWt, mY, sS, sK, sI, scaling)
            else:
                if warp == 0:
                    self.topk(tok, warp, lane, mBias, mIds, mWt, mY, sS, scaling)
            for i in cutlass.range_constexpr(NZ):
                v = tid + i * 32 * WARPS
                if v < NL // 4:
                    rZ.store(rYz[None, i].load().to(BFloat16))
                    cute.autovec_copy(rZ, gZ[0, None, tok, v])
            if const_expr(IS > 0):
                gH = cute.flat_divide(mH, (1, 4))       # (1, 4, M, IS / 4)
                for v in cutlass.range(tid, IS // 4, 32 * WARPS, unroll=2):
                    cute.autovec_copy(gY[0, None, tok, N // 4 + v], rY)
                    cute.autovec_copy(gY[0, None, tok, (N + IS) // 4 + v], rC)
                    for i in cutlass.range_constexpr(4):
                        a = rY[i].to(BFloat16).to(Float32)
                        c = rC[i].to(BFloat16).to(Float32)
                        rZ[i] = situ_glu(a, c).to(BFloat16)
                    cute.autovec_copy(rZ, gH[0, None, tok, v])
            cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def topk_split(self, tok, warp, lane, mBias, mIds, mWt, mWs, sS, sK, sI, scaling: Float32):
            """v2.8: the same top-16 as topk, over all WARPS warps of the CTA. Warp w ranks its NE / WARPS experts
            (w * NE / WARPS + lane + 32 j) and keeps its top-16 (key, expert) pairs in shared memory; warp 0 then
            selects the top-16 of those WARPS * 16 candidates. The global top-16 lies in the union of the per-warp
            top-16s under the same total order (larger key first, then the lower expert), so ids, scores and weights
            are bit-identical to topk's. Each warp's 16 rounds scan 7 keys per lane instead of 28, and the merge 2."""
            first = warp * (NE // WARPS) + lane
            keys = biased_keys(mWs, mBias, tok * self.ws_stride, first, J // WARPS, sS, 0)
            first_u = Uint32(first)
            my_k = Uint32(0)
            my_i = Uint32(0)
            for r in cutlass.range_constexpr(TOPK):
                bk, bj = local_best(keys)
                gmax, gidx = warp_best(bk, first_u + Uint32(32) * bj)
                remove(keys, gidx, first_u)
                mine = lane == r
                my_k = usel(mine, gmax, my_k)
                my_i = usel(mine, gidx, my_i)
            if lane < TOPK:
                sK[warp * TOPK + lane] = my_k
                sI[warp * TOPK + lane] = my_i
            cute.arch.sync_threads()             # the candidates and every warp's sS scores
            if warp == 0:
                # lane l holds candidates l and 32 + l: those of warps 0-1 and 2-3, so slot 0 always holds the lower
                # expert, and ">" below keeps it on equal keys, as local_best does
                k2 = [sK[lane], sK[32 + lane]]
                i2 = [sI[lane], sI[32 + lane]]
                my_id = Uint32(0)
                my_s = Float32(0.0)
                for r in cutlass.range_constexpr(TOPK):
                    take_b = k2[1] > k2[0]
                    _, gidx = warp_best(usel(take_b, k2[1], k2[0]), usel(take_b, i2[1], i2[0]))
                    for q in cutlass.range_constexpr(2):
                        k2[q] = usel(i2[q] == gidx, Uint32(0), k2[q])
                    s_sel = sS[Int32(gidx), 0]
                    mine = lane == r
                    my_id = usel(mine, gidx, my_id)
                    my_s = fsel(mine, s_sel, my_s)
                part = fsel(lane < TOPK, my_s, Float32(0.0))
                tot = cute.arch.warp_reduction_sum(part)
                if lane < TOPK:
                    mIds[tok, lane] = Int32(my_id)
                    mWt[tok, lane] = my_s / (tot + Float32(1e-20)) * scaling

    sym_m = cute.sym_int()
    if mb == 0:             # the top-k of a library GEMM's logits (any M): TopkFromLogits
        y = fake_tensor(Float32, (sym_m, N + 2 * IS))
        bias = fake_tensor(Float32, (NE,))
        z = fake_tensor(BFloat16, (sym_m, NL), align=8)
        ids = fake_tensor(Int32, (sym_m, TOPK), align=4)
        wt = fake_tensor(Float32, (sym_m, TOPK), align=4)
        h = fake_tensor(BFloat16, (sym_m, IS if IS else NL), align=8)     # IS = 0: z stands in, never written
        return cute.compile(TopkFromLogits(), y, bias, z, ids, wt, h, Float32(1.0), Int32(1), fake_stream(),
                            options=TVM_FFI)
    x = fake_tensor(BFloat16, (sym_m, K))
    w = fake_tensor(BFloat16, (N + 2 * IS, K))
    bias = fake_tensor(Float32, (NE,))
    z = fake_tensor(BFloat16, (sym_m, NL))
    ids = fake_tensor(Int32, (sym_m, TOPK), align=4)
    wt = fake_tensor(Float32, (sym_m, TOPK), align=4)
    ws = fake_tensor(Float32, (M_MAX, NE))
    cnt = fake_tensor(Int32, (4,))
    h = fake_tensor(BFloat16, (sym_m, IS if IS else NL))     # IS = 0: z stands in, never written
    obj = FrontMma() if mb in MMA_CONFIG else FrontFma()
    return cute.compile(obj, x, w, bias, z, ids, wt, ws, cnt, h, Float32(1.0), fake_stream(), options=TVM_FFI)


def get_kernel(mb: int, n_experts=N_EXPERTS, latent=LATENT, hidden=HIDDEN, top_k=TOP_K, unroll=None, min_blocks=None,
               rolled=None, shared=0):
    """``shared`` (v2.7, FMA buckets only): the shared experts' intermediate width whose gate/up rows follow the
    latent block in the packed weight (0: none)."""
    _check_shapes(n_experts, latent, hidden, top_k, mb)
    _check_shared(shared, mb)
    rolled = TOPK_ROLLED if rolled is None else bool(rolled)
    unroll = fma_unroll(mb) if unroll is None else unroll      # _check_shapes: hidden % 1024, so 4 | rest
    min_blocks = fma_min_blocks(mb) if min_blocks is None else min_blocks
    if mb in MMA_CONFIG:
        min_blocks = 0
    key = ("router_down_topk", mb, n_experts, latent, hidden, top_k, unroll, min_blocks, rolled) \
        + ((("shared", shared),) if shared else ())
    return compile_cached(key, lambda: _build(mb, n_experts, latent, hidden, top_k, unroll, min_blocks,
                                              shared=shared, rolled=rolled))


def _check_shared(shared, mb=None):
    if not isinstance(shared, int) or shared < 0 or shared % 4:
        raise ValueError(f"shared intermediate width must be a non-negative multiple of 4, got {shared!r}")
    if shared and mb in MMA_CONFIG:
        raise ValueError(f"the shared gate/up fold runs on the FMA front (M <= 4); M bucket {mb} is the tensor-core "
                         "path: use router_down_topk_cublas(..., shared=...) there")


def get_topk_kernel(n_experts=N_EXPERTS, latent=LATENT, top_k=TOP_K, shared=0, rolled=None, split=None):
    """The compiled TopkFromLogits kernel (any M: one CTA per token); its key does not depend on M or on K.
    ``shared``: the shared experts' intermediate width whose gate/up columns follow the latent block (0: none).
    ``split``: the top-k over the CTA's 4 warps (v2.8, the default; None = TOPK_SPLIT; not with ``rolled``)."""
    _check_shapes(n_experts, latent, HIDDEN, top_k)
    _check_shared(shared)
    rolled = TOPK_ROLLED if rolled is None else bool(rolled)
    if split is None:
        # The default follows TOPK_SPLIT where the split build exists (unrolled, experts a multiple of 128 so that
        # each warp ranks whole 32-key lanes); an explicit split=True that cannot be built is an error below.
        split = TOPK_SPLIT and not rolled and n_experts % (32 * WARPS) == 0
    split = bool(split)
    if split and rolled:
        raise ValueError("the split top-k (v2.8) is built unrolled: pass rolled=False with split=True")
    if split and n_experts % (32 * WARPS):
        raise ValueError(f"the split top-k needs n_experts to be a multiple of {32 * WARPS}, got {n_experts}")
    key = ("router_topk_from_logits", n_experts, latent, top_k, shared, rolled) + (("split",) if split else ())
    return compile_cached(key, lambda: _build(0, n_experts, latent, HIDDEN, top_k, UNROLL, shared=shared,
                                              rolled=rolled, split=split))


def warmup(batches=(1, 2, 3, 4, 7, 8, 16, 64), *, n_experts=N_EXPERTS, latent=LATENT, hidden=HIDDEN, top_k=TOP_K,
           device=None):
    """Compile every bucket ``batches`` needs (and allocate the device workspace when ``device`` is given)."""
    for key in compile_keys(batches, n_experts=n_experts, latent=latent, hidden=hidden, top_k=top_k):
        get_kernel(key[1], n_experts, latent, hidden, top_k)
    if device is not None:
        get_workspace(device, n_experts)


def get_workspace(device, n_experts=N_EXPERTS):
    """(logits [64, n_experts] fp32, counter [4] int32 = 0) for ``device``; allocate before graph capture."""
    import torch
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:      # "cuda" and "cuda:0" must share one workspace
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, n_experts)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = (torch.empty(M_MAX, n_experts, dtype=torch.float32, device=device),
              torch.zeros(4, dtype=torch.int32, device=device))
        _WORKSPACES[key] = ws
    return ws


def prepare_front_weight(w_router, w_down):
    """Pack [W_r; W_down] ([896, 7168] + [3584, 7168] bf16) into one [4480, 7168] weight (router rows first)."""
    import torch
    check_tensor("w_router", w_router, dtype=torch.bfloat16, shape=(None, None), align=0)
    check_tensor("w_down", w_down, dtype=torch.bfloat16, shape=(None, w_router.shape[1]), device=w_router.device,
                 align=0)
    return torch.cat([w_router, w_down], dim=0).contiguous()


def _front_outputs(M, latent, top_k, dev, out_z, out_ids, out_w, *, z_align):
    """The front's outputs z [M, latent] bf16, ids [M, top_k] int32, w [M, top_k] fp32: allocated when None, else
    checked (the fused kernel stores z 16 bytes at a time, TopkFromLogits 8)."""
    import torch
    if out_z is None:
        out_z = torch.empty(M, latent, dtype=torch.bfloat16, device=dev)
    if out_ids is None:
        out_ids = torch.empty(M, top_k, dtype=torch.int32, device=dev)
    if out_w is None:
        out_w = torch.empty(M, top_k, dtype=torch.float32, device=dev)
    check_tensor("out_z", out_z, dtype=torch.bfloat16, shape=(M, latent), device=dev, align=z_align)
    check_tensor("out_ids", out_ids, dtype=torch.int32, shape=(M, top_k), device=dev, align=4)
    check_tensor("out_w", out_w, dtype=torch.float32, shape=(M, top_k), device=dev, align=4)
    return out_z, out_ids, out_w


def router_down_topk(x, w_packed, e_bias, *, n_experts=N_EXPERTS, top_k=TOP_K, scaling=1.0,
                     out_z=None, out_ids=None, out_w=None, workspace=None, fma_unroll=None, fma_min_blocks=None,
                     rolled=None, shared=0, out_h=None):
    """z = bf16(x W_down^T), topk_ids [M, top_k] int32, topk_w [M, top_k] fp32 (k3-spec.md sections 10, 11).

    rolled: the top-k selection rounds as a loop (v2.4, opt-in; None = TOPK_ROLLED).

    shared = Is > 0 (v2.7, M <= 4): w_packed is prepare_front_shared_weight's [W_r; W_down; W_sg; W_su], and a
    fourth output h [M, Is] bf16 = the shared experts' SiTU-GLU (shared_expert_gate_up's contract) comes back, from
    the same pass over x.

    fma_unroll: benchmarks only (k3fast.measure.bench's @U4 row): the FMA path's vectors in flight per lane.

    x [M, 7168] bf16 (1 <= M <= 64), w_packed from prepare_front_weight, e_bias [n_experts] fp32.
    ids are ordered by descending s + e_bias, ties by ascending expert index (the lower index wins a tie).
    """
    import torch
    check_tensor("x", x, dtype=torch.bfloat16, shape=(None, None))
    dev = x.device
    if not x.is_cuda:
        raise ValueError(f"x: expected a CUDA tensor, got device {dev}")
    M, K = x.shape
    if not (1 <= M <= M_MAX):
        raise ValueError(f"x: batch M must lie in [1, {M_MAX}], got {M}")
    check_tensor("w_packed", w_packed, dtype=torch.bfloat16, shape=(None, K), device=dev)
    N = w_packed.shape[0]
    _check_shared(shared, bucket_m(M))
    latent = N - n_experts - 2 * shared
    if latent <= 0:
        raise ValueError(f"w_packed: {N} rows cannot hold {n_experts} router rows, a latent block and 2 x {shared} "
                         "shared gate/up rows")
    _check_shapes(n_experts, latent, K, top_k)
    check_tensor("e_bias", e_bias, dtype=torch.float32, shape=(n_experts,), device=dev)
    out_z, out_ids, out_w = _front_outputs(M, latent, top_k, dev, out_z, out_ids, out_w, z_align=16)
    if shared:
        if out_h is None:
            out_h = torch.empty(M, shared, dtype=torch.bfloat16, device=dev)
        check_tensor("out_h", out_h, dtype=torch.bfloat16, shape=(M, shared), device=dev)
    if workspace is None:
        workspace = get_workspace(dev, n_experts)
    ws, cnt = workspace
    check_tensor("workspace[0]", ws, dtype=torch.float32, shape=(M_MAX, n_experts), device=dev)
    check_tensor("workspace[1]", cnt, dtype=torch.int32, shape=(4,), device=dev)
    if not math.isfinite(float(scaling)):
        raise ValueError(f"scaling must be finite, got {scaling}")
    fn = get_kernel(bucket_m(M), n_experts, latent, K, top_k, fma_unroll, fma_min_blocks,  # M > 4: tensor cores
                    rolled, shared)
    fn(x, w_packed, e_bias, out_z, out_ids, out_w, ws, cnt, out_h if shared else out_z, float(scaling))
    return (out_z, out_ids, out_w, out_h) if shared else (out_z, out_ids, out_w)


def route_from_logits(logits, e_bias, *, top_k=TOP_K, scaling=1.0):
    """The routing of k3ref.moe.route from fp32 logits [M, E], in torch ops: ids [M, top_k] int32 by descending
    biased score (ties: the lower expert index, by a stable sort), weights [M, top_k] fp32 renormalised over the
    chosen unbiased scores (+1e-20) and scaled. The same contract as router_down_topk's top-k stage."""
    import torch
    s = torch.sigmoid(logits)
    order = torch.sort(s + e_bias, dim=-1, descending=True, stable=True).indices[:, :top_k]
    ws = s.gather(-1, order)
    ws = ws / (ws.sum(-1, keepdim=True) + 1e-20) * scaling
    return order.to(torch.int32), ws


def prepare_front_shared_weight(w_router, w_down, w_shared_gate, w_shared_up):
    """[W_r; W_down; W_sg; W_su] ([896 + 3584 + 2 Is, 7168] bf16): the cuBLAS front with the shared experts'
    gate/up in the same GEMM (router_down_topk_cublas(..., shared=Is)). Done once."""
    import torch
    front = prepare_front_weight(w_router, w_down)
    for name, t in (("w_shared_gate", w_shared_gate), ("w_shared_up", w_shared_up)):
        check_tensor(name, t, dtype=torch.bfloat16, shape=(None, front.shape[1]), device=front.device, align=0)
    if w_shared_gate.shape != w_shared_up.shape:
        raise ValueError(f"w_shared_gate {list(w_shared_gate.shape)} and w_shared_up {list(w_shared_up.shape)} differ")
    return torch.cat([front, w_shared_gate, w_shared_up], dim=0).contiguous()


def router_down_topk_cublas(x, w_packed, e_bias, *, n_experts=N_EXPERTS, top_k=TOP_K, scaling=1.0, shared=0,
                            rolled=None, split=None):
    """router_down_topk's outputs from one cuBLAS GEMM over the packed front weight (fp32 out: the router logits
    unrounded, z rounded once to bf16) and the TopkFromLogits kernel. For the larger batches, where the fused kernel
    is slower than these library kernels (k3fast.layer.FRONT_DSL_MAX_M says by how much).

    shared = Is > 0: w_packed is prepare_front_shared_weight's [W_r; W_down; W_sg; W_su], and a fourth output h
    [M, Is] bf16 = SiTU-GLU of the shared experts (shared_expert_gate_up's contract) comes back.
    split: TopkFromLogits' top-k over its 4 warps (v2.8, the default; None = TOPK_SPLIT)."""
    import torch
    if shared and w_packed.shape[0] <= 2 * shared:
        raise ValueError(f"w_packed: {w_packed.shape[0]} rows cannot hold 2 x {shared} shared gate/up rows")
    try:
        y = torch.mm(x, w_packed.t(), out_dtype=torch.float32)
    except TypeError:              # torch before out_dtype on mm: the fused kernel serves every batch instead
        if shared:
            raise RuntimeError("router_down_topk_cublas(shared=...) needs torch.mm with out_dtype (a newer torch)")
        import warnings
        warnings.warn("torch.mm has no out_dtype here (it needs a newer torch): router_down_topk_cublas falls back "
                      "to the fused router_down_topk kernel", RuntimeWarning, stacklevel=2)
        return router_down_topk(x, w_packed, e_bias, n_experts=n_experts, top_k=top_k, scaling=scaling)
    h = torch.empty(x.shape[0], shared, dtype=torch.bfloat16, device=x.device) if shared else None
    z, ids, w = topk_from_logits(y, e_bias, n_experts=n_experts, top_k=top_k, scaling=scaling, shared=shared,
                                 out_h=h, rolled=rolled, split=split)
    return (z, ids, w, h) if shared else (z, ids, w)


def topk_from_logits(y, e_bias, *, n_experts=N_EXPERTS, top_k=TOP_K, scaling=1.0, out_z=None, out_ids=None,
                     out_w=None, shared=0, out_h=None, rolled=None, split=None):
    """(z, ids, w) from the packed front GEMM's fp32 output y = x [W_r; W_down]^T ([M, n_experts + latent]): the
    fused kernel's top-k stage on y[:, :n_experts] and z = bf16(y[:, n_experts:]), in one launch (one CTA per
    token). It replaces route_from_logits' ~12 torch kernels (a stable radix sort among them: 50 us at rank16
    b64, records-50b6243-rotperf.json). Same contract as router_down_topk: ids by descending s + e_bias, ties by
    ascending index; weights renormalised over the unbiased scores (+1e-20) and scaled."""
    import torch
    check_tensor("y", y, dtype=torch.float32, shape=(None, None))
    if not y.is_cuda:
        raise ValueError(f"y: expected a CUDA tensor, got device {y.device}")
    M, N = y.shape
    if M < 1:
        raise ValueError("y: expected at least one token row, got 0")
    latent = N - n_experts - 2 * shared
    if latent <= 0:
        raise ValueError(f"y: {N} columns cannot hold {n_experts} router logits, a latent block and 2 x {shared} "
                         "shared gate/up columns")
    _check_shapes(n_experts, latent, HIDDEN, top_k)
    check_tensor("e_bias", e_bias, dtype=torch.float32, shape=(n_experts,), device=y.device)
    if shared:
        if out_h is None:
            raise ValueError("topk_from_logits: shared > 0 needs out_h [M, shared] bf16")
        check_tensor("out_h", out_h, dtype=torch.bfloat16, shape=(M, shared), device=y.device, align=8)
    if not math.isfinite(float(scaling)):
        raise ValueError(f"scaling must be finite, got {scaling}")
    dev = y.device
    out_z, out_ids, out_w = _front_outputs(M, latent, top_k, dev, out_z, out_ids, out_w, z_align=8)
    get_topk_kernel(n_experts, latent, top_k, shared, rolled, split)(y, e_bias, out_z, out_ids, out_w,
                                                                    out_h if shared else out_z, float(scaling), M)
    return out_z, out_ids, out_w
