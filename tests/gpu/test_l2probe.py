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


@pytest.mark.parametrize("nvec,ctas", [(1, 1), (3, 528), (1000, 7), (48 * l2probe.MB // 16, 528), (4097, 132)])
def test_reader_reads_every_vector(nvec, ctas):
    """read_once folds each thread's words into one XOR and stores only if it equals a magic value: on a zero
    buffer with the magic word at position p, the store happens iff vector p was read. First, middle and last."""
    for p in sorted({0, nvec // 2, nvec - 1}):
        x = torch.zeros(4 * nvec, dtype=torch.int32, device="cuda")
        x[4 * p + 1] = 0x7F3A5C11
        out = torch.zeros(1, dtype=torch.int32, device="cuda")
        l2probe.read_once(x, out, ctas)
        torch.cuda.synchronize()
        assert out.item() == 0x7F3A5C11, f"vector {p} of {nvec} was not read"


def test_reader_writes_nothing_on_random_data():
    x = torch.randint(-2**31, 2**31 - 1, (4 * 100_003,), dtype=torch.int32, device="cuda",
                      generator=torch.Generator(device="cuda").manual_seed(9))
    before = x.clone()
    out = torch.full((1,), -5, dtype=torch.int32, device="cuda")
    l2probe.read_once(x, out)
    torch.cuda.synchronize()
    assert out.item() == -5 and torch.equal(x, before)
