"""The main job: ``python -m k3fast``. Runs on a CPU; a GPU adds a live trace.

1. one decode step of a KDA+MoE and an MLA+MoE layer of the reference at tiny() size, checked against fp64;
2. every fused CuTe DSL kernel the layer runs at k3_rank16 batch 1, compiled for sm_90a (no GPU needed);
3. the recorded results: README's table and the headline figure, drawn from traces/ into traces/live/;
4. with a GPU present, a live trace of one k3_rank16 batch-1 KDA+MoE layer, stock beside fast.
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


def compile_kernels() -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from k3fast.kernels._dsl import COMPILE_LOG, dsl_available
    if not dsl_available():
        print("  CuTe DSL (nvidia-cutlass-dsl + apache-tvm-ffi) not installed: skipping (pip install -e '.[gpu]')")
        return
    from k3ref import k3_rank
    from .layer import warmup
    t = time.time()
    n = warmup(k3_rank(16), [1], [1])
    for key, secs in COMPILE_LOG[-n:]:
        print(f"  {secs:4.1f} s  {str(key)[:110]}")
    print(f"  {n} kernels compiled for sm_90a in {time.time() - t:.1f} s (the six launches of a KDA+MoE layer at b1)")


def main() -> int:
    print("1. reference layer")
    reference_demo()
    print("2. fused kernels")
    compile_kernels()
    print("3. recorded results (traces/)")
    from k3fast.measure import report
    with open(os.path.join(report.ROOT, "README.md")) as f:
        sources = report.readme_sources(f.read())
    print(report.results_block(sources))
    out = os.path.join(report.ROOT, "traces", "live", "headline.png")
    print("  figure:", os.path.relpath(report.headline_figure(sources, out), report.ROOT))
    if torch.cuda.is_available():
        print("4. live trace (k3_rank16 KDA+MoE, batch 1, stock beside fast)")
        from k3fast.measure import trace
        trace.main(["--preset", "smoke", "--out", os.path.join(report.ROOT, "traces", "live")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
