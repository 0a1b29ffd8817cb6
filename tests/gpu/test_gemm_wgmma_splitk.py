"""k3fast.kernels.gemm_wgmma_splitk (the in_proj's GEMM at 8 < M <= 64 on WGMMA with a cluster K split) on the GPU.

References (tolerances.py): against F.linear in fp32 ("bf16_kernel": one bf16 rounding of an fp32 sum) and against
cuBLAS on the same bf16 operands ("bf16_kernel_pair": a different K order, 1 bf16 ulp where the fp32 sums round
differently). Outputs are poisoned with NaN first, so an element the kernel skips fails."""
import pytest
import torch
import torch.nn.functional as F

from attnres_cases import K, N_RANK8, N_RANK16, check_norm_then_gemm_in_a_graph, make_w
from tolerances import assert_close

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def G():
    from k3fast.kernels import gemm_wgmma_splitk
    return gemm_wgmma_splitk


# the layer's two in_proj widths (the plan: S = 8 x BN 224 / S = 4 x BN 224), S = 4 pinned at rank16, a small shape
# whose last row tile is partial (1000 rows, K = 1024: 16 k-tiles over 8 CTAs), a two-stage ring, 128-wide stages,
# and no split (S = 1: no cluster, the epilogue reads its own tile)
SHAPES = [(N_RANK16, K, {}), (N_RANK8, K, {}), (N_RANK16, K, dict(ksplit=4)), (1000, 1024, {}),
          (N_RANK8, K, dict(stages=2)), (N_RANK16, K, dict(bk=128)), (N_RANK16, K, dict(ksplit=1, bn=32)),
          (7168, 768, {}), (7168, 1536, {}), (7168, 768, dict(stages=2)), (7168, 1536, dict(stages=3)),
          (N_RANK8, K, dict(ksplit=1, bn=48)), (N_RANK8, K, dict(ksplit=2, bn=96)),
          (N_RANK16, K, dict(xrows="auto")), (N_RANK8, K, dict(xrows="auto")), (7168, 1536, dict(xrows="auto")),
          (N_RANK16, K, dict(ksplit=4, bn=112, xrows="auto"))]
# (7168 x 768 / 1536: o_proj at rank16 / rank8, "fast-opwg" and its ring variants, session 26; the last two: the
# in_proj's cuBLAS-like tiles, session 27; xrows "auto": v3's x tiles of the token bucket's rows; 4 x 112 rows: the
# in_proj at rank16 M 17..64, session 28)


@pytest.mark.parametrize("M", [9, 16, 33, 64, 1, 8])
@pytest.mark.parametrize("N,Kw,kw", SHAPES)
def test_gemm_wgmma(G, seed, M, N, Kw, kw):
    x = torch.randn(M, Kw, device="cuda").to(torch.bfloat16)
    w = make_w(N, Kw)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = G.gemm_wgmma(x, w, out=out, **kw)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr()
    assert_close("gemm_wgmma", y, F.linear(x.float(), w.float()), "bf16_kernel")
    assert_close("gemm_wgmma vs cuBLAS", y, F.linear(x, w), "bf16_kernel_pair")
    assert torch.equal(G.gemm_wgmma(x, w, **kw), y)             # deterministic: fixed split, rank-order sum
    # a token's row does not depend on the other tokens (its own WGMMA row, the same K split)
    assert torch.equal(G.gemm_wgmma(x[-1:].contiguous(), w, **kw)[0], y[-1])


@pytest.mark.parametrize("M", [9, 64])
@pytest.mark.parametrize("N,Kw,kw", [(N_RANK16, K, {}), (N_RANK8, K, dict(stages=3)), (1000, 1024, {}),
                                     (N_RANK16, K, dict(bk=128))])
def test_tiled_weight_gives_the_same_bits(G, seed, M, N, Kw, kw):
    """v2 on tile_weight's copy: the same tiles reach the same shared-memory places, so the same bits; every output
    written (poisoned first)."""
    x = torch.randn(M, Kw, device="cuda").to(torch.bfloat16)
    w = make_w(N, Kw)
    tw = G.tile_weight(w, **({"bk": kw["bk"]} if "bk" in kw else {}))
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    G.gemm_wgmma(x, tw, out=out, **{k: v for k, v in kw.items() if k != "bk"})
    torch.cuda.synchronize()
    assert torch.equal(out, G.gemm_wgmma(x, w, **kw))
    with pytest.raises(ValueError, match="laid out for bk"):
        G.gemm_wgmma(x, tw, bk=128 if tw.bk == 64 else 64)


@pytest.mark.parametrize("M", [9, 17, 64])
@pytest.mark.parametrize("N,Kw,kw", [(N_RANK16, K, dict(ksplit=4, bn=112, xrows="auto")), (N_RANK16, K, {}),
                                     (N_RANK8, K, dict(ksplit=2, bn=96, xrows="auto")), (1000, 1024, {}),
                                     (7168, 768, dict(ksplit=4, bn=240)), (N_RANK16, K, dict(ksplit=1, bn=32))])
def test_bulk_weight_gives_the_same_bits(G, seed, M, N, Kw, kw):
    """v4 on tile_weight(swizzle=True)'s copy: W's tiles by 1-D bulk copies land where the TMA box's 128-byte swizzle
    puts them, so the same bits as the tensor-map build, every output written (poisoned first). The shapes include
    last row tiles that are partial (rank16's 3216 rows over 112 / 224, 1000 over the plan's BN), where the bulk copy
    moves only the rows < N and the box zero-fills the rest."""
    x = torch.randn(M, Kw, device="cuda").to(torch.bfloat16)
    w = make_w(N, Kw)
    bw = G.tile_weight(w, swizzle=True)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    G.gemm_wgmma(x, bw, out=out, **kw)
    torch.cuda.synchronize()
    assert torch.equal(out, G.gemm_wgmma(x, w, **kw))
    # the diagnostic ring without x, on the bulk path (a benchmark row): runs to completion
    G.gemm_wgmma(x, bw, diag="nox", **kw)
    torch.cuda.synchronize()


@pytest.mark.parametrize("M", [9, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("N,Kw,kw", [(N_RANK16, K, {}), (N_RANK8, K, {}), (7168, 1536, {}),
                                     (N_RANK8, K, dict(ksplit=2, bn=96)), (N_RANK16, K, dict(ksplit=4, bn=112))])
def test_x_rows_give_the_same_bits(G, seed, M, N, Kw, kw):
    """v3: a stage loads only the token bucket's x rows and the WGMMAs read the rest of their 64-row view from the
    next stage; the stored rows are the same sums in the same order as with v1's zero-filled 64-row box."""
    x = torch.randn(M, Kw, device="cuda").to(torch.bfloat16)
    w = make_w(N, Kw)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = G.gemm_wgmma(x, w, out=out, xrows="auto", **kw)
    assert torch.equal(y, G.gemm_wgmma(x, w, **kw))


def test_gemm_wgmma_nan_poisons_its_token_only(G, seed):
    x = torch.randn(20, K, device="cuda").to(torch.bfloat16)
    w = make_w(N_RANK16)
    y0 = G.gemm_wgmma(x, w)
    x[7, 3000] = float("nan")
    y = G.gemm_wgmma(x, w)
    torch.cuda.synchronize()
    assert y[7].isnan().all()
    keep = torch.arange(20, device="cuda") != 7
    assert torch.equal(y[keep], y0[keep])


def test_gemm_wgmma_neighbours_untouched(G, seed):
    # out is the head of a bigger buffer: nothing past its M x N elements changes (the last row tile is partial)
    big = torch.full((40, 1000), 7.0, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(33, 1024, device="cuda").to(torch.bfloat16)
    w = make_w(1000, 1024)
    out = big.view(-1)[: 33 * 1000].view(33, 1000)
    G.gemm_wgmma(x, w, out=out)
    torch.cuda.synchronize()
    assert (big.view(-1)[33 * 1000:] == 7.0).all()
    assert_close("gemm_wgmma", out, F.linear(x.float(), w.float()), "bf16_kernel")


@pytest.mark.parametrize("M", [16, 64])
@pytest.mark.parametrize("early", [True, False])
def test_norm_then_wgmma_in_a_graph(G, seed, M, early):
    """fast.attnres_in_proj's wide path (attnres_rmsnorm, its trigger early or late, then gemm_wgmma): p' exact,
    y against the fp32 reference and equal to the norm + gemm_wgmma called apart; captured once and replayed on new
    inputs, each replay equals an eager call (attnres_cases.check_norm_then_gemm_in_a_graph)."""
    check_norm_then_gemm_in_a_graph(M, G.gemm_wgmma, "attnres_in_proj (wgmma)", wide="wgmma", wide_early=early)


def test_diagnostic_build_runs_the_ring_and_writes_zeros(G, seed):
    """diag="nomma" (the benchmark's stream-only build): the same ring and epilogue without WGMMAs finishes and writes
    every output (poisoned first) as zero."""
    x = torch.randn(64, K, device="cuda").to(torch.bfloat16)
    w = make_w(N_RANK16)
    out = torch.full((64, N_RANK16), float("nan"), device="cuda", dtype=torch.bfloat16)
    G.gemm_wgmma(x, w, out=out, diag="nomma")
    torch.cuda.synchronize()
    assert (out == 0).all()
