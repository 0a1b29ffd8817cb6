"""The launch set the sanitizer tier runs under compute-sanitizer: every shipped kernel key of the fused layer, each
launched once, eagerly (no CUDA graph: the tools follow individual launches), and the summary of the tools' logs.

The set is the fewest launches that cover every code path of the shipped plan, in parts that each run in their own
process (``scripts/device_sanitize.sh`` starts one per tool and part, so a part that fails or runs out of time
leaves the others' verdicts standing):

* ``k3_rank16`` / ``k3_rank8`` / ``full``: the whole KDA + MoE layer at batch 1 / 8 / 64 (each batch takes a
  different in_proj, o_proj, front, experts and tail path), and at rank16 / rank8 the attention half of a
  block-boundary layer (the block write of AttnRes #1 and the new partial sum of o_proj);
* ``pool``: the KDA step on a vLLM-style page-strided state pool with slot 0 as padding (the plug-in's build), with
  padded slots and one slot past the pool (the in-kernel guard's path);
* ``mla``: the fused MLA attention half (FusedMLA) at rank16 batch 1 / 8, with and without the combine, a padded
  request and a new cache row opening a page;
* ``control`` / ``control-torch``: the router front's cuBLAS GEMM output (fp32, as the layer computes it above batch
  4) read by torch's own reduction and by TopkFromLogits after a synchronization, and each library GEMM whose
  output initcheck flagged in the layer, alone and read by torch / a torch-written copy of the front's output read
  by TopkFromLogits: which of them initcheck flags says whether its reports in the layer concern our kernel, the
  library's writes it does not follow, or the PDL overlap.

    python -m k3fast.measure.sanitize --out launched.json [--parts k3_rank16 pool]    # what the script runs, per part
    python -m k3fast.measure.sanitize --summarize OUT_DIR                             # the tools' logs -> sanitizer.json

The launched JSON lists every cell with the GPU memory held after it, and every kernel key compiled (or loaded from
K3_KERNEL_CACHE) in the process, so the report can say what each tool saw. Nothing here checks results; the GPU
test tier does that.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time

SHAPES = ("k3_rank16", "k3_rank8", "full")
PARTS = SHAPES + ("pool", "mla", "control", "control-torch")
BATCHES = (1, 8, 64)
BOUNDARY_LAYER = 24          # a KDA layer that closes an AttnRes block (checked below)
TOOLS = ("memcheck", "synccheck", "initcheck", "racecheck")


def launch_set(parts=PARTS, batches=BATCHES, log=print, out: str | None = None) -> list[dict]:
    """Launch the cells of ``parts``; after each cell, ``out`` (when given) is rewritten with the cells so far and the
    kernel keys so far, so a run the tool's time limit cuts short still says what it covered."""
    import torch
    from ..kernels._dsl import COMPILE_LOG
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"parts: unknown {unknown}; expected some of {list(PARTS)}")
    cells, t0 = [], time.perf_counter()

    def save(complete: bool):
        if out:
            with open(out, "w") as f:
                json.dump({"parts": list(parts), "cells": cells, "kernel_keys": [str(k)[:240] for k, _ in COMPILE_LOG],
                           "complete": complete, "wall_s": round(time.perf_counter() - t0, 1)}, f, indent=1)

    # K3_SAN_MEMHIST=1: PyTorch records where each live block was allocated, and every cell says which call sites
    # hold the memory (under the tools a width part holds far more than its layer's tensors: this names what)
    memhist = os.environ.get("K3_SAN_MEMHIST") == "1"
    if memhist:
        torch.cuda.memory._record_memory_history(max_entries=200000)

    def done(**cell):
        torch.cuda.synchronize()
        cell["mem_gb"] = round(torch.cuda.memory_allocated() / 2**30, 2)        # held by live tensors after the cell
        cell["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if memhist:
            cell["held_by"] = held_by(torch.cuda.memory._snapshot())
        cells.append(cell)
        save(False)
        log(f"  launched {cell}")

    for part in parts:
        _PART[part](batches, done)
        torch.cuda.empty_cache()
    save(True)
    return cells


def held_by(snapshot: dict, top: int = 8) -> list[dict]:
    """The live blocks of a ``torch.cuda.memory._snapshot()`` grouped by the innermost frame of this repository
    (k3fast / k3ref) that allocated them, largest first: [{"site": "file:line name", "gb": .., "blocks": n}]. A
    block freed by its tensor but still waiting on a stream's event ("active_pending_free") counts apart, its site
    marked "(pending free)": which of the two holds the memory says whether tensors outlive their use or the
    allocator's frees wait."""
    sites: dict[str, list] = {}
    for seg in snapshot.get("segments", []):
        for b in seg.get("blocks", []):
            state = b.get("state")
            if state not in ("active_allocated", "active_pending_free"):
                continue
            frames = b.get("frames") or []
            ours = [f for f in frames if re.search(r"k3(fast|ref)[/\\]", f.get("filename", ""))]
            f = ours[0] if ours else (frames[0] if frames else {})
            name = re.sub(r".*[/\\](?=k3(fast|ref)[/\\])", "", f.get("filename", "?"))
            site = f"{name}:{f.get('line', '?')} {f.get('name', '?')}" if f else "unrecorded"
            if state == "active_pending_free":
                site += " (pending free)"
            acc = sites.setdefault(site, [0, 0])
            acc[0] += b.get("requested_size", b.get("size", 0))
            acc[1] += 1
    rows = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"site": k, "gb": round(v[0] / 2**30, 3), "blocks": v[1]} for k, v in rows]


def _layer_cells(shape: str):
    def run(batches, done):
        import torch
        from k3ref import preset
        from k3ref.weights import random_layer
        from ..layer import FusedKDA
        from ..layer_io import make_io
        from .impls import make_impl
        cfg = preset(shape)
        # one layer (weights re-laid once) serves every batch: the plan picks each batch's kernels at call time
        w = random_layer(cfg, 1, seed=5, device="cuda")
        fast = make_impl("fast", cfg, w, max_batch=max(batches))
        for batch in batches:
            io = make_io(cfg, 1, batch, seed=6)
            io.slots[0] = -1 if batch > 1 else io.slots[0]          # one padding row where the batch has room
            fast.layer(io)
            done(shape=shape, layer=1, batch=batch, part="layer")
        del w, fast, io
        if shape != "full":
            assert cfg.is_block_boundary(BOUNDARY_LAYER) and cfg.is_kda_layer(BOUNDARY_LAYER)
            wb = random_layer(cfg, BOUNDARY_LAYER, seed=7, device="cuda")
            kda = FusedKDA(cfg, wb)                                  # the attention half only: no experts to re-lay
            for batch in batches:
                io = make_io(cfg, BOUNDARY_LAYER, batch, seed=8)
                kda(io.blocks, io.partial, io.delta, io.state.conv, io.state.recurrent, io.slots, io.x_mlp)
                done(shape=shape, layer=BOUNDARY_LAYER, batch=batch, part="attn")
            del wb, kda, io
        torch.cuda.empty_cache()
    return run


def _pool_cells(batches, done):
    """The plug-in's build: slot 0 is padding, the pools are page-strided views, one slot index past the pool."""
    import torch
    from k3ref import k3_rank
    from k3ref.weights import random_layer
    from ..layer import FusedKDA
    from ..layer_io import make_io
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
    kda = FusedKDA(cfg, w, null_slot=True, check_slots=False)
    kda(io.blocks, io.partial, io.delta, conv_v, rec_v, io.slots, io.x_mlp)
    done(shape="k3_rank16", layer=1, batch=8, part="kda null_slot, page-strided pool")
    io.slots[7] = rec.shape[0]                                     # past the pool: the in-kernel guard's path
    kda(io.blocks, io.partial, io.delta, conv_v, rec_v, io.slots, io.x_mlp)
    done(shape="k3_rank16", layer=1, batch=8, part="kda null_slot, one slot past the pool")


def _mla_cells(batches, done):
    """FusedMLA: with the split count of 132 SMs (the combine path) and of 8 (one split per request at batch 8, no
    combine), mixed cache lengths with a padded request, the appended row on a page edge."""
    from k3ref import k3_rank
    from k3ref.weights import random_layer
    from ..layer import DecodePlan, FusedMLA
    from ..layer_io import make_io, mla_step
    cfg = k3_rank(16)
    layer = next(l for l in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(l) and cfg.is_moe_layer(l))
    w = random_layer(cfg, layer, seed=11, device="cuda")
    for batch in (1, 8):
        for nsm in (132, 8):
            io = make_io(cfg, layer, batch, context=1024, seed=12)
            if batch > 1:
                io.slots[3] = -1
                io.state.lengths[1 + 5] = 64                      # request 5's new row opens a page
            step = mla_step(io.state, io.slots)
            FusedMLA(cfg, w, plan=DecodePlan(mla_attention="fused"), nsm=nsm)(
                io.blocks, io.partial, io.delta, step.pages, step.block_table, step.seqlens, io.x_mlp)
            done(shape="k3_rank16", layer=layer, batch=batch, part=f"mla attention, splits planned for {nsm} SMs")


FRONT_N = 896 + 3584 + 2 * 384   # the router front's packed GEMM at k3_rank16: router | latent down | shared gate, up


def _front_logits(source: str):
    """The router front's fp32 GEMM output at k3_rank16, batch 8 ([8, 896 + 3584 + 2 x 384]), written by cuBLAS (as
    the layer does above batch 4) or by torch's own copy kernel."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 7168, device="cuda", generator=g).bfloat16()
    w = torch.randn(FRONT_N, 7168, device="cuda", generator=g).bfloat16()
    y = torch.mm(x, w.t(), out_dtype=torch.float32)
    if source == "torch":
        y = torch.empty_like(y).copy_(y)
    return y, torch.randn(896, device="cuda", generator=g) * 0.01


# The library GEMMs whose outputs initcheck reported as uninitialized when the next kernel read them in the layer
# (the front at batch 64, MLA's q_b at batch 8, the tail's up-projection at rank8 batch 64): (M, N, K, out dtype).
LIBRARY_GEMMS = {"front fp32 out, batch 64": (64, FRONT_N, 7168, "float32"),
                 "mla q_b, batch 8": (8, 6 * 576, 1536, "bfloat16"),
                 "moe tail up, rank8 batch 64": (64, 7168, 3584, "bfloat16")}


def _control_cells(batches, done):
    """Controls for what initcheck reports where a kernel reads a cuBLAS GEMM's output in the layer (in the layer
    the reader may start early under PDL and wait for the GEMM's grid at griddepcontrol.wait): the front's output at
    batch 8 read by torch's own reduction (does the tool follow cuBLAS's writes at all?) and by TopkFromLogits after
    a device synchronization (no overlap left); then each GEMM of LIBRARY_GEMMS alone, synchronized and read by
    torch's reduction: a report there concerns the library's writes, with none of our kernels involved."""
    import torch
    y, _ = _front_logits("cublas")
    y.sum().item()
    done(shape="-", layer=0, batch=8, part="control: cuBLAS out_dtype GEMM read by torch's sum")
    _synced_topk("cublas", done)
    g = torch.Generator(device="cuda").manual_seed(1)
    for name, (m, n, k, dt) in LIBRARY_GEMMS.items():
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        if dt == "float32":
            y = torch.mm(x, w.t(), out_dtype=torch.float32)
        else:
            y = torch.nn.functional.linear(x, w)
        torch.cuda.synchronize()
        y.float().sum().item()
        done(shape="-", layer=0, batch=m, part=f"control: {name} (cuBLAS), synchronized, read by torch's sum")


def _synced_topk(source: str, done):
    import torch
    from ..kernels.router_down_topk import topk_from_logits
    y, bias = _front_logits(source)
    torch.cuda.synchronize()
    topk_from_logits(y, bias, shared=384)
    done(shape="-", layer=0, batch=8, part=f"control: {source}-written logits, synchronized, TopkFromLogits")


_PART = {**{s: _layer_cells(s) for s in SHAPES}, "pool": _pool_cells, "mla": _mla_cells, "control": _control_cells,
         "control-torch": lambda batches, done: _synced_topk("torch", done)}


# ------------------------------------------------------------------------------------------------------ the report

# the kernel of an access (memcheck, initcheck, synccheck: "at K+0x..") or of a racecheck hazard, named once per
# hazard by its writing thread ("Write Thread (t) at K+0x..")
# (library kernels' names hold spaces: "void at::native::vectorized_elementwise_kernel<...>(int, T2, T3)+0xf0")
_KERNEL_AT = re.compile(r"^=+\s+(?:Write Thread \(\d+,\d+,\d+\) )?at (.+?)\+0x[0-9a-f]+(?: in \S+)?\s*$", re.M)
_API_ERROR = re.compile(r"Program hit (\w+) \(error \d+\)")


def parse_log(text: str) -> dict:
    """One compute-sanitizer log -> its counts: ``errors`` (the tool's total, printed or not; hazards for racecheck),
    ``api_errors`` (failed CUDA API calls, e.g. an allocation the process ran out of memory for: not kernel accesses),
    ``kernels`` (kernel name -> errors printed in it; racecheck's hazards by the kernel of their writing thread),
    ``finished`` (the tool printed its summary), racecheck's ``warnings`` (hazards it only warns of, e.g. "Warp
    Level Programming"; inside ``errors``), ``tool_failed`` (the tool itself broke: "Internal Sanitizer Error",
    which says nothing of the kernels)."""
    totals = re.findall(r"ERROR SUMMARY: (\d+) errors?\s*$", text, re.M)
    race = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    kernels: dict[str, int] = {}
    for name in _KERNEL_AT.findall(text):
        kernels[name] = kernels.get(name, 0) + 1
    errors = int(totals[-1]) if totals else (int(race[-1][1]) + int(race[-1][2]) if race else None)
    return {"errors": errors, "api_errors": len(_API_ERROR.findall(text)), "kernels": kernels,
            "finished": bool(totals or race), "app_failed": "Target application returned an error" in text,
            "warnings": int(race[-1][2]) if race else 0, "tool_failed": "Internal Sanitizer Error" in text}


def summarize(folder: str, env: dict | None = None) -> dict:
    """sanitizer-rc.txt (``tool part rc seconds budget`` per process) and the logs and launched JSONs beside it ->
    one summary: per tool and part what ran, what the tool counted and where; per tool the totals, and ``clean``
    when every part completed with no kernel error (None for "none", the launch set run without a tool)."""
    summary = {"kind": "sanitizer", **(env or {}), "tools": {}}
    with open(os.path.join(folder, "sanitizer-rc.txt")) as f:
        rows = [line.split() for line in f if line.strip()]
    for tool, part, rc, secs, budget in rows:
        stem = os.path.join(folder, f"sanitizer-{tool}-{part}")
        text = open(stem + ".log", errors="replace").read() if os.path.exists(stem + ".log") else ""
        run = json.load(open(stem + "-launched.json")) if os.path.exists(stem + "-launched.json") else {}
        log = parse_log(text)
        kernel_errors = None if log["errors"] is None else log["errors"] - log["api_errors"]
        t = summary["tools"].setdefault(tool, {"parts": {}})
        t["parts"][part] = {"rc": int(rc), "seconds": int(secs), "budget_s": int(budget),
                            "timed_out": int(rc) in (124, 137), "complete": bool(run.get("complete")),
                            "cells": len(run.get("cells", [])), "kernel_keys": len(run.get("kernel_keys", [])),
                            "errors": log["errors"], "api_errors": log["api_errors"], "kernel_errors": kernel_errors,
                            "flagged_kernels": log["kernels"], "app_failed": log["app_failed"],
                            "warnings": log["warnings"], "tool_failed": log["tool_failed"],
                            "peak_gb": max((c.get("peak_gb", 0) for c in run.get("cells", [])), default=None)}
    for tool, t in summary["tools"].items():
        parts = t["parts"].values()
        t["cells"] = sum(p["cells"] for p in parts)
        t["complete_parts"] = sorted(k for k, p in t["parts"].items() if p["complete"])
        t["kernel_errors"] = sum(p["kernel_errors"] or 0 for p in parts)
        t["warnings"] = sum(p["warnings"] for p in parts)
        t["tool_failed_parts"] = sorted(k for k, p in t["parts"].items() if p["tool_failed"])
        # "none" ran the launch set without a tool (its memory, bare): no verdict to give
        t["clean"] = None if tool == "none" else all(p["complete"] and p["kernel_errors"] == 0 for p in parts)
    return summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m k3fast.measure.sanitize", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON: the cells launched and the kernel keys compiled")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("--summarize", metavar="DIR", help="write DIR/sanitizer.json from the logs there and exit")
    a = ap.parse_args(argv)
    if a.summarize:
        env = {"gpu": os.environ.get("K3_GPU", ""), "driver": os.environ.get("K3_DRIVER", ""),
               "commit": os.environ.get("K3_COMMIT", "")}
        version = os.path.join(a.summarize, "sanitizer-version.txt")
        if os.path.exists(version):
            env["sanitizer"] = open(version).read().strip()
        s = summarize(a.summarize, env)
        with open(os.path.join(a.summarize, "sanitizer.json"), "w") as f:
            json.dump(s, f, indent=1)
        for tool, t in s["tools"].items():
            print(f"{tool}: clean={t['clean']} cells={t['cells']} kernel_errors={t['kernel_errors']} "
                  f"complete={t['complete_parts']}")
        return
    if not a.out:
        ap.error("--out is required unless --summarize is given")
    from ..kernels._dsl import COMPILE_LOG
    t0 = time.perf_counter()
    cells = launch_set(a.parts, a.batches, out=a.out)
    print(f"{len(cells)} cells, {len(COMPILE_LOG)} kernel keys, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
