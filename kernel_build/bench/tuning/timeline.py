"""Where one launch spends its time: per-CTA %globaltimer stamps from a build with -DKDTREE_TIMELINE.

On the GPU machine, with the library built that way, e.g. through variants.sh:
    here: bash kernel_build/bench/tuning/variants.sh add tl HEAD -DKDTREE_TIMELINE
    GPU:  bash kernel_build/bench/tuning/variants.sh run 1
          KDTREE_KERNEL_LIB=.variants/tl/build/libkdtree_verify.so python3 kernel_build/bench/tuning/timeline.py \\
              [BATCH,HEADS,DRAFT,PREFIX ...]
Each launch is queued behind a GPU spin, so it starts the way a CUDA-graph replay does, not from an idle
GPU. The stamps cost a few instructions inside the key loops: read the timeline for where the time goes,
and take the durations from bench_verify.py.
"""

from __future__ import annotations

import ctypes
import statistics
import sys

STAMPS = [  # enum Stamp in src/timeline.cuh, in its order
    "entry",
    "request indices loaded",
    "Q landed (score warp 0)",
    "tile 0 landed (output warp 0)",
    "P of tile 0 published",
    "output warps' key loop done",
    "score warps' key loop done",
    "rows staged (output warp 0)",
    "pair: other CTA staged",
    "pair: merged",
    "epilogue done",
]
COMBINE = ["combine scheduled", "combine past its wait", "combine done"]
CTAS = 4096
NEVER = 2**64 - 1  # a combine stamp no block reached


def summarize(main: list[list[int]], combine: list[int]) -> list[str]:
    """Lines of the table: for each stamp the min / median / max over the CTAs that reached it, in us from
    the first CTA's entry; then the combine's first and last, when a combine ran. A 0 stamp: not reached."""
    ctas = [c for c in main if c[0]]
    if not ctas:
        return ["no CTA stamped its entry: was the library built with -DKDTREE_TIMELINE?"]
    t0 = min(c[0] for c in ctas)
    lines = [f"{len(ctas)} CTAs; us from the first entry: min / median / max (CTAs)"]
    for i, name in enumerate(STAMPS):
        v = [(c[i] - t0) / 1e3 for c in ctas if c[i]]
        if v:
            lines.append(f"  {name:30s} {min(v):9.2f} {statistics.median(v):9.2f} {max(v):9.2f}  ({len(v)})")
    if combine[0] != NEVER:
        for i, name in enumerate(COMBINE):
            lines.append(
                f"  {name:30s} {(combine[2 * i] - t0) / 1e3:9.2f} {'':9s} {(combine[2 * i + 1] - t0) / 1e3:9.2f}"
            )
    return lines


def run(batch: int, heads: int, draft: int, prefix: int) -> list[str]:
    import torch

    from kdtree import kernel
    from kdtree.reference import kdtree_call, make_batch

    lib = kernel.library()
    try:
        reset, read = lib.kdtree_timeline_reset, lib.kdtree_timeline
    except AttributeError:
        sys.exit(f"{lib._name} has no timeline: build it with -DKDTREE_TIMELINE (see this file's docstring)")
    b = make_batch(batch, heads, draft, prefix, seed=1, spare_slots=0)
    out = torch.empty(b.q.shape[0], heads * 512, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(
        kernel.workspace_bytes(batch, heads, b.max_q_len, "cuda"), dtype=torch.uint8, device="cuda"
    )
    for _ in range(3):  # warm: code loaded, clocks up
        kdtree_call(b, out, ws)
    main = (ctypes.c_ulonglong * (CTAS * len(STAMPS)))()
    comb = (ctypes.c_ulonglong * 6)()
    if reset() != 0:
        sys.exit(f"timeline reset failed: {lib.kdtree_last_error().decode()}")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000)  # the launch waits behind this, as in a replay
    kdtree_call(b, out, ws)
    torch.cuda.synchronize()
    if read(main, comb) != 0:
        sys.exit(f"timeline read failed: {lib.kdtree_last_error().decode()}")
    n = len(STAMPS)
    lines = summarize([list(main[i * n : (i + 1) * n]) for i in range(CTAS)], list(comb))
    return [f"## b{batch} h{heads} n{draft} p{prefix}: {lines[0]}"] + lines[1:]


def main(argv: list[str]) -> None:
    shapes = [tuple(map(int, a.split(","))) for a in argv] or [(1, 8, 16, 32768), (32, 8, 16, 4096)]
    for shape in shapes:
        if len(shape) != 4:
            sys.exit(f"shape {shape}: give BATCH,HEADS,DRAFT,PREFIX, e.g. 32,8,16,4096")
        print("\n".join(run(*shape)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
