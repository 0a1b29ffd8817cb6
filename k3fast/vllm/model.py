"""vLLM's Kimi K3 language model with the k3fast executor attached. Registered in place of vLLM's
``KimiLinearForCausalLM`` (k3fast.vllm.register); without ``additional_config["k3fast"]`` it is vLLM's class.

Importing this module imports vLLM's model code (it is loaded lazily, by name, from the model registry).
"""
from __future__ import annotations

from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM
from vllm.models.kimi_k3.nvidia.model_state import KimiK3ModelState

from . import config, guards
from .runtime import K3FastDecode


class K3FastKimiLinearForCausalLM(KimiLinearForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.k3fast: K3FastDecode | None = None
        options = config.parse(vllm_config.additional_config)
        if options is None:
            return
        guards.check(guards.engine_facts(vllm_config, self, options))
        self.k3fast = K3FastDecode(self, options, vllm_config)

    def get_model_state_cls(self):
        return K3FastModelState if self.k3fast is not None else super().get_model_state_cls()

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        decode = self.k3fast
        if decode is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        decode.plan(positions)
        try:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        finally:
            decode.finish()


class K3FastModelState(KimiK3ModelState):
    """Prepares the fused halves right after the weights are loaded, before vLLM profiles memory and captures its
    CUDA graphs: every kernel key the engine can run is compiled here, never inside a capture."""

    def __init__(self, vllm_config, model, encoder_cache, device):
        super().__init__(vllm_config, model, encoder_cache, device)
        lm = self.language_model
        lm.k3fast.prepare(vllm_config.compilation_config.cudagraph_capture_sizes)
