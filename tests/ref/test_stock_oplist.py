"""The stock peer's declared launches against the kernels vLLM's own layer launched inside a vLLM 0.33 engine
(recorded on an H100), so that the peer cannot drift from vLLM silently (CPU: reads the record, runs nothing)."""
import collections
import json
import os

import pytest

from k3fast.measure.nbtools import INDEX
from k3fast.stock.vllm_ops import KERNELS_VLLM_LAYER_B1, KERNELS_VLLM_LAYER_MLA_B1

pytestmark = pytest.mark.ref
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _recorded_b1(kind: str = "kda_moe") -> list[str]:
    recs = json.load(open(os.path.join(ROOT, INDEX["vllm_e2e"])))["records"]
    rec = next(r for r in recs if r.get("kind") == "vllm_e2e" and r["engine"] == "stock" and r["batch"] == 1)
    return list(rec["per_layer"][kind]["kernel_names"])


def _recorded_kda_moe_b1() -> list[str]:
    return _recorded_b1("kda_moe")


def _kind(name: str, table=KERNELS_VLLM_LAYER_B1) -> str:
    """The declared prefix a recorded kernel name starts with (the longest, so nvjet and CuTe names resolve)."""
    declared = {k for ks in table.values() for k in ks if not k.startswith("harness:")}
    hits = [k for k in declared if name.startswith(k)]
    assert hits, f"vLLM's layer launched {name!r}, which the vllm-layer stock variant does not declare"
    return max(hits, key=len)


def test_vllm_layer_variant_declares_exactly_what_vllms_layer_launched():
    """Same kernels, same counts: the attention half up to the second AttnRes, the MoE half after it. The order
    inside the MoE half differs (vLLM launches the shared experts before the top-k); the count of each does not."""
    got = _recorded_kda_moe_b1()
    second = [i for i, n in enumerate(got) if n.startswith("_attn_res_kernel")][1]
    halves = {"attn": got[:second + 1], "moe": got[second + 1:]}
    for part, names in halves.items():
        want = [k for k in KERNELS_VLLM_LAYER_B1[part] if not k.startswith("harness:")]
        assert collections.Counter(map(_kind, names)) == collections.Counter(want), part
    harness = [k for ks in KERNELS_VLLM_LAYER_B1.values() for k in ks if k.startswith("harness:")]
    assert len(harness) == 1, "each harness-only launch is named and counted"


def test_vllm_layer_variant_declares_vllms_mla_layer():
    """The MLA+MoE layer likewise: the attention half (FA3's split-KV decode and combine, K3's fused query concat and
    cache insert, the W_UK / W_UV bmms) up to the second AttnRes, then the MoE half; no harness-only launch (the
    paging metadata belongs to the step)."""
    got = _recorded_b1("mla_moe")
    second = [i for i, n in enumerate(got) if n.startswith("_attn_res_kernel")][1]
    halves = {"attn": got[:second + 1], "moe": got[second + 1:]}
    for part, names in halves.items():
        want = KERNELS_VLLM_LAYER_MLA_B1[part]
        kinds = [_kind(n, KERNELS_VLLM_LAYER_MLA_B1) for n in names]
        assert collections.Counter(kinds) == collections.Counter(want), part
    assert not any(k.startswith("harness:") for ks in KERNELS_VLLM_LAYER_MLA_B1.values() for k in ks)


def test_profiled_stock_layer_launches_the_declared_kernels_in_order():
    """The nsight-python profile of the stock KDA+MoE layer (rank16, batch 1, on a GPU) names, half by half and in
    launch order, the kernels the vllm-layer variant declares (Nsight Compute drops the "void ns::" of a name; the
    harness's slot clamp is torch's elementwise kernel)."""
    from k3fast.measure.profile import load_profile
    rec = load_profile(os.path.join(ROOT, INDEX["profile"]))
    assert rec["environment"]["stock_variant"] == "vllm-layer"
    cell = next(c for c in rec["cells"] if c["shape"] == "k3_rank16" and c["batch"] == 1)
    for half in cell["halves"]:
        if half["impl"] != "stock":
            continue
        declared = KERNELS_VLLM_LAYER_B1[half["part"]]
        got = [k["name"] for k in half["kernels"]]
        assert len(got) == len(declared), (half["part"], got)
        for name, want in zip(got, declared):
            base = "vectorized_elementwise_kernel" if want.startswith("harness:") else \
                want.removeprefix("void ").split("::")[-1]
            assert name.startswith(base), (half["part"], name, want)


def _recorded_tp8_b1(kind: str) -> list[str]:
    path = next(p for p in INDEX["vllm_layers_h100"] if p.endswith("k3_rank8.json"))
    recs = json.load(open(os.path.join(ROOT, path)))["records"]
    rec = next(r for r in recs if r.get("kind") == "vllm_e2e" and r["engine"] == "stock" and r["batch"] == 1)
    assert rec["model"]["shape"] == "k3_rank8"
    return list(rec["per_layer"][kind]["kernel_names"])


@pytest.mark.parametrize("kind,table", [("kda_moe", "KERNELS_VLLM_LAYER_TP8_B1"),
                                        ("mla_moe", "KERNELS_VLLM_LAYER_MLA_TP8_B1")])
def test_vllm_layer_variant_declares_vllms_tp8_layer(kind, table):
    """At a TP8 rank vLLM's layer differs from TP16's (its native fused KDA decode at 12 heads; more projections on
    K3's low-latency table): the TP8 lists declare what its engine launched, half by half, same kernels and counts."""
    from k3fast.stock import vllm_ops
    declared = getattr(vllm_ops, table)
    got = _recorded_tp8_b1(kind)
    second = [i for i, n in enumerate(got) if n.startswith("_attn_res_kernel")][1]
    halves = {"attn": got[:second + 1], "moe": got[second + 1:]}
    for part, names in halves.items():
        kinds = [_kind(n, declared) for n in names]
        assert collections.Counter(kinds) == collections.Counter(declared[part]), part
