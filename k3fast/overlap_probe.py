"""Can the routed experts' weights land in shared memory while the front's down-projection streams? A measurement
for a design that is not built yet, not a kernel of the layer.

The design (k3fast/LOG.md, "Where the remaining targets stand (session 14 update)"): at rank16 b1 the MoE half is
the front (~75 MB, of which the down-projection to the latent is ~51 MB), then the routed experts (23.4 MB for the
token's 16 experts, latency-bound: ~17.7 us after the front), then the tail (57 MB). An L2 prefetch cannot carry
bytes across kernels here (k3fast.l2probe, s30-s32), but shared memory can: 23.4 MB over 128 SMs is ~183 KB per
SM, under the 227 KB an SM has. If the top-k ran first, the experts' CTAs could load their weights by expert id
while the down-projection streams on the same SMs, and only the MMAs would remain after it.

This probe asks the memory system alone, before anything of that is built: do the two streams add up?

* ``fill``: ``ctas`` CTAs (one per SM, 512 threads) each copy their slice of a buffer into shared memory with
  cp.async (16 bytes per thread per step, all steps in flight, one wait), then fold what landed into one XOR per
  thread, written out so that a test can check every byte arrived;
* ``stream``: k3fast.l2probe.read_once over a second buffer (528 CTAs, no shared memory, so its CTAs fit beside
  the fill's);
* both on two streams at once, timed from the fork to the join, against each alone and against one after the
  other. The L2 is flushed (256 MB read) before each repetition.

    python -m k3fast.overlap_probe --out traces/h200 --tag <commit>-<step>     (writes overlap-<tag>.json)
"""
import argparse
import json
import sys

import torch

from ._dsl import SMEM_PER_CTA_MAX, TVM_FFI, compile_cached, fake_stream, fake_tensor, import_cute

THREADS = 512
VEC = 16                      # bytes per cp.async
STEP_BYTES = THREADS * VEC    # 8 KB: one step of every thread of a CTA
MB = 1_000_000             # the repository's byte unit (k3-spec, moe_mxfp4_experts): 23.4 MB = 23.4e6 bytes


def _build_fill(steps: int, options: str = TVM_FFI):
    cutlass, cute = import_cute()
    from cutlass import Int32

    smem_bytes = steps * STEP_BYTES

    class SmemFill:
        """CTA c copies bytes [c * S, (c + 1) * S) of X (S = steps * 8 KB) into its shared memory: thread t's step
        s is the 16-byte vector s * 512 + t of the slice, so each step is 8 KB of consecutive bytes per CTA. Every
        copy is issued before the one wait (no ring: the whole slice fits); then each thread folds its own vectors
        out of shared memory into out[c * 512 + t]."""

        @cute.jit
        def __call__(self, mX: cute.Tensor, mOut: cute.Tensor, stream):
            gX = cute.flat_divide(mX, (4,))                       # (4 words, vector)
            grid = cute.size(gX, mode=[1]) // (steps * THREADS)
            self.kernel(gX, mOut).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], smem=smem_bytes + 128,
                                         stream=stream, preferred_smem_carveout=100)

        @cute.kernel
        def kernel(self, gX: cute.Tensor, mOut: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            smem = cutlass.memory.SmemAllocator()
            sX = smem.allocate_tensor(Int32, cute.make_layout((4, steps * THREADS), stride=(1, 4)), 128)
            atom = cute.make_copy_atom(
                cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL), Int32,
                num_bits_per_copy=128)
            base = bidx * (steps * THREADS)
            for s in cutlass.range_constexpr(steps):
                cute.copy(atom, gX[None, base + s * THREADS + tidx], sX[None, s * THREADS + tidx])
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            acc = Int32(0)
            for s in cutlass.range_constexpr(steps):
                for w in cutlass.range_constexpr(4):
                    acc = acc ^ sX[w, s * THREADS + tidx]
            mOut[bidx * THREADS + tidx] = acc

    n, m = cute.sym_int(), cute.sym_int()
    return cute.compile(SmemFill(), fake_tensor(cutlass.Int32, (n,)), fake_tensor(cutlass.Int32, (m,)),
                        fake_stream(), options=options)


def slice_steps(total_bytes: int, ctas: int) -> int:
    """The 8 KB steps per CTA that give ``ctas`` CTAs at least ``total_bytes`` together."""
    steps = -(-total_bytes // (ctas * STEP_BYTES))
    if steps * STEP_BYTES + 128 > SMEM_PER_CTA_MAX:
        raise ValueError(f"{total_bytes} bytes over {ctas} CTAs need {steps * STEP_BYTES} bytes of shared memory "
                         f"per CTA; an H200 CTA has at most {SMEM_PER_CTA_MAX}")
    return steps


def smem_fill(x: torch.Tensor, out: torch.Tensor, ctas: int) -> None:
    """Copy the contiguous int32 CUDA tensor ``x`` into the shared memory of ``ctas`` CTAs (equal slices) on the
    current stream; out[c * 512 + t] is the XOR of thread t's words of slice c."""
    nbytes = x.numel() * x.element_size()
    if x.dtype != torch.int32 or not x.is_contiguous() or x.data_ptr() % 16:
        raise ValueError(f"smem_fill needs a contiguous, 16-byte aligned int32 tensor, got {x.dtype}, "
                         f"contiguous={x.is_contiguous()}")
    if ctas < 1 or nbytes % (ctas * STEP_BYTES):
        raise ValueError(f"smem_fill splits x into {ctas} slices of whole {STEP_BYTES}-byte steps; {nbytes} bytes "
                         f"do not split so")
    steps = slice_steps(nbytes, ctas)
    if out.dtype != torch.int32 or out.numel() != ctas * THREADS:
        raise ValueError(f"out must be an int32 tensor of ctas * {THREADS} = {ctas * THREADS} elements, got "
                         f"{out.dtype} x {out.numel()}")
    fn = compile_cached(("overlap_probe.fill", steps), lambda: _build_fill(steps))
    fn(x, out)


def eager_spans(both) -> list:
    """CUPTI kernel spans of 3 eager repetitions of ``both`` (us from each one's first kernel after the flush). Under
    the profiler the CPU's launch gaps fall between the two launches, so these cannot show co-scheduling alone."""
    from .trace import _profile, flush_l2

    def three():
        for _ in range(3):
            flush_l2()
            both()
    ev = sorted((e for e in _profile(three) if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    timeline, t0 = [], None
    for e in ev:
        name = "fill" if "SmemFill" in e["name"] else "stream" if "L2Read" in e["name"] else "flush"
        if name == "flush":
            t0 = None
            continue
        t0 = e["ts"] if t0 is None else t0
        timeline.append([name, round(e["ts"] - t0, 3), round(e["dur"], 3)])
    return timeline


def main(argv=None) -> int:
    from .l2probe import read_once
    from .trace import (capture, parse_run, profile_replays, replay_stats, replay_timeline, time_eager,
                        time_replays, write_run)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fill-mb", nargs="+", type=float, default=[23.4],
                    help="the experts' bytes (rank16 b1: 23.4 MB for 16 distinct experts)")
    ap.add_argument("--stream-mb", nargs="+", type=float, default=[51.4],
                    help="the down-projection's bytes (7168 x 3584 bf16 = 51.4 MB)")
    ap.add_argument("--fill-ctas", nargs="+", type=int, default=[128])
    ap.add_argument("--stream-carveout", nargs="+", default=["none"],
                    help="the stream kernel's preferred shared-memory carveout: 'none' (the driver's choice) or a "
                         "percentage; the fill asks for 100")
    ap.add_argument("--stream-smem", type=int, default=0, help="unused dynamic shared memory per stream CTA")
    ap.add_argument("--stream-first", action="store_true",
                    help="launch the stream before the fill (the design's order: the down-projection runs, the "
                         "experts join it)")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays (the fork to two streams captured, as fast-overlap does) and take "
                         "the pair's spans from one replay, instead of eager calls (s33-s37 ran eagerly; their "
                         "profiled spans carry the CPU's launch gaps)")
    ap.add_argument("--reps", type=int, default=40)
    run = parse_run(ap, argv, "k3fast.overlap_probe")
    if run is None:
        return 2
    args, env, bw, tag = run
    path = f"{args.out}/overlap-{tag}.json"
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    recs = []
    for fill_mb in args.fill_mb:
        for ctas in args.fill_ctas:
            steps = slice_steps(int(fill_mb * MB), ctas)
            xf = torch.randint(-2**31, 2**31 - 1, (ctas * steps * STEP_BYTES // 4,), dtype=torch.int32,
                               device="cuda")
            out = torch.empty(ctas * THREADS, dtype=torch.int32, device="cuda")
            for stream_mb, cv in [(mb, cv) for mb in args.stream_mb for cv in args.stream_carveout]:
                carve = None if cv == "none" else int(cv)
                xs = torch.randn(int(stream_mb * MB) // 16 * 4, device="cuda")
                fill = (lambda: smem_fill(xf, out, ctas))
                stream = (lambda: read_once(xs, sink, carveout=carve, smem=args.stream_smem))

                def both():
                    cur = torch.cuda.current_stream()     # the capturing stream under --graph
                    s1.wait_stream(cur)
                    s2.wait_stream(cur)
                    first, second = (stream, fill) if args.stream_first else (fill, stream)
                    with torch.cuda.stream(s1):     # default: the fill first, so its CTAs take their SMs
                        first()
                    with torch.cuda.stream(s2):
                        second()
                    cur.wait_stream(s1)
                    cur.wait_stream(s2)
                cases = {"fill": fill, "stream": stream, "fill_then_stream": lambda: (fill(), stream()),
                         "fill_beside_stream": both}
                for fn in cases.values():           # compile and warm outside the timed loops
                    fn()
                torch.cuda.synchronize()
                if args.graph:
                    graphs = {name: capture(fn) for name, fn in cases.items()}
                    row = {name: replay_stats(time_replays(g, lambda: None, args.reps)) for name, g in graphs.items()}
                    # the pair's kernels in the median of 3 profiled replays (each after an L2 flush)
                    tl = replay_timeline(profile_replays(graphs["fill_beside_stream"], lambda: None)[0], 3) or {}
                    timeline = [["fill" if "SmemFill" in k[0] else "stream", k[1], k[2]] for k in tl.get("kernels", [])]
                    del graphs
                else:
                    row = {name: replay_stats(time_eager(fn, args.reps)) for name, fn in cases.items()}
                    timeline = eager_spans(both)
                fill_bytes = xf.numel() * 4
                stream_bytes = xs.numel() * 4
                rec = {**{k: env[k] for k in ("gpu", "driver", "torch", "cutlass", "commit", "date")},
                       "fill_bytes": fill_bytes, "fill_ctas": ctas, "fill_smem_per_cta": steps * STEP_BYTES,
                       "stream_bytes": stream_bytes, "stream_carveout": carve, "stream_first": args.stream_first,
                       "stream_smem": args.stream_smem, "timing": "graph" if args.graph else "eager", "reps": args.reps,
                       "copy_tbps": round(bw, 4),
                       "floor_us_both": round((fill_bytes + stream_bytes) / (bw * 1e12) * 1e6, 3),
                       "floor_us_fill": round(fill_bytes / (bw * 1e12) * 1e6, 3),
                       "floor_us_stream": round(stream_bytes / (bw * 1e12) * 1e6, 3), **row,
                       "beside_timeline": timeline}
                recs.append(rec)
                print(json.dumps({"fill_mb": fill_mb, "ctas": ctas, "stream_mb": stream_mb, "carveout": carve,
                                  "floor_both": rec["floor_us_both"]}
                                 | {k: v["us_median"] for k, v in row.items()} | {"timeline": timeline}), flush=True)
                write_run(path, env, bw, recs)
                del xs
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
