"""Tensor-core GEMV for decode batches 5..64 with the activations staged in shared memory and K split across CTAs:
y[M, N] = bf16( x[M, K] @ w[N, K]^T ), bf16 in and out, fp32 accumulation (sm_90a, CuTe DSL).

Replaces, as an opt-in alternative (``rms_gemv.gemv(..., mma="splitk")``), the tensor-core path of
k3fast/rms_gemv.py (`_MmaGemv`): the packed KDA in_proj after AttnRes + RMSNorm at M > 4.

Why a second kernel.  `_MmaGemv` gives each CTA all of K and splits K among its warps, so every warp reads its B
fragments (the activations) from global memory at every 32-wide k step: at M = 64 that is 8 x 16 B of x per lane
per 2 x 16 B of weights, i.e. 4x the weight bytes again from L2 (rtw = 2) or 8x (rtw = 1).  The H200 run at
ea0c850 measured it 2x slower than cuBLAS at b64 (rank16 in_proj 39.6 us against 21.6 us, floor 11.2 us) and 1.4x
at b8 (27.2 against 19.7).  Here a CTA owns 8 warps x 16 weight rows and one K range of KCS k32 steps; it copies
x[:, K range] into shared memory once (cp.async, after the PDL wait) and all 8 warps read their B fragments from
there.  The K ranges of one row block are summed by the last CTA to finish (an acq_rel counter per row block,
self-resetting), in K-range order, from an fp32 workspace: deterministic, no float atomics.  With KG = 1 (wide N)
the CTA writes y directly.

Numerics: the same swap-AB mma.sync m16n8k16 fragments and K permutation as `_MmaGemv` (_dsl.swapab_a_fragment);
fp32 partial sums per K range, added in range order; one rounding to bf16 at the end.  The result differs from
`_MmaGemv`'s only in fp32 summation order.

Version log
  v1  (2026-11-29).  Prediction (rank16 in_proj, N = 3216,
      K = 7168: 26 row blocks x KG = 14 K ranges of 16 k32 steps, 364 CTAs, x tile 70 KB at M = 64): b64 39.6 ->
      ~22-26 us, b8 27.2 -> ~18-21 us, i.e. on par with cuBLAS; the attention half at b64 then loses ~15-20 us.
      If it misses, the first suspects are the short per-warp streams (16 k32 steps of 1 KB with 4 in flight) and
      the 1.4-wave grid; KG is one host-side number to sweep (``kg=`` override).
      Measured (traces/h200/kernels-e44cd14.json, same inputs and run; GPU tests passed, logs/gpu-junit-e44cd14.xml):
      plain in_proj rank16 b8 25.2 us (rms_gemv v2 27.3, cuBLAS 19.9), b64 58.4 us (v2 39.9, cuBLAS 22.1); the
      attention half at b64 104.8 us against 86.8 us with v2 (records-e44cd14-kda.json, fast-splitk vs fast).
      PREDICTION MISSED: 8 % better at b8, 46 % worse at b64.  Not measured, so hypotheses only: at b64 each
      CTA sums 14 partial tiles of 32 KB alone at the end of the grid, so each row block pays a serial
      ~450 KB read from L2 after its last K range; each warp's 16 k32 steps at unroll 2 are 8 dependent round trips; and
      128 registers x 256 threads allow 2 CTAs per SM, so 364 CTAs run in 1.4 waves.  Next: a kg sweep (1.5-wave
      vs 1-wave grids), and a reduction spread over the row block's CTAs (each sums 1/kg of the tile) or done
      with DSMEM in a cluster of the K ranges.  It stays opt-in (`mma="v2"` is the default).
"""

import functools

from ._dsl import (TVM_FFI, compile_cached, fake_stream, fake_tensor, gemv_operands, import_cute, swapab_a_fragment,
                   swapab_c_fragment_to, weight_load_atom)

WARPS = 8
ROWS = 16 * WARPS              # weight rows per CTA (one 16-row MMA tile per warp)
M_BUCKETS = (8, 16, 32, 64)
TARGET_CTAS = 2 * 132          # two resident CTAs per SM (<= 100 KB of x tile, <= 128 registers)
X_TILE_MAX = 100 * 1024


def bucket(M: int) -> int:
    for b in M_BUCKETS:
        if M <= b:
            return b
    raise ValueError(f"M={M} outside 1..64")


WORKSPACE_MAX = 16 << 20       # fp32 partials must stay L2-resident (50 MB L2), or the reduction costs HBM traffic


def applicable(N: int, K: int, M: int) -> bool:
    """Whether this kernel serves the shape: K a multiple of 32 and, when K is split, partials <= WORKSPACE_MAX.
    (At full width the in_proj's 386 row blocks fill the GPU without a split, but the x tile of all K does not
    fit in shared memory; those shapes stay on rms_gemv's kernel.)"""
    if K % 32 or N % 16 or not 1 <= M <= 64:
        return False
    try:
        kg = config(N, K, bucket(M))
    except ValueError:
        return False
    return kg == 1 or kg * M * N * 4 <= WORKSPACE_MAX


def x_tile_bytes(MB: int, kcs: int) -> int:
    return MB * (kcs * 32 + 32) * 2


@functools.lru_cache(maxsize=None)
def config(N: int, K: int, MB: int) -> int:
    """KG, the number of K ranges: the smallest divisor of K/32 that gives >= TARGET_CTAS CTAs with an x tile
    <= X_TILE_MAX and >= 4 k32 steps per range (otherwise the largest that fits)."""
    nk, rb = K // 32, -(-N // ROWS)
    ok = [d for d in range(1, nk + 1) if nk % d == 0 and nk // d >= 4 and x_tile_bytes(MB, nk // d) <= X_TILE_MAX]
    if not ok:
        raise ValueError(f"no K split fits N={N}, K={K}, M<={MB}")
    for d in ok:
        if rb * d >= TARGET_CTAS:
            return d
    return ok[-1]


def _build():
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32

    class SplitKGemv:
        def __init__(self, MB: int, kcs: int):
            self.MB, self.kcs = MB, kcs
            self.nt = MB // 8
            self.xw = kcs * 32 + 32          # x tile row stride in bf16: +64 B keeps the 16-B B loads conflict-free
            self.unroll = next(u for u in (4, 2, 1) if kcs % u == 0) if MB <= 16 else (2 if kcs % 2 == 0 else 1)
            words = max(x_tile_bytes(MB, kcs), ROWS * MB * 4) // 4
            self.words = -(-words // 4) * 4

        @cute.jit
        def __call__(self, mX, mW, mY, mWs, mCnt, kg: Int32, stream):
            N = cute.size(mW, mode=[0])
            self.kernel(mX, mW, mY, mWs, mCnt, kg).launch(
                grid=[(N + ROWS - 1) // ROWS, kg, 1], block=[32 * WARPS, 1, 1],
                smem=self.words * 4 + 64, stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, mX, mW, mY, mWs, mCnt, kg: Int32):
            tid = cute.arch.thread_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            rb, kgi, _ = cute.arch.block_idx()
            M = cute.size(mX, mode=[0])
            N = cute.size(mW, mode=[0])
            tiles = N // 16
            g = lane // 4
            c = lane - 4 * g
            k0 = kgi * self.kcs
            row0 = rb * ROWS
            gW = cute.flat_divide(mW, (1, 8))
            gX = cute.flat_divide(mX, (1, 8))
            w_atom = weight_load_atom(mW.element_type)
            x_cp = cute.make_copy_atom(
                cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL), BFloat16,
                num_bits_per_copy=128)
            # partial sums written by other CTAs of this launch: read them from L2, never from L1
            p_cg = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128,
                                       load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)
            atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))

            smem = cutlass.memory.SmemAllocator()
            region = smem.allocate_tensor(Float32, cute.make_layout(self.words), 16)
            flag = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
            # the x tile and, after the main loop, the fp32 output tile share one region
            sX = cute.make_tensor(cute.recast_tensor(region, BFloat16).iterator,
                                  cute.make_layout((self.MB, self.xw), stride=(self.xw, 1)))
            sP = cute.make_tensor(region.iterator, cute.make_layout((1, ROWS, self.MB),
                                                                    stride=(ROWS * self.MB, self.MB, 1)))
            gXs = cute.flat_divide(sX, (1, 8))

            # weights do not depend on the previous kernel: start pulling this warp's rows into L2 before the wait
            tile = rb * WARPS + warp
            rowb = cutlass.min(tile, tiles - 1) * 16
            if tile < tiles:
                lpr = (self.kcs * 4 + 7) // 8
                for idx in cutlass.range(lane, 16 * lpr, 32):
                    r = idx // lpr
                    ln = idx - r * lpr
                    cute.arch.prefetch(gW[0, None, rowb + r, k0 * 4 + 8 * ln].iterator.llvm_ptr, cache_level="L2")
            cute.arch.griddepcontrol_wait()
            nv = self.kcs * 4
            for idx in cutlass.range(tid, M * nv, 32 * WARPS):
                m = idx // nv
                v = idx - m * nv
                cute.copy(x_cp, gX[0, None, m, k0 * 4 + v], gXs[0, None, m, v])
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()

            xrow = []
            for j in cutlass.range_constexpr(self.nt):
                xrow.append(cutlass.min(8 * j + g, M - 1))     # token rows >= M: any staged row, never stored
            accs = []
            for j in cutlass.range_constexpr(self.nt):
                a = cute.make_rmem_tensor(cute.make_layout((4, 1, 1), stride=(1, 0, 0)), Float32)
                a.fill(0.0)
                accs.append(a)
            rA = cute.make_rmem_tensor(cute.make_layout((8, 2), stride=(1, 8)), mW.element_type)
            rX = cute.make_rmem_tensor(cute.make_layout((8, self.nt), stride=(1, 8)), BFloat16)
            fa = cute.make_rmem_tensor(cute.make_layout((8, 1, 1), stride=(1, 0, 0)), BFloat16)
            fb = cute.make_rmem_tensor(cute.make_layout((4, 1, 1), stride=(1, 0, 0)), BFloat16)
            for kk in cutlass.range(0, self.kcs, 1, unroll=self.unroll):
                kv = (k0 + kk) * 4 + c
                cute.copy(w_atom, gW[0, None, rowb + g, kv], rA[None, 0])
                cute.copy(w_atom, gW[0, None, rowb + g + 8, kv], rA[None, 1])
                for j in cutlass.range_constexpr(self.nt):
                    cute.autovec_copy(gXs[0, None, xrow[j], kk * 4 + c], rX[None, j])
                for h in cutlass.range_constexpr(2):
                    swapab_a_fragment(fa, rA, h, 0)
                    for j in cutlass.range_constexpr(self.nt):
                        for e in cutlass.range_constexpr(4):
                            fb[e] = rX[4 * h + e, j]
                        cute.gemm(atom, accs[j], fa, fb, accs[j])
            cute.arch.griddepcontrol_launch_dependents()

            # fragments -> fp32 tile sP[0, local row, token] (over the x tile: every warp is done reading it)
            cute.arch.barrier()
            for j in cutlass.range_constexpr(self.nt):
                swapab_c_fragment_to(sP, 0, accs[j], warp * 16 + g, 8 * j + 2 * c)
            cute.arch.barrier()
            nv4 = ROWS // 4
            gY4 = cute.flat_divide(mY, (1, 4))
            gWs4 = cute.flat_divide(mWs, (1, 4))
            r4 = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            s4 = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            o4 = cute.make_rmem_tensor(cute.make_layout(4), BFloat16)
            if kg == 1:
                for o in cutlass.range(tid, M * nv4, 32 * WARPS):
                    tok = o // nv4
                    v = o - tok * nv4
                    if row0 + 4 * v < N:
                        for e in cutlass.range_constexpr(4):
                            o4[e] = sP[0, 4 * v + e, tok].to(BFloat16)
                        cute.autovec_copy(o4, gY4[0, None, tok, rb * nv4 + v])
            else:
                for o in cutlass.range(tid, M * nv4, 32 * WARPS):
                    tok = o // nv4
                    v = o - tok * nv4
                    if row0 + 4 * v < N:
                        for e in cutlass.range_constexpr(4):
                            r4[e] = sP[0, 4 * v + e, tok]
                        cute.autovec_copy(r4, gWs4[0, None, kgi * M + tok, rb * nv4 + v])
                # the last of the kg CTAs of this row block sums the K ranges in order
                cute.arch.fence_acq_rel_gpu()
                cute.arch.barrier()
                if tid == 0:
                    old = cute.arch.atomic_add(mCnt.iterator + rb, Int32(1), sem="acq_rel", scope="gpu")
                    last = Int32(0)
                    if old == kg - 1:
                        mCnt[rb] = Int32(0)                 # self-reset for the next launch / graph replay
                        last = Int32(1)
                    flag[0] = last
                cute.arch.barrier()
                if flag[0] == 1:
                    cute.arch.fence_acq_rel_gpu()
                    for o in cutlass.range(tid, M * nv4, 32 * WARPS):
                        tok = o // nv4
                        v = o - tok * nv4
                        if row0 + 4 * v < N:
                            s4.fill(0.0)
                            for q in cutlass.range(0, kg):
                                cute.copy(p_cg, gWs4[0, None, q * M + tok, rb * nv4 + v], r4)
                                s4.store(s4.load() + r4.load())
                            o4.store(s4.load().to(BFloat16))
                            cute.autovec_copy(o4, gY4[0, None, tok, rb * nv4 + v])

    return SplitKGemv


_CLS = None


def _cls():
    global _CLS
    if _CLS is None:
        _CLS = _build()
    return _CLS


def compile_key(N: int, K: int, M: int, kg: int | None = None) -> tuple:
    MB = bucket(M)
    kg = config(N, K, MB) if kg is None else kg
    if (K // 32) % kg:
        raise ValueError(f"kg={kg} must divide K/32={K // 32}")
    return MB, (K // 32) // kg


def get_kernel(MB: int, kcs: int):
    def build():
        cutlass, cute = import_cute()
        BF, F32, I32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
        M, N, K, R = cute.sym_int(), cute.sym_int(divisibility=16), cute.sym_int(divisibility=32), cute.sym_int()
        return cute.compile(_cls()(MB, kcs), fake_tensor(BF, (M, K)), fake_tensor(BF, (N, K)),
                            fake_tensor(BF, (M, N), align=8), fake_tensor(F32, (R, N)),
                            fake_tensor(I32, (cute.sym_int(),), align=4), I32(1), fake_stream(), options=TVM_FFI)
    return compile_cached(("gemv_splitk", MB, kcs), build)


_WS: dict = {}


def workspace(device, kg: int, M: int, N: int):
    """(fp32 partials [kg * M, N], int32 counters [row blocks]) for one call; grown outside graph capture only."""
    import torch
    need_p, need_c = kg * M * N, -(-N // ROWS)
    ws = _WS.get(device)
    if ws is None or ws[0].numel() < need_p or ws[1].numel() < need_c:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gemv_splitk: workspace too small during CUDA-graph capture; call the GEMV once "
                               "(or warmup) with the largest M and N before capturing")
        old = (0, 0) if ws is None else (ws[0].numel(), ws[1].numel())
        ws = (torch.empty(max(need_p, old[0]), dtype=torch.float32, device=device),
              torch.zeros(max(need_c, old[1], 1024), dtype=torch.int32, device=device))
        _WS[device] = ws
    return ws[0][:need_p].view(kg * M, N), ws[1]


def gemv_splitk(x, w, out=None, *, kg: int | None = None):
    """y[M, N] = x[M, K] @ w[N, K]^T for M in 1..64, N a multiple of 16, K a multiple of 32 (module docstring)."""
    M, N, K, out = gemv_operands(x, w, out, k_multiple=32, out_align=8)
    if not w.is_cuda:
        raise ValueError("gemv_splitk runs on CUDA tensors only")
    MB, kcs = compile_key(N, K, M, kg)
    nkg = (K // 32) // kcs
    part, cnt = workspace(w.device, nkg, M, N)
    get_kernel(MB, kcs)(x, w, out, part, cnt, nkg)
    return out
