"""sidecar/admission.py and the gate's Criterion (sidecar/api.py): a verdict follows from its operator, and a refusal
names what to fix: the evidence, or a server that is down and how to start it."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError
from sidecar_harness import AUTH, make_settings, sidecar

from kdtree.config import Mode
from sidecar.api import Criterion, holds


@pytest.mark.parametrize(
    ("value", "op", "threshold", "passed"),
    [
        (True, "==", True, True),
        (False, "==", True, False),
        (120, ">=", 100, True),
        (99, ">=", 100, False),
        (0.004, "<=", 0.01, True),
        (0.5, "<=", 0.01, False),
        (math.nan, "<=", 0.01, False),  # NaN passes no comparison
        (math.inf, "<=", 0.01, False),
        (None, "<=", 0.01, False),  # no value, no pass
    ],
)
def test_a_criterion_passes_exactly_when_its_comparison_holds(value, op, threshold, passed):
    c = Criterion.check("x", value, op, threshold)
    assert c.passed is passed and holds(value, op, threshold) is passed


def test_a_criterion_without_its_whole_evidence_fails_even_when_the_numbers_pass():
    c = Criterion.check(
        "min_calls_compared", 500, ">=", 100, "not every rank reports validate mode", evidence=False
    )
    assert c.passed is False and c.detail == "not every rank reports validate mode"


def test_a_criterion_that_claims_a_pass_its_comparison_denies_is_refused():
    with pytest.raises(ValidationError, match="says passed, but 0.5 <= 0.01 does not hold"):
        Criterion(name="max_rel_err", value=0.5, op="<=", threshold=0.01, passed=True)
    with pytest.raises(ValidationError):
        Criterion(name="x", value=1, op="<", threshold=2, passed=False)  # an operator the gate does not know


def test_a_criterion_survives_the_wire():
    c = Criterion.check("nan_inf", 0, "<=", 0, "")
    assert Criterion.model_validate(c.model_dump()) == c


@pytest.mark.anyio
async def test_a_flip_refused_because_the_server_is_down_says_so_and_how_to_start_it(engine, tmp_path):
    proc = engine("--fault", "crash-on-start", "--fault-in-mode", "on", mode=Mode.ON, wait=False)
    proc.proc.wait(10)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        refused = await c.post("/mode", json={"mode": "validate"}, headers=AUTH)
    error = refused.json()["error"]
    assert refused.status_code == 412 and "server_up" in error
    assert "the server is down" in error and "docker compose up -d" in error, error
    assert "fix the evidence" not in error


@pytest.mark.anyio
async def test_a_flip_refused_for_thin_evidence_still_says_to_fix_the_evidence(engine, tmp_path):
    proc = engine("--parity-calls", "50", "--layers", "1", "--parity-max-rel", "0.001", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        refused = await c.post("/mode", json={"mode": "on"}, headers=AUTH)
    error = refused.json()["error"]
    assert refused.status_code == 412 and "min_calls_compared" in error and "fix the evidence" in error
    assert "the server is down" not in error
