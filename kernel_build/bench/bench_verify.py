"""Benchmark: kdtree tree-verify vs SGLang's Triton extend kernel and plain PyTorch, against the roofline.

Run on a GPU with SGLang importable (see README, "GPU tests and benchmark"):
    python kernel_build/bench/bench_verify.py --mma-tflops "$(kernel_build/build/mma_peak)" --out bench.md

Ceilings are measured in the same run: device-to-device copy bandwidth (bytes read + written),
the mma.sync bf16 rate (the instruction this kernel uses; passed in from mma_peak.cu) and cuBLAS bf16.
For scale, the header also gives what a mature mma.sync attention kernel reaches on the same card:
PyTorch's flash backend (FlashAttention-2) on dense attention.
Our times are CUDA-graph replays of R calls over R distinct input sets (more data than the L2 holds),
divided by R, as SGLang runs verify under graphs. Baselines are eager calls timed by do_bench, which
flushes the L2 before each call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys

import torch
import triton.testing
from source_id import SOURCES, source_id  # this script's folder is on sys.path

from kdtree import kernel
from kdtree.reference import kdtree_call, make_batch, triton_call

L2_BYTES = 60e6


def copy_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


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


def _commit() -> str:
    """HEAD, marked when the kernel or the runtime differ from it (what a table must not hide), and the id of
    the sources that ran: a GPU machine's copy of the checkout may carry an older HEAD than its files, and
    `source_id.py REV` here says which commit the id belongs to."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", *SOURCES)
    try:
        ids = f"; sources {source_id()}"
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        ids = ""
    return head + (" + uncommitted changes to the kernel or runtime" if dirty else "") + ids


def time_ours(batches) -> float:
    outs, wss = [], []
    for b in batches:
        T, H = b.q.shape[:2]
        outs.append(torch.empty(T, H * 512, dtype=torch.bfloat16, device="cuda"))
        wss.append(
            torch.empty(
                kernel.workspace_bytes(len(b.q_lens), H, b.max_q_len, "cuda"),
                dtype=torch.uint8,
                device="cuda",
            )
        )

    def run():
        for b, o, w in zip(batches, outs, wss, strict=True):
            kdtree_call(b, o, w)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    reps = max(1, math.ceil(200 / len(batches)))
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (reps * len(batches)))
    return sorted(times)[len(times) // 2] * 1e3  # us


def time_triton(b) -> float:
    T, H = b.q.shape[:2]
    o = torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda")
    return triton.testing.do_bench(lambda: triton_call(b, o), warmup=5, rep=60, return_mode="median") * 1e3


def time_torch(b) -> float:
    """What a user would write in plain PyTorch: gather, concatenate, SDPA with the tree mask."""
    B, N, P = len(b.q_lens), b.q_lens[0], b.prefix_lens[0]
    H = b.q.shape[1]
    idx = b.kv_indices.long().view(B, P)
    mask = b.custom_mask.view(B, N, P + N).unsqueeze(1)

    def fn():
        k = torch.cat([b.k_buf[idx, 0], b.k_ext[:, 0].view(B, N, 576)], 1).unsqueeze(1)
        q = b.q.view(B, N, H, 576).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, k[..., :512], attn_mask=mask, scale=b.sm_scale, enable_gqa=True
        )
        return o.transpose(1, 2)

    try:
        return triton.testing.do_bench(fn, warmup=3, rep=40, return_mode="median") * 1e3
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mma-tflops", type=float, required=True, help="measured mma.sync bf16 rate (mma_peak)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--ours-only", action="store_true", help="skip the baselines (for tuning runs)")
    ap.add_argument(
        "--config", choices=["wide", "compact"], help="force a tile configuration (default: the device's)"
    )
    args = ap.parse_args()
    if args.config:
        os.environ["KDTREE_KERNEL_CONFIG"] = args.config

    bw = copy_bandwidth()
    cublas = cublas_tflops()
    fa_impl, fa = flash_attention_tflops()
    props = torch.cuda.get_device_properties(0)
    rows = []
    shapes = [
        (bs, h, n, p) for bs in (1, 8, 32) for h in (8, 16) for n in (16, 64) for p in (4096, 32768, 131072)
    ]
    if args.quick:
        shapes = [(1, 8, 16, 32768), (32, 8, 16, 4096), (8, 16, 64, 32768), (8, 8, 16, 131072)]
    for bs, h, n, p in shapes:
        kv_bytes = bs * (p + n) * 1152
        R = max(1, min(8, math.ceil(3 * L2_BYTES / kv_bytes)))
        batches = [make_batch(bs, h, n, p, seed=s, spare_slots=0) for s in range(R)]
        b = batches[0]
        ours = time_ours(batches)
        tri = float("nan") if args.ours_only else time_triton(b)
        tch = float("nan") if args.ours_only else time_torch(b)
        io_bytes = kv_bytes + b.q.numel() * 2 + bs * n * h * 512 * 2
        flops = 2 * h * n * (576 + 512) * (p + n) * bs
        roof = max(io_bytes / bw, flops / (args.mma_tflops * 1e12)) * 1e6
        rows.append(
            dict(
                batch=bs,
                heads=h,
                draft=n,
                prefix=p,
                ours_us=ours,
                triton_us=tri,
                torch_us=tch,
                speedup=tri / ours,
                gbps=kv_bytes / (ours * 1e-6) / 1e9,
                tflops=flops / (ours * 1e-6) / 1e12,
                roofline_us=roof,
                pct_roofline=100 * roof / ours,
            )
        )
        r = rows[-1]
        print(
            f"b{bs} h{h} n{n} p{p}: ours {ours:.1f} us, triton {tri:.0f} us, torch {tch:.0f} us, "
            f"x{r['speedup']:.3g}, {r['pct_roofline']:.0f}% of roofline",
            flush=True,
        )
        del batches, b
        torch.cuda.empty_cache()

    commit = _commit()
    head = [
        f"GPU: {props.name} ({props.multi_processor_count} SMs), {datetime.date.today()}, commit {commit}",
        f"Ceilings measured in this run: copy {bw / 1e12:.2f} TB/s; mma.sync bf16 {args.mma_tflops:.0f} TFLOP/s "
        f"(the kernel's instruction; roofline uses it); cuBLAS bf16 {cublas:.0f} TFLOP/s",
        f"For scale, dense attention through PyTorch's flash backend ({fa_impl}; 4 x 16 heads, 8k x 8k, no "
        "mask): "
        + ", ".join(
            f"head dim {d} {t:.0f} TFLOP/s ({100 * t / args.mma_tflops:.0f}% of the mma.sync rate)"
            for d, t in fa.items()
        ),
        f"Tile configuration: {os.environ.get('KDTREE_KERNEL_CONFIG', 'auto')}; command: {' '.join(sys.argv)}",
        "",
    ]
    text = "\n".join(head + table(rows))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
            json.dump(
                dict(
                    copy_bw=bw,
                    mma_tflops=args.mma_tflops,
                    cublas_tflops=cublas,
                    flash_attention=dict(impl=fa_impl, tflops_by_head_dim=fa),
                    rows=rows,
                ),
                f,
                indent=1,
            )


def table(rows: list[dict]) -> list[str]:
    """The markdown table of a run's rows (also for re-rendering a saved bench.json). Speedups keep three
    significant digits, so a goal missed by a few percent does not round up to it."""
    return [
        "| batch | H | N | prefix | ours (us) | Triton (us) | PyTorch (us) | speedup vs Triton | KV GB/s | TFLOP/s | roofline (us) | % of roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ] + [
        f"| {r['batch']} | {r['heads']} | {r['draft']} | {r['prefix']} | {r['ours_us']:.1f} | {r['triton_us']:.0f} | "
        f"{r['torch_us']:.0f} | {r['speedup']:.3g}x | {r['gbps']:.0f} | {r['tflops']:.0f} | {r['roofline_us']:.1f} | "
        f"{r['pct_roofline']:.0f}% |"
        for r in rows
    ]


if __name__ == "__main__":
    main()
