"""Execute every notebook headless on the CPU (the .ipynb twins, outputs stripped in git): each one's assertions
pass and it draws at least one figure from the recorded traces."""
import glob
import os

import pytest

pytestmark = pytest.mark.notebooks
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_pairs_are_in_sync_and_stripped():
    import jupytext
    import nbformat
    for nb_path in NOTEBOOKS:
        py = nb_path[:-6] + ".py"
        assert os.path.exists(py), f"{nb_path} has no .py twin"
        nb = nbformat.read(nb_path, as_version=4)
        twin = jupytext.read(py)
        assert [c.source for c in nb.cells] == [c.source for c in twin.cells], f"{nb_path} is out of sync with {py}"
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{nb_path} has outputs"


def test_sweeps_exist_and_hold_stock_beside_fast():
    """nbtools.SWEEPS names files that exist, and each card's sweep has stock and fast in the same cells."""
    from k3fast.measure import nbtools
    for card, files in nbtools.SWEEPS.items():
        for f in files:
            assert os.path.exists(os.path.join(ROOT, f)), f"SWEEPS[{card!r}]: {f} is missing"
        assert nbtools.cells(nbtools.sweep(card), "layer"), f"SWEEPS[{card!r}]: no cell with stock and fast"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_executes(path):
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
    figures = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert figures >= 1, f"{os.path.basename(path)} drew no figure"
