"""k3fast.kernels.rms_gemv on the CPU (CUTE_DSL_ARCH=sm_90a): every build of the AttnRes norm the layer runs, the fused
FMA in_proj (the layer's contender at M <= 2), the order of their PTX, and clear errors for inputs they do not take.

The norm and the fused kernel take K = hidden_size = 7168 at every width, so their builds do not depend on the
in_proj's N: one set serves k3_rank16, k3_rank8 and full width."""
import pytest
import torch

from k3fast.kernels import rms_gemv as R
from k3fast.kernels._dsl import TVM_FFI, dsl_available
from k3ref.config import k3, k3_rank
from attnres_cases import CORNER_SITES, k3_attnres2_variants, k3_attnres_variants

pytestmark = pytest.mark.compile

K = 7168
WIDTHS = (3216, 6288, 49376)          # the packed in_proj's N at k3_rank16 / k3_rank8 / full width
needs_dsl = pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm_ffi not importable")


def _ptx(build):
    from k3fast.measure.ptxcheck import compiled_ptx
    return [ln.strip() for ln in compiled_ptx(lambda: build(options=TVM_FFI + " --keep-ptx")).splitlines()]


def _trigger_wait_stores(lines):
    trig = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.launch_dependents")]
    wait = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")]
    stores = [i for i, ln in enumerate(lines) if ln.startswith("st.global")]
    return trig, wait, stores


def test_fused_config_and_sites():
    for N in WIDTHS:
        rpc, ks, grid = R._fused_config(N, K)
        assert (rpc, ks) == (4, 4) and rpc * ks == R.FUSED_WARPS and N % rpc == 0
        assert 1 <= grid <= R.NUM_SMS and -(-(N // rpc) // grid) == -(-(N // rpc) // R.NUM_SMS)   # no extra round
    assert R._vectors_per_lane(K, 4) == 7
    for cfg in (k3_rank(16), k3_rank(8), k3()):
        v = k3_attnres_variants(cfg)
        assert (0, False, 0) in v and (8, True, -1) in v and (7, True, 7) in v and len(v) == 16
        assert k3_attnres2_variants(cfg) == [(nb, True, -1) for nb in range(1, 9)]
    assert [R.norm_cluster(m) for m in (1, 2, 3, 64)] == [1, 1, R.NORM_CLUSTER, R.NORM_CLUSTER]


def test_compile_keys_are_the_calls():
    """compile_keys lists what the calls run with the module's defaults: the fused kernel at M <= FUSE_MAX_M for a
    projection width (its trigger as asked), the norm kernel above (norm_cluster(M) CTAs per token, each trigger in
    norm_triggers) or at every M without a width; one key per build, whatever the batch or the width."""
    site = [(1, True, -1)]
    keys = R.compile_keys([1, 2, 3, 8, 64], K=K, sites=site, N=WIDTHS, early_trigger=True,
                          norm_triggers=(False, True))
    assert keys == sorted({R.fused_compile_key(m, K, 3216, 1, True, -1, "bf16", 1e-5, True) for m in (1, 2)}
                          | {R.norm_compile_key(K, 1, True, -1, "bf16", 1e-5, et, R.NORM_CLUSTER)
                             for et in (False, True)}, key=str)
    assert all(k[-1] == "early_trigger" for k in keys if k[0] == "rms_gemv.fused")
    assert R.compile_keys([1, 3], K=K, sites=site) == [R.norm_compile_key(K, 1, True, -1, "bf16", 1e-5),
                                                       R.norm_compile_key(K, 1, True, -1, "bf16", 1e-5, cluster=4)]


@needs_dsl
def test_compile_norm_builds_of_the_layer():
    """The norm kernel as the layer runs it: before the in_proj's ring / WGMMA GEMM at M 3..64 (clusters of 4, the
    trigger after its wait) at every pre-attention AttnRes site; before cuBLAS at full width (the trigger after its last
    store) and as AttnRes #2 beside o_proj's GEMM (one CTA per token at M <= 2, clusters above) at the corner sites."""
    cfg = k3()
    R.warmup([3], K=K, sites=k3_attnres_variants(cfg), norm_triggers=(True,))
    R.warmup([3], K=K, sites=CORNER_SITES)
    R.warmup([1, 3], K=K, sites=[s for s in k3_attnres2_variants(cfg) if s[0] in (1, 8)])


@needs_dsl
def test_compile_strided_p_builds():
    """The p_strided builds: the fused kernel at M = 1, 2 and the norm kernel above, as FusedMLA runs them (q_a's
    RMSNorm + W_Q: K = 1536, no block, no delta) and at the layer's width with blocks and a delta."""
    from k3ref import k3_rank
    c16 = k3_rank(16)
    R.warmup([1, 2, 3], K=c16.q_lora_rank, N=(c16.mla_heads * c16.kv_cache_dim,), sites=[(0, False, -1)],
             strided_p=True)
    R.warmup([1, 3], K=K, N=(3216,), sites=[(3, True, -1)], strided_p=True)
    keys = R.compile_keys([1, 3], K=K, N=(3216,), sites=[(3, True, -1)], strided_p=True)
    assert keys and all(k[-1] == "p_strided" for k in keys)


@needs_dsl
def test_compile_fused_contender():
    """The fused FMA in_proj ("fast-infma") at M = 1, 2 with the layer's early trigger, at the corner sites."""
    for M in (1, 2):
        for nb, hd, bw in CORNER_SITES:
            R._compile_fused(R.fused_compile_key(M, K, 3216, nb, hd, bw, "bf16", 1e-5, True))


@needs_dsl
def test_fused_ptx_loop_and_trigger():
    """The fused kernel's loop issues a row group's 7 weight loads (ks = 4, K = 7168: 7 vectors per lane) before its
    first FMA, and with the early trigger launches its dependents right after its wait, before the prologue's first
    store."""
    from k3fast.measure.ptxcheck import loop_issue_order
    rpc, ks, _ = R._fused_config(3216, K)
    lines = _ptx(lambda options: R._build_fused(1, K, 1, True, -1, "bf16", 1e-5, rpc, ks, True, options=options))
    seqs = [seq for _, seq in loop_issue_order("\n".join(lines), min_loads=2)]
    assert any(seq.lstrip("|").startswith("L" * 7 + "f") for seq in seqs), seqs
    trig, wait, stores = _trigger_wait_stores(lines)
    assert len(trig) == 1 and len(wait) == 1 and stores and wait[0] < trig[0] < min(stores)
    assert sum(ln.startswith("prefetch.global.L2") for ln in lines[:wait[0]]) > 0   # W's first group before the wait


@needs_dsl
@pytest.mark.parametrize("M", [1, 2])
def test_pinned_loads_issue_together_in_sass(M):
    """ptxas keeps each batch of the fused loop's 7 weight loads together (the pin: without it, its SASS issues 4, then
    FMAs that wait for the first, then the other 3). SASS needs ptxas and nvdisasm (ptxcheck.find_sass_tools)."""
    import re
    from k3fast.measure.ptxcheck import _assemble, find_sass_tools
    tools = find_sass_tools()
    if tools is None:
        pytest.skip("no ptxas / nvdisasm here")
    rpc, ks, _ = R._fused_config(3216, K)
    ptx = "\n".join(_ptx(lambda options: R._build_fused(M, K, 1, True, -1, "bf16", 1e-5, rpc, ks, True,
                                                        options=options)))
    sass = _assemble(ptx, tools[0], "sm_90a", tools[1], ("-c",))[1]
    ops = "".join("L" if "LDG.E.NA" in ln else "f" if "FFMA" in ln else ""
                  for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln))
    per_lane = R._vectors_per_lane(K, ks)
    assert re.search(r"L[Lf]*", ops).group(0)[:per_lane] == "L" * per_lane


@needs_dsl
@pytest.mark.parametrize("early", [False, True])
def test_norm_trigger_placement(early):
    """attnres_rmsnorm launches its dependent after its last store by default, right after its wait with early_trigger
    (before a ring / WGMMA GEMM, whose weight stages then fill beside it)."""
    lines = _ptx(lambda options: R._build_norm(K, 3, True, -1, "bf16", 1e-5, early, R.NORM_CLUSTER, options=options))
    trig, wait, stores = _trigger_wait_stores(lines)
    assert len(trig) == 1 and len(wait) == 1
    assert (wait[0] < trig[0] < wait[0] + 4) if early else trig[0] > max(stores)


# ----------------------------------------------------------------------------- host checks (CPU only)

def _attn_inputs(M=1, K=64, dtype=torch.bfloat16):
    blocks = torch.randn(M, R.NB_MAX, K, dtype=dtype)
    p = torch.randn(M, K, dtype=dtype)
    d = torch.randn(M, K, dtype=dtype)
    u = torch.randn(K, dtype=torch.float32)
    wl = torch.randn(K, dtype=torch.bfloat16)
    return blocks, p, d, u, wl


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
    b3, p3, d3, _, _ = _attn_inputs(M=3, K=24)
    with pytest.raises(ValueError, match="CTAs per token"):
        R.attnres_rmsnorm(b3, 1, p3, d3, torch.zeros(24), torch.ones(24, dtype=torch.bfloat16))   # K < 8 x 4
    with pytest.raises(ValueError):
        R.attnres_rms_gemv(blocks, 3, p, d, u, wl, w, partial_out=p)   # fused: p' would race with readers
    with pytest.raises(ValueError):
        R.attnres_rms_gemv(blocks, 3, p, d, u, wl, torch.randn(32, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        R.attnres_rms_gemv(blocks, 3, p, d, u, wl, torch.randn(20, 64, dtype=torch.bfloat16))
