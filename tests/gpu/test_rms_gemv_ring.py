"""k3fast.kernels.rms_gemv_ring on the GPU: the fused ring (the layer's in_proj at M <= 2) and the tensor-core ring GEMV
(the layer's in_proj GEMV at M 3..8).

References (tolerances.py): the fused kernel against the fp32 AttnRes + RMSNorm + GEMV reference (attnres_cases;
"bf16_kernel": x is rounded to bf16 before the dot, then the output) and against rms_gemv's fused FMA kernel, its
contender ("bf16_kernel_pair"); the tensor-core ring against F.linear in fp32 ("bf16_kernel") and cuBLAS on the same
bf16 operands ("bf16_kernel_pair"). p' and the written block row are exact (the same prologue code as rms_gemv's).
Outputs are poisoned with NaN first, so an element a kernel skips fails."""
import pytest
import torch
import torch.nn.functional as F

from attnres_cases import EPS, K, N_RANK8, N_RANK16, check_norm_then_gemm_in_a_graph, make_inputs, make_w, ref_attnres
from tolerances import assert_close

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def G():
    from k3fast.kernels import rms_gemv_ring
    return rms_gemv_ring


@pytest.fixture(scope="module")
def R():
    from k3fast.kernels import rms_gemv
    return rms_gemv


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
                                    out=out, partial_out=pout)
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


def test_attnres_rms_gemv_ring_neighbours_untouched(G, seed):
    # out is the head of a bigger buffer (592 rows: 296 pairs over 132 CTAs): nothing past its M x N elements changes
    blocks, p, delta, u, w_ln = make_inputs(2, 1, True)
    w = make_w(592)
    big = torch.full((3, 592), 7.0, device="cuda", dtype=torch.bfloat16)
    out = big.view(-1)[: 2 * 592].view(2, 592)
    G.attnres_rms_gemv_ring(blocks, 1, p, delta, u, w_ln, w, out=out)
    torch.cuda.synchronize()
    assert (big.view(-1)[2 * 592:] == 7.0).all()
    x_ref, _ = ref_attnres(blocks, 1, p, delta, u, w_ln)
    assert_close("attnres_rms_gemv_ring", out, F.linear(x_ref, w.float()), "bf16_kernel")


@pytest.mark.parametrize("n_blocks", [3, 4])
@pytest.mark.parametrize("M", [1, 2])
def test_ring_in_a_graph(G, seed, M, n_blocks):
    """Captured once, replayed with new inputs copied in: each replay equals an eager call on those inputs (at M = 2
    the joint prologue at 3 blocks, the token-by-token one at 4)."""
    blocks, p, delta, u, w_ln = make_inputs(M, n_blocks, True)
    w = make_w(N_RANK16)
    out = torch.empty(M, N_RANK16, device="cuda", dtype=torch.bfloat16)
    pout = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    G.attnres_rms_gemv_ring(blocks, n_blocks, p, delta, u, w_ln, w, out=out, partial_out=pout)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.attnres_rms_gemv_ring(blocks, n_blocks, p, delta, u, w_ln, w, out=out, partial_out=pout)
    for _ in range(3):
        b2, p2, d2, _, _ = make_inputs(M, n_blocks, True)
        blocks.copy_(b2), p.copy_(p2), delta.copy_(d2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        y_e, p_e = G.attnres_rms_gemv_ring(blocks, n_blocks, p, delta, u, w_ln, w)
        torch.cuda.synchronize()
        assert torch.equal(out, y_e) and torch.equal(pout, p_e)


@pytest.mark.parametrize("N", [N_RANK16, N_RANK8])
@pytest.mark.parametrize("n_blocks,with_delta,block_write", [(0, False, 0), (1, True, -1), (3, True, 3),
                                                             (4, True, 4), (8, True, -1)])
def test_tokens_are_independent(G, seed, N, n_blocks, with_delta, block_write):
    """At M = 2 each token's y, p' and written block row equal the token alone (M = 1) bit for bit: the joint prologue
    (n_blocks <= 3) runs each token's arithmetic in the one-token order, the token-by-token one (n_blocks >= 4) is that
    order, and the consumers keep one accumulator per token over the same K split."""
    blocks, p, delta, u, w_ln = make_inputs(2, n_blocks, with_delta)
    w = make_w(N)
    b2 = blocks.clone()
    out = torch.full((2, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    pout = torch.full((2, K), float("nan"), device="cuda", dtype=torch.bfloat16)
    G.attnres_rms_gemv_ring(b2, n_blocks, p, delta, u, w_ln, w, eps=EPS, block_write=block_write, out=out,
                            partial_out=pout)
    for m in range(2):
        bm = blocks[m:m + 1].clone()
        dm = None if delta is None else delta[m:m + 1].contiguous()
        y1, p1 = G.attnres_rms_gemv_ring(bm, n_blocks, p[m:m + 1].contiguous(), dm, u, w_ln, w, eps=EPS,
                                         block_write=block_write)
        torch.cuda.synchronize()
        assert torch.equal(y1[0], out[m]) and torch.equal(p1[0], pout[m]) and torch.equal(bm[0], b2[m])
    x_ref, _ = ref_attnres(blocks, n_blocks, p, delta, u, w_ln)
    assert_close("attnres_rms_gemv_ring (M = 2)", out, F.linear(x_ref, w.float()), "bf16_kernel")


# ------------------------------------------------------------------------------ the tensor-core ring, M 1..8

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
def test_norm_then_ring_mma_in_a_graph(G, seed, M):
    """The layer's in_proj at M 3..8: attnres_rmsnorm (its trigger after its wait) then the ring; p' exact, y against
    the fp32 reference and equal with the norm's trigger at its end; captured once and replayed on new inputs, each
    replay equal to an eager call (attnres_cases.check_norm_then_gemm_in_a_graph)."""
    check_norm_then_gemm_in_a_graph(M, G.gemv_ring_mma, "norm + gemv_ring_mma")
