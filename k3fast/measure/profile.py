"""Kernel-level profiles of the decode layer, stock beside fast, with nsight-python (Nsight Compute from Python).

    python -m k3fast.measure.profile --preset kda_moe [--out traces/h200] [--tag NAME] [--eager]

For each cell of the preset (layer kind, shape, batch) and each implementation (stock, fast), each half of the layer
(``attn``: layer input -> MLP input; ``moe``: MLP input -> layer output) is captured as a CUDA graph, as
k3fast.measure.trace captures it, and one replay runs inside ``nsight.annotate("<impl>.<part>")``.
``nsight.analyze.kernel`` has Nsight Compute profile every kernel launched in those regions and nothing else: each
kernel alone (ncu serializes the kernels and replays each one until it has all its counters), every cache flushed
before each pass, the clocks left as they are. So a kernel's ``gpu__time_duration`` is its cold-cache time with the
whole GPU to itself; the sum over a half is not the replay time, which overlaps kernels (PDL, the stock path's
streams) and keeps whatever the previous kernel left in L2. The trace (k3fast.measure.trace, Perfetto JSON) shows
that timeline; this profile says what each kernel does with its time: the DRAM bytes it moves, the bandwidth it
reaches, how busy the SMs are, its grid.

What one run writes under --out (default traces/<card>):

* ``profile-<tag>.json``: the record (RECORD_FIELDS): the environment (GPU, driver, torch, CUDA, CuTe DSL,
  nsight-python and ncu versions, commit), the ncu options, and per cell and half the kernels in launch order with
  their METRICS, time in µs, DRAM bytes (read + written) and achieved DRAM bandwidth. load_profile reads it back and
  plot_profile draws it on any machine;
* ``profile-<tag>.csv``: one row per kernel; ``profile-<tag>.png``: plot_profile's figure;
* ``ncu-<tag>/<cell>_ncu-output-*.ncu-rep``: Nsight Compute's reports, one per cell, for its UI (or
  ``ncu --import <file> --page details`` in a terminal).

How nsight-python reaches ncu differs by version, and both work here. nsight-python 0.9 re-runs the command under
``ncu`` once per decorated call (one call per cell): the re-run goes through main again, skips the cells the parent
profiles in other runs (their calls return None) and exits after its own cell. With ``python -m`` the re-run starts
this file as a script, hence the sys.path lines below. nsight-python 1.x attaches ncu to this process instead; that
needs Nsight Compute 2026.2.1 or newer and nsight imported before CUDA initializes, which main does.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    # Started as a file (nsight-python 0.9's re-run under ncu): this folder would come first on sys.path and shadow
    # the standard library's `profile` and `trace` modules (cProfile imports `profile`); the repository root goes
    # there instead, so `import k3fast` works without an install.
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))

import argparse
import csv
import glob
import importlib.metadata
import json
import re
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA = "k3fast.measure.profile/1"
NVTX_DOMAIN = "nsight-python"             # the NVTX domain of every nsight.annotate region
IMPLS = ("stock", "fast")
PARTS = ("attn", "moe")

# name -> (what it profiles, cells as (layer kind, shape, batch))
PRESETS = {
    "smoke": ("one cell: KDA+MoE at rank16, batch 1", (("kda_moe", "k3_rank16", 1),)),
    "kda_moe": ("KDA+MoE at rank16, batch 1 and 8: the GEMV regime and the first tensor-core bucket",
                (("kda_moe", "k3_rank16", 1), ("kda_moe", "k3_rank16", 8))),
    "kda_moe_all": ("KDA+MoE at rank16 and rank8, batch 1, 8 and 64",
                    tuple(("kda_moe", s, b) for s in ("k3_rank16", "k3_rank8") for b in (1, 8, 64))),
}

TIME, READ, WRITE = "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum"
# What each kernel's profile holds. Every name is one ncu metric, so ncu gets them in one --metrics list.
METRICS = (
    TIME,
    READ,
    WRITE,
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",   # DRAM busy, % of peak over the kernel's duration
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",     # the busiest SM unit, % of peak
    "lts__t_sector_hit_rate.pct",                           # L2 hit rate (the caches start flushed)
    "sm__warps_active.avg.pct_of_peak_sustained_active",    # achieved occupancy
    "launch__grid_size",
    "launch__block_size",
    "launch__registers_per_thread",
)
NCU_OPTIONS = {"cache_control": "all", "clock_control": "none", "replay_mode": "kernel"}

RECORD_FIELDS = ("schema", "environment", "command", "preset", "replay", "ncu_options", "metrics", "units", "cells")
CELL_FIELDS = ("layer_kind", "shape", "batch", "report", "error", "halves")
HALF_FIELDS = ("impl", "part", "kernels", "time_us", "dram_bytes", "dram_tbps", "nsight_time_us")
KERNEL_FIELDS = ("name", "short", "time_us", "dram_bytes", "dram_tbps", "metrics")

_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
_TO_BYTES = {"byte": 1.0, "B": 1.0, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9,
             "Tbyte": 1e12, "TB": 1e12}


# ------------------------------------------------------------------------------------------------ record (CPU)

def cell_id(kind: str, shape: str, batch: int) -> str:
    return f"{kind}_{shape}_b{batch}"


def short_kernel_name(name: str) -> str:
    """A label for a plot. A CuTe DSL kernel by its module and class ("kernel_cutlass_kernel_k3fastkernelsoproj_attnres
    _buildlocalsOprojAttnRes_object_at_..." -> "oproj_attnres (OprojAttnRes)"; another project's by its class); any
    other kernel by its function name without namespaces, template arguments or parameters."""
    cute = re.match(r"kernel_cutlass_kernel_(.*?)_+object_at", name)
    if cute:
        body = cute.group(1)
        cls = re.search(r"[A-Z][A-Za-z0-9]*$", body)
        if not body.startswith("k3fast"):
            return cls.group(0) if cls else body[:48]
        body = body[len("k3fast"):]
        body = body[len("kernels"):] if body.startswith("kernels") else body
        mod = re.split(r"_+build|_+kernel_class|_*locals", body)[0].strip("_")
        return f"{mod} ({cls.group(0)})" if cls else mod
    base = name.replace("(anonymous namespace)", "")
    base = base[len("void "):] if base.startswith("void ") else base
    depth, out = 0, []
    for ch in base.split("(")[0]:             # template arguments out, however deeply nested
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    return "".join(out).split("::")[-1].strip()[:48] or name[:48]


def _scaled(value, unit: str, table: dict, metric: str) -> float:
    if unit not in table:
        raise ValueError(f"{metric}: unit {unit!r} is not one of {sorted(table)}")
    return float(value) * table[unit]


def kernel_row(name: str, values: dict, units: dict) -> dict:
    """One kernel of the record from its ncu metric values (``values``: metric -> value as ncu reports it, in
    ``units``): time in µs, DRAM bytes read + written, and the bandwidth those bytes take over that time."""
    if TIME not in values:
        raise ValueError(f"kernel {name!r}: no {TIME} among its metrics {sorted(values)}")
    t_us = _scaled(values[TIME], units.get(TIME, ""), _TO_US, TIME)
    nbytes = sum(_scaled(values[m], units.get(m, ""), _TO_BYTES, m) for m in (READ, WRITE) if m in values)
    return {"name": name, "short": short_kernel_name(name), "time_us": round(t_us, 3), "dram_bytes": int(nbytes),
            "dram_tbps": round(nbytes / t_us / 1e6, 4) if t_us > 0 else None, "metrics": dict(values)}


def half_record(impl: str, part: str, kernels: list[dict], nsight_time_us: float | None = None) -> dict:
    """One half of one implementation: its kernels in launch order and their totals. ``nsight_time_us`` is the same
    time summed by nsight-python's own DataFrame (a cross-check of the report reading)."""
    t = sum(k["time_us"] for k in kernels)
    b = sum(k["dram_bytes"] for k in kernels)
    return {"impl": impl, "part": part, "kernels": kernels, "time_us": round(t, 3), "dram_bytes": b,
            "dram_tbps": round(b / t / 1e6, 4) if t > 0 else None, "nsight_time_us": nsight_time_us}


def _region(action) -> str | None:
    """The nsight.annotate region an ncu action (one profiled kernel) ran in, or None."""
    state = action.nvtx_state()
    if state is None:
        return None
    for i in state.domains():
        dom = state.domain_by_id(i)
        if dom.name() != NVTX_DOMAIN:
            continue
        # nsight-python 0.9 pushes and pops its ranges, 1.x starts and ends them
        names = list(getattr(dom, "start_end_ranges", tuple)()) + list(getattr(dom, "push_pop_ranges", tuple)())
        if names:
            return names[0]
    return None


def report_kernels(report, metrics=METRICS) -> tuple[dict[str, list[dict]], dict]:
    """The profiled kernels of an ncu report (an ``ncu_report.load_report`` context), grouped by nsight.annotate
    region in launch order, each as kernel_row; and the units of the metrics. A metric ncu did not collect for a
    kernel is left out of its row."""
    regions: dict[str, list[dict]] = {}
    units: dict[str, str] = {}
    for ri in range(report.num_ranges()):
        rng = report.range_by_idx(ri)
        for ai in range(rng.num_actions()):
            action = rng.action_by_idx(ai)
            region = _region(action)
            if region is None:
                continue
            have = set(action.metric_names())
            values, kunits = {}, {}
            for m in metrics:
                if m in have:
                    metric = action[m]
                    values[m], kunits[m] = metric.value(), metric.unit()
            units.update(kunits)
            regions.setdefault(region, []).append(kernel_row(action.name(), values, kunits))
    return regions, units


def cell_record(kind: str, shape: str, batch: int, regions: dict[str, list[dict]], *, report: str | None,
                error: str | None, nsight_times: dict[str, float] | None = None) -> dict:
    """One cell: a half per implementation and part, stock beside fast (a half with no profiled kernel keeps an
    empty list: ncu saw none in its region)."""
    nsight_times = nsight_times or {}
    halves = [half_record(impl, part, regions.get(f"{impl}.{part}", []), nsight_times.get(f"{impl}.{part}"))
              for part in PARTS for impl in IMPLS]
    return {"layer_kind": kind, "shape": shape, "batch": batch, "report": report, "error": error, "halves": halves}


def new_record(preset: str, env: dict, replay: str, command: str) -> dict:
    return {"schema": SCHEMA, "environment": env, "command": command, "preset": preset, "replay": replay,
            "ncu_options": dict(NCU_OPTIONS), "metrics": list(METRICS), "units": {}, "cells": []}


def _missing(obj: dict, fields, where: str) -> None:
    gone = [f for f in fields if f not in obj]
    if gone:
        raise ValueError(f"{where}: missing {', '.join(gone)} (a {SCHEMA} record has {', '.join(fields)})")


def load_profile(path: str) -> dict:
    """A record written by this module (``path`` absolute, or relative to the working directory or to the
    repository), checked against RECORD_FIELDS / CELL_FIELDS / HALF_FIELDS / KERNEL_FIELDS."""
    full = path if os.path.exists(path) else os.path.join(ROOT, path)
    with open(full) as f:
        rec = json.load(f)
    if not isinstance(rec, dict) or rec.get("schema") != SCHEMA:
        schema = rec.get("schema") if isinstance(rec, dict) else None
        raise ValueError(f"{path}: not a {SCHEMA} record (schema {schema!r})")
    _missing(rec, RECORD_FIELDS, path)
    for c in rec["cells"]:
        where = f"{path}: cell {c.get('layer_kind')} {c.get('shape')} b{c.get('batch')}"
        _missing(c, CELL_FIELDS, where)
        for h in c["halves"]:
            _missing(h, HALF_FIELDS, f"{where} {h.get('impl')}.{h.get('part')}")
            for k in h["kernels"]:
                _missing(k, KERNEL_FIELDS, f"{where} {h['impl']}.{h['part']} kernel {k.get('name')!r}")
    return rec


def _cells(record: dict, cell) -> list[dict]:
    cells = record["cells"]
    if cell is None:
        return cells
    if isinstance(cell, int):
        if not -len(cells) <= cell < len(cells):
            raise ValueError(f"cell={cell}: the record has {len(cells)} cells")
        return [cells[cell]]
    found = [c for c in cells if cell_id(c["layer_kind"], c["shape"], c["batch"]) == cell]
    if not found:
        have = [cell_id(c["layer_kind"], c["shape"], c["batch"]) for c in cells]
        raise ValueError(f"cell={cell!r}: not in the record; it has {have}")
    return found


def profile_table(record: dict, cell=None) -> str:
    """Per cell and half: kernels, summed kernel µs, DRAM MB and achieved TB/s, then each kernel on its own line."""
    variant = record["environment"].get("stock_variant")
    lines = [f"stock = {variant}"] if variant else []
    for c in _cells(record, cell):
        lines.append(f"{c['layer_kind']} {c['shape']} b{c['batch']}" + (f"  ERROR {c['error']}" if c["error"] else ""))
        for h in c["halves"]:
            tbps = f"{h['dram_tbps']:5.2f} TB/s" if h["dram_tbps"] is not None else "    - TB/s"
            lines.append(f"  {h['impl']:5s} {h['part']:4s} {len(h['kernels']):3d} kernels {h['time_us']:8.1f} µs "
                         f"{h['dram_bytes'] / 1e6:8.1f} MB {tbps}")
            for k in h["kernels"]:
                kt = f"{k['dram_tbps']:5.2f}" if k["dram_tbps"] is not None else "    -"
                lines.append(f"      {k['short'][:44]:44s} {k['time_us']:8.2f} µs {k['dram_bytes'] / 1e6:8.2f} MB "
                             f"{kt} TB/s")
    return "\n".join(lines)


def plot_profile(record: dict, ax=None, cell=None):
    """Per-kernel time and achieved DRAM bandwidth, stock beside fast: for each cell one row per half and
    implementation, a bar of the kernels' ncu times end to end in launch order, each kernel coloured by the DRAM
    bandwidth it reached (read + written bytes over its time). ``cell``: an index or "kda_moe_k3_rank16_b1" (default:
    every cell, one axes each); ``ax``: draw one cell there. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib import cm, colors

    cells = _cells(record, cell)
    if ax is not None and len(cells) != 1:
        raise ValueError(f"plot_profile: ax= draws one cell and the record has {len(cells)}; pass cell=")
    if ax is None:
        fig, axes = plt.subplots(len(cells), 1, figsize=(11, 0.6 + 1.9 * len(cells)), squeeze=False)
        axes = list(axes[:, 0])
    else:
        fig, axes = ax.figure, [ax]
    bws = [k["dram_tbps"] for c in cells for h in c["halves"] for k in h["kernels"] if k["dram_tbps"] is not None]
    norm = colors.Normalize(0.0, max([4.0] + bws))
    cmap = plt.get_cmap("viridis")
    for a, c in zip(axes, cells):
        rows = c["halves"][::-1]                       # the first half on top
        longest = max([h["time_us"] for h in rows] + [1e-9])
        for y, h in enumerate(rows):
            left = 0.0
            for k in h["kernels"]:
                bw = k["dram_tbps"]
                a.barh(y, k["time_us"], left=left, height=0.7, edgecolor="white", linewidth=0.6,
                       color=cmap(norm(bw)) if bw is not None else "lightgrey")
                fits = int(k["time_us"] / (1.25 * longest) * 140)      # characters of 7-point text the bar holds
                if fits >= 4:
                    a.text(left + k["time_us"] / 2, y, k["short"].split(" (")[0][:fits], ha="center", va="center",
                           fontsize=7, color="white" if bw is not None and norm(bw) < 0.6 else "black")
                left += k["time_us"]
            n = len(h["kernels"])
            a.text(left + 0.01 * longest, y, f"{h['time_us']:.1f} µs, {n} kernel{'s' * (n != 1)}", va="center",
                   fontsize=8)
        a.set_yticks(range(len(rows)), [f"{h['impl']} {h['part']}" for h in rows])
        a.set_xlim(0, longest * 1.25)
        a.set_xlabel("µs (ncu: each kernel alone, caches flushed; kernels end to end)")
        a.set_title(f"{c['layer_kind']} {c['shape']} b{c['batch']} on {record['environment'].get('gpu')}", fontsize=10)
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes, label="achieved DRAM TB/s (read + written)",
                 fraction=0.03, pad=0.01)
    return fig


def write_csv(record: dict, path: str) -> None:
    """One row per kernel: the cell, the half, its place in the launch order, the derived figures, the metrics."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer_kind", "shape", "batch", "impl", "part", "index", "short", "time_us", "dram_bytes",
                    "dram_tbps", *record["metrics"], "name"])
        for c in record["cells"]:
            for h in c["halves"]:
                for i, k in enumerate(h["kernels"]):
                    w.writerow([c["layer_kind"], c["shape"], c["batch"], h["impl"], h["part"], i, k["short"],
                                k["time_us"], k["dram_bytes"], k["dram_tbps"],
                                *(k["metrics"].get(m, "") for m in record["metrics"]), k["name"]])


# ------------------------------------------------------------------------------------------------ profiling (GPU)

def profile_cell(kind: str, shape: str, batch: int, replay: str = "graph") -> None:
    """What nsight.analyze.kernel profiles for one cell: per implementation, each half's replay inside its own
    ``nsight.annotate`` region. Building the layer, compiling, autotuning and capturing happen outside the regions,
    so ncu profiles none of their kernels. ``replay="eager"`` runs each half's eager call instead of its graph
    replay (the same kernels)."""
    import gc

    import nsight
    import torch
    from k3ref import preset
    from k3ref.weights import random_layer
    from k3fast.measure.impls import make_impl, make_io
    from k3fast.measure.trace import KIND_LAYER, capture, reset_stock_autotuners

    cfg, layer = preset(shape), KIND_LAYER[kind]
    w = random_layer(cfg, layer, seed=1, device="cuda")
    for name in IMPLS:
        impl = make_impl(name, cfg, w, max_batch=batch)
        if name == "stock":
            reset_stock_autotuners()              # Triton tunes at this batch, in the eager call below
        io = make_io(cfg, layer, batch, seed=7)
        impl.layer(io)                            # compile, autotune
        torch.cuda.synchronize()
        for part in PARTS:
            io = make_io(cfg, layer, batch, seed=11)
            if part == "moe":
                impl.attn(io)                     # a realistic MLP input
            half = getattr(impl, part)
            graph = capture(lambda: half(io)) if replay == "graph" else None
            io.reset()
            torch.cuda.synchronize()
            with nsight.annotate(f"{name}.{part}"):
                if graph is not None:
                    graph.replay()
                else:
                    half(io)
                torch.cuda.synchronize()
            del graph
        del impl, io
        gc.collect()
        torch.cuda.empty_cache()


def _ncu_python_dirs() -> list[str]:
    """Where Nsight Compute keeps its own ncu_report module (extras/python), next to the ncu on PATH first."""
    dirs = []
    ncu = shutil.which("ncu")
    if ncu:
        real = os.path.dirname(os.path.realpath(ncu))
        dirs += [os.path.join(real, "extras", "python"), os.path.join(os.path.dirname(real), "extras", "python")]
    dirs += sorted(glob.glob("/opt/nvidia/nsight-compute/*/extras/python"), reverse=True)
    dirs += sorted(glob.glob("/usr/local/cuda*/nsight-compute*/extras/python"), reverse=True)
    return [d for d in dirs if os.path.exists(os.path.join(d, "ncu_report.py"))]


def ncu_version() -> str | None:
    try:
        out = subprocess.run(["ncu", "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"Version\s+([\d.]+)", out)
    return m.group(1) if m else (out.strip().splitlines() or [None])[-1]


def load_nsight():
    """nsight-python and its versions, imported before CUDA initializes (nsight-python 1.x loads ncu's injection at
    import). ncu's reports are read with ncu_report: the pip package nsight-python depends on, or the module Nsight
    Compute ships, put on sys.path here when the package is absent. Raises RuntimeError with what to install."""
    if shutil.which("ncu") is None:
        raise RuntimeError("ncu (Nsight Compute's command line) is not on PATH; install Nsight Compute")
    try:
        import ncu_report  # noqa: F401
    except ImportError:
        sys.path[:0] = _ncu_python_dirs()[:1]
    # both load native code (ncu_report's bindings, nsight's cuda.core / NVML): a build for another Python crashes
    # the interpreter on import, so each is imported in a child process first and a crash becomes an error here.
    # Once per run: nsight-python 0.9's re-runs under ncu inherit the verdict instead of probing again.
    if os.environ.get("K3_NSIGHT_IMPORTS_OK") != "1":
        for module in ("ncu_report", "nsight"):
            crash = _import_crash(module)
            if crash:
                raise RuntimeError(f"importing {module} crashes this Python ({crash}); install an ncu_report / "
                                   f"nsight-python built for Python {sys.version_info.major}.{sys.version_info.minor}")
        os.environ["K3_NSIGHT_IMPORTS_OK"] = "1"
    try:
        import nsight
    except ImportError as ex:
        raise RuntimeError(f"nsight-python does not import ({ex}); `pip install nsight-python` (with Nsight Compute "
                           f"older than 2026.2.1: `pip install nsight-python==0.9.6`)") from ex
    version = importlib.metadata.version("nsight-python")
    err = getattr(getattr(getattr(nsight, "collection", None), "ncu", None), "injection_load_error", None)
    if err is not None:
        why = str(err).rstrip(".")
        raise RuntimeError(f"nsight-python {version} cannot attach Nsight Compute {ncu_version()}: {why}. "
                           "nsight-python 1.x needs ncu 2026.2.1 or newer; with an older ncu, "
                           "`pip install nsight-python==0.9.6`, which runs the command under ncu instead")
    return nsight, {"nsight_python": version, "ncu": ncu_version()}


def _import_crash(module: str) -> str | None:
    """How a child process with this sys.path died importing ``module``: the signal and its last lines (faulthandler
    names the frame), or a time-out. None when it imported, or failed with an ordinary exception (which the import
    in this process then raises with its own message)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", f"import {module}"], env=env,
                           capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "the import did not finish in 300 s"
    if r.returncode >= 0:
        return None
    tail = " | ".join(r.stderr.strip().splitlines()[-3:])[-400:]
    return f"killed by signal {-r.returncode}" + (f": {tail}" if tail else "")


def _add(x, y):
    return x + y


def _nsight_times(result) -> dict[str, float]:
    """µs per region from nsight-python's DataFrame (its kernels' times summed by combine_kernel_metrics)."""
    try:
        df = result.to_dataframe()
        rows = df[df["Metric"] == TIME]
        return {str(a): round(float(v) / 1e3, 3) for a, v in zip(rows["Annotation"], rows["AvgValue"])}
    except Exception:                              # a DataFrame without these columns: the cross-check is skipped
        return {}


def run(preset: str, out: str | None = None, tag: str | None = None, replay: str = "graph", log=print) -> str | None:
    """Profile every cell of ``preset``; returns the record's path (None in nsight-python 0.9's re-run, which exits
    inside its own cell)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if replay not in ("graph", "eager"):
        raise ValueError(f"replay must be 'graph' or 'eager', got {replay!r}")
    nsight, versions = load_nsight()
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("k3fast.measure.profile needs a CUDA GPU (Hopper, sm_90a)")
    from k3fast.measure.trace import card_folder, environment
    from k3fast.stock.layer import default_variant
    variant, fallback = default_variant()
    env = {**environment(), **versions, "stock_variant": variant, "stock_fallback": fallback}
    out = out or card_folder(env["gpu"])
    tag = tag or f"{env['date'][:10]}-{env['commit']}"
    record = new_record(preset, env, replay, " ".join(sys.argv))
    path = os.path.join(out, f"profile-{tag}.json")
    for kind, shape, batch in PRESETS[preset][1]:
        cid = cell_id(kind, shape, batch)
        prefix = os.path.join(out, f"ncu-{tag}", f"{cid}_")
        # One call per cell: nsight-python's DataFrame pairs each region's kernels with the calls' configs, which
        # holds only while every config launches the same kernels, and the dispatch plan differs per batch. The
        # DataFrame sums each region's kernels (combine_kernel_metrics); the per-kernel rows come from the report.
        # No thermal pauses: the profiled kernels run for microseconds.
        profiled = nsight.analyze.kernel(configs=[(kind, shape, batch, replay)], metrics=list(METRICS),
                                         combine_kernel_metrics=_add, output_prefix=prefix, thermal_mode="off",
                                         **NCU_OPTIONS)(profile_cell)
        error = None
        try:
            result = profiled()
        except Exception as ex:                    # the report may still hold the kernels: read it below
            result, error = None, f"{type(ex).__name__}: {str(ex)[:600]}"
        if result is None and error is None:
            continue                               # nsight-python 0.9's re-run: another run profiles this cell
        reports = sorted(glob.glob(glob.escape(prefix) + "ncu-output-*.ncu-rep"), key=os.path.getmtime)
        regions, units = {}, {}
        if reports:
            try:
                import ncu_report
                regions, units = report_kernels(ncu_report.load_report(reports[-1]))
            except Exception as ex:
                error = (error + "; " if error else "") + f"reading {reports[-1]}: {type(ex).__name__}: {ex}"
        record["units"].update(units)
        cell = cell_record(kind, shape, batch, regions, error=error,
                           report=os.path.relpath(reports[-1], out) if reports else None,
                           nsight_times=_nsight_times(result) if result is not None else None)
        record["cells"].append(cell)
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as f:                 # rewritten after every cell: a time-out keeps what was profiled
            json.dump(record, f, indent=1)
        log(profile_table(record, cell=-1))
        for h in cell["halves"]:
            if not h["kernels"]:
                log(f"  WARNING {h['impl']}.{h['part']}: ncu profiled no kernel in this region"
                    + ("; try --eager" if replay == "graph" else ""))
    if not record["cells"]:
        return None
    write_csv(record, os.path.join(out, f"profile-{tag}.csv"))
    try:
        import matplotlib
        matplotlib.use("Agg")
        plot_profile(record).savefig(os.path.join(out, f"profile-{tag}.png"), dpi=120, bbox_inches="tight")
    except Exception as ex:                        # the figure is a convenience: the record is what counts
        log(f"no figure: {type(ex).__name__}: {ex}")
    log(f"wrote {path} ({len(record['cells'])} cells)")
    return path


def main(argv=None) -> int:
    presets = "\n".join(f"  {n:12s} {len(cells)} cell(s): {about}" for n, (about, cells) in PRESETS.items())
    ap = argparse.ArgumentParser(prog="python -m k3fast.measure.profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog="presets:\n" + presets)
    ap.add_argument("--preset", choices=list(PRESETS), default="smoke")
    ap.add_argument("--out", default=None, help="folder for the record and reports (default: traces/<card>)")
    ap.add_argument("--tag", default=None, help="names the outputs (default: date-commit)")
    ap.add_argument("--eager", action="store_true",
                    help="profile each half's eager call instead of its graph replay (the same kernels)")
    args = ap.parse_args(argv)
    import faulthandler
    faulthandler.enable()            # a crash in native code (ncu's injection, a driver call) names its Python frame
    try:
        run(args.preset, args.out, args.tag, "eager" if args.eager else "graph")
    except RuntimeError as ex:
        print(f"k3fast.measure.profile: {ex}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
