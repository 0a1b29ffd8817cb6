"""Compile every oproj_attnres key for the K3 shapes on the CPU (sm_90a), plus host-side input checks."""
import pytest
import torch

from k3fast.kernels import oproj_attnres as oa
from k3fast.kernels._dsl import dsl_available

pytestmark = pytest.mark.compile

needs_dsl = pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")

# k3_rank16, k3_rank8, full width (k3ref.config: kda_proj = 96*128/t)
SHAPES = {"k3_rank16": 768, "k3_rank8": 1536, "full": 12288}
BATCH_BUCKETS = (1, 16, 32, 64)           # TG = 1, 2, 4, 8


def test_shapes_match_config():
    from k3ref.config import k3, k3_rank
    assert k3_rank(16).kda_proj == SHAPES["k3_rank16"]
    assert k3_rank(8).kda_proj == SHAPES["k3_rank8"]
    assert k3().kda_proj == SHAPES["full"]
    assert k3().hidden_size == oa.D
    # pre-MLP mix sees ceil(l/12) + [boundary] blocks: 1..8 over the 93 layers
    cfg = k3()
    nbs = {cfg.num_blocks_before(l) + int(cfg.is_block_boundary(l)) for l in range(cfg.num_hidden_layers)}
    assert nbs == set(range(1, 9))


def test_compile_keys_and_buckets():
    assert [oa._tg_bucket(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [1, 1, 2, 2, 4, 4, 8, 8]
    keys = oa.compile_keys(SHAPES.values(), range(1, 9), BATCH_BUCKETS)
    assert len(keys) == 3 * 8 * 4
    for kp in SHAPES.values():
        for tg in (1, 2, 4, 8):
            s = oa._stages(kp, tg)
            assert (kp // (oa.CHUNK * oa.KS)) % s == 0 and s >= 1


@needs_dsl
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch", BATCH_BUCKETS)
def test_compile_all_n_blocks(shape, batch):
    kp = SHAPES[shape]
    for nb in range(1, 9):
        fn = oa.get_kernel(kp, nb, batch)
        assert fn is not None


def test_split_rows_rule():
    """v1.6 takes 32-row CTAs exactly where 64 rows leave chunks for after the wait, 32 rows leave none, and the
    build stays at 128 registers (ptxas: M <= 8, n_blocks <= SPLIT_MAX_NB): rank8 only."""
    for kp in SHAPES.values():
        for nb in range(9):
            for tg in (1, 2, 4, 8):
                want = 32 if (kp == 1536 and tg == 1 and nb <= oa.SPLIT_MAX_NB) else oa.ROWS
                assert oa._rows(kp, nb, tg, True) == want, (kp, nb, tg)
                assert oa._rows(kp, nb, tg, False) == oa.ROWS
    # 64 rows: 24 chunks per warp, 12 in flight before the wait; 32 rows: 12 and 12
    assert oa._stages(1536, 1) * 2 == 1536 // (oa.CHUNK * oa.KS)
    assert oa._stages(1536, 1, 4) == 1536 // (oa.CHUNK * 4)


@needs_dsl
@pytest.mark.parametrize("nb", [1, 5])
def test_compile_split_rows(nb):
    """The v1.6 build compiles (its own cache key); where ptxas is at hand it keeps 128 registers and no spills,
    so two of its 256-thread CTAs share an SM (the reason SPLIT_MAX_NB is 5)."""
    from k3fast.kernels._dsl import TVM_FFI
    from k3fast.measure.ptxcheck import compiled_ptx, find_sass_tools, ptxas_resources
    assert oa.get_kernel(1536, nb, 1, split_rows=True) is not oa.get_kernel(1536, nb, 1, split_rows=False)
    tools = find_sass_tools()
    if tools is None:
        return
    old = oa.TVM_FFI
    oa.TVM_FFI = TVM_FFI + " --keep-ptx"
    try:
        ptx = compiled_ptx(lambda: oa._compile(1536, nb, 1, oa.PRELOAD_WPOST, oa.LEAN_SYNC, 32))
    finally:
        oa.TVM_FFI = old
    res = ptxas_resources(ptx, tools[0])
    assert res["registers"] <= 128 and res["spill_store_bytes"] == 0, res


@needs_dsl
def test_compile_zero_blocks():
    assert oa.get_kernel(768, 0, 1) is not None


# ---------------------------------------------------------------- host-side checks (CPU tensors)
def _inputs(m=2, kp=768, nb=3, dev="cpu"):
    bf = torch.bfloat16
    return dict(y=torch.zeros(m, kp, dtype=bf, device=dev), w_o=torch.zeros(oa.D, kp, dtype=bf, device=dev),
                blocks=torch.zeros(m, 8, oa.D, dtype=bf, device=dev), n_blocks=nb,
                partial=torch.zeros(m, oa.D, dtype=bf, device=dev),
                u_mlp=torch.zeros(oa.D, dtype=torch.float32, device=dev),
                w_post=torch.zeros(oa.D, dtype=bf, device=dev))


def _call(**kw):
    args = _inputs()
    extra = {k: kw.pop(k) for k in list(kw) if k in ("eps", "boundary", "out_x", "out_partial", "counter")}
    args.update(kw)
    return oa.oproj_attnres(args["y"], args["w_o"], args["blocks"], args["n_blocks"], args["partial"],
                            args["u_mlp"], args["w_post"], **extra)


def test_rejects_cpu_device():
    with pytest.raises(ValueError, match="CUDA"):
        _call()


@pytest.mark.parametrize("bad, exc, msg", [
    (dict(y=torch.zeros(2, 768, dtype=torch.float16)), TypeError, "y: expected dtype"),
    (dict(y=torch.zeros(2, 1000, dtype=torch.bfloat16)), ValueError, "Kp must be"),
    (dict(y=torch.zeros(65, 768, dtype=torch.bfloat16)), ValueError, "batch M"),
    (dict(y=torch.zeros(0, 768, dtype=torch.bfloat16)), ValueError, "batch M"),
    (dict(n_blocks=9), ValueError, "n_blocks"),
    (dict(n_blocks=-1), ValueError, "n_blocks"),
    (dict(n_blocks=3.0), ValueError, "n_blocks"),
    (dict(w_o=torch.zeros(7168, 1536, dtype=torch.bfloat16)), ValueError, "w_o: expected shape"),
    (dict(w_o=torch.zeros(7168, 768, dtype=torch.float32)), TypeError, "w_o: expected dtype"),
    (dict(blocks=torch.zeros(2, 2, 7168, dtype=torch.bfloat16)), ValueError, "block slots"),
    (dict(blocks=torch.zeros(3, 8, 7168, dtype=torch.bfloat16)), ValueError, "blocks: expected shape"),
    (dict(partial=torch.zeros(2, 7168, dtype=torch.float32)), TypeError, "partial: expected dtype"),
    (dict(u_mlp=torch.zeros(7168, dtype=torch.bfloat16)), TypeError, "u_mlp: expected dtype"),
    (dict(w_post=torch.zeros(7167, dtype=torch.bfloat16)), ValueError, "w_post: expected shape"),
    (dict(partial=torch.zeros(2, 2 * 7168, dtype=torch.bfloat16)[:, ::2]), ValueError, "contiguous"),
    (dict(eps=0.0), ValueError, "eps"),
    (dict(out_x=torch.zeros(2, 7168, dtype=torch.float32)), TypeError, "out_x: expected dtype"),
    (dict(counter=torch.zeros(4, dtype=torch.int64)), TypeError, "counter: expected dtype"),
])
def test_bad_inputs(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        _call(**bad)


def test_module_imports_without_cutlass_symbols():
    # the module must not import cutlass at import time (checked by name, cheap)
    import importlib, sys
    src = open(oa.__file__).read()
    head = src.split("def _build")[0]
    assert "import cutlass" not in head


@needs_dsl
@pytest.mark.parametrize("kp,nb,tg", [(768, 1, 1), (1536, 8, 1), (768, 8, 2)])
def test_lean_sync_drops_the_fences(kp, nb, tg):
    """v1.5 (lean_sync, the default): no gpu-scope fence is left (v1.4 has two: the GEMV threads' and the epilogue's
    after its spin), the arrival is still a release, and the departure is the last global access of the epilogue,
    after the stores of x."""
    from k3fast.kernels._dsl import TVM_FFI
    from k3fast.measure.ptxcheck import compiled_ptx
    old = oa.TVM_FFI
    oa.TVM_FFI = TVM_FFI + " --keep-ptx"
    try:
        ptx = {lean: compiled_ptx(lambda lean=lean: oa._compile(kp, nb, tg, True, lean)) for lean in (False, True)}
    finally:
        oa.TVM_FFI = old
    assert ptx[False].count("fence.acq_rel.gpu") == 2 and ptx[True].count("fence.acq_rel.gpu") == 0
    assert "atom.global.release.add" in ptx[True] and "ld.acquire.gpu" in ptx[True]
    lines = [ln.strip() for ln in ptx[True].splitlines()]
    glob = [i for i, ln in enumerate(lines) if ln.startswith(("ld.global", "st.global", "atom.global"))]
    last_atom = max(i for i, ln in enumerate(lines) if ln.startswith("atom.global") and "release" not in ln)
    assert any(lines[i].startswith("st.global") for i in glob if i < last_atom)
    assert not any(lines[i].startswith(("ld.global", "st.global")) for i in glob if i > last_atom)


@needs_dsl
@pytest.mark.parametrize("nb", [1, 8])
def test_preload_wpost_moves_the_last_loads(nb):
    """v1.2 (preload_wpost): after the epilogue's last CTA reduction only stores of x remain (w_post was loaded
    before the PDL wait); by default each store of x follows a load of w_post."""
    from k3fast.kernels._dsl import TVM_FFI
    from k3fast.measure.ptxcheck import compiled_ptx
    old = oa.TVM_FFI
    oa.TVM_FFI = TVM_FFI + " --keep-ptx"
    try:
        tails = {}
        for pre in (False, True):
            lines = [ln.strip() for ln in compiled_ptx(lambda: oa._compile(768, nb, 1, pre)).splitlines()]
            last_bar = max(i for i, ln in enumerate(lines) if ln.startswith("bar.sync"))
            tails[pre] = [ln.split()[0] for ln in lines[last_bar:] if ln.startswith(("ld.global", "st.global"))]
    finally:
        oa.TVM_FFI = old
    assert any(op.startswith("ld.global") for op in tails[False])
    assert tails[True] and all(op.startswith("st.global") for op in tails[True])
