"""The in_proj's GEMM at 8 < M <= 64 on WGMMA: y = bf16(x @ W^T), W streamed once through a TMA ring, the K range
split over a thread-block cluster and the fp32 partials added through distributed shared memory.

Replaces the reference op of k3-spec.md section 7.2 step 1 (y = x @ W_in^T, x the normed MLP-side input
``rms_gemv.attnres_rmsnorm`` wrote) where the layer ran cuBLAS (fast.INPROJ_BLAS, cublasLt's nvjet 64x32 at rank16
M = 64, 16.9 us for 46 MB: 1.5x its floor, s81) and nothing of it could start before the norm kernel ended.

Design (v1)
-----------
* GEMM orientation: the tokens are WGMMA's m64 (A = x, K-major, rows past M zero-filled by the TMA unit), a CTA's BN
  rows of W are its n (B = W, K-major, as stored). Both come through one ring of D stages, each stage an x tile
  [64 x 64] and a W tile [BN x 64] with the 128-byte swizzle the WGMMA descriptors read, on one "full" mbarrier
  (the producer's arrive.expect_tx + both copies' complete_tx) and one "empty" mbarrier (an arrive per consumer
  warp). Warp 4 is the producer (the whole warp runs its loop; one lane arrives on the barriers, and each TMA copy
  elects its own lane); warps 0-3 are one warpgroup, the consumer: per stage four
  m64nBNk16 WGMMAs into fp32 registers (BN / 2 per thread), the stage released once the next stage's group was
  committed and the previous one waited (wgmma.wait_group 1).
* Grid [S, ceil(N / BN)], cluster [S, 1, 1]: the S CTAs of a cluster share a W row tile and take contiguous
  slices of the K / 64 k-tiles. Why a K split: at M = 64 one W row tile per SM needs BN ~ 24 rows, so x (the whole
  K range, 917 KB at M = 64) would be re-read from L2 for every 24 rows of W; with S = 8 a CTA reads 1 / 8 of x per
  224 rows. The plan (``plan``) picks S and BN so that every cluster is co-resident in one wave at one CTA per SM
  (15 clusters of 8, 30 of 4: measured by k3fast.cluster_probe in s90q; the first table's 32 was read off another
  kernel).
* The W tiles do not depend on the predecessor (the norm kernel): the producer fills the whole ring with W before
  griddepcontrol.wait, and the x tiles of those stages after it (each stage's barrier expects both).
* Epilogue: each CTA writes its fp32 tile into its own (drained) ring, a cluster barrier publishes it, CTA r reads
  rows [r 64 / S, (r + 1) 64 / S) of every CTA's tile with ld.shared::cluster in rank order (deterministic; the
  same bits for any scheduling), rounds once to bf16 and stores rows < M, columns < N. A second cluster barrier
  keeps every CTA's shared memory alive until the last remote read.
* PDL: launched with the programmatic-serialization attribute; its dependent is launched after the first cluster
  barrier, when all of the cluster's main loops are done (v1.1; v1 triggered per warp, so the producer warp fired it
  D stages early).

Also o_proj's GEMM at rank8 above M = 8 and at rank16 above M = 16 (fast.oproj_wide_choice, sessions 26 / 28; version
log "o_proj", "Placement beside the norm").

Contracts: x [M, K] and W [N, K] bf16, contiguous, 16-byte aligned, K a multiple of 64 with K / 64 >= S, 8 < M <= 64
(any M in 1..64 is correct; at M <= 8 rms_gemv_ring v13 reads W faster), N even. y [M, N] bf16. Not bit-identical to
cuBLAS (a different K order), identical between runs.

Version log
-----------
v1 (session 25; measured by h200_next s86 / s87 at 076be23; BK = 64 per stage, 6 stages: today's main loop)
    Prediction (written before any GPU run): the bare GEMM at rank16 M = 64 (N 3216, K 7168, 46 MB of W) 11.5-13 us
    against cublasLt's 14.8-16.9 in the same run (15 clusters of 8 x BN 224 = 120 SMs streaming with ~170 KB of W
    in flight each; the M <= 2 ring reached 3.45 TB/s with ~200 KB); at rank8 M = 64 (N 6288, 90 MB) 23-25.5 us
    against ~27. In the layer (norm + this GEMM, PDL-chained, W prefetched while the norm runs) the attention half
    at rank16 b64 53.3 -> 48.5-50.5 us (1.8x stock needs ~50.7), rank8 b64 81.3 -> 77-79, rank8 b16 58.4 ->
    55.5-57.5. If the bare GEMM is no faster than cuBLAS, the per-SM in-flight bytes (one CTA of ~200 KB) are not
    what limits it, and the next probe is the ring depth against S.
    The first build hung (926354c, s86): the producer's loop sat in elect_one and cute.copy of a TMA atom elects its
    own lane, an elect.sync that the other 31 lanes never reached. Fixed at 076be23 (the loop on the whole warp).
    Measured (kernels- / records-076be23-s86 / -s87.json; GPU tests 35 passed; copy 4.07 TB/s). Kernel bench, us
    (cublasLt in the same run): bare rank16 b16 / b64 20.3 / 22.4 (20.6 / 20.2), S = 4 19.8 / 20.8; rank8 b16 / b64
    36.9 / 39.6 (29.4 / 29.9). Attention half (stock / fast / fast-inwg / fast-inwglate): rank16 b16 84.3 / 42.7 /
    38.8 / 40.1 (2.17x with fast-inwg: cuBLAS runs split-K + its reduce there), rank16 b64 91.1 / 53.2 / 53.0 /
    53.7, rank8 b16 102.3 / 58.3 / 63.1 / 62.9, rank8 b64 128.4 / 81.4 / 88.1 / 89.6. In the layer's timeline the
    GEMM takes 18.6 us at rank16 (cublasLt 16.6) and 36.0 at rank8 (26.8): ~2.5 TB/s at every M, against the 3.3-3.4
    predicted. Missed everywhere but rank16 b16. Two suspects, not separated by these runs: (a) every stage asks each
    W row for 128 bytes and the next 128 bytes of that row come a stage (~0.7 us) later, so the DRAM sees up to
    ~26k row streams advancing 128 bytes at a time (cuBLAS's 64-row tiles: ~6k, each advancing 3x as often); (b) the
    epilogue (the KDA step launched ~4.5 us before this kernel ended at rank16, but the trigger was per warp and the
    producer warp, done D stages early, may have fired it).
v1.1 (session 25; measured by h200_next s88 at 24cb2aa) BK = 128 per stage (two boxes per operand issued back to back:
    each W row arrives 256 bytes at a time, 3 stages of 74 / 70 KB), the dependent launched after the first cluster
    barrier (all of the cluster's main loops done), and the epilogue's remote loads unrolled over a static trip count
    (3 rounds of 8 at rank16). Prediction: if (a) holds, the bare GEMM at rank8 b64 39.6 -> ~30-33 us (cuBLAS ~30)
    and the layer's GEMM 36.0 -> ~27-30, rank16 18.6 -> ~14-15.5 (the attention half 53.0 -> ~49-51); if it does not
    move, the limit is the ring depth or the epilogue, and the "@wgmmak64" bench row (v1's stages with v1.1's
    epilogue) says which of the two changes moved what.
    Measured (kernels- / records-24cb2aa-s88.json; GPU tests 34 passed; copy 4.18 TB/s): bare, us, 128-wide / 64-wide
    stages / cublasLt: rank16 b16 20.3 / 20.6 / 20.0, b64 22.7 / 22.4 / 19.6; rank8 b16 40.1 / 37.9 / 29.1, b64 42.3 /
    39.7 / 29.6. Attention half (stock / fast / fast-inwg): rank16 b16 85.5 / 43.1 / 40.1, b64 92.1 / 53.2 / 53.5;
    rank8 b16 102.9 / 58.2 / 65.7, b64 123.6 / 81.5 / 89.9. (a) is refuted: 256-byte pieces are no faster (rank8
    slower: 3 stages in flight instead of 6). (b) is small: with the trigger after the cluster barrier the KDA step
    starts 1.6 us before this kernel ends at rank16 b64 (20.5 against 22.1 in the timeline), so the epilogue is ~1.6
    us and the main loop itself streams ~46 MB in ~17 us: ~2.7 TB/s. BK back to 64 (the default since 40ec5cc).
Plan variants (session 25; measured by h200_next s89 at 40ec5cc, kernels- / records-40ec5cc-s89.json; GPU tests 44
    passed; copy 4.20 TB/s). Question: does the one-wave co-residency that ``plan`` assumes hold? Bare GEMM at b64, us
    (cublasLt 19.2-19.7 / 29.8-30.1 in the same run):
                          plan (D6)  d3    d2    13 x 8 (BN 256)  26 x 4 (BN 128)  8 x BN 256, d2
        rank16 (15 x 8)     21.8     22.6  25.7       22.6            21.7              28.0
        rank8  (31 x 4)     40.3     35.1  35.8        --              --               36.5
    At rank16 fewer clusters than the limit (13 of 8, 26 of 4) change nothing and smaller rings are slower: the plan's
    wave is not the limit there. At rank8 a ring small enough for two CTAs per SM gains 5 us (d3), so 31 clusters of 4
    at one CTA per SM probably do not all fit in one wave; still 5 us behind cuBLAS. In the layer (fast / d3 / d2):
    rank16 b64 53.0 / 55.6 / 59.0, b16 42.6 / 41.5 / 44.3; rank8 b64 81.8 / 85.2 / 86.5, b16 59.2 / 60.4 / 60.6.
    What is left: at ~2.7 TB/s with ~220 KB in flight per SM, Little's law puts each stage's round trip near 10 us,
    which is queueing behind a memory system that delivers this access pattern slowly, not a latency the ring could
    hide. The pattern: ~27k concurrent row streams (120 CTAs x 224 rows), each a 128-byte piece per stage, 14 KB
    apart. Not measured: Nsight Compute of this kernel (DRAM throughput and row-buffer behaviour against cuBLAS's).
v2 (session 25; CPU-compiled, not run: the session's device time ran out) tile_weight's copy [K / BK, N, BK] read
    through a 3-D tensor map (columns of a k-tile, rows, k-tiles): the [BN x 64] tile of one stage is one contiguous
    run of BN x 128 bytes instead of BN pieces 14 KB apart; rows past N are the map's out-of-bounds fill, as before.
    The same tiles land in the same shared-memory places, so the same bits (GPU test written). Prediction: if the
    access pattern is the limit, the bare GEMM at rank16 b64 21.8 -> ~15-17 us and rank8 (d3) 35.1 -> ~26-29 (the
    M <= 2 ring's contiguous chunks stream at 3.45 TB/s); the attention half at rank16 b64 53.0 -> ~49-50.5. If it
    does not move, the row pieces are not the limit either, and the next step is Nsight Compute of v1 beside cuBLAS
    (h200_next s90q measures it; s90 / s91 are the full steps). Cost: FastImpl then holds the in_proj twice.
    The same runs carry bench rows of cuBLAS's own tilings without a K split (1bn32 at rank16 = nvjet 64x32's 101
    CTAs x 32 rows over all of K; 1bn64 at rank8 = 64x64's 99 CTAs) and a split of 2 x 64 rows. Hypothesis: the K
    split walks 224 rows per CTA slowly (a 128-byte piece of each row per ~1.3 us), cuBLAS 32-64 rows fast; if the
    DRAM side pays per row visited, 1bn32 / 1bn64 stream at cuBLAS's rate (2.8 / 3.3 TB/s, bench ~19 / ~30 us at
    b64) where the plan's split does not, and v2 (contiguous tiles) should too.
    Measured (s90q at 81d3be3, kernels-81d3be3-s90q.json, clusterprobe-81d3be3-s90q.json, a staging without vLLM;
    copy 4.21 TB/s). tile_weight's copy gave bit-equal outputs (torch.equal on the H200). Bare GEMM at b64, us
    (cublasLt 19.4-19.6 / 29.8-30.0 in the same run):
                          plan (D6)  tiled  d3    tiledd3  1bn32  1bn64  2bn64  nomma
        rank16 (15 x 8)     21.7     21.8   22.6   21.6    27.8   29.0   21.7   21.3
        rank8  (31 x 4)     40.3     39.7   34.9   33.0     --    33.0    --    37.5
    Every hypothesis of v2's entry is refuted: contiguous tiles stream no faster (21.8 / 39.7), cuBLAS's own tilings
    without a split are slower (27.8 / 33.0), and the ring without a single WGMMA (the diagnostic build) takes 21.3 us:
    the consumer is not the limit, the memory side is. The probe also measured the plan's table wrong at S = 4: 30
    clusters of 4 are co-resident at 211 KB per CTA, not 32 (15 of 8 at 222 KB, 132 of 1 as assumed), so the rank8
    plan's 31 clusters ran a second wave, which is what s89's d3 gain was.
v2.1 (session 26; the plan's table as measured, CLUSTERS_RESIDENT[4] = 30; rank8 now 29 clusters of 4 x BN 224)
    Prediction: rank8 bare b64 40.3 -> ~34-35 us (d3's 34.9), the attention half with fast-inwg at rank8 b16 / b64
    63-66 / 88-90 -> ~60-61 / ~84-85. Measured (s90d at ce064f2, kernels- / records-ce064f2-s90d.json; GPU tests 76
    passed, 6 skipped): bare rank8 b16 / b64 32.4 / 34.9 us (cublasLt 27.6 / 29.6); attention half fast / fast-inwg
    rank8 b16 58.0 / 58.4, b64 81.9 / 83.4 (stock 101.2 / 123.9). Met: rank8 is now within 0.4-1.5 us of cuBLAS in
    the layer, where it lost 5-8.
    The layer default from this session (fast.inproj_wide_choice, INPROJ_WIDE "auto"): this kernel at rank16 M 9..16,
    the one place it won in every run (s87 / s88 / s90c / s90d: 38.8 / 40.1 / 39.9 / 40.1 us against cuBLAS's split-K
    pair at 42.7 / 43.1 / 42.1 / 42.2; 2.10x stock in s90d, 2.00x with "fast-inwgoff", the A/B).
    Nsight Compute at rank16 b64 (s91 at 84e377e, ncu-84e377e-s91/, cold caches, alone): this kernel 19.6 us, DRAM 52 %
    busy (47 MB read, 2.40 TB/s); its ring without WGMMAs 18.3 us, 56 %; cublasLt's nvjet 64x32 (384 threads, clusters
    of 8, 104 CTAs) 16.7 us, 62 %. SM active cycles: 72 % of the elapsed ones here (120 of 132 SMs busy), 64 % for
    cuBLAS (104 busy), so a busy CTA of this kernel runs ~15.6 us for its 401 KB of W (~26 GB/s) where cuBLAS's run
    ~12.9 us for 917 KB of W rows (inference from its name and grid, not measured: 64-row W tiles over all of K, the two token halves on a CTA pair that shares each W tile by multicast). Stall samples (per SASS instruction):
    54 % on the consumers' full-barrier wait (NANOSLEEP.SYNCS after mbarrier.try_wait), 6 % on the producer's
    empty-barrier wait, i.e. the producer finds all six stages still in flight ~40 % of its time: the ring depth binds,
    with a round trip of several microseconds per stage at 52 % DRAM utilisation. Not separated: whether that round
    trip is the TMA unit's issue of 288 128-byte rows per stage, the L2-to-SM fabric (x adds 22 % to every stage; cuBLAS
    halves its W traffic per SM by multicast), or DRAM. Lead for the next session: fewer SM-side bytes per W byte
    (x loaded once per CTA at M <= 16 and fed from registers, so that the ring carries W alone and one stage more fits;
    or a cluster shape whose CTAs share W tiles by multicast, as cuBLAS's does).
o_proj (session 26; fast.OPROJ_WIDE, impls "fast-opwg" / -d3 / -d2; the default at rank8's width since then)
    The same kernel for o_proj where it runs apart from its AttnRes #2 norm (M > 8): N 7168, K 768 / 1536, 30
    clusters of 4 x BN 240, a ring that holds all / 5 of 6 of a CTA's k-tiles, so W is requested before the PDL wait
    (during the KDA step's tail) and the norm kernel is launched from the cluster barrier. 146 registers, no spills.
    Prediction: o_proj + norm after the KDA step rank16 b64 11.4 -> ~8-9 us, rank8 b16 12.9 -> ~9-10 (the attention
    half 53.4 -> ~50.5-51.5, 58.0 -> ~55-56). Measured (s90e at 833d5e0 beside stock, s90f at f3d976a without;
    GPU tests 30 passed: these shapes at M 1..64 against fp32 and cuBLAS, the attention half with it at b16 / b64 on
    both ranks). Attention half fast / fast-opwg (s90e; s90f): rank8 b16 60.0 / 58.5 (59.9 / 58.0), rank8 b64 81.8 /
    79.9 (82.0 / 80.5), rank16 b64 53.4 / 52.6 (53.4 / 53.3), rank16 b16 39.6 / 40.4 (40.0 / 39.4); -d3 at s90e rank16
    b64 52.6, rank8 b16 58.3; -d2 slower (54.7 / 63.1). MISSED (-1.5 to -1.9 at rank8, -0.1 to -0.8 at rank16 b64,
    against -2.5 to -4.5): at b64 the KDA step's CTAs fill the SMs' shared memory, so this kernel's CTAs land as the
    KDA CTAs leave and most of W streams after the KDA step (rank16 b64: the GEMM ends 5.7 us after it, cuBLAS 6.6);
    what it gains is the norm launched from its cluster barrier and one launch gap.
    And a diagnostic row, "@wgmmanomma": the plan's ring whose consumers release each stage without a WGMMA. If it
    streams no faster than the GEMM, the memory side sets the rate; if much faster, the consumer does.
cuBLAS-like tiles (session 27; bench rows 1bn48 / 2bn96, impls fast-inwg1bn64 / 1bn48 / 2bn96; measured by s93 at
    46083d7) Why: in s90d's rank8 b16 timeline the plan streamed the in_proj at ~3.1 TB/s, cuBLAS's nvjet 64x16 (99
    CTAs of 64 rows over all of K) at ~3.5. Predicted: 1bn48 / 1bn64 bare at rank8 b16 ~28-30 us against the plan's
    ~32. Measured (kernels-46083d7-s93.json): plan / 1bn64 / 1bn48 / 2bn96 31.5 / 41.1 / 40.2 / 33.6 at rank8 b16, 33.8
    / 33.5 / 31.5 / 32.3 at b64 (cublasLt 28.1-28.6 / 30.0). MISSED the other way at b16, and the table's pattern (the
    tilings with a large x box next to a small W tile slower at M = 16 than at M = 64, which moves 4x the x bytes)
    pointed at the one part of the kernel that depends on M: the 64-row x box, zero-filled past M by the TMA unit.
v3 (session 27; xrows, x_rows; the layer default at rank8 since s95 / s96, fast.INPROJ_WIDE_PINS_WIDE) Each stage loads
    only the token bucket's x rows (16 / 32 / 64: x_rows(M, "auto")) into stages that many rows apart; the WGMMAs read
    each stage through the 64-row layout with that stage stride, so rows past the bucket come from the next stage (or
    the tail plan() reserves after the last) and only make output rows that are never stored. The same sums in the
    same order: bit-identical to v1 (GPU test test_x_rows_give_the_same_bits, s94: 54 passed with the reference and
    layer tests). At M <= 16 the in_proj plan's stages shrink from 36 to 30 KB (7 instead of 6), o_proj's at rank8 hold
    all 6 of a CTA's k-tiles. ptxas: 138 registers (plan), 74 (2 x 96), no spills.
    Prediction: bare rank8 b16 31.5 -> ~28-29.5 us, rank16 b16 20.9 -> ~19-20; attention half rank8 b16 -1 to -2 us.
    Measured (s94 at f19e2a9, kernels-f19e2a9-s94.json): bare, v1 / v3: plan rank8 b16 32.4 / 32.3, rank16 b16 20.6 /
    20.5 (MISSED: the plan's x box is a fifth of its stage, and the 7th stage did not help either); 2 x 96 rows rank8
    b16 33.1 / 29.4, rank16 b16 24.2 / 20.2 (cublasLt 28.5 / 20.3). The attention half with the plan (fast-inwgx)
    moved within its spread (rank8 b16 56.4 against fast-inwg's 56.8 / 57.7). With 2 x 96 rows (fast-inwg2bn96x, s95 at
    4d1a04c, one run beside stock and a repeat without): rank8 b16 fast (cuBLAS) 57.4 / 57.4 / 57.6 against 54.3 /
    54.4 / 53.9 / 54.4 (stock 101.6: 1.87x), rank8 b64 80.7 / 80.2 / 80.1 against 78.3 / 78.3 / 78.4, rank16 b16
    39.9 against 39.5. The default at rank8 M 9..64 from 51eab9f; s96 (records-51eab9f-s96.json): rank8 b16 stock /
    fast / fast-inwgoff 102.2 / 54.9 / 57.4 (1.86x), b64 123.6 / 79.1 / 80.4 (1.56x), b8 (the v13 ring, unchanged)
    95.2 / 51.7 (1.84x). Where the gain comes from, by the timelines (s95): the GEMM streams W from the norm's early
    trigger at about cuBLAS's rate, so it ends ~2-3 us before cuBLAS's GEMM would, which starts only at the norm's end.
Placement beside the norm (session 28; the layer default at rank16 M 17..64 since s98, fast.INPROJ_WIDE_PINS_LARGE_M)
    The s86-s89 timelines, re-read: at rank16 b64 the plan's GEMM started 3.3-3.5 us into the step, as the norm ended,
    although the norm launches it right after its wait; at b64 the norm is 256 CTAs in clusters of 4. s97 (records-
    f8eaa2c-s97.json) placed variants beside it: clusters of 2 (2 x 96 / 2 x 64 rows) started at 1.3-1.4 us, clusters
    of 4 (4 x 112) and 8 (the plan with a 4-stage, 144 KB ring) at 3.5-3.6, whatever their shared memory. None ended
    the GEMM sooner (20.8-21.0 us, cuBLAS 20.8: the early starters stream slower); what moved the attention half is
    the KDA step launched from the GEMM's cluster barrier, ~1.5-1.8 us before its end (cuBLAS launches it at its end).
    Attention half at rank16 b64 with o_proj on this GEMM as well: 4 x 112 rows 50.8 us, 2 x 96 51.1, 2 x 64 51.7, the
    plan d4 52.5, against fast-opwg 52.6 / 53.0 and stock 93.6. The default since: 29 clusters of 4 x 112 rows at
    rank16 M 17..64 (82 registers, 10 stages, no spills); s98 / s100: 51.2 / 51.6 (stock 90.9) and 50.6 / 50.8 (92.8).
Diagnostic "nox" (session 28; bench rows @wgmma*nox, s99 at 5dfaf5c) The ring with W only (x never loaded). Written to
    test whether x's re-reads (26 MB of x for 46 MB of W at 4 x 112 rows) bind the L2-to-SM side. Bare at rank16 b64:
    plan 21.7 / nox 21.8, 4 x 112 rows 20.6 / 19.9 (nomma 19.9), 2 x 96 21.7 / 20.9; rank8 b64 plan 32.7 / 32.7, 2 x 96
    31.8 / 30.9 (cublasLt 19.3-20.9 / 29.4-29.8). At most 0.9 us: not the x traffic; x multicast not built.
v4 (session 29; ``bulk``, tile_weight(swizzle=True), impl fast-inwgbulk, opt-in) Each stage's W tile is one 1-D
    cp.async.bulk of a pre-swizzled tiled copy (row n's 16-byte chunk p stored at p ^ (n % 8), the image the 128-byte
    swizzle leaves in shared memory), instead of a TMA box: the question was whether the tensor-map path holds the ring
    at ~2.7 TB/s when v12's 1-D ring reached 3.45. Bit-identical to the box (GPU test
    test_bulk_weight_gives_the_same_bits, 18 cases incl. partial last tiles; s103: 22 passed). Predicted: rank16 b64
    4 x 112 rows 20.6 -> 16-17.5 us if the tensor map were the limit. Measured (s103 at 3da9419, kernels-3da9419-s103
    .json, copy 4.13 TB/s), box / bulk, us: rank16 b64 4 x 112 20.90 / 20.48, its nox 19.94 / 19.84, plan 21.92 /
    21.86; rank16 b16 4 x 112 20.13 / 19.97 (bulk with the x bucket 18.88;
    cublasLt 21.2); rank8 b64 2 x 96 x-bucket 32.10 / 31.26, plan 33.60 / 32.51; rank8 b16 2 x 96 x-bucket 30.18 / 28.16
    (cublasLt 28.9), nox 29.28 / 27.81. MISSED at b64 (-0.1 to -0.8 us): the copy mode is not what holds the ring;
    ~2 us (7 %) at rank8 b16. The attention half (s103b, records-3da9419-s103b.json): rank16 b64 fast / fast-inwgbulk
    51.2 / 50.8 and 50.9 / 50.6 (stock 96.3), rank8 b64 78.0 / 77.2, rank8 b16 54.6 / 53.9. Not the default: the gain
    (0.3-0.8 us) costs a second copy of the in_proj per layer (+46 MB at rank16, +90 MB at rank8), since the M <= 8
    GEMVs read the row-major weight. Left between this ring and v12's: the grid (clusters of ~220 KB CTAs) and the
    stage size (14 KB of W per stage against v12's 28 KB per copy).
"""
from __future__ import annotations

import functools
import math

from ._dsl import SMEM_PER_CTA_MAX, TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, import_cute

BM = 64                 # WGMMA's m: the tokens, zero-padded by the TMA unit past M
BK = 64                 # k per ring stage (v1.1's 128, two boxes per operand, was no faster: s88)
MIN_M, MAX_M = 1, 64
# Clusters of S CTAs (one CTA per SM, ~200 KB of shared memory) co-resident in one wave on the H200's 132 SMs, as
# k3fast.cluster_probe measured them at this kernel's footprints (clusterprobe-81d3be3-s90q.json): 15 of 8 at 222 KB,
# 30 of 4 at 211 KB (not the 32 that LOG.md's fourth session read off the experts kernel: the rank8 plan's 31
# clusters of 4 ran a second wave, which is why its 3-stage ring ran 5 us faster in s89), 66 of 2 and 132 of 1 (all
# that the probe launched).
CLUSTERS_RESIDENT = {8: 15, 4: 30, 2: 66, 1: 132}
PRODUCER_WARP = 4
NTHREADS = 32 * (PRODUCER_WARP + 1)
BARRIER_BYTES = 1024


X_ROWS = (16, 32, 64)    # x rows a ring stage loads (v3, ``xrows``): the token bucket; WGMMA's m stays 64
DIAGS = (None, "nomma", "nox")   # compile_key's diagnostic builds (benchmark rows only; their outputs are not y)


def stage_bytes(BN: int, bk: int = BK, xrows: int = BM) -> int:
    return (xrows + BN) * bk * 2


def x_rows(M: int, xrows=None) -> int:
    """The x rows a stage loads for M tokens: None = BM (v1: a 64-row box, the TMA unit zero-filling rows past M),
    "auto" = the smallest of X_ROWS that holds M (v3), or an explicit member of X_ROWS (>= M)."""
    if xrows is None:
        return BM
    if xrows == "auto":
        return next(r for r in X_ROWS if M <= r)
    if xrows not in X_ROWS or xrows < M:
        raise ValueError(f"xrows must be None, 'auto' or one of {X_ROWS} holding M = {M}, got {xrows!r}")
    return int(xrows)


SM_SMEM = 233472       # shared memory per SM (228 KB), 1 KB of it reserved per resident CTA


@functools.lru_cache(maxsize=None)        # every call asks (applicable, then compile_key): the plan once per shape
def plan(N: int, K: int, ksplit: int | None = None, bn: int | None = None, bk: int | None = None,
         stages: int | None = None, xrows: int = BM) -> tuple[int, int, int, int]:
    """(BN, S, D, BK): the W rows per CTA, the cluster's K split, the ring depth and the k per stage for
    y = x @ W^T, W [N, K].

    Among the splits whose clusters are all co-resident in one wave, the one with the fewest ring bytes in the
    busiest CTA (its W tile plus its x tile per k-tile, times its k-tiles); ties go to the larger S (fewer re-reads
    of x). ``ksplit`` / ``bn`` / ``bk`` / ``stages`` pin S / BN / BK / D (the A/B cells of the benchmark); a ring small
    enough for two CTAs per SM doubles the clusters counted as co-resident (judged at the pinned BN, else at BN 256:
    conservative, so the rows s89 measured keep their plans). ``xrows`` (v3): the x rows each stage loads; the ring's
    x tiles then take xrows rows each, and the WGMMA's 64-row view of the last one reads (BM - xrows) rows past it."""
    bk = bk or BK
    if bk not in (64, 128):
        raise ValueError(f"bk must be 64 or 128, got {bk}")
    if xrows not in X_ROWS or (xrows != BM and bk != BK):
        raise ValueError(f"xrows must be one of {X_ROWS} (below {BM} only with bk = {BK}), got {xrows}")
    if K % bk:
        raise ValueError(f"w: K must be a multiple of {bk}, got {K}")
    KT = K // bk
    best = None
    for S in ((ksplit,) if ksplit else (8, 4, 2, 1)):
        if S not in CLUSTERS_RESIDENT:
            raise ValueError(f"ksplit must be one of {sorted(CLUSTERS_RESIDENT)}, got {S}")
        if KT < S:
            continue
        per_sm = 1
        if stages:
            per_sm = 2 if 2 * (stages * stage_bytes(bn or 256, bk) + BARRIER_BYTES + 1024) <= SM_SMEM else 1
        resident = CLUSTERS_RESIDENT[S] * per_sm
        BN = bn or max(16, 16 * math.ceil(N / resident / 16))
        if BN % 16 or not 16 <= BN <= 256 or math.ceil(N / BN) > resident:
            continue
        cost = (BN + BM) * math.ceil(KT / S)
        if best is None or cost < best[0]:
            best = (cost, BN, S)
    if best is None:
        raise ValueError(f"w: no cluster K split fits [N, K] = [{N}, {K}] in one wave (ksplit={ksplit}, bn={bn}); "
                         f"BN must be a multiple of 16 in 16..256 (the DSL's WGMMA builds abort at n = 200 / 216 "
                         f"when compiled) and ceil(N / BN) clusters co-resident")
    _, BN, S = best
    tail = (BM - xrows) * bk * 2        # the 64-row WGMMA view of the last x tile reaches this far past it
    D = stages or (SMEM_PER_CTA_MAX - BARRIER_BYTES - tail) // stage_bytes(BN, bk, xrows)
    ring = D * stage_bytes(BN, bk, xrows) + tail
    if D < 2 or ring + BARRIER_BYTES > SMEM_PER_CTA_MAX or ring < BM * (BN + 4) * 4:
        raise ValueError(f"BN = {BN}, BK = {bk}, D = {D}: fewer than two ring stages, more than fit, or the fp32 tile "
                         f"does not fit the ring")
    return BN, S, D, bk


def applicable(M: int, K: int, N: int, xrows=None, **pins) -> bool:
    """Whether gemm_wgmma takes y[M, N] = x[M, K] @ W[N, K]^T: M in 1..64, N even, and a one-wave plan (``pins``: the
    plan's; ``xrows``: gemm_wgmma's)."""
    if not MIN_M <= M <= MAX_M or N % 2 or N <= 0:
        return False
    try:
        plan(N, K, xrows=x_rows(M, xrows), **pins)
    except ValueError:
        return False
    return True


def _build_class():
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32, Int64, const_expr
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.cutlass_dsl import T
    from cutlass._mlir.dialects import llvm
    from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_shared_cluster_global
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.tensor_utils import LayoutEnum

    def ld_cluster_v4(addr, rank):
        """Four fp32 at shared address ``addr`` of cluster CTA ``rank`` (ld.shared::cluster through mapa)."""
        st = llvm.StructType.get_literal([T.f32()] * 4)
        r = llvm.inline_asm(st, [Int32(addr).ir_value(), Int32(rank).ir_value()],
                            "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, $4, $5;\n"
                            "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [ra];\n}",
                            "=f,=f,=f,=f,r,r", has_side_effects=True, is_align_stack=False,
                            asm_dialect=llvm.AsmDialect.AD_ATT)
        return [Float32(llvm.extractvalue(T.f32(), r, [i])) for i in range(4)]

    class SplitKWgmma:
        def __init__(self, BN, S, K, D, BKS, tiled=False, nomma=False, BMX=BM, nox=False, bulk=False):
            self.BN, self.S, self.K, self.D, self.BKS, self.tiled, self.nomma = BN, S, K, D, BKS, tiled, nomma
            self.BMX = BMX
            self.nox = nox            # diagnostic: the ring carries W only (x tiles never loaded; output garbage)
            # v4: W's tiles by 1-D cp.async.bulk from the pre-swizzled tiled copy (tile_weight(swizzle=True)); the
            # tensor map of W is still built (from the tiled view) but never used
            self.bulk = bulk
            self.stage_tx = BN * BKS * 2 if nox else stage_bytes(BN, BKS, BMX)
            self.KT = K // BKS
            self.BNP = BN + 4          # fp32 tile row pitch: 16-byte rows, the fragment stores off one bank group

        @cute.jit
        def __call__(self, mX, mW, mY, stream):
            BN, D, BK = self.BN, self.D, self.BKS
            tiler = (BM, BN, BK)
            tiled_mma = sm90.make_trivial_tiled_mma(BFloat16, BFloat16, LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
                                                    LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(), Float32, (1, 1, 1),
                                                    tiler_mn=(BM, BN))
            a_lay = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tiler, BFloat16, D)
            b_lay = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tiler, BFloat16, D)
            # v3: the TMA writes BMX rows of x per stage into stages BMX rows apart, and the WGMMAs read each stage
            # through the 64-row layout with that stage stride: rows >= BMX of a stage are the next stage's rows (or,
            # past the last, the tail plan() reserved), which only make output rows >= BMX > M-1, never stored. With
            # BMX = 64 both layouts are v1's (a 64-row box the TMA unit zero-fills past M: s93 timed that box at
            # M = 16 as slow as at M = 64, and slower per W byte the more x boxes a W byte comes with)
            ax_lay = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.BMX, BN, BK), BFloat16, D)
            if const_expr(self.BMX < BM):
                o = a_lay.outer
                a_lay = cute.make_composed_layout(a_lay.inner, 0, cute.make_layout(
                    o.shape, stride=(o.stride[0], o.stride[1], ax_lay.outer.stride[2])))
            tma_a, tA = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX,
                                                    cute.slice_(ax_lay, (None, None, 0)), (self.BMX, BK))
            mWb = mW
            if const_expr(self.tiled or self.bulk):
                # the tiled weight [K / BK, N, BK] read as the [N, K] matrix it holds: column k of row n at
                # (k // BK) N BK + n BK + k % BK, so that the box of rows [n0, n0 + BN) of one k-tile is one
                # contiguous run of BN x BK x 2 bytes
                N = cute.size(mW, mode=[1])
                mW = cute.make_tensor(mW.iterator, cute.make_layout((N, (BK, self.KT)), stride=(BK, (1, N * BK))))
            tma_b, tB = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW,
                                                    cute.slice_(b_lay, (None, None, 0)), (BN, BK))
            ntiles = (cute.size(mW, mode=[0]) + BN - 1) // BN
            self.kernel(tma_a, tA, tma_b, tB, mWb, mY, tiled_mma, a_lay, b_lay, ax_lay).launch(
                grid=[self.S, ntiles, 1], block=[NTHREADS, 1, 1], cluster=[self.S, 1, 1], stream=stream,
                use_pdl=True)

        @cute.jit
        def load_w(self, tma_b, tBgB, tBsB, mWb, sB, mbar, nt, kt, s, N):
            """Arm stage s's full barrier and request k-tile kt of this CTA's W rows into it (the producer warp).
            TMA: one 2-D box; the unit zero-fills rows past N and counts them. Bulk (v4): the rows < N of the tile,
            one contiguous run of the pre-swizzled tiled copy, landing where the box's 128-byte swizzle would put
            them; the slots of rows past N keep stale bytes, which only reach output columns >= N, never stored."""
            BN, BK = self.BN, self.BKS
            if const_expr(self.bulk):
                rows = cutlass.min(BN, N - nt * BN)
                wbytes = rows * (BK * 2)
                tx = wbytes if const_expr(self.nox) else wbytes + self.BMX * BK * 2
                src = mWb.iterator + (kt * N + nt * BN) * BK
                dst = cute.make_ptr(BFloat16, sB.iterator.toint() + s * (BN * BK * 2), cute.AddressSpace.smem,
                                    assumed_align=1024)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, tx)
                    cp_async_bulk_shared_cluster_global(dst, src, mbar + s, wbytes)
            else:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, self.stage_tx)
                cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, s)], tma_bar_ptr=mbar + s)

        @cute.kernel
        def kernel(self, tma_a, mA, tma_b, mB, mWb, mY, tiled_mma, a_lay, b_lay, ax_lay):
            BN, S, D, KT, BNP, BK, BMX = self.BN, self.S, self.D, self.KT, self.BNP, self.BKS, self.BMX
            tid = cute.arch.thread_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            rank = cute.arch.block_idx()[0]          # = the CTA's rank in its [S, 1, 1] cluster
            nt = cute.arch.block_idx()[1]
            M = cute.size(mY, mode=[0])
            N = cute.size(mY, mode=[1])
            k0 = rank * KT // S
            nkt = (rank + 1) * KT // S - k0

            smem = cutlass.memory.SmemAllocator()
            mbar = smem.allocate_array(Int64, 2 * D)          # full[0..D), empty[D..2D)
            sA = smem.allocate_tensor(BFloat16, a_lay.outer, 1024, a_lay.inner)
            sB = smem.allocate_tensor(BFloat16, b_lay.outer, 1024, b_lay.inner)
            # the fp32 tile of the epilogue overlays the drained ring (sA, then sB: one contiguous run)
            # (a plain pointer from the address: sA's iterator carries its swizzle, which the fp32 tile must not)
            pC = cute.make_ptr(Float32, sA.iterator.toint(), cute.AddressSpace.smem, assumed_align=1024)
            sC = cute.make_tensor(pC, cute.make_layout((BM, BN), stride=(BNP, 1)))
            if warp == PRODUCER_WARP:
                cpasync.prefetch_descriptor(tma_a)
                cpasync.prefetch_descriptor(tma_b)
            if tid == 0:
                for s in cutlass.range_constexpr(D):
                    cute.arch.mbarrier_init(mbar + s, 1)
                    cute.arch.mbarrier_init(mbar + D + s, 4)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

            gA = cute.local_tile(mA, (BMX, BK), (0, None))         # (BMX, BK, KT)
            gB = cute.local_tile(mB, (BN, BK), (nt, None))         # (BN, BK, KT)
            sAx = cute.make_tensor(sA.iterator, ax_lay.outer)      # the TMA's view: BMX rows per stage
            tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sAx, 0, 2),
                                               cute.group_modes(gA, 0, 2))
            tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
                                               cute.group_modes(gB, 0, 2))
            thr_mma = tiled_mma.get_slice(tid)
            tCsC = thr_mma.partition_C(sC)
            acc = cute.make_rmem_tensor(tCsC.shape, Float32)

            if warp == PRODUCER_WARP:
                # the whole warp runs the producer loop: cute.copy of a TMA atom elects its issuing lane itself (an
                # elect.sync nested in elect_one would wait for lanes that never arrive), the barrier's arrive.expect_tx
                # is one lane's
                npre = cutlass.min(D, nkt)
                # W does not depend on the predecessor: the whole ring of it goes out before the PDL wait
                for q in cutlass.range(npre, unroll=1):
                    self.load_w(tma_b, tBgB, tBsB, mWb, sB, mbar, nt, k0 + q, q, N)
                cute.arch.griddepcontrol_wait()
                if const_expr(not self.nox):
                    for q in cutlass.range(npre, unroll=1):
                        cute.copy(tma_a, tAgA[(None, k0 + q)], tAsA[(None, q)], tma_bar_ptr=mbar + q)
                for q in cutlass.range(D, nkt, unroll=1):
                    s = q % D
                    cute.arch.mbarrier_wait(mbar + D + s, (q // D - 1) % 2)
                    self.load_w(tma_b, tBgB, tBsB, mWb, sB, mbar, nt, k0 + q, s, N)
                    if const_expr(not self.nox):
                        cute.copy(tma_a, tAgA[(None, k0 + q)], tAsA[(None, s)], tma_bar_ptr=mbar + s)
            else:
                # y is written below: nothing of this warpgroup's global traffic may precede the predecessor's end
                cute.arch.griddepcontrol_wait()
                tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
                tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
                acc.fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                for q in cutlass.range(nkt, unroll=1):
                    s = q % D
                    cute.arch.mbarrier_wait(mbar + s, (q // D) % 2)
                    if const_expr(not self.nomma):
                        warpgroup.fence()
                        for kb in cutlass.range_constexpr(BK // 16):
                            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, s)], tCrB[(None, None, kb, s)], acc)
                        warpgroup.commit_group()
                        # at most this stage's group in flight: the previous stage's operands are read
                        warpgroup.wait_group(1)
                    if q > 0 and lane == 0:
                        cute.arch.mbarrier_arrive(mbar + D + (q - 1) % D)
                warpgroup.wait_group(0)
                # every warp of the group past its last WGMMA before the ring is overwritten
                cute.arch.barrier(barrier_id=1, number_of_threads=128)
                for i in cutlass.range(cute.size(acc), unroll_full=True):
                    tCsC[i] = acc[i]
            R = BM // S
            VPR = BN // 4
            base = sC.iterator.toint()
            if const_expr(S > 1):
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
            else:
                cute.arch.sync_threads()
            # every CTA of the cluster is past its main loop: the dependent may launch (v1 triggered per warp, so the
            # producer warp, done D stages before its consumers, launched it early)
            cute.arch.griddepcontrol_launch_dependents()
            # a static trip count, unrolled, so that the remote loads of all of a thread's vectors are in flight at once
            for it in cutlass.range_constexpr((R * VPR + NTHREADS - 1) // NTHREADS):
                v = tid + it * NTHREADS
                i = v // VPR
                c4 = (v - i * VPR) * 4
                row = rank * R + i
                if v < R * VPR and row < M:
                    addr = base + (row * BNP + c4) * 4
                    t0, t1, t2, t3 = Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)
                    for r in cutlass.range_constexpr(S):
                        p = ld_cluster_v4(addr, r)
                        t0, t1, t2, t3 = t0 + p[0], t1 + p[1], t2 + p[2], t3 + p[3]
                    col = nt * BN + c4
                    tot = (t0, t1, t2, t3)
                    for e in cutlass.range_constexpr(4):
                        if col + e < N:
                            mY[row, col + e] = tot[e].to(BFloat16)
            if const_expr(S > 1):
                # no CTA leaves (freeing its shared memory) before the last remote read of it
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()

    return SplitKWgmma


@functools.cache
def _cls():
    return _build_class()


def compile_key(N: int, K: int, ksplit: int | None = None, bn: int | None = None, bk: int | None = None,
                stages: int | None = None, tiled: bool = False, diag: str | None = None, xrows: int = BM,
                bulk: bool = False) -> tuple:
    """A tiled weight (tile_weight) is its own build; the key then ends with "tiled", or "bulk" for the pre-swizzled
    copy that v4 reads by 1-D bulk copies (tile_weight(swizzle=True); BK 64 only). ``diag="nomma"``: the
    diagnostic build whose consumers wait for each stage and release it without a WGMMA (its output is zeros): the
    ring's streaming rate alone, for the benchmark. ``diag="nox"`` (session 28): the ring carries W only, the x tiles
    are never loaded (the WGMMAs read whatever the x slots hold: the output is garbage): what x's share of the ring's
    bytes costs. ``xrows`` below BM (v3, x_rows): "x<rows>"."""
    if diag not in DIAGS:
        raise ValueError(f"diag must be None, 'nomma' or 'nox', got {diag!r}")
    if bulk and (bk or BK) != BK:
        raise ValueError(f"the bulk build (a pre-swizzled tiled weight) needs bk = {BK}: one 128-byte swizzle row per "
                         f"W row and stage, got bk = {bk}")
    return (("gemm_wgmma_splitk",) + plan(N, K, ksplit, bn, bk, stages, xrows) + (K,)
            + (("bulk",) if bulk else ("tiled",) if tiled else ())
            + ((diag,) if diag else ()) + ((f"x{xrows}",) if xrows != BM else ()))


def _build(BN, S, D, BKS, K, tiled=False, options=TVM_FFI, nomma=False, xrows=BM, nox=False, bulk=False):
    cutlass, cute = import_cute()
    BF = cutlass.BFloat16
    M, N = cute.sym_int(), cute.sym_int(divisibility=2)
    x = fake_tensor(BF, (M, K))
    w = fake_tensor(BF, (K // BKS, N, BKS)) if tiled or bulk else fake_tensor(BF, (N, K))
    y = fake_tensor(BF, (M, N), align=4)
    return cute.compile(_cls()(BN, S, K, D, BKS, tiled, nomma, xrows, nox, bulk), x, w, y, fake_stream(),
                        options=options)


def _compile(key):
    _, BN, S, D, BKS, K = key[:6]
    xrows = next((int(f[1:]) for f in key[6:] if f.startswith("x")), BM)
    return compile_cached(key, lambda: _build(BN, S, D, BKS, K, "tiled" in key[6:], nomma="nomma" in key[6:],
                                              xrows=xrows, nox="nox" in key[6:], bulk="bulk" in key[6:]))


class WgmmaTiledWeight:
    """W [N, K] re-laid for the GEMM's v2 (tile_weight): ``data`` is [K / bk, N, bk], k-tile kt's rows in order, so that
    the bk-wide piece of BN consecutive rows that one ring stage asks for is one contiguous run (in [N, K] it is BN
    pieces of bk x 2 bytes, K x 2 bytes apart). ``swizzled`` (v4): each row's eight 16-byte chunks already permuted
    as the TMA unit's 128-byte swizzle places them in shared memory, so that a 1-D bulk copy lands the stage's tile
    as the box would. A type of its own, so that a plain weight cannot be read as tiled."""

    def __init__(self, data, N: int, K: int, bk: int, swizzled: bool = False):
        self.data, self.N, self.K, self.bk, self.swizzled = data, N, K, bk, swizzled

    @property
    def shape(self):
        return (self.N, self.K)


def swizzle128_chunks(n):
    """Chunk order of the 128-byte swizzle for rows n (a LongTensor): position p of row n holds the row's 16-byte
    chunk p ^ (n % 8). The hardware XORs address bits [4, 7) with bits [7, 10); a stage's tile starts on a 1024-byte
    boundary and its rows are 128 bytes apart (BN a multiple of 8), so bits [7, 10) are the row index mod 8."""
    import torch
    return torch.arange(8, device=n.device).view(1, 8) ^ (n.view(-1, 1) % 8)


def tile_weight(w, bk: int = BK, swizzle: bool = False) -> WgmmaTiledWeight:
    """The tiled copy of a bf16 weight [N, K] (N even, K a multiple of bk) that gemm_wgmma reads as v2, or with
    ``swizzle`` (bk 64) pre-swizzled for v4's 1-D bulk copies."""
    import torch
    check_tensor("w", w, dtype=torch.bfloat16)
    if w.dim() != 2 or w.shape[0] % 2 or w.shape[0] == 0 or w.shape[1] % bk:
        raise ValueError(f"w: expected [N (even, > 0), K (a multiple of {bk})], got {list(w.shape)}")
    if swizzle and bk != BK:
        raise ValueError(f"swizzle: the 128-byte swizzle row is {BK} bf16 columns, so bk must be {BK}, got {bk}")
    N, K = w.shape
    data = w.view(N, K // bk, bk).permute(1, 0, 2).contiguous()
    if swizzle:
        idx = swizzle128_chunks(torch.arange(N, device=w.device))
        data = torch.gather(data.view(K // bk, N, 8, 8), 2,
                            idx.view(1, N, 8, 1).expand(K // bk, N, 8, 8)).view(K // bk, N, bk)
    return WgmmaTiledWeight(data, N, K, bk, swizzled=swizzle)


def gemm_ptx(N: int, K: int = 7168, ksplit: int | None = None, bn: int | None = None, bk: int | None = None,
             tiled: bool = False, xrows: int = BM, bulk: bool = False) -> str:
    """PTX of the build that ``plan`` picks for [N, K] (uncached; for reading and the CPU tests)."""
    from ..measure.ptxcheck import compiled_ptx
    BN, S, D, BKS = plan(N, K, ksplit, bn, bk, xrows=xrows)
    return compiled_ptx(lambda: _build(BN, S, D, BKS, K, tiled, options=TVM_FFI + " --keep-ptx", xrows=xrows,
                                       bulk=bulk))


def gemm_wgmma(x, w, out=None, *, ksplit: int | None = None, bn: int | None = None, bk: int | None = None,
               stages: int | None = None, diag: str | None = None, xrows=None):
    """y[M, N] = bf16(x[M, K] @ w[N, K]^T) with fp32 accumulation, M in 1..64: the cluster K-split WGMMA GEMM.
    w: the [N, K] weight, or its WgmmaTiledWeight (v2: each stage's W tile one contiguous run; v4 when swizzled: that
    run by a 1-D bulk copy instead of the tensor map; the same bits either way).
    ``ksplit`` / ``bn`` / ``bk`` / ``stages``: pin the plan's S / BN / BK / D (benchmark cells); ``diag="nomma"``:
    the diagnostic build without WGMMAs (compile_key), whose output is zeros. ``xrows`` (v3; x_rows): None loads a
    64-row x box per stage, "auto" only the token bucket's 16 / 32 / 64 rows (the same sums: the same bits)."""
    import torch
    tiled = isinstance(w, WgmmaTiledWeight)
    check_tensor("x", x, dtype=torch.bfloat16)
    if tiled:
        if bk not in (None, w.bk):
            raise ValueError(f"bk: the tiled weight was laid out for bk = {w.bk}, got {bk}")
        bk = w.bk
        check_tensor("w.data", w.data, dtype=torch.bfloat16, shape=(w.K // w.bk, w.N, w.bk), device=x.device)
    else:
        check_tensor("w", w, dtype=torch.bfloat16, device=x.device)
    if x.dim() != 2 or not MIN_M <= x.shape[0] <= MAX_M:
        raise ValueError(f"x: expected [M, K] with M in {MIN_M}..{MAX_M}, got {list(x.shape)}")
    N, Kw = w.shape
    if (not tiled and w.dim() != 2) or Kw != x.shape[1] or N % 2 or N == 0:
        raise ValueError(f"w: expected [N (even, > 0), K = {x.shape[1]}], got {list(w.shape)}")
    M, K = x.shape
    if out is None:
        out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(M, N), device=x.device, align=4)
    bulk = tiled and w.swizzled
    _compile(compile_key(N, K, ksplit, bn, bk, stages, tiled and not bulk, diag, x_rows(M, xrows), bulk))(
        x, w.data if tiled else w, out)
    return out
