"""The implementations the traces compare, by name: ``ref``, ``compiled``, ``stock`` and ``fast`` with its live
A/B contenders (k3fast.layer.CONTENDERS)."""
from __future__ import annotations

from k3ref import K3Config
from k3ref.weights import LayerWeights

from ..layer_io import LayerIO, make_io  # noqa: F401  (re-exported: the harness builds its buffers here)
from ..stock.layer import StockImpl
from ..stock.ref import CompiledImpl, RefImpl
from ..kernels.moe_mxfp4_experts import cluster_before_20261129

IMPLS = {"ref": RefImpl, "compiled": CompiledImpl, "stock": StockImpl}


# The fused path's layer-level A/B variants: FastImpl keyword arguments by name. Each is an alternative to one
# default, measured beside "fast" in one run (k3fast/LOG.md; each record names its variant in `fast_variant`).
FAST_VARIANTS = {
    "fast": {},
    "fast-prev": {"experts_version": 3, "experts_cluster": cluster_before_20261129},  # experts before 2026-11-29
    "fast-v5": {"experts_version": 5},          # experts v5 at every bucket (the default above bucket 2 since s31)
    "fast-v51": {"experts_alt_parts": 0},       # experts v5.1: v5's passes only (v5.2, the default at buckets 4 / 8
    #                                             since session 33, takes v7's items on the device when passes are few)
    "fast-v6": {"experts_version": 6},          # experts v6: each expert over two clusters at buckets <= 2 (opt-in)
    "fast-v7": {"experts_version": 7},          # experts v7: parts of I over clusters of 2 (buckets <= 8 since
    #                                             session 31; the default at <= 2 until session 18, still at bucket 2
    #                                             and rank8 b1)
    "fast-v8": {"experts_version": 8},          # experts v8 at buckets <= 2 (the default at bucket 1 since session
    #                                             18 where its row blocks are even; forced here at b2 and rank8 b1)
    "fast-v8tag": {"experts_version": 8, "experts_tagged": True},   # experts v8.3: h as tagged words (opt-in)
    "fast-xlean": {"experts_lean": True},     # experts lean_arrive: no per-thread fence before the arrivals (opt-in)
    "fast-s13": {"experts_version": 4},         # experts v4 at every bucket (before session 8's v7 at buckets <= 2;
    #                                             at buckets > 2 the default until session 31's v5)
    "fast-nibble": {"experts_layout": "nibble"},  # experts in the nibble layout (the default before 2026-11-29)
    "fast-w8": {"experts_warps": 8},            # experts at 8 warps per CTA (the default before 16)
    "fast-route1": {"experts_route_direct": True},  # experts route1: at M = 1 no counting sort (= fast since s11)
    "fast-s21exp": {"experts_route_direct": False},  # the experts' counting sort at M = 1 (before session 11)
    "fast-noringfit": {"experts_ring_fit": False},   # experts rings at the full depth 8 (before session 13 at
    #                                                  buckets > 2, before session 14 at <= 2; there s29 ran the
    #                                                  A/B as "fast-ringfit7", ring_fit on, at fdcdffc)
    # (fast-stagefc1, experts v7's FC1 rows through shared memory at b <= 2, was measured at 592860e (s38), slower
    # at all four cells, and removed)
    # (fast-xco / fast-xcot3 / fast-xc100, the experts at 8 warps and the largest shared-memory carveout so that the
    # tail's CTAs fit beside them, and fast-t3 / fast-t4, the tail's ring of 3 / 4, were measured at 380f788 (s40)
    # and 4d82a0d (s41), no faster, and removed)
    # (fast-xl2 / fast-r1xl2, the experts' per-line L2 prefetch of a work item's rows, were measured slower at
    # 5f1f620 and removed)
    "fast-alldsl": {"tail_dsl_max_m": 64, "gemv_dsl_max_m": 64, "inproj_dsl_max_m": 64,  # no cuBLAS dispatch
                    "front_dsl_max_m": 64, "oproj_max_kp": 1 << 30},
    # the fused oproj_attnres at every o_proj width (before session 23: at full width too)
    "fast-opfull": {"oproj_max_kp": 1 << 30},
    # the in_proj's cuBLAS GEMM (M > 8) on torch's default library, cublas (before session 24: fast.INPROJ_BLAS)
    "fast-inmm": {"inproj_blas": "default"},
    "fast-taildsl": {"tail_dsl_max_m": 64},     # k3fast.kernels.moe_tail at every batch (before 2026-11-29)
    "fast-s27tail": {"tail_norm_fused": False},  # the cuBLAS tail's norm as 3 kernels, fp32 copy (before session 13)
    "fast-gemv0": {"gemv_dsl_max_m": 0},        # in_proj / o_proj GEMMs on cuBLAS at every batch
    "fast-gemv8": {"gemv_dsl_max_m": 8, "inproj_dsl_max_m": 8},  # ... above M = 8 (the threshold before session 5)
    "fast-splitk": {"gemv_mma": "splitk", "gemv_dsl_max_m": 64, "inproj_dsl_max_m": 64},  # in_proj at M > 4 on gemv_splitk
    "fast-s10": {"inproj_dsl_max_m": 4},        # the in_proj's FMA GEMV at M = 3-4 (before session 7's threshold)
    "fast-kdans8": {"kda_nsplit": 8},           # the KDA step split 8 ways at every batch (4 above 64 request-heads)
    # the KDA step's v9.1 (one CTA per request and head) from 192 request-heads is the default since session 22:
    # "fast-s22kda" is the cluster build (nsplit 4 / 8) at every batch, as before; "fast-kdahead" was v9.1 as an
    # opt-in (= fast since), "fast-kdahead48" v9.1 from 48 request-heads (rank16 b8 / b16, rank8 b4 / b8)
    "fast-s22kda": {"kda_head_min": None},
    "fast-kdahead": {"kda_head_min": 192},
    "fast-kdahead48": {"kda_head_min": 48},
    # kda_conv_gate_step v9.2 (the default since s84): the one-CTA-per-head build's state copies behind the first
    # token's projection loads. "fast-s24kda" is the A/B (v9.1, the copies before the PDL wait); "fast-kdapf" the
    # name s84's records give v9.2 (= fast since)
    "fast-s24kda": {"kda_proj_first": False},
    "fast-kdapf": {"kda_proj_first": True},
    # gemm_wgmma_splitk v1 (session 25, opt-in until measured): the in_proj's GEMM at 8 < M <= 64 on WGMMA with a
    # cluster K split instead of cublasLt, behind the AttnRes norm (its trigger after its wait / at its end)
    "fast-inwg": {"inproj_wide": "wgmma", "inproj_wide_early": True},
    "fast-inwgoff": {"inproj_wide": "cublas"},   # the in_proj's GEMM on cuBLAS at every M > 8 (the default before s26)
    # both GEMMs on cuBLAS wherever they run apart from their norms: at rank16 M > 16 the default before session 28
    "fast-inwgoff-opwgoff": {"inproj_wide": "cublas", "oproj_wide": "cublas"},
    # session 26: o_proj's GEMM above M = 8 on gemm_wgmma_splitk (its W ring requested before the PDL wait, during the
    # KDA step's tail) instead of cuBLAS at every width; -d3 / -d2: rings of 3 / 2 stages, which leave room beside the
    # KDA CTAs. The default since session 26 at rank8's width (fast.oproj_wide_choice); "fast-opwgoff" the A/B
    "fast-opwg": {"oproj_wide": "wgmma"},
    "fast-opwgoff": {"oproj_wide": "cublas"},
    # (fast-n2pre / fast-opwg-n2pre, the AttnRes #2 norm reading earlier layers' blocks before its PDL wait (rms_gemv
    # v16), were measured at 2009964 (s92), no faster, and removed)
    "fast-opwgd3": {"oproj_wide": "wgmma", "oproj_wide_plan": {"stages": 3}},
    "fast-opwgd2": {"oproj_wide": "wgmma", "oproj_wide_plan": {"stages": 2}},
    "fast-inwglate": {"inproj_wide": "wgmma", "inproj_wide_early": False},
    # session 27: the in_proj's WGMMA GEMM with cuBLAS-like tiles instead of the plan's K split (at rank8 b16 the plan
    # streamed W at ~3.1 TB/s against cuBLAS's ~3.5 in s90d's timeline): 64 / 48 rows per CTA over all of K, one CTA
    # per SM (99 / 131 CTAs at rank8; 14 / 16 stages), and 66 clusters of 2 x 96 rows
    "fast-inwg1bn64": {"inproj_wide": "wgmma", "inproj_wide_early": True, "inproj_wide_plan": {"ksplit": 1, "bn": 64}},
    "fast-inwg1bn48": {"inproj_wide": "wgmma", "inproj_wide_early": True, "inproj_wide_plan": {"ksplit": 1, "bn": 48}},
    "fast-inwg2bn96": {"inproj_wide": "wgmma", "inproj_wide_early": True, "inproj_wide_plan": {"ksplit": 2, "bn": 96}},
    # gemm_wgmma_splitk v3 (session 27): each ring stage loads the token bucket's x rows (16 / 32 / 64) instead of a
    # 64-row box the TMA unit zero-fills past M, one more stage of W where that frees it; in_proj, o_proj and both
    "fast-inwgx": {"inproj_wide": "wgmma", "inproj_wide_early": True, "inproj_wide_plan": {"xrows": "auto"}},
    # ... with 66 clusters of 2 x 96 rows (s94: bare rank8 b16 29.4 us against the plan's 32.4 and cublasLt's 28.5);
    # the default at rank8 M 9..64 since s95 (fast.INPROJ_WIDE_PINS_WIDE), so = fast there; "fast-inwgoff" the A/B
    "fast-inwg2bn96x": {"inproj_wide": "wgmma", "inproj_wide_early": True,
                        "inproj_wide_plan": {"ksplit": 2, "bn": 96, "xrows": "auto"}},
    "fast-opwgx": {"oproj_wide": "wgmma", "oproj_wide_plan": {"xrows": "auto"}},
    "fast-inwgx-opwgx": {"inproj_wide": "wgmma", "inproj_wide_early": True, "inproj_wide_plan": {"xrows": "auto"},
                         "oproj_wide": "wgmma", "oproj_wide_plan": {"xrows": "auto"}},
    # session 28: at b64 the AttnRes norm before the in_proj runs 256 CTAs (clusters of 4 per token, ~34 KB of shared
    # memory each), and at rank16 b64 the plan's GEMM (15 clusters of 8 x 222 KB) started only as the norm ended
    # (3.3-3.5 us into the step, s86-s89), so none of W moved during the norm although the norm triggers it right
    # after its wait; at rank8 b64 the 2 x 96-row clusters started at 1.3 us (s96). The in_proj on clusters of 2 / 4
    # (easier to place beside the norm's CTAs), or on the plan with a ring that fits beside two of them, each with
    # o_proj's WGMMA GEMM (fast-opwg: -0.5 us at rank16 b64 in s90e / s90f / s92). Measured (s97): only clusters of 2
    # started beside the norm, none ended the GEMM sooner, and 4 x 112 rows was fastest (50.8 us against fast-opwg's
    # 52.6 / 53.0) through the KDA step launched from its cluster barrier: the default at rank16 M 17..64 since s98
    # (fast.INPROJ_WIDE_PINS_LARGE_M), so fast-inwg4bn112x-opwg = fast there
    "fast-inwg2bn96x-opwg": {"inproj_wide": "wgmma", "inproj_wide_early": True,
                             "inproj_wide_plan": {"ksplit": 2, "bn": 96, "xrows": "auto"}, "oproj_wide": "wgmma"},
    "fast-inwg2bn64x-opwg": {"inproj_wide": "wgmma", "inproj_wide_early": True,
                             "inproj_wide_plan": {"ksplit": 2, "bn": 64, "xrows": "auto"}, "oproj_wide": "wgmma"},
    "fast-inwg4bn112x-opwg": {"inproj_wide": "wgmma", "inproj_wide_early": True,
                              "inproj_wide_plan": {"ksplit": 4, "bn": 112, "xrows": "auto"}, "oproj_wide": "wgmma"},
    "fast-inwg2bn64xd7-opwg": {"inproj_wide": "wgmma", "inproj_wide_early": True,
                               "inproj_wide_plan": {"ksplit": 2, "bn": 64, "xrows": "auto", "stages": 7},
                               "oproj_wide": "wgmma"},
    "fast-inwgd4-opwg": {"inproj_wide": "wgmma", "inproj_wide_early": True, "inproj_wide_plan": {"stages": 4},
                         "oproj_wide": "wgmma"},
    # ... the AttnRes #2 norm (after o_proj's GEMM, itself clusters of 4 at b64) as clusters of 2 / 8 CTAs per token
    # instead of 4 (FastImpl norm2_cluster; s97: clusters of 2 were placed beside a running grid of clusters of 4)
    "fast-n2c2": {"norm2_cluster": 2},
    "fast-n2c8": {"norm2_cluster": 8},
    # ... and at rank8 the default's 2 x 96-row clusters with 7 stages (140 KB at b64) instead of 11 (225 KB)
    "fast-inwg2bn96xd7": {"inproj_wide": "wgmma", "inproj_wide_early": True,
                          "inproj_wide_plan": {"ksplit": 2, "bn": 96, "xrows": "auto", "stages": 7}},
    # ... with rings of 3 / 2 stages (two CTAs fit per SM, so the plan may count twice the co-resident clusters)
    "fast-inwgd3": {"inproj_wide": "wgmma", "inproj_wide_early": True, "inproj_wide_plan": {"stages": 3}},
    "fast-inwgd2": {"inproj_wide": "wgmma", "inproj_wide_early": True, "inproj_wide_plan": {"stages": 2}},
    # ... v2: reading its own tiled copy of the in_proj (each ring stage's W tile one contiguous run)
    "fast-inwgtiled": {"inproj_wide": "wgmma", "inproj_wide_early": True, "inproj_wide_tiled": True},
    "fast-inwgtiledd3": {"inproj_wide": "wgmma", "inproj_wide_early": True, "inproj_wide_tiled": True,
                         "inproj_wide_plan": {"stages": 3}},
    # ... v4 (session 29): the default engine rule and pins, W's tiles by 1-D bulk copies of a pre-swizzled tiled copy
    # instead of the tensor map (the same bits); the question: does the TMA tensor path hold the ring at ~2.7 TB/s?
    "fast-inwgbulk": {"inproj_wide_tiled": "bulk"},
    # rms_gemv v15 (session 23): the AttnRes norms that run as their own kernels (M >= 3: before v13's ring GEMV at
    # M 3..8, the in_proj's and o_proj's AttnRes #2 before cuBLAS above) as clusters of 4 CTAs per token, the default
    # since s74. "fast-normc1" is the A/B (one CTA per token, as before); "fast-normc9" the clusters only above M = 8
    # (s73's default), "fast-normc3" s73's name for today's default (= fast)
    "fast-normc1": {"norm_cluster_min_m": 65},
    "fast-normc9": {"norm_cluster_min_m": 9},
    "fast-normc3": {"norm_cluster_min_m": 3},
    "fast-s17kda": {"kda_late_stores": False},  # the KDA step's write-backs before its last cluster barrier (v3 order)
    "fast-s19kda": {"kda_dsmem_tx": False},     # the KDA step's cluster-barrier exchanges (v5, before session 10's v6)
    # (fast-kdaocc6, the KDA step's v7: 6 CTAs per SM asked at nsplit 4, was measured at 0e81145 (s24), no faster
    # at rank16 b64 and slower at b16, and removed)
    "fast-s19tail": {"tail_ring": 0},           # moe_tail v1's register stages (before session 10's cp.async ring)
    # the fused in_proj's v3 (2 row groups per iteration) and v7 (2 / 3 row groups in L2 prefetch ahead), opt-ins
    "fast-gemvg2": {"gemv_groups": 2, "inproj_engine": "fma"},
    "fast-inpf2": {"gemv_prefetch": 2, "inproj_engine": "fma"},
    "fast-inpf3": {"gemv_prefetch": 3, "inproj_engine": "fma"},
    # (fast-inxf / fast-inxr, the fused in_proj's x in fp32 shared memory / in registers, were measured at 5f1f620 /
    # c1bb65a, slower and unchanged, and removed)
    # (fast-inev / fast-inev126, the fused in_proj's v10: rows split evenly over 132 / 126 CTAs, were measured at
    # 0e81145 (s23), no faster, and removed)
    # (fast-insplit1 / fast-insplit3, the in_proj's v11 / v11.1: its prologue as attnres_rmsnorm and the GEMV's
    # first row groups staged in shared memory, were measured at b2bc614 (s42) and, with the prologue kernel's early
    # trigger, at 6874cfa (s44), slower both times, and removed in session 16; the code is at 6874cfa)
    # (the fused in_proj's FMA-kernel opt-ins above and below name inproj_engine "fma": at M <= 2 the default is the
    # ring since session 16, which they do not change)
    "fast-inring": {"inproj_engine": "ring"},  # = fast since session 16 (the name s45 measured it under)
    "fast-infma": {"inproj_engine": "fma"},    # the in_proj on rms_gemv's FMA kernel at M <= 2 (before session 16)
    "fast-ringlate": {"inproj_early_trigger": False},  # = fast since s47 (the ring launches the KDA step at its end)
    "fast-ringearly": {"inproj_early_trigger": True},  # the ring's trigger right after its wait (s45-s46's default)
    "fast-injoint": {"inproj_joint": True},    # = fast since s48 (rms_gemv_ring v12.2, the joint prologue)
    "fast-nojoint": {"inproj_joint": False},   # the ring's token-by-token prologue (v12 / v12.1)
    # session 20: the GEMVs at M 3..8 (cuBLAS there before) through rms_gemv_ring v13's tensor-core ring; the in_proj
    # on it is the default since s62 (fast.INPROJ_MID / INPROJ_MID_EARLY)
    "fast-incublas": {"inproj_mid": "cublas"},  # the in_proj GEMV at M 3..8 on cuBLAS (before session 20)
    "fast-inmma": {"inproj_mid": "ring", "inproj_mid_early": False},   # in_proj, the norm's trigger at its end
    "fast-inmmaet": {"inproj_mid": "ring", "inproj_mid_early": True},  # ... after its wait (= fast since s62)
    # o_proj's GEMV at M 5..8 on v13 + attnres_rmsnorm (with o_proj's threshold at 4, as before session 21)
    "fast-opmma": {"gemv_dsl_max_m": 4, "oproj_mid": "ring"},
    "fast-mid": {"gemv_dsl_max_m": 4, "inproj_mid": "ring", "inproj_mid_early": True, "oproj_mid": "ring"},  # = fast-opmma
    "fast-op8": {"gemv_dsl_max_m": 8},         # = fast since session 21 (oproj_attnres, the fused AttnRes #2, to M = 8)
    "fast-op4": {"gemv_dsl_max_m": 4},         # o_proj on cuBLAS + attnres_rmsnorm at M 5..8 (before session 21)
    # session 26: oproj_attnres (the fused AttnRes #2) at M 9..16 too, where o_proj is cuBLAS + attnres_rmsnorm (the
    # fused kernel's GPU tests cover M = 16; its M = 64 build took 23.6 us against cuBLAS's 8.6, kernels-11595c4.json)
    "fast-opm16": {"gemv_dsl_max_m": 16},
    "fast-inwg-opm16": {"inproj_wide": "wgmma", "inproj_wide_early": True, "gemv_dsl_max_m": 16},
    "fast-intiled": {"inproj_tiled": True},    # the in_proj's ring at M 3..8 on its tiled weight (v14)
    # (fast-inmmatrig / fast-intiledtrig, that ring launching the KDA step right after its wait, were measured at
    # 561d389 (s68), slower at all four b4 / b8 cells, and removed)
    # (fast-opstage / fast-opstagelate, oproj_attnres v1.3's rest of the slice in shared memory before the wait,
    # measured slower at s47 and removed, code at 8574eb7; fast-oppf, v1.4's rest into L2, slower at s50, code at
    # ff51150)
    "fast-trig": {"attn_early_trigger": True},  # = fast since 001a431 (the name its records were measured under)
    # rms_gemv v6 (weight loads tied together), kda_conv_gate_step v3 (proj loads right after the wait) and
    # oproj_attnres v1.2 (w_post before the PDL wait): opt-ins measured at 84291ed, defaults since session 7
    "fast-gemvpin": {"gemv_pin": True, "inproj_engine": "fma"},
    "fast-kdapre": {"kda_preload": True},
    "fast-wpost": {"oproj_preload": True},
    "fast-oplean": {"oproj_lean": True},      # oproj_attnres v1.5 (= fast since session 19: its records' name)
    "fast-opfence": {"oproj_lean": False},    # oproj_attnres v1.4's arrival chain (per-thread / post-spin fences)
    "fast-op32": {"oproj_split": True},       # oproj_attnres v1.6: 32-row GEMV CTAs at rank8 M <= 8 (opt-in)
    # the defaults before them
    "fast-s8": {"gemv_pin": False, "kda_preload": False, "oproj_preload": False, "inproj_engine": "fma"},
    "fast-endtrig": {"attn_early_trigger": False},  # in_proj / KDA trigger their dependents at their ends (before)
    # (fast-gemvpf, fast-frontpf and fast-pf, the bulk L2 prefetch of the fused in_proj and of the router front,
    # were measured slower at 1214f05 and removed; so were the tail's, fast-tailpf / fast-shlatepf / fast-tailpfl,
    # at 84291ed)
    "fast-front0": {"front_dsl_max_m": 0},      # the cuBLAS front + TopkFromLogits at every batch
    "fast-front16": {"front_dsl_max_m": 16},    # ... above M = 16 (the threshold before session 5)
    "fast-rolled": {"router_rolled": True},     # router v2.4: the top-k rounds as a loop (opt-in)
    "fast-topk4": {"topk_split": True},         # router v2.8: TopkFromLogits' top-k over its 4 warps (the default now)
    "fast-s12": {"topk_split": False},          # TopkFromLogits' one-warp top-k (before session 8's default)
    "fast-front0r": {"router_rolled": True, "front_dsl_max_m": 0},
    "fast-shapart": {"shared_in_front": False},  # the shared gate/up kernel apart from both fronts
    "fast-s9front": {"shared_in_fma_front": False},  # ... apart from the fused front only (M <= 4; before router v2.7)
    "fast-shlate": {"shared_late": True},       # the shared gate/up after the experts at M <= 4 (opt-in)
    # Until 11595c4 "fast" overlapped the shared experts on a side stream and "fast-serial" did not; since then
    # "fast" is serial.
    "fast-overlap": {"overlap_shared": True},
    "fast-serial": {"overlap_shared": False},
}


def make_impl(name: str, cfg: K3Config, w: LayerWeights, **kw):
    if name in FAST_VARIANTS:
        from ..layer import FastImpl
        return FastImpl(cfg, w, **FAST_VARIANTS[name], **kw)
    if name not in IMPLS:
        raise ValueError(f"unknown implementation {name!r}; expected one of {sorted(IMPLS) + list(FAST_VARIANTS)}")
    return IMPLS[name](cfg, w, **kw) if name == "stock" else IMPLS[name](cfg, w)
