"""Which commit a record was measured at, checked by content rather than by what the device said.

The device machine runs a copy of the working tree, not a git checkout, so a record's ``commit`` is whatever the
caller put in ``K3_COMMIT``, and a copy's stale git metadata can name a commit from before the code that ran. So
``trace.environment()`` also records ``source_digest``: a hash of the git blob ids of every source file under
``SOURCE_DIRS``, computed from the bytes on disk. Git computes the same blob ids for a commit without checking it
out, so the digest of any commit can be recomputed here and a record matched to the commits that could have made it.

    python -m k3fast.measure.provenance traces/h100/records-<commit>-<step>.json [--max-back 400]

prints the recorded commit, the digest and the commits whose tree gives that digest, and exits 1 where the recorded
commit is not one of them. Untracked source files on the device (the copy carries untracked files that git does not
ignore) change the digest, so a record from such a tree matches no commit, which is the truth.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

SOURCE_DIRS = ("k3fast", "k3ref", "scripts")
SOURCE_SUFFIXES = (".py", ".sh")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def blob_sha1(data: bytes) -> str:
    """Git's object id of a file with these bytes (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _digest(entries: list[tuple[str, str]]) -> str:
    """sha256 over 'path blob' lines in path order; 16 hex digits are plenty to tell commits apart."""
    text = "".join(f"{path} {blob}\n" for path, blob in sorted(entries))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _is_source(path: str) -> bool:
    return path.split("/", 1)[0] in SOURCE_DIRS and path.endswith(SOURCE_SUFFIXES) and "__pycache__" not in path


def tree_digest(root: str = ROOT) -> str:
    """The digest of the source files on disk under ``root`` (what actually ran)."""
    entries = []
    for top in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in filenames:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                if _is_source(rel) and os.path.isfile(full) and not os.path.islink(full):
                    with open(full, "rb") as f:
                        entries.append((rel, blob_sha1(f.read())))
    return _digest(entries)


def commit_digest(commit: str, root: str = ROOT) -> str:
    """The digest the tree of ``commit`` gives, from ``git ls-tree`` (no checkout)."""
    out = subprocess.run(["git", "-C", root, "ls-tree", "-r", commit, "--", *SOURCE_DIRS], capture_output=True,
                         text=True, check=True).stdout
    entries = []
    for line in out.splitlines():
        meta, path = line.split("\t", 1)
        mode, kind, blob = meta.split()
        if kind == "blob" and mode != "120000" and _is_source(path):
            entries.append((path, blob))
    return _digest(entries)


def matching_commits(digest: str, root: str = ROOT, max_back: int = 400) -> list[str]:
    """Short ids of the last ``max_back`` commits of HEAD's history whose tree gives ``digest``."""
    revs = subprocess.run(["git", "-C", root, "rev-list", f"--max-count={max_back}", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.split()
    return [r[:7] for r in revs if commit_digest(r, root) == digest]


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record", help="a records- / experts- / kernels- JSON file written by this repository's tools")
    ap.add_argument("--max-back", type=int, default=400)
    args = ap.parse_args(argv)
    with open(args.record) as f:
        env = json.load(f).get("environment", {})
    digest, commit = env.get("source_digest"), str(env.get("commit", ""))
    if not digest:
        print(f"{args.record}: no source_digest (written before records carried one); recorded commit {commit or '?'}")
        return 2
    hits = matching_commits(digest, max_back=args.max_back)
    print(f"recorded commit {commit}, source digest {digest}; commits with that source: {' '.join(hits) or 'none'}")
    ok = len(commit) >= 7 and any(h == commit[:7] for h in hits)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
