"""The compile tier's shared helpers: skip without the CuTe DSL, and keep a module's PTX while its kernels compile."""
import contextlib

import pytest

from k3fast.kernels._dsl import dsl_available

needs_dsl = pytest.mark.skipif(not dsl_available(), reason="nvidia-cutlass-dsl / apache-tvm-ffi not importable")


@contextlib.contextmanager
def keeping_ptx(module, dump_dir):
    """Inside the block, ``module``'s compiles keep their PTX (written to ``dump_dir``), so PTX checks read the
    cached builds instead of compiling them again. A no-op where the CuTe DSL is not importable."""
    if not dsl_available():
        yield
        return
    from k3fast.kernels._dsl import import_cute
    import_cute()
    from cutlass.cutlass_dsl import CuTeDSL
    env = CuTeDSL._get_dsl().envar
    old_dir, old_opts = env.dump_dir, module.TVM_FFI
    env.dump_dir = str(dump_dir)
    module.TVM_FFI = old_opts + " --keep-ptx"
    try:
        yield
    finally:
        env.dump_dir, module.TVM_FFI = old_dir, old_opts


def keep_ptx_fixture(module):
    """A module-scoped autouse fixture keeping ``module``'s PTX for the whole test file: assign it at module level
    (``keep_ptx = keep_ptx_fixture(mk)``)."""
    @pytest.fixture(scope="module", autouse=True)
    def keep_ptx(tmp_path_factory):
        with keeping_ptx(module, tmp_path_factory.mktemp("ptx")):
            yield
    return keep_ptx
