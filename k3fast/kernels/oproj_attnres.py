"""o_proj GEMV + partial-sum update + pre-MLP AttnRes mix + post_attention RMSNorm, one launch.

What it replaces (docs/k3-layer.md sections 4.2 steps 3-5, 4.3 "attn_res #2", 5, 6, 13.2 item 1)
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

Design
------
The mix needs the whole 7168-wide row of p', which is spread over every GEMV CTA. One launch holds 112 GEMV CTAs
(64 output rows each) and, appended to the grid (block index >= 112), one epilogue CTA per token; 256 threads each.
  * GEMV: mma.sync m16n8k16 swap-AB (weights = A, 8 tokens = B), k permuted so that every lane does 16-byte loads
    of both operands. Per 16 rows x 32 k a lane issues 2 weight LDG.128, and per 8-token group 1 y LDG.128 (L1
    hit) + 2 MMAs: ~0.05 instructions per weight at M=1, ~0.3 at M=64, far below the ~15 per weight the issue rate
    allows at 4.3 TB/s (an FMA GEMV is issue-bound from M=4). K is split over 2 warps per 16-row group and the
    partial tiles are added through shared memory in a fixed order (deterministic). The weight stage ring (12 x
    32 k per warp at M <= 16, else 6) is issued before griddepcontrol_wait: at rank16 and M <= 16 the CTA's whole
    96 KB weight slice is in flight before the predecessor finishes; 48-96 KB in flight per SM covers HBM latency
    (Little: 38 GB/s/SM * ~1 us = 38 KB).
  * The last arriver: after its p' stores each GEMV CTA passes a CTA barrier and its thread 0 adds 1 to a global
    arrival counter with release semantics (the barrier and the release's cumulativity order every thread's
    stores, as CUTLASS's barrier arrivals do; no per-thread fence). Each epilogue CTA's thread 0 spins on the
    counter with acquire loads until all 112 have arrived, then the CTA reads its token's row of p' (.cg: written
    by other SMs). Each epilogue CTA departs by a relaxed add at its very end, after its stores of x; the last of
    the 112 + M arrivals re-arms the counter to 0, so CUDA-graph replays start from 0 with no memset node.
  * No deadlock without co-residency: GEMV CTAs never wait on anything but the PDL predecessor, so they always
    finish once resident; the spinners are at most 64, so at least 68 SMs always remain for GEMV CTAs (at
    M <= 20 the whole grid is one wave anyway).
  * Before the PDL wait each epilogue CTA computes its token's block statistics (<v_i,u>, <v_i,v_i>: they do not
    depend on a), keeps the blocks in shared memory (n_blocks * 14 KB <= 112 KB: registers already limit the
    kernel to 1 CTA/SM) and loads w_post into registers. After the wait the critical path is one L2 round trip
    for p', three CTA reductions and the stores of x. Loaded in the last loop instead, each w_post load would wait
    behind the previous store of x (ptxas does not hoist a load above a store it cannot prove disjoint): 4 serial
    round trips (-1.1 to -1.4 us at b1-b8 with the preload).
  * Residency: 1 CTA/SM (128-194 registers), so the grid (112 + M) is one wave for M <= 20.
  * Where the layer runs it: M <= 8 tokens and o_proj input width Kp <= 1536 (rank16, rank8). Above M = 8 cuBLAS's
    GEMM + a separate AttnRes #2 kernel is faster (at rank16 b64 this kernel took 23.6 us against cuBLAS's 8.6 for
    the GEMM alone); at full width (Kp = 12288, 176 MB) it reached only 1.0 TB/s at b8. The kernel itself accepts
    M <= 64 and all three widths. docs/kernels/oproj_attnres.md has the figures.

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

from ._dsl import PDL, TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, import_cute, weight_load_atom

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
MAX_M = 64
KP_SUPPORTED = (768, 1536, 12288)


def _tg_bucket(m: int) -> int:
    tg = -(-m // 8)
    return 1 << (tg - 1).bit_length()


def _stages(kp: int, tg: int) -> int:
    """Weight stages per warp in flight: 12 chunks of 32 k at M <= 16, 6 above (registers), a divisor of the
    warp's chunks."""
    cpw = kp // (CHUNK * KS)                  # chunks per warp
    s = 12 if tg <= 2 else 6
    s = min(s, cpw)
    while cpw % s:
        s -= 1
    return s


def compile_key(kp: int, n_blocks: int, m: int) -> tuple:
    return ("oproj_attnres", int(kp), int(n_blocks), _tg_bucket(int(m)))


def _build(kp: int, n_blocks: int, tg: int):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32, const_expr
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    NB = n_blocks
    MP = 8 * tg
    R = ROWS
    S = _stages(kp, tg)
    CPW = kp // (CHUNK * KS)
    NIT = CPW // S
    PPT = R * MP // THREADS                 # (row, token) outputs per thread in the GEMV epilogue
    NRED = max(2 * NB, 2)
    red_words = KS * MP * MSTRIDE
    blk_elems = NB * D if NB > 0 else 8       # the blocks stay in shared memory between the two passes
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
                grid=[G + m_tok, 1, 1], block=[THREADS, 1, 1], smem=smem_bytes, stream=stream,
                use_pdl=PDL)

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
            sRed = smem.allocate_tensor(Float32, cute.make_layout((KS, MP, MSTRIDE),
                                                                  stride=(MP * MSTRIDE, MSTRIDE, 1)), 16)
            sBlk = smem.allocate_tensor(BFloat16, cute.make_layout((blk_elems // VEC, VEC), stride=(VEC, 1)), 16)
            sSum = smem.allocate_tensor(Float32, cute.make_layout(WARPS * 16), 16)

            if bid < G:
                # ============================== GEMV role ==============================
                rg = warp % RG
                ks = warp // RG
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
                    self.load_w_stage(gW, rW, s, ks + KS * s, n0, t, w_atom)

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
                        c = ks + KS * (it * S + s)
                        self.consume_stage(gY, rW, rY, acc, s, c, toks, t)
                        self.load_w_stage(gW, rW, s, c + KS * S, n0, t, w_atom)
                for s in cutlass.range_constexpr(S):
                    c = ks + KS * ((NIT - 1) * S + s)
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
                        for k2 in cutlass.range_constexpr(1, KS):
                            v = v + sRed[k2, mm, r]
                        # one bf16 rounding of a (the all-reduce boundary), then the bf16 partial add
                        pn = v.to(BFloat16).to(Float32) + rPart[q]
                        mPo[mm, bid * R + r] = pn.to(BFloat16)
                # release: every thread's p' stores are ordered before thread 0's arrival by the CTA barrier and
                # the release's cumulativity alone, as CUTLASS's barrier arrivals do (a fence in every thread would
                # wait for that thread's own stores first)
                cute.arch.sync_threads()
                if tid == 0:
                    cute.arch.atomic_add(mCnt.iterator, Int32(1), sem="release", scope="gpu")
            else:
                # ============================ epilogue role ============================
                mrow = bid - G
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
                                stats[2 * i + 1] = (stats[2 * i + 1]
                                                    + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                                cute.autovec_copy(r8, sBlk[i * NVEC + jv, None])
                    self.block_sum(stats, 2 * NB, sSum, warp, lane)

                # w_post into registers now, so that the last loop's loads do not queue behind its stores of x
                rWp = cute.make_rmem_tensor(cute.make_layout((VPT, VEC), stride=(VEC, 1)), BFloat16)
                for rr in cutlass.range_constexpr(VPT):
                    jv = tid + rr * THREADS
                    if jv < NVEC:
                        cute.autovec_copy(gWp[None, jv], rWp[rr, None])

                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()

                # ---- wait until every GEMV CTA published its rows of p'
                if tid == 0:
                    cnt = cute.arch.load(mCnt.iterator, Int32, sem="acquire", scope="gpu")
                    while cnt < G:
                        cnt = cute.arch.load(mCnt.iterator, Int32, sem="acquire", scope="gpu")
                cute.arch.sync_threads()            # the acquire load, then the barrier: no fence needed

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
                            cute.autovec_copy(sBlk[i * NVEC + jv, None], r8)
                            acc_m = acc_m + r8.load().to(Float32) * (exps[i] * inv_den)
                        rM[rr, None].store(acc_m)
                        mst[0] = mst[0] + (acc_m * acc_m).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                self.block_sum(mst, 1, sSum, warp, lane)
                rstd = cute.math.rsqrt(mst[0] * inv_d + eps)

                # ---- x = bf16(w_post * m * rstd)
                for rr in cutlass.range_constexpr(VPT):
                    jv = tid + rr * THREADS
                    if jv < NVEC:
                        xv = rWp[rr, None].load().to(Float32) * (rM[rr, None].load() * rstd)
                        r8.store(xv.to(BFloat16))
                        cute.autovec_copy(r8, gX[0, None, mrow, jv])
                # the departure last, where waiting for its result overlaps the stores of x draining (every
                # epilogue CTA passed its spin before departing, so the last one may re-arm)
                if tid == 0:
                    self.depart(mCnt, G + m_tok)

    return OprojAttnRes(), smem_bytes



def _compile(kp: int, n_blocks: int, tg: int):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32

    obj, _ = _build(kp, n_blocks, tg)
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
    # A 128-register cap (2 CTAs/SM for tg > 1) does not take in cutlass-dsl 4.8.1: launch(min_blocks_per_mp=...)
    # queries the driver at compile time (not on a CPU machine) and --ptxas-options maxrregcount leaves the ptxas
    # count unchanged, so the kernel runs 1 CTA/SM (128-194 registers).
    return cute.compile(obj, *fakes, Int32(0), Float32(1e-5), fake_stream(), options=TVM_FFI)


def _get_compiled(key: tuple):
    return compile_cached(key, lambda: _compile(key[1], key[2], key[3]))


def get_kernel(kp: int, n_blocks: int, m: int):
    """The compiled kernel for o_proj input width kp, n_blocks sources and m tokens."""
    return _get_compiled(compile_key(kp, n_blocks, m))


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
        _get_compiled(key)
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
                  out_x=None, out_partial=None, counter=None):
    """x_moe, partial_new = post-attention half of a K3 layer's decode step (see module docstring).

    y [M, Kp] bf16, w_o [7168, Kp] bf16, blocks [M, >=n_blocks, 7168] bf16, partial [M, 7168] bf16,
    u_mlp [7168] fp32, w_post [7168] bf16. Returns (x_moe [M, 7168] bf16, partial_new [M, 7168] bf16),
    written into out_x / out_partial when given (out_partial may alias partial). boundary: this layer starts a new
    block, so p' = a. counter: a private arrival counter (int32 [4], zeros) instead of the device's.
    No host sync; capturable in a CUDA graph after ``warmup``.
    """
    import torch
    _check_inputs(y, w_o, blocks, n_blocks, partial, u_mlp, w_post, eps, out_x, out_partial, counter)
    m, kp = y.shape
    if out_x is None:
        out_x = torch.empty((m, D), dtype=torch.bfloat16, device=y.device)
    if out_partial is None:
        out_partial = torch.empty((m, D), dtype=torch.bfloat16, device=y.device)
    cnt = counter if counter is not None else _workspace(y.device)
    fn = get_kernel(kp, n_blocks, m)
    fn(y, w_o, blocks, partial, u_mlp, w_post, out_partial, out_x, cnt, 1 if boundary else 0, float(eps))
    return out_x, out_partial
