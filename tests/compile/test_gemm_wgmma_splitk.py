"""k3fast.kernels.gemm_wgmma_splitk on the CPU: the split plan for the K3 in_proj and o_proj widths, every build the
layer runs (its three pin sets at the batches they serve), the PTX's order (W requested before the PDL wait, x after
it; the partials summed through DSMEM between two cluster barriers), registers without spills where ptxas is found,
and clear errors for inputs it does not take."""
import math

import pytest
import torch

from k3fast.kernels import gemm_wgmma_splitk as G
from k3fast.kernels._dsl import SMEM_PER_CTA_MAX, TVM_FFI, dsl_available
from k3fast.kernels.kda_conv_gate_step import proj_width
from k3ref.config import k3_rank

pytestmark = pytest.mark.compile
needs_dsl = pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm_ffi not importable")

K = 7168
IN_PROJ = {tp: proj_width(k3_rank(tp).kda_heads) for tp in (16, 8)}
# the layer's pins: the plan's own choice (rank16 M 9..16, o_proj), rank8's 66 clusters of 2 x 96 rows with the token
# bucket's x rows, rank16's 29 clusters of 4 x 112 rows above M = 16
PINS_WIDE = {"ksplit": 2, "bn": 96, "xrows": "auto"}
PINS_LARGE_M = {"ksplit": 4, "bn": 112, "xrows": "auto"}


def test_plan_for_the_in_proj_widths():
    assert IN_PROJ == {16: 3216, 8: 6288}
    assert G.plan(IN_PROJ[16], K) == (224, 8, 6)       # 15 clusters of 8
    assert G.plan(IN_PROJ[8], K) == (224, 4, 6)        # 29 clusters of 4 (30 co-resident)
    assert G.plan(IN_PROJ[16], K, ksplit=4) == (112, 4, 10)
    assert G.plan(IN_PROJ[16], K, ksplit=4, bn=112)[:2] == (112, 4)   # 29 clusters, 116 CTAs: one wave of the 30
    for N in (IN_PROJ[16], IN_PROJ[8], 1000, 48):
        BN, S, D = G.plan(N, K)
        assert math.ceil(N / BN) <= G.CLUSTERS_RESIDENT[S]          # one wave
        assert D * G.stage_bytes(BN) + G.BARRIER_BYTES <= SMEM_PER_CTA_MAX
        assert D * G.stage_bytes(BN) >= G.BM * (BN + 4) * 4         # the fp32 tile fits the drained ring
        assert BN % 16 == 0 and 16 <= BN <= 256


def test_x_rows():
    """xrows "auto": the x rows a stage loads are the token bucket's, and the ring they free holds one more stage of W
    at the in_proj widths (a 16-row x tile: 30 KB stages instead of 36, plus the 64-row view's 6 KB tail once)."""
    assert [G.x_rows(M) for M in (1, 16, 64)] == [64, 64, 64]                   # None: a 64-row box
    assert [G.x_rows(M, "auto") for M in (1, 9, 16, 17, 32, 33, 64)] == [16, 16, 16, 32, 32, 64, 64]
    for bad in (8, 48, 64, "all"):
        with pytest.raises(ValueError, match="xrows"):
            G.x_rows(16, bad)
    assert G.plan(IN_PROJ[16], K, xrows=16) == (224, 8, 7)
    assert G.plan(IN_PROJ[8], K, xrows=16) == (224, 4, 7)
    assert G.plan(IN_PROJ[8], K, xrows=32) == (224, 4, 6)
    assert G.plan(7168, 1536, xrows=16) == (240, 4, 6)                    # o_proj: all 6 k-tiles in the ring
    for N in (IN_PROJ[16], IN_PROJ[8], 7168):
        for xr in G.X_ROWS:
            BN, S, D = G.plan(N, K, xrows=xr)
            ring = D * G.stage_bytes(BN, xr) + (G.BM - xr) * G.BK * 2
            assert ring + G.BARRIER_BYTES <= SMEM_PER_CTA_MAX and ring >= G.BM * (BN + 4) * 4
    assert G.compile_key(IN_PROJ[8], K, xrows=16)[-1] == "x16" and G.compile_key(IN_PROJ[8], K)[-1] == K


def test_plan_for_o_proj():
    """o_proj apart from its AttnRes #2 kernel: N 7168, K = 768 / 1536 (rank16 / rank8): 30 clusters of 4 x 240 rows, a
    ring that holds all 3 / 5 of a CTA's 3 / 6 k-tiles, so nearly all of W is requested before the PDL wait."""
    for Kp in (768, 1536):
        BN, S, D = G.plan(7168, Kp)
        assert (BN, S, D) == (240, 4, 5) and math.ceil(7168 / BN) == 30
        assert G.applicable(16, Kp, 7168) and G.applicable(64, Kp, 7168)


def test_applicable():
    # full width: 49376 rows need BN > 256 even at 30 clusters of 4
    assert not G.applicable(64, K, 49376)
    assert G.applicable(64, K, IN_PROJ[16]) and G.applicable(9, K, IN_PROJ[8])
    assert not G.applicable(65, K, IN_PROJ[16]) and not G.applicable(16, K, 3001)
    for M in (9, 16, 17, 33, 64):     # the layer's pinned plans apply at every batch it gives them
        assert G.applicable(M, K, IN_PROJ[8], **PINS_WIDE) and G.applicable(M, K, IN_PROJ[16], **PINS_LARGE_M)
        assert G.applicable(M, K, IN_PROJ[16])
    assert not G.applicable(16, K, IN_PROJ[8], xrows=16)


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
    with pytest.raises(ValueError, match="xrows"):
        G.gemm_wgmma(torch.zeros(16, 1024, dtype=torch.bfloat16), w, xrows=16)
    with pytest.raises(ValueError, match="multiple of 64"):
        G.plan(64, 1000)
    with pytest.raises(ValueError, match="ksplit"):
        G.plan(64, 1024, ksplit=3)
    with pytest.raises(ValueError, match="one wave"):
        G.plan(49376, K)


def test_compile_keys_are_the_calls():
    # one build per x bucket: 16 / 32 / 64 rows with "auto", the 64-row box without
    keys = G.compile_keys(IN_PROJ[8], K, range(9, 65), **PINS_WIDE)
    assert sorted(str(k[-1]) for k in keys) == [str(K), "x16", "x32"]
    assert G.compile_keys(IN_PROJ[16], K, range(9, 17)) == [G.compile_key(IN_PROJ[16], K)]
    assert G.compile_keys(49376, K, [16, 64]) == []


@needs_dsl
@pytest.mark.parametrize("N,Kw,batches,pins", [
    (IN_PROJ[16], K, range(9, 17), {}), (IN_PROJ[16], K, range(17, 65), PINS_LARGE_M),
    (IN_PROJ[8], K, range(9, 65), PINS_WIDE), (7168, 768, range(17, 65), {}), (7168, 1536, range(9, 65), {})],
    ids=["in_proj-rank16-b9-16", "in_proj-rank16-b17-64", "in_proj-rank8", "o_proj-rank16", "o_proj-rank8"])
def test_compiles_for_the_layer(N, Kw, batches, pins):
    G.warmup(N, Kw, batches, **pins)


@needs_dsl
def test_ptx_order_and_registers():
    from k3fast.measure.ptxcheck import compiled_ptx, find_sass_tools, ptxas_resources
    BN, S, D = G.plan(IN_PROJ[16], K)
    ptx = compiled_ptx(lambda: G._build(BN, S, D, K, options=TVM_FFI + " --keep-ptx"))
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
    if tools is None:
        pytest.skip("ptxas not found (registers / spills need it)")
    res = ptxas_resources(ptx, tools[0])
    assert res["spill_store_bytes"] == 0 and res["registers"] <= 168, res
