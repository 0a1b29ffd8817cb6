"""CPU-only checks of k3fast.kernels.oproj_attnres: every key the layer runs compiles for sm_90a (and one key of each
other batch bucket and width the kernel accepts), the PTX has the synchronisation the design relies on, and the host
entry point rejects bad inputs with clear errors."""
import pytest
from ptx_cache import keep_ptx_fixture, needs_dsl
import torch

from k3fast.kernels import oproj_attnres as oa

pytestmark = pytest.mark.compile


# k3_rank16, k3_rank8, full width (k3ref.config: kda_proj = 96*128/t)
SHAPES = {"k3_rank16": 768, "k3_rank8": 1536, "full": 12288}
LAYER_BATCHES = range(1, 9)               # the layer runs the kernel at M <= 8 (one bucket, TG = 1) ...
LAYER_SHAPES = ("k3_rank16", "k3_rank8")  # ... and o_proj input widths up to 1536


keep_ptx = keep_ptx_fixture(oa)


def _ptx_lines(kp, nb, m) -> list[str]:
    """The stripped PTX lines of one build (the cached one when it kept its PTX, else a fresh compile)."""
    ptx = getattr(getattr(oa.get_kernel(kp, nb, m), "artifacts", None), "PTX", None)
    if not ptx:
        from k3fast.measure.ptxcheck import compiled_ptx
        ptx = compiled_ptx(lambda: oa._compile(kp, nb, oa._tg_bucket(m)))
    return [ln.strip() for ln in ptx.splitlines()]


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
    keys = oa.compile_keys(SHAPES.values(), range(1, 9), (1, 16, 32, 64))
    assert len(keys) == len(set(keys)) == 3 * 8 * 4
    assert oa.compile_keys([768], [1, 2], LAYER_BATCHES) == [oa.compile_key(768, 1, 1), oa.compile_key(768, 2, 1)]
    for kp in SHAPES.values():
        for tg in (1, 2, 4, 8):
            s = oa._stages(kp, tg)
            assert (kp // (oa.CHUNK * oa.KS)) % s == 0 and s >= 1


@needs_dsl
@pytest.mark.parametrize("shape", LAYER_SHAPES)
def test_compile_layer_keys(shape):
    """Every build the layer runs: n_blocks 1..8 at M <= 8; the warm-up names the same keys."""
    kp = SHAPES[shape]
    keys = oa.compile_keys([kp], range(1, 9), LAYER_BATCHES)
    assert len(keys) == 8
    for key in keys:
        assert oa.get_kernel(kp, key[2], 1) is not None, key
    assert oa.warmup([kp], range(1, 9), LAYER_BATCHES) == keys


@needs_dsl
@pytest.mark.parametrize("kp,nb,m", [(768, 0, 1), (768, 8, 16), (1536, 8, 32), (768, 8, 64),
                                     (12288, 8, 1), (12288, 8, 64)])
def test_compile_other_keys(kp, nb, m):
    """The rest of what the kernel accepts, one key each: no blocks, the larger token buckets (the most registers at
    n_blocks 8), full width."""
    assert oa.get_kernel(kp, nb, m) is not None


@needs_dsl
@pytest.mark.parametrize("kp,nb,m", [(768, 1, 1), (1536, 8, 1), (768, 8, 16)])
def test_last_arriver_sync(kp, nb, m):
    """No gpu-scope fence: the GEMV CTAs' arrival is a release add after a CTA barrier, the epilogue spins with
    acquire loads, and its departure (a relaxed add) is its last global access, after the stores of x."""
    lines = _ptx_lines(kp, nb, m)
    assert not any(ln.startswith("fence.acq_rel.gpu") for ln in lines)
    assert any(ln.startswith("atom.global.release.add") for ln in lines)
    assert any(ln.startswith("ld.acquire.gpu") for ln in lines)
    glob = [i for i, ln in enumerate(lines) if ln.startswith(("ld.global", "st.global", "atom.global"))]
    last_atom = max(i for i, ln in enumerate(lines) if ln.startswith("atom.global") and "release" not in ln)
    assert any(lines[i].startswith("st.global") for i in glob if i < last_atom)
    assert not any(lines[i].startswith(("ld.global", "st.global")) for i in glob if i > last_atom)


@needs_dsl
@pytest.mark.parametrize("nb", [1, 8])
def test_w_post_loaded_before_the_wait(nb):
    """After the epilogue's last CTA reduction only stores of x remain: w_post was loaded before the PDL wait, so no
    load waits behind a store of x."""
    lines = _ptx_lines(768, nb, 1)
    last_bar = max(i for i, ln in enumerate(lines) if ln.startswith("bar.sync"))
    tail = [ln.split()[0] for ln in lines[last_bar:] if ln.startswith(("ld.global", "st.global"))]
    assert tail and all(op.startswith("st.global") for op in tail)


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
    src = open(oa.__file__).read()
    head = src.split("def _build")[0]
    assert "import cutlass" not in head
