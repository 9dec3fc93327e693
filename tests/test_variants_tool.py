"""kernel_build/bench/variants.sh add: the kernel sources and flags a GPU-machine comparison run builds.

`run` needs a GPU (it is exercised on the device); `add` runs anywhere git does.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "kernel_build" / "bench" / "variants.sh"

pytestmark = pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout")


def _add(dest: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KDTREE_VARIANTS_DIR": str(dest)}
    return subprocess.run(["bash", SCRIPT, "add", *args], env=env, capture_output=True, text=True)


def test_add_copies_the_kernel_sources_at_a_commit_with_its_flags(tmp_path):
    r = _add(tmp_path, "q8", "HEAD", "-DKDTREE_WIDE_QREG=8")
    assert r.returncode == 0, r.stderr
    v = tmp_path / "q8"
    at_head = subprocess.run(
        ["git", "show", "HEAD:kernel_build/src/tree_verify.cu"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert (v / "src" / "tree_verify.cu").read_text() == at_head
    assert (v / "CMakeLists.txt").is_file() and (v / "include" / "kdtree_verify.h").is_file()
    assert (v / "flags").read_text().split() == ["-DKDTREE_WIDE_QREG=8"]


def test_add_rejects_an_unknown_commit_and_a_bad_name(tmp_path):
    r = _add(tmp_path, "x", "no-such-ref")
    assert r.returncode == 2 and "no commit 'no-such-ref'" in r.stderr
    r = _add(tmp_path, "a b", "HEAD")
    assert r.returncode == 2 and "variant name 'a b'" in r.stderr
    assert not any(tmp_path.iterdir())
