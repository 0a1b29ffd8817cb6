"""Execute every notebook headless on the CPU (the .ipynb twins, outputs stripped in git)."""
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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_executes(path):
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
