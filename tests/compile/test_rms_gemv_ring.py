"""k3fast.kernels.rms_gemv_ring on the CPU: the ring plans, every build the layer runs (the fused ring at M <= 2 at
k3_rank16 / k3_rank8 / full width, the tensor-core ring at M 3..8 at the widths it serves), the order of their PTX
(weights requested before the PDL wait, a proxy fence before the ring reuses the prologue's slots, the dependent
launched after the last store), registers without spills where ptxas is found, and clear errors for inputs they do not
take."""
import pytest
import torch

from k3fast.kernels import rms_gemv_ring as G
from k3fast.kernels._dsl import SMEM_PER_CTA_MAX, TVM_FFI, dsl_available
from k3fast.kernels.kda_conv_gate_step import proj_width
from k3ref.config import k3, k3_rank
from attnres_cases import CORNER_SITES

pytestmark = pytest.mark.compile
needs_dsl = pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm_ffi not importable")

K = 7168
IN_PROJ = {cfg.name: proj_width(cfg.kda_heads) for cfg in (k3_rank(16), k3_rank(8), k3())}


def _ptx(build):
    from k3fast.measure.ptxcheck import compiled_ptx
    return [ln.strip() for ln in compiled_ptx(lambda: build(options=TVM_FFI + " --keep-ptx")).splitlines()]


def _ring_ptx(N, M, nb):
    cmax = G.chunks_max(N)
    return _ptx(lambda options: G._build(M, K, cmax, nb, True, -1, "bf16", 1e-5, G.joint_applies(M, K, nb, cmax),
                                         options=options))


def _ptxas(lines):
    from k3fast.measure.ptxcheck import find_sass_tools, ptxas_resources
    tools = find_sass_tools()
    return None if tools is None else ptxas_resources("\n".join(lines), tools[0])


def test_in_proj_widths():
    assert IN_PROJ == {"k3_rank16": 3216, "k3_rank8": 6288, "k3": 49376}


def test_grid_and_chunks():
    # pairs of rows split evenly: the busiest CTA takes ceil(P / G) chunks
    assert G.grid_for(3216) == 132 and G.chunks_max(3216) == 13
    assert G.grid_for(6288) == 132 and G.chunks_max(6288) == 24
    assert G.grid_for(48) == 24 and G.chunks_max(48) == 1
    for N in (48, 592, 3216, 6288, 49376):
        P, grid = N // 2, G.grid_for(N)
        spans = [(b + 1) * P // grid - b * P // grid for b in range(grid)]
        assert sum(spans) == P and min(spans) >= 1 and max(spans) == G.chunks_max(N)


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("nb", [0, 8])
def test_ring_plan_fits(M, nb):
    D, D1 = G.ring_plan(M, K, nb, G.chunks_max(6288))
    cb = 2 * K * 2
    assert D >= 6 and 1 <= D1 <= D
    assert (D - D1) * cb >= (nb + 1) * K * 2      # the prologue's n_blocks + 1 source rows fit in slots D1..
    assert D * cb < SMEM_PER_CTA_MAX


def test_ring_plan_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="ring slots"):
        G.ring_plan(2, K * 4, 8, 24)


@pytest.mark.parametrize("M,nb,applies", [(1, 1, True), (1, 8, True), (2, 1, True), (2, 3, True), (2, 4, False),
                                          (2, 8, False)])
def test_joint_plan(M, nb, applies):
    """The joint prologue stages every token's source rows at once: it applies where they fit beside >= 2 prefilled
    slots, and the compile key says which prologue a build runs."""
    cmax = G.chunks_max(6288)
    assert G.joint_applies(M, K, nb, cmax) == applies
    if applies:
        D, D1 = G.ring_plan(M, K, nb, cmax, joint=True)
        assert (D - D1) * 2 * K * 2 >= M * (nb + 1) * K * 2 and D1 >= 2
    assert (G.compile_key(M, K, 6288, nb, True, -1)[-1] == "joint") == applies


def test_compile_keys_are_the_calls():
    keys = G.compile_keys([1, 2, 3, 8, 16], K=K, N=6288, sites=[(1, True, -1), (8, True, -1)],
                          mma_shapes=[(6288, K), (49376, K)])
    assert keys == sorted({G.compile_key(m, K, 6288, nb, True, -1) for m in (1, 2) for nb in (1, 8)}
                          | {G.mma_compile_key(m, K, 6288) for m in (4, 8)}, key=str)
    assert G.mma_compile_key(3, K, 6288) == G.mma_compile_key(4, K, 6288) == ("rms_gemv_ring.mma", 4, K, 3)


def test_bad_inputs_are_refused():
    x = torch.zeros(3, K, dtype=torch.bfloat16)
    w = torch.zeros(64, K, dtype=torch.bfloat16)
    blocks = torch.zeros(3, 8, K, dtype=torch.bfloat16)
    u, w_ln = torch.zeros(K), torch.ones(K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M <= 2"):
        G.attnres_rms_gemv_ring(blocks, 1, x, None, u, w_ln, w)
    with pytest.raises(ValueError, match="multiple of 1792"):
        G.attnres_rms_gemv_ring(blocks[:1, :, :1024].contiguous(), 1, x[:1, :1024].contiguous(), None,
                                u[:1024].contiguous(), w_ln[:1024].contiguous(), w[:, :1024].contiguous())
    with pytest.raises(ValueError, match="multiple of 16"):
        G.attnres_rms_gemv_ring(blocks[:1], 1, x[:1], None, u, w_ln, torch.zeros(40, K, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        G.attnres_rms_gemv_ring(blocks[:1], 1, x[:1], None, u, w_ln, w.float())
    with pytest.raises(ValueError, match="must not alias"):
        G.attnres_rms_gemv_ring(blocks[:1], 1, x[:1], None, u, w_ln, w, partial_out=x[:1])


@needs_dsl
@pytest.mark.parametrize("cfg", [k3_rank(16), k3_rank(8), k3()], ids=lambda c: c.name)
def test_compile_fused_ring(cfg):
    """The layer's in_proj at M = 1, 2 at this width: the corner sites of the AttnRes schedule (the joint prologue's
    and the token-by-token one's at M = 2)."""
    G.warmup([1, 2], K=K, N=IN_PROJ[cfg.name], sites=CORNER_SITES)


@needs_dsl
def test_compile_mma_ring():
    """The layer's in_proj GEMV at M 3..8 (buckets 4 and 8) where the tensor-core ring serves it: rank16 and rank8;
    full width falls to cuBLAS (its 12 tiles per CTA and x beside the ring do not fit)."""
    shapes = [(n, K) for n in IN_PROJ.values()]
    keys = G.compile_keys(range(3, 9), K=K, N=3216, sites=[], mma_shapes=shapes)
    assert keys == [G.mma_compile_key(m, K, n) for m in (4, 8) for n in (3216, 6288)]
    assert not any(G.mma_applicable(m, K, 49376) for m in range(3, 9))
    G.warmup(range(3, 9), K=K, N=3216, sites=[], mma_shapes=shapes)


@needs_dsl
def test_fused_ptx_order_and_trigger():
    lines = _ring_ptx(3216, 1, 8)
    first = lambda pat: next(i for i, ln in enumerate(lines) if pat in ln)   # noqa: E731
    # weights are requested before the PDL wait, the rest of the ring after the prologue and a proxy fence
    wait = first("griddepcontrol.wait")
    assert first("cp.async.bulk.shared::cluster.global") < wait
    fence = first("fence.proxy.async.shared::cta")
    assert fence > wait
    assert any("cp.async.bulk.shared::cluster.global" in ln for ln in lines[fence:])
    # the consumer loop reads weights as 16-byte shared loads and releases slots on the empty barriers
    assert sum("ld.shared.v4" in ln for ln in lines) >= 4
    assert any(ln.startswith("mbarrier.arrive.shared") for ln in lines)
    # the dependent launches after the last store of y
    trig = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.launch_dependents")]
    stores = [i for i, ln in enumerate(lines) if ln.startswith("st.global")]
    assert len(trig) == 1 and trig[0] > max(stores)
    res = _ptxas(lines)
    if res is None:
        pytest.skip("ptxas not found (registers / spills need it)")
    assert res["spill_store_bytes"] == 0 and res["registers"] <= 128, res


@needs_dsl
def test_joint_prologue_ptx():
    """The joint prologue at M = 2 has the CTA barriers of M = 1 (one per reduction for both tokens); the
    token-by-token one it falls back to where the sources do not fit has two more (one per reduction per token)."""
    def barriers(lines):
        wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
        return sum(1 for ln in lines[wait:] if ln.startswith(("bar.sync", "barrier.sync")))
    assert barriers(_ring_ptx(6288, 2, 1)) == barriers(_ring_ptx(6288, 1, 1))
    joint4 = _ring_ptx(6288, 1, 4)
    alone4 = _ring_ptx(6288, 2, 4)
    assert barriers(alone4) == barriers(joint4) + 2
    res = _ptxas(alone4)
    if res is None:
        pytest.skip("ptxas not found (registers / spills need it)")
    assert res["spill_store_bytes"] == 0 and res["registers"] <= 128, res


# ------------------------------------------------------------------------------ the tensor-core ring, M 3..8

def test_mma_plan_and_tiles():
    # whole 16-row tiles split evenly over min(132, T) CTAs; the busiest takes ceil(T / G)
    assert G.mma_tiles_max(3216) == 2 and G.mma_tiles_max(6288) == 3 and G.mma_tiles_max(48) == 1
    for N in (48, 592, 3216, 6288, 7168):
        T = N // 16
        grid = min(132, T)
        spans = [(b + 1) * T // grid - b * T // grid for b in range(grid)]
        assert sum(spans) == T and min(spans) >= 1 and max(spans) == G.mma_tiles_max(N)
    for MB, Kw, tmax in ((8, K, 3), (4, K, 3), (8, 768, 4), (8, 1536, 4), (4, 12288, 4)):
        kc, D = G.mma_plan(MB, Kw, tmax)
        assert Kw % kc == 0 and kc % (G.MMA_CONSUMERS * 32) == 0 and D >= 2
        used = (MB * (2 * Kw + G.MMA_PAD) + D * 16 * (2 * kc + G.MMA_PAD) + G.MMA_CONSUMERS * tmax * 512
                + 8 * (2 * D + 1))
        assert used <= SMEM_PER_CTA_MAX
        # staged rows 64 B apart modulo 128: a quad-phase of 16-byte loads (rows g, g + 1) is bank-conflict free
        assert (2 * kc + G.MMA_PAD) % 128 == 64 and (2 * Kw + G.MMA_PAD) % 128 == 64
    with pytest.raises(ValueError, match="ring slots"):
        G.mma_plan(8, 12288, 4)
    # where it serves: the rank16 / rank8 in_proj and o_proj, not full width (x or the tile count too large)
    assert all(G.mma_applicable(M, Kw, N) for M in (3, 8) for N, Kw in ((3216, K), (6288, K), (7168, 768),
                                                                       (7168, 1536)))
    assert not G.mma_applicable(8, 12288, 7168) and not G.mma_applicable(3, K, 49376)
    assert not G.mma_applicable(9, K, 3216)


def test_mma_bad_inputs_are_refused():
    w = torch.zeros(64, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M in 1..8"):
        G.gemv_ring_mma(torch.zeros(9, K, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="K of 256"):
        G.gemv_ring_mma(torch.zeros(3, 1000, dtype=torch.bfloat16), torch.zeros(64, 1000, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 16"):
        G.gemv_ring_mma(torch.zeros(3, K, dtype=torch.bfloat16), torch.zeros(40, K, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="mma_applicable"):
        G.gemv_ring_mma(torch.zeros(8, 12288, dtype=torch.bfloat16), torch.zeros(64, 12288, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x: expected \[M, 7168\]"):
        G.gemv_ring_mma(torch.zeros(3, 1024, dtype=torch.bfloat16), w)
    with pytest.raises(TypeError, match="dtype"):
        G.gemv_ring_mma(torch.zeros(3, K), w)


@needs_dsl
def test_mma_ptx_order_and_registers():
    lines = _ptx(lambda options: G._build_mma(8, K, G.mma_tiles_max(6288), options=options))
    first = lambda pat: next(i for i, ln in enumerate(lines) if pat in ln)   # noqa: E731
    wait = first("griddepcontrol.wait")
    bulk = [i for i, ln in enumerate(lines) if "cp.async.bulk.shared::cluster.global" in ln]
    # a chunk's 16 row pieces go out before the PDL wait; x and the rest of the ring after it
    assert bulk[0] < wait and sum(i < wait for i in bulk) == 16 and sum(i > wait for i in bulk) >= 17
    # 8 consumer warps x 2 k32 steps per 512-column chunk: 3 tiles x 14 chunks x 2 steps x 2 k16 halves
    assert sum(ln.startswith("mma.sync.aligned.m16n8k16") for ln in lines) == 3 * 14 * 2 * 2
    trig = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.launch_dependents")]
    stores = [i for i, ln in enumerate(lines) if ln.startswith("st.global")]
    assert len(trig) == 1 and trig[0] > max(stores)
    res = _ptxas(lines)
    if res is None:
        pytest.skip("ptxas not found (registers / spills need it)")
    assert res["spill_store_bytes"] == 0 and res["registers"] <= 64, res
