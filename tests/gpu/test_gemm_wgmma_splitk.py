"""k3fast.kernels.gemm_wgmma_splitk (the in_proj's and o_proj's GEMM at 8 < M <= 64 on WGMMA with a cluster K split)
on the GPU.

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


# the layer's pin sets (the plan's own; rank8's 2 x 96 rows with the token bucket's x rows; rank16's 4 x 112 rows above
# M = 16)
PINS_WIDE = {"ksplit": 2, "bn": 96, "xrows": "auto"}
PINS_LARGE_M = {"ksplit": 4, "bn": 112, "xrows": "auto"}
# the in_proj at both widths with each pin set the layer gives it, o_proj at rank16 / rank8 (K 768 / 1536), a small
# shape whose last row tile is partial (1000 rows, K = 1024: 16 k-tiles over 8 CTAs), and one the plan gives no split
# (K = 64: one k-tile, S = 1, no cluster: the epilogue reads its own tile)
SHAPES = [(N_RANK16, K, {}), (N_RANK16, K, PINS_LARGE_M), (N_RANK8, K, PINS_WIDE), (N_RANK8, K, {}),
          (7168, 768, {}), (7168, 1536, {}), (1000, 1024, {}), (48, 64, {})]


def _id(v):
    if isinstance(v, dict):
        return {id(PINS_WIDE): "2x96auto", id(PINS_LARGE_M): "4x112auto"}.get(id(v), "plan")
    return str(v)


@pytest.mark.parametrize("M", [9, 16, 33, 64, 1, 8])
@pytest.mark.parametrize("N,Kw,kw", SHAPES, ids=_id)
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


@pytest.mark.parametrize("M", [9, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("N,Kw,kw", [(N_RANK16, K, {}), (N_RANK8, K, dict(ksplit=2, bn=96)),
                                     (N_RANK16, K, dict(ksplit=4, bn=112))], ids=["plan", "2x96", "4x112"])
def test_x_rows_give_the_same_bits(G, seed, M, N, Kw, kw):
    """xrows="auto": a stage loads only the token bucket's x rows and the WGMMAs read the rest of their 64-row view
    from the next stage; the stored rows are the same sums in the same order as with the zero-filled 64-row box, every
    output written (poisoned first)."""
    x = torch.randn(M, Kw, device="cuda").to(torch.bfloat16)
    w = make_w(N, Kw)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = G.gemm_wgmma(x, w, out=out, xrows="auto", **kw)
    assert not y.isnan().any()
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
def test_norm_then_wgmma_in_a_graph(G, seed, M):
    """The layer's in_proj at rank8's width above M = 8: attnres_rmsnorm (its trigger after its wait) then gemm_wgmma
    with the layer's pins; p' exact, y against the fp32 reference and equal with the norm's trigger at its end; captured
    once and replayed on new inputs, each replay equal to an eager call (check_norm_then_gemm_in_a_graph)."""
    check_norm_then_gemm_in_a_graph(M, G.gemm_wgmma, "norm + gemm_wgmma", **PINS_WIDE)
