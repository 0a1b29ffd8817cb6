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

DV = 512                 # o_lat width (kv_lora_rank)
VH = 128                 # v_head_dim
ROWS = 16                # W_UV rows per CTA (one MMA M tile)
WARPS = 4
THREADS = 32 * WARPS
KQ = DV // WARPS         # 128 of K per warp
KSTEPS = KQ // 16        # 8 k16 steps per warp
MAX_M = 64
RSTR = MAX_M + 4         # smem pitch of the per-warp partial tiles [rows, tokens]


def compile_key(m: int) -> tuple:
    """One build per 8-token group count (1, 2, 4, 8 tiles)."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"M must be in 1..{MAX_M}, got {m}")
    tiles = -(-m // 8)
    return ("mla_uv_gate", 1 << (tiles - 1).bit_length())


def _build(nt: int):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32

    from ._dsl import sigmoid

    mma = mma_m16n8k16
    smem_bytes = WARPS * ROWS * RSTR * 4 + 128

    class MlaUvGate:
        @cute.jit
        def __call__(self, mO, mW, mG, mY, g_col: Int32, stream):
            heads = cute.size(mW, mode=[0])
            self.kernel(mO, mW, mG, mY, g_col).launch(grid=[heads * (VH // ROWS), 1, 1], block=[THREADS, 1, 1],
                                                      smem=smem_bytes, stream=stream, use_pdl=True)

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
            m_tok = cute.size(mO, mode=[0])

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
            for kk in cutlass.range_constexpr(KSTEPS):
                kw = warp * (KQ // 2) + 8 * kk + t        # 32-bit word of k = warp * 128 + 16 kk + 2 t
                a = [w32[h, r0 + g, kw], w32[h, r0 + g + 8, kw], w32[h, r0 + g, kw + 4], w32[h, r0 + g + 8, kw + 4]]
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


def _compile(nt: int):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Int32
    obj, _ = _build(nt)
    M, H, W, HV = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    fakes = (fake_tensor(BFloat16, (M, H, DV)),          # o_lat
             fake_tensor(BFloat16, (H, VH, DV)),         # W_UV
             fake_tensor(BFloat16, (M, W)),              # the projection output holding g
             fake_tensor(BFloat16, (M, HV)))             # y
    return cute.compile(obj, *fakes, Int32(0), fake_stream(), options=TVM_FFI)


def _get_compiled(key: tuple):
    return compile_cached(key, lambda: _compile(key[1]))


def warmup(batches) -> list[tuple]:
    keys = sorted({compile_key(m) for m in batches})
    for k in keys:
        _get_compiled(k)
    return keys


def mla_uv_gate(o_lat, w_uv, g_src, *, g_col: int, out=None):
    """y [M, H * 128] bf16 = bf16(bf16(W_UV,h o_lat[m, h]) * sigmoid(g)), g = g_src[:, g_col : g_col + H * 128]."""
    import torch
    check_tensor("o_lat", o_lat, dtype=torch.bfloat16, shape=(None, None, DV))
    M, H = o_lat.shape[0], o_lat.shape[1]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"o_lat: M must be in 1..{MAX_M}, got {M}")
    check_tensor("w_uv", w_uv, dtype=torch.bfloat16, shape=(H, VH, DV))
    check_tensor("g_src", g_src, dtype=torch.bfloat16, shape=(M, None))
    if not (isinstance(g_col, int) and g_col >= 0 and g_col + H * VH <= g_src.shape[1]):
        raise ValueError(f"g_col: expected 0 <= g_col and g_col + {H * VH} <= {g_src.shape[1]}, got {g_col!r}")
    dev = o_lat.device
    if dev.type != "cuda":
        raise ValueError(f"mla_uv_gate needs CUDA tensors, got o_lat on {dev}")
    for name, t in (("w_uv", w_uv), ("g_src", g_src)):
        if t.device != dev:
            raise ValueError(f"{name}: expected device {dev} (the device of o_lat), got {t.device}")
    if out is None:
        out = torch.empty(M, H * VH, dtype=torch.bfloat16, device=dev)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(M, H * VH), device=dev)
    _get_compiled(compile_key(M))(o_lat, w_uv, g_src, out, g_col)
    return out

