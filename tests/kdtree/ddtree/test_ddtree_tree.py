"""The DDTree builder: the fixed-shape torch form (kdtree.ddtree.tree) against the heap reference of Algorithm 1
(kdtree.ddtree.reference), which is itself checked against brute force; and the acceptance walk."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from kdtree.ddtree.reference import build_ddtree_tree, f32, follow_verified_tree


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="the fixed-shape builder needs torch (the server extra)")


def random_lp(rng: random.Random, L: int, K: int, ties: bool, absent: float = 0.0) -> list[list[float]]:
    """Per-depth log-probs sorted descending: float32 values, or quarters (many exact ties, also across
    depths); `absent` is the chance that a depth's tail from some rank on is -inf."""
    rows = []
    for _ in range(L):
        row = sorted(
            (-rng.randint(0, 6) / 4 if ties else f32(math.log(rng.random() + 1e-9)) for _ in range(K)),
            reverse=True,
        )
        if rng.random() < absent:
            cut = rng.randint(0, K)
            row = row[:cut] + [-math.inf] * (K - cut)
        rows.append(row)
    return rows


def brute_force(lp, budget):
    """Every prefix with its float32 score, sorted by the key (-score, rank tuple), the first `budget`."""
    L, K = len(lp), len(lp[0])
    keyed = []
    for d in range(1, L + 1):
        for ranks in itertools.product(range(K), repeat=d):
            s = 0.0
            for i, r in enumerate(ranks):
                s = f32(s + lp[i][r])
            if s > -math.inf:
                keyed.append((-s, ranks))
    return [r for _, r in sorted(keyed)[:budget]]


def check_tree_shape(parents, depths, n_real):
    """Parents first, prefix-closed (a real node's parent is the root or a real node), depth = parent's + 1."""
    for i in range(1, n_real + 1):
        assert 0 <= parents[i] < i
        assert depths[i] == depths[parents[i]] + 1


def build_both(torch, lp_rows, ids_rows, budget, out=None):
    lp = torch.tensor(lp_rows, dtype=torch.float32)
    ids = torch.tensor(ids_rows, dtype=torch.int64)
    roots = torch.arange(1000, 1000 + len(lp_rows), dtype=torch.int64)
    got = build_tree_fn(torch)(lp, ids, roots, budget, out=out)
    refs = [
        build_ddtree_tree(lp_rows[b], ids_rows[b], budget, root_token=1000 + b) for b in range(len(lp_rows))
    ]
    return got, refs


def build_tree_fn(torch):
    from kdtree.ddtree.tree import build_tree

    return build_tree


def assert_matches(got, refs, budget):
    N = budget + 1
    for b, ref in enumerate(refs):
        n = len(ref.tokens) - 1
        pads = budget - n
        assert got.num_nodes[b].item() == n
        assert got.candidates[b].tolist() == ref.tokens + [-1] * pads
        assert got.input_ids[b].tolist() == ref.tokens + [0] * pads
        assert got.parents[b].tolist() == ref.parents + [0] * pads
        assert got.depths[b].tolist() == ref.depths + [1] * pads
        assert got.scores[b].tolist() == ref.scores + [-math.inf] * pads  # exact: same float32 sums
        check_tree_shape(got.parents[b].tolist(), got.depths[b].tolist(), n)
        mask = got.mask[b].tolist()
        for i in range(N):
            expect = {i}
            j = i
            while j > 0:
                j = got.parents[b, j].item() if j <= n else 0
                expect.add(j)
            assert {k for k in range(N) if mask[i][k]} == expect, f"request {b} row {i}"


# --- the reference itself


@pytest.mark.parametrize("ties", [False, True])
def test_reference_heap_equals_brute_force(ties):
    rng = random.Random(7 if ties else 8)
    for _ in range(150):
        L, K = rng.randint(1, 4), rng.randint(1, 4)
        lp = random_lp(rng, L, K, ties, absent=0.2)
        budget = rng.randint(1, 30)
        tree = build_ddtree_tree(lp, [list(range(K))] * L, budget)
        assert tree.ranks[1:] == brute_force(lp, budget)
        check_tree_shape(tree.parents, tree.depths, len(tree.tokens) - 1)


def test_reference_breaks_exact_ties_lexicographically():
    # all scores 0: key order is the rank tuples' lexicographic order, a prefix before its extensions
    tree = build_ddtree_tree([[0.0, 0.0]] * 3, [[10, 11]] * 3, budget=6)
    assert tree.ranks[1:] == [(0,), (0, 0), (0, 0, 0), (0, 0, 1), (0, 1), (0, 1, 0)]
    assert tree.parents == [-1, 0, 1, 2, 2, 1, 5]


def test_reference_refuses_unsorted_or_ragged_input():
    with pytest.raises(ValueError, match="sorted descending"):
        build_ddtree_tree([[-1.0, -0.5]], [[1, 2]], 2)
    with pytest.raises(ValueError, match="same K"):
        build_ddtree_tree([[-1.0, -2.0], [-1.0]], [[1, 2], [3]], 2)


# --- the acceptance walk


def test_walk_descends_on_matching_children_and_returns_the_bonus():
    #        0
    #      /   \
    #   1(a=5)  2(b=6)
    #   /   \      \
    # 3(7)  4(8)   5(9)
    parents, tokens = [-1, 0, 0, 1, 1, 2], [100, 5, 6, 7, 8, 9]
    assert follow_verified_tree(parents, tokens, [6, 0, 9, 0, 0, 42]) == ([0, 2, 5], 42)
    assert follow_verified_tree(parents, tokens, [5, 8, 0, 0, 3, 0]) == ([0, 1, 4], 3)
    assert follow_verified_tree(parents, tokens, [4, 0, 0, 0, 0, 0]) == ([0], 4)  # no child matches
    assert follow_verified_tree(parents, tokens, [5, 9, 0, 0, 0, 0]) == ([0, 1], 9)  # 9 is a cousin's token


def test_walk_never_matches_a_padding_node():
    parents, tokens = [-1, 0, 0, 0], [100, 5, -1, -1]
    assert follow_verified_tree(parents, tokens, [-1, 0, 0, 0]) == ([0], -1)
    assert follow_verified_tree(parents, tokens, [5, 7, 0, 0]) == ([0, 1], 7)


# --- the fixed-shape builder against the reference


@pytest.mark.parametrize("ties", [False, True], ids=["float32", "quantized-ties"])
def test_builder_matches_the_reference_on_random_log_probs(torch, ties):
    rng = random.Random(11 if ties else 12)
    for _ in range(120):
        bs, L, K = rng.randint(1, 3), rng.randint(1, 6), rng.randint(1, 8)
        budget = rng.randint(1, 40)  # often above K (K < budget) and above L * K (padding)
        lp = [random_lp(rng, L, K, ties, absent=0.15) for _ in range(bs)]
        ids = [[rng.sample(range(50), K) for _ in range(L)] for _ in range(bs)]
        got, refs = build_both(torch, lp, ids, budget)
        assert_matches(got, refs, budget)


def test_builder_with_all_scores_tied_takes_lexicographic_order(torch):
    got, refs = build_both(torch, [[[0.0, 0.0]] * 3], [[[10, 11]] * 3], budget=6)
    assert refs[0].ranks[1:] == [(0,), (0, 0), (0, 0, 0), (0, 0, 1), (0, 1), (0, 1, 0)]
    assert_matches(got, refs, 6)


def test_ties_across_depths_follow_rank_tuples_not_depth(torch):
    # (1,) and (0, 0) both score -1: (0, 0) is lexicographically smaller, so it wins the last place
    lp, ids = [[[0.0, -1.0], [-1.0, -2.0]]], [[[1, 2], [3, 4]]]
    got, refs = build_both(torch, lp, ids, budget=2)
    assert refs[0].ranks[1:] == [(0,), (0, 0)]
    assert_matches(got, refs, 2)


def test_budget_above_the_reachable_nodes_pads(torch):
    lp = [[[-0.1, -0.2], [-0.3, -0.4]], [[-0.5, -math.inf], [-0.1, -math.inf]]]
    ids = [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]
    got, refs = build_both(torch, lp, ids, budget=9)
    assert [len(r.tokens) - 1 for r in refs] == [6, 2]  # L*K = 2 + 4 prefixes; only one chain in request 1
    assert got.num_nodes.tolist() == [6, 2]
    assert got.mask[1, 5].tolist() == [True, False, False, False, False, True, False, False, False, False]
    assert_matches(got, refs, 9)


def test_one_depth_is_the_top_budget_of_that_depth(torch):
    lp, ids = [[[-0.1, -0.2, -0.2, -0.9]]], [[[4, 3, 2, 1]]]
    got, refs = build_both(torch, lp, ids, budget=3)
    assert got.candidates[0].tolist() == [1000, 4, 3, 2]
    assert got.parents[0].tolist() == [-1, 0, 0, 0]
    assert_matches(got, refs, 3)


def test_requests_get_their_own_trees_and_reused_buffers_hold_no_stale_state(torch):
    from kdtree.ddtree.tree import TreeBuffers

    rng = random.Random(3)
    bs, L, K, budget = 4, 5, 6, 24
    out = TreeBuffers(bs, L, K, budget)
    trees = []
    for ties in (True, False, True):
        lp = [random_lp(rng, L, K, ties, absent=0.3) for _ in range(bs)]
        ids = [[rng.sample(range(100), K) for _ in range(L)] for _ in range(bs)]
        got, refs = build_both(torch, lp, ids, budget, out=out)
        assert got is out
        assert_matches(got, refs, budget)
        trees.append(got.parents.tolist())
    assert len({str(t) for t in trees[0]}) > 1  # the requests' trees differ


def test_builder_refuses_wrong_inputs_and_mismatched_buffers(torch):
    from kdtree.ddtree.tree import TreeBuffers, build_tree

    lp, ids, roots = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.int64), torch.zeros(2).long()
    with pytest.raises(ValueError, match="lp must be float32"):
        build_tree(lp.double(), ids, roots, 5)
    with pytest.raises(ValueError, match="ids must be int64"):
        build_tree(lp, ids.int(), roots, 5)
    with pytest.raises(ValueError, match="root_ids must be int64"):
        build_tree(lp, ids, roots[:1], 5)
    with pytest.raises(ValueError, match="make TreeBuffers for this shape"):
        build_tree(lp, ids, roots, 5, out=TreeBuffers(2, 3, 4, 6))
    with pytest.raises(ValueError, match="budget must be >= 1"):
        TreeBuffers(2, 3, 4, 0)


def test_a_call_is_one_fixed_sequence_of_out_in_place_and_view_ops(torch):
    """What a CUDA graph needs, seen at the op level: the same ops whatever the data, none that reads a value
    back to the host (item, nonzero, masked_select), and none that returns a new tensor: each writes into the
    buffers (out= or in place) or is a view."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kdtree.ddtree.tree import TreeBuffers, build_tree

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    rng = random.Random(5)
    bs, L, K, budget = 3, 5, 4, 30
    out = TreeBuffers(bs, L, K, budget)
    sequences = []
    for ties, absent in ((True, 0.0), (False, 0.5)):
        lp = torch.tensor([random_lp(rng, L, K, ties, absent) for _ in range(bs)], dtype=torch.float32)
        ids = torch.randint(0, 100, (bs, L, K))
        roots = torch.zeros(bs, dtype=torch.int64)
        with Record() as record:
            build_tree(lp, ids, roots, budget, out=out)
        sequences.append([str(op) for op in record.ops])
        views = {"select", "slice", "view", "expand", "unsqueeze"}
        for op in record.ops:
            name, overload = op.overloadpacket.__name__, op._overloadname
            writes_buffers = name.endswith("_") or "out" in overload or overload.startswith("values")
            assert writes_buffers or name in views, f"{op} returns a new tensor"
    assert sequences[0] == sequences[1]
    assert not {"aten._local_scalar_dense.default", "aten.nonzero.default"} & set(sequences[0])
