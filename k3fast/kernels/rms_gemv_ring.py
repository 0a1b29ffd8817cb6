"""AttnRes #1 + input RMSNorm + the packed in_proj GEMV with the weights streamed through a bulk-copy shared-memory
ring (the layer's in_proj at M <= 2), and the same ring with a tensor-core consumer for a bare GEMV at M <= 8 (the
layer's in_proj GEMV at M 3..8, behind rms_gemv.attnres_rmsnorm).

Replaces the reference ops of ``rms_gemv.attnres_rms_gemv`` (docs/k3-layer.md sections 6 + 4.3 "attn_res #1",
5 input_layernorm, 7.2 step 1): y = bf16(x @ W_in^T) with x = bf16(w_ln * m * rstd(m)); ``gemv_ring_mma`` is the
bare y = bf16(x @ W^T). docs/kernels/rms_gemv_ring.md has the design, the figures and the version table.

Design, fused (``attnres_rms_gemv_ring``): one CTA of 16 warps per SM. CTA b owns a contiguous run of row pairs of W,
so its weights are one contiguous byte range, streamed in chunks of two rows (28 KB at K = 7168) by 1-D
cp.async.bulk into a ring of D slots, each with a "full" mbarrier (the producer's arrive.expect_tx + the copy's
complete_tx) and an "empty" one (an arrival per consumer warp). Warp 14 is the producer (one elected lane); warps
0-13 consume: warp w takes row w // 7 of each chunk and the (w % 7)-th seventh of its K range, with x in registers,
so the loop reads only weights from shared memory. Before the PDL wait the producer fills the D1 slots that do not
hold the AttnRes prologue's staged source rows (weights do not depend on the predecessor); after the prologue
(rms_gemv's code, all 16 warps) and a proxy fence it fills the rest and keeps the ring full. The 7 partials of a row are added in
a fixed order after the loop.

Design, tensor-core (``gemv_ring_mma``): one CTA per SM over the N / 16 row tiles, 8 consumer warps + 1 producer. A
chunk is one 16-row x KC tile of W (16 row pieces of 1-D bulk copies onto one barrier, each staged row padded by 64 B
so that a quad phase of 16-byte loads is conflict-free); x (M rows) is staged once after the PDL wait. Consumer warp
w takes k32 steps [2 w, 2 w + 2) of every chunk, two mma.sync m16n8k16 per step (swap-AB: W rows are the MMA's M,
tokens its N; _dsl.swapab_a_fragment); the 8 warps' fp32 tile partials are added in warp order.

Contracts: W, u and w_ln are read before griddepcontrol_wait; blocks, partial, delta and x after it. Both launch
their PDL dependent after their last store. One CTA per SM (~227 KB of shared memory each). Deterministic: a fixed K
split and summation order per output, whatever the grid. Fused: M <= 2, N a positive multiple of 16, K a multiple of
1792 (7 warps x 32 lanes x 8). Tensor-core: M <= 8, K a multiple of 256, at most MMA_TILES_MAX tiles per CTA
(mma_applicable: the rank16 / rank8 in_proj and o_proj, not full width).
"""

from __future__ import annotations

import math

from ._dsl import (PDL, SMEM_PER_CTA_MAX, TVM_FFI, check_tensor, compile_cached, fake_gemm_operands, fake_stream,
                   fake_tensor, gemv_operands, import_cute)

NUM_SMS = 132
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


def ring_plan(MB: int, K: int, nb: int, cmax: int, joint: bool = False) -> tuple[int, int]:
    """(D, D1): ring slots that fit the CTA's shared memory next to the other buffers, and how many of them the
    producer may fill before the AttnRes prologue (the others hold the prologue's staged source rows: one token's
    n_blocks + 1 rows, or every token's with the joint prologue)."""
    cb = RPC * K * 2
    nm = MB if joint else 1                                          # tokens whose sources are staged at once
    fixed = 2 * 8 * 16 + cmax * RPC * WPR * MB * 4 + SMEM_SLACK     # mbarriers (D <= 16), partial sums, padding
    fixed += MB * K * 2 + WARPS * 2 * (nb + 1) * 4 * nm + WARPS * 4 * nm
    D = min(16, (SMEM_PER_CTA_MAX - fixed) // cb)     # 16 slots are plenty at any K; the mbarrier bound above
    D1 = D - math.ceil(nm * (nb + 1) * K * 2 / cb)
    if D < 2 or D1 < 1:
        raise ValueError(f"rms_gemv_ring: shared memory holds {D} ring slots of {cb} B ({D1} before the prologue) at "
                         f"K={K}, n_blocks={nb}, M={MB}: needs >= 2 and >= 1")
    return D, D1


def joint_applies(MB: int, K: int, nb: int, cmax: int) -> bool:
    """The joint prologue (every token's AttnRes + RMSNorm in one pass: one round of source loads and one CTA barrier
    per reduction for all tokens, w_ln loaded with u) runs where every token's source rows fit in the ring beside at
    least two slots filled before the prologue (at M = 2, K = 7168: n_blocks <= 3); elsewhere the tokens run one by
    one. Both give the same bits."""
    try:
        return ring_plan(MB, K, nb, cmax, joint=True)[1] >= 2
    except ValueError:
        return False


def _build_kernel_class():
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int64, const_expr
    from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_shared_cluster_global
    from . import rms_gemv

    ADD = cute.ReductionOp.ADD
    Norm = rms_gemv._kernels()[3]
    prologue = Norm.prologue                 # the AttnRes mix + RMSNorm of one token, by the whole CTA
    prologue_tokens = Norm.prologue_tokens   # ... of several tokens in one pass (the joint prologue)

    class RingGemv:
        def __init__(self, MB, K, cmax, nb, has_delta, bw, eps, joint):
            self.MB, self.K, self.cmax = MB, K, cmax
            self.nb, self.has_delta, self.bw, self.eps = nb, has_delta, bw, eps
            self.joint = joint
            self.nwarps, self.nthreads = WARPS, 32 * WARPS          # read by the shared prologue
            self.vpt = -(-(K // 8) // self.nthreads)
            self.vpl = K // K_UNIT
            self.cb = RPC * K * 2
            self.D, self.D1 = ring_plan(MB, K, nb, cmax, joint)

        @cute.jit
        def __call__(self, mW, mY, mBlocks, mP, mD, mPout, mU, mWln, stream):
            N = cute.size(mW, mode=[0])
            grid = cutlass.min(N // RPC, NUM_SMS)
            self.kernel(mW, mY, mBlocks, mP, mD, mPout, mU, mWln).launch(
                grid=[grid, 1, 1], block=[self.nthreads, 1, 1], stream=stream, use_pdl=PDL,
                preferred_smem_carveout=100)

        @cute.kernel
        def kernel(self, mW, mY, mBlocks, mP, mD, mPout, mU, mWln):
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

            sX = smem.allocate_tensor(BFloat16, cute.make_layout((self.MB, K), stride=(K, 1)), 16)
            nm = self.MB if const_expr(self.joint) else 1
            sRedA = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 2 * (self.nb + 1) * nm),
                                                                   stride=(2 * (self.nb + 1) * nm, 1)), 16)
            sRedB = smem.allocate_tensor(Float32, cute.make_layout((WARPS, nm), stride=(nm, 1)), 16)
            # the prologue's source rows live in ring slots D1.., which the producer fills only after it
            sV = cute.make_tensor(sRing[None, D1 * CB // 16].iterator,
                                  cute.make_layout((nm * (self.nb + 1), K), stride=(K, 1)))
            cute.arch.griddepcontrol_wait()
            gX = cute.flat_divide(sX, (1, 8))
            if const_expr(self.joint):
                # every token in one pass (one round of source loads, one barrier per reduction, w_ln loaded with
                # u); the same bits as the token-by-token prologue below
                prologue_tokens(self, tuple(range(self.MB)), mBlocks, mP, mD, mPout, mU, mWln, gX, sV, sRedA,
                                sRedB, tid, warp, lane, bid == 0, True)
            else:
                for m in cutlass.range_constexpr(self.MB):
                    prologue(self, m, mBlocks, mP, mD, mPout, mU, mWln, gX, sV, sRedA, sRedB, tid, warp, lane,
                             bid == 0)
            cute.arch.sync_threads()

            rr = warp // WPR
            kv0 = (warp - rr * WPR) * (32 * self.vpl) + lane
            if is_producer:
                with cute.arch.elect_one():
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
            # the dependent (the KDA step) launches at the end: launched after the wait, its CTAs sat beside the
            # ring's and slowed the chain after it (the design note has the figures)
            cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def issue(self, mW, sRing, mbar, s, pair):
            """Chunk `pair` (rows 2 pair, 2 pair + 1: contiguous) into ring slot s, completing on full[s]."""
            cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, self.cb)
            src = cute.flat_divide(mW, (1, 8))[0, None, pair * RPC, 0].iterator
            cp_async_bulk_shared_cluster_global(sRing[None, s * (self.cb // 16)].iterator, src, mbar + s, self.cb)

    return cutlass, cute, RingGemv


# ------------------------------------------------------------------------------ the tensor-core ring, M <= 8
MMA_MAX_M = 8            # x of every token staged in shared memory (8 x 14 KB at K = 7168) beside the ring
MMA_CONSUMERS = 8        # consumer warps; warp 8 is the producer
MMA_PAD = 64             # bytes added to each staged row: rows g and g+1 of a quad phase land 64 B apart (no conflict)
MMA_TILES_MAX = 4        # the consumer loop is unrolled over a CTA's tiles: the K3 in_proj / o_proj at TP 8-16


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


def mma_plan(MB: int, K: int, tmax: int) -> tuple[int, int]:
    """(KC, D): the chunk width and the ring slots that fit beside x (MB padded rows) and the partial sums."""
    kc = mma_kc(K)
    slot = 16 * (2 * kc + MMA_PAD)
    fixed = MB * (2 * K + MMA_PAD) + MMA_CONSUMERS * tmax * 16 * 8 * 4 + 8 * (2 * 16 + 1) + SMEM_SLACK
    D = min(16, (SMEM_PER_CTA_MAX - fixed) // slot)
    if D < 2:
        raise ValueError(f"rms_gemv_ring (mma): {D} ring slots of {slot} B fit beside x at M={MB}, K={K}: needs >= 2")
    return kc, D


def mma_bucket(M: int) -> int:
    if not 1 <= M <= MMA_MAX_M:
        raise ValueError(f"x: the tensor-core ring GEMV takes M in 1..{MMA_MAX_M}, got {M}")
    return 4 if M <= 4 else 8


def mma_applicable(M: int, K: int, N: int) -> bool:
    """Whether gemv_ring_mma serves this GEMV: M <= 8, K a multiple of 256, at most MMA_TILES_MAX tiles per CTA and x
    beside at least two ring slots (not at full width: K = 12288 or N = 49376)."""
    if not 1 <= M <= MMA_MAX_M or K % 256 or N % 16 or N == 0 or mma_tiles_max(N) > MMA_TILES_MAX:
        return False
    try:
        mma_plan(mma_bucket(M), K, mma_tiles_max(N))
    except ValueError:
        return False
    return True


def _build_mma_class():
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int64
    from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_shared_cluster_global
    from ._dsl import swapab_a_fragment

    class RingMmaGemv:
        """y = x W^T for M <= 8: W in 16-row x KC chunks through a bulk-copy ring, x staged once, mma.sync."""

        def __init__(self, MB, K, tmax):
            self.MB, self.K, self.tmax = MB, K, tmax
            self.kc, self.D = mma_plan(MB, K, tmax)
            self.nkc = K // self.kc
            self.spw = self.kc // 32 // MMA_CONSUMERS      # k32 steps of a chunk per consumer warp
            self.rs_v = (2 * self.kc + MMA_PAD) // 16       # staged row stride in 16-byte vectors
            self.slot_v = 16 * self.rs_v
            self.xs_v = (2 * K + MMA_PAD) // 16
            self.nthreads = 32 * (MMA_CONSUMERS + 1)

        @cute.jit
        def __call__(self, mX, mW, mY, stream):
            T = cute.size(mW, mode=[0]) // 16
            self.kernel(mX, mW, mY).launch(grid=[cutlass.min(T, NUM_SMS), 1, 1], block=[self.nthreads, 1, 1],
                                           stream=stream, use_pdl=PDL, preferred_smem_carveout=100)

        @cute.kernel
        def kernel(self, mX, mW, mY):
            tid = cute.arch.thread_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bid = cute.arch.block_idx()[0]
            nblk = cute.arch.grid_dim()[0]
            M = cute.size(mX, mode=[0])
            T = cute.size(mW, mode=[0]) // 16
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
            # the dependent launches at the end: launched after the wait, its CTAs (the KDA step's) sat beside the
            # ring's and stretched the chain (the design note has the figures)
            cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def issue(self, gW, sRing, mbar, s, q, t0):
            """Chunk q of this CTA (tile t0 + q // NKC, columns [(q % NKC) KC, + KC)) into slot s: 16 row pieces."""
            cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, 16 * self.kc * 2)
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


def mma_compile_key(M: int, K: int, N: int) -> tuple:
    """The tensor-core ring's build: the token bucket (4 / 8), K, and the busiest CTA's tile count (N)."""
    return ("rms_gemv_ring.mma", mma_bucket(M), K, mma_tiles_max(N))


def _build_mma(MB, K, tmax, options=TVM_FFI):
    _, cute = import_cute()
    x, w, y = fake_gemm_operands(K, 16, 2)
    return cute.compile(_mma_cls()(MB, K, tmax), x, w, y, fake_stream(), options=options)


def _compile_mma(key):
    _, MB, K, tmax = key
    return compile_cached(key, lambda: _build_mma(MB, K, tmax))


def gemv_ring_mma(x, w, out=None):
    """y[M, N] = x[M, K] @ w[N, K]^T for M <= 8 through the bulk-copy ring with a tensor-core consumer: bf16 in / out,
    fp32 accumulation, the K partials of the 8 consumer warps added in warp order."""
    M, N, K, out = gemv_operands(x, w, out, k_multiple=256)
    mma_bucket(M)
    if not mma_applicable(M, K, N):
        raise ValueError(f"w: the tensor-core ring GEMV takes at most {MMA_TILES_MAX} 16-row tiles per CTA and x "
                         f"beside two ring slots; [N, K] = [{N}, {K}] at M = {M} does not fit (mma_applicable)")
    _compile_mma(mma_compile_key(M, K, N))(x, w, out)
    return out


# ------------------------------------------------------------------------------ the fused ring, M <= 2

_CLS = None


def _cls():
    global _CLS
    if _CLS is None:
        _CLS = _build_kernel_class()
    return _CLS


def compile_key(M: int, K: int, N: int, n_blocks: int, has_delta: bool, block_write: int, wln: str = "bf16",
                eps: float = 1e-5) -> tuple:
    """The fused ring's build: the ring plan depends on M, K, n_blocks and the busiest CTA's chunk count (N); the
    joint prologue runs where it applies (the key then ends with "joint")."""
    cmax = chunks_max(N)
    return (("rms_gemv_ring.fused", M, K, cmax, n_blocks, bool(has_delta), block_write, wln, float(eps))
            + (("joint",) if joint_applies(M, K, n_blocks, cmax) else ()))


def _build(MB, K, cmax, nb, has_delta, bw, wln, eps, joint, options=TVM_FFI):
    cutlass, cute, RingGemv = _cls()
    from .rms_gemv import NB_MAX
    BF = cutlass.BFloat16
    N = cute.sym_int(divisibility=16)
    w = fake_tensor(BF, (N, K))
    y = fake_tensor(BF, (MB, N), align=2)
    blocks = fake_tensor(BF, (MB, NB_MAX, K))
    p = fake_tensor(BF, (MB, K))
    d = fake_tensor(BF, (MB, K)) if has_delta else None
    po = fake_tensor(BF, (MB, K))
    u = fake_tensor(cutlass.Float32, (K,))
    wl = fake_tensor({"bf16": BF, "fp32": cutlass.Float32}[wln], (K,))
    obj = RingGemv(MB, K, cmax, nb, has_delta, bw, eps, joint)
    return cute.compile(obj, w, y, blocks, p, d, po, u, wl, fake_stream(), options=options)


def _compile(key):
    _, M, K, cmax, nb, hd, bw, wln, eps = key[:9]
    return compile_cached(key, lambda: _build(M, K, cmax, nb, hd, bw, wln, eps, key[9:] == ("joint",)))


def _check_w(w, K, dev):
    import torch
    check_tensor("w", w, dtype=torch.bfloat16, device=dev)
    if w.dim() != 2 or w.shape[1] != K or w.shape[0] % 16 or w.shape[0] == 0:
        raise ValueError(f"w: expected [N (a positive multiple of 16), {K}], got {list(w.shape)}")
    if K % K_UNIT:
        raise ValueError(f"rms_gemv_ring: K must be a multiple of {K_UNIT} (7 warps x 32 lanes x 8), got {K}")
    return w.shape[0]


def attnres_rms_gemv_ring(blocks, n_blocks, partial, delta, u, w_ln, w, *, eps=1e-5, block_write=-1, out=None,
                          partial_out=None):
    """rms_gemv.attnres_rms_gemv's contract at M <= 2 with the weights through the bulk-copy ring: returns (y,
    partial_out), y = bf16(RMSNorm_{w_ln}(AttnRes mix) @ w^T), p' = bf16(p + delta) into partial_out (and
    blocks[:, block_write] when block_write >= 0). partial_out must not alias partial or delta (CTA 0 writes p' while
    every CTA reads p)."""
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
    key = compile_key(M, K, N, n_blocks, delta is not None, block_write, wln, eps)
    _compile(key)(w, out, blocks, partial, delta, partial_out, u, w_ln)
    return out, partial_out


# ------------------------------------------------------------------------------ warm-up

def compile_keys(batches, *, K, N, sites, wln="bf16", eps=1e-5, mma_shapes=()) -> list[tuple]:
    """The builds the layer's calls at these batch sizes run: the fused ring at M <= MAX_M for the in_proj [N, K] at
    every AttnRes site (n_blocks, has_delta, block_write) in ``sites``, and the tensor-core ring at MAX_M < M <=
    MMA_MAX_M for each (N, K) of ``mma_shapes`` that it serves (mma_applicable)."""
    keys = set()
    for M in batches:
        if M <= MAX_M:
            keys.update(compile_key(M, K, N, nb, hd, bw, wln, eps) for nb, hd, bw in sites)
        elif M <= MMA_MAX_M:
            keys.update(mma_compile_key(M, k, n) for n, k in mma_shapes if mma_applicable(M, k, n))
    return sorted(keys, key=str)


def warmup(batches, **kw):
    """Compile every build compile_keys(batches, **kw) lists (call before CUDA-graph capture)."""
    for key in compile_keys(batches, **kw):
        (_compile_mma if key[0] == "rms_gemv_ring.mma" else _compile)(key)
