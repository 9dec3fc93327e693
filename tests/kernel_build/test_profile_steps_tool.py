"""kernel_build/bench/tuning/profile_steps.py: a profile's kernel list cut into steps at the logits kernel, each step
a tree or a chain by the tree kernel in it. The kernel lists here are synthetic (the names as SGLang's profiler
gives them); real ones come from profile_engine.py on a GPU."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernel_build" / "bench" / "tuning"))
import profile_steps  # noqa: E402

VERIFY = "void kdtree::tree_verify_kernel<kdtree::Cfg<64, 32, 3, 8, 16, false, false>, (kdtree::Kv)0>(kdtree::Params)"
COMBINE = "void kdtree::combine_kernel<kdtree::Cfg<64, 32, 3, 8, 16, false, false>, 8>(kdtree::Params)"


def step(t0: float, tree: bool) -> list:
    """One step's kernels from its logits on: the walk, the next draft (with the tree kernel on a tree step), two
    layers' verify and combine."""
    names = ["softcap_inplace_logits_kernel", "walk_kernel", "nvjet_gemm"]
    names += ["tree_kernel"] if tree else []
    names += [VERIFY, COMBINE, VERIFY, COMBINE]
    return [[n, t0 + i, 10.0 if n == VERIFY else 2.0] for i, n in enumerate(names)]


def test_steps_are_cut_at_the_logits_kernel_and_named_by_the_tree_kernel(tmp_path, capsys):
    kernels = [["prefill_kernel", -5.0, 99.0]]  # before the first step: not a whole step
    for i, tree in enumerate([False, True, False, False]):
        kernels += step(100.0 * i, tree)
    rows = profile_steps.steps(list(reversed(kernels)))  # sorted by start time, whatever the file's order
    # the last segment has no logits after it: dropped, as the first part is
    assert [r["kind"] for r in rows] == ["chain", "tree", "chain"]
    assert rows[0] == {
        "kind": "chain",
        "kernel_us": 30.0,
        "verify_us": 20.0,
        "combine_us": 4.0,
        "launches": 7,
    }
    assert rows[1]["launches"] == 8 and rows[1]["kernel_us"] == 32.0
    s = profile_steps.summary(rows)
    assert s["chain"] == {"steps": 2, "kernel_us": 30.0, "verify_us": 20.0, "combine_us": 4.0, "launches": 7,
                          "outside_us": 6.0}  # fmt: skip
    path = tmp_path / "auto.kernels.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(kernels, f)
    out = tmp_path / "steps.json"
    assert profile_steps.main(["--out", str(out), "--source", "synthetic", f"DDTREE-B16-AUTO={path}"]) == 0
    assert json.loads(out.read_text()) == {"source": "synthetic", "steps": {"DDTREE-B16-AUTO": rows}}
    assert "| DDTREE-B16-AUTO | tree | 1 | 32.0 | 8.0 | 20.0 | 4.0 | 8 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        profile_steps.main(["--out", str(out), str(path)])  # no ALGORITHM=: a usage error naming the form
    assert "ALGORITHM=PATH" in capsys.readouterr().err
