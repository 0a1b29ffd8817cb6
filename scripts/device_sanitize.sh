#!/usr/bin/env bash
# On the lent GPU machine (CuTe DSL staged): the sanitizer tier. Runs k3fast.measure.sanitize's launch set (every
# shipped kernel key of the fused layer, once, eagerly) under compute-sanitizer's memcheck, racecheck, synccheck
# and initcheck, one process per tool, and writes the logs and a summary (sanitizer.json) under $OUT.
#   [K3_TOOLS="memcheck racecheck"] [K3_SHAPES="k3_rank16 k3_rank8 full"] K3_COMMIT=<sha> bash scripts/device_sanitize.sh
# K3_CALL_S (default 580) bounds the whole call.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
# kernels compiled once per machine, shared by this run's processes; .kcache may arrive pre-filled by
# scripts/precompile.py on the CPU machine (k3fast.kernels._dsl: the cache keys on the kernel sources)
export K3_KERNEL_CACHE=${K3_KERNEL_CACHE:-$PWD/.kcache}
# K3_SAN_NO_CACHING=1: every tensor its own cudaMalloc, so memcheck and initcheck see each buffer's bounds (torch's
# caching allocator hides an overrun that stays inside one of its pooled segments). Off by default: with it, every
# tool's process ran out of GPU memory while re-laying the second layer's experts, a few GB by the tensors' sizes
# (not yet understood; the re-lay allocates and frees many chunk-sized temporaries). With the pool, memcheck still catches
# accesses outside torch's segments and every misaligned or illegal address.
[ "${K3_SAN_NO_CACHING:-0}" = 1 ] && export PYTORCH_NO_CUDA_MEMORY_CACHING=1
t0=$(date +%s)
left() { echo $((${K3_CALL_S:-580} - ($(date +%s) - t0))); }
tools=(${K3_TOOLS:-memcheck synccheck racecheck initcheck})
shapes=${K3_SHAPES:-k3_rank16 k3_rank8 full}
compute-sanitizer --version | tail -1 > "$OUT/sanitizer-version.txt"
# One tool at a time, each with its share of what is left of the call (racecheck, which instruments every shared
# memory access, two shares: it took over 90 s for the first cell); the launch set records each cell as it goes.
share() { [ "$1" = racecheck ] && echo 2 || echo 1; }
for tool in "${tools[@]}"; do
  total=0; seen=0
  for t in "${tools[@]}"; do [ "$t" = "$tool" ] && seen=1; [ $seen = 1 ] && total=$((total + $(share "$t"))); done
  budget=$(( ($(left) - 15) * $(share "$tool") / total ))
  extra=()
  case $tool in
    memcheck)  extra=(--leak-check no) ;;
    racecheck) extra=(--racecheck-report all) ;;
  esac
  s=$(date +%s)
  nvidia-smi --query-gpu=memory.used --format=csv,noheader > "$OUT/sanitizer-$tool-mem-before.txt" 2>&1
  timeout "$budget" compute-sanitizer --tool "$tool" "${extra[@]}" --print-limit 200 --error-exitcode 99 \
    --log-file "$OUT/sanitizer-$tool.log" \
    python3 -m k3fast.measure.sanitize --out "$OUT/sanitizer-$tool-launched.json" --shapes $shapes \
    > "$OUT/sanitizer-$tool.out" 2>&1
  rc=$?
  echo "$tool $rc $(( $(date +%s) - s )) $budget" >> "$OUT/sanitizer-rc.txt"
  echo "$tool rc=$rc in $(( $(date +%s) - s )) s (budget $budget s): $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' \
    "$OUT/sanitizer-$tool.log" 2>/dev/null | tail -1)"
done
python3 - "$OUT" <<'EOF'
import json, os, re, subprocess, sys
out = sys.argv[1]
def sh(c):
    try:
        return subprocess.run(c, shell=True, capture_output=True, text=True).stdout.strip()
    except Exception:
        return ""
summary = {"kind": "sanitizer", "gpu": sh("nvidia-smi --query-gpu=name --format=csv,noheader"),
           "driver": sh("nvidia-smi --query-gpu=driver_version --format=csv,noheader"),
           "sanitizer": open(os.path.join(out, "sanitizer-version.txt")).read().strip(),
           "commit": os.environ.get("K3_COMMIT", ""), "tools": {}}
for line in open(os.path.join(out, "sanitizer-rc.txt")):
    tool, rc, secs, budget = line.split()
    log = os.path.join(out, f"sanitizer-{tool}.log")
    text = open(log, errors="replace").read() if os.path.exists(log) else ""
    m = re.findall(r"(ERROR|RACECHECK) SUMMARY: (\d+) (?:error|hazard)", text)
    launched = os.path.join(out, f"sanitizer-{tool}-launched.json")
    run = json.load(open(launched)) if os.path.exists(launched) else {}
    kernels = sorted(set(re.findall(r"(?:in|kernel) ([A-Za-z_][\w:<>, ]{3,120}?)(?:\(|$)", text)))[:40]
    summary["tools"][tool] = {"rc": int(rc), "seconds": int(secs), "timed_out": int(rc) in (124, 137),
                              "errors": int(m[-1][1]) if m else None,
                              "cells": len(run.get("cells", [])), "kernel_keys": len(run.get("kernel_keys", [])),
                              "complete": run.get("complete", False), "flagged_in": kernels}
json.dump(summary, open(os.path.join(out, "sanitizer.json"), "w"), indent=1)
print(json.dumps({t: {k: v for k, v in s.items() if k != "flagged_in"} for t, s in summary["tools"].items()}))
EOF
