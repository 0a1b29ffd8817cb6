import os
import zlib
import sys

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before anything imports cutlass
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 device machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def seed(request):
    """A fresh seed per test (derived from the test id) so inputs are random but reproducible."""
    s = zlib.crc32(request.node.nodeid.encode()) % (2 ** 31)
    torch.manual_seed(s)
    return s


def pytest_configure(config):
    """In CI the compile tier must run, not skip: a missing CuTe DSL install is an error there."""
    if os.environ.get("CI") and "compile" in (config.getoption("-m") or ""):
        from k3fast.kernels._dsl import dsl_available
        if not dsl_available():
            raise pytest.UsageError("CI selected the compile tier but nvidia-cutlass-dsl / apache-tvm-ffi do not import")
