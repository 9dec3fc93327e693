"""sidecar/api.py: the documents the sidecar builds are the ones kdtreectl reads back, field for field, with the
JSON on the wire as it always was (the keys a client or a dashboard reads)."""

from __future__ import annotations

import json
import math

from kdtree.config import Mode
from kdtree.state.atomic import json_safe
from kdtree.state.rank_records import Parity, RankView, new_record
from sidecar.api import (
    Criterion,
    LogStatus,
    ModeAnswer,
    ModeStatus,
    ServerView,
    StateVolumeStatus,
    StatusDocument,
)
from sidecar.probe import ProbeResult
from sidecar.server_control import ServerState
from sidecar.store import Transition
from sidecar.vocabulary import Condition, Method, Phase

STATUS_KEYS = [
    "phase", "server_phase", "ready", "condition", "condition_evidence", "reasons", "notes", "mode", "state_volume",
    "container", "log", "probe", "probe_failures_in_a_row", "server_health", "ranks", "rank_problems",
    "expected_tp_size", "active_transition", "transitions", "group", "desired_mode", "speculation",
]  # fmt: skip


def wire(document: dict) -> dict:
    """What the sidecar sends (app.ApiJSON: non-finite floats as strings) as a client receives it."""
    return json.loads(json.dumps(json_safe(document)))


def status_document() -> StatusDocument:
    rec = new_record("validate", tp_rank=1, tp_size=2)
    rec.parity = Parity(calls_compared=7, max_rel_l2=math.nan)
    return StatusDocument(
        phase=Phase.READY,
        server_phase=Phase.READY,
        ready=True,
        condition=Condition.READY,
        condition_evidence=[],
        reasons=[],
        notes=["tolerated"],
        mode=ModeStatus(current=Mode.VALIDATE, expected_now=Mode.VALIDATE, desired_file="validate"),
        state_volume=StateVolumeStatus(path="/var/run/kdtree"),
        container=ServerView(
            state=ServerState(name="server", status="running", running=True, started_at=1.0)
        ),
        log=LogStatus(),
        probe=ProbeResult(ok=True, latency_s=0.1, at=2.0),
        probe_failures_in_a_row=0,
        server_health=None,
        ranks=[RankView(record=rec, path="/var/run/kdtree/rank-1.json", stale=False, age_s=0.5)],
        rank_problems=[],
        expected_tp_size=2,
        active_transition=None,
        transitions=[Transition(from_mode=Mode.OFF, to_mode=Mode.VALIDATE)],
    )


def test_the_status_document_keeps_its_keys_and_reads_back_as_built():
    doc = status_document()
    sent = wire(doc.model_dump())
    assert list(sent) == STATUS_KEYS
    assert sent["mode"] == {"current": "validate", "expected_now": "validate", "desired_file": "validate"}
    assert sent["ranks"][0]["record"]["parity"]["max_rel_l2"] == "NaN"  # JSON has no NaN
    back = StatusDocument.model_validate(sent)
    assert math.isnan(back.ranks[0].record.parity.max_rel_l2)
    assert back.ranks[0].record.parity.calls_compared == 7
    assert back.model_dump(exclude={"ranks"}) == doc.model_dump(exclude={"ranks"})


def test_a_mode_answer_carries_only_what_its_case_sets():
    nothing = ModeAnswer(
        from_mode=Mode.ON, to_mode=Mode.ON, method=Method.RESTART, dry_run=False, force=False
    )
    nothing.changed, nothing.detail = False, "the server already runs in mode on"
    assert set(wire(nothing.wire())) == {
        "from_mode",
        "to_mode",
        "method",
        "dry_run",
        "force",
        "changed",
        "detail",
    }
    refused = ModeAnswer(from_mode=Mode.VALIDATE, to_mode=Mode.ON, allowed=False, gate_passed=False)
    refused.criteria = [Criterion.check("min_calls_compared", 50, ">=", 100)]
    refused.error = "the gate to on failed"
    back = ModeAnswer.model_validate(wire(refused.wire()))
    assert (
        back.criteria == refused.criteria and back.criteria[0].passed is False and back.error == refused.error
    )
    assert "transition" not in back.model_fields_set


def test_a_busy_answer_reads_back_with_or_without_a_transition():
    t = Transition(from_mode=Mode.VALIDATE, to_mode=Mode.ON)
    running = ModeAnswer.model_validate(wire(ModeAnswer(error="busy", transition=t).wire()))
    assert isinstance(running.transition, Transition) and running.transition.id == t.id
    deciding = ModeAnswer.model_validate(
        wire(ModeAnswer(error="busy", transition={"step": "evaluating the gate"}).wire())
    )
    assert deciding.transition == {"step": "evaluating the gate"}


def test_the_speculation_report_reads_the_probes_accept_length_and_the_ranks_tree_size():
    """accept length = completion tokens over verify steps (SGLang's), none without both; the tokens a verify reads a
    request = the largest max_extend_len among the verify calls a rank recorded (DDTREE's N), none before one."""
    assert (
        ProbeResult(ok=True, latency_s=0.1, at=1.0, completion_tokens=32, verify_steps=8).accept_length == 4.0
    )
    assert ProbeResult(ok=True, latency_s=0.1, at=1.0, completion_tokens=32).accept_length is None
    assert (
        ProbeResult(ok=True, latency_s=0.1, at=1.0, completion_tokens=32, verify_steps=0).accept_length
        is None
    )
    rec = new_record("on", tp_rank=0, tp_size=1)
    assert rec.verify_tokens is None
    rec.verify_inputs = {"eager": {"max_extend_len": 17, "batch": 8}, "captured": {"max_extend_len": 33}}
    assert rec.verify_tokens == 33
    sent = wire(status_document().model_dump())
    assert sent["speculation"] == {"accept_length": None, "verify_tokens": None, "mean_verify_tokens": None}
    assert sent["probe"]["accept_length"] is None
