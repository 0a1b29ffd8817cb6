#!/usr/bin/env bash
# On the H200 device machine: layer traces + per-kernel benchmarks, everything under $OUT in <= 8 files.
#   K3_COMMIT=<the commit you sent> [K3_TAG=<commit>-<step>] bash scripts/h200_sweep.sh [trace args...]
# The device copy of the tree has no .git: K3_COMMIT is how the records learn their commit. K3_TAG (default: the
# commit) names the files: records-<tag>.json with its traces in perfetto-<tag>/, so that several runs of one commit
# keep their own folders (k3fast.report.perfetto_file finds them).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
: "${K3_COMMIT:?set K3_COMMIT to the commit the tree was sent at}"
export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
tmp=$(mktemp -d)
timeout "${K3_SWEEP_TIMEOUT:-420}" python3 -m k3fast.trace --out "$tmp" --tag "${K3_TAG:-$K3_COMMIT}" "$@" > "$OUT/sweep.log" 2>&1
rc=$?          # the script exits with the sweep's status (not the status of the summary grep below)
if [ -n "${K3_BENCH:-}" ]; then
  timeout "${K3_BENCH_TIMEOUT:-120}" python3 -m k3fast.bench --out "$tmp" --tag "${K3_TAG:-$K3_COMMIT}" $K3_BENCH > "$OUT/bench.log" 2>&1
fi
if [ -n "${K3_EXPERTS:-}" ]; then       # e.g. K3_EXPERTS="--shapes k3_rank16 --batches 1 8 64"
  timeout "${K3_EXPERTS_TIMEOUT:-150}" python3 -m k3fast.bench_experts --out "$tmp" --tag "${K3_TAG:-$K3_COMMIT}" $K3_EXPERTS \
    > "$OUT/experts.log" 2>&1
fi
cp "$tmp"/records-*.json "$tmp"/kernels-*.json "$tmp"/experts-*.json "$OUT"/ 2>/dev/null
ls -d "$tmp"/perfetto-* >/dev/null 2>&1 && tar czf "$OUT/perfetto.tgz" -C "$tmp" $(cd "$tmp" && ls -d perfetto-*)
grep -E "^\s+(ref|stock|compiled|fast[-a-z0-9]*) |FAILED|budget" "$OUT/sweep.log" | cut -c1-160 | tail -60
# The device returns at most 8 files from $OUT (at 6ec1427 a step with tests, sweep, bench and experts wrote 10 and
# lost its records and sweep.log): past 8, the logs and gpu.txt travel as one logs.tgz.
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf logs.tgz $(ls *.log gpu.txt 2>/dev/null) && rm -f *.log gpu.txt)
fi
exit $rc
