"""Small helpers shared by the fusion notebooks: recorded H200 results (GPU test outcomes, kernel
benchmarks, layer traces), a CPU compile of one kernel key, and a live timing when a GPU is present.
Everything a notebook shows on a CPU comes from files under traces/, with their metadata."""
from __future__ import annotations

import glob
import json
import os
import re
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _junit_time(root) -> str:
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return (suite.get("timestamp") if suite is not None else None) or ""


def recorded_gpu_tests(test_module: str) -> dict:
    """Outcome of ``tests/gpu/<test_module>.py`` in the newest recorded H200 JUnit file that ran it (files are
    ordered by their own timestamp, not by mtime, which a checkout resets)."""
    out = {"passed": 0, "failed": 0, "skipped": 0, "source": None, "failures": []}
    best = None
    for path in glob.glob(os.path.join(ROOT, "traces", "h200", "logs", "gpu-junit-*.xml")):
        root = ET.parse(path).getroot()
        cases = [tc for tc in root.iter("testcase") if tc.get("classname", "").split(".")[-1] == test_module]
        if cases and (best is None or _junit_time(root) > best[0]):
            best = (_junit_time(root), path, cases)
    if best is None:
        return out
    out["source"] = os.path.relpath(best[1], ROOT)
    for tc in best[2]:
        if tc.find("failure") is not None or tc.find("error") is not None:
            out["failed"] += 1
            out["failures"].append(tc.get("name"))
        elif tc.find("skipped") is not None:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    return out


def recorded_kernel_bench(kernel: str) -> list[dict]:
    """Rows of traces/h200/kernels-*.json for one fused kernel: the most recent row per (shape, batch)."""
    rows = {}
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "traces", "h200", "kernels-*.json"))):
        with open(path) as f:
            doc = json.load(f)
        found += [{**r, "source": os.path.relpath(path, ROOT)} for r in doc["records"] if r["kernel"] == kernel]
    for r in sorted(found, key=lambda r: r.get("date") or ""):
        rows[(r["shape"], r["batch"])] = r
    order = {"k3_rank16": 0, "k3_rank8": 1, "full": 2}
    return [rows[k] for k in sorted(rows, key=lambda k: (order.get(k[0], 9), k[1]))]


def kernel_ab(kernels_file: str, base: str, other: str, batches, shapes=("k3_rank16", "k3_rank8"),
              digits: int = 1) -> tuple[dict, str]:
    """Median µs of two rows of one kernel-bench run (``kernels_file``, a path under the repository), so the A/B is
    measured in one run: ({(row, shape, batch): µs} for both rows, a printable table of ``other`` -> ``base``)."""
    with open(os.path.join(ROOT, kernels_file)) as f:
        doc = json.load(f)
    rows = {(r["kernel"], r["shape"], r["batch"]): r["fast_us_median"] for r in doc["records"]
            if r["kernel"] in (base, other)}
    lines = [f"{kernels_file}, one run (copy {doc['records'][0]['copy_tbps']:.3f} TB/s): median µs, {other} -> {base}"]
    for shape in shapes:
        lines.append("  " + shape + "".join(f"   b{b}: {rows[(other, shape, b)]:.{digits}f} -> "
                                            f"{rows[(base, shape, b)]:.{digits}f}" for b in batches
                                            if (other, shape, b) in rows and (base, shape, b) in rows))
    return rows, "\n".join(lines)


def recorded_experts_probe(shape: str = "k3_rank16", file: str | None = None) -> tuple[str, dict]:
    """The newest traces/h200/experts-*.json (k3fast.measure.bench_experts), or ``file`` (a path under the repository):
    (source, {variant: {batch: us_median}})."""
    from .report import latest_experts_probe
    path, doc = latest_experts_probe(pattern=os.path.join(ROOT, file) if file else None, shape=shape)
    if doc is None:
        return "", {}
    table: dict = {}
    for r in doc["records"]:
        if r["shape"] == shape and r.get("us_median") is not None:
            table.setdefault(r["variant"], {})[r["batch"]] = r["us_median"]
    return os.path.relpath(path, ROOT), table


def recorded_layer_parts(kind: str, part: str) -> list[dict]:
    from .report import load_records
    return [r for r in load_records() if r["layer_kind"] == kind and r["part"] == part]


def measured_copy_tbps() -> float | None:
    """The copy bandwidth of the most recent recorded H200 run (traces/h200/records-*.json), if any."""
    from .report import load_records
    recs = load_records()
    return max(recs, key=lambda r: r.get("date") or "")["copy_tbps"] if recs else None


def stage_floors(stages: tuple[str, ...], kind: str = "kda_moe", batch: int = 1) -> str:
    """Bytes of the given k3ref.bytes stages at each shape, with the floor at the spec's 4.3 TB/s and at the copy
    bandwidth measured on the H200 (when recorded)."""
    from k3ref import k3, k3_rank
    from k3ref.bytes import floor_us, layer_bytes
    bw = measured_copy_tbps()
    lines = []
    for name, c in (("k3_rank16", k3_rank(16)), ("k3_rank8", k3_rank(8)), ("full", k3())):
        st = {x.stage: x for x in layer_bytes(c, kind, batch, distinct_experts=16)}
        nb = sum(st[s].total for s in stages)
        line = f"{name:10s} batch {batch}: {nb / 1e6:8.2f} MB  floor {floor_us(nb, 4.3):7.2f} µs at 4.3 TB/s"
        if bw:
            line += f", {floor_us(nb, bw):7.2f} µs at the measured {bw:.2f} TB/s"
        lines.append(line)
    return "\n".join(lines)


def compile_on_cpu(warmup_fn, *args, **kw) -> str:
    """Compile one kernel key for sm_90a (no GPU needed); returns a one-line report."""
    from ..kernels._dsl import COMPILE_LOG, dsl_available
    if not dsl_available():
        return "CuTe DSL not installed (pip install -e '.[gpu]'): compile skipped"
    n0, t = len(COMPILE_LOG), time.time()
    warmup_fn(*args, **kw)
    keys = [k for k, _ in COMPILE_LOG[n0:]]
    return f"compiled {len(keys)} kernel(s) for sm_90a in {time.time() - t:.1f} s: {keys}"


def time_live(fn, replays: int = 50) -> float:
    """Median µs of a CUDA-graph replay of ``fn`` with the L2 flushed before each (GPU only)."""
    from .trace import _pct, capture, time_replays
    g = capture(fn)
    return _pct(time_replays(g, lambda: None, replays), 0.5)


def bench_table(rows: list[dict]) -> str:
    if not rows:
        return "no recorded kernel benchmark yet (python -m k3fast.measure.bench on the H200 writes traces/h200/kernels-*.json)"
    lines = ["shape      batch  floor µs   fast µs  stock µs  fast/floor  speed-up  run"]
    for r in rows:
        lines.append(f"{r['shape']:10s} {r['batch']:5d} {r['floor_us']:9.1f} {r.get('fast_us_median', float('nan')):9.1f} "
                     f"{r.get('stock_us_median', float('nan')):9.1f} {r.get('fast_over_floor', float('nan')):10.2f} "
                     f"{r.get('speedup_vs_stock', float('nan')):9.2f}  {str(r.get('commit', '?'))[:7]}")
    return "\n".join(lines)


def ab_table(records_file: str, part: str, impls: list[str], shape: str = "k3_rank16", kind: str = "kda_moe") -> str:
    """Median replay µs (kernels) per batch for several implementations of one recorded run (one records file, so
    the ratios are measured in one run), with each implementation's speed-up over stock."""
    with open(os.path.join(ROOT, records_file)) as f:
        doc = json.load(f)
    recs = [r for r in doc["records"] if r["part"] == part and r["shape"] == shape and r["layer_kind"] == kind]
    cell = {(r["impl"], r["batch"]): r for r in recs}
    batches = sorted({r["batch"] for r in recs})
    lines = [f"{part} half, {kind} {shape}, {records_file} (copy {doc['records'][0]['copy_tbps']:.3f} TB/s)",
             f"{'impl':14s}" + "".join(f"{'b' + str(b):>22s}" for b in batches)]
    for impl in impls:
        row = f"{impl:14s}"
        for b in batches:
            r, s = cell.get((impl, b)), cell.get(("stock", b))
            if r is None:
                row += f"{'—':>22s}"
                continue
            ratio = f" {s['replay_us_median'] / r['replay_us_median']:.2f}x" if s else ""
            row += f"{r['replay_us_median']:9.1f} ({r['kernels']:.0f}){ratio:>9s}"
        lines.append(row)
    return "\n".join(lines)


def recorded_code_sizes() -> tuple[str, list[dict]]:
    """SASS code size per kernel (k3fast.measure.ptxcheck's code_size rows) from the newest traces/cpu/ptxcheck-*.json that
    has them: (source, rows)."""
    best = None
    for path in glob.glob(os.path.join(ROOT, "traces", "cpu", "ptxcheck-*.json")):
        with open(path) as f:
            doc = json.load(f)
        rows = [r for r in doc["records"] if r.get("code_size")]
        date = doc.get("environment", {}).get("date") or ""
        if rows and (best is None or date > best[0]):
            best = (date, path, rows)
    return (os.path.relpath(best[1], ROOT), best[2]) if best else ("", [])


def replay_timeline(records_file: str, part: str, impl: str, batch: int = 1, shape: str = "k3_rank16",
                    kind: str = "kda_moe") -> str:
    """One recorded replay of one half (k3fast.measure.trace's replay_timeline: start and end of each kernel, µs from the
    first kernel's start, under the L2 condition the record names), one kernel per line."""
    with open(os.path.join(ROOT, records_file)) as f:
        doc = json.load(f)
    rec = next((r for r in doc["records"] if (r["part"], r["impl"], r["batch"], r["shape"], r["layer_kind"])
                == (part, impl, batch, shape, kind)), None)
    if rec is None or not rec.get("replay_timeline"):
        return f"{records_file}: no {part} timeline for {impl} at {shape} b{batch}"
    tl = rec["replay_timeline"]
    what = "whole layer" if part == "layer" else f"{part} half"
    lines = [f"{impl}, {what}, {shape} b{batch} ({records_file}; {tl.get('l2', 'L2 condition not recorded')}):"]
    for name, start, dur in tl["kernels"]:
        short = name.split("(")[0][:44]
        if name.startswith("kernel_cutlass_kernel_k3fast"):      # a k3fast kernel: module (class)
            mod = name[len("kernel_cutlass_kernel_k3fast"):].split("_build")[0].split("_kernel_class")[0]
            cls = re.search(r"locals([A-Za-z0-9]+?)_obj", name)
            short = f"{mod} ({cls.group(1)})" if cls else mod
        lines.append(f"  {short:44s} {start:7.1f} -> {start + dur:7.1f} µs")
    return "\n".join(lines)


_NCU_ROWS = {"Duration": "duration_us", "DRAM Throughput": "dram_pct", "Warp Cycles Per Issued Instruction":
             "cycles_per_issue", "Achieved Occupancy": "occupancy_pct", "Registers Per Thread": "registers"}
_NCU_STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio\s+\S+\s+([\d.]+)")


def recorded_ncu(path: str, top: int = 4) -> dict:
    """Headline rows of one Nsight Compute text report written by scripts/h200_ncu.sh (``path`` relative to the
    repository): duration, DRAM busy %, cycles per issued instruction, occupancy, registers, and the ``top`` stall
    reasons in cycles per issued instruction. Its meta.txt (GPU, driver, versions, commit) comes along as "meta"."""
    full = os.path.join(ROOT, path)
    with open(full) as f:
        text = f.read()
    out = {"source": path}
    for line in text.splitlines():
        parts = line.split()
        for label, key in _NCU_ROWS.items():
            if key not in out and line.strip().startswith(label + " ") and parts:
                try:
                    out[key] = float(parts[-1].replace(",", ""))
                except ValueError:
                    pass
    stalls = sorted(((float(v), k) for k, v in _NCU_STALL.findall(text) if k != "selected"), reverse=True)
    out["stalls"] = [(k, v) for v, k in stalls[:top]]
    meta = os.path.join(os.path.dirname(full), "meta.txt")
    if os.path.exists(meta):
        with open(meta) as f:
            out["meta"] = f.read().strip()
    return out


def ncu_table(paths: list[str]) -> str:
    """One line per ncu report: the case (from the file name), duration, DRAM busy, cycles per issue and stalls."""
    lines = []
    for p in paths:
        r = recorded_ncu(p)
        case = os.path.basename(p)[len("ncu-"):-len(".txt")]
        stalls = ", ".join(f"{k} {v:.2f}" for k, v in r["stalls"])
        nan = float("nan")
        lines.append(f"{case:48s} {r.get('duration_us', nan):7.2f} us  DRAM {r.get('dram_pct', nan):5.1f} %"
                     f"  {r.get('cycles_per_issue', nan):5.2f} cyc/issue  [{stalls}]")
    return "\n".join(lines)


def sass_hotspots(path: str, top: int = 6) -> dict:
    """Where the warps waited, from an Nsight Compute source page per SASS instruction (``ncu --import R --page
    source --csv --print-source sass``, gzipped; ``path`` relative to the repository): the total of the warp-stall
    samples and the ``top`` instructions by samples, each with its index in the listing, its SASS text, its share
    of all samples and its largest stall reason. A stall is charged to the instruction that waits to issue, so a
    CTA barrier's wait shows on the instruction after the BAR."""
    import csv
    import gzip
    with gzip.open(os.path.join(ROOT, path), "rt") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    names = rows[head]
    body = [r for r in rows[head + 1:] if len(r) == len(names)]
    col = {n: i for i, n in enumerate(names)}
    samples = col["Warp Stall Sampling (All Samples)"]
    reasons = [n for n in names if n.startswith("stall_") and "(Not Issued)" not in n]
    total = sum(int(r[samples] or 0) for r in body)
    out = []
    for i in sorted(range(len(body)), key=lambda i: -int(body[i][samples] or 0))[:top]:
        r = body[i]
        why = max(reasons, key=lambda n: int(r[col[n]] or 0))
        out.append({"index": i, "sass": r[col["Source"]].strip(), "samples": int(r[samples] or 0),
                    "share": int(r[samples] or 0) / total if total else 0.0, "reason": why[len("stall_"):],
                    "after_barrier": i > 0 and "BAR.SYNC" in " ".join(body[j][col["Source"]] for j in
                                                                    range(max(0, i - 8), i))})
    return {"source": path, "total_samples": total, "instructions": len(body), "top": out}
