"""Gated MLA: the absorbed decode form must equal the naive form (section 8.3)."""
import pytest
import torch

from k3ref import Precision, random_layer, tiny
from k3ref.mla import mla_absorbed, mla_latents, mla_naive
from tolerances import assert_close

pytestmark = pytest.mark.ref


@pytest.mark.parametrize("T,L", [(1, 1), (1, 9), (4, 13)])
def test_absorbed_equals_naive_fp64(seed, T, L):
    cfg = tiny()
    P = Precision.exact()
    w = random_layer(cfg, 3, seed=seed).attn
    N = 2
    x = torch.randn(N * L, cfg.hidden_size, dtype=torch.float64)
    q, rows, _ = mla_latents(x, w, cfg, P)
    q = q.view(N, L, cfg.mla_heads, -1)[:, L - T:]
    cache = rows.view(N, L, -1)
    q_pos = torch.arange(L - T, L)[None].expand(N, T)
    assert_close("o", mla_absorbed(q, cache, q_pos, w, cfg, P), mla_naive(q, cache, q_pos, w, cfg, P), "fp64_reformulation")


def test_nope_no_rotation(seed):
    """k_pe is cached raw: the cache row is [RMSNorm(c_kv) | k_pe] with k_pe = x W_kva^T exactly."""
    cfg, P = tiny(), Precision.exact()
    w = random_layer(cfg, 3, seed=seed).attn
    x = torch.randn(3, cfg.hidden_size, dtype=torch.float64)
    _, rows, _ = mla_latents(x, w, cfg, P)
    kpe = x @ w.kv_a_proj_with_mqa.double()[cfg.kv_lora_rank:].T
    assert_close("k_pe", rows[:, cfg.kv_lora_rank:], kpe, "fp64_reformulation")
