"""Compile the fused layer's kernels on this machine (no GPU needed) into a K3_KERNEL_CACHE folder, so that GPU runs
load them instead of compiling them (k3fast.kernels._dsl explains the cache). This project uses it to spend the
CPU machine's time instead of the lent GPU's: the folder travels with the run and the device scripts point
K3_KERNEL_CACHE at it. Keys the runs need beyond these are compiled there and cached for the run's other processes.

    python scripts/precompile.py --out .kcache [--shapes k3_rank16 k3_rank8 full] [--batches 1 8 64] [-j 2]
                                 [--record traces/cpu/kernel-cache.json]

--record appends this run to a JSON record: per shape the kernels and the seconds each took (compiled, or loaded
when the folder already held them: the objects before and after the run say which), with the machine and versions.

Each shape compiles, in its own process: KDA layers (a block-boundary layer too) and MLA layers under the shipped
plan with the fused MLA attention half, with and without the plug-in's padding slot, the experts in both weight
layouts, then under each contender plan (k3fast.layer.CONTENDERS) that the GPU tests and traces run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

BATCHES = (1, 2, 3, 4, 7, 8, 9, 16, 17, 24, 32, 40, 48, 56, 64)


def _one(shape: str, batches: tuple[int, ...], out: str) -> dict:
    os.environ["K3_KERNEL_CACHE"] = out
    from k3ref import preset
    from k3fast.layer import CONTENDERS, DecodePlan, warmup
    from k3fast.kernels._dsl import COMPILE_LOG
    cfg = preset(shape)
    t0 = time.perf_counter()
    mla = next(l for l in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(l) and cfg.is_moe_layer(l))
    boundary = next(l for l in range(1, cfg.num_hidden_layers) if cfg.is_kda_layer(l) and cfg.is_block_boundary(l))
    n = 0
    for null_slot in (False, True):
        n += warmup(cfg, [1, boundary, mla], batches, plan=DecodePlan(mla_attention="fused"), null_slot=null_slot)
    # the experts' other weight layout (prepare_mxfp4_experts picks it when a checkpoint's scales need it)
    n += warmup(cfg, [], batches, experts_layout="nibble")
    for plan, _ in CONTENDERS.values():
        n += warmup(cfg, [1, boundary, mla], batches, plan=plan)
    secs = sorted(t for _, t in COMPILE_LOG)
    return {"shape": shape, "kernels": n, "seconds": round(time.perf_counter() - t0, 1),
            "per_kernel_s": {"min": round(secs[0], 3), "median": round(secs[len(secs) // 2], 3),
                             "max": round(secs[-1], 3)} if secs else None}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the K3_KERNEL_CACHE folder to fill")
    ap.add_argument("--shapes", nargs="+", default=["k3_rank16", "k3_rank8", "full"])
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("-j", type=int, default=2, help="processes (one shape each)")
    ap.add_argument("--record", help="append this run (per shape: kernels, seconds) to this JSON file")
    a = ap.parse_args(argv)
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    objects = lambda: [f for f in os.listdir(out) if f.endswith(".o")]
    before = len(objects())
    shapes = []
    with ProcessPoolExecutor(a.j) as pool:
        for r in pool.map(_one, a.shapes, [tuple(a.batches)] * len(a.shapes), [out] * len(a.shapes)):
            print(f"{r['shape']}: {r['kernels']} kernels in {r['seconds']:.0f} s, each {r['per_kernel_s']}", flush=True)
            shapes.append(r)
    files = objects()
    mb = sum(os.path.getsize(os.path.join(out, f)) for f in files) / 2**20
    print(f"{out}: {len(files)} objects, {mb:.1f} MiB", file=sys.stderr)
    if a.record:
        _record(a, shapes, before, len(files), round(mb, 1))


def _record(a, shapes, before: int, after: int, mb: float) -> None:
    import json
    import platform
    from k3fast.measure.trace import environment
    run = {"command": "python scripts/precompile.py " + " ".join(sys.argv[1:]), "environment": environment(),
           "processes": a.j, "batches": a.batches, "objects_before": before, "objects_after": after, "mib": mb,
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "shapes": shapes}
    rec = {"kind": "kernel_cache", "runs": []}
    if os.path.exists(a.record):
        with open(a.record) as f:
            rec = json.load(f)
    rec["runs"].append(run)
    os.makedirs(os.path.dirname(os.path.abspath(a.record)), exist_ok=True)
    with open(a.record, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
