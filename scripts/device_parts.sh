#!/usr/bin/env bash
# Stage the H200 packages (../shared/device/prepare.sh), then re-split them into parts small enough to travel
# beside this tree: one device run carries at most 64 MiB in all (tracked files + the carried part), the tree is
# ~20 MB, and prepare.sh's 60 MB parts do not fit (session 13). Prints the run sequence for the new parts.
#   bash scripts/device_parts.sh [--vllm] [MiB per part, default 26: the tree is ~33 MiB since session 24, and the
#   limit counts disk blocks; 32 MiB parts left 0.2 MiB for new traces in session 24, 26 leave ~5]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
flag=""; [ "${1:-}" = "--vllm" ] && { flag="--vllm"; shift; }
mb=${1:-26}
rm -rf .device
bash ../shared/device/prepare.sh $flag > /dev/null
cd .device
tmp=$(mktemp)
cat $(ls -d [0-9]* | sort -n | sed 's|$|/part.*|') > "$tmp"
rm -rf [0-9]*
split -b "${mb}M" -d -a 2 "$tmp" part.
rm -f "$tmp"
n=0
for f in part.*; do n=$((n + 1)); mkdir -p "$n"; mv "$f" "$n/"; done
tree_mb=$(cd "$root" && git ls-files -z | du -cm --files0-from=- | tail -1 | cut -f1)
echo "$n parts of <= $mb MB (tree ~$tree_mb MB); run back to back (the machine is handed back 30 s after a run):"
for k in $(seq 1 $((n - 1))); do
  echo "  run command=\"bash .device/stage.sh $k\"   carry=[\".device/$k\", \".device/stage.sh\"]"
done
echo "  run command=\"bash .device/stage.sh $n >/dev/null && bash .device/stage.sh install 2>&1 | tail -1 && source /tmp/k3env.sh && <GPU command>\"   carry=[\".device/$n\", \".device/stage.sh\"]"
