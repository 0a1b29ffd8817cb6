"""Fused KDA decode step: conv1d + SiLU, f_b projection + decay gate, beta, q/k L2 norms, the gated delta rule on
the FP32 state and the gated output RMSNorm, with the conv-window and state write-back. One launch.

Replaces docs/k3-layer.md section 7.2 steps 2-8 (everything between the packed input projection
``in_proj_qkvgfab`` and ``o_proj``): the causal conv + SiLU of the 3P q/k/v channels (eq. 2), the
head split and q/k L2 norms (eqs. 3-4), the low-rank decay gate f = bf16(f_a W_fb^T) and
lambda = lb * sigmoid(exp(A_log) (f + dt_bias)) (eq. 5, including the f_b GEMM), beta = sigmoid(b)
(eq. 6), the delta rule S <- S diag(alpha); e = v - S k; S <- S + beta e k^T; o = S q (eq. 7) and
y = w_o * o / rms(o) * sigmoid(g) (eq. 8). T in 1..8 tokens per request run as T sequential steps
(speculative verify); only the state after the T-th token is written back.

Bytes it must move per request (B = 1), P = 128 H, and the floor at 4.3 TB/s:
  recurrent state r+w 2 * H * 64 KiB, conv state r+w 2 * 3P * 3 * 2 B, f_b weight P * 256 B
  (shared by the batch), proj row (4P + 128 + H) * 2 B, y P * 2 B.
  k3_rank(16) (H=6):   786 KB + 27.6 KB + 196 KB + ~8 KB  ~= 1.02 MB  -> 0.24 us  (B=64: 52 MB -> 12 us)
  k3_rank(8)  (H=12): 1573 KB + 55.3 KB + 393 KB + ~15 KB ~= 2.04 MB  -> 0.47 us  (B=64: 104 MB -> 24 us)
  full / TP1  (H=96): 12.6 MB + 442 KB + 3.1 MB + ~0.1 MB ~= 16.3 MB  -> 3.8 us   (B=64: 0.83 GB -> 193 us)
At B=1 the kernel is latency-bound (a chain of dependent steps after the PDL wait); at large B it is bound by
how much of the state is in flight.

Two builds, chosen per batch by choose_nsplit (docs/kernels/kda_conv_gate_step.md explains both and gives the
measured figures behind the thresholds):

* The cluster build (nsplit NS = 8 or 4): grid (NS, H, B), clusters of NS CTAs of 128 threads. The NS CTAs of a
  cluster share one (request, head) and split its 128 value rows (R = 128/NS rows per CTA, R/4 per warp; lane l
  owns keys 4l..4l+3 as one float4). Each CTA loads its state rows into registers BEFORE the PDL wait, so what
  remains after the wait is the proj loads, the conv, the f_b dot products, two exchanges and the recurrence.
  Every CTA recomputes its head's q/k conv (256 channels, L2 hits), so no q/k exchange is needed. The f_b
  projection is split: CTA s computes f for the key channels [sR, sR+R) and sends alpha to every peer by st.async
  into the peer's shared memory, completing bytes on the peer's mbarrier. The gated norm needs sum(o^2) over all
  128 rows: each CTA sends its per-token partial the same way, and every CTA adds the NS partials in one fixed
  order (the same rstd bits in every CTA, deterministic). No cluster barrier follows the start and no gpu-scope
  fence sits on the chain. Every write-back comes after the last exchange.
* The head build (nsplit 1, from HEAD_CTA_MIN request-heads): one CTA of HEAD_WARPS warps per (request, head), no
  cluster. The conv, f_b and the decay gate are computed once per head. After the PDL wait every thread requests
  its first token's projections, then thread 0 bulk-copies the head's 64 KB of state into shared memory in
  HEAD_CHUNKS chunks, each completing on its own mbarrier; the warps owning a chunk's rows start on it as soon
  as it lands, and its first lane hands it back to HBM by a bulk store as soon as its rows are final. Every row,
  channel and reduction is computed as nsplit 4 computes it, so the two builds give the same bits.

Conv-state race (cluster build): the q/k conv window of a head is READ by all NS CTAs but WRITTEN only by split 0,
after its last exchange. A peer's norm partial arrives only after the peer consumed its window loads (the conv
outputs went to shared memory), so no CTA can read a window that split 0 already shifted. The v channels
[2P + hD + sR, +R) are read and written only by CTA s.

Contracts:
* PDL: rec_state, conv_state, weights and `slots` may be read BEFORE griddepcontrol.wait. They must not be written
  by the kernel launched immediately before this one (slots come from host-side batch setup; the states were
  written by this kernel in the previous decode step of the same layer). proj is read, and y, conv_state,
  rec_state are written, only after the wait.
* early_trigger=False (the default): the dependents launch at the very end, after a fence.acq_rel.gpu that orders
  the state writes, so a dependent's pre-wait state loads see them; two back-to-back launches on the same slots
  work (tests/gpu test_back_to_back_steps). early_trigger=True (the layer's configuration): the dependents launch
  right after this kernel's own wait, so o_proj streams its weights during the step. Only for a dependent that
  reads no KDA state before its own wait, never for a second KDA step launched directly behind this one; later
  kernels see the state through this grid's completion.
* slots[b] < 0 (and slot 0 in the null_slot build, vLLM's NULL_BLOCK_ID): padding; no state is read or written,
  y rows are zeros. slots[b] >= S (caller error, checked in-kernel without a host sync): no state is touched and
  the y rows are NaN so the error cannot pass silently. Two requests with the same slot: undefined (caller error).
* u (conv output) stays FP32; f is rounded to bf16 like a bf16 GEMM output; state FP32.
"""
from __future__ import annotations

from typing import Iterable

from ._dsl import PDL, TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, import_cute, sigmoid

HEAD_DIM = 128
MAX_T = 8
WARPS = 4                   # warps per CTA of the cluster build
HEAD_WARPS = 8              # warps per CTA of the head build
HEAD_CHUNKS = 4             # bulk copies per 64 KB state (16 KB each), in and out
HEAD_ROW_GROUP = 4          # state rows a warp of the head build loads before updating them (faster than 1 at b64)
# nsplit 1 (the head build) from this many request-heads: rank16 b32 / b64, rank8 b16 and up, full width b2 and up.
# At rank16 / rank8 b64 it is 22-23 % faster than nsplit 4, 13 % at rank8 b16 (192); even at 96, slower below
HEAD_CTA_MIN = 192
NSPLITS = (1, 4, 8)


def proj_width(heads: int, head_dim: int = HEAD_DIM) -> int:
    """Np: row width of the packed projection [q P | k P | v P | g P | f_a 128 | b H | pad to 16]."""
    p = heads * head_dim
    return (4 * p + head_dim + heads + 15) // 16 * 16


def choose_nsplit(batch: int, heads: int) -> int:
    """CTAs per (request, head). 8 for small B*H (fill the GPU: 48 CTAs at rank16 b1), 4 up to HEAD_CTA_MIN
    request-heads (less redundant q/k conv and proj traffic per CTA; 8 state rows per warp still fit registers;
    at rank16 nsplit 8 took 34.0 us at b64 against 30.9, nsplit 4 9.9 us at b4 against 9.1), then 1 (the head build:
    one CTA per (request, head), the state staged in shared memory)."""
    if batch * heads >= HEAD_CTA_MIN:
        return 1
    return 8 if batch * heads <= 64 else 4


def compile_key(heads: int, T: int, nsplit: int, lower_bound: float = -5.0, eps: float = 1e-5,
                head_dim: int = HEAD_DIM, *, early_trigger: bool = False, null_slot: bool = False) -> tuple:
    """The compile-cache key of one build: shape, T, the split (1 = the head build), the trigger placement and the
    padding convention (null_slot: slot 0 also marks padding)."""
    return (("kda_conv_gate_step", int(heads), int(head_dim), int(T), int(nsplit), float(lower_bound), float(eps))
            + (("early_trigger",) if early_trigger else ()) + (("null_slot",) if null_slot else ()))


def compile_keys(heads: int, batches: Iterable[int], Ts: Iterable[int] = (1,), lower_bound: float = -5.0,
                 eps: float = 1e-5, early_trigger: bool = False, null_slot: bool = False) -> list:
    """The kernels kda_conv_gate_step runs for these batches and T (the layer passes early_trigger=True)."""
    keys = []
    for T in Ts:
        for b in batches:
            k = compile_key(heads, T, choose_nsplit(b, heads), lower_bound, eps, early_trigger=early_trigger,
                            null_slot=null_slot)
            if k not in keys:
                keys.append(k)
    return keys


def warmup(heads: int, batches: Iterable[int], Ts: Iterable[int] = (1,), lower_bound: float = -5.0,
           eps: float = 1e-5, early_trigger: bool = False, null_slot: bool = False) -> list:
    """Compile every kernel a (heads, batch list, T list) config needs; call before graph capture."""
    keys = compile_keys(heads, batches, Ts, lower_bound, eps, early_trigger, null_slot)
    for k in keys:
        _get_compiled(k)
    return keys


# ---------------------------------------------------------------------------- device code

# Traced helpers shared by the cluster build (_build) and the one-CTA-per-head build (_build_head): the per-request
# slot, the W_fb rows, the conv step and the decay gate are the same arithmetic in both, which is what makes the two
# builds' outputs the same bits.

def _request_slot(mSlots, b, nslots, pad_max):
    """(is_pad, is_bad, valid, slot_w) of request b: slot_w is its slot as a 64-bit index (S * H * 128 * 128 exceeds
    2**31 elements at full width, S > 1365), 0 for a padded or bad slot (never dereferenced; keeps the address math
    in range). Slots <= pad_max are padding: -1 for our own pools, 0 under vLLM, whose NULL_BLOCK_ID 0 marks the
    padded rows of a CUDA-graph batch."""
    import cutlass
    from cutlass import Int32, Int64
    slot = mSlots[b]
    valid = (slot > pad_max) & (slot < nslots)
    return slot <= pad_max, slot >= nslots, valid, Int32(cutlass.select_(valid, slot, Int32(0))).to(Int64)


def _load_fb_rows(mWfb, mDtBias, row0, step, jv, rW, rDt):
    """W_fb rows row0 + step m (m < len(rDt)), this thread's 16-byte vector jv of each, and their dt_bias."""
    _, cute = import_cute()
    for m in range(cute.size(rDt)):
        wrow = row0 + step * m
        cute.autovec_copy(cute.local_tile(mWfb[wrow, None], (8,), (jv,)), rW[m, None])
        rDt[m] = mDtBias[wrow]


def _conv_step(cw, win, c, x):
    """Channel c's causal conv at the new input x (fp32): sum of the 4 taps over the window [t-3, t-2, t-1] and x;
    the window then moves on by one (x becomes its newest entry)."""
    u = cw[c, 0] * win[c, 0] + cw[c, 1] * win[c, 1] + cw[c, 2] * win[c, 2] + cw[c, 3] * x
    win[c, 0] = win[c, 1]
    win[c, 1] = win[c, 2]
    win[c, 2] = x
    return u


def _decay_alpha(fa, rw_row, dt, decay_rate, lower_bound, lanes):
    """alpha = exp(lower_bound * sigmoid(exp(A_log) * (f + dt_bias))) of one channel, f = bf16(f_a . W_fb row) with
    the row spread over ``lanes`` lanes (8 bf16 each), summed by a butterfly over them."""
    from cutlass import BFloat16, Float32
    _, cute = import_cute()
    part = (fa * rw_row.load().to(Float32)).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
    f = cute.arch.warp_reduction_sum(part, threads_in_group=lanes).to(BFloat16).to(Float32)
    return cute.math.exp(Float32(lower_bound) * sigmoid(decay_rate * (f + dt)))


def _build(heads: int, head_dim: int, T: int, nsplit: int, lower_bound: float, eps: float,
           early_trigger: bool = False, pad_max: int = -1):
    """The cluster build (nsplit 8 or 4)."""
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32, Int64, const_expr
    from cutlass.cutlass_dsl import dsl_user_op
    from cutlass._mlir.dialects import llvm

    H, D, NS = heads, head_dim, nsplit
    P = H * D
    # At T = 1 and nsplit 8 every proj value a thread reads is loaded right after the PDL wait (see phase A). At
    # T > 1 the per-token loads would cost T times the registers, and nsplit 4 (96 registers) would spill 8 bytes.
    preload = T == 1 and NS == 8
    R = D // NS                 # value rows (and f channels) per CTA
    RW = R // WARPS             # value rows per warp
    NTH = 32 * WARPS
    FV = D // 8                 # 16-byte vectors per W_fb row
    FROWS = R * FV // NTH       # W_fb rows per thread (rows tid//FV + (NTH//FV)*m)
    OUT_IT = (T * R + NTH - 1) // NTH
    QSCALE = float(D) ** -0.5
    assert D == 128 and R % WARPS == 0 and R <= 32 and (R * FV) % NTH == 0 and NTH % R == 0
    assert 1 <= T <= MAX_T

    @cute.jit
    def write_conv_window(mConvState, valid, split, has_v, slot_w, cq, ck, cv_c, win):
        # split 0 writes the head's q/k windows (every CTA of the cluster reads them), CTA s its v channels
        if valid:
            if split == 0:
                for j in cutlass.range_constexpr(3):
                    mConvState[slot_w, cq, j] = win[0, j].to(BFloat16)
                    mConvState[slot_w, ck, j] = win[1, j].to(BFloat16)
            if has_v:
                for j in cutlass.range_constexpr(3):
                    mConvState[slot_w, cv_c, j] = win[2, j].to(BFloat16)

    @cute.jit
    def write_state_rows(mRecState, valid, slot_w, h, row0, lane, rS):
        if valid:
            for r in cutlass.range_constexpr(RW):
                g_row = cute.local_tile(mRecState[slot_w, h, row0 + r, None], (4,), (lane,))
                cute.autovec_copy(rS[r, None], g_row)

    @dsl_user_op
    def st_async_f32(smem_ptr, val, rank, mbar_ptr, *, loc=None, ip=None):
        # st.async into peer CTA `rank` (never the executing CTA: PTX leaves that undefined) at the same smem
        # offset; the 4 bytes complete_tx on the peer's mbarrier at the same offset, so the receiver's mbarrier wait
        # publishes them (no cluster barrier, no gpu fence)
        addr = smem_ptr.toint(loc=loc, ip=ip)
        bar = mbar_ptr.toint(loc=loc, ip=ip)
        llvm.inline_asm(
            None,
            [Int32(addr).ir_value(loc=loc, ip=ip), Float32(val).ir_value(loc=loc, ip=ip),
             Int32(rank).ir_value(loc=loc, ip=ip), Int32(bar).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .b32 ra, rb;\n\tmapa.shared::cluster.u32 ra, $0, $2;\n\tmapa.shared::cluster.u32 rb, $3, $2;"
            "\n\tst.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [ra], $1, [rb];\n\t}",
            "r,f,r,r,~{memory}", has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)

    @cute.jit
    def request_step(mProj, mConvState, mRecState, mY, b, slot_w, valid, is_pad, is_bad, rS, win, cw, rW, rDt,
                     decay_rate, onorm, sUq, sUk, sAl, sUv, sO, sRed, sBeta, tid, lane, warp, split, h, cq, ck, cv_c,
                     has_v, jv, fr, row0, mbar):
        """Request b of this CTA's (head h, value rows [row0 of warp 0, +R)), after the PDL wait: the state rows are
        in rS and the conv windows in win (both zero for a padded or bad slot). Phases A-C below, with the two
        cluster exchanges through the mbarriers at mbar, mbar + 1; writes the conv window, the state rows and y."""
        # ---------------- phase A: conv, beta, f -> alpha for all T tokens (state-independent)
        rFa = cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), BFloat16)
        if const_expr(preload):
            # everything this thread reads from proj, issued together right after the wait. Loaded where used, the
            # beta logit and the f_a vector would sit behind the conv sigmoids' division branches in the SASS and
            # the output gate's load after the last exchange: 3 more round trips (-0.5 to -0.8 us at b1-b8).
            p_xq = mProj[b, cq]
            p_xk = mProj[b, ck]
            p_xv = mProj[b, cv_c]
            p_beta = mProj[b, 4 * P + D + h]
            cute.autovec_copy(cute.local_tile(mProj[b, None], (8,), (4 * P // 8 + jv,)), rFa)
            p_gate = mProj[b, 3 * P + h * D + split * R + tid % R]
        for t in cutlass.range_constexpr(T):
            row = b * T + t
            if const_expr(preload):
                xq = p_xq.to(Float32)
                xk = p_xk.to(Float32)
                xv = p_xv.to(Float32)
            else:
                xq = mProj[row, cq].to(Float32)
                xk = mProj[row, ck].to(Float32)
                xv = mProj[row, cv_c].to(Float32)
            uq = _conv_step(cw, win, 0, xq)
            uk = _conv_step(cw, win, 1, xk)
            uv = _conv_step(cw, win, 2, xv)
            sUq[t, tid] = uq * sigmoid(uq)
            sUk[t, tid] = uk * sigmoid(uk)
            if has_v:
                sUv[t, tid] = uv * sigmoid(uv)
            if tid == 0:
                if const_expr(preload):
                    sBeta[t] = sigmoid(p_beta.to(Float32))
                else:
                    sBeta[t] = sigmoid(mProj[row, 4 * P + D + h].to(Float32))
            # f[i] = bf16(sum_j f_a[j] W_fb[hD+i, j]); 16 lanes (one W_fb row) per reduction
            if const_expr(not preload):
                cute.autovec_copy(cute.local_tile(mProj[row, None], (8,), (4 * P // 8 + jv,)), rFa)
            fa = rFa.load().to(Float32)
            for m in cutlass.range_constexpr(FROWS):
                alpha = _decay_alpha(fa, rW[m, None], rDt[m], decay_rate, lower_bound, FV)
                ch = split * R + fr + (NTH // FV) * m
                if jv < NS:
                    # st.async must target another CTA of the cluster (PTX: undefined for the executing CTA):
                    # this CTA's own channels are plain shared stores, ordered by the CTA barrier below
                    if jv == split:
                        sAl[t, ch] = alpha
                    else:
                        st_async_f32(sAl.iterator + (t * D + ch), alpha, jv, mbar)

        # exchange 1: this CTA's mbarrier completes when the D x T alpha values have landed (complete_tx), which
        # needs no gpu-scope fence; the CTA barrier orders sUq/sUk/sUv/sBeta and this CTA's own alpha values
        cute.arch.mbarrier_wait(mbar, 0)
        cute.arch.barrier()

        # ---------------- phase B: T sequential delta-rule steps on the register-resident rows
        rK = cute.make_rmem_tensor(cute.make_layout((4,), stride=(1,)), Float32)
        rQ = cute.make_rmem_tensor(cute.make_layout((4,), stride=(1,)), Float32)
        rA = cute.make_rmem_tensor(cute.make_layout((4,), stride=(1,)), Float32)
        for t in cutlass.range(T, unroll=1):
            cute.autovec_copy(cute.local_tile(sUk[t, None], (4,), (lane,)), rK)
            cute.autovec_copy(cute.local_tile(sUq[t, None], (4,), (lane,)), rQ)
            cute.autovec_copy(cute.local_tile(sAl[t, None], (4,), (lane,)), rA)
            beta = sBeta[t]
            kk = rK.load()
            qq = rQ.load()
            al = rA.load()
            ksq = cute.arch.warp_reduction_sum((kk * kk).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
            qsq = cute.arch.warp_reduction_sum((qq * qq).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
            kn = kk * cute.math.rsqrt(ksq + Float32(1e-6))
            qn = qq * (cute.math.rsqrt(qsq + Float32(1e-6)) * Float32(QSCALE))
            for r in cutlass.range_constexpr(RW):
                s = rS[r, None].load() * al
                sk = cute.arch.warp_reduction_sum((s * kn).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                e = sUv[t, warp * RW + r] - sk
                s = s + kn * (beta * e)
                rS[r, None].store(s)
                o = cute.arch.warp_reduction_sum((s * qn).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                if lane == 0:
                    sO[t, warp * RW + r] = o

        # ---------------- phase C: gated RMSNorm over the head's 128 rows (cluster reduction)
        cute.arch.barrier()
        for t in cutlass.range_constexpr(T):
            if warp == t % WARPS:
                ov = Float32(0.0)
                if lane < R:
                    ov = sO[t, lane]
                ss = cute.arch.warp_reduction_sum(ov * ov)
                if lane < NS:
                    if lane == split:
                        sRed[t, split] = ss
                    else:
                        st_async_f32(sRed.iterator + (t * NS + split), ss, lane, mbar + 1)
        # exchange 2: every peer's partial has landed, so every peer has also finished reading its conv window and
        # its phase B: the write-backs below are safe, and no peer writes into this CTA's smem any more
        cute.arch.mbarrier_wait(mbar + 1, 0)
        cute.arch.barrier()                         # this CTA's own partial (a plain shared store)

        for it in cutlass.range_constexpr(OUT_IT):
            idx = tid + NTH * it
            if idx < T * R:
                t = idx // R
                r = idx % R
                tot = Float32(0.0)
                for p in cutlass.range_constexpr(NS):
                    tot = tot + sRed[t, p]
                rstd = cute.math.rsqrt(tot * Float32(1.0 / D) + Float32(eps))
                col = h * D + split * R + r
                if const_expr(preload):
                    gate = p_gate.to(Float32)          # T = 1: idx = tid < R, so col = 3P + hD + sR + tid
                else:
                    gate = mProj[b * T + t, 3 * P + col].to(Float32)
                yv = onorm * sO[t, r] * rstd * sigmoid(gate)
                if is_pad:
                    yv = Float32(0.0)
                if is_bad:
                    yv = Float32(float("nan"))
                mY[b * T + t, col] = yv.to(BFloat16)

        # the write-backs last, after both exchanges: split 0 shifts the q/k window that every peer reads (the race
        # in the module docstring), and no release on the chain waits for these stores to complete
        write_conv_window(mConvState, valid, split, has_v, slot_w, cq, ck, cv_c, win)
        write_state_rows(mRecState, valid, slot_w, h, row0, lane, rS)

    class KdaConvGateStep:
        @cute.jit
        def __call__(self, mProj, mWfb, mConvW, mALog, mDtBias, mONorm, mConvState, mRecState, mSlots,
                     mY, stream):
            nb = cute.size(mSlots, mode=[0])
            self.kernel(mProj, mWfb, mConvW, mALog, mDtBias, mONorm, mConvState, mRecState, mSlots,
                        mY).launch(grid=[NS, H, nb], block=[NTH, 1, 1], cluster=[NS, 1, 1],
                                   stream=stream, use_pdl=PDL)

        @cute.kernel
        def kernel(self, mProj, mWfb, mConvW, mALog, mDtBias, mONorm, mConvState, mRecState, mSlots, mY):
            tid, _, _ = cute.arch.thread_idx()
            _, h, b = cute.arch.block_idx()
            split = cute.arch.block_idx_in_cluster()          # == blockIdx.x (cluster spans x)
            lane = tid % 32
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            nslots = cute.size(mRecState, mode=[0])

            smem = cutlass.memory.SmemAllocator()
            sUq = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sUk = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sAl = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sUv = smem.allocate_tensor(Float32, cute.make_layout((T, R), stride=(R, 1)), 16)
            sO = smem.allocate_tensor(Float32, cute.make_layout((T, R), stride=(R, 1)), 16)
            sRed = smem.allocate_tensor(Float32, cute.make_layout((T, NS), stride=(NS, 1)), 16)
            sBeta = smem.allocate_tensor(Float32, cute.make_layout((T,), stride=(1,)), 16)
            # one single-use mbarrier per exchange; each expects the bytes its CTA receives from its NS - 1 peers
            # (alpha: (D - R) x T floats, the other CTAs' f channels; the norm: (NS - 1) x T partials). One arrival
            # (thread 0's expect_tx) plus the peers' complete_tx complete phase 0. Initialised before the cluster
            # arrive below, which the peers wait on before their first st.async (fence.mbarrier_init orders the init
            # for them). Every CTA waits for all the bytes sent to it before it ends, so no st.async targets an
            # exited CTA.
            mbar = smem.allocate_array(Int64, 2)
            if tid == 0:
                cute.arch.mbarrier_init(mbar, 1)
                cute.arch.mbarrier_init(mbar + 1, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, (D - R) * T * 4)
                cute.arch.mbarrier_arrive_and_expect_tx(mbar + 1, (NS - 1) * T * 4)

            # DSMEM may only be written once every CTA of the cluster is running: arrive now, wait
            # just before the first remote store (the wait is normally already satisfied).
            cute.arch.cluster_arrive_relaxed()

            # ---------------- before the PDL wait: nothing here is produced by the previous kernel
            is_pad, is_bad, valid, slot_w = _request_slot(mSlots, b, nslots, pad_max)

            # recurrent state rows of this warp: S[slot, h, v, 4*lane : 4*lane+4]
            row0 = split * R + warp * RW
            rS = cute.make_rmem_tensor(cute.make_layout((RW, 4), stride=(4, 1)), Float32)
            rS.fill(0.0)
            if valid:
                for r in cutlass.range_constexpr(RW):
                    g_row = cute.local_tile(mRecState[slot_w, h, row0 + r, None], (4,), (lane,))
                    cute.autovec_copy(g_row, rS[r, None])

            # conv taps: thread tid owns q channel hD+tid, k channel P+hD+tid, and (tid < R) the v
            # channel 2P+hD+sR+tid. win[c, j]: j = 0 oldest (t-3) ... 2 newest (t-1).
            cq = h * D + tid
            ck = P + h * D + tid
            cv = 2 * P + h * D + split * R + tid
            has_v = tid < R
            cv_c = cv
            if not has_v:
                cv_c = 2 * P + h * D + split * R
            win = cute.make_rmem_tensor(cute.make_layout((3, 3), stride=(3, 1)), Float32)
            win.fill(0.0)
            if valid:
                for j in cutlass.range_constexpr(3):
                    win[0, j] = mConvState[slot_w, cq, j].to(Float32)
                    win[1, j] = mConvState[slot_w, ck, j].to(Float32)
                    win[2, j] = mConvState[slot_w, cv_c, j].to(Float32)
            cw = cute.make_rmem_tensor(cute.make_layout((3, 4), stride=(4, 1)), Float32)
            cute.autovec_copy(mConvW[cq, None], cw[0, None])
            cute.autovec_copy(mConvW[ck, None], cw[1, None])
            cute.autovec_copy(mConvW[cv_c, None], cw[2, None])

            # W_fb rows for the f channels [sR, sR+R) of head h; thread: vector jv, rows fr + 8m
            jv = tid % FV
            fr = tid // FV
            rW = cute.make_rmem_tensor(cute.make_layout((FROWS, 8), stride=(8, 1)), BFloat16)
            rDt = cute.make_rmem_tensor(cute.make_layout((FROWS,), stride=(1,)), Float32)
            _load_fb_rows(mWfb, mDtBias, h * D + split * R + fr, NTH // FV, jv, rW, rDt)
            decay_rate = cute.math.exp(mALog[h])
            onorm = mONorm[split * R + tid % R]

            cute.arch.griddepcontrol_wait()
            cute.arch.cluster_wait()
            if const_expr(early_trigger):
                # see the contracts: the dependent (o_proj + AttnRes #2) may start its weight stream now
                cute.arch.griddepcontrol_launch_dependents()

            request_step(mProj, mConvState, mRecState, mY, b, slot_w, valid, is_pad, is_bad, rS, win, cw, rW, rDt,
                         decay_rate, onorm, sUq, sUk, sAl, sUv, sO, sRed, sBeta, tid, lane, warp, split, h, cq, ck,
                         cv_c, has_v, jv, fr, row0, mbar)

            # state writes must be visible before a dependent grid may start its pre-wait loads. Behind the early
            # trigger the dependents were launched before these writes, so a fence would order nothing for them
            # (later kernels see the writes through the grid's completion) and only wait for the stores to drain
            if const_expr(not early_trigger):
                cute.arch.fence_acq_rel_gpu()
                cute.arch.griddepcontrol_launch_dependents()

    return KdaConvGateStep()


# ---------------------------------------------------------------------------- the head build
# The large-batch build (nsplit 1): the state of a (request, head) staged whole in shared memory by bulk copies, and
# everything of the head computed once, in one CTA of HEAD_WARPS warps.

def head_smem_bytes(T: int, head_dim: int = HEAD_DIM) -> int:
    """Shared memory of one head-build CTA: the state, five [T, D] fp32 vectors, the norm partials, beta, the chunks'
    mbarriers (and alignment)."""
    return head_dim * head_dim * 4 + 5 * T * head_dim * 4 + T * 4 * 4 + 16 + 16 + 8 * HEAD_CHUNKS + 128


def head_min_blocks(T: int) -> int:
    """Resident head-build CTAs per SM asked of ptxas (its register cap: 65536 / (blocks x 256 threads)): as many as the
    shared memory holds (228 KB per SM, 1 KB of it reserved per CTA) up to 3 at T = 1 (80 registers, no spills;
    ptxas 12.9) and 2 above (at 80 registers the unrolled T-token phase A spills 180 bytes at T = 4)."""
    return min(3 if T == 1 else 2, (228 * 1024) // (head_smem_bytes(T) + 1024))


def _head_occupancy(T: int) -> dict:
    # the carveout is given explicitly: without it the DSL asks the driver at compile time, which a CPU compile
    # cannot (router_down_topk._occupancy_hint)
    return {"min_blocks_per_mp": head_min_blocks(T), "preferred_smem_carveout": 100}


def _build_head(heads: int, head_dim: int, T: int, lower_bound: float, eps: float, early_trigger: bool = False,
                pad_max: int = -1):
    """The head build (nsplit 1)."""
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int64, const_expr
    from cutlass.experimental.primitives.nvvm_wrapper import (cp_async_bulk_commit_group,
                                                              cp_async_bulk_global_shared_cta,
                                                              cp_async_bulk_shared_cluster_global,
                                                              cp_async_bulk_wait_group)

    H, D = heads, head_dim
    P = H * D
    NTH = 32 * HEAD_WARPS
    RW = D // HEAD_WARPS        # state rows per warp (16)
    FV = D // 8                 # 16-byte vectors per W_fb row
    FSTEP = NTH // FV           # W_fb rows between a thread's rows (16)
    FROWS = D // FSTEP          # W_fb rows per thread (8)
    OUT_IT = (T * D + NTH - 1) // NTH
    QSCALE = float(D) ** -0.5
    # the gated norm's sum of o^2 as nsplit 4 forms it: 4 warp sums over rows [32p, 32p + 32), added in p order, so
    # that y equals the nsplit 4 build's bit for bit (every other value is computed per row / channel as there)
    NPART = 4
    PROWS = D // NPART
    RG = HEAD_ROW_GROUP         # state rows a warp loads before updating them
    CHUNK_ROWS = D // HEAD_CHUNKS
    CHUNK_BYTES = CHUNK_ROWS * D * 4
    WPC = HEAD_WARPS // HEAD_CHUNKS    # warps per chunk (their rows are the chunk's)
    assert D == 128 and NTH == 2 * D and PROWS == 32 and NPART <= HEAD_WARPS and 1 <= T <= MAX_T and RW % RG == 0
    assert HEAD_WARPS % HEAD_CHUNKS == 0 and CHUNK_ROWS == RW * WPC and HEAD_CHUNKS <= 15

    @cute.jit
    def row_vec(t2, row, lane):
        """Lane's 4 keys (16 bytes) of row `row` of a [rows, D] fp32 tensor (shared memory)."""
        return cute.local_tile(t2[row, None], (4,), (lane,))

    class KdaHeadStep:
        @cute.jit
        def __call__(self, mProj, mWfb, mConvW, mALog, mDtBias, mONorm, mConvState, mRecState, mSlots,
                     mY, stream):
            nb = cute.size(mSlots, mode=[0])
            self.kernel(mProj, mWfb, mConvW, mALog, mDtBias, mONorm, mConvState, mRecState, mSlots,
                        mY).launch(grid=[1, H, nb], block=[NTH, 1, 1], stream=stream, use_pdl=PDL,
                                   **_head_occupancy(T))

        @cute.kernel
        def kernel(self, mProj, mWfb, mConvW, mALog, mDtBias, mONorm, mConvState, mRecState, mSlots, mY):
            tid, _, _ = cute.arch.thread_idx()
            _, h, b = cute.arch.block_idx()
            lane = tid % 32
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            nslots = cute.size(mRecState, mode=[0])

            smem = cutlass.memory.SmemAllocator()
            sS = smem.allocate_tensor(Float32, cute.make_layout((D, D), stride=(D, 1)), 128)
            sUq = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sUk = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sUv = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sAl = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sO = smem.allocate_tensor(Float32, cute.make_layout((T, D), stride=(D, 1)), 16)
            sRed = smem.allocate_tensor(Float32, cute.make_layout((T, NPART), stride=(NPART, 1)), 16)
            sBeta = smem.allocate_tensor(Float32, cute.make_layout((T,), stride=(1,)), 16)
            mbar = smem.allocate_array(Int64, HEAD_CHUNKS)

            # ---------------- before the PDL wait: nothing here is produced by the previous kernel
            is_pad, is_bad, valid, slot_w = _request_slot(mSlots, b, nslots, pad_max)

            # conv channels: threads [0, D) own the q channel hD + tid and the k channel P + hD + tid, threads
            # [D, 2D) the v channel 2P + hD + tid - D. win[c, j]: j = 0 oldest (t-3) ... 2 newest (t-1).
            is_qk = tid < D
            c0 = 2 * P + h * D + tid - D
            if is_qk:
                c0 = h * D + tid
            c1 = P + h * D + tid % D
            win = cute.make_rmem_tensor(cute.make_layout((2, 3), stride=(3, 1)), Float32)
            win.fill(0.0)
            if valid:
                for j in cutlass.range_constexpr(3):
                    win[0, j] = mConvState[slot_w, c0, j].to(Float32)
                    if is_qk:
                        win[1, j] = mConvState[slot_w, c1, j].to(Float32)
            cw = cute.make_rmem_tensor(cute.make_layout((2, 4), stride=(4, 1)), Float32)
            cute.autovec_copy(mConvW[c0, None], cw[0, None])
            cute.autovec_copy(mConvW[c1, None], cw[1, None])

            # W_fb rows fr + FSTEP m of head h (every channel of the head), 16-byte vector jv of each
            jv = tid % FV
            fr = tid // FV
            rW = cute.make_rmem_tensor(cute.make_layout((FROWS, 8), stride=(8, 1)), BFloat16)
            rDt = cute.make_rmem_tensor(cute.make_layout((FROWS,), stride=(1,)), Float32)
            _load_fb_rows(mWfb, mDtBias, h * D + fr, FSTEP, jv, rW, rDt)
            decay_rate = cute.math.exp(mALog[h])
            onorm = mONorm[tid % D]         # output element idx = tid + NTH it has row idx % D = tid % D

            # the head's 64 KB of state: HEAD_CHUNKS bulk copies of CHUNK_ROWS rows, each on its own mbarrier, so
            # that the warps of chunk c start as soon as it lands. They are issued after the PDL wait and the first
            # token's projection loads (phase A below): the conv windows, W_fb rows and projections are what phase A
            # waits for, and behind 25 MB of bulk traffic (rank16 b64) they came back only with the last of it
            # (Nsight Compute: 34 % of the stall samples there when the copies led)
            if tid == 0:
                for c in cutlass.range_constexpr(HEAD_CHUNKS):
                    cute.arch.mbarrier_init(mbar + c, 1)
                cute.arch.mbarrier_init_fence()
            if not valid:
                # a padded or bad request runs on a zero state, as the nsplit 4 / 8 builds do (its y rows are then
                # replaced by zeros / NaN; nothing is written back)
                for i in cutlass.range_constexpr(D * D // (4 * NTH)):
                    z4 = row_vec(sS, (tid + NTH * i) // 32, (tid + NTH * i) % 32)
                    z4.fill(0.0)

            cute.arch.griddepcontrol_wait()
            if const_expr(early_trigger):
                cute.arch.griddepcontrol_launch_dependents()

            # ---------------- phase A: conv, beta, f -> alpha for all T tokens (state-independent)
            rFa = cute.make_rmem_tensor(cute.make_layout((8,), stride=(1,)), BFloat16)
            p_gate = Float32(0.0)
            if const_expr(T == 1):
                p_gate = mProj[b, 3 * P + h * D + tid % D].to(Float32)     # loaded with the rest of the row
            for t in cutlass.range_constexpr(T):
                row = b * T + t
                x0 = mProj[row, c0].to(Float32)
                x1 = mProj[row, c1].to(Float32)
                cute.autovec_copy(cute.local_tile(mProj[row, None], (8,), (4 * P // 8 + jv,)), rFa)
                if const_expr(t == 0):
                    # the first token's projections are requested before the state's 64 KB, so that phase A's
                    # inputs do not queue behind 25 MB of bulk copies (rank16 b64); the CTA barrier makes every
                    # warp's requests precede thread 0's copies
                    cute.arch.barrier()
                    if tid == 0:
                        if valid:
                            self.load_state(mRecState, sS, mbar, slot_w, h)
                u0 = _conv_step(cw, win, 0, x0)
                u1 = _conv_step(cw, win, 1, x1)
                if is_qk:
                    sUq[t, tid] = u0 * sigmoid(u0)
                    sUk[t, tid] = u1 * sigmoid(u1)
                else:
                    sUv[t, tid - D] = u0 * sigmoid(u0)
                if tid == 0:
                    sBeta[t] = sigmoid(mProj[row, 4 * P + D + h].to(Float32))
                # f[i] = bf16(sum_j f_a[j] W_fb[hD+i, j]); 16 lanes (one W_fb row) per reduction, as in nsplit 4 / 8
                fa = rFa.load().to(Float32)
                for m in cutlass.range_constexpr(FROWS):
                    alpha = _decay_alpha(fa, rW[m, None], rDt[m], decay_rate, lower_bound, FV)
                    if jv == 0:
                        sAl[t, fr + FSTEP * m] = alpha
            cute.arch.barrier()
            chunk = warp // WPC             # the chunk of this warp's rows
            if valid:
                cute.arch.mbarrier_wait(mbar + chunk, 0)

            # ---------------- phase B: T sequential delta-rule steps on the rows in shared memory
            rK = cute.make_rmem_tensor(cute.make_layout((4,), stride=(1,)), Float32)
            rQ = cute.make_rmem_tensor(cute.make_layout((4,), stride=(1,)), Float32)
            rA = cute.make_rmem_tensor(cute.make_layout((4,), stride=(1,)), Float32)
            rS = cute.make_rmem_tensor(cute.make_layout((RG, 4), stride=(4, 1)), Float32)
            for t in cutlass.range(T, unroll=1):
                cute.autovec_copy(row_vec(sUk, t, lane), rK)
                cute.autovec_copy(row_vec(sUq, t, lane), rQ)
                cute.autovec_copy(row_vec(sAl, t, lane), rA)
                beta = sBeta[t]
                kk = rK.load()
                qq = rQ.load()
                al = rA.load()
                ksq = cute.arch.warp_reduction_sum((kk * kk).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                qsq = cute.arch.warp_reduction_sum((qq * qq).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                kn = kk * cute.math.rsqrt(ksq + Float32(1e-6))
                qn = qq * (cute.math.rsqrt(qsq + Float32(1e-6)) * Float32(QSCALE))
                # RG rows at a time (load RG, update each, store RG): the rows are independent, so RG > 1 gives the
                # scheduler RG reduction chains to interleave; RG = 1 holds one row (4 registers) at a time
                for g in cutlass.range_constexpr(RW // RG):
                    for r in cutlass.range_constexpr(RG):
                        cute.autovec_copy(row_vec(sS, warp * RW + g * RG + r, lane), rS[r, None])
                    for r in cutlass.range_constexpr(RG):
                        row = warp * RW + g * RG + r
                        s = rS[r, None].load() * al
                        sk = cute.arch.warp_reduction_sum((s * kn).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                        e = sUv[t, row] - sk
                        s = s + kn * (beta * e)
                        rS[r, None].store(s)
                        o = cute.arch.warp_reduction_sum((s * qn).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                        if lane == 0:
                            sO[t, row] = o
                    for r in cutlass.range_constexpr(RG):
                        cute.autovec_copy(rS[r, None], row_vec(sS, warp * RW + g * RG + r, lane))

            # a chunk leaves as soon as its WPC warps are done with it: their generic-proxy writes to shared memory
            # are made visible to the bulk-copy (async) proxy, a named barrier of those warps, then the chunk's
            # first lane hands the rows to the bulk engine
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=1 + chunk, number_of_threads=32 * WPC)
            is_storer = (warp % WPC == 0) & (lane == 0)
            if is_storer:
                if valid:
                    cp_async_bulk_global_shared_cta(mRecState[slot_w, h, chunk * CHUNK_ROWS, None].iterator,
                                                    sS[chunk * CHUNK_ROWS, None].iterator, CHUNK_BYTES)
                    cp_async_bulk_commit_group()
            cute.arch.barrier()             # sO complete for the norm

            # ---------------- phase C: gated RMSNorm over the head's 128 rows
            for i in cutlass.range_constexpr(T * NPART):
                if warp == i % HEAD_WARPS:
                    ov = sO[i // NPART, (i % NPART) * PROWS + lane]
                    ss = cute.arch.warp_reduction_sum(ov * ov)
                    if lane == 0:
                        sRed[i // NPART, i % NPART] = ss
            cute.arch.barrier()
            for it in cutlass.range_constexpr(OUT_IT):
                idx = tid + NTH * it
                if idx < T * D:
                    t = idx // D
                    r = idx % D
                    tot = Float32(0.0)
                    for p in cutlass.range_constexpr(NPART):
                        tot = tot + sRed[t, p]
                    rstd = cute.math.rsqrt(tot * Float32(1.0 / D) + Float32(eps))
                    gate = p_gate
                    if const_expr(T > 1):
                        gate = mProj[b * T + t, 3 * P + h * D + r].to(Float32)
                    yv = onorm * sO[t, r] * rstd * sigmoid(gate)
                    if is_pad:
                        yv = Float32(0.0)
                    if is_bad:
                        yv = Float32(float("nan"))
                    mY[b * T + t, h * D + r] = yv.to(BFloat16)

            if valid:
                for j in cutlass.range_constexpr(3):
                    mConvState[slot_w, c0, j] = win[0, j].to(BFloat16)
                    if is_qk:
                        mConvState[slot_w, c1, j] = win[1, j].to(BFloat16)
            if is_storer:
                if valid:
                    if const_expr(early_trigger):
                        # the shared rows must outlive the bulk engine's reads of them; the dependents already run,
                        # and later kernels see the writes through this grid's completion
                        cp_async_bulk_wait_group(0, read=True)
                    else:
                        # a dependent launched at the end may read the state before its wait (a second KDA step):
                        # the writes must be complete and ordered before the trigger
                        cp_async_bulk_wait_group(0)
            if const_expr(not early_trigger):
                cute.arch.fence_acq_rel_gpu()
                cute.arch.barrier()
                cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def load_state(self, mRecState, sS, mbar, slot_w, h):
            """The head's 64 KB of state into shared memory: HEAD_CHUNKS bulk copies, each completing on its own
            mbarrier."""
            for c in cutlass.range_constexpr(HEAD_CHUNKS):
                cute.arch.mbarrier_arrive_and_expect_tx(mbar + c, CHUNK_BYTES)
                cp_async_bulk_shared_cluster_global(sS[c * CHUNK_ROWS, None].iterator,
                                                    mRecState[slot_w, h, c * CHUNK_ROWS, None].iterator,
                                                    mbar + c, CHUNK_BYTES)

    return KdaHeadStep()


def _compile(key):
    _, heads, head_dim, T, nsplit, lower_bound, eps = key[:7]
    early = "early_trigger" in key[7:]
    pad_max = 0 if "null_slot" in key[7:] else -1
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32

    P = heads * head_dim
    M = cute.sym_int()          # B*T rows
    B = cute.sym_int()          # requests
    S = cute.sym_int()          # state slots
    if nsplit == 1:
        obj = _build_head(heads, head_dim, T, lower_bound, eps, early_trigger=early, pad_max=pad_max)
    else:
        obj = _build(heads, head_dim, T, nsplit, lower_bound, eps, early_trigger=early, pad_max=pad_max)
    fakes = (
        fake_tensor(BFloat16, (M, proj_width(heads, head_dim))),
        fake_tensor(BFloat16, (P, head_dim)),
        fake_tensor(Float32, (3 * P, 4)),
        fake_tensor(Float32, (heads,), align=4),
        fake_tensor(Float32, (P,)),
        fake_tensor(Float32, (head_dim,)),
        # the slot stride is a runtime value: vLLM's state pools are page-strided views (a slot's conv and
        # recurrent state share one page), our own pools are compact; 16-byte rows keep the bulk state copies legal
        cute.runtime.make_fake_tensor(BFloat16, (S, 3 * P, 3), (cute.sym_int(64), 3, 1), assumed_align=2),
        cute.runtime.make_fake_tensor(Float32, (S, heads, head_dim, head_dim),
                                      (cute.sym_int(64, divisibility=4), head_dim * head_dim, head_dim, 1),
                                      assumed_align=16),
        fake_tensor(Int32, (B,), align=4),
        fake_tensor(BFloat16, (M, P)),
    )
    return cute.compile(obj, *fakes, fake_stream(), options=TVM_FFI)


def _get_compiled(key):
    return compile_cached(key, lambda: _compile(key))


# ---------------------------------------------------------------------------- host entry point

def kda_conv_gate_step(proj, w_fb, conv_w, a_log, dt_bias, o_norm, conv_state, rec_state, slots, *, heads,
                       head_dim=128, T=1, lower_bound=-5.0, eps=1e-5, out=None, early_trigger=False,
                       null_slot=False, check_slots=True):
    """One fused KDA decode step (T tokens per request). Updates conv_state and rec_state in place
    for the valid slots and returns y [B*T, H*D] bf16 (written into ``out`` when given). The build is
    choose_nsplit's for B requests and H heads. See the module docstring for the contracts.

    proj [B*T, proj_width(H)] bf16 (the packed in_proj output), w_fb [P, 128] bf16, conv_w [3P, 4] fp32,
    a_log [H] fp32, dt_bias [P] fp32, o_norm [128] fp32, conv_state [S, 3P, 3] bf16, rec_state [S, H, 128, 128]
    fp32, slots [B] int32 (negative: padding; with null_slot also 0, vLLM's NULL_BLOCK_ID). The states may be
    slot-strided views (each slot's rows compact), as vLLM's state pools are.

    early_trigger: launch the PDL dependents right after the wait instead of at the end (the layer's
    configuration). Only for a dependent that reads no KDA state before its own wait (o_proj in the layer chain),
    never for a second KDA step launched directly behind this one.

    check_slots: outside a CUDA-graph capture, read the slots to the host first and refuse an index past the pool
    or a slot two requests share (one small copy and a host sync). Inside a capture, and with False, the kernel's
    own guard is what holds (no state touched, NaN rows for a slot past the pool; shared slots undefined)."""
    return _kda_step(proj, w_fb, conv_w, a_log, dt_bias, o_norm, conv_state, rec_state, slots, heads=heads,
                     head_dim=head_dim, T=T, lower_bound=lower_bound, eps=eps, out=out, early_trigger=early_trigger,
                     null_slot=null_slot, check_slots=check_slots)


def check_state_pools(conv_state, rec_state, *, heads: int, head_dim: int = HEAD_DIM) -> None:
    """The KDA state pools' contract: conv_state [S, 3P, 3] bf16 and rec_state [S, H, D, D] fp32 on one device,
    each slot's rows compact; the slots themselves may sit a page apart (vLLM's state pools)."""
    import torch
    D, P = head_dim, heads * head_dim
    check_tensor("conv_state", conv_state, dtype=torch.bfloat16, shape=(None, 3 * P, 3), align=2, contiguous=False)
    check_tensor("rec_state", rec_state, dtype=torch.float32, shape=(None, heads, D, D), contiguous=False,
                 device=conv_state.device)
    if conv_state.stride()[1:] != (3, 1):
        raise ValueError(f"conv_state: expected each slot compact [3P, 3] (strides (*, 3, 1)), got "
                         f"{conv_state.stride()}")
    if rec_state.stride()[1:] != (D * D, D, 1) or rec_state.stride(0) % 4:
        raise ValueError(f"rec_state: expected each slot compact [H, {D}, {D}] with a slot stride divisible by 4 "
                         f"(16-byte rows), got strides {rec_state.stride()}")
    if conv_state.shape[0] != rec_state.shape[0]:
        raise ValueError(f"conv_state and rec_state must have the same number of slots, got "
                         f"{conv_state.shape[0]} and {rec_state.shape[0]}")


def check_slot_indices(slots, n_slots: int, *, null_slot: bool = False) -> None:
    """Refuse slot indices the kernel would only guard against: an index >= n_slots (the state pool's size) or a
    valid slot listed twice. Negative indices (and 0 with null_slot) are padding and always allowed. Syncs with
    the host; never call it inside a CUDA-graph capture."""
    import torch
    check_tensor("slots", slots, dtype=torch.int32, align=4)
    if slots.dim() != 1:
        raise ValueError(f"slots: expected shape [B], got {list(slots.shape)}")
    pad_max = 0 if null_slot else -1
    seen: dict[int, int] = {}
    for i, s in enumerate(slots.tolist()):
        if s >= n_slots:
            raise ValueError(f"slots: request {i} has slot {s}, past the state pool's {n_slots} slots "
                             f"(expected < {n_slots}, or {pad_max} and below for padding)")
        if s > pad_max:
            if s in seen:
                raise ValueError(f"slots: requests {seen[s]} and {i} share slot {s} (each request needs its own)")
            seen[s] = i


def _kda_step(proj, w_fb, conv_w, a_log, dt_bias, o_norm, conv_state, rec_state, slots, *, heads, head_dim=128, T=1,
              lower_bound=-5.0, eps=1e-5, out=None, early_trigger=False, nsplit=None, null_slot=False,
              check_slots=True):
    """kda_conv_gate_step with the build forced (nsplit in NSPLITS; None: choose_nsplit). The tests run each build
    at small sizes this way and compare the head build with nsplit 4 bit for bit."""
    import torch

    if head_dim != HEAD_DIM:
        raise ValueError(f"head_dim must be {HEAD_DIM}, got {head_dim}")
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    if not isinstance(T, int) or not (1 <= T <= MAX_T):
        raise ValueError(f"T must be an int in 1..{MAX_T}, got {T!r}")
    if not (-5.0 <= lower_bound < 0.0):
        raise ValueError(f"lower_bound must lie in [-5, 0), got {lower_bound}")
    D, H = head_dim, heads
    P = H * D
    # dtypes and shapes first (these run on CPU too), then one device for everything
    check_tensor("slots", slots, dtype=torch.int32, align=4)
    if slots.dim() != 1:
        raise ValueError(f"slots: expected shape [B], got {list(slots.shape)}")
    B = slots.shape[0]
    ns = choose_nsplit(B, H) if nsplit is None else int(nsplit)
    if ns not in NSPLITS:
        raise ValueError(f"nsplit must be one of {NSPLITS} (1: one CTA per request and head), got {nsplit}")
    key = compile_key(H, T, ns, lower_bound, eps, D, early_trigger=early_trigger, null_slot=bool(null_slot))
    check_tensor("proj", proj, dtype=torch.bfloat16, shape=(B * T, proj_width(H, D)))
    check_tensor("w_fb", w_fb, dtype=torch.bfloat16, shape=(P, D))
    check_tensor("conv_w", conv_w, dtype=torch.float32, shape=(3 * P, 4))
    check_tensor("a_log", a_log, dtype=torch.float32, shape=(H,), align=4)
    check_tensor("dt_bias", dt_bias, dtype=torch.float32, shape=(P,))
    check_tensor("o_norm", o_norm, dtype=torch.float32, shape=(D,))
    check_state_pools(conv_state, rec_state, heads=H, head_dim=D)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(B * T, P))
    dev = slots.device
    if dev.type != "cuda":
        raise ValueError(f"kda_conv_gate_step needs CUDA tensors, got slots on {dev}")
    for name, t in (("proj", proj), ("w_fb", w_fb), ("conv_w", conv_w), ("a_log", a_log), ("dt_bias", dt_bias),
                    ("o_norm", o_norm), ("conv_state", conv_state), ("rec_state", rec_state), ("out", out)):
        if t is not None and t.device != dev:
            raise ValueError(f"{name}: expected device {dev} (the device of slots), got {t.device}")
    if check_slots and not torch.cuda.is_current_stream_capturing():
        check_slot_indices(slots, rec_state.shape[0], null_slot=null_slot)
    if out is None:
        out = torch.empty((B * T, P), dtype=torch.bfloat16, device=dev)
    if B == 0:
        return out
    _get_compiled(key)(proj, w_fb, conv_w, a_log, dt_bias, o_norm, conv_state, rec_state, slots, out)
    return out
