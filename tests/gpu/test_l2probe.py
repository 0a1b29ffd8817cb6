"""GPU tests of k3fast.l2probe's prefetch kernel: a prefetch moves no data (the buffer and its neighbours keep
every bit), covers odd grid sizes and the largest range the probe uses, and each mode / hint launches."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from k3fast import l2probe  # noqa: E402


@pytest.mark.parametrize("mode", l2probe.MODES)
@pytest.mark.parametrize("hint", l2probe.HINTS)
@pytest.mark.parametrize("ctas,mb", [(1, 1), (4, 48), (7, 3), (132, 24)])
def test_prefetch_moves_no_data(mode, hint, ctas, mb):
    g = torch.Generator(device="cuda").manual_seed(ctas * 100 + mb)
    whole = torch.randn(mb * l2probe.MB // 4 + 2 * 4096, generator=g, device="cuda")
    before = whole.clone()
    x = whole[4096:-4096]                      # neighbours on both sides: 16 KB each, outside the range
    l2probe.l2_prefetch(x, ctas, mode, hint)
    torch.cuda.synchronize()
    assert torch.equal(whole.view(torch.int32), before.view(torch.int32))


def test_misaligned_view_is_refused():
    x = torch.randn(l2probe.CHUNK // 4 + 1, device="cuda")[1:]    # 4-byte offset: not 16-byte aligned
    with pytest.raises(ValueError, match="16-byte aligned"):
        l2probe.l2_prefetch(x, 4)
