"""DDTree's fused kernels (kdtree.ddtree.fused) on CUDA at the worker's shapes (K = budget, L = block - 1): the
tree equals build_tree's and the walk equals follow_tree/window_permutation/path_rows, value for value; both run
with no host synchronisation and replay in a CUDA graph on new inputs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the server extra)")
pytest.importorskip("triton", reason="triton is not installed (the server extra)")

from kdtree.bench import capture_graph  # noqa: E402
from kdtree.ddtree.accept import AcceptBuffers, follow_tree, path_rows, window_permutation  # noqa: E402
from kdtree.ddtree.fused import accept_walk, build_draft_tree, build_tree_fused, fits  # noqa: E402
from kdtree.ddtree.tree import TreeBuffers, build_tree  # noqa: E402

pytestmark = pytest.mark.gpu

TREE_FIELDS = ("input_ids", "candidates", "parents", "depths", "scores", "mask", "num_nodes")
BUDGETS = [8, 16, 32, 64, 128, 256]
SHAPES = [(bs, block - 1, budget) for bs in (1, 4) for block in (8, 16) for budget in BUDGETS]


def fill_inputs(g, lp, ids, kind: str):
    """Top-K log-probs as the drafter gives them (sorted descending), written into lp/ids in place: 'real'
    (log_softmax of random logits), 'ties' (rounded to quarters: many exact ties), 'absent' (-inf tails)."""
    bs, L, K = lp.shape
    logits = torch.randn(bs, L, 4 * K + 8, generator=g, device=lp.device) * 3
    x = torch.log_softmax(logits, -1)
    top, idx = torch.topk(x, K, dim=-1)
    if kind == "ties":
        top = torch.round(top * 4) / 4
    if kind == "absent":
        cut = torch.randint(0, K + 1, (bs, L, 1), generator=g, device=lp.device)
        top = torch.where(torch.arange(K, device=lp.device) >= cut, float("-inf"), top)
    top, order = torch.sort(top, dim=-1, descending=True, stable=True)
    lp.copy_(top)
    ids.copy_(torch.gather(idx, 2, order) + 7)


def assert_same_tree(got: TreeBuffers, want: TreeBuffers):
    for name in TREE_FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def random_targets(g, tree: TreeBuffers, follow: float = 0.85):
    """[bs, N]: at each node the token of one of its children (so the walk descends), else (below the root, with
    probability 1 - follow) a random token."""
    bs, N = tree.parents.shape
    target = torch.randint(0, 1000, (bs, N), generator=g, device=tree.parents.device)
    real = tree.candidates[:, 1:] >= 0
    parent = torch.where(real, tree.parents[:, 1:], 0)
    src = torch.where(real, tree.candidates[:, 1:], target.gather(1, parent))
    target.scatter_(1, parent, src)
    keep = torch.rand(bs, N, generator=g, device=target.device) < follow
    keep[:, 0] = True  # the root follows: every tree with a real node accepts at least one token
    return torch.where(keep, target, torch.randint(0, 1000, (bs, N), generator=g, device=target.device))


def checked_capture(step):
    """step() run once (it compiles), once more under torch's sync debug mode "error" (a host synchronisation fails
    the test), then captured: its graph and the memory allocated after the capture."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph, _, _ = capture_graph(step)
    return graph, torch.cuda.memory_allocated()


def assert_same_walk(tree: TreeBuffers, target, L: int):
    bs, N = tree.parents.shape
    want = follow_tree(tree.parents, tree.candidates, target, L, AcceptBuffers(bs, N, L, "cuda"))
    got = accept_walk(tree.parents, tree.candidates, target, L, AcceptBuffers(bs, N, L, "cuda"))
    for name in ("path", "accepted", "bonus", "out_tokens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.perm, window_permutation(want))
    assert torch.equal(got.rows, path_rows(want))
    return got


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "bs{}-L{}-budget{}".format(*s))
def test_fused_tree_and_walk_equal_the_torch_forms_at_the_worker_shapes(shape):
    bs, L, budget = shape
    K = budget
    g = torch.Generator(device="cuda").manual_seed(bs * 1000 + L * 10 + budget)
    lp = torch.empty(bs, L, K, device="cuda")
    ids = torch.empty(bs, L, K, dtype=torch.int64, device="cuda")
    roots = torch.arange(5, 5 + bs, dtype=torch.int64, device="cuda")
    out = TreeBuffers(bs, L, K, budget, "cuda")
    accepted = []
    for kind in ("real", "ties", "absent"):
        fill_inputs(g, lp, ids, kind)
        want = build_tree(lp, ids, roots, budget)
        got = build_draft_tree(lp, ids, roots, budget, out)
        assert_same_tree(got, want)
        if fits(L, K, budget):  # the kernel itself (build_draft_tree took it)
            out.mask.zero_()
            assert_same_tree(build_tree_fused(lp, ids, roots, budget, out), want)
        accepted += assert_same_walk(got, random_targets(g, got), L).accepted.tolist()
    assert max(accepted) >= 1  # the targets follow the tree


@pytest.mark.parametrize("bs, L, budget", [(1, 15, 32), (4, 15, 64), (4, 7, 16), (2, 15, 128)])
def test_fused_stages_sync_never_and_replay_in_a_cuda_graph(bs, L, budget):
    K, N = budget, budget + 1
    g = torch.Generator(device="cuda").manual_seed(budget + bs)
    lp = torch.empty(bs, L, K, device="cuda")
    ids = torch.empty(bs, L, K, dtype=torch.int64, device="cuda")
    block = torch.zeros(
        bs, 16, dtype=torch.int64, device="cuda"
    )  # roots: a column, as the worker's draft block
    block[:, 0] = torch.arange(5, 5 + bs, device="cuda")
    roots = block[:, 0]
    target = torch.zeros(bs, N, dtype=torch.int64, device="cuda")
    tree = TreeBuffers(bs, L, K, budget, "cuda")
    acc = AcceptBuffers(bs, N, L, "cuda")

    def step():
        build_draft_tree(lp, ids, roots, budget, tree)
        accept_walk(tree.parents, tree.candidates, target, L, acc)

    fill_inputs(g, lp, ids, "real")
    graph, allocated = checked_capture(step)
    for i, kind in enumerate(("real", "ties", "absent", "real")):
        fill_inputs(g, lp, ids, kind)
        want_tree = build_tree(lp, ids, roots, budget)
        target.copy_(random_targets(g, want_tree))
        graph.replay()
        torch.cuda.synchronize()
        assert_same_tree(tree, want_tree)
        want = follow_tree(
            want_tree.parents, want_tree.candidates, target, L, AcceptBuffers(bs, N, L, "cuda")
        )
        for name in ("path", "accepted", "bonus", "out_tokens"):
            assert torch.equal(getattr(acc, name), getattr(want, name)), (i, name)
        assert torch.equal(acc.perm, window_permutation(want))
        assert torch.equal(acc.rows, path_rows(want))
    del want_tree, want
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= allocated


@pytest.mark.parametrize(
    "shape", [(4, 15, 32), (4, 15, 128), (1, 7, 256)], ids=lambda s: "bs{}-L{}-budget{}".format(*s)
)
def test_the_cut_walk_and_its_statistics_equal_the_torch_forms_and_replay_in_a_graph(shape):
    """DDTREE's auto budget on CUDA: the walk of each request's first live[b] nodes and cut_stats, from one launch,
    equal follow_tree with the same cut and the torch cut_stats; captured once, a replay reads new cuts."""
    from kdtree.ddtree.accept import cut_stats
    from kdtree.ddtree.budget import cut_budgets

    bs, L, budget = shape
    N, budgets = budget + 1, cut_budgets(budget)
    g = torch.Generator(device="cuda").manual_seed(budget)
    lp = torch.empty(bs, L, budget, device="cuda")
    ids = torch.empty(bs, L, budget, dtype=torch.int64, device="cuda")
    fill_inputs(g, lp, ids, "real")
    tree = build_tree(lp, ids, torch.arange(bs, device="cuda") + 3, budget)
    target = random_targets(g, tree, follow=0.95)
    live = torch.zeros(bs, dtype=torch.int32, device="cuda")
    got = AcceptBuffers(bs, N, L, "cuda", budgets)
    graph, _, _ = capture_graph(
        lambda: accept_walk(tree.parents, tree.candidates, target, L, got, live, tree.scores)
    )
    for cut in ([N] * bs, [5, 9, 17, 2][:bs], [1] * bs):
        live.copy_(torch.tensor(cut, dtype=torch.int32))
        graph.replay()
        want = follow_tree(
            tree.parents, tree.candidates, target, L, AcceptBuffers(bs, N, L, "cuda", budgets), live
        )
        for name in ("path", "accepted", "bonus", "out_tokens"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (cut, name)
        assert torch.equal(got.perm, window_permutation(want))
        assert torch.allclose(got.stats, cut_stats(want, tree.scores), rtol=1e-5), cut
        assert (got.accepted <= torch.tensor(cut, device="cuda") - 1).all()


@pytest.mark.parametrize("bs, L, budget", [(1, 15, 15), (4, 15, 32), (3, 7, 128)])
def test_the_verify_layout_and_the_walks_commit_equal_the_torch_forms_and_replay_in_a_graph(bs, L, budget):
    """The step's two other launches on CUDA: write_verify_layout (positions, and the masks into SGLang's layout)
    and accept_walk's commit (req_to_token's windows permuted, the drafter's path slots, the commit's lengths)
    equal tree.verify_layout and accept.commit_window; captured once, they replay on new prefixes and trees with no
    host synchronisation and no allocation."""
    from kdtree.ddtree.accept import WindowCommit, commit_window
    from kdtree.ddtree.fused import write_verify_layout
    from kdtree.ddtree.tree import verify_layout

    K, N = budget, budget + 1
    g = torch.Generator(device="cuda").manual_seed(budget + bs)
    lp = torch.empty(bs, L, K, device="cuda")
    ids = torch.empty(bs, L, K, dtype=torch.int64, device="cuda")
    roots = torch.arange(5, 5 + bs, device="cuda")
    tree = TreeBuffers(bs, L, K, budget, "cuda")
    target = torch.zeros(bs, N, dtype=torch.int64, device="cuda")
    prefix = torch.zeros(bs, dtype=torch.int64, device="cuda")
    most = 3000
    buf = torch.zeros(N * bs * (most + N), dtype=torch.uint8, device="cuda")
    positions = torch.zeros(bs, N, dtype=torch.int64, device="cuda")
    table = torch.zeros(bs + 2, most + N, dtype=torch.int32, device="cuda")
    c = WindowCommit(prefix, torch.arange(bs, 0, -1, dtype=torch.int64, device="cuda"), table,
                     torch.zeros(bs * N, dtype=torch.int64, device="cuda"))  # fmt: skip
    acc = AcceptBuffers(bs, N, L, "cuda")

    def step():
        build_draft_tree(lp, ids, roots, budget, tree)
        write_verify_layout(tree.mask, tree.depths, prefix, buf, positions)
        accept_walk(tree.parents, tree.candidates, target, L, acc, commit=c)

    def fill(i):
        fill_inputs(g, lp, ids, ("real", "ties", "absent")[i % 3])
        prefix.copy_(torch.randint(0, most, (bs,), generator=g, device="cuda"))
        table.copy_(torch.randperm(table.numel(), generator=g, device="cuda").view_as(table).to(torch.int32))
        c.draft_ids.copy_(torch.randperm(10 * bs * N, generator=g, device="cuda")[: bs * N])
        buf.fill_(7)

    fill(0)
    graph, allocated = checked_capture(step)
    for i in range(4):
        fill(i)
        want_tree = build_tree(lp, ids, roots, budget)
        target.copy_(random_targets(g, want_tree))
        want_buf, want_pos, want_table = buf.clone(), torch.zeros_like(positions), table.clone()
        verify_layout(want_tree.mask, want_tree.depths, prefix, want_buf, want_pos)
        want = follow_tree(
            want_tree.parents, want_tree.candidates, target, L, AcceptBuffers(bs, N, L, "cuda")
        )
        want.perm.copy_(window_permutation(want))
        commit_window(want, WindowCommit(prefix, c.req_pool_indices, want_table, c.draft_ids))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(buf, want_buf) and torch.equal(positions, want_pos), i
        assert torch.equal(table, want_table), i
        for name in ("path_loc", "draft_positions", "commit_lens", "new_seq_lens", "accepted"):
            assert torch.equal(getattr(acc, name), getattr(want, name)), (i, name)
    del want_tree, want, want_buf, want_pos, want_table
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= allocated


@pytest.mark.parametrize("bs, L, V", [(1, 15, 8192), (4, 15, 163840), (3, 7, 151936)])
def test_the_chain_head_equals_torch_syncs_never_and_replays_in_a_cuda_graph(bs, L, V):
    """chain_head (auto's split head: the chain from the logits) at Kimi-K2's and Qwen3's vocabularies: each depth's
    argmax (torch.argmax's, ties included), its log-probability and E_chain, in a graph replayed on new logits."""
    from kdtree.ddtree.fused import chain_head

    g = torch.Generator(device="cuda").manual_seed(V + bs)
    logits = torch.empty(bs * L, V, dtype=torch.bfloat16, device="cuda")
    tokens = torch.zeros(bs, L, dtype=torch.int64, device="cuda")
    lp = torch.zeros(bs, L, device="cuda")
    expected = torch.zeros(bs, device="cuda")

    def fill(ties: bool):
        x = torch.randn(bs * L, V, generator=g, device="cuda") * 3
        if ties:  # the max twice a row, far apart (different blocks of the kernel)
            x = torch.round(x * 4) / 4
            x[:, 5] = x[:, V - 3] = 40.0
            x[0, 6 : V // 2] = float(
                "-inf"
            )  # and masked tokens: whole blocks of -inf after the first maximum
            x[1, : V // 2] = float("-inf")  # a first block of -inf alone
        logits.copy_(x)

    fill(False)
    graph, allocated = checked_capture(lambda: chain_head(logits, tokens, lp, expected))
    for ties in (False, True, False):
        fill(ties)
        graph.replay()
        torch.cuda.synchronize()
        x = logits.float()
        want_lp = (x.max(-1).values - torch.logsumexp(x, -1)).view(bs, L)
        assert torch.equal(tokens.view(-1), torch.argmax(x, -1)), ties
        assert torch.isfinite(lp).all() and torch.isfinite(expected).all(), ties
        assert torch.allclose(lp, want_lp, atol=1e-4), ties
        assert torch.allclose(expected, torch.exp(torch.cumsum(want_lp, 1)).sum(1), rtol=1e-4), ties
    del x, want_lp
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= allocated
