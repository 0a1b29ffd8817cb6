"""Per-kernel benchmarks: each fused kernel against its byte floor and its stock counterpart, one run.

    python -m k3fast.measure.bench --shapes k3_rank16 k3_rank8 full --batches 1 8 64 --out traces/h200

Each case captures ONE call in a CUDA graph and times replays exactly as the layer traces do
(k3fast.measure.trace.time_replays: L2 flushed before each replay, median/p10/p90). Bytes are what the call
must move (weights + state read/written + activations); the floor uses the copy bandwidth measured
in the same run. Records go to ``<out>/kernels-<tag>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from k3ref import Precision, preset
from k3ref.attnres import attn_res_u
from k3ref.bytes import expert_bytes
from k3ref.weights import random_layer

from .trace import L2_POLICY, L2_WARM, capture, parse_run, replay_stats, time_replays, write_run


def _cublaslt(fn):
    """fn with torch's preferred BLAS library set to cublasLt for the call (the library the layer's cuBLAS GEMMs
    use above M = 2), then restored."""
    def call():
        old = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return fn()
        finally:
            torch.backends.cuda.preferred_blas_library(old)
    return call


def _in_proj_cases(io, w, w_in, u1, p_out, x, M: int):
    """(name, fused callable, stock callable, bytes) of the in_proj rows: each kernel of the layer's in_proj path at
    the batches where it runs, beside cuBLAS on the same bytes. M <= 2: the bulk-copy ring (the default) and the fused
    FMA kernel (its contender); M 3..8: the norm (trigger after its wait) + the tensor-core ring, and that ring bare;
    M 9..64: the norm + the WGMMA GEMM at each of the layer's pin sets that applies, and the GEMM bare. Above M = 2
    "attnres_rms_gemv" is the norm + cuBLAS pair (the layer's path where no kernel of ours applies)."""
    from ..kernels.gemm_wgmma_splitk import applicable as wgmma_applicable, gemm_wgmma
    from ..kernels.rms_gemv import attnres_rms_gemv, attnres_rmsnorm
    from ..kernels.rms_gemv_ring import attnres_rms_gemv_ring, gemv_ring_mma, mma_applicable
    d, N = w_in.shape[1], w_in.shape[0]
    fused_bytes = w_in.numel() * 2 + M * d * 2 * 4
    bare_bytes = w_in.numel() * 2 + M * d * 2
    cases = [("attnres_rms_gemv", lambda: attnres_rms_gemv(io.blocks, 1, io.partial, io.delta, u1, w.input_layernorm,
                                                           w_in, partial_out=p_out, early_trigger=True),
              lambda: F.linear(x, w_in), fused_bytes)]

    def norm(early):
        return attnres_rmsnorm(io.blocks, 1, io.partial, io.delta, u1, w.input_layernorm, partial_out=p_out,
                               early_trigger=early)[0]

    def norm_cublas():
        return _cublaslt(lambda: F.linear(norm(False), w_in))()
    if M <= 2:
        cases.append(("attnres_rms_gemv@ring",
                      lambda: attnres_rms_gemv_ring(io.blocks, 1, io.partial, io.delta, u1, w.input_layernorm, w_in,
                                                    partial_out=p_out),
                      lambda: F.linear(x, w_in), fused_bytes))
    if 2 < M and mma_applicable(M, d, N):
        cases.append(("gemv_in_proj_plain@ringmma", lambda: gemv_ring_mma(x, w_in), lambda: F.linear(x, w_in),
                      bare_bytes))
        cases.append(("attnres_rms_gemv@ringmmaet", lambda: gemv_ring_mma(norm(True), w_in), norm_cublas, fused_bytes))
    # the layer's pin sets: the plan's own, rank8's 2 x 96 rows, rank16's 4 x 112 rows above M = 16
    for tag, pins in (("", {}), ("2bn96xa", dict(ksplit=2, bn=96, xrows="auto")),
                      ("4bn112xa", dict(ksplit=4, bn=112, xrows="auto"))):
        if 8 < M and wgmma_applicable(M, d, N, **pins):
            cases.append((f"gemm_in_proj_plain@wgmma{tag}", lambda pins=pins: gemm_wgmma(x, w_in, **pins),
                          _cublaslt(lambda: F.linear(x, w_in)), bare_bytes))
            cases.append((f"attnres_rms_gemv@wgmmaet{tag}", lambda pins=pins: gemm_wgmma(norm(True), w_in, **pins),
                          norm_cublas, fused_bytes))
    return cases


def _cases(cfg, batch: int):
    """(name, fused callable, stock callable, bytes) for every fused kernel at this shape and batch."""
    from ..kernels import kda_conv_gate_step as kmod
    from .impls import make_io
    from ..kernels.kda_conv_gate_step import kda_conv_gate_step
    from ..kernels.moe_mxfp4_experts import make_workspace, moe_mxfp4_experts, prepare_mxfp4_experts
    from ..kernels.moe_tail import moe_tail
    from ..kernels.oproj_attnres import oproj_attnres
    from ..kernels.router_down_topk import (kernel_path, prepare_front_shared_weight, router_down_topk,
                                            router_down_topk_cublas, topk_from_logits)
    from ..stock.kda import stock_kda_core
    dev, d, M = "cuda", cfg.hidden_size, batch
    w = random_layer(cfg, 1, seed=3, device=dev)
    a, m = w.attn, w.mlp
    P = Precision.model()
    io = make_io(cfg, 1, M, seed=5)
    g = torch.Generator(device=dev).manual_seed(5)
    rnd = lambda *s: torch.randn(*s, generator=g, device=dev).to(torch.bfloat16)
    H, D, Pw = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_proj
    cases = []

    # 1. AttnRes + RMSNorm + packed in_proj
    rows = torch.cat([a.q_proj, a.k_proj, a.v_proj, a.g_proj, a.f_a_proj, a.b_proj])
    w_in = torch.cat([rows, rows.new_zeros(kmod.proj_width(H) - rows.shape[0], d)]).contiguous()
    u1 = attn_res_u(w.attn_res, P).float().contiguous()
    p_out = torch.empty_like(io.partial)
    x = rnd(M, d)
    cases += _in_proj_cases(io, w, w_in, u1, p_out, x, M)
    # 2. KDA core
    proj = rnd(M, w_in.shape[0])
    conv_w = torch.cat([a.q_conv, a.k_conv, a.v_conv]).view(-1, 4).float().contiguous()
    kw = {"conv_qkv": conv_w, "A_log": a.A_log, "dt_bias": a.dt_bias, "o_norm": a.o_norm}
    f = rnd(M, Pw)
    st = io.state
    state_bytes = 2 * (st.recurrent[0].numel() * 4 + st.conv[0].numel() * 2) * M
    def stock_core():
        return stock_kda_core(proj[:, :Pw], proj[:, Pw:2 * Pw], proj[:, 2 * Pw:3 * Pw], proj[:, 3 * Pw:4 * Pw], f,
                              proj[:, 4 * Pw + D:4 * Pw + D + H], st.conv, st.recurrent, io.slots, kw, head_dim=D,
                              null_slot=0)
    kda_bytes = state_bytes + a.f_b_proj.numel() * 2 + M * (proj.shape[1] + Pw) * 2
    # the default (the end trigger) and "@trig" with the early trigger, as the layer runs it
    for tag, kw_kda in (("", {}), ("@trig", {"early_trigger": True})):
        cases.append((f"kda_conv_gate_step{tag}",
                      lambda kw_kda=kw_kda: kda_conv_gate_step(proj, a.f_b_proj, conv_w, a.A_log, a.dt_bias, a.o_norm,
                                                               st.conv, st.recurrent, io.slots, heads=H, **kw_kda),
                      stock_core, kda_bytes))
    # 3. o_proj + AttnRes #2
    y = rnd(M, Pw)
    u2 = attn_res_u(w.mlp_res, P).float().contiguous()
    xo, po = torch.empty(M, d, dtype=torch.bfloat16, device=dev), torch.empty(M, d, dtype=torch.bfloat16, device=dev)
    oproj_bytes = a.o_proj.numel() * 2 + M * d * 2 * 5
    cases.append(("oproj_attnres",
                  lambda: oproj_attnres(y, a.o_proj, io.blocks, 2, io.partial, u2, w.post_attention_layernorm,
                                        out_x=xo, out_partial=po),
                  lambda: F.linear(y, a.o_proj), oproj_bytes))
    from ..kernels.gemm_wgmma_splitk import applicable as wgmma_applicable, gemm_wgmma
    if 8 < M and wgmma_applicable(M, a.o_proj.shape[1], a.o_proj.shape[0]):
        # o_proj's GEMM where the layer runs it apart from its AttnRes #2 kernel, beside cuBLAS (cublasLt)
        cases.append(("gemm_o_proj_plain@wgmma", lambda: gemm_wgmma(y, a.o_proj),
                      _cublaslt(lambda: F.linear(y, a.o_proj)), a.o_proj.numel() * 2 + M * (d + Pw) * 2))
    # 4. the MoE front: router + latent down + top-k + the shared experts' gate/up + SiTU over the packed weight.
    # The fused kernel where the layer runs it (M <= 4), the cuBLAS GEMM + TopkFromLogits at every batch, and
    # TopkFromLogits alone on a precomputed y (~16 KB per token) with the L2 flushed and (names ending "~warm") not.
    # Stock: the router and down GEMMs + torch's top-k, then the shared gate/up GEMM.
    Is = m.shared_gate.shape[0]
    front = prepare_front_shared_weight(m.gate, m.down, m.shared_gate, m.shared_up)
    bias = m.e_score_correction_bias.float().contiguous()
    sh_gu = torch.cat([m.shared_gate, m.shared_up]).contiguous()

    def stock_front():
        s = torch.sigmoid(F.linear(x, m.gate).float())
        ids = torch.topk(s + bias, cfg.num_experts_per_token, dim=-1).indices
        return F.linear(x, m.down), ids, F.linear(x, sh_gu)
    front_bytes = front.numel() * 2 + M * d * 2
    if kernel_path(M) == "fma":
        cases.append(("router_down_topk", lambda: router_down_topk(x, front, bias, shared=Is), stock_front,
                      front_bytes))
    cases.append(("router_down_topk_cublas", lambda: router_down_topk_cublas(x, front, bias, shared=Is), stock_front,
                  front_bytes))
    y_front = torch.mm(x, front.t(), out_dtype=torch.float32)
    for warm in ("", "~warm"):
        cases.append((f"topk_from_logits{warm}", lambda: topk_from_logits(y_front, bias, shared=Is),
                      lambda: torch.topk(torch.sigmoid(y_front[:, :m.gate.shape[0]]) + bias, 16),
                      y_front.numel() * 4))
    # 5. routed experts, uniform routing (distinct experts per token) and skewed (every token draws its 16 experts
    # from one hot set of 24: heavy sharing, ~24 distinct); bench_experts times the open contender beside them
    prep = prepare_mxfp4_experts(m.w1_packed, m.w1_scale, m.w3_packed, m.w3_scale, m.w2_packed, m.w2_scale)
    ws = make_workspace(cfg.routed_expert_hidden_size, dev)
    z = rnd(M, cfg.routed_expert_hidden_size)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g, device=dev)[:cfg.num_experts_per_token]
                       for _ in range(M)]).to(torch.int32)
    tw = torch.softmax(torch.randn(M, cfg.num_experts_per_token, generator=g, device=dev), -1)
    from ..stock.moe import MarlinMXFP4Experts
    built = {}

    def marlin(*args):
        # built at its first (eager, warm-up) call: vLLM's Marlin needs vLLM, which a run of other --kernels need
        # not stage
        if "fn" not in built:
            built["fn"] = MarlinMXFP4Experts(m.w1_packed, m.w1_scale, m.w3_packed, m.w3_scale, m.w2_packed,
                                             m.w2_scale, max_batch=max(M, 1))
        return built["fn"](*args)
    hot = torch.randperm(cfg.num_experts, generator=g, device=dev)[:24]
    ids_sk = torch.stack([hot[torch.randperm(24, generator=g, device=dev)[:cfg.num_experts_per_token]]
                          for _ in range(M)]).to(torch.int32)
    for tag, ids_r in (("", ids), (":skewed", ids_sk)):
        cases.append((f"moe_mxfp4_experts{tag}",
                      lambda ids_r=ids_r: moe_mxfp4_experts(z, ids_r, tw, prep, None, None, None, workspace=ws),
                      lambda ids_r=ids_r: marlin(z, ids_r, tw), int(ids_r.unique().numel()) * expert_bytes(cfg)))
    # 6. the tail: routed_expert_norm + latent up + shared down + add (the layer runs it at M <= 16; above, the
    # fast-taildsl contender does)
    h = rnd(M, cfg.shared_intermediate)
    r = rnd(M, cfg.routed_expert_hidden_size)
    fo = torch.empty(M, d, dtype=torch.bfloat16, device=dev)

    def stock_tail():
        rn = F.rms_norm(r.float(), (r.shape[-1],), m.norm.float(), cfg.rms_norm_eps).bfloat16()
        return F.linear(rn, m.up) + F.linear(h, m.shared_down)
    cases.append(("moe_tail", lambda: moe_tail(r, m.norm, m.up, h, m.shared_down, out=fo), stock_tail,
                  (m.up.numel() + m.shared_down.numel()) * 2 + M * d * 2))
    return cases, io


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["k3_rank16", "k3_rank8", "full"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--kernels", nargs="+", default=None, help="only these case names (default: all)")
    run = parse_run(ap, argv, "k3fast.measure.bench")
    if run is None:
        return 2
    args, env, bw, tag = run
    recs = []
    path = os.path.join(args.out, f"kernels-{tag}.json")
    for shape in args.shapes:
        for M in args.batches:
            cases, io = _cases(preset(shape), M)
            for name, fused, stock, nbytes in cases:
                if args.kernels and name not in args.kernels:
                    continue
                warm = name.endswith("~warm")
                row = {"kernel": name, "shape": shape, "batch": M, "bytes": int(nbytes),
                       "floor_us": round(nbytes / (bw * 1e12) * 1e6, 3), "copy_tbps": round(bw, 4),
                       "l2": L2_WARM if warm else L2_POLICY}
                for impl, fn in (("fast", fused), ("stock", stock)):
                    try:
                        g = capture(fn)
                        row.update(replay_stats(time_replays(g, io.reset, args.replays, flush=not warm), f"{impl}_"))
                    except Exception as ex:
                        row[f"{impl}_error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
                if "fast_us_median" in row:
                    row["fast_over_floor"] = round(row["fast_us_median"] / row["floor_us"], 3)
                    row["achieved_tbps"] = round(nbytes / (row["fast_us_median"] * 1e-6) / 1e12, 3)
                if "fast_us_median" in row and "stock_us_median" in row:
                    row["speedup_vs_stock"] = round(row["stock_us_median"] / row["fast_us_median"], 3)
                recs.append({**{k: env[k] for k in ("gpu", "driver", "torch", "cutlass", "commit", "date")}, **row})
                print(json.dumps(row), flush=True)
            del cases, io
            torch.cuda.empty_cache()
            write_run(path, env, bw, recs)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
