"""CPU-only checks of k3fast.kernels.kda_conv_gate_step: every compile key of the three K3 shapes compiles for
sm_90a, and the host entry point rejects bad inputs with clear errors (no GPU needed)."""
import pytest
import torch

from k3fast.kernels import kda_conv_gate_step as kmod
from k3fast.kernels._dsl import dsl_available
from k3ref.config import k3, k3_rank

pytestmark = pytest.mark.compile

BATCHES = (1, 2, 3, 4, 7, 8, 16, 32, 64)
TS = tuple(range(1, kmod.MAX_T + 1))
SHAPES = {"k3_rank16": k3_rank(16), "k3_rank8": k3_rank(8), "full": k3()}

needs_dsl = pytest.mark.skipif(not dsl_available(), reason="nvidia-cutlass-dsl / apache-tvm-ffi not importable")


def test_proj_width_matches_vllm_packing():
    # k3-spec.md 7.4: 0, 4 and 10 zero pad rows at TP1, TP8, TP16
    for cfg, pad in ((k3(), 0), (k3_rank(8), 4), (k3_rank(16), 10)):
        H, P = cfg.kda_heads, cfg.kda_proj
        assert kmod.proj_width(H) - (4 * P + cfg.kda_head_dim + H) == pad


def test_nsplit_policy():
    assert kmod.choose_nsplit(1, 6, None) == 8 and kmod.choose_nsplit(64, 6, None) == 4
    assert kmod.choose_nsplit(1, 96, None) == 4
    for b in BATCHES:
        for h in (6, 12, 96):
            assert kmod.choose_nsplit(b, h, None) in (4, 8)
            # v9 from head_min request-heads on, the module's HEAD_CTA_MIN when not given
            assert (kmod.choose_nsplit(b, h, 192) == 1) == (b * h >= 192)
            assert kmod.choose_nsplit(b, h) == kmod.choose_nsplit(b, h, kmod.HEAD_CTA_MIN)


def test_head_build_occupancy():
    """v9's shared memory and the resident CTAs asked of ptxas: 3 per SM at T = 1 (all 384 rank16 b64 CTAs in one
    wave), 2 above; the shared memory of that many CTAs fits the SM's 228 KB."""
    for T in range(1, kmod.MAX_T + 1):
        nb = kmod.head_min_blocks(T)
        assert nb == (3 if T == 1 else 2)
        assert nb * (kmod.head_smem_bytes(T) + 1024) <= 228 * 1024
    assert kmod.head_smem_bytes(1) >= 128 * 128 * 4


def test_nsplit_1_key_ignores_the_cluster_options():
    pf = ("proj_first",) if kmod.HEAD_PROJ_FIRST else ()
    key = (kmod.compile_key(6, 1, 1) + ("early_trigger", "head") + (("rows4",) if kmod.HEAD_ROW_GROUP == 4 else ())
           + pf)
    assert kmod.kernel_key(6, 1, 1, row_group=1) == kmod.compile_key(6, 1, 1) + ("head",) + pf
    with pytest.raises(ValueError, match="row_group"):
        kmod.kernel_key(6, 1, 1, row_group=3)
    for opts in ({}, {"preload": True}, {"late_stores": False}, {"dsmem_tx": True, "late_stores": True}):
        assert kmod.kernel_key(6, 1, 1, early_trigger=True, **opts) == key
    assert kmod.compile_keys(6, [64], [1], early_trigger=True, head_min=64) == [key]


@needs_dsl
@pytest.mark.parametrize("shape", list(SHAPES))
def test_compile_all_keys(shape):
    cfg = SHAPES[shape]
    assert cfg.kda_head_dim == kmod.HEAD_DIM and cfg.gate_lower_bound == -5.0
    keys = kmod.compile_keys(cfg.kda_heads, BATCHES, TS, cfg.gate_lower_bound, cfg.rms_norm_eps)
    assert len(keys) == len(set(keys))
    for key in keys:
        fn = kmod._get_compiled(key)
        assert fn is not None, key
    # the cache really caches: a second warm-up builds nothing
    assert kmod.warmup(cfg.kda_heads, BATCHES, TS, cfg.gate_lower_bound, cfg.rms_norm_eps) == keys


@needs_dsl
@pytest.mark.parametrize("shape", list(SHAPES))
def test_compile_head_build(shape):
    """v9 (nsplit 1) at every T, with and without the early trigger (the layer runs it with)."""
    cfg = SHAPES[shape]
    for early in (False, True):
        keys = kmod.compile_keys(cfg.kda_heads, [64], TS, cfg.gate_lower_bound, cfg.rms_norm_eps, early, head_min=1)
        assert len(keys) == len(TS) and all(k[4] == 1 and "head" in k[7:] for k in keys)
        for key in keys:
            assert kmod._get_compiled(key) is not None, key


def _ptx_lines(key) -> list[str]:
    """The stripped PTX lines of one compile key (compiled with --keep-ptx into a scratch directory)."""
    from k3fast.kernels._dsl import TVM_FFI
    from k3fast.measure.ptxcheck import compiled_ptx
    old = kmod.TVM_FFI
    kmod.TVM_FFI = TVM_FFI + " --keep-ptx"
    try:
        return [ln.strip() for ln in compiled_ptx(lambda: kmod._compile(key)).splitlines()]
    finally:
        kmod.TVM_FFI = old


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


def test_T_changes_expected_rows():
    kw = _inputs(B=2, T=4)
    with pytest.raises(ValueError, match="proj"):
        _call(kw, T=2)


@needs_dsl
@pytest.mark.parametrize("early", [False, True])
def test_trigger_placement(early):
    """v2 (early_trigger): the PDL dependents launch right after the wait, before any state store; by default
    after the state writes and their fence (what test_back_to_back_steps relies on)."""
    key = kmod.compile_key(6, 1, kmod.choose_nsplit(1, 6)) + (("early_trigger",) if early else ())
    lines = _ptx_lines(key)
    trig = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
    wait = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    stores = [i for i, ln in enumerate(lines) if ln.strip().startswith("st.global")]
    assert len(trig) == 1 and len(wait) == 1 and stores
    assert (trig[0] < min(stores)) == early and (trig[0] > max(stores)) == (not early) and trig[0] > wait[0]


@needs_dsl
@pytest.mark.parametrize("heads", [6, 96])
def test_preload_issues_proj_loads_before_the_first_sigmoid(heads):
    """v3 (preload, T = 1): after the PDL wait, every global load (the proj values: q/k/v conv inputs, the beta
    logit, the f_a vector, the output gate) comes before the first ex2; v2 has loads after it."""
    base = kmod.compile_key(heads, 1, kmod.choose_nsplit(1, heads)) + ("early_trigger",)
    late = {}
    for pre in (False, True):
        lines = _ptx_lines(base + (("preload",) if pre else ()))
        wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
        first_ex2 = next(i for i, ln in enumerate(lines) if i > wait and ln.startswith("ex2."))
        late[pre] = sum(1 for ln in lines[first_ex2:] if ln.startswith("ld.global"))
    assert late[True] == 0 and late[False] >= 3, late


@needs_dsl
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("heads,batch", [(6, 1), (6, 64)])
def test_late_stores_follow_the_last_cluster_barrier(early, heads, batch):
    """v5 (late_stores): every global store (conv window, state rows, y) comes after the last cluster barrier's
    arrive (a release, MEMBAR.ALL.GPU on sm_90, which would wait for them), and behind the early trigger there is
    no gpu-scope fence; without the early trigger the fence stays between the last store and the trigger."""
    ns = kmod.choose_nsplit(batch, heads, None)          # the cluster builds (v9.1 takes b64 by default)
    key = (kmod.compile_key(heads, 1, ns) + (("early_trigger",) if early else ())
           + (("preload",) if ns == 8 else ()) + ("late_stores",))
    # v5's key; the default (v6 since session 10) adds dsmem_tx to it
    assert key + (("dsmem_tx",) if kmod.DSMEM_TX else ()) in kmod.compile_keys(heads, [batch], [1], early_trigger=early,
                                                                               head_min=None)
    lines = _ptx_lines(key)
    arrives = [i for i, ln in enumerate(lines) if ln.startswith("barrier.cluster.arrive")]
    stores = [i for i, ln in enumerate(lines) if ln.startswith("st.global")]
    fences = [i for i, ln in enumerate(lines) if ln.startswith("fence.acq_rel.gpu")]
    trig = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
    assert len(arrives) >= 3 and stores and len(trig) == 1
    assert min(stores) > max(arrives)
    if early:
        assert not fences and trig[0] < min(stores)
    else:
        assert len(fences) == 1 and max(stores) < fences[0] < trig[0]


@needs_dsl
@pytest.mark.parametrize("heads,batch,T", [(6, 1, 1), (6, 64, 1), (12, 8, 2)])
def test_dsmem_tx_has_no_cluster_barrier_after_the_start(heads, batch, T):
    """v6: after the start's relaxed arrive (and its wait), no barrier.cluster and no gpu-scope fence: the alpha
    (D x T floats) and norm (NS x T) exchanges are st.async with complete_tx on two mbarriers that expect exactly
    those bytes."""
    ns = kmod.choose_nsplit(batch, heads, None)          # the cluster builds (v9.1 takes b64 by default)
    key = (kmod.compile_key(heads, T, ns) + ("early_trigger",) + (("preload",) if ns == 8 and T == 1 else ())
           + ("late_stores", "dsmem_tx"))
    assert kmod.kernel_key(heads, T, ns, early_trigger=True, dsmem_tx=True) == key
    if kmod.DSMEM_TX:
        assert key in kmod.compile_keys(heads, [batch], [T], early_trigger=True, head_min=None)
    lines = _ptx_lines(key)
    arrives = [ln for ln in lines if ln.startswith("barrier.cluster.arrive")]
    assert len(arrives) == 1 and ".relaxed" in arrives[0]
    assert not any(ln.startswith("fence.acq_rel.gpu") for ln in lines)
    assert sum(ln.startswith("st.async.shared::cluster.mbarrier::complete_tx::bytes") for ln in lines) >= 2
    assert sum(ln.startswith("mbarrier.init") for ln in lines) == 2
    assert any(ln.startswith("fence.mbarrier_init.release.cluster") for ln in lines)
    with pytest.raises(ValueError, match="late_stores"):
        _call(_inputs(), dsmem_tx=True, late_stores=False)


@needs_dsl
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("T", [1, 3])
def test_head_build_bulk_copies(early, T):
    """v9.1 (proj_first=False since v9.2): the state arrives as HEAD_CHUNKS bulk copies, each on its own mbarrier, all
    issued before the PDL wait
    and after the thread's own register loads; a chunk leaves by one bulk store (issued by the chunk's first lane,
    after a proxy fence and the chunk's named barrier), with no cluster instruction anywhere. Behind the early
    trigger the storers wait only for the stores' reads of shared memory; at the end trigger they wait for their
    completion and fence before the dependents launch (a second KDA step's pre-wait copies read the state)."""
    key = kmod.kernel_key(6, T, 1, early_trigger=early, proj_first=False)
    lines = _ptx_lines(key)
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    trig = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
    loads = [i for i, ln in enumerate(lines) if ln.startswith("cp.async.bulk.shared::cluster.global")]
    stores = [i for i, ln in enumerate(lines) if ln.startswith("cp.async.bulk.global.shared::cta")]
    waits = [ln for ln in lines if ln.startswith("cp.async.bulk.wait_group")]
    fence_proxy = [i for i, ln in enumerate(lines) if ln.startswith("fence.proxy.async")]
    inits = [i for i, ln in enumerate(lines) if ln.startswith("mbarrier.init")]
    reg_loads = [i for i, ln in enumerate(lines) if ln.startswith("ld.global")]
    named = [i for i, ln in enumerate(lines) if ln.startswith(("bar.sync", "barrier.sync")) and "," in ln]
    assert len(loads) == kmod.HEAD_CHUNKS and len(inits) == kmod.HEAD_CHUNKS and max(loads) < wait
    assert sum(1 for i in reg_loads if i < min(loads)) >= 10       # slot, conv windows / weights, W_fb, dt_bias
    assert len(stores) == 1 and fence_proxy and named and max(fence_proxy) < min(named) < min(stores)
    assert not any("cluster" in ln for ln in lines if ln.startswith(("barrier.cluster", "mapa", "st.async")))
    assert len(trig) == 1 and len(waits) == 1 and (".read" in waits[0]) == early
    if early:
        assert wait < trig[0] < min(stores)
    else:
        fences = [i for i, ln in enumerate(lines) if ln.startswith("fence.acq_rel.gpu")]
        assert len(fences) == 1 and max(stores) < fences[0] < trig[0]


@needs_dsl
@pytest.mark.parametrize("T", [1, 4])
def test_proj_first_issues_the_state_copies_after_the_projections(T):
    """v9.2: the first token's projection loads come right after the PDL wait, then a CTA barrier, then the state's
    HEAD_CHUNKS bulk copies (after the wait, unlike v9.1, where they precede it); the key carries "proj_first" and
    the option belongs to the nsplit 1 build only."""
    key = kmod.kernel_key(6, T, 1, early_trigger=True, proj_first=True)
    assert key == kmod.kernel_key(6, T, 1, early_trigger=True, proj_first=False) + ("proj_first",)
    assert kmod.kernel_key(6, T, 1, early_trigger=True) == key      # the default since s84
    assert kmod.kernel_key(6, T, 4, proj_first=True) == kmod.kernel_key(6, T, 4)
    lines = _ptx_lines(key)
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    loads = [i for i, ln in enumerate(lines) if ln.startswith("cp.async.bulk.shared::cluster.global")]
    bars = [i for i, ln in enumerate(lines) if ln.startswith(("bar.sync", "barrier.sync")) and i > wait]
    proj = [i for i, ln in enumerate(lines) if ln.startswith("ld.global") and wait < i < min(loads)]
    assert len(loads) == kmod.HEAD_CHUNKS and wait < bars[0] < min(loads)
    assert sum(1 for i in proj if i < bars[0]) >= 3     # q / k (or v) channel and the f_a vector, at least


def test_v3_order_runs_the_barrier_exchanges():
    """late_stores=False alone (v3's order: fast-s17kda, bench @v3) builds v5's barrier exchanges, not v6's, whatever
    the module default; both together is the error above. (Session 10: with v6 the default, fast-s17kda raised in
    every GPU test of the attention half until this rule.)"""
    base = kmod.compile_key(6, 1, 8) + ("early_trigger", "preload")
    assert kmod.kernel_key(6, 1, 8, early_trigger=True, late_stores=False) == base
    assert kmod.kernel_key(6, 1, 8, early_trigger=True, late_stores=True, dsmem_tx=False) == base + ("late_stores",)
    with pytest.raises(ValueError, match="late_stores"):
        kmod.kernel_key(6, 1, 8, late_stores=False, dsmem_tx=True)
