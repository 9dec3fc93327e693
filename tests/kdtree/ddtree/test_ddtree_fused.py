"""The fused Triton kernels of DDTree (kdtree.ddtree.fused), run on CPU under Triton's interpreter: the tree kernel
writes exactly what build_tree writes (and so what the reference heap gives), the walk kernel exactly what
follow_tree, window_permutation and path_rows give. The interpreter is slow: small shapes, few cases.

Triton decides at import whether its functions (its own tl.sort among them) are interpreted, so these tests run in
a child pytest process started with TRITON_INTERPRET=1 (test_the_kernels_under_the_interpreter); in a process
without it they skip, saying so."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the fused kernels need torch (the server extra)")
pytest.importorskip("triton", reason="the fused kernels need triton (the server extra)")

from test_ddtree_accept import commit_case, following_targets, random_trees, reference_commit  # noqa: E402
from test_ddtree_tree import assert_matches, random_lp  # noqa: E402

from kdtree.ddtree.accept import AcceptBuffers, cut_stats, follow_tree, path_rows, window_permutation  # noqa: E402
from kdtree.ddtree.reference import build_ddtree_tree  # noqa: E402
from kdtree.ddtree.tree import TreeBuffers, build_tree, verify_layout  # noqa: E402

TREE_FIELDS = ("input_ids", "candidates", "parents", "depths", "scores", "mask", "num_nodes")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
REPO = Path(__file__).resolve().parents[3]


def test_the_kernels_under_the_interpreter():
    """The tests below, in a child process with TRITON_INTERPRET=1 set before Triton is imported."""
    if INTERPRETED:
        pytest.skip("this is the interpreted run itself")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


@pytest.fixture
def fused():
    if not INTERPRETED:
        pytest.skip("runs in test_the_kernels_under_the_interpreter's child process (TRITON_INTERPRET=1)")
    import kdtree.ddtree.fused as module

    return module


def check_tree(fused, lp_rows, ids_rows, budget, out=None):
    bs, L, K = len(lp_rows), len(lp_rows[0]), len(lp_rows[0][0])
    lp = torch.tensor(lp_rows, dtype=torch.float32)
    ids = torch.tensor(ids_rows, dtype=torch.int64)
    block = torch.zeros(
        bs, 3, dtype=torch.int64
    )  # the roots as a strided column, as the worker's draft block
    block[:, 0] = torch.arange(1000, 1000 + bs)
    roots = block[:, 0]
    out = out or TreeBuffers(bs, L, K, budget)
    got = fused.build_tree_fused(lp, ids, roots, budget, out)
    want = build_tree(lp, ids, roots, budget)
    for name in TREE_FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    refs = [build_ddtree_tree(lp_rows[b], ids_rows[b], budget, root_token=1000 + b) for b in range(bs)]
    assert_matches(got, refs, budget)
    return got


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fused_tree_is_build_trees_on_random_log_probs(fused, seed):
    """Ties (quarters), -inf tails, K below and above budget, budget above the reachable nodes, bs > 1; one
    buffer set reused across calls (no stale state)."""
    rng = random.Random(seed)
    bs, L, K, budget = 2, rng.randint(2, 4), rng.randint(2, 6), rng.randint(3, 24)
    out = TreeBuffers(bs, L, K, budget)
    for ties in (True, False):
        lp = [random_lp(rng, L, K, ties, absent=0.3) for _ in range(bs)]
        ids = [[rng.sample(range(50), K) for _ in range(L)] for _ in range(bs)]
        assert check_tree(fused, lp, ids, budget, out) is out


def test_the_fused_tree_pads_past_the_reachable_nodes_and_breaks_ties_by_rank(fused):
    lp = [[[-0.1, -0.2], [-0.3, -0.4]], [[-0.5, -math.inf], [-0.1, -math.inf]]]
    got = check_tree(fused, lp, [[[1, 2], [3, 4]], [[5, 6], [7, 8]]], budget=9)
    assert got.num_nodes.tolist() == [6, 2]
    got = check_tree(fused, [[[0.0, 0.0]] * 3], [[[10, 11]] * 3], budget=6)  # all tied: lexicographic
    assert got.parents[0].tolist() == [-1, 0, 1, 2, 2, 1, 5]
    check_tree(fused, [[[0.0, -1.0], [-1.0, -2.0]]], [[[1, 2], [3, 4]]], budget=2)  # a tie across depths


def test_the_fused_tree_takes_each_beam_from_the_pair_set_when_it_holds_it(fused):
    """Log-probs whose sums float32 holds exactly (multiples of 2^-10): every depth's beam comes from S, the
    (score rank i, rank r) pairs with (i + 1)(r + 1) <= budget, with no full sort; the tree is build_tree's."""
    rng = random.Random(7)
    for bs, L, K, budget in ((2, 4, 24, 24), (1, 3, 9, 20)):
        lp = [
            [sorted((-rng.randrange(8192) / 1024 for _ in range(K)), reverse=True) for _ in range(L)]
            for _ in range(bs)
        ]
        ids = [[rng.sample(range(100), K) for _ in range(L)] for _ in range(bs)]
        assert fused.pair_count(K, budget) < budget * K // 2
        got = check_tree(fused, lp, ids, budget)
        assert got.full_sorts.tolist() == [0] * bs


def test_the_fused_tree_sorts_a_depth_whole_when_a_rounding_tie_puts_its_beam_outside_the_pair_set(fused):
    """Parents whose scores differ by less than the rounding of their children's sums (depth 3's log-probs are
    large): children tie in float32, the lower slot goes first, and a higher-ranked parent's children no longer
    come first. The check sees the beam leave S and sorts that depth whole; the tree is still build_tree's."""
    lp = [[[-3e-08, -0.5, -0.5000000596046448, -1.5], [-3e-08, -0.5000000596046448, -1.0, -1.5], [-16.0] * 4]]
    got = check_tree(fused, lp, [[[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]], budget=7)
    assert got.full_sorts.tolist() == [1]


def test_the_fused_tree_sorts_large_candidate_sets_in_chunks_and_merges_them(fused, monkeypatch):
    """With a small SORT_BLOCK: several chunks merged (the path of candidate sets above SORT_BLOCK, which a raised
    FUSED_MAX_CANDIDATES sends to the kernel; tuning/ddtree_stages.py --max-candidates)."""
    monkeypatch.setattr(fused, "SORT_BLOCK", 128)
    rng = random.Random(4)
    for bs, L, K, budget in ((2, 3, 6, 20), (1, 2, 5, 12)):
        assert fused.fits(L, K, budget) and fused._blocks(L, K, budget)["NC"] > 1
        lp = [random_lp(rng, L, K, ties=True, absent=0.2) for _ in range(bs)]
        ids = [[rng.sample(range(50), K) for _ in range(L)] for _ in range(bs)]
        check_tree(fused, lp, ids, budget)


def test_fits_takes_the_worker_budgets_up_to_32_and_the_rest_goes_to_build_tree(fused):
    assert fused.fits(15, 32, 32) and fused.fits(7, 8, 8) and fused.fits(15, 16, 16)
    assert not fused.fits(15, 64, 64) and not fused.fits(15, 256, 256) and not fused.fits(7, 256, 256)
    lp = torch.zeros(1, 15, 256)
    with pytest.raises(ValueError, match="does not fit one program"):
        fused.build_tree_fused(lp, lp.long(), torch.zeros(1).long(), 256, TreeBuffers(1, 15, 256, 256))
    # CPU tensors (not interpreted by the dispatch): build_tree's own result
    lp = torch.zeros(1, 15, 128)
    out = TreeBuffers(1, 15, 128, 128)
    assert fused.build_draft_tree(lp, lp.long(), torch.zeros(1).long(), 128, out) is out
    assert out.num_nodes.tolist() == [128]


@pytest.mark.parametrize("seed, bs, L, K, budget", [(0, 4, 3, 2, 5), (1, 5, 7, 4, 16), (3, 3, 2, 1, 9)])
def test_the_fused_walk_is_follow_tree_with_its_permutation_and_rows(fused, seed, bs, L, K, budget):
    tree = random_trees(seed, bs, L, K, budget)
    N = budget + 1
    rng = random.Random(seed)
    target = following_targets(tree, L, seed, rng)
    want = follow_tree(tree.parents, tree.candidates, target, L, AcceptBuffers(bs, N, L))
    got = fused.accept_walk(tree.parents, tree.candidates, target, L, AcceptBuffers(bs, N, L))
    for name in ("path", "accepted", "bonus", "out_tokens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.perm, window_permutation(want))
    assert torch.equal(got.rows, path_rows(want))
    assert len(set(want.accepted.tolist())) > 1  # different accepted lengths


@pytest.mark.parametrize("seed, bs, L, K, budget", [(1, 5, 7, 4, 16), (2, 3, 5, 8, 12)])
def test_the_fused_cut_walk_and_its_statistics_are_the_torch_forms(fused, seed, bs, L, K, budget):
    tree = random_trees(seed, bs, L, K, budget)
    N, budgets = budget + 1, (4, 8, budget)
    target = following_targets(tree, L, seed, random.Random(seed))
    live = torch.tensor([1, 5, 9, N, 3][:bs], dtype=torch.int32)
    want = follow_tree(
        tree.parents, tree.candidates, target, L, AcceptBuffers(bs, N, L, budgets=budgets), live
    )
    cut_stats(want, tree.scores)
    got = fused.accept_walk(
        tree.parents, tree.candidates, target, L, AcceptBuffers(bs, N, L, budgets=budgets), live, tree.scores
    )
    for name in ("path", "accepted", "bonus", "out_tokens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.perm, window_permutation(want))
    assert torch.allclose(got.stats, want.stats, rtol=1e-5)


@pytest.mark.parametrize("seed, bs, L, K, budget", [(1, 5, 7, 4, 16), (3, 3, 2, 1, 9)])
def test_the_fused_walk_commits_as_commit_window_does(fused, seed, bs, L, K, budget):
    tree, target, c = commit_case(seed, bs, L, K, budget)
    N = budget + 1
    want = follow_tree(tree.parents, tree.candidates, target, L, AcceptBuffers(bs, N, L))
    table, loc, pos, lens, new = reference_commit(want, c)
    got = fused.accept_walk(tree.parents, tree.candidates, target, L, AcceptBuffers(bs, N, L), commit=c)
    assert torch.equal(c.req_to_token, table)  # the windows permuted, every other entry as it was
    assert got.path_loc.tolist() == loc and got.draft_positions.tolist() == pos
    assert got.commit_lens.tolist() == lens and got.new_seq_lens.tolist() == new
    assert got.commit_lens.dtype == torch.int32


def test_the_fused_cut_walk_commits_as_the_torch_forms_do(fused):
    """The launch DDTREE's auto budget makes: the cut, its statistics and the commit together."""
    bs, L, K, budget = 3, 5, 4, 12
    tree, target, c = commit_case(4, bs, L, K, budget)
    N, budgets = budget + 1, (3, 7, budget)
    live = torch.tensor([4, N, 8], dtype=torch.int32)
    want = follow_tree(
        tree.parents, tree.candidates, target, L, AcceptBuffers(bs, N, L, budgets=budgets), live
    )
    cut_stats(want, tree.scores)
    table, loc, pos, lens, new = reference_commit(want, c)
    got = fused.accept_walk(
        tree.parents,
        tree.candidates,
        target,
        L,
        AcceptBuffers(bs, N, L, budgets=budgets),
        live,
        tree.scores,
        c,
    )
    assert (
        torch.equal(c.req_to_token, table)
        and got.path_loc.tolist() == loc
        and got.draft_positions.tolist() == pos
    )
    assert got.commit_lens.tolist() == lens and got.new_seq_lens.tolist() == new
    assert torch.allclose(got.stats, want.stats, rtol=1e-5)


@pytest.mark.parametrize("bs, N", [(1, 16), (3, 9), (4, 33), (300, 5)])
def test_the_fused_verify_layout_writes_what_verify_layout_writes(fused, bs, N):
    """300 requests: the kernel's sum over the earlier requests' entries runs in several blocks."""
    tree = random_trees(bs + N, bs, 3, 4, N - 1)
    prefix = torch.tensor(([7, 0, 130, 2] * bs)[:bs], dtype=torch.int64)
    size = int(N * (prefix + N).sum())
    want_buf, got_buf = (
        torch.full((size + 5,), 7, dtype=torch.uint8),
        torch.full((size + 5,), 7, dtype=torch.uint8),
    )
    want_pos, got_pos = torch.zeros(bs, N, dtype=torch.int64), torch.zeros(bs, N, dtype=torch.int64)
    verify_layout(tree.mask, tree.depths, prefix, want_buf, want_pos)
    assert fused.write_verify_layout(tree.mask, tree.depths, prefix, got_buf, got_pos) is got_pos
    assert torch.equal(got_buf, want_buf) and torch.equal(got_pos, want_pos)
    assert (
        int((want_buf == 1).sum()) == int(tree.mask.sum()) and int((want_buf == 7).sum()) > 5
    )  # prefixes untouched


def test_the_fused_walk_leaving_at_the_root_accepts_nothing(fused):
    tree = random_trees(5, 2, 4, 3, 8)
    target = torch.full((2, 9), 49, dtype=torch.int64)
    target[:, 0] = -5
    got = fused.accept_walk(tree.parents, tree.candidates, target, 4, AcceptBuffers(2, 9, 4))
    assert got.accepted.tolist() == [0, 0] and got.bonus.tolist() == [-5, -5]
    assert got.perm.tolist() == [list(range(9))] * 2
    assert got.rows[:, 0].tolist() == [0, 9]


def test_the_kernels_compile_for_an_h200_without_one():
    """The compiled path types things the interpreter lets pass (a loop variable changing type, say): compile them
    kernels for sm_90 ahead of time, at a worker shape, with no GPU."""
    if INTERPRETED:
        pytest.skip("compiles in the parent process")
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget

    from kdtree.ddtree import fused

    def compile_for_sm90(kernel, constexprs: dict, types: dict):
        names = list(inspect.signature(kernel.fn).parameters)
        signature = {n: "constexpr" if n in constexprs else types.get(n, "*i64") for n in names}
        src = triton.compiler.ASTSource(
            fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}
        )
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))

    L, budget = 7, 16
    blocks, NP = fused._blocks(L, budget, budget), fused._p2(budget + 1)
    tree = dict(L=L, K=budget, W=budget, UB=blocks["LWP"].bit_length(), NP=NP, RB=NP, **blocks)
    tree.pop("num_warps", None)
    floats = dict(
        lp_ptr="*fp32", root_stride="i32", beam_score_ptr="*fp32", scores_ptr="*fp32", mask_ptr="*i1"
    )
    assert "ptx" in compile_for_sm90(fused.tree_kernel, tree, floats).asm
    # the plain walk; DDTREE's auto budget's (its cut and its statistics); the worker's step with auto (and its commit)
    for cut, commit in ((False, False), (True, False), (True, True)):
        walk = dict(
            N=budget + 1, L=L, NP=NP, LP=fused._p2(L + 1), HAS_LIVE=cut, STATS=cut, C=3, CP=4, COMMIT=commit
        )
        types = dict(live_ptr="*i32", scores_ptr="*fp32", stats_ptr="*fp32", r2t_ptr="*i32", r2t_stride="i64",
                     pool_rows_ptr="*i64", commit_lens_ptr="*i32")  # fmt: skip
        assert "ptx" in compile_for_sm90(fused.walk_kernel, walk, types).asm
    layout = dict(N=budget + 1, NP=NP, BB=128)
    assert (
        "ptx" in compile_for_sm90(fused.verify_layout_kernel, layout, dict(mask_ptr="*u8", buf_ptr="*u8")).asm
    )
    # the split head's chain: the argmax pass over bf16 logits, and E_chain
    top1 = dict(logits_ptr="*bf16", stride="i64", V="i32", lp_ptr="*fp32")
    assert "ptx" in compile_for_sm90(fused.top1_kernel, dict(BV=4096), top1).asm
    expected = dict(lp_ptr="*fp32", out_ptr="*fp32")
    assert "ptx" in compile_for_sm90(fused.chain_expected_kernel, dict(L=L, LP=fused._p2(L)), expected).asm


@pytest.mark.parametrize("V", [50, 4096 + 37])
def test_the_chain_head_is_the_argmax_and_its_log_probability(fused, V):
    """chain_head on the drafter's logits: each depth's argmax (the first of equal maxima, also across the kernel's
    blocks of 4096), its log-probability, and E_chain, as the torch form computes them."""
    bs, L = 2, 3
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(bs * L, V, generator=g) * 4).round() / 4  # quarters: ties within a row
    logits[0, 7] = logits[0, V - 1] = 20.0  # a tie for the max, in different blocks when V > 4096
    logits[1, : min(V - 3, 4096)] = float("-inf")  # a first block of -inf alone when V > 4096 (masked tokens)
    logits = logits.to(torch.bfloat16)
    tokens = torch.zeros(bs, L, dtype=torch.int64)
    lp, expected = torch.zeros(bs, L), torch.zeros(bs)
    fused.chain_head(logits, tokens, lp, expected)
    x = logits.float()
    assert torch.equal(tokens.view(-1), torch.argmax(x, -1)) and tokens[0, 0] == 7
    assert torch.isfinite(lp).all() and torch.isfinite(expected).all()
    want_lp = (x.max(-1).values - torch.logsumexp(x, -1)).view(bs, L)
    assert torch.allclose(lp, want_lp, atol=1e-5)
    assert torch.allclose(expected, torch.exp(torch.cumsum(want_lp, 1)).sum(1), rtol=1e-5)
