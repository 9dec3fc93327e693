"""kernel_build/bench/benchmarks/source_id.py: one id for the kernel and runtime sources, from files or from a commit."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "kernel_build" / "bench" / "benchmarks" / "source_id.py"
sys.path.insert(0, str(SCRIPT.parent))
from source_id import checkout, source_id  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for path, text in {
        "kernel_build/src/k.cu": "kernel v1\n",
        "kernel_build/include/k.h": "abi\n",
        "kdtree/kernel.py": "binding\n",
        "README.md": "not a source\n",
        ".gitignore": "__pycache__/\n",
    }.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "v1")
    return tmp_path


def test_the_files_of_a_clean_checkout_have_the_id_of_its_commit(repo):
    assert source_id(cwd=str(repo)) == source_id("HEAD", cwd=str(repo))


def test_an_edit_or_a_new_file_changes_the_id_and_an_ignored_or_unrelated_file_does_not(repo):
    at_head = source_id("HEAD", cwd=str(repo))
    (repo / "README.md").write_text("edited\n")
    (repo / "kdtree" / "__pycache__").mkdir()
    (repo / "kdtree" / "__pycache__" / "kernel.pyc").write_text("bytes")
    assert source_id(cwd=str(repo)) == at_head
    (repo / "kdtree" / "extra.py").write_text("new\n")  # untracked but not ignored: it would travel and run
    with_new = source_id(cwd=str(repo))
    assert with_new != at_head
    (repo / "kdtree" / "extra.py").unlink()
    (repo / "kernel_build" / "src" / "k.cu").write_text("kernel v2\n")
    edited = source_id(cwd=str(repo))
    assert edited not in (at_head, with_new)
    git(repo, "commit", "-qam", "v2")
    assert source_id("HEAD", cwd=str(repo)) == edited and source_id("HEAD~1", cwd=str(repo)) == at_head


def test_a_stale_index_does_not_matter(repo):
    """A file the index lists but the checkout no longer has (a copy made from newer files) is left out."""
    (repo / "kdtree" / "kernel.py").unlink()
    git(repo, "rm", "-q", "--cached", "kdtree/kernel.py")
    without = source_id(cwd=str(repo))
    git(repo, "reset", "-q")  # the index lists kernel.py again, the file is still gone
    assert source_id(cwd=str(repo)) == without != source_id("HEAD", cwd=str(repo))


def test_cli_names_the_problem_with_a_bad_revision(repo):
    r = subprocess.run([sys.executable, SCRIPT, "no-such-rev"], cwd=repo, capture_output=True, text=True)
    assert r.returncode == 1 and "REV must name a commit" in r.stderr
    r = subprocess.run([sys.executable, SCRIPT, "HEAD"], cwd=repo, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == source_id("HEAD", cwd=str(repo))


def test_a_table_names_head_marks_uncommitted_kernel_or_runtime_changes_and_gives_the_id(repo):
    head = git(repo, "rev-parse", "--short", "HEAD").strip()
    assert checkout(cwd=str(repo)) == f"{head}; sources {source_id('HEAD', cwd=str(repo))}"
    (repo / "README.md").write_text("edited\n")  # not a source: not marked
    assert "uncommitted" not in checkout(cwd=str(repo))
    (repo / "kdtree" / "kernel.py").write_text("binding v2\n")
    assert checkout(cwd=str(repo)) == (
        f"{head} + uncommitted changes to the kernel or runtime; sources {source_id(cwd=str(repo))}"
    )


def test_the_id_is_the_checkouts_from_any_directory_inside_it(repo):
    """From a subdirectory the sources' paths would match nothing: the id of no files, said as if it were one."""
    sub = repo / "kernel_build" / "src"
    assert source_id(cwd=str(sub)) == source_id(cwd=str(repo)) == source_id("HEAD", cwd=str(sub))
    assert checkout(cwd=str(sub)) == checkout(cwd=str(repo))
    r = subprocess.run([sys.executable, SCRIPT, "HEAD"], cwd=sub, capture_output=True, text=True)
    assert r.stdout.strip() == source_id("HEAD", cwd=str(repo))


def test_outside_a_checkout_a_table_says_the_commit_is_unknown(tmp_path):
    assert checkout(cwd=str(tmp_path)) == "unknown"


def test_without_git_the_cli_says_so_and_a_table_says_the_commit_is_unknown(repo, monkeypatch):
    r = subprocess.run(
        [sys.executable, SCRIPT, "HEAD"],
        cwd=repo,
        capture_output=True,
        text=True,
        env={"PATH": "/nonexistent"},
    )
    assert r.returncode == 1 and "needs git on PATH" in r.stderr
    monkeypatch.setenv("PATH", "/nonexistent")
    assert checkout(cwd=str(repo)) == "unknown"
