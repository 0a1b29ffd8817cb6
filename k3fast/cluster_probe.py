"""How many thread-block clusters of S CTAs, each holding a given amount of shared memory, run at once on this GPU.

Why: gemm_wgmma_splitk's plan sizes its grid so that every cluster is co-resident in one wave, from a table
(CLUSTERS_RESIDENT: 15 clusters of 8, 32 of 4) that was read off the experts kernel in the fourth session. s89
suggested the table is optimistic for 31 clusters of 4 at ~210 KB per CTA (a ring half that size ran 5 us faster).
The runtime's cudaOccupancyMaxActiveClusters needs the kernel's CUfunction, which the TVM-FFI compiled object does not
expose; this probe measures the same quantity directly.

The probe kernel: a grid of G clusters of S CTAs, each CTA ``NTHREADS`` threads with ``smem`` bytes of dynamic shared
memory (the GEMM's block shape and footprint). Thread 0 of each CTA adds 1 to a global counter (acq_rel, gpu scope),
then spins on it (relaxed reads via atomic add of 0) until it reaches G x S or ``timeout_us`` of %globaltimer have
passed, and writes the count it last saw. If every CTA is resident at once, every CTA sees G x S. If not, the first
wave's CTAs time out having seen only the first wave's arrivals, so the smallest count written is the number of CTAs
co-resident: the probe reports it in clusters. The counter is reset by the host before each launch.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys

from ._dsl import TVM_FFI, compile_cached, fake_stream, fake_tensor, import_cute

NTHREADS = 160          # gemm_wgmma_splitk's CTA: one consumer warpgroup + one producer warp
SMEM_MAX = 227 * 1024


def _build_class():
    cutlass, cute = import_cute()
    from cutlass import Int32, Int64, const_expr
    from cutlass.cutlass_dsl import T
    from cutlass._mlir.dialects import llvm

    def globaltimer_ns():
        return Int64(llvm.inline_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", has_side_effects=True,
                                     is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))

    class ClusterProbe:
        def __init__(self, S, smem, timeout_us):
            self.S, self.smem, self.timeout_ns = S, smem, timeout_us * 1000

        @cute.jit
        def __call__(self, mCnt, mOut, stream):
            G = cute.size(mOut, mode=[0])
            self.kernel(mCnt, mOut).launch(grid=[G, 1, 1], block=[NTHREADS, 1, 1], cluster=[self.S, 1, 1],
                                           stream=stream)

        @cute.kernel
        def kernel(self, mCnt, mOut):
            tid = cute.arch.thread_idx()[0]
            bid = cute.arch.block_idx()[0]
            total = cute.size(mOut, mode=[0])
            smem = cutlass.memory.SmemAllocator()
            pad = smem.allocate_array(Int64, self.smem // 8)
            if tid == 0:
                pad[0] = Int64(bid)           # the footprint is used, so no pass can drop it
                cute.arch.atomic_add(mCnt.iterator, Int32(1), sem="acq_rel", scope="gpu")
                t0 = globaltimer_ns()
                seen = cute.arch.atomic_add(mCnt.iterator, Int32(0), sem="relaxed", scope="gpu")
                while seen < total and globaltimer_ns() - t0 < Int64(self.timeout_ns):
                    seen = cute.arch.atomic_add(mCnt.iterator, Int32(0), sem="relaxed", scope="gpu")
                mOut[bid] = seen + Int32(pad[0] - Int64(bid))
            if const_expr(self.S > 1):
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()

    return ClusterProbe


@functools.cache
def _cls():
    return _build_class()


def _build(S, smem, timeout_us, options=TVM_FFI):
    cutlass, cute = import_cute()
    cnt = fake_tensor(cutlass.Int32, (1,), align=4)
    out = fake_tensor(cutlass.Int32, (cute.sym_int(),), align=4)
    return cute.compile(_cls()(S, smem, timeout_us), cnt, out, fake_stream(), options=options)


def compile_key(S: int, smem: int, timeout_us: int = 200) -> tuple:
    if S not in (1, 2, 4, 8, 16):
        raise ValueError(f"S: expected a cluster size of 1, 2, 4, 8 or 16, got {S}")
    if not 8 <= smem <= SMEM_MAX or smem % 8:
        raise ValueError(f"smem: expected a multiple of 8 bytes in 8..{SMEM_MAX}, got {smem}")
    return ("cluster_probe", S, smem, int(timeout_us))


def coresident_clusters(S: int, smem: int, clusters: int, timeout_us: int = 200) -> dict:
    """Launch ``clusters`` clusters of S CTAs with ``smem`` bytes of shared memory each; return how many of them were
    resident at once (``resident``; = ``clusters`` when all were) and the counts the CTAs saw."""
    import torch
    key = compile_key(S, smem, timeout_us)
    fn = compile_cached(key, lambda: _build(S, smem, timeout_us))
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.full((clusters * S,), -1, dtype=torch.int32, device="cuda")
    fn(cnt, out)
    torch.cuda.synchronize()
    seen = out.tolist()
    if min(seen) < 0:
        raise RuntimeError(f"cluster_probe: {seen.count(-1)} CTAs wrote nothing")
    return {"S": S, "smem_bytes": smem, "clusters": clusters, "resident": min(min(seen) // S, clusters),
            "all_resident": min(seen) == clusters * S, "timeout_us": timeout_us}


# gemm_wgmma_splitk's footprints: (S, shared memory bytes of its plans, clusters its plans launch)
CASES = [(8, 222 * 1024, 15), (8, 222 * 1024, 16), (4, 211 * 1024, 31), (4, 211 * 1024, 32), (4, 222 * 1024, 30),
         (4, 222 * 1024, 31), (4, 106 * 1024, 32),
         (4, 106 * 1024, 64), (8, 106 * 1024, 30), (2, 211 * 1024, 66), (1, 222 * 1024, 132)]


def main(argv=None) -> int:
    from .trace import parse_run, write_run
    ap = argparse.ArgumentParser(prog="python -m k3fast.cluster_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout-us", type=int, default=200)
    run = parse_run(ap, argv, "k3fast.cluster_probe")
    if run is None:
        return 1
    args, env, bw, tag = run
    path = f"{args.out}/clusterprobe-{tag}.json"
    records = []
    for S, smem, clusters in CASES:
        rec = {**env, **coresident_clusters(S, smem, clusters, args.timeout_us)}
        records.append(rec)
        write_run(path, env, bw, records)
        print(f"S={S} smem={smem // 1024:3d} KB: {rec['resident']} of {clusters} clusters co-resident", flush=True)
    print(json.dumps({"written": path}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
