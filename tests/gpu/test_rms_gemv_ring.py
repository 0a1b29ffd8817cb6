"""k3fast.kernels.rms_gemv_ring (rms_gemv v12: weights through a bulk-copy shared-memory ring) on the GPU.

References (tolerances.py): the bare GEMV against F.linear in fp32 ("bf16_kernel") and against rms_gemv.gemv on
the same x ("bf16_kernel_pair"); the fused kernel against test_rms_gemv's fp32 AttnRes + RMSNorm + GEMV reference
("bf16_kernel": x is rounded to bf16 before the dot, then the output) and against rms_gemv's fused FMA kernel
("bf16_kernel_pair"). p' and the written block row are exact (the same prologue code as rms_gemv's)."""
import pytest
import torch
import torch.nn.functional as F

from attnres_cases import (EPS, K, N_FULL, N_RANK8, N_RANK16, check_norm_then_gemm_in_a_graph, make_inputs,
                           make_w, ref_attnres)
from tolerances import assert_close

pytestmark = pytest.mark.gpu

# 592 rows: 296 pairs over 132 CTAs (2 or 3 chunks each, fewer than the ring's slots); 48 rows: a 24-CTA grid
WIDTHS = [N_RANK16, N_RANK8, 592, 48]


@pytest.fixture(scope="module")
def G():
    from k3fast.kernels import rms_gemv_ring
    return rms_gemv_ring


@pytest.fixture(scope="module")
def R():
    from k3fast.kernels import rms_gemv
    return rms_gemv


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("N,Kw", [(n, K) for n in WIDTHS] + [(N_RANK16, 3584), (N_FULL, K)])
def test_gemv_ring(G, R, seed, M, N, Kw):
    x = torch.randn(M, Kw, device="cuda").to(torch.bfloat16)
    w = make_w(N, Kw)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = G.gemv_ring(x, w, out=out)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr()
    # every row written (the output was poisoned with NaN, which assert_close refuses)
    assert_close("gemv_ring", y, F.linear(x.float(), w.float()), "bf16_kernel")
    assert_close("gemv_ring vs gemv", y, R.gemv(x, w), "bf16_kernel_pair")
    assert torch.equal(G.gemv_ring(x, w), y)                # deterministic: fixed split and order


def test_gemv_ring_neighbours_untouched(G, seed):
    # out is a view into a bigger buffer: nothing outside its rows / columns changes
    big = torch.full((3, 512 + 32), 7.0, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, K, device="cuda").to(torch.bfloat16)
    w = make_w(512)
    view = big[:2, 16:16 + 512]
    with pytest.raises(ValueError, match="contiguous"):
        G.gemv_ring(x, w, out=view)
    out = big[:2].view(-1)[: 2 * 512].view(2, 512)
    G.gemv_ring(x, w, out=out)
    torch.cuda.synchronize()
    assert (big.view(-1)[2 * 512:] == 7.0).all()
    assert_close("gemv_ring", out, F.linear(x.float(), w.float()), "bf16_kernel")


@pytest.mark.parametrize("N", [N_RANK16, N_RANK8, 592])
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("n_blocks,with_delta,block_write", [(0, False, 0), (1, True, -1), (3, False, 3),
                                                             (8, True, -1)])
def test_attnres_rms_gemv_ring(G, R, seed, N, M, n_blocks, with_delta, block_write):
    blocks, p, delta, u, w_ln = make_inputs(M, n_blocks, with_delta)
    w = make_w(N)
    blocks0, p0 = blocks.clone(), p.clone()
    x_ref, p2_ref = ref_attnres(blocks, n_blocks, p, delta, u, w_ln)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    pout = torch.full((M, K), float("nan"), device="cuda", dtype=torch.bfloat16)
    y, po = G.attnres_rms_gemv_ring(blocks, n_blocks, p, delta, u, w_ln, w, eps=EPS, block_write=block_write,
                                    out=out, partial_out=pout, early_trigger=True)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr() and po.data_ptr() == pout.data_ptr()
    assert_close("p'", po, p2_ref, "exact")
    assert_close("attnres_rms_gemv_ring", y, F.linear(x_ref, w.float()), "bf16_kernel")
    expect = blocks0.clone()
    if block_write >= 0:
        expect[:, block_write] = p2_ref
    assert torch.equal(blocks, expect)
    assert torch.equal(p, p0)
    # beside the fused FMA kernel on the same inputs (blocks as they were)
    y_f, p_f = R.attnres_rms_gemv(blocks0.clone(), n_blocks, p, delta, u, w_ln, w, eps=EPS, block_write=block_write)
    torch.cuda.synchronize()
    assert_close("p' (ring vs fma)", po, p_f, "exact")
    assert_close("ring vs fused fma", y, y_f, "bf16_kernel_pair")


def test_attnres_rms_gemv_ring_nan_source_poisons(G, seed):
    """A NaN in a source row reaches y (the softmax mix carries it): NaN never turns into a finite answer."""
    blocks, p, delta, u, w_ln = make_inputs(1, 3, True)
    blocks[0, 1, 100] = float("nan")
    y, _ = G.attnres_rms_gemv_ring(blocks, 3, p, delta, u, w_ln, make_w(N_RANK16))
    torch.cuda.synchronize()
    assert y.isnan().all()


@pytest.mark.parametrize("joint", [False, True])
@pytest.mark.parametrize("M", [1, 2])
def test_ring_in_a_graph(G, seed, M, joint):
    """Captured once, replayed with new inputs copied in: each replay equals an eager call on those inputs."""
    n_blocks = 3
    blocks, p, delta, u, w_ln = make_inputs(M, n_blocks, True)
    w = make_w(N_RANK16)
    out = torch.empty(M, N_RANK16, device="cuda", dtype=torch.bfloat16)
    pout = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    G.attnres_rms_gemv_ring(blocks, n_blocks, p, delta, u, w_ln, w, out=out, partial_out=pout, joint=joint)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.attnres_rms_gemv_ring(blocks, n_blocks, p, delta, u, w_ln, w, out=out, partial_out=pout, joint=joint)
    for _ in range(3):
        b2, p2, d2, _, _ = make_inputs(M, n_blocks, True)
        blocks.copy_(b2), p.copy_(p2), delta.copy_(d2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        y_e, p_e = G.attnres_rms_gemv_ring(blocks, n_blocks, p, delta, u, w_ln, w, joint=joint)
        torch.cuda.synchronize()
        assert torch.equal(out, y_e) and torch.equal(pout, p_e)


@pytest.mark.parametrize("N", [N_RANK16, N_RANK8])
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("n_blocks,with_delta,block_write", [(0, False, 0), (1, True, -1), (3, True, 3),
                                                             (8, True, -1)])
def test_joint_prologue_is_bit_identical(G, seed, N, M, n_blocks, with_delta, block_write):
    """v12.2 runs the tokens' prologues phase by phase together (and loads w_ln early); each token's arithmetic and
    order are the token-by-token prologue's, so y, p' and the written block row equal the default's bit for bit
    (outputs poisoned). At n_blocks 8, M 2 the sources do not fit and the joint key falls back (same build)."""
    blocks, p, delta, u, w_ln = make_inputs(M, n_blocks, with_delta)
    w = make_w(N)
    outs = []
    for joint in (False, True):
        b = blocks.clone()
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        pout = torch.full((M, K), float("nan"), device="cuda", dtype=torch.bfloat16)
        G.attnres_rms_gemv_ring(b, n_blocks, p, delta, u, w_ln, w, eps=EPS, block_write=block_write, out=out,
                                partial_out=pout, joint=joint)
        torch.cuda.synchronize()
        outs.append((out, pout, b))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    x_ref, _ = ref_attnres(blocks, n_blocks, p, delta, u, w_ln)
    assert_close("attnres_rms_gemv_ring (joint)", outs[1][0], F.linear(x_ref, w.float()), "bf16_kernel")
    cmax = G.chunks_max(N)
    key = G.compile_key(M, K, N, True, n_blocks, with_delta, block_write, joint=True)
    assert (key[-1] == "joint") == G.joint_applies(M, K, n_blocks, cmax)


# ------------------------------------------------------------------------------ v13: the tensor-core ring, M 1..8

# in_proj at rank16 / rank8 (2 / 3 tiles per CTA), o_proj at rank16 / rank8 (K 768 / 1536: chunk widths 256 / 512),
# 37 tiles (a 37-CTA grid, one tile each), 3 tiles
MMA_SHAPES = [(N_RANK16, K), (N_RANK8, K), (7168, 768), (7168, 1536), (592, K), (48, K)]


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("N,Kw", MMA_SHAPES)
def test_gemv_ring_mma(G, R, seed, M, N, Kw):
    x = torch.randn(M, Kw, device="cuda").to(torch.bfloat16)
    w = make_w(N, Kw)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = G.gemv_ring_mma(x, w, out=out)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr()
    # every output written (poisoned with NaN, which assert_close refuses), against fp32 and beside cuBLAS
    assert_close("gemv_ring_mma", y, F.linear(x.float(), w.float()), "bf16_kernel")
    assert_close("gemv_ring_mma vs cuBLAS", y, F.linear(x, w), "bf16_kernel_pair")
    assert torch.equal(G.gemv_ring_mma(x, w), y)            # deterministic: fixed split and order
    # a token's result does not depend on the other tokens in the batch (its own MMA column)
    assert torch.equal(G.gemv_ring_mma(x[-1:].contiguous(), w)[0], y[-1])
    # v14 on the tiled weight (mma_tile_weight): every lane reads the same 16 bytes, so v13's bits, every output
    # written (poisoned again), deterministic
    tw = G.mma_tile_weight(w)
    out_t = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert G.gemv_ring_mma(x, tw, out=out_t).data_ptr() == out_t.data_ptr()
    assert torch.equal(out_t, y)
    assert torch.equal(G.gemv_ring_mma(x, tw), y)


def test_gemv_ring_mma_nan_poisons_its_token_only(G, seed):
    """A NaN in token 1's x makes token 1's outputs NaN and leaves the others finite and unchanged."""
    x = torch.randn(5, K, device="cuda").to(torch.bfloat16)
    w = make_w(N_RANK16)
    y0 = G.gemv_ring_mma(x, w)
    x[1, 1000] = float("nan")
    y = G.gemv_ring_mma(x, w)
    torch.cuda.synchronize()
    assert y[1].isnan().all()
    keep = torch.tensor([0, 2, 3, 4], device="cuda")
    assert torch.equal(y[keep], y0[keep])


def test_gemv_ring_mma_neighbours_untouched(G, seed):
    big = torch.full((9, 592), 7.0, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(6, K, device="cuda").to(torch.bfloat16)
    w = make_w(592)
    out = big.view(-1)[: 6 * 592].view(6, 592)
    G.gemv_ring_mma(x, w, out=out)
    torch.cuda.synchronize()
    assert (big.view(-1)[6 * 592:] == 7.0).all()
    assert_close("gemv_ring_mma", out, F.linear(x.float(), w.float()), "bf16_kernel")


@pytest.mark.parametrize("M", [3, 8])
@pytest.mark.parametrize("early", [False, True])
def test_norm_then_ring_mma_in_a_graph(G, seed, M, early):
    """fast.attnres_in_proj's v13 path (attnres_rmsnorm, its trigger early or late, then the ring): p' exact, y against
    the fp32 reference and equal to the norm + ring called apart; captured once and replayed on new inputs, each
    replay equals an eager call (attnres_cases.check_norm_then_gemm_in_a_graph). v14 on the tiled weight gives the
    same bits."""
    from k3fast.layer import attnres_in_proj
    call, (blocks, n_blocks, p, delta, u, w_ln), w = check_norm_then_gemm_in_a_graph(
        M, G.gemv_ring_mma, "attnres_in_proj (v13)", mid="ring", mid_early=early)
    y, _ = call(torch.empty(M, K, device="cuda", dtype=torch.bfloat16))
    y_t, _ = attnres_in_proj(blocks, n_blocks, p, delta, u, w_ln, w, eps=EPS, block_write=-1,
                             partial_out=torch.empty(M, K, device="cuda", dtype=torch.bfloat16),
                             mid="ring", mid_early=early, w_tiled=G.mma_tile_weight(w))
    assert torch.equal(y_t, y)                              # v14 on the tiled weight: the same bits
