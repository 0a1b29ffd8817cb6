"""Which way of calling cuBLAS serves the layer's skinny GEMMs best at decode batches above the DSL kernels' range?
A measurement, not a kernel of the layer.

Why (k3fast/LOG.md, session 24): above M = 8 the attention half runs its in_proj (and o_proj) as
``torch.mm(x, w.t())``. At rank16 b64 cuBLAS picks a split-K nvjet 64x64 kernel plus a split-K reduce kernel: 15.5 +
2.3 us for the 46 MB in_proj (s79), 2.6 TB/s where the copy runs at 4.2; that cell is 3.1 us short of issue 4's 1.8x.
cuBLAS's choice depends on how it is called, so before writing a kernel this probe times the same product through
the entry points torch offers, on the shapes the layer runs:

* ``mm``: ``torch.mm(x, w.t(), out=y)``, what FastImpl calls (cublasGemmEx through torch's default backend);
* ``addmm0``: ``torch.addmm(zero_bias, x, w.t(), out=y)``: torch sends a bias GEMM to cublasLt's bias epilogue,
  whose heuristics choose among other kernels; the zero bias leaves each fp32 sum as it is before the one rounding;
* ``lt``: ``torch.mm`` with ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
* ``mm_fp32red``: ``torch.mm`` with ``allow_bf16_reduced_precision_reduction = False`` (cuBLAS may not then reduce
  split-K partials in bf16; the default allows it).

Each (shape, M, form) is one CUDA graph of two GEMMs on two copies of the weight, replayed after an L2 flush, so
that both read their weights from HBM as in the layer; the record gives the replay median per GEMM, the kernels of a
profiled replay, the bytes, the floor at the copy rate measured in the same run, and the error of each form against
an fp64 product of the same bf16 operands.

    python -m k3fast.blas_probe --out traces/h200 --tag <commit>-<step> [--shapes k3_rank16,k3_rank8] [--ms 9,16,32,64]
"""

import argparse
import contextlib
import json
import sys

import torch

FORMS = ("mm", "addmm0", "lt", "mm_fp32red")


def gemm_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """{name: (N, K)} of the attention half's two cuBLAS GEMMs at ``shape`` (the packed in_proj as FastImpl pads it,
    and o_proj)."""
    from k3ref.config import preset
    from . import kda_conv_gate_step as kda_mod
    cfg = preset(shape)
    H, dh = cfg.kda_heads, cfg.kda_head_dim
    return {"in_proj": (kda_mod.proj_width(H), cfg.hidden_size), "o_proj": (cfg.hidden_size, H * dh)}


@contextlib.contextmanager
def form_context(form: str):
    """The global cuBLAS settings of ``form`` around a capture (restored after); the library switch is the layer's
    own (fast.blas_library)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    from .fast import blas_library
    m = torch.backends.cuda.matmul
    old_red = m.allow_bf16_reduced_precision_reduction
    try:
        if form == "mm_fp32red":
            m.allow_bf16_reduced_precision_reduction = False
        with blas_library("cublaslt" if form == "lt" else None, torch.device("cuda")):
            yield
    finally:
        m.allow_bf16_reduced_precision_reduction = old_red


def gemm(form: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, zero_bias: torch.Tensor) -> torch.Tensor:
    if form == "addmm0":
        return torch.addmm(zero_bias, x, w.t(), out=y)
    return torch.mm(x, w.t(), out=y)


def probe(name: str, N: int, K: int, M: int, form: str, *, replays: int, copy_tbps: float) -> dict:
    from .trace import capture, profile_replays, replay_stats, summarize_graph_events, time_replays
    g_ = torch.Generator(device="cuda").manual_seed(1000 * M + N % 997)
    ws = [(torch.randn(N, K, device="cuda", generator=g_) * K ** -0.5).to(torch.bfloat16) for _ in range(2)]
    x = torch.randn(M, K, device="cuda", generator=g_).to(torch.bfloat16)
    ys = [torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    zero_bias = torch.zeros(N, device="cuda", dtype=torch.bfloat16)

    def step():
        for w, y in zip(ws, ys):
            gemm(form, x, w, y, zero_bias)

    with form_context(form):
        g = capture(step)
    times = time_replays(g, lambda: None, replays)
    ev, l2 = profile_replays(g, lambda: None, replays=3)
    per_gemm = summarize_graph_events(ev, 6)        # 3 replays x 2 GEMMs
    ref = x.double() @ ws[1].double().t()
    err = ((ys[1].double() - ref).norm() / ref.norm()).item()
    if not torch.isfinite(ys[1]).all():
        err = float("nan")
    nbytes = 2 * (N * K + M * K + M * N)
    st = replay_stats([t / 2 for t in times])
    return {"gemm": name, "N": N, "K": K, "M": M, "form": form, **st, "replays": replays,
            "kernels_per_gemm": per_gemm["kernels"], "kernel_names": per_gemm["kernel_names"], "bytes": nbytes,
            "floor_us": round(nbytes / copy_tbps / 1e6, 3), "copy_tbps": copy_tbps,
            "rel_err_vs_fp64": err, "l2": l2,
            "timing": "CUDA-graph replay of two GEMMs on two weight copies, per GEMM (replay / 2), L2 flushed before "
                      "each replay"}


def main(argv=None) -> int:
    from .trace import parse_run, write_run
    ap = argparse.ArgumentParser(prog="python -m k3fast.blas_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="k3_rank16,k3_rank8")
    ap.add_argument("--ms", default="9,16,32,64")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--gemms", default="in_proj,o_proj")
    ap.add_argument("--replays", type=int, default=50)
    run = parse_run(ap, argv, "k3fast.blas_probe")
    if run is None:
        return 1
    args, env, bw, tag = run
    forms = args.forms.split(",")
    for f in forms:
        if f not in FORMS:
            ap.error(f"--forms: {f!r} is not one of {FORMS}")
    path = f"{args.out}/blasprobe-{tag}.json"
    records = []
    for shape in args.shapes.split(","):
        shapes = gemm_shapes(shape)
        for name in args.gemms.split(","):
            N, K = shapes[name]
            for M in (int(m) for m in args.ms.split(",")):
                row = []
                for form in forms:
                    rec = {**env, "shape": shape, **probe(name, N, K, M, form, replays=args.replays, copy_tbps=bw)}
                    records.append(rec)
                    row.append(f"{form} {rec['us_median']:6.2f}")
                    write_run(path, env, bw, records)
                print(f"{shape:10s} {name:8s} M={M:3d} floor {records[-1]['floor_us']:6.2f} us | " + " | ".join(row),
                      flush=True)
    print(json.dumps({"written": path}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
