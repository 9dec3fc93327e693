"""How a shape's time depends on the number of prefix splits: the measurement behind `plan()`'s split rule.

`plan()` (src/tree_verify.cu) splits each request's keys so that the grid fills the device's CTA slots in one wave:
splits = floor(slots / base), base = bs * ceil(N*H / BM). Past base = slots / 2 that is one split and up to half the
device idles (kernel_build/NOTES.md, "DDTree's sizes"). This script times each shape with the split count forced
(the binding's CTA slots set to base * s, which makes plan() choose s) beside the automatic plan, so that the
per-CTA fixed cost c of the model time(s) ~ waves(s) * (keys / s + c) can be fitted and a rule chosen from data.
Graph replays as in kdtree.bench. On the GPU machine (after device_run.sh's build):
    python kernel_build/bench/tuning/split_sweep.py [--out split.json] [--configs wide,compact] [--calls 60]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time

import torch

from kdtree import bench, kernel
from kdtree.bench import DDTREE, input_sets, shape_costs
from kdtree.kernel import plan as plan_mod
from kdtree.kernel import verify_op
from kdtree.reference import make_batch

BM = 64  # rows a CTA's tile holds in both configurations (include/kdtree_tile_configs.h)
SPLITS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
# A few rows of the published grid beside DDTree's, to see that a new rule keeps them (bs, H, N, P)
GRID_ROWS = [(1, 8, 16, 32768), (32, 8, 16, 4096), (8, 16, 64, 32768), (8, 8, 16, 131072), (8, 8, 64, 4096)]


@contextlib.contextmanager
def slots_forced(slots: int | None):
    """The binding plans with `slots` CTA slots (None: the device's own)."""
    real = plan_mod._device_plan
    if slots is None:
        yield
        return

    def forced(index):
        _, config, fp8 = real(index)
        return slots, config, fp8

    plan_mod._device_plan = verify_op._device_plan = forced
    try:
        yield
    finally:
        plan_mod._device_plan = verify_op._device_plan = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="split.json")
    ap.add_argument("--configs", default="wide,compact")
    ap.add_argument("--calls", type=int, default=60, help="calls a timed round makes")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting rows after this many seconds")
    args = ap.parse_args()
    bench.CALLS_PER_ROUND = args.calls
    t0 = time.time()
    rows = []
    for shape in sorted(DDTREE, key=lambda r: -r[0]) + GRID_ROWS:  # bs 4 first: where the rule bites
        if time.time() - t0 > args.budget_s:
            break
        bs, h, n, p = shape
        base = bs * math.ceil(n * h / BM)
        kv_bytes = shape_costs(bs, h, n, p)[0]
        batches = [make_batch(bs, h, n, p, seed=s, spare_slots=0) for s in range(input_sets(kv_bytes))]
        for config in args.configs.split(","):
            with kernel.forced(config):  # outside the slots' patch: forced() clears the real plan's cache
                slots0 = plan_mod._device_plan(torch.cuda.current_device())[0]
                auto = max(1, min(128, slots0 // base))
                times = {"auto": bench._time_graph(batches)}
                for s in sorted(set(SPLITS) | {auto, math.ceil(slots0 / base)}):
                    if s > 128 or p / s < 128:
                        continue
                    with slots_forced(base * s):
                        times[s] = bench._time_graph(batches)
            row = dict(
                batch=bs, heads=h, draft=n, prefix=p, config=config, base=base, slots=slots0, auto=auto
            )
            row["us"] = {str(k): round(v, 2) for k, v in times.items()}
            best = min((v, k) for k, v in times.items() if k != "auto")
            print(
                f"bs{bs} h{h} n{n} p{p} {config}: base {base} auto {auto} -> {times['auto']:.1f} us; "
                f"best s={best[1]} {best[0]:.1f} us; "
                + " ".join(f"{k}:{v:.0f}" for k, v in times.items() if k != "auto"),
                flush=True,
            )
            rows.append(row)
        del batches
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
