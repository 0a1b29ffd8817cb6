"""traces/ holds evidence: every traces/ file that README.md, the notebooks and docs/ cite is in the tree, and the
pruning tool (python -m k3fast.measure.trace prune) keeps exactly what is cited (CPU, no GPU, no compile)."""
import os
import subprocess

import pytest

from k3fast.measure import trace

pytestmark = pytest.mark.ref


def test_every_cited_trace_is_in_the_tree():
    """README.md, notebooks/*.py, docs/**/*.md and traces/README.md name only files the tree holds (full paths,
    globs, bare names such as records-<commit>-<step>.json resolved under traces/*/). docs/lab-log.md is frozen
    history and cites files that live in git history only: it is not checked."""
    cites = trace.citations()
    assert cites, "no citation found: the parser or the CITING globs are broken"
    assert not any(c.source in trace.FROZEN for c in cites)
    missing = [f"{c.source}:{c.line}: {c.text}" for c in trace.unresolved(cites)]
    assert not missing, "cited but not in the tree (restore the file from git history or fix the citation):\n" + \
        "\n".join(missing)


def test_traces_readme_names_the_latest_sweep_of_every_card():
    """Each card folder with records keeps a named sweep through traces/README.md, so prune never empties it."""
    cites = [c for c in trace.citations() if c.source == "traces/README.md" and not c.generic]
    named = {f.split("/")[1] for c in cites for f in c.files if os.path.basename(f).startswith("records-")}
    root = os.path.join(trace.ROOT, "traces")
    cards = {d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))
             and any(n.startswith("records-") for n in os.listdir(os.path.join(root, d)))}
    assert cards and cards <= named, f"card folders without a named sweep in traces/README.md: {cards - named}"


def test_the_notebooks_latest_sweeps_are_kept():
    """The sweeps the notebooks read (k3fast.measure.nbtools.SWEEPS) are among the files prune keeps."""
    from k3fast.measure import nbtools
    kept = set(trace.prune_plan()[0])
    named = [p for paths in getattr(nbtools, "SWEEPS", {}).values() for p in paths]
    assert set(named) <= kept, f"name these in traces/README.md: {sorted(set(named) - kept)}"


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.fixture
def tiny_repo(tmp_path):
    """A repository with a few traces and the documents that cite them."""
    files = {
        "traces/h100/records-abcdef1-s1.json": '{"records": [{"perfetto": "perfetto-abcdef1-s1/kda_b1_fast.json.gz"}]}',
        "traces/h100/perfetto-abcdef1-s1/kda_b1_fast.json.gz": "x",
        "traces/h100/records-abcdef1-s2.json": '{"records": []}',
        "traces/h100/records-abcdef1-s3.json": '{"records": []}',
        "traces/h100/experts-abcdef1-s2.json": "{}",
        "traces/h100/experts-abcdef1-s2-skewed.json": "{}",
        "traces/h100/junit/gpu-junit-abcdef1-s4.xml": "<testsuite/>",
        "traces/h200/ncu-1234567-s5/ncu-case.txt": "Duration us 1.0",
        "traces/h200/ncu-1234567-s5/meta.txt": "H200",
        "traces/h200/kernels-7654321-s6.json": "{}",
        "traces/h200/kernels-7654321-s7.json": "{}",
        "traces/cpu/ptxcheck-0123456789ab.json": "{}",
        "traces/README.md": "Latest: `traces/h100/records-abcdef1-s1.json`; tests `junit/gpu-junit-abcdef1-s4.xml`.\n"
                            "Kinds: `records-*.json`, `traces/h100/`, `traces/cpu/ptxcheck-*.json`.\n",
        "README.md": "See records-abcdef1-s2.json and `traces/h200/ncu-1234567-s5/ncu-case.txt`, "
                     "the output folder traces/live/ and ncu-2.tgz.\n"
                     "<!-- block:begin traces/h200/kernels-*.json -->\n",
        "notebooks/01_x.py": 'r = [load(f"traces/h100/experts-abcdef1-s2{\'-skewed\' if s else \'\'}.json") for s in (0, 1)]\n'
                             'a, b = (load(f"traces/h100/records-{t}.json") for t in ("abcdef1-s1",))\n',
        "docs/kernels/x.md": "| v1 | ... | 1.0 | `records-abcdef1-s{1,2}.json` |\n"
                             "Relative to traces/: `h200/kernels-7654321-s6.json`.\n",
        "docs/lab-log.md": "Old: `records-fedcba9-s0.json` (in git history only).\n",
        ".gitignore": "/traces/live/\n",
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=k3", "-c", "user.email=k3@example.invalid", "commit", "-q", "-m", "traces")
    return tmp_path


def test_citations_resolve_bare_names_globs_braces_and_placeholders(tiny_repo):
    cites = {c.text: c for c in trace.citations(str(tiny_repo))}
    assert cites["records-abcdef1-s2.json"].files == ["traces/h100/records-abcdef1-s2.json"]
    assert cites["junit/gpu-junit-abcdef1-s4.xml"].files == ["traces/h100/junit/gpu-junit-abcdef1-s4.xml"]
    assert cites["h200/kernels-7654321-s6.json"].files == ["traces/h200/kernels-7654321-s6.json"]
    assert cites["records-abcdef1-s{1,2}.json"].files == ["traces/h100/records-abcdef1-s1.json",
                                                          "traces/h100/records-abcdef1-s2.json"]
    # an f-string's expression and a placeholder filled from the same line's quoted words
    assert set(cites["traces/h100/experts-abcdef1-s2{"].files) == {"traces/h100/experts-abcdef1-s2.json",
                                                                   "traces/h100/experts-abcdef1-s2-skewed.json"}
    assert "traces/h100/records-abcdef1-s1.json" in cites["traces/h100/records-{t}.json"].files
    # kinds of file are generic (they keep nothing); a generated block's marker keeps what its glob reads
    assert cites["records-*.json"].generic and cites["traces/h100/"].generic
    assert cites["traces/cpu/ptxcheck-*.json"].generic
    assert not cites["traces/h200/kernels-*.json"].generic
    # ignored output folders, output names in prose and the frozen lab log are not citations
    assert "traces/live/" not in cites and "ncu-2.tgz" not in cites and "records-fedcba9-s0.json" not in cites
    assert trace.unresolved(list(cites.values())) == []


def test_prune_keeps_cited_files_their_traces_and_metadata(tiny_repo):
    kept, removable, missing = trace.prune_plan(str(tiny_repo))
    assert missing == []
    assert removable == ["traces/cpu/ptxcheck-0123456789ab.json", "traces/h100/records-abcdef1-s3.json"]
    assert "traces/h100/perfetto-abcdef1-s1/kda_b1_fast.json.gz" in kept       # the perfetto of a kept record
    assert "traces/h200/ncu-1234567-s5/meta.txt" in kept                       # beside a cited report
    assert "traces/README.md" in kept
    lines = []
    assert trace.prune(apply=True, root=str(tiny_repo), out=lines.append) == 2
    assert any("remove 2" in line for line in lines)
    assert not (tiny_repo / "traces/h100/records-abcdef1-s3.json").exists()
    assert trace.prune_plan(str(tiny_repo))[1] == []


def test_an_uncited_missing_file_is_reported(tiny_repo):
    (tiny_repo / "docs/kernels/y.md").write_text("figure from `traces/h100/records-abcdef1-s9.json`\n")
    missing = trace.unresolved(trace.citations(str(tiny_repo)))
    assert [(c.source, c.text) for c in missing] == [("docs/kernels/y.md", "traces/h100/records-abcdef1-s9.json")]
