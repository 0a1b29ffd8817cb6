"""mla_uv_gate against the torch bmm + gate it replaces, with k3ref's rounding points (GPU)."""
import pytest
import torch

from tolerances import assert_close

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from k3fast.kernels.mla_uv_gate import mla_uv_gate  # noqa: E402


@pytest.mark.parametrize("heads", [6, 12, 96])
@pytest.mark.parametrize("M", [1, 3, 8, 17, 64])
def test_against_bmm_and_gate(M, heads):
    g = torch.Generator(device="cuda").manual_seed(M * 1000 + heads)
    o_lat = torch.randn(M, heads, 512, generator=g, device="cuda").to(torch.bfloat16)
    w_uv = (torch.randn(heads, 128, 512, generator=g, device="cuda") * 512 ** -0.5).to(torch.bfloat16)
    col = 1536 + 576
    z = torch.randn(M, col + heads * 128, generator=g, device="cuda").to(torch.bfloat16)
    out = torch.full((M, heads * 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    mla_uv_gate(o_lat, w_uv, z, g_col=col, out=out)
    again = mla_uv_gate(o_lat, w_uv, z, g_col=col)
    torch.cuda.synchronize()
    o = torch.bmm(o_lat.transpose(0, 1).float(), w_uv.transpose(1, 2).float()).transpose(0, 1).bfloat16()
    want = (o.reshape(M, -1).float() * torch.sigmoid(z[:, col:].float())).bfloat16()
    assert_close("y", out.float(), want.float(), "bf16_kernel")
    assert torch.equal(out, again), "not deterministic"
