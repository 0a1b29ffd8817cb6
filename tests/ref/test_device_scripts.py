"""The lent-machine scripts stay in step with the test tree (CPU, no GPU)."""
import glob
import os
import re

import pytest

pytestmark = pytest.mark.ref
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_two_halves_of_the_gpu_tier_cover_every_file_once():
    """scripts/device_tests.sh --half 1 / 2 together run every GPU test file but the vLLM engine's (which needs its
    own call), none twice."""
    text = open(os.path.join(ROOT, "scripts", "device_tests.sh")).read()
    listed = re.findall(r"tests/gpu/test_\w+\.py", text)
    files = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "gpu", "test_*.py"))}
    assert len(listed) == len(set(listed)), "a file is in both halves"
    assert set(listed) == files - {"tests/gpu/test_vllm_plugin.py"}
