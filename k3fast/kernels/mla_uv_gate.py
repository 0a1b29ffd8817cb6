"""Gated MLA's value up-projection and output gate in one launch, for sm_90a.

Replaces, after the latent attention, the per-head W_UV bmm and the sigmoid gate of k3ref.mla (docs/k3-layer.md
section 8.3 and 8.5):

    o[m, h]  = bf16( W_UV,h o_lat[m, h] )                       (512 -> 128 per head, fp32 accumulation)
    y[m, h]  = bf16( o[m, h] * sigmoid(g[m, h]) )               (fp32 product, one rounding)

so y [M, H * 128] goes straight to o_proj (oproj_attnres). The gate logits g are read in place from the packed
projection output (a column range of it), as the MLA chain produces them.

Grid: one CTA per (head, 16 rows of W_UV,h): 8 H CTAs (48 at TP16). Each CTA's 4 warps split the 512-long K into
four 128-long quarters; a warp runs mma.sync m16n8k16 with the 16 weight rows as M and the tokens as N (8 per
tile, up to 64 tokens), and the four quarter sums meet in shared memory in a fixed order (deterministic). Weights
stream once per call (W_UV: H x 128 x 512 x 2 bytes, 786 KB at TP16); o_lat and g are tiny.

The combine build (``mla_uv_gate(LatentPartials, ...)``, after mla_latent_decode's deferred build) first sums the
splits' partials into o_lat, sliced by latent dim: one CTA per (head, 64 of the 512 dims), 8 H CTAs. A CTA loads
its slice of every (token, split) partial, 128 of them per pass with 16 loads in flight per thread, stages them in
shared memory, and each (token, dim) adds its splits there in split order 0, 1, .. (the decode's own weights and
order: the in-kernel combine's bits), one bf16 rounding. Its 4 warps then multiply the slice by the 64 matching
columns of W_UV,h (32 rows each) and store the 128-wide partial output; the head's last CTA to arrive adds the
eight partials in slice order, rounds, gates and stores y.

Contracts: o_lat [M, H, 512] bf16 contiguous, w_uv [H, 128, 512] bf16 contiguous (k3ref.mla._split_kv_b's W_UV),
g: columns [g_col, g_col + H * 128) of a bf16 [M, W] tensor, out [M, H * 128] bf16; 1 <= M <= 64. Launched with
PDL: only W_UV (a weight, written by no kernel) is read before griddepcontrol.wait.
"""
from ._dsl import PDL, TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, import_cute, mma_m16n8k16
from .mla_latent_decode import LANE_SPLITS, SPLITS_MAX, UV_SLICES, LatentPartials, combine_weights

DV = 512                 # o_lat width (kv_lora_rank)
VH = 128                 # v_head_dim
ROWS = 16                # W_UV rows per CTA (one MMA M tile)
WARPS = 4
THREADS = 32 * WARPS
KQ = DV // WARPS         # 128 of K per warp
KSTEPS = KQ // 16        # 8 k16 steps per warp
MAX_M = 64
RSTR = MAX_M + 4         # smem pitch of the per-warp partial tiles [rows, tokens]
# the combine build
KS = DV // UV_SLICES     # latent dims per CTA (64)
QUADS = KS // 4          # 16-byte loads across a slice
COMBINE_SPLITS = 16      # (token, split) items in flight per thread (one 16-byte load each)
ITEMS = THREADS // QUADS * COMBINE_SPLITS    # items per pass (128)
BSTR = KS + 4            # smem pitch (fp32) of the staged items
OSTR = KS + 8            # smem pitch (bf16) of the combined slice: 36 words, conflict-free B fragments
CSTEPS = KS // 16        # k16 steps over a slice
CROWS = VH // WARPS      # W_UV rows per warp (two MMA M tiles)
WEIGHT_GROUPS = (2, 4, 8, 16)   # lanes per token when a group weighs a token's splits (splits <= the group)
WEIGHT_GROUPS_BELOW = (0,) + WEIGHT_GROUPS[:-1]


def compile_key(m: int, combine: bool = False) -> tuple:
    """One build per 8-token group count (1, 2, 4, 8 tiles); ``combine``: o_lat is first combined from the latent
    decode's split partials (mla_latent_decode's deferred build) instead of read as bf16."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"M must be in 1..{MAX_M}, got {m}")
    tiles = -(-m // 8)
    return ("mla_uv_gate", 1 << (tiles - 1).bit_length()) + (("combine",) if combine else ())


def _build(nt: int, combine: bool = False):
    if combine:
        return _build_combine(nt)
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32

    from ._dsl import sigmoid

    mma = mma_m16n8k16
    smem_bytes = WARPS * ROWS * RSTR * 4 + 128

    class MlaUvGate:
        @cute.jit
        def __call__(self, mO, mW, mG, mY, g_col: Int32, stream):
            heads = cute.size(mW, mode=[0])
            self.kernel(mO, mW, mG, mY, g_col).launch(
                grid=[heads * (VH // ROWS), 1, 1], block=[THREADS, 1, 1], smem=smem_bytes, stream=stream,
                use_pdl=PDL)

        @cute.kernel
        def kernel(self, mO, mW, mG, mY, g_col: Int32):
            tid = cute.arch.thread_idx()[0]
            bid = cute.arch.block_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            g = lane // 4
            t = lane % 4
            h = bid // (VH // ROWS)
            r0 = (bid - h * (VH // ROWS)) * ROWS
            m_tok = cute.size(mY, mode=[0])

            smem = cutlass.memory.SmemAllocator()
            sR = smem.allocate_tensor(Float32, cute.make_layout((WARPS, ROWS, RSTR), stride=(ROWS * RSTR, RSTR, 1)),
                                      16)
            w32 = cute.recast_tensor(mW, Int32)          # (H, 128, 256)
            o32 = cute.recast_tensor(mO, Int32)          # (M, H, 256)
            acc = cute.make_rmem_tensor(cute.make_layout(nt * 4), Float32)
            acc.fill(0.0)

            # the warp's W_UV fragments (32 registers a lane) load before the PDL wait: the weights depend on no
            # earlier kernel, so after the wait only o_lat and g (L2 hits) stand between the decode and the output
            frags = []
            for kk in cutlass.range_constexpr(KSTEPS):
                kw = warp * (KQ // 2) + 8 * kk + t        # 32-bit word of k = warp * 128 + 16 kk + 2 t
                frags.append([w32[h, r0 + g, kw], w32[h, r0 + g + 8, kw], w32[h, r0 + g, kw + 4],
                              w32[h, r0 + g + 8, kw + 4]])

            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

            toks = [cutlass.min(Int32(8 * j) + g, m_tok - 1) for j in range(nt)]   # rows past M: clamped, unused
            for kk in cutlass.range_constexpr(KSTEPS):
                kw = warp * (KQ // 2) + 8 * kk + t
                a = frags[kk]
                for j in cutlass.range_constexpr(nt):
                    mma(acc, 4 * j, a, o32[toks[j], h, kw], o32[toks[j], h, kw + 4])

            # the four K quarters meet in shared memory: rows (g, g + 8) x tokens (8 j + 2 t, + 1)
            for j in cutlass.range_constexpr(nt):
                for q in cutlass.range_constexpr(4):
                    sR[warp, g + 8 * (q // 2), 8 * j + 2 * t + q % 2] = acc[4 * j + q]
            cute.arch.sync_threads()
            for idx in cutlass.range(tid, ROWS * m_tok, THREADS):
                m = idx // ROWS
                r = idx - m * ROWS
                v = sR[0, r, m]
                for w in cutlass.range_constexpr(1, WARPS):
                    v = v + sR[w, r, m]
                col = h * VH + r0 + r
                o = v.to(BFloat16).to(Float32)          # the bmm's bf16 output, then the gate in fp32
                gate = sigmoid(mG[m, g_col + col].to(Float32))
                mY[m, col] = (o * gate).to(BFloat16)

    return MlaUvGate(), smem_bytes


def _build_combine(nt: int):
    """The combine build (module docstring): grid (head, latent slice), the slice's splits summed in shared memory,
    W_UV's slice columns by mma.sync, the head's eight partial outputs added by its last CTA."""
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32, Int64
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    from ._dsl import sigmoid

    mma = mma_m16n8k16
    rows = 8 * nt                                     # token rows of the shared tables (clamped tokens past M)
    smem_bytes = (rows * SPLITS_MAX * 4 + ITEMS * BSTR * 4 + rows * KS * 4 + rows * OSTR * 2 + 4 * 128)

    def ld_cg_v4(addr):
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.f32()] * 4), [Int64(addr).ir_value()],
            "ld.global.cg.v4.f32 {$0,$1,$2,$3}, [$4];", "=f,=f,=f,=f,l",
            has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        return [Float32(llvm.extractvalue(T.f32(), res, [q])) for q in range(4)]

    class MlaUvGateCombine:
        @cute.jit
        def __call__(self, mW, mG, mY, g_col: Int32, mP, mML, mS, mC, splits: Int32, hn: Int32, stream):
            heads = cute.size(mW, mode=[0])
            self.kernel(mW, mG, mY, g_col, mP, mML, mS, mC, splits, hn).launch(
                grid=[heads * UV_SLICES, 1, 1], block=[THREADS, 1, 1], smem=smem_bytes, stream=stream,
                use_pdl=PDL)

        @cute.kernel
        def kernel(self, mW, mG, mY, g_col: Int32, mP, mML, mS, mC, splits: Int32, hn: Int32):
            tid = cute.arch.thread_idx()[0]
            bid = cute.arch.block_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            g = lane // 4
            t = lane % 4
            h = bid // UV_SLICES
            sl = bid - h * UV_SLICES
            m_tok = cute.size(mY, mode=[0])
            heads = cute.size(mW, mode=[0])
            hg = h // hn
            rh = h - hg * hn
            n_hg = (heads + (hn - 1)) // hn

            smem = cutlass.memory.SmemAllocator()
            sWt = smem.allocate_tensor(Float32, cute.make_layout((rows, SPLITS_MAX), stride=(SPLITS_MAX, 1)), 16)
            sBuf = smem.allocate_tensor(Float32, cute.make_layout((ITEMS, BSTR), stride=(BSTR, 1)), 16)
            sAcc = smem.allocate_tensor(Float32, cute.make_layout((rows, KS), stride=(KS, 1)), 16)
            sO = smem.allocate_tensor(BFloat16, cute.make_layout((rows, OSTR), stride=(OSTR, 1)), 16)
            sFlag = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
            sO32 = cute.recast_tensor(sO, Int32)            # (rows, OSTR / 2)
            w32 = cute.recast_tensor(mW, Int32)             # (H, 128, 256)

            # the W_UV fragments of the warp's rows and this slice's columns (32 registers a lane) load before the
            # PDL wait: they depend on no earlier kernel
            frags = []
            for kk in cutlass.range_constexpr(CSTEPS):
                kw = sl * (KS // 2) + 8 * kk + t            # 32-bit word of k = 64 sl + 16 kk + 2 t
                for mt in cutlass.range_constexpr(2):
                    rb = warp * CROWS + 16 * mt
                    frags.append([w32[h, rb + g, kw], w32[h, rb + g + 8, kw], w32[h, rb + g, kw + 4],
                                  w32[h, rb + g + 8, kw + 4]])

            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

            # the decode's weights of this head's splits, and the running sums zeroed. A token's weights take one
            # L2 round trip and two butterflies: a warp per token above 16 splits (batch 1-4), else an aligned group
            # of G >= splits lanes per token, 32 / G tokens per warp at once (same bits, combine_weights): with one
            # wave of splits every batch from 8 up then weighs its tokens in one round (a warp per token would run
            # 16 rounds in series at batch 64)
            if splits > WEIGHT_GROUPS[-1]:
                for m in cutlass.range(warp, m_tok, WARPS):
                    wr = combine_weights(mML.iterator, ((m * n_hg + hg) * splits) * hn + rh, hn, splits, lane)
                    for i in cutlass.range_constexpr(LANE_SPLITS):
                        if lane + 32 * i < splits:
                            sWt[m, lane + 32 * i] = wr[i]
            for gi in cutlass.range_constexpr(len(WEIGHT_GROUPS)):
                G = WEIGHT_GROUPS[gi]
                if splits > WEIGHT_GROUPS_BELOW[gi] and splits <= G:
                    tpw = 32 // G
                    gl = lane % G
                    for m0 in cutlass.range(warp * tpw, m_tok, WARPS * tpw):
                        mg = m0 + lane // G
                        m = cutlass.min(mg, m_tok - 1)      # every lane joins the butterflies; rows past M unused
                        wr = combine_weights(mML.iterator, ((m * n_hg + hg) * splits) * hn + rh, hn, splits, gl,
                                             group=G)
                        if mg < m_tok and gl < splits:
                            sWt[m, gl] = wr[0]
            for idx in cutlass.range(tid, m_tok * KS, THREADS):
                sAcc[idx // KS, idx % KS] = Float32(0.0)
            cute.arch.sync_threads()

            # passes over the (token, split) items in order: thread (quad q4, lane jl) loads dims 4 q4 .. 4 q4 + 3
            # of the slice for COMBINE_SPLITS consecutive items (an item past the last reloads the last: unused)
            q4 = tid % QUADS
            jl = tid // QUADS
            d0 = sl * KS
            total = m_tok * splits
            p_base = mP.iterator.toint()
            for p0 in cutlass.range(0, total, ITEMS):
                vb = cute.make_rmem_tensor(cute.make_layout(4 * COMBINE_SPLITS), Float32)
                for u in cutlass.range_constexpr(COMBINE_SPLITS):
                    it = cutlass.min(p0 + jl * COMBINE_SPLITS + u, total - 1)
                    m = it // splits
                    row = ((m * n_hg + hg) * splits + (it - m * splits)) * hn + rh
                    v4 = ld_cg_v4(p_base + (Int64(row) * DV + d0 + 4 * q4) * 4)
                    for c in cutlass.range_constexpr(4):
                        vb[4 * u + c] = v4[c]
                for u in cutlass.range_constexpr(COMBINE_SPLITS):
                    for c in cutlass.range_constexpr(4):
                        sBuf[jl * COMBINE_SPLITS + u, 4 * q4 + c] = vb[4 * u + c]
                cute.arch.sync_threads()
                # each (token, dim) adds this pass's splits in order onto its running sum
                for idx in cutlass.range(tid, m_tok * KS, THREADS):
                    m = idx // KS
                    d = idx - m * KS
                    acc = sAcc[m, d]
                    lo = cutlass.max(m * splits, p0)
                    hi = cutlass.min(m * splits + splits, p0 + ITEMS)
                    # at batch 1 a 128-long chain of FMAs: unrolled so the shared loads of the next splits overlap
                    for it in cutlass.range(lo, hi, unroll=4):
                        wgt = sWt[m, it - m * splits]
                        # a split with no page wrote no partial O (its slot holds anything): weight 0, value 0
                        v = Float32(cutlass.select_(wgt > Float32(0.0), sBuf[it - p0, d], Float32(0.0)))
                        acc = acc + wgt * v
                    sAcc[m, d] = acc
                cute.arch.sync_threads()
            for idx in cutlass.range(tid, rows * KS, THREADS):
                m = idx // KS
                d = idx - m * KS
                sO[m, d] = sAcc[cutlass.min(m, m_tok - 1), d].to(BFloat16)
            cute.arch.sync_threads()

            # W_UV,h's 64 slice columns: warp w owns rows 32 w .. 32 w + 31 (two M tiles), the tokens as N
            acc = cute.make_rmem_tensor(cute.make_layout(2 * nt * 4), Float32)
            acc.fill(0.0)
            for kk in cutlass.range_constexpr(CSTEPS):
                kl = 8 * kk + t                             # word 64 sl + 16 kk + 2 t of k, within the slice
                for mt in cutlass.range_constexpr(2):
                    a = frags[2 * kk + mt]
                    for j in cutlass.range_constexpr(nt):
                        mma(acc, 4 * (mt * nt + j), a, sO32[8 * j + g, kl], sO32[8 * j + g, kl + 4])
            # this slice's partial output: rows (g, g + 8) x tokens (8 j + 2 t, + 1) of each tile
            for mt in cutlass.range_constexpr(2):
                for j in cutlass.range_constexpr(nt):
                    for q in cutlass.range_constexpr(4):
                        tok = 8 * j + 2 * t + q % 2
                        if tok < m_tok:
                            mS[(h * UV_SLICES + sl) * m_tok + tok, warp * CROWS + 16 * mt + g + 8 * (q // 2)] = \
                                acc[4 * (mt * nt + j) + q]
            # every thread's stores precede thread 0's release by the barrier and the release's cumulativity
            cute.arch.sync_threads()
            if tid == 0:
                old = cute.arch.atomic_add(mC.iterator + h, Int32(1), sem="acq_rel", scope="gpu")
                last = Int32(cutlass.select_(old == UV_SLICES - 1, Int32(1), Int32(0)))
                if last == 1:
                    # every slice of the head has arrived: re-arm for the next launch
                    cute.arch.store(mC.iterator + h, Int32(0), sem="relaxed", scope="gpu")
                sFlag[0] = last
            cute.arch.sync_threads()
            if sFlag[0] == 1:
                # the head's last CTA: the eight slices' partials added in slice order, one bf16 rounding (the
                # bmm's output), then the gate in fp32
                s_base = mS.iterator
                for idx in cutlass.range(tid, m_tok * VH, THREADS):
                    m = idx // VH
                    r = idx - m * VH
                    v = Float32(0.0)
                    for k in cutlass.range_constexpr(UV_SLICES):
                        v = v + cute.arch.load(s_base + (((h * UV_SLICES + k) * m_tok + m) * VH + r), Float32,
                                               cop="cg")
                    col = h * VH + r
                    o = v.to(BFloat16).to(Float32)
                    gate = sigmoid(mG[m, g_col + col].to(Float32))
                    mY[m, col] = (o * gate).to(BFloat16)

    return MlaUvGateCombine(), smem_bytes


def _compile(nt: int, combine: bool = False):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32
    obj, _ = _build(nt, combine)
    M, H, W, HV, R, S = (cute.sym_int() for _ in range(6))
    w_g_y = (fake_tensor(BFloat16, (H, VH, DV)),         # W_UV
             fake_tensor(BFloat16, (M, W)),              # the projection output holding g
             fake_tensor(BFloat16, (M, HV)))             # y
    if not combine:
        return cute.compile(obj, fake_tensor(BFloat16, (M, H, DV)), *w_g_y, Int32(0), fake_stream(), options=TVM_FFI)
    partials = (fake_tensor(Float32, (R, DV)),           # the decode's partial O
                fake_tensor(Float32, (R, 2)),            # their (m, l)
                fake_tensor(Float32, (S, VH)),           # the slices' partial outputs
                fake_tensor(Int32, (H,)))                # the arrival counter per head
    return cute.compile(obj, *w_g_y, Int32(0), *partials, Int32(1), Int32(8), fake_stream(), options=TVM_FFI)


def _get_compiled(key: tuple):
    return compile_cached(key, lambda: _compile(key[1], "combine" in key[2:]))


def warmup(batches, combine=(False,)) -> list[tuple]:
    keys = sorted({compile_key(m, c) for m in batches for c in combine})
    for k in keys:
        _get_compiled(k)
    return keys


def mla_uv_gate(o_lat, w_uv, g_src, *, g_col: int, out=None):
    """y [M, H * 128] bf16 = bf16(bf16(W_UV,h o_lat[m, h]) * sigmoid(g)), g = g_src[:, g_col : g_col + H * 128].

    ``o_lat``: [M, H, 512] bf16, or the LatentPartials of mla_latent_decode(..., defer=True), which this kernel
    combines first (the combine build)."""
    import torch
    partials = o_lat if isinstance(o_lat, LatentPartials) else None
    if partials is not None:
        M, H = partials.requests, partials.heads
        hg = -(-H // partials.hn)
        rows = M * hg * partials.splits * partials.hn
        check_tensor("o_lat.o", partials.o, dtype=torch.float32, shape=(None, DV))
        check_tensor("o_lat.ml", partials.ml, dtype=torch.float32, shape=(None, 2))
        if partials.uv_scratch is None or partials.uv_count is None:
            raise ValueError("o_lat: the partials carry no uv_scratch / uv_count (make the decode's workspace with "
                             "defer=True)")
        check_tensor("o_lat.uv_scratch", partials.uv_scratch, dtype=torch.float32,
                     shape=(H * UV_SLICES * M, VH))
        check_tensor("o_lat.uv_count", partials.uv_count, dtype=torch.int32, shape=(H,), align=4)
        if partials.o.shape[0] < rows or partials.ml.shape[0] < rows:
            raise ValueError(f"o_lat: the partials hold {partials.o.shape[0]} rows, {rows} expected for {M} requests "
                             f"x {hg} head groups x {partials.splits} splits x {partials.hn} rows")
        if not 1 <= partials.splits <= SPLITS_MAX:
            raise ValueError(f"o_lat: splits must be in 1..{SPLITS_MAX}, got {partials.splits}")
    else:
        check_tensor("o_lat", o_lat, dtype=torch.bfloat16, shape=(None, None, DV))
        M, H = o_lat.shape[0], o_lat.shape[1]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"o_lat: M must be in 1..{MAX_M}, got {M}")
    check_tensor("w_uv", w_uv, dtype=torch.bfloat16, shape=(H, VH, DV))
    check_tensor("g_src", g_src, dtype=torch.bfloat16, shape=(M, None))
    if not (isinstance(g_col, int) and g_col >= 0 and g_col + H * VH <= g_src.shape[1]):
        raise ValueError(f"g_col: expected 0 <= g_col and g_col + {H * VH} <= {g_src.shape[1]}, got {g_col!r}")
    dev = partials.o.device if partials is not None else o_lat.device
    if dev.type != "cuda":
        raise ValueError(f"mla_uv_gate needs CUDA tensors, got o_lat on {dev}")
    if partials is not None:
        for name, t in (("ml", partials.ml), ("uv_scratch", partials.uv_scratch), ("uv_count", partials.uv_count)):
            if t.device != dev:
                raise ValueError(f"o_lat.{name}: expected device {dev} (the device of o_lat.o), got {t.device}")
    for name, t in (("w_uv", w_uv), ("g_src", g_src)):
        if t.device != dev:
            raise ValueError(f"{name}: expected device {dev} (the device of o_lat), got {t.device}")
    if out is None:
        out = torch.empty(M, H * VH, dtype=torch.bfloat16, device=dev)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(M, H * VH), device=dev)
    if partials is not None:
        _get_compiled(compile_key(M, True))(w_uv, g_src, out, g_col, partials.o, partials.ml, partials.uv_scratch,
                                            partials.uv_count, partials.splits, partials.hn)
    else:
        _get_compiled(compile_key(M))(o_lat, w_uv, g_src, out, g_col)
    return out

