#!/usr/bin/env bash
# This project's staging for the GPU machine it is lent, not a user step: a user with their own Hopper GPU installs
# the [gpu] extra (and [stock] for the peers) with pip and skips all of this.
#
# The lent machine has no network and no CuTe DSL; each run there carries the tracked tree plus at most 64 MiB in
# all. This packs the packages (scripts/device/prepare.sh: CuTe DSL, tvm-ffi, fla, nsight-python; --vllm adds
# vLLM) into .device/1, .device/2, ... of MiB each (default 26, leaving room for the tree and for what a run
# writes) and prints the run sequence; scripts/device/stage.sh installs them on the machine.
#   bash scripts/device_parts.sh [--vllm] [MiB per part]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
flag=""; [ "${1:-}" = "--vllm" ] && { flag="--vllm"; shift; }
K3_PART_MB=${1:-26} bash scripts/device/prepare.sh $flag
