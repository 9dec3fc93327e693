"""Algorithm 1 of DDTree (arXiv 2604.12989) as a heap over rank tuples, and the acceptance walk, on plain lists.

This is the oracle the fixed-shape builder (`kdtree.ddtree.tree`) is tested against; it follows the paper's
reference `build_ddtree_tree` and `follow_verified_tree` (liranringel/ddtree, ddtree.py):
- inputs: per depth d = 1..L the drafter's top-K log-probs `lp[d-1]` (sorted descending) and their token ids;
- a node is a rank tuple (r_1, ..., r_d), 0-based, its score σ = Σ lp[i-1][r_i]; the heap key is (-σ, ranks), so
  exact ties go to the lexicographically smaller rank tuple (a prefix before its extensions);
- each pop adds the node and pushes its next sibling (last rank + 1) and its first child (rank 0 one level deeper);
  `budget` pops make the tree, so nodes come out in key order, every parent before its children.
Scores accumulate in float32 (each sum rounded to float32), as the torch form does, so both order near-ties alike.
A log-prob of -inf marks a candidate that is not there (a K-padded slot): it is never pushed.
"""

from __future__ import annotations

import heapq
import math
import struct
from dataclasses import dataclass, field


def f32(x: float) -> float:
    """x rounded to float32 (the sum of two float32 values rounded once, as a float32 add gives)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass
class Tree:
    """Node 0 is the root (the previous bonus token, not drafted); nodes 1.. in pop order."""

    tokens: list[int] = field(default_factory=list)  # root: the root token given
    parents: list[int] = field(default_factory=list)  # root: -1
    depths: list[int] = field(default_factory=list)  # root: 0; the position offset from the root
    scores: list[float] = field(default_factory=list)  # root: 0.0
    ranks: list[tuple[int, ...]] = field(default_factory=list)  # root: ()


def build_ddtree_tree(lp: list[list[float]], ids: list[list[int]], budget: int, root_token: int = 0) -> Tree:
    """The best-first tree of at most `budget` nodes (fewer when fewer candidates are there)."""
    L = len(lp)
    if L < 1 or budget < 1 or len(ids) != L:
        raise ValueError(
            f"need L >= 1 depths of log-probs and ids and budget >= 1 (got L={L}, budget={budget})"
        )
    K = len(lp[0])
    for d in range(L):
        if len(lp[d]) != K or len(ids[d]) != K:
            raise ValueError(f"depth {d + 1}: every depth needs the same K={K} log-probs and ids")
        if any(lp[d][i] < lp[d][i + 1] for i in range(K - 1)):
            raise ValueError(f"depth {d + 1}: log-probs must be sorted descending (torch.topk gives them so)")
    tree = Tree([root_token], [-1], [0], [0.0], [()])
    index = {(): 0}
    heap: list[tuple[float, tuple[int, ...]]] = []
    if K and lp[0][0] > -math.inf:
        heap.append((-f32(lp[0][0]), (0,)))
    while heap and len(tree.tokens) <= budget:
        neg, ranks = heapq.heappop(heap)
        d, r, parent = len(ranks), ranks[-1], index[ranks[:-1]]
        index[ranks] = len(tree.tokens)
        tree.tokens.append(ids[d - 1][r])
        tree.parents.append(parent)
        tree.depths.append(d)
        tree.scores.append(-neg)
        tree.ranks.append(ranks)
        if r + 1 < K and lp[d - 1][r + 1] > -math.inf:
            heapq.heappush(heap, (-f32(tree.scores[parent] + lp[d - 1][r + 1]), (*ranks[:-1], r + 1)))
        if d < L and lp[d][0] > -math.inf:
            heapq.heappush(heap, (-f32(-neg + lp[d][0]), (*ranks, 0)))
    return tree


def follow_verified_tree(parents: list[int], tokens: list[int], target: list[int]) -> tuple[list[int], int]:
    """The acceptance walk: from the root, take the target's token at the node (`target[i]`, its argmax or
    sample there); if a child carries that token, descend to it, else that token is the bonus.

    Returns the accepted path's node indices (starting with the root, 0) and the bonus token. A padding node's
    token (-1) never matches a target token."""
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(parents)):
        kids = children.setdefault(parents[i], {})
        if tokens[i] >= 0:
            kids.setdefault(tokens[i], i)  # siblings are distinct top-K tokens; the first wins otherwise
    path = [0]
    while (child := children.get(path[-1], {}).get(target[path[-1]])) is not None:
        path.append(child)
    return path, target[path[-1]]
