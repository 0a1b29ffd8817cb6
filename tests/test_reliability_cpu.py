"""The long-decode instrument on the CPU (k3ref against itself): the bookkeeping the GPU tier relies on."""
import pytest
import torch

from k3fast.measure.reliability import default_starts, long_decode, summarize

pytestmark = pytest.mark.ref


@pytest.mark.parametrize("layer", [1, 3], ids=["kda", "mla"])
def test_long_decode_bookkeeping(layer):
    """impl = the model path itself: errors identical to the model path's, nonzero, requests joining late
    as padding rows (the instrument asserts their slots stay zero), the layer output recorded at every_out."""
    rec = long_decode("k3_rank16", layer, 2, 6, impl="ref", starts=[0, 3], every=2, every_out=3, device="cpu")
    assert [c["step"] for c in rec["curve"]] == [2, 3, 4, 6]
    assert [c["active"] for c in rec["curve"]] == [1, 1, 2, 2]
    s = summarize(rec)
    assert set(s) >= {"x_mlp", "state", "out"}
    for name, q in s.items():
        assert q["ratio_max"] == 1.0 and 0 < q["impl_max"], name
        # the layer output is left out: a router near-tie swaps an expert between precisions (O(1) change)
        assert name == "out" or q["impl_max"] < 3e-2, name


def test_default_starts_spread_the_lengths():
    assert default_starts(1, 2000) == [0]
    st = default_starts(8, 2000)
    assert st[0] == 0 and st == sorted(st) and st[-1] == 875          # the last request decodes 1,125 steps


def test_bad_starts_refused():
    with pytest.raises(ValueError, match="starts"):
        long_decode("k3_rank16", 1, 2, 4, impl="ref", starts=[0, 4], device="cpu")
