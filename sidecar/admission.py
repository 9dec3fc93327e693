"""Admission: may this flip run? The whole gate in one place: the criteria for validate and for on (each a
Criterion whose verdict follows from its operator), force, and the verdict with its answer to POST /mode.

`off` (the kill switch) and `standby` (Triton serves, kdtree idle: the live remedy) are never gated. Parity values
may be non-finite (+inf where the reference is all zeros, NaN from a broken output): every comparison with NaN is
false, so a non-finite value is checked for by name and refuses the gate, never passes it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from pydantic import BaseModel, Field, StrictBool

from kdtree.config import FP8_PARITY_RTOL, LIVE_MODES, Mode
from kdtree.state.rank_records import RankRecord, RankView

from .metrics import Metrics
from .rank_evidence import live_records
from .readiness import Readiness
from .server_control import ServerControl
from .settings import SidecarSettings
from .store import SidecarState, Store, Transition
from .vocabulary import Method

REASON_MAX = 500  # characters of `reason` a request may carry (it goes into the audit log and the logs)


class ModeRequest(BaseModel):
    """POST /mode's body. Flags take JSON booleans only: a string such as "yes" is refused (422), never truthy."""

    model_config = {"extra": "forbid"}

    mode: Mode
    dry_run: StrictBool = False
    force: StrictBool = False
    restart: StrictBool = False  # restart the server even where a live switch would do
    reason: str = Field("", max_length=REASON_MAX)


class Criterion(BaseModel):
    """One condition of a gate: passed when `value <op> threshold` (op: ==, >= or <=) holds."""

    name: str
    value: float | int | bool | None
    op: str
    threshold: float | int | bool | None
    passed: bool
    detail: str = ""


NON_FINITE_CHECKED = ("max_rel_l2", "max_abs_err", "rtol")  # the parity fields that are floats


def non_finite_parity(records: Iterable[RankRecord]) -> list[str]:
    """Each non-finite parity value, named: "rank 1: max_rel_l2 is nan"."""
    return [
        f"rank {r.tp_rank}: {name} is {value}"
        for r in records
        for name in NON_FINITE_CHECKED
        if not math.isfinite(value := getattr(r.parity, name))
    ]


def fp8_bound(record) -> float | None:
    """validate's bound for the fp8 KV pool a rank read (kdtree.config.FP8_PARITY_RTOL, by the dtype its record's
    `verify_inputs` name); None when its pool is not fp8. On an fp8 pool the original (SGLang's Triton kernel) runs fp8
    math and kdtree widens the pool exactly, so the two differ by Triton's own fp8 error, a few percent
    (kernel_build/NOTES.md, "fp8 pools")."""
    pools = {
        str(d["kv_pool"][0])
        for d in record.verify_inputs.values()
        if isinstance(d, dict) and d.get("kv_pool")
    }
    bounds = [FP8_PARITY_RTOL[p] for p in pools if p in FP8_PARITY_RTOL]
    return max(bounds) if bounds else None


def gate_to_on(
    settings: SidecarSettings, views: list[RankView], server_ready: bool, ready_detail: str
) -> list[Criterion]:
    """The criteria for switching to `on`, each with its value, threshold and verdict."""
    live = live_records(settings, views).values()
    in_validate = [r for r in live if r.mode == Mode.VALIDATE.value and r.installed]
    want = settings.expected_tp_size
    all_there = len(in_validate) == want and want > 0
    min_calls = min((r.parity.calls_compared for r in in_validate), default=0)
    rels = [r.parity.max_rel_l2 for r in in_validate]
    # max() skips a NaN that is not first: NaN is the value whenever a rank has one.
    max_rel = math.nan if any(math.isnan(x) for x in rels) else max(rels, default=None)
    fp8 = [b for b in (fp8_bound(r) for r in in_validate) if b is not None]
    rel_bound = max([settings.gate_max_rel_err, *fp8])
    fp8_detail = (
        f"an fp8 KV cache: the bound is the larger of KDTREE_GATE_MAX_REL_ERR and validate's for its dtype ({max(fp8):g})"
        if fp8
        else ""
    )
    non_finite = non_finite_parity(in_validate)
    nan_inf = sum(r.parity.nan_inf for r in in_validate)
    over_tol = sum(r.parity.calls_over_tol for r in in_validate)
    missing = sorted(set(range(want)) - {r.tp_rank for r in in_validate})
    if want == 0:
        ranks_detail = "KDTREE_EXPECTED_TP_SIZE=0: no rank evidence is read, so the gate cannot pass"
    else:
        ranks_detail = f"ranks without a live, installed validate record: {missing}" if missing else ""
    # Parity numbers only count when every rank is in validate: a partial picture is no evidence.
    no_evidence = "" if all_there else "not every rank reports validate mode"
    return [
        Criterion(
            name="server_ready",
            value=server_ready,
            op="==",
            threshold=True,
            passed=server_ready,
            detail=ready_detail,
        ),
        Criterion(
            name="ranks_in_validate",
            op="==",
            value=len(in_validate),
            threshold=want,
            passed=all_there,
            detail=ranks_detail,
        ),
        Criterion(
            name="min_calls_compared",
            op=">=",
            value=min_calls,
            threshold=settings.gate_min_calls,
            detail=no_evidence,
            passed=all_there and min_calls >= settings.gate_min_calls,
        ),
        Criterion(
            name="max_rel_err",
            op="<=",
            value=max_rel,
            threshold=rel_bound,
            detail="; ".join(x for x in (no_evidence, *non_finite, fp8_detail) if x),
            passed=all_there and not non_finite and max_rel is not None and max_rel <= rel_bound,
        ),
        Criterion(
            name="nan_inf",
            op="<=",
            value=nan_inf,
            threshold=settings.gate_max_nan_inf,
            detail=no_evidence,
            passed=all_there and nan_inf <= settings.gate_max_nan_inf,
        ),
        Criterion(
            name="calls_over_tol",
            op="<=",
            value=over_tol,
            threshold=settings.gate_max_calls_over_tol,
            detail=no_evidence,
            passed=all_there and over_tol <= settings.gate_max_calls_over_tol,
        ),
    ]


class Admission:
    """Decides a POST /mode request: nothing to do, refused (the gate failed, no server control), or accepted, with
    the transition it starts made active in `state`."""

    def __init__(
        self,
        settings: SidecarSettings,
        server: ServerControl | None,
        metrics: Metrics,
        store: Store,
        state: SidecarState,
        readiness: Readiness,
    ):
        self.settings = settings
        self.server = server
        self.metrics = metrics
        self.store = store
        self.state = state
        self.readiness = readiness

    async def evaluate(self, req: ModeRequest) -> tuple[int, dict, Transition | None]:
        """The answer to a request, and the transition it starts (made active here) when it is accepted."""
        current = self.state.current_mode
        target = req.mode
        snap = await self.readiness.read_volume()
        method = self._method(current, target, req.restart, snap.views if snap else [])
        base = {
            "from_mode": current,
            "to_mode": target,
            "method": method,
            "dry_run": req.dry_run,
            "force": req.force,
        }
        # Nothing to do only when the mode file agrees: when it says another mode (a rollback could not write
        # it back) the ranks follow it, and a transition to the same mode rewrites it.
        agrees = snap is not None and snap.mode_file_error is None and snap.mode_file in (None, current)
        if target == current and agrees:
            return (
                200,
                {**base, "changed": False, "detail": f"the server already runs in mode {current}"},
                None,
            )
        criteria = await self._criteria(target)
        passed = all(c.passed for c in criteria)
        allowed = passed or req.force
        body = {
            **base,
            "allowed": allowed,
            "gate_passed": passed,
            "criteria": [c.model_dump() for c in criteria],
        }
        if req.dry_run:
            return 200, body, None
        if not allowed:
            self.metrics.gate_refusals.labels(to_mode=target.value).inc()
            failed = ", ".join(c.name for c in criteria if not c.passed)
            self.store.audit(
                "refused", None, from_mode=current, to_mode=target, failed=failed, reason=req.reason
            )
            return (
                412,
                {
                    **body,
                    "error": f"the gate to {target} failed: {failed}; nothing changed "
                    "(fix the evidence, or pass force to override, which is audited)",
                },
                None,
            )
        if method == Method.RESTART and self.server is None:
            return (
                503,
                {
                    **body,
                    "error": "this change needs a server restart and the sidecar has no server control: with "
                    "KDTREE_SERVER_CONTROL=docker, set KDTREE_SERVER_CONTAINER and mount the Docker socket "
                    "(or use KDTREE_SERVER_CONTROL=process)",
                },
                None,
            )
        t = Transition(
            from_mode=current,
            to_mode=target,
            method=method,
            reason=req.reason,
            force=req.force,
            gate=[c.model_dump() for c in criteria],
        )
        self.state.active = t
        if req.force:  # loud whether or not the gate would have passed: someone chose to skip it
            self.store.audit(
                "FORCED",
                t,
                logging.WARNING,
                reason=req.reason,
                failed=[c.name for c in criteria if not c.passed],
                warning="the gate was skipped by force",
            )
        body = {**body, "accepted": True, "transition": t.model_dump()}
        if req.force and not passed:
            body["warning"] = "FORCED: the gate failed and was skipped; this is recorded in the audit log"
        return 202, body, t

    def _method(self, current: Mode, target: Mode, restart: bool, views: list[RankView]) -> Method:
        """live when both modes are live modes and every expected rank says it can switch to the target."""
        if (
            restart
            or current not in LIVE_MODES
            or target not in LIVE_MODES
            or not self.settings.expected_tp_size
        ):
            return Method.RESTART
        records = live_records(self.settings, views)
        able = all(
            r in records and target.value in records[r].live_modes
            for r in range(self.settings.expected_tp_size)
        )
        return Method.LIVE if able else Method.RESTART

    async def _criteria(self, target: Mode) -> list[Criterion]:
        if target in (Mode.OFF, Mode.STANDBY):
            return []  # the kill switch and the live remedy (Triton serves, kdtree idle) are never gated
        a = await self.readiness.assess(
            fresh=True
        )  # a probe of its own: a flip that could not bake is not started
        detail = "; ".join(a.reasons)
        if target == Mode.VALIDATE:
            up = a.probe is not None and a.probe.ok
            return [Criterion(name="server_up", value=up, op="==", threshold=True, passed=up, detail=detail)]
        # Not a.ready: a mode file that disagrees is what this transition rewrites; a failed write still refuses.
        ready = a.server_ready and self.readiness.volume.problem is None
        return gate_to_on(self.settings, a.ranks.ranks, ready, detail)
