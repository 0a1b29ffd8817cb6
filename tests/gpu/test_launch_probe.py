"""k3fast.launch_probe on the GPU: every case's graph replays, its kernels are the ones asked for (count from CUPTI),
and the numbers are finite and ordered (p10 <= median <= p90, the span no longer than the replay's p90)."""
import math

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["torch x3", "dsl 200KB pdl, warm 200KB", "dsl pdl cluster4",
                                  "torch, dsl 200KB pdl, torch"])
def test_case_measures(name):
    from k3fast.launch_probe import CASES, measure
    nodes, warm = next((c[1], c[2]) for c in CASES if c[0] == name)
    r = measure(nodes, warm, n=20, replays=3)
    assert r["kernels"] == len(nodes)
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("replay_us_p10", "replay_us_median", "replay_us_p90"))
    assert r["replay_us_p10"] <= r["replay_us_median"] <= r["replay_us_p90"]
    assert 0 < r["span_us"] <= r["replay_us_p90"]
