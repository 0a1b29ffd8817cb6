"""The plug-in's switch: ``additional_config["k3fast"]`` of a vLLM engine, parsed into one frozen dataclass.

    vllm serve ... --additional-config '{"k3fast": {"max_batch": 64}}'
    LLM(..., additional_config={"k3fast": {"fuse": "moe"}})

Absent key: the plug-in stays inert and the engine runs stock vLLM. Every option and its default:

    fuse        "all" (default): every KDA layer decodes on the fused chain (AttnRes + in_proj, the KDA step, o_proj +
                AttnRes) and every MoE layer's MoE half runs the fused kernels; "moe": only the MoE halves.
    max_batch   1..64 (default 64): the widest decode step the fused attention half runs; wider steps, prefill and
                mixed steps run vLLM's own attention on the same state.
    batches     the decode batch sizes the fused attention half is compiled for: "capture" (default: vLLM's CUDA-graph
                capture sizes up to max_batch) or a list of ints. Other sizes run vLLM's own attention.
    plan        DecodePlan fields to override (k3fast.layer.DecodePlan), e.g. {"tail_fused_max_m": 8};
                {"mla_attention": "fused"} also decodes the MLA layers' attention half on FusedMLA.

This module imports nothing from vLLM, so the parsing is tested on any machine.
"""
from __future__ import annotations

import dataclasses
from typing import Any

KEY = "k3fast"
FUSE_MODES = ("all", "moe")


@dataclasses.dataclass(frozen=True)
class PluginOptions:
    fuse: str = "all"
    max_batch: int = 64
    batches: tuple[int, ...] | None = None      # None: vLLM's CUDA-graph capture sizes up to max_batch
    plan: tuple[tuple[str, Any], ...] = ()      # DecodePlan overrides, as sorted (field, value) pairs

    def __post_init__(self):
        if self.fuse not in FUSE_MODES:
            raise ValueError(f"additional_config['{KEY}']['fuse']: expected one of {FUSE_MODES}, got {self.fuse!r}")
        if not isinstance(self.max_batch, int) or isinstance(self.max_batch, bool) or not 1 <= self.max_batch <= 64:
            raise ValueError(f"additional_config['{KEY}']['max_batch']: expected an int in 1..64 (the fused kernels' "
                             f"widest batch bucket), got {self.max_batch!r}")
        if self.batches is not None:
            bad = [b for b in self.batches if not isinstance(b, int) or isinstance(b, bool)
                   or not 1 <= b <= self.max_batch]
            if bad or not self.batches:
                raise ValueError(f"additional_config['{KEY}']['batches']: expected \"capture\" or a non-empty list of "
                                 f"ints in 1..max_batch={self.max_batch}, got {list(self.batches)!r}")

    def decode_plan(self):
        """The DecodePlan with this config's overrides (raises on an unknown field or a bad value)."""
        from ..layer import DecodePlan
        fields = {f.name for f in dataclasses.fields(DecodePlan)}
        unknown = [k for k, _ in self.plan if k not in fields]
        if unknown:
            raise ValueError(f"additional_config['{KEY}']['plan']: unknown DecodePlan fields {unknown}; "
                             f"known: {sorted(fields)}")
        return DecodePlan(**dict(self.plan))

    def prepared_batches(self, capture_sizes) -> tuple[int, ...]:
        """The decode batch sizes to compile for: the explicit list, else the capture sizes up to max_batch (and
        max_batch itself, so that a step of any width up to it has a prepared size to pad to)."""
        if self.batches is not None:
            return tuple(sorted(set(self.batches)))
        sizes = {int(s) for s in (capture_sizes or ()) if 1 <= int(s) <= self.max_batch}
        return tuple(sorted(sizes | {self.max_batch}))


def parse(additional_config) -> PluginOptions | None:
    """``vllm_config.additional_config`` -> PluginOptions, or None when the engine did not ask for the plug-in."""
    if not isinstance(additional_config, dict) or KEY not in additional_config:
        return None
    raw = additional_config[KEY]
    if raw is True or raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"additional_config['{KEY}']: expected a dict of options (or true), got {raw!r}")
    known = {f.name for f in dataclasses.fields(PluginOptions)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"additional_config['{KEY}']: unknown options {unknown}; known: {sorted(known)}")
    kw = dict(raw)
    if "batches" in kw:
        b = kw["batches"]
        if b == "capture":
            kw["batches"] = None
        elif isinstance(b, (list, tuple)):
            kw["batches"] = tuple(b)
        else:
            raise ValueError(f"additional_config['{KEY}']['batches']: expected \"capture\" or a list of ints, got "
                             f"{b!r}")
    if "plan" in kw:
        if not isinstance(kw["plan"], dict):
            raise ValueError(f"additional_config['{KEY}']['plan']: expected a dict of DecodePlan fields, got "
                             f"{kw['plan']!r}")
        kw["plan"] = tuple(sorted(kw["plan"].items()))
    opts = PluginOptions(**kw)
    opts.decode_plan()          # a bad plan fails at engine start, with the field named
    return opts
