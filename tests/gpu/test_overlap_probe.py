"""GPU tests of k3fast.overlap_probe's shared-memory fill: every 16-byte vector of every slice lands in shared
memory (each thread's XOR of what it copied matches the host's), the source keeps every bit, and it runs beside
read_once on another stream."""
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from k3fast import overlap_probe as op  # noqa: E402
from k3fast.l2probe import read_once  # noqa: E402


def expected_xor(x: torch.Tensor, ctas: int, steps: int) -> np.ndarray:
    a = x.cpu().numpy().reshape(ctas, steps, op.THREADS, 4)
    return np.bitwise_xor.reduce(np.bitwise_xor.reduce(a, axis=3), axis=1).reshape(-1)


@pytest.mark.parametrize("ctas,steps", [(1, 1), (7, 3), (128, 23), (132, 27)])
def test_fill_lands_every_vector(ctas, steps):
    g = torch.Generator(device="cuda").manual_seed(ctas * 31 + steps)
    x = torch.randint(-2**31, 2**31 - 1, (ctas * steps * op.STEP_BYTES // 4,), dtype=torch.int32, device="cuda",
                      generator=g)
    before = x.clone()
    out = torch.full((ctas * op.THREADS,), 0x55AA55AA, dtype=torch.int32, device="cuda")
    op.smem_fill(x, out, ctas)
    torch.cuda.synchronize()
    assert np.array_equal(out.cpu().numpy(), expected_xor(x, ctas, steps))
    assert torch.equal(x, before)


def test_fill_beside_a_stream():
    ctas, steps = 128, 23
    x = torch.randint(-2**31, 2**31 - 1, (ctas * steps * op.STEP_BYTES // 4,), dtype=torch.int32, device="cuda")
    y = torch.randn(51_400_000 // 4, device="cuda")
    out = torch.zeros(ctas * op.THREADS, dtype=torch.int32, device="cuda")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(3):
        with torch.cuda.stream(s1):
            op.smem_fill(x, out, ctas)
        with torch.cuda.stream(s2):
            read_once(y, sink)
    torch.cuda.synchronize()
    assert np.array_equal(out.cpu().numpy(), expected_xor(x, ctas, steps))
