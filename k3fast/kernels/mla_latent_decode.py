"""Gated MLA's decode attention over the latent cache, split across SMs with an exact combine, for sm_90a.

Replaces the attention step of k3ref.mla.mla_core in its absorbed form (docs/k3-layer.md section 8.3): for each
request n and head h, with the cache rows c_i = [c_kv,i (512) | k_pe,i (64)] of its first L_n tokens and the
absorbed query Q_h = [q_nope,h W_UK,h | q_pe,h] (576 wide),

    o_lat[n, h] = sum_i softmax_i(scale * Q_h . c_i) * c_kv,i            (512 wide; W_UV comes after)

The cache is vLLM's paged layout: a pool of pages of 64 rows x 576 bf16, a block table [N, pages] of page ids and
the rows to attend per request (the new token's row included; 0 marks a padded request, whose output rows are 0).

The split (flash-decoding). The grid is (S splits, head groups, N requests); split s of request n takes pages
[s P, (s + 1) P) of its table, so one request's long cache is read by many SMs at once. Each CTA (4 warps) keeps
its head group's 8 or 16 query rows in shared memory and streams its pages through a cp.async ring of two page
buffers, computing one page while the next one loads:

  scores   S^T = K Q^T on mma.sync m16n8k16 with the 64 tokens of a page as the M side (warp w: tokens
           16w..16w+15, all 36 k-steps) and the heads as N (8 per tile): the cache rows are the A operand, read as
           they lie;
  softmax  online, in base 2 (scale * log2 e folded into the scores); the page's max per head goes through
           shared memory so that every warp rescales with the same running max;
  P V      O^T = V^T P^T with 16 of the 512 latent dims per MMA row tile (warp w: dims 128w..128w+127), the
           cache rows transposed into A fragments by ldmatrix.trans, P from shared memory as the B operand.

Rows of a page past L_n are masked to -inf before the softmax, so their probabilities are exact zeros. The pool
holds whatever those rows held before (NaN, say), and 0 x NaN is NaN in P V, so the ring writes zeros for them
instead of loading them.

The combine. With S > 1 each CTA writes its unnormalised O (fp32), its running max and its row sum per head to a
workspace and arrives on the (request, head group) counter; the last arrival (acq_rel) sums the S partials with
the usual rescaling, o = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s, writes bf16 o and re-arms the counter, so
graph replays need no memset. A split with no page of its request writes only (m = -inf, l = 0). The combine first
puts each head row's weights 2^(m_s - M) / L into shared memory (a warp per row, the splits across its lanes), then
loops over the splits once with all of a thread's output elements' loads of a split in flight, so its serial chain
is one L2 round trip per split rather than several per split and element.

Bytes. The step reads each request's L_n x 576 x 2 cache bytes once per head group (one group up to 16 heads:
k3_rank16 and k3_rank8 read the cache once; the full width's 96 heads read it six times, the price of keeping a
group's O in registers), plus q and the outputs. Workspace traffic: S x heads x 512 x 4 bytes per request.

The append (builds with "append"): the step's own row, position L_n - 1, is not in the pool yet. The split that
owns its page builds it from the projection output, [RMSNorm_{kv_a_ln}(c~_kv) | k_pe] (fp32 statistics, one bf16
rounding, as k3ref.mla.mla_latents), writes it to the pool (that page, that row, nothing else) and into its ring
buffer in place of a load: kv_a's norm and the cache write cost no launch of their own.

Contracts: q [N, H, 576] bf16, kv_cache [pages, 64, 576] bf16, block_table [N, MAXP] int32 (entries of pages a
request does not reach are never read), lengths [N] int32 with 0 <= L_n <= 64 MAXP. Launched with PDL: nothing is
read before griddepcontrol.wait; dependents are released right after it (they read o only after their own wait,
which waits for this grid to finish). One workspace per device, stream-ordered (``make_workspace``).
"""

import dataclasses
import math

from ._dsl import PDL, TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, import_cute, mma_m16n8k16

PAGE = 64                 # cache rows per page (vLLM's block size for this layout)
DQK = 576                 # cache row: c_kv (512) | k_pe (64)
DV = 512                  # the latent dims P V produces
WARPS = 4
THREADS = 32 * WARPS
KSTR = DQK + 8            # smem row pitch (bf16) of cache rows and query rows: 292 words, conflict-free fragments
KSTEPS = DQK // 16        # 36 k16 steps of the score MMAs
MT = DV // 16 // WARPS    # 8 dim tiles of 16 per warp in P V
# The ring: a CTA computes one chunk of CHUNK cache rows while the loads of the next NBUF - 1 chunks are in flight.
# A chunk is a whole page, so each warp owns one 16-token row tile with all 36 score k-steps (no partial scores to
# exchange between warps) and every fragment offset is a constant; two buffers keep one page (74 KB) in flight
# while the other is computed, and with the query rows, P and the combine's table they fit one CTA per SM.
CHUNK = PAGE              # cache rows per ring buffer
NBUF = 2                  # ring buffers
HEAD_GROUPS = (8, 16)     # query rows per CTA (8: up to 8 heads, 16 otherwise)
SPLITS_MAX = 160          # the combine's weight table in shared memory holds this many splits per head row
UV_SLICES = 8             # mla_uv_gate's combine: CTAs per head, each summing 512 / 8 latent dims of the splits
# The combine's loads in flight per thread: it walks the splits in groups, all of a group's loads issued before
# any is summed, so its serial chain is splits / group L2 round trips. 128 loads (32 or 64 output elements of 2 or
# 4 splits) keep its registers under 255 beside the 64 accumulators of the 16-head build.
COMBINE_LOADS = 128
LOG2E = 1.4426950408889634


def head_group(heads: int) -> int:
    """Query rows per CTA for ``heads`` heads: 8 when they fit, else 16 (more heads take several groups)."""
    return 8 if heads <= 8 else 16


def plan_splits(n_requests: int, heads: int, max_pages: int, nsm: int = 132, defer: bool = False) -> tuple[int, int]:
    """(S, pages per split). S is the smaller of two counts. One wave: at most one CTA per SM over all requests and
    head groups (nsm // (requests x groups), at least 1); the kernel's shared memory (166 KB at 8 heads) holds one
    CTA per SM, so a CTA past nsm waits for a whole second wave (at batch 8 and 32K tokens, 136 CTAs put the
    attention half at 2.9x its byte floor on an H200). The combine's balance: at most sqrt(cache bytes / partial
    bytes) = sqrt(36 max_pages / hn) splits per request and head group, since the one CTA that combines reads S
    partials of hn x 512 fp32, so the combine's bytes grow with S while each split's share of the cache shrinks
    with it; their sum is smallest there (22 splits of 6 pages at 8K tokens and 8 heads, 8 at 1K; without the cap
    batch 1 takes 128 one-page splits at 8K tokens, and its attention half measures 1.5x longer). Every split is
    non-empty at full capacity; never more than SPLITS_MAX (the combine's weight table). ``defer``: the combine
    runs in mla_uv_gate's many CTAs instead of one CTA here, so the balance does not bind and the wave alone sets S."""
    hn = head_group(heads)
    hg = -(-heads // hn)
    cap = SPLITS_MAX if defer else round(math.sqrt(PAGE * DQK * 2 * max_pages / (hn * DV * 4)))
    s = max(1, min(max_pages, nsm // (n_requests * hg), SPLITS_MAX, cap))
    pps = -(-max_pages // s)
    return -(-max_pages // pps), pps


def compile_key(hn: int, append: bool = False, defer: bool = False) -> tuple:
    """The build for head group ``hn``; ``append``: the kernel also writes the step's own cache row (kv_a's RMSNorm
    of the projection output) before attending over it; ``defer``: every split publishes its partial (O, m, l) and
    none combines (mla_uv_gate's combine build does)."""
    if hn not in HEAD_GROUPS:
        raise ValueError(f"head group must be one of {HEAD_GROUPS}, got {hn}")
    return ("mla_latent_decode", hn) + (("append",) if append else ()) + (("defer",) if defer else ())


def smem_bytes(hn: int) -> int:
    return (hn * KSTR * 2 + NBUF * CHUNK * KSTR * 2 + hn * (CHUNK + 8) * 2 + 2 * WARPS * 16 * 4 + 16
            + hn * SPLITS_MAX * 4 + 6 * 128)


LANE_SPLITS = -(-SPLITS_MAX // 32)    # the combine's splits per lane when a warp weighs one head row


def combine_weights(wml, row0, row_step, splits, lane, group: int = 32):
    """Kernel code (a warp per head row, every lane): the combine's weights of one head row, this lane's share.
    Returns a register tensor of LANE_SPLITS fp32 values, value i the weight of split lane + 32 i:
    w_s = 2^(m_s - M) / sum_s' 2^(m_s' - M) l_s' with M the largest m_s of the splits with l_s > 0; 0 for a split with
    no page (l_s = 0) and past the last split; all 0 for a row no split saw (a padded request). ``wml``: the (m, l)
    workspace's fp32 iterator, two values per row; split s of this head row is row ``row0 + s * row_step``. Each
    lane's (m, l) are loaded together (an index past the last split reads the last one's and is masked), so the
    weights cost one L2 round trip and two warp reductions. Plain Python loops: they unroll as the kernel is traced.

    ``group`` < 32 (a power of two, splits <= group): an aligned group of that many lanes weighs one row, ``lane``
    the lane's index in its group, one value (split ``lane``): 32 / group rows per warp at once. Its butterflies are
    the last log2(group) steps of the whole warp's, whose earlier steps only add the exact zeros (or -inf) that the
    lanes past the last split hold, so the weights are the same bits as the whole warp's."""
    cutlass, cute = import_cute()
    from cutlass import Float32
    n = LANE_SPLITS if group == 32 else 1
    mr = cute.make_rmem_tensor(cute.make_layout(n), Float32)
    lr = cute.make_rmem_tensor(cute.make_layout(n), Float32)
    for i in range(n):
        s2 = lane + 32 * i
        row = row0 + cutlass.min(s2, splits - 1) * row_step
        ms = cute.arch.load(wml + row * 2, Float32, cop="cg")
        ls = cute.arch.load(wml + (row * 2 + 1), Float32, cop="cg")
        mr[i] = ms
        lr[i] = Float32(cutlass.select_(s2 < splits, ls, Float32(0.0)))
    mx = Float32(float("-inf"))
    for i in range(n):
        mx = Float32(cutlass.select_(lr[i] > Float32(0.0), cute.arch.fmax(mx, mr[i]), mx))
    mx = cute.arch.warp_reduction_max(mx, threads_in_group=group)
    m_use = Float32(cutlass.select_(mx == Float32(float("-inf")), Float32(0.0), mx))
    den = Float32(0.0)
    for i in range(n):
        mr[i] = Float32(cutlass.select_(lr[i] > Float32(0.0), cute.math.exp2(mr[i] - m_use), Float32(0.0)))
        den = den + mr[i] * lr[i]
    den = cute.arch.warp_reduction_sum(den, threads_in_group=group)
    inv = Float32(cutlass.select_(den > Float32(0.0), Float32(1.0) / den, Float32(0.0)))
    for i in range(n):
        mr[i] = mr[i] * inv
    return mr


def _build(hn: int, append: bool, defer: bool = False):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32, Int64, const_expr
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    NT = hn // 8
    NEG_INF = float("-inf")
    SMEM = smem_bytes(hn)
    PSTR = CHUNK + 8                          # smem row pitch (bf16) of P [heads, tokens]: conflict-free B fragments
    VSTEPS = CHUNK // 16                      # k16 steps of P V per chunk
    OUT_PER_THREAD = hn * DV // THREADS       # the combine's output elements per thread (32 or 64)
    GROUP = max(1, COMBINE_LOADS // OUT_PER_THREAD)   # splits whose loads the combine issues together

    def _i(x):
        return Int32(x).ir_value()

    mma = mma_m16n8k16

    def ldmatrix_x4_trans(addr):
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.i32()] * 4), [_i(addr)],
            "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0,$1,$2,$3}, [$4];",
            "=r,=r,=r,=r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        return [Int32(llvm.extractvalue(T.i32(), res, [q])) for q in range(4)]

    def cp_async16(smem_addr, gmem_addr):
        llvm.inline_asm(None, [_i(smem_addr), Int64(gmem_addr).ir_value()],
                        "cp.async.cg.shared.global [$0], [$1], 16;", "r,l",
                        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)

    def st_shared_zero16(smem_addr):
        llvm.inline_asm(None, [_i(smem_addr)], "st.shared.v4.b32 [$0], {0, 0, 0, 0};", "r",
                        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)

    class MlaLatentDecode:
        @cute.jit
        def __call__(self, mQ, mC, mBT, mLen, mO, mWO, mWML, mCnt, mZ, mLn, heads: Int32, splits: Int32, pps: Int32,
                     scale_log2: Float32, zcol: Int32, eps: Float32, stream):
            n_req = cute.size(mBT, mode=[0])
            n_hg = (heads + (hn - 1)) // hn
            self.kernel(mQ, mC, mBT, mLen, mO, mWO, mWML, mCnt, mZ, mLn, heads, splits, pps, scale_log2, zcol,
                        eps).launch(
                grid=[splits, n_hg, n_req], block=[THREADS, 1, 1], smem=SMEM, stream=stream, use_pdl=PDL)

        @cute.jit
        def load_chunk(self, mC, sk_base, buf, page, first, rows, new_row, tid):
            """Rows [first, first + rows) of pool page ``page`` into ring buffer ``buf`` (16-byte cp.async pieces);
            the rest of the buffer's CHUNK rows zero-filled. Buffer row ``new_row`` (>= 0: the step's own token) is
            left for write_new_row. The caller commits the group."""
            g_base = mC.iterator.toint() + Int64(page) * (PAGE * DQK * 2) + Int64(first) * (DQK * 2)
            for c in cutlass.range(tid, CHUNK * (DQK // 8), THREADS):
                r = c // (DQK // 8)
                col = c - r * (DQK // 8)
                s_addr = sk_base + ((buf * CHUNK + r) * KSTR + col * 8) * 2
                if r < rows:
                    if r != new_row:
                        cp_async16(s_addr, g_base + Int64((r * DQK + col * 8) * 2))
                else:
                    st_shared_zero16(s_addr)

        @cute.jit
        def issue_chunk(self, mC, sK, sk_base, mBT, mZ, mLn, n, zcol, length, t_begin, ci, buf, eps: Float32, tid,
                        warp, lane, hg):
            """Chunk ``ci`` of the split (tokens t_begin + CHUNK ci ..) into ring buffer ``buf``: its rows of the
            pool, and with ``append`` the step's own row (position length - 1) built in place of its load."""
            tok0 = t_begin + ci * CHUNK
            page = mBT[n, tok0 // PAGE]
            first = tok0 % PAGE
            nr = Int32(-1)
            if const_expr(append):
                nr = Int32(cutlass.select_(length - 1 - tok0 < CHUNK, length - 1 - tok0, Int32(-1)))
            self.load_chunk(mC, sk_base, buf, page, first, cutlass.min(length - tok0, CHUNK), nr, tid)
            if const_expr(append):
                if nr >= 0:
                    self.write_new_row(mC, sK, mZ, mLn, n, zcol, page, first + nr, buf, nr, eps, warp, lane, hg)

        @cute.jit
        def write_new_row(self, mC, sK, mZ, mLn, n, zcol, page, row, buf, brow, eps: Float32, warp, lane, hg):
            """The step's cache row [RMSNorm_{kv_a_ln}(c~_kv) | k_pe] from the projection output z[n, zcol:zcol+576],
            written to row ``brow`` of ring buffer ``buf`` (warp 0; fp32 norm, one bf16 rounding, as
            k3ref.mla.mla_latents) and, by head group 0 alone, to row ``row`` of pool page ``page`` (its slot's page
            only): every head group's owning split builds the row for its own ring, one writes it."""
            # the page's base in 64 bits: page x 36,864 elements passes 2^31 from a pool of ~58K pages (4.3 GB)
            pg = cute.make_tensor(mC.iterator + Int64(page) * (PAGE * DQK),
                                  cute.make_layout((PAGE, DQK), stride=(DQK, 1)))
            if warp == 0:
                xs = cute.make_rmem_tensor(cute.make_layout(DQK // 32), Float32)
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(DQK // 32):
                    e = lane + 32 * i
                    x = mZ[n, zcol + e].to(Float32)
                    xs[i] = x
                    if const_expr(32 * (i + 1) <= DV):
                        ss = ss + x * x
                ss = cute.arch.warp_reduction_sum(ss)
                rstd = cute.math.rsqrt(ss * Float32(1.0 / DV) + eps)
                for i in cutlass.range_constexpr(DQK // 32):
                    e = lane + 32 * i
                    y = xs[i].to(BFloat16)
                    if const_expr(32 * (i + 1) <= DV):
                        y = (xs[i] * rstd * mLn[e]).to(BFloat16)
                    sK[buf, brow, e] = y
                    if hg == 0:
                        pg[row, e] = y

        @cute.kernel
        def kernel(self, mQ, mC, mBT, mLen, mO, mWO, mWML, mCnt, mZ, mLn, heads: Int32, splits: Int32, pps: Int32,
                   scale_log2: Float32, zcol: Int32, eps: Float32):
            tid = cute.arch.thread_idx()[0]
            s_id, hg, n = cute.arch.block_idx()
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            g = lane // 4
            t = lane % 4
            n_hg = (heads + (hn - 1)) // hn
            h0 = hg * hn

            smem = cutlass.memory.SmemAllocator()
            sQ = smem.allocate_tensor(BFloat16, cute.make_layout((hn, KSTR), stride=(KSTR, 1)), 128)
            sK = smem.allocate_tensor(BFloat16, cute.make_layout((NBUF, CHUNK, KSTR), stride=(CHUNK * KSTR, KSTR, 1)),
                                      128)
            sP = smem.allocate_tensor(BFloat16, cute.make_layout((hn, PSTR), stride=(PSTR, 1)), 128)
            sMax = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 16), stride=(16, 1)), 16)
            sSum = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 16), stride=(16, 1)), 16)
            sFlag = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
            # the combine's weights 2^(m_s - M) / L per (head row, split)
            sW = smem.allocate_tensor(Float32, cute.make_layout((hn, SPLITS_MAX), stride=(SPLITS_MAX, 1)), 16)
            sQ32 = cute.recast_tensor(sQ, Int32)        # (hn, KSTR / 2)
            sK32 = cute.recast_tensor(sK, Int32)        # (NBUF, CHUNK, KSTR / 2)
            sP32 = cute.recast_tensor(sP, Int32)        # (hn, PSTR / 2)
            sq_base = sQ.iterator.toint()
            sk_base = sK.iterator.toint()

            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

            length = mLen[n]
            pages_total = (length + (PAGE - 1)) // PAGE
            p_begin = s_id * pps
            p_end = cutlass.min(p_begin + pps, pages_total)

            # the head group's query rows (rows past the last head are zeros: their scores are discarded)
            q_base = mQ.iterator.toint()
            for c in cutlass.range(tid, hn * (DQK // 8), THREADS):
                r = c // (DQK // 8)
                col = c - r * (DQK // 8)
                s_addr = sq_base + (r * KSTR + col * 8) * 2
                if h0 + r < heads:
                    cp_async16(s_addr, q_base + Int64(((n * heads + h0 + r) * DQK + col * 8) * 2))
                else:
                    st_shared_zero16(s_addr)
            cute.arch.cp_async_commit_group()

            acc = cute.make_rmem_tensor(cute.make_layout(MT * NT * 4), Float32)
            acc.fill(0.0)
            sc = cute.make_rmem_tensor(cute.make_layout(NT * 4), Float32)
            m_run = cute.make_rmem_tensor(cute.make_layout(NT * 2), Float32)
            m_run.fill(NEG_INF)
            l_run = cute.make_rmem_tensor(cute.make_layout(NT * 2), Float32)
            l_run.fill(0.0)

            # the split's tokens [t_begin, t_end) in chunks of CHUNK rows; the step's own row (position length - 1)
            # is built in its chunk from the projection output when ``append``
            t_begin = p_begin * PAGE
            t_end = cutlass.min(p_end * PAGE, length)
            n_chunks = (cutlass.max(t_end - t_begin, Int32(0)) + (CHUNK - 1)) // CHUNK
            # the first NBUF - 1 chunks in flight, one commit group each (empty past the split's last chunk, so
            # that wait_group's count is the same in every iteration)
            for ci in cutlass.range_constexpr(NBUF - 1):
                if ci < n_chunks:
                    self.issue_chunk(mC, sK, sk_base, mBT, mZ, mLn, n, zcol, length, t_begin, Int32(ci), Int32(ci),
                                     eps, tid, warp, lane, hg)
                cute.arch.cp_async_commit_group()
            for ci in cutlass.range(n_chunks):
                buf = ci % NBUF
                # chunk ci + NBUF - 1 into the buffer chunk ci - 1 used (the barrier ending the last iteration
                # freed it), so that all NBUF buffers are in flight while chunk ci lands; then chunk ci landed (the
                # NBUF - 1 newer groups may still fly), and the barrier makes every thread's pieces visible
                if ci + NBUF - 1 < n_chunks:
                    self.issue_chunk(mC, sK, sk_base, mBT, mZ, mLn, n, zcol, length, t_begin, ci + NBUF - 1,
                                     (ci + NBUF - 1) % NBUF, eps, tid, warp, lane, hg)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(NBUF - 1)
                cute.arch.sync_threads()

                # ---- scores: tokens 16w + g, 16w + g + 8 (M) x heads 8j + 2t, 8j + 2t + 1 (N)
                sc.fill(0.0)
                r0 = 16 * warp + g
                for kk in cutlass.range_constexpr(KSTEPS):
                    a = [sK32[buf, r0, 8 * kk + t], sK32[buf, r0 + 8, 8 * kk + t],
                         sK32[buf, r0, 8 * kk + t + 4], sK32[buf, r0 + 8, 8 * kk + t + 4]]
                    for j in cutlass.range_constexpr(NT):
                        mma(sc, 4 * j, a, sQ32[8 * j + g, 8 * kk + t], sQ32[8 * j + g, 8 * kk + t + 4])
                tok0 = t_begin + ci * CHUNK + r0
                for j in cutlass.range_constexpr(NT):
                    for q in cutlass.range_constexpr(4):
                        tok = tok0 + 8 * (q // 2)
                        v = sc[4 * j + q] * scale_log2
                        sc[4 * j + q] = Float32(cutlass.select_(tok < length, v, Float32(NEG_INF)))

                # ---- the chunk's max per head, over the warp's 16 tokens, then over the warps
                for j in cutlass.range_constexpr(NT):
                    for q in cutlass.range_constexpr(2):
                        mx = cute.arch.fmax(sc[4 * j + q], sc[4 * j + 2 + q])
                        for off in (4, 8, 16):
                            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=off))
                        if g == 0:
                            sMax[warp, 8 * j + 2 * t + q] = mx
                cute.arch.sync_threads()
                for j in cutlass.range_constexpr(NT):
                    for q in cutlass.range_constexpr(2):
                        col = 8 * j + 2 * t + q
                        c = 2 * j + q
                        tile = sMax[0, col]
                        for w in cutlass.range_constexpr(1, WARPS):
                            tile = cute.arch.fmax(tile, sMax[w, col])
                        m_new = cute.arch.fmax(m_run[c], tile)
                        m_use = Float32(cutlass.select_(m_new == Float32(NEG_INF), Float32(0.0), m_new))
                        alpha = cute.math.exp2(m_run[c] - m_use)
                        p0 = cute.math.exp2(sc[4 * j + q] - m_use)
                        p1 = cute.math.exp2(sc[4 * j + 2 + q] - m_use)
                        ls = p0 + p1
                        for off in (4, 8, 16):
                            ls = ls + cute.arch.shuffle_sync_bfly(ls, offset=off)
                        l_run[c] = l_run[c] * alpha + ls
                        m_run[c] = m_new
                        sP[col, r0] = p0.to(BFloat16)
                        sP[col, r0 + 8] = p1.to(BFloat16)
                        for mt in cutlass.range_constexpr(MT):
                            acc[(mt * NT + j) * 4 + q] = acc[(mt * NT + j) * 4 + q] * alpha
                            acc[(mt * NT + j) * 4 + 2 + q] = acc[(mt * NT + j) * 4 + 2 + q] * alpha
                cute.arch.sync_threads()

                # ---- P V: dims 128w + 16mt + (g, g + 8) (M) x heads (N), tokens of the chunk (K)
                li = lane % 8
                lq = lane // 8
                for kk in cutlass.range_constexpr(VSTEPS):
                    tok = 16 * kk + li + 8 * (lq // 2)
                    bq = [[sP32[8 * j + g, 8 * kk + t], sP32[8 * j + g, 8 * kk + t + 4]] for j in range(NT)]
                    for mt in cutlass.range_constexpr(MT):
                        dim = 128 * warp + 16 * mt + 8 * (lq % 2)
                        a = ldmatrix_x4_trans(sk_base + ((buf * CHUNK + tok) * KSTR + dim) * 2)
                        for j in cutlass.range_constexpr(NT):
                            mma(acc, (mt * NT + j) * 4, a, bq[j][0], bq[j][1])
                # the buffer, sP and sMax are read: the next iteration may refill them
                cute.arch.sync_threads()

            cute.arch.cp_async_wait_group(0)     # an empty split still committed the query rows: retire them

            # ---- the CTA's row sums: each warp holds its own tokens' share
            for c in cutlass.range_constexpr(NT * 2):
                if g == 0:
                    sSum[warp, 8 * (c // 2) + 2 * t + c % 2] = l_run[c]
            cute.arch.sync_threads()
            l_tot = cute.make_rmem_tensor(cute.make_layout(NT * 2), Float32)
            for c in cutlass.range_constexpr(NT * 2):
                col = 8 * (c // 2) + 2 * t + c % 2
                v = sSum[0, col]
                for w in cutlass.range_constexpr(1, WARPS):
                    v = v + sSum[w, col]
                l_tot[c] = v

            if const_expr(not defer) and splits == 1:
                # ---- one split: normalise and store
                for mt in cutlass.range_constexpr(MT):
                    for j in cutlass.range_constexpr(NT):
                        for q in cutlass.range_constexpr(4):
                            c = 2 * j + q % 2
                            head = h0 + 8 * j + 2 * t + q % 2
                            dim = 128 * warp + 16 * mt + g + 8 * (q // 2)
                            if head < heads:
                                inv = Float32(cutlass.select_(l_tot[c] > Float32(0.0),
                                                              Float32(1.0) / l_tot[c], Float32(0.0)))
                                mO[n, head, dim] = (acc[(mt * NT + j) * 4 + q] * inv).to(BFloat16)
            else:
                # ---- several splits: publish the partial, the last arrival combines
                row0 = ((n * n_hg + hg) * splits + s_id) * hn
                if p_begin < p_end:
                    for mt in cutlass.range_constexpr(MT):
                        for j in cutlass.range_constexpr(NT):
                            for q in cutlass.range_constexpr(4):
                                mWO[row0 + 8 * j + 2 * t + q % 2, 128 * warp + 16 * mt + g + 8 * (q // 2)] = \
                                    acc[(mt * NT + j) * 4 + q]
                if warp == 0:
                    if g == 0:
                        for c in cutlass.range_constexpr(NT * 2):
                            col = 8 * (c // 2) + 2 * t + c % 2
                            mWML[row0 + col, 0] = m_run[c]
                            mWML[row0 + col, 1] = l_tot[c]
                if const_expr(not defer):
                    # (the deferred build stops here: the partials are its output, combined by mla_uv_gate)
                    # every thread's stores precede thread 0's release by the barrier and the release's cumulativity
                    cute.arch.sync_threads()
                    if tid == 0:
                        old = cute.arch.atomic_add(mCnt.iterator + (n * n_hg + hg), Int32(1), sem="acq_rel",
                                                   scope="gpu")
                        last = Int32(cutlass.select_(old == splits - 1, Int32(1), Int32(0)))
                        if last == 1:
                            # every split has arrived: re-arm for the next launch
                            cute.arch.store(mCnt.iterator + (n * n_hg + hg), Int32(0), sem="relaxed", scope="gpu")
                        sFlag[0] = last
                    cute.arch.sync_threads()
                    if sFlag[0] == 1:
                        # the last arrival combines: first each head row's weights
                        # w_s = 2^(m_s - M) / sum_s 2^(m_s - M) l_s into shared memory (one warp per row, the splits
                        # across its lanes; a split with no page, l = 0, weighs 0), then every output element sums
                        # w_s O_s with a group of splits' loads in flight: the group loop is the only serial chain
                        base = ((n * n_hg + hg) * splits) * hn
                        ws = mWO.iterator
                        wml = mWML.iterator
                        for r in cutlass.range(warp, hn, WARPS):
                            wr = combine_weights(wml, base + r, hn, splits, lane)
                            for i in cutlass.range_constexpr(LANE_SPLITS):
                                if lane + 32 * i < splits:
                                    sW[r, lane + 32 * i] = wr[i]
                        cute.arch.sync_threads()
                        # element k of this thread: head row k // (DV / THREADS),
                        # dim tid + THREADS * (k % (DV / THREADS))
                        ob = cute.make_rmem_tensor(cute.make_layout(OUT_PER_THREAD), Float32)
                        ob.fill(0.0)
                        vb = cute.make_rmem_tensor(cute.make_layout(GROUP * OUT_PER_THREAD), Float32)
                        for s0 in cutlass.range(0, splits, GROUP):
                            # a group's loads first (a split index past the last reads the last split's slot, weight
                            # 0), then its sums in split order: each element adds its splits in the order 0, 1, ..
                            for u in cutlass.range_constexpr(GROUP):
                                su = cutlass.min(s0 + u, splits - 1)
                                for k in cutlass.range_constexpr(OUT_PER_THREAD):
                                    r = k // (DV // THREADS)
                                    d = tid + THREADS * (k % (DV // THREADS))
                                    vb[u * OUT_PER_THREAD + k] = cute.arch.load(ws + ((base + su * hn + r) * DV + d),
                                                                                Float32, cop="cg")
                            for u in cutlass.range_constexpr(GROUP):
                                for k in cutlass.range_constexpr(OUT_PER_THREAD):
                                    r = k // (DV // THREADS)
                                    wgt = sW[r, cutlass.min(s0 + u, splits - 1)]
                                    # a split with no page wrote no partial O (its slot holds anything):
                                    # weight 0, value 0
                                    v = Float32(cutlass.select_(wgt > Float32(0.0), vb[u * OUT_PER_THREAD + k],
                                                                Float32(0.0)))
                                    ob[k] = Float32(cutlass.select_(s0 + u < splits, ob[k] + wgt * v, ob[k]))
                        for k in cutlass.range_constexpr(OUT_PER_THREAD):
                            r = k // (DV // THREADS)
                            if h0 + r < heads:
                                mO[n, h0 + r, tid + THREADS * (k % (DV // THREADS))] = ob[k].to(BFloat16)

    return MlaLatentDecode()


def _compile(hn: int, append: bool = False, defer: bool = False):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32
    obj = _build(hn, append, defer)
    N, H, NP, MAXP, R, C, W = (cute.sym_int() for _ in range(7))
    fakes = (fake_tensor(BFloat16, (N, H, DQK)),           # q
             fake_tensor(BFloat16, (NP, PAGE, DQK)),       # kv_cache pool
             fake_tensor(Int32, (N, MAXP), align=4),       # block table
             fake_tensor(Int32, (N,), align=4),            # lengths
             fake_tensor(BFloat16, (N, H, DV)),            # out
             fake_tensor(Float32, (R, DV)),                # workspace: partial O
             fake_tensor(Float32, (R, 2)),                 # workspace: (m, l)
             fake_tensor(Int32, (C,), align=4),            # workspace: arrival counters (one per request, head group)
             fake_tensor(BFloat16, (N, W)),                # the projection output holding [c~_kv | k_pe] (append)
             fake_tensor(Float32, (DV,), align=4))         # kv_a_layernorm weight (append)
    return cute.compile(obj, *fakes, Int32(1), Int32(1), Int32(1), Float32(1.0), Int32(0), Float32(1e-5),
                        fake_stream(), options=TVM_FFI)


def _get_compiled(key: tuple):
    return compile_cached(key, lambda: _compile(key[1], "append" in key[2:], "defer" in key[2:]))


def warmup(heads_list=(6, 12, 96), append=(False,), defer=(False,)) -> list[tuple]:
    """Compile the builds these head counts take, with and / or without the fused append and the deferred combine
    (no GPU needed)."""
    keys = sorted({compile_key(head_group(h), a, d) for h in heads_list for a in append for d in defer})
    for k in keys:
        _get_compiled(k)
    return keys


def make_workspace(n_requests: int, heads: int, max_pages: int, device, nsm: int = 132, defer: bool = False):
    """The combine's scratch for these sizes: partial O, (m, l) per (request, head group, split, row) and the
    arrival counters (zeroed here, re-armed by the kernel). Allocate before any CUDA-graph capture. ``defer``: for
    the deferred combine's plan (the partials are the output, read by mla_uv_gate)."""
    import torch
    hn = head_group(heads)
    hg = -(-heads // hn)
    s, _ = plan_splits(n_requests, heads, max_pages, nsm, defer)
    rows = n_requests * hg * s * hn
    ws = {"o": torch.empty(rows, DV, dtype=torch.float32, device=device),
          "ml": torch.empty(rows, 2, dtype=torch.float32, device=device),
          "count": torch.zeros(max(n_requests * hg, 1), dtype=torch.int32, device=device),
          "key": (n_requests, heads, max_pages, nsm, defer)}
    if defer:
        # mla_uv_gate's combine build: each (head, latent slice) CTA's W_UV partial output, and an arrival counter
        # per head (zeroed here, re-armed by the head's last CTA)
        ws["uv_scratch"] = torch.empty(heads * UV_SLICES * n_requests, 128, dtype=torch.float32, device=device)
        ws["uv_count"] = torch.zeros(heads, dtype=torch.int32, device=device)
    return ws


_DUMMY_LN: dict = {}


def check_paging(block_table, lengths, n_pages: int, *, lengths_name: str = "lengths") -> None:
    """Refuse paging the kernel would only trust: a length outside 0..64 MAXP, a page a request reaches that lies
    outside the pool of ``n_pages`` pages, or two live requests whose new rows (position L - 1, the row the append
    writes) are the same cache row. Unreached table entries are never read and may hold anything. The errors name
    ``block_table`` and ``lengths_name``. Syncs with the host; never call it inside a CUDA-graph capture (there the
    metadata is the caller's contract)."""
    import torch
    check_tensor("block_table", block_table, dtype=torch.int32, align=4)
    check_tensor(lengths_name, lengths, dtype=torch.int32, align=4)
    if block_table.dim() != 2 or lengths.dim() != 1 or lengths.shape[0] != block_table.shape[0]:
        raise ValueError(f"block_table, {lengths_name}: expected [N, MAXP] and [N], got {list(block_table.shape)} "
                         f"and {list(lengths.shape)}")
    # one copy to the host, then every test there: a step's table is at most 64 x MAXP entries
    bt, lens = block_table.cpu(), lengths.cpu().long()
    maxp = bt.shape[1]
    bad = ((lens < 0) | (lens > PAGE * maxp)).nonzero().flatten().tolist()
    if bad:
        n = bad[0]
        raise ValueError(f"{lengths_name}: request {n} has {int(lens[n])} rows, expected 0..{PAGE * maxp} ({PAGE} rows "
                         f"x the block table's {maxp} columns)")
    reached = torch.arange(maxp)[None, :] < ((lens + PAGE - 1) // PAGE)[:, None]
    outside = (reached & ((bt < 0) | (bt >= n_pages))).nonzero().tolist()
    if outside:
        n, p = outside[0]
        raise ValueError(f"block_table: request {n} reaches page column {p}, which holds {int(bt[n, p])}; "
                         f"expected a page of the pool, 0..{n_pages - 1}")
    live = (lens > 0).nonzero().flatten()
    last = lens[live] - 1
    rows = (bt[live, last // PAGE].long() * PAGE + last % PAGE).tolist()
    seen: dict[int, int] = {}
    for n, r in zip(live.tolist(), rows):
        if r in seen:
            raise ValueError(f"block_table: requests {seen[r]} and {n} append to the same cache row (page {r // PAGE}, "
                             f"row {r % PAGE}); each request needs its own")
        seen[r] = n


@dataclasses.dataclass(frozen=True)
class LatentPartials:
    """What the deferred build leaves for mla_uv_gate: per (request, head group, split, head row) the unnormalised
    O (``o`` [R, 512] fp32, row ((n * groups + g) * splits + s) * hn + r; not written for a split with no page) and
    (m, l) (``ml`` [R, 2] fp32: the running max in base 2 and the row sum; l = 0 for a split with no page), and the
    scratch mla_uv_gate's combine needs (``uv_scratch`` [heads * UV_SLICES * requests, 128] fp32, ``uv_count``
    [heads] int32, zeroed once)."""
    o: object
    ml: object
    splits: int
    hn: int
    heads: int
    requests: int
    uv_scratch: object = None
    uv_count: object = None


def mla_latent_decode(q, kv_cache, block_table, lengths, *, scale: float, out=None, workspace=None,
                      nsm: int = 132, proj=None, proj_col: int = 0, kv_norm=None,
                      eps: float = 1e-5, defer: bool = False):
    """o_lat [N, H, 512] bf16 = softmax(scale q . c) c_kv over the first lengths[n] cache rows of each request.

    q [N, H, 576] bf16 (the absorbed query), kv_cache [pages, 64, 576] bf16 (vLLM's paged latent cache),
    block_table [N, MAXP] int32, lengths [N] int32 (rows to attend; 0: a padded request, zero output).
    ``proj`` [N, W] (the projection output, [c~_kv | k_pe] at columns proj_col .. proj_col + 575) with ``kv_norm``
    [512] fp32: row lengths[n] - 1 is the step's own token, written here as [RMSNorm_{kv_norm}(c~_kv) | k_pe] into
    its page (and nowhere else) before the attention reads it. ``workspace``: make_workspace's dict for these sizes
    (one is made here when None: not inside a graph capture). No host sync; capturable in a CUDA graph once
    compiled and the workspace exists. ``defer``: return the splits' LatentPartials (in the workspace) for
    mla_uv_gate to combine, instead of o_lat; the workspace must be made with defer=True."""
    import torch
    # dtypes and shapes first (these run on a CPU too), then one device for everything
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, DQK))
    N, H = q.shape[0], q.shape[1]
    if N < 1 or H < 1:
        raise ValueError(f"q: expected at least one request and one head, got {list(q.shape)}")
    check_tensor("kv_cache", kv_cache, dtype=torch.bfloat16, shape=(None, PAGE, DQK))
    check_tensor("block_table", block_table, dtype=torch.int32, shape=(N, None), align=4)
    check_tensor("lengths", lengths, dtype=torch.int32, shape=(N,), align=4)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    dev = q.device
    if dev.type != "cuda":
        raise ValueError(f"mla_latent_decode needs CUDA tensors, got q on {dev}")
    for name, t in (("kv_cache", kv_cache), ("block_table", block_table), ("lengths", lengths)):
        if t.device != dev:
            raise ValueError(f"{name}: expected device {dev} (the device of q), got {t.device}")
    if out is None:
        out = torch.empty(N, H, DV, dtype=torch.bfloat16, device=dev)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(N, H, DV), device=dev)
    maxp = block_table.shape[1]
    if maxp < 1:
        raise ValueError("block_table: expected at least one page column")
    if not isinstance(defer, bool):
        raise ValueError(f"defer must be a bool, got {defer!r}")
    splits, pps = plan_splits(N, H, maxp, nsm, defer)
    if splits > SPLITS_MAX:            # the combine's weight table in shared memory holds SPLITS_MAX splits
        raise ValueError(f"nsm={nsm}: {splits} splits, more than the combine's {SPLITS_MAX}")
    if workspace is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("mla_latent_decode: make the workspace before CUDA-graph capture")
        workspace = make_workspace(N, H, maxp, dev, nsm, defer)
    elif workspace.get("key") != (N, H, maxp, nsm, defer):
        raise ValueError(f"workspace: made for (N, H, MAXP, nsm, defer) = {workspace.get('key')}, the call "
                         f"needs {(N, H, maxp, nsm, defer)}")
    append = proj is not None
    if append:
        check_tensor("proj", proj, dtype=torch.bfloat16, shape=(N, None), device=dev)
        if not (isinstance(proj_col, int) and 0 <= proj_col and proj_col + DQK <= proj.shape[1]
                and proj_col % 8 == 0):
            raise ValueError(f"proj_col: expected a multiple of 8 with proj_col + {DQK} <= {proj.shape[1]}, got "
                             f"{proj_col!r}")
        if kv_norm is None:
            raise ValueError("kv_norm: the kv_a_layernorm weight [512] is needed with proj")
        check_tensor("kv_norm", kv_norm, dtype=torch.float32, shape=(DV,), device=dev, align=4)
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be a positive finite float, got {eps!r}")
        z, zcol, ln = proj, proj_col, kv_norm
    else:
        z, zcol = q.view(N, H * DQK), 0
        ln = _DUMMY_LN.get(dev)
        if ln is None:
            ln = _DUMMY_LN[dev] = torch.zeros(DV, dtype=torch.float32, device=dev)
    fn = _get_compiled(compile_key(head_group(H), append, defer))
    fn(q, kv_cache, block_table, lengths, out, workspace["o"], workspace["ml"], workspace["count"], z, ln, H,
       splits, pps, float(scale) * 1.4426950408889634, zcol, float(eps))
    if defer:
        return LatentPartials(workspace["o"], workspace["ml"], splits, head_group(H), H, N,
                              workspace["uv_scratch"], workspace["uv_count"])
    return out
