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


def test_sanitizer_script_runs_one_process_per_tool_and_part_and_summarizes(tmp_path):
    """scripts/device_sanitize.sh with stand-ins for compute-sanitizer and nvidia-smi: every tool runs every part in
    its own process with its own log and launched JSON, and the summary reads them all."""
    import json
    import subprocess
    import sys
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    # the stand-in writes what the real tool and the launch set would: a clean log and a complete launched JSON
    (bin_ / "compute-sanitizer").write_text(f"""#!{sys.executable}
import json, sys
a = sys.argv[1:]
if a == ["--version"]:
    print("Version 2025.3.1.0 (stand-in)"); sys.exit(0)
log = a[a.index("--log-file") + 1]
out = a[a.index("--out") + 1]
part = a[a.index("--parts") + 1]
open(log, "w").write("========= COMPUTE-SANITIZER\\n========= ERROR SUMMARY: 0 errors\\n")
json.dump({{"parts": [part], "cells": [{{"part": part, "peak_gb": 1.0}}], "kernel_keys": ["k"], "complete": True,
           "argv": a}}, open(out, "w"))
""")
    for f in bin_.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", OUT=str(out), K3_CALL_S="200",
               K3_TOOLS="memcheck racecheck", K3_PARTS="control k3_rank16 mla", K3_BATCHES="1",
               K3_COMMIT="abc1234", K3_SAN_ARGS="--kernel-name kns=RingMmaGemv")
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "device_sanitize.sh")], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.load(open(out / "sanitizer.json"))
    assert s["commit"] == "abc1234" and s["gpu"] == "NVIDIA H100 80GB HBM3"
    for tool in ("memcheck", "racecheck"):
        assert sorted(s["tools"][tool]["parts"]) == ["control", "k3_rank16", "mla"]
        assert s["tools"][tool]["clean"] and s["tools"][tool]["cells"] == 3
    argv = json.load(open(out / "sanitizer-racecheck-k3_rank16-launched.json"))["argv"]
    assert argv[argv.index("--batches") + 1] == "1"                         # K3_BATCHES reaches the launch set
    assert argv[argv.index("--kernel-name") + 1] == "kns=RingMmaGemv"      # K3_SAN_ARGS reaches the tool


def test_engine_layers_run_every_shape_and_keep_the_files_for_the_sweep(tmp_path):
    """scripts/device_vllm_e2e.sh layers with a stand-in for python3: one 4-layer stock engine per shape, each file
    under $OUT and in K3_ENGINE_DIR, where the sweep's --engine finds stock vLLM's figure for a stock record."""
    import json
    import subprocess
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, 580.159.04, 143771 MiB'\n")
    # the stand-in writes what k3fast.measure.vllm_e2e run writes: one record per batch with the per-layer figures
    (bin_ / "python3").write_text("""#!/usr/bin/env bash
while [ $# -gt 0 ]; do case $1 in --out) out=$2; shift ;; --shape) shape=$2; shift ;; esac; shift; done
printf '{"records": [{"kind": "vllm_e2e", "engine": "stock", "gpu": "NVIDIA H200", "batch": 1, ' > "$out"
printf '"model": {"shape": "%s"}, "layer_us_kda_moe": 130.0, "layer_kernels_kda_moe": 25}]}' "$shape" >> "$out"
""")
    for f in bin_.iterdir():
        f.chmod(0o755)
    out, keep = tmp_path / "out", tmp_path / "k3eng"
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", OUT=str(out), K3_CALL_S="600",
               K3_ENGINE_DIR=str(keep))
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "device_vllm_e2e.sh"), "layers"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    shapes = ("k3_rank16", "k3_rank8", "full")
    assert sorted(os.listdir(keep)) == sorted(f"e2e-layers-{s}.json" for s in shapes)
    for s in shapes:
        assert json.load(open(out / f"e2e-layers-{s}.json"))["records"][0]["model"]["shape"] == s
    from k3fast.measure.report import engine_layer_figure
    from k3fast.measure.trace import engine_records
    eng = engine_records(sorted(str(p) for p in keep.iterdir()))
    stock = {"layer_kind": "kda_moe", "shape": "k3_rank8", "batch": 1, "gpu": "NVIDIA H200"}
    assert engine_layer_figure(stock, eng) == {"kernel_us": 130.0, "kernels": 25, "context": [16, 26],
                                               "source": "e2e-layers-k3_rank8.json"}
