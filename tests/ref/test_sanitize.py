"""k3fast.measure.sanitize's report on CPU: compute-sanitizer logs (excerpts of real ones from an H100 run) -> the
counts the summary gives, and a summary that calls a tool clean only when every part completed without a kernel
error."""
import json

import pytest

from k3fast.measure import sanitize as san

pytestmark = pytest.mark.ref

TOPK = ("kernel_cutlass_kernel_k3fastkernelsrouter_down_topk_buildlocalsTopkFromLogits_object_at__tensorptrf32_gmem_"
        "align16_o_524852481_tensorptrf32_gmem_align16_o_8961_tensorptrbf16_gmem_align8_o_0")
INITCHECK = f"""========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at {TOPK}+0xd0
=========     by thread (64,0,0) in block (52,0,0)
=========     Address 0x7f06effaaf00
=========         Host Frame: topk_from_logits in router_down_topk.py:624
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at {TOPK}+0xd0
=========     by thread (65,0,0) in block (52,0,0)
=========
========= Target application returned an error
========= ERROR SUMMARY: 154752 errors
========= ERROR SUMMARY: 154552 errors were not printed. Use --print-limit option to adjust the number of printed errors
"""
MEMCHECK_OOM = """========= COMPUTE-SANITIZER
========= Program hit cudaErrorMemoryAllocation (error 2) due to "out of memory" on CUDA API call to cudaMalloc.
=========     Saved host backtrace up to driver entry point at error
========= Program hit cudaErrorMemoryAllocation (error 2) due to "out of memory" on CUDA API call to cudaGetLastError.
========= Target application returned an error
========= ERROR SUMMARY: 2 errors
"""
RACECHECK_KILLED = """========= COMPUTE-SANITIZER
========= Error: process didn't terminate successfully
========= Target application returned an error
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
CLEAN = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"


def test_parse_counts_every_error_not_only_the_printed_ones():
    p = san.parse_log(INITCHECK)
    assert p["errors"] == 154752 and p["api_errors"] == 0 and p["finished"] and p["app_failed"]
    assert p["kernels"] == {TOPK: 2}


def test_parse_separates_failed_api_calls_from_kernel_accesses():
    p = san.parse_log(MEMCHECK_OOM)
    assert p["errors"] == 2 and p["api_errors"] == 2 and p["kernels"] == {}


def test_parse_racecheck_and_a_log_without_summary():
    p = san.parse_log(RACECHECK_KILLED)
    assert p["errors"] == 0 and p["app_failed"]
    assert san.parse_log("")["errors"] is None and not san.parse_log("")["finished"]


def _write(folder, tool, part, log, rc, complete, cells=2):
    (folder / f"sanitizer-{tool}-{part}.log").write_text(log)
    (folder / f"sanitizer-{tool}-{part}-launched.json").write_text(json.dumps(
        {"parts": [part], "cells": [{"part": "layer", "peak_gb": 3.5}] * cells, "kernel_keys": ["a", "b"],
         "complete": complete}))
    with open(folder / "sanitizer-rc.txt", "a") as f:
        f.write(f"{tool} {part} {rc} 30 100\n")


def test_summary_is_clean_only_when_every_part_completed_without_kernel_errors(tmp_path):
    _write(tmp_path, "synccheck", "k3_rank16", CLEAN, 0, True)
    _write(tmp_path, "synccheck", "mla", CLEAN, 0, True)
    _write(tmp_path, "memcheck", "k3_rank16", CLEAN, 0, True)
    _write(tmp_path, "memcheck", "k3_rank8", MEMCHECK_OOM, 99, False, cells=0)   # out of memory: not clean
    _write(tmp_path, "initcheck", "k3_rank16", INITCHECK, 99, True)
    s = san.summarize(str(tmp_path), {"gpu": "NVIDIA H100 80GB HBM3"})
    assert s["gpu"] == "NVIDIA H100 80GB HBM3"
    sync, mem, init = s["tools"]["synccheck"], s["tools"]["memcheck"], s["tools"]["initcheck"]
    assert sync["clean"] and sync["cells"] == 4 and sync["complete_parts"] == ["k3_rank16", "mla"]
    assert not mem["clean"] and mem["kernel_errors"] == 0 and mem["parts"]["k3_rank8"]["api_errors"] == 2
    assert not init["clean"] and init["kernel_errors"] == 154752
    assert init["parts"]["k3_rank16"]["flagged_kernels"] == {TOPK: 2}
    assert mem["parts"]["k3_rank16"]["peak_gb"] == 3.5


def test_unknown_part_is_refused_by_name():
    with pytest.raises(ValueError, match="parts: unknown"):
        san.launch_set(["k3_rank4"])
