"""The DDTree draft tree (Algorithm 1 of arXiv 2604.12989) built with fixed shapes, for a CUDA graph.

The worker runs this form for shapes the fused kernel does not take and on CPU (`kdtree.ddtree.fused`'s
`build_draft_tree` chooses); the kernel writes the same values into the same `TreeBuffers`, and is tested
against this form.

Input, per request: the drafter's top-K log-probs `lp[bs, L, K]` (float32, each depth sorted descending, -inf
marks an absent candidate) and their token ids `ids[bs, L, K]`, plus the root token (the previous bonus). Output
(`TreeBuffers`): a tree of N = budget + 1 nodes, node 0 the root, nodes 1..budget the best-first prefixes in the
order of the reference heap (`kdtree.ddtree.reference.build_ddtree_tree`), so every parent comes before its
children. When fewer than `budget` prefixes exist (L*K small, or -inf candidates) the rest are padding nodes:
candidate -1 (never matches a target token), input id 0, parent 0, depth 1, score -inf, mask row = root + self.

The order. The reference pops by the key (-σ, rank tuple): σ the float32 sum of the node's log-probs, exact ties
to the lexicographically smaller tuple of 0-based ranks, a prefix before its extensions. Parent and previous
sibling have smaller keys than the node, so the heap's first `budget` pops are the `budget` smallest keys of all
prefixes. This module computes the same set and order:
1. Beam per depth, kept in lexicographic order. C_0 = {root}. For d = 1..L, the candidates C_{d-1} x K are laid
   out flat as slot * K + rank; with C_{d-1} in lexicographic order that flat order is the candidates'
   lexicographic order. A stable descending sort by score then orders them by key; the first `budget` are C_d,
   re-sorted by flat index so that C_d is again in lexicographic order. C_d holds every depth-d node of the
   answer: such a node's parent is in the answer (smaller key) hence in C_{d-1}, and fewer than `budget`
   prefixes of any depth have a smaller key.
2. Lexicographic order across depths: the union of the beams is a prefix-closed tree (each member's parent is a
   member one depth up), and lexicographic order on it is its preorder with children in rank order.
   Subtree sizes come bottom-up (scatter_add over L depths); preorder(u) = preorder(parent) + 1 + sizes of u's
   earlier siblings (siblings are contiguous in C_d, so that is an exclusive cumsum over C_d minus the one at
   the parent's first child, itself an exclusive cumsum over C_{d-1} of the parents' child sizes).
3. Global cut: sort all beam members by preorder, then stable-sort by score descending: key order. The first
   `budget` are the tree; parents map to output indices through the inverse permutation (a scatter).
4. Ancestor-or-self mask: mask = I, then L times mask = I | mask[parent] (a node's depth is at most L).

Scores accumulate in float32 in the same association as the reference (parent score + log-prob), and
float32(σ + lp) <= σ for lp <= 0, so a parent never scores below its child even on rounding.

Only static-shape torch ops: no .item()/.tolist()/.cpu(), no nonzero or boolean-mask indexing, and the loops run
over L (a shape). Every intermediate lives in a `TreeBuffers` allocated once; calls write into it (out=), so a call
can be captured in a CUDA graph and replayed on new inputs written into the same input tensors. (torch.sort may
take scratch memory of its own; under capture that comes from the graph's pool, so a replay allocates nothing.)
Cost per call: L sorts over budget*K scores and 2 over L*budget, per request. lp must hold no NaN and no positive
value (log-probs); nothing here checks the values, as that would synchronise with the host.
"""

from __future__ import annotations

import torch

_BIG = 1 << 62  # preorder of an absent beam member: after every real one


class TreeBuffers:
    """Outputs (read these) and workspace of `build_tree` for one shape: bs requests, L depths, K candidates a
    depth, `budget` nodes besides the root."""

    def __init__(self, bs: int, L: int, K: int, budget: int, device: torch.device | str = "cpu"):
        if min(bs, L, K, budget) < 1:
            raise ValueError(f"bs, L, K and budget must be >= 1 (got bs={bs}, L={L}, K={K}, budget={budget})")
        self.shape = (bs, L, K, budget)
        W, N = budget, budget + 1
        i64, f32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.float32, device=device)
        booln = dict(dtype=torch.bool, device=device)
        # outputs, [bs, N] unless noted
        self.input_ids = torch.zeros(bs, N, **i64)  # root token, node tokens, 0 for padding
        self.candidates = torch.zeros(bs, N, **i64)  # root token, node tokens, -1 for padding
        self.parents = torch.zeros(bs, N, **i64)  # root -1; padding 0
        self.depths = torch.zeros(bs, N, **i64)  # position offset from the root: root 0, padding 1
        self.scores = torch.zeros(bs, N, **f32)  # σ; root 0, padding -inf
        self.mask = torch.zeros(bs, N, N, **booln)  # mask[b, i, j]: j is i or an ancestor of i
        self.num_nodes = torch.zeros(bs, **i64)  # real nodes besides the root
        self.full_sorts = torch.zeros(bs, **i64)  # depths the fused kernel sorted whole (kdtree.ddtree.fused)
        # workspace: beams [bs, L + 1, W] (depth 0 = the root), candidates [bs, W * K], the union [bs, L * W]
        self.beam_score = torch.empty(bs, L + 1, W, **f32)
        self.beam_parent = torch.zeros(bs, L + 1, W, **i64)  # slot in the beam one depth up
        self.beam_rank = torch.zeros(bs, L + 1, W, **i64)
        self.beam_token = torch.zeros(bs, L + 1, W, **i64)
        self.beam_valid = torch.zeros(bs, L + 1, W, **booln)
        self.beam_absent = torch.zeros(bs, L + 1, W, **booln)
        self.beam_count = torch.zeros(bs, L + 1, W, **i64)  # 1 where valid
        self.size = torch.zeros(bs, L + 1, W, **i64)  # subtree size within the union
        self.pre = torch.zeros(bs, L + 1, W, **i64)  # preorder index within the union
        self.cand = torch.empty(bs, W * K, **f32)
        self.cand_sorted = torch.empty(bs, W * K, **f32)
        self.cand_order = torch.empty(bs, W * K, **i64)
        self.sel = torch.empty(bs, W, **i64)
        self.sel_perm = torch.empty(bs, W, **i64)
        self.t1 = torch.empty(bs, W, **i64)
        self.t2 = torch.empty(bs, W, **i64)
        self.t3 = torch.empty(bs, W, **i64)
        self.node_valid = torch.empty(bs, W, **booln)
        self.deep = torch.empty(bs, W, **booln)
        self.all_pre = torch.empty(bs, L * W, **i64)
        self.all_lex = torch.empty(bs, L * W, **i64)
        self.all_score = torch.empty(bs, L * W, **f32)
        self.all_score_sorted = torch.empty(bs, L * W, **f32)
        self.all_key = torch.empty(bs, L * W, **i64)
        self.order = torch.empty(bs, W, **i64)  # union index (d - 1) * W + slot of node 1.., key order
        self.inv = torch.zeros(bs, L * W, **i64)  # union index -> output node index
        self.node_index = torch.arange(1, W + 1, **i64).expand(bs, W)
        self.mask_parent = torch.zeros(bs, N, **i64)
        self.mask_tmp = torch.zeros(bs, N, N, **booln)
        self.eye = torch.eye(N, **booln)
        # torch.where's out= form takes tensors; full() fills on the device (torch.tensor would copy from the host)
        self.const = {v: torch.full((), v, **i64) for v in (-1, 0, 1)}


def build_tree(
    lp: torch.Tensor,
    ids: torch.Tensor,
    root_ids: torch.Tensor,
    budget: int,
    out: TreeBuffers | None = None,
) -> TreeBuffers:
    """Build the tree of each request into `out` (allocated here when None) and return it. See the module."""
    if lp.dim() != 3 or lp.dtype != torch.float32:
        raise ValueError(f"lp must be float32 [bs, L, K] (got {tuple(lp.shape)} {lp.dtype})")
    bs, L, K = lp.shape
    if ids.shape != lp.shape or ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64 {tuple(lp.shape)} like lp (got {tuple(ids.shape)} {ids.dtype})")
    if root_ids.shape != (bs,) or root_ids.dtype != torch.int64:
        raise ValueError(f"root_ids must be int64 [{bs}] (got {tuple(root_ids.shape)} {root_ids.dtype})")
    if out is None:
        out = TreeBuffers(bs, L, K, budget, lp.device)
    if out.shape != (bs, L, K, budget) or out.cand.device != lp.device:
        raise ValueError(
            f"buffers are for (bs, L, K, budget) = {out.shape} on {out.cand.device}, "
            f"the call is {(bs, L, K, budget)} on {lp.device}: make TreeBuffers for this shape"
        )
    b, W, N = out, budget, budget + 1
    neg_inf = float("-inf")

    # 1. the beams, each in lexicographic order
    b.beam_score[:, 0].fill_(neg_inf)
    b.beam_score[:, 0, :1].fill_(0.0)
    cand3 = b.cand.view(bs, W, K)
    for d in range(1, L + 1):
        torch.add(b.beam_score[:, d - 1, :, None], lp[:, d - 1, None, :], out=cand3)
        torch.sort(b.cand, dim=1, descending=True, stable=True, out=(b.cand_sorted, b.cand_order))
        torch.sort(b.cand_order[:, :W], dim=1, out=(b.sel, b.sel_perm))
        torch.gather(b.cand, 1, b.sel, out=b.beam_score[:, d])
        torch.div(b.sel, K, rounding_mode="floor", out=b.beam_parent[:, d])
        torch.remainder(b.sel, K, out=b.beam_rank[:, d])
        torch.gather(ids[:, d - 1], 1, b.beam_rank[:, d], out=b.beam_token[:, d])
    torch.gt(b.beam_score, neg_inf, out=b.beam_valid)
    b.beam_count.copy_(b.beam_valid)

    # 2. preorder of the union: subtree sizes bottom-up, then positions top-down
    b.size[:, L].copy_(b.beam_count[:, L])
    for d in range(L - 1, -1, -1):
        b.size[:, d].copy_(b.beam_count[:, d])
        b.size[:, d].scatter_add_(1, b.beam_parent[:, d + 1], b.size[:, d + 1])
    b.pre[:, 0].zero_()
    for d in range(1, L + 1):
        torch.sub(b.size[:, d - 1], b.beam_count[:, d - 1], out=b.t1)  # each parent's children's sizes
        torch.cumsum(b.t1, 1, out=b.t2)
        b.t2.sub_(b.t1)  # exclusive: preorder offset of each parent's first child below the parent
        torch.cumsum(b.size[:, d], 1, out=b.t3)
        b.t3.sub_(b.size[:, d])
        torch.gather(b.t2, 1, b.beam_parent[:, d], out=b.t1)
        b.t3.sub_(b.t1)  # sizes of the earlier siblings
        torch.gather(b.pre[:, d - 1], 1, b.beam_parent[:, d], out=b.pre[:, d])
        b.pre[:, d].add_(b.t3).add_(1)
    torch.logical_not(b.beam_valid, out=b.beam_absent)
    b.pre.masked_fill_(b.beam_absent, _BIG)

    # 3. the global cut in key order (-score, rank tuple)
    union_score = b.beam_score[:, 1:].reshape(bs, L * W)  # views: each beam row is contiguous
    union_pre = b.pre[:, 1:].reshape(bs, L * W)
    torch.sort(union_pre, dim=1, stable=True, out=(b.all_pre, b.all_lex))
    torch.gather(union_score, 1, b.all_lex, out=b.all_score)
    torch.sort(b.all_score, dim=1, descending=True, stable=True, out=(b.all_score_sorted, b.all_key))
    torch.gather(b.all_lex, 1, b.all_key[:, :W], out=b.order)

    torch.gather(union_score, 1, b.order, out=b.scores[:, 1:])
    torch.gt(b.scores[:, 1:], neg_inf, out=b.node_valid)
    torch.sum(b.node_valid, 1, out=b.num_nodes)
    torch.gather(b.beam_token[:, 1:].reshape(bs, L * W), 1, b.order, out=b.t1)
    torch.where(b.node_valid, b.t1, b.const[-1], out=b.candidates[:, 1:])
    torch.where(b.node_valid, b.t1, b.const[0], out=b.input_ids[:, 1:])
    torch.div(b.order, W, rounding_mode="floor", out=b.t2)  # depth - 1
    torch.add(b.t2, 1, out=b.t3)
    torch.where(b.node_valid, b.t3, b.const[1], out=b.depths[:, 1:])
    torch.ge(b.t2, 1, out=b.deep)
    b.deep.logical_and_(b.node_valid)  # real nodes below depth 1: their parent is a node, not the root
    # the parent's union index: (d - 2) * W + parent slot = order - W - slot + parent slot
    torch.gather(b.beam_parent[:, 1:].reshape(bs, L * W), 1, b.order, out=b.t1)
    torch.remainder(b.order, W, out=b.t3)
    torch.sub(b.order, b.t3, out=b.t2)
    b.t2.add_(b.t1).sub_(W).clamp_(min=0)
    b.inv.zero_()
    b.inv.scatter_(1, b.order, b.node_index)
    torch.gather(b.inv, 1, b.t2, out=b.t1)
    torch.where(b.deep, b.t1, b.const[0], out=b.parents[:, 1:])
    b.scores[:, :1].fill_(0.0)
    b.parents[:, :1].fill_(-1)
    b.depths[:, :1].fill_(0)
    b.input_ids[:, 0].copy_(root_ids)
    b.candidates[:, 0].copy_(root_ids)

    # 4. ancestor-or-self mask
    torch.clamp(b.parents, min=0, out=b.mask_parent)
    rows = b.mask_parent[:, :, None].expand(bs, N, N)
    b.mask.copy_(b.eye.expand(bs, N, N))
    for _ in range(L):
        torch.gather(b.mask, 1, rows, out=b.mask_tmp)
        torch.logical_or(b.mask_tmp, b.eye, out=b.mask)
    return b


def verify_layout(
    mask: torch.Tensor, depths: torch.Tensor, prefix: torch.Tensor, buf: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The trees as the target's verify reads them: positions [bs, N] = prefix + depth, and each ancestor mask
    [bs, N, N] written into `buf` in SGLang's FULL custom-mask layout (request b's N rows of prefix_b + N columns,
    from the sum of the earlier requests' N (prefix + N) entries). Only each row's last N columns, the tree block,
    are written: the prefix's columns are never read, by Triton's extend kernel as by kdtree."""
    N = mask.shape[1]
    p = prefix.to(torch.int64)
    row = p + N  # the columns a row has
    start = torch.cumsum(N * row, 0) - N * row  # exclusive: where request b's rows begin
    i = torch.arange(N, dtype=torch.int64, device=mask.device)
    idx = start[:, None, None] + i[None, :, None] * row[:, None, None] + p[:, None, None] + i[None, None, :]
    buf.view(torch.uint8).view(-1)[idx.reshape(-1)] = mask.reshape(-1).to(torch.uint8)
    torch.add(p[:, None], depths, out=positions)
    return positions


def chain_expected(top1_lp: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """E_chain [bs] from the chain's log-probs [bs, L] (each depth's top-1): the drafter's expected accepted length
    of its chain, the sum over depths of the product of the probabilities up to there (Proposition 1 of the DDTree
    paper, for a tree that is one path)."""
    return torch.sum(torch.exp(torch.cumsum(top1_lp, dim=1)), dim=1, out=out)
