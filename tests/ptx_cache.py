"""The compile tier's shared helper: keep a module's PTX while its kernels compile."""
import contextlib

from k3fast.kernels._dsl import dsl_available


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
