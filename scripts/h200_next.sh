#!/usr/bin/env bash
# On the H200: the measurements k3fast/LOG.md lists under "Next session, in order", as separate steps so each fits
# one 10-minute device call. Files under $OUT (<= 8 per call).
#   K3_COMMIT=<commit> bash scripts/h200_next.sh tests     # all GPU tests (~6 min)
#   K3_COMMIT=<commit> bash scripts/h200_next.sh kda       # KDA+MoE fast vs stock + kernel bench + experts probe
#   K3_COMMIT=<commit> bash scripts/h200_next.sh skewed    # KDA+MoE with routing skewed onto 24 hot experts
#   K3_COMMIT=<commit> bash scripts/h200_next.sh mla       # MLA+MoE stock (FlashMLA core) at every cell
set -o pipefail
cd "$(dirname "$0")/.."
: "${K3_COMMIT:?set K3_COMMIT to the commit the tree was sent at}"
export K3_COMMIT
case "${1:-}" in
  tests)  K3_TEST_TIMEOUT=${K3_TEST_TIMEOUT:-540} bash scripts/h200_tests.sh ;;
  kda)    K3_SWEEP_TIMEOUT=200 K3_BENCH="--shapes k3_rank16 full --batches 1 8 64" K3_BENCH_TIMEOUT=150 \
          K3_EXPERTS="--shapes k3_rank16 --batches 1 8 64" K3_EXPERTS_TIMEOUT=210 \
          bash scripts/h200_sweep.sh --kinds kda_moe --impls stock fast fast-v4 --budget-s 150 ;;
  skewed) K3_SWEEP_TIMEOUT=500 bash scripts/h200_sweep.sh --kinds kda_moe --routing skewed --impls stock fast \
          --budget-s 420 ;;
  mla)    K3_SWEEP_TIMEOUT=540 bash scripts/h200_sweep.sh --kinds mla_moe --impls stock --budget-s 480 ;;
  *) echo "usage: K3_COMMIT=<commit> bash scripts/h200_next.sh tests|kda|skewed|mla"; exit 2 ;;
esac
