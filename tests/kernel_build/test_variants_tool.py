"""kernel_build/bench/tuning/variants.sh add: the kernel sources and flags a GPU-machine comparison run builds.

`run` needs a GPU (it is exercised on the device); `add` runs anywhere git does.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "kernel_build" / "bench" / "tuning" / "variants.sh"

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


def test_run_rejects_an_unknown_pool_word_before_touching_the_gpu(tmp_path):
    env = {**os.environ, "KDTREE_VARIANTS_DIR": str(tmp_path)}
    r = subprocess.run(["bash", SCRIPT, "run", "2", "fp16"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "run [ROUNDS] [fp8]" in r.stderr


def test_the_pools_table_keeps_each_builds_fastest_round_against_its_own_bf16():
    """bench_pools.py's table, on records as `variants.sh run ROUNDS fp8` writes them (no GPU needed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_pools", ROOT / "kernel_build" / "bench" / "tuning" / "bench_pools.py"
    )
    bench_pools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_pools)
    shape = [1, 8, 16, 32768]
    records = [
        dict(variant="A", shape=shape, pool="bf16", config="wide", us=50.0),
        dict(variant="A", shape=shape, pool="e4m3", config="wide", us=80.0),
        dict(variant="A", shape=shape, pool="e4m3", config="wide", us=75.0),  # a second, faster round
        dict(variant="B", shape=shape, pool="bf16", config="wide", us=40.0),
        dict(variant="B", shape=shape, pool="e4m3", config="wide", us=60.0),
    ]
    lines = bench_pools.table(records)
    assert lines[0].startswith("| batch | H | N | prefix | config | pool | A (us) | A / bf16 | B (us) |")
    row = next(line for line in lines if "| wide | e4m3 |" in line)
    assert row == "| 1 | 8 | 16 | 32768 | wide | e4m3 | 75.0 | 1.50x | 60.0 | 1.50x |"
    assert "| compact | e5m2 | - | - | - | - |" in lines[-1]
