"""The routed-experts kernel (k3fast.kernels.moe_mxfp4_experts) beside its open contender and the stock path, on
the same inputs in one run.

    python -m k3fast.measure.bench_experts --shapes k3_rank16 k3_rank8 full --batches 1 4 8 64

Variants (VARIANTS):

* ``default``      the kernel the layer runs;
* ``passes-only``  alt_parts=0: at buckets 4 / 8 the passes alone, without the alternate "parts" items. Still
                   being decided: the alternate items take 7-39 % off skewed routing but cost +4.3 % at uniform
                   rank16 b8, which is not explained (docs/kernels/moe_mxfp4_experts.md). Timed only at the buckets
                   where its kernel differs from the default's;
* ``marlin``       vLLM's Marlin MXFP4 MoE (k3fast.stock.moe.MarlinMXFP4Experts), the stock path (skipped without
                   vLLM).

Routings (``--routing``): ``uniform`` (16 distinct experts per token) and ``skewed`` (every token draws its 16 from
one hot set of 24, so few experts hold every pair). Times are median CUDA-graph replays with the L2 flushed
(k3fast.measure.trace.time_replays). Writes ``experts-<tag>.json`` (uniform) and ``experts-<tag>-skewed.json``,
one record per (shape, batch, variant), ``max_abs_diff_vs_default`` on the default's output.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

from k3ref import preset
from k3ref.weights import random_layer

VARIANTS = ("default", "passes-only", "marlin")
ROUTINGS = ("uniform", "skewed")
HOT_EXPERTS = 24        # skewed routing: every token draws its experts from this many


def kernel_variants(cfg, M: int, nsm: int = 132) -> dict:
    """{variant: (compile key, moe_mxfp4_experts keyword arguments)} of our kernel at batch M: the default, and
    passes-only where its key differs (buckets 4 / 8)."""
    from ..kernels.moe_mxfp4_experts import compile_key
    dims = (cfg.num_experts, cfg.routed_expert_hidden_size, cfg.expert_intermediate, M)
    sb = dict(nsm=nsm, situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta)
    out = {"default": (compile_key(*dims, **sb), {})}
    alone = compile_key(*dims, alt_parts=0, **sb)
    if alone != out["default"][0]:
        out["passes-only"] = (alone, {"alt_parts": 0})
    return out


def routing_ids(cfg, M: int, kind: str, g: torch.Generator, device="cuda") -> torch.Tensor:
    """topk_ids [M, 16] int32: distinct experts per token, drawn from all experts (uniform) or one hot set
    (skewed)."""
    k, n = cfg.num_experts_per_token, cfg.num_experts
    if kind == "skewed":
        hot = torch.randperm(n, generator=g, device=device)[:HOT_EXPERTS]
        rows = [hot[torch.randperm(HOT_EXPERTS, generator=g, device=device)[:k]] for _ in range(M)]
    elif kind == "uniform":
        rows = [torch.randperm(n, generator=g, device=device)[:k] for _ in range(M)]
    else:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {kind!r}")
    return torch.stack(rows).to(torch.int32)


def main(argv=None) -> int:
    from ..kernels.moe_mxfp4_experts import (distinct_expert_bytes, make_workspace, moe_mxfp4_experts,
                                             prepare_mxfp4_experts)
    from ..stock.moe import MarlinMXFP4Experts
    from .trace import L2_POLICY, capture, parse_run, replay_stats, time_replays, write_run
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["k3_rank16", "k3_rank8", "full"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8, 64])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--routing", nargs="+", default=list(ROUTINGS), choices=ROUTINGS)
    ap.add_argument("--replays", type=int, default=30)
    run = parse_run(ap, argv, "k3fast.measure.bench_experts")
    if run is None:
        return 2
    args, env, bw, tag = run
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    for routing in args.routing:
        path = os.path.join(args.out, f"experts-{tag}" + ("" if routing == "uniform" else f"-{routing}") + ".json")
        recs = []
        for shape in args.shapes:
            cfg = preset(shape)
            m = random_layer(cfg, 1, seed=3, device="cuda").mlp
            prep = prepare_mxfp4_experts(m.w1_packed, m.w1_scale, m.w3_packed, m.w3_scale, m.w2_packed, m.w2_scale)
            ws = make_workspace(cfg.routed_expert_hidden_size, "cuda")
            g = torch.Generator(device="cuda").manual_seed(5)
            for M in args.batches:
                z = torch.randn(M, cfg.routed_expert_hidden_size, generator=g, device="cuda").bfloat16()
                ids = routing_ids(cfg, M, routing, g)
                tw = torch.softmax(torch.randn(M, cfg.num_experts_per_token, generator=g, device="cuda"), -1)
                nbytes = distinct_expert_bytes(ids, cfg)
                fns, keys = {}, {}
                for name, (key, kw) in kernel_variants(cfg, M, nsm).items():
                    if name in args.variants:
                        keys[name] = key
                        fns[name] = (lambda kw=kw: moe_mxfp4_experts(
                            z, ids, tw, prep, None, None, None, workspace=ws, situ_beta=cfg.situ_beta,
                            situ_linear_beta=cfg.situ_linear_beta, **kw))
                marlin = None
                if "marlin" in args.variants:
                    try:
                        marlin = MarlinMXFP4Experts(m.w1_packed, m.w1_scale, m.w3_packed, m.w3_scale, m.w2_packed,
                                                    m.w2_scale, max_batch=M)
                        fns["marlin"] = lambda: marlin(z, ids, tw)
                    except ImportError as ex:     # a staging without vLLM: our variants still compare
                        print(f"  {shape} b{M} marlin: skipped ({ex})", flush=True)
                ref_out = None
                for name, fn in fns.items():
                    row = {"shape": shape, "batch": M, "variant": name, "routing": routing, "bytes": nbytes,
                           "copy_tbps": round(bw, 4), "floor_us": round(nbytes / (bw * 1e12) * 1e6, 3),
                           "l2": L2_POLICY}
                    if name in keys:
                        row["kernel_cfg"] = dataclasses.asdict(keys[name])
                        row["smem_bytes"], row["l1_kb"] = keys[name].smem_bytes, keys[name].l1_kb
                    try:
                        out = fn().clone()
                        if name == "default":
                            ref_out = out
                        elif ref_out is not None:
                            row["max_abs_diff_vs_default"] = float((out.float() - ref_out.float()).abs().max())
                        gr = capture(fn)
                        row.update(replay_stats(time_replays(gr, lambda: None, args.replays)))
                        row["achieved_tbps"] = round(nbytes / (row["us_median"] * 1e-6) / 1e12, 3)
                        del gr
                    except Exception as ex:
                        row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
                    recs.append({**{k: env[k] for k in ("gpu", "driver", "torch", "cutlass", "commit", "date")},
                                 **row})
                    print(json.dumps({k: row.get(k) for k in ("routing", "shape", "batch", "variant", "us_median",
                                                              "achieved_tbps", "floor_us", "max_abs_diff_vs_default",
                                                              "error")}), flush=True)
                write_run(path, env, bw, recs)
                del marlin
                torch.cuda.empty_cache()
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
