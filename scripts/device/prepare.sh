#!/usr/bin/env bash
# This project's own staging for the GPU machine it is lent (no network there, one Python 3.12 with torch 2.11 cu130,
# ncu, no CuTe DSL): the Python packages the GPU runs need, packed into numbered parts that travel beside the tree.
# Not a user step: on your own Hopper GPU, `pip install -e .[gpu]` (and `.[stock]` for the peers) is all it takes.
#
#   bash scripts/device/prepare.sh [--vllm]      # usually through scripts/device_parts.sh
#
# Base: CuTe DSL 4.8.1 (cu13), apache-tvm-ffi, fla (the stock KDA kernels) and nsight-python with its dependencies
# (K3_NSIGHT=0 leaves those out). --vllm adds vLLM 0.33.0, pruned of what a Hopper GPU does not use, and the
# dependencies the machine lacks (vllm-lean.txt). K3_DEVICE_EXTRA="pkg==ver ..." adds more wheels.
# One run carries at most 64 MiB (the tracked tree plus the carried part), so the wheels travel in parts of
# K3_PART_MB MiB (default 26). Wheels are cached in ~/.cache/k3-device-wheels; the parts go to .device/ (ignored).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
here=$(cd "$(dirname "$0")" && pwd)
cache=${K3_WHEEL_CACHE:-$HOME/.cache/k3-device-wheels}
part_mb=${K3_PART_MB:-26}
with_vllm=0; [ "${1:-}" = "--vllm" ] && with_vllm=1

plats=()   # every manylinux tag the machine's glibc accepts (x86_64)
for v in 35 34 33 32 31 30 29 28 27 26 25 24 17 5; do plats+=(--platform "manylinux_2_${v}_x86_64"); done
plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
dl() {  # dl DIR PKG...   (cp312 wheels for the GPU machine, without their dependencies; fails loudly)
  local d=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}" \
    -d "$d" "$@" 2> >(grep -v WARNING >&2)
}
fetch_once() {  # fetch_once DIR PKG...   (downloads again only when the list changes)
  local d=$1; shift
  local stamp="$d/.done-$(echo "$*" | md5sum | cut -c1-8)"
  mkdir -p "$d"
  [ -f "$stamp" ] || { dl "$d" "$@" && touch "$stamp"; }
}

BASE=(nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
      nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 fla-core==0.6.0 flash-linear-attention==0.6.0
      ${K3_DEVICE_EXTRA:-})
# nsight-python 0.9.6 (1.x needs Nsight Compute 2026.2.1 or newer; Hopper images ship ncu 2025.x) and what it needs
# beyond the image's own packages (pandas, matplotlib and python-dateutil are there): the ncu-report wheel (abi3,
# any CPython 3.7+; a profile run with only ncu's own extras/python bindings on the path dies of SIGSEGV on the H100
# image, cause not isolated) and nvidia-ml-py. nvtx at the version the vLLM set pins, so both sets can be staged together.
NSIGHT=(nsight-python==0.9.6 nvtx==0.2.15 deepdiff==9.1.0 orderly-set==5.5.0 cachebox==5.2.3 ncu-report==2026.3.1
        nvidia-ml-py==13.615.71)

fetch_once "$cache/base" "${BASE[@]}"
payload=("$cache"/base/*.whl)
if [ "${K3_NSIGHT:-1}" != 0 ]; then
  fetch_once "$cache/nsight" "${NSIGHT[@]}"
  payload+=("$cache"/nsight/*.whl)
fi
vpayload=()
if [ $with_vllm = 1 ]; then
  v="$cache/vllm"
  if [ ! -f "$v/.done" ]; then
    rm -rf "$v" && mkdir -p "$v/wheels"
    mapfile -t lean < "$here/vllm-lean.txt"
    dl "$v/wheels" "${lean[@]}"
    dl "$v" vllm==0.33.0
    t="$v/unpack"; rm -rf "$t"; mkdir -p "$t"; (cd "$t" && unzip -q "$v"/vllm-0.33.0-*.whl)
    # Not needed on Hopper: FA2 (FA3 serves sm_90), the Rust front end, the SM100-only FMHA.
    rm -rf "$t"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$t"/vllm/vllm-rs "$t"/vllm/third_party/fmha_sm100
    (cd "$t" && tar cf - . | xz -6 -T2 > "$v/vllm-0.33.0-pruned.tar.xz")
    rm -rf "$t" "$v"/vllm-0.33.0-*.whl && touch "$v/.done"
  fi
  vpayload=("$v"/wheels/*.whl "$v/vllm-0.33.0-pruned.tar.xz")
  # humming-kernels: vLLM prefers its MXFP4 MoE over Marlin on SM90 when it is importable. It travels as an
  # "optional-" file that stage.sh installs apart (/tmp/k3hum), so a stock engine gets it only when asked
  # (scripts/device_vllm_e2e.sh with K3_HUMMING=1); the image has its dependencies (cuda-toolkit, jinja2, ...).
  fetch_once "$cache/humming" humming-kernels==0.1.20
  mkdir -p "$cache/humming-opt"
  for w in "$cache"/humming/*.whl; do cp -n "$w" "$cache/humming-opt/optional-$(basename "$w")"; done
  vpayload+=("$cache"/humming-opt/optional-*.whl)
fi
# one copy of each file name (a wheel both sets pin travels once)
mapfile -t payload < <(printf '%s\n' "${payload[@]}" | awk -F/ '!seen[$NF]++')
seen_base=$(printf '%s\n' "${payload[@]}" | awk -F/ '{print $NF}')
vfiles=()
for f in "${vpayload[@]}"; do grep -qxF "$(basename "$f")" <<< "$seen_base" || vfiles+=("$f"); done

# Two tar series: the base set (part.*) and the vLLM set (vpart.*), so that a session can stage the base alone and
# add vLLM later on the same machine (stage.sh install takes whatever series arrived since the last install).
rm -rf "$root/.device" && mkdir -p "$root/.device"
n=0
series() {  # series PREFIX FILE...
  local prefix=$1; shift
  tar cf - -C / "${@#/}" --transform 's|.*/||' | split -b "${part_mb}M" -d -a 2 - "$root/.device/$prefix."
  for f in "$root"/.device/"$prefix".*; do n=$((n+1)); mkdir -p "$root/.device/$n"; mv "$f" "$root/.device/$n/"; done
}
series part "${payload[@]}"
nbase=$n
[ ${#vfiles[@]} = 0 ] || series vpart "${vfiles[@]}"
cp "$here/stage.sh" "$root/.device/stage.sh"
tree_mb=$(cd "$root" && git ls-files -z | du -cm --files0-from=- | tail -1 | cut -f1)
echo "$n parts of <= $part_mb MiB beside a tree of ~$tree_mb MiB (a run carries at most 64 MiB in all);"
echo "parts 1-$nbase: the base set$([ $n -gt $nbase ] && echo "; parts $((nbase+1))-$n: vLLM")."
echo "Run sequence on a fresh machine, back to back (it is handed back soon after a run ends):"
last() { echo "  run command=\"bash .device/stage.sh $1 && bash .device/stage.sh install && source /tmp/k3env.sh && <GPU command>\"   carry=[\".device/$1\", \".device/stage.sh\"]"; }
for i in $(seq 1 $((nbase-1))); do echo "  run command=\"bash .device/stage.sh $i\"   carry=[\".device/$i\", \".device/stage.sh\"]"; done
last $nbase
for i in $(seq $((nbase+1)) $((n-1))); do echo "  run command=\"bash .device/stage.sh $i\"   carry=[\".device/$i\", \".device/stage.sh\"]"; done
[ $n -gt $nbase ] && last $n
echo "While it stays warm, later runs: command=\"source /tmp/k3env.sh && <GPU command>\" (no carry)."
