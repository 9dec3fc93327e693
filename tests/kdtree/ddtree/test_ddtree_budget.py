"""DDTREE's auto budget (kdtree.ddtree.budget): the budgets it chooses among and the policy's choice, on host numbers
(CPU; the kernel's timing, measure_cut_cost, runs in the GPU suite and the real server)."""

from __future__ import annotations

import pytest

from kdtree.ddtree.budget import BudgetPolicy, VerifyCost, cut_budgets


def test_the_budgets_are_the_powers_of_two_from_4_below_the_cap_and_the_cap():
    assert cut_budgets(128) == (4, 8, 16, 32, 64, 128)
    assert cut_budgets(32) == (4, 8, 16, 32)
    assert cut_budgets(33) == (4, 8, 16, 32, 33)
    assert cut_budgets(4) == (4,)
    assert cut_budgets(1) == (1,)
    with pytest.raises(ValueError, match="at least 1"):
        cut_budgets(0)


def cost(budgets, fixed_us=0.0, per_key_ns_per_token=0.1, layers=10) -> VerifyCost:
    """A verify whose attention costs per_key_ns_per_token ns a key a verified token, layer by layer."""
    return VerifyCost(
        layers=layers,
        fixed={b: fixed_us * 1e-6 for b in budgets},
        per_key={b: per_key_ns_per_token * 1e-9 * (b + 1) for b in budgets},
    )


def run(
    policy: BudgetPolicy, steps: int, *, bs=1, prefix=2048, step_s=0.01, accept=None, expected=None, t0=0.0
):
    """`steps` decode steps `step_s` apart, each observed at once: accept(b) drafted tokens accepted a request within
    b (capped by the chosen budget, as a cut walk is), expected(b) the trees' E(b). Returns the budgets chosen."""
    chosen = []
    t = t0
    for _ in range(steps):
        b = policy.choose(t, bs, prefix * bs, serving=True)
        chosen.append(b)
        acc = [bs * accept(min(c, b)) for c in policy.budgets]
        exp = [bs * expected(c) for c in policy.budgets]
        policy.observe(b, bs, acc, exp)
        t += step_s
    return chosen


def test_the_cap_until_a_step_was_timed_and_whenever_kdtree_does_not_serve():
    budgets = cut_budgets(64)
    p = BudgetPolicy(budgets, cost(budgets), probe_every=1000)
    flat = ([1.0] * 5, [4.0] * 5)  # acceptance flat above 4: a smaller budget would do once a step is timed
    assert p.choose(0.0, 1, 4096, serving=False) == 64  # validate / standby / off: every b costs the same
    p.observe(64, 1, *flat)
    assert p.choose(0.01, 1, 4096, serving=True) == 64
    assert p.fixed_s is None  # the step before was not kdtree's: its interval is another kernel's time
    p.observe(64, 1, *flat)
    assert p.choose(0.02, 1, 4096, serving=True) == 4  # timed now
    assert p.fixed_s is not None
    assert p.choose(0.03, 1, 4096, serving=False) == 64
    assert BudgetPolicy(budgets, None).choose(0.0, 1, 4096, serving=True) == 64  # no cost model: the cap


def test_a_long_prefix_and_a_flat_acceptance_choose_a_small_budget():
    """Acceptance that stops growing at 8 nodes, a 32k prefix where the verify's attention dominates: 8 wins."""
    budgets = cut_budgets(128)
    p = BudgetPolicy(budgets, cost(budgets, per_key_ns_per_token=0.05, layers=61), probe_every=1000)
    chosen = run(
        p, 40, prefix=32768, step_s=0.03, accept=lambda b: min(b, 8) * 0.5, expected=lambda b: min(b, 8)
    )
    assert chosen[0] == 128 and chosen[-1] == 8
    assert p.expected_accepted(8) == pytest.approx(4.0, rel=1e-3)


def test_acceptance_that_keeps_growing_at_a_short_prefix_keeps_the_cap():
    budgets = cut_budgets(64)
    p = BudgetPolicy(budgets, cost(budgets, per_key_ns_per_token=0.001, layers=61), probe_every=1000)
    chosen = run(p, 30, prefix=2048, step_s=0.012, accept=lambda b: b / 8, expected=lambda b: b / 4)
    assert chosen[-1] == 64
    assert p.expected_accepted(64) == pytest.approx(8.0, rel=1e-3)  # rho = 1/2 measured at the cap


def test_budgets_above_the_chosen_one_are_extrapolated_by_the_largest_observed_calibration():
    """After the first step (the cap), only the chosen budget and those below it are observed: larger ones keep the
    rho of the largest observed and their own E(b), which every step updates."""
    budgets = (4, 8, 16)
    p = BudgetPolicy(budgets, cost(budgets), weight=1.0)
    p.observe(8, 2, accepted=[2.0, 4.0, 4.0], expected=[4.0, 8.0, 12.0])  # b = 8: 16 is not observed
    assert p.expected_accepted(4) == pytest.approx(1.0)  # rho(4) = 1/2, E(4) = 2 a request
    assert p.expected_accepted(8) == pytest.approx(2.0)
    assert p.expected_accepted(16) == pytest.approx(3.0)  # rho(8) = 1/2 times E(16) = 6


def test_the_probe_verifies_the_whole_tree_every_probe_every_steps():
    budgets = cut_budgets(64)
    p = BudgetPolicy(budgets, cost(budgets, per_key_ns_per_token=0.05, layers=61), probe_every=10)
    chosen = run(
        p, 40, prefix=32768, step_s=0.03, accept=lambda b: min(b, 4) * 0.5, expected=lambda b: min(b, 4)
    )
    assert [i for i, b in enumerate(chosen) if b == 64][1:] == [9, 19, 29, 39]
    assert set(chosen[12:19]) == {4}
    assert p.chosen[64] == 5 and sum(p.chosen.values()) == 40


def test_a_gap_or_a_prefill_between_steps_is_not_a_steps_time():
    budgets = (4, 8)
    p = BudgetPolicy(budgets, cost(budgets, fixed_us=10.0), max_gap_s=1.0)
    p.choose(0.0, 1, 1000, serving=True)
    p.choose(5.0, 1, 1000, serving=True)  # idle for 5 s
    assert p.fixed_s is None
    p.interrupt()  # a prefill ran
    p.choose(5.5, 1, 1000, serving=True)
    assert p.fixed_s is None
    p.choose(5.52, 1, 1000, serving=True)
    want = 0.02 - cost(budgets, fixed_us=10.0).seconds(8, 1000)  # the cap was chosen at 5.5
    assert p.fixed_s == pytest.approx(want)


def test_the_snapshot_is_what_the_rank_record_holds():
    from kdtree.state.rank_records import DdtreeBudget

    budgets = cut_budgets(32)
    p = BudgetPolicy(budgets, cost(budgets))
    run(p, 3, accept=lambda b: 1.0, expected=lambda b: 2.0)
    snap = p.snapshot()
    rec = DdtreeBudget(steps=3, request_steps=3, live_tokens=99, **snap)
    assert rec.budgets == [4, 8, 16, 32] and sum(rec.steps_at.values()) == 3
    assert rec.mean_verify_tokens == 33.0
    assert rec.expected_accepted["32"] == pytest.approx(1.0)


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="positive"):
        BudgetPolicy((), None)
    with pytest.raises(ValueError, match="no time"):
        BudgetPolicy((4, 8), cost((4,)))
