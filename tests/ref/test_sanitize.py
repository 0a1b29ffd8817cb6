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
RACECHECK_WARNINGS = """========= COMPUTE-SANITIZER
========= Warning: (Warp Level Programming) Potential RAW hazard detected (CUDA barrier operation) at __shared__ 0xaa8 in block (0,2,0) :
=========     Write Thread (31,0,0) at kernel_cutlass_kernel_k3fastkernelskda_conv_gate_step_buildlocalsKdaConvGateStep_0+0x130 in kda_conv_gate_step.py:395
=========     Read Thread (0,0,0) at kernel_cutlass_kernel_k3fastkernelskda_conv_gate_step_buildlocalsKdaConvGateStep_0+0x160 in kda_conv_gate_step.py:398
=========     Current Value : 0
=========
========= RACECHECK SUMMARY: 200 hazards displayed (0 errors, 1540 warnings)
"""
RACECHECK_TOOL_FAILED = """========= COMPUTE-SANITIZER
========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception.
=========
========= Target application returned an error
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""


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
    if log is not None:
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


def test_bare_run_has_cells_and_memory_but_no_verdict(tmp_path):
    _write(tmp_path, "none", "k3_rank16", None, 0, True, cells=6)
    _write(tmp_path, "memcheck", "k3_rank16", CLEAN, 0, True)
    s = san.summarize(str(tmp_path))
    bare = s["tools"]["none"]
    assert bare["clean"] is None and bare["cells"] == 6 and bare["parts"]["k3_rank16"]["peak_gb"] == 3.5
    assert s["tools"]["memcheck"]["clean"] is True


# excerpts of an H200 run: a racecheck hazard names two threads, counted once, by the kernel of its writing thread;
# torch's own kernels carry spaces in their names
RING = "kernel_cutlass_kernel_k3fastkernelsrms_gemv_ring_build_mma_classlocalsRingMmaGemv_object_at__0"
RACECHECK_RING = f"""========= COMPUTE-SANITIZER
========= Error: Potential WAR hazard detected at __shared__ 0x1e690 in block (1,0,0) :
=========     Read Thread (1,0,0) at {RING}+0x1cf0
=========     Write Thread (256,0,0) at {RING}+0x1650
=========     Current Value : 0, Incoming Value : ?
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""
TORCH_ADD = ("void at::native::vectorized_elementwise_kernel<(int)8, at::native::CUDAFunctor_add<c10::BFloat16>, "
             "std::array<char *, (unsigned long)3>>(int, T2, T3)")
INITCHECK_TORCH = f"""========= Uninitialized __global__ memory read of size 16 bytes
=========     at {TORCH_ADD}+0xf0
=========     by thread (32,0,0) in block (100,0,0)
========= ERROR SUMMARY: 1 error
"""


def test_parse_names_racecheck_hazards_by_their_writer_and_library_kernels_whole():
    assert san.parse_log(RACECHECK_RING)["kernels"] == {RING: 1}
    assert san.parse_log(RACECHECK_RING)["errors"] == 1
    assert san.parse_log(INITCHECK_TORCH)["kernels"] == {TORCH_ADD: 1}


def test_library_gemm_controls_are_the_layer_shapes():
    """The controls' GEMMs are the ones the layer runs where initcheck reported reads of their outputs."""
    from k3ref import preset
    r16, r8 = preset("k3_rank16"), preset("k3_rank8")
    assert san.LIBRARY_GEMMS["front fp32 out, batch 64"][1:3] == (
        r16.num_experts + r16.routed_expert_hidden_size + 2 * r16.shared_intermediate, r16.hidden_size)
    assert san.LIBRARY_GEMMS["mla q_b, batch 8"][1:3] == (r16.mla_heads * r16.kv_cache_dim, r16.q_lora_rank)
    assert san.LIBRARY_GEMMS["moe tail up, rank8 batch 64"][1:3] == (r8.hidden_size, r8.routed_expert_hidden_size)


def test_unknown_part_is_refused_by_name():
    with pytest.raises(ValueError, match="parts: unknown"):
        san.launch_set(["k3_rank4"])


def test_parse_keeps_racecheck_warnings_and_the_tools_own_failure_apart():
    """racecheck's summary splits errors from warnings (here all 1,540 hazards are warnings, each named by its
    writer's kernel); an "Internal Sanitizer Error" is the tool breaking, flagged as such (its one "error" names no
    kernel)."""
    w = san.parse_log(RACECHECK_WARNINGS)
    assert w["errors"] == 1540 and w["warnings"] == 1540 and not w["tool_failed"] and w["finished"]
    assert list(w["kernels"]) == ["kernel_cutlass_kernel_k3fastkernelskda_conv_gate_step_buildlocalsKdaConvGateStep_0"]
    f = san.parse_log(RACECHECK_TOOL_FAILED)
    assert f["tool_failed"] and f["warnings"] == 0 and f["kernels"] == {} and f["app_failed"]
    assert not san.parse_log(CLEAN)["tool_failed"] and san.parse_log(CLEAN)["warnings"] == 0


def test_summary_counts_racecheck_warnings_and_names_the_parts_the_tool_broke_on(tmp_path):
    """Warnings still count against clean (a finding to explain); the parts where the tool itself failed are named."""
    _write(tmp_path, "racecheck", "k3_rank16", RACECHECK_WARNINGS, 99, True)
    _write(tmp_path, "racecheck", "mla", RACECHECK_TOOL_FAILED, 99, False, cells=0)
    race = san.summarize(str(tmp_path))["tools"]["racecheck"]
    assert not race["clean"] and race["warnings"] == 1540 and race["tool_failed_parts"] == ["mla"]
    assert race["parts"]["k3_rank16"]["kernel_errors"] == 1540 and not race["parts"]["k3_rank16"]["tool_failed"]


def test_held_by_groups_live_blocks_by_our_innermost_frame():
    from k3fast.measure.sanitize import held_by

    def frames(*sites):
        return [{"filename": f, "line": l, "name": n} for f, l, n in sites]
    torch_frame = ("/usr/lib/python3/site-packages/torch/random.py", 10, "randn")
    relay = ("/root/repo/k3fast/kernels/moe_mxfp4_experts.py", 300, "prepare_mxfp4_experts")
    draw = ("/root/repo/k3ref/weights.py", 50, "random_layer")
    snap = {"segments": [
        {"blocks": [{"size": 3 << 30, "requested_size": 3 << 30, "state": "active_allocated",
                     "frames": frames(torch_frame, relay, draw)},
                    {"size": 1 << 30, "state": "inactive", "frames": frames(relay)},
                    {"size": 1 << 29, "requested_size": 1 << 29, "state": "active_allocated",
                     "frames": frames(draw)}]},
        {"blocks": [{"size": 1 << 30, "requested_size": 1 << 30, "state": "active_allocated",
                     "frames": frames(relay)},
                    {"size": 1 << 20, "requested_size": 1 << 20, "state": "active_allocated", "frames": []},
                    {"size": 1 << 28, "requested_size": 1 << 28, "state": "active_pending_free",
                     "frames": frames(relay)}]}]}
    rows = held_by(snap)
    # the freed (inactive) block is not held; torch's own frame gives way to the repository's innermost one; a
    # block whose free waits on an event is held apart
    assert rows[0] == {"site": "k3fast/kernels/moe_mxfp4_experts.py:300 prepare_mxfp4_experts", "gb": 4.0, "blocks": 2}
    assert rows[1] == {"site": "k3ref/weights.py:50 random_layer", "gb": 0.5, "blocks": 1}
    assert rows[2] == {"site": "k3fast/kernels/moe_mxfp4_experts.py:300 prepare_mxfp4_experts (pending free)",
                       "gb": 0.25, "blocks": 1}
    assert rows[3]["site"] == "unrecorded" and rows[3]["blocks"] == 1
    assert held_by(snap, top=1) == rows[:1]
