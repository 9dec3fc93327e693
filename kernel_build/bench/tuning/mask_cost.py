"""What a verify's tree mask and DDTREE's live rows cost kdtree's kernel against the causal chain at the same width.

In the real server (61 layers, 32k, H100; kernel_build/NOTES.md, "The tree at the chain's width"), DDTREE's target
verify at the chain's 16 tokens took 0.36 ms a step more GPU time than DFlash's chain verify. Its attention differs in
two inputs only: the tree's mask in SGLang's FULL layout (the chain passes none: causal) and q_live (DDTREE's verify
always passes the device's live-rows buffer). This times the kernel alone in the three forms, graph replays as in
kdtree.bench; and, as a server's pool holds a prompt (its slots allocated one after another), with the prefix's slots
in order instead of shuffled. On the GPU machine (after device_run.sh's build, with its PYTHONPATH: gpu_env.sh):
    python kernel_build/bench/tuning/mask_cost.py [--shapes 1x8x16x2048,1x8x16x32768] [--out mask.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from kdtree import bench
from kdtree.bench import input_sets, shape_costs
from kdtree.reference import make_batch

FORMS = ("causal", "tree", "tree+q_live", "causal, slots in order", "tree+q_live, slots in order")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes", default="1x8x16x2048,1x8x16x32768,4x8x16x32768", help="bs x heads x N x prefix"
    )
    ap.add_argument("--rounds", type=int, default=3, help="each form timed this many times, interleaved")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for spec in a.shapes.split(","):
        bs, h, n, p = (int(x) for x in spec.split("x"))
        sets = input_sets(shape_costs(bs, h, n, p)[0])
        batches = {
            "causal": [make_batch(bs, h, n, p, tree=False, seed=s, spare_slots=0) for s in range(sets)],
            "tree": [make_batch(bs, h, n, p, tree=True, seed=s, spare_slots=0) for s in range(sets)],
        }
        for form in (
            "causal",
            "tree",
        ):  # each request's prefix in consecutive slots (slot 0 is SGLang's dummy)
            batches[form + ", in order"] = [
                dataclasses.replace(
                    b,
                    kv_indices=torch.arange(1, b.kv_indices.numel() + 1, device="cuda").to(
                        b.kv_indices.dtype
                    ),
                )
                for b in batches[form]
            ]
        live = torch.full((bs,), n, dtype=torch.int32, device="cuda")  # every token live, as a fixed budget's
        times = {f: [] for f in FORMS}
        for _ in range(a.rounds):
            times["causal"].append(bench._time_graph(batches["causal"], None))
            times["tree"].append(bench._time_graph(batches["tree"], None))
            times["tree+q_live"].append(bench._time_graph(batches["tree"], live))
            times["causal, slots in order"].append(bench._time_graph(batches["causal, in order"], None))
            times["tree+q_live, slots in order"].append(bench._time_graph(batches["tree, in order"], live))
        row = {"batch": bs, "heads": h, "draft": n, "prefix": p} | {f: min(v) for f, v in times.items()}
        rows.append(row)
        print(
            f"bs {bs} H {h} N {n} P {p}: "
            + ", ".join(f"{f} {row[f]:.1f} us" for f in FORMS)
            + f" (tree / causal {row['tree'] / row['causal']:.3f}, +q_live {row['tree+q_live'] / row['causal']:.3f})",
            flush=True,
        )
        del batches
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
