"""A decode step's kernels, step by step, from profile_engine.py's kernel lists: what a chain step of DDTREE's auto
costs beside DFlash's, and a tree step beside both.

profile_engine.py keeps each row's kernels (name, start, duration in us) in kernels/<row>.kernels.json.gz. This cuts
a row's list into steps at each launch of the target's logits kernel (one a step: SGLang's softcap on the verify's
logits), so a segment holds what follows one step's logits (its walk and commit) and the draft and verify of the
next step; a segment with the fused tree kernel (`tree_kernel`, the tree's own graph) verified a tree, else a chain.
Per algorithm and kind it prints the medians of the kernel time a step (both streams summed), of that time outside
kdtree's verify and combine kernels, of those two, and of the launches; and writes every step to --out (JSON).

    python3 kernel_build/bench/tuning/profile_steps.py --out steps.json \
        DFLASH-B16=kernels/dflash-b16-61l-on-192137.kernels.json.gz \
        DDTREE-B16-AUTO=kernels/ddtree-b16-auto-61l-on-192137.kernels.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

STEP_MARK = "softcap_inplace_logits_kernel"  # the target's logits, one launch a step
TREE_MARK = "tree_kernel"  # kdtree.ddtree.fused's tree builder, in a tree step's own graph
VERIFY = "tree_verify_kernel"  # kdtree's verify kernel (a template: its name starts the demangled name)
COMBINE = "combine_kernel"


def _is(name: str, kernel: str) -> bool:
    """Whether a demangled name is this kernel's (a plain Triton name, or a C++ template's `void ns::kernel<`)."""
    return name == kernel or name.startswith(kernel + "<") or f"::{kernel}<" in name or f"::{kernel}(" in name


def steps(kernels: list) -> list[dict]:
    """The kernels [(name, start, duration us), ...] cut into steps (see the module); the part before the first
    mark and the one after the last are not whole steps, and are dropped."""
    rows, cur = [], None
    for name, _, dur in sorted(kernels, key=lambda k: k[1]):
        if _is(name, STEP_MARK):
            if cur is not None:
                rows.append(cur)
            cur = []
        if cur is not None:
            cur.append((name, float(dur)))
    return [
        {
            "kind": "tree" if any(_is(n, TREE_MARK) for n, _ in s) else "chain",
            "kernel_us": round(sum(d for _, d in s), 1),
            "verify_us": round(sum(d for n, d in s if _is(n, VERIFY)), 1),
            "combine_us": round(sum(d for n, d in s if _is(n, COMBINE)), 1),
            "launches": len(s),
        }
        for s in rows
    ]


def summary(rows: list[dict]) -> dict[str, dict]:
    """Per kind: the steps and the medians of each column, and of the time outside verify and combine."""
    out = {}
    for kind in ("chain", "tree"):
        r = [x for x in rows if x["kind"] == kind]
        if r:
            med = {
                k: statistics.median(x[k] for x in r)
                for k in ("kernel_us", "verify_us", "combine_us", "launches")
            }
            med["outside_us"] = statistics.median(
                x["kernel_us"] - x["verify_us"] - x["combine_us"] for x in r
            )
            out[kind] = {"steps": len(r), **{k: round(v, 1) for k, v in med.items()}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="+", metavar="ALGORITHM=KERNELS.json.gz", help="a row's kernel list, named")
    ap.add_argument("--out", required=True, help="every step, by algorithm (JSON)")
    ap.add_argument(
        "--source", default="", help="what the lists are (the profile's command, GPU and sources)"
    )
    args = ap.parse_args(argv)
    per_algo = {}
    for item in args.rows:
        algo, sep, path = item.partition("=")
        if not sep or not algo:
            ap.error(
                f"{item!r}: give each list as ALGORITHM=PATH, e.g. DFLASH-B16=kernels/dflash.kernels.json.gz"
            )
        with gzip.open(Path(path), "rt") as f:
            per_algo[algo] = steps(json.load(f))
    print(
        "| algorithm | kind | steps | kernels a step (us) | outside verify and combine | verify | combine | launches |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for algo, rows in per_algo.items():
        for kind, s in summary(rows).items():
            print(f"| {algo} | {kind} | {s['steps']} | {s['kernel_us']} | {s['outside_us']} | {s['verify_us']} | "
                  f"{s['combine_us']} | {s['launches']:.0f} |")  # fmt: skip
    Path(args.out).write_text(json.dumps({"source": args.source, "steps": per_algo}, indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
