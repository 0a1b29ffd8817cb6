"""The main job: ``python -m k3fast``.

1. runs one decode step of a KDA+MoE and an MLA+MoE layer of the reference at tiny() size and checks it
   against the fp64 reference;
2. compiles every fused CuTe DSL kernel at batch 1 for sm_90a (no GPU needed);
3. renders the recorded H200 trace comparison from traces/ (table + plots);
4. with a GPU present, also traces one live batch-1 k3_rank(16) KDA+MoE layer (ref vs stock).
"""
from __future__ import annotations

import importlib
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


KERNEL_MODULES = ("rms_gemv", "kda_conv_gate_step", "oproj_attnres", "router_down_topk", "moe_mxfp4_experts", "moe_tail")


def compile_kernels() -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from k3fast._dsl import COMPILE_LOG, dsl_available
    if not dsl_available():
        print("  CuTe DSL (nvidia-cutlass-dsl + apache-tvm-ffi) not installed: skipping (pip install -e '.[gpu]')")
        return
    for name in KERNEL_MODULES:
        try:
            mod = importlib.import_module(f"k3fast.{name}")
        except ImportError:
            continue
        warm = getattr(mod, "warmup_batch1", None) or getattr(mod, "warmup", None)
        if warm is None:
            continue
        t = time.time()
        n0 = len(COMPILE_LOG)
        try:
            try:
                warm(batches=[1])
            except TypeError:
                warm([1])
            print(f"  compiled {name}: {len(COMPILE_LOG) - n0} kernel(s) for sm_90a in {time.time() - t:.1f} s")
        except Exception as ex:      # report and go on: one broken kernel must not hide the others
            print(f"  {name}: compile FAILED: {type(ex).__name__}: {str(ex)[:300]}")


def main() -> int:
    print("1. reference layer")
    reference_demo()
    print("2. fused kernels")
    compile_kernels()
    print("3. recorded H200 traces")
    from k3fast import report
    report.main(["--no-plots"] if not os.environ.get("K3_PLOTS") else [])
    if torch.cuda.is_available():
        print("4. live trace (k3_rank16 KDA+MoE, batch 1)")
        from k3fast import trace
        trace.main(["--kinds", "kda_moe", "--shapes", "k3_rank16", "--batches", "1", "--impls", "ref", "stock",
                    "--replays", "20", "--out", "traces/live"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
