"""README's results table and headline figure, rendered from recorded layer traces; nothing is typed by hand.

    python -m k3fast.measure.report            # rebuild README's results block and docs/figures/headline.png
    python -m k3fast.measure.report --check    # exit 1 if README's block is not what its record files give

README's block names its sources in its begin marker, one run per card:
``<!-- results:begin H100=traces/h100/records-<tag>.json H200=traces/h200/records-<tag>.json -->``. A later run of
one shape on a card may replace that shape's rows: ``H100:k3_rank8=traces/h100/records-<tag2>.json``. Every row's
stock and fast come from one file, so each ratio is measured within one run on one card, and the line above the
table names every file.
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
# README's table shows MLA layers at one cache length (8K tokens, where decode attention is a real share of the
# layer); notebook 09 draws them over the cache length.
README_MLA_CONTEXT = 8192


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
    """One row per (layer kind, shape, batch) of a run where both stock and fast measured the whole layer (MLA layers
    at README_MLA_CONTEXT cached tokens)."""
    cells: dict[tuple, dict] = defaultdict(dict)
    for r in recs:
        if r["layer_kind"] == "mla_moe" and r.get("context") != README_MLA_CONTEXT:
            continue
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


def _source_rows(sources: dict[str, str]) -> list[tuple[str, list[dict], list[dict]]]:
    """[(file, its records, its rows)] in marker order: a "CARD" source gives that card's rows, a "CARD:SHAPE" source
    replaces the rows of that shape on that card (a later run of one shape) and gives nothing else."""
    per: dict[str, list[dict]] = {}
    runs: dict[str, list[dict]] = {}
    for key, path in sources.items():
        card, _, shape = key.partition(":")
        if shape and shape not in SHAPES:
            raise SystemExit(f"results marker: {key}: the shape after the card must be one of {', '.join(SHAPES)}")
        if path not in runs:
            runs[path] = _one_run(path)
        rows = results_rows(card, runs[path])
        if shape:
            rows = [r for r in rows if r["shape"] == shape]
            if not rows:
                raise SystemExit(f"results marker: {key}: {path} has no stock / fast pair at {shape}")
            for other in per.values():
                other[:] = [r for r in other if (r["card"], r["shape"]) != (card, shape)]
        per[path] = per.get(path, []) + rows
    return [(path, runs[path], rows) for path, rows in per.items()]


def _ordered(rows: list[dict]) -> list[dict]:
    order = {s: i for i, s in enumerate(SHAPES)}
    return sorted(rows, key=lambda r: (r["card"], r["kind"], order.get(r["shape"], 9), r["batch"], r["context"]))


def results_block(sources: dict[str, str]) -> str:
    """README's results block from {card or card:shape: records file}: the table and the line that says where each
    row comes from."""
    rows, notes = [], []
    for path, recs, got in _source_rows(sources):
        rows += got
        e = recs[0]
        # which stock: vLLM's own layer ("vllm-layer") or an earlier composition of its kernels ("vllm-ops")
        stock = sorted({str(r.get("stock_variant") or "unrecorded") for r in recs if r["impl"] == "stock"})
        keys = [k for k, p in sources.items() if p == path]
        what = ", ".join(k.replace(":", " ") for k in keys)
        notes.append(f"{what}: `{path}` ({e['gpu']}, driver {e['driver']}, torch {e['torch']}, cutlass "
                     f"{e['cutlass']}, commit {str(e.get('commit'))[:7]}, copy "
                     f"{', '.join(f'{c:.2f}' for c in sorted({r['copy_tbps'] for r in recs}))} TB/s, "
                     f"stock = {', '.join(stock)})")
    lines = ["| card | layer | shape | batch | floor µs | stock µs | fast µs | stock / fast | fast / floor | "
             "kernels stock → fast |", "|" + "---|" * 10]
    for r in _ordered(rows):
        kind = r["kind"] + (f" {r['context'] // 1024}K" if r["context"] else "")
        lines.append(f"| {r['card']} | {kind} | {r['shape']} | {r['batch']} | {r['floor']:.1f} | {r['stock']:.1f} | "
                     f"{r['fast']:.1f} | {r['stock'] / r['fast']:.2f}x | {r['fast'] / r['floor']:.2f}x | "
                     f"{r['k_stock']:g} → {r['k_fast']:g} |")
    marker = " ".join(f"{c}={p}" for c, p in sources.items())
    return (f"{RESULTS_BEGIN} {marker} -->\n"
            "Generated by `python -m k3fast.measure.report`, each row from one run on one card: " + "; ".join(notes)
            + ". Median CUDA-graph replay of one decode step of one layer (uniform routing), L2 flushed before each "
            "replay; floor = the bytes the step must move / the copy bandwidth measured in the same run.\n\n"
            + "\n".join(lines) + f"\n{RESULTS_END}")


def readme_sources(text: str) -> dict[str, str]:
    i = text.find(RESULTS_BEGIN)
    if i < 0:
        raise SystemExit(f"README.md has no {RESULTS_BEGIN} ... --> marker")
    words = text[i + len(RESULTS_BEGIN):text.index("-->", i)].split()
    if not words or not all("=" in w for w in words):
        raise SystemExit("the results marker names CARD=records-file pairs, e.g. H100=traces/h100/records-x.json "
                         "(or CARD:SHAPE=file for a later run of one shape)")
    return dict(w.split("=", 1) for w in words)


def update_readme(path: str = os.path.join(ROOT, "README.md"), check: bool = False) -> bool:
    """Rebuild README's results block from the files its marker names; with ``check``, only compare."""
    with open(path) as f:
        text = f.read()
    i = text.find(RESULTS_BEGIN)
    sources = readme_sources(text)
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
    every = _ordered([r for _, _, rows in _source_rows(sources) for r in rows if r["kind"] == "kda_moe"])
    cards = list(dict.fromkeys(r["card"] for r in every))
    fig, axes = plt.subplots(1, len(cards), figsize=(6.5 * len(cards), 4.2), squeeze=False)
    for ax, card in zip(axes[0], cards):
        rows = [r for r in every if r["card"] == card]
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


# Cached tokens per request while vllm_e2e profiles its per-layer figures: its 16-token prompts and the 10 decode steps
# inside the profiler (files written before the field existed carry no ``per_layer_context``).
ENGINE_PROFILE_CONTEXT = (16, 26)


def engine_layer_figure(rec: dict, e2e_records: list[dict]) -> dict | None:
    """vLLM's own in-engine figure for the layer a stock trace record measures: same layer kind, shape, batch and
    card (and, for an MLA layer, a cache length inside the one the engine profiled at). {"kernel_us", "kernels",
    "context", "source"} or None where the engine runs have no such cell."""
    for e in e2e_records:
        if e.get("kind") != "vllm_e2e" or e.get("engine") != "stock" or e.get("batch") != rec["batch"]:
            continue
        if e.get("gpu") != rec.get("gpu") or (e.get("model") or {}).get("shape") != rec["shape"]:
            continue
        us = e.get(f"layer_us_{rec['layer_kind']}")
        if us is None:
            continue
        lo, hi = e.get("per_layer_context") or ENGINE_PROFILE_CONTEXT
        if rec["layer_kind"] == "mla_moe" and not lo <= (rec.get("context") or 0) <= hi:
            continue
        return {"kernel_us": us, "kernels": e[f"layer_kernels_{rec['layer_kind']}"], "context": [lo, hi],
                "source": e.get("source")}
    return None


def engine_match(records_path: str, *e2e_paths: str) -> str:
    """The stock layer of a trace run beside vLLM's own layer inside an engine (a vllm_e2e file, same card): per
    layer kind and batch, the stock record's kernel count and summed kernel time against the engine's eager
    per-layer figure (``layer_kernels`` / ``layer_us``), the stock variant, and whether the kernel time is within 5 %.
    Both are sums of kernel durations of one decode step's layer, so they compare like for like; the trace's
    replay median also contains launch gaps, the engine's figure does not. An MLA layer's time grows with the cache,
    so its cells compare only at the cache length the engine profiled at; other cells are listed as not comparable."""
    recs = [r for r in load_records(os.path.join(ROOT, records_path))
            if r["impl"] == "stock" and r["part"] == "layer"]
    e2e = []
    for path in e2e_paths:
        with open(os.path.join(ROOT, path)) as f:
            e2e += json.load(f)["records"]
    lines = [f"stock in `{records_path}` against vLLM's layer in " + ", ".join(f"`{p}`" for p in e2e_paths), "",
             "| layer | shape | batch | context | stock variant | kernels stock / vLLM | kernel µs stock / vLLM | "
             "within 5 % |", "|" + "---|" * 8]
    for r in sorted(recs, key=lambda r: (r["layer_kind"], r["shape"], r["batch"], r.get("context") or 0)):
        eng = engine_layer_figure(r, e2e)
        head = f"| {r['layer_kind']} | {r['shape']} | {r['batch']} | {r.get('context') or 0} | {r.get('stock_variant')} |"
        if eng is None:
            lines.append(f"{head} {r['kernels']:g} / - | {r['kernel_us_sum']:.1f} / - | no engine cell (shape, "
                         f"batch, card or cache length differ) |")
            continue
        ok = abs(r["kernel_us_sum"] / eng["kernel_us"] - 1) <= 0.05
        lines.append(f"{head} {r['kernels']:g} / {eng['kernels']:g} | {r['kernel_us_sum']:.1f} / "
                     f"{eng['kernel_us']:.1f} | {'yes' if ok else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when README's block differs from its files")
    ap.add_argument("--no-figure", action="store_true", help="leave docs/figures/headline.png alone")
    ap.add_argument("--print-only", action="store_true", help="print the table; write nothing")
    ap.add_argument("--compare", nargs=2, metavar=("NEW", "OLD"), help="print compare_runs(NEW, OLD) and exit")
    ap.add_argument("--engine-match", nargs="+", metavar="FILE",
                    help="RECORDS VLLM_E2E [VLLM_E2E ...]: print the stock layer of RECORDS against vLLM's own layer "
                         "in the engine files (same card), and exit")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare_runs(*args.compare))
        return 0
    if args.engine_match:
        if len(args.engine_match) < 2:
            ap.error("--engine-match takes a records file and at least one vllm_e2e file")
        print(engine_match(*args.engine_match))
        return 0
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        sources = readme_sources(f.read())
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
