#!/usr/bin/env bash
# On the lent GPU machine, vLLM staged (scripts/device_parts.sh --vllm): the plug-in's end-to-end runs, one per
# call (each engine start takes minutes; a call has 10). Everything lands under $OUT (default ./out).
#   K3_COMMIT=<sha> bash scripts/device_vllm_e2e.sh small | deep | deep-k3fast | deep-stock | layers | layers-<shape>
# K3_PLAN='{"mla_attention": "fused"}' passes DecodePlan overrides to the plug-in's engines. K3_HUMMING=1 puts
# humming-kernels (staged apart, /tmp/k3hum) on the path: vLLM then prefers its MXFP4 MoE to Marlin on SM90, the
# second stock variant (the records' moe_backend says which ran).
[ "${K3_HUMMING:-0}" = 1 ] && export PYTHONPATH=/tmp/k3hum${PYTHONPATH:+:$PYTHONPATH}
# small: the 4-layer model with the plug-in (greedy tokens, k3ref fidelity, the fused KDA layers against vLLM's own
# inside the engine), then stock vLLM on it if the call has time left. deep: the 36-layer model, stock then plug-in
# (~7 min on an H100 with cold caches); deep-*: one engine. layers-<shape> (k3_rank16, k3_rank8, full): stock vLLM's
# per-layer kernels and kernel time at batch 1 / 8 / 64 on the 4-layer model of that shape, the counterpart of the
# trace's stock cells (report --engine-match); layers: every shape, one after the other, while the call has time.
# The layers files are also kept in K3_ENGINE_DIR (default /tmp/k3eng) on the machine, so that a later call's sweep
# matches its stock records against them: scripts/device_sweep.sh --preset stock-vs-vllm --engine /tmp/k3eng/*.json
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
# kernels compiled once per machine, shared by this run's processes; .kcache may arrive pre-filled by
# scripts/precompile.py on the CPU machine (k3fast.kernels._dsl: the cache keys on the kernel sources)
export K3_KERNEL_CACHE=${K3_KERNEL_CACHE:-$PWD/.kcache}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1; cat "$OUT/gpu.txt"
t0=$(date +%s)
left() { echo $((${K3_CALL_S:-580} - ($(date +%s) - t0))); }
e2e() {  # e2e NAME ENGINE DEPTH BATCHES... (+ options via E2E_OPTS)
  local name=$1${K3_HUMMING:+-humming} engine=$2 depth=$3; shift 3
  timeout $(($(left) - 5)) python3 -m k3fast.measure.vllm_e2e run --engine "$engine" --depth "$depth" --batches "$@" \
    --out "$OUT/e2e-$name.json" $E2E_OPTS ${K3_PLAN:+--plan "$K3_PLAN"} > "$OUT/e2e-$name-$engine.log" 2>&1
  local rc=$?
  echo "== $name $engine rc=$rc after $(( $(date +%s) - t0 )) s"
  grep -E "^\[|Error|error:|Traceback|k3fast:" "$OUT/e2e-$name-$engine.log" | grep -v Warning | tail -25
  return $rc
}
case "${1:-small}" in
  small)
    E2E_OPTS="--parity --fidelity --probe --util 0.5 --steps ${K3_STEPS:-32} --repeats ${K3_REPEATS:-2}" e2e small-k3fast k3fast 4 1 8
    [ "$(left)" -gt 150 ] && E2E_OPTS="--parity --fidelity --util 0.5 --steps 32 --repeats 2" e2e small-stock stock 4 1 8
    ;;
  deep)      # both engines, one after the other, one file (python -m k3fast.measure.vllm_e2e both)
    timeout $(($(left) - 5)) python3 -m k3fast.measure.vllm_e2e both --depth 36 --batches 1 8 64 --parity --fidelity \
      --probe --util 0.88 --steps 32 --repeats 2 --out "$OUT/e2e-deep.json" > "$OUT/e2e-deep.log" 2>&1
    echo "== deep rc=$? after $(( $(date +%s) - t0 )) s"
    grep -E "^\[|Error|Traceback|k3fast:" "$OUT/e2e-deep.log" | grep -v Warning | tail -30
    ;;
  deep-k3fast|deep-stock)
    E2E_OPTS="--parity --fidelity --probe --util 0.88 --steps 32 --repeats 2" e2e deep "${1#deep-}" 36 1 8 64
    if [ "$1" = deep-k3fast ] && [ "$(left)" -gt 120 ]; then
      timeout $(($(left) - 5)) python3 -m pytest -m gpu -q -rfE tests/gpu/test_kda_conv_gate_step.py -k paged \
        --junitxml="$OUT/gpu-junit-paged.xml" > "$OUT/gpu-paged.log" 2>&1
      tail -3 "$OUT/gpu-paged.log"
    fi
    ;;
  layers|layers-*)
    shapes=${1#layers-}; [ "$1" = layers ] && shapes="k3_rank16 k3_rank8 full"
    mkdir -p "${K3_ENGINE_DIR:=/tmp/k3eng}"
    for s in $shapes; do
      # a 4-layer engine starts and profiles in a few minutes: a shape starts only with 150 s left
      [ "$(left)" -gt 150 ] || { echo "== layers-$s skipped: $(left) s left"; continue; }
      E2E_OPTS="--shape $s --util 0.85 --steps 8 --repeats 1" e2e "layers-$s" stock 4 1 8 64
      cp "$OUT"/e2e-layers-"$s"*.json "$K3_ENGINE_DIR/" 2>/dev/null
    done
    ;;
  *) echo "unknown run $1"; exit 2 ;;
esac
ls -la "$OUT"
