"""k3fast.launch_probe on the CPU: the empty kernel compiles for sm_90a in every case's configuration, PDL's wait and
trigger appear only in the PDL builds, the shared-memory footprint is the one asked for, and bad arguments get clear
errors."""
import pytest

from k3fast import launch_probe as P
from k3fast._dsl import dsl_available

pytestmark = pytest.mark.compile
needs_dsl = pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm_ffi not importable")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        P.compile_key(228 * 1024, True)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        P.compile_key(1000, False)
    with pytest.raises(ValueError, match="cluster"):
        P.compile_key(0, True, 3)


def test_cases_vary_one_property_against_a_baseline():
    names = [c[0] for c in P.CASES]
    assert len(set(names)) == len(names)
    nodes = {c[0]: c[1] for c in P.CASES}
    # each DSL property has a case that differs from "dsl" in it alone
    assert nodes["dsl pdl"] == [("dsl", 0, True, 1)] and nodes["dsl"] == [("dsl", 0, False, 1)]
    assert nodes["dsl 200KB"] == [("dsl", 200, False, 1)]
    assert nodes["dsl pdl cluster4"] == [("dsl", 0, True, 4)]
    for _, nds, warm in P.CASES:
        for nd in nds:
            if nd[0] == "dsl":
                P.compile_key(nd[1] * 1024, nd[2], nd[3])
        assert warm in (0, 100, 200)


@needs_dsl
@pytest.mark.parametrize("smem,pdl,cluster", [(0, False, 1), (0, True, 1), (200 * 1024, True, 1), (0, True, 4),
                                              (100 * 1024, False, 1)])
def test_probe_kernel_compiles(smem, pdl, cluster):
    from k3fast.ptxcheck import compiled_ptx
    ptx = compiled_ptx(lambda: P._build(smem, pdl, cluster, options=P.TVM_FFI + " --keep-ptx"))
    lines = [ln.strip() for ln in ptx.splitlines()]
    assert sum(ln.startswith("griddepcontrol") for ln in lines) == (2 if pdl else 0)
    stores = [ln for ln in lines if ln.startswith("st.shared")]
    if smem:
        # the last word of the footprint is written, so the whole allocation is live
        assert any(f"+{smem - 4}]" in ln for ln in stores), stores
    else:
        assert not stores
