"""AttnRes mix + input RMSNorm + packed in_proj GEMV with the weights streamed through a bulk-copy shared-memory
ring (rms_gemv v12; the layer's in_proj at M <= 2 since session 16, fast.INPROJ_ENGINE; "fast-infma" is the A/B).

Replaces the same reference ops as ``rms_gemv.attnres_rms_gemv`` at M <= 2 (k3-spec.md section 6 + 4.3 "attn_res
#1", section 5 input_layernorm, section 7.2 step 1: y = bf16(x @ W_in^T) with x = bf16(w_ln * m * rstd(m))), and,
as ``gemv_ring``, the bare GEMV y = x @ W^T (x given) for the benchmark beside cuBLAS and the FMA GEMV.

Version log
-----------
v12 (2026-11-30, session 16; CPU-compiled, measured by h200_next s45)
    Why (ncu5, traces/h200/ncu-b845cf5-ncu5/): cuBLAS's M = 1 GEMV on the in_proj's bytes is nvjet_sm90_tst_64x8,
    a TMA + WGMMA kernel: ~100 CTAs of 384 threads, each with a 164 KB shared-memory pipeline. It reads the 90 MB
    rank8 in_proj in 28.0 us (3.31 TB/s) and the 46 MB rank16 one in 16.6 us (2.92 TB/s), issuing 1.3-2.3 M warp
    instructions. Our FMA GEMVs (rms_gemv v6, 16-byte register loads) take 33.1 / 20.4 us and issue 13.4 / 6.8 M;
    the fused in_proj 31.1 us at rank8. Session 11 (v8-v10) showed that the FMA loop is not issue-bound and that
    more loads per lane or deeper L2 prefetch do not help: each SM streams ~25 GB/s with ~57 KB in its registers.
    The TMA unit keeps a whole ring of ~200 KB per SM in flight without a register or an LSU slot for any of it.
    Design: one CTA per SM (grid min(132, N / 2)), 16 warps. CTA b owns the contiguous rows [2 p0, 2 p1) of W
    (pairs split evenly over the grid), so its weights are one contiguous byte range, streamed in chunks of two
    rows (2 x K x 2 bytes = 28 KB at K = 7168) by cp.async.bulk (1-D, no tensor map) into a ring of D slots, each
    with a "full" mbarrier (the producer's arrive.expect_tx + the copy's complete_tx) and an "empty" one (one
    arrive per consumer warp).
    * Warp 14 is the producer (one elected lane). Warps 0-13 are consumers: warp w takes row w // 7 of each chunk
      and the w % 7-th seventh of its k range (VPL = K / 1792 16-byte vectors per lane, 4 at K = 7168; lanes read
      consecutive vectors, so each LDS.128 phase is conflict-free). Warp 15 only joins the prologue.
    * Before the PDL wait the producer fills the D1 slots that do not overlap the prologue's source staging (the
      weights do not depend on the predecessor). The AttnRes prologue (rms_gemv's, unchanged, all 16 warps) stages
      its n_blocks + 1 source rows in the ring's later slots; after its closing barrier (and a proxy fence, since
      the bulk copies then overwrite what generic loads read) the producer fills the rest and keeps the ring full.
    * Each consumer lane holds its x vectors in registers (8 VPL x M fp32), so the loop reads only weights from
      shared memory: VPL LDS.128, 8 VPL x M FMAs, the 8-wide sum, a warp butterfly, one fp32 partial per (chunk,
      row, seventh, token) into shared memory, and lane 0's release of the slot. The 7 partials of a row are added
      in a fixed order after the loop (deterministic; not bit-identical to v6, whose K split is 4 slices).
    Bytes: the same as the fused kernel (weights once, x / sources from L2).
    Prediction (written before any GPU run): gemv_in_proj_plain@ring at rank16 / rank8 b1 ~15-16.5 / ~25-27 us
    in the kernel bench (FMA v6 22.4 / 34.3, cuBLAS 19.9 / 27.0 in s43); the fused in_proj in the layer (flushed
    timeline, rank16 b1) 19.5-20 -> ~15-16.5 us, so the attention half rank16 b1 33.5 -> ~29-31 us and rank8 b1
    47.6 -> ~43-45 us (1.8x stock needs ~42.8). If the bare ring GEMV is not faster than v6 in the kernel bench,
    the per-SM rate is not set by how the bytes are requested, and the TMA engine is not the lever for the
    attention half.
    Measured (s45 at afcdadf, kernels- / records-afcdadf-s45.json, ncu-afcdadf-ncu7/; GPU tests 50 passed, copy
    4.22 TB/s). Kernel bench, us (the FMA kernels v6 / cuBLAS's bare GEMV in the same run):
                              rank16 b1   rank16 b2   rank8 b1   rank8 b2
        gemv_in_proj_plain@ring  16.9        17.8        26.1       27.2     (FMA 22.2 / 26.6 / 34.3 / 35.6;
                                                                              cuBLAS 19.3 / 19.9 / 29.8 / 28.9)
        attnres_rms_gemv@ring    18.2        21.4        28.4       31.8     (fused FMA 22.9 / 27.7 / 33.3 / 38.6)
    The bare ring reads the rank8 in_proj at 3.45 TB/s (82 % of copy), past cuBLAS's 3.0 in the same run: met, and
    the prediction's range held (15-16.5 / 25-27). ncu: rank8 26.4 us, DRAM 73 % busy (the FMA GEMV 58 %), 3.1 M
    warp instructions at rank16 against 6.8 M, 86 registers. Attention half (fast / fast-inring, stock in the same
    run): rank16 b1 33.5 -> 31.5 us (stock 66.2), b2 38.1 -> 33.9 (72.9); rank8 b1 47.4 -> 45.9 (78.0), b2 53.0 ->
    48.4 (85.6). Predicted rank16 b1 ~29-31, rank8 b1 ~43-45: both missed by ~1 us, because in the layer the
    KDA step and o_proj took ~3 us longer after this kernel than after the FMA one (the timeline: the KDA CTAs,
    launched by the early trigger, sit beside the ring's CTAs from 2.5 us; after the ring ends the KDA step needs
    7.2 us instead of 5.8 and o_proj 9.9 after it instead of 8.2). The default at M <= 2 since s46 (fast.INPROJ_ENGINE;
    s46 at d9e6f60 repeated it: rank16 b1 / b2 31.5 / 34.1 against fast-infma 33.6 / 38.0, rank8 45.8 / 50.3
    against 47.6 / 52.9). The whole layer at rank8 b1 was 1.3-1.5 us slower than with the FMA in_proj in both runs
    (109.2 against 107.9 in s46): the MoE front, PDL-launched by o_proj, ends later; not explained yet.
v12.1 (written in session 16, measured at s47, the default since; impl "fast-ringlate": FastImpl
    inproj_early_trigger=False) The ring launches the KDA step at its end instead of after its wait. Prediction: if the KDA CTAs sitting beside the ring from its
    start are what slows the chain after it, rank8 b1 attention half 45.8 -> ~44-45 us and the rank8 layer back to
    the FMA in_proj's; if not, within +-0.5 us.
    Measured (records-8574eb7-s47.json, one run beside stock; attention half, us, fast -> fast-ringlate): rank8 b1
    45.4 -> 43.1 (stock 78.5: 1.82x), b2 47.8 -> 48.3 (84.2); rank16 b1 31.6 -> 30.7 (66.2: 2.16x), b2 34.3 -> 33.8
    (73.3). Whole layer: rank8 b1 108.5 -> 103.5, b2 120.5 -> 119.5; rank16 b1 87.0 -> 84.3, b2 94.8 -> 93.4. The
    prediction held at b1 and past it (rank8 -2.3 us; the layer -5.0, below fast-infma's 107.7, so s45-s46's slower
    rank8 layer was this trigger too); rank8 b2 +0.5 is inside the spread. In the rank8 b1 timeline the KDA step now
    takes 6.0 us after the ring (7.2 with the early trigger in s46) and o_proj ends 8.6 us after it (9.6).
    EARLY_TRIGGER = False since; "fast-ringearly" is the A/B.
v12.2 (session 17; joint / JOINT_PROLOGUE, measured as "fast-injoint" at s48, the default since, "fast-nojoint" the
    A/B) The AttnRes prologue of both tokens in one pass at M = 2 (rms_gemv._attnres_tokens): one round of source loads, one
    CTA barrier per reduction for both tokens (5 barriers instead of 7 in the PTX), and w_ln loaded with u at the
    start instead of after the second reduction (at M = 1 that is the only change). Each token's arithmetic and
    its order are the token-by-token prologue's: bit-identical (GPU test test_joint_prologue_is_bit_identical).
    Both tokens' source rows are staged at once, so where they do not fit beside two prefilled ring slots (M = 2,
    n_blocks >= 4 at K = 7168) the key falls back to the token-by-token prologue (joint_applies). At M = 2,
    n_blocks 1 one slot fewer is filled before the wait (4 of 6 at rank8). 128 registers at M = 2, no spills.
    Why: the kernel bench (s45) puts the fused ring above the bare one by 1.3 / 2.3 us at b1 (rank16 / rank8) and
    3.6 / 4.6 at b2: the second token's prologue runs after the first's, each a chain of two L2 round trips and
    two CTA barriers after the PDL wait, with the HBM stream of the CTA stalled once the prefilled slots are read.
    Prediction: bench attnres_rms_gemv@ringjoint against @ring -1.5 to -2.5 us at b2, -0.2 to -0.6 at b1;
    attention half (fast-injoint against fast) the same, so rank8 b2 ~48 -> ~46 us (1.8x stock needs ~46.8). If b2
    does not move, the prologue's cost is its L2 reads' bandwidth, not its latency chain.
    Measured (kernels- / records-d8196e2-s48.json, records-5f15bc1-s49.json; GPU tests at s49: bit-identical at M 1
    / 2, n_blocks 0 / 1 / 3 / 8, both widths, and in a graph). Bench @ring -> @ringjoint: rank16 b1 18.2 -> 18.4 us,
    b2 22.1 -> 21.3; rank8 b1 28.5 -> 28.2, b2 31.8 -> 30.8. Attention half (fast -> fast-injoint, s48; fast-nojoint
    -> fast, s49): rank8 b1 -0.5 / -0.2, b2 -1.0 / -0.8; rank16 b1 -0.4 / -0.3, b2 -0.5 / -0.4. Half the predicted
    gain at b2: about half of the second token's cost was its serial chain; the rest, by the rule above, is not
    (not measured further).
v13 (session 20; RingMmaGemv / gemv_ring_mma, opt-in: fast.INPROJ_MID / OPROJ_MID, impls "fast-inmma",
    "fast-inmmaet", "fast-opmma", "fast-mid"; CPU-compiled, measured by h200_next s62)
    Why: at M 3..8 the layer's in_proj is attnres_rmsnorm (one CTA per token) + cuBLAS's nvjet 64x8, and o_proj
    cuBLAS + the AttnRes #2 kernel. In s59's rank8 b8 attention half (56.5 us against stock's 93.1: 1.65x, the
    1.8x target needs 51.7) the norm takes 0-4.3 us, the cuBLAS in_proj 4.9-32.2 (27.3 us for 90 MB, 3.3 TB/s),
    and the KDA step starts at 33.0: a cuBLAS launch is not PDL-chained, so no weight byte moves while the norm's
    8 CTAs run on 8 of 132 SMs, and each boundary costs ~0.6-0.8 us of launch gap. The M <= 2 ring's FMA consumer
    holds x in registers (8 vectors x M fp32 per lane), which does not scale to M = 8.
    Design: the same producer / consumer ring with a tensor-core consumer. One CTA per SM (grid min(132, T) over the
    T = N / 16 row tiles, split evenly: the busiest CTA takes ceil(T / G), 2 at rank16, 3 at rank8), 8 consumer
    warps + 1 producer warp. A ring chunk is one 16-row tile x KC columns (KC = 512 at K = 7168, 256 at K = 768),
    16 row pieces of 1 KB, each its own 1-D cp.async.bulk onto one "full" mbarrier; staged rows are padded by 64 B
    so that the two rows of a quad phase of 16-byte loads sit in different bank halves. The first D chunks are
    requested before the PDL wait; after it the producer stages x (M rows of 14 KB, bulk copies from L2) and keeps
    the ring full. Consumer warp w takes k32 steps [2w, 2w + 2) of every chunk: per step two 16-byte loads of
    weight rows g and g + 8 and one of x's token g (rms_gemv's swap-AB fragments and K permutation,
    _dsl.swapab_a_fragment), two mma.sync m16n8k16; tokens past M read token M - 1's row, finite columns the store
    skips. After the ring the 8 warps' fp32 tile partials are added in warp order (deterministic). 36-44
    registers, no spills (ptxas 12.9). The norm kernel gets an early-trigger build (attnres_rmsnorm early_trigger,
    its own compile key; v11.1 had the same at 6874cfa) so that the ring's CTAs can fill their slots on the SMs
    the M norm CTAs leave idle (with the trigger at its end, the ring only gains its pace and the launch gaps).
    Prediction (written before any GPU run; s62 beside stock):
      * bench: gemv_in_proj_plain@ringmma against cuBLAS F.linear at b4 / b8: rank8 ~25-26.5 us (the M <= 2
        ring's 3.45 TB/s on 90 MB; cuBLAS ~27-29), rank16 ~14.5-17 (46 MB). attnres_rms_gemv@ringmmaet against
        the norm + cuBLAS pair: -4 to -7 us at rank8, -3 to -6 at rank16; @ringmma (norm trigger at its end) -1.5
        to -3.5.
      * attention half, fast-inmmaet against fast: rank8 b8 56.5 -> ~49-51 us (1.8x stock needs ~51.7), rank16
        b8 41.8 -> ~34-36, b4 about the same gains; fast-inmma half of that. fast-opmma (o_proj's GEMV on v13,
        7.5 us on cuBLAS at rank8 b8): -0.5 to -2. fast-op8 (oproj_attnres's fused FMA GEMV up to M = 8, unmeasured
        at b8 since session 5): no prediction beyond +-3 us; it is the control of the fused o_proj at M = 8.
      * Decision rule: INPROJ_MID = "ring" (with INPROJ_MID_EARLY = True if fast-inmmaet beats fast-inmma) if its
        attention half is faster than fast in all four cells (b4 / b8 x rank16 / rank8) and the GPU tests pass;
        OPROJ_MID likewise from fast-mid against fast-inmmaet.
    Measured (s62 at 4d058c5, kernels- / records-4d058c5-s62.json, one run beside stock, copy 4.19 TB/s; GPU tests
    64 passed, 4 skipped): kernel rows, us (cuBLAS in the same run):
                                     rank16 b4   rank16 b8   rank8 b4   rank8 b8
        gemv_in_proj_plain@ringmma      --          19.1        28.3       29.3     (cuBLAS 20.5 / 28.1 / 29.0)
        attnres_rms_gemv@ringmma       22.4        23.2        32.1       33.9     (norm + cuBLAS 24.7 / 25.2 /
        attnres_rms_gemv@ringmmaet     20.9        21.8        30.7       32.5      33.3 / 33.9)
        gemv_o_proj_plain@ringmma       9.6        10.0        12.4       12.8     (cuBLAS 8.7 / 8.5 / 11.4 / 11.1)
    Attention half (stock / fast / inmma / inmmaet / opmma / mid / op8): rank8 b8 92.5 / 56.1 / 55.6 / 54.5 / 54.1 /
    53.0 / 53.1; rank16 b8 79.5 / 41.0 / 39.8 / 38.5 / 40.3 / 37.3 / 38.3; rank8 b4 87.7 / 50.0 / 48.5 / 46.4 / -- /
    46.8 / --; rank16 b4 74.8 / 36.7 / 34.5 / 33.0 / -- / 33.1 / -- (o_proj at b4 is oproj_attnres in all).
    The decision rule is met (fast-inmmaet below fast in all four cells, tests passed): INPROJ_MID = "ring" with
    the early trigger is the default since. The prediction is missed at b8: -1.6 / -2.5 us at rank8 / rank16, not
    -5.5 to -7.5 / -5 to -8; met at b4 (-3.6 / -3.7). Why, from the timelines and rows: the ring streams at
    3.1 TB/s (29.3 us for 90 MB bare, no faster than cuBLAS), against the M <= 2 ring's 3.45, and the norm kernel
    stretches from 3.8 to 5.2 us while the ring fills beside it (v11.1's lesson again). With 115 KB of x in shared
    memory v13 keeps 5 slots (87 KB) in flight per SM where the M <= 2 ring keeps ~200 KB. On its own, o_proj's
    GEMV is slower on v13 than on cuBLAS (1.4-1.7 us), yet fast-opmma gains 2.0 us at rank8 b8 in the layer (PDL
    behind the KDA step); fast-op8 (the fused oproj_attnres at M 5..8) gains 3.0 / 2.7 at b8.
v13.1 (session 20, measured wrong at s63 and removed; the code is at c5137f8) x's B fragments in the consumer warps'
    registers (28 16-byte vectors per lane at K = 7168, 152 registers) so that the ring held 12 slots instead of 5.
    Predicted: bench rank8 b8 29.3 -> ~26-27 us. Measured (kernels- / records-c5137f8-s63.json, logs/*-c5137f8-s63.*):
    28.9 against v13's 29.4 in the same run (rank16 b8 18.3 / 18.9), so the deeper ring bought ~0.5 us, and its
    results were WRONG: 13 GPU test failures, all at K = 7168 on grids whose CTAs take 2-3 tiles (rel-RMSE 1.7-5.9 %
    against fp32 at M >= 4; 1.1 % in the attention half's recurrent state at b7 rank16), while the same build matched
    v13 bit for bit in another test of the same run at M = 8: nondeterministic. The PTX keeps every shared load after
    its full-barrier wait and every empty arrival after the loads' MMAs; the cause was not found in the session. Not
    the default, not kept; v13 (x in shared memory) is what the layer runs.
v14 (session 21; gemv_ring_mma on an MmaTiledWeight, mma_tile_weight; opt-in: fast.INPROJ_MID_TILED, impl
    "fast-intiled"; CPU-compiled, measured by h200_next s65)
    Why: v13 streams the rank8 in_proj at b8 in 29.3 us (s62), the M <= 2 ring (v12) the same 90 MB at b1 in 26.0
    (s48), and both give each CTA the same bytes (rank8: 393 tiles over 132 CTAs, 3 at most, 2.98 on average; v12's
    row pairs 24 at most). v13.1 had as many bytes in flight as v12 (12 slots, ~209 KB) and was still 28.9. What
    differs is the request: v12 copies 28 KB contiguous runs, v13 a chunk as 16 row pieces of 1 KB, 14 KB apart (688
    bulk copies per CTA instead of 24; cuBLAS's TMA tiles, 3.0-3.3 TB/s, are also many short row pieces).
    Design: mma_tile_weight re-lays W once, on the host, so that each ring chunk (16 rows x KC columns) is one
    contiguous 16 KB run, ordered as the consumer lanes read it: per k32 step kk and half h, lane (g, c)'s 16 bytes
    of row 8 h + g at columns 32 kk + 8 c, so that a warp's load is 512 contiguous bytes (no bank conflict without
    the rows' 64 B padding, hence a slot of 16 KB instead of 17 KB: 6 slots at rank8 b8 instead of 5). One bulk
    copy per chunk; the consumer's fragments, MMAs and sums are v13's, so the result is v13's bit for bit. The layer
    keeps the row-major in_proj for the M <= 2 ring and cuBLAS, so FastImpl holds a second copy (+90 MB at rank8).
    Prediction (written before any GPU run; s65): if the 1 KB pieces are what holds v13 back, the bare GEMV at
    rank8 b8 29.3 -> ~26.5 us (v12's pace), b4 28.3 -> ~26; rank16 b8 19.1 -> ~17.5 (its tile imbalance, 201 tiles
    over 132 CTAs, 1.52 on average and 2 at most, stays); the attention half fast-intiled against fast: rank8 b4 / b8
    -2 to -3 us, rank16 -1 to -2. Within +-0.5 us: the piece size is not the limit, and the gap to v12 is elsewhere
    (x staged before the first MMA, the consumers' per-chunk barrier).
    Measured (s66 at 2c88954, kernels- / records-2c88954-s66.json; GPU tests 40 passed, v14 = v13 bit for bit; s65 at
    c23e108 ran a build whose weight operand was 32 KC wide, so every call was refused at its argument check): bare
    GEMV v13 -> v14 rank8 b8 29.5 -> 28.6 us, b4 28.1 -> 27.4, rank16 b8 19.4 -> 18.7; attention half fast ->
    fast-intiled rank8 b8 51.8 -> 50.8 (s66), 51.5 -> 51.3 (s67), 51.6 -> 50.5 (s68); rank16 b8 -1.2 / -1.2 / -0.7;
    b4 -0.2 to -1.0. Missed: the 1 KB pieces were ~0.7 us of the gap (b4, 9 slots in both) and one more slot ~0.3
    (b8); the rest of the gap to v12 is not the request size. Opt-in: the layer would hold the in_proj twice.

Contracts
---------
  * W, u and w_ln are read before griddepcontrol_wait (weights); blocks, partial and delta after it.
  * M <= 2 (x of both tokens in registers); N a positive multiple of 16; K a multiple of 1792 (7 warps x 32
    lanes x 8); one CTA per SM with ~227 KB of shared memory (it cannot share an SM with another CTA).
  * Deterministic: a fixed K split and summation order per row, whatever the grid.
  * v13 / v14 (gemv_ring_mma): M <= 8, K a multiple of 256, at most MMA_TILES_MAX tiles per CTA (mma_applicable:
    the rank16 / rank8 in_proj and o_proj, not full width); W only before the PDL wait, x after it; one CTA per SM.
    v14 reads W only through an MmaTiledWeight (a distinct type, so that a row-major W cannot be taken for one).
"""

from __future__ import annotations

import math

from ._dsl import (SMEM_PER_CTA_MAX, TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, gemv_operands,
                   import_cute)

NUM_SMS = 132
# v12.1 (the default since s47): the layer's ring launches its dependent (the KDA step) after its last store, not
# right after its wait; the version log says why.
EARLY_TRIGGER = False
# v12.2 (the default since s48; "fast-nojoint" is the A/B): the AttnRes prologue of both tokens in one pass at M = 2,
# w_ln loaded with u
JOINT_PROLOGUE = True
WARPS = 16
WPR = 7                  # consumer warps per weight row (each takes a seventh of K)
RPC = 2                  # weight rows per ring chunk
CONSUMERS = WPR * RPC    # warps 0..13
PRODUCER = CONSUMERS     # warp 14
MAX_M = 2
K_UNIT = WPR * 32 * 8    # K must be a multiple: 7 warps x 32 lanes x one 16-byte vector
SMEM_SLACK = 1024        # alignment padding of the shared-memory allocations


def grid_for(N: int) -> int:
    return min(NUM_SMS, N // RPC)


def chunks_max(N: int) -> int:
    """The most two-row chunks any CTA of the grid takes (sizes the partial-sum buffer): CTA b takes pairs
    [b P / G, (b + 1) P / G), so the largest share is ceil(P / G)."""
    return -(-(N // RPC) // grid_for(N))


def ring_plan(MB: int, K: int, nb: int, cmax: int, fused: bool, joint: bool = False) -> tuple[int, int]:
    """(D, D1): ring slots that fit the CTA's shared memory next to the other buffers, and how many of them the
    producer may fill before the AttnRes prologue (the others hold the prologue's staged source rows: one token's
    n_blocks + 1 rows, or every token's with the joint prologue, v12.2)."""
    cb = RPC * K * 2
    nm = MB if joint else 1                                          # tokens whose sources are staged at once
    fixed = 2 * 8 * 16 + cmax * RPC * WPR * MB * 4 + SMEM_SLACK     # mbarriers (D <= 16), partial sums, padding
    if fused:
        fixed += MB * K * 2 + WARPS * 2 * (nb + 1) * 4 * nm + WARPS * 4 * nm
    D = min(16, (SMEM_PER_CTA_MAX - fixed) // cb)     # 16 slots are plenty at any K; the mbarrier bound above
    D1 = D - (math.ceil(nm * (nb + 1) * K * 2 / cb) if fused else 0)
    if D < 2 or D1 < 1:
        raise ValueError(f"rms_gemv_ring: shared memory holds {D} ring slots of {cb} B ({D1} before the prologue) at "
                         f"K={K}, n_blocks={nb}, M={MB}: needs >= 2 and >= 1")
    return D, D1


def joint_applies(MB: int, K: int, nb: int, cmax: int) -> bool:
    """v12.2: the joint prologue runs where every token's source rows fit in the ring beside at least two slots
    filled before the prologue (at M = 2, K = 7168: n_blocks <= 3); elsewhere the tokens run one by one."""
    try:
        return ring_plan(MB, K, nb, cmax, True, joint=True)[1] >= 2
    except ValueError:
        return False


def _build_kernel_class():
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int64, const_expr
    from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_shared_cluster_global
    from . import rms_gemv

    ADD = cute.ReductionOp.ADD
    prologue = rms_gemv._kernels()[4].prologue     # the AttnRes mix + RMSNorm of one token, by the whole CTA
    prologue_tokens = rms_gemv._kernels()[4].prologue_tokens      # ... of several tokens at once (v12.2)

    class RingGemv:
        def __init__(self, MB, K, cmax, fused, nb=0, has_delta=False, bw=-1, eps=1e-5, early_trigger=False,
                     joint=False):
            self.MB, self.K, self.cmax, self.fused = MB, K, cmax, fused
            self.nb, self.has_delta, self.bw, self.eps = nb, has_delta, bw, eps
            self.early_trigger = early_trigger
            self.joint = joint
            self.nwarps, self.nthreads = WARPS, 32 * WARPS          # read by the shared prologue
            self.vpt = -(-(K // 8) // self.nthreads)
            self.vpl = K // K_UNIT
            self.cb = RPC * K * 2
            self.D, self.D1 = ring_plan(MB, K, nb, cmax, fused, joint)

        @cute.jit
        def __call__(self, mX, mW, mY, mBlocks, mP, mD, mPout, mU, mWln, stream):
            N = cute.size(mW, mode=[0])
            grid = cutlass.min(N // RPC, NUM_SMS)
            self.kernel(mX, mW, mY, mBlocks, mP, mD, mPout, mU, mWln).launch(
                grid=[grid, 1, 1], block=[self.nthreads, 1, 1], stream=stream, use_pdl=True,
                preferred_smem_carveout=100)

        @cute.kernel
        def kernel(self, mX, mW, mY, mBlocks, mP, mD, mPout, mU, mWln):
            tid = cute.arch.thread_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bid = cute.arch.block_idx()[0]
            nblk = cute.arch.grid_dim()[0]
            N = cute.size(mW, mode=[0])
            K = self.K
            D, D1, CB = self.D, self.D1, self.cb
            P = N // RPC
            p0 = bid * P // nblk
            nch = (bid + 1) * P // nblk - p0

            smem = cutlass.memory.SmemAllocator()
            mbar = smem.allocate_array(Int64, 2 * D)                # full[0..D), empty[D..2D)
            sPart = smem.allocate_tensor(Float32, cute.make_layout((self.cmax, RPC, WPR, self.MB),
                                                                   stride=(RPC * WPR * self.MB, WPR * self.MB,
                                                                           self.MB, 1)), 16)
            # the ring as 16-byte vectors: slot s, row rr, vector kv at [:, s * RPC * K / 8 + rr * K / 8 + kv]
            sRing = smem.allocate_tensor(BFloat16, cute.make_layout((8, D * CB // 16), stride=(1, 8)), 128)
            if tid == 0:
                for s in cutlass.range_constexpr(D):
                    cute.arch.mbarrier_init(mbar + s, 1)
                    cute.arch.mbarrier_init(mbar + D + s, CONSUMERS)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

            is_producer = warp == PRODUCER
            # weights do not depend on the predecessor: the first D1 slots fill before the PDL wait
            if is_producer:
                with cute.arch.elect_one():
                    for c in cutlass.range(cutlass.min(D1, nch)):
                        self.issue(mW, sRing, mbar, c, p0 + c)
                cute.arch.sync_warp()

            if const_expr(self.fused):
                sX = smem.allocate_tensor(BFloat16, cute.make_layout((self.MB, K), stride=(K, 1)), 16)
                nm = self.MB if const_expr(self.joint) else 1
                sRedA = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 2 * (self.nb + 1) * nm),
                                                                       stride=(2 * (self.nb + 1) * nm, 1)), 16)
                sRedB = smem.allocate_tensor(Float32, cute.make_layout((WARPS, nm), stride=(nm, 1)), 16)
                # the prologue's source rows live in ring slots D1.., which the producer fills only after it
                sV = cute.make_tensor(sRing[None, D1 * CB // 16].iterator,
                                      cute.make_layout((nm * (self.nb + 1), K), stride=(K, 1)))
                cute.arch.griddepcontrol_wait()
                if const_expr(self.early_trigger):
                    cute.arch.griddepcontrol_launch_dependents()
                gXs = cute.flat_divide(sX, (1, 8))
                if const_expr(self.joint):
                    # v12.2: both tokens in one pass (one round of source loads, one barrier per reduction, w_ln
                    # loaded with u); bit-identical to the token-by-token prologue below
                    prologue_tokens(self, tuple(range(self.MB)), mBlocks, mP, mD, mPout, mU, mWln, gXs, sV, sRedA,
                                    sRedB, tid, warp, lane, bid == 0, True)
                else:
                    for m in cutlass.range_constexpr(self.MB):
                        prologue(self, m, mBlocks, mP, mD, mPout, mU, mWln, gXs, sV, sRedA, sRedB, tid, warp, lane,
                                 bid == 0)
                cute.arch.sync_threads()
                gX = gXs
            else:
                cute.arch.griddepcontrol_wait()
                if const_expr(self.early_trigger):
                    cute.arch.griddepcontrol_launch_dependents()
                gX = cute.flat_divide(mX, (1, 8))

            rr = warp // WPR
            kv0 = (warp - rr * WPR) * (32 * self.vpl) + lane
            if is_producer:
                with cute.arch.elect_one():
                    if const_expr(self.fused):
                        # the slots about to be overwritten by the async proxy were last read by generic loads
                        cute.arch.fence_proxy("async.shared", space="cta")
                    for c in cutlass.range(D1, nch):
                        s = c % D
                        if c >= D:
                            cute.arch.mbarrier_wait(mbar + D + s, (c // D - 1) % 2)
                        self.issue(mW, sRing, mbar, s, p0 + c)
                cute.arch.sync_warp()
            elif warp < CONSUMERS:
                rX = cute.make_rmem_tensor(cute.make_layout((8, self.vpl, self.MB), stride=(1, 8, 8 * self.vpl)),
                                           Float32)
                rT = cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), BFloat16)
                for m in cutlass.range_constexpr(self.MB):
                    for u in cutlass.range_constexpr(self.vpl):
                        cute.autovec_copy(gX[0, None, m, kv0 + 32 * u], rT)
                        rX[None, u, m].store(rT.load().to(Float32))
                rWs = [cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), BFloat16) for _ in range(self.vpl)]
                acc = cute.make_rmem_tensor(cute.make_layout((8, self.MB), stride=(1, 8)), Float32)
                base = rr * (K // 8) + kv0
                for c in cutlass.range(nch):
                    s = c % D
                    cute.arch.mbarrier_wait(mbar + s, (c // D) % 2)
                    vb = s * (RPC * K // 8) + base
                    for u in cutlass.range_constexpr(self.vpl):
                        cute.autovec_copy(sRing[None, vb + 32 * u], rWs[u])
                    acc.fill(0.0)
                    for u in cutlass.range_constexpr(self.vpl):
                        wv = rWs[u].load().to(Float32)
                        for m in cutlass.range_constexpr(self.MB):
                            acc[None, m].store(acc[None, m].load() + rX[None, u, m].load() * wv)
                    for m in cutlass.range_constexpr(self.MB):
                        t = cute.arch.warp_reduction_sum(acc[None, m].load().reduce(ADD, Float32(0.0), 0))
                        if lane == 0:
                            sPart[c, rr, warp - rr * WPR, m] = t
                    # the butterfly above consumed every lane's loads of slot s: release it
                    if lane == 0:
                        cute.arch.mbarrier_arrive(mbar + D + s)
            cute.arch.sync_threads()
            # the 7 partials of each row in a fixed order
            for idx in cutlass.range(tid, nch * RPC * self.MB, self.nthreads):
                c = idx // (RPC * self.MB)
                rem = idx - c * (RPC * self.MB)
                r2 = rem // self.MB
                m = rem - r2 * self.MB
                tot = Float32(0.0)
                for q in cutlass.range_constexpr(WPR):
                    tot = tot + sPart[c, r2, q, m]
                mY[m, (p0 + c) * RPC + r2] = tot.to(mY.element_type)
            if const_expr(not self.early_trigger):
                cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def issue(self, mW, sRing, mbar, s, pair):
            """Chunk `pair` (rows 2 pair, 2 pair + 1: contiguous) into ring slot s, completing on full[s]."""
            cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, self.cb)
            src = cute.flat_divide(mW, (1, 8))[0, None, pair * RPC, 0].iterator
            cp_async_bulk_shared_cluster_global(sRing[None, s * (self.cb // 16)].iterator, src, mbar + s, self.cb)

    return cutlass, cute, RingGemv



# ------------------------------------------------------------------------------------------------ v13: M 3..8
# The in_proj above the fused ring's M <= 2 ran attnres_rmsnorm + cuBLAS (nvjet 64x8, not PDL-launched). v13 is the
# GEMV half of that pair through the same kind of ring, with a tensor-core consumer (version log, v13).
MMA_MAX_M = 8            # x of every token staged in shared memory (8 x 14 KB at K = 7168) beside the ring
MMA_CONSUMERS = 8        # consumer warps; warp 8 is the producer
MMA_PAD = 64             # bytes added to each staged row: rows g and g+1 of a quad phase land 64 B apart (no conflict)


def mma_kc(K: int) -> int:
    """Columns of W per ring chunk (16 rows x KC): a divisor of K, a multiple of 8 warps x 32."""
    for kc in (512, 256):
        if K % kc == 0:
            return kc
    raise ValueError(f"rms_gemv_ring (mma): K must be a multiple of 256, got {K}")


def mma_tiles_max(N: int) -> int:
    """The most 16-row tiles any CTA takes: CTA b owns tiles [b T / G, (b + 1) T / G), G = min(132, T)."""
    T = N // 16
    return -(-T // min(NUM_SMS, T))


def mma_plan(MB: int, K: int, tmax: int, tiled: bool = False) -> tuple[int, int]:
    """(KC, D): the chunk width and the ring slots that fit beside x (MB padded rows) and the partial sums. A tiled
    weight's chunk (v14) is staged as it lies in memory, without the rows' padding."""
    kc = mma_kc(K)
    slot = 16 * (2 * kc + (0 if tiled else MMA_PAD))
    fixed = MB * (2 * K + MMA_PAD) + MMA_CONSUMERS * tmax * 16 * 8 * 4 + 8 * (2 * 16 + 1) + SMEM_SLACK
    D = min(16, (SMEM_PER_CTA_MAX - fixed) // slot)
    if D < 2:
        raise ValueError(f"rms_gemv_ring (mma): {D} ring slots of {slot} B fit beside x at M={MB}, K={K}: needs >= 2")
    return kc, D


MMA_TILES_MAX = 4        # the consumer loop is unrolled over a CTA's tiles: the K3 in_proj / o_proj at TP 8-16


def mma_applicable(M: int, K: int, N: int, tiled: bool = False) -> bool:
    """Whether v13 / v14 serves this GEMV: M <= 8, K a multiple of 256, at most MMA_TILES_MAX tiles per CTA and x
    beside at least two ring slots (not at full width: K = 12288 or N = 49376)."""
    if not 1 <= M <= MMA_MAX_M or K % 256 or N % 16 or N == 0 or mma_tiles_max(N) > MMA_TILES_MAX:
        return False
    try:
        mma_plan(mma_bucket(M), K, mma_tiles_max(N), tiled)
    except ValueError:
        return False
    return True


def _build_mma_class():
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int64, const_expr
    from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_shared_cluster_global
    from ._dsl import swapab_a_fragment

    class RingMmaGemv:
        """y = x W^T for M <= 8: W in 16-row x KC chunks through a bulk-copy ring, x staged once, mma.sync.
        tiled (v14): W as mma_tile_weight lays it out, each chunk one contiguous run in fragment order."""

        def __init__(self, MB, K, tmax, early_trigger=False, tiled=False):
            self.MB, self.K, self.tmax, self.early_trigger, self.tiled = MB, K, tmax, early_trigger, tiled
            self.kc, self.D = mma_plan(MB, K, tmax, tiled)
            self.nkc = K // self.kc
            self.spw = self.kc // 32 // MMA_CONSUMERS      # k32 steps of a chunk per consumer warp
            self.rs_v = (2 * self.kc + (0 if tiled else MMA_PAD)) // 16    # staged row stride in 16-byte vectors
            self.slot_v = 16 * self.rs_v
            self.xs_v = (2 * K + MMA_PAD) // 16
            self.nthreads = 32 * (MMA_CONSUMERS + 1)

        def tiles(self, mW):
            """T, the 16-row tiles of W: a tiled weight holds a row per chunk, NKC per tile."""
            return cute.size(mW, mode=[0]) // (self.nkc if self.tiled else 16)

        @cute.jit
        def __call__(self, mX, mW, mY, stream):
            T = self.tiles(mW)
            self.kernel(mX, mW, mY).launch(grid=[cutlass.min(T, NUM_SMS), 1, 1], block=[self.nthreads, 1, 1],
                                           stream=stream, use_pdl=True, preferred_smem_carveout=100)

        @cute.kernel
        def kernel(self, mX, mW, mY):
            tid = cute.arch.thread_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bid = cute.arch.block_idx()[0]
            nblk = cute.arch.grid_dim()[0]
            M = cute.size(mX, mode=[0])
            T = self.tiles(mW)
            t0 = bid * T // nblk
            ntile = (bid + 1) * T // nblk - t0
            D, NKC, KC = self.D, self.nkc, self.kc
            nch = ntile * NKC
            g = lane // 4
            c = lane - 4 * g

            smem = cutlass.memory.SmemAllocator()
            mbar = smem.allocate_array(Int64, 2 * D + 1)            # full[0..D), empty[D..2D), x at 2D
            sRed = smem.allocate_tensor(Float32, cute.make_layout((MMA_CONSUMERS, self.tmax, 16, 8),
                                                                  stride=(self.tmax * 128, 128, 8, 1)), 16)
            sX = smem.allocate_tensor(BFloat16, cute.make_layout((8, self.MB * self.xs_v), stride=(1, 8)), 128)
            sRing = smem.allocate_tensor(BFloat16, cute.make_layout((8, D * self.slot_v), stride=(1, 8)), 128)
            if tid == 0:
                for s in cutlass.range_constexpr(D):
                    cute.arch.mbarrier_init(mbar + s, 1)
                    cute.arch.mbarrier_init(mbar + D + s, MMA_CONSUMERS)
                cute.arch.mbarrier_init(mbar + 2 * D, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

            is_producer = warp == MMA_CONSUMERS
            gW = cute.flat_divide(mW, (1, 8))
            if is_producer:
                with cute.arch.elect_one():
                    # the weights do not depend on the predecessor: the first D chunks go out before the PDL wait
                    for q in cutlass.range(cutlass.min(D, nch)):
                        self.issue(gW, sRing, mbar, q, q, t0)
            cute.arch.griddepcontrol_wait()
            if const_expr(self.early_trigger):
                cute.arch.griddepcontrol_launch_dependents()
            if is_producer:
                with cute.arch.elect_one():
                    gX = cute.flat_divide(mX, (1, 8))
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar + 2 * D, M * self.K * 2)
                    for m in cutlass.range(M):
                        cp_async_bulk_shared_cluster_global(sX[None, m * self.xs_v].iterator,
                                                            gX[0, None, m, 0].iterator, mbar + 2 * D, self.K * 2)
                    for q in cutlass.range(D, nch):
                        s = q % D
                        cute.arch.mbarrier_wait(mbar + D + s, (q // D - 1) % 2)
                        self.issue(gW, sRing, mbar, s, q, t0)
                cute.arch.sync_warp()
            else:
                atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
                rA = cute.make_rmem_tensor(cute.make_layout((8, 2), stride=(1, 8)), BFloat16)
                rX = cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), BFloat16)
                fa = cute.make_rmem_tensor(cute.make_layout((8, 1, 1), stride=(1, 0, 0)), BFloat16)
                fb = cute.make_rmem_tensor(cute.make_layout((4, 1, 1), stride=(1, 0, 0)), BFloat16)
                accs = []
                for ti in cutlass.range_constexpr(self.tmax):
                    a = cute.make_rmem_tensor(cute.make_layout((4, 1, 1), stride=(1, 0, 0)), Float32)
                    a.fill(0.0)
                    accs.append(a)
                # tokens past M read token M - 1's row: finite columns that the store skips
                xb = cutlass.min(g, M - 1) * self.xs_v + c
                cute.arch.mbarrier_wait(mbar + 2 * D, 0)
                for ti in cutlass.range_constexpr(self.tmax):
                    if ti < ntile:
                        for kc in cutlass.range_constexpr(NKC):
                            q = ti * NKC + kc
                            s = q % D
                            cute.arch.mbarrier_wait(mbar + s, (q // D) % 2)
                            for st in cutlass.range_constexpr(self.spw):
                                kk = warp * self.spw + st
                                if const_expr(self.tiled):
                                    # fragment order: the warp's 32 lanes read 512 contiguous bytes per load
                                    vb = s * self.slot_v + kk * 64 + lane
                                    cute.autovec_copy(sRing[None, vb], rA[None, 0])
                                    cute.autovec_copy(sRing[None, vb + 32], rA[None, 1])
                                else:
                                    vb = s * self.slot_v + g * self.rs_v + kk * 4 + c
                                    cute.autovec_copy(sRing[None, vb], rA[None, 0])
                                    cute.autovec_copy(sRing[None, vb + 8 * self.rs_v], rA[None, 1])
                                cute.autovec_copy(sX[None, xb + kc * (KC // 8) + kk * 4], rX)
                                for h in cutlass.range_constexpr(2):
                                    swapab_a_fragment(fa, rA, h, 0)
                                    for e in cutlass.range_constexpr(4):
                                        fb[e] = rX[4 * h + e]
                                    cute.gemm(atom, accs[ti], fa, fb, accs[ti])
                            # the MMAs above consumed every lane's loads of slot s (mma.sync is warp-wide)
                            cute.arch.sync_warp()
                            if lane == 0:
                                cute.arch.mbarrier_arrive(mbar + D + s)
                for ti in cutlass.range_constexpr(self.tmax):
                    sRed[warp, ti, g, 2 * c] = accs[ti][0]
                    sRed[warp, ti, g, 2 * c + 1] = accs[ti][1]
                    sRed[warp, ti, g + 8, 2 * c] = accs[ti][2]
                    sRed[warp, ti, g + 8, 2 * c + 1] = accs[ti][3]
            cute.arch.sync_threads()
            # the consumer warps' K partials of each output in warp order (deterministic)
            for o in cutlass.range(tid, ntile * 16 * M, self.nthreads):
                tok = o // (ntile * 16)
                rem = o - tok * (ntile * 16)
                ti = rem // 16
                r = rem - ti * 16
                tot = Float32(0.0)
                for w in cutlass.range_constexpr(MMA_CONSUMERS):
                    tot = tot + sRed[w, ti, r, tok]
                mY[tok, (t0 + ti) * 16 + r] = tot.to(mY.element_type)
            if const_expr(not self.early_trigger):
                cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def issue(self, gW, sRing, mbar, s, q, t0):
            """Chunk q of this CTA (tile t0 + q // NKC, columns [(q % NKC) KC, + KC)) into slot s: 16 row pieces,
            or, tiled, the chunk's one contiguous run (row t0 NKC + q of the tiled weight)."""
            cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, 16 * self.kc * 2)
            if const_expr(self.tiled):
                cp_async_bulk_shared_cluster_global(sRing[None, s * self.slot_v].iterator,
                                                    gW[0, None, t0 * self.nkc + q, 0].iterator, mbar + s,
                                                    16 * self.kc * 2)
            else:
                ti = q // self.nkc
                k8 = (q - ti * self.nkc) * (self.kc // 8)
                for r in cutlass.range_constexpr(16):
                    cp_async_bulk_shared_cluster_global(sRing[None, s * self.slot_v + r * self.rs_v].iterator,
                                                        gW[0, None, (t0 + ti) * 16 + r, k8].iterator, mbar + s,
                                                        self.kc * 2)

    return RingMmaGemv


_MMA_CLS = None


def _mma_cls():
    global _MMA_CLS
    if _MMA_CLS is None:
        _MMA_CLS = _build_mma_class()
    return _MMA_CLS


def mma_bucket(M: int) -> int:
    if not 1 <= M <= MMA_MAX_M:
        raise ValueError(f"x: the tensor-core ring GEMV takes M in 1..{MMA_MAX_M}, got {M}")
    return 4 if M <= 4 else 8


def mma_compile_key(M: int, K: int, N: int, early_trigger: bool = False, tiled: bool = False) -> tuple:
    """v14 (a tiled weight) is its own build; the key then ends with "tiled"."""
    return ("rms_gemv_ring.mma", mma_bucket(M), K, mma_tiles_max(N), bool(early_trigger)) + (("tiled",) if tiled else ())


def _build_mma(MB, K, tmax, early_trigger=False, tiled=False, options=TVM_FFI):
    cutlass, cute = import_cute()
    BF = cutlass.BFloat16
    M, N = cute.sym_int(), cute.sym_int(divisibility=16)
    x = fake_tensor(BF, (M, K))
    w = fake_tensor(BF, (cute.sym_int(), mma_tiled_shape(16, K)[1])) if tiled else fake_tensor(BF, (N, K))
    y = fake_tensor(BF, (M, N), align=2)
    return cute.compile(_mma_cls()(MB, K, tmax, early_trigger, tiled), x, w, y, fake_stream(), options=options)


def _compile_mma(key):
    _, MB, K, tmax, et = key[:5]
    return compile_cached(key, lambda: _build_mma(MB, K, tmax, et, key[5:] == ("tiled",)))


def ring_mma_ptx(N: int, K: int = 7168, M: int = 8, early_trigger: bool = False, tiled: bool = False) -> str:
    """PTX of the tensor-core ring GEMV (uncached; for reading and the CPU tests)."""
    from ..measure.ptxcheck import compiled_ptx
    return compiled_ptx(lambda: _build_mma(mma_bucket(M), K, mma_tiles_max(N), early_trigger, tiled,
                                           options=TVM_FFI + " --keep-ptx"))


def mma_tiled_shape(N: int, K: int) -> tuple[int, int]:
    """[N / 16 * K / KC, 16 KC]: the tiled weight's shape, a row per ring chunk (the one place that says it)."""
    kc = mma_kc(K)
    return N // 16 * (K // kc), 16 * kc


class MmaTiledWeight:
    """W [N, K] re-laid for v14 (mma_tile_weight): ``data`` is [N / 16 * K / KC, 16 * KC], row t * NKC + kc one
    ring chunk (rows [16 t, 16 t + 16), columns [kc KC, kc KC + KC)) in the order the consumer warps read it: for
    each k32 step kk, for h in (0, 1), lane (g, c) = (lane // 4, lane % 4) holds the 8 columns kk 32 + 8 c .. + 8 of
    row 16 t + 8 h + g. A type of its own, so that a plain [N, K] weight cannot be read as a tiled one."""

    def __init__(self, data, N: int, K: int):
        self.data, self.N, self.K = data, N, K

    @property
    def shape(self):
        return (self.N, self.K)


def mma_tile_weight(w) -> MmaTiledWeight:
    """The tiled copy of a bf16 weight [N, K] (N a multiple of 16, K of 256) that gemv_ring_mma reads as v14."""
    import torch
    check_tensor("w", w, dtype=torch.bfloat16)
    if w.dim() != 2 or w.shape[0] % 16 or w.shape[0] == 0 or w.shape[1] % 256:
        raise ValueError(f"w: expected [N (a positive multiple of 16), K (a multiple of 256)], got {list(w.shape)}")
    N, K = w.shape
    kc = mma_kc(K)
    # row 16 t + 8 h + g, column kc KC + 32 kk + 8 c + e  ->  [t, kc, kk, h, g, c, e]
    v = w.reshape(N // 16, 2, 8, K // kc, kc // 32, 4, 8).permute(0, 3, 4, 1, 2, 5, 6)
    return MmaTiledWeight(v.contiguous().view(mma_tiled_shape(N, K)), N, K)


def gemv_ring_mma(x, w, out=None, *, early_trigger: bool = False):
    """y[M, N] = x[M, K] @ w[N, K]^T for M <= 8 through the bulk-copy ring with a tensor-core consumer: bf16 in / out,
    fp32 accumulate, the K partials of the 8 consumer warps added in warp order. w: the [N, K] weight (v13, each
    chunk as 16 row pieces), or its MmaTiledWeight (v14, each chunk one contiguous bulk copy); both give the same
    bits."""
    tiled = isinstance(w, MmaTiledWeight)
    if tiled:
        import torch
        check_tensor("w.data", w.data, dtype=torch.bfloat16, shape=mma_tiled_shape(w.N, w.K))
    M, N, K, out = gemv_operands(x, w.data if tiled else w, out, k_multiple=256, nk=w.shape if tiled else None)
    mma_bucket(M)
    if not mma_applicable(M, K, N, tiled):
        raise ValueError(f"w: the tensor-core ring GEMV takes at most {MMA_TILES_MAX} 16-row tiles per CTA and x beside "
                         f"two ring slots; [N, K] = [{N}, {K}] at M = {M} does not fit (mma_applicable)")
    _compile_mma(mma_compile_key(M, K, N, early_trigger, tiled))(x, w.data if tiled else w, out)
    return out


_CLS = None


def _cls():
    global _CLS
    if _CLS is None:
        _CLS = _build_kernel_class()
    return _CLS


def _build(MB, K, cmax, fused, nb=0, has_delta=False, bw=-1, wln="bf16", eps=1e-5, early_trigger=False,
           joint=False, options=TVM_FFI):
    cutlass, cute, RingGemv = _cls()
    BF = cutlass.BFloat16
    N = cute.sym_int(divisibility=16)
    w = fake_tensor(BF, (N, K))
    y = fake_tensor(BF, (MB, N), align=2)
    obj = RingGemv(MB, K, cmax, fused, nb, has_delta, bw, eps, early_trigger, joint)
    if not fused:
        x = fake_tensor(BF, (MB, K))
        return cute.compile(obj, x, w, y, None, None, None, None, None, None, fake_stream(), options=options)
    from .rms_gemv import NB_MAX
    blocks = fake_tensor(BF, (MB, NB_MAX, K))
    p = fake_tensor(BF, (MB, K))
    d = fake_tensor(BF, (MB, K)) if has_delta else None
    po = fake_tensor(BF, (MB, K))
    u = fake_tensor(cutlass.Float32, (K,))
    wl = fake_tensor({"bf16": BF, "fp32": cutlass.Float32}[wln], (K,))
    return cute.compile(obj, None, w, y, blocks, p, d, po, u, wl, fake_stream(), options=options)


def compile_key(M: int, K: int, N: int, fused: bool, n_blocks: int = 0, has_delta: bool = False,
                block_write: int = -1, wln: str = "bf16", eps: float = 1e-5, early_trigger: bool = False,
                joint: bool | None = None) -> tuple:
    """The build a call runs: the ring plan depends on M, K, n_blocks and the busiest CTA's chunk count (N).
    joint (None = JOINT_PROLOGUE) is kept only where joint_applies; the key then ends with "joint"."""
    if fused:
        cmax = chunks_max(N)
        jt = (JOINT_PROLOGUE if joint is None else bool(joint)) and joint_applies(M, K, n_blocks, cmax)
        return (("rms_gemv_ring.fused", M, K, cmax, n_blocks, bool(has_delta), block_write, wln, float(eps),
                 bool(early_trigger)) + (("joint",) if jt else ()))
    return ("rms_gemv_ring.plain", M, K, chunks_max(N), bool(early_trigger))


def _compile(key):
    if key[0] == "rms_gemv_ring.plain":
        _, M, K, cmax, et = key
        return compile_cached(key, lambda: _build(M, K, cmax, False, early_trigger=et))
    _, M, K, cmax, nb, hd, bw, wln, eps, et = key[:10]
    return compile_cached(key, lambda: _build(M, K, cmax, True, nb, hd, bw, wln, eps, et, joint=key[10:] == ("joint",)))


def ring_ptx(N: int, K: int = 7168, M: int = 1, n_blocks: int = 1, fused: bool = True,
             early_trigger: bool = True, joint: bool = False) -> str:
    """PTX of the ring kernel (uncached; for reading and the CPU tests)."""
    from ..measure.ptxcheck import compiled_ptx
    return compiled_ptx(lambda: _build(M, K, chunks_max(N), fused, n_blocks, True, -1, "bf16", 1e-5, early_trigger,
                                       joint=joint, options=TVM_FFI + " --keep-ptx"))


def _check_w(w, K, dev):
    import torch
    check_tensor("w", w, dtype=torch.bfloat16, device=dev)
    if w.dim() != 2 or w.shape[1] != K or w.shape[0] % 16 or w.shape[0] == 0:
        raise ValueError(f"w: expected [N (a positive multiple of 16), {K}], got {list(w.shape)}")
    if K % K_UNIT:
        raise ValueError(f"rms_gemv_ring: K must be a multiple of {K_UNIT} (7 warps x 32 lanes x 8), got {K}")
    return w.shape[0]


def gemv_ring(x, w, out=None, *, early_trigger: bool = False):
    """y[M, N] = x[M, K] @ w[N, K]^T through the bulk-copy ring (M <= 2, bf16 in / out, fp32 accumulate)."""
    M, N, K, out = gemv_operands(x, w, out, k_multiple=K_UNIT)
    if M > MAX_M:
        raise ValueError(f"x: the ring GEMV takes M <= {MAX_M} (x of every token in registers), got {M}")
    _compile(compile_key(M, K, N, False, early_trigger=early_trigger))(x, w, out, None, None, None, None, None, None)
    return out


def attnres_rms_gemv_ring(blocks, n_blocks, partial, delta, u, w_ln, w, *, eps=1e-5, block_write=-1, out=None,
                          partial_out=None, early_trigger=None, joint=None):
    """rms_gemv.attnres_rms_gemv's fused path (M <= 2) with the weights through the bulk-copy ring: returns (y,
    partial_out), y = bf16(RMSNorm_{w_ln}(AttnRes mix) @ w^T), p' = bf16(p + delta) into partial_out (and blocks).
    early_trigger: None = EARLY_TRIGGER (the dependent launched at the end, v12.1); True: right after the wait.
    joint: v12.2's joint prologue (None = JOINT_PROLOGUE; where joint_applies), bit-identical to the default."""
    import torch
    from .rms_gemv import _check_attnres
    if partial.dim() != 2 or not 1 <= partial.shape[0] <= MAX_M:
        raise ValueError(f"partial: expected [M <= {MAX_M}, K] for the ring in_proj, got {list(partial.shape)}")
    M, K, wln, partial_out = _check_attnres(blocks, n_blocks, partial, delta, u, w_ln, block_write, partial_out, True)
    N = _check_w(w, K, partial.device)
    if out is None:
        out = torch.empty(M, N, dtype=torch.bfloat16, device=partial.device)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(M, N), device=partial.device, align=2)
    et = EARLY_TRIGGER if early_trigger is None else bool(early_trigger)
    key = compile_key(M, K, N, True, n_blocks, delta is not None, block_write, wln, eps, et, joint)
    _compile(key)(None, w, out, blocks, partial, delta, partial_out, u, w_ln)
    return out, partial_out
