"""The L2 probe's prefetch kernel (k3fast.l2probe): each mode and hint compiles for sm_90a to the instruction it
names, and bad buffers are refused before any launch."""
import re

import pytest
import torch

from k3fast import l2probe
from k3fast._dsl import TVM_FFI, dsl_available
from k3fast.ptxcheck import compiled_ptx

pytestmark = pytest.mark.compile
needs_dsl = pytest.mark.skipif(not dsl_available(), reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")

EXPECTED = {
    ("bulk", ""): r"cp\.async\.bulk\.prefetch\.L2\.global\s+\[",
    ("bulk", "evict_last"): r"cp\.async\.bulk\.prefetch\.L2\.global\.L2::cache_hint\s+\[",
    ("line", ""): r"prefetch\.global\.L2\s+\[",
    ("line", "evict_last"): r"prefetch\.global\.L2::evict_last\s+\[",
}


@needs_dsl
@pytest.mark.parametrize("mode,hint", list(EXPECTED))
def test_prefetch_compiles_to_its_instruction(mode, hint):
    ptx = compiled_ptx(lambda: l2probe._build(mode, hint, 128, options=TVM_FFI + " --keep-ptx"))
    assert re.search(EXPECTED[(mode, hint)], ptx), f"{mode}/{hint}: expected /{EXPECTED[(mode, hint)]}/ in the PTX"
    others = [k for k in EXPECTED if k[0] != mode]
    assert not any(re.search(EXPECTED[k], ptx) for k in others)       # no instruction of the other mode
    assert ("createpolicy.fractional.L2::evict_last" in ptx) == (hint == "evict_last" and mode == "bulk")
    assert "ld.global" not in ptx and "st.global" not in ptx          # a prefetch moves no data to the SM


def test_bad_buffers_are_refused_before_any_launch():
    x = torch.zeros(l2probe.CHUNK // 4 + 1)            # not whole chunks (and not on a GPU: refused first)
    with pytest.raises(ValueError, match="whole 16384-byte chunks"):
        l2probe.l2_prefetch(x, 4)
    with pytest.raises(ValueError, match="mode must be one of"):
        l2probe.l2_prefetch(torch.zeros(l2probe.CHUNK // 4), 4, mode="tma")
    with pytest.raises(ValueError, match="ctas must be in"):
        l2probe.l2_prefetch(torch.zeros(l2probe.CHUNK // 4), 0)
    with pytest.raises(ValueError, match="whole 128-byte lines"):
        l2probe.l2_prefetch(torch.zeros(31), 4, mode="line")


@needs_dsl
def test_reader_compiles_to_vector_loads_and_no_unconditional_store():
    ptx = compiled_ptx(lambda: l2probe._build_read(256, 4, options=TVM_FFI + " --keep-ptx"))
    assert len(re.findall(r"ld\.global[^\n]*\.v4\.", ptx)) >= 4, "four 16-byte loads in flight per loop turn"
    assert len(re.findall(r"st\.global", ptx)) == 1          # the one predicated store of the fold


def test_reader_refuses_bad_buffers():
    with pytest.raises(ValueError, match="whole 16-byte vectors"):
        l2probe.read_once(torch.zeros(3), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="1-element int32"):
        l2probe.read_once(torch.zeros(4), torch.zeros(2, dtype=torch.int32))
