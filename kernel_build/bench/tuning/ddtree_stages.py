"""GPU time per call of DDTree's two per-step stages, torch ops against the fused Triton kernels (kdtree.ddtree.fused).

Each stage is captured in a CUDA graph (as the worker runs the tree) and replayed; the time is the replay's, so
launch overhead inside the graph counts and host time does not. Run on a GPU machine:
    python kernel_build/bench/tuning/ddtree_stages.py [--bs 1] [--block 16] [--budgets 16,32,64,128,256] [--warps 4]
`--max-candidates N` sets fused.FUSED_MAX_CANDIDATES for the run (65536 tries the fused tree at budget 256); a
shape the kernel does not compile for prints its error instead of a time, one it gets wrong says WRONG.
"""

from __future__ import annotations

import argparse

import torch

from kdtree.bench import capture_graph, replay_us
from kdtree.ddtree import fused
from kdtree.ddtree.accept import AcceptBuffers, follow_tree, path_rows, window_permutation
from kdtree.ddtree.tree import TreeBuffers, build_tree

REPLAYS = 200


def graph_us(fn) -> float:
    """GPU time of one replay of fn captured in a CUDA graph (the benchmarks' capture and timing, kdtree.bench)."""
    graph, _, _ = capture_graph(fn)
    for _ in range(10):
        graph.replay()
    return replay_us(graph, REPLAYS, 1)


def row(bs: int, L: int, budget: int) -> str:
    K, N = budget, budget + 1
    lp = torch.log_softmax(torch.randn(bs, L, 4 * K, device="cuda") * 3, -1)
    lp, idx = torch.topk(lp, K, dim=-1)
    ids, roots = idx + 7, torch.arange(bs, dtype=torch.int64, device="cuda")
    old_t, new_t = TreeBuffers(bs, L, K, budget, "cuda"), TreeBuffers(bs, L, K, budget, "cuda")
    target = torch.randint(0, 1000, (bs, N), device="cuda")
    old_a, new_a = AcceptBuffers(bs, N, L, "cuda"), AcceptBuffers(bs, N, L, "cuda")

    def old_walk():
        follow_tree(old_t.parents, old_t.candidates, target, L, old_a)
        window_permutation(old_a)
        path_rows(old_a)

    tree_old = graph_us(lambda: build_tree(lp, ids, roots, budget, out=old_t))
    walk_old = graph_us(old_walk)
    walk_new = graph_us(lambda: fused.accept_walk(old_t.parents, old_t.candidates, target, L, new_a))
    if fused.fits(L, K, budget):
        try:
            tree_new = graph_us(lambda: fused.build_tree_fused(lp, ids, roots, budget, new_t))
            same = all(
                torch.equal(getattr(old_t, f), getattr(new_t, f)) for f in ("parents", "scores", "mask")
            )
            # depths whose beam the pair set S did not hold (sorted whole): 0 on log-probs without rounding ties
            tree_new_s = (
                f"{tree_new:9.1f}"
                + ("" if same else " WRONG")
                + f" (full sorts {int(new_t.full_sorts.sum())})"
            )
        except Exception as e:  # noqa: BLE001 - a shape above what one program takes: say why
            tree_new_s = f"  error: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    else:
        tree_new_s = "   (torch)"
    return f"{bs:3d} {L:3d} {budget:6d} {tree_old:9.1f} {tree_new_s} {walk_old:9.1f} {walk_new:9.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--budgets", default="16,32,64,128,256")
    ap.add_argument("--max-candidates", type=int, default=fused.FUSED_MAX_CANDIDATES)
    ap.add_argument("--warps", type=int, default=fused.NUM_WARPS, help="num_warps of both kernels")
    args = ap.parse_args()
    fused.FUSED_MAX_CANDIDATES, fused.NUM_WARPS = args.max_candidates, args.warps
    print(f"us per call (CUDA graph replay); fused tree up to {args.max_candidates} candidates a depth")
    print(" bs   L budget tree-torch tree-fused walk-torch walk-fused")
    for budget in (int(b) for b in args.budgets.split(",")):
        print(row(args.bs, args.block - 1, budget), flush=True)


if __name__ == "__main__":
    main()
