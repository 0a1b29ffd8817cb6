#!/usr/bin/env bash
# On the H200 device machine: run every GPU test tier, logs and JUnit XML under $OUT (or ./out).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
# arguments: test paths and pytest options (default: every GPU test)
[ $# -gt 0 ] || set -- tests/gpu
timeout "${K3_TEST_TIMEOUT:-480}" python3 -m pytest -m gpu -q -rfE --timeout="${K3_PER_TEST_TIMEOUT:-240}" \
  --junitxml="$OUT/gpu-junit.xml" "$@" > "$OUT/gpu-tests.log" 2>&1
rc=$?
grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | cut -c1-300 | head -60
exit $rc
