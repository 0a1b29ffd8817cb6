"""The overlap probe's shared-memory fill (k3fast.overlap_probe): it compiles for sm_90a to cp.async copies that
are all issued before one wait, and bad buffers are refused before any launch."""
import re

import pytest
import torch

from k3fast import overlap_probe as op
from k3fast._dsl import SMEM_PER_CTA_MAX, TVM_FFI, dsl_available
from k3fast.ptxcheck import compiled_ptx

pytestmark = pytest.mark.compile
needs_dsl = pytest.mark.skipif(not dsl_available(), reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")


@needs_dsl
def test_fill_issues_every_copy_before_its_one_wait():
    steps = op.slice_steps(int(23.4 * op.MB), 128)
    assert steps == 23 and steps * op.STEP_BYTES <= SMEM_PER_CTA_MAX - 128
    ptx = compiled_ptx(lambda: op._build_fill(steps, options=TVM_FFI + " --keep-ptx"))
    copies = [m.start() for m in re.finditer(r"cp\.async\.cg\.shared\.global", ptx)]
    waits = [m.start() for m in re.finditer(r"cp\.async\.wait_group", ptx)]
    assert len(copies) == steps, f"one 16-byte cp.async per step, got {len(copies)}"
    assert len(waits) == 1 and max(copies) < waits[0]
    assert "ld.global" not in ptx                  # the slice reaches the SM through shared memory only


def test_sizes_and_bad_buffers_are_refused_before_any_launch():
    with pytest.raises(ValueError, match="at most"):
        op.slice_steps(64 * op.MB, 128)            # 512 KB per CTA does not fit
    x = torch.zeros(128 * op.STEP_BYTES // 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32 tensor of ctas"):
        op.smem_fill(x, torch.zeros(5, dtype=torch.int32), 128)
    with pytest.raises(ValueError, match="do not split"):
        op.smem_fill(x[:-4], torch.zeros(128 * op.THREADS, dtype=torch.int32), 128)
    with pytest.raises(ValueError, match="int32"):
        op.smem_fill(x.float(), torch.zeros(128 * op.THREADS, dtype=torch.int32), 128)
