"""CuTe DSL glue shared by every k3fast kernel: arch selection, lazy import, compile-once cache.

Contracts (hardware facts; docs/findings.md has the measurements):

* ``CUTE_DSL_ARCH`` is read when ``cutlass`` is imported. On a machine without a GPU the DSL would
  default to sm_100a, so ``import_cute()`` sets ``sm_90a`` first unless the user chose otherwise.
* Kernels are compiled once per compile key with fake tensors and ``--enable-tvm-ffi``; the
  compiled object is called with torch tensors and launches on torch's current stream (so it can
  be captured in a CUDA graph). Calling a ``@cute.jit`` function directly costs ~30 ms: never.
* ``cute.compile`` is not thread-safe: the cache takes a lock.
* ``K3_KERNEL_CACHE=<folder>`` adds a cache across processes: each compiled kernel is exported there as an object
  file (``export_to_c``, ~0.1 s) and a later process loads it (``cute.runtime.load_module``, JIT-linked as the DSL
  links its own in-process compile) instead of compiling again (a median 0.8 s a key on 2 CPU cores, up to 7 s). The file name
  hashes the compile key with the kernel sources, the DSL and tvm-ffi versions and the target arch, so an edited
  kernel never loads a stale object. Objects compiled on a CPU machine for sm_90a load on the GPU machine. Off
  when unset.
"""
from __future__ import annotations

import functools
import hashlib
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
    """Return the compiled kernel for ``key``, building it (``build()`` -> cute.compile result) once per process, and
    once per K3_KERNEL_CACHE folder when that is set."""
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            t0 = time.perf_counter()
            path, name = _disk_entry(key)
            fn = _load(path, name) if path and os.path.exists(path) else None
            if fn is None:
                fn = build()
                if path:
                    _export(fn, path, name)
            COMPILE_LOG.append((key, time.perf_counter() - t0))
            _CACHE[key] = fn
    return fn


@functools.cache
def _source_stamp() -> bytes:
    """What besides the key decides a compiled object: every kernel source file, the DSL, tvm-ffi, the arch."""
    import importlib.metadata as md
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for f in sorted(os.listdir(here)):
        if f.endswith(".py"):
            with open(os.path.join(here, f), "rb") as fh:
                h.update(f.encode() + b"\0" + fh.read())
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            h.update(f"{dist}={md.version(dist)}".encode())
        except md.PackageNotFoundError:
            h.update(f"{dist}=?".encode())
    h.update(os.environ.get("CUTE_DSL_ARCH", "").encode())
    h.update(b"pdl" if PDL else b"no-pdl")
    return h.digest()


def _disk_entry(key: Hashable) -> tuple[str | None, str]:
    """(object file path, exported function name) for ``key``; no path when the cache is off or the key's repr is
    not a stable value (an object address would differ in every process)."""
    folder = os.environ.get("K3_KERNEL_CACHE")
    text = repr(key)
    if not folder or " at 0x" in text:
        return None, ""
    digest = hashlib.sha256(text.encode() + _source_stamp()).hexdigest()[:40]
    return os.path.join(folder, f"k3_{digest}.o"), f"k3_{digest}"


def _load(path: str, name: str):
    """The exported kernel, or None when the file cannot be loaded (it is then compiled and written again)."""
    _, cute = import_cute()
    try:
        return cute.runtime.load_module(path, enable_tvm_ffi=True)[name]
    except Exception as e:          # a truncated or foreign file: compile instead, never fail the caller
        print(f"k3fast: kernel cache entry {os.path.basename(path)} not loaded ({type(e).__name__}); compiling")
        return None


def _export(fn, path: str, name: str) -> None:
    """Write ``fn`` to the cache; a partial file never becomes visible (rename), and a failed write only costs the
    next process a compile."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fn.export_to_c(tmp, function_name=name)
        os.replace(tmp, path)
    except Exception as e:
        print(f"k3fast: kernel cache entry {os.path.basename(path)} not written ({type(e).__name__}: {e})")
        if os.path.exists(tmp):
            os.remove(tmp)


def fake_tensor(dtype, shape, *, align: int = 16, row_major: bool = True):
    """A fake compact tensor for cute.compile. ``shape`` entries may be ints or cute.sym_int()."""
    _, cute = import_cute()
    order = tuple(range(len(shape) - 1, -1, -1)) if row_major else tuple(range(len(shape)))
    return cute.runtime.make_fake_compact_tensor(dtype, tuple(shape), stride_order=order, assumed_align=align)


def fake_stream():
    _, cute = import_cute()
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


TVM_FFI = "--enable-tvm-ffi"
# K3_PDL=0 launches every kernel without programmatic dependent launch. griddepcontrol.wait then returns at once
# (the previous grid has completed before the launch), so every result is the same; what changes is only the
# overlap. A control for tools that may not follow PDL (compute-sanitizer's racecheck, scripts/device_sanitize.sh).
PDL = os.environ.get("K3_PDL", "1") != "0"
SMEM_PER_CTA_MAX = 227 * 1024      # sm_90's largest dynamic shared memory per CTA (232,448 B)
# sm_90 splits each SM's 256 KB of L1 / shared memory in these steps (KB of shared memory); the driver takes the
# smallest step that holds the resident CTAs' shared memory plus 1 KB reserved per CTA, and the rest is L1. The L1
# is also where every global load's data lands on its way to the registers (L1::no_allocate too), so a kernel with
# many loads in flight per SM can lose bandwidth when a few bytes more of shared memory take it one step up.
SMEM_CARVEOUTS_KB = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)
SMEM_RESERVED_PER_CTA = 1024


def carveout_kb(smem_bytes: int, ctas_per_sm: int = 1) -> int:
    """The shared-memory carve-out (KB) the driver picks for ``ctas_per_sm`` resident CTAs of ``smem_bytes`` each."""
    if smem_bytes > SMEM_PER_CTA_MAX:
        raise ValueError(f"{smem_bytes} B of shared memory per CTA: sm_90 allows at most {SMEM_PER_CTA_MAX} (227 KB)")
    need = ctas_per_sm * (smem_bytes + SMEM_RESERVED_PER_CTA)
    return next(k for k in SMEM_CARVEOUTS_KB if k * 1024 >= need)


def l1_kb(smem_bytes: int, ctas_per_sm: int = 1) -> int:
    """KB of L1 left on the SM beside that carve-out."""
    return 256 - carveout_kb(smem_bytes, ctas_per_sm)


def weight_load_atom(dtype):
    """16-byte global -> register copy for weights, which each kernel reads exactly once: L1::no_allocate keeps
    them from evicting the activations that every warp re-reads from L1."""
    _, cute = import_cute()
    return cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=128,
                               l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)


def sigmoid(x):
    """1 / (1 + exp(-x)) in fp32, traced inside a kernel: the one form every k3fast kernel uses (an IEEE division,
    so the result does not depend on which kernel computes it)."""
    from cutlass import Float32
    _, cute = import_cute()
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))


def situ_glu(a, c):
    """SiTU-GLU of docs/k3-layer.md §9 in fp32, traced inside a kernel: [4 tanh(a/4) sigmoid(a)] * [25 tanh(c/25)],
    with K3's betas (4 and 25). a and c are the gate and up values, already rounded as the bf16 Linear would."""
    from cutlass import Float32
    _, cute = import_cute()
    return Float32(4.0) * cute.math.tanh(a * Float32(0.25)) * sigmoid(a) * (Float32(25.0) * cute.math.tanh(c * Float32(0.04)))


def st_shared_cluster_f32(smem_ptr, val, rank):
    """st.shared::cluster of one fp32 into cluster CTA ``rank``'s shared memory at the offset of ``smem_ptr`` in this
    CTA's (a DSMEM push; ``rank`` may be this CTA), traced inside a kernel. Visible to the receiver after a cluster
    barrier (arrive has release, wait acquire semantics by default)."""
    from cutlass import Float32, Int32
    from cutlass._mlir.dialects import llvm
    addr = smem_ptr.toint()
    llvm.inline_asm(
        None, [Int32(addr).ir_value(), Float32(val).ir_value(), Int32(rank).ir_value()],
        "{\n\t.reg .b32 ra;\n\tmapa.shared::cluster.u32 ra, $0, $2;\n\tst.shared::cluster.f32 [ra], $1;\n\t}",
        "r,f,r,~{memory}", has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT)


def mma_m16n8k16(acc, base: int, a, b0, b1) -> None:
    """acc[base .. base + 3] += A B on one mma.sync m16n8k16 (bf16 in, fp32 accumulate), traced inside a kernel.
    a: the four 32-bit A registers (bf16 pairs), b0 / b1: the two B registers; acc: an fp32 register tensor."""
    from cutlass import Float32, Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [Int32(x).ir_value() for x in (a[0], a[1], a[2], a[3], b0, b1)] + [acc[base + q].ir_value() for q in range(4)],
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
        "{$10,$11,$12,$13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
    for q in range(4):
        acc[base + q] = Float32(llvm.extractvalue(T.f32(), res, [q]))


def swapab_a_fragment(fa, rA, h, t):
    """Fill the 8 bf16 A registers of one m16n8k16 (swap-AB GEMV: weight rows g and g+8 of tile t) from the two
    16-byte row loads rA[:, 2t] (row g) and rA[:, 2t+1] (row g+8), for the h-th k16 half of a 32-wide chunk.
    The A registers hold {row g k(2c,2c+1), row g+8 k(2c,2c+1), row g k(2c+8,+9), row g+8 k(2c+8,+9)}, which is
    physical k 8c+4h+{0,1}, 8c+4h+{0,1}, 8c+4h+{2,3}, 8c+4h+{2,3}: the K permutation that lets thread c of a quad
    load 8 contiguous k with one 16-byte load (the B side is permuted the same way)."""
    fa[0] = rA[4 * h + 0, 2 * t]
    fa[1] = rA[4 * h + 1, 2 * t]
    fa[2] = rA[4 * h + 0, 2 * t + 1]
    fa[3] = rA[4 * h + 1, 2 * t + 1]
    fa[4] = rA[4 * h + 2, 2 * t]
    fa[5] = rA[4 * h + 3, 2 * t]
    fa[6] = rA[4 * h + 2, 2 * t + 1]
    fa[7] = rA[4 * h + 3, 2 * t + 1]


def swapab_c_fragment_to(sRed, k, acc, row, tok):
    """Store one m16n8k16 accumulator fragment of the swap-AB GEMV into smem sRed[k, row, token]: this thread
    holds weight rows ``row`` (= tile row g) and ``row + 8``, tokens ``tok`` (= 2c) and ``tok + 1``."""
    sRed[k, row, tok] = acc[0]
    sRed[k, row, tok + 1] = acc[1]
    sRed[k, row + 8, tok] = acc[2]
    sRed[k, row + 8, tok + 1] = acc[3]


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


def fake_gemm_operands(K: int, n_divisibility: int, out_align: int):
    """Fake bf16 x [M, K], w [N, K], y [M, N] for compiling a y = x w^T kernel once for every M and N (symbolic; N
    divisible by ``n_divisibility``, y aligned to ``out_align`` elements)."""
    cutlass, cute = import_cute()
    M, N = cute.sym_int(), cute.sym_int(divisibility=n_divisibility)
    return (fake_tensor(cutlass.BFloat16, (M, K)), fake_tensor(cutlass.BFloat16, (N, K)),
            fake_tensor(cutlass.BFloat16, (M, N), align=out_align))


def gemv_operands(x, w, out, *, k_multiple: int = 16, out_align: int = 2, nk=None):
    """Validate y[M, N] = x[M, K] @ w[N, K]^T operands (bf16, M in 1..64, N a multiple of 16, K of k_multiple);
    allocate ``out`` when None.  Returns (M, N, K, out). ``nk``: (N, K) of a re-laid weight ``w`` whose layout its
    caller has checked, in place of w's own shape."""
    import torch
    check_tensor("w", w, dtype=torch.bfloat16)
    if nk is not None:
        N, K = nk
    elif w.dim() != 2:
        raise ValueError(f"w: expected [N, K], got {list(w.shape)}")
    else:
        N, K = w.shape
    if N % 16 or K % k_multiple or N == 0 or K == 0:
        raise ValueError(f"w: N must be a positive multiple of 16 and K of {k_multiple}, got [{N}, {K}]")
    check_tensor("x", x, dtype=torch.bfloat16, device=w.device)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x: expected [M, {K}], got {list(x.shape)}")
    M = x.shape[0]
    if not 1 <= M <= 64:
        raise ValueError(f"x: M must be in 1..64, got {M}")
    if out is None:
        out = torch.empty(M, N, dtype=torch.bfloat16, device=w.device)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(M, N), device=w.device, align=out_align)
    return M, N, K, out
