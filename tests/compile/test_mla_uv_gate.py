"""CPU-only checks of k3fast.kernels.mla_uv_gate: every token-group build compiles for sm_90a with one MMA per k-step
and token tile and no local memory; the host entry point refuses bad inputs by name."""
import collections
import re

import numpy as np
import pytest
from ptx_cache import keep_ptx_fixture, needs_dsl
import torch

from k3fast.kernels import mla_uv_gate as uv

pytestmark = pytest.mark.compile


keep_ptx = keep_ptx_fixture(uv)


def test_token_buckets():
    assert [uv.compile_key(m)[1] for m in (1, 8, 9, 16, 17, 33, 64)] == [1, 1, 2, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="M must"):
        uv.compile_key(65)


@needs_dsl
@pytest.mark.parametrize("nt", [1, 2, 4, 8])
def test_builds_compile(nt):
    from k3fast.measure.ptxcheck import compiled_ptx
    ptx = compiled_ptx(lambda: uv._compile(nt))
    assert ptx.count("mma.sync.aligned.m16n8k16") == uv.KSTEPS * nt
    assert ".local" not in ptx and "griddepcontrol.wait" in ptx
    # the warp's W_UV fragments (4 words per k-step) are loaded before the PDL wait, nothing else is
    assert _global_loads_before_wait(ptx) == 4 * uv.KSTEPS


def _global_loads_before_wait(ptx: str) -> int:
    head = ptx.split("griddepcontrol.wait")[0]
    return sum(1 for line in head.splitlines() if "ld.global" in line)


def _args(M=2, H=6):
    return dict(o_lat=torch.zeros(M, H, 512, dtype=torch.bfloat16), w_uv=torch.zeros(H, 128, 512, dtype=torch.bfloat16),
                g_src=torch.zeros(M, 2880, dtype=torch.bfloat16))


@pytest.mark.parametrize("name,bad,exc", [
    ("o_lat", torch.zeros(2, 6, 256, dtype=torch.bfloat16), ValueError),
    ("o_lat", torch.zeros(2, 6, 512, dtype=torch.float32), TypeError),
    ("w_uv", torch.zeros(6, 128, 256, dtype=torch.bfloat16), ValueError),
    ("w_uv", torch.zeros(5, 128, 512, dtype=torch.bfloat16), ValueError),
    ("g_src", torch.zeros(3, 2880, dtype=torch.bfloat16), ValueError),
])
def test_bad_arguments_refused_by_name(name, bad, exc):
    kw = _args()
    kw[name] = bad
    with pytest.raises(exc, match=name):
        uv.mla_uv_gate(**kw, g_col=2112)


def test_bad_gate_columns_and_cpu_refused():
    with pytest.raises(ValueError, match="g_col"):
        uv.mla_uv_gate(**_args(), g_col=2200)
    with pytest.raises(ValueError, match="CUDA"):
        uv.mla_uv_gate(**_args(), g_col=2112)


@needs_dsl
@pytest.mark.parametrize("nt", [1, 8])
def test_combine_builds_compile(nt):
    """The combine build, sliced by latent dim: two MMA M tiles per warp over the slice's four k16 steps; the
    partials' loads as COMBINE_SPLITS 16-byte loads with no branch between them (one L2 round trip per pass of
    ITEMS items); one arrival per CTA; no local memory; shared memory within a CTA's 227 KB."""
    from k3fast.measure.ptxcheck import compiled_ptx
    ptx = compiled_ptx(lambda: uv._compile(nt, combine=True))
    assert ptx.count("mma.sync.aligned.m16n8k16") == 2 * uv.CSTEPS * nt
    assert ".local" not in ptx and "griddepcontrol.wait" in ptx
    assert ptx.count("atom.global.acq_rel.add") == 1
    assert _global_loads_before_wait(ptx) == 4 * 2 * uv.CSTEPS        # W_UV's slice fragments only
    # the weights' two butterflies (max, sum): the whole warp's five steps, and each lane group's last log2(G)
    offsets = collections.Counter(int(o) for o in re.findall(r"shfl\.sync\.bfly\.b32\s+[^,]+,\s*[^,]+,\s*(\d+)", ptx))
    want = collections.Counter()
    for g in (32,) + uv.WEIGHT_GROUPS:
        for k in range(g.bit_length() - 1):
            want[1 << k] += 2
    assert offsets == want
    runs, run = [], 0
    for line in ptx.splitlines():
        if "ld.global.cg.v4.f32" in line:
            run += 1
        elif "bra" in line or "shfl" in line or "bar.sync" in line:
            runs.append(run)
            run = 0
    assert max(runs) == uv.COMBINE_SPLITS
    _, smem = uv._build(nt, combine=True)
    assert smem <= 227 * 1024
    assert uv.compile_key(5, combine=True) == ("mla_uv_gate", 1, "combine")
    assert uv.ITEMS == 128 and uv.KS * uv.UV_SLICES == uv.DV


def _partials(M=2, H=6, splits=3, hn=8, rows=None, dev="cpu", scratch=True):
    from k3fast.kernels.mla_latent_decode import UV_SLICES, LatentPartials
    rows = M * splits * hn if rows is None else rows
    extra = (torch.zeros(H * UV_SLICES * M, 128, device=dev), torch.zeros(H, dtype=torch.int32, device=dev)) \
        if scratch else ()
    return LatentPartials(torch.zeros(rows, 512, device=dev), torch.zeros(rows, 2, device=dev), splits, hn, H, M,
                          *extra)


def test_combine_arguments_refused_by_name():
    kw = _args()
    kw["o_lat"] = _partials(rows=40)
    with pytest.raises(ValueError, match="o_lat: the partials hold 40 rows"):
        uv.mla_uv_gate(**kw, g_col=2112)
    kw["o_lat"] = _partials(splits=0, rows=48)
    with pytest.raises(ValueError, match="splits"):
        uv.mla_uv_gate(**kw, g_col=2112)
    kw["o_lat"] = _partials(scratch=False)
    with pytest.raises(ValueError, match="uv_scratch"):
        uv.mla_uv_gate(**kw, g_col=2112)
    kw["o_lat"] = _partials()
    with pytest.raises(ValueError, match="CUDA"):
        uv.mla_uv_gate(**kw, g_col=2112)


def _butterfly(v, group):
    """A warp's shuffle-xor sum over aligned groups of ``group`` lanes, in the kernel's operand order."""
    v = v.copy()
    off = group // 2
    while off:
        v = (v + v[np.arange(32) ^ off]).astype(np.float32)
        off //= 2
    return v


@pytest.mark.parametrize("splits", [1, 2, 3, 5, 8, 13, 16])
def test_a_lane_group_sums_the_same_bits_as_the_whole_warp(splits):
    """The combine build weighs a token's splits with G >= splits lanes (combine_weights' group): its butterfly is
    the last log2(G) steps of the whole warp's, whose first steps only add the zeros held past the last split."""
    rng = np.random.default_rng(splits)
    g = next(g for g in uv.WEIGHT_GROUPS if g >= splits)
    for _ in range(50):
        x = (rng.random(splits, dtype=np.float32) * np.float32(2.0) ** rng.integers(-30, 30, splits)).astype(np.float32)
        warp = np.zeros(32, np.float32)
        warp[:splits] = x
        tokens = np.zeros(32, np.float32)            # 32 / g tokens, each its own x: only the first group compared
        tokens[:splits] = x
        tokens[g:] = rng.random(32 - g, dtype=np.float32)
        assert _butterfly(warp, 32)[0].tobytes() == _butterfly(tokens, g)[0].tobytes()
