"""One naming scheme for the stages of a layer, emitted as NVTX ranges (Nsight Systems) and as
torch.profiler ``record_function`` ranges (Perfetto / Chrome traces), so every implementation's trace
lines up stage by stage with the others and with the bytes model (k3ref.bytes).

    k3.layer
      k3.attn_res          AttnRes #1 + input RMSNorm
      k3.kda.in_proj       q, k, v, g, f_a, b projections       | k3.mla.in_proj, k3.mla.q_b
      k3.kda.core          conv, gates, delta rule, gated norm  | k3.mla.core
      k3.o_proj
      k3.attn_res_mlp      partial-sum update, AttnRes #2 + post-attention RMSNorm
      k3.router            router logits + top-k
      k3.moe.down          latent down-projection
      k3.moe.experts       routed experts + combine
      k3.moe.up            routed_expert_norm + latent up-projection (+ the final add)
      k3.moe.shared        shared experts
      (k3.mlp.dense        layer 0)

A fused kernel that spans several stages is recorded under the range it is launched in; its name
says which stages it replaces.
"""
from __future__ import annotations

import contextlib

import torch

STAGES = ("k3.attn_res", "k3.kda.in_proj", "k3.kda.core", "k3.mla.in_proj", "k3.mla.q_b", "k3.mla.core",
          "k3.o_proj", "k3.attn_res_mlp", "k3.router", "k3.moe.down", "k3.moe.experts", "k3.moe.up",
          "k3.moe.shared", "k3.mlp.dense")
PARTS = ("k3.layer", "k3.attn", "k3.moe")


@contextlib.contextmanager
def stage(name: str):
    """An NVTX range plus a profiler range of the same name. Free when neither tool is listening."""
    if name not in STAGES and name not in PARTS:
        raise ValueError(f"unknown stage {name!r}; stages are {STAGES}")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if cuda:
            torch.cuda.nvtx.range_pop()
