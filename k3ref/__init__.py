"""k3ref: a readable pure-PyTorch reference of one Kimi K3 decoder layer (CPU-runnable, no kernels).

The executable specification that every fused kernel, trace and the vLLM plug-in are tested
against. Section numbers in docstrings refer to ``docs/k3-layer.md`` (the project's layer specification).
"""
from .attnres import ResidualStream
from .config import K3Config, k3, k3_rank, mini, preset, tiny
from .layer import K3DecoderLayer
from .precision import Precision
from .state import KDAState, MLACache, allocate_state
from .weights import LayerWeights, random_layer

__all__ = ["K3Config", "k3", "k3_rank", "tiny", "mini", "preset", "Precision", "K3DecoderLayer", "ResidualStream",
           "KDAState", "MLACache", "allocate_state", "LayerWeights", "random_layer"]
