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

Contracts: o_lat [M, H, 512] bf16 contiguous, w_uv [H, 128, 512] bf16 contiguous (k3ref.mla._split_kv_b's W_UV),
g: columns [g_col, g_col + H * 128) of a bf16 [M, W] tensor, out [M, H * 128] bf16; 1 <= M <= 64. Launched with
PDL: nothing is read before griddepcontrol.wait.
"""
from ._dsl import TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, import_cute, mma_m16n8k16
from .mla_latent_decode import LANE_SPLITS, SPLITS_MAX, LatentPartials, combine_weights

DV = 512                 # o_lat width (kv_lora_rank)
VH = 128                 # v_head_dim
ROWS = 16                # W_UV rows per CTA (one MMA M tile)
WARPS = 4
THREADS = 32 * WARPS
KQ = DV // WARPS         # 128 of K per warp
KSTEPS = KQ // 16        # 8 k16 steps per warp
MAX_M = 64
RSTR = MAX_M + 4         # smem pitch of the per-warp partial tiles [rows, tokens]
OSTR = DV + 8            # smem pitch (bf16) of the combined o_lat rows: 260 words, conflict-free B fragments
COMBINE_SPLITS = 16      # the combine build's splits in flight per thread (one 16-byte load each)


def compile_key(m: int, combine: bool = False) -> tuple:
    """One build per 8-token group count (1, 2, 4, 8 tiles); ``combine``: o_lat is first combined from the latent
    decode's split partials (mla_latent_decode's deferred build) instead of read as bf16."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"M must be in 1..{MAX_M}, got {m}")
    tiles = -(-m // 8)
    return ("mla_uv_gate", 1 << (tiles - 1).bit_length()) + (("combine",) if combine else ())


def _build(nt: int, combine: bool = False):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32, Int64, const_expr
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    from ._dsl import sigmoid

    mma = mma_m16n8k16
    smem_bytes = WARPS * ROWS * RSTR * 4 + 128
    if combine:
        smem_bytes += 8 * nt * OSTR * 2 + 8 * nt * SPLITS_MAX * 4 + 256

    def ld_cg_v4(addr):
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.f32()] * 4), [Int64(addr).ir_value()],
            "ld.global.cg.v4.f32 {$0,$1,$2,$3}, [$4];", "=f,=f,=f,=f,l",
            has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        return [Float32(llvm.extractvalue(T.f32(), res, [q])) for q in range(4)]

    class MlaUvGate:
        @cute.jit
        def __call__(self, mO, mW, mG, mY, g_col: Int32, mP, mML, splits: Int32, hn: Int32, stream):
            heads = cute.size(mW, mode=[0])
            self.kernel(mO, mW, mG, mY, g_col, mP, mML, splits, hn).launch(
                grid=[heads * (VH // ROWS), 1, 1], block=[THREADS, 1, 1], smem=smem_bytes, stream=stream,
                use_pdl=True)

        @cute.kernel
        def kernel(self, mO, mW, mG, mY, g_col: Int32, mP, mML, splits: Int32, hn: Int32):
            tid = cute.arch.thread_idx()[0]
            bid = cute.arch.block_idx()[0]
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            g = lane // 4
            t = lane % 4
            h = bid // (VH // ROWS)
            r0 = (bid - h * (VH // ROWS)) * ROWS
            m_tok = cute.size(mY, mode=[0])
            heads = cute.size(mW, mode=[0])

            smem = cutlass.memory.SmemAllocator()
            sR = smem.allocate_tensor(Float32, cute.make_layout((WARPS, ROWS, RSTR), stride=(ROWS * RSTR, RSTR, 1)),
                                      16)
            w32 = cute.recast_tensor(mW, Int32)          # (H, 128, 256)
            o32 = cute.recast_tensor(mO, Int32)          # (M, H, 256)
            acc = cute.make_rmem_tensor(cute.make_layout(nt * 4), Float32)
            acc.fill(0.0)

            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

            toks = [cutlass.min(Int32(8 * j) + g, m_tok - 1) for j in range(nt)]   # rows past M: clamped, unused
            if const_expr(combine):
                # o_lat[m, h] = sum_s w_s O_s over the decode's splits, as its own combine sums them (the same
                # weights, each element's splits in order 0, 1, .., one bf16 rounding), for this CTA's head and
                # every token, into shared memory: each of the head's 8 CTAs sums the head's partials itself
                sO = smem.allocate_tensor(BFloat16, cute.make_layout((8 * nt, OSTR), stride=(OSTR, 1)), 16)
                sWt = smem.allocate_tensor(Float32, cute.make_layout((8 * nt, SPLITS_MAX), stride=(SPLITS_MAX, 1)),
                                           16)
                sO32 = cute.recast_tensor(sO, Int32)    # (8 nt, OSTR / 2)
                hg = h // hn
                rh = h - hg * hn
                n_hg = (heads + (hn - 1)) // hn
                for m in cutlass.range(warp, m_tok, WARPS):
                    wr = combine_weights(mML.iterator, ((m * n_hg + hg) * splits) * hn + rh, hn, splits, lane)
                    for i in cutlass.range_constexpr(LANE_SPLITS):
                        if lane + 32 * i < splits:
                            sWt[m, lane + 32 * i] = wr[i]
                cute.arch.sync_threads()
                # thread tid sums dims 4 tid .. 4 tid + 3 of every token: COMBINE_SPLITS 16-byte loads in flight
                p_base = mP.iterator.toint()
                for m in cutlass.range(m_tok):
                    row0 = ((m * n_hg + hg) * splits) * hn + rh
                    ob = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                    ob.fill(0.0)
                    vb = cute.make_rmem_tensor(cute.make_layout(4 * COMBINE_SPLITS), Float32)
                    for s0 in cutlass.range(0, splits, COMBINE_SPLITS):
                        for u in cutlass.range_constexpr(COMBINE_SPLITS):
                            su = cutlass.min(s0 + u, splits - 1)
                            v4 = ld_cg_v4(p_base + Int64((row0 + su * hn) * DV + 4 * tid) * 4)
                            for c in cutlass.range_constexpr(4):
                                vb[4 * u + c] = v4[c]
                        for u in cutlass.range_constexpr(COMBINE_SPLITS):
                            wgt = sWt[m, cutlass.min(s0 + u, splits - 1)]
                            for c in cutlass.range_constexpr(4):
                                # a split with no page wrote no partial O (its slot holds anything): weight 0, value 0
                                v = Float32(cutlass.select_(wgt > Float32(0.0), vb[4 * u + c], Float32(0.0)))
                                ob[c] = Float32(cutlass.select_(s0 + u < splits, ob[c] + wgt * v, ob[c]))
                    for c in cutlass.range_constexpr(4):
                        sO[m, 4 * tid + c] = ob[c].to(BFloat16)
                cute.arch.sync_threads()
                for kk in cutlass.range_constexpr(KSTEPS):
                    kw = warp * (KQ // 2) + 8 * kk + t
                    a = [w32[h, r0 + g, kw], w32[h, r0 + g + 8, kw], w32[h, r0 + g, kw + 4],
                         w32[h, r0 + g + 8, kw + 4]]
                    for j in cutlass.range_constexpr(nt):
                        mma(acc, 4 * j, a, sO32[toks[j], kw], sO32[toks[j], kw + 4])
            else:
                for kk in cutlass.range_constexpr(KSTEPS):
                    kw = warp * (KQ // 2) + 8 * kk + t        # 32-bit word of k = warp * 128 + 16 kk + 2 t
                    a = [w32[h, r0 + g, kw], w32[h, r0 + g + 8, kw], w32[h, r0 + g, kw + 4],
                         w32[h, r0 + g + 8, kw + 4]]
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


def _compile(nt: int, combine: bool = False):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32
    obj, _ = _build(nt, combine)
    M, H, W, HV, R, O = (cute.sym_int() for _ in range(6))
    fakes = (fake_tensor(BFloat16, (O, H, DV)),          # o_lat (the plain build; a placeholder for combine)
             fake_tensor(BFloat16, (H, VH, DV)),         # W_UV
             fake_tensor(BFloat16, (M, W)),              # the projection output holding g
             fake_tensor(BFloat16, (M, HV)))             # y
    partials = (fake_tensor(Float32, (R, DV)),           # the decode's partial O (combine; else a placeholder)
                fake_tensor(Float32, (R, 2)))            # their (m, l)
    return cute.compile(obj, *fakes, Int32(0), *partials, Int32(1), Int32(8), fake_stream(), options=TVM_FFI)


def _get_compiled(key: tuple):
    return compile_cached(key, lambda: _compile(key[1], "combine" in key[2:]))


def warmup(batches, combine=(False,)) -> list[tuple]:
    keys = sorted({compile_key(m, c) for m in batches for c in combine})
    for k in keys:
        _get_compiled(k)
    return keys


_PLACEHOLDERS: dict = {}


def _placeholders(dev, H: int):
    """Tensors for the arguments a build does not read (the plain build's partials, the combine build's o_lat):
    never read, so allocated without a fill (no kernel, also when the first call is inside a graph capture)."""
    import torch
    key = (dev, H)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = (torch.empty(1, H, DV, dtype=torch.bfloat16, device=dev),
                              torch.empty(1, DV, dtype=torch.float32, device=dev),
                              torch.empty(1, 2, dtype=torch.float32, device=dev))
    return _PLACEHOLDERS[key]


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
    if partials is not None and partials.ml.device != dev:
        raise ValueError(f"o_lat.ml: expected device {dev} (the device of o_lat.o), got {partials.ml.device}")
    for name, t in (("w_uv", w_uv), ("g_src", g_src)):
        if t.device != dev:
            raise ValueError(f"{name}: expected device {dev} (the device of o_lat), got {t.device}")
    if out is None:
        out = torch.empty(M, H * VH, dtype=torch.bfloat16, device=dev)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(M, H * VH), device=dev)
    o_ph, p_ph, ml_ph = _placeholders(dev, H)
    if partials is not None:
        _get_compiled(compile_key(M, True))(o_ph, w_uv, g_src, out, g_col, partials.o, partials.ml,
                                            partials.splits, partials.hn)
    else:
        _get_compiled(compile_key(M))(o_lat, w_uv, g_src, out, g_col, p_ph, ml_ph, 1, 8)
    return out

