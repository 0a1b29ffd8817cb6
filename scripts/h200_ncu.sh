#!/usr/bin/env bash
# Nsight Compute on the H200 for the cases of scripts/ncu_cases.py (one profiled launch each, caches flushed by
# ncu before every replay pass, clocks left alone as the device notes ask). Writes $OUT/ncu.tgz (one text report
# per case; ncu-2.tgz, ... when it exists) and prints the headline rows. Usage: bash scripts/h200_ncu.sh "<case args>" ["<case args>" ...]
# InstructionStats (session 10) gives the executed instruction mix by opcode class, e.g. for the fused in_proj's
# 7.1 M warp instructions at rank16 b1 (~79 per 512-byte warp load); K3_NCU_EXTRA adds ncu options other than
# --metrics (ncu 2025.3 refuses a second --metrics); K3_NCU_METRICS appends names to the one --metrics list, e.g.
# K3_NCU_METRICS=sm__cycles_active.min,sm__cycles_active.max for the per-SM spread.
set -u
: "${OUT:?}"
tmp=$(mktemp -d)
PD=""
ncu --help 2>/dev/null | grep -q -- "--print-details" && PD="--print-details all"
for c in "$@"; do
  n=$(echo "$c" | tr -s ' ' '_' | tr -d -- '-')
  timeout "${K3_NCU_TIMEOUT:-150}" ncu --clock-control none --nvtx --nvtx-include "profile/" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section SchedulerStats --section WarpStateStats --section InstructionStats $PD ${K3_NCU_EXTRA:-} \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio${K3_NCU_METRICS:+,$K3_NCU_METRICS}" \
    python3 scripts/ncu_cases.py $c > "$tmp/ncu-$n.txt" 2>&1
  echo "== $c (rc $?)"
  grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|No kernels|ERR|Error" \
    "$tmp/ncu-$n.txt" | head -12
  grep -E "issue_stalled" "$tmp/ncu-$n.txt" | sort -k3 -g -r | head -6
done
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  ncu --version | tail -1
  python3 -c "import torch, importlib.metadata as m; print('torch', torch.__version__, 'cutlass', m.version('nvidia-cutlass-dsl'))"
  echo "commit ${K3_COMMIT:-unknown}; cases: $*"
  echo "extra metrics: ${K3_NCU_METRICS:-none}; extra options: ${K3_NCU_EXTRA:-none}"; } > "$tmp/meta.txt" 2>&1
# Two ncu steps chained in one device command (s44's ncu5; ncu6) must not overwrite each other: session 16 lost
# ncu5's reports that way. The second archive is ncu-2.tgz, and so on.
arc="$OUT/ncu.tgz"; k=2
while [ -e "$arc" ]; do arc="$OUT/ncu-$k.tgz"; k=$((k + 1)); done
tar czf "$arc" -C "$tmp" .
# The device returns at most 8 files from $OUT: when this archive is one too many after a sweep (s18 lost its
# sweep.log that way), the logs and gpu.txt travel as one logs.tgz (added to, if the sweep made one already).
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
  (cd "$OUT" && if [ -f logs.tgz ]; then gunzip -c logs.tgz > logs.tar; else tar cf logs.tar --files-from /dev/null; fi \
     && tar rf logs.tar $(ls *.log gpu.txt 2>/dev/null) && gzip -c logs.tar > logs.tgz && rm -f logs.tar *.log gpu.txt)
fi
