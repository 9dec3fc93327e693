"""kernel_build/bench/tuning/sm120_model.py: the paper model of compact on the RTX PRO 6000 (sm_120) in kernel_build/NOTES.md
runs, its rooflines are bytes / bandwidth and FLOPs / rate, its H200 calibration holds on the point it was not fitted
to, and NOTES.md carries the table it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "kernel_build" / "bench" / "tuning" / "sm120_model.py"
sys.path.insert(0, str(SCRIPT.parent))
import sm120_model as m  # noqa: E402

from kdtree.bench import DDTREE, GRID, mma_share, shape_costs  # noqa: E402


def test_it_runs_and_prints_one_row_per_shape_of_the_grid():
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(GRID) == 36


def test_rooflines_are_bytes_over_bandwidth_and_flops_over_rate():
    for row in m.model():
        _, io_bytes, flops = shape_costs(*row["shape"])
        assert row["memory_us"] == pytest.approx(io_bytes / 1.792e12 * 1e6)
        assert row["compute_us"] == pytest.approx(flops / 503.8e12 * 1e6)
    # Half the bandwidth: twice the memory roofline, the same compute roofline.
    for a, b in zip(m.model(), m.model(copy_tbps=m.SM120_COPY_TBPS / 2), strict=True):
        assert b["memory_us"] == pytest.approx(2 * a["memory_us"])
        assert b["compute_us"] == pytest.approx(a["compute_us"])


def test_h8_n16_shapes_are_the_memory_bound_ones_on_this_card_not_on_the_h200():
    # 2*H*N*1088 FLOP per 1152-byte key row against a ridge of 503.8 / 1.792 = 281 FLOP/B: H*N = 128 is below it.
    for row in m.model():
        _, h, n, _ = row["shape"]
        assert (row["bound"] == "memory") == (h * n == 128), row
        if row["bound"] == "memory":  # the H200's ridge, 630 / 4.24 = 149 FLOP/B, has them compute-bound
            _, io_bytes, flops = shape_costs(*row["shape"])
            assert flops / (m.H200_MMA_TFLOPS * 1e12) > io_bytes / (m.H200_COPY_TBPS * 1e12)


def test_prediction_is_the_steady_state_at_compacts_h200_efficiency_plus_the_fixed_cost():
    eff, fixed_h200 = m.compact_h200()
    assert 0.3 < eff < 0.5 and 10 < fixed_h200 < 25
    for row in m.model():
        steady = max(row["memory_us"], row["compute_us"] / eff)
        assert row["predicted_us"] == pytest.approx(steady + row["fixed_us"])
        assert (
            row["fixed_us"] + max(row["memory_us"], row["compute_us"])
            <= row["best_case_us"]
            <= row["predicted_us"]
        )


def test_the_h200_calibration_predicts_the_shapes_it_was_not_fitted_to():
    # Fitted to two shapes; the run measured compact on all 36. The fixed cost weighs most at 4k, where the
    # split plans differ most between shapes.
    eff, fixed = m.compact_h200()
    assert len(m.H200_COMPACT_US) == 36
    for shape, measured in m.H200_COMPACT_US.items():
        predicted = shape_costs(*shape)[2] / (m.H200_MMA_TFLOPS * 1e12) * 1e6 / eff + fixed
        assert predicted == pytest.approx(measured, rel=0.03 if shape[3] >= 32768 else 0.15), shape


def test_fixed_cost_scales_with_the_clock_and_the_ramp_with_bandwidth():
    base = m.fixed_us(m.SM120_COPY_TBPS)
    assert m.fixed_us(m.SM120_COPY_TBPS, m.SM120_CLOCK_GHZ / 2) > base  # a slower clock: longer on-chip part
    assert m.fixed_us(m.SM120_COPY_TBPS / 2) > base  # less bandwidth: a longer ramp
    # With the H200's own clock and bandwidth, the ramp of 188 CTAs instead of 132: a little above the H200's cost.
    _, fixed_h200 = m.compact_h200()
    assert fixed_h200 < m.fixed_us(m.H200_COPY_TBPS, m.H200_CLOCK_GHZ) < fixed_h200 + 2


@pytest.mark.parametrize("args", [[], ["--ddtree"]], ids=["grid", "ddtree"])
def test_notes_carry_the_table_the_script_prints(args):
    notes = (ROOT / "kernel_build" / "NOTES.md").read_text()
    r = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=True
    )
    for line in r.stdout.splitlines():
        assert line in notes, f"kernel_build/NOTES.md lacks this line of sm120_model.py's output:\n{line}"


def test_ddtree_prints_one_row_per_shape_of_the_ddtree_grid():
    r = subprocess.run([sys.executable, str(SCRIPT), "--ddtree"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(DDTREE) == 48
    assert [tuple(map(int, line.split("|")[1:5])) for line in rows] == DDTREE


def test_row_padding_is_the_last_64_row_tiles_empty_share():
    assert m.row_padding(8, 9) == pytest.approx(128 / 72)  # 72 rows in two tiles
    assert m.row_padding(16, 9) == pytest.approx(192 / 144)
    assert m.row_padding(8, 257) == pytest.approx(33 * 64 / 2056)
    assert all(m.row_padding(h, n) == 1 for _, h, n, _ in GRID)  # the calibration grid: whole tiles


def test_ddtree_rows_are_the_grids_model_with_the_padding_and_fp8_on_the_qmma_path():
    eff, _ = m.compact_h200()
    best = m.best_case_tflops(m.SM120_MMA_TFLOPS)
    for row in m.ddtree_model():
        shape = row["shape"]
        _, h, n, _ = shape
        _, io_bytes, flops = shape_costs(*shape)
        assert row["memory_us"] == pytest.approx(io_bytes / 1.792e12 * 1e6)
        assert row["compute_us"] == pytest.approx(flops / 503.8e12 * 1e6)
        padded = row["compute_us"] * m.row_padding(h, n)
        assert row["predicted_us"] == pytest.approx(max(row["memory_us"], padded / eff) + row["fixed_us"])
        assert row["best_case_us"] == pytest.approx(
            max(row["memory_us"], padded * m.SM120_MMA_TFLOPS / best) + row["fixed_us"]
        )
        fp8_memory = shape_costs(*shape, pool_bytes=1)[1] / 1.792e12 * 1e6
        assert row["fp8_b_us"] == pytest.approx(
            max(fp8_memory, padded * m.MMA8_COMPUTE_SHARE / eff) + row["fixed_us"]
        )
        # path (b) reads half the prefix bytes and runs QK^T at twice the rate: never slower than bf16
        assert row["fp8_b_us"] <= row["predicted_us"]
        assert row["predicted_pct_mma"] == pytest.approx(mma_share(row["predicted_us"], shape, 503.8))
        # Under compact's H200 efficiency: the fixed cost and the padding only take from it.
        assert row["predicted_pct_mma"] < 100 * eff
    # At N 257 the padding is small and the fixed cost a sliver of a long call: near the steady state.
    big = [r for r in m.ddtree_model() if r["shape"][2] == 257 and r["shape"][3] == 32768]
    assert all(100 * eff - 3 < r["predicted_pct_mma"] < 100 * eff for r in big)


def test_ddtree_model_at_the_grids_shared_shape_agrees_with_the_grids_model():
    """A DDTree-style row on a shape of the calibration grid (H*N a multiple of 64: no padding) is model()'s row."""
    by_shape = {r["shape"]: r for r in m.model()}
    saved = m.DDTREE
    try:
        m.DDTREE = [(1, 8, 64, 32768), (8, 16, 16, 4096)]
        for row in m.ddtree_model():
            want = by_shape[row["shape"]]
            for key in (
                "memory_us",
                "compute_us",
                "bound",
                "fixed_us",
                "predicted_us",
                "best_case_us",
                "fp8_b_us",
            ):
                assert row[key] == pytest.approx(want[key]) if key != "bound" else row[key] == want[key], key
    finally:
        m.DDTREE = saved
