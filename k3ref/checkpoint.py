"""HF-format safetensors checkpoints of K3 layers: write random ones, read real or random ones.

Tensor names, shapes and dtypes are the released checkpoint's (docs/k3-layer.md §12), experts one
tensor per expert, packed MXFP4 as uint8. A file that does not match raises ONE CheckpointError
listing every problem.
"""
from __future__ import annotations

import os

import torch

from .config import K3Config
from .weights import LayerWeights, layer_from_checkpoint, layer_to_checkpoint, random_layer


def save_layers(path: str, layers: list[LayerWeights], cfg: K3Config) -> None:
    from safetensors.torch import save_file
    tensors = {}
    for w in layers:
        tensors.update({k: v.contiguous().cpu() for k, v in layer_to_checkpoint(w, cfg).items()})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(tensors, path, metadata={"format": "pt", "k3lab_config": cfg.name})


def load_tensors(path: str) -> dict[str, torch.Tensor]:
    """All tensors of one .safetensors file, or of every shard in a directory."""
    from safetensors.torch import load_file
    if os.path.isdir(path):
        out = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                out.update(load_file(os.path.join(path, f)))
        return out
    return load_file(path)


def load_layer(path: str, cfg: K3Config, layer: int, device="cpu") -> LayerWeights:
    """One full-width layer from a checkpoint (file or shard directory), validated."""
    return layer_from_checkpoint(load_tensors(path), cfg, layer).to(device)


def write_random_checkpoint(path: str, cfg: K3Config, layers, seed: int = 0) -> None:
    """A checkpoint of random layers with realistic scales, so tests and notebooks need no download."""
    save_layers(path, [random_layer(cfg, l, seed=seed) for l in layers], cfg)


def save_model(path: str, w, cfg: K3Config) -> None:
    """A whole model (k3ref.model.K3ModelWeights) as one HF-format safetensors file."""
    from safetensors.torch import save_file
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in w.to_checkpoint(cfg).items()}, path,
              metadata={"format": "pt", "k3lab_config": cfg.name})


def load_model(path: str, cfg: K3Config, device="cpu"):
    """A whole model from a checkpoint file or shard directory, validated (one error lists every problem)."""
    from .model import model_from_checkpoint
    w = model_from_checkpoint(load_tensors(path), cfg)
    from .weights import _map
    return _map(w, lambda t: t.to(device))
