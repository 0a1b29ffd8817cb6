"""k3fast.kernels.gemm_wgmma_splitk on the CPU: the split plan for the K3 in_proj widths, every compile key the layer needs,
the PTX's order (W requested before the PDL wait, x after it; the partials summed through DSMEM between two cluster
barriers), registers without spills, and clear errors for inputs it does not take."""
import math

import pytest
import torch

from k3fast.kernels import gemm_wgmma_splitk as G
from k3fast.kernels._dsl import SMEM_PER_CTA_MAX, dsl_available
from k3fast.kernels.kda_conv_gate_step import proj_width
from k3ref.config import k3_rank

pytestmark = pytest.mark.compile
needs_dsl = pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm_ffi not importable")

K = 7168
IN_PROJ = {tp: proj_width(k3_rank(tp).kda_heads) for tp in (16, 8)}


def test_plan_for_the_in_proj_widths():
    assert IN_PROJ == {16: 3216, 8: 6288}
    assert G.plan(IN_PROJ[16], K) == (224, 8, 6, 64)       # 15 clusters of 8
    assert G.plan(IN_PROJ[8], K) == (224, 4, 6, 64)        # 29 clusters of 4 (30 co-resident, s90q)
    assert G.plan(IN_PROJ[16], K, ksplit=4) == (112, 4, 10, 64)
    assert G.plan(IN_PROJ[16], K, bk=128) == (224, 8, 3, 128)  # v1.1's stages
    # a ring of two stages fits two CTAs per SM, which doubles the co-resident clusters the plan may use
    assert G.plan(IN_PROJ[8], K, stages=2) == (224, 8, 2, 64)
    for N in (IN_PROJ[16], IN_PROJ[8], 1000, 48):
        BN, S, D, BK = G.plan(N, K)
        assert math.ceil(N / BN) <= G.CLUSTERS_RESIDENT[S]          # one wave
        assert D * G.stage_bytes(BN, BK) + G.BARRIER_BYTES <= SMEM_PER_CTA_MAX
        assert D * G.stage_bytes(BN, BK) >= G.BM * (BN + 4) * 4    # the fp32 tile fits the drained ring
        assert BN % 16 == 0 and 16 <= BN <= 256


def test_x_rows():
    """v3: the x rows a stage loads are the token bucket's, and the ring they free holds one more stage of W at the
    in_proj widths (a 16-row x tile: 30 KB stages instead of 36, plus the 64-row view's 6 KB tail once)."""
    assert [G.x_rows(M) for M in (1, 16, 64)] == [64, 64, 64]                   # None: v1's 64-row box
    assert [G.x_rows(M, "auto") for M in (1, 9, 16, 17, 32, 33, 64)] == [16, 16, 16, 32, 32, 64, 64]
    assert G.x_rows(20, 64) == 64
    for bad in (8, 48, "all"):
        with pytest.raises(ValueError, match="xrows"):
            G.x_rows(16, bad)
    with pytest.raises(ValueError, match="xrows"):
        G.x_rows(33, 32)                # rows past the tile would never be loaded
    assert G.plan(IN_PROJ[16], K, xrows=16) == (224, 8, 7, 64)
    assert G.plan(IN_PROJ[8], K, xrows=16) == (224, 4, 7, 64)
    assert G.plan(IN_PROJ[8], K, xrows=32) == (224, 4, 6, 64)
    assert G.plan(7168, 1536, xrows=16) == (240, 4, 6, 64)                    # o_proj: all 6 k-tiles in the ring
    for N in (IN_PROJ[16], IN_PROJ[8], 7168):
        for xr in G.X_ROWS:
            BN, S, D, BK = G.plan(N, K, xrows=xr)
            ring = D * G.stage_bytes(BN, BK, xr) + (G.BM - xr) * BK * 2
            assert ring + G.BARRIER_BYTES <= SMEM_PER_CTA_MAX and ring >= G.BM * (BN + 4) * 4
    with pytest.raises(ValueError, match="xrows"):
        G.plan(IN_PROJ[16], K, bk=128, xrows=16)
    assert G.applicable(16, K, IN_PROJ[8], xrows="auto") and not G.applicable(16, K, IN_PROJ[8], xrows=8)
    assert G.compile_key(IN_PROJ[8], K, xrows=16)[-1] == "x16" and G.compile_key(IN_PROJ[8], K)[-1] == K


def test_plan_for_o_proj():
    """o_proj (session 26's opt-in "fast-opwg"): N 7168, K = 768 / 1536 (rank16 / rank8): 30 clusters of 4 x 240 rows,
    a ring that holds all 3 / 5 of a CTA's 3 / 6 k-tiles, so nearly all of W is requested before the PDL wait."""
    for Kp in (768, 1536):
        BN, S, D, BK = G.plan(7168, Kp)
        assert (BN, S, D, BK) == (240, 4, 5, 64) and math.ceil(7168 / BN) == 30
        assert G.applicable(16, Kp, 7168) and G.applicable(64, Kp, 7168)
    assert G.plan(7168, 768, stages=3) == (240, 4, 3, 64) and G.plan(7168, 768, stages=2) == (128, 4, 2, 64)


def test_full_width_stays_on_cublas():
    # 49376 rows need BN > 256 even at 32 clusters of 4
    assert not G.applicable(64, K, 49376)
    assert G.applicable(64, K, IN_PROJ[16]) and G.applicable(9, K, IN_PROJ[8])
    assert not G.applicable(65, K, IN_PROJ[16]) and not G.applicable(16, K, 3001)


def test_bad_inputs_are_refused():
    w = torch.zeros(64, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M in 1..64"):
        G.gemm_wgmma(torch.zeros(65, 1024, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="K = 1024"):
        G.gemm_wgmma(torch.zeros(16, 1024, dtype=torch.bfloat16), torch.zeros(64, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="even"):
        G.gemm_wgmma(torch.zeros(16, 1024, dtype=torch.bfloat16), torch.zeros(63, 1024, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        G.gemm_wgmma(torch.zeros(16, 1024), w)
    with pytest.raises(ValueError, match="multiple of 64"):
        G.plan(64, 1000)
    with pytest.raises(ValueError, match="D = 9"):
        G.plan(IN_PROJ[16], K, stages=9)
    with pytest.raises(ValueError, match="bk must be"):
        G.plan(64, 1024, bk=256)
    with pytest.raises(ValueError, match="ksplit"):
        G.plan(64, 1024, ksplit=3)
    with pytest.raises(ValueError, match="one wave"):
        G.plan(49376, K)


@needs_dsl
@pytest.mark.parametrize("tp,kw", [(16, {}), (8, {}), (16, dict(ksplit=4)), (16, dict(bk=128)), (8, dict(stages=2)),
                                   (16, dict(ksplit=8, bn=256, stages=2)), (16, dict(ksplit=1, bn=32)),
                                   (8, dict(ksplit=1, bn=64)), (8, dict(ksplit=1, bn=48)),
                                   (8, dict(ksplit=2, bn=96)), (16, dict(xrows=16)), (8, dict(xrows=16)),
                                   (8, dict(xrows=32)), (8, dict(ksplit=2, bn=96, xrows=16)),
                                   (16, dict(ksplit=2, bn=64)), (16, dict(ksplit=2, bn=64, stages=7)),
                                   (16, dict(ksplit=4, bn=112)), (16, dict(stages=4)),
                                   (8, dict(ksplit=2, bn=96, stages=7)), (8, dict(ksplit=2, bn=96, xrows=16, stages=7))])
def test_compiles_for_the_layer(tp, kw):
    G._compile(G.compile_key(IN_PROJ[tp], K, **kw))


@needs_dsl
@pytest.mark.parametrize("Kp,kw", [(768, {}), (1536, {}), (768, dict(stages=3)), (1536, dict(stages=3)),
                                   (768, dict(stages=2)), (1536, dict(stages=2)), (1536, dict(xrows=16))])
def test_compiles_for_o_proj(Kp, kw):
    G._compile(G.compile_key(7168, Kp, **kw))


def test_tile_weight_layout():
    w = torch.randn(6, 256).to(torch.bfloat16)
    tw = G.tile_weight(w)
    assert tw.shape == (6, 256) and tw.data.shape == (4, 6, 64) and tw.data.is_contiguous()
    for kt in range(4):      # k-tile kt holds every row's columns [64 kt, 64 kt + 64), rows in order
        assert torch.equal(tw.data[kt], w[:, 64 * kt:64 * kt + 64])
    with pytest.raises(ValueError, match="multiple of 64"):
        G.tile_weight(torch.zeros(6, 100, dtype=torch.bfloat16))


@needs_dsl
def test_tiled_build_reads_w_as_one_3d_box():
    ptx = G.gemm_ptx(IN_PROJ[16], tiled=True)
    tma = [ln.strip() for ln in ptx.splitlines() if ln.strip().startswith("cp.async.bulk.tensor")]
    # W through a 3-D tensor map (columns of a k-tile, rows, k-tiles), x as before
    assert sum(".3d." in t for t in tma) == 2 and sum(".2d." in t for t in tma) == 2
    G._compile(G.compile_key(IN_PROJ[16], K, tiled=True))


def test_swizzled_tile_weight_layout():
    """tile_weight(swizzle=True): k-tile kt, row n holds the row's 16-byte chunks of columns [64 kt, 64 kt + 64) in the
    order the 128-byte swizzle gives them in shared memory (position p <- chunk p ^ (n % 8))."""
    w = torch.randn(18, 192).to(torch.bfloat16)
    tw = G.tile_weight(w, swizzle=True)
    assert tw.swizzled and tw.data.shape == (3, 18, 64) and tw.data.is_contiguous()
    for kt in range(3):
        for n in range(18):
            for p in range(8):
                c = p ^ (n % 8)
                assert torch.equal(tw.data[kt, n, 8 * p:8 * p + 8], w[n, 64 * kt + 8 * c:64 * kt + 8 * c + 8])
    assert not G.tile_weight(w).swizzled
    with pytest.raises(ValueError, match="bk must be 64"):
        G.tile_weight(torch.zeros(6, 256, dtype=torch.bfloat16), bk=128, swizzle=True)
    with pytest.raises(ValueError, match="bulk build"):
        G.compile_key(IN_PROJ[16], K, bk=128, bulk=True)


@needs_dsl
@pytest.mark.parametrize("tp,kw", [(16, dict(ksplit=4, bn=112, xrows=16)), (8, dict(ksplit=2, bn=96, xrows=16)),
                                   (16, {})])
def test_bulk_build_copies_w_without_a_tensor_map(tp, kw):
    """v4: W's tiles by 1-D cp.async.bulk (one per stage: the prefetch loop before the producer's wait and the steady
    loop), x's still by its 2-D box after the wait; the expect_tx bytes are a runtime value (the last row tile's rows)."""
    from k3fast.kernels._dsl import TVM_FFI
    from k3fast.measure.ptxcheck import compiled_ptx
    xrows = kw.pop("xrows", G.BM)
    BN, S, D, BK = G.plan(IN_PROJ[tp], K, xrows=xrows, **kw)
    ptx = compiled_ptx(lambda: G._build(BN, S, D, BK, K, options=TVM_FFI + " --keep-ptx", xrows=xrows, bulk=True))
    lines = [ln.strip() for ln in ptx.splitlines()]
    bulk = [i for i, ln in enumerate(lines) if ln.startswith("cp.async.bulk.shared::cluster.global")]
    tma = [i for i, ln in enumerate(lines) if ln.startswith("cp.async.bulk.tensor")]
    waits = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")]
    assert len(bulk) == 2 and len(tma) == 2 and all(".2d." in lines[i] for i in tma)
    assert bulk[0] < waits[0] < tma[0] < bulk[1] < tma[1]
    key = G.compile_key(IN_PROJ[tp], K, xrows=xrows, bulk=True, **kw)
    assert key[6] == "bulk" and "tiled" not in key
    G._compile(key)


@needs_dsl
def test_diagnostic_build_streams_without_wgmma():
    from k3fast.kernels._dsl import TVM_FFI
    from k3fast.measure.ptxcheck import compiled_ptx
    BN, S, D, BK = G.plan(IN_PROJ[16], K)
    ptx = compiled_ptx(lambda: G._build(BN, S, D, BK, K, options=TVM_FFI + " --keep-ptx", nomma=True))
    lines = [ln.strip() for ln in ptx.splitlines()]
    assert not any(ln.startswith("wgmma.mma_async") for ln in lines)
    assert sum(ln.startswith("cp.async.bulk.tensor") for ln in lines) == 4      # the same ring
    assert G.compile_key(IN_PROJ[16], K, diag="nomma")[-1] == "nomma"
    with pytest.raises(ValueError, match="diag"):
        G.compile_key(IN_PROJ[16], K, diag="fast")
    assert G.DIAGS == (None, "nomma", "nox")


@needs_dsl
def test_diagnostic_build_without_x_streams_w_only():
    """diag="nox" (session 28): the ring's stages expect and carry W's tile alone (x's TMA copies are not emitted), the
    WGMMAs are the GEMM's; a key of its own."""
    from k3fast.kernels._dsl import TVM_FFI
    from k3fast.measure.ptxcheck import compiled_ptx
    BN, S, D, BK = G.plan(IN_PROJ[16], K, ksplit=4, bn=112)
    ptx = compiled_ptx(lambda: G._build(BN, S, D, BK, K, options=TVM_FFI + " --keep-ptx", nox=True))
    lines = [ln.strip() for ln in ptx.splitlines()]
    tma = [ln for ln in lines if ln.startswith("cp.async.bulk.tensor")]
    assert len(tma) == 2 and all(".2d." in t for t in tma)            # W's box in the prefetch and steady loops
    assert sum("wgmma.mma_async" in ln and "m64n112k16" in ln for ln in lines) == 4
    # the stage's transaction bytes (an immediate moved into the expect_tx operand): W's tile, not W's + x's
    assert f", {BN * BK * 2};" in ptx and f", {G.stage_bytes(BN, BK)};" not in ptx
    assert G.compile_key(IN_PROJ[16], K, ksplit=4, bn=112, diag="nox")[-1] == "nox"
    G._compile(G.compile_key(IN_PROJ[16], K, ksplit=4, bn=112, diag="nox"))


@needs_dsl
def test_ptx_order_and_registers():
    from k3fast.measure.ptxcheck import find_sass_tools, ptxas_resources
    ptx = G.gemm_ptx(IN_PROJ[16])
    lines = [ln.strip() for ln in ptx.splitlines()]
    waits = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")]
    tma = [i for i, ln in enumerate(lines) if ln.startswith("cp.async.bulk.tensor")]
    # the W prefetch loop (one box per stage) before the producer's wait, the x copies of the prefetched stages
    # after it, one box each per stage in the steady loop
    assert len(waits) == 2 and len(tma) == 4 and tma[0] < waits[0] < tma[1]
    assert sum("wgmma.mma_async" in ln and "m64n224k16" in ln for ln in lines) == 4
    clusters = [i for i, ln in enumerate(lines) if ln.startswith("barrier.cluster.wait")]
    remote = [i for i, ln in enumerate(lines) if ln.startswith("ld.shared::cluster")]
    # R x BN / 4 = 8 x 56 vectors over 160 threads: 3 unrolled rounds of 8 remote loads, between the barriers
    assert len(clusters) == 2 and len(remote) == 24 and clusters[0] < min(remote) and max(remote) < clusters[1]
    trig = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.launch_dependents"))
    assert clusters[0] < trig < min(remote)
    tools = find_sass_tools()
    if tools is not None:
        res = ptxas_resources(ptx, tools[0])
        assert res["spill_store_bytes"] == 0 and res["registers"] <= 168, res


def test_layer_rule_picks_wgmma_only_where_it_was_measured_faster():
    """fast.inproj_wide_choice ("auto"): the WGMMA GEMM at rank16's width for M 9..16 on the plan's own clusters of 8
    (faster than cuBLAS's split-K pair in s87 / s88 / s90c; session 26) and for M 17..64 on 4 x 112-row clusters
    (s97: the KDA step launched from its cluster barrier; session 28), at rank8's width for M 9..64 on 66 clusters of
    2 x 96 rows with the bucket's x rows (s95 / s95b; session 27), cuBLAS at full width (not measured)."""
    from k3fast.layer import INPROJ_WIDE, inproj_wide_choice, inproj_wide_pins
    assert INPROJ_WIDE == "auto"
    assert ([inproj_wide_choice(M, IN_PROJ[16]) for M in (3, 8, 9, 16, 17, 64)]
            == ["cublas", "cublas", "wgmma", "wgmma", "wgmma", "wgmma"])
    assert ([inproj_wide_choice(M, IN_PROJ[8]) for M in (3, 8, 9, 16, 17, 64)]
            == ["cublas", "cublas", "wgmma", "wgmma", "wgmma", "wgmma"])
    assert {inproj_wide_choice(M, 49376) for M in (9, 16, 64)} == {"cublas"}
    assert inproj_wide_pins(IN_PROJ[8]) == {"ksplit": 2, "bn": 96, "xrows": "auto"}
    assert inproj_wide_pins(IN_PROJ[8], None, None, 64) == {"ksplit": 2, "bn": 96, "xrows": "auto"}
    assert inproj_wide_pins(IN_PROJ[16]) == {} and inproj_wide_pins(IN_PROJ[16], None, None, 16) == {}
    assert [inproj_wide_pins(IN_PROJ[16], None, None, M) for M in (17, 64)] == [{"ksplit": 4, "bn": 112,
                                                                                  "xrows": "auto"}] * 2
    assert inproj_wide_pins(IN_PROJ[8], "wgmma") == {} and inproj_wide_pins(IN_PROJ[16], "wgmma", None, 64) == {}
    assert inproj_wide_pins(IN_PROJ[8], None, {"stages": 3}) == {"stages": 3}
    for M in (9, 16, 17, 33, 64):     # the pinned plans apply at every batch the rule gives them
        assert G.applicable(M, K, IN_PROJ[8], **inproj_wide_pins(IN_PROJ[8], None, None, M))
        assert G.applicable(M, K, IN_PROJ[16], **inproj_wide_pins(IN_PROJ[16], None, None, M))
    # 29 clusters of 4 x 112 rows at rank16 (116 CTAs, one wave of the 30 that fit)
    assert G.plan(IN_PROJ[16], K, ksplit=4, bn=112)[:2] == (112, 4)
    assert inproj_wide_choice(64, IN_PROJ[16], "wgmma") == "wgmma"
    assert inproj_wide_choice(16, IN_PROJ[16], "cublas") == "cublas"
    with pytest.raises(ValueError, match="inproj_wide"):
        inproj_wide_choice(16, IN_PROJ[16], "cutlass")


def test_o_proj_rule_picks_wgmma_where_it_was_measured_faster():
    """fast.oproj_wide_choice ("auto"): o_proj's GEMM apart from its norm on WGMMA at rank8's input width (1536: -1.5 to
    -1.9 us in s90e and s90f at b16 / b64; session 26) at every M, at rank16's (768) from M = 17 (beside the in_proj's
    4 x 112-row clusters; session 28: -0.5 to -0.9 us at b64 in s90e / s90f / s92 / s97, mixed at b16), cuBLAS at
    full width (12288: not measured)."""
    from k3fast.layer import OPROJ_WIDE, oproj_wide_choice
    assert OPROJ_WIDE == "auto"
    assert [oproj_wide_choice(kp) for kp in (768, 1536, 12288)] == ["cublas", "wgmma", "cublas"]
    assert [oproj_wide_choice(768, None, M) for M in (9, 16, 17, 64)] == ["cublas", "cublas", "wgmma", "wgmma"]
    assert [oproj_wide_choice(1536, None, M) for M in (9, 64)] == ["wgmma", "wgmma"]
    assert oproj_wide_choice(12288, None, 64) == "cublas"
    assert oproj_wide_choice(768, "wgmma") == "wgmma" and oproj_wide_choice(1536, "cublas") == "cublas"
    assert oproj_wide_choice(768, "cublas", 64) == "cublas"
    with pytest.raises(ValueError, match="oproj_wide"):
        oproj_wide_choice(1536, "ring")
