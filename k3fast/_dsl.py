"""CuTe DSL glue shared by every k3fast kernel: arch selection, lazy import, compile-once cache.

Contracts (k3-spec-independent, hardware facts from ../shared/cutedsl-hopper.md):

* ``CUTE_DSL_ARCH`` is read when ``cutlass`` is imported. On a machine without a GPU the DSL would
  default to sm_100a, so ``import_cute()`` sets ``sm_90a`` first unless the user chose otherwise.
* Kernels are compiled once per compile key with fake tensors and ``--enable-tvm-ffi``; the
  compiled object is called with torch tensors and launches on torch's current stream (so it can
  be captured in a CUDA graph). Calling a ``@cute.jit`` function directly costs ~30 ms: never.
* ``cute.compile`` is not thread-safe: the cache takes a lock.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Hashable

_LOCK = threading.Lock()
_CACHE: dict[Hashable, Any] = {}
COMPILE_LOG: list[tuple[Hashable, float]] = []     # (key, seconds): read by tests and notebooks


def import_cute():
    """Import cutlass + cute with the arch pinned to sm_90a when no choice was made."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass  # noqa: F401
    import cutlass.cute as cute
    return cutlass, cute


def dsl_available() -> bool:
    try:
        import_cute()
        import tvm_ffi  # noqa: F401
    except Exception:
        return False
    return True


def compile_cached(key: Hashable, build: Callable[[], Any]) -> Any:
    """Return the compiled kernel for ``key``, building it (``build()`` -> cute.compile result) once."""
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            t0 = time.perf_counter()
            fn = build()
            COMPILE_LOG.append((key, time.perf_counter() - t0))
            _CACHE[key] = fn
    return fn


def fake_tensor(dtype, shape, *, align: int = 16, row_major: bool = True):
    """A fake compact tensor for cute.compile. ``shape`` entries may be ints or cute.sym_int()."""
    _, cute = import_cute()
    order = tuple(range(len(shape) - 1, -1, -1)) if row_major else tuple(range(len(shape)))
    return cute.runtime.make_fake_compact_tensor(dtype, tuple(shape), stride_order=order, assumed_align=align)


def fake_stream():
    _, cute = import_cute()
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


TVM_FFI = "--enable-tvm-ffi"


def check_tensor(name: str, t, *, dtype=None, shape=None, device=None, contiguous: bool = True, align: int = 16):
    """Validate a torch tensor handed to a kernel; raise one clear error instead of a crash inside it."""
    import torch
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (strides {t.stride()})")
    if align and t.is_cuda and t.data_ptr() % align:
        raise ValueError(f"{name}: data pointer must be {align}-byte aligned")
