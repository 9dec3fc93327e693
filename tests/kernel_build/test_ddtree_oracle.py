"""The DDTREE oracle of the GPU tests (kernel_build/bench/harness/ddtree_oracle.py), on the CPU: its scripted
candidates, through kdtree's own tree builder and acceptance walk with the bigram target's tokens, accept exactly
what `expected_accepted` predicts from the reference heap, and the continuation it predicts is the bigram's."""

from __future__ import annotations

import types

import ddtree_oracle as oracle
import pytest

torch = pytest.importorskip("torch", reason="the oracle's scripted head is torch (the server extra)")
pytest.importorskip("sglang", reason="kdtree.ddtree.worker imports SGLang's DFlash worker (the server extra)")


def test_the_continuation_is_the_permutation():
    assert oracle.continuation(5, 3, 8192) == [48, 349, 2456]
    assert len({oracle.perm(x, 8192) for x in range(8192)}) == 8192  # a permutation


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "ranks", [[0] * 7, [0, 0, 1, 0, 0, 2, 0], [1, 1, 1, 1, 1, 1, 1], [3, 0, 0, 0, 0, 0, 0]]
)
def test_scripted_candidates_accept_what_the_reference_predicts(monkeypatch, ranks):
    from kdtree.ddtree import worker
    from kdtree.ddtree.accept import AcceptBuffers, follow_tree
    from kdtree.ddtree.tree import build_tree

    monkeypatch.setenv(oracle.ENV, ",".join(map(str, ranks)))
    module = types.SimpleNamespace(
        TreeDraftSampler=type("S", (worker.TreeDraftSampler,), {}), DDTreeWorker=type("W", (), {})
    )
    oracle.install(module)
    sampler = object.__new__(module.TreeDraftSampler)
    sampler.L, sampler.K, budget, vocab = 7, 16, 16, 8192
    sampler.lm_head = types.SimpleNamespace(org_vocab_size=vocab)
    sampler.oracle_lp = torch.tensor(oracle.scripted_lp(16), dtype=torch.float32)
    root = torch.tensor([5, 8000, 77])
    lp, ids = sampler.candidates(None, root)
    tree = build_tree(lp, ids, root, budget)
    target = (oracle.A * tree.candidates + oracle.C) % vocab  # the bigram target's greedy token at every node
    out = follow_tree(tree.parents, tree.candidates, target, 7, AcceptBuffers(3, budget + 1, 7))
    a = oracle.expected_accepted(ranks, 16, budget)
    assert out.accepted.tolist() == [a] * 3
    for b, r in enumerate(root.tolist()):
        assert out.out_tokens[b, : a + 1].tolist() == oracle.continuation(r, a + 1, vocab)
