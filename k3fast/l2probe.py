"""Does a byte range stay in the H200's L2 until the kernel that needs it runs? A measurement, not a kernel of
the layer.

Why (k3fast/LOG.md, "Where the remaining targets stand"): at rank16 b1 the MoE tail streams its 57 MB of
weights from HBM after the routed experts, which read only ~23 MB in ~17 us and leave the HBM mostly idle.
Four designs prefetched weights into L2 during another kernel (moe_tail v2 / v3, router v2.6, experts xl2) and
all cost more than they hid; why was never measured. This probe separates the two explanations on plain
buffers, with nothing of the layer around them:

* capacity: how much of a range X read once is still in L2 when it is read again, alone or after / beside a
  stream Y of another range (Y = the experts' 23 MB at rank16 b1);
* fill: whether a few CTAs (the 4 SMs that experts v7's 128 CTAs leave free) can pull X into L2 with
  ``cp.async.bulk.prefetch.L2`` or per-line ``prefetch.global.L2`` while Y streams, and at what cost to Y;
* eviction priority: the same prefetches marked ``L2::evict_last`` (a createpolicy descriptor), which the
  earlier designs did not use.

Each scenario is timed by its last read of X (``read_once``: every 16-byte vector once, four loads in flight per
thread; CUDA events around that kernel only; the L2 flushed by a 256 MB read before each repetition). s30 (at
c2c2528) read with a torch sum instead, whose time hardly depends on where the bytes come from (8 MB: 10.3 us cold,
9.4 warm); ``*_settled`` rows wait ~50 us after the prefetch, to tell late lines from missing ones. Its "L2 share" is (cold - t) / (cold - warm): 0 when the read costs
what it costs from HBM, 1 when it costs what a read straight after a read of X costs. It is an estimate from
time, not a hit-rate counter.

    python -m k3fast.l2probe --out traces/h200 --tag <commit>-<step>       (writes l2probe-<tag>.json)
"""

import argparse
import json
import sys

import torch

from ._dsl import TVM_FFI, compile_cached, fake_stream, fake_tensor, import_cute

CHUNK = 16384        # bytes per cp.async.bulk.prefetch request (a multiple of 16; buffers are whole chunks)
LINE = 128           # bytes per prefetch.global.L2 (one L2 line)
MODES = ("bulk", "line")
HINTS = ("", "evict_last")
MB = 1 << 20
SETTLE_CYCLES = 100_000   # ~50 us at the H200's 1.98 GHz: several times a 48 MB range's time from HBM


def _build(mode: str, hint: str, threads: int, options: str = TVM_FFI):
    cutlass, cute = import_cute()
    from cutlass import Int32, Int64, const_expr
    from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_prefetch

    class L2Prefetch:
        """Every thread asks for its chunks (bulk) or lines (line) of X, strided over the grid: no data reaches
        the SM, so a few CTAs can request a large range. hint "evict_last": the lines are filled with the
        L2::evict_last priority, so a concurrent stream of evict_normal lines is evicted first."""

        def __init__(self):
            self.mode, self.hint, self.threads = mode, hint, threads
            self.words = (CHUNK if mode == "bulk" else LINE) // 4

        @cute.jit
        def __call__(self, mX: cute.Tensor, grid: Int32, stream):
            self.kernel(cute.flat_divide(mX, (self.words,))).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1],
                                                                    stream=stream)

        @cute.kernel
        def kernel(self, gX: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            nblk, _, _ = cute.arch.grid_dim()
            n = cute.size(gX, mode=[1])
            policy = Int64(0)
            if const_expr(self.hint == "evict_last" and self.mode == "bulk"):
                policy = cute.arch.inline_ptx("createpolicy.fractional.L2::evict_last.b64 {$w0}, 1.0;",
                                              write_only_types=[Int64])
            for i in cutlass.range(bidx * self.threads + tidx, n, nblk * self.threads):
                if const_expr(self.mode == "bulk"):
                    if const_expr(self.hint == "evict_last"):
                        cp_async_bulk_prefetch(gX[None, i].iterator, CHUNK, l2_cache_hint=policy)
                    else:
                        cp_async_bulk_prefetch(gX[None, i].iterator, CHUNK)
                else:
                    if const_expr(self.hint == "evict_last"):
                        cute.arch.inline_ptx("prefetch.global.L2::evict_last [{$r0}];",
                                             read_only_args=[gX[None, i].iterator.toint()])
                    else:
                        cute.arch.prefetch(gX[None, i].iterator.llvm_ptr, cache_level="L2")

    n = cute.sym_int()
    return cute.compile(L2Prefetch(), fake_tensor(cutlass.Int32, (n,)), Int32(1), fake_stream(), options=options)


def _build_read(threads: int, unroll: int, options: str = TVM_FFI, carveout: int | None = None, smem: int = 0):
    cutlass, cute = import_cute()
    from cutlass import Int32
    from ._dsl import weight_load_atom

    # carveout: the shared-memory share of the SM's L1 / shared split this kernel asks for (None: the driver's
    # choice). overlap_probe runs it beside a kernel that asks for 100 (its 184 KB per CTA), to see whether CTAs
    # of two kernels that ask for different splits share an SM.
    occupancy = {} if carveout is None else {"preferred_smem_carveout": carveout}
    if smem:                      # unused dynamic shared memory, for the same reason (overlap_probe --stream-smem)
        occupancy["smem"] = smem

    class L2Read:
        """Reads every 16-byte vector of X once (grid-stride, ``unroll`` loads in flight per thread) and folds
        them into one XOR per thread; the store is predicated on a value that random data never produces, so
        the loads stay and nothing is written. Unlike a torch reduction (s30: 9.4 us for 8 MB warm, 10.3 cold),
        its time tracks where the bytes come from."""

        def __init__(self):
            self.threads, self.unroll = threads, unroll

        @cute.jit
        def __call__(self, mX: cute.Tensor, mOut: cute.Tensor, grid: Int32, stream):
            self.kernel(cute.flat_divide(mX, (4,)), mOut).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1],
                                                               stream=stream, **occupancy)

        @cute.kernel
        def kernel(self, gX: cute.Tensor, mOut: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            nblk, _, _ = cute.arch.grid_dim()
            nvec = cute.size(gX, mode=[1])
            step = nblk * self.threads
            atom = weight_load_atom(Int32)
            frag = cute.make_rmem_tensor((4, self.unroll), Int32)
            frag.fill(0)
            acc = Int32(0)
            for base in cutlass.range(bidx * self.threads + tidx, nvec, step * self.unroll):
                for u in cutlass.range_constexpr(self.unroll):
                    if base + u * step < nvec:
                        cute.copy(atom, gX[None, base + u * step], frag[None, u])
                for u in cutlass.range_constexpr(self.unroll):
                    for w in cutlass.range_constexpr(4):
                        acc = acc ^ frag[w, u]
            if acc == Int32(0x7F3A5C11):
                mOut[0] = acc

    n = cute.sym_int()
    return cute.compile(L2Read(), fake_tensor(cutlass.Int32, (n,)), fake_tensor(cutlass.Int32, (1,)), Int32(1),
                        fake_stream(), options=options)


def read_once(x: torch.Tensor, out: torch.Tensor, ctas: int | None = None, threads: int = 256,
              unroll: int = 4, carveout: int | None = None, smem: int = 0) -> None:
    """Read every byte of the contiguous CUDA tensor ``x`` once (L2Read), on the current stream; ``out`` is a
    1-element int32 tensor that is written only with probability ~2^-32."""
    nbytes = x.numel() * x.element_size()
    if not x.is_contiguous() or nbytes % 16 or x.data_ptr() % 16:
        raise ValueError(f"read_once needs a contiguous, 16-byte aligned tensor of whole 16-byte vectors; got "
                         f"{nbytes} bytes, contiguous={x.is_contiguous()}")
    if out.dtype != torch.int32 or out.numel() != 1:
        raise ValueError(f"out must be a 1-element int32 tensor, got {out.dtype} x {out.numel()}")
    if ctas is None:
        ctas = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count
    fn = compile_cached(("l2probe.read", threads, unroll, carveout, smem),
                        lambda: _build_read(threads, unroll, carveout=carveout, smem=smem))
    fn(x.view(torch.int32), out, ctas)


def l2_prefetch(x: torch.Tensor, ctas: int, mode: str = "bulk", hint: str = "", threads: int = 128) -> None:
    """Request every byte of the contiguous CUDA tensor ``x`` into L2 from ``ctas`` CTAs (on the current stream)."""
    if mode not in MODES or hint not in HINTS:
        raise ValueError(f"mode must be one of {MODES} and hint one of {HINTS}, got {mode!r} / {hint!r}")
    unit = CHUNK if mode == "bulk" else LINE
    nbytes = x.numel() * x.element_size()
    if not x.is_contiguous() or nbytes % unit or x.data_ptr() % 16:
        raise ValueError(f"l2_prefetch needs a contiguous, 16-byte aligned tensor of whole {unit}-byte "
                         f"{'chunks' if mode == 'bulk' else 'lines'}; got {nbytes} bytes, contiguous={x.is_contiguous()}")
    if not 1 <= ctas <= 65535:
        raise ValueError(f"ctas must be in 1..65535, got {ctas}")
    fn = compile_cached(("l2probe", mode, hint, threads), lambda: _build(mode, hint, threads))
    fn(x.view(torch.int32), ctas)


def main(argv=None) -> int:
    from .trace import parse_run, replay_stats, time_eager, write_run
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", nargs="+", type=int, default=[8, 16, 24, 32, 40, 48])
    ap.add_argument("--stream-mb", type=int, default=23, help="Y: the concurrent / intervening stream")
    ap.add_argument("--ctas", nargs="+", type=int, default=[4, 132], help="prefetch grid sizes")
    ap.add_argument("--reader-ctas", nargs="+", type=int, default=[528],
                    help="read_once's grid (528 = 4 per SM: every 16-byte vector of 8 MB in flight in one turn; "
                         "132 = one per SM: a quarter as many loads in flight, so latency shows)")
    ap.add_argument("--reps", type=int, default=40)
    run = parse_run(ap, argv, "k3fast.l2probe")
    if run is None:
        return 2
    args, env, bw, tag = run
    path = f"{args.out}/l2probe-{tag}.json"
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    y = torch.randn(args.stream_mb * MB // 4, device="cuda")
    main_s, s1, s2 = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()
    y_ev = {}

    def beside(first, second, key=None):
        """first on s1 and second on s2, both after the flush, joined before the measured read; if key, second is
        timed (events on s2) into y_ev[key]."""
        def run():
            s1.wait_stream(main_s)
            s2.wait_stream(main_s)
            with torch.cuda.stream(s1):
                first()
            with torch.cuda.stream(s2):
                if key:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    second()
                    b.record()
                    y_ev.setdefault(key, []).append((a, b))
                else:
                    second()
            main_s.wait_stream(s1)
            main_s.wait_stream(s2)
        return run

    recs = []
    for size, rc in [(sz, rc) for sz in args.sizes_mb for rc in args.reader_ctas]:
        x = torch.randn(size * MB // 4, device="cuda")
        read_x, read_y = (lambda: read_once(x, out, rc)), (lambda: read_once(y, out, rc))
        scen = {"cold": lambda: None, "warm": read_x,
                "after_stream": lambda: (read_x(), read_y()),
                "beside_stream": beside(read_x, read_y)}
        for mode in MODES:
            for hint in HINTS:
                for g in args.ctas:
                    name = f"pf_{mode}{'_' + hint if hint else ''}_g{g}"
                    pf = (lambda mode=mode, hint=hint, g=g: l2_prefetch(x, g, mode, hint))
                    scen[name] = pf
                    # the same after SETTLE_CYCLES of one spinning thread: the prefetch is asynchronous (its
                    # kernel ends when the requests are issued), so this tells late lines from missing ones
                    scen[name + "_settled"] = (lambda pf=pf: (pf(), torch.cuda._sleep(SETTLE_CYCLES)))
                    scen[name + "_beside_stream"] = beside(pf, read_y, key=(size, rc, name))
        # compile and warm every piece outside the timed loops
        for fn in scen.values():
            fn()
        read_x()
        torch.cuda.synchronize()
        y_ev.clear()
        rows = {}
        for name, setup in scen.items():
            t = replay_stats(time_eager(read_x, args.reps, setup=setup))
            rows[name] = t
        y_alone = replay_stats(time_eager(read_y, args.reps))
        cold, warm = rows["cold"]["us_median"], rows["warm"]["us_median"]
        for name, t in rows.items():
            share = (cold - t["us_median"]) / (cold - warm) if cold > warm else None
            rec = {**{k: env[k] for k in ("gpu", "driver", "torch", "cutlass", "commit", "date")},
                   "x_mb": size, "stream_mb": args.stream_mb, "scenario": name, "reps": args.reps,
                   "reader_ctas": rc,
                   "copy_tbps": round(bw, 4), "x_read": t, "l2_share": None if share is None else round(share, 3),
                   "x_floor_us": round(size * MB / (bw * 1e12) * 1e6, 3)}
            evs = y_ev.get((size, rc, name.replace("_beside_stream", "")))
            if name.endswith("_beside_stream") and evs:
                rec["y_beside"] = replay_stats([a.elapsed_time(b) * 1e3 for a, b in evs])
                rec["y_alone"] = y_alone
            recs.append(rec)
            print(json.dumps({k: rec.get(k) for k in ("x_mb", "reader_ctas", "scenario", "l2_share")}
                             | {"x_us": t["us_median"], "y_beside_us": rec.get("y_beside", {}).get("us_median"),
                                "y_alone_us": y_alone["us_median"] if "y_beside" in rec else None}), flush=True)
        write_run(path, env, bw, recs)
        del x
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
