"""What a part's graph replay costs outside its kernels, and which property of its kernels sets that cost.

Why: every record's timed replay (CUDA events around one graph replay, after the L2 flush) is longer than its
CUPTI span (first kernel start to last kernel end). For the stock path the difference is 0.4-1.8 us; for the fast
path it is 2.6-4.4 us at every cell (records-3b5c7d3-s82.json, records-40ec5cc-s89.json, 30 cells each), ~2.5 us
more on every ratio's denominator. The two paths differ in what their graphs are made of: the fast path's kernels
are CuTe DSL kernels launched through TVM-FFI, most with the programmatic-serialization (PDL) attribute, some as
thread-block clusters, most with large dynamic shared memory (the SMs leave the flush's L1-heavy split for a
shared-memory-heavy one); the stock path's are Triton / cuBLAS / torch kernels without PDL.

This probe times graphs of EMPTY kernels (132 CTAs of 128 threads that write one word) that differ in one of those
properties at a time, so the replay time is the launch cost and nothing else: each graph timed exactly as the
layer traces time a part (k3fast.trace.time_replays: L2 flushed before each replay, median of many) and profiled
the same way (its CUPTI span), so ``replay_us - span_us`` is comparable with the records'. The cases (CASES):
the kernel's kind (torch, DSL), PDL on the first / the last / every node, the dynamic shared memory (0 / 100 /
200 KB), a cluster launch, and the same 200 KB kernel after an untimed 200 KB kernel (the SMs already in the
shared-memory-heavy split when the timed replay starts).

    python -m k3fast.launch_probe --out traces/h200 --tag <commit>-<step>
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys

from ._dsl import TVM_FFI, compile_cached, fake_stream, fake_tensor, import_cute

NTHREADS = 128
SMEM_MAX = 227 * 1024
CLUSTERS = (1, 2, 4)


def _build_class():
    cutlass, cute = import_cute()
    from cutlass import Int32, const_expr

    class Empty:
        """Every CTA writes one word (its block index, through shared memory when it has any, so the footprint
        is used and kept). With ``pdl`` the launch carries the programmatic-serialization attribute and the
        kernel waits on its predecessor and triggers its dependent as the fast path's kernels do."""

        def __init__(self, smem, pdl, cluster):
            self.smem, self.pdl, self.cluster = smem, pdl, cluster
            # the carveout is given explicitly: without it the DSL asks the driver at compile time (no GPU in CI)
            self.extra = {"smem": smem, "preferred_smem_carveout": 100} if smem else {}
            if cluster > 1:
                self.extra["cluster"] = [cluster, 1, 1]

        @cute.jit
        def __call__(self, mOut, stream):
            G = cute.size(mOut, mode=[0])
            self.kernel(mOut).launch(grid=[G, 1, 1], block=[NTHREADS, 1, 1], stream=stream, use_pdl=self.pdl,
                                     **self.extra)

        @cute.kernel
        def kernel(self, mOut):
            tid = cute.arch.thread_idx()[0]
            bid = cute.arch.block_idx()[0]
            if const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()
            if tid == 0:
                if const_expr(self.smem > 0):
                    smem = cutlass.memory.SmemAllocator()
                    pad = smem.allocate_array(Int32, self.smem // 4)
                    pad[self.smem // 4 - 1] = Int32(bid)
                    mOut[bid] = pad[self.smem // 4 - 1]
                else:
                    mOut[bid] = Int32(bid)
            if const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()

    return Empty


@functools.cache
def _cls():
    return _build_class()


def compile_key(smem: int, pdl: bool, cluster: int = 1) -> tuple:
    if not 0 <= smem <= SMEM_MAX or smem % 16:
        raise ValueError(f"smem: expected a multiple of 16 bytes in 0..{SMEM_MAX}, got {smem}")
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster: expected one of {CLUSTERS} CTAs, got {cluster}")
    return ("launch_probe", int(smem), bool(pdl), int(cluster))


def _build(smem, pdl, cluster, options=TVM_FFI):
    cutlass, cute = import_cute()
    out = fake_tensor(cutlass.Int32, (cute.sym_int(),), align=4)
    return cute.compile(_cls()(smem, pdl, cluster), out, fake_stream(), options=options)


def empty_kernel(smem: int = 0, pdl: bool = False, cluster: int = 1):
    """The compiled empty kernel: call it as fn(out) with out a CUDA int32 tensor of one entry per CTA."""
    key = compile_key(smem, pdl, cluster)
    return compile_cached(key, lambda: _build(smem, pdl, cluster))


# A node: ("torch",) -- one small elementwise torch kernel (the stock path's kind of launch) -- or
# ("dsl", smem KB, pdl, cluster). A case: (name, nodes, warm): ``warm`` launches a DSL kernel of that many KB of shared
# memory, untimed, between the flush and the timed replay.
CASES = [
    ("torch", [("torch",)], 0),
    ("torch x3", [("torch",)] * 3, 0),
    ("dsl", [("dsl", 0, False, 1)], 0),
    ("dsl pdl", [("dsl", 0, True, 1)], 0),
    ("dsl 100KB", [("dsl", 100, False, 1)], 0),
    ("dsl 200KB", [("dsl", 200, False, 1)], 0),
    ("dsl 200KB pdl", [("dsl", 200, True, 1)], 0),
    ("dsl 200KB pdl, warm 200KB", [("dsl", 200, True, 1)], 200),
    ("dsl pdl cluster4", [("dsl", 0, True, 4)], 0),
    ("dsl pdl x3", [("dsl", 0, True, 1)] * 3, 0),
    ("dsl 200KB pdl x3", [("dsl", 200, True, 1)] * 3, 0),
    ("torch, dsl pdl", [("torch",), ("dsl", 0, True, 1)], 0),
    ("dsl pdl, torch", [("dsl", 0, True, 1), ("torch",)], 0),
    ("torch, dsl 200KB pdl, torch", [("torch",), ("dsl", 200, True, 1), ("torch",)], 0),
]


def _node_fn(node, out, scratch):
    if node[0] == "torch":
        return lambda: scratch.add_(1)
    _, kb, pdl, cl = node
    fn = empty_kernel(kb * 1024, pdl, cl)
    return lambda: fn(out)


def measure(nodes, warm_kb: int = 0, n: int = 200, replays: int = 5) -> dict:
    """Capture ``nodes`` as one graph, time ``n`` replays as the traces do and profile ``replays`` of them: the replay
    median, its CUPTI span and their difference (the launch cost outside the kernels)."""
    import torch
    from .trace import profile_replays, replay_timeline, time_replays
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.full((sms,), -1, dtype=torch.int32, device="cuda")
    scratch = torch.zeros(sms * NTHREADS, dtype=torch.int32, device="cuda")
    calls = [_node_fn(nd, out, scratch) for nd in nodes]
    for c in calls:                                    # compile and warm up outside the capture
        c()
    torch.cuda.synchronize()
    if any(nd[0] == "dsl" for nd in nodes) and out.tolist() != list(range(sms)):
        raise RuntimeError("launch_probe: the empty kernel did not write its block indices")
    warm = (lambda: None) if not warm_kb else (lambda f=empty_kernel(warm_kb * 1024): f(out))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(s)
    us = time_replays(g, warm, n)
    ev, l2 = profile_replays(g, warm, replays)
    tl = replay_timeline(ev, replays) or {}
    med = statistics.median(us)
    span = tl.get("span_us")
    return {"replay_us_median": round(med, 3), "replay_us_p10": round(sorted(us)[len(us) // 10], 3),
            "replay_us_p90": round(sorted(us)[9 * len(us) // 10], 3), "span_us": span,
            "outside_kernels_us": None if span is None else round(med - span, 3),
            "kernels": len(tl.get("kernels", [])), "timeline": tl.get("kernels"), "l2": l2}


def main(argv=None) -> int:
    from .trace import parse_run, write_run
    ap = argparse.ArgumentParser(prog="python -m k3fast.launch_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=200, help="timed replays per case")
    run = parse_run(ap, argv, "k3fast.launch_probe")
    if run is None:
        return 1
    args, env, bw, tag = run
    path = f"{args.out}/launchprobe-{tag}.json"
    records = []
    for name, nodes, warm_kb in CASES:
        rec = {**env, "case": name, "nodes": [list(nd) for nd in nodes], "warm_kb": warm_kb,
               **measure(nodes, warm_kb, args.n)}
        records.append(rec)
        write_run(path, env, bw, records)
        print(f"{name:32s} replay {rec['replay_us_median']:7.2f} us  span {rec['span_us']}  "
              f"outside {rec['outside_kernels_us']}", flush=True)
    print(json.dumps({"written": path}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
