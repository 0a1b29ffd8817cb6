"""The MoE front of a Kimi K3 decode step: router logits, top-16 routing, latent down-projection and the shared
experts' gate/up + SiTU, from one pass over the MLP input x.

What it replaces (docs/k3-layer.md sections 10, 11 and 12):
  l   = x W_r^T                (fp32; bf16 products, fp32 accumulate, never rounded)        section 10.1
  s   = sigmoid(l)             (fp32)                                                        section 10.2
  T   = top-16(s + e_bias)     (ties: the LOWER expert index wins; output order = descending
                                biased score, ties by ascending index)                       section 10.3
  w_e = s_e / (sum_T s + 1e-20) * routed_scaling_factor                                      section 10.4
  z   = bf16(x W_down^T)       (latent down-projection, plain Linear)                       section 11
  h   = bf16(SiTU-GLU(bf16(x W_sg^T), bf16(x W_su^T)))   (the shared experts' gate/up)       section 12
All four read the same x, so their weights are packed once, router rows first, into
W = [W_r; W_down; W_sg; W_su] ([896 + 3584 + 2 Is, 7168] bf16, ``prepare_front_shared_weight``).

Two ways to run it, with the same contract and the same top-k code (so the same tie order):
  * ``router_down_topk`` (M <= 4, ``kernel_path(M) == "fma"``): ONE fused launch. A warp streams one packed
    weight row with 16-byte loads and FMAs it against the M tokens of x. Router CTAs come first in the grid and
    count their arrival on a device counter; the last one runs the top-16 of the tokens from the fp32 logits
    workspace while the latent and shared rows still stream. The shared CTAs meet their gate/up pairs in shared
    memory and write h.
  * ``router_down_topk_cublas`` (M > 4): one cuBLAS GEMM with fp32 output over the same packed W, then
    ``TopkFromLogits`` (one CTA per token): the top-16 split over the CTA's 4 warps, z = bf16(y), and h.
docs/kernels/router_down_topk.md has the design, the figures behind the M = 4 threshold and the version table.

Contracts of the fused kernel
  * The top-k needs all 896 logits of a token, which are spread over 224 router CTAs. Each router CTA writes
    its logits to an fp32 workspace, fences, then does an acq_rel atomic add on a device counter. The CTA whose
    add returns R-1 (the last arriver) resets the counter to 0 (so CUDA-graph replays and the next layer start
    clean) and bumps an epoch word with a release store; the T-1 arrivers just before it would spin (acquire) on
    the epoch. T = ceil(M / 4) top-k CTAs of 4 tokens each (one warp per token), so at M <= 4 the last arriver
    alone runs the top-k and nothing spins.
  * All counter/workspace accesses come after griddepcontrol_wait, so a PDL-overlapped next launch of this
    kernel (the next layer) cannot see a half-reset counter.
  * The workspace and counter are per device and shared by all calls: at most ONE call may be in flight per
    device at a time (the decode step is one stream). Pass ``workspace=`` to use a private one.
  * Router CTAs are the lowest block indices, so they are scheduled first and the top-k overlaps the
    down-projection and shared rows streaming in the remaining CTAs.
"""


import math

from k3fast.kernels._dsl import (PDL, TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, import_cute,
                                 sigmoid, situ_glu, weight_load_atom)

HIDDEN = 7168
N_EXPERTS = 896
LATENT = 3584
TOP_K = 16
M_BUCKETS = (1, 2, 4)   # the fused kernel's compile-time token buckets (M itself is a run-time dim)
M_MAX = 4               # the largest batch of the fused kernel; above it the cuBLAS front serves
WS_ROWS = 64            # rows of the logits workspace (the kernel's static workspace shape; >= M_MAX)
WARPS = 4               # warps per CTA = rows per CTA = tokens per top-k CTA
PRE = 4                 # 16-byte weight vectors per lane issued before griddepcontrol_wait
UNROLL = 4              # 16-byte weight vectors per lane in flight in the main loop

_WORKSPACES: dict = {}


def bucket_m(m: int) -> int:
    """The fused kernel's token bucket for batch m (1 <= m <= M_MAX)."""
    for b in M_BUCKETS:
        if 1 <= m <= b:
            return b
    raise ValueError(f"router_down_topk supports 1 <= M <= {M_MAX}, got M={m}")


def kernel_path(m: int) -> str:
    """"fma" (the fused warp-per-row kernel, 1 <= m <= M_MAX) or "cublas" (router_down_topk_cublas) for batch m."""
    if m < 1:
        raise ValueError(f"batch M must be at least 1, got M={m}")
    return "fma" if m <= M_MAX else "cublas"


def compile_keys(shared: int, batches=(1, 2, 3, 4, 7, 8, 16, 64), *, fused: bool = True, n_experts=N_EXPERTS,
                 latent=LATENT, hidden=HIDDEN, top_k=TOP_K) -> list[tuple]:
    """Every compile key that running the batches in ``batches`` needs, with shared experts of width ``shared``:
    the fused kernel's bucket where ``kernel_path`` says "fma" (and ``fused``), TopkFromLogits elsewhere (its key
    does not depend on M). ``fused=False``: the cuBLAS front at every batch."""
    _check_shared(shared)
    keys = set()
    for b in batches:
        if fused and kernel_path(b) == "fma":
            keys.add(_front_key(bucket_m(b), shared, n_experts, latent, hidden, top_k))
        else:
            keys.add(_topk_key(shared, n_experts, latent, top_k))
    return sorted(keys)


def _front_key(mb, shared, n_experts, latent, hidden, top_k):
    return ("router_down_topk", mb, n_experts, latent, hidden, top_k, shared)


def _topk_key(shared, n_experts, latent, top_k):
    return ("router_topk_from_logits", n_experts, latent, top_k, shared)


def warmup(shared: int, batches=(1, 2, 3, 4, 7, 8, 16, 64), *, fused: bool = True, n_experts=N_EXPERTS,
           latent=LATENT, hidden=HIDDEN, top_k=TOP_K, device=None) -> list[tuple]:
    """Compile every kernel ``compile_keys`` lists (and allocate the device workspace when ``device`` is given)."""
    keys = compile_keys(shared, batches, fused=fused, n_experts=n_experts, latent=latent, hidden=hidden,
                        top_k=top_k)
    for key in keys:
        if key[0] == "router_down_topk":
            get_kernel(key[1], shared, n_experts, latent, hidden, top_k)
        else:
            get_topk_kernel(shared, n_experts, latent, top_k)
    if device is not None:
        get_workspace(device, n_experts)
    return keys


def _check_shapes(n_experts, latent, hidden, top_k):
    if n_experts % (32 * WARPS):
        raise ValueError(f"n_experts must be a multiple of {32 * WARPS}, got {n_experts}")
    if not (1 <= top_k <= 32 and top_k <= n_experts):
        raise ValueError(f"top_k must lie in [1, min(32, n_experts)], got {top_k}")
    if latent % WARPS:
        raise ValueError(f"latent width must be a multiple of {WARPS}, got {latent}")
    if hidden % (8 * 32 * UNROLL) or hidden // 256 < PRE:
        raise ValueError(f"hidden size must be a multiple of {8 * 32 * UNROLL}, got {hidden}")


def _check_shared(shared):
    if not isinstance(shared, int) or isinstance(shared, bool) or shared <= 0 or shared % 4:
        raise ValueError(f"shared (the shared experts' intermediate width Is) must be a positive multiple of 4, "
                         f"got {shared!r}")


def _build(mb: int, n_experts: int, latent: int, hidden: int, top_k: int, shared: int):
    """Trace and compile the fused kernel for token bucket ``mb`` (1, 2, 4), or TopkFromLogits (mb = 0)."""
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32, Uint32, const_expr

    NE, NL, K, TOPK, IS = n_experts, latent, hidden, top_k, shared
    N = NE + NL
    KV = K // 8                      # 16-byte vectors per row
    ITERS = KV // 32                 # per lane
    J = NE // 32                     # logits per lane in the one-warp top-k
    R = NE // WARPS                  # router CTAs
    T = (max(mb, 1) + WARPS - 1) // WARPS    # top-k CTAs (the last T router arrivers)
    U = UNROLL
    S0 = N // WARPS                  # fused kernel: the first shared gate/up CTA
    NZ = -(-(NL // 4) // (32 * WARPS))   # TopkFromLogits: z vectors per thread
    assert (ITERS - PRE) % U == 0, f"unroll {U} must divide the {ITERS - PRE} vectors per lane after the prologue"
    assert T <= R and IS % 4 == 0 and NE % (32 * WARPS) == 0

    def orderable(v):
        # fp32 -> u32 whose unsigned order is the float order (-0 never occurs: s > 0 or s = +0, and x + -x = +0)
        u = v.bitcast(Uint32)
        neg = Uint32(0) - (u >> Uint32(31))
        return u ^ (neg | Uint32(0x80000000))

    def usel(c, a, b):
        return Uint32(cutlass.select_(c, a, b))

    def fsel(c, a, b):
        return Float32(cutlass.select_(c, a, b))

    def local_best(keys):
        # this lane's best (largest key, lowest slot on ties): a tree whose left operand is always the lower
        # slot, so ">" keeps the lower expert index on equal keys. Plain Python: unrolled at trace time.
        cur = [(keys[j], Uint32(j)) for j in range(len(keys))]
        while len(cur) > 1:
            nxt = []
            for p in range(0, len(cur) - 1, 2):
                (ka, ja), (kb, jb) = cur[p], cur[p + 1]
                take_b = kb > ka
                nxt.append((usel(take_b, kb, ka), usel(take_b, jb, ja)))
            if len(cur) % 2:
                nxt.append(cur[-1])
            cur = nxt
        return cur[0]

    def remove(keys, gidx, first):
        # the owner lane of expert gidx drops its key (0 is below every real key); the lane's key j belongs to
        # expert first + 32 j
        for j in range(len(keys)):
            keys[j] = usel(gidx == first + Uint32(32 * j), Uint32(0), keys[j])

    def warp_best(bk, expert):
        """(largest key of the warp, the lowest expert index among the lanes holding it), from each lane's best key
        and its expert."""
        gmax = cute.arch.warp_redux_sync(bk, "umax")
        return gmax, cute.arch.warp_redux_sync(usel(bk == gmax, expert, Uint32(0xFFFFFFFF)), "umin")

    def biased_keys(mWs, mBias, row, first, n, sS, col):
        """The n keys orderable(s + e_bias) of this lane's experts first + 32 j, from the fp32 logits at mWs[row + e];
        s = sigmoid(logit) goes to sS[e, col]. Every logit and bias is loaded before the first sigmoid: each IEEE
        division carries a slow-path branch, and ptxas does not hoist a load above a branch, so loads interleaved
        with the sigmoids would run one L2 round trip at a time (a CPU test checks the order in the PTX)."""
        lgs = [cute.arch.load(mWs.iterator + (row + first + 32 * j), Float32, cop="cg") for j in range(n)]
        bs = [mBias[first + 32 * j] for j in range(n)]
        keys = []
        for j in range(n):
            s = sigmoid(lgs[j])
            sS[first + 32 * j, col] = s
            keys.append(orderable(s + bs[j]))
        return keys

    def select_round(keys, r, lane, lane_u, sS, warp, my_id, my_s):
        """One of the top-k's TOPK rounds: the warp's best remaining key (largest; the lowest expert index among
        equal keys), removed from its owner lane's keys (in place); lane r keeps its expert id and unbiased score."""
        bk, bj = local_best(keys)
        _, gidx = warp_best(bk, lane_u + Uint32(32) * bj)
        remove(keys, gidx, lane_u)
        s_sel = sS[Int32(gidx), warp]          # written by the owner lane of this warp
        mine = lane == r
        return usel(mine, gidx, my_id), fsel(mine, s_sel, my_s)

    @cute.jit
    def write_weights(tok, lane, my_id, my_s, mIds, mWt, scaling: Float32):
        # lane r < TOPK holds the r-th expert and its unbiased score; 1e-20 and the scaling exactly as HF's gate
        # (k3-layer.md 10.4)
        part = fsel(lane < TOPK, my_s, Float32(0.0))
        tot = cute.arch.warp_reduction_sum(part)
        if lane < TOPK:
            mIds[tok, lane] = Int32(my_id)
            mWt[tok, lane] = my_s / (tot + Float32(1e-20)) * scaling

    class FrontFma:
        """The fused front (M <= 4): warp = one packed weight row, CTA = 4 rows; rows [0, NE) router, [NE, N)
        latent, then IS / 2 CTAs of shared gate/up pairs."""
        n_arrive, n_topk, per_cta = R, T, WARPS      # router CTAs, top-k CTAs, tokens per top-k CTA
        ws_stride = NE                               # fp32 elements between two tokens' logits in mWs

        @cute.jit
        def __call__(self, mX, mW, mBias, mZ, mIds, mWt, mWs, mCnt, mH, scaling: Float32, stream):
            w_atom = weight_load_atom(BFloat16)
            self.kernel(mX, mW, mBias, mZ, mIds, mWt, mWs, mCnt, mH, scaling, w_atom).launch(
                grid=[(N + 2 * IS) // WARPS, 1, 1], block=[32 * WARPS, 1, 1], stream=stream, use_pdl=PDL)

        @cute.kernel
        def kernel(self, mX, mW, mBias, mZ, mIds, mWt, mWs, mCnt, mH, scaling: Float32, w_atom: cute.CopyAtom):
            tid = cute.arch.thread_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bid = cute.arch.block_idx()[0]
            n = bid * WARPS + warp
            if const_expr(IS > 0):
                # shared CTA c computes h columns 2c and 2c + 1: its warps 2p and 2p + 1 take the gate and the up
                # row of column 2c + p, so the SiTU pairs meet in this CTA's shared memory
                n = Int32(cutlass.select_(bid >= S0, N + (warp % 2) * IS + 2 * (bid - S0) + warp // 2, n))
            M = cute.size(mX, mode=[0])

            smem = cutlass.memory.SmemAllocator()
            sArr = smem.allocate_tensor(Int32, cute.make_layout((2,)), 16)
            # sigmoid scores of the top-k CTA's tokens (keeps 28 fp32 per lane out of the register file)
            sS = smem.allocate_tensor(Float32, cute.make_layout((NE, WARPS)), 16)
            if const_expr(IS > 0):
                sG = smem.allocate_tensor(Float32, cute.make_layout((WARPS, mb), stride=(mb, 1)), 16)

            gW = cute.flat_divide(mW, (1, 8))           # (1, 8, N, KV)
            gX = cute.flat_divide(mX, (1, 8))           # (1, 8, M, KV)
            rW = cute.make_rmem_tensor(cute.make_layout((PRE, 8), stride=(8, 1)), BFloat16)
            rV = cute.make_rmem_tensor(cute.make_layout((U, 8), stride=(8, 1)), BFloat16)
            rX = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
            acc = cute.make_rmem_tensor(cute.make_layout((mb,)), Float32)
            acc.fill(0.0)

            # Weights do not depend on the previous kernel: start streaming them before the PDL wait.
            for i in cutlass.range_constexpr(PRE):
                cute.copy(w_atom, gW[0, None, n, lane + 32 * i], rW[i, None])
            cute.arch.griddepcontrol_wait()

            for i in cutlass.range_constexpr(PRE):
                w = rW[i, None].load().to(Float32)
                for m in cutlass.range(mb, unroll_full=True):
                    # rows m >= M read the last valid row (never stored): no branch, no out-of-bounds load
                    mm = cutlass.min(Int32(m), M - 1)
                    cute.autovec_copy(gX[0, None, mm, lane + 32 * i], rX)
                    acc[m] += (rX.load().to(Float32) * w).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            for it in cutlass.range(0, (ITERS - PRE) // U, 1):
                for u in cutlass.range_constexpr(U):
                    cute.copy(w_atom, gW[0, None, n, lane + 32 * (PRE + it * U + u)], rV[u, None])
                for u in cutlass.range_constexpr(U):
                    w = rV[u, None].load().to(Float32)
                    for m in cutlass.range(mb, unroll_full=True):
                        mm = cutlass.min(Int32(m), M - 1)
                        cute.autovec_copy(gX[0, None, mm, lane + 32 * (PRE + it * U + u)], rX)
                        acc[m] += (rX.load().to(Float32) * w).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)

            is_router = bid < R
            for m in cutlass.range(mb, unroll_full=True):
                tot = cute.arch.warp_reduction_sum(acc[m])
                if lane == 0:
                    if Int32(m) < M:
                        if is_router:
                            mWs[m, n] = tot
                        else:
                            if const_expr(IS > 0):
                                if bid >= S0:
                                    sG[warp, m] = tot
                                else:
                                    mZ[m, n - NE] = tot.to(BFloat16)
                            else:
                                mZ[m, n - NE] = tot.to(BFloat16)

            if is_router:
                self.arrive_then_topk(tid, warp, lane, M, mCnt, sArr, mBias, mIds, mWt, mWs, sS, scaling)
            if const_expr(IS > 0):
                if bid >= S0:
                    self.shared_situ(tid, bid, M, sG, mH)
            cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def shared_situ(self, tid, bid, M, sG, mH):
            """Shared CTAs: h = bf16(SiTU-GLU(bf16(a), bf16(c))) for the CTA's two columns and every token (a and c
            rounded as a bf16 Linear would; the expression TopkFromLogits uses)."""
            cute.arch.sync_threads()                    # sG is written by lane 0 of each warp
            if tid < 2 * mb:
                p = tid // mb
                m = tid - p * mb
                if m < M:
                    a = sG[2 * p, m].to(BFloat16).to(Float32)
                    c = sG[2 * p + 1, m].to(BFloat16).to(Float32)
                    mH[m, 2 * (bid - S0) + p] = situ_glu(a, c).to(BFloat16)

        @cute.jit
        def arrive_then_topk(self, tid, warp, lane, M, mCnt, sArr, mBias, mIds, mWt, mWs, sS, scaling: Float32):
            """Router CTAs only: count this CTA's arrival; the last ``n_topk`` arrivers (the last one after
            resetting the counter for the next launch / graph replay) each run the top-16 of ``per_cta``
            tokens, one per warp. The spinners wait only on CTAs that already arrived: no deadlock."""
            NA, NT_, PC = self.n_arrive, self.n_topk, self.per_cta
            # Make this CTA's logits visible at GPU scope before its arrival is counted.
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tid == 0:
                cnt_ptr = mCnt.iterator
                ep_ptr = mCnt.iterator + 1
                e0 = cute.arch.load(ep_ptr, Int32, sem="relaxed", scope="gpu")
                old = cute.arch.atomic_add(cnt_ptr, Int32(1), sem="acq_rel", scope="gpu")
                if old == NA - 1:
                    # last arriver: reset for the next launch / graph replay, then release the spinners
                    cute.arch.store(cnt_ptr, Int32(0), sem="relaxed", scope="gpu")
                    cute.arch.store(ep_ptr, e0 + 1, sem="release", scope="gpu")
                else:
                    if old >= NA - NT_:
                        ep = cute.arch.load(ep_ptr, Int32, sem="acquire", scope="gpu")
                        while ep == e0:
                            ep = cute.arch.load(ep_ptr, Int32, sem="acquire", scope="gpu")
                sArr[0] = old
            cute.arch.sync_threads()
            slot = sArr[0] - (NA - NT_)
            if slot >= 0:
                cute.arch.fence_acq_rel_gpu()
                tok = slot * PC + warp
                if tok < M:
                    self.topk(tok, warp, lane, mBias, mIds, mWt, mWs, sS, scaling)

        @cute.jit
        def topk(self, tok, warp, lane, mBias, mIds, mWt, mWs, sS, scaling: Float32):
            """One warp ranks all NE experts of token tok (J keys per lane) in TOPK unrolled selection rounds."""
            keys = biased_keys(mWs, mBias, tok * self.ws_stride, lane, J, sS, warp)
            cute.arch.sync_warp()          # sS is read below by other lanes of this warp
            lane_u = Uint32(lane)
            my_id = Uint32(0)
            my_s = Float32(0.0)
            for r in cutlass.range_constexpr(TOPK):
                my_id, my_s = select_round(keys, r, lane, lane_u, sS, warp, my_id, my_s)
            write_weights(tok, lane, my_id, my_s, mIds, mWt, scaling)

    class TopkFromLogits:
        """The front's second half after a library GEMM: y = x [W_r; W_down; W_sg; W_su]^T in fp32
        ([M, NE + NL + 2 IS]). One CTA per token: its 4 warps run the top-16 on y[tok, :NE] (topk_split, the
        same order and the same weights as the fused kernel's one-warp top-k on the same logits), all warps round
        the latent block to z = bf16(y[tok, NE:NE+NL]) (the GEMM's single rounding of z, k3-layer.md section 11),
        and h = bf16(SiTU-GLU(bf16(a), bf16(c))) from the shared experts' gate and up columns: a and c rounded to
        bf16 as a bf16 Linear would (k3-layer.md section 12), SiTU in fp32. No counter, no workspace."""
        ws_stride = N + 2 * IS

        @cute.jit
        def __call__(self, mY, mBias, mZ, mIds, mWt, mH, scaling: Float32, grid_x: Int32, stream):
            self.kernel(mY, mBias, mZ, mIds, mWt, mH, scaling).launch(
                grid=[grid_x, 1, 1], block=[32 * WARPS, 1, 1], stream=stream, use_pdl=PDL)

        @cute.kernel
        def kernel(self, mY, mBias, mZ, mIds, mWt, mH, scaling: Float32):
            tid = cute.arch.thread_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tok = cute.arch.block_idx()[0]
            smem = cutlass.memory.SmemAllocator()
            sS = smem.allocate_tensor(Float32, cute.make_layout((NE, WARPS)), 16)
            gY = cute.flat_divide(mY, (1, 4))           # (1, 4, M, ws_stride / 4)
            gZ = cute.flat_divide(mZ, (1, 4))           # (1, 4, M, NL / 4)
            rY = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
            rC = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
            rZ = cute.make_rmem_tensor(cute.make_layout((4,)), BFloat16)
            cute.arch.griddepcontrol_wait()             # y is the previous kernel's output
            # Every z vector of this thread is loaded before the first store (and before the top-k). As a loop,
            # each store waited for its load and the next load was not hoisted above the store (y and z may alias
            # as far as ptxas knows): NZ serial L2 round trips.
            rYz = cute.make_rmem_tensor(cute.make_layout((4, NZ), stride=(1, 4)), Float32)
            for i in cutlass.range_constexpr(NZ):
                vc = cutlass.min(tid + i * 32 * WARPS, NL // 4 - 1)   # past the end: re-read, never stored
                cute.autovec_copy(gY[0, None, tok, NE // 4 + vc], rYz[None, i])
            sK = smem.allocate_tensor(Uint32, cute.make_layout((WARPS * TOPK,)), 16)
            sI = smem.allocate_tensor(Uint32, cute.make_layout((WARPS * TOPK,)), 16)
            self.topk_split(tok, warp, lane, mBias, mIds, mWt, mY, sS, sK, sI, scaling)
            for i in cutlass.range_constexpr(NZ):
                v = tid + i * 32 * WARPS
                if v < NL // 4:
                    rZ.store(rYz[None, i].load().to(BFloat16))
                    cute.autovec_copy(rZ, gZ[0, None, tok, v])
            gH = cute.flat_divide(mH, (1, 4))           # (1, 4, M, IS / 4)
            for v in cutlass.range(tid, IS // 4, 32 * WARPS, unroll=2):
                cute.autovec_copy(gY[0, None, tok, N // 4 + v], rY)
                cute.autovec_copy(gY[0, None, tok, (N + IS) // 4 + v], rC)
                for i in cutlass.range_constexpr(4):
                    a = rY[i].to(BFloat16).to(Float32)
                    c = rC[i].to(BFloat16).to(Float32)
                    rZ[i] = situ_glu(a, c).to(BFloat16)
                cute.autovec_copy(rZ, gH[0, None, tok, v])
            cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def topk_split(self, tok, warp, lane, mBias, mIds, mWt, mWs, sS, sK, sI, scaling: Float32):
            """The top-16 over all WARPS warps of the CTA. Warp w ranks its NE / WARPS experts
            (w * NE / WARPS + lane + 32 j) and keeps its top-16 (key, expert) pairs in shared memory; warp 0 then
            selects the top-16 of those WARPS * 16 candidates. The global top-16 lies in the union of the per-warp
            top-16s under the same total order (larger key first, then the lower expert), so ids, scores and weights
            equal the one-warp top-k's bit for bit. Each warp's 16 rounds scan 7 keys per lane instead of 28, and
            the merge 2."""
            first = warp * (NE // WARPS) + lane
            keys = biased_keys(mWs, mBias, tok * self.ws_stride, first, J // WARPS, sS, 0)
            first_u = Uint32(first)
            my_k = Uint32(0)
            my_i = Uint32(0)
            for r in cutlass.range_constexpr(TOPK):
                bk, bj = local_best(keys)
                gmax, gidx = warp_best(bk, first_u + Uint32(32) * bj)
                remove(keys, gidx, first_u)
                mine = lane == r
                my_k = usel(mine, gmax, my_k)
                my_i = usel(mine, gidx, my_i)
            if lane < TOPK:
                sK[warp * TOPK + lane] = my_k
                sI[warp * TOPK + lane] = my_i
            cute.arch.sync_threads()             # the candidates and every warp's sS scores
            if warp == 0:
                # lane l holds candidates l and 32 + l: those of warps 0-1 and 2-3, so slot 0 always holds the lower
                # expert, and ">" below keeps it on equal keys, as local_best does
                k2 = [sK[lane], sK[32 + lane]]
                i2 = [sI[lane], sI[32 + lane]]
                my_id = Uint32(0)
                my_s = Float32(0.0)
                for r in cutlass.range_constexpr(TOPK):
                    take_b = k2[1] > k2[0]
                    _, gidx = warp_best(usel(take_b, k2[1], k2[0]), usel(take_b, i2[1], i2[0]))
                    for q in cutlass.range_constexpr(2):
                        k2[q] = usel(i2[q] == gidx, Uint32(0), k2[q])
                    s_sel = sS[Int32(gidx), 0]
                    mine = lane == r
                    my_id = usel(mine, gidx, my_id)
                    my_s = fsel(mine, s_sel, my_s)
                write_weights(tok, lane, my_id, my_s, mIds, mWt, scaling)

    sym_m = cute.sym_int()
    ids = fake_tensor(Int32, (sym_m, TOPK), align=4)
    wt = fake_tensor(Float32, (sym_m, TOPK), align=4)
    bias = fake_tensor(Float32, (NE,))
    if mb == 0:             # the top-k of a library GEMM's logits (any M): TopkFromLogits
        y = fake_tensor(Float32, (sym_m, N + 2 * IS))
        z = fake_tensor(BFloat16, (sym_m, NL), align=8)
        h = fake_tensor(BFloat16, (sym_m, IS), align=8)
        return cute.compile(TopkFromLogits(), y, bias, z, ids, wt, h, Float32(1.0), Int32(1), fake_stream(),
                            options=TVM_FFI)
    x = fake_tensor(BFloat16, (sym_m, K))
    w = fake_tensor(BFloat16, (N + 2 * IS, K))
    z = fake_tensor(BFloat16, (sym_m, NL))
    ws = fake_tensor(Float32, (WS_ROWS, NE))
    cnt = fake_tensor(Int32, (4,))
    h = fake_tensor(BFloat16, (sym_m, IS))
    return cute.compile(FrontFma(), x, w, bias, z, ids, wt, ws, cnt, h, Float32(1.0), fake_stream(), options=TVM_FFI)


def get_kernel(mb: int, shared: int, n_experts=N_EXPERTS, latent=LATENT, hidden=HIDDEN, top_k=TOP_K):
    """The compiled fused kernel for token bucket ``mb`` (1, 2 or 4) with shared experts of width ``shared``."""
    if mb not in M_BUCKETS:
        raise ValueError(f"the fused kernel's token buckets are {M_BUCKETS}, got {mb!r}")
    _check_shapes(n_experts, latent, hidden, top_k)
    _check_shared(shared)
    return compile_cached(_front_key(mb, shared, n_experts, latent, hidden, top_k),
                          lambda: _build(mb, n_experts, latent, hidden, top_k, shared))


def get_topk_kernel(shared: int, n_experts=N_EXPERTS, latent=LATENT, top_k=TOP_K):
    """The compiled TopkFromLogits kernel (any M: one CTA per token); its key depends neither on M nor on K."""
    _check_shapes(n_experts, latent, HIDDEN, top_k)
    _check_shared(shared)
    return compile_cached(_topk_key(shared, n_experts, latent, top_k),
                          lambda: _build(0, n_experts, latent, HIDDEN, top_k, shared))


def get_workspace(device, n_experts=N_EXPERTS):
    """(logits [WS_ROWS, n_experts] fp32, counter [4] int32 = 0) for ``device``; allocate before graph capture."""
    import torch
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:      # "cuda" and "cuda:0" must share one workspace
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, n_experts)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = (torch.empty(WS_ROWS, n_experts, dtype=torch.float32, device=device),
              torch.zeros(4, dtype=torch.int32, device=device))
        _WORKSPACES[key] = ws
    return ws


def prepare_front_shared_weight(w_router, w_down, w_shared_gate, w_shared_up):
    """[W_r; W_down; W_sg; W_su] ([896 + 3584 + 2 Is, 7168] bf16): the packed weight both fronts read (router rows
    first, then the latent rows, then the shared experts' gate rows and their up rows). Done once."""
    import torch
    check_tensor("w_router", w_router, dtype=torch.bfloat16, shape=(None, None), align=0)
    K = w_router.shape[1]
    for name, t in (("w_down", w_down), ("w_shared_gate", w_shared_gate), ("w_shared_up", w_shared_up)):
        check_tensor(name, t, dtype=torch.bfloat16, shape=(None, K), device=w_router.device, align=0)
    if w_shared_gate.shape != w_shared_up.shape:
        raise ValueError(f"w_shared_gate {list(w_shared_gate.shape)} and w_shared_up {list(w_shared_up.shape)} differ")
    return torch.cat([w_router, w_down, w_shared_gate, w_shared_up], dim=0).contiguous()


def _front_outputs(M, latent, shared, top_k, dev, out_z, out_ids, out_w, out_h, *, z_align):
    """The front's outputs z [M, latent] bf16, ids [M, top_k] int32, w [M, top_k] fp32, h [M, shared] bf16:
    allocated when None, else checked (the fused kernel stores z 16 bytes at a time, TopkFromLogits 8)."""
    import torch
    if out_z is None:
        out_z = torch.empty(M, latent, dtype=torch.bfloat16, device=dev)
    if out_ids is None:
        out_ids = torch.empty(M, top_k, dtype=torch.int32, device=dev)
    if out_w is None:
        out_w = torch.empty(M, top_k, dtype=torch.float32, device=dev)
    if out_h is None:
        out_h = torch.empty(M, shared, dtype=torch.bfloat16, device=dev)
    check_tensor("out_z", out_z, dtype=torch.bfloat16, shape=(M, latent), device=dev, align=z_align)
    check_tensor("out_ids", out_ids, dtype=torch.int32, shape=(M, top_k), device=dev, align=4)
    check_tensor("out_w", out_w, dtype=torch.float32, shape=(M, top_k), device=dev, align=4)
    check_tensor("out_h", out_h, dtype=torch.bfloat16, shape=(M, shared), device=dev, align=z_align)
    return out_z, out_ids, out_w, out_h


def _latent_width(what, n_cols, n_experts, shared):
    latent = n_cols - n_experts - 2 * shared
    if latent <= 0:
        raise ValueError(f"{what}: {n_cols} cannot hold {n_experts} router rows, a latent block and 2 x {shared} "
                         "shared gate/up rows")
    return latent


def _check_scaling(scaling):
    if not math.isfinite(float(scaling)):
        raise ValueError(f"scaling must be finite, got {scaling}")


def router_down_topk(x, w_packed, e_bias, *, shared, n_experts=N_EXPERTS, top_k=TOP_K, scaling=1.0,
                     out_z=None, out_ids=None, out_w=None, out_h=None, workspace=None):
    """(z, ids, w, h) from one fused launch, for 1 <= M <= M_MAX (docs/k3-layer.md sections 10-12).

    x [M, 7168] bf16; w_packed from prepare_front_shared_weight; e_bias [n_experts] fp32; shared = Is.
    z [M, latent] bf16 = bf16(x W_down^T); ids [M, top_k] int32, ordered by descending s + e_bias, ties by
    ascending expert index; w [M, top_k] fp32 = the chosen unbiased scores renormalised (+1e-20) and scaled;
    h [M, Is] bf16 = the shared experts' SiTU-GLU. ``out_*``: preallocated outputs (else allocated)."""
    import torch
    check_tensor("x", x, dtype=torch.bfloat16, shape=(None, None))
    dev = x.device
    if not x.is_cuda:
        raise ValueError(f"x: expected a CUDA tensor, got device {dev}")
    M, K = x.shape
    if not (1 <= M <= M_MAX):
        raise ValueError(f"x: batch M must lie in [1, {M_MAX}] (router_down_topk_cublas serves larger batches), "
                         f"got {M}")
    check_tensor("w_packed", w_packed, dtype=torch.bfloat16, shape=(None, K), device=dev)
    _check_shared(shared)
    latent = _latent_width("w_packed", w_packed.shape[0], n_experts, shared)
    _check_shapes(n_experts, latent, K, top_k)
    check_tensor("e_bias", e_bias, dtype=torch.float32, shape=(n_experts,), device=dev)
    out_z, out_ids, out_w, out_h = _front_outputs(M, latent, shared, top_k, dev, out_z, out_ids, out_w, out_h,
                                                  z_align=16)
    if workspace is None:
        workspace = get_workspace(dev, n_experts)
    ws, cnt = workspace
    check_tensor("workspace[0]", ws, dtype=torch.float32, shape=(WS_ROWS, n_experts), device=dev)
    check_tensor("workspace[1]", cnt, dtype=torch.int32, shape=(4,), device=dev)
    _check_scaling(scaling)
    fn = get_kernel(bucket_m(M), shared, n_experts, latent, K, top_k)
    fn(x, w_packed, e_bias, out_z, out_ids, out_w, ws, cnt, out_h, float(scaling))
    return out_z, out_ids, out_w, out_h


def router_down_topk_cublas(x, w_packed, e_bias, *, shared, n_experts=N_EXPERTS, top_k=TOP_K, scaling=1.0):
    """router_down_topk's outputs (z, ids, w, h) at any batch: one cuBLAS GEMM over the packed front weight with
    fp32 output (the router logits unrounded, z, a and c rounded once to bf16 in TopkFromLogits), then
    TopkFromLogits. The layer's front above M_MAX, where these library kernels beat the fused one."""
    import torch
    check_tensor("x", x, dtype=torch.bfloat16, shape=(None, None))
    check_tensor("w_packed", w_packed, dtype=torch.bfloat16, shape=(None, x.shape[1]), device=x.device)
    _check_shared(shared)
    try:
        y = torch.mm(x, w_packed.t(), out_dtype=torch.float32)
    except TypeError:
        raise RuntimeError("router_down_topk_cublas needs torch.mm with out_dtype (a newer torch)") from None
    return topk_from_logits(y, e_bias, shared=shared, n_experts=n_experts, top_k=top_k, scaling=scaling)


def topk_from_logits(y, e_bias, *, shared, n_experts=N_EXPERTS, top_k=TOP_K, scaling=1.0, out_z=None,
                     out_ids=None, out_w=None, out_h=None):
    """(z, ids, w, h) from the packed front GEMM's fp32 output y = x [W_r; W_down; W_sg; W_su]^T
    ([M, n_experts + latent + 2 shared]), in one launch (one CTA per token). Same contract as router_down_topk."""
    import torch
    check_tensor("y", y, dtype=torch.float32, shape=(None, None))
    if not y.is_cuda:
        raise ValueError(f"y: expected a CUDA tensor, got device {y.device}")
    M, N = y.shape
    if M < 1:
        raise ValueError("y: expected at least one token row, got 0")
    _check_shared(shared)
    latent = _latent_width("y", N, n_experts, shared)
    _check_shapes(n_experts, latent, HIDDEN, top_k)
    check_tensor("e_bias", e_bias, dtype=torch.float32, shape=(n_experts,), device=y.device)
    _check_scaling(scaling)
    out_z, out_ids, out_w, out_h = _front_outputs(M, latent, shared, top_k, y.device, out_z, out_ids, out_w, out_h,
                                                  z_align=8)
    get_topk_kernel(shared, n_experts, latent, top_k)(y, e_bias, out_z, out_ids, out_w, out_h, float(scaling), M)
    return out_z, out_ids, out_w, out_h
