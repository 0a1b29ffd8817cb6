"""o_proj GEMV + partial-sum update + pre-MLP AttnRes mix + post_attention RMSNorm, one launch.

Version log
-----------
v1  One launch of 112 GEMV CTAs + M epilogue CTAs (256 threads each).
    GEMV: swap-AB mma.sync m16n8k16 (weights = A, 8 tokens = B), k permuted so that every lane
    does 16-byte loads of both operands; K split over 2 warps per 16-row group, reduced through
    smem in a fixed order (deterministic). Epilogue CTAs: block statistics before the PDL wait
    (blocks kept in smem), "all GEMV CTAs arrived" counter (release/acquire, reset by the last
    epilogue CTA), then mix + RMSNorm of one token row.
    ptxas (sm_90a, remarks{ptx}), 0 spills everywhere: 128 regs (Kp 768, n_blocks 0, M<=8),
    144 (1536, 1, M<=32), 176 (768, 8, M<=16; 12288, 8, M<=8), 182 (12288, 8, M<=64),
    186 (768, 8, M<=64) -> 1 CTA/SM. Measured (kernels-11595c4.json): rank16 b1/b8/b64 12.9 / 13.1 / 23.6 us (cuBLAS
    GEMV alone 8.3 / 8.4 / 8.6, floor 2.6-3.7); full b1/b8/b64 69 / 79 / 190 us (cuBLAS 48 / 53 / 60, floor 42).
    Expected was: M=1 rank16 ~3.5-4 us
    (floor 2.7 us), M=64 rank16 ~6-7 us (floor 4.9 us), full width M=1 ~43 us (floor 41 us).
v1.1 Kernel unchanged. H200 run e5c7220: 51 pass / 43 fail, every failure the GPU test's
    "p' within 1 bf16 ulp of |a|" check (counter re-arm, determinism, NaN, graph replay, x_moe all
    pass). Cause: near a = 0 the fp32 summation-order error (absolute, ~2^-26 * sum|y w|) exceeds one
    ulp of a; a CPU replay of the exact test inputs predicts 190 such elements vs 156 seen, growing
    with M * Kp as observed. The kernel rounds a to bf16 once before the fp32 add, as specified. The
    test now brackets p' between its values at v -/+ 2^-17 * sum|y w| (monotone roundings).
v1.2 (2026-11-29, session 6; PRELOAD_WPOST, the default since session 7; "fast-s8" is the A/B without it)
    The epilogue loads its w_post vectors into registers before griddepcontrol_wait. Why: the SASS of the last
    loop (x = bf16(w_post * m * rstd)) reads LDG, STG, LDG, STG, ...: each store waits for its load, and ptxas does
    not hoist the next load above a store to memory it cannot prove disjoint, so the loop costs VPT = 4 serial
    round trips on the attention half's critical path. w_post is a weight, so the contracts already allow reading
    it before the wait. ptxas 12.9: 128 registers unchanged at n_blocks = 1; 174 -> 194 at n_blocks = 8 (still one
    CTA per SM); no spills; loads behind a store 3 -> 0 (traces/cpu/ptxcheck-cb84e2ba91f3.json). Outputs bit-identical (GPU test test_preload_wpost_is_bit_identical). Prediction:
    attention half b1-4 -1 to -1.5 us (rank16 b1 36.5 -> ~35-35.5 us, 1.84-1.87x stock).
    Measured (kernels-84291ed.json, records-84291ed-s9perf.json, one run; GPU tests passed): kernel bench b1 / b2 /
    b4 / b8 12.8 -> 11.4, 12.9 -> 11.6, 12.8 -> 11.6, 13.2 -> 12.1 us; attention half b1 36.7 -> 35.4 us
    (fast-wpost; stock 65.7 in the same run: 1.86x). Met. The default since session 7 ("fast-s8" keeps v1.1).

v1.3 (2026-11-30, session 16; opt-in stage_rest, impl "fast-opstage"; measured at s47 and removed, code at
    8574eb7) Where the register stage ring holds only part of a GEMV CTA's weight slice, the rest goes into
    shared memory by cp.async.bulk before griddepcontrol_wait too: at rank8 (Kp 1536) and M <= 16 the ring holds
    k < 768, and the 64 rows' k >= 768 (96 KB per CTA, one 1.5 KB bulk copy per row, rows 64 B apart in the banks)
    land in the region where the epilogue CTAs keep the blocks. After the wait the CTA consumes the register stages,
    waits on the copies' mbarrier, then reads the rest's fragments from shared memory: the same stages in the same
    order, so the output is bit-identical (GPU test test_stage_rest_is_bit_identical). ptxas: registers as without
    it at M <= 16 (128 / 194), 102 instead of 144 at M = 32; no spills.
    Why (records-d9e6f60-s46.json): o_proj ends 5.0 us after the KDA step at rank16 b1 / b2, where the whole slice
    is in registers before the wait, and 8.0-12.1 us after it at rank8, where half of it is loaded after the wait
    (8.0 / 8.7 with the FMA in_proj, 9.9 / 12.1 with the ring in_proj).
    Prediction: rank8 attention half b1 45.8 -> ~42-43.5 us, b2 50.3 -> ~45-47 (o_proj ~5.5-6.5 us after the KDA
    step); rank16 unchanged (no rest). If it does not move, the o_proj CTAs are not resident while the KDA step
    runs (the loads then start at the wait anyway), and the timeline's o_proj start says so.
    Measured (records-8574eb7-s47.json, one run beside stock; GPU tests: bit-identical at M 1-4, nb 1 / 8, boundary,
    and in a graph): attention half fast -> fast-opstage rank8 b1 45.4 -> 45.5 us, b2 47.8 -> 51.5; with the ring's
    late trigger (fast-ringlate -> fast-opstagelate) b1 43.1 -> 47.9, b2 48.3 -> 52.2; rank16 31.6 / 34.3 -> 31.7 /
    34.0 (no rest, as predicted). Missed: no gain at b1, slower at b2 and with the late trigger. In the rank8 b2
    timeline o_proj ends 13.7 us after the KDA step (9.9 without) and the KDA step is no shorter. Inference, not
    measured (the timeline has no per-CTA record): with 96 KB of shared memory per GEMV CTA fewer of those CTAs fit
    beside the KDA CTAs than with the register stages alone, so their copies start later than the loads they
    replace. Removed, with STAGE_REST.
v1.4 (session 17; opt-in prefetch_rest, impl "fast-oppf"; measured at s50 and removed, code at ff51150)
    The rest of v1.3, into L2 instead of shared memory: before griddepcontrol_wait the first 64 threads of a GEMV
    CTA each issue one cp.async.bulk.prefetch.L2 of their row's k >= KREG (1.5 KB at rank8, M <= 16; 11 MB over
    the grid); the loads after the wait are the default's and should hit L2. Nothing reaches the CTA: shared
    memory, registers and residency are unchanged, which is where v1.3 is thought to have lost; bit-identical
    (GPU test test_prefetch_rest_is_bit_identical). Only where the rest fits well inside L2 (prefetch_applies:
    <= 16 MB over the grid; not full width's 165 MB). ptxas: 128 registers at M 1 / 2 as without it; at M 16,
    128 with 16 B of spills (138 without).
    Why this is not the L2 prefetch that lost six times (LOG sessions 6-11): those ran beside a saturated stream of
    the same kernel or of the experts. Here the window is the KDA step (~6 us at rank8 b1, s49's timeline: o_proj
    CTAs arrive 2.7 us into it), which reads little, so the HBM is mostly idle while the 11 MB come in.
    Prediction: rank8 attention half b1 43.7 -> ~42.5-43 us, b2 47.5 -> ~46.5 (o_proj 8.6 -> ~7-7.5 us after the
    KDA step in the timeline); rank16 unchanged (the same build). If o_proj's end does not move but the KDA step
    gets longer, the prefetch took the KDA step's bandwidth.
    Measured (records-ff51150-s50.json, one run beside stock; GPU tests 10 passed: bit-identical at M 1 / 2 / 16 /
    32, nb 1-8, boundary; the rank8 attention half at b1-4): attention half fast -> fast-oppf rank8 b1 43.4 -> 44.9
    us, b2 47.0 -> 47.8. Missed, slower. The b1 timeline gives the reason that the rule written before the run
    named: the KDA step took 7.5 us instead of 6.0 (the 11 MB took its bandwidth, or its L2), and o_proj still
    ended 8.7 us after it (8.8 without). Either the lines were not in L2 by the wait, or o_proj's time after the
    KDA step is not set by the rest's reads (the chain of ring refills and MMAs, one wave of 12 stages per warp);
    the timeline cannot tell which, and v1.3's miss points the same way. The seventh L2 prefetch design measured
    slower. Removed.

v1.5 (session 18, written after its runs; lean_sync / LEAN_SYNC, the default since session 19; "fast-opfence" / bench
    row oproj_attnres@fenced are the A/B without it, "fast-oplean" the name its first records carry) The arrival
    chain as experts v8.1 measured it (moe_mxfp4_experts version log: v8 -> v8.1 took 0.6 us out of an exchange of
    the same shape). After its p' stores each GEMV thread fenced at gpu scope, which
    waits for that thread's own stores, before the CTA barrier and thread 0's release arrival; the barrier and the
    release's cumulativity already order them (CUTLASS's barrier arrivals rely on the same). The epilogue's thread 0
    fenced after its acquire spin (not needed: acquire load, then the CTA barrier) and then waited for its
    departure atomic's result before the barrier that every epilogue thread waits at: one serial L2 round trip on
    the attention half's critical path. v1.5 drops both fences and departs at the end of the epilogue, after the
    stores of x. Same arithmetic: bit-identical (GPU test test_lean_sync_is_bit_identical; counter re-armed, graph
    replays). Why now: ncu8 / ncu9 put ~7 us of the kernel alone outside bandwidth, 8 % of its stall samples on
    memory barriers.
    Prediction: attention half -0.4 to -0.8 us at every b1 / b2 cell (o_proj is its last kernel), rank8 b1 43.2 ->
    ~42.5 (1.77x -> ~1.80x at s55's stock); the kernel bench b1 -0.3 to -0.6. If the kernel bench moves and the
    attention half does not, the spin's end is set by the last GEMV CTA's loads, not by the chain after it.
    Measured (s58 at 377caf5, kernels- and records-377caf5-s58.json, one run beside stock, copy 4.155 / 4.132 TB/s;
    GPU tests 10 passed: bit-identical at M 1 / 2 / 8 / 64, nb 1-8, boundary, counter re-armed, graph replay; the attention
    half at rank8 / rank16 b1 / b2). Kernel bench (default -> lean, us): rank16 b1 11.07 -> 10.94, b2 11.65 -> 11.07,
    rank8 b1 14.46 -> 14.02, b2 14.43 -> 14.05. Attention half (stock / fast / fast-oplean): rank16 b1 65.3 / 30.6 /
    30.4 (2.15x), b2 73.3 / 33.6 / 32.8 (2.23x), rank8 b1 77.8 / 43.6 / 43.1 (1.81x), b2 86.3 / 47.5 / 46.3 (1.86x).
    Met at three cells of four (-0.5, -0.8, -1.2), under it at rank16 b1 (-0.2); kernel bench -0.1 to -0.6 (met
    but for rank16 b1). Every cell moved the same way in both benches, so the default from session 19.
    ncu10 (the v1.4 path, rank16 b1, ncu-377caf5-ncu10/, --set full with the report kept and its source page per
    SASS instruction): 499 warp-stall samples, 459 of them in the 112 GEMV CTAs, 36 % on the first use of the
    weight registers (long scoreboard: the loads in flight), 19 % issuing the weight loads (LG throttle: the load
    queue is full), 7 % on the per-thread fence v1.5 removes; the one epilogue CTA (8 warps) holds 21 samples. The
    GEMV is a single wave of loads waiting for HBM; what is not bandwidth in the isolated kernel is the load
    latency of that one wave and the serial chain behind it, not one hot instruction.
v1.6 (session 19; opt-in split_rows / SPLIT_ROWS, impl "fast-op32", bench row oproj_attnres@rows32; measured at
    s60) At rank8 (Kp 1536) a 64-row CTA's slice is 24 chunks per warp and the register stages hold
    12, so half of the 22 MB is requested only after griddepcontrol_wait; v1.3 (that half into shared memory) and
    v1.4 (into L2) both lost. v1.6 halves the rows per CTA instead (32 rows: 2 row groups x 4 K splits, 224 GEMV
    CTAs): each warp again has 12 chunks, all of them in flight before the wait, exactly as at rank16, and at 128
    registers two CTAs share an SM. Where it applies (_rows): Kp 1536, M <= 8, n_blocks <= SPLIT_MAX_NB = 5 (ptxas
    12.9: 128 registers at nb 0-5, 160-194 at 6-8, 132 at M <= 16; above 128 the 224 CTAs need a second wave).
    The K split of 4 sums the fp32 partial tiles in another order than v1.5's 2, so it is not bit-identical: the
    GPU tests hold it to the reference like the default (p' inside the accumulation bracket, x within 1e-2).
    Why: s59's rank8 b1 timeline (records-54bd858-s59.json): in_proj 24.4 us (92 % of the copy rate), the KDA step to
    29.3, o_proj ends 10.8 us after it; at rank16, where the whole slice is in flight, 5.4. ncu8 put rank8's extra
    at its second 11 MB arriving after the wait. The KDA step (~4.8 us) reads little, so the HBM can bring most of
    the 22 MB while it runs, if the 224 CTAs are resident then.
    Prediction: attention half rank8 b1 42.9 -> ~38.5-40 us (o_proj ~6-7.5 us after the KDA step; 1.93-2.0x at
    s59's stock 77.2), b2 46.7 -> ~42.5-44; kernel bench rank8 b1 13.8 -> ~11.5-12.5. rank16 and M > 8 unchanged
    (same builds). If the attention half does not move, the 224 CTAs are not resident beside the KDA CTAs (their
    loads then start at the wait anyway); if the kernel bench moves and the layer does not, that is the reason.
    Measured (s60 at f253411, kernels- and records-f253411-s60.json, one run beside stock, copy 4.116 / 4.156 TB/s; GPU
    tests 17 passed: the reference at M 1-8, nb 0-5, boundary, in place, graph replay with the counter re-armed;
    the sweep's error against k3ref equals the default's). Kernel bench rank8 b1 13.57 -> 13.70 us, b2 13.95 ->
    13.70. Attention half (stock / fast / fast-op32): b1 77.2 / 42.9 / 42.5 (1.80x -> 1.82x), b2 84.9 / 46.5 / 45.4
    (1.83x -> 1.87x). MISSED (-0.4 / -1.1 against -3 to -4.4). The b1 timeline says where it went: o_proj now ends
    5.4 us after the KDA step (9.1 with 64 rows: what the prediction expected), but the KDA step took 8.9 us
    instead of 6.3, so the span moved only 40.0 -> 38.8. Twice the bytes in flight during the KDA step slow the
    KDA step by about what they save after it, as v1.4's L2 prefetch did (KDA 6.0 -> 7.5 there). Inference, not
    measured: the KDA chain's loads after its wait queue behind o_proj's stream (ncu10: o_proj's warps fill the
    load queues; LG throttle is a fifth of its samples). Stays opt-in. What would use it: o_proj's stream held
    back until the KDA chain's loads are done (a later trigger inside the KDA kernel), LOG next steps.
    s61 (e3ab9f1, records-e3ab9f1-s61.json, no stock) tried exactly that (kda_conv_gate_step v8, removed): the KDA
    step got shorter, o_proj ended later, the attention half longer. The same run repeated v1.6 against fast:
    rank8 b1 41.7 -> 42.7 us (+1.0; s60 -0.4), b2 46.6 -> 46.0 (-0.6; s60 -1.1), the KDA step 6.2 -> 9.2 and o_proj
    8.2 -> 5.2 us after it. At b1 the two runs disagree in sign: no gain that one run can tell. Stays opt-in.
M 9..16 (session 26; impls "fast-opm16" / "fast-inwg-opm16", fast.GEMV_DSL_MAX_M 8 -> 16 for o_proj; no new code)
    Where o_proj is cuBLAS + the separate AttnRes #2 kernel (rank8 b16: 8.3 + 3.9 us and three launch gaps, 12.8 us
    after the KDA step in s90c), this kernel at its M = 16 bucket. Prediction: o_proj + norm after the KDA step 12.8
    -> ~10 us, attention half rank8 b16 59.1 -> ~56-57 (1.8x of stock needs ~56.3), rank16 b16 42.1 -> ~40-41.
    Measured (s90c at 111bb49, kernels- / records-111bb49-s90c.json, one run beside stock; GPU tests 54 passed, this
    kernel at M = 16 and the attention half with it): attention half (stock / fast / fast-opm16) rank8 b16 101.4 /
    59.1 / 60.6, rank16 b16 86.8 / 42.1 / 41.6; kernel bench at M = 16 13.2 / 16.3 us (rank16 / rank8; cuBLAS's
    o_proj alone 8.1 / 11.1). MISSED: in the rank8 timeline o_proj now ends 11.9 us after the KDA step (12.9 before),
    but its CTAs start during the KDA step and take its bandwidth: the KDA step 11.8 -> 15.2 us. The same trade as
    v1.3 / v1.4 / v1.6. Not the default; the impls stay as the A/B.

What it replaces (k3-spec.md sections 4.2 steps 3-5, 4.3 "attn_res #2", 5, 6, 13.2 item 1)
-----------------------------------------------------------------------------------------
    a        = bf16(y @ w_o^T)                      o_proj (row-TP slice; the all-reduce boundary on
                                                    a TP rank is the single bf16 rounding; TP1: none)
    p'       = a if boundary else bf16(p + a)       partial block sum (step 3)
    sources  = blocks[:, :n_blocks] ++ [p']         (n_blocks already counts a block written at a
                                                    boundary layer)
    r_i      = rsqrt(mean(v_i^2) + eps), s_i = r_i * <v_i, u_mlp>, alpha = softmax(s)   (fp32)
    m        = sum_i alpha_i v_i                    (fp32, raw sources)
    x_moe    = bf16(w_post * m * rsqrt(mean(m^2) + eps))   post_attention_layernorm of fp32 m
                                                    (vLLM semantics; HF would round m to bf16 first)
    u_mlp = mlp_res_norm.weight * mlp_res_proj.weight (fp32, folded offline).

Bytes and floors (H200, 4.3 TB/s), one rank, D = 7168
-----------------------------------------------------
    o_proj weight 7168 x Kp bf16:  rank16 (Kp=768) 11.0 MB -> 2.56 us; rank8 (1536) 22.0 MB -> 5.12 us;
                                   full (12288) 176 MB -> 41.0 us.
    activations per token: y 2*Kp, partial r+w 28.7 KB, x 14.3 KB, blocks 14.3 KB * n_blocks
    (n_blocks=8: 158 KB/token).  M=1: +0.16 MB (+0.04 us).  M=64, n_blocks=8: +10.1 MB (+2.4 us):
    rank16 M=64 floor = 21.1 MB -> 4.9 us; full M=64 floor 186 MB -> 43.3 us.

Design choice (brief options a/b/c) and cost estimates
------------------------------------------------------
The mix needs the whole 7168-wide row of p', which is spread over every GEMV CTA. Chosen: (a),
single launch, with dedicated epilogue CTAs appended to the grid (block index >= 112), one per
token.
  * GEMV CTAs never wait on anything but the PDL predecessor, so they always finish once resident.
    Epilogue CTAs spin (thread 0, ld.acquire.gpu) on a global arrival counter until all 112 GEMV
    CTAs released it. Spinners only wait on CTAs that never wait themselves and the spinners are
    at most 64, so at least 68 SMs always remain for GEMV CTAs: no deadlock even without
    co-residency of the whole grid (at M <= 20 the whole grid is one wave anyway). The last epilogue CTA to pass the spin resets the counter to 0 (the value
    climbs to 112 + M first), so CUDA-graph replays start from 0 with no memset node.
  * The block statistics (<v_i,u>, <v_i,v_i>, 2 * n_blocks fp32 per token) do not depend on a: the
    epilogue CTAs read blocks[m, :n_blocks] and compute them BEFORE griddepcontrol_wait, overlapped
    with the predecessor's tail and with the GEMV. They also keep the blocks in smem
    (n_blocks * 14 KB <= 112 KB) so the post-GEMV critical path only reads p' (14 KB, L2) + 2 block
    reductions: ~0.6-0.9 us after the last GEMV CTA arrives (estimate: one L2 round trip for p',
    ~2x 0.1 us barriers, 14 KB store). Re-reading the blocks from L2 instead would add ~1 us.
  * Residency: 1 CTA/SM, so the grid (112 + M) is one wave for M <= 20; above that the last
    epilogue CTAs start when GEMV CTAs retire (their block reads are then not overlapped: ~+1-2 us
    at M=64, v2: several tokens per epilogue CTA or a 128-register build).
  * (b) cooperative launch + grid barrier would let every CTA finish its own 64 columns (needs the
    full Gram matrix or two barriers) but cooperative + PDL launch attributes together are untested
    here and a grid barrier costs ~1-2 us of its own; (c) a second kernel costs one launch gap
    (~1 us with PDL) which the brief forbids at M <= 4. (a) costs one extra L2 round trip.
  * GEMV engine: mma.sync swap-AB for all M. Per 16 rows x 32 k a lane issues 2 weight LDG.128,
    and per 8-token group 1 y LDG.128 (L1 hit) + 2 MMAs: ~0.05 instr/weight at M=1, ~0.3 at M=64,
    far below the ~15 instr/weight issue budget at 4.3 TB/s; the FMA GEMV of cutedsl-hopper.md
    2.1 is issue-bound from M=4. The weight stage ring (12 x 32 k per warp at M <= 16, else 6) is
    issued before griddepcontrol_wait: at rank16 and M <= 16 the CTA's whole 96 KB weight slice is
    in flight before the predecessor finishes. 48-96 KB in flight per SM covers HBM latency
    (Little: 38 GB/s/SM * ~1 us = 38 KB).
  * Expected: GEMV phase ~1.1x weight floor (112 of 132 SMs busy, ramp); total M=1 rank16
    ~3.5-4 us (1.3-1.5x of 2.6 us), M=64 rank16 ~6-7 us (~1.3x of 4.9 us), full width ~1.05x.

Contracts
---------
  * blocks, u_mlp, w_post and w_o are read BEFORE griddepcontrol_wait: they must have been written
    by a grid that finished before the immediately preceding grid passed its own
    griddepcontrol_wait (true in the K3 chain when every kernel triggers its dependents after its
    wait: the boundary block comes from AttnRes #1, >= 3 launches earlier). y and partial are read
    after the wait.
  * One arrival counter per device (``_workspace``): calls on one device must be stream-ordered
    (two concurrent streams would share the counter); pass ``counter=`` (int32 [4], zeros) to use a
    private one. Successive launches are safe under PDL because both roles touch the counter only
    after griddepcontrol_wait.
  * out_partial may alias partial (each element is read and written by the same thread).
  * M (tokens) is a run-time dim; the compile key buckets it as TG = 8-token groups in {1,2,4,8}.
"""


import math
from typing import Iterable

from k3fast.kernels._dsl import (TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, import_cute,
                         weight_load_atom)

D = 7168                 # hidden size
ROWS = 64                # o_proj output rows per GEMV CTA
G = D // ROWS            # 112 GEMV CTAs
WARPS = 8
THREADS = 32 * WARPS
RG = ROWS // 16          # 16-row MMA groups per CTA
KS = WARPS // RG         # K splits per row group (reduced in smem, fixed order)
CHUNK = 32               # k per lane-step: 2 MMAs of k16
MSTRIDE = ROWS + 4       # smem row pitch of the K-split tile: conflict-free fragment stores
VEC = 8                  # bf16 per 16-byte vector
NVEC = D // VEC          # 896 vectors per row
VPT = -(-NVEC // THREADS)            # 4 vectors per thread in the epilogue (last one partial)
TAIL = NVEC - (VPT - 1) * THREADS    # 128 threads own a 4th vector
MAX_M = 64
KP_SUPPORTED = (768, 1536, 12288)


# v1.2 (the default since session 7; "fast-s8" is the A/B without it): the epilogue loads w_post into registers
# before griddepcontrol_wait (the version log says why)
PRELOAD_WPOST = True
# v1.5 (the default since session 19, measured at s58; "fast-opfence" is the A/B without it): the arrival chain with no
# fence per thread, no fence after the spin, and the departure at the end of the epilogue (the version log says why)
LEAN_SYNC = True
# v1.6 (opt-in, "fast-op32"; session 19, s60: -0.4 / -1.1 us at rank8 b1 / b2, the KDA step slower): 32 output
# rows per GEMV CTA (224 CTAs, two per SM) where 64 rows leave half of a CTA's weight slice to be loaded after the PDL
# wait and 32 rows fit all of it in the register stages (rank8, M <= 8, n_blocks <= SPLIT_MAX_NB); see the version log
SPLIT_ROWS = False
SPLIT_MAX_NB = 5          # ptxas 12.9, rows 32, M <= 8: 128 registers at n_blocks 0-5, 160-194 at 6-8 (and 132 at
#                           M <= 16): above 128 a CTA takes more than half the register file and the 224 CTAs need
#                           a second wave


def _rows(kp: int, n_blocks: int, tg: int, split: bool) -> int:
    """Output rows per GEMV CTA: 32 (v1.6) only where that puts the whole slice in flight before the wait and two
    CTAs fit on an SM."""
    ks32 = WARPS // (32 // 16)
    if (split and tg == 1 and n_blocks <= SPLIT_MAX_NB and kp // (CHUNK * ks32) <= _stages(kp, tg, ks32)
            and kp // (CHUNK * KS) > _stages(kp, tg)):
        return 32
    return ROWS


def _tg_bucket(m: int) -> int:
    tg = -(-m // 8)
    return 1 << (tg - 1).bit_length()


def _stages(kp: int, tg: int, ks: int = KS) -> int:
    cpw = kp // (CHUNK * ks)                  # chunks per warp
    s = 12 if tg <= 2 else 6
    s = min(s, cpw)
    while cpw % s:
        s -= 1
    return s


def _stage_blocks(tg: int) -> bool:
    # registers already limit the kernel to 1 CTA/SM, so smem for n_blocks * 14 KB is free
    return True


def compile_key(kp: int, n_blocks: int, m: int) -> tuple:
    return ("oproj_attnres", int(kp), int(n_blocks), _tg_bucket(int(m)))


def _build(kp: int, n_blocks: int, tg: int, preload_wpost: bool = False, lean_sync: bool = False, rows: int = ROWS):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32, const_expr
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    NB = n_blocks
    MP = 8 * tg
    # the CTA's tiling (v1.6 halves the rows and doubles the K splits: the same chunks per warp, twice the CTAs)
    R = rows
    GC = D // R                                # GEMV CTAs
    RGL = R // 16
    KSL = WARPS // RGL
    MSTR = R + 4
    S = _stages(kp, tg, KSL)
    CPW = kp // (CHUNK * KSL)
    NIT = CPW // S
    STAGE = _stage_blocks(tg)
    PPT = R * MP // THREADS                 # (row, token) outputs per thread in the GEMV epilogue
    NRED = max(2 * NB, 2)
    red_words = KSL * MP * MSTR
    blk_elems = NB * D if (STAGE and NB > 0) else 8
    smem_bytes = red_words * 4 + blk_elems * 2 + WARPS * 16 * 4 + 3 * 128

    def mma16816(acc, base, a0, a1, a2, a3, b0, b1):
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.f32(), T.f32(), T.f32(), T.f32()]),
            [a0.ir_value(), a1.ir_value(), a2.ir_value(), a3.ir_value(), b0.ir_value(), b1.ir_value(),
             acc[base].ir_value(), acc[base + 1].ir_value(), acc[base + 2].ir_value(), acc[base + 3].ir_value()],
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        for q in range(4):
            acc[base + q] = Float32(llvm.extractvalue(T.f32(), res, [q]))

    class OprojAttnRes:
        @cute.jit
        def __call__(self, mY, mW, mBlk, mP, mU, mWp, mPo, mX, mCnt, boundary: Int32, eps: Float32,
                     stream):
            m_tok = cute.size(mY, mode=[0])
            self.kernel(mY, mW, mBlk, mP, mU, mWp, mPo, mX, mCnt, boundary, eps).launch(
                grid=[GC + m_tok, 1, 1], block=[THREADS, 1, 1], smem=smem_bytes, stream=stream,
                use_pdl=True)

        # ------------------------------------------------------------------ helpers
        @cute.jit
        def block_sum(self, vals, n: cutlass.Constexpr, sred, warp, lane):
            """Sum n fp32 per-thread values over the CTA; every thread gets the totals (fixed order)."""
            for k in cutlass.range_constexpr(n):
                v = cute.arch.warp_reduction_sum(vals[k])
                if lane == 0:
                    sred[warp * 16 + k] = v
            cute.arch.sync_threads()
            for k in cutlass.range_constexpr(n):
                tot = sred[k]
                for w in cutlass.range_constexpr(1, WARPS):
                    tot = tot + sred[w * 16 + k]
                vals[k] = tot
            cute.arch.sync_threads()

        @cute.jit
        def depart(self, mCnt, arrivals):
            """An epilogue CTA's departure (after its spin): the last of the launch's G + M re-arms the counter."""
            old = cute.arch.atomic_add(mCnt.iterator, Int32(1), sem="relaxed", scope="gpu")
            if old == arrivals - 1:
                # every epilogue CTA has passed its spin -> re-arm for the next launch
                cute.arch.store(mCnt.iterator, Int32(0), sem="relaxed", scope="gpu")

        @cute.jit
        def load_w_stage(self, gW, rW, s: cutlass.Constexpr, c, n0, t, w_atom):
            cute.copy(w_atom, gW[0, None, n0, c * 4 + t], rW[s, 0, None])
            cute.copy(w_atom, gW[0, None, n0 + 8, c * 4 + t], rW[s, 1, None])

        @cute.jit
        def consume_stage(self, gY, rW, rY, acc, s: cutlass.Constexpr, c, toks, t):
            w32 = cute.recast_tensor(rW, Int32)
            for j in cutlass.range_constexpr(tg):
                cute.autovec_copy(gY[0, None, toks[j], c * 4 + t], rY)
                y32 = cute.recast_tensor(rY, Int32)
                # k permutation: lane t holds k = 8t..8t+7 of the chunk; MMA 1 uses k 8t..8t+3, MMA 2
                # k 8t+4..8t+7. A and B use the same map, so the dot product is unchanged.
                mma16816(acc, 4 * j, w32[s, 0, 0], w32[s, 1, 0], w32[s, 0, 1], w32[s, 1, 1], y32[0], y32[1])
                mma16816(acc, 4 * j, w32[s, 0, 2], w32[s, 1, 2], w32[s, 0, 3], w32[s, 1, 3], y32[2], y32[3])

        # ------------------------------------------------------------------ kernel
        @cute.kernel
        def kernel(self, mY, mW, mBlk, mP, mU, mWp, mPo, mX, mCnt, boundary: Int32, eps: Float32):
            tid = cute.arch.thread_idx()[0]
            bid = cute.arch.block_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            m_tok = cute.size(mY, mode=[0])

            smem = cutlass.memory.SmemAllocator()
            sRed = smem.allocate_tensor(Float32, cute.make_layout((KSL, MP, MSTR),
                                                                  stride=(MP * MSTR, MSTR, 1)), 16)
            sBlk = smem.allocate_tensor(BFloat16, cute.make_layout((blk_elems // VEC, VEC), stride=(VEC, 1)), 16)
            sSum = smem.allocate_tensor(Float32, cute.make_layout(WARPS * 16), 16)

            if bid < GC:
                # ============================== GEMV role ==============================
                rg = warp % RGL
                ks = warp // RGL
                g = lane // 4
                t = lane % 4
                n0 = bid * R + rg * 16 + g
                gW = cute.flat_divide(mW, (1, VEC))            # (1, 8, N, Kp/8)
                gY = cute.flat_divide(mY, (1, VEC))            # (1, 8, M, Kp/8)
                w_atom = weight_load_atom(BFloat16)
                rW = cute.make_rmem_tensor(cute.make_layout((S, 2, VEC), stride=(2 * VEC, VEC, 1)), BFloat16)
                rY = cute.make_rmem_tensor(cute.make_layout((VEC,), stride=(1,)), BFloat16)
                acc = cute.make_rmem_tensor(cute.make_layout((4 * tg,), stride=(1,)), Float32)
                acc.fill(0.0)
                rPart = cute.make_rmem_tensor(cute.make_layout((PPT,), stride=(1,)), Float32)
                rPart.fill(0.0)

                # weights do not depend on the predecessor: put the first S stages in flight now
                for s in cutlass.range_constexpr(S):
                    self.load_w_stage(gW, rW, s, ks + KSL * s, n0, t, w_atom)

                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()

                # token rows beyond M are clamped (valid address); their MMA columns are discarded
                toks = []
                for j in cutlass.range_constexpr(tg):
                    tk = Int32(j * 8) + g
                    toks.append(cutlass.min(tk, m_tok - 1))

                # partial (read after the wait; its store comes after the K loop)
                for q in cutlass.range_constexpr(PPT):
                    idx = tid + q * THREADS
                    r = idx % R
                    mm = idx // R
                    if boundary == 0:
                        if mm < m_tok:
                            rPart[q] = mP[mm, bid * R + r].to(Float32)

                for it in cutlass.range(NIT - 1):
                    for s in cutlass.range_constexpr(S):
                        c = ks + KSL * (it * S + s)
                        self.consume_stage(gY, rW, rY, acc, s, c, toks, t)
                        self.load_w_stage(gW, rW, s, c + KSL * S, n0, t, w_atom)
                for s in cutlass.range_constexpr(S):
                    c = ks + KSL * ((NIT - 1) * S + s)
                    self.consume_stage(gY, rW, rY, acc, s, c, toks, t)

                # K-split partial tiles -> smem (rows = o_proj outputs, cols = tokens)
                for j in cutlass.range_constexpr(tg):
                    for h in cutlass.range_constexpr(2):
                        for q in cutlass.range_constexpr(2):
                            sRed[ks, j * 8 + 2 * t + q, rg * 16 + g + 8 * h] = acc[4 * j + 2 * h + q]
                cute.arch.sync_threads()
                for q in cutlass.range_constexpr(PPT):
                    idx = tid + q * THREADS
                    r = idx % R
                    mm = idx // R
                    if mm < m_tok:
                        v = sRed[0, mm, r]
                        for k2 in cutlass.range_constexpr(1, KSL):
                            v = v + sRed[k2, mm, r]
                        # one bf16 rounding of a (the all-reduce boundary), then the bf16 partial add
                        pn = v.to(BFloat16).to(Float32) + rPart[q]
                        mPo[mm, bid * R + r] = pn.to(BFloat16)
                # release: every thread's p' stores are ordered before thread 0's arrival (v1.5: by the CTA
                # barrier and the release's cumulativity alone, as CUTLASS's barrier arrivals do; v1.2 also fenced
                # in every thread, which waits for each thread's own stores first)
                if const_expr(not lean_sync):
                    cute.arch.fence_acq_rel_gpu()
                cute.arch.sync_threads()
                if tid == 0:
                    cute.arch.atomic_add(mCnt.iterator, Int32(1), sem="release", scope="gpu")
            else:
                # ============================ epilogue role ============================
                mrow = bid - GC
                gB = cute.flat_divide(mBlk, (1, 1, VEC))       # (1, 1, 8, M, NBS, 896)
                gP = cute.flat_divide(mPo, (1, VEC))           # (1, 8, M, 896)
                gX = cute.flat_divide(mX, (1, VEC))
                gU = cute.flat_divide(mU, (VEC,))              # (8, 896)
                gWp = cute.flat_divide(mWp, (VEC,))
                p_atom = cute.make_copy_atom(
                    cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128,
                    load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)   # .cg: p' was written by other SMs
                r8 = cute.make_rmem_tensor(cute.make_layout((VEC,), stride=(1,)), BFloat16)
                rU = cute.make_rmem_tensor(cute.make_layout((VEC,), stride=(1,)), Float32)
                stats = cute.make_rmem_tensor(cute.make_layout((NRED,), stride=(1,)), Float32)
                stats.fill(0.0)
                rM = cute.make_rmem_tensor(cute.make_layout((VPT, VEC), stride=(VEC, 1)), Float32)
                rM.fill(0.0)

                # ---- block statistics: independent of a, computed before the PDL wait
                if const_expr(NB > 0):
                    for rr in cutlass.range_constexpr(VPT):
                        jv = tid + rr * THREADS
                        if jv < NVEC:
                            cute.autovec_copy(gU[None, jv], rU)
                            u = rU.load()
                            for i in cutlass.range_constexpr(NB):
                                cute.autovec_copy(gB[0, 0, None, mrow, i, jv], r8)
                                v = r8.load().to(Float32)
                                stats[2 * i] = stats[2 * i] + (v * u).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                                stats[2 * i + 1] = stats[2 * i + 1] + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                                if const_expr(STAGE):
                                    cute.autovec_copy(r8, sBlk[i * NVEC + jv, None])
                    self.block_sum(stats, 2 * NB, sSum, warp, lane)

                # v1.2 (the default): w_post into registers now, so the last loop's loads do not queue behind its stores
                rWp = cute.make_rmem_tensor(cute.make_layout((VPT, VEC), stride=(VEC, 1)), BFloat16)
                if const_expr(preload_wpost):
                    for rr in cutlass.range_constexpr(VPT):
                        jv = tid + rr * THREADS
                        if jv < NVEC:
                            cute.autovec_copy(gWp[None, jv], rWp[rr, None])

                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()

                # ---- wait until every GEMV CTA published its rows of p'
                if tid == 0:
                    cnt = cute.arch.load(mCnt.iterator, Int32, sem="acquire", scope="gpu")
                    while cnt < GC:
                        cnt = cute.arch.load(mCnt.iterator, Int32, sem="acquire", scope="gpu")
                    if const_expr(not lean_sync):
                        cute.arch.fence_acq_rel_gpu()
                        self.depart(mCnt, GC + m_tok)
                cute.arch.sync_threads()

                # ---- statistics of p'
                pst = cute.make_rmem_tensor(cute.make_layout((2,), stride=(1,)), Float32)
                pst.fill(0.0)
                for rr in cutlass.range_constexpr(VPT):
                    jv = tid + rr * THREADS
                    if jv < NVEC:
                        cute.copy(p_atom, gP[0, None, mrow, jv], r8)
                        cute.autovec_copy(gU[None, jv], rU)
                        v = r8.load().to(Float32)
                        rM[rr, None].store(v)
                        pst[0] = pst[0] + (v * rU.load()).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                        pst[1] = pst[1] + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                self.block_sum(pst, 2, sSum, warp, lane)

                # ---- softmax over the NB + 1 source scores (fp32, every thread redundantly)
                inv_d = Float32(1.0 / D)
                s_p = pst[0] * cute.math.rsqrt(pst[1] * inv_d + eps)
                mx = s_p
                scores = []
                for i in cutlass.range_constexpr(NB):
                    si = stats[2 * i] * cute.math.rsqrt(stats[2 * i + 1] * inv_d + eps)
                    scores.append(si)
                    mx = cute.arch.fmax(mx, si)
                e_p = cute.math.exp(s_p - mx)
                den = e_p
                exps = []
                for i in cutlass.range_constexpr(NB):
                    ei = cute.math.exp(scores[i] - mx)
                    exps.append(ei)
                    den = den + ei
                inv_den = Float32(1.0) / den
                alpha_p = e_p * inv_den

                # ---- m = sum_i alpha_i v_i (fp32), ||m||^2
                mst = cute.make_rmem_tensor(cute.make_layout((1,), stride=(1,)), Float32)
                mst.fill(0.0)
                for rr in cutlass.range_constexpr(VPT):
                    jv = tid + rr * THREADS
                    if jv < NVEC:
                        acc_m = rM[rr, None].load() * alpha_p
                        for i in cutlass.range_constexpr(NB):
                            if const_expr(STAGE):
                                cute.autovec_copy(sBlk[i * NVEC + jv, None], r8)
                            else:
                                cute.autovec_copy(gB[0, 0, None, mrow, i, jv], r8)
                            acc_m = acc_m + r8.load().to(Float32) * (exps[i] * inv_den)
                        rM[rr, None].store(acc_m)
                        mst[0] = mst[0] + (acc_m * acc_m).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                self.block_sum(mst, 1, sSum, warp, lane)
                rstd = cute.math.rsqrt(mst[0] * inv_d + eps)

                # ---- x = bf16(w_post * m * rstd)
                for rr in cutlass.range_constexpr(VPT):
                    jv = tid + rr * THREADS
                    if jv < NVEC:
                        if const_expr(preload_wpost):
                            xv = rWp[rr, None].load().to(Float32) * (rM[rr, None].load() * rstd)
                        else:
                            cute.autovec_copy(gWp[None, jv], r8)
                            xv = r8.load().to(Float32) * (rM[rr, None].load() * rstd)
                        r8.store(xv.to(BFloat16))
                        cute.autovec_copy(r8, gX[0, None, mrow, jv])
                if const_expr(lean_sync):
                    # v1.5: the departure last, where waiting for its result overlaps the stores of x draining
                    # (every epilogue CTA passed its spin before departing, so the last one may re-arm)
                    if tid == 0:
                        self.depart(mCnt, GC + m_tok)

    return OprojAttnRes(), smem_bytes


def _compile(kp: int, n_blocks: int, tg: int, preload_wpost: bool = False, lean_sync: bool = False,
             rows: int = ROWS):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32

    obj, _ = _build(kp, n_blocks, tg, preload_wpost, lean_sync, rows)
    m = cute.sym_int()
    nbs = cute.sym_int()
    fakes = (
        fake_tensor(BFloat16, (m, kp)),                 # y
        fake_tensor(BFloat16, (D, kp)),                 # w_o
        fake_tensor(BFloat16, (m, nbs, D)),             # blocks
        fake_tensor(BFloat16, (m, D)),                  # partial
        fake_tensor(Float32, (D,)),                     # u_mlp
        fake_tensor(BFloat16, (D,)),                    # w_post
        fake_tensor(BFloat16, (m, D)),                  # out_partial
        fake_tensor(BFloat16, (m, D)),                  # out_x
        fake_tensor(Int32, (4,)),                       # arrival counter
    )
    return cute.compile(obj, *fakes, Int32(0), Float32(1e-5), fake_stream(), options=_options(tg))


def _options(tg: int) -> str:
    # A 128-register cap (2 CTAs/SM for tg > 1) was tried: neither launch(min_blocks_per_mp=...)
    # (queries the driver at compile time, so not on a CPU box) nor --ptxas-options maxrregcount
    # changed the ptxas count in 4.8.1. v1 therefore runs 1 CTA/SM (176-186 registers).
    return TVM_FFI


def get_kernel(kp: int, n_blocks: int, m: int, preload_wpost: bool | None = None, lean_sync: bool | None = None,
               split_rows: bool | None = None):
    return _kernel_for_key(compile_key(kp, n_blocks, m), preload_wpost, lean_sync, split_rows)


def _kernel_for_key(key: tuple, preload_wpost: bool | None = None, lean_sync: bool | None = None,
                    split_rows: bool | None = None):
    pre = PRELOAD_WPOST if preload_wpost is None else bool(preload_wpost)
    lean = LEAN_SYNC if lean_sync is None else bool(lean_sync)
    rows = _rows(key[1], key[2], key[3], SPLIT_ROWS if split_rows is None else bool(split_rows))
    return compile_cached(key + (("preload_wpost",) if pre else ()) + (("lean_sync",) if lean else ())
                          + ((f"rows{rows}",) if rows != ROWS else ()),
                          lambda: _compile(key[1], key[2], key[3], pre, lean, rows))


def compile_keys(kp_list: Iterable[int] = KP_SUPPORTED, n_blocks_list: Iterable[int] = range(1, 9),
                 batches: Iterable[int] = (1, 2, 3, 4, 7, 8, 16, 64)) -> list[tuple]:
    keys = []
    for kp in kp_list:
        for nb in n_blocks_list:
            for b in batches:
                k = compile_key(kp, nb, b)
                if k not in keys:
                    keys.append(k)
    return keys


_WS: dict = {}


def _workspace(device):
    import torch
    key = (device.type, device.index)
    buf = _WS.get(key)
    if buf is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("oproj_attnres: call warmup() before CUDA-graph capture (the arrival "
                               "counter must be allocated and zeroed outside the capture)")
        buf = torch.zeros(4, dtype=torch.int32, device=device)
        _WS[key] = buf
    return buf


def warmup(kp_list: Iterable[int] = KP_SUPPORTED, n_blocks_list: Iterable[int] = range(1, 9),
           batches: Iterable[int] = (1, 2, 4, 8, 16, 32, 64), device=None) -> list[tuple]:
    """Compile every key the given shapes need and allocate the per-device counter."""
    keys = compile_keys(kp_list, n_blocks_list, batches)
    for key in keys:
        _kernel_for_key(key)          # the build the default call takes (the module's option defaults)
    if device is not None:
        import torch
        _workspace(torch.device(device))
    return keys


def _check_inputs(y, w_o, blocks, n_blocks, partial, u_mlp, w_post, eps, out_x, out_partial, counter):
    import torch
    check_tensor("y", y, dtype=torch.bfloat16, shape=(None, None))
    dev = y.device
    m, kp = y.shape
    if not (1 <= m <= MAX_M):
        raise ValueError(f"y: batch M must be in 1..{MAX_M}, got {m}")
    if kp not in KP_SUPPORTED:
        raise ValueError(f"y: Kp must be one of {KP_SUPPORTED} (P/t for K3 at TP16, TP8, TP1), got {kp}")
    if not isinstance(n_blocks, int) or isinstance(n_blocks, bool) or not (0 <= n_blocks <= 8):
        raise ValueError(f"n_blocks must be an int in 0..8, got {n_blocks!r}")
    check_tensor("w_o", w_o, dtype=torch.bfloat16, shape=(D, kp), device=dev)
    check_tensor("blocks", blocks, dtype=torch.bfloat16, shape=(m, None, D), device=dev)
    if blocks.shape[1] < max(n_blocks, 1):
        raise ValueError(f"blocks: needs at least {max(n_blocks, 1)} block slots, got {blocks.shape[1]}")
    check_tensor("partial", partial, dtype=torch.bfloat16, shape=(m, D), device=dev)
    check_tensor("u_mlp", u_mlp, dtype=torch.float32, shape=(D,), device=dev)
    check_tensor("w_post", w_post, dtype=torch.bfloat16, shape=(D,), device=dev)
    if out_x is not None:
        check_tensor("out_x", out_x, dtype=torch.bfloat16, shape=(m, D), device=dev)
    if out_partial is not None:
        check_tensor("out_partial", out_partial, dtype=torch.bfloat16, shape=(m, D), device=dev)
    if counter is not None:
        check_tensor("counter", counter, dtype=torch.int32, shape=(4,), device=dev)
    if not (isinstance(eps, (int, float)) and eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a positive finite float, got {eps!r}")
    if dev.type != "cuda":
        raise ValueError(f"oproj_attnres runs on CUDA tensors, got device {dev}")
    if out_x is not None and out_partial is not None and out_x.data_ptr() == out_partial.data_ptr():
        raise ValueError("out_x and out_partial must not alias")
    if out_x is not None and out_x.data_ptr() == partial.data_ptr():
        raise ValueError("out_x must not alias partial")


def oproj_attnres(y, w_o, blocks, n_blocks, partial, u_mlp, w_post, *, eps=1e-5, boundary=False,
                  out_x=None, out_partial=None, counter=None, preload_wpost=None, lean_sync=None, split_rows=None):
    """x_moe, partial_new = post-attention half of a K3 layer's decode step (see module docstring).

    y [M, Kp] bf16, w_o [7168, Kp] bf16, blocks [M, >=n_blocks, 7168] bf16, partial [M, 7168] bf16,
    u_mlp [7168] fp32, w_post [7168] bf16. Returns (x_moe [M, 7168] bf16, partial_new [M, 7168] bf16).
    No host sync; capturable in a CUDA graph after ``warmup``. preload_wpost: v1.2 (None = PRELOAD_WPOST);
    lean_sync: v1.5 (None = LEAN_SYNC); split_rows: v1.6 (None = SPLIT_ROWS; a no-op where _rows keeps 64 rows).
    """
    import torch
    _check_inputs(y, w_o, blocks, n_blocks, partial, u_mlp, w_post, eps, out_x, out_partial, counter)
    m, kp = y.shape
    if out_x is None:
        out_x = torch.empty((m, D), dtype=torch.bfloat16, device=y.device)
    if out_partial is None:
        out_partial = torch.empty((m, D), dtype=torch.bfloat16, device=y.device)
    cnt = counter if counter is not None else _workspace(y.device)
    fn = get_kernel(kp, n_blocks, m, preload_wpost, lean_sync, split_rows)
    fn(y, w_o, blocks, partial, u_mlp, w_post, out_partial, out_x, cnt, 1 if boundary else 0, float(eps))
    return out_x, out_partial
