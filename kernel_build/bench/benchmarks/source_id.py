"""A content id of the kernel and runtime sources, the same whether computed from the files of a checkout
or from a commit, so that a benchmark table names exactly the code it measured.

The GPU machine's copy of the checkout can carry an older HEAD than the files it holds, so the commit a
benchmark prints is not proof of what ran; this id is. Check a table's id against a commit here:

    python3 kernel_build/bench/benchmarks/source_id.py 759721f     # the id of that commit's sources
    python3 kernel_build/bench/benchmarks/source_id.py             # the id of the files in this checkout

(from anywhere inside the checkout).

The id is the sha256 (first 12 hex digits) of the sorted "blob-id path" lines of every file under SOURCES
that git tracks or would track (ignored files left out); blob ids are git's own.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

SOURCES = ("kernel_build/CMakeLists.txt", "kernel_build/src", "kernel_build/include", "kdtree")


def _git(*args: str, cwd: str | None = None) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=cwd).stdout


def _digest(pairs: list[tuple[str, str]]) -> str:
    lines = sorted(f"{blob} {path}" for blob, path in pairs)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def _top(cwd: str | None) -> str:
    """The checkout's root: SOURCES are paths from it, and git takes paths from the directory it runs in (from a
    subdirectory they would match nothing, and the id would be that of no files)."""
    return _git("rev-parse", "--show-toplevel", cwd=cwd).strip()


def source_id(rev: str | None = None, cwd: str | None = None) -> str:
    """The id of commit `rev`'s sources, or (None) of the files in the checkout at `cwd` (anywhere inside it)."""
    cwd = _top(cwd)
    if rev is not None:
        listing = _git("ls-tree", "-r", "--format=%(objectname) %(path)", rev, "--", *SOURCES, cwd=cwd)
        return _digest([tuple(line.split(" ", 1)) for line in listing.splitlines()])
    listed = _git("ls-files", "-co", "--exclude-standard", "--", *SOURCES, cwd=cwd).splitlines()
    files = sorted({p for p in listed if os.path.isfile(os.path.join(cwd, p))})  # the index may be stale
    blobs = _git("hash-object", "--", *files, cwd=cwd).split() if files else []
    return _digest(list(zip(blobs, files, strict=True)))


def checkout(cwd: str | None = None) -> str:
    """What a benchmark's table says ran: HEAD, marked when the kernel or the runtime differ from it (what a table
    must not hide), and the id of the sources that ran (a GPU machine's copy of the checkout may carry an older
    HEAD than its files: `source_id.py REV` here says which commit the id belongs to)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", top, *args], capture_output=True, text=True).stdout.strip()

    try:
        top = _top(cwd)
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        return "unknown"

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", *SOURCES)
    try:
        ids = f"; sources {source_id(cwd=top)}"
    except (OSError, subprocess.CalledProcessError):  # a table is still worth its commit
        ids = ""
    return head + (" + uncommitted changes to the kernel or runtime" if dirty else "") + ids


if __name__ == "__main__":
    try:
        print(source_id(sys.argv[1] if len(sys.argv) > 1 else None))
    except subprocess.CalledProcessError as e:
        sys.exit(f"git failed: {e.stderr.strip()} (run inside the checkout; REV must name a commit)")
    except OSError as e:
        sys.exit(f"git could not run ({e}): the id needs git on PATH")
