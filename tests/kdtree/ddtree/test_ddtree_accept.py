"""DDTree's fixed-shape acceptance walk and commit permutation (kdtree.ddtree.accept) against the reference walk
(kdtree.ddtree.reference.follow_verified_tree), on trees from the fixed-shape builder (CPU)."""

from __future__ import annotations

import random

import pytest

from kdtree.ddtree.reference import follow_verified_tree

torch = pytest.importorskip("torch", reason="the fixed-shape walk needs torch (the server extra)")

from kdtree.ddtree.accept import (  # noqa: E402
    AcceptBuffers,
    WindowCommit,
    commit_window,
    cut_stats,
    follow_tree,
    window_permutation,
)
from kdtree.ddtree.tree import build_tree  # noqa: E402


def random_trees(seed: int, bs: int, L: int, K: int, budget: int):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(bs, L, K * 3, generator=g), -1)[..., :K]
    lp, _ = torch.sort(lp, dim=-1, descending=True)
    ids = torch.stack([torch.randperm(50, generator=g)[:K] for _ in range(bs * L)]).view(bs, L, K)
    return build_tree(lp, ids, torch.arange(bs, dtype=torch.int64) + 100, budget)


def following_targets(tree, L: int, seed: int, rng: random.Random):
    """[bs, N] targets that follow the tree for a while, then leave it (and some that never enter it)."""
    bs, N = tree.parents.shape
    target = torch.randint(0, 50, (bs, N), generator=torch.Generator().manual_seed(seed + 7))
    for b in range(bs):
        node = 0
        for _ in range(rng.randint(0, L)):
            kids = [i for i in range(1, N) if tree.parents[b, i] == node and tree.candidates[b, i] >= 0]
            if not kids:
                break
            node = rng.choice(kids)
            target[b, tree.parents[b, node]] = tree.candidates[b, node]
    return target


@pytest.mark.parametrize(
    "seed, bs, L, K, budget", [(0, 4, 3, 2, 5), (1, 8, 7, 4, 16), (2, 6, 15, 8, 32), (3, 3, 2, 1, 9)]
)
def test_the_walk_and_the_commit_match_the_reference_walk(seed, bs, L, K, budget):
    tree = random_trees(seed, bs, L, K, budget)
    N = budget + 1
    rng = random.Random(seed)
    target = following_targets(tree, L, seed, rng)
    out = follow_tree(tree.parents, tree.candidates, target, L, AcceptBuffers(bs, N, L))
    perm = window_permutation(out)
    seen_lengths = set()
    for b in range(bs):
        path, bonus = follow_verified_tree(
            tree.parents[b].tolist(), tree.candidates[b].tolist(), target[b].tolist()
        )
        a = len(path) - 1
        seen_lengths.add(a)
        assert out.accepted[b].item() == a
        assert out.path[b, : a + 1].tolist() == path
        assert out.bonus[b].item() == bonus
        assert out.out_tokens[b, : a + 1].tolist() == [tree.candidates[b, i].item() for i in path[1:]] + [
            bonus
        ]
        # the commit: the path's slots first, in path order; the window keeps every slot once
        assert perm[b, : a + 1].tolist() == path
        assert sorted(perm[b].tolist()) == list(range(N))
        assert [d.item() for d in tree.depths[b, path]] == list(
            range(a + 1)
        )  # positions prefix + j hold depth j
    assert len(seen_lengths) > 1  # the targets exercise different accepted lengths


def commit_case(seed: int, bs: int, L: int, K: int, budget: int):
    """A walked batch and what its commit reads: prefixes of different lengths, the requests in rows of a
    req_to_token table in another order (a row no request owns among them), distinct slot ids everywhere."""
    tree = random_trees(seed, bs, L, K, budget)
    N = budget + 1
    target = following_targets(tree, L, seed, random.Random(seed))
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 40, (bs,), generator=g)
    rows = torch.randperm(bs + 1, generator=g)[:bs].to(torch.int32)
    table = torch.randperm((bs + 1) * (40 + N + 5), generator=g).to(torch.int32).view(bs + 1, -1)
    draft_ids = torch.randperm(10 * bs * N, generator=g)[: bs * N]
    return tree, target, WindowCommit(prefix, rows, table, draft_ids)


def reference_commit(out: AcceptBuffers, c: WindowCommit):
    """The commit as a loop: (table, path_loc, draft_positions, commit_lens, new_seq_lens)."""
    bs, N, L = out.shape
    perm, table = window_permutation(out), c.req_to_token.clone()
    ids = c.draft_ids.view(bs, N)
    loc, pos = [], []
    for b in range(bs):
        r, p = int(c.req_pool_indices[b]), int(c.prefix[b])
        window = table[r, p : p + N].clone()
        table[r, p : p + N] = window[perm[b]]
        loc.append([int(ids[b, i]) for i in out.path[b]])
        pos.append([p + j for j in range(L + 1)])
    return table, loc, pos, (out.accepted + 1).tolist(), (c.prefix + out.accepted + 1).tolist()


@pytest.mark.parametrize("seed, bs, L, K, budget", [(0, 4, 3, 2, 5), (1, 8, 7, 4, 16), (3, 3, 2, 1, 9)])
def test_the_commit_moves_the_paths_slots_to_the_windows_front_and_nothing_else(seed, bs, L, K, budget):
    tree, target, c = commit_case(seed, bs, L, K, budget)
    out = follow_tree(tree.parents, tree.candidates, target, L, AcceptBuffers(bs, budget + 1, L))
    table, loc, pos, lens, new = reference_commit(out, c)
    out.perm.copy_(window_permutation(out))  # the walk's (accept_walk writes it)
    commit_window(out, c)
    assert torch.equal(c.req_to_token, table)
    assert out.path_loc.tolist() == loc and out.draft_positions.tolist() == pos
    assert out.commit_lens.tolist() == lens and out.new_seq_lens.tolist() == new
    assert len(set(lens)) > 1


def test_a_target_that_leaves_at_the_root_accepts_nothing_and_gives_its_bonus():
    tree = random_trees(5, 2, 4, 3, 8)
    target = torch.full((2, 9), 49, dtype=torch.int64)
    target[:, 0] = -5  # no candidate is negative but padding (-1): nothing matches
    out = follow_tree(tree.parents, tree.candidates, target, 4, AcceptBuffers(2, 9, 4))
    assert out.accepted.tolist() == [0, 0]
    assert out.bonus.tolist() == [-5, -5]
    assert out.out_tokens[:, 0].tolist() == [-5, -5]
    assert window_permutation(out).tolist() == [list(range(9))] * 2


def test_the_logprobs_sglang_computes_from_the_path_rows_are_those_of_the_emitted_tokens():
    """SGLang's compute_spec_logprobs (its real function; the batch is a stand-in with the four fields it reads)
    with accept_index = path_rows: the logprob of emitted token j of request b is the target's at the node it came
    from, the j-th node of the accepted path."""
    pytest.importorskip("sglang", reason="sglang==0.5.23 is not installed (the server extra)")
    from types import SimpleNamespace

    from sglang.srt.layers.logprob_processor import compute_spec_logprobs

    from kdtree.ddtree.accept import path_rows

    bs, L, K, budget, V = 3, 4, 3, 9, 50
    tree = random_trees(11, bs, L, K, budget)
    N = budget + 1
    logits = torch.randn(bs * N, V, generator=torch.Generator().manual_seed(3))
    target = torch.argmax(logits, -1).view(bs, N)
    for b in range(bs):  # make the target follow the tree for a step or two
        kids = [i for i in range(1, N) if tree.parents[b, i] == 0 and tree.candidates[b, i] >= 0]
        logits[b * N, tree.candidates[b, kids[0]]] = 100.0
        target[b, 0] = tree.candidates[b, kids[0]]
    out = follow_tree(tree.parents, tree.candidates, target, L, AcceptBuffers(bs, N, L))
    batch = SimpleNamespace(
        seq_lens=torch.zeros(bs),
        sampling_info=SimpleNamespace(is_all_greedy=True),
        top_logprobs_nums=None,
        token_ids_logprobs=None,
    )
    logits_output = SimpleNamespace(next_token_logits=logits)
    compute_spec_logprobs(batch, logits_output, target.reshape(-1), accept_index=path_rows(out))
    got = logits_output.next_token_logprobs
    assert got.shape == (bs, L + 1)
    for b in range(bs):
        a = out.accepted[b].item()
        assert a >= 1
        for j in range(a + 1):
            row = b * N + out.path[b, j].item()
            want = torch.log_softmax(logits[row], -1)[out.out_tokens[b, j]]
            assert torch.isclose(got[b, j], want), (b, j)


@pytest.mark.parametrize("seed, bs, L, K, cap", [(0, 6, 7, 6, 24), (1, 8, 15, 4, 16), (2, 5, 3, 2, 40)])
def test_the_cut_walks_the_tree_of_the_smaller_budget(seed, bs, L, K, cap):
    """DDTREE's auto budget: the tree of budget b is the first b + 1 nodes of the tree of the cap (node for node, the
    scores included), the walk of the cap's tree cut at b is the walk of the tree of b, and cut_stats of one walk at
    the cap gives, for every b, the accepted length of the walk at b and the tree of b's sum of exp(score)."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(bs, L, K * 2, generator=g), -1)[..., :K]
    lp, _ = torch.sort(lp, dim=-1, descending=True)
    ids = torch.stack([torch.randperm(50, generator=g)[:K] for _ in range(bs * L)]).view(bs, L, K)
    root = torch.arange(bs, dtype=torch.int64) + 100
    full = build_tree(lp, ids, root, cap)
    N = cap + 1
    budgets = tuple(b for b in (1, 2, 4, 8, 16, 32) if b < cap) + (cap,)
    rng = random.Random(seed)
    target = following_targets(full, L, seed, rng)
    whole = follow_tree(full.parents, full.candidates, target, L, AcceptBuffers(bs, N, L, budgets=budgets))
    stats = cut_stats(whole, full.scores)
    assert len(set(whole.accepted.tolist())) > 1
    for c, b in enumerate(budgets):
        small = build_tree(lp[..., : min(K, b)], ids[..., : min(K, b)], root, b)
        for name in ("candidates", "parents", "depths", "scores"):
            assert torch.equal(getattr(small, name), getattr(full, name)[:, : b + 1]), (b, name)
        live = torch.full((bs,), b + 1, dtype=torch.int32)
        cut = follow_tree(full.parents, full.candidates, target, L, AcceptBuffers(bs, N, L), live)
        alone = follow_tree(
            small.parents, small.candidates, target[:, : b + 1], L, AcceptBuffers(bs, b + 1, L)
        )
        for name in ("accepted", "bonus", "path", "out_tokens"):
            assert torch.equal(getattr(cut, name), getattr(alone, name)), (b, name)
        assert stats[:, 0, c].tolist() == cut.accepted.float().tolist()
        want_e = small.scores[:, 1:].exp().sum(-1)
        assert torch.allclose(stats[:, 1, c], want_e, rtol=1e-6)
