"""Launch one fused kernel a few times on fresh random inputs, for Nsight Compute to profile (no timing here).

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section WarpStateStats ... \
        python3 scripts/ncu_cases.py kda --shape k3_rank16 --batch 64 [--late 0|1] [--trig 0|1]
    ncu ... python3 scripts/ncu_cases.py experts --shape k3_rank16 --batch 1 [--probe sort|fc1|fc2|stream]
    ncu ... python3 scripts/ncu_cases.py tail --shape k3_rank16 --batch 1
    ncu ... python3 scripts/ncu_cases.py bench --kernel attnres_rms_gemv --shape k3_rank16 --batch 1
    ncu ... python3 scripts/ncu_cases.py bench --kernel gemv_in_proj_plain --shape k3_rank8 --stock 1

Each case makes its inputs once (random, never zeros) and launches the kernel --launches times with a device
synchronize between launches; only the last launch runs inside the NVTX range "profile", so ncu's NVTX filter
profiles that one and neither the compile-time launch nor the input set-up kernels. ncu flushes the
caches before each replay pass by default (--cache-control all), so the profiled launch reads from HBM like the
flushed bench replays. scripts/h200_next.sh names the runs and their ncu options.
"""
from __future__ import annotations

import argparse
import sys

import torch


def kda_case(cfg, M: int, late_stores=None, early_trigger: bool = False, dev: str = "cuda"):
    from k3fast.kernels.kda_conv_gate_step import kda_conv_gate_step, proj_width
    H, D = cfg.kda_heads, cfg.kda_head_dim
    P = H * D
    g = torch.Generator(device=dev).manual_seed(1)
    proj = torch.randn(M, proj_width(H), generator=g, device=dev).bfloat16()
    w_fb = (torch.randn(P, D, generator=g, device=dev) * 0.05).bfloat16()
    conv_w = torch.randn(3 * P, 4, generator=g, device=dev) * 0.5
    a_log = torch.rand(H, generator=g, device=dev) * 2.0
    dt_bias = torch.randn(P, generator=g, device=dev) * 0.5
    o_norm = 1.0 + 0.2 * torch.randn(D, generator=g, device=dev)
    S = M + 1
    conv = torch.randn(S, 3 * P, 3, generator=g, device=dev).bfloat16()
    rec = torch.randn(S, H, D, D, generator=g, device=dev) * 0.05
    slots = torch.randperm(S, generator=g, device=dev)[:M].to(torch.int32)
    out = torch.empty(M, P, dtype=torch.bfloat16, device=dev)
    return lambda: kda_conv_gate_step(proj, w_fb, conv_w, a_log, dt_bias, o_norm, conv, rec, slots, heads=H,
                                      out=out, late_stores=late_stores, early_trigger=early_trigger)


def experts_case(cfg, M: int, probe: str = ""):
    """The experts kernel at its default key, or one of its stage probes (moe_mxfp4_experts.PROBES: the stream
    probe stopped after the routing, after FC1 and the h exchange, or after FC2; wrong outputs, timing only)."""
    import dataclasses

    from k3ref.weights import random_layer
    from k3fast.kernels.moe_mxfp4_experts import compile_key, make_workspace, moe_mxfp4_experts, prepare_mxfp4_experts
    m = random_layer(cfg, 1, seed=3, device="cuda").mlp
    prep = prepare_mxfp4_experts(m.w1_packed, m.w1_scale, m.w3_packed, m.w3_scale, m.w2_packed, m.w2_scale)
    ws = make_workspace(cfg.routed_expert_hidden_size, "cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    z = torch.randn(M, cfg.routed_expert_hidden_size, generator=g, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g, device="cuda")[:cfg.num_experts_per_token]
                       for _ in range(M)]).to(torch.int32)
    tw = torch.softmax(torch.randn(M, cfg.num_experts_per_token, generator=g, device="cuda"), -1)
    key = None
    if probe:
        key = dataclasses.replace(compile_key(cfg.num_experts, cfg.routed_expert_hidden_size, cfg.expert_intermediate,
                                              M, situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta),
                                  probe=probe)
    return lambda: moe_mxfp4_experts(z, ids, tw, prep, None, None, None, workspace=ws, situ_beta=cfg.situ_beta,
                                     situ_linear_beta=cfg.situ_linear_beta, kernel_cfg=key)


def tail_case(cfg, M: int, ring=None, dev: str = "cuda"):
    from k3fast.kernels.moe_tail import moe_tail
    g = torch.Generator(device=dev).manual_seed(7)
    dL, Hd, Is = cfg.routed_expert_hidden_size, cfg.hidden_size, cfg.shared_intermediate
    r = torch.randn(M, dL, generator=g, device=dev).bfloat16()
    w_norm = (1.0 + 0.1 * torch.randn(dL, generator=g, device=dev)).bfloat16()
    w_up = (torch.randn(Hd, dL, generator=g, device=dev) * 0.02).bfloat16()
    h = torch.randn(M, Is, generator=g, device=dev).bfloat16()
    w_sd = (torch.randn(Hd, Is, generator=g, device=dev) * 0.02).bfloat16()
    return lambda: moe_tail(r, w_norm, w_up, h, w_sd, ring=ring)


def bench_case(cfg, M: int, name: str, stock: bool = False):
    """Any case of k3fast.measure.bench (the per-kernel bench's inputs and call), e.g. attnres_rms_gemv or
    router_down_topk+shared; stock: the case's stock counterpart instead (e.g. cuBLAS's GEMV on the same x and
    weights for gemv_in_proj_plain)."""
    from k3fast.measure.bench import _cases
    cases, _ = _cases(cfg, M)
    found = {c[0]: c[2] if stock else c[1] for c in cases}
    if name not in found:
        raise SystemExit(f"no k3fast.measure.bench case {name!r} at this shape / batch; have: {sorted(found)}")
    return found[name]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=("kda", "experts", "tail", "bench"))
    ap.add_argument("--kernel", default=None, help="bench: the k3fast.measure.bench case name")
    ap.add_argument("--shape", default="k3_rank16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--late", type=int, choices=(0, 1), default=None, help="kda: v5's late write-backs off / on")
    ap.add_argument("--trig", type=int, choices=(0, 1), default=0, help="kda: the early PDL trigger (the layer's)")
    ap.add_argument("--ring", type=int, default=None, help="tail: moe_tail v5's ring depth (0 = v1)")
    ap.add_argument("--stock", type=int, choices=(0, 1), default=0, help="bench: profile the case's stock counterpart")
    ap.add_argument("--probe", default="", choices=("", "stream", "sort", "fc1", "fc2"),
                    help="experts: one of the kernel's stage probes instead of the kernel")
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("scripts/ncu_cases.py needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, ".")
    from k3fast.measure.bench import preset
    cfg = preset(args.shape)
    if args.case == "kda":
        fn = kda_case(cfg, args.batch, None if args.late is None else bool(args.late), bool(args.trig))
    elif args.case == "experts":
        fn = experts_case(cfg, args.batch, args.probe)
    elif args.case == "tail":
        fn = tail_case(cfg, args.batch, args.ring)
    else:
        fn = bench_case(cfg, args.batch, args.kernel, bool(args.stock))
    for i in range(args.launches):
        if i == args.launches - 1:
            torch.cuda.nvtx.range_push("profile")   # ncu --nvtx --nvtx-include "profile/": only this launch
        fn()
        torch.cuda.synchronize()
        if i == args.launches - 1:
            torch.cuda.nvtx.range_pop()
    print(f"{args.case} {args.shape} b{args.batch}: {args.launches} launches", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
