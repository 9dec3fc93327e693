"""kdtree's time on a bf16 pool and on fp8 pools (e4m3, e5m2, scales 0.5; the widen path), both tile
configurations, on the quick rows: what `variants.sh run ROUNDS fp8` times for each variant build.

    python3 kernel_build/bench/tuning/bench_pools.py time NAME OUT.jsonl   # one build (KDTREE_KERNEL_LIB): appends records
    python3 kernel_build/bench/tuning/bench_pools.py table OUT.jsonl       # every build's fastest round, side by side

Each record is one time (`kdtree.bench.time_ours`: CUDA-graph replays, as the published tables), so the rounds of
one build in one call can be compared with each other as well as with the other builds.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from kdtree.config import TILE_CONFIGS

POOLS = ("bf16", "e4m3", "e5m2")
CONFIGS = tuple(TILE_CONFIGS)


def time_build(name: str, out: str) -> None:
    import torch

    from kdtree.bench import QUICK, input_sets, shape_costs, time_ours
    from kdtree.reference import fp8_pool, make_batch

    dtypes = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    with open(out, "a") as f:
        for shape in QUICK:
            bs, h, n, p = shape
            sets = input_sets(shape_costs(bs, h, n, p)[0])
            batches = [make_batch(bs, h, n, p, seed=s, spare_slots=0) for s in range(sets)]
            for pool in POOLS:
                pooled = batches if pool == "bf16" else [fp8_pool(b, dtypes[pool], 0.5, 0.5) for b in batches]
                for config in CONFIGS:
                    us = time_ours(pooled, config, None if pool == "bf16" else "widen")
                    f.write(
                        json.dumps(dict(variant=name, shape=list(shape), pool=pool, config=config, us=us))
                        + "\n"
                    )
                    f.flush()
                del pooled
            del batches
            torch.cuda.empty_cache()


def table(records: list[dict]) -> list[str]:
    """Markdown: per row, configuration and pool, each build's fastest round and its ratio to the same build's bf16
    time; '-' where a build has no record."""
    best: dict[tuple, float] = defaultdict(lambda: float("inf"))
    names: list[str] = []
    for r in records:
        key = (tuple(r["shape"]), r["config"], r["pool"], r["variant"])
        best[key] = min(best[key], r["us"])
        if r["variant"] not in names:
            names.append(r["variant"])
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in records))
    head = (
        "| batch | H | N | prefix | config | pool | "
        + " | ".join(f"{n} (us) | {n} / bf16" for n in names)
        + " |"
    )
    lines = [head, "|" + "---|" * (6 + 2 * len(names))]
    for shape in shapes:
        for config in CONFIGS:
            for pool in POOLS:
                cells = []
                for n in names:
                    us, bf16 = best[(shape, config, pool, n)], best[(shape, config, "bf16", n)]
                    cells.append(f"{us:.1f} | {us / bf16:.2f}x" if us < float("inf") else "- | -")
                lines.append(
                    f"| {' | '.join(map(str, shape))} | {config} | {pool} | " + " | ".join(cells) + " |"
                )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("time", help="time the build KDTREE_KERNEL_LIB names; append to OUT")
    t.add_argument("name")
    t.add_argument("out")
    s = sub.add_parser("table", help="the builds' fastest rounds in OUT, side by side")
    s.add_argument("out")
    args = ap.parse_args(argv)
    if args.cmd == "time":
        time_build(args.name, args.out)
    else:
        with open(args.out) as f:
            print("\n".join(table([json.loads(line) for line in f if line.strip()])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
