"""The experts bench (k3fast.measure.bench_experts) on the CPU: which kernels it times at each batch and the
routings it draws. No compile: the keys are the module's own (tests/compile/test_moe_mxfp4_experts.py builds them)."""
import dataclasses

import pytest
import torch

from k3fast.kernels import moe_mxfp4_experts as mx
from k3fast.measure import bench_experts as be
from k3ref import k3, k3_rank

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("cfg", [k3_rank(16), k3_rank(8), k3()], ids=["k3_rank16", "k3_rank8", "full"])
def test_kernel_variants(cfg):
    """The default key at every batch; passes-only (alt_parts=0) only at buckets 4 / 8, where it drops the
    alternate items and keeps everything else."""
    dims = (cfg.num_experts, cfg.routed_expert_hidden_size, cfg.expert_intermediate)
    for M in (1, 2, 3, 4, 8, 16, 64):
        v = be.kernel_variants(cfg, M)
        key, kw = v["default"]
        assert kw == {} and key == mx.compile_key(*dims, M, situ_beta=cfg.situ_beta,
                                                  situ_linear_beta=cfg.situ_linear_beta)
        assert set(v) <= set(be.VARIANTS) - {"marlin"}
        if mx.m_bucket(M) in (4, 8):
            alone, kw = v["passes-only"]
            assert kw == {"alt_parts": 0} and key.alt_parts == mx.ALT_PARTS and alone.alt_parts == 0
            assert alone == dataclasses.replace(key, alt_parts=0)
        else:
            assert set(v) == {"default"}


def test_routing_ids():
    cfg = k3_rank(16)
    g = torch.Generator().manual_seed(0)
    for M in (1, 8, 64):
        for kind in be.ROUTINGS:
            ids = be.routing_ids(cfg, M, kind, g, device="cpu")
            assert ids.shape == (M, cfg.num_experts_per_token) and ids.dtype == torch.int32
            assert all(len(set(row.tolist())) == cfg.num_experts_per_token for row in ids)
            assert int(ids.min()) >= 0 and int(ids.max()) < cfg.num_experts
            if kind == "skewed":
                assert len(set(ids.flatten().tolist())) <= be.HOT_EXPERTS
    with pytest.raises(ValueError, match="routing"):
        be.routing_ids(cfg, 1, "zipf", g, device="cpu")


def test_main_needs_a_gpu_or_stops_cleanly(capsys):
    if torch.cuda.is_available():
        pytest.skip("runs the bench on a GPU")
    assert be.main(["--shapes", "k3_rank16", "--batches", "1"]) == 2
    with pytest.raises(SystemExit):
        be.main(["--variants", "v7"])                 # only the named variants exist
