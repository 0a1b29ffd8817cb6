"""k3fast.kernels.rms_gemv_ring (rms_gemv v12) on the CPU: its ring plan, every compile key the K3 in_proj needs at M <= 2,
the order of its PTX (weights requested before the PDL wait, a proxy fence before the ring reuses the prologue's
slots), registers without spills, and clear errors for inputs it does not take."""
import pytest
import torch

from k3fast.kernels import rms_gemv_ring as G
from k3fast.kernels._dsl import SMEM_PER_CTA_MAX, dsl_available
from k3ref.config import k3, k3_rank
from attnres_cases import k3_attnres_variants

pytestmark = pytest.mark.compile
needs_dsl = pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm_ffi not importable")


def test_grid_and_chunks():
    # pairs of rows split evenly: the busiest CTA takes ceil(P / G) chunks
    assert G.grid_for(3216) == 132 and G.chunks_max(3216) == 13
    assert G.grid_for(6288) == 132 and G.chunks_max(6288) == 24
    assert G.grid_for(48) == 24 and G.chunks_max(48) == 1
    for N in (48, 592, 3216, 6288, 49376):
        P, grid = N // 2, G.grid_for(N)
        spans = [(b + 1) * P // grid - b * P // grid for b in range(grid)]
        assert sum(spans) == P and min(spans) >= 1 and max(spans) == G.chunks_max(N)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("nb", [0, 8])
def test_ring_plan_fits(fused, M, nb):
    D, D1 = G.ring_plan(M, 7168, nb, G.chunks_max(6288), fused)
    cb = 2 * 7168 * 2
    assert D >= 6 and 1 <= D1 <= D
    if fused:     # the prologue's n_blocks + 1 source rows fit in slots D1.. of the ring
        assert (D - D1) * cb >= (nb + 1) * 7168 * 2
    else:
        assert D1 == D
    assert D * cb < SMEM_PER_CTA_MAX


def test_ring_plan_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="ring slots"):
        G.ring_plan(2, 7168 * 4, 8, 24, True)


def test_bad_inputs_are_refused():
    x = torch.zeros(3, 7168, dtype=torch.bfloat16)
    w = torch.zeros(64, 7168, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M <= 2"):
        G.gemv_ring(x, w)
    with pytest.raises(ValueError, match="K of 1792"):
        G.gemv_ring(torch.zeros(1, 1024, dtype=torch.bfloat16), torch.zeros(64, 1024, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 16"):
        G.gemv_ring(x[:1], torch.zeros(40, 7168, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        G.gemv_ring(x[:1].float(), w)
    blocks = torch.zeros(3, 8, 7168, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M <= 2"):
        G.attnres_rms_gemv_ring(blocks, 1, x, None, torch.zeros(7168), torch.ones(7168, dtype=torch.bfloat16), w)


@needs_dsl
@pytest.mark.parametrize("cfg", [k3_rank(16), k3_rank(8), k3()], ids=["rank16", "rank8", "full"])
@pytest.mark.parametrize("M", [1, 2])
def test_compile_in_proj_keys(cfg, M):
    """Every AttnRes site of the layer schedule (n_blocks, delta, block write) at this in_proj width, fused, and the
    bare GEMV the benchmark runs."""
    from k3fast.kernels.rms_gemv import k3_gemv_shapes
    N = k3_gemv_shapes(cfg)["in_proj"][0]
    G._compile(G.compile_key(M, 7168, N, False, early_trigger=False))
    for nb, hd, bw in k3_attnres_variants(cfg):
        G._compile(G.compile_key(M, 7168, N, True, nb, hd, bw, "bf16", cfg.rms_norm_eps, True))


@needs_dsl
def test_ptx_order_and_registers():
    ptx = G.ring_ptx(3216, M=1, n_blocks=8, fused=True)
    lines = [ln.strip() for ln in ptx.splitlines()]
    first = lambda pat: next(i for i, ln in enumerate(lines) if pat in ln)   # noqa: E731
    # weights are requested before the PDL wait, the rest of the ring after the prologue and a proxy fence
    assert first("cp.async.bulk.shared::cluster.global") < first("griddepcontrol.wait")
    fence = first("fence.proxy.async.shared::cta")
    assert fence > first("griddepcontrol.wait")
    assert any("cp.async.bulk.shared::cluster.global" in ln for ln in lines[fence:])
    # the consumer loop reads weights as 16-byte shared loads and releases slots on the empty barriers
    assert sum("ld.shared.v4" in ln for ln in lines) >= 4
    assert any(ln.startswith("mbarrier.arrive.shared") for ln in lines)
    from k3fast.measure.ptxcheck import find_sass_tools, ptxas_resources
    tools = find_sass_tools()
    if tools is None:
        pytest.skip("ptxas not found (registers / spills need it)")
    for M in (1, 2):
        for fused in (False, True):
            res = ptxas_resources(G.ring_ptx(6288, M=M, n_blocks=8, fused=fused), tools[0])
            assert res["spill_store_bytes"] == 0 and res["registers"] <= 128, (M, fused, res)


@needs_dsl
@pytest.mark.parametrize("early", [True, False])
def test_trigger_placement(early):
    """v12 launches its dependent right after its wait ("fast-ringearly"); v12.1 (the layer's default since s47)
    after its last store of y."""
    lines = [ln.strip() for ln in G.ring_ptx(6288, M=1, n_blocks=1, early_trigger=early).splitlines()]
    trig = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.launch_dependents")]
    wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
    stores = [i for i, ln in enumerate(lines) if ln.startswith("st.global")]
    assert len(trig) == 1
    if early:
        assert wait < trig[0] < wait + 4
    else:
        assert trig[0] > max(stores)


@pytest.mark.parametrize("M,nb,applies", [(1, 1, True), (1, 8, True), (2, 1, True), (2, 3, True), (2, 4, False),
                                          (2, 8, False)])
def test_joint_plan(M, nb, applies):
    """v12.2 stages every token's source rows at once: it applies where they fit beside >= 2 prefilled slots."""
    cmax = G.chunks_max(6288)
    assert G.joint_applies(M, 7168, nb, cmax) == applies
    if applies:
        D, D1 = G.ring_plan(M, 7168, nb, cmax, True, joint=True)
        assert (D - D1) * 2 * 7168 * 2 >= M * (nb + 1) * 7168 * 2 and D1 >= 2
    key = G.compile_key(M, 7168, 6288, True, nb, True, -1, joint=True)
    assert (key[-1] == "joint") == applies
    assert G.compile_key(M, 7168, 6288, True, nb, True, -1, joint=False)[-1] != "joint"
    assert (G.compile_key(M, 7168, 6288, True, nb, True, -1)[-1] == "joint") == applies   # the default since s48


@needs_dsl
@pytest.mark.parametrize("M", [1, 2])
def test_joint_prologue_ptx(M):
    """The joint prologue: one CTA barrier per reduction for all tokens (the token-by-token one has two per token),
    w_ln's loads issued before the first of them, and no spills."""
    def barriers_and_wln(ptx):
        lines = [ln.strip() for ln in ptx.splitlines()]
        wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
        bars = [i for i, ln in enumerate(lines) if i > wait and ln.startswith(("bar.sync", "barrier.sync"))]
        return lines, wait, bars
    joint, base = G.ring_ptx(6288, M=M, n_blocks=1, joint=True), G.ring_ptx(6288, M=M, n_blocks=1, joint=False)
    lj, wj, bj = barriers_and_wln(joint)
    lb, wb, bb = barriers_and_wln(base)
    assert len(bb) - len(bj) == 2 * (M - 1)
    # the loads between the wait and the first barrier: u, the sources, and (joint only) w_ln's
    assert sum(ln.startswith("ld.global") for ln in lj[wj:bj[0]]) > sum(ln.startswith("ld.global") for ln in lb[wb:bb[0]])
    from k3fast.measure.ptxcheck import find_sass_tools, ptxas_resources
    tools = find_sass_tools()
    if tools is None:
        pytest.skip("ptxas not found (registers / spills need it)")
    res = ptxas_resources(joint, tools[0])
    assert res["spill_store_bytes"] == 0 and res["registers"] <= 128, res


# ------------------------------------------------------------------------------ v13: the tensor-core ring, M 3..8

def test_mma_plan_and_tiles():
    # whole 16-row tiles split evenly over min(132, T) CTAs; the busiest takes ceil(T / G)
    assert G.mma_tiles_max(3216) == 2 and G.mma_tiles_max(6288) == 3 and G.mma_tiles_max(48) == 1
    for N in (48, 592, 3216, 6288, 7168):
        T = N // 16
        grid = min(132, T)
        spans = [(b + 1) * T // grid - b * T // grid for b in range(grid)]
        assert sum(spans) == T and min(spans) >= 1 and max(spans) == G.mma_tiles_max(N)
    for MB, K, tmax in ((8, 7168, 3), (4, 7168, 3), (8, 768, 4), (8, 1536, 4), (4, 12288, 4)):
        kc, D = G.mma_plan(MB, K, tmax)
        assert K % kc == 0 and kc % (G.MMA_CONSUMERS * 32) == 0 and D >= 2
        used = (MB * (2 * K + G.MMA_PAD) + D * 16 * (2 * kc + G.MMA_PAD) + G.MMA_CONSUMERS * tmax * 512
                + 8 * (2 * D + 1))
        assert used <= SMEM_PER_CTA_MAX
        # staged rows 64 B apart modulo 128: a quad-phase of 16-byte loads (rows g, g + 1) is bank-conflict free
        assert (2 * kc + G.MMA_PAD) % 128 == 64 and (2 * K + G.MMA_PAD) % 128 == 64
    with pytest.raises(ValueError, match="ring slots"):
        G.mma_plan(8, 12288, 4)
    # where v13 serves: the rank16 / rank8 in_proj and o_proj, not full width (x or the tile count too large)
    assert all(G.mma_applicable(M, K, N) for M in (3, 8) for N, K in ((3216, 7168), (6288, 7168), (7168, 768),
                                                                      (7168, 1536)))
    assert not G.mma_applicable(8, 12288, 7168) and not G.mma_applicable(3, 7168, 49376)
    assert not G.mma_applicable(9, 7168, 3216)


def test_mma_bad_inputs_are_refused():
    w = torch.zeros(64, 7168, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M in 1..8"):
        G.gemv_ring_mma(torch.zeros(9, 7168, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="K of 256"):
        G.gemv_ring_mma(torch.zeros(3, 1000, dtype=torch.bfloat16), torch.zeros(64, 1000, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 16"):
        G.gemv_ring_mma(torch.zeros(3, 7168, dtype=torch.bfloat16), torch.zeros(40, 7168, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="mma_applicable"):
        G.gemv_ring_mma(torch.zeros(8, 12288, dtype=torch.bfloat16), torch.zeros(64, 12288, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        G.gemv_ring_mma(torch.zeros(3, 7168), w)


@needs_dsl
@pytest.mark.parametrize("cfg", [k3_rank(16), k3_rank(8), k3()], ids=["rank16", "rank8", "full"])
def test_compile_mma_keys(cfg):
    """The layer's two GEMVs that v13 may serve at M 3..8: the in_proj and o_proj."""
    from k3fast.kernels.rms_gemv import k3_gemv_shapes
    shapes = k3_gemv_shapes(cfg)
    for name in ("in_proj", "o_proj"):
        N, K = shapes[name]
        for M in (3, 8):
            if G.mma_applicable(M, K, N):
                G._compile_mma(G.mma_compile_key(M, K, N))
            else:
                assert cfg.tp == 1, (name, M)       # only full width falls back to cuBLAS


@needs_dsl
@pytest.mark.parametrize("early", [False, True])
def test_mma_ptx_order_and_registers(early):
    lines = [ln.strip() for ln in G.ring_mma_ptx(6288, M=8, early_trigger=early).splitlines()]
    first = lambda pat: next(i for i, ln in enumerate(lines) if pat in ln)   # noqa: E731
    wait = first("griddepcontrol.wait")
    bulk = [i for i, ln in enumerate(lines) if "cp.async.bulk.shared::cluster.global" in ln]
    # a chunk's 16 row pieces go out before the PDL wait; x and the rest of the ring after it
    assert bulk[0] < wait and sum(i < wait for i in bulk) == 16 and sum(i > wait for i in bulk) >= 17
    # 8 consumer warps x 2 k32 steps per 512-column chunk: 3 tiles x 14 chunks x 2 steps x 2 k16 halves
    assert sum(ln.startswith("mma.sync.aligned.m16n8k16") for ln in lines) == 3 * 14 * 2 * 2
    trig = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.launch_dependents")]
    stores = [i for i, ln in enumerate(lines) if ln.startswith("st.global")]
    assert len(trig) == 1
    assert (wait < trig[0] < wait + 4) if early else trig[0] > max(stores)
    from k3fast.measure.ptxcheck import find_sass_tools, ptxas_resources
    tools = find_sass_tools()
    if tools is None:
        pytest.skip("ptxas not found (registers / spills need it)")
    for N, K, M in ((3216, 7168, 8), (6288, 7168, 4), (7168, 1536, 8)):
        res = ptxas_resources(G.ring_mma_ptx(N, K, M), tools[0])
        assert res["spill_store_bytes"] == 0 and res["registers"] <= 64, (N, K, M, res)


# ------------------------------------------------------------------ v14: the same ring on a tiled (re-laid) weight

def test_mma_tile_weight_layout():
    """Chunk row t NKC + kc of the tiled weight, 16-byte vector kk 64 + h 32 + lane, is what lane (g, c) of the
    consumer warps reads for k32 step kk, half h: row 16 t + 8 h + g, columns kc KC + 32 kk + 8 c .. + 8."""
    N, K = 48, 1024                                       # K = 2 chunks of 512
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(5)).bfloat16()
    tw = G.mma_tile_weight(w)
    assert tw.shape == (N, K) and tw.data.shape == (N // 16 * 2, 16 * 512) and tw.data.is_contiguous()
    assert G.mma_tiled_shape(N, K) == tuple(tw.data.shape)
    vec = tw.data.view(N // 16, 2, 1024, 8)
    for t in range(N // 16):
        for kc in range(2):
            for kk in (0, 5, 15):
                for h in range(2):
                    for lane in (0, 7, 31):
                        g, c = divmod(lane, 4)
                        col = kc * 512 + 32 * kk + 8 * c
                        assert torch.equal(vec[t, kc, 64 * kk + 32 * h + lane], w[16 * t + 8 * h + g, col:col + 8])
    # a permutation: every element once
    assert torch.equal(torch.sort(tw.data.flatten().float())[0], torch.sort(w.flatten().float())[0])


def test_mma_tiled_plan_and_bad_inputs():
    # without the rows' 64 B padding a slot is 16 KB: one more slot at rank8 b8 (6 against 5)
    assert G.mma_plan(8, 7168, 3, tiled=True) == (512, 6) and G.mma_plan(8, 7168, 3) == (512, 5)
    assert G.mma_compile_key(8, 7168, 6288, tiled=True)[-1] == "tiled"
    assert G.mma_compile_key(8, 7168, 6288) == ("rms_gemv_ring.mma", 8, 7168, 3, False)
    with pytest.raises(ValueError, match="multiple of 256"):
        G.mma_tile_weight(torch.zeros(64, 1000, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 16"):
        G.mma_tile_weight(torch.zeros(40, 7168, dtype=torch.bfloat16))
    tw = G.mma_tile_weight(torch.zeros(64, 7168, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x: expected \[M, 7168\]"):
        G.gemv_ring_mma(torch.zeros(3, 1024, dtype=torch.bfloat16), tw)
    tw.data = tw.data[:-1]                                 # a tiled weight that lost a chunk
    with pytest.raises(ValueError, match="w.data: expected shape"):
        G.gemv_ring_mma(torch.zeros(3, 7168, dtype=torch.bfloat16), tw)


@needs_dsl
def test_mma_tiled_ptx():
    """v14: one 16 KB bulk copy per chunk (rank8 b8: 6 slots before the PDL wait), the same MMAs as v13, and each
    weight fragment one 16-byte shared load."""
    for early in (False, True):
        G._compile_mma(G.mma_compile_key(8, 7168, 6288, early, tiled=True))
        G._compile_mma(G.mma_compile_key(4, 7168, 3216, early, tiled=True))
    lines = [ln.strip() for ln in G.ring_mma_ptx(6288, M=8, tiled=True).splitlines()]
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    bulk = [i for i, ln in enumerate(lines) if "cp.async.bulk.shared::cluster.global" in ln]
    # one copy in the pre-wait loop (run D times); after the wait x's per-token copies and the ring's refill, in
    # loops the compiler unrolls (v13: 16 row pieces per chunk, 21 copies there)
    assert sum(i < wait for i in bulk) == 1 and 2 <= sum(i > wait for i in bulk) <= 12
    assert sum(ln.startswith("mma.sync.aligned.m16n8k16") for ln in lines) == 3 * 14 * 2 * 2
    assert sum(ln.startswith("ld.shared.v4") for ln in lines) == 3 * 14 * 2 * 3     # A rows g, g + 8 and x
    from k3fast.measure.ptxcheck import find_sass_tools, ptxas_resources
    tools = find_sass_tools()
    if tools is None:
        pytest.skip("ptxas not found (registers / spills need it)")
    res = ptxas_resources(G.ring_mma_ptx(6288, M=8, tiled=True), tools[0])
    assert res["spill_store_bytes"] == 0 and res["registers"] <= 64, res


@needs_dsl
@pytest.mark.parametrize("early", [False, True])
def test_norm_trigger_placement(early):
    """attnres_rmsnorm launches its dependent after its last store by default, right after its wait when it
    serves v13 ("fast-inmmaet")."""
    from k3fast.kernels import rms_gemv
    from k3fast.measure.ptxcheck import compiled_ptx
    cutlass, cute, _, _, Norm = rms_gemv._kernels()
    BF = cutlass.BFloat16
    from k3fast.kernels._dsl import fake_stream, fake_tensor, TVM_FFI
    M = cute.sym_int()
    blocks, p, d, po, u, wl = rms_gemv._attn_fakes(cute, BF, M, 7168, True, "bf16")
    x = fake_tensor(BF, (M, 7168))
    ptx = compiled_ptx(lambda: cute.compile(Norm(7168, 3, True, -1, 1e-5, early), blocks, p, d, po, u, wl, x,
                                            fake_stream(), options=TVM_FFI + " --keep-ptx"))
    lines = [ln.strip() for ln in ptx.splitlines()]
    trig = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.launch_dependents")]
    wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
    stores = [i for i, ln in enumerate(lines) if ln.startswith("st.global")]
    assert len(trig) == 1
    assert (wait < trig[0] < wait + 4) if early else trig[0] > max(stores)
