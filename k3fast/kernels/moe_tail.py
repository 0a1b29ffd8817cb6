"""Tail of a Kimi K3 LatentMoE layer's decode step (k3-spec.md section 11), plus the shared-expert gate/up GEMV.

Version log
-----------
v1  mma.sync m16n8k16 "swap-AB" GEMV for every batch M = 1..64: weight rows are the 16-row A operand, loaded
    straight from HBM into registers with 16-byte loads (no shared-memory staging, no pre-shuffle: the k order inside
    a 32-wide chunk is permuted identically for A and B, which a full K reduction does not see), tokens are the
    8-column B operand (NT = ceil(M/8) n-tiles, a compile-time bucket; M itself is a run-time dim).
    Two kernels:
      * ``shared_expert_gate_up``: packed [2*Is, d] weight (gate/up interleaved in groups of 8 rows, so one mma's
        D fragment holds a and c of the same (row, token) in the same thread), SiTU-GLU epilogue in registers.
      * ``moe_tail``: routed_expert_norm + latent up-projection + shared down-projection + add, one launch.
    Registers/spills (ptxas, sm_90a, CUTE_DSL_COMPILER_OPT="remarks{ptx}"): 0 spill bytes in every key.
      moe_tail  (Is 384 / 768 / 6144):  NT=1 64/65/78, NT=2 90/79/96, NT=4 128/128/123, NT=8 162-190
      gate_up   (Is 384 / 768 / 6144):  NT=1 48/48/68, NT=2 60/60/76, NT=4 78/78/96,   NT=8 112/112/112
      Launch: tail 256 threads (WR x WK = 1x8 for NT<=2: 448 CTAs; 2x4 for NT=4: 224; 4x2 for NT=8: 112);
      gate_up 512 threads (1x16) when 2*Is/16 < 264 row tiles (48 / 96 CTAs at rank16 / rank8), else 256 (768 CTAs).
    Measured (kernels-11595c4.json): tail rank16 b1/b8/b64 20.9 / 22.1 / 82.0 us (floor 13.5-13.7; stock norm + 2
    GEMMs + add 39.8 / 40.4 / 40.7), full 50.9 / 53.6 / 124.8 (floor 33; stock 63 / 65 / 61); shared gate/up rank16
    11.7 / 11.8 / 25.6 (cuBLAS 10.7 / 10.9 / 11.4).  The M > 8 path is the weak one.
    Expected (see "Performance" below): tail M<=8 ~1.1-1.2x floor, M=16 ~1.3x,
    M=64 ~2-2.5x (issue-bound on the per-warp B-operand prep, see below); gate_up at k3_rank(16) ~1.3-1.6x
    floor standalone (only 48 CTAs: it is meant to run beside the routed experts, see "Schedule").
v2  (2026-11-29, session 6; measured slower and removed in session 7's review, with v3) Before its PDL wait each
    CTA issues one cp.async.bulk.prefetch.L2 per weight row of its tile (W_up and W_sd rows in the tail, the packed
    gate/up rows in gate_up). Why: in the rank16 b1 timeline (records-31884ea-s6perf.json) the tail starts beside
    the routed experts at 39.3 us but ends 16.1 us after them (60.3 -> 76.4): before the wait it has only one
    register stage (2 chunks per warp) in flight, so its 57 MB stream from HBM after the experts end, while during
    the experts (~23 MB in ~22 us) the HBM is mostly idle. The ~270 tail CTAs that fit beside the 64 expert SMs can
    pull ~60 % of W_up (~34 MB; the L2 holds 60 MB) into L2 during the experts. Arithmetic unchanged: outputs are
    bit-identical (GPU test test_l2_prefetch_is_bit_identical). Prediction: the tail's time after the experts at
    b1 16 -> ~9-10 us, MoE half b1 -5 to -7 us; b8 (same tiles, one n-tile) -3 to -6 us; b64 unchanged (cuBLAS
    tail above TAIL_DSL_MAX_M). Risk: the prefetch competes with the experts' own loads (they would slow down) and
    can evict their lines; the layer A/B fast-tailpf shows the net.
    Measured (records-1214f05-s7perf.json, kernels-1214f05.json): slower. MoE half b1 74.0 against 69.9 us, b8
    121.7 against 115.7. The tail alone (bench) is 28.6 against 21.2 us at b1, 30.2 against 22.5 at b8, but 70.0
    against 80.4 at b64, where it is issue-bound (and on cuBLAS in the layer). Stays opt-in.
    The b1 timeline says more than the totals: with the prefetch, the experts took 25.7 us instead of 22.8, and the
    tail still ended 20.3 us after them instead of 16.6. So the ~34 MB requested during the experts did not wait
    in L2 for the tail. Either the requests were still queued in the TMA units when the tail's loads came, or the
    lines were evicted. Both are inference: nothing measured the L2 hit rate.
v3  (2026-11-29, session 6; measured slower and removed in session 7's review) The same rows,
    prefetched with one prefetch.global.L2 per 128-byte line by every thread of the CTA (~4 per thread at b1):
    ordinary L2 fill requests, as rms_gemv's fused kernel issues for its next row group. If v2 lost because the
    TMA units queued the bulk requests, v3's lines arrive during the experts and the tail reads ~60 % of W_up from
    L2. Prediction: tail after the experts at b1 16.6 -> ~10-12 us, experts +1-2 us, MoE half b1 -3 to -5 us. If
    v3 also loses, eviction is the better explanation. The test after that is a prefetch of the rows that the
    tail's second wave reads first. Bench rows moe_tail@pfl; layer A/B fast-tailpfl; GPU test
    test_l2_prefetch_is_bit_identical[line].
    Measured (kernels-84291ed.json, records-84291ed-s9perf.json): slower too, less than v2. Tail bench b1 24.4
    against 21.3 us (v2 28.8); MoE half b1 71.3 against 70.3 (fast-tailpfl). So the requests are not queueing in
    the TMA units alone: every L2 prefetch tried beside this kernel's register loads at M <= 8 cost more than it
    hid. v2 and v3 were removed in session 7's review (the code is at 84291ed; LOG.md has the record).
v4  (2026-11-30, session 8; measured slower and removed in the same session; the code is at 6ec1427) Deeper weight
    preload: both register stages of W_up in flight before the PDL wait (v1: one), and W_sd's first stage issued
    during W_up's last stage instead of after it. Why: in the b1 layer timeline at 3960ffc the tail runs 17.6 us
    after the experts for its 57 MB (3.2 TB/s, floor 13.6), and experts v7's 128 CTAs leave no SM for it to sit
    beside them. Bit-identical (GPU test passed). At one n-tile the build asked 79 registers (3 CTAs per SM, a
    second wave for 448 CTAs), so it asked ptxas for 4 CTAs per SM: 64 registers with 32 B of spills.
    Predicted: tail after the experts at b1 17.6 -> ~15.5-16.5 us, MoE half b1 / b8 -1 to -2 us.
    Measured (kernels-6ec1427-s15.json, records-6ec1427-s15.json, one run): tail bench b1 20.8 -> 22.0 us, b8
    22.5 -> 23.4; MoE half b1 60.1 -> 60.9. MISSED, the other way. Not separated: the spills of the 64-register
    cap, and whether the W_sd stage issued early delays the last W_up stage's data. The tail's 17.6 us after the
    experts stays the item to move (LOG.md, next steps).
v5  (2026-11-30, session 9; RING_DEPTH, the default at depth 2 since session 10; "fast-s19tail" is the A/B without it)
    The weight stages go through a ring of D slots per warp in shared memory, filled by cp.async (16 B per thread
    per row and chunk, the same fragments v1 loads), at M <= RING_MAX_M = 16 (one or two n-tiles). Stage it is copied
    from slot it % D into the registers v1 would have loaded, multiplied, and the slot is refilled with stage it + D;
    the first D stages are issued before the PDL wait. Each thread copies and reads back only its own 16-byte chunks,
    so cp.async.wait_group orders them without a barrier. The MMAs see the same registers: bit-identical (GPU test).
    Why: ncu at rank16 b1 (traces/h200/ncu-5446d13-ncu1/ncu-tail_*.txt): 38.8 cycles per issued instruction, 33.3 of
    them long-scoreboard waits, 0.24 eligible warps per scheduler, DRAM 63 % busy, SMs active 83 % of the elapsed
    cycles. A warp's 14 chunks of W_up are 7 register stages with one in flight ahead of the one being multiplied,
    so each warp waits a memory round trip ~7 times in a row; more stages in registers spilled (v4). Shared memory
    holds them without registers: D = 3 is 48 KB per CTA, which keeps the 4 CTAs per SM that 448 CTAs need for one
    wave (launched with the largest carveout); D = 4 (64 KB) leaves 3 per SM and a second wave.
    ptxas (sm_90a, 12.9): 46 registers at NT = 1 (v1: 64), 64 at NT = 2 (v1: 90, 2 CTAs per SM), no spills.
    Prediction: tail bench rank16 b1 20.8 -> ~15.5-17 us at D = 3 (D = 2 between, D = 4 no better than v1); b8 22.5
    -> ~17-19; MoE half b1 / b8 -2.5 to -3.5 us (the tail's 17.6 us after the experts -> ~14-15).
    Measured (kernels-2674eff-s19.json, records-2674eff-s19.json, one run, copy 4.065 TB/s; bit-identical and graph
    replay GPU tests passed, logs/gpu-junit-2674eff-s19.xml). Tail bench, v1 / D = 2 / 3 / 4 (us):
        rank16 b1   21.2 / 20.6 / 21.1 / 26.7      rank8 b1   29.6 / 21.9 / 22.1 / 28.0
        rank16 b8   22.5 / 21.2 / 22.4 / 30.6      rank8 b8   31.1 / 23.9 / 24.3 / 32.2
        rank16 b16  33.0 / 25.7 / 35.1 / 34.3      (b64 runs v1 at every depth: 80.8, and the layer uses cuBLAS there)
    MoE half with D = 3 ("fast-tailring"): rank16 b1 60.4 -> 59.3 us, b8 112.8 -> 110.7; rank8 b1 75.1 -> 66.2,
    b8 177.6 -> 168.0. MISSED at rank16 (-3 % in the kernel, -1.1 us in the layer, not -2.5 to -3.5); beaten at
    rank8, where v1's NT = 1 tail ran at 2.1 TB/s. ncu at rank16 b1 (ncu-2674eff-ncu2/, D = 3 against v1): long-
    scoreboard stalls 34.3 -> 18.1 cycles per issue, DRAM 62.6 -> 63.8 % busy, 19.7 -> 19.4 us: the warps wait
    less, and the stream rate does not follow; at rank16 the tail's rate is set elsewhere (the 448-CTA grid's ramp
    and the HBM's ~3 TB/s on 57 MB read by 1-2 warps per row tile). D = 4 needs 64 KB per CTA: 3 CTAs per SM, a
    second wave. D = 3 at b16 (NT = 2, 96 KB per CTA) is likewise one CTA per SM short. D = 2 is the default.

What it replaces (k3-spec.md section 11, section 9 for SiTU, section 13 for the per-rank shapes)
---------------------------------------------------------------------------------------------
    a, c   = bf16(x W_sg^T), bf16(x W_su^T)                  -> shared_expert_gate_up (one launch)
    h      = bf16(4 tanh(a/4) sigma(a) * 25 tanh(c/25))         (SiTU-GLU, fp32 math)
    r_hat  = RMSNorm_{routed_expert_norm}(r), eps 1e-5        \
    routed = bf16(r_hat W_up^T)                                 > moe_tail (one launch)
    shared = bf16(h W_sd^T)                                     |
    f      = bf16(routed + shared)                            /
r = bf16(sum_e w_e y_e) is the routed-expert combine (produced by the expert kernel); on a single GPU there is no
latent all-reduce and no shared-expert all-reduce (section 13.2), so f is the whole MLP output delta'.

Numerics. Both kernels accumulate in fp32 on tensor cores. ``moe_tail`` keeps TWO accumulators per output
(routed and shared), so routed and shared are rounded to bf16 separately before the add, exactly as the reference.
The RMSNorm statistics (sum of r^2 over dL = 3584, fp32) are accumulated from the same r registers that feed the
MMA, so there is no extra pass over r; the per-token scale 1/rms is applied to the routed accumulator in the
epilogue. The B operand is bf16(w_norm * r) instead of the reference's bf16(w_norm * r / rms): one bf16 rounding
either way (same relative size), so the result matches the reference to the same tolerance as a different
summation order would.

Bytes and floors at 4.3 TB/s (weights dominate; activations are < 1 MB even at M = 64)
------------------------------------------------------------------------------------
    w_up      7168 x 3584 bf16 = 51.4 MB (replicated on every rank)                 -> 11.9 us
    w_sd      7168 x Is  bf16  =  5.5 / 11.0 / 88.1 MB  (rank16 / rank8 / full)     ->  1.3 / 2.6 / 20.5 us
    moe_tail  total              56.9 / 62.4 / 139.5 MB                              -> 13.2 / 14.5 / 32.4 us
    gate_up   2 x Is x 7168 bf16 = 11.0 / 22.0 / 176.2 MB                            ->  2.6 / 5.1 / 41.0 us
    (Is = 384 at k3_rank(16), 768 at k3_rank(8), 6144 full; d = 7168, dL = 3584.)

Schedule in the layer (intended)
--------------------------------
``shared_expert_gate_up`` depends only on x (the MLP input, the output of the post-attention AttnRes + RMSNorm), not
on the router or the routed experts. Launch it on a side stream right after x is ready (event ``x_ready``), so it
runs concurrently with the router / latent-down GEMV and the routed experts on the main stream; with only
2*Is/16 CTAs at rank shapes (48 / 96) it takes few SMs and leaves the rest to the experts. The main stream then
waits on the side stream's event before ``moe_tail`` (the CUDA graph captures this as a join edge). ``moe_tail``
launches with PDL behind the expert/combine kernel: it issues its first w_up weight loads before
``griddepcontrol_wait`` and reads r and h only after it. (If the lead prefers a single stream: gate_up before the
router, PDL-chained; it then costs its own floor on the critical path.)

Kernel structure (both kernels)
-------------------------------
CTA = WR x WK warps. A warp owns one 16-row output tile (WR tiles per CTA) and 1/WK of the K chunks (chunk = 32
k, chunks dealt round-robin over the WK warps). Per chunk a lane (g = lane/4, t = lane%4) loads 16 B of weight row g
and 16 B of row g+8 at k = 32c + 8t, and 16 B of token (8j + g)'s activation at the same k; the four 32-bit words
feed two m16n8k16 MMAs (k = 8t+{0,1} / 8t+{2,3} for the first, 8t+{4,5} / 8t+{6,7} for the second). Weights are
double-buffered in registers (U chunks per stage) so two stages of loads are in flight. The WK partial tiles are
summed through shared memory in a fixed order (deterministic). Every output element is written exactly once.

Performance notes / what limits it
-----------------------------------
* M <= 8: one n-tile; per 1 KB of weights a warp issues 2 weight loads, 1 activation load, ~30 ALU ops and 2 MMAs,
  far below the issue limit: the kernel is latency/bandwidth bound like a plain GEMV (4.28 TB/s measured for a
  warp-per-row GEMV at M=1, cutedsl-hopper.md section 2.1). 448 CTAs x 256 threads for the tail.
* M = 32..64: two limits. (1) Registers: the two fp32 accumulator sets (64 regs at NT=8) leave room for only one
  register stage of U=1 chunk, so each SM keeps ~16 KB of weight loads in flight (1 CTA/SM at 162-190 regs):
  expected ~2-2.5x floor at M=64, ~1.3-1.5x at M=16..32. (2) Issue: the B-operand prep (bf16 -> fp32, sum of
  squares, x w_norm -> bf16; the compiler fuses the last two into mul.bf16x2) is ~16 ops per token per chunk and
  is repeated by the WR warps that share activations. Next steps, in order: accumulators in shared memory with
  weights held stationary in registers and tokens streamed in groups of 8 (vLLM ws_gemm style), so registers no
  longer scale with M; or WGMMA m64nNk16 with N = tokens (A = weights from TMA-staged smem) for M >= 32.
* gate_up at rank shapes has only 2*Is/16 row tiles (48 at rank16): a standalone launch cannot fill 132 SMs
  (expected 1.3-1.6x floor). Cluster split-K with a DSMEM reduction is the fix if it ever sits on the critical
  path; beside the experts it is the right size.
"""


import math
from typing import Iterable

from ._dsl import check_tensor, compile_cached, fake_stream, fake_tensor, import_cute, situ_glu, TVM_FFI

HIDDEN = 7168          # d
LATENT = 3584          # dL = routed_expert_hidden_size
CHUNK = 32             # k per chunk: 4 lanes x 8 bf16
MAX_M = 64
SHARED_INTERMEDIATE = {"k3_rank16": 384, "k3_rank8": 768, "k3": 6144}
# v5 (the default from session 10 at depth 2; "fast-s19tail" is the A/B without it): the tail's weight stages in a
# ring of RING_DEPTH slots per warp in shared memory (cp.async) instead of two register stages, at M <= RING_MAX_M
# (one or two n-tiles); 0 = off. The version log says why, and why 2 rather than 3.
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


def _tail_cfg(nt: int) -> tuple[int, int, int]:
    """(WR, WK, U) for moe_tail: rows tiles per CTA, K-split warps, chunks per register stage."""
    return {1: (1, 8, 2), 2: (1, 8, 2), 4: (2, 4, 2), 8: (4, 2, 1)}[nt]


def _gate_up_cfg(nt: int, inter: int) -> tuple[int, int, int]:
    tiles = 2 * inter // 16
    wk = 16 if tiles < 264 else 8       # few row tiles: put more warps on K so each SM keeps enough loads in flight
    u = 2 if nt <= 4 else 1
    return (1, wk, u)


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

    class SwapAbGemv:
        """mode "tail": out = bf16(bf16(rstd * (w_norm*r) W1^T) + bf16(h W2^T)); mode "gate_up": h = SiTU(x Wp^T)."""

        def __init__(self, mode: str, nt: int, wr: int, wk: int, u: int, n_rows: int, k1: int, k2: int,
                     early_trigger: bool = False, ring: int = 0):
            assert mode in ("tail", "gate_up")
            # early_trigger: launch the dependents (the tail) as soon as every CTA has its first weights in flight,
            # not after the main loop. For the shared gate/up launched after the routed experts (FastImpl
            # shared_late): the tail then prefetches its weights during the experts, as it does when the experts
            # kernel is its direct predecessor. Safe: the tail still waits (griddepcontrol.wait) for this grid to
            # complete.
            self.early_trigger = early_trigger
            assert k1 % CHUNK == 0 and k2 % CHUNK == 0 and n_rows % (16 * wr) == 0
            self.mode, self.nt, self.wr, self.wk, self.u = mode, nt, wr, wk, u
            self.n_rows, self.k1, self.k2 = n_rows, k1, k2
            self.sets = 2 if mode == "tail" else 1
            self.nch = (k1 // CHUNK, k2 // CHUNK)
            self.nit = tuple(-(-n // (wk * u)) for n in self.nch)
            self.threads = 32 * wr * wk
            self.nacc = 4 * nt * self.sets
            self.red_slots = max(1, (wk - 1) * wr)
            self.smem_bytes = 4 * (self.red_slots * self.nacc * 32 + 8 * nt * wk) + 64
            # v5 (opt-in): a ring of `ring` weight stages per warp in shared memory, filled by cp.async (see
            # RING_DEPTH); the register stage is then only the one being multiplied
            self.ring = ring
            # v5: the ring's ~48 KB per CTA must not cost the 4 CTAs per SM that 448 CTAs need to run in one wave
            # (the largest shared-memory carveout; given explicitly, since otherwise the DSL asks the driver at
            # compile time, which the CPU compile cannot)
            self.occupancy = {"preferred_smem_carveout": 100} if ring else {}
            if ring:
                assert mode == "tail" and ring >= 2
                self.ring_bytes = 16 * 32 * 2 * u * ring * wr * wk
                self.smem_bytes += self.ring_bytes + 128

        @cute.jit
        def __call__(self, mX1: cute.Tensor, mW1: cute.Tensor, mWn, mX2, mW2, mOut: cute.Tensor,
                     eps: Float32, stream):
            grid_x = self.n_rows // (16 * self.wr)
            self.kernel(mX1, mW1, mWn, mX2, mW2, mOut, eps).launch(
                grid=[grid_x, 1, 1], block=[self.threads, 1, 1], smem=self.smem_bytes, stream=stream, use_pdl=True,
                **self.occupancy)

        # -- one register stage of weight fragments: U chunks x rows (g, g+8), 16 B each
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
                if const_expr(seg == 0 and self.mode == "tail"):
                    cute.autovec_copy(gWn[None, 4 * cc + t], rWn[None, u])
                for j in cutlass.range_constexpr(self.nt):
                    tok = cutlass.min(8 * j + g, m_last)
                    cute.autovec_copy(gX[0, None, tok, 4 * cc + t], rX[None, j, u])
            w32 = cute.recast_tensor(rW, Int32)
            for u in cutlass.range_constexpr(self.u):
                c = (it * self.u + u) * self.wk + wk
                # all-ones when the chunk exists, zero when it is past the end (its weights are stale registers)
                cmask = ~((Int32(nch - 1) - c) >> 31)
                norm_seg = const_expr(seg == 0 and self.mode == "tail")
                if const_expr(norm_seg):
                    fmask = (cmask & 1).to(Float32)
                    wn = rWn[None, u].load().to(Float32) * fmask
                for j in cutlass.range_constexpr(self.nt):
                    if const_expr(norm_seg):
                        xf = rX[None, j, u].load().to(Float32)
                        ssq[j] = ssq[j] + (xf * xf).reduce(cute.ReductionOp.ADD, Float32(0.0), 0) * fmask
                        rB.store((xf * wn).to(BFloat16))
                        b32 = cute.recast_tensor(rB, Int32)
                        b = (b32[0], b32[1], b32[2], b32[3])
                    else:
                        x32 = cute.recast_tensor(rX[None, j, u], Int32)
                        b = (x32[0] & cmask, x32[1] & cmask, x32[2] & cmask, x32[3] & cmask)
                    for s in cutlass.range_constexpr(2):
                        base = 4 * (j + self.nt * (seg if const_expr(self.mode == "tail") else 0))
                        d = mma_bf16(w32[2 * s, 0, u, buf], w32[2 * s, 1, u, buf],
                                     w32[2 * s + 1, 0, u, buf], w32[2 * s + 1, 1, u, buf],
                                     b[2 * s], b[2 * s + 1],
                                     acc[base + 0], acc[base + 1], acc[base + 2], acc[base + 3])
                        for i in cutlass.range_constexpr(4):
                            acc[base + i] = d[i]

        # -- v5: one stage of the same fragments into ring slot `slot` by cp.async (one commit group per stage,
        #    empty past the end, so wait_group counts stay uniform). Each thread copies and later reads back only its
        #    own 16-byte chunks, so cp.async.wait_group orders them without a barrier.
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
            """v5: stage it is multiplied from registers copied out of ring slot it % D, and slot it % D is then
            refilled with stage it + D: D stages of this warp's loads stay in flight (v1: at most two, in
            registers). The MMAs see the same registers as v1's, so the results are bit-identical."""
            # A chunk past the end is skipped by ring_load, so its slot keeps an earlier stage's weights, which are
            # finite (the first segment, W_up, fills every slot: dL / CHUNK = 112 chunks are 7 full stages), and
            # compute() zeroes that chunk's B operand, as v1 does with its stale registers.
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
            gWn = None
            if const_expr(self.mode == "tail"):
                gWn = cute.flat_divide(mWn, (8,))

            # stale-register safety: a chunk past the end multiplies zero B by these, so they must be finite
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

            # weights do not depend on the previous kernel: first stage in flight before the PDL wait (v5: the ring's
            # D stages, which hold no registers)
            if const_expr(self.ring):
                for d in cutlass.range_constexpr(self.ring):
                    self.ring_load(gW1, sW, d, Int32(d), wk, warp, row_g, lane, t, self.nch[0])
            else:
                self.load_w(gW1, rW, 0, Int32(0), wk, row_g, t, self.nch[0])
            if const_expr(self.early_trigger):
                cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()

            if const_expr(self.ring):
                self.ring_segment(0, gX1, gW1, gWn, sW, rW, wk, warp, row_g, lane, g, t, m_last, acc, ssq, True)
            else:
                self.segment(0, gX1, gW1, gWn, rW, wk, row_g, g, t, m_last, acc, ssq, True)
            if const_expr(self.mode == "tail"):
                gW2 = cute.flat_divide(mW2, (1, 8))
                gX2 = cute.flat_divide(mX2, (1, 8))
                if const_expr(self.ring):
                    self.ring_segment(1, gX2, gW2, gWn, sW, rW, wk, warp, row_g, lane, g, t, m_last, acc, ssq, False)
                else:
                    self.segment(1, gX2, gW2, gWn, rW, wk, row_g, g, t, m_last, acc, ssq, False)

            # the next kernel may start its own weight prefetch while we reduce and store
            if const_expr(not self.early_trigger):
                cute.arch.griddepcontrol_launch_dependents()

            # ---- cross-warp (split-K) reduction through shared memory, fixed order
            if const_expr(self.wk > 1):
                if wk > 0:
                    slot = wr * (self.wk - 1) + wk - 1
                    for v in cutlass.range_constexpr(self.nacc):
                        sRed[lane, v, slot] = acc[v]
            if const_expr(self.mode == "tail"):
                for j in cutlass.range_constexpr(self.nt):
                    sq = cute.arch.warp_reduction_sum(ssq[j], threads_in_group=4)
                    if wr == 0 and t == 0:
                        sSsq[8 * j + g, wk] = sq
            cute.arch.sync_threads()

            if wk == 0:
                if const_expr(self.wk > 1):
                    for k2 in cutlass.range_constexpr(self.wk - 1):
                        slot = wr * (self.wk - 1) + k2
                        for v in cutlass.range_constexpr(self.nacc):
                            acc[v] = acc[v] + sRed[lane, v, slot]
                for j in cutlass.range_constexpr(self.nt):
                    for q in cutlass.range_constexpr(2):             # token 8j + 2t + q
                        tok = 8 * j + 2 * t + q
                        if const_expr(self.mode == "tail"):
                            tot = Float32(0.0)
                            for k2 in cutlass.range_constexpr(self.wk):
                                tot = tot + sSsq[tok, k2]
                            rstd = cute.math.rsqrt(tot * Float32(1.0 / self.k1) + eps)
                            for h in cutlass.range_constexpr(2):     # rows g, g+8
                                routed = (acc[4 * j + 2 * h + q] * rstd).to(BFloat16).to(Float32)
                                shared = acc[4 * (self.nt + j) + 2 * h + q].to(BFloat16).to(Float32)
                                if tok < m_tokens:
                                    mOut[tok, row_g + 8 * h] = (routed + shared).to(BFloat16)
                        else:
                            a = acc[4 * j + q].to(BFloat16).to(Float32)           # gate row (tile rows 0..7)
                            c = acc[4 * j + 2 + q].to(BFloat16).to(Float32)       # up row   (tile rows 8..15)
                            hv = situ_glu(a, c)
                            if tok < m_tokens:
                                mOut[tok, tile * 8 + g] = hv.to(BFloat16)

    _KERNEL_CLS = SwapAbGemv
    return SwapAbGemv


# ----------------------------------------------------------------------------------------------- compile
def _sym_m():
    _, cute = import_cute()
    return cute.sym_int()


def _build_tail(nt: int, inter: int, ring: int = 0):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32
    wr, wk, u = _tail_cfg(nt)
    obj = _kernel_class()("tail", nt, wr, wk, u, HIDDEN, LATENT, inter, ring=ring)
    m = _sym_m()
    fakes = (fake_tensor(BFloat16, (m, LATENT)), fake_tensor(BFloat16, (HIDDEN, LATENT)),
             fake_tensor(BFloat16, (LATENT,)), fake_tensor(BFloat16, (m, inter)),
             fake_tensor(BFloat16, (HIDDEN, inter)), fake_tensor(BFloat16, (m, HIDDEN)))
    return cute.compile(obj, *fakes, Float32(1e-5), fake_stream(), options=TVM_FFI)


def _build_gate_up(nt: int, inter: int, early_trigger: bool = False):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32
    wr, wk, u = _gate_up_cfg(nt, inter)
    obj = _kernel_class()("gate_up", nt, wr, wk, u, 2 * inter, HIDDEN, 0, early_trigger=early_trigger)
    m = _sym_m()
    fakes = (fake_tensor(BFloat16, (m, HIDDEN)), fake_tensor(BFloat16, (2 * inter, HIDDEN)),
             None, None, None, fake_tensor(BFloat16, (m, inter)))
    return cute.compile(obj, *fakes, Float32(0.0), fake_stream(), options=TVM_FFI)


def compile_keys(inter: int, batches: Iterable[int]) -> list[tuple]:
    """Every compile key that running M in ``batches`` with shared intermediate ``inter`` needs."""
    _check_inter(inter)
    nts = sorted({n_tiles(m) for m in batches})
    # the default ring serves M <= RING_MAX_M, i.e. the n-tile buckets 8 * nt <= RING_MAX_M (moe_tail's key below)
    ring = lambda nt: (RING_DEPTH,) if RING_DEPTH and 8 * nt <= RING_MAX_M else ()     # noqa: E731
    return ([("moe_tail", nt, inter) + ring(nt) for nt in nts]
            + [("shared_gate_up", nt, inter) for nt in nts])


def _get(key: tuple):
    op, nt, inter = key[:3]
    ring = key[3] if len(key) > 3 else 0
    if op == "moe_tail":
        build = lambda: _build_tail(nt, inter, ring)                             # noqa: E731
    else:
        build = lambda: _build_gate_up(nt, inter, early_trigger=(op == "shared_gate_up_early"))  # noqa: E731
    return compile_cached(("k3fast.kernels.moe_tail",) + key, build)


def warmup(inter: int, batches: Iterable[int] = (1, 2, 4, 8, 16, 32, 64)) -> list[tuple]:
    """Compile (once) every kernel the given shared width and batch sizes need; call before CUDA-graph capture."""
    keys = compile_keys(inter, batches)
    for k in keys:
        _get(k)
    return keys


# ----------------------------------------------------------------------------------------------- host API
def _check_inter(inter: int) -> None:
    if inter <= 0 or inter % CHUNK:
        raise ValueError(f"shared intermediate width must be a positive multiple of {CHUNK}, got {inter}")


def prepare_shared_gate_up(w_gate, w_up):
    """Pack W_sg, W_su [Is, d] into [2*Is, d]: rows 16i..16i+7 = gate rows 8i..8i+7, rows 16i+8..16i+15 = up rows
    8i..8i+7. One m16n8k16 tile then yields a and c of the same intermediate row in the same thread. Done once."""
    import torch
    check_tensor("w_gate", w_gate, dtype=torch.bfloat16, shape=(None, HIDDEN))
    inter = w_gate.shape[0]
    _check_inter(inter)
    check_tensor("w_up", w_up, dtype=torch.bfloat16, shape=(inter, HIDDEN), device=w_gate.device)
    packed = torch.stack([w_gate.reshape(inter // 8, 8, HIDDEN), w_up.reshape(inter // 8, 8, HIDDEN)], dim=1)
    return packed.reshape(2 * inter, HIDDEN).contiguous()


def _check_m(name: str, t) -> int:
    m = t.shape[0]
    if not (1 <= m <= MAX_M):
        raise ValueError(f"{name}: batch M must be in [1, {MAX_M}], got {m}")
    return m


def shared_expert_gate_up(x, packed, *, out=None, early_trigger=False):
    """h [M, Is] = SiTU-GLU(x W_sg^T, x W_su^T), with ``packed`` from prepare_shared_gate_up. x [M, 7168] bf16.

    early_trigger: the PDL dependents launch when this kernel starts, not after its main loop (for a launch
    after the routed experts, see SwapAbGemv; opt-in)."""
    import torch
    check_tensor("x", x, dtype=torch.bfloat16, shape=(None, HIDDEN))
    m = _check_m("x", x)
    check_tensor("packed", packed, dtype=torch.bfloat16, shape=(None, HIDDEN), device=x.device)
    if packed.shape[0] % 16:
        raise ValueError(f"packed: expected [2*Is, {HIDDEN}] from prepare_shared_gate_up, got {list(packed.shape)}")
    inter = packed.shape[0] // 2
    _check_inter(inter)
    if out is None:
        out = torch.empty(m, inter, dtype=torch.bfloat16, device=x.device)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(m, inter), device=x.device)
    if not x.is_cuda:
        raise ValueError("shared_expert_gate_up: expected CUDA tensors")
    fn = _get(("shared_gate_up_early" if early_trigger else "shared_gate_up", n_tiles(m), inter))
    fn(x, packed, None, None, None, out, 0.0)
    return out


def moe_tail(r, w_norm, w_up, h, w_sd, *, eps: float = 1e-5, out=None, ring: int | None = None):
    """f [M, 7168] = bf16(bf16(RMSNorm_{w_norm}(r) W_up^T) + bf16(h W_sd^T)).

    r [M, 3584] bf16 (combined routed-expert output), w_norm [3584] bf16, w_up [7168, 3584] bf16,
    h [M, Is] bf16 (SiTU output of the shared experts), w_sd [7168, Is] bf16.

    ring (v5; None = RING_DEPTH, 0 = off): weight stages per warp in a shared-memory ring filled by cp.async, at
    M <= RING_MAX_M (above it the v1 kernel runs whatever ring says). Bit-identical to v1."""
    import torch
    check_tensor("r", r, dtype=torch.bfloat16, shape=(None, LATENT))
    dev = r.device
    m = _check_m("r", r)
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
    depth = RING_DEPTH if ring is None else ring
    if not isinstance(depth, int) or depth < 0 or depth == 1 or depth > 4:
        raise ValueError(f"ring must be 0 (off) or a depth in 2..4, got {ring!r}")
    if not r.is_cuda:
        raise ValueError("moe_tail: expected CUDA tensors")
    key = ("moe_tail", n_tiles(m), inter) + ((depth,) if depth and m <= RING_MAX_M else ())
    fn = _get(key)
    fn(r, w_up, w_norm, h, w_sd, out, float(eps))
    return out
