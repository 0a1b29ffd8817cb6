"""CPU-only checks of k3fast.kernels.mla_latent_decode: its builds (with and without the fused append) compile for
sm_90a with the instruction mix the design relies on, the split plan covers every page once, and the host entry
point refuses bad inputs by name."""
import re

import pytest
from ptx_cache import keep_ptx_fixture, needs_dsl
import torch

from k3fast.kernels import mla_latent_decode as mk

pytestmark = pytest.mark.compile


keep_ptx = keep_ptx_fixture(mk)


def test_shapes_match_config():
    from k3ref.config import k3, k3_rank
    for cfg in (k3(), k3_rank(8), k3_rank(16)):
        assert cfg.kv_cache_dim == mk.DQK and cfg.kv_lora_rank == mk.DV
    assert [mk.head_group(h) for h in (6, 8, 12, 16, 96)] == [8, 8, 16, 16, 16]


@pytest.mark.parametrize("n,heads,maxp", [(1, 6, 128), (1, 6, 1), (8, 12, 512), (64, 6, 16), (64, 96, 2048),
                                          (3, 96, 17)])
def test_split_plan_covers_every_page_once(n, heads, maxp):
    s, pps = mk.plan_splits(n, heads, maxp)
    assert s >= 1 and pps >= 1
    assert (s - 1) * pps < maxp <= s * pps          # no empty split at full capacity, no page left out
    hg = -(-heads // mk.head_group(heads))
    # one wave: the kernel holds one CTA per SM, so no more CTAs than SMs unless the requests alone outnumber them
    assert n * hg * s <= max(132, n * hg)
    # the combine's cap: its partials (S x hn x 2 KB) no larger than ~2x one split's share of the cache
    assert s * mk.head_group(heads) * mk.DV * 4 <= 2 * pps * mk.PAGE * mk.DQK * 2


def test_split_plan_examples():
    assert mk.plan_splits(1, 6, 128) == (22, 6)       # 8K tokens, batch 1: 22 splits (the combine's cap), not 128
    assert mk.plan_splits(8, 6, 512) == (16, 32) and mk.plan_splits(64, 6, 512) == (2, 256)   # 128 CTAs, one wave
    assert mk.plan_splits(8, 6, 128, nsm=8) == (1, 128)                                      # no combine
    assert mk.plan_splits(1, 6, 1) == (1, 1)


@needs_dsl
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("hn", mk.HEAD_GROUPS)
def test_builds_compile_with_the_designed_instruction_mix(hn, append):
    """Per page (one ring chunk): 36 score k-steps x (hn / 8) head tiles per warp and 4 P V k-steps x 8 dim tiles
    x (hn / 8) MMAs, the transposed fragments by ldmatrix, no local memory (the accumulators stay in registers),
    shared memory within the 227 KB a CTA may hold; the append adds no MMA."""
    from k3fast.measure.ptxcheck import compiled_ptx
    ptx = compiled_ptx(lambda: mk._compile(hn, append))
    nt = hn // 8
    assert mk.CHUNK == mk.PAGE and mk.NBUF == 2
    assert ptx.count("mma.sync.aligned.m16n8k16") == 36 * nt + mk.CHUNK // 16 * 8 * nt
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans") == mk.CHUNK // 16 * 8
    assert ".local" not in ptx
    assert mk.smem_bytes(hn) <= 227 * 1024
    # the ring: one wait per chunk that leaves the NBUF - 1 newer chunks in flight (and the final drain)
    assert re.search(rf"cp\.async\.wait_group\s+{mk.NBUF - 1};", ptx)
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    # the combine's serial chain is its loop over groups of splits: a group's partial O (COMBINE_LOADS values: all
    # of a thread's output elements of 2 or 4 splits) is loaded with no branch between the loads (one L2 round trip
    # per group)
    runs, run = [], 0
    for line in ptx.splitlines():
        if "ld.global.cg" in line:
            run += 1
        elif "bra" in line or "shfl" in line:
            runs.append(run)
            run = 0
    assert max(runs) >= mk.COMBINE_LOADS


@needs_dsl
@pytest.mark.parametrize("hn", mk.HEAD_GROUPS)
def test_deferred_build_publishes_and_never_combines(hn):
    """defer: the same attention (MMAs, ring), every split publishes its partial; no arrival counter, no combine
    loads (mla_uv_gate's combine build reads the partials)."""
    from k3fast.measure.ptxcheck import compiled_ptx
    ptx = compiled_ptx(lambda: mk._compile(hn, True, True))
    nt = hn // 8
    assert ptx.count("mma.sync.aligned.m16n8k16") == 36 * nt + mk.CHUNK // 16 * 8 * nt
    assert "atom." not in ptx and "ld.global.cg" not in ptx and ".local" not in ptx
    assert mk.compile_key(hn, True, True) == ("mla_latent_decode", hn, "append", "defer")


def test_deferred_plan_fills_a_wave():
    """Without the in-kernel combine the balance cap goes: one wave of splits (at most one CTA per SM)."""
    assert mk.plan_splits(1, 6, 128) == (22, 6)                 # the in-kernel combine's cap
    assert mk.plan_splits(1, 6, 128, defer=True) == (128, 1)    # batch 1, 8K tokens: a page per SM
    assert mk.plan_splits(1, 6, 512, defer=True) == (128, 4)    # 32K: 132 // 1 = 132 splits of 4 pages -> 128
    assert mk.plan_splits(8, 6, 512, defer=True) == mk.plan_splits(8, 6, 512) == (16, 32)
    assert mk.plan_splits(64, 6, 128, defer=True) == (2, 64)
    for n, heads, maxp in [(1, 6, 1), (3, 12, 40), (17, 96, 9), (64, 6, 512)]:
        s, pps = mk.plan_splits(n, heads, maxp, defer=True)
        assert n * -(-heads // mk.head_group(heads)) * s <= max(132, n * -(-heads // mk.head_group(heads)))
        assert (s - 1) * pps < maxp <= s * pps


def _args(N=2, H=6, pages=4, maxp=3, dev="cpu"):
    return dict(q=torch.zeros(N, H, 576, dtype=torch.bfloat16, device=dev),
                kv_cache=torch.zeros(pages, 64, 576, dtype=torch.bfloat16, device=dev),
                block_table=torch.zeros(N, maxp, dtype=torch.int32, device=dev),
                lengths=torch.ones(N, dtype=torch.int32, device=dev))


def test_deferred_workspace_carries_the_uv_gate_combine_scratch():
    """The deferred workspace also holds mla_uv_gate's combine scratch: a 128-wide partial output per (head, latent
    slice, request) and a zeroed arrival counter per head; the in-kernel combine's workspace has neither."""
    ws = mk.make_workspace(3, 12, 10, "cpu", defer=True)
    assert ws["uv_scratch"].shape == (12 * mk.UV_SLICES * 3, 128) and ws["uv_scratch"].dtype == torch.float32
    assert ws["uv_count"].shape == (12,) and ws["uv_count"].dtype == torch.int32 and not ws["uv_count"].any()
    assert "uv_scratch" not in mk.make_workspace(3, 12, 10, "cpu")


@pytest.mark.parametrize("name,bad,exc", [
    ("q", torch.zeros(2, 6, 512, dtype=torch.bfloat16), ValueError),
    ("q", torch.zeros(2, 6, 576, dtype=torch.float16), TypeError),
    ("kv_cache", torch.zeros(4, 32, 576, dtype=torch.bfloat16), ValueError),
    ("kv_cache", torch.zeros(4, 64, 576, dtype=torch.float32), TypeError),
    ("block_table", torch.zeros(3, 3, dtype=torch.int32), ValueError),
    ("block_table", torch.zeros(2, 3, dtype=torch.int64), TypeError),
    ("lengths", torch.zeros(2, dtype=torch.int64), TypeError),
    ("lengths", torch.zeros(3, dtype=torch.int32), ValueError),
])
def test_bad_arguments_refused_by_name(name, bad, exc):
    kw = _args()
    kw[name] = bad
    with pytest.raises(exc, match=name):
        mk.mla_latent_decode(**kw, scale=0.07)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), "0.07"])
def test_bad_scale_refused(scale):
    with pytest.raises(ValueError, match="scale"):
        mk.mla_latent_decode(**_args(), scale=scale)


def test_cpu_tensors_and_unknown_builds_refused():
    with pytest.raises(ValueError, match="CUDA"):
        mk.mla_latent_decode(**_args(), scale=0.07)
    with pytest.raises(ValueError, match="head group"):
        mk.compile_key(12)


def _paging(lengths, maxp=4, n_pages=16):
    """A block table that gives request n the pages 4n .. 4n + maxp - 1 (disjoint), unreached entries -1."""
    lens = torch.tensor(lengths, dtype=torch.int32)
    table = torch.full((len(lengths), maxp), -1, dtype=torch.int32)
    for n, L in enumerate(lengths):
        for p in range(min(maxp, -(-L // mk.PAGE))):
            table[n, p] = (4 * n + p) % n_pages
    return table, lens


def test_check_paging_accepts_what_the_kernel_reads_safely():
    # padding (0), a page edge (64), a full table (256), unreached entries holding -1
    mk.check_paging(*_paging([0, 64, 1, 256]), 16)


@pytest.mark.parametrize("what,edit,name,says", [
    ("a length past the table", lambda t, l: l.__setitem__(1, 4 * mk.PAGE + 1), "lengths", "0..256"),
    ("a negative length", lambda t, l: l.__setitem__(0, -1), "lengths", "request 0"),
    ("a reached page past the pool", lambda t, l: t.__setitem__((2, 0), 16), "block_table", "0..15"),
    ("a reached page below zero", lambda t, l: t.__setitem__((3, 3), -1), "block_table", "page column 3"),
    ("two requests appending to one row", lambda t, l: (t.__setitem__((2, 0), 4), l.__setitem__(2, 64)),
     "block_table", "requests 1 and 2"),
])
def test_check_paging_refuses_by_name(what, edit, name, says):
    table, lens = _paging([0, 64, 1, 256])
    edit(table, lens)
    with pytest.raises(ValueError, match=name) as ei:
        mk.check_paging(table, lens, 16)
    assert says in str(ei.value), f"{what}: {ei.value}"


def test_check_paging_names_the_callers_argument():
    table, lens = _paging([300])
    with pytest.raises(ValueError, match="seqlens: request 0 has 300 rows"):
        mk.check_paging(table, lens, 16, lengths_name="seqlens")
    with pytest.raises(TypeError, match="seqlens"):
        mk.check_paging(table, lens.long(), 16, lengths_name="seqlens")


@needs_dsl
def test_layer_warmup_compiles_the_fused_mla_half():
    """k3fast.layer.warmup with the fast-mla plan compiles the MLA layer's in_proj at its packed width
    [q_a | kv_a | g] (2880 rows at k3_rank16), o_proj + AttnRes #2 and this kernel's build."""
    from k3ref import k3_rank
    from k3fast.kernels import rms_gemv_ring
    from k3fast.kernels._dsl import _CACHE
    from k3fast.layer import CONTENDERS, warmup
    cfg = k3_rank(16)
    warmup(cfg, (3,), (1, 8, 64), plan=CONTENDERS["fast-mla"][0])
    assert mk.compile_key(mk.head_group(cfg.mla_heads), append=True) in _CACHE
    width = cfg.q_lora_rank + cfg.kv_cache_dim + cfg.mla_heads * cfg.v_head_dim
    assert width == 2880
    site = (cfg.num_blocks_before(3), True, -1)
    for key in rms_gemv_ring.compile_keys([1], K=cfg.hidden_size, N=width, sites=[site], eps=cfg.rms_norm_eps):
        assert key in _CACHE, f"the MLA in_proj build {key} was not compiled"
