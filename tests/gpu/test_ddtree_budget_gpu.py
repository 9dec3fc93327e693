"""DDTREE's auto budget on CUDA (kdtree.ddtree.budget.measure_cut_cost): kdtree's kernel timed as the cut runs it, at
the start of a DDTREE server. What it measures must order the budgets as the kernel's work does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the server extra)")

from kdtree.ddtree.budget import BudgetPolicy, cut_budgets, measure_cut_cost  # noqa: E402

pytestmark = pytest.mark.gpu


def test_the_cuts_cost_grows_with_the_budget_and_the_prefix():
    budgets = cut_budgets(128)
    cost = measure_cut_cost(8, 128, budgets, layers=61, device=torch.device("cuda"))
    at_32k = [cost.seconds(b, 32768) for b in budgets]
    assert all(t > 0 for t in at_32k)
    assert at_32k[-1] > 2 * at_32k[0], (
        at_32k
    )  # 129 tokens against 4: the tensor pipe's work, 17 row tiles against 1
    assert all(b >= 0.9 * a for a, b in zip(at_32k, at_32k[1:], strict=False)), at_32k  # within timing noise
    assert cost.seconds(128, 32768) > 2 * cost.seconds(128, 2048)
    # 61 layers of a 32k verify of 129 tokens on an H200-class GPU: milliseconds, not microseconds or seconds
    assert 1e-3 < at_32k[-1] < 0.2, at_32k
    policy = BudgetPolicy(budgets, cost)  # a policy accepts what the measurement gives
    assert policy.choose(0.0, 1, 32768, serving=True) == 128
