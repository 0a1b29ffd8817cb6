"""AttnRes #1 + input RMSNorm, alone or folded into the packed in_proj GEMV (Kimi K3 decode, sm_90a).

Reference ops (docs/k3-layer.md): section 6 + 4.3 "attn_res #1": p' = bf16(p + delta), optionally written to
blocks[:, block_write]; the softmax mix m over {blocks[:, :n_blocks], p'} with u = gamma * pi; section 5
input_layernorm: x = bf16(w_ln * m * rsqrt(mean m^2 + eps)) on the fp32 mix (vLLM semantics: m is not rounded before
the norm); section 7.2 step 1: y = bf16(x @ W_in^T), fp32 accumulation. x is rounded to bf16 before the dot product
in every path, as a bf16 GEMM input would be.

Two kernels (docs/kernels/rms_gemv.md has the design, the figures and the version table):

* ``attnres_rmsnorm``: one CTA of 16 warps per token, or from NORM_CLUSTER_MIN_M tokens a cluster of NORM_CLUSTER
  CTAs per token, each over K / NORM_CLUSTER columns, the statistics summed through distributed shared memory. The
  layer runs it before its GEMMs above M = 2 (rms_gemv_ring's tensor-core ring, gemm_wgmma_splitk or cuBLAS) and for
  AttnRes #2 beside o_proj's GEMM.
* ``attnres_rms_gemv`` at M <= FUSE_MAX_M: one persistent launch. Every CTA prefetches its first row group of W into
  L2, waits for its PDL predecessor, computes x for every token into its shared memory (the prologue, n_blocks + 1
  source rows from L2), then streams W with 16-byte register loads, one warp per (row, k-slice). The layer's default
  at M <= 2 is rms_gemv_ring (the same prologue, W through a bulk-copy ring); this kernel is its FMA contender
  ("fast-infma"). Above FUSE_MAX_M ``attnres_rms_gemv`` runs attnres_rmsnorm + cuBLAS.

Contracts: bf16 blocks [M, NB_MAX, K], partial / delta / partial_out [M, K], u fp32 [K], w_ln bf16 or fp32 [K], W
bf16 [N, K] (N a multiple of 16), M in 1..64, K a multiple of 8. Weights (W, u, w_ln) may be read before the PDL wait,
activations only after it. Deterministic: fixed reduction orders, no atomics, no workspace.
"""


from ._dsl import (PDL, TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, import_cute,
                   st_shared_cluster_f32, weight_load_atom)

NUM_SMS = 132
NB_MAX = 8               # blocks [M, NB_MAX, K]: the AttnRes block slots
NORM_WARPS = 16
# attnres_rmsnorm from NORM_CLUSTER_MIN_M tokens: a cluster of NORM_CLUSTER CTAs per token. Each CTA stages 28 KB of
# sources instead of 129 KB at K = 7168 and n_blocks = 8; the attention half gains 0.7-1.5 us at b8 / b16 / b64
# (docs/kernels/rms_gemv.md). Below it one CTA per token (M <= 2 runs the fused kernels).
NORM_CLUSTER = 4
NORM_CLUSTER_MIN_M = 3
FUSED_WARPS = 16
# The fused kernel's largest batch: every CTA recomputes the prologue for every token (serially, ~1 us each), so at
# M = 3..4 the separate norm kernel + a GEMM costs less.
FUSE_MAX_M = 2


def _vectors_per_lane(K: int, ks: int) -> int:
    """16-byte weight vectors per lane of one warp's k-slice (K split into ks slices, 32 lanes each)."""
    return -(-(-(-(K // 8) // ks)) // 32)


def _fused_config(N: int, K: int) -> tuple[int, int, int]:
    """(rows per CTA iteration, k-slices, grid) for the persistent fused kernel: ks = 4 where K allows (>= 64 16-byte
    vectors per slice), the fastest of ks 1 / 2 / 4 / 8 at rank16 and full width (docs/kernels/rms_gemv.md); the grid
    is as small as the row groups' rounds allow, so that no CTA runs more groups than another."""
    ks = 4
    while ks > 1 and (K // 8) // ks < 64:
        ks //= 2
    rpc = FUSED_WARPS // ks
    groups = N // rpc
    iters = -(-groups // NUM_SMS)
    return rpc, ks, -(-groups // iters)


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
        share one round of source loads and one CTA barrier per reduction instead of one each (rms_gemv_ring's joint
        prologue at M = 2). Each token's arithmetic, and its order, is the one-token prologue's, so the
        results are bit-identical to calling it token by token. sV [len(ms) * NS, K], sRedA [warps, len(ms) * 2 NS],
        sRedB [warps, len(ms)]. hoist_wln: w_ln (a weight) is loaded with u at the start instead of after the
        second reduction, so its round trip is not on the chain.

        split (the norm kernel's cluster build): None, this CTA takes all of K; or (rank, sX, sY) for CTA
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

    # ------------------------------------------------------------------ AttnRes + RMSNorm + FMA GEMV, one launch
    class _FusedGemv:
        """y[m, n] = sum_k x[m, k] w[n, k] with x = the AttnRes + RMSNorm prologue's output, computed by every CTA
        into its shared memory. Warps = rpc rows x ks k-slices; the grid is persistent over row groups (grid-stride),
        so each CTA pays the prologue once."""

        def __init__(self, MB, rpc, ks, K, nb, has_delta, bw, eps, early_trigger=False):
            self.MB, self.rpc, self.ks, self.nwarps = MB, rpc, ks, FUSED_WARPS
            # early_trigger: launch the PDL dependents (the KDA step) right after the wait, so that their pre-wait
            # state and weight loads overlap this kernel's weight stream instead of following it
            self.early_trigger = early_trigger
            self.K, self.nb, self.has_delta, self.bw, self.eps = K, nb, has_delta, bw, eps
            self.nthreads = 32 * FUSED_WARPS
            self.vpt = -(-(K // 8) // self.nthreads)
            # 16-byte weight loads in flight per lane: a batch of U loads is issued together, then its FMAs. 8 at
            # M = 1; at M >= 2 the x vectors of 8 loads would not fit the 128-register cap of a 16-warp CTA. Where a
            # warp's k-slice is only a few vectors per lane (<= 8), the whole slice is one predicated batch: a
            # runtime-trip-count loop that short would run in its remainder, one load per round trip.
            self.U = 8 if MB == 1 else 4
            per_lane = _vectors_per_lane(K, ks)
            if per_lane <= 8:
                self.U = per_lane

        @cute.jit
        def __call__(self, mW, mY, mBlocks, mP, mD, mPout, mU, mWln, grid_x: Int32, stream):
            self.kernel(mW, mY, mBlocks, mP, mD, mPout, mU, mWln).launch(
                grid=[grid_x, 1, 1], block=[self.nthreads, 1, 1], stream=stream, use_pdl=PDL)

        @cute.kernel
        def kernel(self, mW, mY, mBlocks, mP, mD, mPout, mU, mWln):
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
            # weights do not depend on the producer: the first row group's HBM stream starts before the PDL wait
            if bid < n_groups:
                _prefetch_rows(gW, bid * self.rpc + r, 1, kv0, kv1, lane)
            sX = smem.allocate_tensor(BFloat16, cute.make_layout((self.MB, self.K), stride=(self.K, 1)), 16)
            sRedA = smem.allocate_tensor(Float32, cute.make_layout((self.nwarps, 2 * (self.nb + 1)),
                                                                   stride=(2 * (self.nb + 1), 1)), 16)
            sRedB = smem.allocate_tensor(Float32, cute.make_layout((self.nwarps, 1), stride=(1, 1)), 16)
            sV = smem.allocate_tensor(BFloat16, cute.make_layout((self.nb + 1, self.K), stride=(self.K, 1)), 16)
            cute.arch.griddepcontrol_wait()
            if const_expr(self.early_trigger):
                cute.arch.griddepcontrol_launch_dependents()
            gX = cute.flat_divide(sX, (1, 8))
            for m in cutlass.range_constexpr(self.MB):
                _attnres_token(self, m, mBlocks, mP, mD, mPout, mU, mWln, gX, sV, sRedA, sRedB, tid, warp, lane,
                               bid == 0)
            cute.arch.sync_threads()

            rX = cute.make_rmem_tensor(cute.make_layout((8, self.MB), stride=(1, 8)), BFloat16)
            acc = cute.make_rmem_tensor(cute.make_layout((8, self.MB), stride=(1, 8)), Float32)
            rWs = [cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), mW.element_type)
                   for _ in range(self.U)]
            buf = Int32(0)
            for grp in cutlass.range(bid, n_groups, nblk):
                base = grp * self.rpc
                row = base + r
                # the CTA's next row group into L2 while this one computes
                nxt = grp + nblk
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
            # the pin: every FMA's weight scale also depends on all U loaded vectors, as 0 * (their sum). Without it
            # ptxas issues 4 of the 7 loads, then the FMAs of the first (which wait for its data), then the other 3,
            # i.e. 2-3 round trips per batch. The pin is exactly 0 for finite weights (the scale and the outputs are
            # unchanged), and a NaN weight poisons only this lane's slice of its own row, whose dot product it
            # poisons anyway.
            pin = Float32(0.0)
            for u in cutlass.range_constexpr(self.U):
                pin = pin + rWs[u][0].to(Float32)
            pin = pin * Float32(0.0)
            for u in cutlass.range_constexpr(self.U):
                kv = kvb + 32 * u
                kvc = cutlass.min(kv, kv1 - 1)
                scale = cutlass.select_(kv < kv1, Float32(1.0), Float32(0.0))
                scale = scale + pin
                wv = rWs[u].load().to(Float32) * scale
                for m in cutlass.range_constexpr(self.MB):
                    cute.autovec_copy(gX[0, None, m, kvc], rX[None, m])
                    acc[None, m].store(acc[None, m].load() + rX[None, m].load().to(Float32) * wv)

        @cute.jit
        def reduce_store(self, acc, sRed, sbuf, row0, mY, warp, lane, tid):
            """A row group's warp sums -> sRed[sbuf] -> the k-slices added in a fixed order -> y[:, row0 + rr]
            (deterministic). sRed is double-buffered, so the next group's sums need no barrier before them."""
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

    # ------------------------------------------------------------ AttnRes + RMSNorm, one CTA (or cluster) per token
    class _AttnResNorm:
        def __init__(self, K, nb, has_delta, bw, eps, early_trigger=False, cl=1):
            self.K, self.nb, self.has_delta, self.bw, self.eps = K, nb, has_delta, bw, eps
            self.early_trigger = early_trigger
            self.cl = cl
            nvec = K // 8
            # a cluster of cl CTAs per token, each over vpc vectors with one thread per vector (up to 16 warps)
            self.vpc = -(-nvec // cl)
            self.nthreads = 32 * NORM_WARPS if cl == 1 else min(32 * NORM_WARPS, 32 * -(-self.vpc // 32))
            self.nwarps = self.nthreads // 32
            self.vpt = -(-(nvec if cl == 1 else self.vpc) // self.nthreads)

        @cute.jit
        def __call__(self, mBlocks, mP, mD, mPout, mU, mWln, mX, stream):
            M = cute.size(mP, mode=[0])
            if cutlass.const_expr(self.cl == 1):
                self.kernel(mBlocks, mP, mD, mPout, mU, mWln, mX).launch(
                    grid=[M, 1, 1], block=[self.nthreads, 1, 1], stream=stream, use_pdl=PDL)
            else:
                self.kernel(mBlocks, mP, mD, mPout, mU, mWln, mX).launch(
                    grid=[self.cl, M, 1], block=[self.nthreads, 1, 1], cluster=[self.cl, 1, 1], stream=stream,
                    use_pdl=PDL)

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
                # the dependent's pre-wait work (a ring / WGMMA GEMM's weight stages) runs on the SMs this grid leaves
                # idle
                cute.arch.griddepcontrol_launch_dependents()
            _attnres_tokens(self, (m,), mBlocks, mP, mD, mPout, mU, mWln, cute.flat_divide(mX, (1, 8)), sV,
                            sRedA, sRedB, tid, warp, lane, True, split=split)
            if cutlass.const_expr(not self.early_trigger):
                cute.arch.griddepcontrol_launch_dependents()

    # also run by rms_gemv_ring over its own CTA: token by token, or every token in one pass (its joint prologue)
    _AttnResNorm.prologue = staticmethod(_attnres_token)
    _AttnResNorm.prologue_tokens = staticmethod(_attnres_tokens)
    return cutlass, cute, _FusedGemv, _AttnResNorm




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


def _attn_fakes(cute, BF, M, K, has_delta, wln, p_strided=False):
    blocks = fake_tensor(BF, (M, NB_MAX, K))
    # p_strided: p's rows at any stride that keeps 16-byte vectors aligned (a column slice of a wider output, e.g.
    # q_a inside MLA's packed projection output); the kernels read p through its layout, 8 elements at a time
    p = (cute.runtime.make_fake_tensor(BF, (M, K), (cute.sym_int(divisibility=8), 1), assumed_align=16)
         if p_strided else fake_tensor(BF, (M, K)))
    d = fake_tensor(BF, (M, K)) if has_delta else None
    po = fake_tensor(BF, (M, K))
    u = fake_tensor(_dt("fp32"), (K,))
    wl = fake_tensor(_dt(wln), (K,))
    return blocks, p, d, po, u, wl


def norm_compile_key(K, nb, has_delta, bw, wln, eps, early_trigger=False, cluster=1, p_strided=False) -> tuple:
    return (("rms_gemv.norm", K, nb, has_delta, bw, wln, eps) + (("early",) if early_trigger else ())
            + ((f"cl{cluster}",) if cluster > 1 else ()) + (("p_strided",) if p_strided else ()))


def _build_norm(K, nb, has_delta, bw, wln, eps, early_trigger=False, cluster=1, p_strided=False, options=TVM_FFI):
    cutlass, cute, _, Norm = _kernels()
    BF = cutlass.BFloat16
    M = cute.sym_int()
    blocks, p, d, po, u, wl = _attn_fakes(cute, BF, M, K, has_delta, wln, p_strided)
    x = fake_tensor(BF, (M, K))
    return cute.compile(Norm(K, nb, has_delta, bw, eps, early_trigger, cluster), blocks, p, d, po, u, wl, x,
                        fake_stream(), options=options)


def _compile_norm(key):
    _, K, nb, hd, bw, wln, eps = key[:7]
    cluster = next((int(f[2:]) for f in key[7:] if f.startswith("cl")), 1)
    return compile_cached(key, lambda: _build_norm(K, nb, hd, bw, wln, eps, "early" in key[7:], cluster,
                                                   "p_strided" in key[7:]))


def fused_compile_key(M, K, N, nb, has_delta, bw, wln, eps, early_trigger=False, p_strided=False) -> tuple:
    """The fused kernel's build for M tokens and an [N, K] weight: its config (_fused_config) depends on N."""
    rpc, ks, _ = _fused_config(N, K)
    return (("rms_gemv.fused", M, K, nb, bool(has_delta), bw, wln, float(eps), rpc, ks)
            + (("early_trigger",) if early_trigger else ()) + (("p_strided",) if p_strided else ()))


def _build_fused(MB, K, nb, has_delta, bw, wln, eps, rpc, ks, early_trigger=False, p_strided=False,
                 options=TVM_FFI):
    cutlass, cute, Fused, _ = _kernels()
    BF = cutlass.BFloat16
    N = cute.sym_int(divisibility=16)
    blocks, p, d, po, u, wl = _attn_fakes(cute, BF, MB, K, has_delta, wln, p_strided)
    w = fake_tensor(BF, (N, K))
    y = fake_tensor(BF, (MB, N), align=2)
    obj = Fused(MB, rpc, ks, K, nb, has_delta, bw, eps, early_trigger)
    return cute.compile(obj, w, y, blocks, p, d, po, u, wl, cutlass.Int32(1), fake_stream(), options=options)


def _compile_fused(key):
    _, MB, K, nb, hd, bw, wln, eps, rpc, ks = key[:10]
    early, strided = "early_trigger" in key[10:], "p_strided" in key[10:]
    return compile_cached(key, lambda: _build_fused(MB, K, nb, hd, bw, wln, eps, rpc, ks, early, strided))


# ----------------------------------------------------------------------------- host entry points

def _check_2d(name, t, M, K, dev):
    import torch
    check_tensor(name, t, dtype=torch.bfloat16, shape=(M, K), device=dev)


def p_strided(partial) -> bool:
    """Whether ``partial``'s rows lie at a stride other than its width (a column slice of a wider tensor): those
    calls take the p_strided builds."""
    return partial.dim() == 2 and partial.stride(0) != partial.shape[1]


def _check_attnres(blocks, n_blocks, partial, delta, u, w_ln, block_write, partial_out, fused):
    import torch
    check_tensor("partial", partial, dtype=torch.bfloat16, contiguous=False)
    if partial.dim() != 2:
        raise ValueError(f"partial: expected [M, K], got {list(partial.shape)}")
    M, K = partial.shape
    # rows compact, or a column slice whose rows keep the 16-byte vectors aligned (the p_strided builds)
    # (one row: its stride never matters, the kernels read row 0 only)
    if partial.stride(1) != 1 or (M > 1 and p_strided(partial) and (partial.stride(0) % 8 or partial.stride(0) < K)):
        raise ValueError(f"partial: expected rows of unit stride at a row stride that is K={K} or a multiple of 8 "
                         f"no smaller than K, got strides {partial.stride()}")
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


def norm_cluster(M: int) -> int:
    """CTAs per token of attnres_rmsnorm at M tokens: NORM_CLUSTER from NORM_CLUSTER_MIN_M tokens, else 1."""
    return NORM_CLUSTER if M >= NORM_CLUSTER_MIN_M else 1


def attnres_rmsnorm(blocks, n_blocks, partial, delta, u, w_ln, *, eps=1e-5, block_write=-1, out=None,
                    partial_out=None, early_trigger=False):
    """x = bf16(RMSNorm_{w_ln}(AttnRes mix over {blocks[:, :n_blocks], p'})), p' = bf16(p + delta).

    Returns (x [M, K] bf16, partial_out); blocks[:, block_write] = p' when block_write >= 0. delta may be None (then
    p' = p). partial_out may be partial itself (each thread reads its elements before writing them).
    early_trigger: launch the PDL dependent right after the wait instead of after the last store, for a dependent
    that reads none of this call's outputs before its own wait (a ring or WGMMA GEMM that requests its weights
    there). norm_cluster(M) CTAs per token: with a cluster each CTA takes K / cluster of the columns and the
    statistics are summed over the cluster (deterministic; not bit-identical to one CTA, whose per-warp sums split K
    differently)."""
    import torch
    M, K, wln, partial_out = _check_attnres(blocks, n_blocks, partial, delta, u, w_ln, block_write, partial_out,
                                            False)
    cl = norm_cluster(M)
    if K // 8 < cl:
        raise ValueError(f"partial: K = {K} gives fewer 16-byte vectors than the {cl} CTAs per token at M = {M} "
                         f"(K >= {8 * cl})")
    if out is None:
        out = torch.empty(M, K, dtype=torch.bfloat16, device=partial.device)
    else:
        _check_2d("out", out, M, K, partial.device)
    fn = _compile_norm(norm_compile_key(K, n_blocks, delta is not None, block_write, wln, float(eps),
                                        bool(early_trigger), cl, p_strided(partial)))
    fn(blocks, partial, delta, partial_out, u, w_ln, out)
    return out, partial_out


def attnres_rms_gemv(blocks, n_blocks, partial, delta, u, w_ln, w, *, eps=1e-5, block_write=-1, out=None,
                     partial_out=None, early_trigger=False):
    """y = bf16(RMSNorm_{w_ln}(AttnRes mix) @ w^T), plus p' = bf16(p + delta) into partial_out (and blocks).

    Returns (y [M, N] bf16, partial_out). M <= FUSE_MAX_M (and K a multiple of 16): the fused kernel, one launch;
    partial_out must then not alias partial or delta (CTA 0 writes p' while every CTA reads p). early_trigger: the
    fused kernel launches its PDL dependents right after its wait, for a dependent whose pre-wait reads do not
    include this call's outputs (the KDA step). Otherwise attnres_rmsnorm (its trigger after its last store) and
    cuBLAS (torch.mm): cuBLAS reads a skinny W faster than this module's GEMVs did above M = 2 (the design note
    has the figures)."""
    import torch
    fused = partial.dim() == 2 and partial.shape[0] <= FUSE_MAX_M
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
        key = fused_compile_key(M, K, N, n_blocks, delta is not None, block_write, wln, eps, bool(early_trigger),
                                p_strided(partial))
        _compile_fused(key)(w, out, blocks, partial, delta, partial_out, u, w_ln, _fused_config(N, K)[2])
        return out, partial_out
    x, partial_out = attnres_rmsnorm(blocks, n_blocks, partial, delta, u, w_ln, eps=eps,
                                     block_write=block_write, partial_out=partial_out)
    torch.mm(x, w.t(), out=out)
    return out, partial_out


# ----------------------------------------------------------------------------- warm-up

def compile_keys(batches, *, K, sites, N=(), wln="bf16", eps=1e-5, early_trigger=False,
                 norm_triggers=(False,), strided_p=False) -> list[tuple]:
    """The builds that calls at these batch sizes run with the module's defaults, at every AttnRes site (n_blocks,
    has_delta, block_write) of ``sites``. With projection widths N: attnres_rms_gemv, i.e. the fused kernel at
    M <= FUSE_MAX_M (its trigger ``early_trigger``; the layer's FMA contender passes True) and the norm kernel above;
    without: the norm kernel alone at every M. The norm kernel: norm_cluster(M) CTAs per token, one build per trigger
    placement in ``norm_triggers`` (the layer runs both: after its wait before the ring and WGMMA GEMMs, after its
    last store before cuBLAS and for AttnRes #2). ``strided_p``: the builds for a partial whose rows lie at a wider
    stride (p_strided)."""
    keys = set()
    for nb, hd, bw in sites:
        for M in batches:
            if N and M <= FUSE_MAX_M:
                keys.update(fused_compile_key(M, K, n, nb, hd, bw, wln, eps, bool(early_trigger), strided_p)
                            for n in N)
            else:
                keys.update(norm_compile_key(K, nb, bool(hd), bw, wln, float(eps), bool(et), norm_cluster(M),
                                             strided_p) for et in norm_triggers)
    return sorted(keys, key=str)


def warmup(batches, **kw):
    """Compile every build compile_keys(batches, **kw) lists (call before CUDA-graph capture)."""
    for key in compile_keys(batches, **kw):
        (_compile_fused if key[0] == "rms_gemv.fused" else _compile_norm)(key)
