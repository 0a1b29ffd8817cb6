"""The bytes model (hand-checked), the trace summariser and the record schema (CPU)."""
import glob
import json
import os

import pytest

from k3ref import k3, k3_rank, tiny
from k3ref.bytes import expected_distinct_experts, expert_bytes, floor_us, layer_bytes, part_bytes

pytestmark = pytest.mark.ref


def test_expert_bytes_hand_checked():
    # docs/k3-layer.md §11.1: 3 x (5,505,024 data + 344,064 scale) = 17,547,264 B per expert at full width
    assert expert_bytes(k3()) == 17_547_264
    # TP16: padded 256-row slices: w1,w3 [256, 3584] + w2 [3584, 256], 4.25 bits per weight
    assert expert_bytes(k3_rank(16)) == 3 * (256 * 3584 // 2 + 256 * 3584 // 32)


def test_layer_bytes_match_spec_section_14():
    cases = {("k3", "kda_moe"): 1561.8, ("k3_rank8", "kda_moe"): 298.3, ("k3_rank16", "kda_moe"): 214.0,
             ("k3", "mla_moe"): 1125.3, ("k3_rank8", "mla_moe"): 268.6, ("k3_rank16", "mla_moe"): 213.3,
             ("k3", "kda_dense"): 2354.5, ("k3_rank16", "kda_dense"): 149.3}
    cfgs = {"k3": k3(), "k3_rank8": k3_rank(8), "k3_rank16": k3_rank(16)}
    for (c, kind), mb in cases.items():
        got = part_bytes(layer_bytes(cfgs[c], kind, 1, distinct_experts=16), "layer") / 1e6
        assert abs(got - mb) / mb < 0.005, (c, kind, got, mb)   # the spec rounds activations differently


def test_parts_add_up_and_state_scales_with_batch():
    c = k3_rank(16)
    st1, st8 = layer_bytes(c, "kda_moe", 1, distinct_experts=16), layer_bytes(c, "kda_moe", 8, distinct_experts=16)
    assert part_bytes(st1, "attn") + part_bytes(st1, "moe") == part_bytes(st1, "layer")
    core1 = next(s for s in st1 if s.stage == "k3.kda.core").state
    core8 = next(s for s in st8 if s.stage == "k3.kda.core").state
    assert core8 == 8 * core1 == 8 * 2 * (6 * 128 * 128 * 4 + 3 * 768 * 3 * 2)
    mla = layer_bytes(c, "mla_moe", 2, context=1000, distinct_experts=16)
    assert next(s for s in mla if s.stage == "k3.mla.core").state == 2 * (1000 + 1) * 576 * 2


def test_distinct_experts_and_floor():
    c = k3()
    assert expected_distinct_experts(c, 1) == pytest.approx(16)
    assert 110 < expected_distinct_experts(c, 8) < 125             # ~119 (vllm-k3-decode.md 0.1)
    assert floor_us(4.3e6, 4.3) == pytest.approx(1.0)


def test_stage_summariser_attributes_kernels():
    from k3fast.measure.trace import summarize_graph_events, summarize_stages
    ev = [
        {"cat": "user_annotation", "name": "k3.attn_res", "ts": 0, "dur": 100},
        {"cat": "user_annotation", "name": "k3.kda.core", "ts": 100, "dur": 100},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 150, "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 160, "args": {"correlation": 3}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 500, "args": {"correlation": 4}},
        {"cat": "kernel", "name": "a", "ts": 20, "dur": 3.0, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "b", "ts": 170, "dur": 5.0, "args": {"correlation": 2}},
        {"cat": "gpu_memcpy", "name": "c", "ts": 180, "dur": 1.0, "args": {"correlation": 3}},
        {"cat": "kernel", "name": "d", "ts": 510, "dur": 2.0, "args": {"correlation": 4}},
    ]
    st = summarize_stages(ev)
    assert st["k3.attn_res"] == {"kernels": 1, "copies": 0, "gpu_us": 3.0}
    assert st["k3.kda.core"] == {"kernels": 1, "copies": 1, "gpu_us": 6.0}
    assert st["unattributed"]["kernels"] == 1
    g = summarize_graph_events(ev, replays=2)
    assert g["kernels"] == 1.5 and g["kernel_us_sum"] == 5.0 and g["copies"] == 0.5


def test_record_schema_validation(tmp_path):
    from k3fast.measure.report import load_records, table, validate
    from k3fast.measure.trace import SCHEMA_FIELDS
    good = {k: 1.0 for k in SCHEMA_FIELDS}
    good.update(layer_kind="kda_moe", shape="k3_rank16", batch=1, impl="stock", part="layer", replay_us_p10=0.9,
                replay_us_p90=1.1, gpu="H200", commit="x", date="d", torch="t", cutlass="c", driver="v")
    bad = dict(good, part="mlp", floor_us=0.0)
    p = tmp_path / "records-x.json"
    p.write_text(json.dumps({"records": [good, bad]}))
    recs = load_records(str(p))
    probs = validate(recs)
    assert any("part 'mlp'" in s for s in probs) and any("floor_us" in s for s in probs)
    assert not validate([r for r in recs if r["part"] == "layer"])
    assert "| kda_moe | k3_rank16 | 1 |" in table([r for r in recs if r["part"] == "layer"])


def test_report_latest_record_wins_and_ratio_only_within_one_run(tmp_path):
    from k3fast.measure.report import load_records, table
    from k3fast.measure.trace import SCHEMA_FIELDS
    base = {k: 1.0 for k in SCHEMA_FIELDS}
    base.update(layer_kind="kda_moe", shape="k3_rank16", batch=1, part="layer", gpu="H200", torch="t", cutlass="c",
                driver="v", floor_us=10.0, kernels=3, replay_us_p10=1.0, replay_us_p90=500.0)
    old_stock = dict(base, impl="stock", commit="aaaaaaa", date="2026-11-29T09:00:00+00:00", replay_us_median=300.0)
    new_stock = dict(base, impl="stock", commit="bbbbbbb", date="2026-11-29T11:00:00+00:00", replay_us_median=200.0)
    fast = dict(base, impl="fast", commit="bbbbbbb", date="2026-11-29T11:01:00+00:00", replay_us_median=100.0)
    # file names sort opposite to the dates: the date must decide
    (tmp_path / "records-0-new.json").write_text(json.dumps({"records": [new_stock, fast]}))
    (tmp_path / "records-9-old.json").write_text(json.dumps({"records": [old_stock]}))
    recs = load_records(str(tmp_path / "records-*.json"))
    stock = [r for r in recs if r["impl"] == "stock"]
    assert len(stock) == 1 and stock[0]["replay_us_median"] == 200.0
    row = [ln for ln in table(recs).splitlines() if ln.startswith("| kda_moe")][0]
    assert "200.0 (3)" in row and "100.0 (3)" in row and "2.00x" in row and "bbbbbbb" in row
    # stock and fast from different runs: no ratio
    fast_other = dict(fast, commit="ccccccc", date="2026-11-29T12:00:00+00:00")
    row = [ln for ln in table([new_stock, fast_other]).splitlines() if ln.startswith("| kda_moe")][0]
    assert "x |" not in row and "bbbbbbb ccccccc" in row


def test_skewed_routing_forces_a_hot_set_and_is_reported_apart(tmp_path):
    import torch
    from k3fast.measure.report import load_records, table
    from k3fast.measure.trace import ROUTINGS, SCHEMA_FIELDS, skew_routing
    from k3ref import Precision, tiny
    from k3ref.moe import route
    from k3ref.weights import random_layer
    cfg = tiny()
    layer = next(l for l in range(cfg.num_hidden_layers) if l > 0)
    w = random_layer(cfg, layer, seed=5)
    before = w.mlp.e_score_correction_bias.clone()
    skew_routing(w, n_hot=cfg.num_experts_per_token + 2)
    hot = (w.mlp.e_score_correction_bias != before).nonzero().flatten()
    assert hot.numel() == cfg.num_experts_per_token + 2
    ids, _ = route(torch.randn(32, cfg.hidden_size).bfloat16(), w.mlp, cfg, Precision.model())
    assert set(ids.flatten().tolist()) <= set(hot.tolist())
    base = {k: 1.0 for k in SCHEMA_FIELDS}
    base.update(layer_kind="kda_moe", shape="k3_rank16", batch=8, part="layer", impl="fast", gpu="H200", torch="t",
                cutlass="c", driver="v", commit="abc", replay_us_p10=0.5, replay_us_p90=9.0, kernels=8)
    recs = [dict(base, date="2026-01-01", routing=ROUTINGS["random"], replay_us_median=2.0),
            dict(base, date="2026-01-02", routing=ROUTINGS["skewed"], replay_us_median=3.0)]
    (tmp_path / "records-x.json").write_text(json.dumps({"records": recs}))
    rows = [ln for ln in table(load_records(str(tmp_path / "records-*.json"))).splitlines() if "k3_rank16" in ln]
    assert len(rows) == 2 and any("kda_moe skewed" in ln and "3.0 (8)" in ln for ln in rows)


def test_flush_l2_reads_the_whole_buffer_on_cpu():
    # the same code path as on the GPU (a bug here once cost a whole H200 sweep)
    import k3fast.measure.trace as tr
    tr.flush_l2(device="cpu", nbytes=1 << 20)
    assert tr._FLUSH_OUT.item() == (1 << 20) // 4
    tr._FLUSH = tr._FLUSH_OUT = None


def test_replay_stats_and_write_run(tmp_path):
    from k3fast.measure.trace import replay_stats, write_run
    st = replay_stats([float(x) for x in range(1, 102)], "fast_")
    assert st == {"fast_us_median": 51.0, "fast_us_p10": 11.0, "fast_us_p90": 91.0}
    p = tmp_path / "r.json"
    write_run(str(p), {"gpu": "x"}, 4.2, [{"a": 1}])
    doc = json.loads(p.read_text())
    assert doc["copy_tbps"] == 4.2 and doc["records"] == [{"a": 1}] and doc["command"]


def test_trace_cell_spec_parses_and_rejects_bad_cells():
    import argparse

    from k3fast.measure.trace import parse_cell
    assert parse_cell("mla_moe,full,64,8192,ref+compiled") == ("mla_moe", "full", 64, 8192, ["ref", "compiled"])
    assert parse_cell("kda_moe,k3_rank16,1,0,stock") == ("kda_moe", "k3_rank16", 1, 0, ["stock"])
    for bad in ["mla_moe,full,64,ref", "gqa,full,1,0,ref", "kda_moe,k3_rank4,1,0,ref", "kda_moe,full,x,0,ref",
                "kda_moe,full,1,1024,ref", "mla_moe,full,1,0,ref", "kda_moe,full,0,0,ref"]:
        with pytest.raises(argparse.ArgumentTypeError):
            parse_cell(bad)


def test_trace_presets_expand_to_valid_cells():
    from k3fast.measure.trace import CONTENDERS, PRESETS, parse_cell, preset_table
    assert {"smoke", "kda-sweep", "kda-sweep-skewed", "mla-sweep"} <= set(PRESETS)
    kda = PRESETS["kda-sweep"].cells()
    assert [(k, s, b) for k, s, b, _, _ in kda] == [("kda_moe", s, b) for s in ("k3_rank16", "k3_rank8", "full")
                                                    for b in (1, 8, 64)]
    assert all(c == 0 and impls == ["stock", "fast"] for _, _, _, c, impls in kda)
    assert PRESETS["kda-sweep"].routing == "random" and PRESETS["kda-sweep-skewed"].routing == "skewed"
    mla = PRESETS["mla-sweep"].cells()
    assert len(mla) == 18 and {c for *_, c, _ in mla} == {1024, 8192}
    for name, p in PRESETS.items():          # every preset's cells are cells --cell accepts
        for kind, shape, b, c, impls in p.cells(contenders=["fast-x"]):
            assert parse_cell(f"{kind},{shape},{b},{c},{'+'.join(impls)}") == (kind, shape, b, c, impls), name
    # "contenders" stands for the registry's live ones, each once, after the names listed before it
    assert PRESETS["kda-contenders"].impls[-1] == CONTENDERS
    assert PRESETS["kda-contenders"].cells(contenders=["fast-a", "fast", "fast-b"])[0][4] == [
        "stock", "fast", "fast-a", "fast-b"]
    assert all(name in preset_table() for name in PRESETS)
    # the MLA-only contenders (FusedMLA) run in MLA cells and never in KDA cells, where it would time the shipped
    # path again
    assert PRESETS["mla-fused"].cells()[0][4] == ["stock", "fast", "fast-mla", "fast-mla-uvc"]
    kda_impls = {i for *_, impls in PRESETS["kda-contenders"].cells() for i in impls}
    assert "fast-v51" in kda_impls and not {"fast-mla", "fast-mla-uvc"} & kda_impls


def test_trace_command_line_checks_its_arguments(capsys):
    from k3fast.measure.trace import main
    assert main(["--list-presets"]) == 0 and "kda-sweep-skewed" in capsys.readouterr().out
    for bad in (["--preset", "kda-sweep", "--cell", "kda_moe,full,1,0,fast"], ["--preset", "nope"],
                ["--kinds", "gqa_moe"], ["--batches", "0"], ["--shapes", "k3_rank4"]):
        with pytest.raises(SystemExit):
            main(bad)


def test_card_folder_names_the_gpu_model():
    from k3fast.measure.trace import card_folder
    assert card_folder("NVIDIA H100 80GB HBM3") == os.path.join("traces", "h100")
    assert card_folder("NVIDIA H200") == os.path.join("traces", "h200")
    assert card_folder("NVIDIA A100-SXM4-80GB") == os.path.join("traces", "a100")
    assert card_folder("") == os.path.join("traces", "cpu")


def test_replay_timeline_splits_busy_and_idle():
    from k3fast.measure.trace import replay_timeline
    ev = []
    for r, base in enumerate((0.0, 1000.0, 2000.0)):
        gap = (5.0, 30.0, 6.0)[r]                   # the middle replay has the median span
        ev += [{"cat": "kernel", "name": "router", "ts": base, "dur": 10.0},
               {"cat": "kernel", "name": "experts", "ts": base + 8.0, "dur": 20.0},      # overlaps under PDL
               {"cat": "kernel", "name": "tail", "ts": base + 28.0 + gap, "dur": 4.0},
               {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": base - 3.0, "dur": 2.0}]
    t = replay_timeline(ev, 3)
    assert t["span_us"] == 38.0 and t["busy_us"] == 32.0 and t["idle_us"] == 6.0
    assert [k[0] for k in t["kernels"]] == ["router", "experts", "tail"] and t["kernels"][2][1] == 34.0
    assert replay_timeline(ev[:-2], 3) is None      # 8 kernels do not split into 3 replays


def test_graph_events_keep_only_the_replays_kernels():
    """profile_replays flushes the L2 and resets the inputs between replays: those eager kernels and copies must not
    count as the graph's (kernel count, timeline), and a replay's kernels share its cudaGraphLaunch's correlation."""
    from k3fast.measure.trace import graph_events, replay_timeline, summarize_graph_events
    ev = []
    for r, base in enumerate((0.0, 1000.0, 2000.0)):
        c = 10 * r
        ev += [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": base - 50, "args": {"correlation": c + 1}},
               {"cat": "kernel", "name": "flush", "ts": base - 40, "dur": 30.0, "args": {"correlation": c + 1}},
               {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": base - 9, "args": {"correlation": c + 2}},
               {"cat": "gpu_memcpy", "name": "reset", "ts": base - 8, "dur": 1.0, "args": {"correlation": c + 2}},
               {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": base - 3, "args": {"correlation": c + 3}},
               {"cat": "kernel", "name": "gemv", "ts": base, "dur": 10.0, "args": {"correlation": c + 3}},
               {"cat": "kernel", "name": "tail", "ts": base + 12.0, "dur": 4.0, "args": {"correlation": c + 3}}]
    g = graph_events(ev)
    assert [e["name"] for e in g] == ["gemv", "tail"] * 3
    s = summarize_graph_events(g, 3)
    assert s["kernels"] == 2 and s["copies"] == 0 and s["kernel_us_sum"] == 14.0
    assert replay_timeline(g, 3)["span_us"] == 16.0
    assert graph_events([e for e in ev if e["name"] != "cudaGraphLaunch"]) == []


def test_serial_loads_counts_loads_behind_branches_and_stores():
    from k3fast.measure.ptxcheck import serial_loads
    sass = "\n".join(f"        /*{16 * i:04x}*/                   {ins} ;" for i, ins in enumerate([
        "LDG.E R0, desc[UR6][R2.64]", "LDG.E R1, desc[UR6][R2.64+0x4]",          # two in a row: not counted
        "MUFU.RCP R4, R0", "@P0 BRA `(.L_x_1)", "LDG.E R5, desc[UR6][R2.64+0x8]",  # behind a branch
        "STG.E desc[UR6][R8.64], R5", "LDG.E R6, desc[UR6][R2.64+0xc]",           # behind a store
        "BRA `(.L_x_2)", "LDG.E.128 R8, desc[UR6][R2.64+0x10]",                  # unconditional: not counted
        "STG.E desc[UR6][R8.64], R6", "@!P1 BRA `(.L_x_3)", "LDG.E R9, desc[UR6][R2.64]"]))
    assert serial_loads(sass) == {"loads_behind_branch": 2, "loads_behind_store": 1, "loads_behind_use": 0}
    sunk = "\n".join(f"        /*{16 * i:04x}*/                   {ins} ;" for i, ins in enumerate([
        "LDG.E.NA.128 R32, desc[UR6][R32.64]", "LDG.E.NA.128 R24, desc[UR6][R24.64]",
        "PRMT R11, R33, 0x7632, R11", "FFMA R8, R11, R10, R8",                     # reads the first load's R33
        "LDG.E.NA.128 R32, desc[UR6][R40.64]", "FFMA R7, R26, R10, R7", "LDG.E.NA.128 R16, desc[UR6][R42.64]"]))
    assert serial_loads(sunk) == {"loads_behind_branch": 0, "loads_behind_store": 0, "loads_behind_use": 2}


# Records from before per-run Perfetto folders whose trace file a later run of the same cell replaced (the records
# keep their figures; only the link is gone).
PERFETTO_LINKS_LOST = {"records-5acc39b-a.json", "records-6316bd2-kda.json"}


def test_every_recorded_perfetto_trace_is_found():
    """Each record's Perfetto trace resolves to a file under traces/h200 (k3fast.measure.report.perfetto_file), so the
    traces a reader opens in Perfetto or Nsight Systems are the ones the figures came from."""
    from k3fast.measure.report import ROOT, perfetto_file
    missing = []
    for path in sorted(glob.glob(os.path.join(ROOT, "traces", "h200", "records-*.json"))):
        if os.path.basename(path) in PERFETTO_LINKS_LOST:
            continue
        with open(path) as f:
            doc = json.load(f)
        src = os.path.relpath(path, ROOT)
        missing += [(src, r["perfetto"]) for r in doc["records"]
                    if r.get("perfetto") and perfetto_file({**r, "source": src}) is None]
    assert not missing, missing[:5]


def test_reset_stock_autotuners_clears_only_stock_library_caches(monkeypatch):
    """k3fast.measure.trace.reset_stock_autotuners forgets the configs of Triton autotuners found in fla / vLLM modules (their
    keys omit the batch, so the first cell of a process chose them for every later cell), also behind a
    ``@triton.heuristics`` wrapper (fla's conv kernel), switches off their on-disk result cache, counts a tuner
    reachable twice once, touches no attribute of anything that is not a Triton kernel wrapper (a lazy module's
    getattr may import what is not installed), and leaves other modules alone."""
    import sys
    import types
    from k3fast.measure.trace import reset_stock_autotuners

    class KernelInterface:                    # triton.runtime.jit.KernelInterface: JIT functions and their wrappers
        pass

    class Autotuner(KernelInterface):         # stands in for triton.runtime.autotuner.Autotuner
        def __init__(self, fn=None):
            self.cache = {("D", "W"): "config chosen at b1"}
            self.cache_results = True
            self.fn = fn

    class Heuristics(KernelInterface):        # triton.runtime.autotuner.Heuristics: not an Autotuner, wraps one
        def __init__(self, fn):
            self.fn = fn

    class LazyModule:                         # vLLM's lazy attributes: a getattr imports a missing package
        def __getattr__(self, name):
            raise ModuleNotFoundError("No module named 'runai_model_streamer'")

    fake, fake_jit = types.ModuleType("triton.runtime.autotuner"), types.ModuleType("triton.runtime.jit")
    fake.Autotuner, fake_jit.KernelInterface = Autotuner, KernelInterface
    for name in ("triton", "triton.runtime"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "triton.runtime.autotuner", fake)
    monkeypatch.setitem(sys.modules, "triton.runtime.jit", fake_jit)
    stock, other = types.ModuleType("fla.modules.conv_k3test"), types.ModuleType("k3test_other")
    stock.kernel, stock.not_a_tuner, other.kernel = Autotuner(fn=lambda: None), {"x": 1}, Autotuner()
    stock.wrapped = Heuristics(Autotuner(fn=types.SimpleNamespace(fn=None)))
    stock.alias = stock.kernel                # the same tuner under a second name
    stock.lazy = LazyModule()
    monkeypatch.setitem(sys.modules, stock.__name__, stock)
    monkeypatch.setitem(sys.modules, other.__name__, other)
    assert reset_stock_autotuners() == 2
    assert stock.kernel.cache == {} and stock.wrapped.fn.cache == {}
    assert not stock.kernel.cache_results and not stock.wrapped.fn.cache_results
    assert other.kernel.cache and other.kernel.cache_results and stock.not_a_tuner == {"x": 1}


def test_blas_library_is_scoped_and_checked():
    """k3fast.layer.blas_library changes torch's preferred BLAS library only inside the block, only for a CUDA device (a CPU
    build of torch refuses cublasLt), and rejects a name it does not know."""
    import torch
    from k3fast.layer import blas_library
    before = torch.backends.cuda.preferred_blas_library()
    for lib in (None, "cublaslt"):
        with blas_library(lib, torch.device("cpu")):
            assert torch.backends.cuda.preferred_blas_library() == before
    with blas_library("cublas", torch.device("cuda")):
        assert str(torch.backends.cuda.preferred_blas_library()).lower().endswith("cublas")
    assert torch.backends.cuda.preferred_blas_library() == before
    with pytest.raises(ValueError, match="expected None, 'cublas' or 'cublaslt'"):
        with blas_library("hipblaslt", torch.device("cuda")):
            pass


def test_ptx_version_is_lowered_to_what_the_ptxas_reads():
    """k3fast.measure.ptxcheck assembles the DSL's PTX with whatever ptxas the machine has: the .version line is lowered to
    the ISA that release reads (CUDA 13.0's ptxas refuses 9.4, the DSL's), and left alone for a release it does not
    know."""
    from k3fast.measure.ptxcheck import _lower_version
    ptx = ".version 9.4\n.target sm_90a\n.version 9.4 stays\n"
    assert _lower_version(ptx, "", "Cuda compilation tools, release 13.0, V13.0.88").startswith(".version 9.0\n")
    assert _lower_version(ptx, "", "release 12.8, V12.8.93").splitlines()[:3] == [".version 8.7", ".target sm_90a",
                                                                                  ".version 9.4 stays"]
    assert _lower_version(ptx, "", "release 14.2") == ptx
