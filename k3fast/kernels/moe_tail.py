"""The tail of a Kimi K3 LatentMoE decode step in one launch (docs/k3-layer.md section 11):

    r_hat  = RMSNorm_{routed_expert_norm}(r), eps 1e-5
    routed = bf16(r_hat W_up^T)            (latent up-projection, dL = 3584 -> d = 7168)
    shared = bf16(h W_sd^T)                (shared experts' down-projection, Is -> d)
    f      = bf16(routed + shared)

r = bf16(sum_e w_e y_e) is the routed-expert combine (moe_mxfp4_experts) and h the shared experts' SiTU-GLU
output (router_down_topk); on one GPU there is no all-reduce (section 13.2), so f is the whole MLP delta.

Numerics. Both products accumulate in fp32 on tensor cores, in TWO accumulator sets per output, so routed and
shared are rounded to bf16 separately before the add, exactly as the reference. The RMSNorm statistics (sum of
r^2 over dL, fp32) come from the same r registers that feed the MMA, so there is no extra pass over r; the
per-token scale 1/rms is applied to the routed accumulator in the epilogue. The B operand is bf16(w_norm * r)
instead of the reference's bf16(w_norm * r / rms): one bf16 rounding either way (the same relative size), so the
result matches the reference to the tolerance a different summation order gives.

Kernel ("swap-AB" GEMV, mma.sync m16n8k16 bf16 -> fp32). Weight rows are the 16-row A operand, tokens the 8-column
B operand (NT = ceil(M / 8) n-tiles, a compile-time bucket; M itself is a run-time dim). A CTA is WR x WK warps:
a warp owns one 16-row output tile and every WK-th 32-wide K chunk. Per chunk a lane (g = lane / 4, t = lane % 4)
holds 16 B of weight rows g and g + 8 at k = 32 c + 8 t, and 16 B of token (8 j + g)'s activation at the same k;
the four 32-bit words feed two MMAs. The k order inside a chunk is permuted identically for A and B, which a full K
reduction does not see, so no shuffle or shared-memory staging of the operands is needed. At M <= RING_MAX_M the
weight stages go through a ring of RING_DEPTH slots per warp in shared memory, filled by cp.async; above it (the
layer runs cuBLAS there; the fast-taildsl contender runs this kernel) two register stages. Either way the first
stages are issued before the PDL wait (weights do not depend on the previous kernel). The WK partial tiles are
summed through shared memory in a fixed order (deterministic). Every output element is written exactly once.

docs/kernels/moe_tail.md has the bytes, the figures behind RING_DEPTH and the layer's M = 16 limit, and the
version table.
"""


import math
from typing import Iterable

from ._dsl import PDL, TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, import_cute

HIDDEN = 7168          # d
LATENT = 3584          # dL = routed_expert_hidden_size
CHUNK = 32             # k per chunk: 4 lanes x 8 bf16
MAX_M = 64
# Weight stages in flight per warp at M <= RING_MAX_M (one or two n-tiles), in a shared-memory ring filled by
# cp.async. 2 stages (32 KB per CTA) keep the 4 CTAs per SM that the 448-CTA grid needs for one wave; 3 were no
# faster at M <= 8 and a second wave at M = 16, 4 a second wave everywhere (docs/kernels/moe_tail.md).
RING_DEPTH = 2
RING_MAX_M = 16


# ----------------------------------------------------------------------------------------------- configuration
def n_tiles(m: int) -> int:
    """Compile-time n-tile bucket (tokens are padded to 8 * NT inside the kernel; M itself stays dynamic)."""
    if not (1 <= m <= MAX_M):
        raise ValueError(f"batch M must be in [1, {MAX_M}], got {m}")
    nt = 1
    while 8 * nt < m:
        nt *= 2
    return nt


def tail_cfg(nt: int) -> tuple[int, int, int, int]:
    """(WR, WK, U, ring depth) for NT n-tiles: row tiles per CTA, K-split warps, K chunks per stage, and the
    shared-memory ring's depth (0: two register stages). More n-tiles hold more accumulators, so fewer warps
    split K and a stage holds one chunk at NT = 8."""
    wr, wk, u = {1: (1, 8, 2), 2: (1, 8, 2), 4: (2, 4, 2), 8: (4, 2, 1)}[nt]
    return wr, wk, u, (RING_DEPTH if 8 * nt <= RING_MAX_M else 0)


# ----------------------------------------------------------------------------------------------- kernel
_KERNEL_CLS = None


def _kernel_class():
    global _KERNEL_CLS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32, const_expr

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        # D(16x8, f32) += A(16x16, bf16, row) * B(16x8, bf16, col); operands are packed bf16x2 words.
        return cute.arch.inline_ptx(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{ {$w0}, {$w1}, {$w2}, {$w3} }, { {$r0}, {$r1}, {$r2}, {$r3} }, { {$r4}, {$r5} }, "
            "{ {$r6}, {$r7}, {$r8}, {$r9} };",
            write_only_types=[Float32, Float32, Float32, Float32],
            read_only_args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3])

    class MoeTail:
        """out = bf16(bf16(rstd * (w_norm * r) W1^T) + bf16(h W2^T)): segment 0 is the normed up-projection
        (K = k1 = dL), segment 1 the shared down-projection (K = k2 = Is), into two accumulator sets."""

        def __init__(self, nt: int, k2: int):
            self.nt = nt
            self.wr, self.wk, self.u, self.ring = tail_cfg(nt)
            self.n_rows, self.k1, self.k2 = HIDDEN, LATENT, k2
            assert self.k1 % CHUNK == 0 and k2 % CHUNK == 0 and self.n_rows % (16 * self.wr) == 0
            self.nch = (self.k1 // CHUNK, k2 // CHUNK)
            self.nit = tuple(-(-n // (self.wk * self.u)) for n in self.nch)
            self.threads = 32 * self.wr * self.wk
            self.nacc = 4 * nt * 2
            self.red_slots = max(1, (self.wk - 1) * self.wr)
            self.smem_bytes = 4 * (self.red_slots * self.nacc * 32 + 8 * nt * self.wk) + 64
            # the ring's 32 KB per CTA must not cost the 4 CTAs per SM that 448 CTAs need to run in one wave: the
            # largest shared-memory carveout, given explicitly (otherwise the DSL asks the driver at compile time,
            # which the CPU compile cannot)
            self.occupancy = {"preferred_smem_carveout": 100} if self.ring else {}
            self.ring_bytes = 16 * 32 * 2 * self.u * self.ring * self.wr * self.wk
            if self.ring:
                self.smem_bytes += self.ring_bytes + 128

        @cute.jit
        def __call__(self, mX1: cute.Tensor, mW1: cute.Tensor, mWn, mX2, mW2, mOut: cute.Tensor,
                     eps: Float32, stream):
            self.kernel(mX1, mW1, mWn, mX2, mW2, mOut, eps).launch(
                grid=[self.n_rows // (16 * self.wr), 1, 1], block=[self.threads, 1, 1], smem=self.smem_bytes,
                stream=stream, use_pdl=PDL, **self.occupancy)

        # -- one register stage of weight fragments (no ring): U chunks x rows (g, g+8), 16 B each
        @cute.jit
        def load_w(self, gW: cute.Tensor, rW: cute.Tensor, buf: cutlass.Constexpr, it, wk, row_g, t,
                   nch: cutlass.Constexpr):
            w_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            for u in cutlass.range_constexpr(self.u):
                c = (it * self.u + u) * self.wk + wk
                if c < nch:
                    cute.copy(w_atom, gW[0, None, row_g, 4 * c + t], rW[None, 0, u, buf])
                    cute.copy(w_atom, gW[0, None, row_g + 8, 4 * c + t], rW[None, 1, u, buf])

        # -- MMAs for one stage; activations are loaded here (L1/L2 hits: they are tiny and shared by all CTAs)
        @cute.jit
        def compute(self, seg: cutlass.Constexpr, gX: cute.Tensor, gWn, rW: cute.Tensor, buf: cutlass.Constexpr,
                    it, wk, g, t, m_last, acc: cute.Tensor, ssq: cute.Tensor, nch: cutlass.Constexpr):
            rX = cute.make_rmem_tensor(cute.make_layout((8, self.nt, self.u), stride=(1, 8, 8 * self.nt)), BFloat16)
            rB = cute.make_rmem_tensor((8,), BFloat16)
            rWn = cute.make_rmem_tensor(cute.make_layout((8, self.u), stride=(1, 8)), BFloat16)
            # issue every activation load of the stage first (addresses clamped so they are always in bounds;
            # a clamped token only feeds its own, never-stored, output column)
            for u in cutlass.range_constexpr(self.u):
                c = (it * self.u + u) * self.wk + wk
                cc = cutlass.min(c, nch - 1)
                if const_expr(seg == 0):
                    cute.autovec_copy(gWn[None, 4 * cc + t], rWn[None, u])
                for j in cutlass.range_constexpr(self.nt):
                    tok = cutlass.min(8 * j + g, m_last)
                    cute.autovec_copy(gX[0, None, tok, 4 * cc + t], rX[None, j, u])
            w32 = cute.recast_tensor(rW, Int32)
            for u in cutlass.range_constexpr(self.u):
                c = (it * self.u + u) * self.wk + wk
                # all-ones when the chunk exists, zero when it is past the end (its weights are an earlier stage's)
                cmask = ~((Int32(nch - 1) - c) >> 31)
                if const_expr(seg == 0):
                    fmask = (cmask & 1).to(Float32)
                    wn = rWn[None, u].load().to(Float32) * fmask
                for j in cutlass.range_constexpr(self.nt):
                    if const_expr(seg == 0):
                        xf = rX[None, j, u].load().to(Float32)
                        ssq[j] = ssq[j] + (xf * xf).reduce(cute.ReductionOp.ADD, Float32(0.0), 0) * fmask
                        rB.store((xf * wn).to(BFloat16))
                        b32 = cute.recast_tensor(rB, Int32)
                        b = (b32[0], b32[1], b32[2], b32[3])
                    else:
                        x32 = cute.recast_tensor(rX[None, j, u], Int32)
                        b = (x32[0] & cmask, x32[1] & cmask, x32[2] & cmask, x32[3] & cmask)
                    for s in cutlass.range_constexpr(2):
                        base = 4 * (j + self.nt * seg)
                        d = mma_bf16(w32[2 * s, 0, u, buf], w32[2 * s, 1, u, buf],
                                     w32[2 * s + 1, 0, u, buf], w32[2 * s + 1, 1, u, buf],
                                     b[2 * s], b[2 * s + 1],
                                     acc[base + 0], acc[base + 1], acc[base + 2], acc[base + 3])
                        for i in cutlass.range_constexpr(4):
                            acc[base + i] = d[i]

        # -- one stage of weight fragments into ring slot `slot` by cp.async (one commit group per stage, empty past
        #    the end, so wait_group counts stay uniform). Each thread copies and later reads back only its own
        #    16-byte chunks, so cp.async.wait_group orders them without a barrier.
        @cute.jit
        def ring_load(self, gW: cute.Tensor, sW: cute.Tensor, slot, it, wk, warp, row_g, lane, t,
                      nch: cutlass.Constexpr):
            a_atom = cute.make_copy_atom(
                cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL), BFloat16,
                num_bits_per_copy=128)
            for u in cutlass.range_constexpr(self.u):
                c = (it * self.u + u) * self.wk + wk
                if c < nch:
                    cute.copy(a_atom, gW[0, None, row_g, 4 * c + t], sW[None, lane, 0, u, slot, warp])
                    cute.copy(a_atom, gW[0, None, row_g + 8, 4 * c + t], sW[None, lane, 1, u, slot, warp])
            cute.arch.cp_async_commit_group()

        @cute.jit
        def ring_segment(self, seg: cutlass.Constexpr, gX, gW, gWn, sW, rW, wk, warp, row_g, lane, g, t, m_last, acc,
                         ssq, prefetched: cutlass.Constexpr):
            """Stage it is multiplied from registers copied out of ring slot it % D, and slot it % D is then refilled
            with stage it + D: D stages of this warp's loads stay in flight."""
            # A chunk past the end is skipped by ring_load, so its slot keeps an earlier stage's weights, which are
            # finite (the first segment, W_up, fills every slot: dL / CHUNK = 112 chunks are 7 full stages), and
            # compute() zeroes that chunk's B operand.
            D = self.ring
            nch = self.nch[seg]
            nit = self.nit[seg]
            if const_expr(not prefetched):
                for d in cutlass.range_constexpr(D):
                    self.ring_load(gW, sW, d, Int32(d), wk, warp, row_g, lane, t, nch)
            for it in cutlass.range(nit, unroll=1):
                slot = it % D
                cute.arch.cp_async_wait_group(D - 1)
                for u in cutlass.range_constexpr(self.u):
                    for h in cutlass.range_constexpr(2):
                        cute.autovec_copy(sW[None, lane, h, u, slot, warp], rW[None, h, u, 0])
                self.compute(seg, gX, gWn, rW, 0, it, wk, g, t, m_last, acc, ssq, nch)
                self.ring_load(gW, sW, slot, it + D, wk, warp, row_g, lane, t, nch)
            # drain: the groups committed past the end are empty, but the next segment reuses the slots
            cute.arch.cp_async_wait_group(0)

        @cute.jit
        def segment(self, seg: cutlass.Constexpr, gX, gW, gWn, rW, wk, row_g, g, t, m_last, acc, ssq,
                    prefetched: cutlass.Constexpr):
            """Without the ring: two register stages (buffers 0 and 1), the next one loading while the current one
            is multiplied."""
            nch = self.nch[seg]
            nit = self.nit[seg]
            if const_expr(not prefetched):
                self.load_w(gW, rW, 0, Int32(0), wk, row_g, t, nch)
            for p in cutlass.range(nit // 2):
                it0 = 2 * p
                self.load_w(gW, rW, 1, it0 + 1, wk, row_g, t, nch)
                self.compute(seg, gX, gWn, rW, 0, it0, wk, g, t, m_last, acc, ssq, nch)
                self.load_w(gW, rW, 0, it0 + 2, wk, row_g, t, nch)
                self.compute(seg, gX, gWn, rW, 1, it0 + 1, wk, g, t, m_last, acc, ssq, nch)
            if const_expr(nit % 2 == 1):
                self.compute(seg, gX, gWn, rW, 0, Int32(nit - 1), wk, g, t, m_last, acc, ssq, nch)

        @cute.kernel
        def kernel(self, mX1: cute.Tensor, mW1: cute.Tensor, mWn, mX2, mW2, mOut: cute.Tensor, eps: Float32):
            tidx = cute.arch.thread_idx()[0]
            lane = tidx % 32
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wr = warp // self.wk
            wk = warp % self.wk
            g = lane // 4
            t = lane % 4
            tile = cute.arch.block_idx()[0] * self.wr + wr
            row_g = tile * 16 + g
            m_tokens = cute.size(mX1, mode=[0])
            m_last = m_tokens - 1

            smem = cutlass.memory.SmemAllocator()
            sRed = smem.allocate_tensor(
                Float32, cute.make_layout((32, self.nacc, self.red_slots), stride=(1, 32, 32 * self.nacc)), 16)
            sSsq = smem.allocate_tensor(
                Float32, cute.make_layout((8 * self.nt, self.wk), stride=(1, 8 * self.nt)), 16)

            gW1 = cute.flat_divide(mW1, (1, 8))
            gX1 = cute.flat_divide(mX1, (1, 8))
            gWn = cute.flat_divide(mWn, (8,))

            # register stages (two buffers; with the ring only buffer 0, copied out of the slot being multiplied). A
            # chunk past the end multiplies a zero B by these registers, so they start finite.
            rW = cute.make_rmem_tensor(cute.make_layout((8, 2, self.u, 2), stride=(1, 8, 16, 16 * self.u)), BFloat16)
            rW.fill(0.0)
            acc = cute.make_rmem_tensor((self.nacc,), Float32)
            acc.fill(0.0)
            ssq = cute.make_rmem_tensor((self.nt,), Float32)
            ssq.fill(0.0)

            sW = None
            if const_expr(self.ring):
                # (8 bf16 of a lane's 16-byte chunk, lane, row g / g+8, chunk u, ring slot, warp)
                n_w = self.wr * self.wk
                sW = smem.allocate_tensor(
                    BFloat16, cute.make_layout((8, 32, 2, self.u, self.ring, n_w),
                                               stride=(1, 8, 256, 512, 512 * self.u, 512 * self.u * self.ring)), 128)

            # weights do not depend on the previous kernel: the first stages are in flight before the PDL wait (the
            # ring's D stages, which hold no registers, or the first register stage)
            if const_expr(self.ring):
                for d in cutlass.range_constexpr(self.ring):
                    self.ring_load(gW1, sW, d, Int32(d), wk, warp, row_g, lane, t, self.nch[0])
            else:
                self.load_w(gW1, rW, 0, Int32(0), wk, row_g, t, self.nch[0])
            cute.arch.griddepcontrol_wait()

            if const_expr(self.ring):
                self.ring_segment(0, gX1, gW1, gWn, sW, rW, wk, warp, row_g, lane, g, t, m_last, acc, ssq, True)
            else:
                self.segment(0, gX1, gW1, gWn, rW, wk, row_g, g, t, m_last, acc, ssq, True)
            gW2 = cute.flat_divide(mW2, (1, 8))
            gX2 = cute.flat_divide(mX2, (1, 8))
            if const_expr(self.ring):
                self.ring_segment(1, gX2, gW2, gWn, sW, rW, wk, warp, row_g, lane, g, t, m_last, acc, ssq, False)
            else:
                self.segment(1, gX2, gW2, gWn, rW, wk, row_g, g, t, m_last, acc, ssq, False)

            # the next kernel may start its own weight prefetch while we reduce and store
            cute.arch.griddepcontrol_launch_dependents()

            # ---- cross-warp (split-K) reduction through shared memory, fixed order
            if wk > 0:
                slot = wr * (self.wk - 1) + wk - 1
                for v in cutlass.range_constexpr(self.nacc):
                    sRed[lane, v, slot] = acc[v]
            for j in cutlass.range_constexpr(self.nt):
                sq = cute.arch.warp_reduction_sum(ssq[j], threads_in_group=4)
                if wr == 0 and t == 0:
                    sSsq[8 * j + g, wk] = sq
            cute.arch.sync_threads()

            if wk == 0:
                for k2 in cutlass.range_constexpr(self.wk - 1):
                    slot = wr * (self.wk - 1) + k2
                    for v in cutlass.range_constexpr(self.nacc):
                        acc[v] = acc[v] + sRed[lane, v, slot]
                for j in cutlass.range_constexpr(self.nt):
                    for q in cutlass.range_constexpr(2):             # token 8j + 2t + q
                        tok = 8 * j + 2 * t + q
                        tot = Float32(0.0)
                        for k2 in cutlass.range_constexpr(self.wk):
                            tot = tot + sSsq[tok, k2]
                        rstd = cute.math.rsqrt(tot * Float32(1.0 / self.k1) + eps)
                        for h in cutlass.range_constexpr(2):     # rows g, g+8
                            routed = (acc[4 * j + 2 * h + q] * rstd).to(BFloat16).to(Float32)
                            shared = acc[4 * (self.nt + j) + 2 * h + q].to(BFloat16).to(Float32)
                            if tok < m_tokens:
                                mOut[tok, row_g + 8 * h] = (routed + shared).to(BFloat16)

    _KERNEL_CLS = MoeTail
    return MoeTail


# ----------------------------------------------------------------------------------------------- compile
def _build_tail(nt: int, inter: int):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32
    obj = _kernel_class()(nt, inter)
    m = cute.sym_int()
    fakes = (fake_tensor(BFloat16, (m, LATENT)), fake_tensor(BFloat16, (HIDDEN, LATENT)),
             fake_tensor(BFloat16, (LATENT,)), fake_tensor(BFloat16, (m, inter)),
             fake_tensor(BFloat16, (HIDDEN, inter)), fake_tensor(BFloat16, (m, HIDDEN)))
    return cute.compile(obj, *fakes, Float32(1e-5), fake_stream(), options=TVM_FFI)


def compile_keys(inter: int, batches: Iterable[int]) -> list[tuple]:
    """Every compile key that running M in ``batches`` (each 1..MAX_M) with shared intermediate ``inter`` needs."""
    _check_inter(inter)
    return [("moe_tail", nt, inter) for nt in sorted({n_tiles(m) for m in batches})]


def _get(key: tuple):
    _, nt, inter = key
    return compile_cached(("k3fast.kernels.moe_tail",) + key, lambda: _build_tail(nt, inter))


def warmup(inter: int, batches: Iterable[int] = (1, 2, 4, 8, 16)) -> list[tuple]:
    """Compile (once) every kernel the given shared width and batch sizes need; call before CUDA-graph capture."""
    keys = compile_keys(inter, batches)
    for k in keys:
        _get(k)
    return keys


# ----------------------------------------------------------------------------------------------- host API
def _check_inter(inter: int) -> None:
    if inter <= 0 or inter % CHUNK:
        raise ValueError(f"shared intermediate width must be a positive multiple of {CHUNK}, got {inter}")


def moe_tail(r, w_norm, w_up, h, w_sd, *, eps: float = 1e-5, out=None):
    """f [M, 7168] = bf16(bf16(RMSNorm_{w_norm}(r) W_up^T) + bf16(h W_sd^T)), 1 <= M <= MAX_M (the layer: M <= 16).

    r [M, 3584] bf16 (combined routed-expert output), w_norm [3584] bf16, w_up [7168, 3584] bf16,
    h [M, Is] bf16 (SiTU output of the shared experts), w_sd [7168, Is] bf16; ``out`` [M, 7168] bf16 (else
    allocated)."""
    import torch
    check_tensor("r", r, dtype=torch.bfloat16, shape=(None, LATENT))
    dev = r.device
    m = r.shape[0]
    if not (1 <= m <= MAX_M):
        raise ValueError(f"r: batch M must be in [1, {MAX_M}], got {m}")
    check_tensor("w_norm", w_norm, dtype=torch.bfloat16, shape=(LATENT,), device=dev)
    check_tensor("w_up", w_up, dtype=torch.bfloat16, shape=(HIDDEN, LATENT), device=dev)
    check_tensor("h", h, dtype=torch.bfloat16, shape=(m, None), device=dev)
    inter = h.shape[1]
    _check_inter(inter)
    check_tensor("w_sd", w_sd, dtype=torch.bfloat16, shape=(HIDDEN, inter), device=dev)
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite float, got {eps!r}")
    if out is None:
        out = torch.empty(m, HIDDEN, dtype=torch.bfloat16, device=dev)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(m, HIDDEN), device=dev)
    if not r.is_cuda:
        raise ValueError("moe_tail: expected CUDA tensors")
    fn = _get(("moe_tail", n_tiles(m), inter))
    fn(r, w_up, w_norm, h, w_sd, out, float(eps))
    return out
