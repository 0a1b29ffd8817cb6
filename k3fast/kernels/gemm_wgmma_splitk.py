"""The in_proj's (and o_proj's) GEMM at 8 < M <= 64 on WGMMA: y = bf16(x @ W^T), W streamed once through a TMA ring,
the K range split over a thread-block cluster and the fp32 partials added through distributed shared memory.

Replaces the reference op of docs/k3-layer.md section 7.2 step 1 (y = x @ W_in^T, x the normed input that
``rms_gemv.attnres_rmsnorm`` wrote) and o_proj's GEMM where it runs apart from its AttnRes #2 kernel. Its gain over
cuBLAS is the chain: W does not depend on the norm, so the ring fills before the PDL wait while the norm runs, and
the dependent launches from the cluster barrier, before the epilogue. docs/kernels/gemm_wgmma_splitk.md has the
design, the figures and the version table.

Design
* GEMM orientation: the tokens are WGMMA's m64 (A = x, K-major), a CTA's BN rows of W are its n (B = W, K-major, as
  stored). Both come through one ring of D stages, each an x tile [xrows x 64] and a W tile [BN x 64] with the
  128-byte swizzle the WGMMA descriptors read, on a "full" mbarrier (the producer's arrive.expect_tx + both copies'
  complete_tx) and an "empty" one (an arrival per consumer warp). Warp 4 is the producer (the whole warp runs its
  loop: a TMA copy elects its own lane); warps 0-3 are the consumer warpgroup: four m64nBNk16 WGMMAs per stage into
  fp32 registers, the stage released once the next stage's group is committed and the previous one waited.
* Grid [S, ceil(N / BN)], cluster [S, 1, 1]: the S CTAs of a cluster share a W row tile and take contiguous slices of
  the K / 64 k-tiles, so x (917 KB at M = 64, K = 7168) is re-read from L2 once per BN x S rows of W instead of once
  per ~24 rows. ``plan`` picks S and BN so that every cluster is co-resident in one wave at one CTA per SM.
* The producer requests the whole ring of W before griddepcontrol.wait, and the x tiles of those stages after it.
* Epilogue: each CTA writes its fp32 tile into its drained ring, a cluster barrier publishes it, CTA r reads rows
  [r 64 / S, (r + 1) 64 / S) of every CTA's tile with ld.shared::cluster in rank order (deterministic), rounds once to
  bf16 and stores rows < M, columns < N. A second cluster barrier keeps every CTA's shared memory alive until the
  last remote read. The PDL dependent launches after the first cluster barrier.

Contracts: x [M, K] and W [N, K] bf16, contiguous, 16-byte aligned; K a multiple of 64 with K / 64 >= S; M in 1..64;
N even. y [M, N] bf16. Not bit-identical to cuBLAS (a different K order), identical between runs. W only before the
PDL wait, x after it.
"""
from __future__ import annotations

import functools
import math

from ._dsl import (PDL, SMEM_PER_CTA_MAX, TVM_FFI, check_tensor, compile_cached, fake_gemm_operands, fake_stream,
                   import_cute)

BM = 64                 # WGMMA's m: the tokens (rows past M are zero-filled by the TMA unit or never stored)
BK = 64                 # k per ring stage: one 128-byte swizzle row per operand row
MIN_M, MAX_M = 1, 64
# Clusters of S CTAs (one CTA per SM, ~200 KB of shared memory) co-resident in one wave on the 132 SMs, as measured at
# this kernel's footprints: 15 of 8 at 222 KB, 30 of 4 at 211 KB (a 31-cluster plan ran a second wave and lost ~5 us),
# 66 of 2, 132 of 1 (docs/kernels/gemm_wgmma_splitk.md).
CLUSTERS_RESIDENT = {8: 15, 4: 30, 2: 66, 1: 132}
PRODUCER_WARP = 4
NTHREADS = 32 * (PRODUCER_WARP + 1)
BARRIER_BYTES = 1024
X_ROWS = (16, 32, 64)    # x rows a ring stage loads with xrows="auto": the token bucket; WGMMA's m stays 64


def stage_bytes(BN: int, xrows: int = BM) -> int:
    return (xrows + BN) * BK * 2


def x_rows(M: int, xrows=None) -> int:
    """The x rows a stage loads for M tokens: None = BM (a 64-row box, the TMA unit zero-filling rows past M), "auto"
    = the smallest of X_ROWS that holds M (the stage's x tile then costs what the tokens need)."""
    if xrows is None:
        return BM
    if xrows == "auto":
        return next(r for r in X_ROWS if M <= r)
    raise ValueError(f"xrows must be None or 'auto', got {xrows!r}")


@functools.lru_cache(maxsize=None)        # every call asks (applicable, then compile_key): the plan once per shape
def plan(N: int, K: int, ksplit: int | None = None, bn: int | None = None, xrows: int = BM) -> tuple[int, int, int]:
    """(BN, S, D): the W rows per CTA, the cluster's K split and the ring depth for y = x @ W^T, W [N, K].

    Among the splits whose clusters are all co-resident in one wave, the one with the fewest ring bytes in the busiest
    CTA (its W tile plus its x tile per k-tile, times its k-tiles); ties go to the larger S (fewer re-reads of x).
    ``ksplit`` / ``bn`` pin S / BN (the layer's pins). ``xrows``: the x rows each stage loads; the ring's x tiles then
    take xrows rows each, and the WGMMA's 64-row view of the last one reads (BM - xrows) rows past it, which the ring
    reserves."""
    if xrows not in X_ROWS:
        raise ValueError(f"xrows must be one of {X_ROWS}, got {xrows}")
    if K % BK:
        raise ValueError(f"w: K must be a multiple of {BK}, got {K}")
    KT = K // BK
    best = None
    for S in ((ksplit,) if ksplit else (8, 4, 2, 1)):
        if S not in CLUSTERS_RESIDENT:
            raise ValueError(f"ksplit must be one of {sorted(CLUSTERS_RESIDENT)}, got {S}")
        if KT < S:
            continue
        resident = CLUSTERS_RESIDENT[S]
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
    tail = (BM - xrows) * BK * 2        # the 64-row WGMMA view of the last x tile reaches this far past it
    D = (SMEM_PER_CTA_MAX - BARRIER_BYTES - tail) // stage_bytes(BN, xrows)
    ring = D * stage_bytes(BN, xrows) + tail
    if D < 2 or ring < BM * (BN + 4) * 4:
        raise ValueError(f"BN = {BN}, D = {D}: fewer than two ring stages, or the fp32 tile does not fit the ring")
    return BN, S, D


def applicable(M: int, K: int, N: int, xrows=None, **pins) -> bool:
    """Whether gemm_wgmma takes y[M, N] = x[M, K] @ W[N, K]^T: M in 1..64, N even, and a one-wave plan (``pins``:
    ksplit / bn; ``xrows``: gemm_wgmma's)."""
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
        def __init__(self, BN, S, K, D, BMX=BM):
            self.BN, self.S, self.K, self.D, self.BKS = BN, S, K, D, BK
            self.BMX = BMX
            self.stage_tx = stage_bytes(BN, BMX)
            self.KT = K // BK
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
            # The TMA writes BMX rows of x per stage into stages BMX rows apart, and the WGMMAs read each stage through
            # the 64-row layout with that stage stride: rows >= BMX of a stage are the next stage's rows (or, past the
            # last, the tail plan() reserved), which only make output rows >= BMX > M - 1, never stored. With BMX = 64
            # both layouts are the plain one (a 64-row box the TMA unit zero-fills past M).
            ax_lay = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.BMX, BN, BK), BFloat16, D)
            if const_expr(self.BMX < BM):
                o = a_lay.outer
                a_lay = cute.make_composed_layout(a_lay.inner, 0, cute.make_layout(
                    o.shape, stride=(o.stride[0], o.stride[1], ax_lay.outer.stride[2])))
            tma_a, tA = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX,
                                                    cute.slice_(ax_lay, (None, None, 0)), (self.BMX, BK))
            tma_b, tB = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW,
                                                    cute.slice_(b_lay, (None, None, 0)), (BN, BK))
            ntiles = (cute.size(mW, mode=[0]) + BN - 1) // BN
            self.kernel(tma_a, tA, tma_b, tB, mW, mY, tiled_mma, a_lay, b_lay, ax_lay).launch(
                grid=[self.S, ntiles, 1], block=[NTHREADS, 1, 1], cluster=[self.S, 1, 1], stream=stream,
                use_pdl=PDL)

        @cute.jit
        def load_w(self, tma_b, tBgB, tBsB, mbar, kt, s):
            """Arm stage s's full barrier (W's and x's bytes) and request k-tile kt of this CTA's W rows into it (the
            producer warp): one 2-D box; the TMA unit zero-fills rows past N and counts them."""
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, self.stage_tx)
            cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, s)], tma_bar_ptr=mbar + s)

        @cute.kernel
        def kernel(self, tma_a, mA, tma_b, mB, mW, mY, tiled_mma, a_lay, b_lay, ax_lay):
            # mW (W itself) is not read here: tma_b carries it. It stays a kernel parameter so that this build's PTX
            # is the measured one.
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
                    self.load_w(tma_b, tBgB, tBsB, mbar, k0 + q, q)
                cute.arch.griddepcontrol_wait()
                for q in cutlass.range(npre, unroll=1):
                    cute.copy(tma_a, tAgA[(None, k0 + q)], tAsA[(None, q)], tma_bar_ptr=mbar + q)
                for q in cutlass.range(D, nkt, unroll=1):
                    s = q % D
                    cute.arch.mbarrier_wait(mbar + D + s, (q // D - 1) % 2)
                    self.load_w(tma_b, tBgB, tBsB, mbar, k0 + q, s)
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
            # every CTA of the cluster is past its main loop: the dependent may launch (a trigger per warp would let
            # the producer warp, done D stages before its consumers, launch it early)
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


def compile_key(N: int, K: int, ksplit: int | None = None, bn: int | None = None, xrows: int = BM) -> tuple:
    """The build for [N, K] with the plan's pins; x tiles of fewer than BM rows end the key with "x<rows>"."""
    return ("gemm_wgmma_splitk",) + plan(N, K, ksplit, bn, xrows) + (K,) + ((f"x{xrows}",) if xrows != BM else ())


def _build(BN, S, D, K, xrows=BM, options=TVM_FFI):
    _, cute = import_cute()
    x, w, y = fake_gemm_operands(K, 2, 4)
    return cute.compile(_cls()(BN, S, K, D, xrows), x, w, y, fake_stream(), options=options)


def _compile(key):
    _, BN, S, D, K = key[:5]
    xrows = int(key[5][1:]) if len(key) > 5 else BM
    return compile_cached(key, lambda: _build(BN, S, D, K, xrows))


def gemm_wgmma(x, w, out=None, *, ksplit: int | None = None, bn: int | None = None, xrows=None):
    """y[M, N] = bf16(x[M, K] @ w[N, K]^T) with fp32 accumulation, M in 1..64: the cluster K-split WGMMA GEMM.
    ``ksplit`` / ``bn``: pin the plan's S / BN; ``xrows``: None loads a 64-row x box per stage, "auto" only the token
    bucket's 16 / 32 / 64 rows (the same sums: the same bits). The layer's pins: {}, {"ksplit": 2, "bn": 96, "xrows":
    "auto"} (rank8's width), {"ksplit": 4, "bn": 112, "xrows": "auto"} (rank16's width above M = 16)."""
    import torch
    check_tensor("x", x, dtype=torch.bfloat16)
    check_tensor("w", w, dtype=torch.bfloat16, device=x.device)
    if x.dim() != 2 or not MIN_M <= x.shape[0] <= MAX_M:
        raise ValueError(f"x: expected [M, K] with M in {MIN_M}..{MAX_M}, got {list(x.shape)}")
    if w.dim() != 2 or w.shape[1] != x.shape[1] or w.shape[0] % 2 or w.shape[0] == 0:
        raise ValueError(f"w: expected [N (even, > 0), K = {x.shape[1]}], got {list(w.shape)}")
    M, K = x.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(M, N), device=x.device, align=4)
    _compile(compile_key(N, K, ksplit, bn, x_rows(M, xrows)))(x, w, out)
    return out


# ------------------------------------------------------------------------------ warm-up

def compile_keys(N: int, K: int, batches, *, ksplit: int | None = None, bn: int | None = None, xrows=None) -> list:
    """The builds gemm_wgmma(x, w, **pins) runs for an [N, K] weight at these batch sizes (those it applies to)."""
    return sorted({compile_key(N, K, ksplit, bn, x_rows(M, xrows)) for M in batches
                   if applicable(M, K, N, xrows, ksplit=ksplit, bn=bn)}, key=str)


def warmup(N: int, K: int, batches, **pins):
    """Compile every build compile_keys(N, K, batches, **pins) lists (call before CUDA-graph capture)."""
    for key in compile_keys(N, K, batches, **pins):
        _compile(key)
