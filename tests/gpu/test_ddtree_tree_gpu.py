"""The DDTree builder on CUDA: no host synchronisation, captured in a CUDA graph with its buffers and replayed on
new inputs, each replay equal to the heap reference of Algorithm 1 (and to the CPU build, bit for bit)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the server extra)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kdtree" / "ddtree"))
from test_ddtree_tree import assert_matches, random_lp  # noqa: E402

from kdtree.ddtree.reference import build_ddtree_tree  # noqa: E402
from kdtree.ddtree.tree import TreeBuffers, build_tree  # noqa: E402

pytestmark = pytest.mark.gpu

# bs, L (block - 1), K, budget: the budgets at block 16, K < budget, and padding (L*K below budget)
SHAPES = [(1, 15, 32, 32), (4, 15, 16, 64), (8, 7, 8, 128), (2, 15, 128, 256), (3, 2, 3, 40), (2, 1, 64, 16)]


def random_inputs(rng, bs, L, K, ties):
    lp = [random_lp(rng, L, K, ties, absent=0.1) for _ in range(bs)]
    ids = [[rng.sample(range(129280), K) for _ in range(L)] for _ in range(bs)]
    return lp, ids


def references(lp, ids, budget):
    return [build_ddtree_tree(lp[b], ids[b], budget, root_token=1000 + b) for b in range(len(lp))]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "bs{}-L{}-K{}-budget{}".format(*s))
def test_builder_on_cuda_syncs_never_and_replays_in_a_cuda_graph(shape):
    bs, L, K, budget = shape
    rng = random.Random(sum(shape))
    dev = "cuda"
    lp_buf = torch.zeros(bs, L, K, dtype=torch.float32, device=dev)
    ids_buf = torch.zeros(bs, L, K, dtype=torch.int64, device=dev)
    roots = torch.arange(1000, 1000 + bs, dtype=torch.int64, device=dev)
    out = TreeBuffers(bs, L, K, budget, dev)

    # eager, with every host synchronisation an error
    lp, ids = random_inputs(rng, bs, L, K, ties=True)
    lp_buf.copy_(torch.tensor(lp))
    ids_buf.copy_(torch.tensor(ids))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        build_tree(lp_buf, ids_buf, roots, budget, out=out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_matches(out, references(lp, ids, budget), budget)
    cpu = build_tree(lp_buf.cpu(), ids_buf.cpu(), roots.cpu(), budget)
    for name in ("candidates", "parents", "depths", "scores", "mask", "num_nodes"):
        assert torch.equal(getattr(out, name).cpu(), getattr(cpu, name)), name

    # capture once (warmed up on a side stream, as SGLang's graph runners do), replay on new inputs
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        build_tree(lp_buf, ids_buf, roots, budget, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        build_tree(lp_buf, ids_buf, roots, budget, out=out)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    for i in range(6):
        lp, ids = random_inputs(rng, bs, L, K, ties=i % 2 == 0)
        lp_buf.copy_(torch.tensor(lp))
        ids_buf.copy_(torch.tensor(ids))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, references(lp, ids, budget), budget)
    assert torch.cuda.memory_allocated() == allocated
