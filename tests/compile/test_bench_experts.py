"""The experts design-space probe (k3fast.measure.bench_experts): every variant is a valid key and the probe compiles."""
import pytest

from k3fast.measure import bench_experts as be
from k3fast.kernels import moe_mxfp4_experts as mx
from k3fast.kernels._dsl import dsl_available
from k3ref import k3, k3_rank

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("cfg", [k3_rank(16), k3_rank(8), k3()], ids=["k3_rank16", "k3_rank8", "full"])
def test_variants_are_valid_keys(cfg):
    for M in (1, 8, 64):
        base = mx.compile_key(cfg.num_experts, cfg.routed_expert_hidden_size, cfg.expert_intermediate, M)
        for v in be.VARIANTS:
            if v[:2] in ("v6", "v7", "v8") and base.MB > mx.SPLIT_MAX_MB[int(v[1])]:
                # v6 / v8 serve batch buckets <= 2, v7 <= 8 (since session 31); the bench skips them above
                with pytest.raises(ValueError, match=f"version {v[1]}"):
                    be.variant_cfg(v, base)
                continue
            if v.startswith(("R1", "S1")) and M > 1:   # route1 / its sorted A/B: batch bucket 1; skipped above
                with pytest.raises(ValueError, match="route_direct"):
                    be.variant_cfg(v, base)
                continue
            if v.startswith("PARK"):                   # the park probe: v7 (buckets <= 2) where it fits
                if base.version != 7:
                    with pytest.raises(ValueError, match="PARK"):
                        be.variant_cfg(v, base)
                    continue
                try:
                    kc = be.variant_cfg(v, base)
                except ValueError as ex:               # PARK64 beside a kernel that leaves less than 64 KB
                    assert "park=" in str(ex) and v != "PARK"
                    continue
                assert kc.park % mx.PARK_CHUNK == 0 and kc.smem_bytes <= mx.SMEM_PER_CTA_MAX
                continue
            if v == "C8" and base.version in (7, 8) and cfg.expert_intermediate == 256:
                with pytest.raises(ValueError, match="K split"):   # 1 FC1 tile per CTA: 16 K parts of 56 steps
                    be.variant_cfg(v, base)                        # (the bench prints it as skipped)
                continue
            kc = be.variant_cfg(v, base)
            assert kc.Q * kc.C <= 132 and (kc.dL // 16) % kc.C == 0
        assert be.variant_cfg("probe", base).probe == "stream"
        assert be.variant_cfg("v2", base).version == 2
        assert be.variant_cfg("default", base) == base and base.version == mx.default_version(base.MB, base.I, base.dL)
        dp = be.variant_cfg("Dprobe4", base)
        assert dp.probe == "stream" and dp.D == 4 and dp.C == base.C and dp.version == base.version
        assert be.variant_cfg("v3C8", base).C == 8 and be.variant_cfg("v3C8", base).version == 3
        assert be.variant_cfg("v3C8", base).W == 8 and be.variant_cfg("W8", base).W == 8 and base.W == 16
        assert be.variant_cfg("nibble", base).layout == "nibble" and base.layout == "rot"
        nrf = be.variant_cfg("NRF", base)          # ring_fit off, at every default version (4 / 7)
        assert base.ring_fit and not nrf.ring_fit and be.variant_cfg("NRFprobe", base).probe == "stream"
        assert base.D1 == base._fit(base.KS1) and base.D1 <= base.D and base.D2 <= base.D
        assert (nrf.D1, nrf.D2) == (nrf.D, nrf.D)
        assert not be.variant_cfg("v3", base).ring_fit             # other versions keep the full ring
        if M <= 2:
            assert be.variant_cfg("v4", base).ring_fit == mx.RING_FIT      # a named version: its own default
            v6 = mx.compile_key(cfg.num_experts, cfg.routed_expert_hidden_size, cfg.expert_intermediate, M,
                                version=6)
            with pytest.raises(ValueError, match="ring_fit"):        # v6 has no fitted ring to turn off
                be.variant_cfg("NRF", v6)
        if M == 1:
            # route1 is the default at batch 1 since session 11; S1 is the sorted kernel of before
            assert be.variant_cfg("R1", base) == base and base.route_direct == mx.ROUTE_DIRECT
            assert not be.variant_cfg("S1", base).route_direct
            assert be.variant_cfg("S1sortprobe", base) == __import__("dataclasses").replace(
                base, route_direct=False, probe="sort")
            assert base.version == (7 if cfg.expert_intermediate == 384 else 8)   # v8 where its row blocks are even
            v7 = be.variant_cfg("v7", base)
            assert v7.version == 7 and v7.C == mx.V7_CLUSTER and v7 == mx.compile_key(
                cfg.num_experts, cfg.routed_expert_hidden_size, cfg.expert_intermediate, M, version=7)
            assert be.variant_cfg("v7P2", base).parts == 2 and be.variant_cfg("v7probe", base).probe == "stream"
            assert be.variant_cfg("v4", v7).parts == 1
            for st in ("sort", "fc1", "fc2"):
                assert be.variant_cfg(st + "probe", base) == __import__("dataclasses").replace(base, probe=st)
                v4p = be.variant_cfg("v4" + st + "probe", base)
                assert v4p.probe == st and v4p.version == 4 and v4p.parts == 1
    with pytest.raises(ValueError):
        be.variant_cfg("Y1", base)
    with pytest.raises(ValueError, match="probe"):
        mx.KernelCfg(E=896, dL=3584, I=256, MB=8, C=8, probe="nonsense")


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
def test_stream_probe_compiles():
    base = mx.compile_key(896, 3584, 256, 8)
    assert mx.get_kernel(be.variant_cfg("probe", base)) is not None


def test_v52_variants():
    """At buckets 4 / 8 the default is v5.2; "A0" is v5.1 (the A/B), and a variant naming another version or
    cluster size leaves v5.2's v7 items out (they belong to v5 on clusters of 2)."""
    base = mx.compile_key(896, 3584, 256, 8)
    assert base.alt_parts == 2 and be.variant_cfg("default", base) == base
    assert be.variant_cfg("A0", base) == mx.compile_key(896, 3584, 256, 8, alt_parts=0)
    for v in ("v4", "v7", "C4N120", "probe", "fc1probe"):
        assert be.variant_cfg(v, base).alt_parts == 0, v
    assert be.variant_cfg("pad4", base).alt_parts == 2
