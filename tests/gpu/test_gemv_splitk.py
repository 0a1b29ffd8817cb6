"""k3fast.gemv_splitk on the GPU against fp64 torch, on fresh random inputs (bf16_kernel tolerance: bf16 output
rounding over fp32 accumulation), with poisoned outputs, rows past M untouched, every K split the host may pick,
repeat launches bit-identical (the per-row-block counters reset themselves), and the gemv(mma="splitk") route."""
import pytest
import torch

from tolerances import assert_close

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from k3fast import gemv_splitk as S  # noqa: E402
from k3fast import rms_gemv as R  # noqa: E402


def inputs(M, N, K):
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") * K ** -0.5).to(torch.bfloat16)
    return x, w, (x.double() @ w.double().t())


@pytest.mark.parametrize("M", [5, 8, 13, 16, 31, 33, 64])
@pytest.mark.parametrize("N,K", [(3216, 7168), (6288, 7168), (7168, 768), (4480, 7168), (7168, 3584)])
def test_matches_fp64(seed, M, N, K):
    if not S.applicable(N, K, M):
        pytest.skip("shape served by rms_gemv's kernel")
    x, w, ref = inputs(M, N, K)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = S.gemv_splitk(x, w, out=out)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr()
    assert_close("y", out, ref, "bf16_kernel")
    again = S.gemv_splitk(x, w)
    assert torch.equal(again.view(torch.int16), out.view(torch.int16)), "not deterministic"


@pytest.mark.parametrize("kg", [1, 2, 7, 14, 28])
def test_every_k_split(seed, kg):
    M, N, K = 24, 3216, 7168
    x, w, ref = inputs(M, N, K)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    if S.x_tile_bytes(S.bucket(M), (K // 32) // kg) > 227 * 1024:
        pytest.skip("x tile exceeds shared memory")
    S.gemv_splitk(x, w, out=out, kg=kg)
    torch.cuda.synchronize()
    assert_close(f"y kg={kg}", out, ref, "bf16_kernel")


def test_rows_beyond_M_untouched(seed):
    big = torch.full((16, 3216), 7.0, device="cuda", dtype=torch.bfloat16)
    x, w, ref = inputs(9, 3216, 7168)
    S.gemv_splitk(x, w, out=big[:9])
    torch.cuda.synchronize()
    assert (big[9:] == 7.0).all()
    assert_close("y", big[:9], ref, "bf16_kernel")


def test_graph_replay_and_gemv_route(seed):
    x, w, ref = inputs(64, 3216, 7168)
    out = torch.full((64, 3216), float("nan"), device="cuda", dtype=torch.bfloat16)
    R.gemv(x, w, out=out, mma="splitk")            # warm: compile + workspace outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        R.gemv(x, w, out=out, mma="splitk")
    out.fill_(float("nan"))
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert_close("y replay", out, ref, "bf16_kernel")
    assert torch.equal(out.view(torch.int16), S.gemv_splitk(x, w).view(torch.int16))
