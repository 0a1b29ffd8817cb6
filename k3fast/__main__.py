"""The main job: ``python -m k3fast``.

1. runs one decode step of a KDA+MoE and an MLA+MoE layer of the reference at tiny() size and checks it
   against the fp64 reference;
2. compiles every fused CuTe DSL kernel at batch 1 for sm_90a (no GPU needed);
3. renders the recorded H200 trace comparison from traces/ (table + plots);
4. with a GPU present, also traces one live batch-1 k3_rank(16) KDA+MoE layer (ref vs stock).
"""
from __future__ import annotations

import os
import sys
import time

import torch


def reference_demo() -> None:
    from k3ref import K3DecoderLayer, Precision, ResidualStream, allocate_state, random_layer, tiny
    from k3ref.compare import rel_rmse
    cfg = tiny()
    for layer in (1, 3):
        outs = {}
        for P in (Precision.model(), Precision.exact()):
            w = random_layer(cfg, layer, seed=0)
            st = allocate_state(cfg, layer, 4, max_len=16, P=P)
            g = torch.Generator().manual_seed(0)
            emb = torch.randn(3, cfg.hidden_size, generator=g, dtype=torch.float64).to(P.io_dtype)
            s = ResidualStream.from_embeddings(emb, cfg.max_blocks)
            s.delta = (0.5 * torch.randn(3, cfg.hidden_size, generator=g, dtype=torch.float64)).to(P.io_dtype)
            L = K3DecoderLayer(cfg, w, P)
            for _ in range(3):
                L.decode_step(s, st, torch.tensor([0, 2, -1]))
            outs[P.compute] = s.delta
        err = rel_rmse(outs[torch.float32], outs[torch.float64])
        print(f"  reference {L.kind} layer {layer} (tiny): 3 decode steps, BF16 model vs fp64 rel err {err:.2e}")


def batch1_warmups():
    """(module, description, thunk) compiling each fused kernel's k3_rank(16) batch-1 key(s) for sm_90a."""
    from k3ref import k3_rank
    c = k3_rank(16)
    d = c.hidden_size

    def rms():
        from .kernels import kda_conv_gate_step as kmod
        from .kernels import rms_gemv
        n = kmod.proj_width(c.kda_heads)
        rms_gemv.warmup([(n, d)], [1], attnres_K=d, attnres_N=(n,), n_blocks=[1], block_write=(-1,), deltas=(True,),
                        early_trigger=True)     # as the layer calls its in_proj (FastImpl attn_early_trigger)
    def ring():
        from .kernels import kda_conv_gate_step as kmod
        from .kernels import rms_gemv_ring
        key = rms_gemv_ring.compile_key(1, d, kmod.proj_width(c.kda_heads), True, 1, True, -1, "bf16", c.rms_norm_eps,
                                        early_trigger=True)
        rms_gemv_ring._compile(key)
    return [
        ("rms_gemv_ring", "AttnRes + RMSNorm + packed in_proj, weights through a bulk-copy ring (M <= 2)", ring),
        ("rms_gemv", "AttnRes + RMSNorm + packed in_proj GEMV", rms),
        ("kda_conv_gate_step", "KDA core (conv, gates, delta rule, gated norm)",
         lambda: __import__("k3fast.kernels.kda_conv_gate_step", fromlist=["x"]).warmup(c.kda_heads, [1], early_trigger=True)),
        ("oproj_attnres", "o_proj + partial sum + AttnRes #2 + RMSNorm",
         lambda: __import__("k3fast.kernels.oproj_attnres", fromlist=["x"]).warmup([c.kda_proj], [2], [1])),
        ("router_down_topk", "router + latent down + top-16",
         lambda: __import__("k3fast.kernels.router_down_topk", fromlist=["x"]).warmup([1])),
        ("moe_mxfp4_experts", "MXFP4 routed experts + combine",
         lambda: __import__("k3fast.kernels.moe_mxfp4_experts", fromlist=["x"]).warmup(c, [1], nsm=132)),
        ("moe_tail", "shared gate/up + SiTU; routed norm + up + shared down + add",
         lambda: __import__("k3fast.kernels.moe_tail", fromlist=["x"]).warmup(c.shared_intermediate, [1])),
    ]


def compile_kernels() -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from k3fast.kernels._dsl import COMPILE_LOG, dsl_available
    if not dsl_available():
        print("  CuTe DSL (nvidia-cutlass-dsl + apache-tvm-ffi) not installed: skipping (pip install -e '.[gpu]')")
        return
    for name, what, thunk in batch1_warmups():
        t, n0 = time.time(), len(COMPILE_LOG)
        try:
            thunk()
            print(f"  {name:20s} {what}: {len(COMPILE_LOG) - n0} kernel(s) compiled for sm_90a in {time.time() - t:.1f} s")
        except Exception as ex:      # report and go on: one broken kernel must not hide the others
            print(f"  {name:20s} compile FAILED: {type(ex).__name__}: {str(ex)[:300]}")


def main() -> int:
    print("1. reference layer")
    reference_demo()
    print("2. fused kernels")
    compile_kernels()
    print("3. recorded H200 traces")
    from k3fast.measure import report
    report.main(["--print-only"])
    if torch.cuda.is_available():
        print("4. live trace (k3_rank16 KDA+MoE, batch 1)")
        from k3fast.measure import trace
        trace.main(["--kinds", "kda_moe", "--shapes", "k3_rank16", "--batches", "1", "--impls", "ref", "stock",
                    "--replays", "20", "--out", "traces/live"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
