"""Benchmark kdtree's tree-verify kernel on this GPU against SGLang's own Triton kernel and the roofline.

    python -m kdtree.bench [--quick | --full | --ddtree] [--torch | --no-torch] [--fp8 [e4m3 | e5m2]] [--out DIR]

In the server image: `docker run --rm --gpus all --entrypoint python kdtree-server -m kdtree.bench`.

First line: the GPU, its SM count and compute capability, the tile configuration kdtree runs there (`wide` or
`compact`; KDTREE_KERNEL_CONFIG forces one), the library's architectures, the date and kdtree's version. Then the
ceilings measured in the same run (device-to-device copy bandwidth; the mma.sync bf16 rate, measured by the
kernel library), then one row per shape with the columns of kernel_build/BENCHMARKS.md. --quick (the default)
times four shapes in about a minute on an H200; --full the whole grid of the published tables; --ddtree the grid of
DDTree's tree sizes (N = 9 to 257 draft tokens, bs 1 and 4, 8 and 16 heads, prefixes 8k and 32k), where verify is
bound by the tensor pipe: its table has the share of the measured mma.sync rate each call reaches and, where the GPU
runs `wide`, `compact` (sm_120's configuration) forced on the same inputs beside it. Nothing is read
from the network: the batches are random (kdtree.reference.make_batch). --fp8 adds, on every row, kdtree on an fp8
KV pool of that dtype by each of its two paths (KDTREE_FP8_PATH: widen, the default, and mma) and SGLang's Triton
kernel on the same pool: what decides which path an fp8 KV cache should take on this GPU.

How it times (the same functions make the published tables, through kernel_build/bench/benchmarks/bench_verify.py):
kdtree as SGLang runs verify, CUDA-graph replays of R calls over R distinct input sets (more data than the L2
holds), divided by R; the baselines (SGLang 0.5.23's Triton `extend_attention_fwd`, what TritonAttnBackend runs
for target-verify, and optionally gather + PyTorch SDPA with the tree mask) eager, by triton.testing.do_bench,
which flushes the L2 before each call. Roofline time = max(bytes / copy bandwidth, FLOPs / mma.sync rate), bytes
= KV read once + q + out, FLOPs = 2*H*N*(576 + 512) per key.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
import warnings
from pathlib import Path

PROG = "kdtree.bench"
EXIT_ENV = 2  # no GPU, no kernel library, no code for this GPU, no SGLang: one line on stderr
NO_GPU = f"{PROG}: no CUDA GPU is visible (run the image with --gpus all)"

# batch x heads x draft tokens x prefix: the grid of kernel_build/BENCHMARKS.md, and its quick subset
GRID = [(bs, h, n, p) for bs in (1, 8, 32) for h in (8, 16) for n in (16, 64) for p in (4096, 32768, 131072)]
QUICK = [(1, 8, 16, 32768), (32, 8, 16, 4096), (8, 16, 64, 32768), (8, 8, 16, 131072)]
# DDTree's tree sizes (N = budget + 1: the root and a budget of 8 to 256 draft tokens), where each draft token attends to
# the whole prefix and verify is bound by the tensor pipe; rows of one shape (bs, H, prefix) in order of N.
DDTREE_N = (9, 17, 33, 65, 129, 257)
DDTREE = [(bs, h, n, p) for bs in (1, 4) for h in (8, 16) for p in (8192, 32768) for n in DDTREE_N]
# What a DDTree table's header says of its columns (kdtree.bench --ddtree and bench_verify.py --ddtree)
DDTREE_NOTE = (
    "% of mma.sync: FLOPs 2*bs*H*N*P*(576 + 512) per call (the prefix's work) over the mma.sync rate measured above; "
    "Triton eager, by do_bench (about 60 ms of calls a row)"
)
# The input sets of one timed graph hold 3x the L2 where that takes at most 8 sets, sized for the H200's 50 MiB
# L2 (the published tables); a larger L2 (RTX PRO 6000: 128 MB) gets proportionally more sets.
L2_BYTES = 60e6
MAX_SETS = 8
KV_ROW_BYTES = 576 * 2  # one latent KV row, bf16
CALLS_PER_ROUND = (
    200  # calls a timed round of graph replays makes (bench_verify --calls lowers it for short runs)
)
FLOP_PER_KEY_ROW = 2 * (576 + 512)  # per (draft token x head): QK^T and PV


class EnvironmentProblem(Exception):
    """What this machine lacks to run the benchmark; main() prints it as one line and exits 2."""


def input_sets(kv_bytes: int, l2_bytes: float = L2_BYTES) -> int:
    """Distinct input sets for one graph: enough that a replay finds none of its KV in the L2."""
    l2 = max(L2_BYTES, l2_bytes)
    return max(1, min(math.ceil(MAX_SETS * l2 / L2_BYTES), math.ceil(3 * l2 / kv_bytes)))


def shape_costs(bs: int, h: int, n: int, p: int, pool_bytes: int = 2) -> tuple[int, int, int]:
    """(KV bytes read once, all bytes: KV + q + out, FLOPs) of one call; pool_bytes per element of the prefix's
    pool rows (2: bf16, 1: fp8; the draft rows are bf16 either way)."""
    kv_bytes = bs * (p * pool_bytes * KV_ROW_BYTES // 2 + n * KV_ROW_BYTES)
    io_bytes = kv_bytes + bs * n * h * 576 * 2 + bs * n * h * 512 * 2
    return kv_bytes, io_bytes, FLOP_PER_KEY_ROW * h * n * (p + n) * bs


def mma_share(us: float, shape: tuple[int, int, int, int], mma_tflops: float) -> float:
    """Percent of the mma.sync bf16 rate that a call of `us` reaches on `shape`, counting the prefix's work alone,
    2*bs*H*N*P*(576 + 512) FLOPs (the draft keys' N x N block, about 3% more at N 257 / 8k, is left out)."""
    bs, h, n, p = shape
    return 100 * FLOP_PER_KEY_ROW * bs * h * n * p / (us * 1e-6) / (mma_tflops * 1e12)


def with_mma_shares(row: dict, mma_tflops: float) -> dict:
    """A row of measure() with the share of the mma.sync rate (the run's, `mma_tflops`) of each kdtree time it has."""
    shape = (row["batch"], row["heads"], row["draft"], row["prefix"])
    shares = {"pct_mma": mma_share(row["ours_us"], shape, mma_tflops)}
    if "compact_us" in row:
        shares["compact_pct_mma"] = mma_share(row["compact_us"], shape, mma_tflops)
    return row | shares


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second."""
    import torch
    import triton.testing

    def timed() -> float:
        x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        return triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")

    ms = timed()
    torch.cuda.empty_cache()  # the 4 GiB go back to the device before the batches are made
    return 2 * (2 << 30) / (ms * 1e-3)


def time_ours(batches, config: str | None = None, fp8_path: str | None = None) -> float:
    """us per call: one CUDA graph of a call per input set, replayed; `config` forces a tile configuration and
    `fp8_path` an fp8 pool's path."""
    from kdtree import kernel

    with kernel.forced(config, fp8_path):
        return _time_graph(batches)


def _time_graph(batches, q_live=None) -> float:
    """us per call: one CUDA graph of a call per input set, replayed (q_live: each request's live tokens, or all)."""
    import torch

    from kdtree import kernel
    from kdtree.reference import kdtree_call

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
            kdtree_call(b, o, w, q_live=q_live)

    g, _, _ = capture_graph(run)
    for _ in range(3):
        g.replay()
    return replay_us(g, max(1, math.ceil(CALLS_PER_ROUND / len(batches))), len(batches))


def capture_graph(fn):
    """`fn` run once eagerly on a side stream, then captured into a CUDA graph, as SGLang warms up before it captures
    (lazy initialisation, workspace and autotuning stay out of the graph): the one warm-up-and-capture of the
    benchmarks and the GPU tests. Returns the graph, what the captured run of `fn` returned, and the capture's
    seconds (the device idle before and after it)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out, time.perf_counter() - t0


def replay_us(g, reps: int, calls: int) -> float:
    """Microseconds per call of graph `g` holding `calls` calls: the median of 5 rounds of `reps` replays."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * calls))
    return sorted(times)[2]


def time_triton(b) -> float:
    """us per call of SGLang's Triton extend kernel, eager, L2 flushed before each call."""
    import torch
    import triton.testing

    from kdtree.reference import triton_call

    T, H = b.q.shape[:2]
    o = torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda")
    return triton.testing.do_bench(lambda: triton_call(b, o), warmup=5, rep=60, return_mode="median") * 1e3


def time_torch(b) -> float:
    """What a user would write in plain PyTorch: gather, concatenate, SDPA with the tree mask (nan: out of memory)."""
    import torch
    import triton.testing

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


FP8_POOLS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}  # an fp8 row's pool: the torch dtype of each


def measure(
    shape: tuple[int, int, int, int],
    copy_bw: float,
    mma_tflops: float,
    *,
    triton: bool = True,
    torch_sdpa: bool = True,
    compact: bool = False,
    fp8: str | None = None,
    l2_bytes: float = L2_BYTES,
) -> dict:
    """One row of the table: kdtree, the baselines asked for (nan otherwise), and the roofline; with `compact`,
    also kdtree forced into the compact configuration (sm_120's) on the same inputs; with `fp8` (a key of
    FP8_POOLS), also kdtree by both fp8 paths (and the Triton baseline, if asked for) on the same inputs with a pool
    of that fp8 dtype (scales 0.5: any scale costs the same), beside the bf16 times."""
    import torch

    from kdtree.reference import fp8_pool, make_batch

    bs, h, n, p = shape
    kv_bytes, io_bytes, flops = shape_costs(bs, h, n, p)
    batches = [make_batch(bs, h, n, p, seed=s, spare_slots=0) for s in range(input_sets(kv_bytes, l2_bytes))]
    ours = time_ours(batches)
    compact_us = time_ours(batches, "compact") if compact else None
    tri = time_triton(batches[0]) if triton else float("nan")
    tch = time_torch(batches[0]) if torch_sdpa else float("nan")
    extra = {}
    if fp8:
        batches = [fp8_pool(b, getattr(torch, FP8_POOLS[fp8]), 0.5, 0.5) for b in batches]
        for path, key in (("widen", "fp8"), ("mma", "fp8_mma")):
            extra[f"{key}_us"] = time_ours(batches, None, path)
            extra[f"{key}_vs_ours"] = extra[f"{key}_us"] / ours
            if compact:
                extra[f"compact_{key}_us"] = time_ours(batches, "compact", path)
                extra[f"compact_{key}_vs_compact"] = extra[f"compact_{key}_us"] / compact_us
        extra["triton_fp8_us"] = time_triton(batches[0]) if triton else float("nan")
        extra["fp8_pool"] = fp8
    del batches
    torch.cuda.empty_cache()
    roof = max(io_bytes / copy_bw, flops / (mma_tflops * 1e12)) * 1e6
    if compact_us is not None:
        extra |= dict(
            compact_us=compact_us,
            compact_pct_roofline=100 * roof / compact_us,
            compact_vs_ours=compact_us / ours,
        )
    return dict(
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
        **extra,
    )


def progress(r: dict) -> str:
    """The line printed as each shape finishes."""
    line = (
        f"b{r['batch']} h{r['heads']} n{r['draft']} p{r['prefix']}: ours {r['ours_us']:.1f} us, "
        f"triton {r['triton_us']:.0f} us, torch {r['torch_us']:.0f} us, "
        f"x{r['speedup']:.3g}, {r['pct_roofline']:.0f}% of roofline"
    )
    if "compact_us" in r:
        line += f"; compact {r['compact_us']:.1f} us ({r['compact_vs_ours']:.2f}x), {r['compact_pct_roofline']:.0f}%"
    for key, name in (("fp8", "fp8"), ("fp8_mma", "fp8 mma")):
        if f"{key}_us" in r:
            line += f"; {name} {r[f'{key}_us']:.1f} us ({r[f'{key}_vs_ours']:.2f}x)"
            if f"compact_{key}_us" in r:
                line += f", compact {name} {r[f'compact_{key}_us']:.1f} us ({r[f'compact_{key}_vs_compact']:.2f}x)"
    return line


def table(rows: list[dict]) -> list[str]:
    """The markdown table of a run's rows (also for re-rendering a saved bench.json). Speedups keep three
    significant digits, so a goal missed by a few percent does not round up to it. Rows measured with compact
    beside the device's configuration get three more columns."""
    compact = any("compact_us" in r for r in rows)
    fp8 = any("fp8_us" in r for r in rows)
    head = "| batch | H | N | prefix | ours (us) | Triton (us) | PyTorch (us) | speedup vs Triton | KV GB/s | TFLOP/s | roofline (us) | % of roofline |"
    if compact:
        head += " compact (us) | compact, % of roofline | compact / ours |"
    fp8_mma = any("fp8_mma_us" in r for r in rows)  # tables saved before the mma path have none
    if fp8:
        head += " fp8 (us) | fp8 / ours | Triton fp8 (us) | fp8 speedup vs Triton fp8 |"
        if fp8_mma:
            head += " fp8 mma (us) | fp8 mma / ours |"
        if compact:
            head += " compact fp8 (us) | compact fp8 / compact |"
            if fp8_mma:
                head += " compact fp8 mma (us) | compact fp8 mma / compact |"

    def pair(r: dict, us: str, ratio: str) -> str:  # a time and its ratio, or dashes for a row without them
        return f" {r[us]:.1f} | {r[ratio]:.2f}x |" if us in r else " - | - |"

    def cells(r: dict) -> str:
        line = (
            f"| {r['batch']} | {r['heads']} | {r['draft']} | {r['prefix']} | {r['ours_us']:.1f} | {r['triton_us']:.0f} | "
            f"{r['torch_us']:.0f} | {r['speedup']:.3g}x | {r['gbps']:.0f} | {r['tflops']:.0f} | {r['roofline_us']:.1f} | "
            f"{r['pct_roofline']:.0f}% |"
        )
        if compact:
            line += (
                f" {r['compact_us']:.1f} | {r['compact_pct_roofline']:.0f}% | {r['compact_vs_ours']:.2f}x |"
                if "compact_us" in r
                else " - | - | - |"
            )
        if fp8:
            line += (
                f" {r['fp8_us']:.1f} | {r['fp8_vs_ours']:.2f}x | {r['triton_fp8_us']:.0f} |"
                f" {r['triton_fp8_us'] / r['fp8_us']:.3g}x |"
                if "fp8_us" in r
                else " - | - | - | - |"
            )
            if fp8_mma:
                line += pair(r, "fp8_mma_us", "fp8_mma_vs_ours")
            if compact:
                line += pair(r, "compact_fp8_us", "compact_fp8_vs_compact")
                if fp8_mma:
                    line += pair(r, "compact_fp8_mma_us", "compact_fp8_mma_vs_compact")
        return line

    return [head, "|---" * head.count(" |") + "|"] + [cells(r) for r in rows]


def ddtree_table(rows: list[dict]) -> list[str]:
    """The markdown table of a DDTree run (rows of with_mma_shares): kdtree's time and its share of the mma.sync rate,
    Triton's (and PyTorch's, where a row timed it), and, where the run timed compact beside the device's
    configuration, compact's and compact / ours."""
    compact = any("compact_us" in r for r in rows)
    torch_sdpa = any(not math.isnan(r["torch_us"]) for r in rows)
    head = "| batch | H | N | prefix | ours (us) | ours, % of mma.sync | Triton (us) | speedup vs Triton |"
    if torch_sdpa:
        head += " PyTorch (us) |"
    if compact:
        head += " compact (us) | compact, % of mma.sync | compact / ours |"

    def cells(r: dict) -> str:
        line = (
            f"| {r['batch']} | {r['heads']} | {r['draft']} | {r['prefix']} | {r['ours_us']:.1f} | {r['pct_mma']:.0f}% | "
            f"{r['triton_us']:.0f} | {r['speedup']:.3g}x |"
        )
        if torch_sdpa:
            line += f" {r['torch_us']:.0f} |"
        if compact:
            line += (
                f" {r['compact_us']:.1f} | {r['compact_pct_mma']:.0f}% | {r['compact_vs_ours']:.2f}x |"
                if "compact_us" in r
                else " - | - | - |"
            )
        return line

    return [head, "|---" * head.count(" |") + "|"] + [cells(r) for r in rows]


def _cuda_visible() -> bool:
    try:
        import torch
    except ImportError as e:
        raise EnvironmentProblem(
            f"{PROG}: torch does not import here ({e}); run it in the server image"
        ) from None
    with warnings.catch_warnings():  # a missing driver may warn; NO_GPU says it once
        warnings.simplefilter("ignore")
        return torch.cuda.is_available()


def device_info() -> dict:
    """The GPU and what kdtree runs on it; EnvironmentProblem when there is no GPU, library or code for it."""
    if not _cuda_visible():
        raise EnvironmentProblem(NO_GPU)
    import torch

    import kdtree
    from kdtree import kernel
    from kdtree.config import ConfigError, KernelSettings

    try:
        kernel.library()
        _, config, _ = kernel.plan._device_plan(torch.cuda.current_device())
    except (
        kernel.KernelUnavailable,
        ConfigError,
        OSError,
    ) as e:  # OSError: the library is there but does not load
        raise EnvironmentProblem(f"{PROG}: {e}") from None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    forced = KernelSettings.load().kernel_config
    return dict(
        gpu=props.name,
        sms=props.multi_processor_count,
        capability=f"sm_{props.major}{props.minor}",
        l2_bytes=getattr(props, "L2_cache_size", 0),
        config={v: k for k, v in kernel.CONFIGS.items()}[config],
        config_forced=bool(forced),
        archs=kernel.compiled_archs(),
        date=str(datetime.date.today()),
        kdtree=kdtree.__version__,
    )


def device_line(d: dict) -> str:
    forced = " (forced by KDTREE_KERNEL_CONFIG)" if d["config_forced"] else ""
    return (
        f"GPU: {d['gpu']} ({d['sms']} SMs, {d['capability']}), tile configuration {d['config']}{forced}, "
        f"library {','.join(d['archs'])}, {d['date']}, kdtree {d['kdtree']}"
    )


def _require_baseline() -> None:
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd  # noqa: F401
    except Exception as e:  # any failure to import it (missing, or a broken install) means no baseline
        raise EnvironmentProblem(
            f"{PROG}: SGLang's Triton extend kernel does not import here ({type(e).__name__}: {e}); "
            "run it in the server image"
        ) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="Time kdtree's tree-verify kernel on this GPU against SGLang's Triton kernel and the roofline "
        "measured in the same run (copy bandwidth, mma.sync rate). Reads nothing from the network.",
    )
    grid = ap.add_mutually_exclusive_group()
    grid.add_argument(
        "--quick", action="store_true", help=f"{len(QUICK)} shapes, about a minute (the default)"
    )
    grid.add_argument("--full", action="store_true", help=f"the whole grid of {len(GRID)} shapes")
    grid.add_argument(
        "--ddtree",
        action="store_true",
        help=f"DDTree's tree sizes: {len(DDTREE)} shapes (N {', '.join(map(str, DDTREE_N))}), with the share of the "
        "mma.sync rate and, on a GPU that runs wide, compact beside it",
    )
    ap.add_argument(
        "--torch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time gather + PyTorch SDPA (default: with --full only)",
    )
    ap.add_argument(
        "--fp8",
        nargs="?",
        const="e4m3",
        choices=sorted(FP8_POOLS),
        help="also time every row on an fp8 KV pool of this dtype (e4m3 when none is named), by both fp8 paths "
        "(KDTREE_FP8_PATH=widen, the default, and mma) and with SGLang's Triton kernel",
    )
    ap.add_argument("--out", type=Path, metavar="DIR", help="write bench.md and bench.json into this folder")
    args = ap.parse_args(argv)
    if args.ddtree and args.fp8:
        ap.error("--ddtree times bf16 pools only: run --fp8 with --quick or --full")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = GRID if args.full else DDTREE if args.ddtree else QUICK
    torch_sdpa = args.full if args.torch is None else args.torch
    try:
        dev = device_info()
        _require_baseline()
    except EnvironmentProblem as e:
        print(e, file=sys.stderr, flush=True)
        return EXIT_ENV
    from kdtree import kernel

    head = [device_line(dev)]
    print(head[0], flush=True)
    bw = copy_bandwidth()
    mma = kernel.mma_peak_tflops()
    head.append(
        f"Ceilings measured in this run: copy {bw / 1e12:.2f} TB/s; mma.sync bf16 {mma:.0f} TFLOP/s "
        "(the kernel's instruction, measured by the kdtree library; the roofline uses both)"
    )
    head.append(
        "Baselines: SGLang's Triton extend_attention_fwd"
        + (", gather + PyTorch SDPA" if torch_sdpa else " (PyTorch SDPA not timed: --torch)")
        + f"; {'full grid' if args.full else 'DDTree grid' if args.ddtree else 'quick grid (--full: all shapes)'}"
        + (
            f"; {DDTREE_NOTE}"
            + ("; compact forced in the compact columns" if dev["config"] == "wide" else "")
            if args.ddtree
            else ""
        )
        + (
            f"; fp8 columns on an fp8 {args.fp8} pool (scales 0.5, the draft rows bf16): `fp8` the widen path "
            "(the default), `fp8 mma` KDTREE_FP8_PATH=mma"
            if args.fp8
            else ""
        )
    )
    print(head[1], head[2], sep="\n", flush=True)
    rows = []
    for shape in shapes:
        if args.ddtree:
            row = measure(
                shape,
                bw,
                mma,
                torch_sdpa=torch_sdpa,
                compact=dev["config"] == "wide",
                l2_bytes=dev["l2_bytes"],
            )
            rows.append(with_mma_shares(row, mma))
        else:
            rows.append(
                measure(shape, bw, mma, torch_sdpa=torch_sdpa, fp8=args.fp8, l2_bytes=dev["l2_bytes"])
            )
        print(progress(rows[-1]), flush=True)
    lines = ddtree_table(rows) if args.ddtree else table(rows)
    text = "\n".join([*head, "", *lines])
    print("\n" + "\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.md").write_text(text + "\n")
        record = dict(
            device=dev,
            copy_bw=bw,
            mma_tflops=mma,
            torch_sdpa=torch_sdpa,
            fp8_pool=args.fp8,
            grid="full" if args.full else "ddtree" if args.ddtree else "quick",
            rows=rows,
        )
        (args.out / "bench.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out / 'bench.md'} and {args.out / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
