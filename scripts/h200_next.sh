#!/usr/bin/env bash
# On the H200: the measurements k3fast/LOG.md lists under "Next session, in order", as separate steps so each fits
# one 10-minute device call. Files under $OUT (<= 8 per call).
#   K3_COMMIT=<commit> bash scripts/h200_next.sh tests     # all GPU tests (~9 min: use tests1 + tests2)
#   K3_COMMIT=<commit> bash scripts/h200_next.sh changed   # the GPU tests of what changed since the last full run
#   K3_COMMIT=<commit> bash scripts/h200_next.sh kda       # KDA+MoE stock/fast/fast-splitk + kernel bench + experts probe
#   K3_COMMIT=<commit> bash scripts/h200_next.sh skewed    # KDA+MoE with routing skewed onto 24 hot experts
#   K3_COMMIT=<commit> bash scripts/h200_next.sh mla       # MLA+MoE stock (FlashMLA core) at every cell
set -o pipefail
cd "$(dirname "$0")/.."
# K3_COMMIT: the commit the tree was sent at, written out on the CPU side (never `git rev-parse` on the device: its
# copy's git metadata can be stale, s107). Each record's source_digest checks it: python -m k3fast.provenance FILE
: "${K3_COMMIT:?set K3_COMMIT to the commit the tree was sent at}"
export K3_COMMIT
export K3_TAG="${K3_TAG:-$K3_COMMIT-${1:-}}"      # records-<commit>-<step>.json and perfetto-<commit>-<step>/

# Nsight Compute (--set full) of one k3fast.bench case at rank16 b64, the report kept on the device under /tmp/NAME
# (the tree travels under a 64 MiB carry limit); its details page and its source page per SASS instruction come back
# gzipped under $OUT as NAME-details.txt.gz and NAME-sass.csv.gz (nbtools.sass_hotspots reads the latter)
ncu_sass() {      # ncu_sass <bench case> <name> <time-out s> [extra ncu_cases.py args, e.g. "--stock 1"]
  local o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
  timeout "$3" ncu --clock-control none --nvtx --nvtx-include "profile/" --set full -o "/tmp/$2" \
    python3 scripts/ncu_cases.py bench --kernel "$1" --shape k3_rank16 --batch 64 ${4:-} > "$o/ncu.log" 2>&1
  tail -3 "$o/ncu.log"
  ncu --import "/tmp/$2.ncu-rep" --page source --csv --print-source sass > "$o/$2-sass.csv" 2>&1
  ncu --import "/tmp/$2.ncu-rep" --print-details all > "$o/$2-details.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Shared Memory|Achieved Occupancy|Registers Per|Waves Per SM" "$o/$2-details.txt" | head -20
  gzip "$o/$2-sass.csv" "$o/$2-details.txt"
}

a0pad8_bench() {  # s109's experts bench (A0pad8 beside A0 and the default at rank16 / rank8 b8), uniform then
  # skewed, each process under timeout $1; the two logs packed into one file (<= 8 files come back from $OUT)
  o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
  for r in uniform skewed; do
    timeout "$1" python3 -m k3fast.bench_experts --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 \
      --batches 8 --variants default A0 A0pad8 --replays 50 --routing $r > "$o/experts-$r.log" 2>&1
    grep -v -i warn "$o/experts-$r.log" | tail -8; done
  tar czf "$o/experts-logs.tgz" -C "$o" experts-uniform.log experts-skewed.log && rm -f "$o"/experts-*.log
}

s110_cells() {    # every issue cell, KDA layer: stock and fast, and fast-v51 (v5.2's A/B) at b8
  for s in k3_rank16 k3_rank8 full; do for b in 1 8 64; do
    i=stock+fast; [ $b = 8 ] && i=$i+fast-v51; echo "--cell kda_moe,$s,$b,0,$i"; done; done
}
case "${1:-}" in
  tests)  K3_TEST_TIMEOUT=${K3_TEST_TIMEOUT:-540} bash scripts/h200_tests.sh ;;
  # the whole GPU tier in two calls (since 2026-11-29 it is ~9 min, past one call's limit with the start-up):
  tests1) K3_TEST_TIMEOUT=540 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv.py tests/gpu/test_gemv_splitk.py \
          tests/gpu/test_oproj_attnres.py tests/gpu/test_kda_conv_gate_step.py tests/gpu/test_router_down_topk.py \
          tests/gpu/test_moe_tail.py ;;
  # the experts file alone since the rot layout (~140 cases, compile time dominates)
  tests1x) K3_TEST_TIMEOUT=540 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py ;;
  tests2) K3_TEST_TIMEOUT=540 bash scripts/h200_tests.sh tests/gpu/test_fast_layer.py tests/gpu/test_stock_compiled.py \
          tests/gpu/test_stock_vllm_ops.py tests/gpu/test_ops.py ;;
  # the GPU tests of session 4's CPU-only changes (cuBLAS in_proj/o_proj/front dispatch, router v2.2 occupancy hint)
  changed5) K3_TEST_TIMEOUT=500 bash scripts/h200_tests.sh tests/gpu/test_fast_layer.py tests/gpu/test_router_down_topk.py \
          tests/gpu/test_ops.py tests/gpu/test_rms_gemv.py tests/gpu/test_oproj_attnres.py ;;
  # what changed since the last GPU test run (2026-11-29): experts clusters, fused ks, gemv_splitk
  changed) K3_TEST_TIMEOUT=260 bash scripts/h200_tests.sh tests/gpu/test_gemv_splitk.py \
          tests/gpu/test_moe_mxfp4_experts.py tests/gpu/test_fast_layer.py tests/gpu/test_router_down_topk.py \
          tests/gpu/test_rms_gemv.py -k "(splitk or cluster or attnres_rms_gemv or fused or fast or router or matches or v4) and not full_width" ;;
  kda)    K3_SWEEP_TIMEOUT=190 K3_BENCH="--shapes k3_rank16 --batches 1 8 64" K3_BENCH_TIMEOUT=80 \
          K3_EXPERTS="--shapes k3_rank16 --batches 1 8 64 --variants default probe C4 D4 D12 W16D8 Dprobe4 v3C8" \
          K3_EXPERTS_TIMEOUT=140 \
          bash scripts/h200_sweep.sh --kinds kda_moe --impls stock fast fast-splitk --budget-s 150 ;;
  skewed) K3_SWEEP_TIMEOUT=330 K3_EXPERTS="--shapes k3_rank16 --batches 1 8 64 --routing skewed --variants default v5 v5W16D8" \
          K3_EXPERTS_TIMEOUT=120 bash scripts/h200_sweep.sh --kinds kda_moe --routing skewed --impls stock fast fast-v5 \
          --budget-s 280 ;;
  mla)    K3_SWEEP_TIMEOUT=540 bash scripts/h200_sweep.sh --kinds mla_moe --impls stock --budget-s 480 ;;
  # issue 3's last 12 cells (records at 21f6cdf lack them), ordered so that cells sharing a torch.compile graph
  # (same shape and batch, two MLA contexts) run back to back; records are rewritten after every cell
  cellsA) K3_SWEEP_TIMEOUT=${K3_SWEEP_TIMEOUT:-500} bash scripts/h200_sweep.sh --budget-s ${K3_BUDGET:-380} \
          --cell mla_moe,k3_rank8,8,1024,compiled --cell mla_moe,k3_rank8,8,8192,compiled \
          --cell mla_moe,k3_rank8,64,1024,compiled --cell mla_moe,k3_rank8,64,8192,compiled \
          --cell mla_moe,full,1,1024,compiled --cell mla_moe,full,1,8192,compiled \
          --cell mla_moe,full,64,8192,ref ;;
  cellsB) K3_SWEEP_TIMEOUT=${K3_SWEEP_TIMEOUT:-500} bash scripts/h200_sweep.sh --budget-s ${K3_BUDGET:-380} \
          --cell mla_moe,full,8,1024,compiled --cell mla_moe,full,8,8192,compiled \
          --cell mla_moe,full,64,1024,compiled --cell mla_moe,full,64,8192,compiled \
          --cell kda_moe,full,64,0,compiled ;;
  # the cells cellsA/cellsB could not record (capture out of memory, fixed in k3fast.trace.capture; an uncaught
  # out-of-memory while building a cell's weights), in two calls
  cellsC) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True K3_SWEEP_TIMEOUT=${K3_SWEEP_TIMEOUT:-520} \
          bash scripts/h200_sweep.sh --budget-s ${K3_BUDGET:-400} \
          --cell mla_moe,k3_rank8,64,1024,compiled --cell mla_moe,k3_rank8,64,8192,compiled \
          --cell mla_moe,full,8,1024,compiled --cell mla_moe,full,64,8192,ref ;;
  cellsD) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True K3_SWEEP_TIMEOUT=${K3_SWEEP_TIMEOUT:-520} \
          bash scripts/h200_sweep.sh --budget-s ${K3_BUDGET:-400} \
          --cell mla_moe,full,64,1024,compiled --cell mla_moe,full,64,8192,compiled \
          --cell kda_moe,full,64,0,compiled ;;
  # issue 3's last three cells, one process each: in one process the compiled reference kept earlier cells'
  # memory (the KDA cell ran out of memory after two full-width MLA cells, records-7b9edd7-cellsD.json)
  cellsF) rc=0; for c in mla_moe,full,8,1024,compiled mla_moe,full,64,1024,compiled kda_moe,full,64,0,compiled; do
            OUT="$OUT/${c//,/_}" K3_SWEEP_TIMEOUT=180 bash scripts/h200_sweep.sh --cell "$c" || rc=1; done; exit $rc ;;
  # the rot-layout experts and the cuBLAS tail (2026-11-29): their GPU tests, then the A/B in one run
  rot)    K3_TEST_TIMEOUT=420 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py tests/gpu/test_fast_layer.py \
          tests/gpu/test_ops.py -k "rot or 16_warps or moe_half or ops or (v5_matches and (64 or 3072)) or \
          (test_matches_reference and (ties or 384 or 3072 or 64-256))" ;;
  rotperf) K3_SWEEP_TIMEOUT=200 K3_EXPERTS="--shapes k3_rank16 --batches 1 8 64 --variants default nibble probe W8 v5" \
          K3_EXPERTS_TIMEOUT=130 K3_BENCH="--shapes k3_rank16 --batches 1 8 64" K3_BENCH_TIMEOUT=150 \
          bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 --impls stock fast fast-w8 fast-nibble fast-alldsl fast-overlap \
          --budget-s 170 ;;
  # session 5: the cuBLAS front's top-k kernel (+ shared gate/up folded in), the router hint revert; tests, then the A/B
  s5tests) K3_TEST_TIMEOUT=420 bash scripts/h200_tests.sh tests/gpu/test_router_down_topk.py tests/gpu/test_fast_layer.py \
          tests/gpu/test_ops.py -k "router or moe_half or gemv0 or ops or graph_replay or boundary" ;;
  s5fix) K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh tests/gpu/test_fast_layer.py -k "moe_half and (overlap or front0 or 64-fast])" ;;
  s5perf) K3_SWEEP_TIMEOUT=230 K3_BENCH="--shapes k3_rank16 --batches 1 8 64 --kernels router_down_topk \
          router_down_topk@minb9 router_down_topk_cublas router_down_topk_cublas+shared shared_expert_gate_up" \
          K3_BENCH_TIMEOUT=120 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 \
          --impls stock fast fast-front0 fast-front4 fast-gemv0 fast-shapart --budget-s 200 ;;
  # (fast-front4 was the name, at cd4a730, of today's default front threshold; fast-front16 is the old one)
  # session 6: router v2.4 (rolled top-k, opt-in) and the session-5 thresholds; tests, then the A/B, then every shape
  s6tests) K3_TEST_TIMEOUT=420 bash scripts/h200_tests.sh tests/gpu/test_router_down_topk.py tests/gpu/test_fast_layer.py \
          tests/gpu/test_rms_gemv.py tests/gpu/test_moe_mxfp4_experts.py -k "router or rolled or front0r or front16 \
          or gemv8 or shlate or graph_replay or two_groups or gemvg2 or v6"; rc=$?
          # experts v6 against the default and the stream probe at b1 / b2 (experts-<commit>.json)
          timeout 120 python3 -m k3fast.bench_experts --out "$OUT" --tag "$K3_COMMIT" --shapes k3_rank16 --batches 1 2 \
            --variants default v6 probe v6probe > "$OUT/experts.log" 2>&1 || rc=1
          exit $rc ;;
  s6perf) K3_SWEEP_TIMEOUT=300 K3_BENCH="--shapes k3_rank16 --batches 1 8 64 --kernels router_down_topk \
          router_down_topk@rolled router_down_topk_cublas+shared router_down_topk_cublas+shared@rolled \
          topk_from_logits topk_from_logits~warm topk_from_logits@rolled topk_from_logits@rolled~warm \
          attnres_rms_gemv attnres_rms_gemv@G2" K3_BENCH_TIMEOUT=120 \
          bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 --impls stock fast fast-rolled fast-shlate \
          fast-gemvg2 fast-v6 fast-front0 fast-front0r fast-front16 fast-gemv8 --budget-s 240 ;;
  # session 6, second run: router v2.5 (default) and the bulk L2 prefetch opt-ins; tests, then the A/B
  # (as run at 1214f05: fast-gemvpf / fast-frontpf / fast-pf and their @pf bench rows were removed afterwards)
  s7tests) K3_TEST_TIMEOUT=400 bash scripts/h200_tests.sh tests/gpu/test_router_down_topk.py tests/gpu/test_fast_layer.py \
          tests/gpu/test_moe_tail.py tests/gpu/test_rms_gemv.py -k "router or pf or prefetch or bulk or graph_replay \
          or -fast]" ;;
  s7perf) K3_SWEEP_TIMEOUT=300 K3_BENCH="--shapes k3_rank16 --batches 1 8 64 --kernels router_down_topk \
          router_down_topk@pf router_down_topk@rolled router_down_topk_cublas+shared topk_from_logits \
          topk_from_logits~warm topk_from_logits@rolled attnres_rms_gemv attnres_rms_gemv@pf shared_expert_gate_up \
          shared_expert_gate_up@pf moe_tail moe_tail@pf" K3_BENCH_TIMEOUT=150 \
          bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 --impls stock fast fast-rolled fast-tailpf \
          fast-shlatepf fast-gemvpf fast-frontpf fast-pf fast-front0 --budget-s 240 ;;
  # session 6, last run (~5 min of device time left): TopkFromLogits' batched z copy (default) and the early
  # PDL triggers of the attention chain (fast-trig): their GPU tests, the rank16 A/B and the top-k bench rows
  s8) K3_TEST_TIMEOUT=110 bash scripts/h200_tests.sh tests/gpu/test_router_down_topk.py tests/gpu/test_fast_layer.py \
          tests/gpu/test_kda_conv_gate_step.py -k "router or fast-trig or back_to_back"; rc=$?
      K3_SWEEP_TIMEOUT=110 K3_BENCH="--shapes k3_rank16 --batches 1 8 --kernels topk_from_logits \
          topk_from_logits~warm" K3_BENCH_TIMEOUT=50 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 \
          --impls stock fast fast-trig --budget-s 90 || rc=1
      exit $rc ;;
  # session 7: the opt-ins written after session 6's last run (o_proj w_post preload, the pinned in_proj loads,
  # the tail's per-line L2 prefetch); their GPU tests, then the rank16 A/B and bench rows
  s9tests) K3_TEST_TIMEOUT=400 bash scripts/h200_tests.sh tests/gpu/test_fast_layer.py tests/gpu/test_rms_gemv.py \
          tests/gpu/test_oproj_attnres.py tests/gpu/test_moe_tail.py tests/gpu/test_kda_conv_gate_step.py -k "wpost or gemvpin or tailpfl or kdapre or opt_in_builds \
          or preload or prefetch or graph_replay or -fast]" ;;
  s9perf) K3_SWEEP_TIMEOUT=300 K3_BENCH="--shapes k3_rank16 --batches 1 2 4 8 --kernels attnres_rms_gemv \
          attnres_rms_gemv@pin gemv_in_proj_plain gemv_in_proj_plain@pin oproj_attnres oproj_attnres@wpost moe_tail \
          moe_tail@pf moe_tail@pfl kda_conv_gate_step kda_conv_gate_step@pre" K3_BENCH_TIMEOUT=150 \
          bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 --impls stock fast fast-wpost fast-gemvpin \
          fast-kdapre fast-tailpfl fast-endtrig --budget-s 240 ;;
  # session 7: router v2.7 (shared gate/up in the fused front) and the new attention defaults (s8 = the old ones)
  s10tests) K3_TEST_TIMEOUT=400 bash scripts/h200_tests.sh tests/gpu/test_router_down_topk.py tests/gpu/test_fast_layer.py \
          -k "shared or rolled_matches or exact_ties or graph_replay or s9front or s8 or -fast]" ;;
  s10perf) K3_SWEEP_TIMEOUT=240 K3_BENCH="--shapes k3_rank16 --batches 1 2 4 --kernels router_down_topk \
          router_down_topk+shared shared_expert_gate_up router_down_topk_cublas+shared" K3_BENCH_TIMEOUT=90 \
          bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 --batches 1 4 8 64 --impls stock fast fast-s8 fast-s9front \
          --budget-s 200 ;;
  # session 7, the last call after a staging (~8.5 min): the tests of the in_proj threshold (M = 3-4 on cuBLAS) and of
  # the KDA split A/B, then the layer A/B at rank16 and rank8 with the kernel rows they predict
  s11)    K3_TEST_TIMEOUT=170 bash scripts/h200_tests.sh tests/gpu/test_fast_layer.py \
            -k "fast_attention_half and (s10 or kdans8 or -fast])"
          K3_SWEEP_TIMEOUT=250 K3_BENCH="--shapes k3_rank16 --batches 4 64 --kernels kda_conv_gate_step \
            kda_conv_gate_step@ns8 kda_conv_gate_step@ns4 gemv_in_proj_plain" K3_BENCH_TIMEOUT=60 \
            bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 --batches 1 4 8 64 \
            --impls stock fast fast-s10 fast-kdans8 --budget-s 200 ;;
  # the experts kernel at rank8 b64, where the MoE half lost to stock (records-9ac30a0-kdaall2.json): is it the load
  # structure (probe), the cluster size (C4) or the warps (W8)? Fits the ~2 minutes left after a staging.
  rank8x) mkdir -p "${OUT:-out}"; timeout 130 env PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a python3 -m k3fast.bench_experts \
            --shapes k3_rank8 --batches 64 --variants default probe C4 W8 --replays 20 --out "${OUT:-out}" \
            --tag "$K3_COMMIT" > "${OUT:-out}/experts.log" 2>&1; grep -v Warn "${OUT:-out}/experts.log" | tail -20 ;;
  # next session, first call after the staging: router v2.8 (TopkFromLogits split over 4 warps) and the new default
  # chain at every batch, then its A/B with the kernel rows of its prediction
  s12)    K3_TEST_TIMEOUT=240 bash scripts/h200_tests.sh tests/gpu/test_router_down_topk.py tests/gpu/test_fast_layer.py \
            -k "split or topk4 or exact_ties or -fast]"
          K3_SWEEP_TIMEOUT=200 K3_BENCH="--shapes k3_rank16 --batches 1 8 64 --kernels topk_from_logits \
            topk_from_logits~warm topk_from_logits@split topk_from_logits@split~warm router_down_topk_cublas+shared \
            router_down_topk_cublas+shared@split" K3_BENCH_TIMEOUT=80 \
            bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 --batches 1 8 64 \
            --impls stock fast fast-topk4 --budget-s 150 ;;
  # experts v7 (parts of I over clusters of 2 at buckets <= 2): its GPU tests, the experts probe and the layer A/B
  s13)    K3_TEST_TIMEOUT=280 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py tests/gpu/test_fast_layer.py \
            -k "v7 or fast-s12"
          K3_SWEEP_TIMEOUT=150 K3_EXPERTS="--shapes k3_rank16 k3_rank8 --batches 1 2 --variants default probe v6 v6probe v7 v7probe v7P2" \
            K3_EXPERTS_TIMEOUT=150 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 --batches 1 2 \
            --impls stock fast fast-v7 --budget-s 120 ;;
  # the FC2 prefetch (xpf): GPU tests (bit-identity) + the MoE half's layer tests with v7 as default, experts probe
  # (run at 3960ffc; xpf was measured slower and removed, so this step needs that commit)
  s14)    K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py tests/gpu/test_fast_layer.py \
            -k "prefetch or (moe_half and (-fast] or fast-s13] or fast-v7]))"
          K3_EXPERTS="--shapes k3_rank16 --batches 1 8 64 --variants default probe X1 X1probe v4" K3_EXPERTS_TIMEOUT=200 \
            K3_SWEEP_TIMEOUT=60 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 --batches 1 --impls fast \
            --budget-s 40 ;;
  # moe_tail v4 (preload): bit-identity tests, kernel bench and the layer A/B; the experts' b1 stage probes
  # (run at 6ec1427; moe_tail v4 was measured slower and removed, so this step needs that commit)
  s15)    K3_TEST_TIMEOUT=110 bash scripts/h200_tests.sh tests/gpu/test_moe_tail.py tests/gpu/test_fast_layer.py \
            -k "preload or fast-tailpre]"
          K3_SWEEP_TIMEOUT=100 K3_BENCH="--shapes k3_rank16 --batches 1 8 --kernels moe_tail moe_tail@pre" K3_BENCH_TIMEOUT=60 \
            K3_EXPERTS="--shapes k3_rank16 --batches 1 --variants default probe sortprobe fc1probe fc2probe v4 v4probe v4fc1probe v4fc2probe" \
            K3_EXPERTS_TIMEOUT=120 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 --batches 1 8 \
            --impls stock fast fast-tailpre --budget-s 80 ;;
  # experts v7's grid combine (GPU tests, layer A/B) and v7's ring depth at b1 / b2 (run at 26465c5 with the rows
  # G1 G1probe and the impl fast-gridcomb; the grid combine was measured slower and removed, so they are dropped)
  s16)    K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py tests/gpu/test_fast_layer.py \
            -k "split_versions"
          K3_EXPERTS="--shapes k3_rank16 k3_rank8 --batches 1 2 --variants default probe D12 D16 W8D16 W8D28" \
            K3_EXPERTS_TIMEOUT=200 K3_SWEEP_TIMEOUT=120 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 \
            --batches 1 2 --impls stock fast --budget-s 100 ;;
  # kda_conv_gate_step v4 (the request loop where the one-request grid needs a second wave): its GPU tests (reference,
  # bit-identity with the one-request grid, graph replay, back to back), the kernel bench at the three shapes and the
  # attention-half A/B at b64 (fast-s16kda: the one-request grid everywhere). Run at d875e46; v4 was measured slower
  # and removed, so this step and ncu1's --persist cases need that commit (5446d13 for ncu1)
  s17)    K3_TEST_TIMEOUT=220 bash scripts/h200_tests.sh tests/gpu/test_kda_conv_gate_step.py tests/gpu/test_fast_layer.py \
            -k "kda_conv or kdav4"
          K3_SWEEP_TIMEOUT=170 K3_BENCH="--shapes k3_rank16 k3_rank8 full --batches 1 8 64 --kernels kda_conv_gate_step \
            kda_conv_gate_step@one kda_conv_gate_step@v4 kda_conv_gate_step@v4half" K3_BENCH_TIMEOUT=120 \
            bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 --batches 64 \
            --impls stock fast fast-s16kda --budget-s 140 ;;
  # Nsight Compute: the KDA step at rank16 b64 (one-request grid and v4) and b1, the experts at b1 / b64, the tail at b1
  ncu1)   bash scripts/h200_ncu.sh "kda --shape k3_rank16 --batch 64 --persist 0" "kda --shape k3_rank16 --batch 64 --persist 1" \
            "kda --shape k3_rank16 --batch 1" "experts --shape k3_rank16 --batch 1" "tail --shape k3_rank16 --batch 1" \
            "experts --shape k3_rank16 --batch 64" ;;
  # kda_conv_gate_step v5 (write-backs after the last cluster barrier, no end fence behind the early trigger): GPU
  # tests, kernel bench (the @trig rows are the layer's configuration), the attention-half A/B (fast-s17kda: v3's
  # order) at every batch of rank16 / rank8, then ncu of v5 against v3 at rank16 b64 with the early trigger
  s18)    K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh tests/gpu/test_kda_conv_gate_step.py tests/gpu/test_fast_layer.py \
            -k "kda_conv or s17kda"
          K3_SWEEP_TIMEOUT=170 K3_BENCH="--shapes k3_rank16 k3_rank8 full --batches 1 8 64 --kernels kda_conv_gate_step \
            kda_conv_gate_step@v3 kda_conv_gate_step@trig kda_conv_gate_step@v3trig" K3_BENCH_TIMEOUT=110 \
            bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 --batches 1 8 64 \
            --impls stock fast fast-s17kda --budget-s 150
          K3_NCU_TIMEOUT=60 bash scripts/h200_ncu.sh "kda --shape k3_rank16 --batch 64 --late 0 --trig 1" \
            "kda --shape k3_rank16 --batch 64 --late 1 --trig 1" ;;
  # moe_tail v5 (a cp.async shared-memory ring of weight stages per warp, opt-in) and kda_conv_gate_step v6 (the
  # cluster exchanges as st.async + mbarrier, opt-in): bit-identity / reference / graph tests, the layer halves
  # with them, the kernel bench (tail ring depths 2-4; KDA @txtrig against @trig) and the layer A/B
  # (s19 ran at 2674eff; its impls and bench rows were renamed when both became defaults: fast-tailring ->
  # fast-s19tail (the inverse A/B), fast-kdatx -> fast-s19kda, moe_tail@ring2-4 -> moe_tail / moe_tail@v1,
  # kda_conv_gate_step@txtrig -> @trig / @v5trig. Rerun it at that commit.)
  s19)    K3_TEST_TIMEOUT=170 bash scripts/h200_tests.sh tests/gpu/test_moe_tail.py tests/gpu/test_kda_conv_gate_step.py \
            tests/gpu/test_fast_layer.py -k "ring or tailring or dsmem or late_stores or kdatx"
          K3_SWEEP_TIMEOUT=180 K3_BENCH="--shapes k3_rank16 k3_rank8 full --batches 1 8 16 64 --kernels moe_tail \
            moe_tail@ring2 moe_tail@ring3 moe_tail@ring4 kda_conv_gate_step@trig kda_conv_gate_step@txtrig" \
            K3_BENCH_TIMEOUT=110 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 \
            --batches 1 8 64 --impls stock fast fast-tailring fast-kdatx --budget-s 160 ;;
  # session 10's defaults (moe_tail v5 ring at depth 2, KDA v6) and the cuBLAS tail's in-place add (M > 16): every
  # moe_tail / KDA step test, the layer halves with fast and the s19 A/Bs; then (s20b) the kernel bench and the layer
  # sweep with the A/Bs and the 8-warp experts (whose spare registers could hold tail CTAs during the experts)
  s20)    K3_TEST_TIMEOUT=290 bash scripts/h200_tests.sh tests/gpu/test_moe_tail.py tests/gpu/test_kda_conv_gate_step.py \
            tests/gpu/test_fast_layer.py -k "not timing_report and (ring or dsmem or late_stores or s19 or step or tail \
            or gate_up or graph or padding or full_width or nan or (half and not fast-))" ;;
  s20b)   K3_SWEEP_TIMEOUT=230 K3_BENCH="--shapes k3_rank16 k3_rank8 --batches 1 8 16 64 --kernels moe_tail moe_tail@v1 \
            kda_conv_gate_step@trig kda_conv_gate_step@v5trig" K3_BENCH_TIMEOUT=100 bash scripts/h200_sweep.sh \
            --kinds kda_moe --shapes k3_rank16 k3_rank8 --batches 1 8 64 --impls stock fast fast-s19tail fast-s19kda \
            fast-w8 --budget-s 210 ;;
  # rms_gemv v7 (the fused in_proj's L2 prefetch depth, opt-in), the experts tests corrected to 8 warps for their
  # bit-identity claims, fast-s17kda again: tests, then the in_proj bench rows and the attention half A/B at b1 / b2
  # and the experts' route1 (batch 1 without the counting sort, opt-in): s21 the tests, s21b the benches and the A/B
  # (as run at 5f1f620 / c1bb65a: fast-inxf, fast-inxr, fast-xl2, fast-r1xl2 and their bench rows were removed
  # afterwards, so s21, s21b, s22 and ncu3 reproduce only at those commits)
  s21)    K3_TEST_TIMEOUT=480 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py tests/gpu/test_rms_gemv.py \
            tests/gpu/test_fast_layer.py -k "not timing_report and (experts or route1 or xl2 or opt_in_builds or fused \
            or inpf3 or inxf or s17kda)" ;;
  s21b)   K3_SWEEP_TIMEOUT=280 K3_BENCH="--shapes k3_rank16 k3_rank8 --batches 1 2 --kernels attnres_rms_gemv \
            attnres_rms_gemv@pf2 attnres_rms_gemv@pf3 attnres_rms_gemv@xf" K3_BENCH_TIMEOUT=90 \
            K3_EXPERTS="--shapes k3_rank16 k3_rank8 --batches 1 8 64 --variants default R1 L2 R1L2 probe R1probe \
            L2probe sortprobe R1sortprobe" K3_EXPERTS_TIMEOUT=150 bash scripts/h200_sweep.sh --kinds kda_moe \
            --shapes k3_rank16 k3_rank8 --batches 1 8 64 --impls stock fast fast-inpf3 fast-inxf fast-route1 fast-xl2 fast-r1xl2 \
            --budget-s 260 ;;
  # session 11: the fused in_proj's v9 (x in registers, fast-inxr) and route1 as the default (fast-s21exp is the
  # sorted A/B): their GPU tests, the in_proj bench rows and the b1 layer A/B, then ncu of v9 if time is left
  # (files: tests 3 + sweep 5 + ncu 1 > 8, so the logs travel as logs.tgz)
  s22)    K3_TEST_TIMEOUT=170 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv.py tests/gpu/test_fast_layer.py \
            -k "not timing_report and (x_regs or (inxr and (1-1 or 1-8 or 2-1 or 2-8)) or s21exp or graph_replay \
            or (moe_half and [1-fast]))"
          K3_SWEEP_TIMEOUT=200 K3_BENCH="--shapes k3_rank16 k3_rank8 --batches 1 --kernels attnres_rms_gemv \
            attnres_rms_gemv@xr attnres_rms_gemv@xf" K3_BENCH_TIMEOUT=70 bash scripts/h200_sweep.sh --kinds kda_moe \
            --shapes k3_rank16 k3_rank8 --batches 1 --impls stock fast fast-s21exp fast-inxr --budget-s 180
          K3_NCU_TIMEOUT=60 bash scripts/h200_ncu.sh "bench --kernel attnres_rms_gemv@xr --shape k3_rank16 --batch 1"
          ls "$OUT" ;;      # (h200_sweep.sh / h200_ncu.sh already pack the logs into logs.tgz past 8 files)
  # the per-SM spread of active cycles (min / max / avg over the 132 SMs) of the three b1 kernels whose load balance
  # was in question: the ring tail (448 tiles over 132 SMs), the fused in_proj (115 CTAs) and the experts (ran at
  # c1bb65a with the machine left from s22; meta.txt names the metrics since then)
  ncu4)   K3_NCU_METRICS=sm__cycles_active.min,sm__cycles_active.max,sm__cycles_active.avg,sm__cycles_elapsed.max \
          K3_NCU_TIMEOUT=80 bash scripts/h200_ncu.sh "tail --shape k3_rank16 --batch 1 --ring 2" \
            "bench --kernel attnres_rms_gemv --shape k3_rank16 --batch 1" "experts --shape k3_rank16 --batch 1" ;;
  # (as run at 0e81145 in session 12: rms_gemv v10 and kda_conv_gate_step v7 measured no faster, and fast-inev,
  # fast-inev126, fast-kdaocc6, their bench rows and tests were removed afterwards, so s23 and s24 reproduce only
  # at that commit)
  # session 11, written for session 12: the fused in_proj's v10 (rows even over 132 CTAs, fast-inev): its GPU tests,
  # the in_proj bench rows at b1 / b2 and the layer A/B at rank16 / rank8 b1 / b2 (with fast-inxr, the miss of s22,
  # for the record), then the whole GPU suite's experts file if time is left
  s23)    K3_TEST_TIMEOUT=170 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv.py tests/gpu/test_fast_layer.py \
            -k "not timing_report and (even_rows or (inev and (1-1 or 1-8 or 2-1 or 2-8)))"
          K3_SWEEP_TIMEOUT=260 K3_BENCH="--shapes k3_rank16 k3_rank8 --batches 1 2 --kernels attnres_rms_gemv \
            attnres_rms_gemv@ev attnres_rms_gemv@ev126" K3_BENCH_TIMEOUT=90 bash scripts/h200_sweep.sh --kinds kda_moe \
            --shapes k3_rank16 k3_rank8 --batches 1 2 --impls stock fast fast-inev fast-inev126 --budget-s 240 ;;
  # session 11, written for session 12: the KDA step's v7 occupancy hint (6 CTAs per SM at nsplit 4, fast-kdaocc6):
  # its GPU tests, the KDA bench rows at b16 / b64 and the attention-half A/B at rank16 / rank8 b8 / b64 (b8 at
  # rank16 runs nsplit 8, the control)
  s24)    K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh tests/gpu/test_kda_conv_gate_step.py tests/gpu/test_fast_layer.py \
            -k "not timing_report and (min_blocks or (kdaocc6 and (16-16 or 64-16 or 16-8 or 64-8)))"
          K3_SWEEP_TIMEOUT=240 K3_BENCH="--shapes k3_rank16 k3_rank8 --batches 16 64 --kernels kda_conv_gate_step@trig \
            kda_conv_gate_step@occ6trig" K3_BENCH_TIMEOUT=80 bash scripts/h200_sweep.sh --kinds kda_moe \
            --shapes k3_rank16 k3_rank8 --batches 8 64 --impls stock fast fast-kdaocc6 --budget-s 220 ;;
  # session 12: the whole-suite run at 0e81145 found v5 (opt-in) + route1 (default since session 11) unwritten at
  # batch 1 (pass_off never set); the fix's tests, then tests2 again (its first failure poisoned the context)
  s25)    K3_TEST_TIMEOUT=540 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py tests/gpu/test_fast_layer.py \
            tests/gpu/test_stock_compiled.py tests/gpu/test_stock_vllm_ops.py tests/gpu/test_ops.py \
            -k "not test_moe_mxfp4_experts or v5" ;;
  # session 12, written for session 13: the torch ops with FastImpl's batch dispatch (test_ops at b1 / 3 / 8 / 64,
  # both fronts) and the layer tests over the cuBLAS o_proj / tail helpers FastImpl now shares with the ops
  # (and the experts' ring_fit opt-in: its bit-identity at rank8, bench_experts RF / RFprobe at rank8 b8 / b64, the
  # MoE-half A/B at rank8 / rank16 b8 / b64 with fast-ringfit; rank16 is the control, its PTX is the default's)
  # (as run at 2667c16; since session 13 ring_fit is the default and the A/B impl is fast-noringfit)
  s26)    K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh tests/gpu/test_ops.py tests/gpu/test_fast_layer.py \
            tests/gpu/test_moe_mxfp4_experts.py -k "test_ops or ring_fit or (test_fast_layer and not timing_report \
            and (64 or 17))"
          K3_SWEEP_TIMEOUT=150 K3_EXPERTS_TIMEOUT=100 K3_EXPERTS="--shapes k3_rank8 --batches 8 64 --variants default RF probe RFprobe" \
            bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 --batches 8 64 \
            --impls stock fast fast-ringfit --budget-s 130 ;;
  # Nsight Compute with the instruction mix: the fused in_proj at b1 (v6 and v8, x in fp32) and the experts at b1
  # (default), to see where the in_proj's ~79 instructions per warp load go
  # (plus the per-SM spread of active cycles, min / max / avg, for the load-balance question of the tail and the
  # in_proj; K3_NCU_EXTRA is a second --metrics list: if this ncu refuses two, drop it and use the section instead)
  # (ran at 5f1f620 without K3_NCU_EXTRA: this ncu refuses a second --metrics, "option '--metrics' cannot be
  # specified more than once"; the per-SM spread needs those metrics in h200_ncu.sh's one list)
  ncu3)   K3_NCU_TIMEOUT=90 bash scripts/h200_ncu.sh "bench --kernel attnres_rms_gemv --shape k3_rank16 --batch 1" \
            "bench --kernel attnres_rms_gemv@xf --shape k3_rank16 --batch 1" \
            "experts --shape k3_rank16 --batch 1" "tail --shape k3_rank16 --batch 1 --ring 2" ;;
  # Nsight Compute: the tail at b1 (v1 / ring 3) and the other two b1 GEMVs (fused in_proj, fused router front)
  ncu2)   K3_NCU_TIMEOUT=90 bash scripts/h200_ncu.sh "tail --shape k3_rank16 --batch 1" \
            "tail --shape k3_rank16 --batch 1 --ring 3" "bench --kernel attnres_rms_gemv --shape k3_rank16 --batch 1" \
            "bench --kernel router_down_topk+shared --shape k3_rank16 --batch 1" ;;
  # every KDA+MoE shape, fused vs stock only (fits what device time is left after a staging)
  kdaall2) K3_SWEEP_TIMEOUT=430 bash scripts/h200_sweep.sh --kinds kda_moe --impls stock fast --budget-s 380 ;;
  # every KDA+MoE shape, fused vs stock, with the all-CuTe A/B (no cuBLAS dispatch above M = 8 / 16)
  kdaall) K3_SWEEP_TIMEOUT=540 bash scripts/h200_sweep.sh --kinds kda_moe --impls stock fast fast-alldsl --budget-s 470 ;;
  # session 13: ring_fit is the default (s26: MoE half rank8 b64 643.8 -> 540.2 us); the A/B against the full
  # ring (fast-noringfit, bench_experts NRF / NRFprobe) with the stock path and Marlin beside it (vLLM staged)
  s27)    K3_SWEEP_TIMEOUT=170 K3_EXPERTS_TIMEOUT=120 K3_EXPERTS="--shapes k3_rank8 k3_rank16 --batches 8 64 --variants default NRF probe NRFprobe" \
            bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 --batches 8 64 \
            --impls stock fast fast-noringfit --budget-s 150 ;;
  # the GPU tests the default change reaches: the experts file whole, the layer and the ops
  s27t)   K3_TEST_TIMEOUT=560 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py tests/gpu/test_fast_layer.py \
            tests/gpu/test_ops.py ;;
  # session 13: the cuBLAS tail's norm in one kernel (fast vs fast-s27tail at b32 / b64; no stock, so no vLLM to
  # stage), then its tests and the tests1 files (not rerun since 0e81145)
  s28)    K3_SWEEP_TIMEOUT=100 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 --batches 32 64 \
            --impls fast fast-s27tail --budget-s 80
          K3_TEST_TIMEOUT=300 bash scripts/h200_tests.sh tests/gpu/test_fast_layer.py::test_fast_moe_half_same_input \
            tests/gpu/test_moe_tail.py tests/gpu/test_rms_gemv.py tests/gpu/test_gemv_splitk.py \
            tests/gpu/test_oproj_attnres.py tests/gpu/test_kda_conv_gate_step.py tests/gpu/test_router_down_topk.py \
            -k "not test_fast_moe_half_same_input or s27tail" ;;
  # session 13, written for session 14: ring_fit at v7 (opt-in fast-ringfit7 / bench_experts RF7) at b1 / b2 beside
  # stock (vLLM staged), then the tests: its bit-identity and the whole layer file (the one-kernel tail norm's
  # whole-layer cases at b17 / b64 have not run yet). (As run at fdcdffc; since session 14 ring_fit at v7 is the
  # default, fast-ringfit7 and RF7 / RF7probe are gone, and the A/B is fast-noringfit / NRF / NRFprobe)
  s29)    K3_SWEEP_TIMEOUT=200 K3_EXPERTS_TIMEOUT=120 K3_EXPERTS="--shapes k3_rank16 k3_rank8 --batches 1 2 --variants default RF7 probe RF7probe" \
            bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 --batches 1 2 8 64 \
            --impls stock fast fast-ringfit7 --budget-s 180 ;;
  s29t)   K3_TEST_TIMEOUT=480 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py tests/gpu/test_fast_layer.py \
            -k "at_v7 or test_fast_layer" ;;
  # session 14: does a range stay in L2 until it is read (k3fast.l2probe: capacity, a few CTAs' prefetch beside a
  # 23 MB stream, evict_last), then its GPU tests, the new default's A/B at the layer (fast-noringfit at every
  # batch) and bench_experts' NRF at b1 / b2 (the full ring, now the A/B there)
  s30)    o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 150 python3 -m k3fast.l2probe --out "$o" --tag "$K3_TAG" > "$o/l2probe.log" 2>&1; tail -2 "$o/l2probe.log"
          timeout 120 python3 -m k3fast.bench_experts --out "$o" --tag "$K3_TAG" --shapes k3_rank8 k3_rank16 \
            --batches 1 2 --variants default NRF > "$o/experts.log" 2>&1; tail -2 "$o/experts.log"
          K3_TEST_TIMEOUT=240 bash scripts/h200_tests.sh tests/gpu/test_l2probe.py tests/gpu/test_fast_layer.py \
            -k "test_l2probe or noringfit" ;;
  # session 14: l2probe again with its own reader (s30's torch sum hardly saw the L2) and *_settled rows
  s31)    o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          K3_TEST_TIMEOUT=120 bash scripts/h200_tests.sh tests/gpu/test_l2probe.py
          timeout 200 python3 -m k3fast.l2probe --out "$o" --tag "$K3_TAG" > "$o/l2probe.log" 2>&1; tail -2 "$o/l2probe.log" ;;
  # the same probe with a second reader grid (one CTA per SM) and 2 / 4 MB ranges, the machine's time permitting
  s32)    o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 300 python3 -m k3fast.l2probe --out "$o" --tag "$K3_TAG" --sizes-mb 2 4 8 16 24 32 48 \
            --reader-ctas 528 132 > "$o/l2probe.log" 2>&1; tail -2 "$o/l2probe.log" ;;
  # session 14: the experts' weights into shared memory beside the down-projection's stream (k3fast.overlap_probe)
  s33)    o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          K3_TEST_TIMEOUT=120 bash scripts/h200_tests.sh tests/gpu/test_overlap_probe.py
          timeout 150 python3 -m k3fast.overlap_probe --out "$o" --tag "$K3_TAG" --fill-ctas 128 132 \
            --stream-mb 51.4 25.7 > "$o/overlap.log" 2>&1; tail -6 "$o/overlap.log" ;;
  # s33 found no overlap (beside 23.8 us = one after the other 24.2): the stream kernel at the fill's carveout
  s34)    o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 150 python3 -m k3fast.overlap_probe --out "$o" --tag "$K3_TAG" --fill-ctas 128 \
            --stream-mb 51.4 --stream-carveout none 100 > "$o/overlap.log" 2>&1; tail -4 "$o/overlap.log" ;;
  # s34: no overlap at either carveout; the CUPTI spans of the pair say whether the two kernels ran at once
  s35)    o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 150 python3 -m k3fast.overlap_probe --out "$o" --tag "$K3_TAG" --fill-ctas 128 \
            --stream-mb 51.4 > "$o/overlap.log" 2>&1; tail -4 "$o/overlap.log" ;;
  # session 14, written for session 15: experts stage_fc1 (opt-in fast-stagefc1 / bench_experts SF1) at b1 / b2
  # beside stock (vLLM staged), then its GPU tests (bit-identity with a graph replay; the MoE half at b1)
  s38)    K3_SWEEP_TIMEOUT=240 K3_EXPERTS_TIMEOUT=150 K3_EXPERTS="--shapes k3_rank16 k3_rank8 --batches 1 2 --variants default SF1 probe SF1probe" \
            bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 --batches 1 2 \
            --impls stock fast fast-stagefc1 --budget-s 200 ;;
  s38t)   K3_TEST_TIMEOUT=300 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py tests/gpu/test_fast_layer.py \
            -k "stage_fc1 or stagefc1" ;;
  # session 14, written for session 15: overlap_probe as CUDA-graph replays (the fork captured), with the pair's
  # spans from one profiled replay: does the block scheduler co-schedule the fill's grid beside the stream's?
  s39)    o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 200 python3 -m k3fast.overlap_probe --out "$o" --tag "$K3_TAG" --graph --fill-ctas 128 \
            --stream-mb 51.4 --stream-carveout none 100 > "$o/overlap.log" 2>&1
          timeout 100 python3 -m k3fast.overlap_probe --out "$o" --tag "$K3_TAG-first" --graph --stream-first \
            --fill-ctas 128 --stream-mb 51.4 >> "$o/overlap.log" 2>&1; grep -v Warning "$o/overlap.log" | tail -4 ;;
  # session 15: the tail's CTAs beside experts v7 (fast-xco: 8 warps + the largest carveout; fast-xcot3 with the
  # tail's ring of 3; fast-xc100 / fast-t3 / fast-w8 the controls) beside stock at b1 / b2; bench CO / W8CO
  s40)    K3_SWEEP_TIMEOUT=330 K3_EXPERTS_TIMEOUT=120 K3_EXPERTS="--shapes k3_rank16 k3_rank8 --batches 1 2 --variants default W8 CO W8CO" \
            bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 --batches 1 2 \
            --impls stock fast fast-w8 fast-xco fast-xcot3 fast-xc100 fast-t3 --budget-s 300 ;;
  s40t)   K3_TEST_TIMEOUT=400 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py tests/gpu/test_fast_layer.py \
            -k "carveout or xco or xcot3 or xc100 or fast-t3" ;;
  # session 15: the tail's ring depth in the layer (s40: fast-t3 0.4-0.8 us under fast at b1 / b2, one run; the
  # bench of session 10 had depth 3 slower alone): a second run, with b8 and depth 4, beside stock
  s41)    K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh tests/gpu/test_fast_layer.py -k "fast-t4" || true
          K3_SWEEP_TIMEOUT=330 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 --batches 1 2 8 \
            --impls stock fast fast-t3 fast-t4 --budget-s 300 ;;
  # session 15: rms_gemv v11 (fast-insplit1 / 3: the in_proj's prologue as its own one-CTA kernel, the GEMV's first
  # row groups copied into shared memory before its wait): tests, bench rows, the attention-half A/B beside stock
  s42)    K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv.py tests/gpu/test_fast_layer.py \
            -k "split_stage or insplit" || true
          K3_SWEEP_TIMEOUT=240 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 \
            --batches 1 2 --impls stock fast fast-insplit1 fast-insplit3 --budget-s 190 ;;
  # session 15, last device minutes: the fused in_proj's k split again (ks 1 / 2 / 8 against 4) and the plain GEMV
  s43)    o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 170 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 1 2 \
            --kernels attnres_rms_gemv attnres_rms_gemv@ks1 attnres_rms_gemv@ks2 attnres_rms_gemv@ks8 \
            gemv_in_proj_plain > "$o/bench.log" 2>&1; grep -v -i warn "$o/bench.log" | tail -24 ;;
  # written in session 15 for session 16: what makes cuBLAS's GEMV faster than our plain FMA GEMV on the same x and
  # weights (s43: rank8 b1 27.0 against 34.3 us, rank16 19.9 against 22.4): grid, block, registers, shared memory,
  # DRAM throughput and stalls of both, and of the fused in_proj, one profiled launch each
  ncu5)   K3_NCU_METRICS=sm__cycles_active.min,sm__cycles_active.max,dram__bytes_read.sum bash scripts/h200_ncu.sh \
            "bench --kernel gemv_in_proj_plain --shape k3_rank8" "bench --kernel gemv_in_proj_plain --shape k3_rank8 --stock 1" \
            "bench --kernel gemv_in_proj_plain --shape k3_rank16" "bench --kernel gemv_in_proj_plain --shape k3_rank16 --stock 1" \
            "bench --kernel attnres_rms_gemv --shape k3_rank8" ;;
  # s44's impls were removed in session 16 (the code is at 6874cfa)
  # written in session 15 for session 16: rms_gemv v11.1 (v11 with the prologue kernel's early trigger, which s42
  # lacked): its tests, then the attention-half A/B beside stock (needs vLLM staged)
  s44)    K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv.py tests/gpu/test_fast_layer.py \
            -k "split_stage or insplit" || true
          K3_SWEEP_TIMEOUT=300 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 \
            --batches 1 2 --impls stock fast fast-insplit1 fast-insplit3 --budget-s 280 ;;
  # written in session 15 for session 16: where experts v7's b1 chain after z spends its time (the MoE lead's largest
  # uncertain term): the kernel and its stage probes under ncu, rank16 b1
  ncu6)   K3_NCU_METRICS=sm__cycles_active.min,sm__cycles_active.max bash scripts/h200_ncu.sh \
            "experts --shape k3_rank16 --batch 1" "experts --shape k3_rank16 --batch 1 --probe sort" \
            "experts --shape k3_rank16 --batch 1 --probe fc1" "experts --shape k3_rank16 --batch 1 --probe fc2" \
            "experts --shape k3_rank16 --batch 1 --probe stream" ;;
  # session 16: rms_gemv v12 (rms_gemv_ring: the in_proj's weights through a bulk-copy shared-memory ring): its GPU
  # tests, the kernel bench beside the FMA kernels and cuBLAS on the same bytes, then the attention half beside
  # stock (needs vLLM staged)
  s45)    K3_TEST_TIMEOUT=240 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv_ring.py tests/gpu/test_fast_layer.py \
            -k "ring" || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 150 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 1 2 \
            --kernels attnres_rms_gemv attnres_rms_gemv@ring gemv_in_proj_plain gemv_in_proj_plain@ring \
            > "$o/bench.log" 2>&1; grep -v -i warn "$o/bench.log" | tail -10
          K3_SWEEP_TIMEOUT=180 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 \
            --batches 1 2 --impls stock fast fast-inring --budget-s 150 ;;
  # after s45: the ring kernels under Nsight Compute beside the FMA kernel and cuBLAS (rank8 / rank16 b1)
  ncu7)   K3_NCU_METRICS=sm__cycles_active.min,sm__cycles_active.max,dram__bytes_read.sum bash scripts/h200_ncu.sh \
            "bench --kernel gemv_in_proj_plain@ring --shape k3_rank8" "bench --kernel attnres_rms_gemv@ring --shape k3_rank8" \
            "bench --kernel gemv_in_proj_plain@ring --shape k3_rank16" "bench --kernel attnres_rms_gemv@ring --shape k3_rank16" \
            "bench --kernel attnres_rms_gemv --shape k3_rank16" ;;
  # session 16, after s45: the ring in_proj as the default at M <= 2 (FastImpl INPROJ_ENGINE): the attention-half and
  # layer tests, the torch ops against the direct calls, then the A/B (fast-infma = the FMA kernel) beside stock
  s46)    K3_TEST_TIMEOUT=220 bash scripts/h200_tests.sh tests/gpu/test_fast_layer.py tests/gpu/test_ops.py \
            -k "attention_half or full_width or graph_replay or ops_match" || true
          K3_SWEEP_TIMEOUT=200 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank16 k3_rank8 \
            --batches 1 2 --impls stock fast fast-infma --budget-s 170 ;;
  # written in session 16 for session 17 (stage with vLLM): oproj_attnres v1.3 (the rest of the weight slice in
  # shared memory before the wait) and the ring in_proj's trigger at its end, their tests, then the A/B beside stock
  s47)    K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh tests/gpu/test_oproj_attnres.py tests/gpu/test_fast_layer.py \
            -k "stage_rest or opstage" || true
          K3_SWEEP_TIMEOUT=300 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank8 k3_rank16 \
            --batches 1 2 --impls stock fast fast-opstage fast-ringlate fast-opstagelate fast-infma --budget-s 270 ;;
  # session 17, after s47 (v12.1 the default, v1.3 removed): rms_gemv_ring v12.2 (the joint prologue, "fast-injoint"):
  # the ring's tests (bit identity, graph), the attention half at b1 / b2 for the default, the early trigger and
  # v12.2; the kernel bench; the A/B beside stock (needs vLLM staged)
  s48)    ids=$(for i in fast fast-ringearly fast-injoint; do for b in 1 2; do for t in 16 8; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-$t-$i]"; done; done; done)
          K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv_ring.py $ids || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 120 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 1 2 \
            --kernels attnres_rms_gemv@ring attnres_rms_gemv@ringjoint gemv_in_proj_plain@ring \
            > "$o/bench.log" 2>&1; grep -v -i warn "$o/bench.log" | tail -10
          K3_SWEEP_TIMEOUT=200 bash scripts/h200_sweep.sh --kinds kda_moe --shapes k3_rank8 k3_rank16 \
            --batches 1 2 --impls stock fast fast-ringearly fast-injoint --budget-s 170 ;;
  # session 17, after s48 (v12.2 the default; s48's tests did not run: fast-injoint was not in test_fast_layer's list):
  # the ring's tests, the attention half at b1 / b2 (fast, fast-nojoint, fast-ringearly), the torch ops; then the
  # A/B at b1 / b2 and the default beside stock at b8 / b64 (needs vLLM staged)
  s49)    ids=$(for i in fast fast-nojoint fast-ringearly; do for b in 1 2; do for t in 16 8; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-$t-$i]"; done; done; done)
          K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv_ring.py tests/gpu/test_ops.py $ids || true
          cells=""; for c in k3_rank8,1 k3_rank8,2 k3_rank16,1 k3_rank16,2; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-nojoint"; done
          for c in k3_rank8,8 k3_rank16,8 k3_rank16,64 k3_rank8,64; do
              cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast"; done
          K3_SWEEP_TIMEOUT=300 bash scripts/h200_sweep.sh $cells --budget-s 270 ;;
  # session 17, after s49 (as run at ff51150; fast-oppf was removed after it): oproj_attnres v1.4, the rank8 rest into L2: its
  # bit-identity tests and the rank8 attention half, then the A/B at rank8 b1 / b2 beside stock (needs vLLM staged)
  s50)    ids=$(for b in 1 2 3 4; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-8-fast-oppf]"; done)
          K3_TEST_TIMEOUT=120 bash scripts/h200_tests.sh tests/gpu/test_oproj_attnres.py -k "prefetch_rest or oppf" $ids || true
          K3_SWEEP_TIMEOUT=170 bash scripts/h200_sweep.sh --cell kda_moe,k3_rank8,1,0,stock+fast+fast-oppf \
            --cell kda_moe,k3_rank8,2,0,stock+fast+fast-oppf --budget-s 150 ;;
  # written in session 17 for the next: oproj_attnres under Nsight Compute at rank8 b1 against rank16 b1 (o_proj ends
  # ~8.7 us after the rank8 KDA step against ~6 at rank16; v1.3 and v1.4 moved its weights earlier and did not help)
  ncu8)   K3_NCU_METRICS=sm__cycles_active.min,sm__cycles_active.max,dram__bytes_read.sum,lts__t_sector_hit_rate.pct \
            bash scripts/h200_ncu.sh "bench --kernel oproj_attnres --shape k3_rank8" \
            "bench --kernel oproj_attnres --shape k3_rank16" "bench --kernel oproj_attnres --shape k3_rank8 --batch 2" ;;
  # written in session 17 for the next: the experts' park probe (bulk copies into the experts kernel's idle shared
  # memory during its post-FC2 stage; what parking the tail's weights there costs the chain), no vLLM needed
  s51)    K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py -k "park" || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 200 python3 -m k3fast.bench_experts --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 \
            --batches 1 2 --variants default PARK PARK64 fc2probe --replays 50 > "$o/experts.log" 2>&1
          grep -v -i warn "$o/experts.log" | tail -16 ;;
  # s51's bench alone (s51's GPU tests passed: 4 of 4; its bench stopped on the missing vLLM, now optional)
  s51b)   o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 300 python3 -m k3fast.bench_experts --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 \
            --batches 1 2 --variants default PARK PARK64 fc2probe --replays 50 > "$o/experts.log" 2>&1
          grep -v -i warn "$o/experts.log" | tail -20 ;;
  # session 18: experts v8 (FC2 split by output rows, h through global memory): GPU tests (bit-identical to v4 at
  # clusters of RB, graph replay), the kernel bench against v7 with the stage probes; s52b: the layer A/B
  s52)    K3_TEST_TIMEOUT=230 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py -k "v8 or split_versions" \
            "tests/gpu/test_fast_layer.py::test_fast_moe_half_same_input[1-fast-v8]" || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 150 python3 -m k3fast.bench_experts --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 \
            --batches 1 2 --variants default v8 probe v8probe fc1probe v8fc1probe --replays 50 > "$o/experts.log" 2>&1
          grep -v -i warn "$o/experts.log" | tail -26 ;;
  s52b)   cells=""; for c in k3_rank16,1 k3_rank16,2 k3_rank8,1 k3_rank8,2; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-v8"; done
          K3_SWEEP_TIMEOUT=300 bash scripts/h200_sweep.sh $cells --budget-s 270 ;;
  # v8.1 (one release arrival after the barrier, no per-thread fences, the departure after FC2): GPU tests, the
  # kernel bench against v7 and the layer A/B at rank16 b1 / b2 and rank8 b2 (rank8 b1 runs 2 parts: s52 31.8 us)
  s53)    K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py -k "v8" \
            "tests/gpu/test_fast_layer.py::test_fast_moe_half_same_input[1-fast-v8]" || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 110 python3 -m k3fast.bench_experts --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 \
            --batches 1 2 --variants default v8 fc1probe v8fc1probe --replays 50 > "$o/experts.log" 2>&1
          grep -v -i warn "$o/experts.log" | grep -v marlin | tail -17
          cells=""; for c in k3_rank16,1 k3_rank16,2 k3_rank8,2; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-v8"; done
          K3_SWEEP_TIMEOUT=250 bash scripts/h200_sweep.sh $cells --budget-s 220 ;;
  # v8 the default at buckets <= 2 where its parts equal v7's (rank16 b1 / b2, rank8 b2): the default path's GPU
  # tests, then the layer beside stock (vLLM staged) with fast-v7 as the A/B
  s54)    ids="tests/gpu/test_fast_layer.py::test_fast_moe_half_same_input[1-fast]"
          ids="$ids tests/gpu/test_fast_layer.py::test_fast_moe_half_same_input[1-fast-v7]"
          for c in 1-256-uniform 1-256-ties 2-256-shared 2-256-uniform 1-384-uniform; do
            ids="$ids tests/gpu/test_moe_mxfp4_experts.py::test_matches_reference[$c]"; done
          ids="$ids tests/gpu/test_moe_mxfp4_experts.py::test_cuda_graph_replay_new_routing[1]"
          ids="$ids tests/gpu/test_moe_mxfp4_experts.py::test_cuda_graph_replay_new_routing[2]"
          K3_TEST_TIMEOUT=120 bash scripts/h200_tests.sh $ids || true
          cells=""; for c in k3_rank16,1 k3_rank16,2 k3_rank8,1 k3_rank8,2; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-v7"; done
          K3_SWEEP_TIMEOUT=360 bash scripts/h200_sweep.sh $cells --budget-s 330 ;;
  # the final default (v8 at bucket 1 where its parts equal v7's, v7 at bucket 2): the default path's GPU tests (s54's
  # ids had two that do not exist, so none ran), then the four b1 / b2 cells beside stock with both A/Bs
  s55)    ids="tests/gpu/test_fast_layer.py::test_fast_moe_half_same_input[1-fast]"
          ids="$ids tests/gpu/test_fast_layer.py::test_fast_layer_graph_replay_is_stable"
          for c in 1-256-uniform 1-256-ties 2-256-shared 2-256-uniform; do
            ids="$ids tests/gpu/test_moe_mxfp4_experts.py::test_matches_reference[$c]"; done
          ids="$ids tests/gpu/test_moe_mxfp4_experts.py::test_cuda_graph_replay_new_routing[1]"
          K3_TEST_TIMEOUT=120 bash scripts/h200_tests.sh $ids || true
          cells="--cell kda_moe,k3_rank8,1,0,stock+fast"
          for c in k3_rank16,1 k3_rank16,2 k3_rank8,2; do
            cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-v7+fast-v8"; done
          K3_SWEEP_TIMEOUT=360 bash scripts/h200_sweep.sh $cells --budget-s 330 ;;
  # v8.2 (uneven row blocks, rank8 b1 with v7's 3 parts): GPU tests, bench, the layer A/B (no stock: vLLM not staged)
  s56)    K3_TEST_TIMEOUT=100 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py -k "v8 and 384" || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 60 python3 -m k3fast.bench_experts --out "$o" --tag "$K3_TAG" --shapes k3_rank8 \
            --batches 1 --variants default v8 fc1probe v8fc1probe --replays 50 > "$o/experts.log" 2>&1
          grep -v -i warn "$o/experts.log" | grep -v marlin | tail -5
          K3_SWEEP_TIMEOUT=100 bash scripts/h200_sweep.sh --cell kda_moe,k3_rank8,1,0,fast+fast-v8 --budget-s 80 ;;
  # written in session 18 (LOG, next steps 3): where oproj_attnres's ~7 us that are not bandwidth sit, by the warp
  # stall samples per SASS address (SourceCounters), rank16 b1 and rank8 b1
  ncu9)   K3_NCU_EXTRA="--section SourceCounters" \
            bash scripts/h200_ncu.sh "bench --kernel oproj_attnres --shape k3_rank16" \
            "bench --kernel oproj_attnres --shape k3_rank8" ;;
  # written in session 18 after ncu9 (whose SourceCounters text has totals only): the rank16 b1 report kept and its
  # source page printed per SASS instruction, with the stall samples of each (ncu 2025.3: --page source,
  # --print-source sass); the report itself comes back too, for the GUI's source view
  ncu10)  o=${OUT:-out}; mkdir -p "$o"; export CUTE_DSL_ARCH=sm_90a
          timeout 200 ncu --clock-control none --nvtx --nvtx-include "profile/" --set full -o "$o/oproj16" \
            python3 scripts/ncu_cases.py bench --kernel oproj_attnres --shape k3_rank16 > "$o/ncu10.log" 2>&1
          tail -3 "$o/ncu10.log"
          ncu --import "$o/oproj16.ncu-rep" --page source --csv --print-source sass > "$o/oproj16-sass.csv" 2>&1
          echo "source page rc $?: $(wc -l < "$o/oproj16-sass.csv") lines"; head -3 "$o/oproj16-sass.csv" | cut -c1-300 ;;
  # written in session 18 after the runs: v8.3, v8's exchange through epoch-tagged words (no counter poll), and
  # lean_arrive (no per-thread fence before the combine's arrivals); no vLLM
  s57)    K3_TEST_TIMEOUT=180 bash scripts/h200_tests.sh tests/gpu/test_moe_mxfp4_experts.py -k "tagged or lean_arrive" \
            "tests/gpu/test_fast_layer.py::test_fast_moe_half_same_input[1-fast-v8tag]" \
            "tests/gpu/test_fast_layer.py::test_fast_moe_half_same_input[1-fast-xlean]" || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 100 python3 -m k3fast.bench_experts --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 \
            --batches 1 2 --variants default v8 v8tag LEAN v7LEAN v8fc1probe v8tagfc1probe --replays 50 \
            > "$o/experts.log" 2>&1
          grep -v -i warn "$o/experts.log" | grep -v marlin | tail -29
          cells=""; for c in k3_rank16,1 k3_rank16,2 k3_rank8,1; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,fast+fast-v8tag+fast-xlean"; done
          K3_SWEEP_TIMEOUT=200 bash scripts/h200_sweep.sh $cells --budget-s 170 ;;
  # written in session 18 after the runs: oproj_attnres v1.5 (lean arrival chain): GPU tests, kernel bench, the
  # attention half A/B at rank8 / rank16 b1 / b2 (no stock without vLLM: stage with --vllm to get the ratios)
  s58)    ids=$(for b in 1 2; do for t in 16 8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-$t-fast-oplean]"; done; done)
          K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh tests/gpu/test_oproj_attnres.py -k "lean" $ids || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 120 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 1 2 \
            --kernels oproj_attnres oproj_attnres@lean > "$o/kernels.log" 2>&1; grep -v -i warn "$o/kernels.log" | tail -10
          cells=""; for c in k3_rank8,1 k3_rank8,2 k3_rank16,1 k3_rank16,2; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-oplean"; done
          K3_SWEEP_TIMEOUT=300 bash scripts/h200_sweep.sh $cells --budget-s 270 ;;
  # written in session 19 after s58: v1.5 the default; the whole oproj_attnres GPU file on the default (lean) path, the
  # attention half at b1 / b2 / b8 for fast and fast-opfence, the kernel A/B, and the layer beside stock (stage with
  # --vllm) at rank8 / rank16 b1 / b2 / b8
  s59)    ids=$(for b in 1 2 8; do for t in 16 8; do for i in fast fast-opfence; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-$t-$i]"; done; done; done)
          K3_TEST_TIMEOUT=170 bash scripts/h200_tests.sh tests/gpu/test_oproj_attnres.py $ids || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 100 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 1 2 \
            --kernels oproj_attnres oproj_attnres@fenced > "$o/kernels.log" 2>&1; grep -v -i warn "$o/kernels.log" | tail -10
          cells=""; for c in k3_rank8,1 k3_rank8,2 k3_rank16,1 k3_rank16,2 k3_rank8,8 k3_rank16,8; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-opfence"; done
          K3_SWEEP_TIMEOUT=300 bash scripts/h200_sweep.sh $cells --budget-s 270 ;;
  # written in session 19 after s59: oproj_attnres v1.6 (32-row GEMV CTAs at rank8 M <= 8; opt-in fast-op32): GPU
  # tests, the kernel A/B, and the attention half beside stock at rank8 b1 / b2 (stage with --vllm)
  s60)    ids=$(for b in 1 2 3 4; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-8-fast-op32]"; done)
          K3_TEST_TIMEOUT=120 bash scripts/h200_tests.sh tests/gpu/test_oproj_attnres.py -k "split or op32" $ids || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 60 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank8 --batches 1 2 \
            --kernels oproj_attnres oproj_attnres@rows32 > "$o/kernels.log" 2>&1; grep -v -i warn "$o/kernels.log" | tail -5
          cells=""; for c in k3_rank8,1 k3_rank8,2; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-op32"; done
          K3_SWEEP_TIMEOUT=200 bash scripts/h200_sweep.sh $cells --budget-s 170 ;;
  # written in session 19 after s60: KDA v8 (the early trigger after phase A) with 64- and 32-row o_proj; no vLLM, the
  # A/B in one run (fast against fast-op32 / fast-kdamid / fast-op32mid) at rank8 b1 / b2 and rank16 b1 (measured;
  # KDA v8 and its impls were removed after it, the code is at e3ab9f1)
  s61)    ids=$(for b in 1 2; do for i in 16-fast-kdamid 8-fast-kdamid 8-fast-op32mid; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-$i]"; done; done)
          K3_TEST_TIMEOUT=100 bash scripts/h200_tests.sh tests/gpu/test_kda_conv_gate_step.py -k "mid_trigger or kdamid or op32mid" $ids || true
          cells=""; for c in k3_rank8,1 k3_rank8,2 k3_rank16,1; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,fast+fast-op32+fast-kdamid+fast-op32mid"; done
          K3_SWEEP_TIMEOUT=170 bash scripts/h200_sweep.sh $cells --budget-s 150 ;;
  # written in session 20: rms_gemv_ring v13 (the tensor-core ring GEMV at M 3..8 where the in_proj / o_proj are
  # cuBLAS): its GPU tests, the attention half with it against the reference, the kernel rows beside cuBLAS, and the
  # attention half beside stock at b4 / b8 (stage with --vllm)
  s62)    ids=$(for b in 3 8; do for t in 16 8; do for i in fast-inmma fast-inmmaet fast-opmma fast-mid fast-op8; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-$t-$i]"; done; done; done)
          K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv_ring.py -k "mma or mid or op8" $ids || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 80 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 4 8 \
            --kernels gemv_in_proj_plain@ringmma attnres_rms_gemv@ringmma attnres_rms_gemv@ringmmaet \
            gemv_o_proj_plain@ringmma > "$o/kernels.log" 2>&1; grep -v -i warn "$o/kernels.log" | tail -16
          cells=""; for c in k3_rank8,8 k3_rank16,8 k3_rank8,4 k3_rank16,4; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-inmma+fast-inmmaet+fast-opmma+fast-mid+fast-op8"; done
          K3_SWEEP_TIMEOUT=260 bash scripts/h200_sweep.sh $cells --budget-s 240 ;;
  # written in session 20 after s62 (measured at c5137f8; v13.1 and its bench row @ringmma13 removed after it):
  # v13.1 (x in registers, the deeper ring) as the default in_proj at M 3..8; the
  # o_proj choice at M 5..8 (fast-opmma / fast-op8) beside stock (stage with --vllm)
  s63)    ids=$(for b in 3 4 7 8; do for t in 16 8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-$t-fast]"; done; done
                for t in 16 8; do for i in fast-opmma fast-op8 fast-incublas; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[8-$t-$i]"; done; done)
          K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv_ring.py -k "mma or fast" $ids || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 60 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 8 \
            --kernels gemv_in_proj_plain@ringmma gemv_in_proj_plain@ringmma13 attnres_rms_gemv@ringmmaet \
            > "$o/kernels.log" 2>&1; grep -v -i warn "$o/kernels.log" | tail -8
          cells=""; for c in k3_rank8,8 k3_rank16,8 k3_rank8,4 k3_rank16,4; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-incublas+fast-opmma+fast-op8"; done
          K3_SWEEP_TIMEOUT=250 bash scripts/h200_sweep.sh $cells --budget-s 230 ;;
  # written in session 20 after s63 (v13.1 wrong, removed): the default (v13 in_proj at M 3..8, the norm's early
  # trigger) under its GPU tests again, and the attention half beside stock at b4 / b8 (stage with --vllm)
  s64)    ids=$(for b in 3 4 7 8; do for t in 16 8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-$t-fast]"; done; done
                for t in 16 8; do for i in fast-inmma fast-incublas fast-op8; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[8-$t-$i]"; done; done)
          K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv_ring.py -k "mma or fast" $ids || true
          cells=""; for c in k3_rank8,8 k3_rank16,8 k3_rank8,4 k3_rank16,4; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-incublas+fast-op8"; done
          K3_SWEEP_TIMEOUT=220 bash scripts/h200_sweep.sh $cells --budget-s 200 ;;
  # written in session 21: the o_proj's fused kernel to M = 8 (the new default) and rms_gemv_ring v14 (the in_proj's
  # ring on a tiled weight, fast-intiled): GPU tests, the kernel rows, the attention half beside stock at b4 / b8
  # (stage with --vllm)
  s65)    ids=$(for b in 3 4 7 8; do for t in 16 8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-$t-fast]"; done; done
                for t in 16 8; do for b in 3 8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-$t-fast-intiled]"; done
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[8-$t-fast-op4]"; done)
          K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv_ring.py -k "mma or fast" $ids || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 80 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 4 8 \
            --kernels gemv_in_proj_plain@ringmma gemv_in_proj_plain@ringmmatiled attnres_rms_gemv@ringmmaet \
            attnres_rms_gemv@ringmmaettiled > "$o/kernels.log" 2>&1; grep -v -i warn "$o/kernels.log" | tail -16
          cells=""; for c in k3_rank8,8 k3_rank16,8 k3_rank8,4 k3_rank16,4; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-intiled+fast-op4"; done
          K3_SWEEP_TIMEOUT=230 bash scripts/h200_sweep.sh $cells --budget-s 210 ;;
  # written in session 21 after s65 (v14's build took a 32 KC-wide weight operand, so every v14 call was refused at
  # its argument check; fixed): v14's tests, its kernel rows and fast-intiled beside fast and stock
  # (after s68 test_gemv_ring_mma_tiled was folded into test_gemv_ring_mma: "-k tiled" now selects the graph test only)
  s66)    ids=$(for t in 16 8; do for b in 3 4 7 8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-$t-fast-intiled]"; done; done)
          K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv_ring.py -k "tiled or graph or fast" $ids || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 80 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 4 8 \
            --kernels gemv_in_proj_plain@ringmma gemv_in_proj_plain@ringmmatiled attnres_rms_gemv@ringmmaet \
            attnres_rms_gemv@ringmmaettiled > "$o/kernels.log" 2>&1; grep -v -i warn "$o/kernels.log" | tail -16
          cells=""; for c in k3_rank8,8 k3_rank16,8 k3_rank8,4 k3_rank16,4; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-intiled"; done
          K3_SWEEP_TIMEOUT=200 bash scripts/h200_sweep.sh $cells --budget-s 180 ;;
  # written in session 21 after s66: the default beside stock at every rank16 / rank8 cell of the sweep (b1 / b2 / b8
  # / b64: b64 last measured at s49), fast-intiled again at b8 (no tests: s65 / s66 ran them)
  s67)    cells=""; for c in k3_rank16,1 k3_rank8,1 k3_rank16,2 k3_rank8,2; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast"; done
          for c in k3_rank8,8 k3_rank16,8; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-intiled"; done
          for c in k3_rank16,64 k3_rank8,64; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast"; done
          K3_SWEEP_TIMEOUT=400 bash scripts/h200_sweep.sh $cells --budget-s 370 ;;
  # written in session 21 after s67: the in_proj ring's trigger right after its wait (fast-inmmatrig /
  # fast-intiledtrig) beside fast and stock at b4 / b8
  s68)    ids=$(for t in 16 8; do for b in 3 8; do for i in fast-inmmatrig fast-intiledtrig; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-$t-$i]"; done; done; done)
          K3_TEST_TIMEOUT=120 bash scripts/h200_tests.sh $ids || true
          cells=""; for c in k3_rank8,8 k3_rank16,8 k3_rank8,4 k3_rank16,4; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-inmmatrig+fast-intiled+fast-intiledtrig"; done
          K3_SWEEP_TIMEOUT=260 bash scripts/h200_sweep.sh $cells --budget-s 240 ;;
  # written in session 22: the KDA step's v9 (nsplit 1: one CTA per request and head, the state through shared
  # memory by bulk copies): its GPU tests, the kernel rows at b1 / b8 / b16 / b64, the attention half beside stock
  # (fast-kdahead at b64, fast-kdahead48 at b4 / b8) (stage with --vllm)
  s69)    ids=$(for c in 64-16-fast-kdahead 64-8-fast-kdahead 16-8-fast-kdahead 8-16-fast-kdahead48 8-8-fast-kdahead48 \
                         4-8-fast-kdahead48; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c]"; done)
          K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh tests/gpu/test_kda_conv_gate_step.py -k "head or timing" $ids || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 90 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 1 8 16 64 \
            --kernels kda_conv_gate_step@trig kda_conv_gate_step@ns1trig > "$o/kernels.log" 2>&1
          grep -v -i warn "$o/kernels.log" | tail -20
          cells=""; for c in k3_rank16,64 k3_rank8,64; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-kdahead"; done
          for c in k3_rank16,8 k3_rank8,8; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-kdahead48"; done
          cells="$cells --cell kda_moe,k3_rank8,4,0,fast+fast-kdahead48"
          K3_SWEEP_TIMEOUT=220 bash scripts/h200_sweep.sh $cells --budget-s 200 ;;
  # written in session 22 after s69 (v9 correct and bit-identical, but rank16 b64 27.4 -> 25.3 us only): where v9's
  # time goes. Nsight Compute (full set, the per-SASS source page) on v9 at rank16 b64; the kernel rows with v9's
  # rows loaded 4 at a time (row_group 4: its SASS runs each row's load -> 10 shuffles -> store as one chain)
  s70)    K3_TEST_TIMEOUT=120 bash scripts/h200_tests.sh tests/gpu/test_kda_conv_gate_step.py -k "bit_identical_to_nsplit4" || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 60 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 16 64 \
            --kernels kda_conv_gate_step@trig kda_conv_gate_step@ns1trig kda_conv_gate_step@ns1g4trig > "$o/kernels.log" 2>&1
          grep -v -i warn "$o/kernels.log" | cut -c1-200 | tail -14
          timeout 200 ncu --clock-control none --nvtx --nvtx-include "profile/" --set full -o "$o/kdav9" \
            python3 scripts/ncu_cases.py bench --kernel kda_conv_gate_step@ns1trig --shape k3_rank16 --batch 64 \
            > "$o/ncu.log" 2>&1
          tail -3 "$o/ncu.log"
          ncu --import "$o/kdav9.ncu-rep" --page source --csv --print-source sass > "$o/kdav9-sass.csv" 2>&1
          ncu --import "$o/kdav9.ncu-rep" --print-details all > "$o/kdav9-details.txt" 2>&1
          grep -E "Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Block Limit|Waves Per SM|Registers Per|Shared Memory Config|Dynamic Shared" "$o/kdav9-details.txt" | head -20
          gzip "$o/kdav9-sass.csv"
          (cd "$o" && tar czf logs.tgz gpu.txt gpu-tests.log kernels.log ncu.log && rm -f gpu.txt gpu-tests.log kernels.log ncu.log) ;;
  # written in session 22 after s70: v9.1 (the state by chunk: each chunk's warps start when it lands and store it
  # when done) under the v9 tests, the kernel rows, the attention half beside stock at b16 / b64 (stage with --vllm)
  s71)    ids=$(for c in 64-16-fast-kdahead 64-8-fast-kdahead 16-8-fast-kdahead 16-16-fast-kdahead48; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c]"; done)
          K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh tests/gpu/test_kda_conv_gate_step.py -k "head" $ids || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 70 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 8 16 64 \
            --kernels kda_conv_gate_step@trig kda_conv_gate_step@ns1trig kda_conv_gate_step@ns1g1trig > "$o/kernels.log" 2>&1
          grep -v -i warn "$o/kernels.log" | cut -c1-130 | tail -18
          cells=""; for c in k3_rank16,64 k3_rank8,64 k3_rank8,16; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-kdahead"; done
          cells="$cells --cell kda_moe,k3_rank16,16,0,fast+fast-kdahead48"
          K3_SWEEP_TIMEOUT=200 bash scripts/h200_sweep.sh $cells --budget-s 180 ;;
  # written in session 22 after s71: v9.1 the default from 192 request-heads. Its tests as the default (the KDA step
  # and the attention half at b16 / b64, the A/B fast-s22kda), then the default beside stock at every rank16 / rank8
  # cell of the sweep (b1 / b2 / b8 / b64, and rank8 b16) for the status table (stage with --vllm)
  s72)    ids=$(for c in 64-16-fast 64-8-fast 16-8-fast 16-16-fast 64-16-fast-s22kda 64-8-fast-s22kda; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c]"; done
                for c in 64-1-6 64-1-12 64-4-12 64-8-6 16-1-12 16-4-12 16-8-6; do
                  echo "tests/gpu/test_kda_conv_gate_step.py::test_step[$c]"; done
                for f in test_late_stores_are_bit_identical test_dsmem_tx_against_reference; do
                  echo "tests/gpu/test_kda_conv_gate_step.py::$f"; done)
          K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh $ids || true
          cells=""; for c in k3_rank16,1 k3_rank8,1 k3_rank16,2 k3_rank8,2 k3_rank16,8 k3_rank8,8 k3_rank8,16; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast"; done
          for c in k3_rank16,64 k3_rank8,64; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-s22kda"; done
          K3_SWEEP_TIMEOUT=330 bash scripts/h200_sweep.sh $cells --budget-s 300 ;;
  # written in session 23: rms_gemv v15 (the AttnRes norms above M = 8 as clusters of 4 CTAs per token): its GPU
  # tests, the layer tests it touches (the attention half at b16 / b64 and its A/B, the v13 norm at b3 / b8 with
  # fast-normc3), session 22's folded KDA tests and the KDA cluster build (its DSMEM helper moved to _dsl), the norm
  # rows of the kernel bench, the attention half beside stock at b8 / b16 / b64 (stage with --vllm)
  s73)    ids=$(for c in 64-16-fast 64-8-fast 16-8-fast 16-16-fast 64-16-fast-normc1 16-8-fast-normc1 \
                         8-8-fast-normc3 3-16-fast-normc3; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c]"; done
                for t in "test_all_padding_and_bad_slot[1]" "test_back_to_back_steps[12-slots_list1-1]" \
                         "test_cuda_graph_replay[6-64-1-opts2]" "test_cuda_graph_replay[12-16-4-opts3]" \
                         "test_dsmem_tx_against_reference[7-3-6]" "test_late_stores_are_bit_identical[True-12-8-1]"; do
                  echo "tests/gpu/test_kda_conv_gate_step.py::$t"; done)
          K3_TEST_TIMEOUT=240 bash scripts/h200_tests.sh $ids "tests/gpu/test_fast_layer.py::test_fast_attention_half_at_a_block_boundary" \
            tests/gpu/test_rms_gemv.py::test_attnres_rmsnorm tests/gpu/test_rms_gemv.py::test_attnres_rmsnorm_cluster \
            tests/gpu/test_rms_gemv.py::test_attnres_rmsnorm_in_place tests/gpu/test_rms_gemv_ring.py::test_joint_prologue_is_bit_identical \
            tests/gpu/test_rms_gemv_ring.py::test_norm_then_ring_mma_in_a_graph || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          ks=""; for nb in 1 8; do for cl in 1 2 4 8; do ks="$ks attnres_rmsnorm@nb${nb}cl${cl}"; done; done
          timeout 60 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 --batches 8 16 64 \
            --kernels $ks > "$o/kernels.log" 2>&1
          grep -v -i warn "$o/kernels.log" | cut -c1-130 | tail -26
          cells=""; for c in k3_rank16,64 k3_rank8,64 k3_rank8,16; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-normc1"; done
          cells="$cells --cell kda_moe,k3_rank16,16,0,fast+fast-normc1"
          for c in k3_rank8,8 k3_rank16,8; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-normc3"; done
          K3_SWEEP_TIMEOUT=280 bash scripts/h200_sweep.sh $cells --budget-s 250 ;;
  # written in session 23 after s73 (v15 faster in every cell, also at M 3..8 as fast-normc3): the clusters from M = 3
  # as the default. Its tests (the attention half at b3 / b4 / b7 / b8, the v13 norm + ring in a graph, the torch ops
  # and the layer's graph replay at b4), then the default beside stock at every rank16 / rank8 cell, the A/Bs at b8
  # (fast-normc9, s73's default) and b64 (fast-normc1) (stage with --vllm)
  s74)    ids=$(for c in 3-8-fast 4-16-fast 7-8-fast 8-8-fast 8-16-fast 8-8-fast-normc1 4-16-fast-normc9; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c]"; done)
          K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh $ids tests/gpu/test_ops.py \
            tests/gpu/test_fast_layer.py::test_fast_layer_graph_replay_is_stable \
            tests/gpu/test_rms_gemv_ring.py::test_norm_then_ring_mma_in_a_graph || true
          cells=""; for c in k3_rank16,1 k3_rank8,1 k3_rank16,2 k3_rank8,2 k3_rank16,16 k3_rank8,16; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast"; done
          for c in k3_rank16,8 k3_rank8,8; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-normc9"; done
          for c in k3_rank16,64 k3_rank8,64; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-normc1"; done
          K3_SWEEP_TIMEOUT=340 bash scripts/h200_sweep.sh $cells --budget-s 310 ;;
  # the default beside stock at full width (one rank holding the whole layer), b1 / b8 / b64: the attention and MoE
  # halves' cells the issues list, last measured at a5373e5 (session 3)
  s75)    cells=""; for b in 1 8 64; do cells="$cells --cell kda_moe,full,$b,0,stock+fast"; done
          K3_SWEEP_TIMEOUT=500 bash scripts/h200_sweep.sh $cells --budget-s 420 ;;
  # written in session 23 after s75 (at full width b8 the fused oproj_attnres took 168 us of an attention half of 372,
  # stock's 319): o_proj on cuBLAS + the AttnRes #2 norm above K = 1536 (OPROJ_FUSED_MAX_KP). Its tests at full width
  # (the attention half at b8 with both o_proj paths, the layer at b1) and the torch ops, then the full-width cells
  # beside stock and the A/B fast-opfull (stage with --vllm)
  s76)    K3_TEST_TIMEOUT=240 bash scripts/h200_tests.sh tests/gpu/test_fast_layer.py::test_fast_attention_half_full_width_b8 \
            tests/gpu/test_fast_layer.py::test_fast_layer_full_width_b1 tests/gpu/test_ops.py || true
          cells=""; for b in 1 8 64; do cells="$cells --cell kda_moe,full,$b,0,stock+fast+fast-opfull"; done
          K3_SWEEP_TIMEOUT=260 bash scripts/h200_sweep.sh $cells --budget-s 230 ;;
  # written in session 23 after s74, whose stock rank8 cells ran vLLM's causal_conv1d_update at 10.6 / 19.3 / 72.8 us
  # (b8 / b16 / b64; ~2 us in s73): its Triton config follows the first batch a process runs at each width, and s74 ran
  # rank8 b1 first. The final defaults beside stock at the cells under 1.8x, each width's largest batch first (the
  # order vLLM captures its graphs in; s73's order) (stage with --vllm)
  s77)    cells=""; for c in k3_rank8,64 k3_rank8,16 k3_rank8,8 k3_rank16,64 k3_rank16,16 k3_rank16,8; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast"; done
          K3_SWEEP_TIMEOUT=200 bash scripts/h200_sweep.sh $cells --budget-s 170 ;;
  # written in session 23 for the next session (not run yet). s78: Nsight Compute on the KDA step's v9.1 (the default
  # at rank16 b64) per SASS instruction, before rewriting its phase B: the per-row shuffle chains against the shared
  # memory pipe. The report itself stays on the device (the tree is 0.5 MiB under the carry limit): its details and
  # the gzipped SASS source page come back. s79: the defaults beside stock at every rank16 / rank8 cell with the stock
  # libraries' autotuners reset before each stock cell (trace.reset_stock_autotuners) (both: stage with --vllm)
  s78)    ncu_sass kda_conv_gate_step@ns1trig kdav91 200 ;;
  s79)    cells=""; for c in k3_rank16,1 k3_rank8,1 k3_rank16,2 k3_rank8,2 k3_rank16,8 k3_rank8,8 k3_rank16,16 k3_rank8,16 \
                             k3_rank16,64 k3_rank8,64; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast"; done
          K3_SWEEP_TIMEOUT=380 bash scripts/h200_sweep.sh $cells --budget-s 350 ;;
  # written in session 24: the KDA step's whole GPU file (the review's shared helpers, PTX-checked but not run) and the
  # attention half at every batch of the sweep with the default impl, then s78's Nsight Compute report (stage with --vllm)
  s80)    ids=$(for b in 1 2 3 4 7 8 16 64; do for r in 16 8; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-$r-fast]"; done; done)
          K3_TEST_TIMEOUT=330 bash scripts/h200_tests.sh tests/gpu/test_kda_conv_gate_step.py $ids \
            tests/gpu/test_fast_layer.py::test_fast_layer_graph_replay_is_stable || true
          bash scripts/h200_next.sh s78 ;;
  # written in session 24 after s79 (whose autotuner reset missed fla's conv tuner behind @triton.heuristics, and
  # Triton's on-disk autotune cache refilled what it did clear; both fixed): the cuBLAS entry points on the attention
  # half's GEMMs above M = 8 (k3fast.blas_probe), then s79 again (stage with --vllm)
  s81)    o=${OUT:-out}; mkdir -p "$o"
          timeout 150 python3 -m k3fast.blas_probe --out "$o" --tag "$K3_TAG" > "$o/blasprobe.log" 2>&1
          cat "$o/blasprobe.log" | tail -20
          bash scripts/h200_next.sh s79 ;;
  # written in session 24 after s81: fast.INPROJ_BLAS (the in_proj's cuBLAS GEMM through cublasLt, no split-K at
  # rank16 M = 64) with its tests, then every rank16 / rank8 cell beside stock (the autotuner reset fixed twice; s81's
  # stock cells failed) and the A/B fast-inmm where the GEMM runs on cuBLAS (stage with --vllm)
  s82)    ids=$(for c in 64-16 64-8 16-16 16-8 8-16; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-fast]"; done)
          K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh $ids tests/gpu/test_ops.py || true
          cells=""; for c in k3_rank16,1 k3_rank8,1 k3_rank16,2 k3_rank8,2 k3_rank16,8 k3_rank8,8; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast"; done
          for c in k3_rank16,16 k3_rank8,16 k3_rank16,64 k3_rank8,64; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-inmm"; done
          K3_SWEEP_TIMEOUT=380 bash scripts/h200_sweep.sh $cells --budget-s 350 ;;
  # written in session 24 after s82: INPROJ_BLAS at full width, where the in_proj GEMM runs on cuBLAS from M = 3 and
  # s81's probe did not look: the probe on the full in_proj, then fast beside fast-inmm at b8 / b64 (no stock:
  # s76 measured it at e8c9c17) (stage with --vllm)
  s83)    o=${OUT:-out}; mkdir -p "$o"
          timeout 120 python3 -m k3fast.blas_probe --out "$o" --tag "$K3_TAG" --shapes full --gemms in_proj \
            --forms mm,lt --ms 3,8,16,64 --replays 30 > "$o/blasprobe.log" 2>&1
          cat "$o/blasprobe.log" | tail -6
          cells=""; for b in 8 64; do cells="$cells --cell kda_moe,full,$b,0,fast+fast-inmm"; done
          K3_SWEEP_TIMEOUT=300 bash scripts/h200_sweep.sh $cells --budget-s 270 ;;
  # written in session 24: kda_conv_gate_step v9.2 (proj_first: the state's bulk copies behind the first token's
  # projection loads), its bitwise tests and the attention half with it, the kernel bench beside v9.1 and the cells
  # where v9.1 runs beside stock (stage with --vllm)
  # (run at 92d0ab6 with these commands typed out and shorter time-outs, to fit the session's last device minutes:
  # the values below are the ones used)
  s84)    K3_TEST_TIMEOUT=80 bash scripts/h200_tests.sh tests/gpu/test_kda_conv_gate_step.py::test_proj_first_is_bit_identical \
            "tests/gpu/test_fast_layer.py::test_fast_attention_half[64-16-fast-kdapf]" \
            "tests/gpu/test_fast_layer.py::test_fast_attention_half[16-8-fast-kdapf]" || true
          cells=""; for c in k3_rank16,64 k3_rank8,16 k3_rank8,64; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-kdapf"; done
          K3_SWEEP_TIMEOUT=125 K3_BENCH="--shapes k3_rank16 k3_rank8 --batches 16 64 --kernels kda_conv_gate_step@ns1trig \
            kda_conv_gate_step@ns1pftrig" K3_BENCH_TIMEOUT=45 bash scripts/h200_sweep.sh $cells --budget-s 105 ;;
  # written in session 24 for the next session (not run): v9.2 at full width, where the one-CTA-per-head build runs at
  # b8 / b64 and was not measured with it (the attention half's full-width test at b8, fast beside fast-s24kda), then
  # Nsight Compute of v9.2 at rank16 b64 (report kept on the device; details and the gzipped SASS page come back), to
  # see what is left of v9.1's 23.5 % at phase A's barrier (stage with --vllm)
  s85)    K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh "tests/gpu/test_fast_layer.py::test_fast_attention_half_full_width_b8[fast]" || true
          cells=""; for b in 8 64; do cells="$cells --cell kda_moe,full,$b,0,fast+fast-s24kda"; done
          K3_SWEEP_TIMEOUT=220 bash scripts/h200_sweep.sh $cells --budget-s 200
          ncu_sass kda_conv_gate_step@ns1pftrig kdav92 150 ;;
  # written in session 25: gemm_wgmma_splitk v1 (the in_proj's GEMM at M 9..64 on WGMMA with a cluster K split) with
  # its GPU tests and the attention half with it (fast-inwg: the norm's trigger after its wait; fast-inwglate: at its
  # end), then the kernel bench of its rows beside cublasLt. s87 (a warm follow-up): the cells where it runs, beside
  # stock and fast (stage with --vllm)
  s86)    bash scripts/h200_next.sh s86smoke || exit 1
          ids=$(for c in 16-16 16-8 64-16 64-8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-fast-inwg]"; done)
          K3_TEST_TIMEOUT=170 bash scripts/h200_tests.sh tests/gpu/test_gemm_wgmma_splitk.py $ids \
            "tests/gpu/test_fast_layer.py::test_fast_attention_half[64-16-fast-inwglate]" || true
          K3_SWEEP_TIMEOUT=100 K3_BENCH="--shapes k3_rank16 k3_rank8 --batches 16 64 --kernels gemm_in_proj_plain@wgmma \
            gemm_in_proj_plain@wgmma4 attnres_rms_gemv@wgmma attnres_rms_gemv@wgmmaet" K3_BENCH_TIMEOUT=90 \
            bash scripts/h200_sweep.sh --cell kda_moe,k3_rank16,64,0,fast+fast-inwg --budget-s 60 ;;
  s87)    cells=""; for c in k3_rank16,64 k3_rank8,64 k3_rank16,16 k3_rank8,16; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-inwg+fast-inwglate"; done
          K3_SWEEP_TIMEOUT=330 bash scripts/h200_sweep.sh $cells --budget-s 300 ;;
  # written in session 25 after s86 / s87: gemm_wgmma_splitk v1.1 (128-wide stages, the trigger after the cluster's main
  # loops, the epilogue unrolled): its tests, the kernel bench beside v1's stages and cublasLt, and the four cells
  # beside stock and fast (stage with --vllm)
  s88)    bash scripts/h200_next.sh s86smoke || exit 1
          ids=$(for c in 16-16 16-8 64-16 64-8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-fast-inwg]"; done)
          K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh tests/gpu/test_gemm_wgmma_splitk.py $ids || true
          cells=""; for c in k3_rank16,64 k3_rank8,64 k3_rank16,16 k3_rank8,16; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-inwg"; done
          K3_SWEEP_TIMEOUT=200 K3_BENCH="--shapes k3_rank16 k3_rank8 --batches 16 64 --kernels gemm_in_proj_plain@wgmma \
            gemm_in_proj_plain@wgmmak64 attnres_rms_gemv@wgmmaet" K3_BENCH_TIMEOUT=80 \
            bash scripts/h200_sweep.sh $cells --budget-s 180 ;;
  # written in session 25 after s88 (v1.1's 128-wide stages no faster; the KDA launch after the cluster barrier showed
  # the epilogue takes ~1.6 us, so the main loop itself runs at ~2.7 TB/s): whether the one-wave co-residency the plan
  # assumes holds. Rings of 3 / 2 stages fit two CTAs per SM; 13 clusters of 8 / 26 of 4 leave margin (stage with --vllm)
  s89)    bash scripts/h200_next.sh s86smoke || exit 1
          K3_TEST_TIMEOUT=110 bash scripts/h200_tests.sh tests/gpu/test_gemm_wgmma_splitk.py \
            "tests/gpu/test_fast_layer.py::test_fast_attention_half[64-16-fast-inwgd2]" \
            "tests/gpu/test_fast_layer.py::test_fast_attention_half[64-8-fast-inwgd2]" || true
          cells="--cell kda_moe,k3_rank16,64,0,stock+fast+fast-inwg+fast-inwgd3+fast-inwgd2"
          for c in k3_rank8,64 k3_rank16,16 k3_rank8,16; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,fast+fast-inwgd3+fast-inwgd2"; done
          K3_SWEEP_TIMEOUT=140 K3_BENCH="--shapes k3_rank16 k3_rank8 --batches 64 --kernels gemm_in_proj_plain@wgmma \
            gemm_in_proj_plain@wgmmad3 gemm_in_proj_plain@wgmmad2 gemm_in_proj_plain@wgmma8bn256 \
            gemm_in_proj_plain@wgmma4bn128 gemm_in_proj_plain@wgmma8bn256d2" K3_BENCH_TIMEOUT=75 \
            bash scripts/h200_sweep.sh $cells --budget-s 120 ;;
  # written in session 25 for its last ~3 device-minutes (refused: too little time to start a machine; stage WITHOUT
  # vLLM: 4 parts): v2 (the tiled weight) against the plain layout in the kernel bench at b64, both widths, after an
  # equality check of the two, and cuBLAS's own tilings without a K split (1bn32 / 1bn64) and a split of 2 x 64 rows
  s90q)   o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 40 python3 -c "import torch; from k3fast.gemm_wgmma_splitk import gemm_wgmma as g, tile_weight as t
x = torch.randn(64, 7168, device='cuda').bfloat16(); w = torch.randn(3216, 7168, device='cuda').bfloat16()
y = g(x, w); yt = g(x, t(w)); torch.cuda.synchronize(); print('tiled == plain:', torch.equal(y, yt))" || exit 1
          timeout 60 python3 -m k3fast.cluster_probe --out "$o" --tag "$K3_TAG" 2>&1 | tail -10
          timeout 90 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 64 \
            --kernels gemm_in_proj_plain@wgmma gemm_in_proj_plain@wgmmatiled gemm_in_proj_plain@wgmmad3 \
            gemm_in_proj_plain@wgmmatiledd3 gemm_in_proj_plain@wgmma1bn32 gemm_in_proj_plain@wgmma1bn64 \
            gemm_in_proj_plain@wgmma2bn64 gemm_in_proj_plain@wgmmanomma > "$o/bench.log" 2>&1
          grep -o '"kernel": "[^"]*", "shape": "[^"]*"\|"fast_us_median": [0-9.]*\|"stock_us_median": [0-9.]*' "$o/bench.log" | paste - - - - ;;
  # written in session 25 for the next session (not run; stage with --vllm). s90: v2 (the tiled weight) with its bitwise
  # tests and in the attention half, the kernel bench of the plain / tiled layouts at both ring depths, and the four
  # cells beside stock and fast. s91 (a warm follow-up): Nsight Compute of v1 at rank16 b64 (DRAM throughput, stalls)
  s90)    bash scripts/h200_next.sh s86smoke || exit 1
          o=${OUT:-out}; mkdir -p "$o"; timeout 60 python3 -m k3fast.cluster_probe --out "$o" --tag "$K3_TAG" 2>&1 | tail -10
          ids=$(for c in 16-16 64-16 16-8 64-8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-fast-inwgtiled]"; done)
          K3_TEST_TIMEOUT=130 bash scripts/h200_tests.sh tests/gpu/test_gemm_wgmma_splitk.py tests/gpu/test_cluster_probe.py $ids || true
          cells=""; for c in k3_rank16,64 k3_rank8,64 k3_rank16,16 k3_rank8,16; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-inwg+fast-inwgtiled+fast-inwgtiledd3"; done
          K3_SWEEP_TIMEOUT=230 K3_BENCH="--shapes k3_rank16 k3_rank8 --batches 16 64 --kernels gemm_in_proj_plain@wgmma \
            gemm_in_proj_plain@wgmmad3 gemm_in_proj_plain@wgmmatiled gemm_in_proj_plain@wgmmatiledd3 \
            gemm_in_proj_plain@wgmma1bn32 gemm_in_proj_plain@wgmma1bn64 gemm_in_proj_plain@wgmma2bn64 \
            gemm_in_proj_plain@wgmmanomma" K3_BENCH_TIMEOUT=110 \
            bash scripts/h200_sweep.sh $cells --budget-s 210 ;;
  # (session 26, after s90q showed the ring without WGMMAs as slow as with them; stage WITHOUT vLLM: 4 parts) the
  # plan's kernel, its diagnostic ring and cublasLt at rank16 b64 under Nsight Compute
  s91)    ncu_sass gemm_in_proj_plain@wgmma wgmmav1 150
          ncu_sass gemm_in_proj_plain@wgmmanomma wgmmanomma 130
          ncu_sass gemm_in_proj_plain@wgmma cublaslt64 110 "--stock 1" ;;
  # written in session 26 after s90q (the ring without WGMMAs as slow as with them: the GEMM's time is not its consumer's):
  # where the fast path's extra ~2.5 us of replay outside its kernels comes from (stage WITHOUT vLLM: 4 parts)
  s90b)   o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          K3_TEST_TIMEOUT=100 bash scripts/h200_tests.sh tests/gpu/test_launch_probe.py || true
          timeout 200 python3 -m k3fast.launch_probe --out "$o" --tag "$K3_TAG" 2>&1 | tail -16 ;;
  # written in session 26 after s90b (the replay's time outside the kernels is the graph launch, ~4 us for any graph):
  # o_proj's fused kernel (oproj_attnres, the fused AttnRes #2) at M 9..16 (fast-opm16) beside stock, the b16 cells
  # (stage with --vllm)
  s90c)   ids=$(for c in 16-16 16-8; do for i in fast-opm16 fast-inwg-opm16; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-$i]"; done; done)
          K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh $ids tests/gpu/test_oproj_attnres.py -k "16" || true
          K3_SWEEP_TIMEOUT=300 K3_BENCH="--shapes k3_rank16 k3_rank8 --batches 16 --kernels oproj_attnres" \
            K3_BENCH_TIMEOUT=60 bash scripts/h200_sweep.sh \
            --cell kda_moe,k3_rank8,16,0,stock+fast+fast-opm16+fast-inwg-opm16 \
            --cell kda_moe,k3_rank16,16,0,stock+fast+fast-opm16+fast-inwg+fast-inwg-opm16 --budget-s 240 ;;
  # written in session 26 after s90c: the in_proj's GEMM on gemm_wgmma_splitk at rank16 M 9..16 (fast.inproj_wide_choice,
  # the default now; fast-inwgoff the A/B) and the plan's co-residency table as s90q measured it (rank8: 29 clusters
  # of 4 x BN 224 instead of 31 x 208): tests, the cells beside stock, the rank8 kernel bench (stage with --vllm)
  s90d)   o=${OUT:-out}; mkdir -p "$o"; timeout 60 python3 -m k3fast.cluster_probe --out "$o" --tag "$K3_TAG" 2>&1 | tail -11
          ids=$(for c in 16-16 16-8 64-16 64-8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-fast]"; done)
          K3_TEST_TIMEOUT=170 bash scripts/h200_tests.sh tests/gpu/test_gemm_wgmma_splitk.py tests/gpu/test_ops.py $ids \
            "tests/gpu/test_fast_layer.py::test_fast_attention_half[64-8-fast-inwg]" || true
          K3_SWEEP_TIMEOUT=300 K3_BENCH="--shapes k3_rank8 --batches 16 64 --kernels gemm_in_proj_plain@wgmma \
            gemm_in_proj_plain@wgmmad3" K3_BENCH_TIMEOUT=60 bash scripts/h200_sweep.sh \
            --cell kda_moe,k3_rank16,16,0,stock+fast+fast-inwgoff --cell kda_moe,k3_rank8,64,0,stock+fast+fast-inwg \
            --cell kda_moe,k3_rank16,64,0,stock+fast --cell kda_moe,k3_rank8,16,0,stock+fast+fast-inwg --budget-s 240 ;;
  # written in session 26 after s91: o_proj's GEMM above M = 8 on gemm_wgmma_splitk (fast-opwg: W requested before its
  # PDL wait, the norm launched after its cluster barrier; -d3 / -d2 smaller rings) beside stock (stage with --vllm)
  s90e)   timeout 60 python3 -c "import torch; from k3fast.gemm_wgmma_splitk import gemm_wgmma as g
x = torch.randn(16, 1536, device='cuda').bfloat16(); w = torch.randn(7168, 1536, device='cuda').bfloat16()
y = g(x, w); torch.cuda.synchronize(); print('smoke: max |y - ref|', (y.float() - x.float() @ w.float().T).abs().max().item())" \
            || { echo "smoke failed"; exit 1; }
          ids=$(for c in 16-16 64-16 16-8 64-8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-fast-opwg]"; done)
          K3_TEST_TIMEOUT=100 bash scripts/h200_tests.sh tests/gpu/test_gemm_wgmma_splitk.py $ids \
            "tests/gpu/test_fast_layer.py::test_fast_attention_half[64-16-fast-opwgd2]" \
            "tests/gpu/test_fast_layer.py::test_fast_attention_half[16-8-fast-opwgd3]" -k "7168-768 or 7168-1536 or opwg" || true
          K3_SWEEP_TIMEOUT=220 bash scripts/h200_sweep.sh \
            --cell kda_moe,k3_rank16,64,0,stock+fast+fast-opwg+fast-opwgd3+fast-opwgd2 \
            --cell kda_moe,k3_rank8,16,0,stock+fast+fast-opwg+fast-opwgd3+fast-opwgd2 \
            --cell kda_moe,k3_rank8,64,0,stock+fast+fast-opwg --cell kda_moe,k3_rank16,16,0,stock+fast+fast-opwg \
            --budget-s 200 ;;
  # (session 26, the last device minutes; stage WITHOUT vLLM) fast against fast-opwg again at the three cells where s90e
  # had it ahead, and rank16 b16 where it was behind: the A/B a default needs (no stock: s90e has the ratios)
  s90f)   K3_SWEEP_TIMEOUT=110 bash scripts/h200_sweep.sh --cell kda_moe,k3_rank16,64,0,fast+fast-opwg \
            --cell kda_moe,k3_rank8,16,0,fast+fast-opwg --cell kda_moe,k3_rank8,64,0,fast+fast-opwg \
            --cell kda_moe,k3_rank16,16,0,fast+fast-opwg --budget-s 95 ;;
  # written in session 26 for the next session (not run; stage with --vllm): rms_gemv v16 (the AttnRes #2 norm reads the
  # earlier layers' blocks before its PDL wait) alone and with o_proj on WGMMA, its bitwise tests, beside stock
  s92)    ids=$(for c in 16-16 64-16 16-8 64-8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-fast-opwg-n2pre]"; done)
          K3_TEST_TIMEOUT=120 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv.py $ids -k "pre_blocks or n2pre" || true
          K3_SWEEP_TIMEOUT=260 bash scripts/h200_sweep.sh \
            --cell kda_moe,k3_rank16,64,0,stock+fast+fast-opwg+fast-opwg-n2pre+fast-n2pre \
            --cell kda_moe,k3_rank8,16,0,stock+fast+fast-n2pre+fast-opwgoff \
            --cell kda_moe,k3_rank8,64,0,stock+fast+fast-n2pre --cell kda_moe,k3_rank16,16,0,stock+fast+fast-n2pre \
            --budget-s 240 ;;
  # session 27: the in_proj's WGMMA GEMM with cuBLAS-like tiles instead of the plan's K split, where at M = 16 the plan
  # streamed W ~12 % slower than cuBLAS (fast-inwg1bn64 / 1bn48 / 2bn96: 99 / 131 / 132 SMs at rank8): GEMM and layer
  # tests, the kernel bench of the tilings at b16 / b64, and the rank8 cells beside stock (stage with --vllm)
  s93)    ids=$(for i in fast-inwg1bn64 fast-inwg1bn48 fast-inwg2bn96; do for c in 16-8 64-8 16-16; do
            echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-$i]"; done; done)
          K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh tests/gpu/test_gemm_wgmma_splitk.py $ids \
            -k "kw11 or kw12 or inwg1bn or inwg2bn" || true
          K3_SWEEP_TIMEOUT=300 K3_BENCH="--shapes k3_rank8 k3_rank16 --batches 16 64 --kernels gemm_in_proj_plain@wgmma \
            gemm_in_proj_plain@wgmma1bn64 gemm_in_proj_plain@wgmma1bn48 gemm_in_proj_plain@wgmma2bn96 \
            gemm_in_proj_plain@wgmma1bn32" K3_BENCH_TIMEOUT=70 bash scripts/h200_sweep.sh \
            --cell kda_moe,k3_rank8,16,0,stock+fast+fast-inwg+fast-inwg1bn64+fast-inwg1bn48+fast-inwg2bn96 \
            --cell kda_moe,k3_rank8,64,0,stock+fast+fast-inwg1bn64+fast-inwg1bn48+fast-inwg2bn96 --budget-s 240 ;;
  # session 27 after s93: gemm_wgmma_splitk v3 (x tiles of the token bucket's rows; fast-inwgx / -opwgx / both): the
  # GEMM's bitwise and reference tests, the layer tests, the kernel bench at b16 / b64 and the b16 cells beside stock
  s94)    ids=$(for i in fast-inwgx fast-opwgx fast-inwgx-opwgx; do for c in 16-8 64-8 16-16 64-16; do
            echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-$i]"; done; done)
          K3_TEST_TIMEOUT=170 bash scripts/h200_tests.sh tests/gpu/test_gemm_wgmma_splitk.py $ids \
            -k "x_rows or kw13 or kw14 or kw15 or inwgx or opwgx" || true
          K3_SWEEP_TIMEOUT=300 K3_BENCH="--shapes k3_rank8 k3_rank16 --batches 16 64 --kernels gemm_in_proj_plain@wgmma \
            gemm_in_proj_plain@wgmmaxa gemm_in_proj_plain@wgmma2bn96 gemm_in_proj_plain@wgmma2bn96xa" \
            K3_BENCH_TIMEOUT=60 bash scripts/h200_sweep.sh \
            --cell kda_moe,k3_rank8,16,0,stock+fast+fast-inwg+fast-inwgx+fast-opwgx+fast-inwgx-opwgx \
            --cell kda_moe,k3_rank16,16,0,stock+fast+fast-inwgx+fast-inwgx-opwgx \
            --cell kda_moe,k3_rank8,16,0,fast+fast-inwgx-opwgx+fast-inwg --budget-s 240 ;;
  # session 27 after s94: the in_proj on v3's 66 clusters of 2 x 96 rows with the bucket's x rows (fast-inwg2bn96x)
  s95)    ids=$(for c in 16-8 64-8 16-16; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-fast-inwg2bn96x]"; done)
          K3_TEST_TIMEOUT=90 bash scripts/h200_tests.sh $ids || true
          K3_SWEEP_TIMEOUT=240 bash scripts/h200_sweep.sh \
            --cell kda_moe,k3_rank8,16,0,stock+fast+fast-inwg2bn96x+fast-inwg+fast-inwg2bn96x \
            --cell kda_moe,k3_rank8,64,0,stock+fast+fast-inwg2bn96x \
            --cell kda_moe,k3_rank16,16,0,stock+fast+fast-inwg2bn96x --budget-s 200 ;;
  # session 27: the new default (the in_proj at rank8 M 9..64 on 2 x 96-row clusters with the bucket's x rows): its
  # layer tests at rank8 and the rank8 cells beside stock, fast-inwgoff the A/B (stage with --vllm)
  s96)    ids=$(for b in 16 64; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-8-fast]"; done)
          K3_TEST_TIMEOUT=90 bash scripts/h200_tests.sh $ids || true
          K3_SWEEP_TIMEOUT=200 bash scripts/h200_sweep.sh --cell kda_moe,k3_rank8,16,0,stock+fast+fast-inwgoff \
            --cell kda_moe,k3_rank8,64,0,stock+fast+fast-inwgoff --cell kda_moe,k3_rank8,8,0,stock+fast --budget-s 170 ;;
  # session 28: the in_proj's WGMMA GEMM placed beside the AttnRes norm's 256 CTAs at b64 (clusters of 2 / 4, or the
  # plan's clusters of 8 with a 4-stage ring), each with o_proj on WGMMA, at rank16 b64 beside stock; the default's
  # 2 x 96 rows with 7 stages at rank8 b64 / b16 (stage with --vllm)
  s97)    ids=$(for i in fast-inwg2bn96x-opwg fast-inwg2bn64x-opwg fast-inwg2bn64xd7-opwg fast-inwg4bn112x-opwg \
                   fast-inwgd4-opwg; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[64-16-$i]"; done
                for b in 16 64; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$b-8-fast-inwg2bn96xd7]"; done)
          K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh $ids || true
          K3_SWEEP_TIMEOUT=300 bash scripts/h200_sweep.sh \
            --cell kda_moe,k3_rank16,64,0,stock+fast+fast-opwg+fast-inwg2bn96x-opwg+fast-inwg2bn64x-opwg+fast-inwg2bn64xd7-opwg+fast-inwg4bn112x-opwg+fast-inwgd4-opwg+fast-opwg \
            --cell kda_moe,k3_rank8,64,0,stock+fast+fast-inwg2bn96xd7+fast \
            --cell kda_moe,k3_rank8,16,0,fast+fast-inwg2bn96xd7 --budget-s 280 ;;
  # session 28: the new default at rank16 M 17..64 (in_proj on 4 x 112-row clusters, o_proj on WGMMA): the GEMM at its
  # pins against fp32 / cuBLAS and v1, the attention half and the torch ops at b16 / b64; beside stock with the A/Bs
  s98)    ids="$(for M in 9 16 33 64 1 8; do echo "tests/gpu/test_gemm_wgmma_splitk.py::test_gemm_wgmma[3216-7168-kw16-$M]"; done)
$(for M in 9 16 17 32 33 64; do echo "tests/gpu/test_gemm_wgmma_splitk.py::test_x_rows_give_the_same_bits[3216-7168-kw4-$M]"; done)
$(for c in 16-16-fast 64-16-fast 64-16-fast-inwgoff-opwgoff 64-8-fast 64-16-fast-normc1; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c]"; done)
tests/gpu/test_ops.py::test_ops_match_the_direct_calls[eager-64-fast]
tests/gpu/test_ops.py::test_ops_match_the_direct_calls[eager-16-fast]"
          K3_TEST_TIMEOUT=200 bash scripts/h200_tests.sh $ids || true
          K3_SWEEP_TIMEOUT=300 bash scripts/h200_sweep.sh \
            --cell kda_moe,k3_rank16,64,0,stock+fast+fast-inwgoff+fast-inwgoff-opwgoff+fast-inwg2bn96x-opwg+fast-normc1+fast \
            --cell kda_moe,k3_rank16,16,0,stock+fast --cell kda_moe,k3_rank16,8,0,fast --budget-s 280 ;;
  # session 28: what the x tiles cost the WGMMA GEMM's ring (diag "nox": W only) at both in_proj widths, b64 / b16
  s99)    o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 150 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 64 16 \
            --kernels gemm_in_proj_plain@wgmma gemm_in_proj_plain@wgmmanox gemm_in_proj_plain@wgmmanomma \
            gemm_in_proj_plain@wgmma4bn112 gemm_in_proj_plain@wgmma4bn112nox gemm_in_proj_plain@wgmma4bn112nomma \
            gemm_in_proj_plain@wgmma2bn96xa gemm_in_proj_plain@wgmma2bn96nox > "$o/bench.log" 2>&1
          grep -o '"kernel": "[^"]*", "shape": "[^"]*", "batch": [0-9]*\|"fast_us_median": [0-9.]*\|"stock_us_median": [0-9.]*' "$o/bench.log" | paste - - - ;;
  # session 28: the KDA step's state copies before its PDL wait (v9.1, "fast-s24kda") now that the in_proj's WGMMA GEMM
  # launches it ~1.5 us before its own end at b64 (rank16 and rank8), beside stock and a second default cell
  s100)   ids=$(for c in 64-16 64-8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-fast-s24kda]"; done)
          K3_TEST_TIMEOUT=120 bash scripts/h200_tests.sh $ids || true
          K3_SWEEP_TIMEOUT=240 bash scripts/h200_sweep.sh \
            --cell kda_moe,k3_rank16,64,0,stock+fast+fast-s24kda+fast+fast-s24kda \
            --cell kda_moe,k3_rank8,64,0,stock+fast+fast-s24kda --budget-s 220 ;;
  # session 28, last: the defaults beside stock at the session's final commit (rank16 b64 three times)
  s101)   K3_SWEEP_TIMEOUT=240 bash scripts/h200_sweep.sh \
            --cell kda_moe,k3_rank16,64,0,stock+fast+fast+fast --cell kda_moe,k3_rank16,16,0,stock+fast \
            --cell kda_moe,k3_rank8,64,0,stock+fast --budget-s 220 ;;
  # session 28: the AttnRes #2 norm as clusters of 2 / 8 CTAs per token after o_proj's clusters of 4 (fast-n2c2 / -n2c8)
  s102)   ids=$(for c in 64-16-fast-n2c2 64-16-fast-n2c8 64-8-fast-n2c2; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c]"; done)
          K3_TEST_TIMEOUT=120 bash scripts/h200_tests.sh $ids || true
          K3_SWEEP_TIMEOUT=240 bash scripts/h200_sweep.sh \
            --cell kda_moe,k3_rank16,64,0,stock+fast+fast-n2c2+fast-n2c8+fast+fast-n2c2 \
            --cell kda_moe,k3_rank8,64,0,fast+fast-n2c2 --cell kda_moe,k3_rank8,16,0,fast+fast-n2c2 --budget-s 200 ;;
  # session 29: gemm_wgmma_splitk v4, W's tiles by 1-D bulk copies of a pre-swizzled tiled copy (the same bits as the
  # tensor map), its tests and the bare GEMM beside the TMA builds at both in_proj widths; s103b: the layer A/B
  s103)   ids="$(for k in 3216-7168-kw0 3216-7168-kw1 6288-7168-kw2 1000-1024-kw3 7168-768-kw4 3216-7168-kw5; do
                   for M in 9 17 64; do echo "tests/gpu/test_gemm_wgmma_splitk.py::test_bulk_weight_gives_the_same_bits[$k-$M]"; done; done)
$(for c in 64-16 64-8 16-16 16-8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-fast-inwgbulk]"; done)"
          K3_TEST_TIMEOUT=240 bash scripts/h200_tests.sh $ids || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 170 python3 -m k3fast.bench --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 --batches 64 16 \
            --kernels gemm_in_proj_plain@wgmma4bn112 gemm_in_proj_plain@wgmmabulk4bn112 gemm_in_proj_plain@wgmmabulk4bn112xa \
            gemm_in_proj_plain@wgmma4bn112nox gemm_in_proj_plain@wgmmabulk4bn112nox gemm_in_proj_plain@wgmma2bn96xa \
            gemm_in_proj_plain@wgmmabulk2bn96xa gemm_in_proj_plain@wgmma2bn96nox gemm_in_proj_plain@wgmmabulk2bn96nox \
            gemm_in_proj_plain@wgmma gemm_in_proj_plain@wgmmabulk > "$o/bench.log" 2>&1
          grep -o '"kernel": "[^"]*", "shape": "[^"]*", "batch": [0-9]*\|"fast_us_median": [0-9.]*\|"stock_us_median": [0-9.]*' "$o/bench.log" | paste - - - ;;
  s103b)  K3_SWEEP_TIMEOUT=250 bash scripts/h200_sweep.sh \
            --cell kda_moe,k3_rank16,64,0,stock+fast+fast-inwgbulk+fast+fast-inwgbulk \
            --cell kda_moe,k3_rank8,64,0,fast+fast-inwgbulk --cell kda_moe,k3_rank8,16,0,fast+fast-inwgbulk --budget-s 230 ;;
  # session 30, at the session's final code: today's defaults beside stock in one run at every rank16 / rank8 batch
  # of the issues' sweeps (s104), the default path's GPU tests and the full-width cells (s104b), the skewed routing
  # at rank16 b1 / b8 / b64 and rank8 b64 (what the device budget left), with experts v5 (single passes as work
  # items) as the A/B (s104c) (stage with --vllm)
  s104)   cells=""; for b in 1 2 4 8 16 64; do for s in k3_rank16 k3_rank8; do
                      cells="$cells --cell kda_moe,$s,$b,0,stock+fast"; done; done
          K3_SWEEP_TIMEOUT=420 bash scripts/h200_sweep.sh $cells --budget-s 380 ;;
  s104b)  ids=$(for c in 1-16 1-8 2-16 2-8 3-16 4-8 7-16 8-8 16-16 16-8 64-16 64-8; do
                  echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-fast]"; done
                for b in 1 3 8 17 64; do echo "tests/gpu/test_fast_layer.py::test_fast_moe_half_same_input[$b-fast]"; done
                for b in 1 2 4 64; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half_at_a_block_boundary[fast-$b]"; done)
          K3_TEST_TIMEOUT=230 bash scripts/h200_tests.sh $ids tests/gpu/test_fast_layer.py::test_fast_layer_graph_replay_is_stable \
            tests/gpu/test_ops.py || true
          cells=""; for b in 1 8 64; do cells="$cells --cell kda_moe,full,$b,0,stock+fast"; done
          K3_SWEEP_TIMEOUT=260 bash scripts/h200_sweep.sh $cells --budget-s 220 ;;
  s104c)  cells=""; for c in k3_rank16,64 k3_rank16,8 k3_rank16,1 k3_rank8,64; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-v5"; done
          K3_SWEEP_TIMEOUT=${K3_SWEEP_TIMEOUT:-190} bash scripts/h200_sweep.sh $cells --routing skewed \
            --budget-s ${K3_BUDGET_S:-150} ;;
  # s105 / s105b: issue 5's skewed routing (--routing skewed) on every issue cell, stock beside fast and fast-v5
  s105)   cells=""; for c in k3_rank16,64 k3_rank16,8 k3_rank16,1 k3_rank8,64 k3_rank8,8 k3_rank8,1; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-v5"; done
          K3_SWEEP_TIMEOUT=${K3_SWEEP_TIMEOUT:-470} bash scripts/h200_sweep.sh $cells --routing skewed \
            --budget-s ${K3_BUDGET_S:-430} ;;
  s105b)  cells=""; for b in 64 8 1; do cells="$cells --cell kda_moe,full,$b,0,stock+fast+fast-v5"; done
          K3_SWEEP_TIMEOUT=${K3_SWEEP_TIMEOUT:-400} bash scripts/h200_sweep.sh $cells --routing skewed \
            --budget-s ${K3_BUDGET_S:-360} ;;
  # s106 / s106b: experts v5 as the default above batch bucket 2 ("fast-s13" keeps v4 there) at b64, and v7 at
  # bucket 8 (two parts of I, "fast-v7") at b8; skewed (s106), then uniform (s106b, after the GPU tests of both)
  # beside stock in one run per step
  s106)   cells=""; for c in k3_rank16,64 k3_rank8,64 full,64; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-s13"; done
          for c in full,8 k3_rank16,8 k3_rank8,8; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-v7"; done
          K3_SWEEP_TIMEOUT=${K3_SWEEP_TIMEOUT:-420} bash scripts/h200_sweep.sh $cells --routing skewed \
            --budget-s ${K3_BUDGET_S:-380} ;;
  s106b)  t=tests/gpu/test_moe_mxfp4_experts.py; f=tests/gpu/test_fast_layer.py
          K3_TEST_TIMEOUT=260 bash scripts/h200_tests.sh $t::test_v7_matches_v4_and_reference \
            $t::test_v5_matches_v4_and_reference $t::test_matches_reference $t::test_cuda_graph_replay_new_routing \
            $t::test_split_versions_fall_back_above_batch_2_and_replay $t::test_ring_fit_is_bit_identical \
            "$f::test_fast_moe_half_same_input[8-fast]" "$f::test_fast_moe_half_same_input[64-fast]" \
            "$f::test_fast_moe_half_same_input[8-fast-v7]" \
            $f::test_fast_layer_graph_replay_is_stable || true
          cells=""; for c in k3_rank16,64 k3_rank8,64; do
                      cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-s13"; done
          for c in k3_rank16,8 k3_rank8,8 full,8; do cells="$cells --cell kda_moe,${c%,*},${c#*,},0,stock+fast+fast-v7"; done
          K3_SWEEP_TIMEOUT=${K3_SWEEP_TIMEOUT:-250} bash scripts/h200_sweep.sh $cells --budget-s ${K3_BUDGET_S:-210} ;;
  # s106c: is v5's +2.8 % at uniform rank8 b64 (s106b, H100) real? The two uniform b64 cells again, v5 beside v4
  s106c)  cells=""; for s in k3_rank8 k3_rank16; do cells="$cells --cell kda_moe,$s,64,0,stock+fast+fast-s13"; done
          K3_SWEEP_TIMEOUT=${K3_SWEEP_TIMEOUT:-170} bash scripts/h200_sweep.sh $cells --budget-s ${K3_BUDGET_S:-140} ;;
  # s107: v5.1 (pass offsets packed into act_e: v5's shared memory is v4's again) and the carve-out question behind
  # it: the GPU tests (v5.1 bit-identical to v4), the kernel bench with shared-memory pads that move a key to a
  # larger carve-out (less L1), then the two uniform b64 cells in the layer, v5.1 beside v4 and stock
  s107)   t=tests/gpu/test_moe_mxfp4_experts.py; f=tests/gpu/test_fast_layer.py
          K3_TEST_TIMEOUT=150 bash scripts/h200_tests.sh $t::test_v5_matches_v4_and_reference \
            "$f::test_fast_moe_half_same_input[64-fast]" || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          timeout 150 python3 -m k3fast.bench_experts --out "$o" --tag "$K3_TAG" --shapes k3_rank8 k3_rank16 \
            --batches 64 --variants default v4 pad4 v4pad4 pad24 probe pad24probe --replays 50 \
            > "$o/experts.log" 2>&1; grep -v -i warn "$o/experts.log" | tail -20
          cells=""; for s in k3_rank8 k3_rank16; do cells="$cells --cell kda_moe,$s,64,0,stock+fast+fast-s13"; done
          K3_SWEEP_TIMEOUT=${K3_SWEEP_TIMEOUT:-170} bash scripts/h200_sweep.sh $cells --budget-s ${K3_BUDGET_S:-140} ;;
  # s107b: the skewed b8 cells' idle clusters (24 items on 66 clusters of 2): clusters of 4 over 30 (all co-resident)
  # or 33 clusters, and v7's halves, beside the default on the skewed and the uniform routing (kernel bench only)
  s107b)  o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          for r in skewed uniform; do
            timeout 170 python3 -m k3fast.bench_experts --out "$o" --tag "$K3_TAG" --shapes full \
              --batches 8 --variants default C4 C4N120 v7 --replays 50 --routing $r > "$o/experts-$r.log" 2>&1
            grep -v -i warn "$o/experts-$r.log" | tail -10; done ;;
  # s107c: s107b cut to what a small device budget holds: rank16 and rank8 b8 (cheap set-up, no vLLM staging: no
  # Marlin row), clusters of 4 over 30 co-resident clusters against v7's halves, skewed and uniform
  s107c)  o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          for r in skewed uniform; do
            timeout 110 python3 -m k3fast.bench_experts --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 \
              --batches 8 --variants default C4N120 v7 --replays 50 --routing $r > "$o/experts-$r.log" 2>&1
            grep -v -i warn "$o/experts-$r.log" | tail -8; done ;;
  # s108: experts v5.2 (v7's items chosen on the device when the passes are few; the default at buckets 4 / 8): its
  # GPU tests, then the kernel bench at b4 / b8 beside v5.1 (A0) and v7, skewed and uniform (full width in its own
  # process: rank16 / rank8 / full in one ran out of an H100's memory in s107d)
  s108)   t=tests/gpu/test_moe_mxfp4_experts.py
          K3_TEST_TIMEOUT=170 bash scripts/h200_tests.sh $t::test_v52_is_v7_when_the_passes_are_few_else_v51 \
            $t::test_v52_one_graph_takes_both_branches $t::test_v5_matches_v4_and_reference || true
          o=${OUT:-out}; mkdir -p "$o"; export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=sm_90a
          for r in skewed uniform; do
            timeout 100 python3 -m k3fast.bench_experts --out "$o" --tag "$K3_TAG" --shapes k3_rank16 k3_rank8 \
              --batches 4 8 --variants default A0 v7 --replays 50 --routing $r > "$o/experts-$r.log" 2>&1
            grep -v -i warn "$o/experts-$r.log" | tail -13; done
          for r in skewed uniform; do
            timeout 90 python3 -m k3fast.bench_experts --out "$o" --tag "$K3_TAG-full" --shapes full \
              --batches 8 --variants default A0 v7 --replays 50 --routing $r > "$o/experts-full-$r.log" 2>&1
            grep -v -i warn "$o/experts-full-$r.log" | tail -5; done ;;
  # s108b: v5.2 in the layer: the MoE half at b8, skewed and uniform, stock / fast (v5.2) / fast-v51 in one run each
  s108b)  cells=""; for s in k3_rank16 k3_rank8 full; do cells="$cells --cell kda_moe,$s,8,0,stock+fast+fast-v51"; done
          K3_SWEEP_TIMEOUT=${K3_SWEEP_TIMEOUT:-250} bash scripts/h200_sweep.sh $cells --routing skewed \
            --budget-s ${K3_BUDGET_S:-220}
          mv "${OUT:-out}/sweep.log" "${OUT:-out}/sweep-skewed.log" 2>/dev/null
          cells=""; for s in k3_rank16 k3_rank8; do cells="$cells --cell kda_moe,$s,8,0,stock+fast+fast-v51"; done
          K3_TAG="$K3_TAG-uniform" K3_SWEEP_TIMEOUT=150 bash scripts/h200_sweep.sh $cells --budget-s 120 ;;
  # s109: rank16 b8 uniform's +4 % under v5.2 (s108): v5.1 with v5.2's shared memory (A0pad8: 66,592 + 8,192 B,
  # v5.2 asks for 74,768) beside A0 and the default, uniform then skewed; then full width b8 in the layer, skewed
  # and uniform, stock / fast / fast-v51 (s108 had no room for it). <= 8 files come back: the bench logs are packed
  s109)   a0pad8_bench 100; o=${OUT:-out}
          K3_SWEEP_TIMEOUT=230 bash scripts/h200_sweep.sh --cell kda_moe,full,8,0,stock+fast+fast-v51 --routing skewed \
            --budget-s 200
          mv "$o/sweep.log" "$o/sweep-skewed.log"
          K3_TAG="$K3_TAG-uniform" K3_SWEEP_TIMEOUT=200 bash scripts/h200_sweep.sh \
            --cell kda_moe,full,8,0,stock+fast+fast-v51 --budget-s 170 ;;
  # s110a / s110b: the closing sweep at the current defaults, every issue-4 / issue-5 cell (rank16, rank8, full x
  # b1 / b8 / b64) stock beside fast in one run per routing, fast-v51 beside them at b8; s110a first runs s109's
  # experts bench (A0pad8: is rank16 b8's +4 % the shared memory?); s110b adds the layer-level GPU parity of fast.
  s110a)  a0pad8_bench 90
          K3_SWEEP_TIMEOUT=330 bash scripts/h200_sweep.sh $(s110_cells) --budget-s 300 ;;
  s110b)  ids=$(for c in 1-16 1-8 8-16 8-8 64-16 64-8; do echo "tests/gpu/test_fast_layer.py::test_fast_attention_half[$c-fast]"; done
                for b in 1 3 8 17 64; do echo "tests/gpu/test_fast_layer.py::test_fast_moe_half_same_input[$b-fast]"; done)
          K3_TEST_TIMEOUT=170 bash scripts/h200_tests.sh $ids tests/gpu/test_fast_layer.py::test_fast_layer_graph_replay_is_stable \
            tests/gpu/test_fast_layer.py::test_fast_layer_full_width_b1 || true
          K3_SWEEP_TIMEOUT=360 bash scripts/h200_sweep.sh $(s110_cells) --routing skewed --budget-s 330 ;;
  # s111: the closing GPU check at the code that closes issues 4 / 5: every per-kernel file of tests1, and the
  # default path's attention half at b1 / 2 / 3 / 4 / 7 / 8 / 16 / 64 x rank16 / rank8 (and at a block boundary, full
  # width b8), the MoE half on the same input, the graph replay and the full-width layer (3 files come back)
  s111)   ids=$(python3 -m pytest -m gpu --collect-only -q tests/gpu/test_fast_layer.py 2>/dev/null \
                | grep -E '^tests/.*(\[([^]]*-)?fast(-[0-9]+)?\]|_is_stable|_full_width_b1\[full\])$')
          K3_TEST_TIMEOUT=470 bash scripts/h200_tests.sh tests/gpu/test_rms_gemv.py tests/gpu/test_gemv_splitk.py \
            tests/gpu/test_oproj_attnres.py tests/gpu/test_kda_conv_gate_step.py tests/gpu/test_router_down_topk.py \
            tests/gpu/test_moe_tail.py $ids ;;
  s86smoke) timeout 60 python3 -c "import torch; from k3fast.gemm_wgmma_splitk import gemm_wgmma as g
x = torch.randn(64, 7168, device='cuda').bfloat16(); w = torch.randn(3216, 7168, device='cuda').bfloat16()
y = g(x, w); torch.cuda.synchronize(); print('smoke: max |y - ref|', (y.float() - x.float() @ w.float().T).abs().max().item())" \
            || { echo "smoke failed: gemm_wgmma did not finish"; exit 1; } ;;
  *) echo "usage: K3_COMMIT=<commit> bash scripts/h200_next.sh tests|tests1|tests2|changed|changed5|kda|skewed|mla|cellsA|cellsB|cellsC|cellsD|cellsF|rot|rotperf|tests1x|kdaall|s5tests|s5perf|s5fix|s6tests|s6perf|s7tests|s7perf|kdaall2|s8|s9tests|s9perf|s10tests|s10perf|s11|rank8x|s12|s13|s14|s15|s16|s17|ncu1|s18|s19|ncu2|s20|s20b|s21|s21b|ncu3|s22|ncu4|s23|s24|s25|s26|s27|s27t|s28|s29|s29t|s30|s31|s32|s33|s34|s35|s38|s38t|s39|s40|s40t|s41|s42|s43|ncu5|s44|ncu6|s45|ncu7|s46|s47|s48|s49|s50|ncu8|s51|s51b|s52|s52b|s53|s54|s55|s56|ncu9|ncu10|s57|s58|s59|s60|s61|s62|s63|s64|s65|s66|s67|s68|s69|s70|s71|s72|s73|s74|s75|s76|s77|s78|s79|s80|s81|s82|s83|s84|s85|s86|s86smoke|s87|s88|s89|s90q|s90|s91|s90b|s90c|s90d|s90e|s90f|s92|s93|s94|s95|s96|s97|s98|s99|s100|s101|s102|s103|s103b|s104|s104b|s104c|s105|s105b|s106|s106b|s106c|s107|s107b|s107c|s108|s108b|s109|s110a|s110b|s111"; exit 2 ;;
esac
