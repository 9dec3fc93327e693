"""DDTreeWorker's pieces that run on the CPU (kdtree.ddtree.worker imports SGLang's DFlash worker; the worker itself
runs in the real server: tests/gpu/test_engine_gpu.py): the target's token at every node, greedy and sampled
through SGLang's own verify distribution (build_speculative_verify_target_probs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="the worker needs torch (the server extra)")
pytest.importorskip("sglang", reason="sglang==0.5.23 is not installed (the server extra)")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def sampling(bs, temperature, top_k=None):
    """A stand-in for SGLang's SamplingBatchInfo with the fields its verify distribution reads."""
    return SimpleNamespace(
        is_all_greedy=False,
        temperatures=torch.full((bs, 1), temperature),
        top_ks=torch.full((bs,), top_k or 0, dtype=torch.int32),
        top_ps=torch.ones(bs),
        need_top_k_sampling=top_k is not None,
        need_top_p_sampling=False,
        need_min_p_sampling=False,
    )


def test_greedy_is_the_argmax_at_every_node():
    from kdtree.ddtree.worker import target_tokens

    logits = torch.randn(2 * 5, 30, generator=torch.Generator().manual_seed(0))
    assert torch.equal(target_tokens(logits, None, 2, 5), logits.argmax(-1).view(2, 5))
    assert torch.equal(
        target_tokens(logits, SimpleNamespace(is_all_greedy=True), 2, 5), logits.argmax(-1).view(2, 5)
    )


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.5, None), (1.0, 3)])
def test_a_sampled_node_draws_from_the_targets_distribution(temperature, top_k):
    """One independent draw per node: over many nodes with the same logits, the frequencies are the target's
    probabilities (temperature, then top-k renormalised), within a few standard errors."""
    from kdtree.ddtree.worker import target_tokens

    torch.manual_seed(1)
    V, bs, N = 6, 4, 5000
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    want = torch.softmax(row / temperature, -1)
    if top_k is not None:
        want = torch.where(torch.arange(V) < top_k, want, 0.0)
        want = want / want.sum()
    logits = row.expand(bs * N, V).clone()
    got = target_tokens(
        logits, sampling(bs, temperature, top_k), bs, N, SimpleNamespace(max_top_k=top_k or 1)
    )
    freq = torch.bincount(got.reshape(-1), minlength=V).float() / (bs * N)
    stderr = (want * (1 - want) / (bs * N)).sqrt()
    assert torch.all((freq - want).abs() <= 5 * stderr + 1e-4), (freq, want)


def scripted_head(bs, L, budget):
    """A TreeDraftSampler whose candidates are given (the target's lm_head and SGLang's candidate_topk are the real
    server's: tests/gpu/test_engine_gpu.py), log-probs random and sorted per depth as the head returns them; with
    them."""
    from kdtree.ddtree.worker import TreeDraftSampler

    K = budget  # the head's K (Lemma 1)
    g = torch.Generator().manual_seed(7)
    lp = torch.sort(torch.log_softmax(torch.randn(bs, L, 40, generator=g), -1)[..., :K], -1, descending=True)[
        0
    ]
    ids = torch.randint(0, 1000, (bs, L, K), generator=g)
    sampler = type("Scripted", (TreeDraftSampler,), {"candidates": lambda self, hs, root: (lp, ids)})(
        lm_head=SimpleNamespace(org_vocab_size=1000),
        block_size=L + 1,
        budget=budget,
        sizes=[bs],
        device="cpu",
    )
    return sampler, lp, ids


def test_the_head_writes_the_chain_and_the_build_the_tree_so_a_chain_step_builds_none():
    """The draft graph's head writes each depth's top-K, the chain and E_chain; the tree is `build`'s alone (auto's
    chain arm replays the head, not the build), and it equals build_tree on the head's candidates."""
    from kdtree.ddtree.tree import build_tree

    bs, L, budget = 3, 5, 8
    sampler, lp, ids = scripted_head(bs, L, budget)
    tokens = torch.arange(bs * (L + 1)) + 100  # the block: the root first
    sampler(torch.zeros(bs * (L + 1), 2), tokens)
    o = sampler.outputs(bs)
    root = tokens.view(bs, L + 1)[:, 0]
    assert torch.equal(o.chain[:bs], ids[:, :, 0]) and torch.equal(o.root[:bs], root)
    assert torch.allclose(o.chain_expected[:bs], torch.exp(torch.cumsum(lp[:, :, 0], 1)).sum(1))
    assert not o.parents.any() and not o.mask.any(), "the head built a tree"
    tree = sampler.build(bs, graphed=False)  # no graph here: eagerly at bs
    want = build_tree(lp, ids, root, budget)
    for name in ("input_ids", "candidates", "parents", "depths", "scores", "mask"):
        assert torch.equal(getattr(tree, name)[:bs], getattr(want, name)), name


def test_a_split_head_drafts_the_chain_from_the_logits_and_the_build_the_tree_from_them():
    """auto's split head (the draft graph keeps the logits and takes only the chain; the tree's graph takes the
    top-K from those logits): the chain is each depth's argmax of the real head's logits with E_chain of their
    log-probs, the head computes no top-K, and the build's tree is build_tree on the top-K of the same logits."""
    from kdtree.ddtree.tree import build_tree
    from kdtree.ddtree.worker import TreeDraftSampler

    bs, L, budget, V, H = 3, 5, 8, 64, 16
    g = torch.Generator().manual_seed(11)
    lm_head = SimpleNamespace(weight=torch.randn(V, H, generator=g), org_vocab_size=V)
    sampler = TreeDraftSampler(
        lm_head=lm_head, block_size=L + 1, budget=budget, sizes=[4], device="cpu", split_head=True
    )
    hidden = torch.randn(bs * (L + 1), H, generator=g)
    tokens = torch.arange(bs * (L + 1)) + 100
    sampler(hidden, tokens)
    o = sampler.outputs(bs)
    logits = (hidden.view(bs, L + 1, H)[:, 1:] @ lm_head.weight.T).float()
    lp = torch.log_softmax(logits, -1)
    assert torch.equal(o.chain[:bs], logits.argmax(-1))
    want_e = torch.exp(torch.cumsum(lp.max(-1).values, 1)).sum(1)
    assert torch.allclose(o.chain_expected[:bs], want_e, rtol=1e-5)
    assert not o.lp.any() and not o.parents.any(), "the split head computed the top-K or a tree"
    tree = sampler.build(bs, graphed=True)  # no graph captured here: the build eagerly, top-K from the logits
    top_lp, top_ids = torch.sort(lp, dim=-1, descending=True, stable=True)
    root = tokens.view(bs, L + 1)[:, 0]
    want = build_tree(top_lp[..., :budget].contiguous(), top_ids[..., :budget].contiguous(), root, budget)
    assert torch.allclose(tree.lp[:bs], top_lp[..., :budget], atol=1e-5)
    for name in ("input_ids", "candidates", "parents", "depths", "mask"):
        assert torch.equal(getattr(tree, name)[:bs], getattr(want, name)), name


def test_without_a_split_head_the_draft_graphs_head_is_the_whole_head():
    bs, L, budget = 2, 4, 6
    sampler, lp, ids = scripted_head(bs, L, budget)
    assert sampler.logits is None
    sampler(torch.zeros(bs * (L + 1), 2), torch.arange(bs * (L + 1)))
    o = sampler.outputs(bs)
    assert (
        torch.equal(o.lp[:bs], lp)
        and torch.equal(o.ids[:bs], ids)
        and torch.equal(o.chain[:bs], ids[:, :, 0])
    )
