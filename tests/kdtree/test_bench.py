"""`python -m kdtree.bench`, the benchmark users run from the server image, on the CPU side: its one-line refusals,
its command line, and that it computes the published tables' rows (kernel_build/bench/benchmarks/bench_verify.py, which made
them, now runs on its functions). The GPU side runs on the GPU machine (tests/gpu, device_run.sh userbench)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from kdtree import bench, kernel  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = (
    ROOT / "kernel_build" / "bench" / "results" / "h200-371e508.json"
)  # the table in BENCHMARKS.md at 371e508


def run_module(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kdtree.bench", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        timeout=120,
    )


def test_without_a_gpu_it_exits_2_with_one_line():
    r = run_module(CUDA_VISIBLE_DEVICES="")  # hides any GPU this machine has
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    assert r.stderr.splitlines() == ["kdtree.bench: no CUDA GPU is visible (run the image with --gpus all)"]


def test_help_names_the_grids_and_the_output():
    r = run_module("--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--quick", "--full", "--ddtree", "--torch", "--fp8 [{e4m3,e5m2}]", "--out DIR"):
        assert flag in r.stdout
    assert run_module("--quick", "--full").returncode == 2  # one grid or the other
    assert run_module("--full", "--ddtree").returncode == 2
    both = run_module("--ddtree", "--fp8")
    assert both.returncode == 2 and "--ddtree times bf16 pools only" in both.stderr
    bad = run_module("--fp8", "e4m3fn")
    assert bad.returncode == 2 and "invalid choice: 'e4m3fn' (choose from" in bad.stderr


@pytest.mark.parametrize("flag, pool", [([], None), (["--fp8"], "e4m3"), (["--fp8", "e5m2"], "e5m2")])
def test_fp8_flag_times_every_row_on_that_pool_and_names_it(monkeypatch, tmp_path, capsys, flag, pool):
    """--fp8 reaches measure() for every row (the fp8 columns, both paths: the CPU test of measure() below) and the
    output names the pool and which column is which path; without it no row is timed on an fp8 pool."""
    dev = dict(
        gpu="stand-in GPU (not a device)",
        sms=1,
        capability="sm_120",
        l2_bytes=0,
        config="compact",
        config_forced=False,
        archs=["sm_120"],
        date="2026-12-03",
        kdtree="0",
    )
    asked = []

    def measure(shape, bw, mma, *, torch_sdpa, fp8, l2_bytes):
        asked.append(fp8)
        row = dict(
            batch=shape[0],
            heads=shape[1],
            draft=shape[2],
            prefix=shape[3],
            ours_us=10.0,
            triton_us=100.0,
            torch_us=50.0,
            speedup=10.0,
            gbps=1.0,
            tflops=1.0,
            roofline_us=5.0,
            pct_roofline=50.0,
        )
        if fp8:
            row |= dict(
                fp8_us=9.0,
                fp8_vs_ours=0.9,
                triton_fp8_us=90.0,
                fp8_mma_us=7.0,
                fp8_mma_vs_ours=0.7,
                fp8_pool=fp8,
            )
        return row

    monkeypatch.setattr(bench, "device_info", lambda: dev)
    monkeypatch.setattr(bench, "_require_baseline", lambda: None)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 1.8e12)
    monkeypatch.setattr(kernel, "mma_peak_tflops", lambda: 500.0)
    monkeypatch.setattr(bench, "measure", measure)
    assert bench.main([*flag, "--out", str(tmp_path)]) == 0
    assert asked == [pool] * len(bench.QUICK)
    text = (tmp_path / "bench.md").read_text()
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["fp8_pool"] == pool
    if pool:
        assert f"fp8 columns on an fp8 {pool} pool" in text and "`fp8 mma` KDTREE_FP8_PATH=mma" in text
        assert (
            "| fp8 (us) | fp8 / ours | Triton fp8 (us) | fp8 speedup vs Triton fp8 | fp8 mma (us) | fp8 mma / ours |"
            in text
        )
        assert "| 9.0 | 0.90x | 90 | 10x | 7.0 | 0.70x |" in text
        assert "| 7.0 | 0.70x |" in capsys.readouterr().out
    else:
        assert "fp8" not in text


def test_a_missing_library_is_named_in_one_line(monkeypatch):
    monkeypatch.setattr(bench, "_cuda_visible", lambda: True)  # as if a GPU were there
    monkeypatch.setenv("KDTREE_KERNEL_LIB", "/nonexistent/libkdtree_verify.so")
    kernel.library.cache_clear()
    try:
        with pytest.raises(bench.EnvironmentProblem) as e:
            bench.device_info()
    finally:
        kernel.library.cache_clear()
    assert str(e.value).startswith("kdtree.bench: kdtree kernel library not found; tried: /nonexistent/")
    assert "\n" not in str(e.value)


def test_grids():
    assert len(bench.GRID) == 36 and len(set(bench.GRID)) == 36
    assert set(bench.QUICK) <= set(bench.GRID)
    assert bench.QUICK[:2] == [(1, 8, 16, 32768), (32, 8, 16, 4096)]  # the two goals of the published tables


def test_the_ddtree_grid_is_its_tree_sizes_at_each_shape():
    """N = budget + 1 for budgets 8 to 256, at bs 1 and 4, 8 and 16 heads, prefixes 8k and 32k: 48 rows, those of one
    (bs, H, prefix) together in order of N; every row fits the kernel's limits."""
    assert bench.DDTREE_N == (9, 17, 33, 65, 129, 257)
    assert len(bench.DDTREE) == 48 == len(set(bench.DDTREE))
    assert set(bench.DDTREE) == {
        (bs, h, n, p) for bs in (1, 4) for h in (8, 16) for n in bench.DDTREE_N for p in (8192, 32768)
    }
    assert bench.DDTREE[:6] == [(1, 8, n, 8192) for n in bench.DDTREE_N]
    assert bench.DDTREE[6:12] == [(1, 8, n, 32768) for n in bench.DDTREE_N]
    assert all(h <= kernel.MAX_HEADS and n <= kernel.MAX_Q_LEN for _, h, n, _ in bench.DDTREE)


def test_mma_share_counts_the_prefix_work_against_the_run_rate():
    # The issue's own row: bs 1, 8 heads, N 257, 32k prefix, 493.4 us at 630 TFLOP/s is 47% of the rate.
    assert bench.mma_share(493.4, (1, 8, 257, 32768), 630.0) == pytest.approx(47.2, abs=0.05)
    flops = 2 * 4 * 16 * 65 * 8192 * (576 + 512)
    assert bench.mma_share(100.0, (4, 16, 65, 8192), 500.0) == pytest.approx(100 * flops / 100e-6 / 500e12)
    # Twice the time, half the share; twice the rate, half the share.
    assert bench.mma_share(200.0, (1, 8, 9, 8192), 600.0) == pytest.approx(
        bench.mma_share(100.0, (1, 8, 9, 8192), 1200.0)
    )
    assert bench.mma_share(200.0, (1, 8, 9, 8192), 600.0) == pytest.approx(
        bench.mma_share(100.0, (1, 8, 9, 8192), 600.0) / 2
    )


def ddtree_row(shape, ours, compact=None):
    """A row with the columns measure() returns (a stand-in's times), with compact when given."""
    row = dict(batch=shape[0], heads=shape[1], draft=shape[2], prefix=shape[3], ours_us=ours, triton_us=6000.0,
               torch_us=float("nan"), speedup=6000.0 / ours, gbps=1.0, tflops=1.0, roofline_us=5.0,
               pct_roofline=100 * 5.0 / ours)  # fmt: skip
    if compact is not None:
        row |= dict(
            compact_us=compact, compact_pct_roofline=100 * 5.0 / compact, compact_vs_ours=compact / ours
        )
    return row


def test_the_ddtree_table_has_each_configurations_share_and_the_ratio():
    shape = (1, 8, 257, 32768)
    row = bench.with_mma_shares(ddtree_row(shape, 493.4, 625.0), 630.0)
    assert row["pct_mma"] == pytest.approx(bench.mma_share(493.4, shape, 630.0))
    assert row["compact_pct_mma"] == pytest.approx(bench.mma_share(625.0, shape, 630.0))
    head, rule, line = bench.ddtree_table([row])
    assert head == (
        "| batch | H | N | prefix | ours (us) | ours, % of mma.sync | Triton (us) | speedup vs Triton |"
        " compact (us) | compact, % of mma.sync | compact / ours |"
    )
    assert head.count(" |") == rule.count("|---") == line.count(" |")
    assert line == "| 1 | 8 | 257 | 32768 | 493.4 | 47% | 6000 | 12.2x | 625.0 | 37% | 1.27x |"
    # A GPU that runs compact itself (sm_120) times no second configuration: no compact columns.
    head, _, line = bench.ddtree_table([bench.with_mma_shares(ddtree_row(shape, 600.0), 500.0)])
    assert "compact" not in head and "compact_pct_mma" not in bench.with_mma_shares(
        ddtree_row(shape, 600.0), 500.0
    )
    assert line == "| 1 | 8 | 257 | 32768 | 600.0 | 49% | 6000 | 10x |"
    # PyTorch SDPA (--torch) gets its column where a row timed it.
    head, _, line = bench.ddtree_table(
        [bench.with_mma_shares(ddtree_row(shape, 600.0) | {"torch_us": 3000.0}, 500.0)]
    )
    assert head.endswith("| speedup vs Triton | PyTorch (us) |") and line.endswith("| 10x | 3000 |")


@pytest.mark.parametrize("config", ["wide", "compact"])
def test_ddtree_flag_times_the_ddtree_grid_with_compact_beside_wide(monkeypatch, tmp_path, capsys, config):
    """--ddtree times every DDTree row, compact forced beside the device's configuration where that is wide, and
    writes the DDTree table (shares of the run's mma.sync rate) and a record that names the grid."""
    dev = dict(gpu="stand-in GPU (not a device)", sms=1, capability="sm_90", l2_bytes=0, config=config,
               config_forced=False, archs=["sm_90"], date="2026-12-04", kdtree="0")  # fmt: skip
    asked = []

    def measure(shape, bw, mma, *, torch_sdpa, compact, l2_bytes):
        asked.append((shape, torch_sdpa, compact))
        return ddtree_row(shape, 100.0, 120.0 if compact else None)

    monkeypatch.setattr(bench, "device_info", lambda: dev)
    monkeypatch.setattr(bench, "_require_baseline", lambda: None)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4.2e12)
    monkeypatch.setattr(kernel, "mma_peak_tflops", lambda: 630.0)
    monkeypatch.setattr(bench, "measure", measure)
    assert bench.main(["--ddtree", "--out", str(tmp_path)]) == 0
    assert asked == [(s, False, config == "wide") for s in bench.DDTREE]
    text = (tmp_path / "bench.md").read_text()
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["grid"] == "ddtree" and len(record["rows"]) == 48
    assert record["rows"][0]["pct_mma"] == pytest.approx(bench.mma_share(100.0, bench.DDTREE[0], 630.0))
    assert f"DDTree grid; {bench.DDTREE_NOTE}" in text and "FLOPs 2*bs*H*N*P*(576 + 512) per call" in text
    for line in bench.ddtree_table(record["rows"]):
        assert line in text
    assert ("compact / ours" in text) == (config == "wide")
    assert "| 1 | 8 | 9 | 8192 | 100.0 |" in capsys.readouterr().out


def test_bench_verify_ddtree_grid_is_the_users_one():
    """bench_verify.py --ddtree times kdtree.bench.DDTREE and prints kdtree.bench.ddtree_table: one grid, one table."""
    sys.path.insert(0, str(ROOT / "kernel_build" / "bench" / "benchmarks"))
    try:
        import bench_verify
    finally:
        sys.path.pop(0)
    for name in ("DDTREE", "ddtree_table", "with_mma_shares"):
        assert getattr(bench_verify, name) is getattr(bench, name), name


def test_device_run_has_the_ddtree_grid_target():
    """device_run.sh ddtree-grid runs bench_verify.py --ddtree into $OUT, the GPU tests at DDTree's sizes and the users'
    command (and names the target in its usage line)."""
    script = (ROOT / "kernel_build" / "bench" / "device_run.sh").read_text()
    usage = next(line for line in script.splitlines() if line.startswith("# usage:"))
    assert "|ddtree-grid|" in usage
    block = script.split('if [ "$what" = ddtree-grid ]; then', 1)[1].split("\nfi\n", 1)[0]
    assert "bench_verify.py --ddtree" in block and '--out "$out/ddtree.md"' in block
    assert '-m kdtree.bench --ddtree --out "$out/userbench-ddtree"' in block
    assert (
        '-k "ddtree or short_prefix"' in block
    )  # the GPU tests at DDTree's sizes (tests/gpu), in the same call
    r = subprocess.run(
        ["bash", "-n", str(ROOT / "kernel_build" / "bench" / "device_run.sh")], capture_output=True
    )
    assert r.returncode == 0, r.stderr


def test_device_run_names_its_parts_before_it_looks_for_a_gpu():
    """A typo is refused (exit 2, the parts listed) and --help answered on a machine without a GPU; every part the
    script runs is in its list and its usage line."""
    path = ROOT / "kernel_build" / "bench" / "device_run.sh"
    script = path.read_text()
    listed = set(re.search(r'^parts="([^"]+)"', script, re.M).group(1).split())
    usage = next(line for line in script.splitlines() if line.startswith("# usage:"))
    assert (
        listed
        == set(re.findall(r'"\$what" = ([\w-]+)', script))
        == set(usage.split("[", 1)[1].split("]")[0].split("|"))
    )
    bad = subprocess.run(["bash", str(path), "engine-spce"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "no part named 'engine-spce'" in bad.stderr and "engine-spec" in bad.stderr
    assert "nvidia-smi" not in bad.stderr
    helped = subprocess.run(["bash", str(path), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert helped.returncode == 0 and "# usage:" in helped.stdout


def test_input_sets_keep_the_published_rule_on_the_h200_and_grow_with_the_l2():
    h200_l2 = 50 * 2**20
    for shape in bench.GRID:
        kv = bench.shape_costs(*shape)[0]
        assert bench.input_sets(kv, h200_l2) == max(
            1, min(8, math.ceil(3 * 60e6 / kv))
        )  # bench_verify's rule
        big = bench.input_sets(kv, 128 * 2**20)  # RTX PRO 6000 Blackwell: 128 MB of L2
        assert big >= bench.input_sets(kv, h200_l2)
        assert big * kv >= 3 * 128 * 2**20 or big == math.ceil(8 * 128 * 2**20 / 60e6)


def test_rows_and_table_reproduce_the_published_h200_table(monkeypatch):
    """Fed the published run's times and ceilings, measure() returns that run's rows and table() prints the lines
    of the table in kernel_build/BENCHMARKS.md: the shared code computes what bench_verify.py computed."""
    run = json.loads(PUBLISHED.read_text().replace("NaN", '"nan"'))
    published = {(r["batch"], r["heads"], r["draft"], r["prefix"]): r for r in run["rows"]}
    assert set(published) == set(bench.GRID)
    made = []

    class Batch:
        def __init__(self, *shape):
            self.shape = shape

    def make_batch(bs, h, n, p, seed, spare_slots):
        made.append(seed)
        return Batch(bs, h, n, p)

    def published_time(key):
        return lambda b: float(published[b.shape if isinstance(b, Batch) else b[0].shape][key])

    monkeypatch.setattr("kdtree.reference.make_batch", make_batch)
    monkeypatch.setattr(bench, "time_ours", published_time("ours_us"))
    monkeypatch.setattr(bench, "time_triton", published_time("triton_us"))
    monkeypatch.setattr(bench, "time_torch", published_time("torch_us"))
    rows = [bench.measure(s, run["copy_bw"], run["mma_tflops"], l2_bytes=50 * 2**20) for s in bench.GRID]
    for row in rows:
        want = published[(row["batch"], row["heads"], row["draft"], row["prefix"])]
        for key, value in row.items():
            if isinstance(want[key], str) or math.isnan(value):  # PyTorch out of memory
                assert math.isnan(value) and want[key] == "nan", key
            else:
                assert value == pytest.approx(want[key], rel=1e-12), (key, row)
    text = (ROOT / "kernel_build" / "BENCHMARKS.md").read_text()
    for line in bench.table(rows):
        assert line in text, line
    assert max(made) == 7  # the smallest shapes are timed over 8 input sets, as published


def test_bench_verify_runs_on_the_shared_functions():
    sys.path.insert(0, str(ROOT / "kernel_build" / "bench" / "benchmarks"))
    try:
        import bench_verify
    finally:
        sys.path.pop(0)
    for name in ("measure", "table", "progress", "copy_bandwidth", "GRID", "QUICK"):
        assert getattr(bench_verify, name) is getattr(bench, name), name
    for own in ("time_ours", "time_triton", "time_torch", "L2_BYTES"):
        assert not hasattr(bench_verify, own), f"bench_verify.py has its own {own}: one implementation only"


def test_fp8_rows_time_both_paths_in_both_configurations(monkeypatch):
    """With fp8 (a pool dtype), a row times kdtree on a pool of that dtype by each path (widen, mma) in the device's
    and the compact configuration, and its table line has a cell for every heading (a table saved before the mma
    path renders without its columns)."""
    timed = []

    def time_ours(batches, config=None, fp8_path=None):
        fp8 = str(batches[0].k_buf.dtype) != "torch.bfloat16"
        timed.append((config, fp8_path if fp8 else None))
        return {None: 10.0, "compact": 12.0}[config] * ({None: 1, "widen": 1.5, "mma": 1.25}[timed[-1][1]])

    class Batch:
        def __init__(self):
            import torch

            self.k_buf = torch.zeros(1, dtype=torch.bfloat16)

    pools = []

    def fp8_pool(b, dtype, k_scale, v_scale):
        import torch

        pools.append(dtype)
        b = Batch()
        b.k_buf = torch.zeros(1, dtype=dtype)
        return b

    monkeypatch.setattr("kdtree.reference.make_batch", lambda *a, **k: Batch())
    monkeypatch.setattr("kdtree.reference.fp8_pool", fp8_pool)
    monkeypatch.setattr(bench, "time_ours", time_ours)
    row = bench.measure((1, 8, 16, 4096), 4e12, 600, triton=False, torch_sdpa=False, compact=True, fp8="e5m2")
    assert sorted(timed, key=str) == sorted(
        [
            (None, None),
            ("compact", None),
            (None, "widen"),
            ("compact", "widen"),
            (None, "mma"),
            ("compact", "mma"),
        ],
        key=str,
    )
    import torch

    assert set(pools) == {torch.float8_e5m2} and row["fp8_pool"] == "e5m2"  # the pool named, not e4m3's
    assert (row["fp8_vs_ours"], row["fp8_mma_vs_ours"]) == (1.5, 1.25)
    assert (row["compact_fp8_vs_compact"], row["compact_fp8_mma_vs_compact"]) == (1.5, 1.25)
    head, _, line = bench.table([row])
    assert head.count(" |") == line.count(" |")
    assert "fp8 mma / ours" in head and "compact fp8 mma / compact" in head and " 12.5 | 1.25x |" in line
    old = {k: v for k, v in row.items() if "mma" not in k}
    head, _, line = bench.table([old])
    assert "mma" not in head and head.count(" |") == line.count(" |")


def test_the_fp8_table_against_triton_is_its_raw_record_rendered():
    """BENCHMARKS.md's fp8 grid beside SGLang's own fp8 path is table() of the raw record it names, line for line."""
    run = json.loads(
        (ROOT / "kernel_build" / "bench" / "results" / "h200-fp8-triton-19c6e00.json").read_text()
    )
    assert {(r["batch"], r["heads"], r["draft"], r["prefix"]) for r in run["rows"]} == set(bench.GRID)
    text = (ROOT / "kernel_build" / "BENCHMARKS.md").read_text()
    lines = bench.table(run["rows"])
    assert "fp8 speedup vs Triton fp8" in lines[0]
    for line in lines:
        assert line in text, line


def test_the_dflash_end_to_end_table_is_its_raw_record_rendered():
    """BENCHMARKS.md's DFLASH rows are bench_engine.markdown() of the raw record it names, line for line."""
    sys.path.insert(0, str(ROOT / "kernel_build" / "bench" / "benchmarks"))
    import bench_engine

    run = json.loads(
        (ROOT / "kernel_build" / "bench" / "results" / "engine-h200-dflash-26edbab.json").read_text()
    )
    assert {(r["algorithm"], r["prompt"]) for r in run["rows"]} == {
        (a, p) for a in ("DFLASH-B8", "DFLASH-B16") for p in (2048, 32768)
    }
    assert all(r["identical"] for r in run["rows"]) and run["not_measured"] == {}
    text = (ROOT / "kernel_build" / "BENCHMARKS.md").read_text()
    for line in bench_engine.markdown(run["rows"], []).splitlines()[
        1:
    ]:  # after the blank line its head ends with
        assert line in text, line


def test_bench_verify_ddtree_writes_its_table_and_record_after_every_row(monkeypatch, tmp_path):
    """bench_verify.py --ddtree (its GPU calls stood in for): after each row, ddtree.md holds the header (GPU, date,
    commit, command) and the DDTree table of the rows so far, and ddtree.json the record with them; at the end all 48."""
    sys.path.insert(0, str(ROOT / "kernel_build" / "bench" / "benchmarks"))
    try:
        import bench_verify
    finally:
        sys.path.pop(0)

    class Props:  # a stand-in for torch.cuda.get_device_properties' answer
        name, multi_processor_count, L2_cache_size = "stand-in GPU (not a device)", 132, 50 * 2**20

    out = tmp_path / "ddtree.md"
    seen = []

    def measure(shape, bw, mma, *, triton, torch_sdpa, compact, fp8, l2_bytes):
        assert (triton, torch_sdpa, compact, fp8) == (True, False, True, None)
        if out.exists():  # what the previous rows left
            seen.append(len(json.loads(out.with_suffix(".json").read_text())["rows"]))
        return ddtree_row(shape, 100.0, 125.0)

    monkeypatch.setattr(bench_verify, "copy_bandwidth", lambda: 4.2e12)
    monkeypatch.setattr(bench_verify.kernel, "mma_peak_tflops", lambda: 630.0)
    monkeypatch.setattr(bench_verify, "cublas_tflops", lambda: 700.0)
    monkeypatch.setattr(bench_verify, "flash_attention_tflops", lambda: ("FA2 stand-in", {128: 350.0}))
    monkeypatch.setattr(bench_verify.torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(bench_verify, "device_info", lambda: dict(config="wide"))
    monkeypatch.setattr(bench_verify, "checkout", lambda: "abc1234; sources 0123456789ab")
    monkeypatch.setattr(bench_verify, "measure", measure)
    monkeypatch.delenv("KDTREE_KERNEL_CONFIG", raising=False)
    argv = ["bench_verify.py", "--ddtree", "--no-torch", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_verify.main()
    assert seen == list(range(1, 48))
    text = out.read_text()
    assert text.startswith("GPU: stand-in GPU (not a device) (132 SMs), ")
    assert "commit abc1234; sources 0123456789ab" in text and f"command: {' '.join(argv)}" in text
    assert f"DDTree grid: {bench.DDTREE_NOTE}" in text
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["grid"] == "ddtree" and record["commit"] == "abc1234; sources 0123456789ab"
    assert record["mma_tflops"] == 630.0 and len(record["rows"]) == 48
    for line in bench.ddtree_table(record["rows"]):
        assert line in text
    assert "| 1 | 8 | 9 | 8192 | 100.0 | " in text and "| 125.0 | " in text and "| 1.25x |" in text


def test_the_ddtree_tables_in_benchmarks_md_are_their_raw_records_rendered():
    """Every DDTree record in results/ (bench_verify.py --ddtree's ddtree.json, grid "ddtree") has its table in
    BENCHMARKS.md, line for line, with the GPU, date, commit and command its header names."""
    records = [
        json.loads(p.read_text())
        for p in sorted((ROOT / "kernel_build" / "bench" / "results").glob("*.json"))
    ]
    # bench_verify.py's records (kdtree.bench's, e.g. a userbench run's, name no commit)
    ddtree = [r for r in records if isinstance(r, dict) and r.get("grid") == "ddtree" and "commit" in r]
    if not ddtree:
        pytest.skip(
            "no DDTree record in kernel_build/bench/results yet (device_run.sh ddtree-grid makes one)"
        )
    text = (ROOT / "kernel_build" / "BENCHMARKS.md").read_text()
    for run in ddtree:
        assert {(r["batch"], r["heads"], r["draft"], r["prefix"]) for r in run["rows"]} == set(bench.DDTREE)
        assert run["commit"] in text and run["command"] in text
        for line in bench.ddtree_table(run["rows"]):
            assert line in text, line


def test_bench_verify_shape_takes_four_positive_integers():
    """bench_verify.py --shape BS,H,N,P (tuning runs time a few shapes) parses four positive integers and names the
    form it wants otherwise."""
    import argparse

    sys.path.insert(0, str(ROOT / "kernel_build" / "bench" / "benchmarks"))
    try:
        import bench_verify
    finally:
        sys.path.pop(0)
    assert bench_verify.shape_arg("1,8,65,32768") == (1, 8, 65, 32768)
    for bad in ("1,8,65", "1,8,0,32768", "1,8,x,32768", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="BS,H,N,P as four positive integers"):
            bench_verify.shape_arg(bad)
