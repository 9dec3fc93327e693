"""The benchmark's GPU side: the library's mma.sync rate and one timed row (the whole run of `python -m kdtree.bench`
is `bash kernel_build/bench/device_run.sh userbench`)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kdtree import bench, kernel  # noqa: E402

pytestmark = pytest.mark.gpu


def test_mma_peak_is_a_plausible_rate():
    rate = kernel.mma_peak_tflops()
    # Dense bf16 with fp32 accumulate: H200 mma.sync measured 628-636 TFLOP/s, RTX PRO 6000 published 503.8.
    assert 20 < rate < 2000, rate
    lone = kernel.mma_peak_tflops(4)  # one warp per scheduler: below the full rate (H200: 565 of 631)
    assert 0.3 * rate < lone < 1.1 * rate, (lone, rate)
    with pytest.raises(ValueError):
        kernel.mma_peak_tflops(33)


def test_one_row_times_kdtree_and_fills_the_columns():
    info = bench.device_info()
    assert (
        info["config"] in kernel.CONFIGS
        and info["sms"] == torch.cuda.get_device_properties(0).multi_processor_count
    )
    assert bench.device_line(info).startswith(f"GPU: {info['gpu']} ({info['sms']} SMs, sm_")
    row = bench.measure(
        (1, 8, 16, 4096), 1e12, 100.0, triton=False, torch_sdpa=False, l2_bytes=info["l2_bytes"]
    )
    assert 1 < row["ours_us"] < 10_000, row
    assert math.isnan(row["triton_us"]) and math.isnan(row["torch_us"])
    kv, io, flops = bench.shape_costs(1, 8, 16, 4096)
    assert row["roofline_us"] == pytest.approx(max(io / 1e12, flops / 100e12) * 1e6)
    assert len(bench.table([row])) == 3


def test_an_fp8_row_times_both_paths_on_that_pool():
    """`python -m kdtree.bench --fp8 e5m2`'s row on this GPU: both fp8 paths timed on an e5m2 pool, beside bf16."""
    row = bench.measure((1, 8, 16, 4096), 1e12, 100.0, triton=False, torch_sdpa=False, fp8="e5m2")
    assert row["fp8_pool"] == "e5m2" and math.isnan(row["triton_fp8_us"])
    for key in ("fp8", "fp8_mma"):
        assert 1 < row[f"{key}_us"] < 10_000, row
        assert row[f"{key}_vs_ours"] == pytest.approx(row[f"{key}_us"] / row["ours_us"])
    head, _, line = bench.table([row])
    assert "fp8 mma / ours" in head and head.count(" |") == line.count(" |")
