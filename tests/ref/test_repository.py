"""The repository's own rules, checked on the source (CPU, no imports of the modules under test):

* the import direction: product code (k3fast.kernels, k3fast.layer, k3fast.ops, k3fast.stock, ...) never imports the
  measuring tools (k3fast.measure); kernel modules import only the DSL glue, each other and the standard library /
  torch / the DSL;
* code explains the design, not its history: no session labels, commit ids or record paths in k3fast's comments and
  docstrings (they belong in the design notes' version tables under docs/kernels/).
"""
import ast
import io
import pathlib
import re
import tokenize

import pytest

pytestmark = pytest.mark.ref

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "k3fast"
PRODUCT = [p for p in PKG.rglob("*.py") if "measure" not in p.relative_to(PKG).parts and p.name != "__main__.py"]
KERNELS = sorted((PKG / "kernels").glob("*.py"))


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Absolute names of every module ``path`` imports (at any depth of the file, lazily or not)."""
    tree = ast.parse(path.read_text())
    here = _module(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]                        # the package a relative import starts from
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)     # `from pkg import module`
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__" and node.args \
                and isinstance(node.args[0], ast.Constant):
            out.add(node.args[0].value)
    return out


def test_the_trees_are_found():
    assert len(PRODUCT) >= 10 and len(KERNELS) >= 8


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(ROOT)))
def test_product_code_never_imports_the_measuring_tools(path):
    bad = sorted(m for m in _imports(path) if m == "k3fast.measure" or m.startswith("k3fast.measure."))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_kernels_import_only_the_dsl_glue_and_each_other(path):
    bad = sorted(m for m in _imports(path) if m.startswith(("k3fast", "k3ref"))
                 and not m.startswith("k3fast.kernels"))
    assert not bad, f"{path.name} imports {bad}"


# "Session 12", "s110a", "(s45)", "records-340beb3-s110a.json", a 7-40 hex commit id next to the word commit or
# in parentheses, "before session", "since session"
HISTORY = re.compile(r"\b[Ss]ession \d+|\bs\d{2,3}[a-z]?\b|records-[0-9a-f]{7}|kernels-[0-9a-f]{7}|experts-[0-9a-f]{7}"
                     r"|vllm-e2e-[0-9a-f]{7}|long-decode-[0-9a-f]{7}|sanitizer-[0-9a-f]{7}"
                     r"|\b(?:before|since|until) (?:session|s\d)|\bcommit [0-9a-f]{7,40}\b|\bat [0-9a-f]{7}\b")


def _comments_and_docstrings(path: pathlib.Path):
    """(line, text) of every comment and every string literal that stands as a statement (docstrings)."""
    src = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for i, line in enumerate(node.value.value.splitlines()):
                yield node.lineno + i, line


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_comments_say_why_not_when(path):
    hits = [f"{path.relative_to(ROOT)}:{n}: {t.strip()[:100]}" for n, t in _comments_and_docstrings(path)
            if HISTORY.search(t)]
    assert not hits, "history in code comments (move it to docs/kernels/<module>.md):\n" + "\n".join(hits[:20])


def test_the_history_pattern_catches_what_it_should():
    for s in ("# Session 12 measured", "(s110a)", "see records-340beb3-s110a.json", "the default since session 4",
              "(traces/h100/vllm-e2e-4c9dbfe.json)",
              "at 0c2876b", "commit 76bd9ff"):
        assert HISTORY.search(s), s
    for s in ("# 16-byte loads: 4.28 TB/s measured at M=1", "sm_90a", "the s-th split", "a 64 x 112 tile"):
        assert not HISTORY.search(s), s
