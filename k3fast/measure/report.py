"""README's results table and headline figure, rendered from recorded layer traces; nothing is typed by hand.

    python -m k3fast.measure.report            # rebuild README's results block and docs/figures/headline.png
    python -m k3fast.measure.report --check    # exit 1 if README's block is not what its record files give

README's block names its sources in its begin marker, one run per card:
``<!-- results:begin H100=traces/h100/records-<tag>.json H200=traces/h200/records-<tag>.json -->``. Every row's
stock and fast come from that one file, so each ratio is measured within one run on one card.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMPL_ORDER = ("ref", "compiled", "stock", "fast", "fast-v51", "fast-infma", "fast-cublas", "fast-front0",
              "fast-taildsl")
RESULTS_BEGIN, RESULTS_END = "<!-- results:begin", "<!-- results:end -->"
HEADLINE = os.path.join("docs", "figures", "headline.png")
SHAPES = ("k3_rank16", "k3_rank8", "full")


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

    k3fast.measure.trace writes a run's traces to perfetto-<tag>/ beside records-<tag>.json and records that relative path.
    Where one commit had several runs, the files were kept as records-<commit>-<step>.json with their traces in
    perfetto-<commit>-<step>/, so that folder is tried first. Older records without a per-run folder name
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
    """The layer kind, marked when the MoE routing was forced onto a hot set (k3fast.measure.trace --routing skewed)."""
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


KERNEL_ORDER = ("attnres_rms_gemv", "kda_conv_gate_step", "oproj_attnres", "router_down_topk", "moe_mxfp4_experts",
                "moe_tail")


def load_kernel_bench(pattern: str | None = None) -> list[dict]:
    """Rows of traces/h200/kernels-*.json (k3fast.measure.bench); for the same (kernel, shape, batch) the latest wins."""
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
    """(path, document) of the newest uniform-routing k3fast.measure.bench_experts file (with records of ``shape``, when
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
    """Per shape, the newest uniform-routing k3fast.measure.bench_experts file with that shape, as variant x batch (µs and
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


# The issue targets the closing block checks (issue 4: attention half; issue 5: MoE half), as (issue, what, part,
# shapes, batches, test). Each test reads one (stock, fast) pair of records from one run; "ceiling" is stock over
# the floor: the ratio an implementation at the byte floor would reach against that stock.
_ALL = ("k3_rank16", "k3_rank8", "full")
TARGETS = (
    ("4", "attention half in <= 3 launches", "attn", ("k3_rank16",), (1,), ("kernels", 3)),
    ("4", "attention half within 1.3x of its floor", "attn", ("k3_rank16",), (1,), ("over_floor", 1.3)),
    ("4", "attention half >= 1.8x stock", "attn", _ALL, (1, 8, 64), ("speedup", 1.8)),
    ("5", "MoE half in <= 4 launches", "moe", ("k3_rank16",), (1,), ("kernels", 4)),
    ("5", "MoE half >= 2x stock", "moe", ("k3_rank16",), (1,), ("speedup", 2.0)),
    ("5", "MoE half >= 1.5x stock", "moe", _ALL, (64,), ("speedup", 1.5)),
)


def _one_run_pairs(records: list[dict]) -> dict:
    """(routing label, shape, batch, part) -> {impl: record}, refusing two runs of one cell: the closing block
    compares stock and fast only where one run measured both."""
    cells: dict[tuple, dict] = defaultdict(dict)
    for r in records:
        cells[(_kind_label(r), r["shape"], r["batch"], r["part"])][r["impl"]] = r
    for key, c in cells.items():
        if len({r.get("source") for r in c.values()}) > 1:
            raise SystemExit(f"{key}: records from several files; give the closing block one run per routing")
    return cells


def closing_cells_table(records: list[dict], part: str) -> str:
    """Stock beside fast per cell of one run, with the byte floor and what the floor allows: ``stock / floor`` is
    the largest stock / fast ratio any implementation could show on those bytes at the measured copy bandwidth."""
    cells = _one_run_pairs(records)
    order = {s: i for i, s in enumerate(_ALL)}
    lines = ["| routing | shape | batch | floor µs | stock µs (kernels) | fast µs (kernels) | stock / fast | "
             "fast / floor | stock / floor (ceiling) | fast TB/s (of copy) |", "|" + "---|" * 10]
    for key in sorted((k for k in cells if k[3] == part), key=lambda k: (k[0], order.get(k[1], 9), k[2])):
        st, fa = cells[key].get("stock"), cells[key].get("fast")
        if not (st and fa):
            continue
        tbps = fa["bytes"] / fa["replay_us_median"] / 1e6
        routing = "skewed" if key[0].endswith("skewed") else "uniform"
        lines.append(f"| {routing} | {key[1]} | {key[2]} | {fa['floor_us']:.1f} | {st['replay_us_median']:.1f} "
                     f"({st['kernels']:g}) | {fa['replay_us_median']:.1f} ({fa['kernels']:g}) | "
                     f"{st['replay_us_median'] / fa['replay_us_median']:.2f}x | "
                     f"{fa['replay_us_median'] / fa['floor_us']:.2f}x | {st['replay_us_median'] / st['floor_us']:.2f}x"
                     f" | {tbps:.2f} ({tbps / fa['copy_tbps']:.0%}) |")
    return "\n".join(lines)


def closing_targets_table(records: list[dict], experts: list[dict] | None = None) -> str:
    """Each issue target at each cell it names, from the records of one run per routing: measured, met or missed,
    and the ceiling (stock over its floor) where the target is a ratio to stock. ``experts`` are
    k3fast.measure.bench_experts rows (uniform routing, the default kernel) for the routed-experts bandwidth target."""
    cells = _one_run_pairs(records)
    lines = ["| issue | target | routing | cell | measured | met | ceiling (stock / floor) |", "|" + "---|" * 7]
    for issue, what, part, shapes, batches, (test, bound) in TARGETS:
        for routing in sorted({k[0] for k in cells}):
            if part == "attn" and routing.endswith("skewed"):
                continue                                     # the attention half does not see the routing
            for shape in shapes:
                for b in batches:
                    c = cells.get((routing, shape, b, part), {})
                    st, fa = c.get("stock"), c.get("fast")
                    if fa is None or (test == "speedup" and st is None):
                        continue
                    if test == "kernels":
                        ok, shown = fa["kernels"] <= bound, f"{fa['kernels']:g}"
                    elif test == "over_floor":
                        v = fa["replay_us_median"] / fa["floor_us"]
                        ok, shown = v <= bound, f"{v:.2f}x ({fa['replay_us_median']:.1f} / {fa['floor_us']:.1f} µs)"
                    else:
                        v = st["replay_us_median"] / fa["replay_us_median"]
                        ok = v >= bound
                        shown = f"{v:.2f}x ({st['replay_us_median']:.1f} / {fa['replay_us_median']:.1f} µs)"
                    ceil = (f"{st['replay_us_median'] / st['floor_us']:.2f}x" if test == "speedup" else "")
                    rt = "skewed" if routing.endswith("skewed") else "uniform"
                    lines.append(f"| {issue} | {what} | {rt} | {shape} b{b} | {shown} | {'yes' if ok else 'no'} | "
                                 f"{ceil} |")
    for r in experts or []:
        share = r["achieved_tbps"] / r["copy_tbps"]
        lines.append(f"| 5 | routed experts >= 75% of copy | uniform | {r['shape']} b{r['batch']} | "
                     f"{share:.0%} ({r['us_median']:.1f} µs, {r['achieved_tbps']:.2f} of {r['copy_tbps']:.2f} TB/s; "
                     f"`{r['source']}`) | {'yes' if share >= 0.75 else 'no'} | |")
    return "\n".join(lines)


def latest_experts_default(pattern: str, batches=(8, 64)) -> list[dict]:
    """The newest uniform-routing row of the default routed-experts kernel per (shape, batch) in the files of
    ``pattern`` (k3fast.measure.bench_experts), each with its source file."""
    best: dict[tuple, dict] = {}
    for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
        with open(path) as f:
            doc = json.load(f)
        for r in doc["records"]:
            if (r.get("variant") == "default" and r.get("routing", "uniform") == "uniform" and r["batch"] in batches
                    and r.get("us_median")):
                key = (r["shape"], r["batch"])
                if key not in best or (r.get("date") or "") > (best[key].get("date") or ""):
                    best[key] = {**r, "source": os.path.relpath(path, ROOT)}
    order = {s: i for i, s in enumerate(_ALL)}
    return [best[k] for k in sorted(best, key=lambda k: (k[1], order.get(k[0], 9)))]


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


# ------------------------------------------------------------------------------------------ README's block

def _one_run(path: str) -> list[dict]:
    """The records of one file (one run on one card), refused when they do not validate."""
    recs = load_records(os.path.join(ROOT, path))
    if not recs:
        raise SystemExit(f"results: no records in {path}")
    probs = validate(recs)
    if probs:
        raise SystemExit(f"results: schema problems in {path}:\n  " + "\n  ".join(probs[:20]))
    return recs


def results_rows(card: str, recs: list[dict]) -> list[dict]:
    """One row per (layer kind, shape, batch) of a run where both stock and fast measured the whole layer."""
    cells: dict[tuple, dict] = defaultdict(dict)
    for r in recs:
        if r["part"] == "layer" and not str(r.get("routing", "")).startswith("skewed"):
            cells[(r["layer_kind"], r["shape"], r["batch"], r.get("context") or 0)][r["impl"]] = r
    rows = []
    order = {s: i for i, s in enumerate(SHAPES)}
    for key in sorted(cells, key=lambda k: (k[0], order.get(k[1], 9), k[2], k[3])):
        st, fa = cells[key].get("stock"), cells[key].get("fast")
        if st and fa:
            rows.append(dict(card=card, kind=key[0], shape=key[1], batch=key[2], context=key[3],
                             floor=fa["floor_us"], stock=st["replay_us_median"], fast=fa["replay_us_median"],
                             k_stock=st["kernels"], k_fast=fa["kernels"], gpu=fa["gpu"], commit=fa.get("commit")))
    return rows


def results_block(sources: dict[str, str]) -> str:
    """README's results block from {card: records file}: the table and the line that says where it comes from."""
    rows, notes = [], []
    for card, path in sources.items():
        recs = _one_run(path)
        rows += results_rows(card, recs)
        e = recs[0]
        notes.append(f"{card}: `{path}` ({e['gpu']}, driver {e['driver']}, torch {e['torch']}, cutlass "
                     f"{e['cutlass']}, commit {str(e.get('commit'))[:7]}, copy "
                     f"{', '.join(f'{c:.2f}' for c in sorted({r['copy_tbps'] for r in recs}))} TB/s)")
    lines = ["| card | layer | shape | batch | floor µs | stock µs | fast µs | stock / fast | fast / floor | "
             "kernels stock → fast |", "|" + "---|" * 10]
    for r in rows:
        kind = r["kind"] + (f" {r['context'] // 1024}K" if r["context"] else "")
        lines.append(f"| {r['card']} | {kind} | {r['shape']} | {r['batch']} | {r['floor']:.1f} | {r['stock']:.1f} | "
                     f"{r['fast']:.1f} | {r['stock'] / r['fast']:.2f}x | {r['fast'] / r['floor']:.2f}x | "
                     f"{r['k_stock']:g} → {r['k_fast']:g} |")
    marker = " ".join(f"{c}={p}" for c, p in sources.items())
    return (f"{RESULTS_BEGIN} {marker} -->\n"
            "Generated by `python -m k3fast.measure.report` from one run per card: " + "; ".join(notes) + ". "
            "Median CUDA-graph replay of one decode step of one layer (uniform routing), L2 flushed before each "
            "replay; floor = the bytes the step must move / the copy bandwidth measured in the same run.\n\n"
            + "\n".join(lines) + f"\n{RESULTS_END}")


def _sources(text: str) -> dict[str, str]:
    i = text.find(RESULTS_BEGIN)
    if i < 0:
        raise SystemExit(f"README.md has no {RESULTS_BEGIN} ... --> marker")
    words = text[i + len(RESULTS_BEGIN):text.index("-->", i)].split()
    if not words or not all("=" in w for w in words):
        raise SystemExit("the results marker names CARD=records-file pairs, e.g. H100=traces/h100/records-x.json")
    return dict(w.split("=", 1) for w in words)


def update_readme(path: str = os.path.join(ROOT, "README.md"), check: bool = False) -> bool:
    """Rebuild README's results block from the files its marker names; with ``check``, only compare."""
    with open(path) as f:
        text = f.read()
    i = text.find(RESULTS_BEGIN)
    sources = _sources(text)
    j = text.index(RESULTS_END, i) + len(RESULTS_END)
    new = text[:i] + results_block(sources) + text[j:]
    if check:
        return new == text
    with open(path, "w") as f:
        f.write(new)
    return True


def headline_figure(sources: dict[str, str], out: str = os.path.join(ROOT, HEADLINE)) -> str:
    """One figure per card: per (shape, batch) of the KDA + MoE layer, stock and fast µs against the floor, with
    the stock / fast ratio above each pair."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cards = list(sources)
    fig, axes = plt.subplots(1, len(cards), figsize=(6.5 * len(cards), 4.2), squeeze=False)
    for ax, card in zip(axes[0], cards):
        rows = [r for r in results_rows(card, _one_run(sources[card])) if r["kind"] == "kda_moe"]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["stock"] for r in rows], 0.4, label="stock", color="#b0b0b0")
        ax.bar([x + 0.2 for x in xs], [r["fast"] for r in rows], 0.4, label="fast (k3fast)", color="#2a6fba")
        for x, r in zip(xs, rows):
            ax.plot([x - 0.45, x + 0.45], [r["floor"]] * 2, "k-", lw=1.5, label="byte floor" if x == 0 else None)
            ax.text(x, max(r["stock"], r["fast"]) * 1.04, f"{r['stock'] / r['fast']:.2f}x", ha="center", fontsize=8)
        ax.set_xticks(list(xs), [f"{r['shape'].replace('k3_', '')}\nb{r['batch']}" for r in rows], fontsize=8)
        ax.set_yscale("log")
        ax.set(ylabel="µs per decode step (log)", title=f"KDA + MoE layer, {card} ({rows[0]['gpu'] if rows else ''})")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def compare_runs(new_path: str, old_path: str) -> str:
    """Each cell two record files share (same card expected): the new median replay against the old, the kernel
    counts, and whether the outputs' error against the reference is the same to the last bit (same seeds, so equal
    errors mean the kernels computed the same numbers). For checking that a change moved no time and no bit."""
    def cells(path):
        return {(r["layer_kind"], r["shape"], r["batch"], r["part"], r["impl"]): r
                for r in load_records(os.path.join(ROOT, path))}
    new, old = cells(new_path), cells(old_path)
    gpus = {r["gpu"] for r in new.values()} | {r["gpu"] for r in old.values()}
    lines = [f"`{new_path}` against `{old_path}` ({', '.join(sorted(gpus))})", "",
             "| layer | shape | batch | part | impl | new µs | old µs | change | kernels | same error bits |",
             "|" + "---|" * 10]
    order = {s: i for i, s in enumerate(SHAPES)}
    for k in sorted(set(new) & set(old), key=lambda k: (k[0], order.get(k[1], 9), k[2], k[3], k[4])):
        n, o = new[k], old[k]
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {n['replay_us_median']:.1f} | "
                     f"{o['replay_us_median']:.1f} | {100 * (n['replay_us_median'] / o['replay_us_median'] - 1):+.1f} % | "
                     f"{n['kernels']:g} / {o['kernels']:g} | "
                     f"{'yes' if n.get('rel_err_vs_ref') == o.get('rel_err_vs_ref') else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when README's block differs from its files")
    ap.add_argument("--no-figure", action="store_true", help="leave docs/figures/headline.png alone")
    ap.add_argument("--print-only", action="store_true", help="print the table; write nothing")
    ap.add_argument("--compare", nargs=2, metavar=("NEW", "OLD"), help="print compare_runs(NEW, OLD) and exit")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare_runs(*args.compare))
        return 0
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        sources = _sources(f.read())
    if args.check:
        ok = update_readme(path, check=True)
        print("README results block is up to date" if ok else
              "README results block differs from its files: run python -m k3fast.measure.report")
        return 0 if ok else 1
    if args.print_only:
        print(results_block(sources))
        return 0
    update_readme(path)
    if not args.no_figure:
        print("wrote", os.path.relpath(headline_figure(sources), ROOT))
    print(results_block(sources))
    return 0


if __name__ == "__main__":
    sys.exit(main())
