"""CPU-only checks of the cache across processes (K3_KERNEL_CACHE in k3fast.kernels._dsl): a compiled kernel is
written once and loaded instead of compiled, a changed kernel source never loads the old object, an unreadable
entry is compiled again, and a key without a stable repr is never written."""
import json
import os
import subprocess
import sys

import pytest
from ptx_cache import needs_dsl

from k3fast.kernels import _dsl

pytestmark = [pytest.mark.compile, needs_dsl]


def _build():
    from k3fast.kernels import mla_uv_gate
    return mla_uv_gate._compile(1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_KERNEL_CACHE", str(tmp_path))
    saved = dict(_dsl._CACHE)
    yield tmp_path
    _dsl._CACHE.clear()
    _dsl._CACHE.update(saved)


def _fresh(key):
    _dsl._CACHE.pop(key, None)


def test_written_once_then_loaded(cache):
    key = ("kernel-cache-test", "uv", 1)
    _fresh(key)
    built = []
    _dsl.compile_cached(key, lambda: built.append(1) or _build())
    files = [f for f in os.listdir(cache) if f.endswith(".o")]
    assert built == [1] and len(files) == 1, (built, os.listdir(cache))
    _fresh(key)

    def must_not_build():
        raise AssertionError("compiled although the cache holds the key")
    fn = _dsl.compile_cached(key, must_not_build)
    import tvm_ffi
    assert isinstance(fn, tvm_ffi.Function)
    assert _dsl.COMPILE_LOG[-1][0] == key                      # a load still counts as this process's kernel


def test_other_process_loads_without_compiling(cache):
    """What the GPU runs rely on: a second Python process finds the object the first one wrote."""
    code = ("import sys; from k3fast.kernels import _dsl, mla_uv_gate as m;"
            "fn = _dsl.compile_cached(('kernel-cache-test', 'proc'), lambda: sys.argv[1] == 'build' and m._compile(1));"
            "print(type(fn).__name__)")
    env = dict(os.environ, K3_KERNEL_CACHE=str(cache))
    first = subprocess.run([sys.executable, "-c", code, "build"], env=env, capture_output=True, text=True)
    second = subprocess.run([sys.executable, "-c", code, "load"], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout.strip().endswith("Function"), second.stdout


def test_changed_source_misses(cache, monkeypatch):
    key = ("kernel-cache-test", "stamp")
    _fresh(key)
    _dsl.compile_cached(key, _build)
    _fresh(key)
    monkeypatch.setattr(_dsl, "_source_stamp", lambda: b"an edited kernel source")
    built = []
    _dsl.compile_cached(key, lambda: built.append(1) or _build())
    assert built == [1] and len([f for f in os.listdir(cache) if f.endswith(".o")]) == 2


def test_unreadable_entry_is_compiled_again(cache, capsys):
    key = ("kernel-cache-test", "broken")
    path, _ = _dsl._disk_entry(key)
    with open(path, "wb") as f:
        f.write(b"not an object file")
    _fresh(key)
    built = []
    _dsl.compile_cached(key, lambda: built.append(1) or _build())
    assert built == [1] and "not loaded" in capsys.readouterr().out
    assert os.path.getsize(path) > 1000                         # the compiled object replaced it


def test_unstable_key_is_not_written(cache):
    class Opaque:
        pass
    key = ("kernel-cache-test", Opaque())
    assert " at 0x" in repr(key) and _dsl._disk_entry(key) == (None, "")
    _dsl.compile_cached(key, _build)
    assert not os.listdir(cache)


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv("K3_KERNEL_CACHE", raising=False)
    assert _dsl._disk_entry(("kernel-cache-test", 1)) == (None, "")


def test_precompile_script_fills_a_folder_the_layer_then_loads(tmp_path):
    """scripts/precompile.py (what the GPU runs' cache is filled with) writes the layer's kernels; the same warmup in
    a fresh process then compiles nothing."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "kc"
    record = tmp_path / "kernel-cache.json"
    r = subprocess.run([sys.executable, os.path.join(root, "scripts", "precompile.py"), "--out", str(out),
                        "--shapes", "k3_rank16", "--batches", "1", "-j", "1", "--record", str(record)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    run = json.load(open(record))["runs"][0]
    assert run["objects_before"] == 0 and run["shapes"][0]["shape"] == "k3_rank16" and run["shapes"][0]["kernels"] >= 8
    n = len([f for f in os.listdir(out) if f.endswith(".o")])
    assert n >= 8, os.listdir(out)
    code = "from k3ref import k3_rank; from k3fast.layer import warmup; warmup(k3_rank(16), [1], [1])"
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, K3_KERNEL_CACHE=str(out)),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len([f for f in os.listdir(out) if f.endswith(".o")]) == n        # nothing new: every key was loaded


def test_pdl_off_compiles_and_keys_apart():
    """K3_PDL=0 (the sanitizer's control without programmatic dependent launch) is read once per process, builds
    the kernels, and stamps the cache apart from the PDL builds, so neither process loads the other's objects."""
    code = ("from k3fast.kernels import _dsl, mla_uv_gate; mla_uv_gate._compile(1); "
            "print(_dsl.PDL, _dsl._source_stamp().hex())")
    out = {}
    for pdl in ("1", "0"):
        env = dict(os.environ, K3_PDL=pdl, CUTE_DSL_ARCH="sm_90a")
        env.pop("K3_KERNEL_CACHE", None)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        out[pdl] = r.stdout.split()[-2:]
    assert out["1"][0] == "True" and out["0"][0] == "False"
    assert out["1"][1] != out["0"][1]
