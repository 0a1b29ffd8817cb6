"""Per-layer decode traces: kernel count, kernel time, graph-replay time, bytes and the byte floor.

    python -m k3fast.measure.trace --preset kda-sweep            # a named sweep (--list-presets shows them all)
    python -m k3fast.measure.trace --kinds mla_moe --shapes full --batches 8 --impls stock fast
    python -m k3fast.measure.trace --cell kda_moe,k3_rank16,64,0,stock+fast      # exactly these cells
    python -m k3fast.measure.trace prune [--apply]               # what traces/ holds that nothing cites

Records go to traces/<card>/records-<tag>.json (the card from the GPU's name: traces/h200, traces/h100), the batch-1
layer traces to perfetto-<tag>/ beside it. For each (layer kind, shape, batch, context, impl, part) one record:

* the part (``layer``, ``attn``: layer input -> MLP input, ``moe``: MLP input -> output) is captured
  as its own CUDA graph;
* ``replay_us_*``: each replay timed alone with CUDA events (median, p10, p90 of many), the L2
  flushed by reading a 256 MB buffer before every replay (outside the timed events) and the step's
  mutated inputs restored, so weights and state come from HBM every time. A read, not a write: a
  write flush leaves the L2 full of dirty lines whose write-back is then charged to the timed replay
  (up to ~50 MB of extra HBM traffic, ~12 µs on an H200);
* ``kernels``, ``kernel_us_sum``, ``kernel_names``, ``replay_timeline``: torch.profiler (CUPTI) over a few
  replays, each after the same flush and reset as the timed ones (``replay_timeline["l2"]`` says so);
* ``stages``: the same step run eagerly inside the k3fast.nvtx ranges, kernels attributed to the
  innermost range (kernel count and GPU µs per stage);
* ``bytes`` and ``floor_us`` from k3ref.bytes, at ``copy_tbps`` measured by a device-to-device copy
  in the same run; ``rel_err_vs_ref``: the impl's output against k3ref on the same inputs.

On one GPU a per-rank shape computes exactly what one tensor-parallel rank computes between its
collectives; the collectives themselves are not timed (``collectives: "not timed"``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import glob
import gzip
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch

from k3ref import preset
from k3ref.compare import rel_rmse
from k3ref.bytes import floor_us, layer_bytes, part_bytes
from k3ref.weights import random_layer

SCHEMA_FIELDS = ("gpu", "driver", "torch", "cutlass", "commit", "date", "layer_kind", "shape", "batch", "impl", "part",
                 "kernels", "kernel_us_sum", "replay_us_median", "replay_us_p10", "replay_us_p90", "bytes", "floor_us",
                 "copy_tbps")
KIND_LAYER = {"kda_moe": 1, "mla_moe": 3, "kda_dense": 0}
PARTS = ("layer", "attn", "moe")


# ------------------------------------------------------------------------------------------------ metadata

def environment() -> dict:
    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            return ""
    try:
        import cutlass
        cutlass_v = cutlass.__version__
    except Exception:
        cutlass_v = None
    try:
        import tvm_ffi
        tvm_v = tvm_ffi.__version__
    except Exception:
        tvm_v = None
    here = os.path.dirname(os.path.abspath(__file__))
    # K3_COMMIT first: the device machine's copy of the tree is not a faithful git checkout
    commit = os.environ.get("K3_COMMIT") or run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"]) or "unknown"
    dirty = not os.environ.get("K3_COMMIT") and bool(run(["git", "-C", here, "status", "--porcelain",
                                                          "--untracked-files=no"]))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    from .provenance import tree_digest
    try:
        digest = tree_digest()      # what actually ran: `python -m k3fast.measure.provenance FILE` matches it to commits
    except OSError:
        digest = None
    return {"gpu": gpu, "driver": run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) or None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "cutlass": cutlass_v, "tvm_ffi": tvm_v,
            "commit": commit + ("-dirty" if dirty else ""), "source_digest": digest,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "sm_count": torch.cuda.get_device_properties(0).multi_processor_count if gpu else None}


# ------------------------------------------------------------------------------------------------ timing

def copy_bandwidth_tbps(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy, counting bytes read plus written; median of ``reps``."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    times.sort()
    del a, b
    return nbytes / times[len(times) // 2] / 1e12


def capture(fn: Callable[[], None], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Warm up (Triton autotuning, torch.compile, CuTe compile) on a side stream, then capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    # A capture allocates from a private pool and may not free cached blocks (cudaFree is illegal while capturing):
    # with the eager runs' blocks still cached, a large graph (torch.compile's MoE at full width or batch 64) ran
    # out of memory inside the capture, which surfaces as cudaErrorStreamCaptureInvalidated.
    gc.collect()
    torch.cuda.empty_cache()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


_FLUSH: torch.Tensor | None = None
_FLUSH_OUT: torch.Tensor | None = None
L2_POLICY = "flushed (256 MB read) before each replay"


def flush_l2(device: str = "cuda", nbytes: int = 256 << 20) -> None:
    """Evict the L2 by reading 256 MB (5x its size); leaves clean lines only (see the module docstring).
    ``device``/``nbytes`` exist so the CPU tests can run the same code."""
    global _FLUSH, _FLUSH_OUT
    if _FLUSH is None or _FLUSH.device.type != torch.device(device).type or _FLUSH.numel() * 4 != nbytes:
        _FLUSH = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        _FLUSH_OUT = torch.empty(1, dtype=torch.float32, device=device)
    torch.sum(_FLUSH.view(1, -1), dim=1, out=_FLUSH_OUT)


L2_WARM = "not flushed: the previous replay's weights, inputs and code stay in L2 (a diagnostic, not a speed claim)"


def time_replays(g: torch.cuda.CUDAGraph, reset: Callable[[], None], n: int, *, flush: bool = True) -> list[float]:
    """µs of each of ``n`` replays (CUDA events around the replay only), each after an L2 flush (unless ``flush`` is
    False: L2_WARM) and an input reset, neither timed."""
    flush_l2()                                # allocates the flush buffer outside the timed loop
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)             # keep the GPU behind the CPU so no launch gap is timed
    for i in range(n):
        if flush:
            flush_l2()
        reset()
        starts[i].record()
        g.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def start_run(out: str, tag: str | None) -> tuple[dict, float, str]:
    """The environment, the copy bandwidth measured now, and the run's tag (default: date-commit); prints them
    and creates ``out``. Every tool that writes records under traces/ starts with this."""
    env = environment()
    bw = copy_bandwidth_tbps()
    print(f"{env['gpu']} driver {env['driver']} torch {env['torch']} cutlass {env['cutlass']} commit {env['commit']}: "
          f"copy {bw:.3f} TB/s", flush=True)
    os.makedirs(out, exist_ok=True)
    return env, bw, tag or f"{env['date'][:10]}-{env['commit']}"


def card_folder(gpu_name: str | None = None) -> str:
    """traces/<card>, where a run on this GPU keeps its records: the model in the GPU's name, lower case
    ("NVIDIA H100 80GB HBM3" -> traces/h100, "NVIDIA H200" -> traces/h200)."""
    name = gpu_name if gpu_name is not None else (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
    words = [w for w in re.split(r"[\s_-]+", name) if w and w.upper() != "NVIDIA"]
    model = next((w for w in words if re.fullmatch(r"[A-Za-z]{1,3}\d{2,4}[A-Za-z]?", w)), None)
    slug = (model or "-".join(words) or "cpu").lower()
    return os.path.join("traces", re.sub(r"[^a-z0-9-]", "", slug) or "gpu")


def parse_run(ap, argv, prog: str):
    """--out / --tag added to ``ap``, the arguments parsed, then start_run: (args, env, bw, tag), or None after a
    message when there is no CUDA GPU. The command-line tools that write records under traces/<card> start with it."""
    ap.add_argument("--out", default=None, help="folder for the records (default: traces/<card>, e.g. traces/h200)")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{prog} needs a CUDA GPU", file=sys.stderr)
        return None
    args.out = args.out or card_folder()
    return (args, *start_run(args.out, args.tag))


def write_run(path: str, env: dict, bw: float, records: list[dict]) -> None:
    """One records file: environment, copy bandwidth, the exact command line, the records (rewritten after every
    cell, so a time-out keeps what was measured)."""
    with open(path, "w") as f:
        json.dump({"environment": env, "copy_tbps": bw, "command": " ".join(sys.argv), "records": records}, f,
                  indent=1)


def replay_stats(times: list[float], prefix: str = "") -> dict:
    """{prefix}us_median / us_p10 / us_p90 of per-replay µs."""
    return {f"{prefix}us_{k}": round(_pct(times, q), 3) for k, q in (("median", 0.5), ("p10", 0.1), ("p90", 0.9))}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


# ------------------------------------------------------------------------------------------------ profiling

def _profile(fn: Callable[[], None], path: str | None = None) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        tmp = f.name
    prof.export_chrome_trace(tmp)
    with open(tmp) as f:
        events = json.load(f)["traceEvents"]
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "rb") as src, gzip.open(path, "wb") as dst:
            dst.write(src.read())
    os.unlink(tmp)
    return events


def summarize_graph_events(events: list[dict], replays: int) -> dict:
    """Kernel count and GPU µs per replay from a CUPTI trace of ``replays`` graph replays."""
    kern = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    names: dict[str, float] = {}
    for e in kern:
        names[e["name"]] = names.get(e["name"], 0.0) + e.get("dur", 0.0) / replays
    return {"kernels": len(kern) / replays, "kernel_us_sum": sum(e.get("dur", 0.0) for e in kern) / replays,
            "copies": len(copies) / replays, "kernel_names": {k[:160]: round(v, 3) for k, v in
                                                              sorted(names.items(), key=lambda kv: -kv[1])}}


def graph_events(events: list[dict]) -> list[dict]:
    """The GPU events (kernels, copies) of a CUPTI trace that graph replays launched: those whose correlation id is a
    cudaGraphLaunch's. What the host launched eagerly between replays (the L2 flush, the input reset) is left out,
    so replays can be profiled under the same conditions as they are timed."""
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "GraphLaunch" in e.get("name", "")
                and "correlation" in e.get("args", {})}
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
            and e.get("args", {}).get("correlation") in launches]


def profile_replays(g: "torch.cuda.CUDAGraph", reset: Callable[[], None], replays: int = 3) -> tuple[list[dict], str]:
    """CUPTI events of ``replays`` graph replays, each after an L2 flush and an input reset as in time_replays (so
    the kernel durations in replay_timeline are cold-L2 ones, like the timed replays; back-to-back replays keep
    part of a <= 50 MB step's weights in L2, e.g. ~6 µs of the rank16 attention half at b1 on an H200). Returns (the graph's events, the L2 condition). Falls back to back-to-back
    replays (L2_WARM) when the trace carries no cudaGraphLaunch correlation to tell the replays' kernels apart."""
    def run():
        for _ in range(replays):
            flush_l2()
            reset()
            g.replay()
    ev = graph_events(_profile(run))
    if ev:
        return ev, L2_POLICY
    return [e for e in _profile(lambda: [g.replay() for _ in range(replays)])
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], L2_WARM


def replay_timeline(events: list[dict], replays: int) -> dict | None:
    """Where the time of a graph replay goes, from the same CUPTI trace as summarize_graph_events: for the replay
    whose span (first kernel start to last kernel end) is the median, each kernel's start offset and duration (µs),
    the span, the time some kernel was running (``busy_us``, overlaps under PDL counted once) and the rest
    (``idle_us``: launch and dependency gaps inside the replay). A replay's wall time minus its span is the graph
    launch itself. None when the kernels do not split evenly into ``replays``."""
    kern = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kern or len(kern) % replays:
        return None
    n = len(kern) // replays
    groups = [kern[i * n:(i + 1) * n] for i in range(replays)]

    def span(g):
        return max(e["ts"] + e.get("dur", 0.0) for e in g) - g[0]["ts"]
    g = sorted(groups, key=span)[len(groups) // 2]
    t0, busy, cur_s, cur_e = g[0]["ts"], 0.0, None, None
    for e in g:                      # union of [ts, ts + dur) in start order
        s, t = e["ts"], e["ts"] + e.get("dur", 0.0)
        if cur_e is None or s > cur_e:
            busy += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    busy += cur_e - cur_s
    sp = span(g)
    return {"span_us": round(sp, 3), "busy_us": round(busy, 3), "idle_us": round(sp - busy, 3),
            "kernels": [[e["name"][:80], round(e["ts"] - t0, 3), round(e.get("dur", 0.0), 3)] for e in g]}


def summarize_stages(events: list[dict]) -> dict:
    """Attribute each kernel of an eager run to the innermost k3.* range around its launch."""
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("k3.")]
    launches = {}
    for e in events:
        # driver-API launches (Triton, CuTe DSL, cuBLASLt's nvjet kernels) carry the correlation too
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e["ts"]
    out: dict[str, dict] = {}
    for k in (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")):
        ts = launches.get(k.get("args", {}).get("correlation"))
        owner = "unattributed"
        if ts is not None:
            inner = [r for r in ranges if r["ts"] <= ts <= r["ts"] + r.get("dur", 0)]
            if inner:
                owner = min(inner, key=lambda r: r.get("dur", 0))["name"]
        d = out.setdefault(owner, {"kernels": 0, "copies": 0, "gpu_us": 0.0})
        d["kernels" if k["cat"] == "kernel" else "copies"] += 1
        d["gpu_us"] += k.get("dur", 0.0)
    return {k: {**v, "gpu_us": round(v["gpu_us"], 3)} for k, v in out.items()}


# ------------------------------------------------------------------------------------------------ sweep

ROUTINGS = {"random": "router on random inputs",
            "skewed": "skewed: correction bias +8 on a hot set of 24 experts (every token picks 16 of them)"}


def skew_routing(w, n_hot: int = 24, seed: int = 3) -> None:
    """Make the router pick from a hot set: a selection-only bias of +8 (sigmoid scores lie in (0, 1)) on n_hot
    experts, so every token's top-16 lies in that set while the combine weights still come from the scores."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hot = torch.randperm(w.mlp.e_score_correction_bias.shape[0], generator=g)[:n_hot]
    w.mlp.e_score_correction_bias[hot.to(w.mlp.e_score_correction_bias.device)] += 8.0


def run_cell(kind: str, shape: str, batch: int, impls: list[str], *, context: int, replays: int, env: dict,
             copy_tbps: float, perfetto_dir: str | None, log=print, stock_ops: str = "vllm-layer",
             routing: str = "random", engine: list[dict] = ()) -> list[dict]:
    """All implementations and parts of one (kind, shape, batch, context) cell; returns records. ``engine``: vLLM's
    in-engine layer figures (engine_records) that the stock records are matched against."""
    cfg = preset(shape)
    layer = KIND_LAYER[kind]
    w = random_layer(cfg, layer, seed=1, device="cuda")
    if routing == "skewed" and kind.endswith("moe"):
        skew_routing(w)
    records = []
    ref_out = {}
    if "ref" not in impls:
        # an untimed eager reference run, so every timed impl still carries its error against k3ref
        from .impls import make_impl, make_io
        io = make_io(cfg, layer, batch, context=context, seed=7)
        make_impl("ref", cfg, w).layer(io)
        torch.cuda.synchronize()
        ref_out.update({"attn": io.x_mlp.clone(), "layer": io.out.clone()})
        del io
    for impl_name in impls:
        try:
            records += _run_impl(impl_name, kind, shape, cfg, layer, w, batch, context, replays, env, copy_tbps,
                                 perfetto_dir, ref_out, log, stock_ops=stock_ops, routing=routing, engine=engine)
        except Exception as ex:                     # one broken implementation must not stop the sweep
            import traceback
            log(f"  {impl_name}: FAILED {type(ex).__name__}: {str(ex)[:300]}\n" + traceback.format_exc()[-1500:])
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return records


def reset_stock_autotuners(prefixes=("fla.", "vllm.")) -> int:
    """Forget the configs Triton's autotuners chose in the stock path's libraries (fla, vLLM), so that the next call
    tunes again at its own shapes. Returns how many autotuners were reset (0 without Triton).

    Why: fla's causal_conv1d_update is autotuned on (D, W), not on the batch, so the config it keeps is the one the
    first batch of a process chose. With b1 first, the stock conv step took 10.6 / 19.3 / 72.8 µs at b8 / b16 / b64
    on an H200 (about 2 µs when b64 ran first). Resetting before every stock cell lets each batch tune for itself:
    the best the stock path can do there, and the same whatever the order of the cells.

    Two traps (a reset that missed them left rank8 b64's conv step at 23.5 µs): (1) fla stacks
    ``@triton.heuristics`` over its autotuner, so the module attribute is a Heuristics whose ``.fn`` is the
    autotuner; the chain of ``.fn`` is walked. (2) fla 0.6 passes ``cache_results=True`` (FLA_CACHE_RESULTS
    defaults to 1), so an emptied in-memory cache is refilled from Triton's on-disk autotune cache, whose key omits
    the batch just the same; the disk cache is switched off on every autotuner reset."""
    import sys
    try:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import KernelInterface
    except ImportError:
        return 0
    seen = set()
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(prefixes):
            continue
        for obj in list(vars(mod).values()):
            # only Triton's own wrappers are unwrapped: a getattr on anything else may run a lazy import (vLLM's lazy
            # modules import runai_model_streamer, which a lean install lacks, and every stock cell would fail)
            while isinstance(obj, KernelInterface):
                if isinstance(obj, Autotuner) and isinstance(getattr(obj, "cache", None), dict):
                    if id(obj) not in seen:
                        seen.add(id(obj))
                        obj.cache.clear()
                        if getattr(obj, "cache_results", False):
                            obj.cache_results = False
                    break
                obj = getattr(obj, "fn", None)
    return len(seen)


def engine_records(paths: list[str] | None = None) -> list[dict]:
    """vLLM's in-engine per-layer figures that stock records are matched against: the vllm_e2e records of ``paths``
    (runs made on this machine, e.g. scripts/device_vllm_e2e.sh layers-<shape> before the sweep), else of the file
    traces/index.json names (none when the file or the key is absent). A record keeps the file it came from."""
    if paths is None:
        try:
            with open(os.path.join(ROOT, "traces", "index.json")) as f:
                paths = [os.path.join(ROOT, json.load(f)["vllm_e2e"])]
        except (OSError, TypeError, KeyError, ValueError):
            return []
    out = []
    for path in paths:
        with open(path) as f:
            out += [{**r, "source": os.path.basename(path)} for r in json.load(f)["records"]]
    return out


def _run_impl(impl_name, kind, shape, cfg, layer, w, batch, context, replays, env, copy_tbps, perfetto_dir, ref_out, log,
              stock_ops="vllm-layer", routing="random", engine=()):
    from ..layer_io import kda_state_indices, mla_step
    from .impls import make_impl, make_io
    from .report import engine_layer_figure
    records = []
    t0 = time.time()
    autotune_reset = None
    if impl_name == "stock":
        impl = make_impl(impl_name, cfg, w, max_batch=max(batch, 1), ops=stock_ops)
        # the eager call below tunes at this cell's batch, before any capture
        autotune_reset = reset_stock_autotuners()
    elif impl_name.startswith("fast"):
        impl = make_impl(impl_name, cfg, w, max_batch=max(batch, 1))
    else:
        impl = make_impl(impl_name, cfg, w)
    # correctness on identical fresh inputs: each impl's eager outputs vs the reference's
    io = make_io(cfg, layer, batch, context=context, seed=7)
    impl.layer(io)
    torch.cuda.synchronize()
    outs = {"attn": io.x_mlp.clone(), "layer": io.out.clone()}
    if impl_name == "ref" and not ref_out:
        ref_out.update(outs)
    err = {p: (rel_rmse(outs[p], ref_out[p]) if ref_out else None) for p in outs}
    # the MoE half on the reference's own MLP input: isolates the MoE arithmetic from routing flips
    # that a 1-ulp difference in x_mlp can cause between near-tied router scores
    if ref_out:
        io.x_mlp.copy_(ref_out["attn"])
        impl.moe(io)
        torch.cuda.synchronize()
        err["moe_same_input"] = rel_rmse(io.out, ref_out["layer"])
    # distinct experts actually read by this step's routing (for the bytes model)
    distinct = None
    if kind.endswith("moe"):
        from k3ref.moe import route
        from k3ref import Precision
        ids, _ = route(io.x_mlp, w.mlp, cfg, Precision.model())
        distinct = int(ids.unique().numel())
    stages_bytes = layer_bytes(cfg, kind, batch, context=context, layer=layer, distinct_experts=distinct)
    for part in PARTS:
        io = make_io(cfg, layer, batch, context=context, seed=11)
        # the step's metadata, built once per step outside the layers as vLLM's scheduler and attention builder do;
        # the layers that read it (vLLM's own KDA and FA3 paths, FusedMLA) time only their own work
        if kind == "mla_moe":
            io.mla_step = mla_step(io.state, io.slots)
        else:
            io.state_indices = kda_state_indices(io.slots)
        if part == "moe":
            impl.attn(io)                        # a realistic MLP input for the moe part
            torch.cuda.synchronize()
        fn = {"layer": lambda: impl.layer(io), "attn": lambda: impl.attn(io), "moe": lambda: impl.moe(io)}[part]
        g = capture(fn)
        times = time_replays(g, io.reset, replays)
        ev, timeline_l2 = profile_replays(g, io.reset, 3)
        gsum = summarize_graph_events(ev, 3)
        timeline = replay_timeline(ev, 3)
        if timeline is not None:
            timeline["l2"] = timeline_l2
        io.reset()
        trace_path = None
        if perfetto_dir and batch == 1 and part == "layer":
            sk = "_skewed" if routing == "skewed" else ""
            trace_path = os.path.join(perfetto_dir, f"{kind}_{shape}_b{batch}{sk}_{impl_name}.json.gz")
        st_ev = _profile(fn, trace_path)
        io.reset()
        nbytes = part_bytes(stages_bytes, part)
        rec = {**{k: env[k] for k in ("gpu", "driver", "torch", "cutlass", "commit", "date")},
               "cuda": env.get("cuda"), "tvm_ffi": env.get("tvm_ffi"),
               "layer_kind": kind, "shape": shape, "batch": batch, "context": context if kind == "mla_moe" else None,
               "impl": impl_name, "part": part, "kernels": gsum["kernels"], "kernel_us_sum": round(gsum["kernel_us_sum"], 3),
               "copies": gsum["copies"],
               "replay_us_median": round(_pct(times, 0.5), 3), "replay_us_p10": round(_pct(times, 0.1), 3),
               "replay_us_p90": round(_pct(times, 0.9), 3), "replays": len(times),
               "bytes": int(nbytes), "floor_us": round(floor_us(nbytes, copy_tbps), 3), "copy_tbps": round(copy_tbps, 4),
               "distinct_experts": distinct, "routing": ROUTINGS[routing],
               "rel_err_vs_ref": err.get("attn" if part == "attn" else "layer"),
               "rel_err_moe_same_input": err.get("moe_same_input") if part != "attn" else None,
               "collectives": "not timed" if cfg.tp > 1 else "none (TP1)",
               "l2": L2_POLICY, "kernel_names": gsum["kernel_names"],
               # the step's metadata (KDA state indices in vLLM's form, MLA paging) is built outside the layer
               "step_metadata": "once per step, outside the layer's graph",
               "stages": summarize_stages(st_ev),
               "replay_timeline": timeline,
               "perfetto": os.path.join(os.path.basename(perfetto_dir), os.path.basename(trace_path)) if trace_path else None,
               "config": cfg.describe()}
        if impl_name.startswith("fast"):
            rec["fast_variant"] = getattr(impl, "variant", None)      # e.g. "serial, experts v3"
        if impl_name == "stock":
            rec["stock_variant"] = getattr(impl, "variant", None)     # "vllm-layer" | "vllm-ops" | "torch-glue"
            rec["stock_autotune"] = f"Triton autotuners reset before the cell ({autotune_reset})"
            if getattr(impl, "mla_core_variant", None):
                rec["stock_mla_core"] = impl.mla_core_variant
            if getattr(impl, "ops_fallback", None):
                rec["stock_ops_fallback"] = impl.ops_fallback
            if part == "layer":
                # vLLM's own layer in an engine on this card, same kind / shape / batch (engine_records): the stock
                # layer's summed kernel time should be within 5 % of it
                eng = engine_layer_figure(rec, engine)
                rec["vllm_layer_kernel_us"] = eng["kernel_us"] if eng else None
                rec["vllm_layer_kernels"] = eng["kernels"] if eng else None
                rec["vllm_layer_source"] = eng["source"] if eng else None
        records.append(rec)
        log(f"  {impl_name:9s} {part:5s} kernels {rec['kernels']:6.1f}  replay {rec['replay_us_median']:9.1f} us  "
            f"floor {rec['floor_us']:7.1f} us  err {rec['rel_err_vs_ref']}")
        del g
    variant = f" [{getattr(impl, 'variant', '?')}]" if impl_name == "stock" else ""
    log(f"  {impl_name}{variant} done in {time.time() - t0:.0f} s")
    return records


SHAPES = ("k3_rank16", "k3_rank8", "full")


def parse_cell(spec: str) -> tuple[str, str, int, int, list[str]]:
    """``KIND,SHAPE,BATCH,CONTEXT,IMPL[+IMPL...]`` (one sweep cell with its implementations, e.g.
    ``mla_moe,full,64,8192,ref+compiled``) -> (kind, shape, batch, context, impls). KDA cells take context 0."""
    parts = spec.split(",")
    if len(parts) != 5:
        raise argparse.ArgumentTypeError(f"--cell expects KIND,SHAPE,BATCH,CONTEXT,IMPL[+IMPL...], got {spec!r}")
    kind, shape, batch, ctx, impls = parts
    if kind not in ("kda_moe", "mla_moe"):
        raise argparse.ArgumentTypeError(f"--cell kind must be kda_moe or mla_moe, got {kind!r}")
    if shape not in SHAPES:
        raise argparse.ArgumentTypeError(f"--cell shape must be k3_rank16, k3_rank8 or full, got {shape!r}")
    try:
        b, c = int(batch), int(ctx)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cell batch and context must be integers, got {batch!r}, {ctx!r}") from None
    if b < 1 or c < 0 or (kind == "kda_moe" and c != 0) or (kind == "mla_moe" and c < 1):
        raise argparse.ArgumentTypeError(f"--cell {spec!r}: batch >= 1; context 0 for kda_moe, >= 1 for mla_moe")
    return kind, shape, b, c, [i for i in impls.split("+") if i]


# ------------------------------------------------------------------------------------------------ presets

CONTENDERS = "contenders"       # in Preset.impls: every live fast contender that k3fast.measure.impls registers


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named sweep: the cells kinds x shapes x batches (x contexts for MLA layers), in that order, each cell running
    the same implementations. Any field can be overridden on the command line (--shapes, --batches, ...)."""
    about: str
    kinds: tuple[str, ...] = ("kda_moe",)
    shapes: tuple[str, ...] = SHAPES
    batches: tuple[int, ...] = (1, 8, 64)
    contexts: tuple[int, ...] = (1024, 8192)
    impls: tuple[str, ...] = ("stock", "fast")
    routing: str = "random"
    replays: int = 50

    def cells(self, contenders: list[str] | None = None) -> list[tuple[str, str, int, int, list[str]]]:
        """(kind, shape, batch, context, impls) per cell, as --cell gives them; CONTENDERS expands to
        ``contenders`` (default: the registry's live ones)."""
        impls = []
        for name in self.impls:
            if name != CONTENDERS:
                impls.append(name)
                continue
            if contenders is None:
                from .impls import impl_names
                contenders = [n for n in impl_names() if n.startswith("fast-")]
            impls += [n for n in contenders if n not in impls]
        return [(k, s, b, c, [i for i in impls if _differs_for(i, k)]) for k in self.kinds for s in self.shapes
                for b in self.batches for c in (self.contexts if k == "mla_moe" else (0,))]


# the DecodePlan fields that only an MLA layer reads
_MLA_ONLY_FIELDS = {"mla_attention", "mla_combine"}


def _differs_for(impl: str, kind: str) -> bool:
    """Whether ``impl`` runs anything other than "fast" does in a ``kind`` layer: a contender whose plan differs from
    the shipped one only in MLA-only fields is the shipped path in a KDA layer (measuring it there measures fast)."""
    from ..layer import CONTENDERS, DEFAULT_PLAN
    if impl not in CONTENDERS or kind == "mla_moe":
        return True
    plan = CONTENDERS[impl][0]
    diff = {f for f in DEFAULT_PLAN.__dataclass_fields__ if getattr(plan, f) != getattr(DEFAULT_PLAN, f)}
    return not diff <= _MLA_ONLY_FIELDS


# The stock / fast comparisons the README and the design notes quote come from these presets: one run per card
# and routing, every implementation of a cell in the same process (the copy bandwidth and the clocks are shared).
PRESETS = {
    "smoke": Preset("one cheap cell (KDA+MoE, rank16, batch 1), stock beside fast: the harness works on this machine",
                    shapes=("k3_rank16",), batches=(1,), replays=20),
    "kda-sweep": Preset("the KDA+MoE layer at rank16 / rank8 / full width x batch 1 / 8 / 64, stock beside fast, "
                        "the router on random inputs (near-uniform over the experts)"),
    "kda-sweep-skewed": Preset("kda-sweep with the routing skewed onto a hot set of 24 experts (every token picks "
                               "16 of them)", routing="skewed"),
    "kda-batches": Preset("the KDA+MoE layer at rank16 / rank8 over every batch bucket of the dispatch plan "
                          "(1, 2, 4, 8, 16, 64), stock beside fast", shapes=("k3_rank16", "k3_rank8"),
                          batches=(1, 2, 4, 8, 16, 64)),
    "kda-contenders": Preset("fast beside each live contender and stock, KDA+MoE at rank16 / rank8 x batch 1 / 8 / 64",
                             shapes=("k3_rank16", "k3_rank8"), impls=("stock", "fast", CONTENDERS)),
    "mla-fused": Preset("the MLA+MoE layer at rank16 / rank8 x batch 1 / 8 / 64 x context 1K / 8K / 32K cached tokens: "
                        "stock, fast (stock attention half), fast-mla (FusedMLA) and fast-mla-uvc (its split "
                        "combine in mla_uv_gate) in one run",
                        kinds=("mla_moe",), shapes=("k3_rank16", "k3_rank8"), contexts=(1024, 8192, 32768),
                        impls=("stock", "fast", "fast-mla", "fast-mla-uvc")),
    "stock-vs-vllm": Preset("the stock layer as vLLM runs it beside fast, for the ratios the README quotes: KDA+MoE and "
                            "MLA+MoE at rank16 / rank8 / full x batch 1 / 8 / 64, MLA at 24 cached tokens (where the "
                            "engine profiles its layers: report --engine-match) and at 1K / 8K",
                            kinds=("kda_moe", "mla_moe"), contexts=(24, 1024, 8192)),
    "mla-sweep": Preset("the MLA+MoE layer at rank16 / rank8 / full width x batch 1 / 8 / 64 x context 1024 / 8192 "
                        "cached tokens, stock beside fast (whose attention half is the stock one)",
                        kinds=("mla_moe",)),
}
# What a bare `python -m k3fast.measure.trace` runs: the peers (ref, compiled, stock) at every cell of both kinds.
DEFAULT_SWEEP = Preset("the peers at every cell of both layer kinds", kinds=("kda_moe", "mla_moe"),
                       impls=("ref", "compiled", "stock"))


def preset_table() -> str:
    """One line per preset: its name, its cell count and what it measures."""
    return "\n".join(f"{name:17s} {len(p.cells(contenders=[])):3d} cells  {p.about}" for name, p in PRESETS.items())


# ------------------------------------------------------------------------------------------------ what traces/ keeps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The documents whose citations keep a file under traces/. docs/lab-log.md is frozen history: it cites files that
# now live in git history only, so it keeps nothing and is not checked.
CITING = ("README.md", "notebooks/*.py", "docs/**/*.md", "traces/README.md", "traces/index.json")
FROZEN = ("docs/lab-log.md",)
# The kinds of file a bare name may cite (records-<tag>.json, h200/records-<tag>.json ...); a bare name counts only
# when its tag starts with a commit id (7+ hex digits) or a wildcard, so output names in prose ("ncu-2.tgz") are
# not citations.
FILE_KINDS = ("records", "kernels", "experts", "perfetto", "profile", "ptxcheck", "overlap", "l2probe",
              "clusterprobe", "blasprobe", "launchprobe", "ncu", "gpu-junit", "gpu-tests", "gpu", "sweep", "bench")
_PATH = r"[\w@.*{},/-]*"
_CITE = re.compile(r"(?<![\w./-])(?:traces/" + _PATH + r"|(?:[\w-]+/)*(?:" + "|".join(FILE_KINDS)
                   + r")-(?:[0-9a-f]{7}|\*|\{)" + _PATH + ")")
_EXT = re.compile(r"(\.(json|xml|txt|log|gz|tgz|png|svg|csv))+$")


@dataclasses.dataclass
class Citation:
    source: str         # the citing file, relative to the repository
    line: int
    text: str           # as written
    files: list[str]    # the tracked files it names (a folder: every file under it)
    generic: bool       # names a kind of file (records-*.json, traces/h100/), not evidence: keeps nothing


def _expand(text: str, line: str) -> list[tuple[list[str], str | None]]:
    """Glob patterns for one cited text, as (patterns, fallback) pairs: {a,b} alternatives expanded; a format
    placeholder ({t}, an unclosed f-string brace) filled with each quoted word of the same line, the fallback (the
    placeholder as a wildcard) standing in only when none of those names a file."""
    m = re.search(r"\{([^{}]*)\}", text)
    if m and "," in m.group(1):
        return [p for alt in m.group(1).split(",") for p in _expand(text[:m.start()] + alt + text[m.end():], line)]
    if m or "{" in text:
        start = m.start() if m else text.index("{")
        rest = text[m.end():] if m else ""
        words = re.findall(r"""["']([\w.-]*)["']""", line)      # '' too: f"...{'-skewed' if s else ''}"
        return [([text[:start] + w + rest for w in words], text[:start] + "*" + rest)]
    return [([text], None)]


def _matches(pattern: str, tracked: set[str]) -> set[str]:
    """The tracked files a cited pattern names: a full path under traces/, or a name relative to traces/ (h200/...)
    or to any card folder (traces/*/ and one level below); a stem without a suffix ("overlap-*-first") names the file
    with its suffix."""
    pattern = pattern.rstrip("/")
    full = [pattern] if pattern.split("/")[0] == "traces" else [f"traces/{pattern}", f"traces/*/{pattern}",
                                                                  f"traces/*/*/{pattern}"]
    if not _EXT.search(pattern):
        full += [g + ".*" for g in full]
    out = set()
    for g in map(_glob_re, full):
        out |= {t for t in tracked if g.fullmatch(t)}
    return out


def _generic(pattern: str) -> bool:
    """True when nothing below the card folder is specific: a kind prefix, wildcards and an extension only."""
    parts = [p for p in pattern.split("/") if p]
    if parts[:1] == ["traces"]:
        parts = parts[1:] if len(parts) == 2 and "." in parts[1] else parts[2:]    # traces/README.md is a file
    for part in parts:
        stem = _EXT.sub("", part)
        for kind in sorted(FILE_KINDS, key=len, reverse=True):
            if stem.startswith(kind + "-"):
                stem = stem[len(kind) + 1:]
                break
        if stem.strip("*-"):
            return False
    return True


def _glob_re(pattern: str) -> re.Pattern:
    """A glob over repository paths as a regex: ``*`` and ``?`` stay inside one path component; a folder matches
    every file under it."""
    body = "".join("[^/]*" if ch == "*" else "[^/]" if ch == "?" else re.escape(ch) for ch in pattern)
    return re.compile(body + "(/.*)?")


def _tracked(root: str) -> set[str]:
    out = subprocess.run(["git", "-C", root, "ls-files", "traces"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"git ls-files failed in {root}: {out.stderr.strip()}")
    return set(out.stdout.split())


def _ignored(root: str, path: str) -> bool:
    """git ignores ``path`` (or, for a folder that does not exist, what would lie in it)."""
    return any(subprocess.run(["git", "-C", root, "check-ignore", "-q", p]).returncode == 0
               for p in (path, path.rstrip("/") + "/_"))


def citations(root: str = ROOT, tracked: set[str] | None = None) -> list[Citation]:
    """Every traces/ path or bare record name cited by the CITING documents (FROZEN left out), resolved against the
    tracked files (_matches). Paths git ignores (a local output folder) and the folder after a command's --out are
    not citations."""
    tracked = _tracked(root) if tracked is None else tracked
    docs = {os.path.relpath(p, root) for pat in CITING for p in glob.glob(os.path.join(root, pat), recursive=True)}
    docs = sorted(docs - set(FROZEN))
    out = []
    for doc in docs:
        with open(os.path.join(root, doc), encoding="utf-8") as f:
            lines = f.read().splitlines()
        for n, line in enumerate(lines, 1):
            marker = "<!--" in line          # a generated block's marker names the files its generator reads
            for m in _CITE.finditer(line):
                text = m.group(0).rstrip(".,;:")
                if re.search(r"--out[= ]$", line[:m.start()]) or (text.startswith("traces/") and _ignored(root, text)):
                    continue                    # where a command writes, not what the tree holds
                template = line[m.end():m.end() + 1] == "<"      # traces/<card>/, records-<tag>.json
                files, used = set(), []
                for pats, fallback in _expand(text + ("*" if template else ""), line):
                    found = {f for p in pats for f in _matches(p, tracked)}
                    if not found and fallback:
                        pats, found = [fallback], _matches(fallback, tracked)
                    files |= found
                    used += pats
                generic = not marker and all(_generic(p) for p in used)
                out.append(Citation(doc, n, text, sorted(files), generic))
    return out


def unresolved(cites: list[Citation]) -> list[Citation]:
    """The citations of evidence that name no tracked file (a generic pattern, a kind of file, may match none)."""
    return [c for c in cites if not c.files and not c.generic]


def _perfetto_of(root: str, records_file: str) -> set[str]:
    """The Perfetto traces a records file's records point to (k3fast.measure.report.perfetto_file's lookup)."""
    base = os.path.dirname(records_file)
    stem = os.path.basename(records_file)[len("records-"):-len(".json")]
    try:
        with open(os.path.join(root, records_file)) as f:
            recs = json.load(f).get("records", [])
    except (OSError, ValueError):
        return set()
    out = set()
    for r in recs:
        if r.get("perfetto"):
            name = os.path.basename(r["perfetto"])
            out |= {os.path.normpath(os.path.join(base, d, name)) for d in (f"perfetto-{stem}", "perfetto")}
            out.add(os.path.normpath(os.path.join(base, r["perfetto"])))
    return out


def prune_plan(root: str = ROOT) -> tuple[list[str], list[str], list[Citation]]:
    """(kept, removable, unresolved citations) over the tracked files under traces/. Kept: traces/README.md, what a
    CITING document names (a folder: everything under it; a generic pattern: nothing), the Perfetto traces of
    every kept records file and the meta.txt beside any kept file of a run folder. traces/README.md names the
    latest full sweep and GPU test run per card, so those are kept too."""
    tracked = _tracked(root)
    cites = citations(root, tracked)
    kept = {"traces/README.md"} & tracked
    for c in cites:
        if not c.generic:
            kept |= set(c.files)
    for f in sorted(kept):
        if os.path.basename(f).startswith("records-") and f.endswith(".json"):
            kept |= _perfetto_of(root, f) & tracked
        if f.count("/") > 2:                       # a file of a run folder keeps the folder's metadata beside it
            kept |= {os.path.join(os.path.dirname(f), "meta.txt")} & tracked
    return sorted(kept), sorted(tracked - kept), unresolved(cites)


def _size(root: str, files: list[str]) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for f in files if os.path.exists(os.path.join(root, f)))


def prune(apply: bool = False, root: str = ROOT, out=print) -> int:
    """List (or, with ``apply``, git rm) every file under traces/ that prune_plan does not keep. Returns the
    number of removable files."""
    kept, removable, missing = prune_plan(root)
    by_folder: dict[str, list[str]] = {}
    for f in removable:
        by_folder.setdefault("/".join(f.split("/")[:2]), []).append(f)
    for f in removable:
        out(f"remove {f}")
    for c in missing:
        out(f"warning: {c.source}:{c.line} cites {c.text}, which is not in the tree")
    for folder, files in sorted(by_folder.items()):
        out(f"{folder}: {len(files)} files, {_size(root, files) / 1e6:.1f} MB removable")
    out(f"traces/: keep {len(kept)} files ({_size(root, kept) / 1e6:.1f} MB), remove {len(removable)} "
        f"({_size(root, removable) / 1e6:.1f} MB)" + ("" if apply else "; --apply removes them with git rm"))
    if apply and removable:
        for i in range(0, len(removable), 200):
            subprocess.run(["git", "-C", root, "rm", "-q", "--", *removable[i:i + 200]], check=True)
    return len(removable)


# ------------------------------------------------------------------------------------------------ command line

def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["prune"]:
        ap = argparse.ArgumentParser(prog="python -m k3fast.measure.trace prune",
                                     description="List the files under traces/ that no document cites and that are "
                                                 "not the latest sweep per card (traces/README.md names those).")
        ap.add_argument("--apply", action="store_true", help="remove them with git rm")
        prune(ap.parse_args(argv[1:]).apply)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="a named sweep (--list-presets); --kinds/--shapes/--batches/--contexts/--impls/--routing/"
                         "--replays override its fields")
    ap.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    ap.add_argument("--kinds", nargs="+", default=None, help=f"default {' '.join(DEFAULT_SWEEP.kinds)}")
    ap.add_argument("--shapes", nargs="+", default=None, choices=SHAPES)
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="default 1 8 64")
    ap.add_argument("--contexts", nargs="+", type=int, default=None,
                    help="MLA cached tokens per request (default 1024 8192)")
    ap.add_argument("--impls", nargs="+", default=None,
                    help=f"default {' '.join(DEFAULT_SWEEP.impls)}; '{CONTENDERS}' stands for every live fast contender")
    ap.add_argument("--stock-ops", choices=["vllm-layer", "vllm", "torch"], default="vllm-layer",
                    help="stock path: vLLM's own layer kernel for kernel (vllm-layer, the default), vLLM 0.33's fused "
                         "ops composed with fla's KDA kernels and FlashMLA (vllm), or torch glue; each falls back to "
                         "the next where this machine lacks what it needs")
    ap.add_argument("--replays", type=int, default=None, help="timed replays per part (default 50)")
    ap.add_argument("--out", default=None, help="folder for the records (default: traces/<card>, e.g. traces/h200)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new cells after this many seconds")
    ap.add_argument("--cell", action="append", type=parse_cell, default=None, metavar="KIND,SHAPE,BATCH,CTX,IMPLS",
                    help="run exactly these cells, in this order (repeatable; replaces --preset/--kinds/--shapes/"
                         "--batches/--contexts/--impls), e.g. --cell mla_moe,full,64,8192,ref+compiled")
    ap.add_argument("--routing", choices=sorted(ROUTINGS), default=None,
                    help="MoE routing: the router on random inputs (default), or skewed onto a hot set of 24 experts")
    ap.add_argument("--engine", nargs="+", default=None, metavar="VLLM_E2E_JSON",
                    help="vllm_e2e files from this card (stock vLLM's per-layer figures) that each stock record is "
                         "matched against (default: traces/index.json's vllm_e2e)")
    args = ap.parse_args(argv)
    if args.list_presets:
        print(preset_table())
        return 0
    if args.cell and (args.preset or args.kinds or args.shapes or args.batches or args.contexts or args.impls):
        ap.error("--cell names its cells: give it without --preset/--kinds/--shapes/--batches/--contexts/--impls")
    bad = [k for k in args.kinds or () if k not in KIND_LAYER]
    if bad:
        ap.error(f"--kinds: unknown layer kind {bad[0]!r}; expected some of {sorted(KIND_LAYER)}")
    if any(b < 1 for b in args.batches or ()) or any(c < 1 for c in args.contexts or ()):
        ap.error("--batches and --contexts take integers >= 1")
    base = PRESETS[args.preset] if args.preset else DEFAULT_SWEEP
    sweep = dataclasses.replace(base, **{f: tuple(getattr(args, f)) for f in ("kinds", "shapes", "batches",
                                                                          "contexts", "impls") if getattr(args, f)},
                                **{f: getattr(args, f) for f in ("routing", "replays") if getattr(args, f)})
    if not torch.cuda.is_available():
        print("k3fast.measure.trace needs a CUDA GPU; on this machine render the recorded traces with "
              "`python -m k3fast.measure.report`", file=sys.stderr)
        return 2
    out = args.out or card_folder()
    engine = engine_records(args.engine)
    env, bw, tag = start_run(out, args.tag)
    perfetto_dir = os.path.join(out, f"perfetto-{tag}")      # one folder per run: names repeat across runs
    cells = args.cell or sweep.cells()
    print(f"{args.preset or 'sweep'}: {len(cells)} cells, routing {sweep.routing}, {sweep.replays} replays", flush=True)
    records, t0 = [], time.time()
    path = os.path.join(out, f"records-{tag}.json")
    try:
        from tqdm import tqdm
        it = tqdm(cells, desc="cells", file=sys.stdout, mininterval=5)
    except ImportError:
        it = cells
    for kind, shape, batch, ctx, impls in it:
        if time.time() - t0 > args.budget_s:
            print(f"budget reached: skipping {kind} {shape} b{batch} ctx{ctx}", flush=True)
            continue
        print(f"{kind} {shape} batch {batch} context {ctx}", flush=True)
        try:
            records += run_cell(kind, shape, batch, impls, context=ctx, replays=sweep.replays, env=env, copy_tbps=bw,
                                perfetto_dir=perfetto_dir, log=lambda m: print(m, flush=True),
                                stock_ops=args.stock_ops, routing=sweep.routing, engine=engine)
        except Exception as ex:                     # e.g. out of memory building the cell's weights: next cell
            import traceback
            print(f"  cell FAILED {type(ex).__name__}: {str(ex)[:300]}\n" + traceback.format_exc()[-1500:], flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        write_run(path, env, bw, records)
    print(f"wrote {len(records)} records to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
