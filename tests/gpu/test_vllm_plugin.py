"""The plug-in inside a real vLLM 0.33 engine (GPU, vLLM installed): a 4-layer Kimi K3 at TP16-rank shapes with the
k3-random weights, run by k3fast.measure.vllm_e2e in its own process (an engine per process).

* layer parity: in eager decode steps at batch 1 and 8, each fused KDA layer against vLLM's own layer on the same
  inputs and state rows (the tool's --probe): the partial sum after the attention half, the KDA state rows, the block
  rows, the layer output;
* fidelity: k3ref teacher-forced on the engine's greedy tokens. At depth 4 arithmetic alone does not move k3ref's
  greedy choice (traces/cpu/k3ref-precision-depth.json), so the engine's tokens must be k3ref's.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tolerances import TOLERANCES

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM 0.33 ([vllm] extra)")]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "small.json"
    cmd = [sys.executable, "-m", "k3fast.measure.vllm_e2e", "run", "--engine", "k3fast", "--depth", "4", "--batches",
           "1", "8", "--parity", "--fidelity", "--probe", "--util", "0.5", "--steps", "4", "--repeats", "1",
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.load(open(out))["records"]


def test_fused_layers_match_vllms_own_layers(small_run):
    probe = next(r for r in small_run if r["kind"] == "vllm_layer_parity")
    assert probe["all_finite"] and probe["samples"] >= 2 * 3        # 3 KDA layers, steps at batch 1 and 8
    bounds = {"partial": TOLERANCES["bf16_layer"][1], "layer_out": TOLERANCES["bf16_layer"][1],
              "blocks": TOLERANCES["bf16_layer"][1], "rec_state": TOLERANCES["vllm_layer_state"][1],
              "conv_state": TOLERANCES["vllm_layer_state"][1]}
    for row in probe["rows"]:
        for key, bound in bounds.items():
            assert row[key] <= bound, f"layer {row['layer']} rows {row['rows']}: {key} {row[key]:.2e} > {bound}"


def test_greedy_tokens_follow_k3ref(small_run):
    fid = next(r for r in small_run if r["kind"] == "vllm_parity")["fidelity"]
    assert "error" not in fid, fid
    assert fid["first_disagreement"] is None or fid["first_disagreement"] >= 16, fid
    assert fid["median_abs_dlogprob"] < 0.1, fid
