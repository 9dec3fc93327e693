"""DDTree's acceptance walk and commit with fixed shapes (no host synchronisation), the GPU form of
`kdtree.ddtree.reference.follow_verified_tree`.

`target[b, i]` is the target's token at node i of request b (its argmax, or a sample from its distribution
there: one independent sample per node, and the walk reads only the samples at the nodes it visits, so every
emitted token is a sample of the target at its own context; that is why the walk is lossless). From the root,
while a child of the current node carries the target's token there, descend; the target's token at the last
node is the bonus. Siblings carry distinct tokens (top-K candidates) and padding nodes carry -1, so at most
one child matches.

The commit keeps the KV the verify already wrote: node i's KV sits in window slot i (the verify window is
positions prefix .. prefix + N - 1 of the request's row of req_to_token); the accepted path's nodes sit at
depths 0..a, exactly their positions, so the commit is a permutation of the window's slots in req_to_token:
the path's slots first, in path order, then the others. Valid with page size 1 (the launcher's rule).

On CUDA the worker runs these three as one kernel (`kdtree.ddtree.fused.accept_walk`, the same values); the torch
forms here are its CPU path and the oracle its tests compare it with.
"""

from __future__ import annotations

import torch


class AcceptBuffers:
    """Outputs of `follow_tree` for bs requests, trees of N nodes and at most L drafted depths."""

    def __init__(self, bs: int, N: int, L: int, device: torch.device | str = "cpu"):
        i64 = dict(dtype=torch.int64, device=device)
        self.shape = (bs, N, L)
        self.path = torch.zeros(
            bs, L + 1, **i64
        )  # node indices, root first; past the accepted length: the last
        self.accepted = torch.zeros(bs, **i64)  # a: drafted tokens accepted (path length - 1)
        self.bonus = torch.zeros(bs, **i64)
        self.out_tokens = torch.zeros(bs, L + 1, **i64)  # the a accepted tokens, then the bonus
        self.commit_lens = torch.zeros(bs, dtype=torch.int32, device=device)  # a + 1 (the worker writes it)
        self.new_seq_lens = torch.zeros(bs, **i64)  # prefix + a + 1 (likewise)
        self.perm = torch.zeros(bs, N, **i64)  # window_permutation (fused.accept_walk writes it)
        self.rows = torch.zeros(bs, L + 1, **i64)  # path_rows (likewise)
        self.cur = torch.zeros(bs, **i64)
        self.want = torch.zeros(bs, 1, **i64)
        self.match = torch.zeros(bs, N, dtype=torch.bool, device=device)
        self.tmp = torch.zeros(bs, N, dtype=torch.bool, device=device)
        self.has = torch.zeros(bs, dtype=torch.bool, device=device)
        self.nxt = torch.zeros(bs, **i64)
        self.key = torch.zeros(bs, N, **i64)
        self.depth_index = torch.arange(L + 1, **i64).expand(bs, L + 1)
        self.node_index = torch.arange(N, **i64).expand(bs, N)


def follow_tree(
    parents: torch.Tensor, candidates: torch.Tensor, target: torch.Tensor, L: int, out: AcceptBuffers
) -> AcceptBuffers:
    """The walk for every request at once, L steps of [bs, N] ops. parents/candidates/target: int64 [bs, N]
    (root's parent -1, padding nodes' candidate -1)."""
    o = out
    o.cur.zero_()
    o.path.zero_()
    o.accepted.zero_()
    o.has.fill_(True)
    for d in range(1, L + 1):
        torch.gather(target, 1, o.cur[:, None], out=o.want)
        torch.eq(parents, o.cur[:, None], out=o.match)
        torch.eq(candidates, o.want, out=o.tmp)
        o.match.logical_and_(o.tmp)
        o.has.logical_and_(o.match.any(1))  # alive: every step so far matched
        torch.argmax(o.match.to(torch.uint8), 1, out=o.nxt)
        torch.where(o.has, o.nxt, o.cur, out=o.cur)
        o.path[:, d].copy_(o.cur)
        o.accepted.add_(o.has)
    torch.gather(target, 1, o.cur[:, None], out=o.want)
    o.bonus.copy_(o.want[:, 0])
    torch.gather(candidates, 1, o.path[:, 1:], out=o.out_tokens[:, :-1])
    o.out_tokens[:, -1].zero_()
    o.out_tokens.scatter_(1, o.accepted[:, None], o.want)
    return o


def window_permutation(out: AcceptBuffers) -> torch.Tensor:
    """perm [bs, N]: the window's new slot order, perm[b, j] = the node whose slot moves to position j: the
    accepted path's nodes first (path order), then every other node in index order (written into out.key)."""
    bs, N, L = out.shape
    o = out
    big = torch.where(o.depth_index <= o.accepted[:, None], o.depth_index, N + L + 1)
    o.key.fill_(N + L + 1)
    o.key.scatter_reduce_(1, o.path, big, reduce="amin")  # each path node's depth on the path
    torch.where(o.key <= L, o.key, o.node_index + (L + 1), out=o.key)
    return torch.argsort(o.key, dim=1, stable=True)


def path_rows(out: AcceptBuffers) -> torch.Tensor:
    """[bs, L + 1]: the verify's logits row (b * N + node) of each token the step emits, in emitted order (the
    path's nodes; the bonus comes from the last one): SGLang's compute_spec_logprobs reads these (accept_index)."""
    bs, N, L = out.shape
    return out.path + torch.arange(bs, device=out.path.device)[:, None] * N
