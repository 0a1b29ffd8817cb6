"""k3fast.cluster_probe on the CPU: the probe kernel compiles for sm_90a at the GEMM's footprints, its PTX has the
arrival, the globaltimer-bounded spin and the cluster barrier, and bad arguments get clear errors."""
import pytest

from k3fast import cluster_probe as P
from k3fast._dsl import dsl_available

pytestmark = pytest.mark.compile
needs_dsl = pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm_ffi not importable")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="cluster size"):
        P.compile_key(3, 1024)
    with pytest.raises(ValueError, match="multiple of 8 bytes"):
        P.compile_key(4, 228 * 1024)
    with pytest.raises(ValueError, match="multiple of 8 bytes"):
        P.compile_key(4, 1001)


def test_cases_cover_the_gemm_plans():
    from k3fast import gemm_wgmma_splitk as G
    from k3fast.gemm_wgmma_splitk import stage_bytes
    for N in (3216, 6288):
        BN, S, D, BK = G.plan(N, 7168)
        smem = D * stage_bytes(BN, BK) + G.BARRIER_BYTES
        clusters = -(-N // BN)
        # a case with this cluster size, at least this footprint and at least this many clusters
        assert any(s == S and m >= smem and c >= clusters for s, m, c in P.CASES), (S, smem, clusters)


@needs_dsl
def test_probe_compiles_and_spins_on_the_timer():
    from k3fast.ptxcheck import compiled_ptx
    ptx = compiled_ptx(lambda: P._build(8, 222 * 1024, 200, options=P.TVM_FFI + " --keep-ptx"))
    lines = [ln.strip() for ln in ptx.splitlines()]
    assert sum("globaltimer" in ln for ln in lines) >= 2
    assert sum(ln.startswith("atom.") for ln in lines) >= 2
    assert sum(ln.startswith("barrier.cluster") for ln in lines) == 2
