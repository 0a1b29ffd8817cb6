"""Render recorded traces: a results table (markdown, into README.md) and one plot per layer kind.

    python -m k3fast.report                 # read traces/h200/records-*.json, write plots + README table
    python -m k3fast.report --check         # exit 1 if README's table is not what the records give

Everything shown comes from the JSON records; nothing is typed by hand.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- results-table:begin -->", "<!-- results-table:end -->"
IMPL_ORDER = ("ref", "compiled", "stock", "fast", "fast-serial", "fast-overlap", "fast-v4", "fast-prev", "fast-splitk", "fast-v5", "fast-taildsl", "fast-nibble", "fast-alldsl", "fast-w8")


def load_records(pattern: str | None = None) -> list[dict]:
    """All records of traces/h200/records-*.json; for the same cell the most recently measured record wins."""
    pattern = pattern or os.path.join(ROOT, "traces", "h200", "records-*.json")
    found = []
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            doc = json.load(f)
        found += [{**r, "source": os.path.relpath(path, ROOT)} for r in doc["records"]]
    cells: dict[tuple, dict] = {}
    for r in sorted(found, key=lambda r: r.get("date") or ""):      # ISO dates sort chronologically
        cells[(_kind_label(r), r["shape"], r["batch"], r.get("context"), r["impl"], r["part"])] = r
    return list(cells.values())


def perfetto_file(rec: dict) -> str | None:
    """The Perfetto trace of a record loaded by load_records (its "source" names the records file), or None.

    k3fast.trace writes a run's traces to perfetto-<tag>/ beside records-<tag>.json and records that relative path.
    Where one commit had several runs, the files were kept as records-<commit>-<step>.json with their traces in
    perfetto-<commit>-<step>/, so that folder is tried first. Records from before per-run folders (2026-11-28) name
    a bare file in traces/h200/perfetto/, which a later run of the same cell may have replaced."""
    if not rec.get("perfetto"):
        return None
    base = os.path.dirname(os.path.join(ROOT, rec["source"]))
    stem = os.path.basename(rec["source"])[len("records-"):-len(".json")]
    name = os.path.basename(rec["perfetto"])
    for cand in (os.path.join(base, f"perfetto-{stem}", name), os.path.join(base, rec["perfetto"]),
                 os.path.join(base, "perfetto", name)):
        if os.path.exists(cand):
            return os.path.relpath(cand, ROOT)
    return None


def _kind_label(r: dict) -> str:
    """The layer kind, marked when the MoE routing was forced onto a hot set (k3fast.trace --routing skewed)."""
    return r["layer_kind"] + (" skewed" if str(r.get("routing", "")).startswith("skewed") else "")


def validate(records: list[dict]) -> list[str]:
    """Schema problems (empty list when every record has every required field with a sane value)."""
    from .trace import SCHEMA_FIELDS
    problems = []
    for i, r in enumerate(records):
        for k in SCHEMA_FIELDS:
            if k not in r:
                problems.append(f"record {i}: missing {k}")
        if r.get("part") not in ("layer", "attn", "moe"):
            problems.append(f"record {i}: part {r.get('part')!r}")
        if r.get("layer_kind") not in ("kda_moe", "mla_moe", "kda_dense"):
            problems.append(f"record {i}: layer_kind {r.get('layer_kind')!r}")
        if r.get("shape") not in ("k3_rank16", "k3_rank8", "full"):
            problems.append(f"record {i}: shape {r.get('shape')!r}")
        for k in ("replay_us_median", "floor_us", "bytes", "copy_tbps"):
            v = r.get(k)
            if not isinstance(v, (int, float)) or v <= 0:
                problems.append(f"record {i}: {k} = {v!r}")
        if isinstance(r.get("replay_us_p10"), (int, float)) and isinstance(r.get("replay_us_p90"), (int, float)):
            if not r["replay_us_p10"] <= r["replay_us_median"] <= r["replay_us_p90"]:
                problems.append(f"record {i}: percentiles out of order")
    return problems


def table(records: list[dict], part: str = "layer", kinds: tuple[str, ...] | None = None) -> str:
    rows = defaultdict(dict)
    for r in records:
        if r["part"] == part and (kinds is None or r["layer_kind"] in kinds):
            rows[(_kind_label(r), r["shape"], r["batch"], r.get("context"))][r["impl"]] = r
    impls = [i for i in IMPL_ORDER if any(i in v for v in rows.values())]
    head = ("| layer | shape | batch | ctx | floor µs | " + " | ".join(f"{i} µs (kernels)" for i in impls)
            + " | stock / fast (one run) | runs |")
    sep = "|" + "---|" * (7 + len(impls))
    lines = [head, sep]
    shape_order = {"k3_rank16": 0, "k3_rank8": 1, "full": 2}
    for key in sorted(rows, key=lambda k: (k[0], shape_order.get(k[1], 9), k[2], k[3] or 0)):
        cell = rows[key]
        any_r = max(cell.values(), key=lambda r: r.get("date") or "")     # the floor of the latest run
        vals = []
        for i in impls:
            r = cell.get(i)
            vals.append("—" if r is None else f"{r['replay_us_median']:.1f} ({r['kernels']:g})")
        runs = sorted({str(r.get("commit", "?"))[:7] for r in cell.values()})
        st, fa = cell.get("stock"), cell.get("fast")
        ratio = (f"{st['replay_us_median'] / fa['replay_us_median']:.2f}x"
                 if st and fa and st.get("commit") == fa.get("commit") else "—")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3] or ''} | {any_r['floor_us']:.1f} | " + " | ".join(vals)
                     + f" | {ratio} | {' '.join(runs)} |")
    return "\n".join(lines)


KERNEL_ORDER = ("attnres_rms_gemv", "kda_conv_gate_step", "oproj_attnres", "router_down_topk", "shared_expert_gate_up",
                "moe_mxfp4_experts", "moe_tail")


def load_kernel_bench(pattern: str | None = None) -> list[dict]:
    """Rows of traces/h200/kernels-*.json (k3fast.bench); for the same (kernel, shape, batch) the latest wins."""
    pattern = pattern or os.path.join(ROOT, "traces", "h200", "kernels-*.json")
    found = []
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            found += [{**r, "source": os.path.relpath(path, ROOT)} for r in json.load(f)["records"]]
    cells = {}
    for r in sorted(found, key=lambda r: r.get("date") or ""):
        cells[(r["kernel"], r["shape"], r["batch"])] = r
    return list(cells.values())


def kernel_table(rows: list[dict]) -> str:
    """One row per fused kernel and shape, one column per batch: fast / stock µs in one run, and fast over floor.
    Diagnostic variants (names with @ or :) stay in the JSON and the notebooks."""
    cells = defaultdict(dict)
    for r in rows:
        if r["kernel"] in KERNEL_ORDER:
            cells[(r["kernel"], r["shape"])][r["batch"]] = r
    batches = sorted({b for c in cells.values() for b in c})
    shape_order = {"k3_rank16": 0, "k3_rank8": 1, "full": 2}
    lines = ["| kernel | shape | " + " | ".join(f"b{b}: fast / stock µs (x floor)" for b in batches) + " | runs |",
             "|" + "---|" * (3 + len(batches))]
    for key in sorted(cells, key=lambda k: (KERNEL_ORDER.index(k[0]), shape_order.get(k[1], 9))):
        c = cells[key]
        vals = []
        for b in batches:
            r = c.get(b)
            vals.append("—" if r is None else f"{r['fast_us_median']:.1f} / {r['stock_us_median']:.1f} "
                                              f"({r['fast_us_median'] / r['floor_us']:.1f})")
        runs = " ".join(sorted({str(r.get("commit", "?"))[:7] for r in c.values()}))
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(vals) + f" | {runs} |")
    return "\n".join(lines)


def latest_experts_probe(pattern: str | None = None, shape: str | None = None):
    """(path, document) of the newest uniform-routing k3fast.bench_experts file (with records of ``shape``, when
    given), or (None, None)."""
    pattern = pattern or os.path.join(ROOT, "traces", "h200", "experts-*.json")
    best = None
    for path in glob.glob(pattern):
        if path.endswith("-skewed.json"):
            continue
        with open(path) as f:
            doc = json.load(f)
        if shape is not None and not any(r["shape"] == shape for r in doc["records"]):
            continue
        date = max((r.get("date") or "" for r in doc["records"]), default="")
        if best is None or date > best[0]:
            best = (date, path, doc)
    return (None, None) if best is None else best[1:]


def experts_probe_table(pattern: str | None = None) -> str:
    """Per shape, the newest uniform-routing k3fast.bench_experts file with that shape, as variant x batch (µs and
    TB/s), Marlin included: one table per file, so every row of a table comes from one run."""
    pattern = pattern or os.path.join(ROOT, "traces", "h200", "experts-*.json")
    shapes = set()
    for path in glob.glob(pattern):
        if not path.endswith("-skewed.json"):
            with open(path) as f:
                shapes |= {r["shape"] for r in json.load(f)["records"]}
    picked = {}
    for shape in sorted(shapes, key=lambda s: {"k3_rank16": 0, "k3_rank8": 1, "full": 2}.get(s, 9)):
        path, doc = latest_experts_probe(pattern, shape)
        picked.setdefault(path, (doc, []))[1].append(shape)
    if not picked:
        return "_No experts probe recorded yet._"
    tables = []
    for path, (doc, wanted) in picked.items():
        rows = defaultdict(dict)
        for r in doc["records"]:
            if r.get("us_median") is not None and r["shape"] in wanted:
                rows[(r["shape"], r["variant"])][r["batch"]] = r
        batches = sorted({b for c in rows.values() for b in c})
        lines = [f"From `{os.path.relpath(path, ROOT)}` (copy {doc.get('copy_tbps', float('nan')):.2f} TB/s).",
                 "", "| shape | variant | " + " | ".join(f"b{b} µs (TB/s)" for b in batches) + " |",
                 "|" + "---|" * (2 + len(batches))]
        for (shape, variant), c in rows.items():
            vals = ["—" if b not in c else f"{c[b]['us_median']:.1f} ({c[b]['achieved_tbps']:.2f})" for b in batches]
            lines.append(f"| {shape} | {variant} | " + " | ".join(vals) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def readme_block(records: list[dict], kernel_rows: list[dict] | None = None, experts: str | None = None) -> str:
    if not records:
        return f"{BEGIN}\n_No H200 records yet._\n{END}"
    env = records[0]
    srcs = sorted({r["source"] for r in records})
    variants = sorted({r.get("stock_variant") or "torch-glue" for r in records if r["impl"] == "stock"})
    l2 = sorted({r.get("l2") or "flushed (256 MB write) before each replay" for r in records})
    return (f"{BEGIN}\nMedian CUDA-graph replay µs with the kernel count per replay; for each cell and implementation "
            f"the most recent record. Floor = bytes / copy bandwidth measured in the same run "
            f"({', '.join(f'{b:.2f}' for b in sorted({r['copy_tbps'] for r in records}))} TB/s in the runs). "
            f"L2: {'; '.join(l2)} (see `k3fast/trace.py`). GPU {env['gpu']}, driver {env['driver']}, torch {env['torch']}, "
            f"cutlass {env['cutlass']}. Stock variant: {', '.join(variants) or 'none'}. "
            f"`runs` names the commits the row's records come from; the stock/fast ratio is shown only when both come "
            f"from one run. Sources: {', '.join(f'`{s}`' for s in srcs)}.\n\n"
            f"**Whole layer** (`part: layer`)\n\n{table(records)}\n\n"
            f"**Attention half** (`part: attn`, layer input -> MLP input), KDA layers\n\n"
            f"{table(records, 'attn', ('kda_moe',))}\n\n"
            f"**MoE half** (`part: moe`, MLP input -> layer output), KDA layers\n\n"
            f"{table(records, 'moe', ('kda_moe',))}\n\n"
            + (f"**Per kernel** (`python -m k3fast.bench`, `kernels-*.json`): each fused kernel alone as a one-kernel "
               f"CUDA graph against its stock counterpart in the same run, and its time over its floor\n\n"
               f"{kernel_table(kernel_rows)}\n\n" if kernel_rows else "")
            + (f"**Routed-experts design probe** (`python -m k3fast.bench_experts`; variants in its docstring)\n\n"
               f"{experts}\n" if experts else "")
            + f"{END}")


def plot(records: list[dict], out_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for kind in sorted({_kind_label(r) for r in records}):
        rs = [r for r in records if _kind_label(r) == kind and r["part"] == "layer"]
        shapes = [s for s in ("k3_rank16", "k3_rank8", "full") if any(r["shape"] == s for r in rs)]
        fig, axes = plt.subplots(2, len(shapes), figsize=(5 * len(shapes), 7), squeeze=False)
        for j, shape in enumerate(shapes):
            sub = [r for r in rs if r["shape"] == shape]
            ctxs = sorted({r.get("context") or 0 for r in sub})
            for ctx in ctxs:
                for impl in IMPL_ORDER:
                    pts = sorted((r["batch"], r["replay_us_median"], r["kernels"]) for r in sub
                                 if r["impl"] == impl and (r.get("context") or 0) == ctx)
                    if not pts:
                        continue
                    lab = impl + (f" ctx{ctx}" if ctx else "")
                    axes[0, j].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=lab)
                    axes[1, j].plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=lab)
                fl = sorted({(r["batch"], r["floor_us"]) for r in sub if (r.get("context") or 0) == ctx})
                axes[0, j].plot([p[0] for p in fl], [p[1] for p in fl], "k--", label="floor" + (f" ctx{ctx}" if ctx else ""))
            axes[0, j].set(xscale="log", yscale="log", title=f"{kind} {shape}", ylabel="µs per decode step")
            axes[1, j].set(xscale="log", yscale="log", xlabel="batch", ylabel="kernels per step")
            axes[0, j].legend(fontsize=7)
        fig.tight_layout()
        os.makedirs(out_dir, exist_ok=True)
        p = os.path.join(out_dir, f"{kind.replace(' ', '_')}.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def update_readme(block: str, path: str = os.path.join(ROOT, "README.md"), check: bool = False) -> bool:
    with open(path) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} markers")
    new = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    if check:
        return new == text
    with open(path, "w") as f:
        f.write(new)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", default=None, help="glob of record files (default traces/h200/records-*.json)")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--print-only", action="store_true", help="print the table; write no plot and leave README alone")
    args = ap.parse_args(argv)
    recs = load_records(args.records)
    probs = validate(recs)
    if probs:
        print("schema problems:\n  " + "\n  ".join(probs[:20]))
        return 1
    block = readme_block(recs, load_kernel_bench(), experts_probe_table())
    if args.check:
        ok = update_readme(block, check=True)
        print("README table is up to date" if ok else "README table differs from the records: run python -m k3fast.report")
        return 0 if ok else 1
    if args.print_only:
        print(table(recs) if recs else "no records")
        return 0
    if not args.no_plots and recs:
        for p in plot(recs, os.path.join(ROOT, "traces", "h200", "plots")):
            print("wrote", os.path.relpath(p, ROOT))
    update_readme(block)
    print(table(recs) if recs else "no records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
