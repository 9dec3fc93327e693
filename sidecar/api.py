"""The documents of the sidecar's API, typed (POST /mode's body and every answer): the sidecar builds them, kdtreectl parses them (one reading
of each). Pydantic only (no FastAPI): kdtreectl imports this module.

The JSON on the wire is each model's dump: the same keys and values as the API has always sent. A POST /mode answer
carries only the fields its case sets (model_dump(exclude_unset=True)), as before.
"""

from __future__ import annotations

import asyncio
import math
import operator
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, field_validator, model_validator

from kdtree.config import Mode
from kdtree.state.rank_records import RankView

from .probe import HealthResult, ProbeResult
from .server_control import ServerControl, ServerControlError, ServerMissing, ServerState
from .server_log import LogMarker
from .store import DesiredHold, Transition
from .vocabulary import Condition, DesiredState, Method, Phase

# ---- POST /mode ----------------------------------------------------------------------------------------------

Op = Literal["==", ">=", "<="]
_COMPARE = {"==": operator.eq, ">=": operator.ge, "<=": operator.le}


def holds(value: float | int | bool | None, op: Op, threshold: float | int | bool | None) -> bool:
    """`value <op> threshold`; False when either is missing or not a number (NaN compares false either way)."""
    if value is None or threshold is None:
        return False
    if isinstance(value, float) and math.isnan(value):
        return False
    return bool(_COMPARE[op](value, threshold))


class Criterion(BaseModel):
    """One condition of a gate: passed only when `value <op> threshold` holds (and, for `check`, the evidence is
    complete). A criterion that says it passed while its own comparison does not hold is refused at construction,
    so its text and its verdict cannot disagree."""

    name: str
    value: float | int | bool | None
    op: Op
    threshold: float | int | bool | None
    passed: bool
    detail: str = ""

    @model_validator(mode="after")
    def _verdict_follows_the_comparison(self) -> Criterion:
        if self.passed and not holds(self.value, self.op, self.threshold):
            raise ValueError(
                f"criterion {self.name} says passed, but {self.value} {self.op} {self.threshold} does not hold"
            )
        return self

    @classmethod
    def check(
        cls,
        name: str,
        value: float | int | bool | None,
        op: Op,
        threshold: float | int | bool | None,
        detail: str = "",
        *,
        evidence: bool = True,
    ) -> Criterion:
        """The criterion with its verdict computed from its operator: passed iff `evidence` (the picture is whole)
        and `value <op> threshold`."""
        passed = evidence and holds(value, op, threshold)
        return cls(name=name, value=value, op=op, threshold=threshold, passed=passed, detail=detail)


REASON_MAX = 500  # characters of `reason` a request may carry (it goes into the audit log and the logs)


class ModeRequest(BaseModel):
    """POST /mode's body. Flags take JSON booleans only: a string such as "yes" is refused (422), never truthy."""

    model_config = {"extra": "forbid"}

    mode: Mode
    dry_run: StrictBool = False
    force: StrictBool = False
    restart: StrictBool = False  # restart the server even where a live switch would do
    reason: str = Field("", max_length=REASON_MAX)

    @field_validator("reason")
    @classmethod
    def _one_printable_line(cls, v: str) -> str:
        if not v.isprintable():  # it is shown by /status, kdtreectl and the logs: no line breaks or escapes
            raise ValueError("printable characters only (no line breaks, tabs or control characters)")
        return v


class ModeAnswer(BaseModel):
    """POST /mode's answer. Which fields are there depends on the case: nothing to do (changed, detail), a dry run
    or a refusal (allowed, gate_passed, criteria; error), accepted (accepted, transition; warning when forced past a
    failed gate), busy (error, transition)."""

    from_mode: Mode | None = None
    to_mode: Mode | None = None
    method: Method | None = None
    dry_run: bool | None = None
    force: bool | None = None
    changed: bool | None = None
    detail: str | list | None = None  # a list: FastAPI's 422 names each field
    allowed: bool | None = None
    gate_passed: bool | None = None
    criteria: list[Criterion] = []
    error: str | None = None
    accepted: bool | None = None
    # a Transition whenever it reads as one; a dict ({"step": "evaluating the gate"}) while a request is decided
    transition: Transition | dict[str, Any] | None = Field(None, union_mode="left_to_right")
    warning: str | None = None

    def wire(self) -> dict:
        """The JSON body: the fields this case set, nothing else."""
        return {k: v for k, v in self.model_dump().items() if k in self.model_fields_set}


# ---- GET /status ---------------------------------------------------------------------------------------------


class ServerView(BaseModel):
    """What the server control answered (/status: "container", whatever the control)."""

    state: ServerState | None = None
    error: str | None = None
    missing: bool = False  # the control answered: there is no server (no such container, no start yet)

    @classmethod
    async def inspect(cls, server: ServerControl | None) -> ServerView:
        """Ask the control (on a thread: Docker or the process table) and keep its answer or its error."""
        if server is None:  # docker control with no container named (sidecar.app.server_control)
            return cls(error="no server container configured (set KDTREE_SERVER_CONTAINER)")
        try:
            return cls(state=await asyncio.to_thread(server.inspect))
        except ServerControlError as e:
            return cls(error=str(e), missing=isinstance(e, ServerMissing))


class ModeStatus(BaseModel):
    current: Mode  # the mode the sidecar last settled on
    expected_now: Mode  # the mode the server should be in now (a running transition decides)
    desired_file: str | None  # what the mode file says ("unreadable: ...", "unread: ..."), None without one


class VolumeProblemReport(BaseModel):
    """volume.VolumeProblem with its fix spelled out."""

    operation: str
    path: str
    errno: str
    strerror: str
    uid: int
    at: float
    fix: str


class StateVolumeStatus(BaseModel):
    path: str
    problem: VolumeProblemReport | None = None


class LogStatus(BaseModel):
    latest_marker: LogMarker | None = None
    crash_excerpt: list[str] = []
    error: str | None = None


DESIRED_MODE_ANNOTATION = "kdtree.dev/desired-mode"  # the pod annotation the desired-mode file projects


class DesiredModeStatus(BaseModel):
    """The desired mode the cluster holds (KDTREE_DESIRED_MODE_FILE) and what the sidecar did about it."""

    file: str
    state: DesiredState
    content: str | None = None  # the file's text as read (absent or empty: None)
    generation: str | None = None  # its content hash: a changed value is a new intent
    mode: Mode | None = None  # the mode it names, when it names one
    detail: str = ""  # why the state is what it is, for people
    hold: DesiredHold | None = None  # the value not acted on again until it changes
    transition: str | None = None  # the transition the sidecar started for it (its id in `transitions`)
    events: str = (
        ""  # whether what the sidecar does is also posted as Kubernetes Events on the pod, and why not
    )


class SpeculationStatus(BaseModel):
    """What speculative decoding does on the server: the tokens a verify step gave the latest probe (SGLang's accept
    length: completion tokens over verify steps) and the tokens one verify reads a request (the draft tree's size,
    N: DDTREE's budget + 1), from the ranks' records of the verify calls they saw; under DDTREE's auto budget, the
    tokens it verified a request on average."""

    accept_length: float | None = None
    verify_tokens: int | None = None
    # DDTREE's auto budget: tokens it verified a request on average (of verify_tokens captured), from rank 0's record
    mean_verify_tokens: float | None = None


class StatusDocument(BaseModel):
    """GET /status."""

    phase: Phase
    server_phase: Phase
    ready: bool
    condition: Condition
    condition_evidence: list[str]
    reasons: list[str]
    notes: list[str]
    mode: ModeStatus
    state_volume: StateVolumeStatus
    container: ServerView
    log: LogStatus
    probe: ProbeResult | None
    probe_failures_in_a_row: int
    server_health: HealthResult | None
    ranks: list[RankView]
    rank_problems: list[str]
    expected_tp_size: int
    active_transition: Transition | None
    transitions: list[Transition]
    group: list[dict[str, Any]] | None = (
        None  # a group's leader: each node, its ranks and problems (sidecar/group_leader.py)
    )
    desired_mode: DesiredModeStatus | None = None  # None: KDTREE_DESIRED_MODE_FILE is unset
    speculation: SpeculationStatus = Field(default_factory=SpeculationStatus)


# ---- GET /gate -----------------------------------------------------------------------------------------------


class GateVerdict(BaseModel):
    """GET /gate: the gate's verdict for a flip to `to_mode`, read-only (nothing is flipped). `pass` is what Argo
    Rollouts' web metric reads (jsonPath "{$.pass}", successCondition "result == true"); POST /gate answers the
    same body with 200 when it passes and 412 when it does not, for Flagger's webhooks."""

    model_config = {"populate_by_name": True}

    passed: bool = Field(alias="pass")
    from_mode: Mode
    to_mode: Mode
    failed: list[str]  # the names of the criteria that did not pass
    criteria: list[Criterion]
    detail: str = ""  # what to do when it does not pass (a server that is down)
