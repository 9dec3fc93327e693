"""DDTree's per-step stages as one Triton kernel each: the draft tree, the verify's inputs (positions and the ancestor
masks in SGLang's layout) and the acceptance walk with its commit. One launch where torch takes a dozen, so that the
host's time a step stays small beside the GPU's (kernel_build/NOTES.md).

`tree_kernel` writes exactly what `kdtree.ddtree.tree.build_tree` writes into a `TreeBuffers` (same values, same
order and tie rule: see that module), one program per request, in four phases separated by block barriers over
the buffers' global workspace:
1. per depth d, the beam C_d: every candidate (parent slot p, rank r) of C_{d-1} x K gets an int64 key, the
   order-preserving int32 image of -score in the high bits and its flat index p * KP + r in the low bits (flat
   order = lexicographic order, as in build_tree); the first `budget` keys are C_d, sorted again by flat index
   (lexicographic order). Scores are recomputed as parent score + log-prob, the same float32 add.
   The first `budget` keys come from the pair set S: with the parents ranked by key, the pairs (rank i, r) with
   (i + 1)(r + 1) <= budget, about budget * ln(budget) of the budget * K candidates. A candidate outside S has
   at least `budget` pairs of S at or above it in score (its row and column are sorted), so S holds C_d unless
   float32 rounding ties reorder them; the kernel checks that exactly (each row's first pair outside S against
   the budget-th key of S) and otherwise sorts that depth's candidates whole: tl.sort in chunks of at most
   SORT_BLOCK, the first `budget` of each chunk merged by one more sort (`TreeBuffers.full_sorts` counts those
   depths);
2. subtree sizes bottom-up and preorder top-down, cumsums over each beam (children of a parent are contiguous);
3. the global cut: one tl.sort of the union's keys (-score image, preorder, union index), the first `budget`;
4. the ancestor-or-self mask, L parent hops per node.
Which shapes: `fits` (blocks padded to powers of two: L * budget and the merge at most SORT_BLOCK, budget * K at
most FUSED_MAX_CANDIDATES, a speed limit: at K = budget, budgets up to 32). `build_draft_tree` gives every other
shape, and CPU tensors, to build_tree (torch ops, the same values).

`verify_layout_kernel` writes what `kdtree.ddtree.tree.verify_layout` writes, one row of one request per program.

`walk_kernel` does `kdtree.ddtree.accept.follow_tree`, `window_permutation` and `path_rows` for one request per
program and writes AcceptBuffers' path, accepted, bonus, out_tokens, perm and rows (every shape); given DDTREE's cut
(`live`) it walks only each request's first live[b] nodes, given the tree's scores it writes `cut_stats` too, and
given a `WindowCommit` it does `commit_window`.

`top1_kernel` and `chain_expected_kernel` (`chain_head`) take the drafter's chain from its logits: each depth's argmax
and its log-probability (one pass over the row: a running max, its first index and an online sum of exponentials),
then E_chain, the chain's expected accepted length. Two launches where the top-K head takes a dozen: what auto's
chain steps run (kdtree.ddtree.worker.TreeDraftSampler).

They allocate nothing and read nothing back to the host: a call is one launch (two for chain_head), capturable in
a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree.ddtree.accept import (
    AcceptBuffers,
    WindowCommit,
    commit_window,
    cut_stats,
    follow_tree,
    path_rows,
    window_permutation,
)
from kdtree.ddtree.tree import TreeBuffers, build_tree, chain_expected, verify_layout

SORT_BLOCK = 4096  # the most elements one tl.sort takes (registers of one program)
# budget * K (padded) above which build_draft_tree keeps build_tree. Measured on an H200 (bs 1, L 15, graph replays;
# tuning/ddtree_stages.py): fused 46 / 201 / 1307 / 5104 us against torch's 955 / 1002 / 1129 / 1554 at budgets
# 16 / 32 / 64 / 128 (K = budget): the fused sorts grew as budget * K, so it takes budgets up to 32. (Measured
# before the pair set S, which sorts about budget * ln(budget) candidates a depth: not yet measured.)
FUSED_MAX_CANDIDATES = 1024
_MIN_BLOCK = 16
NUM_WARPS = 4


def _p2(n: int) -> int:
    return max(_MIN_BLOCK, triton.next_power_of_2(n))


def pair_count(K: int, budget: int) -> int:
    """|S|: the candidates (parent of score rank i, rank r) with (i + 1)(r + 1) <= budget and r < K, about
    budget * ln(budget) of the budget * K (see the module)."""
    return sum(min(budget // (i + 1), K) for i in range(budget))


def _blocks(L: int, K: int, budget: int) -> dict:
    WP, KP = _p2(budget), _p2(K)
    CH = min(WP * KP, SORT_BLOCK)
    NC = WP * KP // CH
    return dict(WP=WP, KP=KP, CH=CH, NC=NC, MP=NC * WP, LWP=_p2(L * budget), SP=_p2(pair_count(K, budget)))


def fits(L: int, K: int, budget: int) -> bool:
    """Whether the fused builder takes this shape (else build_tree does; see the module)."""
    s = _blocks(L, K, budget)
    return (
        s["KP"] <= SORT_BLOCK
        and s["MP"] <= SORT_BLOCK
        and s["NC"] <= K  # the merge area lives in TreeBuffers.cand_order, [bs, budget * K]
        and s["LWP"] <= SORT_BLOCK
        and s["SP"] <= SORT_BLOCK
        and s["WP"] * s["KP"] <= FUSED_MAX_CANDIDATES
    )


@triton.jit
def _neg_score_image(s):
    """int64 in [0, 2^32): smaller for a larger float32 score (-0.0 as +0.0), -inf the largest finite image."""
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    m = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    return 0x7FFFFFFF - m


@triton.jit
def tree_kernel(
    lp_ptr,  # [bs, L, K] float32
    ids_ptr,  # [bs, L, K] int64
    root_ptr,  # [bs] int64, root_stride apart (a column of the draft block's ids)
    root_stride,
    beam_score_ptr,  # [bs, L + 1, W] float32
    beam_parent_ptr,  # [bs, L + 1, W] int64
    beam_token_ptr,  # [bs, L + 1, W] int64
    size_ptr,  # [bs, L + 1, W] int64
    pre_ptr,  # [bs, L + 1, W] int64
    sel_ptr,  # [bs, W] int64 workspace
    merge_ptr,  # [bs, NC * W] int64 workspace (NC > 1)
    t1_ptr,  # [bs, W] int64 workspace
    t2_ptr,  # [bs, W] int64 workspace
    t3_ptr,  # [bs, W] int64 workspace
    order_ptr,  # [bs, W] int64: union index of node 1..
    inv_ptr,  # [bs, L * W] int64 workspace
    input_ids_ptr,
    candidates_ptr,
    parents_ptr,
    depths_ptr,  # [bs, N] int64
    scores_ptr,  # [bs, N] float32
    mask_ptr,  # [bs, N, N] bool
    num_nodes_ptr,  # [bs] int64
    full_sorts_ptr,  # [bs] int64: depths whose beam S did not hold
    L: tl.constexpr,
    K: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    KP: tl.constexpr,
    CH: tl.constexpr,  # candidates sorted at once (a multiple of KP)
    NC: tl.constexpr,  # chunks: WP * KP = NC * CH
    MP: tl.constexpr,  # merge block, NC * WP
    LWP: tl.constexpr,
    SP: tl.constexpr,  # block of the pair set S, pair_count padded
    UB: tl.constexpr,  # bits of a union index / preorder field in the cut's key
    NP: tl.constexpr,
    RB: tl.constexpr,  # mask rows per block
):
    b = tl.program_id(0).to(tl.int64)
    N: tl.constexpr = W + 1
    NEG_INF = float("-inf")
    MAXKEY: tl.constexpr = 0x7FFFFFFFFFFFFFFF
    LOW31: tl.constexpr = 0x7FFFFFFF
    beam = b * (L + 1) * W  # this request's [L + 1, W] rows
    lp_row = lp_ptr + b * L * K
    ids_row = ids_ptr + b * L * K
    w = tl.arange(0, WP)
    wm = w < W

    # 1. the beams, each in lexicographic order; depth 0 = the root in slot 0. First the pair set S: pair j is
    # (parent of score rank srow[j], rank sr[j]), rows of min(W // (i + 1), K) pairs one after another. A
    # candidate outside S is worse than every pair of S before it in its row and in its column, at least W of
    # them, so S holds the beam unless rounding ties say otherwise; the check below decides exactly, and when it
    # fails the depth sorts all candidates: in NC chunks of CH, the first W of each chunk to the merge area,
    # whose first W (sorted again) are the beam's.
    j = tl.arange(0, SP)
    srow = tl.zeros([SP], dtype=tl.int64)
    sstart = tl.zeros([SP], dtype=tl.int64)
    total = 0
    for i in range(0, W):
        cnt = tl.minimum(W // (i + 1), K)
        inrow = (j >= total) & (j < total + cnt)
        srow = tl.where(inrow, i, srow)
        sstart = tl.where(inrow, total, sstart)
        total += cnt
    sm = j < total
    sr = j - sstart
    er = W // (w + 1)  # the first rank of row w outside S
    em = wm & (er < K)
    full = 0
    tl.store(beam_score_ptr + beam + w, tl.where(w == 0, 0.0, NEG_INF), mask=wm)
    for d in range(1, L + 1):
        tl.debug_barrier()
        prev = tl.load(beam_score_ptr + beam + (d - 1) * W + w, mask=wm, other=NEG_INF)
        rank = tl.sort(tl.where(wm, (_neg_score_image(prev) << 31) | w.to(tl.int64), MAXKEY))
        tl.store(t1_ptr + b * W + w, rank & LOW31, mask=wm)  # the slot of score rank w (ties: lower slot)
        tl.debug_barrier()
        sslot = tl.load(t1_ptr + b * W + srow, mask=sm, other=0)
        ss = tl.load(beam_score_ptr + beam + (d - 1) * W + sslot, mask=sm, other=0.0)
        sx = tl.load(lp_row + (d - 1) * K + sr, mask=sm, other=0.0)
        skey = tl.sort(tl.where(sm, (_neg_score_image(ss + sx) << 31) | (sslot * KP + sr), MAXKEY))
        kw = tl.max(tl.where(j == W - 1, skey, 0), 0)  # the beam's last key if S holds it
        eslot = tl.load(t1_ptr + b * W + w, mask=em, other=0)
        es = tl.load(beam_score_ptr + beam + (d - 1) * W + eslot, mask=em, other=0.0)
        ex = tl.load(lp_row + (d - 1) * K + er, mask=em, other=0.0)
        ekey = (_neg_score_image(es + ex) << 31) | (eslot * KP + er)
        # rows are sorted (lp descending, flat ascending): S holds the beam iff no row's first pair outside S
        # comes before its last key
        outside = tl.sum((em & (ekey < kw)).to(tl.int32), 0)
        full += (outside > 0).to(tl.int32)
        if outside == 0:
            tl.store(sel_ptr + b * W + j, skey, mask=j < W)
        else:
            for c in range(NC):
                f = c * CH + tl.arange(0, CH)
                fp = f // KP
                fr = f % KP
                fm = (fp < W) & (fr < K)
                s = tl.load(beam_score_ptr + beam + (d - 1) * W + fp, mask=fm, other=0.0)
                x = tl.load(lp_row + (d - 1) * K + fr, mask=fm, other=0.0)
                key = (_neg_score_image(s + x) << 31) | f.to(tl.int64)
                key = tl.sort(tl.where(fm, key, MAXKEY))
                ci = tl.arange(0, CH)
                if NC == 1:
                    tl.store(sel_ptr + b * W + ci, key, mask=ci < W)
                else:
                    tl.store(merge_ptr + b * NC * W + c * W + ci, key, mask=ci < W)
            if NC > 1:
                tl.debug_barrier()
                mi = tl.arange(0, MP)
                mk = tl.load(merge_ptr + b * NC * W + mi, mask=mi < NC * W, other=MAXKEY)
                mk = tl.sort(mk)
                tl.store(sel_ptr + b * W + mi, mk, mask=mi < W)
        tl.debug_barrier()
        flat = tl.load(sel_ptr + b * W + w, mask=wm, other=MAXKEY) & LOW31
        flat = tl.sort(tl.where(wm, flat, MAXKEY))
        p = tl.where(wm, flat // KP, 0)
        r = tl.where(wm, flat % KP, 0)
        ps = tl.load(beam_score_ptr + beam + (d - 1) * W + p, mask=wm, other=0.0)
        px = tl.load(lp_row + (d - 1) * K + r, mask=wm, other=0.0)
        tok = tl.load(ids_row + (d - 1) * K + r, mask=wm, other=0)
        tl.store(beam_score_ptr + beam + d * W + w, ps + px, mask=wm)
        tl.store(beam_parent_ptr + beam + d * W + w, p, mask=wm)
        tl.store(beam_token_ptr + beam + d * W + w, tok, mask=wm)

    # 2. subtree sizes bottom-up, then preorder top-down (as build_tree's step 2). A beam's children of one parent
    # are contiguous (lexicographic order), so a parent's children's sizes are a difference of the cumsum over
    # the beam: at its last child minus before its first (written at the parent's slot, else 0).
    tl.debug_barrier()
    for up in range(0, L + 1):
        d = L - up
        cnt = (tl.load(beam_score_ptr + beam + d * W + w, mask=wm, other=NEG_INF) > NEG_INF).to(tl.int64)
        kids = tl.zeros([WP], dtype=tl.int64)
        if d < L:
            tl.store(t1_ptr + b * W + w, tl.zeros([WP], dtype=tl.int64), mask=wm)
            tl.store(t3_ptr + b * W + w, tl.zeros([WP], dtype=tl.int64), mask=wm)
            par = tl.load(beam_parent_ptr + beam + (d + 1) * W + w, mask=wm, other=W)
            nxt = tl.load(beam_parent_ptr + beam + (d + 1) * W + w + 1, mask=w + 1 < W, other=W + 1)
            prv = tl.load(beam_parent_ptr + beam + (d + 1) * W + w - 1, mask=wm & (w >= 1), other=-1)
            sz = tl.load(size_ptr + beam + (d + 1) * W + w, mask=wm, other=0)
            cum = tl.cumsum(sz, 0)
            tl.debug_barrier()
            tl.store(t1_ptr + b * W + par, cum, mask=wm & (par != nxt))
            tl.store(t3_ptr + b * W + par, cum - sz, mask=wm & (par != prv))
            tl.debug_barrier()
            kids = tl.load(t1_ptr + b * W + w, mask=wm, other=0) - tl.load(
                t3_ptr + b * W + w, mask=wm, other=0
            )
        tl.store(size_ptr + beam + d * W + w, cnt + kids, mask=wm)
        tl.debug_barrier()
    ABSENT: tl.constexpr = (1 << UB) - 1
    tl.store(pre_ptr + beam + w, tl.zeros([WP], dtype=tl.int64), mask=wm)
    for d in range(1, L + 1):
        tl.debug_barrier()
        up_cnt = (tl.load(beam_score_ptr + beam + (d - 1) * W + w, mask=wm, other=NEG_INF) > NEG_INF).to(
            tl.int64
        )
        up_kids = tl.load(size_ptr + beam + (d - 1) * W + w, mask=wm, other=0) - up_cnt
        tl.store(t2_ptr + b * W + w, tl.cumsum(up_kids, 0) - up_kids, mask=wm)
        tl.debug_barrier()
        sc = tl.load(beam_score_ptr + beam + d * W + w, mask=wm, other=NEG_INF)
        sz = tl.load(size_ptr + beam + d * W + w, mask=wm, other=0)
        par = tl.load(beam_parent_ptr + beam + d * W + w, mask=wm, other=0)
        first = tl.load(t2_ptr + b * W + par, mask=wm, other=0)
        up_pre = tl.load(pre_ptr + beam + (d - 1) * W + par, mask=wm, other=0)
        pre = up_pre + 1 + (tl.cumsum(sz, 0) - sz) - first
        tl.store(pre_ptr + beam + d * W + w, tl.where(sc > NEG_INF, pre, ABSENT), mask=wm)

    # 3. the global cut in key order (-score, preorder); absent members after, in union order
    tl.debug_barrier()
    u = tl.arange(0, LWP)
    um = u < L * W
    us = tl.load(beam_score_ptr + beam + W + u, mask=um, other=NEG_INF)
    upre = tl.load(pre_ptr + beam + W + u, mask=um, other=ABSENT)
    ukey = (_neg_score_image(us) << 31) | (upre << UB) | u.to(tl.int64)
    ukey = tl.sort(tl.where(um, ukey, MAXKEY))
    tl.store(order_ptr + b * W + u, ukey & ((1 << UB) - 1), mask=u < W)
    tl.debug_barrier()
    o = tl.load(order_ptr + b * W + w, mask=wm, other=0)
    tl.store(inv_ptr + b * L * W + o, w.to(tl.int64) + 1, mask=wm)
    score = tl.load(beam_score_ptr + beam + W + o, mask=wm, other=NEG_INF)
    valid = (score > NEG_INF) & wm
    tok = tl.load(beam_token_ptr + beam + W + o, mask=wm, other=0)
    dm1 = o // W
    bpar = tl.load(beam_parent_ptr + beam + W + o, mask=wm, other=0)
    up_u = tl.maximum(o - (o % W) + bpar - W, 0)
    deep = valid & (dm1 >= 1)
    tl.debug_barrier()
    parent = tl.load(inv_ptr + b * L * W + up_u, mask=deep, other=0)
    out = b * N + 1 + w
    tl.store(scores_ptr + out, score, mask=wm)
    tl.store(candidates_ptr + out, tl.where(valid, tok, -1), mask=wm)
    tl.store(input_ids_ptr + out, tl.where(valid, tok, 0), mask=wm)
    tl.store(depths_ptr + out, tl.where(valid, dm1 + 1, 1), mask=wm)
    tl.store(parents_ptr + out, tl.where(deep, parent, 0), mask=wm)
    tl.store(num_nodes_ptr + b, tl.sum(valid.to(tl.int64), 0))
    tl.store(full_sorts_ptr + b, full.to(tl.int64))
    root = tl.load(root_ptr + b * root_stride)
    tl.store(scores_ptr + b * N, 0.0)
    tl.store(parents_ptr + b * N, -1)
    tl.store(depths_ptr + b * N, 0)
    tl.store(input_ids_ptr + b * N, root)
    tl.store(candidates_ptr + b * N, root)

    # 4. ancestor-or-self mask: row i holds i and its first L ancestors (the root's parent taken as the root)
    tl.debug_barrier()
    cols = tl.arange(0, NP)[None, :]
    for r0 in range(0, NP, RB):
        ri = r0 + tl.arange(0, RB)
        im = ri < N
        cur = ri.to(tl.int64)
        m = cols == cur[:, None]
        for _ in range(L):
            cur = tl.maximum(tl.load(parents_ptr + b * N + cur, mask=im, other=0), 0)
            m = m | (cols == cur[:, None])
        tl.store(mask_ptr + b * N * N + ri[:, None] * N + cols, m, mask=im[:, None] & (cols < N))


def build_tree_fused(
    lp: torch.Tensor, ids: torch.Tensor, root_ids: torch.Tensor, budget: int, out: TreeBuffers
) -> TreeBuffers:
    """build_tree's result in one launch (shapes that `fits`); `out` as for build_tree, required."""
    bs, L, K = lp.shape
    if out.shape != (bs, L, K, budget) or out.cand.device != lp.device:
        raise ValueError(
            f"buffers are for {out.shape} on {out.cand.device}, the call is {(bs, L, K, budget)}"
        )
    if not fits(L, K, budget):
        raise ValueError(
            f"(L, K, budget) = {(L, K, budget)} does not fit one program (`fits`): use build_tree"
        )
    lp, ids = lp.contiguous(), ids.contiguous()  # no-ops for the worker's
    W, N = budget, budget + 1
    blocks, NP = _blocks(L, K, budget), _p2(N)
    t = out
    tree_kernel[(bs,)](
        lp, ids, root_ids, root_ids.stride(0),
        t.beam_score, t.beam_parent, t.beam_token, t.size, t.pre, t.sel, t.cand_order, t.t1, t.t2, t.t3,
        t.order, t.inv, t.input_ids, t.candidates, t.parents, t.depths, t.scores, t.mask, t.num_nodes,
        t.full_sorts,
        L=L, K=K, W=W, UB=max(blocks["LWP"], L * W + 2).bit_length(), NP=NP, RB=min(NP, max(1, 4096 // NP)),
        **blocks, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def build_draft_tree(
    lp: torch.Tensor, ids: torch.Tensor, root_ids: torch.Tensor, budget: int, out: TreeBuffers
) -> TreeBuffers:
    """The step's tree: the fused kernel on CUDA for shapes that `fits`, else build_tree (same values)."""
    _, L, K = lp.shape
    if lp.is_cuda and fits(L, K, budget):
        return build_tree_fused(lp, ids, root_ids, budget, out)
    return build_tree(lp, ids, root_ids, budget, out=out)


@triton.jit
def walk_kernel(
    parents_ptr,  # [bs, N] int64
    cands_ptr,  # [bs, N] int64
    target_ptr,  # [bs, N] int64
    path_ptr,  # [bs, L + 1] int64
    accepted_ptr,  # [bs]
    bonus_ptr,  # [bs]
    out_tokens_ptr,  # [bs, L + 1]
    perm_ptr,  # [bs, N]
    rows_ptr,  # [bs, L + 1]
    live_ptr,  # [>= bs] int32: request b's tree is its first live[b] nodes (HAS_LIVE)
    scores_ptr,  # [bs, N] float32, the tree's scores (STATS)
    budgets_ptr,  # [C] int64, the budgets the statistics are for (STATS)
    stats_ptr,  # [bs, 2, C] float32: accepted and expected accepted at each budget (STATS)
    prefix_ptr,  # [bs] the prefix lengths (COMMIT, as are the rest)
    pool_rows_ptr,  # [bs] the requests' rows of req_to_token
    r2t_ptr,  # req_to_token [rows, cols]
    r2t_stride,
    draft_ids_ptr,  # [bs, N] the drafter's write ids of the window
    path_loc_ptr,  # [bs, L + 1] int64
    draft_pos_ptr,  # [bs, L + 1] int64
    commit_lens_ptr,  # [bs] int32
    new_lens_ptr,  # [bs] int64
    N: tl.constexpr,
    L: tl.constexpr,
    NP: tl.constexpr,
    LP: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    STATS: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    COMMIT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, NP)
    nm = n < N
    par = tl.load(parents_ptr + b * N + n, mask=nm, other=-2)
    cand = tl.load(cands_ptr + b * N + n, mask=nm, other=-1)
    if HAS_LIVE:  # nodes past the cut are not in the tree: unmatchable, as padding is
        cand = tl.where(n < tl.load(live_ptr + b).to(tl.int64), cand, -1)
    j = tl.arange(0, LP)
    cur = tl.zeros([], dtype=tl.int64)
    alive = tl.full([], 1, tl.int1)
    accepted = tl.zeros([], dtype=tl.int64)
    path = tl.zeros([LP], dtype=tl.int64)
    toks = tl.zeros([LP], dtype=tl.int64)
    pos = tl.where(n == 0, 0, -1).to(tl.int64)  # a path node's place in the new window order, else -1
    for d in range(1, L + 1):
        want = tl.load(target_ptr + b * N + cur)
        match = (par == cur) & (cand == want) & nm
        nxt = tl.min(tl.where(match, n, NP), 0).to(tl.int64)  # the first match, as argmax
        has = alive & (nxt < NP)
        cur = tl.where(has, nxt, cur)
        alive = has
        accepted += has.to(tl.int64)
        pos = tl.where(has & (n == cur), d, pos)
        path = tl.where(j == d, cur, path)
        toks = tl.where(j == d - 1, tl.load(cands_ptr + b * N + cur), toks)
    bonus = tl.load(target_ptr + b * N + cur)
    toks = tl.where(j == accepted, bonus, tl.where(j == L, 0, toks))
    jm = j < L + 1
    tl.store(path_ptr + b * (L + 1) + j, path, mask=jm)
    tl.store(rows_ptr + b * (L + 1) + j, path + b * N, mask=jm)
    tl.store(out_tokens_ptr + b * (L + 1) + j, toks, mask=jm)
    tl.store(accepted_ptr + b, accepted)
    tl.store(bonus_ptr + b, bonus)
    off = (pos < 0) & nm
    rest = tl.cumsum(off.to(tl.int64), 0) - off.to(tl.int64)  # off-path nodes before this one
    new_pos = tl.where(off, accepted + 1 + rest, pos)  # node n's slot moves to window position new_pos
    tl.store(perm_ptr + b * N + new_pos, n.to(tl.int64), mask=nm)
    if COMMIT:  # accept.commit_window
        prefix = tl.load(prefix_ptr + b).to(tl.int64)
        window = r2t_ptr + tl.load(pool_rows_ptr + b).to(tl.int64) * r2t_stride + prefix
        old = tl.load(window + n, mask=nm)
        tl.debug_barrier()  # every slot read before any is rewritten (the permutation is in place)
        tl.store(window + new_pos, old, mask=nm)
        loc = tl.load(draft_ids_ptr + b * N + path, mask=jm)
        tl.store(path_loc_ptr + b * (L + 1) + j, loc.to(tl.int64), mask=jm)
        tl.store(draft_pos_ptr + b * (L + 1) + j, prefix + j, mask=jm)
        tl.store(commit_lens_ptr + b, (accepted + 1).to(tl.int32))
        tl.store(new_lens_ptr + b, prefix + accepted + 1)
    if STATS:  # cut_stats: the path's nodes within each budget, and the tree's sum of exp(score) there
        c = tl.arange(0, CP)
        budget = tl.load(budgets_ptr + c, mask=c < C, other=0)
        on_path = (j >= 1) & (j <= accepted)
        within = (path[None, :] <= budget[:, None]) & on_path[None, :]
        acc_c = tl.sum(within.to(tl.float32), 1)
        sc = tl.load(scores_ptr + b * N + n, mask=nm & (n >= 1), other=float("-inf"))
        e = tl.exp(sc)
        e_c = tl.sum(tl.where(n[None, :] <= budget[:, None], e[None, :], 0.0), 1)
        tl.store(stats_ptr + b * 2 * C + c, acc_c, mask=c < C)
        tl.store(stats_ptr + b * 2 * C + C + c, e_c, mask=c < C)


def accept_walk(
    parents: torch.Tensor,
    candidates: torch.Tensor,
    target: torch.Tensor,
    L: int,
    out: AcceptBuffers,
    live: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    commit: WindowCommit | None = None,
) -> AcceptBuffers:
    """follow_tree, then out.perm = window_permutation and out.rows = path_rows: one launch on CUDA (or under
    Triton's interpreter), the torch forms elsewhere. live (int32, at least bs entries): request b's tree is its
    first live[b] nodes (DDTREE's cut). scores [bs, N]: also out.stats = cut_stats at out.budgets. commit: also
    commit_window (in the same launch)."""
    bs, N = parents.shape
    if out.shape != (bs, N, L):
        raise ValueError(f"AcceptBuffers are for (bs, N, L) = {out.shape}, the call is {(bs, N, L)}")
    if live is not None and (live.dtype != torch.int32 or live.numel() < bs):
        raise ValueError(
            f"live must be int32 with at least bs={bs} entries (got {live.dtype}, {live.numel()})"
        )
    stats = scores is not None and out.budgets.numel() > 0
    if parents.is_cuda or _interpreting():
        parents, candidates, target = parents.contiguous(), candidates.contiguous(), target.contiguous()
        o, C = out, out.budgets.numel()
        c = commit or WindowCommit(o.accepted, o.accepted, o.accepted, o.accepted)  # unread without COMMIT
        if commit is not None and (c.req_to_token.stride(1) != 1 or c.draft_ids.numel() != bs * N):
            raise ValueError("commit: req_to_token's rows must be contiguous and draft_ids hold bs * N ids")
        walk_kernel[(bs,)](
            parents, candidates, target, o.path, o.accepted, o.bonus, o.out_tokens, o.perm, o.rows,
            live if live is not None else o.accepted, scores.contiguous() if stats else o.stats, o.budgets, o.stats,
            c.prefix.contiguous(), c.req_pool_indices.contiguous(), c.req_to_token, c.req_to_token.stride(0), c.draft_ids.contiguous(),
            o.path_loc, o.draft_positions, o.commit_lens, o.new_seq_lens,
            N=N, L=L, NP=_p2(N), LP=_p2(L + 1), HAS_LIVE=live is not None, STATS=stats, C=max(C, 1),
            CP=_p2(max(C, 1)), COMMIT=commit is not None, num_warps=NUM_WARPS,
        )  # fmt: skip
        return out
    follow_tree(parents, candidates, target, L, out, live)
    out.perm.copy_(window_permutation(out))
    out.rows.copy_(path_rows(out))
    if stats:
        cut_stats(out, scores)
    if commit is not None:
        commit_window(out, commit)
    return out


@triton.jit
def verify_layout_kernel(
    mask_ptr,  # [bs, N, N] uint8, the ancestor masks
    depths_ptr,  # [bs, N] int64
    prefix_ptr,  # [bs] the prefix lengths
    buf_ptr,  # uint8, SGLang's custom-mask buffer
    positions_ptr,  # [bs, N] int64
    N: tl.constexpr,
    NP: tl.constexpr,
    BB: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64)  # the row (node) this program writes
    start = tl.zeros([], dtype=tl.int64)  # the earlier requests' N (prefix + N) entries
    for c0 in range(0, b, BB):
        c = c0 + tl.arange(0, BB)
        p = tl.load(prefix_ptr + c, mask=c < b, other=0).to(tl.int64)
        start += tl.sum(tl.where(c < b, N * (p + N), 0), 0)
    prefix = tl.load(prefix_ptr + b).to(tl.int64)
    j = tl.arange(0, NP)
    jm = j < N
    m = tl.load(mask_ptr + (b * N + i) * N + j, mask=jm)
    tl.store(buf_ptr + start + i * (prefix + N) + prefix + j, m, mask=jm)
    tl.store(positions_ptr + b * N + i, prefix + tl.load(depths_ptr + b * N + i))


def write_verify_layout(
    mask: torch.Tensor, depths: torch.Tensor, prefix: torch.Tensor, buf: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """tree.verify_layout (the verify's positions, and the ancestor masks into SGLang's custom-mask buffer): one
    launch on CUDA (or under Triton's interpreter), the torch form elsewhere. Returns positions [bs, N]."""
    bs, N = mask.shape[0], mask.shape[1]
    if not (mask.is_cuda or _interpreting()):
        return verify_layout(mask, depths, prefix, buf, positions)
    if not (mask.is_contiguous() and depths.is_contiguous() and positions.is_contiguous()):
        raise ValueError("write_verify_layout: mask, depths and positions must be contiguous")
    verify_layout_kernel[(bs, N)](
        mask.view(torch.uint8), depths, prefix.contiguous(), buf.view(torch.uint8).view(-1), positions,
        N=N, NP=_p2(N), BB=128, num_warps=1,
    )  # fmt: skip
    return positions


@triton.jit
def top1_kernel(
    logits_ptr,  # [rows, V], rows contiguous
    stride,  # elements between rows
    V,
    tokens_ptr,  # [rows] int64: each row's argmax (the first of equal maxima)
    lp_ptr,  # [rows] float32: its log-probability, max - logsumexp
    BV: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = logits_ptr + r * stride
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    idx = tl.zeros([], dtype=tl.int64)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        x = tl.load(row + v, mask=v < V, other=float("-inf")).to(tl.float32)
        bm = tl.max(x, 0)
        bi = tl.argmax(x, 0, tie_break_left=True)
        new_m = tl.maximum(m, bm)
        ref = tl.where(new_m == float("-inf"), 0.0, new_m)  # all -inf so far: exp(-inf - 0) = 0, not exp(NaN)
        s = s * tl.exp(m - ref) + tl.sum(tl.exp(x - ref), 0)
        idx = tl.where(bm > m, v0 + bi.to(tl.int64), idx)  # strictly greater: an earlier block keeps a tie
        m = new_m
    tl.store(tokens_ptr + r, idx)
    tl.store(lp_ptr + r, -tl.log(s))  # x_max - (x_max + log s)


@triton.jit
def chain_expected_kernel(lp_ptr, out_ptr, L: tl.constexpr, LP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, LP)
    lp = tl.load(lp_ptr + b * L + j, mask=j < L, other=0.0)
    e = tl.where(j < L, tl.exp(tl.cumsum(lp, 0)), 0.0)
    tl.store(out_ptr + b, tl.sum(e, 0))


def chain_head(logits: torch.Tensor, tokens: torch.Tensor, lp: torch.Tensor, expected: torch.Tensor) -> None:
    """The chain from the drafter's logits [bs * L, V] (rows contiguous; no NaN, -inf allowed): tokens [bs, L] int64,
    each depth's argmax (the first of equal logits, as torch.argmax), lp [bs, L] float32 its log-probability, and
    expected [bs] float32, E_chain (`kdtree.ddtree.tree.chain_expected`). Two launches on CUDA (or under Triton's
    interpreter), torch ops elsewhere; the outputs are written in place."""
    bs, L = tokens.shape
    if logits.dim() != 2 or logits.shape[0] != bs * L or logits.stride(1) != 1:
        raise ValueError(f"chain_head: logits must be [bs * L, V] = [{bs * L}, V] with contiguous rows")
    if not (tokens.is_contiguous() and lp.is_contiguous() and tokens.dtype == torch.int64):
        raise ValueError("chain_head: tokens (int64) and lp must be contiguous")
    if not (logits.is_cuda or _interpreting()):
        x = logits.float()
        tokens.copy_(torch.argmax(x, -1).view(bs, L))
        lp.copy_((x.gather(1, tokens.view(-1, 1)).squeeze(1) - torch.logsumexp(x, -1)).view(bs, L))
        expected.copy_(chain_expected(lp))
        return
    V = logits.shape[1]
    top1_kernel[(bs * L,)](
        logits, logits.stride(0), V, tokens, lp, BV=min(4096, triton.next_power_of_2(V)), num_warps=8
    )  # fmt: skip
    chain_expected_kernel[(bs,)](lp, expected, L=L, LP=_p2(L), num_warps=1)


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)
