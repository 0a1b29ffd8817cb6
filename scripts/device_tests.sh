#!/usr/bin/env bash
# On the lent GPU machine: the GPU test tier (default: every file under tests/gpu), the log and the JUnit XML under
# $OUT (default ./out). Back on this side, the JUnit file goes to traces/<card>/junit/ (traces/README.md).
#   [K3_TAG=<commit>-<step>] bash scripts/device_tests.sh [test paths and pytest options]
#   K3_TEST_TIMEOUT (s, default 480) bounds the whole run, K3_PER_TEST_TIMEOUT (default 240) each test.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
[ $# -gt 0 ] || set -- tests/gpu
timeout "${K3_TEST_TIMEOUT:-480}" python3 -m pytest -m gpu -q -rfE --timeout="${K3_PER_TEST_TIMEOUT:-240}" \
  --junitxml="$OUT/gpu-junit${K3_TAG:+-$K3_TAG}.xml" "$@" > "$OUT/gpu-tests.log" 2>&1
rc=$?
grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | cut -c1-300 | head -60
exit $rc
