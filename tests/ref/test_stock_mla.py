"""k3fast.stock.mla (the stock FlashMLA decode core) on CPU: FlashMLA itself is replaced by a plain-torch paged
attention written here from its documented contract (vllm/third_party/flashmla/flash_mla_interface.py), so the
paging, the cache append, the padding and the absorbed projections are checked against k3ref's mla_core."""
import sys
import types

import pytest
import torch

from k3ref import Precision, tiny
from k3ref.mla import mla_core, mla_latents
from k3ref.state import MLACache
from k3ref.weights import random_layer
from tolerances import assert_close

pytestmark = pytest.mark.ref
CALLS = []


def _paged_attention(q, k_cache, block_table, cache_seqlens, head_dim_v, sched_meta, softmax_scale=None,
                     causal=False, **_):
    """FlashMLA's dense decode contract: q [B, 1, Hq, D], k_cache [blocks, page, 1, D], block_table [B, pages],
    cache_seqlens [B]; the first cache_seqlens[b] rows of request b's pages are K, their first head_dim_v
    columns are V; returns (o [B, 1, Hq, head_dim_v] in q's dtype, lse [B, Hq, 1])."""
    CALLS.append(dict(block_table=block_table.clone(), seqlens=cache_seqlens.clone(), causal=causal))
    assert block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32 and q.shape[1] == 1
    B, _, H, D = q.shape
    page = k_cache.shape[1]
    outs, lses = [], []
    for b in range(B):
        rows = k_cache[block_table[b].long()].reshape(-1, D)[: int(cache_seqlens[b])].float()   # [L, D]
        logits = q[b, 0].float() @ rows.T * softmax_scale                                        # [H, L]
        p = torch.softmax(logits, dim=-1)
        outs.append((p @ rows[:, :head_dim_v]).to(q.dtype))
        lses.append(torch.logsumexp(logits, dim=-1))
    assert page == 64
    return torch.stack(outs)[:, None], torch.stack(lses)[:, :, None]


@pytest.fixture
def fake_flashmla(monkeypatch):
    names = ["vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops", "vllm.v1.attention.ops.flashmla"]
    mods = {n: types.ModuleType(n) for n in names}
    mods[names[-1]].FlashMLASchedMeta = type("FlashMLASchedMeta", (), {})
    mods[names[-1]].flash_mla_with_kvcache = _paged_attention
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    CALLS.clear()
    return CALLS


@pytest.mark.parametrize("slots", [[0, 1, 2], [2, -1, 0], [-1, -1, 1]], ids=["all", "padded", "mostly-padded"])
def test_flashmla_core_matches_mla_core(fake_flashmla, slots):
    from k3fast.stock.mla import FlashMLADecodeCore
    cfg, P = tiny(), Precision.model()
    layer = next(l for l in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(l))
    w = random_layer(cfg, layer, seed=41)
    g = torch.Generator().manual_seed(42)
    N = len(slots)
    x = torch.randn(N, cfg.hidden_size, generator=g).bfloat16()
    q, rows, _ = mla_latents(x, w.attn, cfg, P)
    caches = []
    for _ in range(2):
        c = MLACache.allocate(cfg, 4, 128, P)
        c.kv.copy_(torch.randn(c.kv.shape, generator=torch.Generator().manual_seed(43)).bfloat16())
        c.lengths.copy_(torch.tensor([70, 5, 64, 100]))          # page-crossing, short, page-exact, long
        caches.append(c)
    sl = torch.tensor(slots, dtype=torch.int32)
    want = mla_core(q, rows, w.attn, caches[0].kv, caches[0].lengths, sl, 1, cfg, P)
    got = FlashMLADecodeCore(cfg, w.attn)(q, rows, caches[1].kv, caches[1].lengths, sl)
    assert torch.equal(caches[1].kv, caches[0].kv), "the cache append differs from k3ref's"
    assert torch.equal(caches[1].lengths, caches[0].lengths)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    pad = sl < 0
    assert (got[pad] == 0).all()
    if (~pad).any():
        assert_close("o", got[~pad], want[~pad], "bf16_kernel")
    call = fake_flashmla[0]
    assert call["causal"]
    assert call["block_table"].shape == (N, 2) and int(call["block_table"][0, 1]) == max(slots[0], 0) * 2 + 1


def test_flashmla_core_rejects_unpaged_pool(fake_flashmla):
    from k3fast.stock.mla import FlashMLADecodeCore
    cfg, P = tiny(), Precision.model()
    layer = next(l for l in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(l))
    w = random_layer(cfg, layer, seed=41)
    c = MLACache.allocate(cfg, 2, 100, P)
    q, rows, _ = mla_latents(torch.randn(1, cfg.hidden_size).bfloat16(), w.attn, cfg, P)
    with pytest.raises(ValueError, match="multiple"):
        FlashMLADecodeCore(cfg, w.attn)(q, rows, c.kv, c.lengths, torch.tensor([0], dtype=torch.int32))


def test_flashmla_unavailable_without_vllm_or_gpu():
    from k3fast.stock.mla import flashmla_available
    ok, why = flashmla_available()
    assert not ok and why


def test_fast_layer_stock_attention_builds_no_expert_copy(monkeypatch):
    """FastImpl on an MLA layer whose plan keeps the stock attention: StockImpl builds its attention half only
    (no Marlin copy of the experts, so no vLLM import for the MoE), and its MoE half refuses to run."""
    import k3fast.layer as layer_mod
    from k3fast.stock.layer import StockImpl
    cfg = tiny()
    lay = next(l for l in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(l) and cfg.is_moe_layer(l))
    w = random_layer(cfg, lay, seed=3)
    monkeypatch.setattr(layer_mod, "FusedMoE", lambda *a, **k: None)     # the fused MoE half is not under test
    with pytest.warns(UserWarning):
        fast = layer_mod.FastImpl(cfg, w)
    assert isinstance(fast.stock_attn, StockImpl) and fast.stock_attn.with_moe is False
    assert not hasattr(fast.stock_attn, "experts")
    with pytest.raises(RuntimeError, match="with_moe=False"):
        fast.stock_attn.moe(None)
