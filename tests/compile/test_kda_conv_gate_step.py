"""CPU-only checks of k3fast.kernels.kda_conv_gate_step: every kernel the layer runs at the three K3 shapes compiles
for sm_90a, the PTX has the structure the design relies on, and the host entry point rejects bad inputs with clear
errors (no GPU needed)."""
import pytest
from ptx_cache import keep_ptx_fixture, needs_dsl
import torch

from k3fast.kernels import kda_conv_gate_step as kmod
from k3ref.config import k3, k3_rank

pytestmark = pytest.mark.compile

BATCHES = (1, 2, 3, 4, 7, 8, 16, 32, 64)   # every split at every shape (the rule depends on batch x heads)
TS = (1, 4, 8)
SHAPES = {"k3_rank16": k3_rank(16), "k3_rank8": k3_rank(8), "full": k3()}


keep_ptx = keep_ptx_fixture(kmod)


def _ptx_lines(key) -> list[str]:
    """The stripped PTX lines of one build (the cached one when it kept its PTX, else a fresh compile)."""
    ptx = getattr(getattr(kmod._get_compiled(key), "artifacts", None), "PTX", None)
    if not ptx:
        from k3fast.measure.ptxcheck import compiled_ptx
        ptx = compiled_ptx(lambda: kmod._compile(key))
    return [ln.strip() for ln in ptx.splitlines()]


def _key(heads, batch, T=1, early=True):
    return kmod.compile_key(heads, T, kmod.choose_nsplit(batch, heads), early_trigger=early)


def test_proj_width_matches_vllm_packing():
    # docs/k3-layer.md 7.4: 0, 4 and 10 zero pad rows at TP1, TP8, TP16
    for cfg, pad in ((k3(), 0), (k3_rank(8), 4), (k3_rank(16), 10)):
        H, P = cfg.kda_heads, cfg.kda_proj
        assert kmod.proj_width(H) - (4 * P + cfg.kda_head_dim + H) == pad


def test_nsplit_policy():
    assert kmod.choose_nsplit(1, 6) == 8 and kmod.choose_nsplit(10, 6) == 8 and kmod.choose_nsplit(11, 6) == 4
    assert kmod.choose_nsplit(16, 6) == 4 and kmod.choose_nsplit(32, 6) == 1 and kmod.choose_nsplit(64, 6) == 1
    assert kmod.choose_nsplit(5, 12) == 8 and kmod.choose_nsplit(8, 12) == 4 and kmod.choose_nsplit(16, 12) == 1
    assert kmod.choose_nsplit(1, 96) == 4 and kmod.choose_nsplit(2, 96) == 1
    for b in range(1, 65):
        for h in (6, 12, 96):
            rh = b * h
            assert kmod.choose_nsplit(b, h) == (1 if rh >= kmod.HEAD_CTA_MIN else 8 if rh <= 64 else 4)


def test_head_build_occupancy():
    """The head build's shared memory and the resident CTAs asked of ptxas: 3 per SM at T = 1 (all 384 rank16 b64
    CTAs in one wave), 2 above; the shared memory of that many CTAs fits the SM's 228 KB."""
    for T in range(1, kmod.MAX_T + 1):
        nb = kmod.head_min_blocks(T)
        assert nb == (3 if T == 1 else 2)
        assert nb * (kmod.head_smem_bytes(T) + 1024) <= 228 * 1024
    assert kmod.head_smem_bytes(1) >= 128 * 128 * 4


def test_compile_keys():
    keys = kmod.compile_keys(6, BATCHES, TS, early_trigger=True)
    assert len(keys) == len(set(keys)) == 3 * len(TS)          # nsplit 8, 4 and 1 at each T
    assert all(k[-1] == "early_trigger" for k in keys)
    assert kmod.compile_keys(6, [1, 2], [1]) == [kmod.compile_key(6, 1, 8)]
    assert {k[4] for k in kmod.compile_keys(96, BATCHES)} == {4, 1}


@needs_dsl
@pytest.mark.parametrize("shape", list(SHAPES))
def test_compile_layer_keys(shape):
    """Every build the layer runs (the early trigger) at batches 1..64 and T = 1 / 4 / 8."""
    cfg = SHAPES[shape]
    assert cfg.kda_head_dim == kmod.HEAD_DIM and cfg.gate_lower_bound == -5.0
    keys = kmod.compile_keys(cfg.kda_heads, BATCHES, TS, cfg.gate_lower_bound, cfg.rms_norm_eps, early_trigger=True)
    for key in keys:
        assert kmod._get_compiled(key) is not None, key
    # the cache really caches: a second warm-up builds nothing new and names the same keys
    assert kmod.warmup(cfg.kda_heads, BATCHES, TS, cfg.gate_lower_bound, cfg.rms_norm_eps, early_trigger=True) == keys


# ----------------------------------------------------------------------------- PTX structure

@needs_dsl
@pytest.mark.parametrize("early", [False, True])
def test_cluster_build_trigger_and_write_backs(early):
    """The cluster build: every global store (y, conv window, state rows) comes after the second exchange's mbarrier
    wait. With the early trigger the dependents launch right after the PDL wait, before any store, and no gpu-scope
    fence is left; at the end trigger one fence sits between the last store and the trigger (what
    test_back_to_back_steps relies on)."""
    lines = _ptx_lines(_key(6, 1, early=early))
    trig = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
    wait = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    stores = [i for i, ln in enumerate(lines) if ln.startswith("st.global")]
    mb_waits = [i for i, ln in enumerate(lines) if ln.startswith("mbarrier.try_wait")]
    fences = [i for i, ln in enumerate(lines) if ln.startswith("fence.acq_rel.gpu")]
    assert len(trig) == 1 and len(wait) == 1 and stores and trig[0] > wait[0]
    assert min(stores) > max(mb_waits)
    if early:
        assert not fences and trig[0] < min(stores)
    else:
        assert len(fences) == 1 and max(stores) < fences[0] < trig[0]


@needs_dsl
@pytest.mark.parametrize("heads,batch,T", [(6, 1, 1), (6, 16, 1), (12, 8, 4)])
def test_cluster_exchanges_are_st_async(heads, batch, T):
    """After the start's relaxed arrive (and its wait), no barrier.cluster and no gpu-scope fence: the alpha (D x T
    floats) and norm (NS x T) exchanges are st.async with complete_tx on two mbarriers."""
    key = _key(heads, batch, T)
    assert key[4] in (4, 8)
    lines = _ptx_lines(key)
    arrives = [ln for ln in lines if ln.startswith("barrier.cluster.arrive")]
    assert len(arrives) == 1 and ".relaxed" in arrives[0]
    assert not any(ln.startswith("fence.acq_rel.gpu") for ln in lines)
    assert sum(ln.startswith("st.async.shared::cluster.mbarrier::complete_tx::bytes") for ln in lines) >= 2
    assert sum(ln.startswith("mbarrier.init") for ln in lines) == 2
    assert any(ln.startswith("fence.mbarrier_init.release.cluster") for ln in lines)


@needs_dsl
@pytest.mark.parametrize("heads,batch4", [(6, 16), (12, 8)])
def test_proj_loads_before_the_first_sigmoid(heads, batch4):
    """At T = 1 every global load after the PDL wait (the q/k/v conv inputs, the beta logit, the f_a vector, the
    output gate) comes before the first ex2 in the build that preloads them (nsplit 8, b1); nsplit 4 (b batch4)
    loads them where they are used."""
    late = {}
    for batch in (1, batch4):
        key = _key(heads, batch)
        lines = _ptx_lines(key)
        wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
        first_ex2 = next(i for i, ln in enumerate(lines) if i > wait and ln.startswith("ex2."))
        late[key[4]] = sum(1 for ln in lines[first_ex2:] if ln.startswith("ld.global"))
    assert late[8] == 0 and late[4] >= 3, late


@needs_dsl
@pytest.mark.parametrize("early,T", [(False, 1), (True, 1), (True, 4)])
def test_head_build_bulk_copies(early, T):
    """The head build: after the PDL wait every thread requests its first token's projections, a CTA barrier, then
    the state arrives as HEAD_CHUNKS bulk copies, each on its own mbarrier; a chunk leaves by one bulk store (issued
    by the chunk's first lane, after a proxy fence and the chunk's named barrier), with no cluster instruction
    anywhere. Behind the early trigger the storers wait only for the stores' reads of shared memory; at the end
    trigger they wait for their completion and fence before the dependents launch (a second KDA step reads the
    state before its wait)."""
    key = kmod.compile_key(6, T, 1, early_trigger=early)
    assert key == _key(6, 64, T, early)
    lines = _ptx_lines(key)
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    trig = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
    loads = [i for i, ln in enumerate(lines) if ln.startswith("cp.async.bulk.shared::cluster.global")]
    stores = [i for i, ln in enumerate(lines) if ln.startswith("cp.async.bulk.global.shared::cta")]
    waits = [ln for ln in lines if ln.startswith("cp.async.bulk.wait_group")]
    fence_proxy = [i for i, ln in enumerate(lines) if ln.startswith("fence.proxy.async")]
    inits = [i for i, ln in enumerate(lines) if ln.startswith("mbarrier.init")]
    bars = [i for i, ln in enumerate(lines) if ln.startswith(("bar.sync", "barrier.sync")) and i > wait]
    named = [i for i, ln in enumerate(lines) if ln.startswith(("bar.sync", "barrier.sync")) and "," in ln]
    proj = [i for i, ln in enumerate(lines) if ln.startswith("ld.global") and wait < i < bars[0]]
    assert len(loads) == kmod.HEAD_CHUNKS and len(inits) == kmod.HEAD_CHUNKS and wait < bars[0] < min(loads)
    assert len(proj) >= 3             # the q / k (or v) channel and the f_a vector, at least
    assert len(stores) == 1 and fence_proxy and named and max(fence_proxy) < min(named) < min(stores)
    assert not any("cluster" in ln for ln in lines if ln.startswith(("barrier.cluster", "mapa", "st.async")))
    assert len(trig) == 1 and len(waits) == 1 and (".read" in waits[0]) == early
    if early:
        assert wait < trig[0] < min(stores)
    else:
        fences = [i for i, ln in enumerate(lines) if ln.startswith("fence.acq_rel.gpu")]
        assert len(fences) == 1 and max(stores) < fences[0] < trig[0]


# ----------------------------------------------------------------------------- host-side validation

def _inputs(H=6, B=2, T=1, S=4):
    D = 128
    P = H * D
    bf, f32 = torch.bfloat16, torch.float32
    return dict(
        proj=torch.zeros(B * T, kmod.proj_width(H), dtype=bf),
        w_fb=torch.zeros(P, D, dtype=bf),
        conv_w=torch.zeros(3 * P, 4, dtype=f32),
        a_log=torch.zeros(H, dtype=f32),
        dt_bias=torch.zeros(P, dtype=f32),
        o_norm=torch.zeros(D, dtype=f32),
        conv_state=torch.zeros(S, 3 * P, 3, dtype=bf),
        rec_state=torch.zeros(S, H, D, D, dtype=f32),
        slots=torch.zeros(B, dtype=torch.int32),
    )


def _call(kw, **opts):
    opts.setdefault("heads", 6)
    return kmod.kda_conv_gate_step(**kw, **opts)


def test_cpu_tensors_rejected():
    with pytest.raises(ValueError, match="CUDA"):
        _call(_inputs())


@pytest.mark.parametrize("name,bad,exc", [
    ("proj", torch.zeros(2, kmod.proj_width(6), dtype=torch.float16), TypeError),
    ("proj", torch.zeros(2, 4 * 768 + 128 + 6, dtype=torch.bfloat16), ValueError),   # unpadded width
    ("proj", torch.zeros(3, kmod.proj_width(6), dtype=torch.bfloat16), ValueError),  # rows != B*T
    ("w_fb", torch.zeros(768, 128, dtype=torch.float32), TypeError),
    ("w_fb", torch.zeros(128, 768, dtype=torch.bfloat16), ValueError),
    ("conv_w", torch.zeros(3 * 768, 4, dtype=torch.bfloat16), TypeError),
    ("conv_w", torch.zeros(3 * 768, 1, 4, dtype=torch.float32), ValueError),
    ("a_log", torch.zeros(128, dtype=torch.float32), ValueError),
    ("dt_bias", torch.zeros(768, dtype=torch.bfloat16), TypeError),
    ("o_norm", torch.zeros(768, dtype=torch.float32), ValueError),
    ("conv_state", torch.zeros(4, 3 * 768, 3, dtype=torch.float32), TypeError),
    ("conv_state", torch.zeros(4, 3, 3 * 768, dtype=torch.bfloat16), ValueError),
    ("conv_state", torch.zeros(5, 3 * 768, 3, dtype=torch.bfloat16), ValueError),    # S mismatch
    ("rec_state", torch.zeros(4, 6, 128, 128, dtype=torch.bfloat16), TypeError),
    ("rec_state", torch.zeros(4, 12, 128, 128, dtype=torch.float32), ValueError),
    ("slots", torch.zeros(2, dtype=torch.int64), TypeError),
    ("slots", torch.zeros(2, 1, dtype=torch.int32), ValueError),
])
def test_bad_tensor(name, bad, exc):
    kw = _inputs()
    kw[name] = bad
    with pytest.raises(exc, match=name):
        _call(kw)


def test_non_contiguous_rejected():
    kw = _inputs()
    kw["rec_state"] = torch.zeros(4, 6, 128, 128).transpose(2, 3)
    with pytest.raises(ValueError, match="rec_state"):
        _call(kw)


def test_bad_out():
    with pytest.raises(ValueError, match="out"):
        _call(_inputs(), out=torch.zeros(2, 700, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out"):
        _call(_inputs(), out=torch.zeros(2, 768, dtype=torch.float32))


@pytest.mark.parametrize("opts,match", [
    (dict(T=0), "T must"), (dict(T=9), "T must"), (dict(head_dim=64), "head_dim"),
    (dict(heads=0), "heads"), (dict(lower_bound=-6.0), "lower_bound"), (dict(lower_bound=0.0), "lower_bound"),
])
def test_bad_options(opts, match):
    with pytest.raises(ValueError, match=match):
        _call(_inputs(), **opts)


def test_bad_forced_split():
    with pytest.raises(ValueError, match="nsplit"):
        kmod._kda_step(**_inputs(), heads=6, nsplit=2)


def test_T_changes_expected_rows():
    kw = _inputs(B=2, T=4)
    with pytest.raises(ValueError, match="proj"):
        _call(kw, T=2)


def test_slot_strided_pools_pass_validation():
    """vLLM's pools (slots a page apart, each slot's rows compact) pass every check but the device one."""
    kw = _inputs()
    S = kw["rec_state"].shape[0]
    page = 6 * 128 * 128 + 1028                                   # floats per page: rows compact, stride % 4 == 0
    buf = torch.zeros(S * page)
    kw["rec_state"] = buf.as_strided((S, 6, 128, 128), (page, 128 * 128, 128, 1))
    cbuf = torch.zeros(S * (3 * 768 * 3 + 50), dtype=torch.bfloat16)
    kw["conv_state"] = cbuf.as_strided((S, 3 * 768, 3), (3 * 768 * 3 + 50, 3, 1))
    with pytest.raises(ValueError, match="CUDA"):
        _call(kw)


@pytest.mark.parametrize("name,make,match", [
    # vLLM's default SD conv layout seen as [S, 3P, 3]: each slot's rows are not compact
    ("conv_state", lambda S: torch.zeros(S, 3, 3 * 768, dtype=torch.bfloat16).transpose(1, 2), "compact"),
    # a slot stride that breaks the 16-byte rows of the bulk state copies
    ("rec_state", lambda S: torch.zeros(S * (6 * 128 * 128 + 2)).as_strided(
        (S, 6, 128, 128), (6 * 128 * 128 + 2, 128 * 128, 128, 1)), "divisible by 4"),
])
def test_pool_layouts_refused(name, make, match):
    kw = _inputs()
    kw[name] = make(kw["rec_state"].shape[0])
    with pytest.raises(ValueError, match=match):
        _call(kw)


@pytest.mark.parametrize("slots,n,null_slot,match", [
    ([0, 1, 4], 4, False, "past the state pool's 4 slots"),
    ([2, -1, 2], 4, False, "share slot 2"),
    ([1, 0, 0], 4, True, None),                   # slot 0 is padding in the null_slot build: may repeat
    ([0, 0], 4, False, "share slot 0"),
    ([-1, -1, 3], 4, False, None),
])
def test_slot_indices_checked_on_the_host(slots, n, null_slot, match):
    """Eager calls read the slots first: an index past the pool or a slot two requests share is refused by name."""
    t = torch.tensor(slots, dtype=torch.int32)
    if match is None:
        kmod.check_slot_indices(t, n, null_slot=null_slot)
    else:
        with pytest.raises(ValueError, match=match):
            kmod.check_slot_indices(t, n, null_slot=null_slot)


def test_slot_indices_check_refuses_bad_tensors():
    with pytest.raises(TypeError, match="slots"):
        kmod.check_slot_indices(torch.zeros(2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="slots"):
        kmod.check_slot_indices(torch.zeros(2, 1, dtype=torch.int32), 4)
