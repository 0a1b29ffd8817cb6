"""k3fast.measure.provenance: a record's source digest, recomputed from git, names the commits that could have made it."""
import os
import subprocess

import pytest

from k3fast.measure import provenance as pv

pytestmark = pytest.mark.ref


def _git(*args):
    return subprocess.run(["git", "-C", pv.ROOT, *args], capture_output=True, text=True, check=True).stdout


def test_blob_id_is_gits():
    data = b"x = 1\n\0binary\xff"
    try:
        want = subprocess.run(["git", "hash-object", "--stdin"], input=data, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git not available")
    assert pv.blob_sha1(data) == want.decode().strip()


def test_digest_sees_every_source_file_and_only_those(tmp_path):
    for rel, text in (("k3fast/a.py", "a"), ("k3ref/b.py", "b"), ("scripts/c.sh", "c"), ("k3fast/__pycache__/a.py", "x"),
                      ("k3fast/notes.md", "n"), ("traces/d.py", "d")):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    base = pv.tree_digest(str(tmp_path))
    (tmp_path / "k3fast/notes.md").write_text("changed")          # not a source file
    (tmp_path / "traces/d.py").write_text("changed")               # outside the source folders
    (tmp_path / "k3fast/__pycache__/a.py").write_text("changed")
    assert pv.tree_digest(str(tmp_path)) == base
    (tmp_path / "k3ref/b.py").write_text("b2")                     # one byte of source moves it
    changed = pv.tree_digest(str(tmp_path))
    assert changed != base
    (tmp_path / "k3ref/b.py").write_text("b")
    (tmp_path / "scripts/new.sh").write_text("")                   # so does a new (e.g. untracked) source file
    assert pv.tree_digest(str(tmp_path)) not in (base, changed)


def test_a_clean_tree_matches_its_commit():
    try:
        head = _git("rev-parse", "HEAD").strip()
        dirty = _git("status", "--porcelain", "--untracked-files=all", "--", *pv.SOURCE_DIRS).strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert pv.commit_digest(head) == pv.commit_digest(head[:12])
    if dirty:
        pytest.skip("source files differ from HEAD in this checkout")
    assert pv.tree_digest() == pv.commit_digest(head)
    assert head[:7] in pv.matching_commits(pv.tree_digest(), max_back=3)
