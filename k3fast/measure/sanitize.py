"""The launch set the sanitizer tier runs under compute-sanitizer: every shipped kernel key of the fused layer, each
launched once, eagerly (no CUDA graph: the tools follow individual launches).

The set is the fewest launches that cover every code path of the shipped plan: the whole KDA + MoE layer at
k3_rank16 / k3_rank8 / full width and batch 1 / 8 / 64 (each batch takes a different in_proj, o_proj, front,
experts and tail path), the attention half of a block-boundary layer at rank16 and rank8 (the block write of
AttnRes #1 and the new partial sum of o_proj), and the KDA step on a vLLM-style page-strided state pool with
slot 0 as padding (the plug-in's build), with padded and out-of-range slots in the batch. Then the fused MLA
attention half (FusedMLA, a live contender) at rank16 batch 1 / 8 with both split rules (``--no-mla`` leaves it out).

    python -m k3fast.measure.sanitize --out launched.json           # what scripts/device_sanitize.sh runs

The JSON lists every cell and every kernel key compiled (= launched) in the process, so the report can say what
each tool saw. Nothing here checks results; the GPU test tier does that.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from k3ref import k3_rank, preset
from k3ref.weights import random_layer

from ..layer import FusedKDA
from ..layer_io import make_io
from .impls import make_impl

SHAPES = ("k3_rank16", "k3_rank8", "full")
BATCHES = (1, 8, 64)
BOUNDARY_LAYER = 24          # a KDA layer that closes an AttnRes block (checked below)


def launch_set(shapes=SHAPES, batches=BATCHES, log=print, out: str | None = None, mla: bool = True) -> list[dict]:
    """Launch the set; after each cell, ``out`` (when given) is rewritten with the cells so far and the kernel keys
    compiled so far, so a run the tool's time limit cuts short still says what it covered."""
    from ..kernels._dsl import COMPILE_LOG
    cells, t0 = [], time.perf_counter()

    def save(complete: bool):
        if out:
            with open(out, "w") as f:
                json.dump({"cells": cells, "kernel_keys": [str(k)[:240] for k, _ in COMPILE_LOG],
                           "complete": complete, "wall_s": round(time.perf_counter() - t0, 1)}, f, indent=1)

    def done(**cell):
        torch.cuda.synchronize()
        cells.append(cell)
        save(False)
        log(f"  launched {cell}")

    for shape in shapes:
        cfg = preset(shape)
        # one layer (weights re-laid once) serves every batch: the plan picks each batch's kernels at call time
        w = random_layer(cfg, 1, seed=5, device="cuda")
        fast = make_impl("fast", cfg, w, max_batch=max(batches))
        for batch in batches:
            io = make_io(cfg, 1, batch, seed=6)
            io.slots[0] = -1 if batch > 1 else io.slots[0]          # one padding row where the batch has room
            fast.layer(io)
            done(shape=shape, layer=1, batch=batch, part="layer")
        del w, fast
        if shape != "full":
            assert cfg.is_block_boundary(BOUNDARY_LAYER) and cfg.is_kda_layer(BOUNDARY_LAYER)
            wb = random_layer(cfg, BOUNDARY_LAYER, seed=7, device="cuda")
            kda = FusedKDA(cfg, wb)                                  # the attention half only: no experts to re-lay
            for batch in batches:
                io = make_io(cfg, BOUNDARY_LAYER, batch, seed=8)
                kda(io.blocks, io.partial, io.delta, io.state.conv, io.state.recurrent, io.slots, io.x_mlp)
                done(shape=shape, layer=BOUNDARY_LAYER, batch=batch, part="attn")
            del wb, kda
        torch.cuda.empty_cache()
    # the plug-in's build: slot 0 is padding, the pools are page-strided views, one slot index past the pool
    cfg = k3_rank(16)
    w = random_layer(cfg, 1, seed=9, device="cuda")
    io = make_io(cfg, 1, 8, seed=10, slots=12)
    conv, rec = io.state.conv, io.state.recurrent
    page = rec[0].numel() + 4096                                   # fp32 elements per page, slot rows compact
    pool = torch.zeros(conv.shape[0] * page, dtype=torch.float32, device="cuda")
    rec_v = pool.as_strided(rec.shape, (page,) + rec.stride()[1:])
    cpool = torch.zeros(conv.shape[0] * (conv[0].numel() + 64), dtype=torch.bfloat16, device="cuda")
    conv_v = cpool.as_strided(conv.shape, (conv[0].numel() + 64,) + conv.stride()[1:])
    rec_v.copy_(rec)
    conv_v.copy_(conv)
    io.slots.copy_(torch.tensor([1, 0, 3, -1, 5, 6, 7, 8], dtype=torch.int32))
    FusedKDA(cfg, w, null_slot=True, check_slots=False)(io.blocks, io.partial, io.delta, conv_v, rec_v, io.slots,
                                                        io.x_mlp)
    done(shape="k3_rank16", layer=1, batch=8, part="kda null_slot, page-strided pool")
    io.slots[7] = rec.shape[0]                                     # past the pool: the in-kernel guard's path
    FusedKDA(cfg, w, null_slot=True, check_slots=False)(io.blocks, io.partial, io.delta, conv_v, rec_v, io.slots,
                                                        io.x_mlp)
    done(shape="k3_rank16", layer=1, batch=8, part="kda null_slot, one slot past the pool")
    del w, io, pool, cpool
    if mla:
        # the fused MLA attention half (a live contender, not yet shipped): both split rules, mixed cache lengths with
        # a padded request, the appended row on a page edge
        from ..layer import DecodePlan, FusedMLA
        from ..layer_io import mla_step
        mla_layer = next(l for l in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(l) and cfg.is_moe_layer(l))
        w = random_layer(cfg, mla_layer, seed=11, device="cuda")
        for batch in (1, 8):
            for rule in ("sm", "balanced"):
                io = make_io(cfg, mla_layer, batch, context=1024, seed=12)
                if batch > 1:
                    io.slots[3] = -1
                    io.state.lengths[1 + 5] = 64                      # request 5's new row opens a page
                step = mla_step(io.state, io.slots)
                FusedMLA(cfg, w, plan=DecodePlan(mla_attention="fused", mla_splits=rule))(
                    io.blocks, io.partial, io.delta, step.pages, step.block_table, step.seqlens, io.x_mlp)
                done(shape="k3_rank16", layer=mla_layer, batch=batch, part=f"mla attention, {rule} splits")
        del w, io
    save(True)
    return cells


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m k3fast.measure.sanitize", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON: the cells launched and the kernel keys compiled")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("--no-mla", action="store_true", help="leave out the fused MLA attention half's cells")
    a = ap.parse_args(argv)
    from ..kernels._dsl import COMPILE_LOG
    t0 = time.perf_counter()
    cells = launch_set(a.shapes, a.batches, out=a.out, mla=not a.no_mla)
    print(f"{len(cells)} cells, {len(COMPILE_LOG)} kernel keys, {time.perf_counter() - t0:.0f} s")

if __name__ == "__main__":
    main()
