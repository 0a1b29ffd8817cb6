"""The harness's MLA cache seen as vLLM pages it (k3fast.layer_io.mla_step / mla_paged_view), on the CPU."""
import pytest
import torch

from k3ref import k3_rank
from k3ref.state import MLACache
from k3fast.layer_io import MLA_PAGE, kda_state_indices, mla_paged_view, mla_step

pytestmark = pytest.mark.ref


def test_pages_table_lengths_and_padding():
    cfg = k3_rank(16)
    st = MLACache.allocate(cfg, 4, 2 * MLA_PAGE)
    st.kv.normal_()
    st.lengths.copy_(torch.tensor([0, 5, 64, 127]))
    pages, table, seqlens = mla_paged_view(st, torch.tensor([1, -1, 3, 2], dtype=torch.int32))
    assert pages.shape == (8, MLA_PAGE, cfg.kv_cache_dim) and pages.data_ptr() == st.kv.data_ptr()
    assert table.dtype == torch.int32 and table.tolist() == [[2, 3], [0, 1], [6, 7], [4, 5]]
    assert seqlens.dtype == torch.int32 and seqlens.tolist() == [6, 0, 128, 65]     # padded request: 0
    assert st.lengths.tolist() == [0, 6, 65, 128]                                    # advanced once per request
    # page p of slot s holds rows 64 p .. 64 p + 63 of that slot
    assert torch.equal(pages[table[2, 1]], st.kv[3, MLA_PAGE:])


def test_overflow_and_bad_pool_refused():
    cfg = k3_rank(16)
    st = MLACache.allocate(cfg, 2, MLA_PAGE)
    st.lengths.fill_(MLA_PAGE)
    with pytest.raises(ValueError, match="more than its 64 rows"):
        mla_paged_view(st, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 64"):
        mla_paged_view(MLACache.allocate(cfg, 2, 100), torch.tensor([0], dtype=torch.int32))


def test_step_metadata_changes_nothing_and_maps_the_new_rows():
    """mla_step (the scheduler's per-step metadata) leaves the lengths alone; slot_mapping is the flat row each live
    request's new token goes to (slot * Lmax + length before the step), -1 for padding; the rest equals the paged view."""
    cfg = k3_rank(16)
    st = MLACache.allocate(cfg, 4, 2 * MLA_PAGE)
    st.lengths.copy_(torch.tensor([0, 5, 64, 127]))
    slots = torch.tensor([1, -1, 3, 2], dtype=torch.int32)
    step = mla_step(st, slots)
    assert st.lengths.tolist() == [0, 5, 64, 127]
    assert step.slot_mapping.tolist() == [1 * 128 + 5, -1, 3 * 128 + 127, 2 * 128 + 64]
    pages, table, seqlens = mla_paged_view(st, slots)
    assert torch.equal(step.block_table, table) and torch.equal(step.seqlens, seqlens)
    assert step.pages.data_ptr() == pages.data_ptr() and step.backend == {}
    # the flat row is where the paged view puts it: page slot_mapping // 64, row slot_mapping % 64
    assert torch.equal(pages[step.slot_mapping[2] // MLA_PAGE, step.slot_mapping[2] % MLA_PAGE], st.kv[3, 127])


def test_kda_state_indices_are_vllms_form():
    """The harness's padding (-1) on vLLM's null slot 0, int32, the live slots unchanged (the harness keeps slot 0
    spare, so no request owns it)."""
    got = kda_state_indices(torch.tensor([3, -1, 1, -1], dtype=torch.int32))
    assert got.dtype == torch.int32 and got.tolist() == [3, 0, 1, 0]
