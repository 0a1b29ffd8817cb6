"""The ``k3-random`` load format: Kimi K3 weights drawn at realistic scales, for benchmarks and parity runs without
a checkpoint.

vLLM's ``dummy`` format draws every bf16 weight from U(-1e-3, 1e-3). For K3 that makes routing meaningless: router
logits are ~1e-3, sigmoid scores tie, and top-16 falls to the score-correction bias. This loader loads exactly
``k3ref.model.random_model(cfg, seed)`` (projections ~ N(0, 1/in), norms ~ 1, AttnRes pseudo-queries that make the
block mixture non-uniform, MXFP4 experts with RMS ~ 1/sqrt(in)), so the engine routes tokens the way a trained model
spreads them, and k3ref can rebuild the same weights from (config, seed) to check what vLLM computes.

    LLM(model=DIR_WITH_CONFIG_JSON, load_format="k3-random", model_loader_extra_config={"seed": 0}, ...)
"""
from __future__ import annotations

import dataclasses

import torch
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

from k3ref.model import GLOBAL, K3ModelWeights, random_globals
from k3ref.weights import MoEWeights, layer_to_checkpoint, random_layer


class K3RandomLoader(BaseModelLoader):
    def __init__(self, load_config):
        super().__init__(load_config)
        extra = dict(load_config.model_loader_extra_config or {})
        unknown = sorted(set(extra) - {"seed"})
        if unknown:
            raise ValueError(f"load format k3-random: unknown model_loader_extra_config keys {unknown} (known: seed)")
        self.seed = int(extra.get("seed", 0))

    def download_model(self, model_config) -> None:
        pass

    @torch.no_grad()
    def load_weights(self, model, model_config) -> None:
        from .weights import k3_config, routed_experts
        cfg = k3_config(model_config.hf_text_config)
        lm = model.get_language_model() if hasattr(model, "get_language_model") else model
        # what no checkpoint name reaches (the in_proj's padding rows) keeps vLLM's dummy values, never garbage
        for name, p in lm.named_parameters():
            initialize_single_dummy_weight(p, name=name)
        strip = lambda names: ((n[len(GLOBAL):] if n.startswith(GLOBAL) else n, t) for n, t in names.items())
        glob = random_globals(cfg, seed=self.seed, device="cuda")
        lm.load_weights(strip(K3ModelWeights.to_checkpoint(glob, cfg)))
        for layer in lm.model.layers:
            w = random_layer(cfg, layer.layer_idx, seed=self.seed, device="cuda")
            m = w.mlp
            if isinstance(m, MoEWeights):
                # the experts straight into vLLM's stacked parameters ([w1; w3], as its loader stacks them): one copy
                # per tensor instead of 6 x 896 per-expert loader calls
                ex = routed_experts(layer.block_sparse_moe)
                I = m.w1_packed.shape[1]
                ex.w13_weight_packed[:, :I].copy_(m.w1_packed)
                ex.w13_weight_packed[:, I:].copy_(m.w3_packed)
                ex.w13_weight_scale[:, :I].copy_(m.w1_scale)
                ex.w13_weight_scale[:, I:].copy_(m.w3_scale)
                ex.w2_weight_packed.copy_(m.w2_packed)
                ex.w2_weight_scale.copy_(m.w2_scale)
                none = m.w1_packed[:0]          # no per-expert checkpoint names below
                w.mlp = dataclasses.replace(m, w1_packed=none, w1_scale=none, w3_packed=none, w3_scale=none,
                                            w2_packed=none, w2_scale=none)
            lm.load_weights(strip(layer_to_checkpoint(w, cfg)))
