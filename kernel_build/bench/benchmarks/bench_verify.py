"""Benchmark: kdtree tree-verify vs SGLang's Triton extend kernel and plain PyTorch, against the roofline.

Run on a GPU with SGLang importable (see README, "GPU tests and benchmark"):
    python kernel_build/bench/benchmarks/bench_verify.py --out bench.md
    python kernel_build/bench/benchmarks/bench_verify.py --ddtree --no-torch --out ddtree.md   # DDTree's grid

The timing, the roofline and the table are kdtree.bench's (what `python -m kdtree.bench` runs in the server
image); this script adds what the committed tables carry besides: cuBLAS bf16 and, for scale, what a mature
mma.sync attention kernel reaches on the same card (PyTorch's flash backend, FlashAttention-2, on dense
attention), the id of the sources that ran, the tuning switches (--ours-only, --config), and, where the device
runs `wide` and no --config is given, `compact` (the sm_120 configuration) forced on the same inputs beside it.
Ceilings are measured in the same run: device-to-device copy bandwidth (bytes read + written) and the mma.sync
bf16 rate (the instruction this kernel uses; measured by the kernel library, kernel.mma_peak_tflops, unless
--mma-tflops gives it). --ddtree times DDTree's grid instead (kdtree.bench.DDTREE: N = 9 to 257, where verify is bound
by the tensor pipe) and prints its table (kdtree.bench.ddtree_table): each configuration's share of that mma.sync rate
and compact / ours. --shape BS,H,N,P (repeatable) times only the shapes given (tuning runs: `variants.sh`).
Our times are CUDA-graph replays of R calls over R distinct input sets (more data than the L2 holds),
divided by R, as SGLang runs verify under graphs. Baselines are eager calls timed by do_bench, which
flushes the L2 before each call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton.testing
from source_id import checkout  # this script's folder is on sys.path

from kdtree import bench, kernel
from kdtree.bench import (
    DDTREE,
    GRID,
    QUICK,
    copy_bandwidth,
    ddtree_table,
    device_info,
    measure,
    progress,
    table,
    with_mma_shares,
)


def cublas_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def flash_attention_tflops() -> tuple[str, dict[int, float]]:
    """Dense bf16 attention (4 x 16 heads, 8k queries x 8k keys, no mask) through PyTorch's flash backend,
    per head dim: FlashAttention-2, whose sm_90 code is mma.sync like this kernel's, unless another
    implementation was activated (named in the result)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    current = getattr(torch.nn.attention, "current_flash_attention_impl", lambda: None)()
    impl = current or "FlashAttention-2 (built in)"

    def rate(d: int) -> float:
        q, k, v = (torch.randn(4, 16, 8192, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises rather than run another backend
            ms = triton.testing.do_bench(
                lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                warmup=10,
                rep=200,
                return_mode="median",
            )
        return 4 * q.shape[0] * q.shape[1] * 8192 * 8192 * d / (ms * 1e-3) / 1e12

    rates = {d: rate(d) for d in (128, 256)}
    return impl, rates


def shape_arg(text: str) -> tuple[int, int, int, int]:
    """--shape's value: four positive integers, batch, heads, draft tokens, prefix."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give BS,H,N,P as four positive integers, e.g. 1,8,65,32768"
        )
    return shape


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--mma-tflops",
        type=float,
        help="mma.sync bf16 rate for the roofline (default: measured now by the kernel library)",
    )
    ap.add_argument("--out", default=None)
    grid = ap.add_mutually_exclusive_group()
    grid.add_argument("--quick", action="store_true", help="a few shapes only")
    grid.add_argument(
        "--ddtree",
        action="store_true",
        help="DDTree's grid (N 9 to 257), with the share of the mma.sync rate",
    )
    grid.add_argument(
        "--shape",
        action="append",
        type=shape_arg,
        metavar="BS,H,N,P",
        help="time this shape (batch, heads, draft tokens, prefix) instead of a grid; repeatable (tuning runs)",
    )
    ap.add_argument("--ours-only", action="store_true", help="skip the baselines (for tuning runs)")
    ap.add_argument(
        "--no-torch", action="store_true", help="skip the PyTorch SDPA baseline (Triton still timed)"
    )
    ap.add_argument(
        "--config", choices=list(kernel.CONFIGS), help="force a tile configuration (default: the device's)"
    )
    ap.add_argument(
        "--fp8",
        nargs="?",
        const="e4m3",
        choices=sorted(bench.FP8_POOLS),
        help="also time every row on an fp8 pool of this dtype (e4m3 when none is named)",
    )
    ap.add_argument(
        "--calls", type=int, default=bench.CALLS_PER_ROUND, help="calls per timed round of graph replays"
    )
    args = ap.parse_args()
    if args.ddtree and args.fp8:
        ap.error("--ddtree times bf16 pools only: run --fp8 without it")
    bench.CALLS_PER_ROUND = args.calls
    if args.config:
        os.environ["KDTREE_KERNEL_CONFIG"] = args.config

    bw = copy_bandwidth()
    mma = args.mma_tflops or kernel.mma_peak_tflops()
    cublas = cublas_tflops()
    fa_impl, fa = flash_attention_tflops()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 0)
    compact = not args.config and device_info()["config"] == "wide"
    commit = checkout()
    head = [
        f"GPU: {props.name} ({props.multi_processor_count} SMs), {datetime.date.today()}, commit {commit}",
        f"Ceilings measured in this run: copy {bw / 1e12:.2f} TB/s; mma.sync bf16 {mma:.0f} TFLOP/s "
        f"(the kernel's instruction; roofline uses it); cuBLAS bf16 {cublas:.0f} TFLOP/s",
        f"For scale, dense attention through PyTorch's flash backend ({fa_impl}; 4 x 16 heads, 8k x 8k, no "
        "mask): "
        + ", ".join(
            f"head dim {d} {t:.0f} TFLOP/s ({100 * t / mma:.0f}% of the mma.sync rate)" for d, t in fa.items()
        ),
        f"Tile configuration: {os.environ.get('KDTREE_KERNEL_CONFIG', 'auto')}"
        + ("; compact forced in the compact columns" if compact else "")
        + (f"; the fp8 columns on an fp8 {args.fp8} pool (scales 0.5)" if args.fp8 else "")
        + (f"; DDTree grid: {bench.DDTREE_NOTE}" if args.ddtree else "")
        + f"; command: {' '.join(sys.argv)}",
        "",
    ]
    grid = "shapes" if args.shape else "quick" if args.quick else "ddtree" if args.ddtree else "full"
    record = dict(
        gpu=props.name,
        date=str(datetime.date.today()),
        commit=commit,
        command=" ".join(sys.argv),
        grid=grid,
        copy_bw=bw,
        mma_tflops=mma,
        cublas_tflops=cublas,
        flash_attention=dict(impl=fa_impl, tflops_by_head_dim=fa),
    )

    def write(rows: list[dict]) -> str:
        """The table and the raw record of the rows so far (after every row: a run cut short keeps what it timed)."""
        text = "\n".join(head + (ddtree_table(rows) if args.ddtree else table(rows)))
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
            with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
                json.dump(record | dict(rows=rows), f, indent=1)
        return text

    rows = []
    for shape in args.shape or (QUICK if args.quick else DDTREE if args.ddtree else GRID):
        row = measure(
            shape,
            bw,
            mma,
            triton=not args.ours_only,
            torch_sdpa=not (args.ours_only or args.no_torch),
            compact=compact,
            fp8=args.fp8,
            l2_bytes=l2,
        )
        rows.append(with_mma_shares(row, mma) if args.ddtree else row)
        print(progress(rows[-1]), flush=True)
        write(rows)
    print(write(rows))


if __name__ == "__main__":
    main()
