#!/usr/bin/env bash
# On the lent GPU machine: one layer-trace sweep (python -m k3fast.measure.trace), then optionally the per-kernel and
# the routed-experts benchmarks, everything under $OUT (default ./out) in at most 8 files, what one device run returns.
#   K3_COMMIT=<commit sent> [K3_TAG=<commit>-<step>] bash scripts/device_sweep.sh --preset kda-sweep [trace args...]
#   K3_BENCH="--shapes k3_rank16 --batches 1 8 64"     also runs python -m k3fast.measure.bench with these arguments
#   K3_EXPERTS="--shapes k3_rank16 --batches 8 64"     also runs python -m k3fast.measure.bench_experts
#   --preset stock-vs-vllm --engine /tmp/k3eng/*.json    each stock record beside stock vLLM's own layer, measured in an
#                                                       earlier call on this machine (device_vllm_e2e.sh layers)
#   K3_SWEEP_TIMEOUT / K3_BENCH_TIMEOUT / K3_EXPERTS_TIMEOUT (s) bound each step; give the trace a --budget-s below
#   K3_SWEEP_TIMEOUT so that it stops between cells and keeps what it measured.
# The machine's copy of the tree has no .git: K3_COMMIT is how the records learn their commit (each record's
# source_digest checks it: python -m k3fast.measure.provenance FILE). K3_TAG (default: the commit) names the files,
# records-<tag>.json with its traces in perfetto-<tag>/, so several runs of one commit keep their own folders.
# Back on this side: records, kernels and experts JSON go to traces/<card>/, and `tar xzf perfetto.tgz -C
# traces/<card>` puts the Perfetto traces beside them (traces/README.md).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
: "${K3_COMMIT:?set K3_COMMIT to the commit the tree was sent at}"
export K3_COMMIT PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
# kernels compiled once per machine, shared by this run's processes; .kcache may arrive pre-filled by
# scripts/precompile.py on the CPU machine (k3fast.kernels._dsl: the cache keys on the kernel sources)
export K3_KERNEL_CACHE=${K3_KERNEL_CACHE:-$PWD/.kcache}
tag=${K3_TAG:-$K3_COMMIT}
tmp=$(mktemp -d)
timeout "${K3_SWEEP_TIMEOUT:-420}" python3 -m k3fast.measure.trace --out "$tmp" --tag "$tag" "$@" > "$OUT/sweep.log" 2>&1
rc=$?          # the script exits with the sweep's status (not the status of the summary grep below)
if [ -n "${K3_BENCH:-}" ]; then
  timeout "${K3_BENCH_TIMEOUT:-120}" python3 -m k3fast.measure.bench --out "$tmp" --tag "$tag" $K3_BENCH \
    > "$OUT/bench.log" 2>&1
fi
if [ -n "${K3_EXPERTS:-}" ]; then
  timeout "${K3_EXPERTS_TIMEOUT:-150}" python3 -m k3fast.measure.bench_experts --out "$tmp" --tag "$tag" $K3_EXPERTS \
    > "$OUT/experts.log" 2>&1
fi
cp "$tmp"/records-*.json "$tmp"/kernels-*.json "$tmp"/experts-*.json "$OUT"/ 2>/dev/null
ls -d "$tmp"/perfetto-* >/dev/null 2>&1 && tar czf "$OUT/perfetto.tgz" -C "$tmp" $(cd "$tmp" && ls -d perfetto-*)
grep -E "^\s+(ref|stock|compiled|fast[-a-z0-9]*) |FAILED|budget" "$OUT/sweep.log" | cut -c1-160 | tail -60
# At most 8 files come back from $OUT: past 8, the logs and gpu.txt travel as one logs.tgz.
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf logs.tgz $(ls *.log gpu.txt 2>/dev/null) && rm -f *.log gpu.txt)
fi
exit $rc
