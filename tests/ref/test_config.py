"""The configuration and schedule match docs/k3-layer.md §1, §2, §13."""
import pytest

from k3ref import k3, k3_rank, mini, tiny

pytestmark = pytest.mark.ref


def test_layer_schedule():
    c = k3()
    mla = [l for l in range(93) if not c.is_kda_layer(l)]
    assert mla == list(range(3, 92, 4)) + [92] and len(mla) == 24
    assert sum(c.is_kda_layer(l) for l in range(93)) == 69
    assert [l for l in range(93) if not c.is_moe_layer(l)] == [0]
    assert [l for l in range(93) if c.is_block_boundary(l)] == [0, 12, 24, 36, 48, 60, 72, 84]
    assert all(c.is_kda_layer(l) for l in range(0, 93, 12))
    assert c.max_blocks == 8
    assert [c.num_blocks_before(l) for l in (0, 1, 11, 12, 13, 92)] == [0, 1, 1, 1, 2, 8]


@pytest.mark.parametrize("tp,heads,shared,expert,dense", [(1, 96, 6144, 3072, 33792), (8, 12, 768, 384, 4224),
                                                          (16, 6, 384, 256, 2112)])
def test_rank_shapes(tp, heads, shared, expert, dense):
    c = k3_rank(tp)
    assert (c.kda_heads, c.mla_heads, c.shared_intermediate, c.expert_intermediate, c.dense_intermediate) == \
        (heads, heads, shared, expert, dense)
    assert c.kda_proj == heads * 128 and c.kv_cache_dim == 576 and c.qk_head_dim == 192


def test_presets_build():
    for c in (tiny(), tiny(2), tiny(4), mini()):
        c.describe()
    assert tiny(4).expert_intermediate == 64 and tiny(4).expert_intermediate_valid == 32   # padded like TP16
