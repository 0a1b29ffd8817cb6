#!/usr/bin/env bash
# On the lent GPU machine: the GPU test tier (default: every file under tests/gpu), the log and the JUnit XML under
# $OUT (default ./out). Back on this side, the JUnit file goes to traces/<card>/junit/ (traces/README.md).
#   [K3_TAG=<commit>-<step>] bash scripts/device_tests.sh [test paths and pytest options]
#   K3_TEST_TIMEOUT (s, default 480) bounds the whole run, K3_PER_TEST_TIMEOUT (default 240) each test.
#   K3_XDIST=N runs N pytest-xdist workers, one file each at a time (the image has pytest-xdist): the kernels' JIT
#   compiles are CPU-bound and the machine has 16 cores; every worker holds its own weights on the one GPU, and a
#   full-width layer with its re-laid experts is ~32 GB, so 2 workers on an 80 GB H100, 3 on an H200.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
# kernels compiled once per machine, shared by this run's processes; .kcache may arrive pre-filled by
# scripts/precompile.py on the CPU machine (k3fast.kernels._dsl: the cache keys on the kernel sources)
export K3_KERNEL_CACHE=${K3_KERNEL_CACHE:-$PWD/.kcache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
# --half 1 | 2: the tier in two calls of the lent machine (serially the whole tier runs ~9 minutes on an H100, past
# one call with the staging; with K3_XDIST=2 its first 646 cases took 270 s, about 500 s of test time, so the whole
# tier needs ~7 minutes there); the halves split the files about evenly by time, each with its own JUnit file.
if [ "${1:-}" = --half ]; then
  case $2 in
    1) files=(tests/gpu/test_fast_layer.py tests/gpu/test_gemm_wgmma_splitk.py tests/gpu/test_kda_conv_gate_step.py
              tests/gpu/test_moe_mxfp4_experts.py tests/gpu/test_moe_tail.py tests/gpu/test_mla_latent_decode.py
              tests/gpu/test_mla_uv_gate.py) ;;
    2) files=(tests/gpu/test_oproj_attnres.py tests/gpu/test_ops.py tests/gpu/test_reliability.py
              tests/gpu/test_rms_gemv.py tests/gpu/test_rms_gemv_ring.py tests/gpu/test_router_down_topk.py
              tests/gpu/test_stock_compiled.py tests/gpu/test_stock_vllm_ops.py) ;;
    *) echo "--half takes 1 or 2"; exit 2 ;;
  esac
  K3_TAG=${K3_TAG:-half}-half$2; shift 2; set -- "${files[@]}" "$@"
fi
[ $# -gt 0 ] || set -- tests/gpu
xdist=(); [ "${K3_XDIST:-0}" -gt 1 ] && xdist=(-n "$K3_XDIST" --dist loadfile)
# SIGINT first: pytest then stops at the running test and still writes the JUnit file for what finished
timeout -s INT -k 30 "${K3_TEST_TIMEOUT:-480}" \
  python3 -m pytest -m gpu -q -rfE --timeout="${K3_PER_TEST_TIMEOUT:-240}" "${xdist[@]}" \
  --junitxml="$OUT/gpu-junit${K3_TAG:+-$K3_TAG}.xml" "$@" > "$OUT/gpu-tests.log" 2>&1
rc=$?
grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | cut -c1-300 | head -60
exit $rc
