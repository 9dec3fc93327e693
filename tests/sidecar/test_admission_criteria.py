"""sidecar/admission.py and sidecar/rank_evidence.py on records made here: the rank check, the gate to `on` (non-finite parity above all), the bake's
evidence. No server and no file: the records are what read_records would return."""

from __future__ import annotations

import math
import time

import pytest

from kdtree.config import FP8_PARITY_RTOL, Mode
from kdtree.state.rank_records import Parity, RankView, new_record
from sidecar.admission import gate_to_on, non_finite_parity
from sidecar.rank_evidence import bake_evidence, check_ranks, fp8_bound, live_records
from sidecar.settings import SidecarSettings


def settings(**overrides) -> SidecarSettings:
    base = dict(admin_token="t", expected_tp_size=2, gate_min_calls=100, gate_max_rel_err=0.02)
    return SidecarSettings(**{**base, **overrides})


def view(
    rank: int, mode: str = "validate", stale: bool = False, pool: str = "bfloat16", **parity
) -> RankView:
    rec = new_record(mode, tp_rank=rank, tp_size=2)
    rec.installed = True
    rec.live_modes = ["on", "standby", "validate"]
    rec.verify_inputs = {
        "captured": {"kv_pool": [pool, [1, 576], 576]}
    }  # as kdtree.verify.describe_call writes it
    rec.parity = Parity(**{"calls_compared": 500, "max_rel_l2": 0.001, "max_abs_err": 0.001, **parity})
    return RankView(record=rec, path=f"rank-{rank}.json", stale=stale, age_s=0.0)


def criteria(views, ready=True) -> dict:
    return {c.name: c for c in gate_to_on(settings(), views, ready, "")}


def test_clean_evidence_passes_every_criterion():
    crit = criteria([view(0), view(1)])
    assert all(c.passed for c in crit.values()), crit
    assert crit["max_rel_err"].value == 0.001 and crit["min_calls_compared"].value == 500


@pytest.mark.parametrize(
    ("pool", "max_rel", "passes"),
    [
        (
            "float8_e4m3fn",
            0.045,
            True,
        ),  # Triton's own fp8 error on an fp8 pool: within validate's bound for it
        ("float8_e5m2", 0.09, True),
        ("float8_e4m3fn", 0.07, False),  # beyond it
        ("float8_e5m2", 0.13, False),
        ("bfloat16", 0.045, False),  # a bf16 pool keeps KDTREE_GATE_MAX_REL_ERR
    ],
)
def test_an_fp8_kv_cache_is_gated_by_its_dtypes_bound(pool, max_rel, passes):
    """On an fp8 pool validate compares kdtree with SGLang's fp8 Triton math, a few percent apart by fp8 alone: the
    gate takes the larger of its own bound and validate's for the pool's dtype, and says so."""
    crit = criteria([view(0, pool=pool, max_rel_l2=max_rel), view(1, pool=pool)])
    c = crit["max_rel_err"]
    assert c.passed is passes and c.value == max_rel
    assert c.threshold == FP8_PARITY_RTOL.get(pool, 0.02)
    assert ("an fp8 KV cache" in c.detail) is pool.startswith("float8")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_non_finite_parity_value_refuses_the_gate_naming_its_criterion(value, rank):
    """NaN compares false with everything, so max() keeps it only when it comes first and `<=` never holds:
    whichever rank has it, the gate refuses on max_rel_err and says which rank and field, never passes."""
    views = [view(0), view(1)]
    views[rank] = view(rank, max_rel_l2=value)
    crit = criteria(views)
    c = crit["max_rel_err"]
    assert c.passed is False and f"rank {rank}: max_rel_l2 is {value}" in c.detail
    assert math.isnan(c.value) if math.isnan(value) else c.value == max(value, 0.001)
    assert {name for name, x in crit.items() if not x.passed} == {"max_rel_err"}


@pytest.mark.parametrize("field", ["max_abs_err", "rtol"])
def test_any_non_finite_parity_field_refuses_the_gate(field):
    crit = criteria([view(0), view(1, **{field: math.nan})])
    assert crit["max_rel_err"].passed is False and f"rank 1: {field} is nan" in crit["max_rel_err"].detail


def test_non_finite_parity_names_every_value():
    recs = [view(0, max_rel_l2=math.inf).record, view(1, max_abs_err=-math.inf, rtol=math.nan).record]
    assert non_finite_parity(recs) == [
        "rank 0: max_rel_l2 is inf",
        "rank 1: max_abs_err is -inf",
        "rank 1: rtol is nan",
    ]


def test_parity_counts_only_when_every_rank_is_in_validate():
    crit = criteria([view(0), view(1, mode="on")])
    assert not crit["ranks_in_validate"].passed and "[1]" in crit["ranks_in_validate"].detail
    assert (
        not crit["max_rel_err"].passed
        and crit["max_rel_err"].detail == "not every rank reports validate mode"
    )


def test_stale_and_extra_ranks_are_not_live():
    views = [view(0), view(1, stale=True), view(5)]
    assert sorted(live_records(settings(), views)) == [0]
    assert not criteria(views)["ranks_in_validate"].passed


def test_check_ranks_names_each_problem():
    views = [view(0, mode="on"), view(1, stale=True)]
    views[1].stale_reason = "unreadable: schema_version 99; this sidecar reads 1"
    check = check_ranks(settings(expected_tp_size=3), views, Mode.VALIDATE)
    assert check.problems == [
        "rank 0: reports mode on, expected validate",
        "rank 1: record is stale (unreadable: schema_version 99; this sidecar reads 1)",
        "rank 2: no record in /var/run/kdtree",
    ]
    assert check_ranks(settings(), [view(0, mode="on"), view(1)], {Mode.ON, Mode.VALIDATE}).ok
    old = check_ranks(settings(), [view(0), view(1)], Mode.VALIDATE, started_after=time.time() + 60)
    assert old.problems[0] == "rank 0: record is from a server started before the restart"


def test_bake_evidence_needs_the_new_modes_work_on_every_rank():
    before = {r: view(r, mode="on").record for r in (0, 1)}
    after = {r: rec.model_copy(deep=True) for r, rec in before.items()}
    after[0].served_kdtree = 12
    problems = bake_evidence(settings(), Mode.ON, before, after)
    assert problems == ["rank 1: kdtree served no verify call during the bake (served_kdtree 0 -> 0)"]
    assert bake_evidence(settings(), Mode.STANDBY, before, after) == []


@pytest.mark.parametrize("kv_pool", [5, {"a": 1}, [], [7, [1]], "float8_e5m2", None])
def test_a_pool_written_in_no_known_shape_names_no_fp8_bound(kv_pool):
    """A record is the server process's writing: a kv_pool that is not [dtype, shape, width] leaves the gate on
    KDTREE_GATE_MAX_REL_ERR, with no exception (the gate, /gate and /metrics read it)."""
    views = [view(0), view(1)]
    views[1].record.verify_inputs = {"captured": {"kv_pool": kv_pool}}
    assert fp8_bound(views[1].record) is None
    assert criteria(views)["max_rel_err"].threshold == 0.02
