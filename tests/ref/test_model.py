"""The whole-model reference: layer-by-layer teacher forcing (sequence_logits, what the vLLM fidelity check runs
on a deep model) gives exactly what K3Model.decode_step gives token by token."""
import torch

from k3ref import tiny
from k3ref.model import K3Model, random_globals, random_model, sequence_logits
from k3ref.weights import random_layer


def test_sequence_logits_equal_token_by_token_decode():
    cfg = tiny()
    w = random_model(cfg, seed=3)
    tokens = [5, 17, 3, 3, 200, 11]
    model = K3Model(cfg, w, slots=1, max_len=16)
    slot = torch.zeros(1, dtype=torch.long)
    step = torch.cat([model.decode_step(torch.tensor([t]), slot) for t in tokens])
    seq = sequence_logits(cfg, random_globals(cfg, seed=3), lambda l: random_layer(cfg, l, seed=3), tokens)
    assert torch.isfinite(seq).all() and torch.equal(seq, step)


def test_random_globals_are_random_models_globals():
    cfg = tiny()
    a, b = random_globals(cfg, seed=1), random_model(cfg, seed=1)
    assert torch.equal(a.embed, b.embed) and torch.equal(a.lm_head, b.lm_head)
    assert torch.equal(a.output_res.proj, b.output_res.proj) and a.layers == []
