"""A whole K3 text model over the reference layers (docs/k3-layer.md §2, §4.2, §12): embedding,
the layer stack, the final AttnRes mix, ``model.norm`` and ``lm_head``. Used with ``mini()`` for
end-to-end runs; at full size it is the same code with 93 layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attnres import ResidualStream, final_mix
from .config import K3Config
from .layer import K3DecoderLayer
from .norms import rms_norm
from .precision import Precision
from .state import allocate_state
from .weights import AttnResSite, BF16, CheckpointError, LayerWeights, layer_from_checkpoint, random_layer

GLOBAL = "language_model."


def global_spec(cfg: K3Config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The model-level tensors (section 12): embedding, lm_head, final norm, final AttnRes site."""
    V, d = cfg.vocab_size, cfg.hidden_size
    return {GLOBAL + "model.embed_tokens.weight": ((V, d), BF16), GLOBAL + "lm_head.weight": ((V, d), BF16),
            GLOBAL + "model.norm.weight": ((d,), BF16), GLOBAL + "model.output_attn_res_norm.weight": ((d,), BF16),
            GLOBAL + "model.output_attn_res_proj.weight": ((1, d), BF16)}


@dataclass
class K3ModelWeights:
    embed: torch.Tensor
    lm_head: torch.Tensor
    norm: torch.Tensor
    output_res: AttnResSite
    layers: list[LayerWeights]

    def to_checkpoint(self, cfg: K3Config) -> dict[str, torch.Tensor]:
        from .weights import layer_to_checkpoint
        g = GLOBAL
        out = {g + "model.embed_tokens.weight": self.embed, g + "lm_head.weight": self.lm_head,
               g + "model.norm.weight": self.norm, g + "model.output_attn_res_norm.weight": self.output_res.norm,
               g + "model.output_attn_res_proj.weight": self.output_res.proj}
        for w in self.layers:
            out.update(layer_to_checkpoint(w, cfg))
        return out


def random_globals(cfg: K3Config, *, seed: int = 0, device="cpu") -> K3ModelWeights:
    """random_model's model-level tensors alone (``layers`` empty): the same values, drawn in the same order."""
    g = torch.Generator(device=device).manual_seed(seed)
    V, d = cfg.vocab_size, cfg.hidden_size
    return K3ModelWeights(
        embed=torch.randn(V, d, generator=g, device=device).to(BF16),
        lm_head=(torch.randn(V, d, generator=g, device=device) * d ** -0.5).to(BF16),
        norm=(1 + 0.05 * torch.randn(d, generator=g, device=device)).to(BF16),
        output_res=AttnResSite(norm=(1 + 0.05 * torch.randn(d, generator=g, device=device)).to(BF16),
                               proj=(torch.randn(1, d, generator=g, device=device) * 4 * d ** -0.5).to(BF16)),
        layers=[])


def random_model(cfg: K3Config, *, seed: int = 0, device="cpu") -> K3ModelWeights:
    w = random_globals(cfg, seed=seed, device=device)
    w.layers = [random_layer(cfg, l, seed=seed, device=device) for l in range(cfg.num_hidden_layers)]
    return w


def model_from_checkpoint(tensors: dict[str, torch.Tensor], cfg: K3Config) -> K3ModelWeights:
    """Validate every layer and the global tensors, then build the model (ONE error for all problems)."""
    problems = []
    for name, (shape, dtype) in global_spec(cfg).items():
        t = tensors.get(name)
        if t is None:
            problems.append(f"missing: {name} (expected {list(shape)} {dtype})")
        elif tuple(t.shape) != shape or t.dtype != dtype:
            problems.append(f"wrong shape/dtype: {name} is {list(t.shape)} {t.dtype}, expected {list(shape)} {dtype}")
    layers = []
    for l in range(cfg.num_hidden_layers):
        try:
            layers.append(layer_from_checkpoint(tensors, cfg, l))
        except CheckpointError as e:
            problems.extend(str(e).split("\n  ")[1:])
    if problems:
        raise CheckpointError(f"checkpoint does not match the {cfg.name} model: {len(problems)} problem(s):\n  "
                              + "\n  ".join(problems))
    t = lambda n: tensors[GLOBAL + n]
    return K3ModelWeights(embed=t("model.embed_tokens.weight"), lm_head=t("lm_head.weight"), norm=t("model.norm.weight"),
                          output_res=AttnResSite(t("model.output_attn_res_norm.weight"), t("model.output_attn_res_proj.weight")),
                          layers=layers)


class K3Model:
    """Embedding -> layers -> final mix -> model.norm -> lm_head, one decode step at a time."""

    def __init__(self, cfg: K3Config, w: K3ModelWeights, precision: Precision | None = None, *, slots: int = 8,
                 max_len: int = 256):
        self.cfg, self.w, self.P = cfg, w, precision or Precision.model()
        dev = w.embed.device
        self.layers = [K3DecoderLayer(cfg, lw, self.P) for lw in w.layers]
        self.states = [allocate_state(cfg, l, slots, max_len=max_len, P=self.P, device=dev) for l in range(cfg.num_hidden_layers)]

    def decode_step(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """tokens [N] int64 (one per request) -> logits [N, vocab] FP32."""
        stream = ResidualStream.from_embeddings(self.w.embed[tokens].to(self.P.io_dtype), self.cfg.max_blocks)
        for layer, st in zip(self.layers, self.states):
            layer.decode_step(stream, st, slots)
        h = rms_norm(final_mix(stream, self.w.output_res, self.cfg, self.P), self.w.norm, self.cfg.rms_norm_eps)
        return self.P.linear_f32(self.P.rnd(h), self.w.lm_head)


def sequence_logits(cfg: K3Config, w: K3ModelWeights, layer_weights, tokens, precision: Precision | None = None):
    """Logits [T, vocab] FP32 of one request's tokens, teacher-forced from an empty state: what K3Model.decode_step
    gives token by token, computed layer by layer. Every position's residual stream passes layer l before layer
    l + 1 is built by ``layer_weights(l)``, so one layer's weights are held at a time (a deep model on a GPU that
    a serving engine shares). ``w``: the model-level tensors (its ``layers`` are not used)."""
    P = precision or Precision.model()
    dev = w.embed.device
    ids = torch.as_tensor(tokens, device=dev)
    streams = [ResidualStream.from_embeddings(w.embed[t:t + 1].to(P.io_dtype), cfg.max_blocks) for t in ids]
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    for l in range(cfg.num_hidden_layers):
        layer = K3DecoderLayer(cfg, layer_weights(l), P)
        state = allocate_state(cfg, l, 1, max_len=len(streams) + 1, P=P, device=dev)
        for s in streams:
            layer.decode_step(s, state, slot)
        del layer, state
    # the head one position at a time, as decode_step runs it (a batched GEMM may sum in another order)
    return torch.cat([P.linear_f32(P.rnd(rms_norm(final_mix(s, w.output_res, cfg, P), w.norm, cfg.rms_norm_eps)),
                                   w.lm_head) for s in streams])
