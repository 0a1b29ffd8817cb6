"""k3fast.cluster_probe on the GPU: a grid that surely fits is all resident; one that surely does not (more CTAs of
~222 KB than SMs) reports at most one CTA per SM and most of them."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_small_grid_is_all_resident():
    from k3fast.cluster_probe import coresident_clusters
    r = coresident_clusters(2, 1024, 4)
    assert r["all_resident"] and r["resident"] == 4


def test_oversubscribed_grid_reports_the_first_wave():
    from k3fast.cluster_probe import coresident_clusters
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    r = coresident_clusters(1, 222 * 1024, sms + 40)
    assert not r["all_resident"]
    assert sms * 3 // 4 <= r["resident"] <= sms
