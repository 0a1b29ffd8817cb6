"""The fused decode step (``impl="fast"``): the CuTe DSL kernels chained with PDL, over the same static
buffers as the other implementations (k3fast.measure.impls.LayerIO).

Attention half of a KDA layer (3 launches at batch <= 2):
    attnres_rms_gemv      AttnRes #1 + input RMSNorm + packed in_proj [q|k|v|g|f_a|b]   (rms_gemv_ring.py at
                          M <= 2: weights through a bulk-copy shared-memory ring; rms_gemv.py above: the AttnRes +
                          RMSNorm kernel and the GEMV, on cuBLAS above INPROJ_DSL_MAX_M)
    kda_conv_gate_step    conv + SiLU, f_b + decay gate, beta, L2 norms, delta rule, gated norm
    oproj_attnres         o_proj + partial-sum update + AttnRes #2 + post-attention RMSNorm
                          (above GEMV_DSL_MAX_M: o_proj on cuBLAS + rms_gemv.attnres_rmsnorm)
MoE half (3 launches at batch <= 4):
    router_down_topk      router logits + latent down-projection + top-16 + renormalised weights + the shared
                          experts' gate/up + SiTU, one pass over x (M <= FRONT_DSL_MAX_M; above it one cuBLAS GEMM
                          over [router; down; shared gate/up] + router_down_topk.TopkFromLogits: top-16, z, and h)
    shared_expert_gate_up shared experts' gate/up + SiTU on its own (the A/B variants, the side stream)
    moe_mxfp4_experts     routed experts, MXFP4 dequantised in registers, SiTU, w2, weighted combine
    moe_tail              routed_expert_norm + latent up-projection + shared down-projection + add
                          (M <= TAIL_DSL_MAX_M; above it RMSNorm + two cuBLAS GEMMs + add, see below)

Weights are re-laid once at construction (packed in_proj, packed front, interleaved shared gate/up,
MXFP4 tiles); nothing is compiled or allocated on the hot path after ``warmup``. MLA layers use the
stock attention half (the fused MLA chain is not written yet).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from k3ref import K3Config
from k3ref.attnres import attn_res_u
from k3ref.precision import Precision
from k3ref.weights import KDAWeights, LayerWeights, MoEWeights

from .nvtx import stage


# Largest batch whose MoE tail (routed_expert_norm + up + shared down + add) runs on k3fast.kernels.moe_tail; above it the
# tail is RMSNorm + two cuBLAS GEMMs + add (3-4 kernels). moe_tail's swap-AB GEMV re-reads the activations from
# L2 in every warp and holds two fp32 accumulator sets per n-tile, so past two n-tiles it falls far behind cuBLAS:
# in the layer at rank16 b64 it took 124.4 us against the stock tail's ~25 us (records-e44cd14-kda.json, stages
# k3.moe.up / k3.moe.shared), 82.0 us in isolation (kernels-11595c4.json). At M <= 16 it is 1.1-1.3x its floor.
TAIL_DSL_MAX_M = 16
# Largest batch whose in_proj GEMV (after the AttnRes + RMSNorm prologue) runs on rms_gemv's tensor-core kernel;
# above it cuBLAS. kernels-e44cd14.json, plain GEMV at rank16: ours 27.3 / 39.9 us at b8 / b64 against cuBLAS
# 19.9 / 22.1 (the split-K variant 25.2 / 58.4). At b8 ours stays: it is PDL-chained with the prologue and the
# KDA core, a cuBLAS launch is not, and the layer A/B (fast-alldsl) is the measurement that decides.
# Session 5 (records-cd4a730-s5perf.json, one run, rank16): with in_proj and o_proj on cuBLAS at b8 (fast-gemv0) the
# attention half took 41.9 us against 46.7 for ours (stock 77.2), so the threshold went 8 -> 4; at b1 ours stays
# (39.6 against 40.2). M = 2..4 were not measured: they keep the FMA path, which is where the b1 figure comes from.
# Session 21: 4 -> 8 for o_proj (oproj_attnres's fused AttnRes #2 at M 5..8 instead of cuBLAS + attnres_rmsnorm).
# Measured as "fast-op8" beside the then default (records-4d058c5-s62.json, records-ef2e00e-s64.json): the attention
# half at b8 -3.0 / -2.7 us (s62, rank8 / rank16, cuBLAS in_proj) and -3.1 / -3.3 (s64, on the v13 in_proj: rank8 b8
# 55.0 -> 51.9 against stock's 90.6). "fast-op4" is the A/B with the threshold at 4. The in_proj has its own
# threshold (INPROJ_DSL_MAX_M below), so this one now moves o_proj alone.
GEMV_DSL_MAX_M = 8      # the same threshold serves o_proj (oproj_attnres: 23.6 us at rank16 b64, cuBLAS 8.6)
# Session 23: ... and only up to o_proj's K = 1536 (rank8). At full width (K = 12288, 176 MB) oproj_attnres took 61.5
# us at b1 and 168.0 at b8 in s75's timelines (records-8f4e39e-s75.json: 1.0 TB/s at b8; the attention half 371.9 us
# against stock's 319.0), where stock's cuBLAS o_proj + its AttnRes kernel took 45.1 + 2.1 + 5.9 / 51.4 + 2.2 + 5.8.
# "fast-opfull" is the A/B (the fused kernel at every width, as before). Measured (s76 at e8c9c17,
# records-e8c9c17-s76.json, one run beside stock; GPU tests at full width passed): attention half full b8 377.6 ->
# 277.4 us (stock 327.2: 0.87x -> 1.18x), b1 229.4 both (the fused kernel and cuBLAS even there), b64 unchanged
# (cuBLAS in both above M = 8).
OPROJ_FUSED_MAX_KP = 1536


def oproj_fused(M: int, Kp: int, max_m: int = GEMV_DSL_MAX_M, max_kp: int = OPROJ_FUSED_MAX_KP) -> bool:
    """Whether o_proj + AttnRes #2 runs as the fused oproj_attnres (else oproj_attnres_cublas) at M tokens and
    o_proj input width Kp."""
    return M <= max_m and Kp <= max_kp
# Session 7: the in_proj GEMV has its own, lower threshold. At M = 3-4 the AttnRes prologue no longer fuses (rms_gemv
# FUSE_MAX_M = 2), and the FMA GEMV behind it took 37.7 us at rank16 b4 against cuBLAS's 19.7 (kernels-84291ed.json,
# gemv_in_proj_plain); in the layer the b4 attention half was 51.5 us, 30.5 of them that GEMV
# (records-9ac30a0-s10perf.json). o_proj keeps GEMV_DSL_MAX_M: its fused kernel beats cuBLAS + a separate AttnRes
# there. "fast-s10" is the A/B with the FMA GEMV up to M = 4. Measured (records-0bc90c0-s11.json, one run): attention
# half b4 51.1 -> 37.6 us at rank16 (stock 74.4: 1.98x), 72.5 -> 51.0 at rank8 (predicted ~40-43 at rank16).
INPROJ_DSL_MAX_M = 2
# Session 16: at M <= 2 the fused in_proj streams its weights through rms_gemv_ring's bulk-copy shared-memory ring
# (rms_gemv v12) instead of the FMA kernel's 16-byte register loads. Measured (records-afcdadf-s45.json, one run beside
# stock): attention half rank16 b1 / b2 33.5 / 38.1 -> 31.5 / 33.9 us, rank8 47.4 / 53.0 -> 45.9 / 48.4 (kernel bench,
# kernels-afcdadf-s45.json: the fused in_proj rank16 b1 22.9 -> 18.2 us, rank8 33.3 -> 28.4, cuBLAS's bare GEMV 19.2 /
# 29.8). "fast-infma" is the A/B with the FMA kernel.
INPROJ_ENGINE = "ring"
# Session 20: the in_proj at INPROJ_DSL_MAX_M < M <= rms_gemv_ring.MMA_MAX_M (3..8), where the AttnRes + RMSNorm
# prologue runs as its own kernel (attnres_rmsnorm, one CTA per token) and the GEMV was cuBLAS's nvjet 64x8 (not
# PDL-launched, so no weight byte moved before the prologue ended): "cublas", or "ring" = rms_gemv_ring v13, the
# bulk-copy ring with a tensor-core consumer, PDL-chained behind the norm kernel. INPROJ_MID_EARLY: the norm
# kernel then launches the ring right after its wait, so the ring's CTAs fill their slots on the SMs the M norm
# CTAs leave idle. Version log v13 in rms_gemv_ring.py. The default since s62 (records-4d058c5-s62.json, one run
# beside stock: the attention half rank8 b8 56.1 -> 54.5 us, rank16 b8 41.0 -> 38.5, rank8 b4 50.0 -> 46.4, rank16
# b4 36.7 -> 33.0 with the early trigger; 55.6 / 39.8 / 48.5 / 34.5 with it at the norm's end). "fast-incublas" is
# the A/B with cuBLAS, "fast-inmma" the norm's trigger at its end.
INPROJ_MID = "ring"
INPROJ_MID_EARLY = True
# Session 21: the same ring reading a tiled copy of the in_proj weight (rms_gemv_ring v14, mma_tile_weight: each
# 16-row x 512-column chunk one contiguous 16 KB bulk copy in the consumers' fragment order, instead of 16 row pieces
# of 1 KB). FastImpl then holds the in_proj twice (the M <= 2 ring and cuBLAS above M = 8 read it row-major).
# "fast-intiled" is the A/B; version log v14 in rms_gemv_ring.py.
INPROJ_MID_TILED = False
# (The ring GEMV launching the KDA step right after its wait, "fast-inmmatrig" / "fast-intiledtrig", was measured at
# 561d389 (s68): the KDA CTAs sat beside the ring from 6.7 us and the attention half took +9.7 us at rank8 b8, +2.5
# at rank16 b8; removed, the code is at 561d389. The ring launches it at its end.)
# Session 24: the in_proj's cuBLAS GEMM (above rms_gemv_ring.MMA_MAX_M) is called with torch's preferred BLAS
# library switched to cublasLt for that call ("default": torch's own choice, cublas; "fast-inmm" is the A/B).
# k3fast.blas_probe (blasprobe-7e1a15e-s81.json, two GEMMs per graph on cold weights): at rank16 M = 64 cublasLt
# picks nvjet 64x32 4x2 without split-K (one kernel, 14.8 us; replay 16.9 us per GEMM) where cublas picks the split-K
# nvjet 64x64 + its reduce kernel (14.7 + 2.4 us; 19.5); at M 9 / 16 / 32 and at rank8 both libraries pick the same
# kernels (and for o_proj at every M), so nothing else moves. Measured (s82, records-3b5c7d3-s82.json, one run):
# attention half rank16 b64 55.4 -> 54.1 us with one launch fewer (predicted -2.0 to -2.8: in the layer the
# cublasLt kernel took 16.9 us, in the probe 14.8), rank16 b16 / rank8 b16 / b64 within +-0.7; full width the same
# kernels and times (s83).
INPROJ_BLAS = "cublaslt"
# Session 25: where the in_proj's GEMM would be that cuBLAS call (8 < M <= 64), "wgmma" runs the AttnRes norm and
# then gemm_wgmma_splitk (v1: WGMMA with a cluster K split, W streamed through a TMA ring and prefetched before its
# PDL wait, so that its weights move while the norm runs); INPROJ_WIDE_EARLY: the norm launches it right after its
# own wait. "cublas" keeps the cuBLAS GEMM (INPROJ_BLAS). Measured (s86-s89, the module's version log): it streams at
# ~2.5-2.7 TB/s, faster in the layer only at rank16 b16 (38.8 against 42.7 us, s87), even at rank16 b64, slower at
# rank8; so cuBLAS stayed, and "fast-inwg" (plus its -late / -d3 / -d2 / -tiled variants) is the opt-in.
# Session 26: "auto", the default: gemm_wgmma_splitk where it won in every run, M <= INPROJ_WIDE_MAX_M (there cuBLAS
# splits K and adds its reduce kernel) and N <= INPROJ_WIDE_MAX_N (rank16's 3216, whose 15 clusters of 8 are
# co-resident; at rank8's 6288 it lost in every run), cuBLAS elsewhere. Rank16 b16, fast-inwg against the then
# default in one run each: 38.8 / 42.7 us (s87), 40.1 / 43.1 (s88), 39.9 / 42.1 (s90c, records-111bb49-s90c.json);
# with this rule as the default, fast / fast-inwgoff 40.1 / 42.2 (s90d, records-ce064f2-s90d.json; stock 84.2: 2.10x).
# "fast-inwgoff" is the A/B (cuBLAS at every M).
# Session 27: above INPROJ_WIDE_MAX_N up to INPROJ_WIDE_WIDE_MAX_N (rank8's 6288; full width not measured) "auto" also
# takes the WGMMA GEMM, at M 9..64, with the plan
# pinned to INPROJ_WIDE_PINS_WIDE: 66 clusters of 2 x 96 rows whose stages load only the token bucket's x rows
# (gemm_wgmma_splitk v3; the plan's own 29 clusters of 4 x 224 rows lost there in every run). Bare at rank8 b16
# 29.4 us against cublasLt's 28.5 (s94); attention half fast (cuBLAS) / fast-inwg2bn96x: rank8 b16 57.4 / 54.3
# and 54.4 (s95, stock 101.6: 1.87x), 57.4 / 53.9, 57.6 / 54.4 (s95b); rank8 b64 80.7 / 78.3 (s95, stock 122.9),
# 80.2 / 78.3, 80.1 / 78.4 (s95b), 80.0 / 78.9 with v1's 64-row x box (s93) (records-4d1a04c-s95.json,
# records-4d1a04c-s95b.json, records-46083d7-s93.json). M 17..63 lie between the two measured batches.
# Session 28: at rank16's width above INPROJ_WIDE_MAX_M (M 17..64) "auto" takes the WGMMA GEMM too, pinned to
# INPROJ_WIDE_PINS_LARGE_M: 29 clusters of 4 x 112 rows (116 CTAs). At b64 the AttnRes norm before it is 256 CTAs
# (clusters of 4 per token) and the plan's clusters of 8 were never placed beside them (its W did not move during
# the norm: the s86-s89 timelines, and s97's 4-stage ring, 144 KB, started as late); what the WGMMA GEMM brings there
# is the KDA step launched from its cluster barrier, ~1.8 us before the GEMM ends, where cuBLAS launches it at its end.
# Attention half at rank16 b64 (s97, records-f8eaa2c-s97.json; with o_proj on WGMMA as well, OPROJ_WIDE_MIN_M_NARROW):
# stock 93.6, fast (cuBLAS in_proj and o_proj) 53.5, fast-opwg 52.6 / 53.0, 4 x 112 rows 50.8 (1.84x), 2 x 96 rows
# 51.1, 2 x 64 rows 51.7, the plan with 4 stages 52.5. As the default: 50.6-51.6 against stock 90.9-92.8 (s98, s100-
# s102), fast-inwgoff-opwgoff 52.9 (s98). Measured at M = 64 only in the layer; M 17..63 (x tiles of 32 / 64 rows,
# the GEMM tested at 17 / 32 / 33) lie between it and the plan's measured M = 16.
INPROJ_WIDE = "auto"
INPROJ_WIDE_MAX_M = 16
INPROJ_WIDE_MAX_N = 4096
INPROJ_WIDE_WIDE_MAX_M = 64
INPROJ_WIDE_WIDE_MAX_N = 8192
INPROJ_WIDE_PINS_WIDE = {"ksplit": 2, "bn": 96, "xrows": "auto"}
INPROJ_WIDE_LARGE_MAX_M = 64
INPROJ_WIDE_PINS_LARGE_M = {"ksplit": 4, "bn": 112, "xrows": "auto"}
INPROJ_WIDE_EARLY = True


def _wide_engine(name: str, wide: str | None, default: str) -> str:
    """``wide`` with None resolved to ``default``, checked: one of the GEMM engine settings "auto" / "cublas" /
    "wgmma" (inproj_wide / oproj_wide, in the choices below and in FastImpl's arguments)."""
    w = default if wide is None else wide
    if w not in ("auto", "cublas", "wgmma"):
        raise ValueError(f"{name} must be None, 'auto', 'cublas' or 'wgmma', got {wide!r}")
    return w


def inproj_wide_choice(M: int, N: int, wide: str | None = None) -> str:
    """"cublas" or "wgmma": the in_proj's GEMM engine at M tokens and N output rows where it would be cuBLAS, for
    ``wide`` (None = INPROJ_WIDE; "auto" = the measured rule above, which leaves M <= rms_gemv_ring.MMA_MAX_M to the
    v13 ring where that applies and to cuBLAS where not)."""
    w = _wide_engine("inproj_wide", wide, INPROJ_WIDE)
    if w == "auto":
        from .kernels.rms_gemv_ring import MMA_MAX_M
        if N <= INPROJ_WIDE_MAX_N:
            return "wgmma" if MMA_MAX_M < M <= INPROJ_WIDE_LARGE_MAX_M else "cublas"
        if N <= INPROJ_WIDE_WIDE_MAX_N:
            return "wgmma" if MMA_MAX_M < M <= INPROJ_WIDE_WIDE_MAX_M else "cublas"
        return "cublas"
    return w


def inproj_wide_pins(N: int, wide: str | None = None, plan: dict | None = None, M: int | None = None) -> dict:
    """gemm_wgmma's plan pins for the in_proj's WGMMA GEMM at N output rows and M tokens: ``plan`` where given, else
    under "auto" INPROJ_WIDE_PINS_WIDE above INPROJ_WIDE_MAX_N (session 27), INPROJ_WIDE_PINS_LARGE_M at or below it
    for M > INPROJ_WIDE_MAX_M (session 28; M None: not that case) and the plan's own choice elsewhere; an explicit
    "wgmma" (fast-inwg and its variants) keeps the plan's own choice, as it was measured."""
    if plan is not None:
        return dict(plan)
    if _wide_engine("inproj_wide", wide, INPROJ_WIDE) == "auto":
        if INPROJ_WIDE_MAX_N < N <= INPROJ_WIDE_WIDE_MAX_N:
            return dict(INPROJ_WIDE_PINS_WIDE)
        if N <= INPROJ_WIDE_MAX_N and M is not None and M > INPROJ_WIDE_MAX_M:
            return dict(INPROJ_WIDE_PINS_LARGE_M)
    return {}
# Above GEMV_DSL_MAX_M, o_proj's GEMV before the separate AttnRes #2 kernel: "cublas", or "ring" (v13 as above,
# M <= 8; "fast-opmma" is the A/B with GEMV_DSL_MAX_M = 4, since at 8 no o_proj GEMV both runs apart and fits v13).
OPROJ_MID = "cublas"
# Session 26: o_proj's GEMM where it runs apart from its AttnRes #2 kernel (M > GEMV_DSL_MAX_M): "wgmma" runs
# gemm_wgmma_splitk (o_proj's W does not depend on the KDA step, so its ring stages are requested before the PDL
# wait: at rank16 / rank8 the plan's ring holds all / 5 of 6 of a CTA's k-tiles; the norm kernel is launched after
# the GEMM's cluster barrier) instead of cuBLAS, which starts only after the KDA step ends and launches the norm at its
# own end. "auto", the default: the WGMMA GEMM where o_proj's input width is OPROJ_WIDE_KP (rank8's 1536), the width
# where it gained in both runs; cuBLAS at rank16's 768 (even) and at full width (not measured). Attention half, fast
# (cuBLAS) / fast-opwg, µs: rank8 b16 60.0 / 58.5 (s90e), 59.9 / 58.0 (s90f); rank8 b64 81.8 / 79.9, 82.0 / 80.5;
# rank16 b64 53.4 / 52.6, 53.4 / 53.3; rank16 b16 39.6 / 40.4, 40.0 / 39.4 (records-833d5e0-s90e.json,
# records-f3d976a-s90f.json). The timelines: the GEMM's CTAs cannot sit beside the KDA step's (its shared memory is
# full at b64), so most of W still streams after it; the gain is the norm kernel launched from the GEMM's cluster
# barrier instead of after its end, and one launch gap. "fast-opwgoff" is the A/B (cuBLAS everywhere).
# Session 28: also at rank16's width (OPROJ_WIDE_KP_NARROW) from OPROJ_WIDE_MIN_M_NARROW tokens, where the in_proj runs
# on gemm_wgmma_splitk's 4 x 112-row clusters (INPROJ_WIDE_PINS_LARGE_M): fast-opwg 52.6 / 53.0 against fast 53.5 at
# rank16 b64 in s97, as in s90e / s90f / s92 (52.6 / 53.3 / 52.6 against 53.4 / 53.4 / 53.5); rank16 b16 stays on
# cuBLAS (mixed there).
OPROJ_WIDE = "auto"
OPROJ_WIDE_KP = 1536
OPROJ_WIDE_KP_NARROW = 768
OPROJ_WIDE_MIN_M_NARROW = INPROJ_WIDE_MAX_M + 1


def oproj_wide_choice(Kp: int, wide: str | None = None, M: int | None = None) -> str:
    """"cublas" or "wgmma": o_proj's GEMM engine where it runs apart from its AttnRes #2 kernel, for o_proj input width
    Kp, M tokens (None: below every batch threshold) and ``wide`` (None = OPROJ_WIDE; "auto" = the measured rule
    above)."""
    w = _wide_engine("oproj_wide", wide, OPROJ_WIDE)
    if w == "auto":
        narrow = Kp == OPROJ_WIDE_KP_NARROW and M is not None and M >= OPROJ_WIDE_MIN_M_NARROW
        return "wgmma" if Kp == OPROJ_WIDE_KP or narrow else "cublas"
    return w
# Largest batch whose router + latent down-projection + top-k runs on router_down_topk (one launch); above it one
# cuBLAS GEMM with fp32 output + the TopkFromLogits kernel (router_down_topk_cublas): at rank16 b64 the fused kernel
# took 63.2 us in the layer against the stock router + down at 35.5 us (records-e384fbf-rot.json); at b8 36.5
# against 29.3. Until 2026-11-29 (session 5) the top-k there was torch ops (route_from_logits: ~12 kernels, 50 us
# at b64 with its stable radix sort, records-50b6243-rotperf.json). fast-front0 / fast-front16 are the A/B: in
# records-cd4a730-s5perf.json the cuBLAS front took the MoE half at b8 from 133.4 to 125.3 us (with the cuBLAS front above M = 4: 125.6), and
# at b1 79.4 against 80.4 (the fused kernel: 31.7 us alone against 39.7 for GEMM + top-k, kernels-cd4a730.json).
# So 16 -> 4: the fused kernel keeps its FMA buckets, the cuBLAS front serves the tensor-core ones.
FRONT_DSL_MAX_M = 4


# The library halves of the batch dispatch above, shared by FastImpl and the torch ops (k3fast.ops), so that both
# give the same bits at every batch.

@contextlib.contextmanager
def blas_library(lib: str | None, device: torch.device):
    """torch's preferred BLAS library set to ``lib`` ("cublaslt" / "cublas") for the calls inside, then restored; a
    no-op for None, "default" or a CPU tensor (a CPU build of torch refuses cublasLt). The setting is global, so it
    is held only around the one GEMM that wants it; in a CUDA graph the library is chosen once, at capture."""
    if lib not in (None, "default", "cublas", "cublaslt"):
        raise ValueError(f"blas: expected None, 'default', 'cublas' or 'cublaslt', got {lib!r}")
    if lib in (None, "default") or device.type != "cuda":
        yield
        return
    old = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(lib)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(old)


def attnres_in_proj(blocks, n_blocks, partial, delta, u, w_ln, w, *, eps, block_write, partial_out,
                    early_trigger=None, engine=None, mma=None, joint=None, mid=None, mid_early=None, w_tiled=None,
                    norm_cluster=None, blas=None, wide=None, wide_early=None, wide_plan=None, wide_w=None,
                    **fma_options):
    """AttnRes #1 + input RMSNorm + packed in_proj as the layer runs it: rms_gemv_ring (one launch) at M <= 2 when
    ``engine`` (None = INPROJ_ENGINE) is "ring"; otherwise rms_gemv.attnres_rms_gemv, fused at M <= 2, its
    tensor-core GEMV up to INPROJ_DSL_MAX_M and cuBLAS above (``mma`` None = that rule; fma_options are
    attnres_rms_gemv's opt-ins). ``early_trigger`` None: each engine's default (the ring launches its dependent at
    its end, rms_gemv_ring.EARLY_TRIGGER; the FMA kernels right after their wait). ``joint``: the ring's v12.2
    prologue (None = rms_gemv_ring.JOINT_PROLOGUE). ``mid`` (None = INPROJ_MID): where the GEMV would be cuBLAS
    and M <= rms_gemv_ring.MMA_MAX_M, "ring" runs attnres_rmsnorm + rms_gemv_ring's tensor-core ring GEMV (v13),
    the norm launching it after its wait when ``mid_early`` (None = INPROJ_MID_EARLY); ``w_tiled``, w's
    rms_gemv_ring.mma_tile_weight copy, makes that GEMV v14 (the same bits). ``norm_cluster``: CTAs per token of
    attnres_rmsnorm where it runs apart (None = rms_gemv.norm_cluster(M), v15). ``blas``: the BLAS library of the
    cuBLAS GEMM where one runs (None = INPROJ_BLAS, "default" = torch's; blas_library). ``wide`` (None = INPROJ_WIDE;
    "auto": inproj_wide_choice's rule): where that cuBLAS GEMM would run at M in gemm_wgmma_splitk's range, "wgmma"
    runs attnres_rmsnorm (its trigger after its wait when ``wide_early``, None = INPROJ_WIDE_EARLY) + gemm_wgmma_splitk
    instead (``wide_plan``: its plan's
    pins, gemm_wgmma's keyword arguments; ``wide_w``: w's gemm_wgmma_splitk.tile_weight copy, its v2, the same bits).
    Returns (y, partial_out)."""
    from .kernels import gemm_wgmma_splitk
    from .kernels import rms_gemv
    from .kernels import rms_gemv_ring
    M = partial.shape[0]
    if (INPROJ_ENGINE if engine is None else engine) == "ring" and partial.dim() == 2 and M <= 2:
        return rms_gemv_ring.attnres_rms_gemv_ring(blocks, n_blocks, partial, delta, u, w_ln, w, eps=eps,
                                                   block_write=block_write, partial_out=partial_out,
                                                   early_trigger=early_trigger, joint=joint)
    early_trigger = True if early_trigger is None else early_trigger
    if mma is None:
        mma = "v2" if M <= INPROJ_DSL_MAX_M else "cublas"
    if (mma == "cublas" and (INPROJ_MID if mid is None else mid) == "ring" and partial.dim() == 2
            and rms_gemv_ring.mma_applicable(M, w.shape[1], w.shape[0])):
        x, partial_out = rms_gemv.attnres_rmsnorm(blocks, n_blocks, partial, delta, u, w_ln, eps=eps,
                                                  block_write=block_write, partial_out=partial_out,
                                                  early_trigger=INPROJ_MID_EARLY if mid_early is None else mid_early,
                                                  cluster=norm_cluster)
        return rms_gemv_ring.gemv_ring_mma(x, w if w_tiled is None else w_tiled), partial_out
    wide_gemm = mma == "cublas" and inproj_wide_choice(M, w.shape[0], wide) == "wgmma" and partial.dim() == 2
    pins = inproj_wide_pins(w.shape[0], wide, wide_plan, M) if wide_gemm else None
    if wide_gemm and gemm_wgmma_splitk.applicable(M, w.shape[1], w.shape[0], **pins):
        x, partial_out = rms_gemv.attnres_rmsnorm(blocks, n_blocks, partial, delta, u, w_ln, eps=eps,
                                                  block_write=block_write, partial_out=partial_out,
                                                  early_trigger=INPROJ_WIDE_EARLY if wide_early is None else wide_early,
                                                  cluster=norm_cluster)
        return gemm_wgmma_splitk.gemm_wgmma(x, w if wide_w is None else wide_w, **pins), partial_out
    with blas_library((INPROJ_BLAS if blas is None else blas) if mma == "cublas" else None, partial.device):
        return rms_gemv.attnres_rms_gemv(blocks, n_blocks, partial, delta, u, w_ln, w, eps=eps,
                                         block_write=block_write, partial_out=partial_out, mma=mma,
                                         early_trigger=early_trigger, norm_cluster=norm_cluster, **fma_options)


def oproj_attnres_cublas(y, w_o, blocks, n_blocks, p1, u_mlp, w_post, *, eps, boundary, zeros=None, out_x=None,
                         out_partial=None, gemv=None, norm_cluster=None, wide=None, wide_plan=None):
    """oproj_attnres's contract above GEMV_DSL_MAX_M: a = bf16(y W_o^T) on cuBLAS (oproj_attnres's GEMV is 1.5-2x
    cuBLAS there, kernels-11595c4.json), then the same AttnRes #2 + RMSNorm as in_proj's prologue with p' =
    bf16(p1 + a), or a itself at a block boundary (p' then starts the new block: p1 := 0). ``zeros``: a zero tensor
    shaped like p1 for the boundary case (FastImpl passes one it owns, so nothing is allocated in a graph).
    ``gemv`` (None = OPROJ_MID): "ring" takes a from rms_gemv_ring's tensor-core ring GEMV (v13) where M <= 8.
    ``norm_cluster``: the AttnRes #2 kernel's CTAs per token (None = rms_gemv.norm_cluster(M), v15). ``wide`` (None =
    OPROJ_WIDE; "auto": oproj_wide_choice's rule): "wgmma" takes a from gemm_wgmma_splitk where it applies
    (``wide_plan``: its plan's pins)."""
    from .kernels import gemm_wgmma_splitk
    from .kernels.rms_gemv import attnres_rmsnorm
    from .kernels.rms_gemv_ring import gemv_ring_mma, mma_applicable
    if (oproj_wide_choice(w_o.shape[1], wide, y.shape[0]) == "wgmma"
            and gemm_wgmma_splitk.applicable(y.shape[0], w_o.shape[1], w_o.shape[0], **(wide_plan or {}))):
        a = gemm_wgmma_splitk.gemm_wgmma(y, w_o, **(wide_plan or {}))
    elif (OPROJ_MID if gemv is None else gemv) == "ring" and mma_applicable(y.shape[0], w_o.shape[1], w_o.shape[0]):
        a = gemv_ring_mma(y, w_o)
    else:
        a = F.linear(y, w_o)
    p = (zeros if zeros is not None else torch.zeros_like(p1)) if boundary else p1
    return attnres_rmsnorm(blocks, n_blocks, p, a, u_mlp, w_post, eps=eps, out=out_x, partial_out=out_partial,
                           cluster=norm_cluster)


def moe_tail_cublas(r, w_norm, w_up, h, w_sd, *, eps, out=None, fused_norm: bool = True):
    """moe_tail's contract above TAIL_DSL_MAX_M (which says why): RMSNorm + two cuBLAS GEMMs + add, with the same
    roundings as k3ref and the fused moe_tail: bf16 r_hat, bf16 routed and shared, their sum rounded once.
    (226990a folded the add into the up GEMM, addmm_ with beta = 1: one kernel less at b64, but the routed product
    was then not rounded before the add, unlike k3ref and moe_tail; reverted in the same session, LOG.md.)
    w_norm: routed_expert_norm.weight (BF16 in the checkpoint, so its BF16 copy is exact).
    fused_norm (the default since session 13): one torch RMSNorm kernel on the BF16 r, which up-casts, normalises
    and multiplies in FP32 and rounds once, as k3ref does. False: the FP32 copy of r, the norm, and a BF16 copy,
    three kernels (~9 us at b64 in records-1f10ff5-s27.json; "fast-s27tail" is the A/B)."""
    with stage("k3.moe.shared"):
        shared = F.linear(h, w_sd)
    with stage("k3.moe.up"):
        if fused_norm:
            rn = F.rms_norm(r, (r.shape[-1],), w_norm.to(r.dtype), eps)
        else:
            rn = F.rms_norm(r.float(), (r.shape[-1],), w_norm.float(), eps).bfloat16()
        return torch.add(F.linear(rn, w_up), shared, out=out)


class FastImpl:
    name = "fast"

    def __init__(self, cfg: K3Config, w: LayerWeights, *, max_batch: int = 64, overlap_shared: bool = False,
                 experts_version: int | None = None, experts_cluster=None, gemv_mma: str = "v2",
                 tail_dsl_max_m: int = TAIL_DSL_MAX_M, experts_layout: str = "auto",
                 gemv_dsl_max_m: int = GEMV_DSL_MAX_M, front_dsl_max_m: int = FRONT_DSL_MAX_M,
                 experts_warps: int | None = None, shared_in_front: bool = True, router_rolled: bool | None = None,
                 shared_late: bool = False, gemv_groups: int | None = None,
                 attn_early_trigger: bool = True, oproj_preload: bool | None = None, gemv_pin: bool | None = None,
                 oproj_lean: bool | None = None, oproj_split: bool | None = None,
                 kda_preload: bool | None = None, shared_in_fma_front: bool = True,
                 inproj_dsl_max_m: int = INPROJ_DSL_MAX_M, kda_nsplit: int | None = None, kda_head_min="module",
                 kda_late_stores: bool | None = None, tail_ring: int | None = None, kda_dsmem_tx: bool | None = None,
                 topk_split: bool | None = None, gemv_prefetch: int | None = None,
                 experts_route_direct: bool | None = None, experts_ring_fit: bool | None = None,
                 experts_tagged: bool = False, experts_lean: bool | None = None, experts_alt_parts: int | None = None,
                 tail_norm_fused: bool = True, inproj_engine: str | None = None,
                 inproj_early_trigger: bool | None = None, inproj_joint: bool | None = None,
                 inproj_mid: str | None = None, inproj_mid_early: bool | None = None, oproj_mid: str | None = None,
                 oproj_wide: str | None = None, oproj_wide_plan: dict | None = None,
                 inproj_tiled: bool | None = None, norm_cluster_min_m: int | None = None,
                 norm2_cluster: int | None = None,
                 oproj_max_kp: int = OPROJ_FUSED_MAX_KP, inproj_blas: str | None = None,
                 kda_proj_first: bool | None = None, inproj_wide: str | None = None,
                 inproj_wide_early: bool | None = None, inproj_wide_plan: dict | None = None,
                 inproj_wide_tiled: bool | str = False):
        from .kernels import kda_conv_gate_step as kda_mod
        from .kernels.moe_mxfp4_experts import prepare_mxfp4_experts
        from .kernels.moe_tail import prepare_shared_gate_up
        from .kernels.router_down_topk import prepare_front_shared_weight, prepare_front_weight
        self.cfg, self.w, self.P = cfg, w, Precision.model()
        P = self.P
        self.u_attn = attn_res_u(w.attn_res, P).float().contiguous()
        self.u_mlp = attn_res_u(w.mlp_res, P).float().contiguous()
        a = w.attn
        if isinstance(a, KDAWeights):
            H = cfg.kda_heads
            rows = torch.cat([a.q_proj, a.k_proj, a.v_proj, a.g_proj, a.f_a_proj, a.b_proj])
            pad = kda_mod.proj_width(H) - rows.shape[0]
            self.in_proj = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]).contiguous()
            self.conv_w = torch.cat([a.q_conv, a.k_conv, a.v_conv]).view(-1, cfg.short_conv_kernel_size).float().contiguous()
            self.stock_attn = None
        else:
            from .measure.impls import StockImpl
            self.stock_attn = StockImpl(cfg, w, max_batch=max_batch)
        m = w.mlp
        if isinstance(m, MoEWeights):
            # versions 2-3 (the fast-prev A/B) decode the nibble layout only; otherwise the layout is "auto"
            layout = "nibble" if experts_layout == "nibble" or (experts_version or 4) < 4 else "auto"
            self.experts = prepare_mxfp4_experts(m.w1_packed, m.w1_scale, m.w3_packed, m.w3_scale, m.w2_packed,
                                                 m.w2_scale, layout=layout)
            self.shared_gu = prepare_shared_gate_up(m.shared_gate, m.shared_up)
            self.e_bias = m.e_score_correction_bias.float().contiguous()
            # the cuBLAS tail's (M > tail_dsl_max_m) RMSNorm weight: BF16 for the fused norm; in fp32 for the
            # three-kernel A/B, cast once here (the cast per call was its own ~3 us kernel in the rank8 b64
            # timeline, records-2674eff-s19.json)
            self.tail_norm = m.norm.contiguous() if tail_norm_fused else m.norm.float().contiguous()
            self.tail_norm_fused = tail_norm_fused
            # The shared experts' gate/up rows ride in the front's pass over x: in the cuBLAS front's GEMM (M >
            # front_dsl_max_m; TopkFromLogits forms h), where the separate gate/up kernel was 20 us on the critical
            # path at b64 (records-50b6243-rotperf.json), and since session 7 in the fused FMA front's last CTAs
            # (router v2.7, M <= 4; shared_in_fma_front=False / "fast-s9front" keeps the separate kernel there): in
            # the b1 timeline that kernel ended 7.7 us after the router and the experts started only then
            # (records-001a431-s8.json). Not with the side-stream overlap, which runs it apart. [W_r; W_down] is
            # the packed weight's first rows, so the front without the fold reads a view of the same memory.
            self.front_sh = None
            if shared_in_front and not overlap_shared:
                self.front_sh = prepare_front_shared_weight(m.gate, m.down, m.shared_gate, m.shared_up)
                self.front = self.front_sh[:m.gate.shape[0] + m.down.shape[0]]
            else:
                self.front = prepare_front_weight(m.gate, m.down)
            self.shared_in_fma_front = shared_in_fma_front and self.front_sh is not None
        self._ws = None
        self._bufs: dict[str, torch.Tensor] = {}
        # The shared experts' gate/up depends on x alone, so it may run on a second stream (forked and joined
        # inside the captured graph) beside the router and the routed experts. Off by default: in the 11595c4
        # sweep the whole layer was 7 % slower with it at rank16 b1, 2.7 % faster at rank8 b1 and within 2 %
        # elsewhere, i.e. no measured gain for a more complex graph (LOG.md).
        self.overlap_shared = overlap_shared
        # k3fast.kernels.moe_mxfp4_experts version log. experts_cluster: None = default_cluster; a callable MB -> C selects
        # another rule (the "fast-prev" A/B runs the defaults before 2026-11-29: v3, C = 8 up to MB 8, else 4).
        # None: moe_mxfp4_experts.default_version per batch bucket (at buckets <= 2 v7 since session 8, v8 at b1 where
        # its row blocks split the w2 tiles evenly since session 18; else v4)
        self.experts_version = experts_version
        self.experts_cluster = experts_cluster
        self.gemv_mma = gemv_mma      # rms_gemv.gemv's kernel for M > 4: "v2" or the opt-in "splitk"
        self.tail_dsl_max_m = tail_dsl_max_m
        self.gemv_dsl_max_m = gemv_dsl_max_m
        self.inproj_dsl_max_m = min(inproj_dsl_max_m, gemv_dsl_max_m)
        # the KDA step's value-row split (None: kda_conv_gate_step.choose_nsplit: 8 up to 64 request-heads, 4 above, 1
        # (v9.1) from its HEAD_CTA_MIN = 192). "fast-kdans8"
        # runs 8 at every batch, the alternative its v1 log named for large batches; measured slower at b64
        # (records-0bc90c0-s11.json: attention 68.3 against 65.2 us at rank16, 111.3 against 101.6 at rank8)
        self.kda_nsplit = kda_nsplit
        # v9 (one CTA per request and head, the state in shared memory) from kda_head_min request-heads on, when
        # kda_nsplit is None ("module": kda_conv_gate_step.HEAD_CTA_MIN; None: never, "fast-s22kda")
        self.kda_head_min = kda_head_min
        # None: rms_gemv.NORM_CLUSTER_MIN_M (v15: the AttnRes norms that run as their own kernels as clusters of
        # NORM_CLUSTER CTAs per token from that batch, 3); "fast-normc1" never, "fast-normc9" above M = 8 only
        self.norm_cluster_min_m = norm_cluster_min_m
        # the AttnRes #2 norm's CTAs per token where it runs apart from o_proj, when set (session 28, opt-in: at b64 a
        # dependent grid of clusters of 4 was not placed beside a running one in s97, and the #2 norm's clusters of 4
        # follow o_proj's clusters of 4); None: the rule both norms share
        if norm2_cluster is not None:
            from .kernels.rms_gemv import NORM_CLUSTERS
            if norm2_cluster not in NORM_CLUSTERS:
                raise ValueError(f"norm2_cluster must be None or one of {NORM_CLUSTERS}, got {norm2_cluster!r}")
        self.norm2_cluster = norm2_cluster
        self.oproj_max_kp = oproj_max_kp     # the widest o_proj input the fused oproj_attnres takes (oproj_fused)
        self.inproj_blas = inproj_blas       # None: INPROJ_BLAS (cublasLt for the in_proj's cuBLAS GEMM); "fast-inmm"
        # None: kda_conv_gate_step.HEAD_PROJ_FIRST (v9.2: the state's bulk copies behind the first token's
        # projection loads, in the one-CTA-per-head build; on since s84); "fast-s24kda" turns it off
        self.kda_proj_first = kda_proj_first
        # None: kda_conv_gate_step.LATE_STORES (v5: write-backs after the last cluster barrier, no end fence behind
        # the early trigger); "fast-s17kda" keeps v3's order
        self.kda_late_stores = kda_late_stores
        self.kda_dsmem_tx = kda_dsmem_tx     # None: kda_conv_gate_step.DSMEM_TX (v6, on; "fast-s19kda" is v5)
        self.tail_ring = tail_ring           # None: moe_tail.RING_DEPTH (2; "fast-s19tail" = 0, v1's registers)
        self.front_dsl_max_m = front_dsl_max_m
        self.router_rolled = router_rolled   # None: router_down_topk.TOPK_ROLLED (the top-k rounds as a loop, v2.4)
        self.topk_split = topk_split         # None: router_down_topk.TOPK_SPLIT (TopkFromLogits over 4 warps, v2.8)
        # Where the fused front serves (M <= front_dsl_max_m), launch the shared gate/up after the routed experts
        # instead of between the router and the experts (opt-in, "fast-shlate"). At b1 the experts kernel fills 64
        # SMs, so the gate/up CTAs wait beside it with their weights loaded and finish a few us after it, where in
        # line they cost ~7.5 us between the router and the experts (records-cd4a730-s5perf.json, the b1 timeline).
        # The gate/up then launches the tail at its start (moe_tail early_trigger), so the tail still prefetches
        # during the experts.
        self.shared_late = shared_late
        self.gemv_groups = gemv_groups       # None: rms_gemv.FUSED_GROUPS (2 = the fused in_proj's v3, opt-in)
        self.gemv_prefetch = gemv_prefetch   # None: rms_gemv.PREFETCH_GROUPS (1; 2 / 3: its v7, "fast-inpf2" / 3)
        # None: INPROJ_ENGINE ("ring": at M <= 2 the fused in_proj streams its weights through rms_gemv_ring's
        # bulk-copy shared-memory ring, rms_gemv v12; "fma": rms_gemv's register-load kernel, "fast-infma")
        if inproj_engine not in (None, "fma", "ring"):
            raise ValueError(f"inproj_engine must be None, 'fma' or 'ring', got {inproj_engine!r}")
        self.inproj_engine = inproj_engine
        # None: INPROJ_MID / INPROJ_MID_EARLY / OPROJ_MID (the GEMVs at M 3..8 on cuBLAS or rms_gemv_ring v13)
        for name, v in (("inproj_mid", inproj_mid), ("oproj_mid", oproj_mid)):
            if v not in (None, "cublas", "ring"):
                raise ValueError(f"{name} must be None, 'cublas' or 'ring', got {v!r}")
        self.inproj_mid, self.inproj_mid_early, self.oproj_mid = inproj_mid, inproj_mid_early, oproj_mid
        # None: OPROJ_WIDE (o_proj's GEMM before its separate AttnRes #2 kernel on cuBLAS or gemm_wgmma_splitk)
        _wide_engine("oproj_wide", oproj_wide, OPROJ_WIDE)
        self.oproj_wide, self.oproj_wide_plan = oproj_wide, oproj_wide_plan
        # None: INPROJ_WIDE / INPROJ_WIDE_EARLY (the in_proj's GEMM at 8 < M <= 64 on cuBLAS or gemm_wgmma_splitk)
        _wide_engine("inproj_wide", inproj_wide, INPROJ_WIDE)
        self.inproj_wide, self.inproj_wide_early = inproj_wide, inproj_wide_early
        self.inproj_wide_plan = inproj_wide_plan
        # gemm_wgmma_splitk v2 (True): its own copy of the in_proj, each ring stage's tile one contiguous run; v4
        # ("bulk"): that copy pre-swizzled, read by 1-D bulk copies (used wherever the engine rule picks the GEMM)
        if inproj_wide_tiled not in (False, True, "bulk"):
            raise ValueError(f"inproj_wide_tiled must be False, True or 'bulk', got {inproj_wide_tiled!r}")
        self.in_proj_wide_tiled = None
        if (inproj_wide_tiled and self.stock_attn is None
                and (INPROJ_WIDE if inproj_wide is None else inproj_wide) in ("wgmma", "auto")):
            from .kernels.gemm_wgmma_splitk import BK, tile_weight
            self.in_proj_wide_tiled = tile_weight(self.in_proj, (inproj_wide_plan or {}).get("bk", BK),
                                                  swizzle=inproj_wide_tiled == "bulk")
        # None: INPROJ_MID_TILED. The tiled copy exists only where the v13 path can run (M 3..8 within max_batch)
        self.inproj_tiled = INPROJ_MID_TILED if inproj_tiled is None else inproj_tiled
        self.in_proj_tiled = None
        if (self.inproj_tiled and self.stock_attn is None and max_batch > inproj_dsl_max_m
                and (INPROJ_MID if inproj_mid is None else inproj_mid) == "ring"):
            from .kernels.rms_gemv_ring import mma_tile_weight
            self.in_proj_tiled = mma_tile_weight(self.in_proj)
        # None: the in_proj engine's default when attn_early_trigger, else False. The ring launches the KDA step at
        # its end (rms_gemv_ring v12.1, the default since s47: with the early trigger the KDA CTAs sat beside the
        # ring's CTAs from its start and the chain after it took ~2 us longer at rank8 b1); "fast-ringearly" is the
        # A/B, "fast-ringlate" the name s47 measured v12.1 under
        self.inproj_early_trigger = inproj_early_trigger if inproj_early_trigger is not None else \
            (None if attn_early_trigger else False)
        # The attention chain's PDL triggers right after each kernel's wait (in_proj -> KDA -> o_proj), so each
        # dependent's weight/state prologue overlaps its predecessor (rms_gemv v5, kda_conv_gate_step v2). The
        # default since 001a431: rank16 attention half b1 39.6 -> 36.5 us (records-001a431-s8.json); A/B
        # "fast-endtrig" keeps the triggers at the kernels' ends
        self.attn_early_trigger = attn_early_trigger
        self.inproj_joint = inproj_joint     # None: rms_gemv_ring.JOINT_PROLOGUE (v12.2; False: "fast-nojoint")
        self.oproj_preload = oproj_preload   # None: oproj_attnres.PRELOAD_WPOST (True: its v1.2, "fast-wpost")
        self.oproj_lean = oproj_lean         # None: oproj_attnres.LEAN_SYNC (v1.5; False: "fast-opfence")
        self.oproj_split = oproj_split       # None: oproj_attnres.SPLIT_ROWS (True: its v1.6, "fast-op32")
        self.gemv_pin = gemv_pin             # None: rms_gemv.PIN_LOADS (True: the in_proj GEMV's v6, "fast-gemvpin")
        self.kda_preload = kda_preload       # None: kda_conv_gate_step.PRELOAD (True: its v3, "fast-kdapre")
        # None: moe_mxfp4_experts.DEFAULT_WARPS (16). A 16-warp CTA takes the whole register file, so the PDL-
        # launched tail can no longer sit beside it and prefetch its weights during the experts (the layer A/B
        # "fast-w8" measures what that overlap was worth against the 16 warps' faster loop)
        self.experts_warps = experts_warps
        # None: moe_mxfp4_experts.ROUTE_DIRECT (route1 at M = 1: the pairs as segments, no counting sort; on since
        # session 11, "fast-s21exp" is the sorted A/B)
        self.experts_route_direct = experts_route_direct
        # None: moe_mxfp4_experts.RING_FIT (on since session 13: the experts' ring depths fitted to their K steps at
        # batch buckets > 2, and since session 14 at <= 2 (v7); "fast-noringfit" is the A/B at the full depth)
        self.experts_ring_fit = experts_ring_fit
        self.experts_tagged = experts_tagged    # v8.3's tagged h exchange (v8 only; version log)
        self.experts_lean = experts_lean        # None: moe_mxfp4_experts.LEAN_ARRIVE (version log "lean_arrive")
        # None: moe_mxfp4_experts.alt_parts_rule (v5.2 at buckets 4 / 8 since session 33); 0: v5.1 ("fast-v51")
        self.experts_alt_parts = experts_alt_parts
        self.variant = (("overlap-shared" if overlap_shared else "serial") + (f", experts v{self.experts_version}" if self.experts_version else ", experts default_version")
                        + ("" if experts_cluster is None else f", clusters {getattr(experts_cluster, '__name__', experts_cluster)}")
                        + ("" if gemv_mma == "v2" else f", in_proj mma {gemv_mma}")
                        + ("" if tail_dsl_max_m == TAIL_DSL_MAX_M else f", moe_tail up to M={tail_dsl_max_m}")
                        + ("" if gemv_dsl_max_m == GEMV_DSL_MAX_M else f", o_proj fused (oproj_attnres) up to M={gemv_dsl_max_m}")
                        + ("" if inproj_dsl_max_m == INPROJ_DSL_MAX_M else f", in_proj DSL GEMV up to M={inproj_dsl_max_m}")
                        + ("" if kda_nsplit is None else f", KDA nsplit {kda_nsplit}")
                        + ("" if kda_head_min == "module" else f", KDA one CTA per head from {kda_head_min} request-heads")
                        + ("" if norm_cluster_min_m is None else f", AttnRes norm clusters from M={norm_cluster_min_m}")
                        + ("" if norm2_cluster is None else f", AttnRes #2 norm {norm2_cluster} CTAs per token")
                        + ("" if oproj_max_kp == OPROJ_FUSED_MAX_KP else f", fused o_proj up to K={oproj_max_kp}")
                        + ("" if inproj_blas is None else f", in_proj BLAS {inproj_blas}")
                        + ("" if inproj_wide is None else f", in_proj GEMM at M 9-64 {inproj_wide}")
                        + ("" if inproj_wide_early is None
                           else f", its norm's trigger {'early' if inproj_wide_early else 'late'}")
                        + ("" if inproj_wide_plan is None else f", its plan {inproj_wide_plan}")
                        + ({False: "", True: ", its tiled weight", "bulk": ", its weight by bulk copies (v4)"}[
                            inproj_wide_tiled])
                        + ("" if kda_proj_first is None else f", KDA proj first {'on' if kda_proj_first else 'off'}")
                        + ("" if kda_late_stores is None else f", KDA late stores {'on' if kda_late_stores else 'off'}")
                        + ("" if tail_ring is None else f", moe_tail ring {tail_ring}")
                        + ("" if kda_dsmem_tx is None else f", KDA st.async exchange {'on' if kda_dsmem_tx else 'off'}")
                        + ("" if topk_split is None else f", TopkFromLogits split {'on' if topk_split else 'off'}")
                        + ("" if front_dsl_max_m == FRONT_DSL_MAX_M else f", router front up to M={front_dsl_max_m}")
                        + ("" if experts_warps is None else f", experts {experts_warps} warps")
                        + ("" if experts_route_direct is None
                           else f", experts routing at b1 {'direct' if experts_route_direct else 'sorted'}")
                        + ("" if experts_ring_fit is None else f", experts ring fit {'on' if experts_ring_fit else 'off'}")
                        + (", experts v8 exchange tagged" if experts_tagged else "")
                        + ("" if experts_lean is None else f", experts lean arrivals {'on' if experts_lean else 'off'}")
                        + ("" if experts_alt_parts is None else f", experts v5.2 parts {experts_alt_parts}")
                        + ("" if tail_norm_fused else ", cuBLAS tail norm in 3 kernels")
                        + ("" if shared_in_front or overlap_shared else ", shared gate/up apart from both fronts")
                        + ("" if shared_in_fma_front or not shared_in_front else ", shared gate/up apart from the fused front")
                        + ("" if router_rolled is None else f", router top-k {'rolled' if router_rolled else 'unrolled'}")
                        + (", shared gate/up after the experts" if shared_late else "")
                        + ("" if gemv_groups is None else f", fused in_proj {gemv_groups} row groups per iteration")
                        + ("" if gemv_prefetch is None else f", fused in_proj {gemv_prefetch} row groups prefetched ahead")
                        + ("" if inproj_engine is None else f", in_proj engine {inproj_engine} at M <= 2")
                        + ("" if inproj_early_trigger is None else
                           f", in_proj PDL trigger {'early' if inproj_early_trigger else 'at its end'}")
                        + ("" if inproj_joint is None else f", ring in_proj joint prologue {'on' if inproj_joint else 'off'}")
                        + ("" if inproj_mid is None else f", in_proj GEMV at M 3-8 {inproj_mid}")
                        + ("" if inproj_tiled is None else f", in_proj v13 weight {'tiled' if inproj_tiled else 'row-major'}")
                        + ("" if inproj_mid_early is None else
                           f", AttnRes norm trigger {'early' if inproj_mid_early else 'at its end'} before it")
                        + ("" if oproj_mid is None else f", o_proj GEMV at M 5-8 {oproj_mid}")
                        + ("" if oproj_wide is None else f", o_proj GEMM apart from its norm {oproj_wide}"
                           + ("" if not oproj_wide_plan else f" {oproj_wide_plan}"))
                        + ("" if kda_preload is None else f", KDA proj preload {'on' if kda_preload else 'off'}")
                        + ("" if gemv_pin is None else f", in_proj loads pinned {'on' if gemv_pin else 'off'}")
                        + ("" if oproj_preload is None else f", o_proj w_post preload {'on' if oproj_preload else 'off'}")
                        + ("" if oproj_lean is None else f", o_proj lean arrivals {'on' if oproj_lean else 'off'}")
                        + ("" if oproj_split is None else f", o_proj 32-row CTAs {'on' if oproj_split else 'off'}")
                        + ("" if attn_early_trigger else ", attention PDL triggers at the kernels' ends")
                        + (f", experts layout {self.experts.layout}" if hasattr(self, "experts") else ""))
        self._side = None

    def _fma_front_shared(self, M: int, side) -> bool:
        """Router v2.7: the shared gate/up folded into the fused front (its FMA buckets only; not with the side
        stream, nor with fast-shlate, which moves the gate/up after the experts)."""
        from .kernels.router_down_topk import kernel_path
        return self.shared_in_fma_front and side is None and not self.shared_late and kernel_path(M) == "fma"

    def _experts_cluster(self, M: int):
        if self.experts_cluster is None:
            return None
        from .kernels.moe_mxfp4_experts import m_bucket
        return self.experts_cluster(m_bucket(M))

    # ------------------------------------------------------------------------------------------ halves
    def _norm_cluster(self, io) -> int | None:
        from .kernels.rms_gemv import norm_cluster
        m = self.norm_cluster_min_m
        return None if m is None else norm_cluster(io.partial.shape[0], m)

    def _kda_nsplit(self, batch: int, heads: int) -> int | None:
        """The KDA step's value-row split: kda_nsplit if set, else choose_nsplit with this impl's v9 threshold."""
        if self.kda_nsplit is not None or self.kda_head_min == "module":
            return self.kda_nsplit
        from .kernels.kda_conv_gate_step import choose_nsplit
        return choose_nsplit(batch, heads, self.kda_head_min)

    def attn(self, io) -> None:
        if self.stock_attn is not None:
            return self.stock_attn.attn(io)
        from .kernels.kda_conv_gate_step import kda_conv_gate_step
        from .kernels.oproj_attnres import oproj_attnres
        cfg, w, l = self.cfg, self.w, io.layer
        boundary = cfg.is_block_boundary(l)
        nb = cfg.num_blocks_before(l)
        # p' = p + delta goes to a scratch row (the fused prologue reads p in every CTA, so it may not
        # write p in place); o_proj + AttnRes #2 then reads p' and writes the layer's partial sum.
        p1 = self._scratch("p1", io.partial)
        norm_cl = self._norm_cluster(io)     # both AttnRes norms that run apart use one cluster size
        with stage("k3.kda.in_proj"):
            proj, _ = attnres_in_proj(io.blocks, nb, io.partial, io.delta, self.u_attn, w.input_layernorm, self.in_proj,
                                      eps=cfg.rms_norm_eps,
                                      block_write=(l // cfg.attn_res_block_size) if boundary else -1,
                                      partial_out=p1, early_trigger=self.inproj_early_trigger,
                                      engine=self.inproj_engine, joint=self.inproj_joint,
                                      mid=self.inproj_mid, mid_early=self.inproj_mid_early,
                                      w_tiled=self.in_proj_tiled,
                                      mma=self.gemv_mma if io.partial.shape[0] <= self.inproj_dsl_max_m else "cublas",
                                      fused_groups=self.gemv_groups, pin_loads=self.gemv_pin,
                                      prefetch_groups=self.gemv_prefetch, norm_cluster=norm_cl, blas=self.inproj_blas,
                                      wide=self.inproj_wide, wide_early=self.inproj_wide_early,
                                      wide_plan=self.inproj_wide_plan, wide_w=self.in_proj_wide_tiled)
        with stage("k3.kda.core"):
            y = kda_conv_gate_step(proj, w.attn.f_b_proj, self.conv_w, w.attn.A_log, w.attn.dt_bias, w.attn.o_norm,
                                   io.state.conv, io.state.recurrent, io.slots, heads=cfg.kda_heads,
                                   lower_bound=cfg.gate_lower_bound, eps=cfg.rms_norm_eps,
                                   early_trigger=self.attn_early_trigger, preload=self.kda_preload,
                                   nsplit=self._kda_nsplit(io.slots.shape[0], cfg.kda_heads),
                                   late_stores=self.kda_late_stores, dsmem_tx=self.kda_dsmem_tx,
                                   proj_first=self.kda_proj_first)
        with stage("k3.o_proj"):
            if oproj_fused(io.partial.shape[0], w.attn.o_proj.shape[1], self.gemv_dsl_max_m, self.oproj_max_kp):
                oproj_attnres(y, w.attn.o_proj, io.blocks, nb + int(boundary), p1, self.u_mlp,
                              w.post_attention_layernorm, eps=cfg.rms_norm_eps, boundary=boundary,
                              out_x=io.x_mlp, out_partial=io.partial, preload_wpost=self.oproj_preload,
                              lean_sync=self.oproj_lean, split_rows=self.oproj_split)
            else:
                oproj_attnres_cublas(y, w.attn.o_proj, io.blocks, nb + int(boundary), p1, self.u_mlp,
                                     w.post_attention_layernorm, eps=cfg.rms_norm_eps, boundary=boundary,
                                     zeros=self._zeros("p0", p1), out_x=io.x_mlp, out_partial=io.partial,
                                     gemv=self.oproj_mid,
                                     norm_cluster=norm_cl if self.norm2_cluster is None else self.norm2_cluster,
                                     wide=self.oproj_wide,
                                     wide_plan=self.oproj_wide_plan)

    def moe(self, io) -> None:
        from .kernels.moe_mxfp4_experts import moe_mxfp4_experts
        from .kernels.moe_tail import moe_tail, shared_expert_gate_up
        from .kernels.router_down_topk import router_down_topk, router_down_topk_cublas
        cfg, m = self.cfg, self.w.mlp
        x = io.x_mlp
        side = self._side_stream() if self.overlap_shared else None
        h = None              # the shared experts' SiTU output: the side stream, the cuBLAS front, or its own kernel
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
            # h comes from a buffer owned by this object (allocated at the first, eager call), so no
            # allocation is made on, or freed across, the side stream
            h = self._buf("h", (x.shape[0], self.shared_gu.shape[0] // 2), x)
            with torch.cuda.stream(side), stage("k3.moe.shared"):
                shared_expert_gate_up(x, self.shared_gu, out=h)
        with stage("k3.router"):
            kw = dict(n_experts=cfg.num_experts, top_k=cfg.num_experts_per_token, scaling=cfg.routed_scaling_factor,
                      rolled=self.router_rolled)
            if x.shape[0] <= self.front_dsl_max_m:
                if self._fma_front_shared(x.shape[0], side):
                    z, ids, ws, h = router_down_topk(x, self.front_sh, self.e_bias, shared=self.shared_gu.shape[0] // 2,
                                                     **kw)
                else:
                    z, ids, ws = router_down_topk(x, self.front, self.e_bias, **kw)
            elif self.front_sh is not None and side is None:       # the shared gate/up in the same GEMM (k3.router covers both)
                z, ids, ws, h = router_down_topk_cublas(x, self.front_sh, self.e_bias,
                                                        shared=self.shared_gu.shape[0] // 2, split=self.topk_split, **kw)
            else:
                z, ids, ws = router_down_topk_cublas(x, self.front, self.e_bias, split=self.topk_split, **kw)
        late = self.shared_late and side is None and h is None
        if side is None and h is None and not late:
            with stage("k3.moe.shared"):
                h = shared_expert_gate_up(x, self.shared_gu)
        with stage("k3.moe.experts"):
            r = moe_mxfp4_experts(z, ids, ws, self.experts, None, None, None,
                                  situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta, workspace=self._workspace(x),
                                  version=self.experts_version, cluster=self._experts_cluster(x.shape[0]),
                                  warps=self.experts_warps, route_direct=self.experts_route_direct,
                                  ring_fit=self.experts_ring_fit, tagged=self.experts_tagged,
                                  lean_arrive=self.experts_lean, alt_parts=self.experts_alt_parts)
        if late:
            with stage("k3.moe.shared"):
                h = shared_expert_gate_up(x, self.shared_gu, early_trigger=True)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        if x.shape[0] <= self.tail_dsl_max_m:
            with stage("k3.moe.up"):
                moe_tail(r, m.norm, m.up, h, m.shared_down, eps=cfg.rms_norm_eps, out=io.out, ring=self.tail_ring)
        else:
            moe_tail_cublas(r, self.tail_norm, m.up, h, m.shared_down, eps=cfg.rms_norm_eps, out=io.out,
                            fused_norm=self.tail_norm_fused)

    def layer(self, io) -> None:
        self.attn(io)
        self.moe(io)

    def _side_stream(self):
        if self._side is None and torch.cuda.is_available():
            self._side = torch.cuda.Stream()
        return self._side

    def _workspace(self, x):
        if self._ws is None:            # allocated at the first (eager) call, before any graph capture
            from .kernels.moe_mxfp4_experts import make_workspace
            self._ws = make_workspace(self.cfg.routed_expert_hidden_size, x.device)
        return self._ws

    def _buf(self, name: str, shape, like):
        t = self._bufs.get(name)
        if t is None or tuple(t.shape) != tuple(shape):
            t = self._bufs[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return t

    def _zeros(self, name: str, like):
        """A zero tensor shaped like ``like``, owned here and never written (allocated at the first, eager call)."""
        t = self._bufs.get(name)
        if t is None or t.shape != like.shape:
            t = self._bufs[name] = torch.zeros_like(like)
        return t

    def _scratch(self, name: str, like):
        t = self._bufs.get(name)
        if t is None or t.shape != like.shape:
            t = self._bufs[name] = torch.empty_like(like)
        return t
