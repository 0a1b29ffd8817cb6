#!/usr/bin/env bash
# On the lent GPU machine (CuTe DSL staged): the sanitizer tier. Runs k3fast.measure.sanitize's launch set (every
# shipped kernel key of the fused layer, once, eagerly) under compute-sanitizer's memcheck, synccheck, initcheck
# and racecheck: one process per tool and part of the set, so a part that fails or runs out of time leaves the
# others' verdicts standing. Logs and a summary (sanitizer.json, k3fast.measure.sanitize.summarize) under $OUT.
# K3_TOOLS may name "none": the same processes without compute-sanitizer (the memory each cell holds, bare).
# K3_SAN_ARGS adds options to every tool's command line, e.g. "--kernel-name kns=RingMmaGemv": the tool instruments
# only the kernels whose name holds that string and the rest run at full speed (racecheck one kernel at a time).
#   [K3_TOOLS="memcheck racecheck"] [K3_PARTS="k3_rank16 pool mla"] [K3_BATCHES="1"] K3_COMMIT=<sha> \
#   bash scripts/device_sanitize.sh
# K3_CALL_S (default 580) bounds the whole call.
# K3_PDL=0: every kernel launched without programmatic dependent launch (same results, no overlap): a control for
# a tool that may not follow PDL.
# K3_SAN_MEMHIST=1: each cell of the launched JSON names the call sites holding GPU memory (torch's allocation
# history; k3fast.measure.sanitize.held_by).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
# kernels compiled once per machine, shared by this run's processes; .kcache may arrive pre-filled by
# scripts/precompile.py on the CPU machine (k3fast.kernels._dsl: the cache keys on the kernel sources)
export K3_KERNEL_CACHE=${K3_KERNEL_CACHE:-$PWD/.kcache}
# K3_SAN_NO_CACHING=1: every tensor its own cudaMalloc, so memcheck and initcheck see each buffer's bounds (torch's
# caching allocator hides an overrun that stays inside one of its pooled segments). Off by default: with the pool,
# memcheck still catches accesses outside torch's segments and every misaligned or illegal address.
[ "${K3_SAN_NO_CACHING:-0}" = 1 ] && export PYTORCH_NO_CUDA_MEMORY_CACHING=1
t0=$(date +%s)
left() { echo $((${K3_CALL_S:-580} - ($(date +%s) - t0))); }
tools=(${K3_TOOLS:-memcheck synccheck initcheck racecheck})
parts=(${K3_PARTS:-control control-torch k3_rank16 pool mla k3_rank8 full})
# K3_BATCHES="1": the width parts at batch 1 only (racecheck, slowest per launch, gets through more kernels so)
batches=${K3_BATCHES:+--batches $K3_BATCHES}
compute-sanitizer --version | tail -1 > "$OUT/sanitizer-version.txt"
# Each tool gets its share of what is left of the call (racecheck, which instruments every shared memory access,
# three shares), and each part its weight of the tool's share (full width moves the most data).
share() { [ "$1" = racecheck ] && echo 3 || echo 1; }
weight() { case $1 in full) echo 3 ;; k3_rank16|k3_rank8) echo 2 ;; *) echo 1 ;; esac; }
for tool in "${tools[@]}"; do
  total=0; seen=0
  for t in "${tools[@]}"; do [ "$t" = "$tool" ] && seen=1; [ $seen = 1 ] && total=$((total + $(share "$t"))); done
  tool_end=$(( $(date +%s) + ($(left) - 15) * $(share "$tool") / total ))
  extra=()
  case $tool in
    memcheck)  extra=(--leak-check no) ;;
    racecheck) extra=(--racecheck-report all) ;;
  esac
  for i in "${!parts[@]}"; do
    part=${parts[$i]}
    wleft=0; for q in "${parts[@]:$i}"; do wleft=$((wleft + $(weight "$q"))); done
    budget=$(( (tool_end - $(date +%s)) * $(weight "$part") / wleft ))
    [ "$budget" -ge 10 ] || { echo "$tool $part: no time left"; continue; }
    s=$(date +%s)
    launch=(python3 -m k3fast.measure.sanitize --out "$OUT/sanitizer-$tool-$part-launched.json" --parts "$part" $batches)
    if [ "$tool" = none ]; then
      # the launch set without a tool: the GPU memory each cell holds when nothing instruments the process
      timeout "$budget" "${launch[@]}" > "$OUT/sanitizer-$tool-$part.out" 2>&1
    else
      timeout "$budget" compute-sanitizer --tool "$tool" "${extra[@]}" ${K3_SAN_ARGS:-} --print-limit 200 --error-exitcode 99 \
        --log-file "$OUT/sanitizer-$tool-$part.log" "${launch[@]}" > "$OUT/sanitizer-$tool-$part.out" 2>&1
    fi
    rc=$?
    echo "$tool $part $rc $(( $(date +%s) - s )) $budget" >> "$OUT/sanitizer-rc.txt"
    echo "$tool $part rc=$rc in $(( $(date +%s) - s )) s (budget $budget s): $(grep -h 'ERROR SUMMARY: [0-9]* errors*$\|RACECHECK SUMMARY' \
      "$OUT/sanitizer-$tool-$part.log" 2>/dev/null | tail -1)"
  done
done
K3_GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) \
K3_DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1) \
  python3 -m k3fast.measure.sanitize --summarize "$OUT"
