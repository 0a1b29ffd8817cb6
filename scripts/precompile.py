"""Compile the fused layer's kernels on this machine (no GPU needed) into a K3_KERNEL_CACHE folder, so that GPU runs
load them instead of compiling them (k3fast.kernels._dsl explains the cache). This project uses it to spend the
CPU machine's time instead of the lent GPU's: the folder travels with the run and the device scripts point
K3_KERNEL_CACHE at it. Keys the runs need beyond these are compiled there and cached for the run's other processes.

    python scripts/precompile.py --out .kcache [--shapes k3_rank16 k3_rank8 full] [--batches 1 8 64] [-j 2]

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


def _one(shape: str, batches: tuple[int, ...], out: str) -> str:
    os.environ["K3_KERNEL_CACHE"] = out
    from k3ref import preset
    from k3fast.layer import CONTENDERS, DecodePlan, warmup
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
    return f"{shape}: {n} kernels in {time.perf_counter() - t0:.0f} s"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the K3_KERNEL_CACHE folder to fill")
    ap.add_argument("--shapes", nargs="+", default=["k3_rank16", "k3_rank8", "full"])
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("-j", type=int, default=2, help="processes (one shape each)")
    a = ap.parse_args(argv)
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    with ProcessPoolExecutor(a.j) as pool:
        for line in pool.map(_one, a.shapes, [tuple(a.batches)] * len(a.shapes), [out] * len(a.shapes)):
            print(line, flush=True)
    files = [f for f in os.listdir(out) if f.endswith(".o")]
    mb = sum(os.path.getsize(os.path.join(out, f)) for f in files) / 2**20
    print(f"{out}: {len(files)} objects, {mb:.1f} MiB", file=sys.stderr)


if __name__ == "__main__":
    main()
