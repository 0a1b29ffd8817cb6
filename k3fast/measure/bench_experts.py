"""Design-space probe of the routed-experts kernel (k3fast.kernels.moe_mxfp4_experts) on the GPU.

    python -m k3fast.measure.bench_experts --shapes k3_rank16 --batches 1 8 64 --out traces/h200

Why: v3 measured 0.6-1.2 TB/s where the issue asks for >= 75 % of the copy bandwidth, and the z-in-smem change
predicted to fix it moved it by only 1-15 % (LOG.md). Each CTA streams ~6-7 GB/s at every batch. The candidate
causes give different signatures, and one run of this module separates them:

* ``probe``  the same kernel with decode + MMA replaced by an XOR fold of the loaded words: if it is not much
             faster, the time is in the load pipeline / barriers / combine, not in the arithmetic;
* ``C2 C4 C8`` cluster size: if clusters of C CTAs cannot all be co-resident (GPCs of 16-18 SMs hold
             floor(n / C) clusters), the last clusters run as a second wave and the time doubles at some C;
* ``C4N120`` (letter N) the SMs the grid may fill: 30 clusters of 4, all co-resident, where C4 asks for 33;
* ``D4 D12`` register ring depth: loads in flight per lane; a latency-bound loop scales with D (D12 spills
             40-64 bytes, ptxas 4.8.1). At v7's b1 / b2 (experts-26465c5-s16.json, one run) D12 D16 W8D16 W8D28
             were all slower than D = 8 (rank16 b1 22.3 / 21.8 / 22.1 / 23.2 against 21.2 us; only rank8 b2 D12
             under it, 40.4 against 41.4);
* ``W8`` 8 warps per CTA: the default until e384fbf (16 since);
* ``W16D4 W16D8`` 16 warps per CTA (512 threads, so ptxas caps registers at 128; 12-60 bytes of spills): twice
             the warps per SM to hide the decode/MMA dependency chain;
* ``nibble`` the default kernel decoding the nibble layout (PRMT table, fp32 per-block scales): the default
             until the rot layout (2026-11-29), so the decode change is an A/B in one run;
* ``v2 v3``  earlier versions (v3 is v4 without the copy-free ring) on the same inputs;
* ``default`` the kernel the layer runs (v5 with C = 2 above batch 2 since session 31, v4 before, as v5.2 at
             buckets 4 / 8 since session 33; v7 / v8 at
             batch buckets <= 2), the reference
             for ``max_abs_diff_vs_default``; ``v3C8 v3C4`` are the defaults of before;
* ``A0``     v5.1 (v5's passes only) where the default is v5.2 (buckets 4 / 8: v7's items when the passes are few);
* ``v5 v5W16D8`` single passes (expert, <= NT pairs) as work items instead of whole experts (the default above
             batch 2 since session 31; it matters
             with ``--routing skewed``, where ~24 experts hold every pair);
* ``v6 v6probe`` (batch buckets <= 2) each expert split over two clusters by I: 32 clusters of 4 (128 SMs) at b1
             instead of 16 (64 SMs); opt-in, the version log has the prediction;
* ``v7 v7probe v7P2`` (batch buckets <= 8; <= 2 until session 31) each expert split into NH parts of I over clusters of 2 (rank16 b1: 4
             parts, 64 clusters = 128 SMs, all co-resident), the parts' partials added by the pair's last part;
             ``v7P2`` takes 2 parts (64 SMs at b1, as the default) to separate the split's cost from the SMs';
* ``R1 R1probe R1sortprobe`` (batch 1) route1: the token's 16 pairs as segments straight from the ids, no counting
             sort (the default at batch 1 since session 11); its stream probe, and the probe stopped after its
             routing; ``S1 S1probe S1sortprobe`` the same with the counting sort (the default before);
* ``NRF NRFprobe`` ring_fit off: FC1's and FC2's rings at the full depth D = 8 (the default before session 13 at
             batch buckets > 2, before session 14 at <= 2; the default fits each ring to its K steps per unit,
             rank8 b64: 7 and 6, rank16 b1: 7 and 8, so that no step divides), and its stream probe. Session 14's
             s29 ran the v7 A/B the other way round as ``RF7 RF7probe`` (at fdcdffc, where v7's default was the
             full ring);
* ``sortprobe fc1probe fc2probe`` (and ``v4...``): the stream probe stopped after the routing sort, after FC1 and
             the h exchange, or after FC2 (no part reduction / combine): the stages of the b1 latency chain;
* ``PARK PARK<KB>`` (v7, batch buckets <= 2) the park probe: after its first FC2 each CTA bulk-copies weights nobody
             reads into its unused shared memory (all that fits in 16 KB chunks, or <KB> KB), during the part
             reduction and the combine; the output is the default's. What parking the tail's weights in the
             experts kernel would cost its chain (k3fast/LOG.md, session 17);
* ``pad<KB>`` (e.g. ``pad4``, ``v4pad4``) the same kernel asking for <KB> more shared memory that it never uses:
             where that takes it to a larger carve-out step (k3fast.kernels._dsl.carveout_kb; rank8 b64 sits 80 B under the
             196 KB step), the L1 left beside it drops (60 -> 28 KB there), and the row times what that L1 is
             worth; each row records ``smem_bytes`` and ``l1_kb`` (version log v5.1);
* ``Dprobe4`` the stream probe at ring depth 4: with ``probe`` and ``D4 D12 D16`` it tells whether the loop at
             C = 2 is bound by loads in flight (time moves with D) or by issue (the probe is much faster than
             the kernel at every D).

Every variant runs on the same inputs (uniform routing) in one process; times are median CUDA-graph replays with
the L2 flushed (k3fast.measure.trace.time_replays); Marlin (the stock path) is timed beside them. Writes
``experts-<tag>.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

import torch

from k3ref import preset
from k3ref.weights import random_layer

VARIANTS = ("default", "A0", "nibble", "v3", "v5", "v6", "v6probe", "v7", "v7probe", "v7P2", "probe", "C2", "C4", "C8", "D4", "D12", "D16", "W8", "W16D4", "W16D8", "v5W16D8", "Dprobe4",
            "v3C8", "v3C4", "v2", "R1", "R1probe", "R1sortprobe", "S1", "S1probe", "S1sortprobe", "NRF", "NRFprobe",
            "PARK", "PARK64", "v8", "v8probe", "v8fc1probe", "v8tag", "v8tagfc1probe", "LEAN", "v7LEAN", "pad4",
            "v4pad4")


def variant_cfg(name: str, base):
    """The KernelCfg of a variant name, derived from the default key ``base``."""
    if name == "default":
        return base
    if name == "probe":
        return dataclasses.replace(base, probe="stream", alt_parts=0)     # (the probes time v5's passes)
    if name.endswith("nibble"):              # e.g. nibble, W16D8nibble: the same kernel on the nibble layout
        return dataclasses.replace(variant_cfg(name[:-len("nibble")] or "default", base), layout="nibble")
    stage = re.fullmatch(r"(.*?)(sort|fc1|fc2)probe", name)
    if stage:                                # e.g. fc1probe, v4sortprobe: the stream probe stopped after a stage
        return dataclasses.replace(variant_cfg(stage.group(1) or "default", base), probe=stage.group(2), alt_parts=0)
    if name.endswith("probe") and name != "probe":
        return dataclasses.replace(variant_cfg(name[:-len("probe")], base), probe="stream", alt_parts=0)
    if name.startswith("Dprobe"):            # the stream probe at another ring depth, e.g. Dprobe4
        return dataclasses.replace(base, probe="stream", D=int(name[len("Dprobe"):]), alt_parts=0)
    park = re.fullmatch(r"PARK(\d*)", name)
    if park:                                 # the park probe: PARK (all the free shared memory) or PARK<KB>
        from ..kernels.moe_mxfp4_experts import park_max
        if base.version != 7:
            raise ValueError(f"PARK (the park probe) serves version 7 (batch buckets <= 2), got v{base.version}")
        return dataclasses.replace(base, park=int(park.group(1)) * 1024 if park.group(1) else park_max(base))
    pad = re.fullmatch(r"(.*?)pad(\d+)", name)
    if pad:                                  # e.g. pad4, v4pad4: <KB> of shared memory nobody uses (a larger carve-out)
        return dataclasses.replace(variant_cfg(pad.group(1) or "default", base), smem_pad=int(pad.group(2)) * 1024)
    if name.endswith("LEAN"):                # lean_arrive: no per-thread fence before the arrivals (e.g. v7LEAN)
        return dataclasses.replace(variant_cfg(name[:-len("LEAN")] or "default", base), lean_arrive=True)
    if name.endswith("tag"):                 # v8.3: v8's h exchange through tagged words (e.g. v8tag)
        kc = variant_cfg(name[:-len("tag")], base)
        if kc.version != 8:
            raise ValueError(f"{name}: tagged is a version 8 option, got v{kc.version}")
        return dataclasses.replace(kc, tagged=True)
    if name == "R1":                         # route1 (batch 1's pairs as segments, no counting sort)
        return dataclasses.replace(base, route_direct=True)
    if name == "NRF":                        # ring_fit off: both rings at the full depth D
        from ..kernels.moe_mxfp4_experts import RING_FIT_VERSIONS
        if base.version not in RING_FIT_VERSIONS:
            raise ValueError(f"NRF (ring_fit off) differs from the default at versions {RING_FIT_VERSIONS} only, "
                             f"got v{base.version}")
        return dataclasses.replace(base, ring_fit=False)
    if name == "S1":                         # the counting sort at batch 1 (route1 off; other buckets always sort)
        if base.MB != 1:
            raise ValueError(f"S1 (route_direct off) differs from the default at batch bucket 1 only, got MB={base.MB}")
        return dataclasses.replace(base, route_direct=False)
    parts = re.fullmatch(r"((?:[CDWvPNA]\d+)+)", name)
    if parts:                # e.g. C2, D4, W16D4, v4, v4W16D4, v7P2, C4N120, A0: cluster size, ring depth, warps,
        #                      version, parts, N: the SMs the grid may fill (Q = N / C clusters: C4N120 is 30 clusters
        #                      of 4, all co-resident, where C4 alone asks for 33), and A: v5.2's parts (A0 is v5.1)
        kw = {k: int(v) for k, v in re.findall(r"([CDWvPNA])(\d+)", name)}
        if "N" in kw:
            kw["nsm"] = kw.pop("N")
        if "A" in kw:
            kw["alt_parts"] = kw.pop("A")
        elif kw.get("v", 5) != 5 or kw.get("C", base.C) != base.C:
            kw["alt_parts"] = 0              # v5.2's v7 items belong to v5 on v7's clusters of 2 (alt_parts_rule)
        if "v" in kw:
            kw["version"] = kw.pop("v")
            if kw["version"] < 4:            # versions 2-3: the nibble layout only, and 8 warps as they ran
                kw["layout"] = "nibble"
                kw.setdefault("W", 8)
        if "P" in kw:
            kw["parts"] = kw.pop("P")
        if kw.get("version") in (7, 8):      # v7 / v8's own cluster and parts defaults (compile_key's)
            from ..kernels.moe_mxfp4_experts import V7_CLUSTER, default_parts
            kw.setdefault("C", V7_CLUSTER)
            kw.setdefault("parts", default_parts(base.I, base.MB, kw["C"], base.nsm))
        elif "version" in kw:                # another version named: one part (only v7 / v8 split)
            kw["parts"] = 1
        if "version" in kw:                  # the named version's ring_fit default (compile_key's rule)
            from ..kernels.moe_mxfp4_experts import ring_fit_rule
            kw["ring_fit"] = ring_fit_rule(None, kw["version"])
        return dataclasses.replace(base, **kw)
    raise ValueError(f"unknown variant {name!r}; expected one of {VARIANTS} or letters C/D/W with numbers")


def main(argv=None) -> int:
    from ..kernels.moe_mxfp4_experts import (compile_key, distinct_expert_bytes, make_workspace, moe_mxfp4_experts,
                                    prepare_mxfp4_experts)
    from ..stock.moe import MarlinMXFP4Experts
    from .trace import L2_POLICY, capture, parse_run, replay_stats, time_replays, write_run
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["k3_rank16"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--routing", choices=("uniform", "skewed"), default="uniform",
                    help="skewed: every token draws its 16 experts from one hot set of 24")
    run = parse_run(ap, argv, "k3fast.measure.bench_experts")
    if run is None:
        return 2
    args, env, bw, tag = run
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    path = os.path.join(args.out, f"experts-{tag}" + ("" if args.routing == "uniform" else f"-{args.routing}") + ".json")
    recs = []
    for shape in args.shapes:
        cfg = preset(shape)
        m = random_layer(cfg, 1, seed=3, device="cuda").mlp
        preps = {lay: prepare_mxfp4_experts(m.w1_packed, m.w1_scale, m.w3_packed, m.w3_scale, m.w2_packed,
                                            m.w2_scale, layout=lay) for lay in ("rot", "nibble")}
        ws = make_workspace(cfg.routed_expert_hidden_size, "cuda")
        g = torch.Generator(device="cuda").manual_seed(5)
        for M in args.batches:
            try:
                marlin = MarlinMXFP4Experts(m.w1_packed, m.w1_scale, m.w3_packed, m.w3_scale, m.w2_packed,
                                            m.w2_scale, max_batch=M)
            except ImportError as ex:     # a staging without vLLM: our variants still compare among themselves
                print(f"  {shape} b{M} marlin: skipped ({ex})", flush=True)
                marlin = None
            z = torch.randn(M, cfg.routed_expert_hidden_size, generator=g, device="cuda").bfloat16()
            if args.routing == "skewed":
                hot = torch.randperm(cfg.num_experts, generator=g, device="cuda")[:24]
                ids = torch.stack([hot[torch.randperm(24, generator=g, device="cuda")[:cfg.num_experts_per_token]]
                                   for _ in range(M)]).to(torch.int32)
            else:
                ids = torch.stack([torch.randperm(cfg.num_experts, generator=g, device="cuda")[:cfg.num_experts_per_token]
                                   for _ in range(M)]).to(torch.int32)
            tw = torch.softmax(torch.randn(M, cfg.num_experts_per_token, generator=g, device="cuda"), -1)
            nbytes = distinct_expert_bytes(ids, cfg)
            base = compile_key(cfg.num_experts, cfg.routed_expert_hidden_size, cfg.expert_intermediate, M, nsm=nsm,
                               situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta)
            fns = {} if marlin is None else {"marlin": lambda: marlin(z, ids, tw)}
            kcfgs = {}
            for v in args.variants:
                try:
                    kc = variant_cfg(v, base)
                except ValueError as ex:          # e.g. a cluster size that does not divide the tiles
                    print(f"  {shape} b{M} {v}: skipped ({ex})", flush=True)
                    continue
                if v != "default" and kc == base:
                    print(f"  {shape} b{M} {v}: same kernel as default, not timed twice", flush=True)
                    continue
                kcfgs[v] = kc
                fns[v] = (lambda kc=kc: moe_mxfp4_experts(z, ids, tw, preps[kc.layout], None, None, None, workspace=ws,
                                                          situ_beta=cfg.situ_beta,
                                                          situ_linear_beta=cfg.situ_linear_beta, kernel_cfg=kc))
            ref_out = None
            for name, fn in fns.items():
                row = {"shape": shape, "batch": M, "variant": name, "routing": args.routing, "bytes": nbytes,
                       "copy_tbps": round(bw, 4),
                       "floor_us": round(nbytes / (bw * 1e12) * 1e6, 3), "l2": L2_POLICY}
                if name in kcfgs:
                    row["kernel_cfg"] = dataclasses.asdict(kcfgs[name])
                    row["smem_bytes"], row["l1_kb"] = kcfgs[name].smem_bytes, kcfgs[name].l1_kb
                try:
                    out = fn().clone()
                    if name == "default":
                        ref_out = out
                    elif ref_out is not None and "probe" not in name:
                        row["max_abs_diff_vs_default"] = float((out.float() - ref_out.float()).abs().max())
                    gr = capture(fn)
                    row.update(replay_stats(time_replays(gr, lambda: None, args.replays)))
                    row["achieved_tbps"] = round(nbytes / (row["us_median"] * 1e-6) / 1e12, 3)
                    del gr
                except Exception as ex:
                    row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
                recs.append({**{k: env[k] for k in ("gpu", "driver", "torch", "cutlass", "commit", "date")}, **row})
                print(json.dumps({k: row.get(k) for k in ("shape", "batch", "variant", "us_median", "achieved_tbps",
                                                          "floor_us", "max_abs_diff_vs_default", "error")}), flush=True)
            write_run(path, env, bw, recs)
            del marlin
            torch.cuda.empty_cache()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
