"""k3fast inside vLLM 0.33: an out-of-tree plug-in that decodes Kimi K3 with the fused layer.

Installed with the ``[vllm]`` extra, vLLM loads ``register`` through the ``vllm.general_plugins`` entry point in
every process. Nothing changes until an engine asks for it with ``additional_config={"k3fast": {...}}``
(options: k3fast.vllm.config). ``register`` is idempotent, imports no vLLM model code and initialises no CUDA.
"""
from __future__ import annotations

ARCHITECTURE = "KimiLinearForCausalLM"
MODEL_CLASS = "k3fast.vllm.model:K3FastKimiLinearForCausalLM"
LOAD_FORMAT = "k3-random"

_registered = False


def register() -> None:
    """Point vLLM's ``KimiLinearForCausalLM`` (Kimi K3's language model, also what KimiK3ForConditionalGeneration
    builds inside) at the plug-in's subclass, and add the ``k3-random`` load format (k3fast.vllm.loader)."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    from vllm.model_executor.model_loader import register_model_loader
    from .loader import K3RandomLoader
    register_model_loader(LOAD_FORMAT)(K3RandomLoader)
    _registered = True
