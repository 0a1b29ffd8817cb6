"""k3fast.measure.profile on the CPU: the preset table, the record built from an ncu report, load_profile /
plot_profile / profile_table / write_csv on a small synthetic record, and an import that needs neither nsight-python
nor a GPU. The profiling itself runs on a Hopper GPU with Nsight Compute (docs/profiling.md)."""
import csv
import json
import os
import subprocess
import sys

import pytest

from k3fast.measure import profile as prof
from k3ref.config import PRESETS as SHAPE_PRESETS

pytestmark = pytest.mark.ref
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_presets_name_valid_distinct_cells():
    from k3fast.measure.trace import KIND_LAYER
    assert "smoke" in prof.PRESETS and len(prof.PRESETS["smoke"][1]) == 1
    for name, (about, cells) in prof.PRESETS.items():
        assert about and cells, name
        assert len(set(cells)) == len(cells), name
        for kind, shape, batch in cells:
            assert kind in KIND_LAYER and kind.endswith("_moe"), (name, kind)
            assert shape in SHAPE_PRESETS, (name, shape)
            assert isinstance(batch, int) and 1 <= batch <= 64, (name, batch)


def test_metrics_are_one_ncu_list():
    assert len(set(prof.METRICS)) == len(prof.METRICS)
    assert {prof.TIME, prof.READ, prof.WRITE} <= set(prof.METRICS)
    for m in prof.METRICS:                          # ncu metric names: no spaces, no regex, no commas
        assert m == m.strip() and "," not in m and " " not in m and not m.startswith("regex:"), m


def test_short_kernel_names():
    assert prof.short_kernel_name("kernel_cutlass_kernel_k3fastkernelsoproj_attnres_buildlocalsOprojAttnRes_object_at"
                                  "__tensorptrbf16_gmem") == "oproj_attnres (OprojAttnRes)"
    assert prof.short_kernel_name("kernel_cutlass_kernel_k3fastrms_gemv_build_kernelslocals_AttnResNorm_object_at__t"
                                  ) == "rms_gemv (AttnResNorm)"
    assert prof.short_kernel_name("kernel_cutlass_kernel_vllmmodel_executorkernelslinearcute_dsl_ll_bf16_splitk"
                                  "LLBf16SplitK_object_at__tensorptr") == "LLBf16SplitK"
    assert prof.short_kernel_name("void vllm::moe::moe_align_block_size_kernel<int>(int const*, int*)") \
        == "moe_align_block_size_kernel"
    assert prof.short_kernel_name("void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16, "
                                  "long, 2>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>)") \
        == "indexSelectSmallIndex"
    assert prof.short_kernel_name("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT") == "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT"


def test_kernel_row_scales_units_and_derives_bandwidth():
    row = prof.kernel_row("k", {prof.TIME: 10_000.0, prof.READ: 30.0, prof.WRITE: 2.0, "launch__grid_size": 132},
                          {prof.TIME: "nsecond", prof.READ: "Mbyte", prof.WRITE: "Mbyte", "launch__grid_size": ""})
    assert row["time_us"] == 10.0 and row["dram_bytes"] == 32_000_000
    assert row["dram_tbps"] == pytest.approx(3.2)
    assert row["metrics"]["launch__grid_size"] == 132 and row["short"] == "k"
    assert prof.kernel_row("k", {prof.TIME: 2.0}, {prof.TIME: "usecond"})["dram_bytes"] == 0
    with pytest.raises(ValueError, match="furlong"):
        prof.kernel_row("k", {prof.TIME: 1.0}, {prof.TIME: "furlong"})
    with pytest.raises(ValueError, match="gpu__time_duration.sum"):
        prof.kernel_row("k", {prof.READ: 1.0}, {prof.READ: "byte"})


# ------------------------------------------------------------------------ an ncu report, as ncu_report reads one

class _Metric:
    def __init__(self, value, unit):
        self._v, self._u = value, unit

    def value(self):
        return self._v

    def unit(self):
        return self._u


class _Domain:
    def __init__(self, name, ranges, style):
        self._name, self._ranges, self._style = name, ranges, style

    def name(self):
        return self._name

    def push_pop_ranges(self):
        return self._ranges if self._style == "push_pop" else ()

    def start_end_ranges(self):
        return self._ranges if self._style == "start_end" else ()


class _State:
    def __init__(self, domains):
        self._d = domains

    def domains(self):
        return list(range(len(self._d)))

    def domain_by_id(self, i):
        return self._d[i]


class _Action:
    def __init__(self, name, region, metrics, style="push_pop"):
        self._name, self._metrics = name, metrics
        doms = [_Domain("<default>", ["k3.moe.experts"], style)]
        if region:
            doms.append(_Domain(prof.NVTX_DOMAIN, [region], style))
        self._state = _State(doms)

    def name(self):
        return self._name

    def nvtx_state(self):
        return self._state

    def metric_names(self):
        return tuple(self._metrics)

    def __getitem__(self, m):
        return _Metric(*self._metrics[m])


class _Items:
    """A report (its ranges) or a range (its actions), indexed as ncu_report indexes them."""
    def __init__(self, items):
        self._items = items

    def num_ranges(self):
        return len(self._items)

    def range_by_idx(self, i):
        return self._items[i]

    num_actions, action_by_idx = num_ranges, range_by_idx


def _report(actions):
    return _Items([_Items(actions)])


def _metrics(t_ns, read_b, write_b, grid=132):
    return {prof.TIME: (t_ns, "nsecond"), prof.READ: (read_b, "byte"), prof.WRITE: (write_b, "byte"),
            "launch__grid_size": (grid, ""), "dram__throughput.avg.pct_of_peak_sustained_elapsed": (80.0, "%")}


@pytest.mark.parametrize("style", ["push_pop", "start_end"])   # nsight-python 0.9 / 1.x
def test_report_kernels_groups_by_region_in_launch_order(style):
    rep = _report([
        _Action("outside", None, _metrics(1000, 1, 1), style),                       # no nsight region: left out
        _Action("void a<int>(int)", "fast.attn", _metrics(4000, 8e6, 1e6), style),
        _Action("b", "fast.attn", _metrics(1000, 1e6, 0), style),
        _Action("c", "stock.moe", {prof.TIME: (2000, "nsecond")}, style),          # fewer metrics collected
    ])
    regions, units = prof.report_kernels(rep)
    assert list(regions) == ["fast.attn", "stock.moe"]
    assert [k["short"] for k in regions["fast.attn"]] == ["a", "b"]
    assert regions["fast.attn"][0]["dram_tbps"] == pytest.approx(9e6 / 4.0 / 1e6, abs=1e-4)
    assert regions["stock.moe"][0]["dram_bytes"] == 0 and regions["stock.moe"][0]["metrics"] == {prof.TIME: 2000}
    assert units[prof.TIME] == "nsecond" and units[prof.READ] == "byte"


def _synthetic_record():
    rep = _report([
        _Action("kernel_cutlass_kernel_k3fastkernelsrms_gemv_ring_build_mma_classlocalsRingMmaGemv_object_at__x",
                "fast.attn", _metrics(9000, 20e6, 1e6)),
        _Action("kernel_cutlass_kernel_k3fastkernelskda_conv_gate_step_buildlocalsKdaConvGateStep_object_at__x",
                "fast.attn", _metrics(6000, 9e6, 2e6)),
        _Action("rms_norm_kernel", "stock.attn", _metrics(3000, 1e6, 1e6)),
        _Action("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "stock.attn", _metrics(14000, 30e6, 0.1e6)),
        _Action("fused_recurrent_kda_fwd_kernel", "stock.attn", _metrics(8000, 10e6, 3e6)),
        _Action("Marlin", "stock.moe", _metrics(40000, 60e6, 1e6)),
        _Action("kernel_cutlass_kernel_k3fastkernelsmoe_mxfp4_experts_build_kernel_classlocalsMoeMxfp4Experts_"
                "object_at__x", "fast.moe", _metrics(25000, 58e6, 1e6)),
    ])
    regions, units = prof.report_kernels(rep)
    env = {"gpu": "NVIDIA H200", "driver": "580.159.04", "torch": "2.11.0+cu130", "cutlass": "4.8.1",
           "commit": "abc1234", "date": "2026-12-01T00:00:00+00:00", "nsight_python": "0.9.6", "ncu": "2025.3.1.0",
           "stock_variant": "vllm-layer", "stock_fallback": None}
    rec = prof.new_record("smoke", env, "graph", "python -m k3fast.measure.profile --preset smoke")
    rec["units"].update(units)
    rec["cells"].append(prof.cell_record("kda_moe", "k3_rank16", 1, regions, report="ncu-t/x.ncu-rep", error=None,
                                         nsight_times={"fast.attn": 15.0}))
    rec["cells"].append(prof.cell_record("kda_moe", "k3_rank16", 8, {}, report=None, error="ProfilerException: x"))
    return rec


def test_record_fields_and_halves():
    rec = _synthetic_record()
    assert tuple(rec) == prof.RECORD_FIELDS
    assert rec["metrics"] == list(prof.METRICS) and rec["ncu_options"]["clock_control"] == "none"
    c = rec["cells"][0]
    assert tuple(c) == prof.CELL_FIELDS
    assert [(h["impl"], h["part"]) for h in c["halves"]] == [("stock", "attn"), ("fast", "attn"),
                                                             ("stock", "moe"), ("fast", "moe")]
    for h in c["halves"]:
        assert tuple(h) == prof.HALF_FIELDS
        assert h["time_us"] == pytest.approx(sum(k["time_us"] for k in h["kernels"]))
        for k in h["kernels"]:
            assert tuple(k) == prof.KERNEL_FIELDS
    fa = c["halves"][1]
    assert fa["time_us"] == 15.0 and fa["nsight_time_us"] == 15.0 and fa["dram_bytes"] == 32_000_000
    assert fa["dram_tbps"] == pytest.approx(32e6 / 15.0 / 1e6, abs=1e-4)     # rounded to 4 digits
    assert all(h["kernels"] == [] and h["dram_tbps"] is None for h in rec["cells"][1]["halves"])


def test_load_profile_round_trip_and_bad_records(tmp_path):
    rec = _synthetic_record()
    p = tmp_path / "profile-t.json"
    p.write_text(json.dumps(rec))
    assert prof.load_profile(str(p)) == rec
    del rec["cells"][0]["halves"][0]["kernels"][0]["time_us"]
    p.write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="time_us"):
        prof.load_profile(str(p))
    p.write_text(json.dumps({"records": []}))
    with pytest.raises(ValueError, match="not a k3fast.measure.profile"):
        prof.load_profile(str(p))


def test_plot_profile_draws_every_kernel(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rec = _synthetic_record()
    fig = prof.plot_profile(rec)
    axes = [a for a in fig.axes if a.get_label() != "<colorbar>"]
    assert len(axes) == 2                                          # one per cell, plus the colorbar
    bars = [p for p in axes[0].patches]
    assert len(bars) == sum(len(h["kernels"]) for h in rec["cells"][0]["halves"])
    labels = [t.get_text() for t in axes[0].get_yticklabels()]
    assert labels == ["fast moe", "stock moe", "fast attn", "stock attn"]
    fig.savefig(tmp_path / "p.png")
    plt.close(fig)
    fig, ax = plt.subplots()
    assert prof.plot_profile(rec, ax=ax, cell="kda_moe_k3_rank16_b1") is fig
    with pytest.raises(ValueError, match="one cell"):
        prof.plot_profile(rec, ax=ax)
    with pytest.raises(ValueError, match="kda_moe_k3_rank16_b1"):
        prof.plot_profile(rec, cell="kda_moe_full_b1")
    plt.close("all")


def test_table_and_csv(tmp_path):
    rec = _synthetic_record()
    text = prof.profile_table(rec)
    assert text.splitlines()[0] == "stock = vllm-layer"                 # which stock the record's rows are
    assert "kda_moe k3_rank16 b1" in text and "ERROR ProfilerException" in text
    assert "rms_gemv_ring (RingMmaGemv)" in text and "15.0 µs" in text
    path = tmp_path / "p.csv"
    prof.write_csv(rec, str(path))
    rows = list(csv.DictReader(open(path)))
    assert len(rows) == 7 and rows[0]["impl"] == "stock" and rows[0]["short"] == "rms_norm_kernel"
    assert set(prof.METRICS) <= set(rows[0]) and rows[-1]["part"] == "moe"


def test_stock_variant_names_the_fallback_without_a_gpu():
    from k3fast.stock.layer import OPS, default_variant
    variant, why = default_variant()
    assert variant in OPS.values()
    assert (why is None) == (variant == "vllm-layer") and (why is None or why.strip())


def test_import_needs_neither_nsight_nor_a_gpu():
    code = ("import sys; sys.modules['nsight'] = None; sys.modules['ncu_report'] = None\n"
            "import k3fast.measure.profile as p\n"
            "assert 'cutlass' not in sys.modules\n"
            "rc = p.main(['--preset', 'smoke', '--out', 'unused'])\n"
            "print('rc', rc)\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "PATH": os.environ.get("PATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rc 2" in out.stdout                                   # no ncu / no nsight-python: a message, exit 2
    assert "ncu" in out.stderr or "nsight-python" in out.stderr, out.stderr[-2000:]


def test_an_import_that_crashes_python_is_reported_not_suffered():
    """load_nsight imports ncu_report and nsight in a child first: a native crash (here a NULL read) is reported with
    its signal and frame; an ordinary ImportError is left to the import in this process."""
    assert prof._import_crash("json") is None
    assert prof._import_crash("no_such_module_for_k3") is None
    crash = prof._import_crash("ctypes; ctypes.string_at(0)")
    assert crash.startswith("killed by signal 11") and "string_at" in crash
