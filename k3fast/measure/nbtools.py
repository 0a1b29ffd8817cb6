"""What the notebooks share: the recorded sweeps they read (chosen in one place, ``SWEEPS``), stage times beside the
byte floor of the same stages, a CPU compile of one kernel key, and the figures each notebook ends with.

Everything a notebook shows on a CPU comes from files under traces/: a record carries its GPU, driver, commit and
the copy bandwidth measured in the same run, so every floor below is the floor of that run."""
from __future__ import annotations

import gzip
import json
import os
import re
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The files the notebooks read, named in one place: traces/index.json (the latest full sweep per card, stock beside
# fast in one run per file, and the end-to-end files). A new run replaces its entry there and nowhere else.
with open(os.path.join(ROOT, "traces", "index.json")) as _f:
    INDEX = json.load(_f)
SWEEPS: dict[str, tuple[str, ...]] = {card: tuple(files) for card, files in INDEX["sweeps"].items()}
SHAPES = ("k3_rank16", "k3_rank8", "full")

# Each fusion, by the NVTX ranges (= k3ref.bytes stages) it covers. The fast path books a fused kernel under the
# range of its first stage, so a fusion is compared on the sum of its stages in both paths.
FUSIONS: dict[str, tuple[str, ...]] = {
    "in_proj": ("k3.attn_res", "k3.kda.in_proj"),
    "kda_core": ("k3.kda.core",),
    "o_proj": ("k3.o_proj", "k3.attn_res_mlp"),
    "front": ("k3.router", "k3.moe.down"),
    "experts_tail": ("k3.moe.experts", "k3.moe.shared", "k3.moe.up"),
}
STAGE_COLORS = {"k3.attn_res": "#9ecae1", "k3.kda.in_proj": "#3182bd", "k3.kda.core": "#31a354",
                "k3.o_proj": "#756bb1", "k3.attn_res_mlp": "#bcbddc", "k3.router": "#e6550d", "k3.moe.down": "#fdae6b",
                "k3.moe.experts": "#d62728", "k3.moe.shared": "#8c564b", "k3.moe.up": "#e377c2", None: "#999999"}


def config(shape: str):
    """The k3ref config a record's ``shape`` names."""
    from k3ref import k3, k3_rank
    return {"k3_rank16": k3_rank(16), "k3_rank8": k3_rank(8), "full": k3()}[shape]


def routing(rec: dict) -> str:
    return "skewed" if str(rec.get("routing", "")).startswith("skewed") else "uniform"


def sweep(card: str | None = None) -> list[dict]:
    """The records of ``SWEEPS[card]`` (every card when None), each with "card" and "source" (its file) added."""
    from .report import load_records
    out = []
    for c, files in SWEEPS.items():
        if card is None or c == card:
            for f in files:
                out += [{**r, "card": c, "source": f} for r in load_records(os.path.join(ROOT, f))]
    return out


def vllm_layer(shapes=("k3_rank16",)) -> list[dict]:
    """The KDA + MoE records of ``shapes`` whose stock is vLLM's own layer kernel for kernel (``trace --stock-ops
    vllm-layer``), matched to vLLM's in-engine layer by ``report --engine-match``: traces/index.json's
    ``vllm_layer_check_<card>`` entries ({shape: the run that checked that shape}), each record with "card" and
    "source" added. The sweeps' stock is an earlier composition of library kernels (fla's KDA among them), so a
    stage's ratio against vLLM itself comes from these records. The fusion notebooks read the TP16 rank;
    docs/findings.md has every width."""
    from .report import load_records
    out = []
    for key, per_shape in INDEX.items():
        if key.startswith("vllm_layer_check_"):
            card = key.rsplit("_", 1)[1].upper()
            for shape, f in per_shape.items():
                if shape in shapes:
                    out += [{**r, "card": card, "source": f} for r in load_records(os.path.join(ROOT, f))
                            if r["layer_kind"] == "kda_moe" and r["shape"] == shape]
    return out


def pick(recs: list[dict], **want) -> list[dict]:
    """The records whose fields equal ``want`` ("routing" compares the uniform / skewed label)."""
    return [r for r in recs if all((routing(r) if k == "routing" else r.get(k)) == v for k, v in want.items())]


def one(recs: list[dict], **want) -> dict:
    found = pick(recs, **want)
    if len(found) != 1:
        raise LookupError(f"{len(found)} records match {want}")
    return found[0]


def cells(recs: list[dict], part: str = "layer", rt: str = "uniform") -> list[tuple[str, str, int]]:
    """(card, shape, batch) of every cell measured for both stock and fast, in card / shape / batch order."""
    have = {(r["card"], r["shape"], r["batch"], r["impl"]) for r in pick(recs, part=part, routing=rt)}
    keys = {k[:3] for k in have if (*k[:3], "stock") in have and (*k[:3], "fast") in have}
    return sorted(keys, key=lambda k: (k[0], SHAPES.index(k[1]), k[2]))


def stage_bytes(shape: str, batch: int, stages, distinct_experts: int | None = None) -> int:
    """Bytes of the given k3ref.bytes stages of one decode step of a KDA + MoE layer."""
    from k3ref.bytes import layer_bytes
    st = {s.stage: s.total for s in layer_bytes(config(shape), "kda_moe", batch, distinct_experts=distinct_experts)}
    return int(sum(st[s] for s in stages))


def stage_rows(stages, recs: list[dict], rt: str = "uniform") -> list[dict]:
    """Per cell of ``recs``: GPU µs and kernels of the given NVTX stages in the stock and the fast eager step
    (part "layer"), the floor of those stages' bytes at the run's copy bandwidth, and the bandwidth each path
    achieves on those bytes."""
    from k3ref.bytes import floor_us
    rows = []
    for card, shape, batch in cells(recs, "layer", rt):
        st, fa = (one(recs, card=card, shape=shape, batch=batch, part="layer", impl=i, routing=rt)
                  for i in ("stock", "fast"))
        nb = stage_bytes(shape, batch, stages, fa["distinct_experts"])
        row = {"card": card, "shape": shape, "batch": batch, "bytes": nb,
               "floor_us": floor_us(nb, fa["copy_tbps"]), "copy_tbps": fa["copy_tbps"]}
        for name, r in (("stock", st), ("fast", fa)):
            row[f"{name}_us"] = sum(r["stages"].get(s, {}).get("gpu_us", 0.0) for s in stages)
            row[f"{name}_kernels"] = sum(r["stages"].get(s, {}).get("kernels", 0) for s in stages)
            row[f"{name}_tbps"] = nb / row[f"{name}_us"] / 1e6 if row[f"{name}_us"] else float("nan")
        rows.append(row)
    return rows


def fusion_rows(recs: list[dict], shape: str, batch: int, rt: str = "uniform") -> list[dict]:
    """stage_rows of one cell per card, one row per fusion of ``FUSIONS`` (its name in "label")."""
    rows = []
    for name, stages in FUSIONS.items():
        rows += [{**r, "label": name} for r in stage_rows(stages, recs, rt)
                 if (r["shape"], r["batch"]) == (shape, batch)]
    return sorted(rows, key=lambda r: r["card"])


def part_rows(part: str, recs: list[dict], rt: str = "uniform") -> list[dict]:
    """Per cell: the median graph-replay µs of one part ("layer", "attn", "moe") for stock and fast, their
    kernels, the part's bytes and floor, and the achieved bandwidth (bytes over the replay)."""
    rows = []
    for card, shape, batch in cells(recs, part, rt):
        st, fa = (one(recs, card=card, shape=shape, batch=batch, part=part, impl=i, routing=rt)
                  for i in ("stock", "fast"))
        rows.append({"card": card, "shape": shape, "batch": batch, "bytes": fa["bytes"], "floor_us": fa["floor_us"],
                     "copy_tbps": fa["copy_tbps"], "stock_us": st["replay_us_median"],
                     "fast_us": fa["replay_us_median"], "stock_kernels": st["kernels"], "fast_kernels": fa["kernels"],
                     "fast_tbps": fa["bytes"] / fa["replay_us_median"] / 1e6,
                     "stock_tbps": st["bytes"] / st["replay_us_median"] / 1e6, "rel_err_vs_ref": fa["rel_err_vs_ref"]})
    return rows


def show(rows: list[dict]) -> None:
    """Print stage_rows / part_rows as a table: µs, kernels, the floor, stock / fast and fast / floor."""
    print(f"{'card':5s} {'shape':10s} {'batch':>5s} {'floor µs':>9s} {'stock µs (k)':>14s} {'fast µs (k)':>13s} "
          f"{'stock/fast':>10s} {'fast/floor':>10s}")
    for r in rows:
        print(f"{r['card']:5s} {r['shape']:10s} {r['batch']:5d} {r['floor_us']:9.1f} "
              f"{r['stock_us']:9.1f} ({r['stock_kernels']:2g}) {r['fast_us']:8.1f} ({r['fast_kernels']:2g}) "
              f"{r['stock_us'] / r['fast_us']:9.2f}x {r['fast_us'] / r['floor_us']:9.2f}x")


def floors(stages, batches=(1,)) -> None:
    """Print the bytes of the given stages per shape and batch, and their floor at each card's copy bandwidth (as
    measured in its sweep; distinct experts at their expected number under uniform routing)."""
    from k3ref.bytes import expected_distinct_experts, floor_us
    bw = {c: min(r["copy_tbps"] for r in sweep(c)) for c in SWEEPS}
    print(f"{'shape':10s} {'batch':>5s} {'MB':>9s}" + "".join(f"  {c + ' µs':>9s}" for c in bw)
          + "   (" + ", ".join(f"{c} copy {t:.2f} TB/s" for c, t in bw.items()) + ")")
    for shape in SHAPES:
        for b in batches:
            nb = stage_bytes(shape, b, stages, round(expected_distinct_experts(config(shape), b)))
            print(f"{shape:10s} {b:5d} {nb / 1e6:9.2f}" + "".join(f"  {floor_us(nb, t):9.2f}" for t in bw.values()))


def compile_on_cpu(warmup_fn, *args, **kw) -> list[tuple]:
    """Compile the kernel keys ``warmup_fn(*args, **kw)`` needs for sm_90a (no GPU needed) and print each key with
    its compile time. Returns [(key, seconds)], empty when the CuTe DSL is not installed."""
    from ..kernels._dsl import COMPILE_LOG, dsl_available
    if not dsl_available():
        print("CuTe DSL not installed (pip install -e '.[gpu]'): compile skipped")
        return []
    n0, t = len(COMPILE_LOG), time.perf_counter()
    warmup_fn(*args, **kw)
    new = COMPILE_LOG[n0:]
    print(f"{len(new)} kernel(s) compiled for sm_90a in {time.perf_counter() - t:.1f} s")
    for key, s in new:
        print(f"  {s:5.1f} s  {key}")
    return list(new)


def time_live(fn, replays: int = 50) -> float:
    """Median µs of a CUDA-graph replay of ``fn`` with the L2 flushed before each replay (GPU only)."""
    from .trace import _pct, capture, time_replays
    return _pct(time_replays(capture(fn), lambda: None, replays), 0.5)


# ------------------------------------------------------------------------------------------------ timelines

_K3_MODULES = ("rms_gemv_ring", "rms_gemv", "gemm_wgmma_splitk", "kda_conv_gate_step", "oproj_attnres",
               "router_down_topk", "moe_mxfp4_experts", "moe_tail", "mla_latent_decode", "mla_uv_gate")
KERNEL_COLORS = {"rms_gemv_ring": "#3182bd", "rms_gemv": "#9ecae1", "gemm_wgmma_splitk": "#08519c",
                 "kda_conv_gate_step": "#31a354", "oproj_attnres": "#756bb1", "router_down_topk": "#e6550d",
                 "moe_mxfp4_experts": "#d62728", "moe_tail": "#e377c2", "mla_latent_decode": "#8c564b",
                 "mla_uv_gate": "#bcbd22"}


def short_name(kernel: str) -> str:
    """A readable kernel name: the k3fast module for our kernels, the function name for library kernels."""
    if "k3fast" in kernel:
        return next((m for m in _K3_MODULES if m in kernel), "k3fast")
    name = re.sub(r"^void\s+|\(anonymous namespace\)::", "", kernel).split("<")[0].split("(")[0]
    return name.split("::")[-1][:32]


def perfetto_path(rec: dict) -> str | None:
    """The Perfetto trace (absolute path) of a record, beside its records file, or None."""
    if not rec.get("perfetto"):
        return None
    p = os.path.join(ROOT, os.path.dirname(rec["source"]), rec["perfetto"])
    return p if os.path.exists(p) else None


def perfetto_events(rec: dict) -> list[dict]:
    path = perfetto_path(rec)
    if path is None:
        raise FileNotFoundError(f"no Perfetto trace for {rec['impl']} {rec['shape']} b{rec['batch']}")
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def perfetto_kernels(rec: dict) -> list[dict]:
    """The kernels of a record's Perfetto trace (one eager step) in start order: name, start and duration in µs
    from the first kernel's start, and the NVTX stage (the GPU-side k3.* range around it)."""
    ev = perfetto_events(rec)
    ranges = [e for e in ev if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("k3.")]
    kern = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    t0 = kern[0]["ts"]
    out = []
    for k in kern:
        inner = [r for r in ranges if r["ts"] <= k["ts"] <= r["ts"] + r.get("dur", 0)]
        stage = min(inner, key=lambda r: r.get("dur", 0))["name"] if inner else None
        out.append({"name": k["name"], "start": k["ts"] - t0, "dur": k.get("dur", 0.0), "stage": stage})
    return out


def replay_kernels(rec: dict) -> list[dict]:
    """One recorded graph replay (the record's replay_timeline: cold L2, the median span of three), each kernel with
    the NVTX stage its counterpart in the Perfetto trace ran under (the same kernels in the same order)."""
    tl = rec["replay_timeline"]["kernels"]
    try:
        eager = perfetto_kernels(rec)
    except FileNotFoundError:
        eager = []
    stages = [k["stage"] for k in eager] if len(eager) == len(tl) else [None] * len(tl)
    return [{"name": n, "start": s, "dur": d, "stage": st} for (n, s, d), st in zip(tl, stages)]


def replay_rows(recs: list[dict], card: str, shape: str, part: str, batches, impl: str = "fast",
                rt: str = "uniform") -> list[tuple[str, list[dict]]]:
    """(label, replay_kernels) of one part per batch, for plot_timelines."""
    return [(f"{impl} b{b}", replay_kernels(one(recs, card=card, shape=shape, batch=b, part=part, impl=impl,
                                                routing=rt))) for b in batches]


# ------------------------------------------------------------------------------------------------ figures

def pyplot():
    """matplotlib.pyplot, with the Agg backend outside a Jupyter kernel (where figures display inline)."""
    import matplotlib
    try:
        from IPython import get_ipython
        interactive = get_ipython() is not None
    except ImportError:
        interactive = False
    if not interactive:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _by_card(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["card"], []).append(r)
    return out


def plot_stage_bars(rows: list[dict], title: str):
    """Stock and fast µs per cell (stage_rows or part_rows), one panel per card (top to bottom), with each cell's
    floor as a black bar: what the bytes allow at the copy bandwidth measured in that run."""
    import numpy as np
    plt = pyplot()
    groups = _by_card(rows)
    width = max(7.0, 0.6 * max(len(rs) for rs in groups.values()))
    fig, axes = plt.subplots(len(groups), 1, figsize=(width, 3.3 * len(groups)), squeeze=False)
    for ax, (card, rs) in zip(axes[:, 0], groups.items()):
        x = np.arange(len(rs))
        ax.bar(x - 0.2, [r["stock_us"] for r in rs], 0.4, label="stock", color="#bbbbbb")
        ax.bar(x + 0.2, [r["fast_us"] for r in rs], 0.4, label="fast", color="#3182bd")
        ax.hlines([r["floor_us"] for r in rs], x - 0.42, x + 0.42, colors="k", label="byte floor")
        ax.set_xticks(x, [r.get("label") or f"{r['shape'].replace('k3_', '')}\nb{r['batch']}" for r in rs],
                      fontsize=8)
        ax.set(yscale="log", ylabel="µs", title=f"{title}, {card}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_over_batch(rows: list[dict], title: str):
    """Two rows of panels per card, over batch: the bandwidth stock and fast achieve (bytes over time; dotted: the
    copy bandwidth of the run) and stock / fast (part_rows or stage_rows)."""
    plt = pyplot()
    groups = _by_card(rows)
    fig, axes = plt.subplots(2, len(groups), figsize=(6 * len(groups), 6.5), squeeze=False, sharex="col")
    colors = {"k3_rank16": "#3182bd", "k3_rank8": "#31a354", "full": "#e6550d"}
    for j, (card, rs) in enumerate(groups.items()):
        for shape in SHAPES:
            pts = sorted((r for r in rs if r["shape"] == shape), key=lambda r: r["batch"])
            if not pts:
                continue
            b = [r["batch"] for r in pts]
            axes[0, j].plot(b, [r["fast_tbps"] for r in pts], "o-", color=colors[shape], label=f"{shape} fast")
            axes[0, j].plot(b, [r["stock_tbps"] for r in pts], "s--", color=colors[shape], alpha=0.5,
                            label=f"{shape} stock")
            axes[1, j].plot(b, [r["stock_us"] / r["fast_us"] for r in pts], "o-", color=colors[shape], label=shape)
        axes[0, j].axhline(min(r["copy_tbps"] for r in rs), color="k", ls=":", label="copy")
        axes[0, j].set(xscale="log", ylabel="TB/s (bytes / time)", title=f"{title}, {card}", ylim=(0, None))
        axes[1, j].axhline(1.0, color="k", lw=0.8)
        axes[1, j].set(xscale="log", xlabel="batch", ylabel="stock / fast")
        batches = sorted({r["batch"] for r in rs})
        axes[1, j].set_xticks(batches, [str(b) for b in batches])
        axes[1, j].minorticks_off()
        axes[0, j].legend(fontsize=7, ncol=2)
        axes[1, j].legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_timelines(rows: list[tuple[str, list[dict]]], title: str, ax=None):
    """Kernels as bars on one time axis, one row per (label, kernels) from top to bottom, coloured by NVTX stage
    where the kernels carry one, else by k3fast module (library kernels in grey). A kernel that starts before the previous one ends (PDL) is drawn in the row's lower lane."""
    plt = pyplot()
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(12, 1.1 + 0.7 * len(rows)))
    seen = set()
    for i, (label, kern) in enumerate(rows):
        y, end, lane = len(rows) - 1 - i, float("-inf"), 0
        for k in kern:
            lane = 1 - lane if k["start"] < end else 0
            end = max(end, k["start"] + k["dur"]) if lane else k["start"] + k["dur"]
            key = k["stage"] or short_name(k["name"])
            color = STAGE_COLORS[key] if key in STAGE_COLORS else KERNEL_COLORS.get(key, "#cccccc")
            ax.barh(y + (0.17 if lane == 0 else -0.17), k["dur"], left=k["start"], height=0.32, color=color,
                    edgecolor="k", lw=0.3, label=None if key in seen or color == "#cccccc" else key)
            seen.add(key)
    ax.set_yticks(range(len(rows)), [label for label, _ in reversed(rows)])
    ax.set(xlabel="µs from the first kernel's start", title=title)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    if fig is not None:
        fig.tight_layout()
    return fig if fig is not None else ax.figure
