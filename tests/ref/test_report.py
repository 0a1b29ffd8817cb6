"""k3fast.measure.report: README's results block comes from one run per card, names its files, and --check notices a
hand edit (CPU)."""
import json
import os

import pytest

pytestmark = pytest.mark.ref


def _rec(impl, shape, batch, us, kernels, floor, part="layer", commit="aaaaaaa", gpu="NVIDIA H200"):
    return dict(impl=impl, shape=shape, batch=batch, part=part, layer_kind="kda_moe", replay_us_median=us,
                replay_us_p10=us * 0.98, replay_us_p90=us * 1.02, kernels=kernels, floor_us=floor, bytes=floor * 4.2e6,
                copy_tbps=4.2, gpu=gpu, driver="580", torch="2.11", cutlass="4.8.1", commit=commit,
                date="2026-12-07T05", context=0, routing="random")


def _write(path, recs):
    from k3fast.measure.trace import SCHEMA_FIELDS
    full = [{**{k: r.get(k, 1) for k in SCHEMA_FIELDS}, **r} for r in recs]
    path.write_text(json.dumps({"records": full}))


def test_results_block_pairs_stock_and_fast_of_one_run(tmp_path, monkeypatch):
    from k3fast.measure import report
    monkeypatch.setattr(report, "ROOT", str(tmp_path))
    _write(tmp_path / "records-a.json", [_rec("stock", "k3_rank16", 1, 160.0, 36, 50.0),
                                         _rec("fast", "k3_rank16", 1, 80.0, 6, 50.0),
                                         _rec("fast", "k3_rank16", 1, 30.0, 3, 20.0, part="attn"),
                                         _rec("fast", "k3_rank8", 8, 190.0, 8, 129.0)])        # no stock: no row
    block = report.results_block({"H200": "records-a.json"})
    rows = [ln for ln in block.splitlines() if ln.startswith("| H200")]
    assert rows == ["| H200 | kda_moe | k3_rank16 | 1 | 50.0 | 160.0 | 80.0 | 2.00x | 1.60x | 36 → 6 |"]
    assert "`records-a.json` (NVIDIA H200" in block and block.startswith("<!-- results:begin H200=records-a.json -->")


def test_results_block_takes_one_shape_from_a_later_run(tmp_path, monkeypatch):
    """A CARD:SHAPE source replaces that card's rows at that shape; every row still pairs stock and fast of one file,
    and the line above the table names both files."""
    from k3fast.measure import report
    monkeypatch.setattr(report, "ROOT", str(tmp_path))
    _write(tmp_path / "records-a.json", [_rec("stock", "k3_rank16", 1, 160.0, 25, 50.0),
                                         _rec("fast", "k3_rank16", 1, 100.0, 6, 50.0),
                                         _rec("stock", "k3_rank8", 1, 180.0, 22, 99.0),
                                         _rec("fast", "k3_rank8", 1, 120.0, 6, 99.0)])
    _write(tmp_path / "records-b.json", [_rec("stock", "k3_rank8", 1, 169.0, 21, 100.0, commit="bbbbbbb"),
                                         _rec("fast", "k3_rank8", 1, 130.0, 6, 100.0, commit="bbbbbbb"),
                                         _rec("stock", "k3_rank16", 1, 1.0, 1, 1.0, commit="bbbbbbb"),
                                         _rec("fast", "k3_rank16", 1, 1.0, 1, 1.0, commit="bbbbbbb")])
    block = report.results_block({"H100": "records-a.json", "H100:k3_rank8": "records-b.json"})
    rows = [ln for ln in block.splitlines() if ln.startswith("| H100")]
    assert rows == ["| H100 | kda_moe | k3_rank16 | 1 | 50.0 | 160.0 | 100.0 | 1.60x | 2.00x | 25 → 6 |",
                    "| H100 | kda_moe | k3_rank8 | 1 | 100.0 | 169.0 | 130.0 | 1.30x | 1.30x | 21 → 6 |"]
    assert "H100: `records-a.json`" in block and "H100 k3_rank8: `records-b.json`" in block and "commit bbbbbbb" in block
    with pytest.raises(SystemExit, match="one of k3_rank16"):
        report.results_block({"H100": "records-a.json", "H100:rank8": "records-b.json"})
    with pytest.raises(SystemExit, match="no stock / fast pair at full"):
        report.results_block({"H100": "records-a.json", "H100:full": "records-b.json"})


def test_readme_round_trip_and_check(tmp_path, monkeypatch):
    from k3fast.measure import report
    monkeypatch.setattr(report, "ROOT", str(tmp_path))
    _write(tmp_path / "records-b.json", [_rec("stock", "full", 64, 4500.0, 38, 4100.0),
                                         _rec("fast", "full", 64, 4300.0, 13, 4100.0)])
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- results:begin H100=records-b.json -->\nstale\n<!-- results:end -->\n\ntail\n")
    assert not report.update_readme(str(readme), check=True)
    report.update_readme(str(readme))
    text = readme.read_text()
    assert text.startswith("# x\n\n") and text.endswith("\n\ntail\n") and "stale" not in text
    assert "| H100 | kda_moe | full | 64 | 4100.0 | 4500.0 | 4300.0 | 1.05x | 1.05x | 38 → 13 |" in text
    assert report.update_readme(str(readme), check=True)
    readme.write_text(text.replace("1.05x | 1.05x", "1.10x | 1.05x"))
    assert not report.update_readme(str(readme), check=True)
    readme.write_text("# no marker\n")
    with pytest.raises(SystemExit, match="no <!-- results:begin"):
        report.update_readme(str(readme), check=True)


def test_readme_results_match_their_files():
    """Every figure in README's results table is rebuilt from the record files its marker names."""
    from k3fast.measure.report import HEADLINE, ROOT, update_readme
    assert update_readme(check=True), "README's results block differs from its files: python -m k3fast.measure.report"
    assert os.path.exists(os.path.join(ROOT, HEADLINE))


def test_compare_runs_reports_time_and_identical_errors(tmp_path, monkeypatch):
    from k3fast.measure import report
    monkeypatch.setattr(report, "ROOT", str(tmp_path))
    a = _rec("fast", "k3_rank16", 1, 99.0, 6, 73.0)
    b = _rec("fast", "k3_rank16", 1, 100.0, 6, 73.0)
    a["rel_err_vs_ref"], b["rel_err_vs_ref"] = 0.00396, 0.00396
    c = dict(_rec("fast", "k3_rank8", 8, 240.0, 8, 186.0), rel_err_vs_ref=0.1)
    d = dict(_rec("fast", "k3_rank8", 8, 236.0, 8, 186.0), rel_err_vs_ref=0.2)
    _write(tmp_path / "records-new.json", [a, c])
    _write(tmp_path / "records-old.json", [b, d])
    rows = report.compare_runs("records-new.json", "records-old.json").splitlines()
    assert "| kda_moe | k3_rank16 | 1 | layer | fast | 99.0 | 100.0 | -1.0 % | 6 / 6 | yes |" in rows
    assert "| kda_moe | k3_rank8 | 8 | layer | fast | 240.0 | 236.0 | +1.7 % | 8 / 8 | no |" in rows


def test_engine_match_puts_stock_beside_vllms_own_layer():
    """The stock layer of a trace run beside vLLM's layer in the engine run of the same card (TP16-rank cells)."""
    from k3fast.measure.nbtools import INDEX
    from k3fast.measure.report import engine_match
    text = engine_match(INDEX["layout_check_h100"], INDEX["vllm_e2e"])
    rows = [ln for ln in text.splitlines() if ln.startswith("| kda_moe | k3_rank16")]
    assert [ln.split("|")[3].strip() for ln in rows] == ["1", "8", "64"]
    # the vllm-ops composition is not vLLM's layer at batch 1: 35 kernels against the engine's 25
    assert "| vllm-ops | 35 / 25 |" in rows[0] and rows[0].rstrip().endswith("| no |")
    # the engine runs the TP16-rank model only: other shapes have no counterpart
    assert all("no engine cell" in ln for ln in text.splitlines() if ln.startswith("| kda_moe | full"))


def test_vllm_layer_stock_is_vllms_layer_within_5_percent():
    """The recorded proof of match: the vllm-layer stock (KDA+MoE and MLA+MoE at the TP16 and TP8 ranks, H100)
    against stock vLLM's own layers in engines run on the same machine: b1 / b8 / b64 within 5 % of kernel time with
    the same kernel counts (each shape from its latest run: TP8's after stock took K3's low-latency GEMM table on
    every projection it lists, docs/vllm-plugin.md); MLA cells at 8K cached tokens have no engine counterpart."""
    from k3fast.measure.nbtools import INDEX
    from k3fast.measure.report import engine_match
    counts = {}
    for shape, path in INDEX["vllm_layer_check_h100"].items():
        for ln in engine_match(path, *INDEX["vllm_layers_h100"]).splitlines():
            cols = [c.strip() for c in ln.split("|")]
            if len(cols) > 8 and cols[1] in ("kda_moe", "mla_moe") and cols[2] == shape:
                if cols[4] in ("0", "24"):
                    assert cols[5] == "vllm-layer" and cols[8] == "yes", ln
                    counts[(cols[1], shape, int(cols[3]))] = cols[6]
                else:
                    assert "no engine cell" in cols[8], ln
    assert [counts[("kda_moe", "k3_rank16", b)] for b in (1, 8, 64)] == ["25 / 25", "26 / 26", "26 / 26"]
    assert [counts[("kda_moe", "k3_rank8", b)] for b in (1, 8, 64)] == ["21 / 21", "22 / 22", "24 / 24"]
    assert [counts[("mla_moe", "k3_rank16", b)] for b in (1, 8, 64)] == ["30 / 30", "31 / 31", "33 / 33"]
    assert [counts[("mla_moe", "k3_rank8", b)] for b in (1, 8, 64)] == ["28 / 28", "29 / 29", "33 / 33"]


def test_engine_figure_needs_the_same_cell():
    from k3fast.measure.report import engine_layer_figure
    eng = [{"kind": "vllm_e2e", "engine": "stock", "batch": 8, "gpu": "G", "model": {"shape": "k3_rank16"},
            "layer_us_mla_moe": 240.0, "layer_kernels_mla_moe": 31, "per_layer_context": [16, 26]}]
    rec = {"layer_kind": "mla_moe", "shape": "k3_rank16", "batch": 8, "gpu": "G", "context": 24}
    assert engine_layer_figure(rec, eng) == {"kernel_us": 240.0, "kernels": 31, "context": [16, 26],
                                             "source": None}
    for change in ({"context": 1024}, {"batch": 1}, {"gpu": "H"}, {"shape": "k3_rank8"}, {"layer_kind": "kda_moe"}):
        assert engine_layer_figure({**rec, **change}, eng) is None, change


def test_engine_records_come_from_the_named_files(tmp_path):
    from k3fast.measure.nbtools import INDEX
    from k3fast.measure.report import engine_layer_figure
    from k3fast.measure.trace import engine_records
    rec = {"kind": "vllm_e2e", "engine": "stock", "batch": 1, "gpu": "G", "model": {"shape": "k3_rank8"},
           "layer_us_kda_moe": 160.0, "layer_kernels_kda_moe": 25}
    path = tmp_path / "e2e-layers-k3_rank8.json"
    path.write_text(json.dumps({"records": [rec]}))
    eng = engine_records([str(path)])
    assert eng == [{**rec, "source": "e2e-layers-k3_rank8.json"}]
    stock = {"layer_kind": "kda_moe", "shape": "k3_rank8", "batch": 1, "gpu": "G"}
    assert engine_layer_figure(stock, eng)["source"] == "e2e-layers-k3_rank8.json"
    assert engine_layer_figure({**stock, "shape": "k3_rank16"}, eng) is None
    # without files: the run traces/index.json names
    assert all(r["source"] == os.path.basename(INDEX["vllm_e2e"]) for r in engine_records())
