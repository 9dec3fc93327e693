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

On CUDA the worker runs these three, and the commit (`commit_window`), as one kernel (`kdtree.ddtree.fused.accept_walk`,
the same values); the torch forms here are its CPU path and the oracle its tests compare it with.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class WindowCommit(NamedTuple):
    """What the commit of a step rewrites and reads: the requests' prefix lengths and rows of req_to_token (each
    request's window is columns prefix .. prefix + N - 1 of its row), and the drafter's write ids of the window's N
    slots a request ([bs, N] or [bs * N])."""

    prefix: torch.Tensor
    req_pool_indices: torch.Tensor
    req_to_token: torch.Tensor
    draft_ids: torch.Tensor


class AcceptBuffers:
    """Outputs of `follow_tree` for bs requests, trees of N nodes and at most L drafted depths; `budgets` (tree
    sizes, ascending) are what `cut_stats` writes `stats` for."""

    def __init__(
        self, bs: int, N: int, L: int, device: torch.device | str = "cpu", budgets: tuple[int, ...] = ()
    ):
        i64 = dict(dtype=torch.int64, device=device)
        self.shape = (bs, N, L)
        self.budgets = torch.empty(len(budgets), **i64)
        for i, b in enumerate(
            budgets
        ):  # filled on the device: a tensor from a host list would be a synchronising copy
            self.budgets[i].fill_(b)
        self.stats = torch.zeros(bs, 2, len(budgets), dtype=torch.float32, device=device)
        self.live_candidates = torch.zeros(bs, N, **i64)  # the candidates with the nodes past a cut made -1
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
        self.path_loc = torch.zeros(bs, L + 1, **i64)  # commit_window: the path's drafter write ids
        self.draft_positions = torch.zeros(bs, L + 1, **i64)  # commit_window: prefix + 0 .. L
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
    parents: torch.Tensor,
    candidates: torch.Tensor,
    target: torch.Tensor,
    L: int,
    out: AcceptBuffers,
    live: torch.Tensor | None = None,
) -> AcceptBuffers:
    """The walk for every request at once, L steps of [bs, N] ops. parents/candidates/target: int64 [bs, N]
    (root's parent -1, padding nodes' candidate -1). live [>= bs]: request b's tree is its first live[b] nodes
    (DDTREE's cut: the tree's order is best-first with parents first, so its first b + 1 nodes are the tree of
    budget b); the nodes past it are unmatchable, as padding is."""
    o = out
    if live is not None:
        bs = parents.shape[0]
        keep = o.node_index < live[:bs, None].to(torch.int64)
        candidates = torch.where(keep, candidates, torch.full_like(candidates, -1), out=o.live_candidates)
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


def commit_window(out: AcceptBuffers, commit: WindowCommit) -> AcceptBuffers:
    """The step's commit after the walk in `out` (its perm and path): the window's slots in req_to_token permuted,
    the accepted path's first (so the committed KV is contiguous), out.commit_lens = accepted + 1, out.new_seq_lens
    = prefix + accepted + 1, out.path_loc = the drafter's write ids at the path's nodes and out.draft_positions =
    prefix + 0 .. L: where and at which positions the drafter's KV of the path is written."""
    bs, N, L = out.shape
    o = out
    prefix = commit.prefix.to(torch.int64)
    torch.add(o.accepted, 1, out=o.commit_lens)
    torch.add(prefix, o.commit_lens, out=o.new_seq_lens)
    rows = commit.req_pool_indices.to(torch.int64)[:, None]
    cols = prefix[:, None] + o.node_index
    old = commit.req_to_token[rows, cols]
    commit.req_to_token[rows, cols] = torch.gather(old, 1, o.perm)
    torch.gather(commit.draft_ids.reshape(bs, N).to(torch.int64), 1, o.path, out=o.path_loc)
    torch.add(prefix[:, None], o.depth_index, out=o.draft_positions)
    return o


def path_rows(out: AcceptBuffers) -> torch.Tensor:
    """[bs, L + 1]: the verify's logits row (b * N + node) of each token the step emits, in emitted order (the
    path's nodes; the bonus comes from the last one): SGLang's compute_spec_logprobs reads these (accept_index)."""
    bs, N, L = out.shape
    return out.path + torch.arange(bs, device=out.path.device)[:, None] * N


def cut_stats(out: AcceptBuffers, scores: torch.Tensor) -> torch.Tensor:
    """out.stats [bs, 2, C] for the walk in `out`: per request and budget b of out.budgets, [0] the drafted tokens
    the walk accepted within the tree's first b nodes (the path's nodes are in increasing order, so that is what a
    walk of the tree cut at b accepts: the target's tokens at the nodes it visits are the same), [1] the sum of
    exp(score) over nodes 1..b (Proposition 1 of the DDTree paper: the drafter's expected accepted length of that
    tree). What the auto budget (`kdtree.ddtree.budget`) learns from."""
    bs, N, L = out.shape
    o = out
    on_path = (o.depth_index >= 1) & (o.depth_index <= o.accepted[:, None])  # [bs, L + 1]
    within = (o.path[:, None, :] <= o.budgets[None, :, None]) & on_path[:, None, :]
    o.stats[:, 0].copy_(within.sum(-1))
    e = torch.where(o.node_index >= 1, scores.exp(), torch.zeros_like(scores))
    upto = o.node_index[:, None, :] <= o.budgets[None, :, None]  # [bs, C, N]
    o.stats[:, 1].copy_(torch.where(upto, e[:, None, :], torch.zeros((), dtype=e.dtype)).sum(-1))
    return o.stats
