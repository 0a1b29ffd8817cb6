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


@pytest.mark.parametrize("heads", [6, 12])
@pytest.mark.parametrize("lengths", [[33000], [8192], [65, 1, 0, 130], [1024 - 7 * i for i in range(64)]],
                         ids=["b1-33k", "b1-8k", "b4-mixed", "b64-1k"])
def test_combine_build_against_the_plain_build(lengths, heads):
    """The combine build (the decode's deferred partials, summed by latent slice, the head's slices met by its last
    CTA) against the plain build on the in-kernel combine's o_lat: real W_UV and gate, within bf16_kernel; b1 at 33K
    tokens plans more (token, split) items than one pass holds (129 splits); a padded request gives zeros x gate; the same bits
    on a second call (the per-head counters re-arm)."""
    from test_mla_latent_decode import SCALE, paged_case

    from k3fast.kernels import mla_latent_decode as mk
    from k3fast.kernels.mla_uv_gate import ITEMS
    q, pool, table, lens = paged_case(lengths, heads, seed=len(lengths) * 7 + heads)
    N = len(lengths)
    g = torch.Generator(device="cuda").manual_seed(heads)
    w_uv = (torch.randn(heads, 128, 512, generator=g, device="cuda") * 512 ** -0.5).to(torch.bfloat16)
    z = torch.randn(N, heads * 128, generator=g, device="cuda").to(torch.bfloat16)
    ws = mk.make_workspace(N, heads, table.shape[1], q.device, defer=True)
    parts = mk.mla_latent_decode(q, pool, table, lens, scale=SCALE, workspace=ws, defer=True)
    if lengths == [33000]:
        assert N * parts.splits > ITEMS
    out = torch.full((N, heads * 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    mla_uv_gate(parts, w_uv, z, g_col=0, out=out)
    again = mla_uv_gate(parts, w_uv, z, g_col=0)
    want = mla_uv_gate(mk.mla_latent_decode(q, pool, table, lens, scale=SCALE), w_uv, z, g_col=0)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert_close("y", out.float(), want.float(), "bf16_kernel")
    assert torch.equal(out, again), "not deterministic"
