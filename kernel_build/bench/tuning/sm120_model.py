"""A performance model, on paper, of kdtree's `compact` configuration on the RTX PRO 6000 Blackwell (sm_120).

    python3 kernel_build/bench/tuning/sm120_model.py [--ddtree] [--copy-tbps X] [--mma-tflops Y] [--clock-ghz Z]

Prints the table of kernel_build/NOTES.md, "A performance model of the RTX PRO 6000 (sm_120)" (a test keeps the
two equal). By default from the card's published numbers (below, each with its source); give the copy bandwidth
and mma.sync rate that `python -m kdtree.bench` measured on your card (and its SM clock under load, nvidia-smi's
clocks.sm) to get the model for that card.

Per shape of the benchmark grid (kdtree.bench.GRID):
- memory roofline = bytes / bandwidth, bytes = KV read once + q + out (kdtree.bench.shape_costs);
- compute roofline = FLOPs / mma.sync rate, FLOPs = 2*H*N*(576 + 512) per key;
- fixed cost per launch, scaled from compact's on the H200 (fixed_us below);
- predicted = max(memory roofline, compute roofline / compact's H200 efficiency) + fixed: the steady state runs at
  the fraction of the mma.sync rate that compact reaches on the H200 (conservative: see best_case);
- best case = the same with compact's H200 rate per SM and clock instead, capped by sm_120's tensor pipe;
- fp8 pools (e4m3; e5m2 about the same): path (a), the default, reads half the prefix bytes and widens them in
  shared memory for f16 mma.sync at bf16's rate; its widening costs compute-side time, measured on the H200: the
  predicted time times what an e4m3 pool cost compact there at the same shape (H200_FP8_RUN_JSON), no lower than the
  fp8 bytes' memory roofline; path (b) (`KDTREE_FP8_PATH=mma`, measured on the H200 only through ptxas's emulation
  of its instruction, which says nothing of sm_120's) runs QK^T as fp8 mma.sync (QMMA) at twice the bf16 rate
  and, in compact's 16-key tiles, PV as half-filled m16n8k32 (as many instructions as bf16): the compute part
  times MMA8_COMPUTE_SHARE, at bf16's efficiency (uncalibrated).
--ddtree prints the model of DDTree's grid instead (kdtree.bench.DDTREE: N = 9 to 257 draft tokens, NOTES.md, "The
model at DDTree's tree sizes"): the same steady state and fixed cost, with the row tiles' padding (one request's H*N
rows in 64-row tiles: N = 2^k + 1 leaves a last tile part empty, whose mma the tensor pipe still runs), each time's
share of the mma.sync bf16 rate (kdtree.bench.mma_share, as the measured grid reports it), and fp8 pools on path (b),
the QMMA path; path (a) needs compact's fp8 cost measured on the H200 at the same shape, which no run has at these.
Pure Python: no GPU, no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[3])
)  # the repository root: kdtree.bench's grid and costs
from kdtree.bench import DDTREE, GRID, mma_share, shape_costs  # noqa: E402  (stdlib only at import)

# ---- RTX PRO 6000 Blackwell (GB202, sm_120): published ----------------------------------------------------------
# 188 of GB202's 192 SMs, 128 MB L2, 128 KB of L1/shared memory per SM at 128 B/clk, L2 ~8.7 TB/s:
#   https://chipsandcheese.com/p/blackwell-nvidias-massive-gpu
SM120_SMS = 188
# Boost clock 2617 MHz (Workstation Edition; the Server Edition is specified alike, Max-Q lower):
#   https://hmc-tech.com/gpu/nvidia-rtx-pro-6000-blackwell-vs-amd-radeon-pro-duo-polaris
SM120_CLOCK_GHZ = 2.617
# 96 GB GDDR7 on a 512-bit bus at 28 Gbps, 1,792 GB/s:
#   https://itdaily.com/news/workplace/nvidia-rtx-pro-blackwell/
SM120_COPY_TBPS = 1.792
# Dense BF16 with FP32 accumulate, 503.8 TFLOP/s (1007.6 with sparsity), NVIDIA's RTX Blackwell PRO architecture
# whitepaper as NVIDIA's cudnn-frontend quotes it (= 1024 FLOP/clk/SM x 188 SMs x 2.617 GHz; full rate with FP32
# accumulate, unlike GeForce parts, which halve it):
#   https://github.com/NVIDIA/cudnn-frontend/blob/main/benchmark/attention_training/benchmark_single_sdpa.py
# sm_120 has no wgmma and no tcgen05, so its cuBLAS runs mma.sync too; cuBLAS bf16 measured 417 TFLOP/s on an RTX PRO
# 6000 Server Edition (8192^3), 83% of this: https://github.com/zzc0721/torch-performance-test-data/issues/162
SM120_MMA_TFLOPS = 503.8
# Shared memory 100 KB per SM, 99 KB per block (opt-in); 64K 32-bit registers per SM; 1536 threads per SM (CCCL's
# architecture traits, shipped with CUDA 13.0 as include/cccl/cuda/__device/arch_traits.h):
#   https://github.com/NVIDIA/cccl/blob/main/libcudacxx/include/cuda/__device/arch_traits.h
SM120_SMEM_PER_SM_KB, SM120_SMEM_PER_BLOCK_KB, SM120_REGS_PER_SM = 100, 99, 65536

# ---- H200 (sm_90): measured here ---------------------------------------------------------------------------------
H200_SMS = 132
H200_CLOCK_GHZ = 1.755  # SM clock under this kernel's load (NOTES.md: Nsight Compute runs at 1.75-1.77 GHz)
# One H200 run measured the ceilings, wide and compact forced (the compact columns) on the whole grid: the table
# of BENCHMARKS.md at 9a05dd8 (`bench_verify.py`), raw numbers in this file.
H200_RUN_JSON = Path(__file__).resolve().parents[1] / "results" / "h200-9a05dd8.json"
_RUN = json.loads(H200_RUN_JSON.read_text())
H200_COPY_TBPS = _RUN["copy_bw"] / 1e12
H200_MMA_TFLOPS = _RUN["mma_tflops"]  # mma.sync bf16, all SMs busy
_SHAPES = {(r["batch"], r["heads"], r["draft"], r["prefix"]): r for r in _RUN["rows"]}
H200_WIDE_US = {s: r["ours_us"] for s, r in _SHAPES.items()}
H200_COMPACT_US = {s: r["compact_us"] for s, r in _SHAPES.items()}
# fp8 path (a) on the H200: compact on an e4m3 pool against compact on bf16, same run, same shapes (BENCHMARKS.md,
# "fp8 pools: both dtypes widened in shared memory"; d2f41bc).
H200_FP8_RUN_JSON = Path(__file__).resolve().parents[1] / "results" / "h200-fp8-0f8da2d.json"
H200_COMPACT_FP8_RATIO = {
    (r["batch"], r["heads"], r["draft"], r["prefix"]): r["compact_fp8_vs_compact"]
    for r in json.loads(H200_FP8_RUN_JSON.read_text())["rows"]
}

# ---- compact (src/tree_verify.cu, Cfg<64, 16, 3, 8, 20, false, true>) -------------------------------------------
BM, BN = 64, 16  # rows (draft token x head) and keys per tile
# A tile's mma m16n8k16: 4 score warps x (2 n-blocks x 36 k-steps) + 8 output warps x (4 m-blocks x 8 n-blocks).
# Each of the four schedulers holds one score warp and two output warps: 72 + 2 x 32 mma per tile, a quarter of
# the tile's, so the tensor pipe does not cap compact below the SM's mma rate.
TILE_MMA, BUSIEST_SCHEDULER_MMA = 4 * 72 + 8 * 32, 72 + 2 * 32
TENSOR_CAP = TILE_MMA / (4 * BUSIEST_SCHEDULER_MMA)
RAMP_BYTES_PER_CTA = BM * 576 * 2 + BN * 576 * 2  # Q and the first key tile: read before a CTA's first mma
CTAS_PER_SM = 1  # 93 KB of shared memory and 12 warps at 168 registers: one CTA per SM on both cards


def compact_h200() -> tuple[float, float]:
    """(efficiency, fixed us) of compact on the H200: time = compute roofline / efficiency + fixed, fitted to the
    batch-1 and the largest measured shape; the third point checks it (test_sm120_model)."""
    (b1, t1), (big, t2) = ((s, H200_COMPACT_US[s]) for s in [(1, 8, 16, 32768), (8, 16, 64, 32768)])
    c1, c2 = (shape_costs(*s)[2] / (H200_MMA_TFLOPS * 1e12) * 1e6 for s in (b1, big))
    eff = (c2 - c1) / (t2 - t1)
    return eff, t1 - c1 / eff


def fixed_us(copy_tbps: float, clock_ghz: float = SM120_CLOCK_GHZ) -> float:
    """compact's fixed cost per launch on sm_120. On the H200 it is ~17 us (compact_h200), nearly all on chip:
    launch, dependent index loads, the pipeline filling and draining, the split merge (whose partial rows stay in
    the L2: 50 MB there, 128 MB here). That part scales with the SM clock (1.755 -> 2.617 GHz). The ramp's DRAM
    traffic (Q and the first key tile of every CTA of the first wave: 12.2 MB on the H200, 17.3 MB on 188 SMs)
    scales with bandwidth instead. Every shape of the grid fills the first wave, so it is one number."""
    _, fixed_h200 = compact_h200()
    ramp_h200 = H200_SMS * CTAS_PER_SM * RAMP_BYTES_PER_CTA / (H200_COPY_TBPS * 1e12) * 1e6
    ramp_sm120 = SM120_SMS * CTAS_PER_SM * RAMP_BYTES_PER_CTA / (copy_tbps * 1e12) * 1e6
    return (fixed_h200 - ramp_h200) * H200_CLOCK_GHZ / clock_ghz + ramp_sm120


def best_case_tflops(mma_tflops: float, clock_ghz: float = SM120_CLOCK_GHZ) -> float:
    """compact's steady-state rate if it keeps its H200 rate per SM and clock (what it is bound by there, latency and
    issue, is per clock the same on both SMs), capped by the tensor pipe of sm_120's two busiest schedulers."""
    eff, _ = compact_h200()
    per_sm_clk_h200 = eff * H200_MMA_TFLOPS * 1e12 / (H200_SMS * H200_CLOCK_GHZ * 1e9)
    per_sm_clk_cap = TENSOR_CAP * mma_tflops * 1e12 / (SM120_SMS * clock_ghz * 1e9)
    return min(per_sm_clk_h200, per_sm_clk_cap) * SM120_SMS * clock_ghz * 1e9 / 1e12


# Path (b) in compact: QK^T's 576 of the 1088 FLOP per key at twice the rate, PV's 512 at the same rate.
MMA8_COMPUTE_SHARE = (576 / 2 + 512) / (576 + 512)


def row_padding(h: int, n: int) -> float:
    """The tensor work a request's H*N rows cost in BM-row tiles, over their own: 1 on the calibration grid (H*N a
    multiple of 64), up to 1.78 at H 8 / N 9 (72 rows in two tiles)."""
    return math.ceil(h * n / BM) * BM / (h * n)


def ddtree_model(
    copy_tbps: float = SM120_COPY_TBPS,
    mma_tflops: float = SM120_MMA_TFLOPS,
    clock_ghz: float = SM120_CLOCK_GHZ,
) -> list[dict]:
    """compact on DDTree's grid: model()'s prediction and best case with the row tiles' padding in the compute part,
    fp8 path (b) likewise, and each one's share of the bf16 mma.sync rate."""
    eff, _ = compact_h200()
    fixed, best = fixed_us(copy_tbps, clock_ghz), best_case_tflops(mma_tflops, clock_ghz)
    rows = []
    for shape in DDTREE:
        _, h, n, _ = shape
        _, io_bytes, flops = shape_costs(*shape)
        memory = io_bytes / (copy_tbps * 1e12) * 1e6
        memory_fp8 = shape_costs(*shape, pool_bytes=1)[1] / (copy_tbps * 1e12) * 1e6
        compute = flops / (mma_tflops * 1e12) * 1e6
        padded = compute * row_padding(h, n)
        predicted = max(memory, padded / eff) + fixed
        fp8_b = max(memory_fp8, padded * MMA8_COMPUTE_SHARE / eff) + fixed
        rows.append(
            dict(
                shape=shape,
                memory_us=memory,
                compute_us=compute,
                bound="memory" if memory > compute else "compute",
                padding=row_padding(h, n),
                fixed_us=fixed,
                predicted_us=predicted,
                predicted_pct_mma=mma_share(predicted, shape, mma_tflops),
                best_case_us=max(memory, padded * mma_tflops / best) + fixed,
                fp8_b_us=fp8_b,
                fp8_b_pct_mma=mma_share(fp8_b, shape, mma_tflops),
            )
        )
    return rows


def model(
    copy_tbps: float = SM120_COPY_TBPS,
    mma_tflops: float = SM120_MMA_TFLOPS,
    clock_ghz: float = SM120_CLOCK_GHZ,
) -> list[dict]:
    eff, _ = compact_h200()
    fixed, best = fixed_us(copy_tbps, clock_ghz), best_case_tflops(mma_tflops, clock_ghz)
    wide = H200_WIDE_US
    rows = []
    for shape in GRID:
        _, io_bytes, flops = shape_costs(*shape)
        memory = io_bytes / (copy_tbps * 1e12) * 1e6
        memory_fp8 = shape_costs(*shape, pool_bytes=1)[1] / (copy_tbps * 1e12) * 1e6
        compute = flops / (mma_tflops * 1e12) * 1e6
        rows.append(
            dict(
                shape=shape,
                memory_us=memory,
                compute_us=compute,
                bound="memory" if memory > compute else "compute",
                fixed_us=fixed,
                predicted_us=max(memory, compute / eff) + fixed,
                best_case_us=max(memory, flops / (best * 1e12) * 1e6) + fixed,
                fp8_a_us=max(
                    memory_fp8 + fixed, (max(memory, compute / eff) + fixed) * H200_COMPACT_FP8_RATIO[shape]
                ),
                fp8_b_us=max(memory_fp8, compute * MMA8_COMPUTE_SHARE / eff) + fixed,
                h200_wide_us=wide[shape],
            )
        )
    return rows


def markdown(rows: list[dict]) -> list[str]:
    out = [
        "| batch | H | N | prefix | memory roofline (us) | compute roofline (us) | bound at the rooflines "
        "| fixed (us) | predicted compact (us) | best case (us) | fp8 pool, path (a) (us) | fp8 pool, path (b) (us) "
        "| H200 wide, measured (us) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bs, h, n, p = r["shape"]
        out.append(
            f"| {bs} | {h} | {n} | {p} | {r['memory_us']:.1f} | {r['compute_us']:.1f} | {r['bound']} "
            f"| {r['fixed_us']:.1f} | {r['predicted_us']:.0f} | {r['best_case_us']:.0f} | {r['fp8_a_us']:.0f} "
            f"| {r['fp8_b_us']:.0f} | {r['h200_wide_us']:.1f} |"
        )
    return out


def ddtree_markdown(rows: list[dict]) -> list[str]:
    out = [
        "| batch | H | N | prefix | memory roofline (us) | compute roofline (us) | bound at the rooflines "
        "| row tiles' padding | fixed (us) | predicted compact (us) | predicted, % of mma.sync | best case (us) "
        "| fp8 pool, path (b) (us) | path (b), % of bf16 mma.sync |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bs, h, n, p = r["shape"]
        out.append(
            f"| {bs} | {h} | {n} | {p} | {r['memory_us']:.1f} | {r['compute_us']:.1f} | {r['bound']} "
            f"| {r['padding']:.2f}x | {r['fixed_us']:.1f} | {r['predicted_us']:.0f} | {r['predicted_pct_mma']:.0f}% "
            f"| {r['best_case_us']:.0f} | {r['fp8_b_us']:.0f} | {r['fp8_b_pct_mma']:.0f}% |"
        )
    return out


def summary(copy_tbps: float, mma_tflops: float, clock_ghz: float) -> list[str]:
    eff, fixed_h200 = compact_h200()
    best = best_case_tflops(mma_tflops, clock_ghz)
    return [
        f"Inputs: {SM120_SMS} SMs at {clock_ghz} GHz, copy {copy_tbps:.3f} TB/s, mma.sync bf16 "
        f"{mma_tflops:.1f} TFLOP/s (ridge {mma_tflops / copy_tbps:.0f} FLOP/B); compact on the H200: "
        f"{100 * eff:.1f}% of the mma.sync rate + {fixed_h200:.1f} us per launch",
        f"Steady state: predicted at {eff * mma_tflops:.0f} TFLOP/s ({100 * eff:.1f}%), best case at "
        f"{best:.0f} TFLOP/s ({100 * best / mma_tflops:.1f}%); fixed {fixed_us(copy_tbps, clock_ghz):.1f} us per launch",
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copy-tbps", type=float, default=SM120_COPY_TBPS, help="copy bandwidth, TB/s")
    ap.add_argument("--mma-tflops", type=float, default=SM120_MMA_TFLOPS, help="mma.sync bf16 rate, TFLOP/s")
    ap.add_argument("--clock-ghz", type=float, default=SM120_CLOCK_GHZ, help="SM clock under load, GHz")
    ap.add_argument("--ddtree", action="store_true", help="DDTree's grid (N 9 to 257), fp8 pools on path (b)")
    a = ap.parse_args(argv)
    ceilings = (a.copy_tbps, a.mma_tflops, a.clock_ghz)
    table = ddtree_markdown(ddtree_model(*ceilings)) if a.ddtree else markdown(model(*ceilings))
    lines = [*summary(*ceilings), "", *table]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
