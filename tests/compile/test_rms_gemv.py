"""Compile every k3fast.kernels.rms_gemv kernel key the K3 shapes need (CPU, CUTE_DSL_ARCH=sm_90a) + host-check tests."""
import pytest
import torch

from k3fast.kernels import rms_gemv as R
from k3fast.kernels._dsl import COMPILE_LOG, dsl_available
from k3ref.config import k3, k3_rank
from attnres_cases import k3_attnres_variants

pytestmark = pytest.mark.compile

CONFIGS = [k3_rank(16), k3_rank(8), k3()]
BATCHES = [1, 2, 3, 4, 7, 8, 16, 32, 64]
needs_dsl = pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm_ffi not importable")


def _gemv_shapes():
    shapes = set()
    for cfg in CONFIGS:
        shapes |= set(R.k3_gemv_shapes(cfg).values())
    return sorted(shapes)


def test_shapes_and_configs():
    assert R.k3_gemv_shapes(k3_rank(16))["in_proj"] == (3216, 7168)
    assert R.k3_gemv_shapes(k3_rank(8))["in_proj"] == (6288, 7168)
    assert R.k3_gemv_shapes(k3())["in_proj"] == (49376, 7168)
    for (N, K) in _gemv_shapes():
        rpc, ks = R._fma_config(N, K)
        assert rpc * ks == R.FMA_WARPS and 16 % rpc == 0
        for MB in (8, 16, 32, 64):
            rtw, rt, ks = R._mma_config(N, K, MB)
            assert rt * ks == R.MMA_WARPS and rtw in (1, 2)
    for N in (3216, 6288, 49376):
        rpc, ks, grid = R._fused_config(N, 7168)
        assert rpc * ks == R.FUSED_WARPS and 1 <= grid <= R.NUM_SMS and N % rpc == 0
    assert [R.bucket_m(m) for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64)] == [1, 2, 3, 4, 8, 8, 8, 16, 16, 32, 64, 64]
    with pytest.raises(ValueError):
        R.bucket_m(65)
    v = k3_attnres_variants(k3())
    assert (0, False, 0) in v and (8, True, -1) in v and (7, True, 7) in v and len(v) == 16


@needs_dsl
def test_compile_gemv_all_keys():
    keys = R.compile_keys(_gemv_shapes(), BATCHES)
    assert any(k[0] == "fma" for k in keys) and any(k[0] == "mma" for k in keys)
    R.warmup(_gemv_shapes(), BATCHES)
    for k in keys:
        fn = R._compile_fma(*k[1:]) if k[0] == "fma" else R._compile_mma(*k[1:])
        assert fn is not None


@needs_dsl
def test_compile_attnres_rmsnorm_schedule():
    d = k3().hidden_size
    for (nb, hd, bw) in k3_attnres_variants(k3()):
        for wln in ("bf16", "fp32"):
            assert R._compile_norm(d, nb, hd, bw, wln, 1e-5) is not None


@needs_dsl
def test_compile_attnres_rmsnorm_cluster():
    """v15: the cluster builds (2 / 4 / 8 CTAs per token) of the schedule's corner variants, each with its own key;
    compile_keys lists the cluster build the layer's batches from NORM_CLUSTER_MIN_M run."""
    d = k3().hidden_size
    for cl in R.NORM_CLUSTERS[1:]:
        for (nb, hd, bw) in [(0, False, 0), (8, True, -1), (7, True, 7)]:
            assert R._compile_norm(d, nb, hd, bw, "bf16", 1e-5, False, cl) is not None
        assert R._compile_norm(d, 3, True, -1, "fp32", 1e-5, True, cl) is not None
    assert R.norm_compile_key(d, 1, True, -1, "bf16", 1e-5) != R.norm_compile_key(d, 1, True, -1, "bf16", 1e-5,
                                                                                  cluster=4)
    assert [R.norm_cluster(m, 9) for m in (1, 8, 9, 64)] == [1, 1, R.NORM_CLUSTER, R.NORM_CLUSTER]
    assert R.norm_cluster(R.NORM_CLUSTER_MIN_M - 1) == 1 and R.norm_cluster(R.NORM_CLUSTER_MIN_M) == R.NORM_CLUSTER
    keys = R.compile_keys([], [8, 16], attnres_K=d, n_blocks=(1,), block_write=(-1,), deltas=(True,))
    assert ("norm", d, 1, True, -1, "bf16", 1e-5) in keys
    assert ("norm", d, 1, True, -1, "bf16", 1e-5, False, R.NORM_CLUSTER) in keys


@needs_dsl
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_compile_fused(cfg):
    """Fused AttnRes+RMSNorm+in_proj for M <= FUSE_MAX_M: the corner variants of the schedule (the other
    n_blocks values change only unrolled trip counts); M = 3, 4 compiled once for rank16 (fuse_max_m=4)."""
    N, K = R.k3_gemv_shapes(cfg)["in_proj"]
    rpc, ks, _ = R._fused_config(N, K)
    for (nb, hd, bw) in [(0, False, 0), (1, True, -1), (7, True, 7), (8, True, -1)]:
        for M in range(1, R.FUSE_MAX_M + 1):
            assert R._compile_fused(M, K, nb, hd, bw, "bf16", 1e-5, rpc, ks) is not None
    if cfg.tp == 16:
        for M in (3, 4):
            assert R._compile_fused(M, K, 8, True, -1, "bf16", 1e-5, rpc, ks) is not None


@needs_dsl
def test_compile_keys_cover_fused_and_norm():
    keys = R.compile_keys([(3216, 7168)], [1, 2, 8], attnres_K=7168, attnres_N=(3216,), n_blocks=(1,),
                          block_write=(-1,), deltas=(True,))
    kinds = sorted({k[0] for k in keys})
    assert kinds == ["fma", "fused", "mma", "norm"]
    # the keys are the builds the calls run with the module defaults (until session 10 the fused and FMA keys
    # lacked the pinned loads, so warmup compiled builds no default call used)
    fused = {k for k in keys if k[0] == "fused"}
    assert fused == {("fused",) + R._fused_args(m, 7168, 3216, 1, True, -1, "bf16", 1e-5)[0] for m in (1, 2)}
    assert all(k[12] == R.PIN_LOADS and k[13] == R.PREFETCH_GROUPS and k[11] is False and len(k) == 14
               for k in fused)
    assert {k[-1] for k in keys if k[0] == "fma"} == {R.PIN_LOADS}
    early = R.compile_keys([(3216, 7168)], [1], attnres_K=7168, attnres_N=(3216,), n_blocks=(1,), block_write=(-1,),
                           deltas=(True,), early_trigger=True)
    assert all(k[11] is True for k in early if k[0] == "fused")
    n0 = len(COMPILE_LOG)
    R.warmup([(3216, 7168)], [1, 2, 8], attnres_K=7168, attnres_N=(3216,), n_blocks=(1,), block_write=(-1,),
             deltas=(True,))
    assert len(COMPILE_LOG) >= n0


# ----------------------------------------------------------------------------- host checks (CPU only)

def _attn_inputs(M=1, K=64, dtype=torch.bfloat16):
    blocks = torch.randn(M, R.NB_MAX, K, dtype=dtype)
    p = torch.randn(M, K, dtype=dtype)
    d = torch.randn(M, K, dtype=dtype)
    u = torch.randn(K, dtype=torch.float32)
    wl = torch.randn(K, dtype=torch.bfloat16)
    return blocks, p, d, u, wl


def test_gemv_bad_inputs():
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError):
        R.gemv(x.float(), w)
    with pytest.raises(TypeError):
        R.gemv(x, w.half())
    with pytest.raises(ValueError):
        R.gemv(torch.randn(2, 48, dtype=torch.bfloat16), w)            # K mismatch
    with pytest.raises(ValueError):
        R.gemv(x, torch.randn(24, 64, dtype=torch.bfloat16))          # N not a multiple of 16
    with pytest.raises(ValueError):
        R.gemv(torch.randn(65, 64, dtype=torch.bfloat16), w)          # M > 64
    with pytest.raises(ValueError):
        R.gemv(torch.randn(0, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError):
        R.gemv(torch.randn(64, 2, dtype=torch.bfloat16).t(), w)       # not contiguous
    with pytest.raises(ValueError):
        R.gemv(x, w, out=torch.empty(2, 16, dtype=torch.bfloat16))
    if torch.cuda.is_available():
        with pytest.raises(ValueError):
            R.gemv(x.cuda(), w)                                        # device mismatch


def test_attnres_bad_inputs():
    blocks, p, d, u, wl = _attn_inputs()
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        R.attnres_rmsnorm(blocks, 9, p, d, u, wl)                      # n_blocks > 8
    with pytest.raises(ValueError):
        R.attnres_rmsnorm(blocks, 3, p, d, u, wl, block_write=2)       # overwrites a mixed source
    with pytest.raises(ValueError):
        R.attnres_rmsnorm(blocks, 3, p, d, u, wl, block_write=8)
    with pytest.raises(TypeError):
        R.attnres_rmsnorm(blocks, 3, p, d, u.bfloat16(), wl)           # u must be fp32
    with pytest.raises(TypeError):
        R.attnres_rmsnorm(blocks, 3, p, d, u, wl.half())
    with pytest.raises(ValueError):
        R.attnres_rmsnorm(blocks[:, :4].contiguous(), 3, p, d, u, wl)  # NBmax must be 8
    with pytest.raises(ValueError):
        R.attnres_rmsnorm(blocks, 3, p, d[:, :32].contiguous(), u, wl)
    with pytest.raises(TypeError):
        R.attnres_rmsnorm(blocks, 3, p.float(), d, u, wl)
    for bad in (3, 16, 0):
        with pytest.raises(ValueError, match="cluster must be one of"):
            R.attnres_rmsnorm(blocks, 3, p, d, u, wl, cluster=bad)      # CTAs per token: 1, 2, 4 or 8
    with pytest.raises(ValueError):
        R.attnres_rms_gemv(blocks, 3, p, d, u, wl, w, partial_out=p)   # fused: p' would race with readers
    with pytest.raises(ValueError):
        R.attnres_rms_gemv(blocks, 3, p, d, u, wl, torch.randn(32, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        R.attnres_rms_gemv(blocks, 3, p, d, u, wl, torch.randn(20, 64, dtype=torch.bfloat16))


@needs_dsl
@pytest.mark.parametrize("N", [3216, 6288, 49376])
@pytest.mark.parametrize("M", [1, 2])
def test_fused_two_groups_issue_all_loads_first(N, M):
    """v3 (fused_groups=2): the loop body issues both row groups' weight loads (2 x 7 per lane at ks = 4, K = 7168)
    before the first FMA, so one round trip serves two groups; v2's body issues one group's 7."""
    from k3fast.measure.ptxcheck import loop_issue_order
    for G, n in ((1, 7), (2, 14)):
        seqs = [seq for _, seq in loop_issue_order(R.fused_ptx(N, M=M, G=G), min_loads=2)]
        assert any(seq.lstrip("|").startswith("L" * n + "f") for seq in seqs), (G, seqs)


def test_fused_two_groups_rejects_multi_batch_slices():
    _, _, Fma, _, _ = R._kernels()
    with pytest.raises(ValueError, match="G = 2"):
        Fma(1, 8, 1, R.FMA_WARPS, G=2)                  # the plain GEMV: slices of several batches
    with pytest.raises(ValueError, match="fused_groups"):
        R._check_groups(3)


@needs_dsl
@pytest.mark.parametrize("early", [False, True])
def test_fused_trigger_placement(early):
    """v5 (early_trigger): the fused kernel launches its dependents right after its wait, before the AttnRes
    prologue's first store; by default after its last row group's stores."""
    lines = R.fused_ptx(3216, M=1, early_trigger=early).splitlines()
    trig = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
    wait = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    stores = [i for i, ln in enumerate(lines) if ln.strip().startswith("st.global")]
    assert len(trig) == 1 and len(wait) == 1 and stores and trig[0] > wait[0]
    assert (trig[0] < min(stores)) == early and (trig[0] > max(stores)) == (not early)


@needs_dsl
@pytest.mark.parametrize("M", [1, 2])
def test_pinned_loads_issue_together_in_sass(M):
    """v6 (pin): ptxas keeps each batch's weight loads together in the fused kernel's loop (v2's SASS issues 4, then
    FMAs that wait for the first, then the other 3). SASS needs ptxas and nvdisasm (k3fast.measure.ptxcheck.find_sass_tools);
    without them only the compile is checked."""
    from k3fast.measure.ptxcheck import _assemble, find_sass_tools
    ptx = {pin: R.fused_ptx(3216, M=M, pin=pin) for pin in (False, True)}
    tools = find_sass_tools()
    if tools is None:
        pytest.skip("no ptxas / nvdisasm here: compiled only")
    import re

    def loop_issue(sass):
        ops = "".join("L" if "LDG.E.NA" in ln else "f" if "FFMA" in ln else ""
                      for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln))
        return re.search(r"L[Lf]*", ops).group(0)
    seq = {pin: loop_issue(_assemble(ptx[pin], tools[0], "sm_90a", tools[1], ("-c",))[1]) for pin in ptx}
    per_lane = R._vectors_per_lane(7168, R._fused_config(3216, 7168)[1])
    assert seq[True][:per_lane] == "L" * per_lane, seq[True][:40]
    assert seq[False][:per_lane] != "L" * per_lane, seq[False][:40]


@needs_dsl
@pytest.mark.parametrize("M", [1, 3, 4])
def test_plain_gemv_pinned_compiles(M):
    """v6 on the plain FMA GEMV (the in_proj at M = 3-4 after attnres_rmsnorm): its own compile key."""
    rpc, ks = R._fma_config(3216, 7168)
    assert R._compile_fma(R.bucket_m(M), rpc, ks, True) is not R._compile_fma(R.bucket_m(M), rpc, ks, False)


@needs_dsl
@pytest.mark.parametrize("pf", [1, 2, 3])
def test_fused_prefetch_depth(pf):
    """v7 (prefetch_groups): pf row groups' L2 prefetches are issued before the PDL wait (pf times the lines of one
    group per lane), and the loop still prefetches one group per iteration; the loop's loads and FMAs are v6's."""
    import re
    lines = [ln.strip() for ln in R.fused_ptx(3216, M=1, pin=True, early_trigger=True, pf=pf).splitlines()]
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    pre = sum(1 for ln in lines[:wait] if ln.startswith("prefetch.global.L2"))
    post = sum(1 for ln in lines[wait:] if ln.startswith("prefetch.global.L2"))
    base = [ln.strip() for ln in R.fused_ptx(3216, M=1, pin=True, early_trigger=True).splitlines()]
    bwait = next(i for i, ln in enumerate(base) if "griddepcontrol.wait" in ln)
    bpre = sum(1 for ln in base[:bwait] if ln.startswith("prefetch.global.L2"))
    bpost = sum(1 for ln in base[bwait:] if ln.startswith("prefetch.global.L2"))
    assert bpre > 0 and pre == pf * bpre and post == bpost
    ops = lambda ls: sorted(re.split(r"\s", ln)[0] for ln in ls if re.match(r"(ld\.global|fma\.rn)", ln))   # noqa: E731
    assert ops(lines[wait:]) == ops(base[bwait:])


def test_prefetch_groups_is_checked():
    for bad in (0, 5, 2.0, True, "2"):
        with pytest.raises(ValueError, match="prefetch_groups"):
            R._check_prefetch(bad)
    assert R._check_prefetch(3) == 3

