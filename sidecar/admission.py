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

from kdtree.config import LIVE_MODES, Mode
from kdtree.state.rank_records import RankRecord, RankView

from .api import Criterion, ModeAnswer, ModeRequest
from .metrics import Metrics
from .probe import REFUSED
from .rank_evidence import fp8_bound, live_records
from .readiness import Assessment, Readiness
from .server_control import ServerControl
from .settings import SidecarSettings
from .store import SidecarState, Store, Transition
from .vocabulary import Method, Phase

NON_FINITE_CHECKED = ("max_rel_l2", "max_abs_err", "rtol")  # the parity fields that are floats


def non_finite_parity(records: Iterable[RankRecord]) -> list[str]:
    """Each non-finite parity value, named: "rank 1: max_rel_l2 is nan"."""
    return [
        f"rank {r.tp_rank}: {name} is {value}"
        for r in records
        for name in NON_FINITE_CHECKED
        if not math.isfinite(value := getattr(r.parity, name))
    ]


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
        Criterion.check("server_ready", server_ready, "==", True, ready_detail),
        Criterion.check("ranks_in_validate", len(in_validate), "==", want, ranks_detail, evidence=want > 0),
        Criterion.check(
            "min_calls_compared", min_calls, ">=", settings.gate_min_calls, no_evidence, evidence=all_there
        ),
        Criterion.check(
            "max_rel_err",
            max_rel,
            "<=",
            rel_bound,
            "; ".join(x for x in (no_evidence, *non_finite, fp8_detail) if x),
            evidence=all_there and not non_finite,
        ),
        Criterion.check("nan_inf", nan_inf, "<=", settings.gate_max_nan_inf, no_evidence, evidence=all_there),
        Criterion.check(
            "calls_over_tol",
            over_tol,
            "<=",
            settings.gate_max_calls_over_tol,
            no_evidence,
            evidence=all_there,
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

    async def evaluate(self, req: ModeRequest) -> tuple[int, ModeAnswer, Transition | None]:
        """The answer to a request, and the transition it starts (made active here) when it is accepted."""
        current = self.state.current_mode
        target = req.mode
        # The kill switch answers at once: it reads the workers' latest reports, not theirs now (a silent worker
        # would hold the answer for its whole deadline); its transition writes to every node and owes the silent.
        snap = await self.readiness.read_volume(workers=target != Mode.OFF)
        method = self._method(current, target, req.restart, snap.views if snap else [])
        answer = ModeAnswer(
            from_mode=current, to_mode=target, method=method, dry_run=req.dry_run, force=req.force
        )
        # Nothing to do only when the mode file agrees, and in a group every worker's: when one says another mode
        # (a rollback could not write it back, a debt to a node the leader's sidecar could not read back) the ranks
        # follow it, and a transition to the same mode rewrites it.
        agrees = (
            snap is not None
            and snap.mode_file_error is None
            and snap.mode_file in (None, current)
            and all(says in (None, current.value) for says in snap.node_mode_files.values())
        )
        if target == current and agrees:
            answer.changed, answer.detail = False, f"the server already runs in mode {current}"
            return 200, answer, None
        # The mode it runs in, asked again while a mode file disagrees: a repair, not gated. The gate let this mode in
        # once, and a gate to `on` (every rank in validate) would refuse exactly the disagreement it repairs.
        repair = target == current
        criteria, down = ([], None) if repair else await self._criteria(target)
        passed = all(c.passed for c in criteria)
        answer.allowed, answer.gate_passed, answer.criteria = passed or req.force, passed, criteria
        if req.dry_run:
            return 200, answer, None
        if not answer.allowed:
            self.metrics.gate_refusals.labels(to_mode=target.value).inc()
            failed = ", ".join(c.name for c in criteria if not c.passed)
            self.store.audit(
                "refused", None, from_mode=current, to_mode=target, failed=failed, reason=req.reason
            )
            answer.error = f"the gate to {target} failed: {failed}; nothing changed " + (
                f"({down})" if down else "(fix the evidence, or pass force to override, which is audited)"
            )
            return 412, answer, None
        if method == Method.RESTART and self.server is None:
            answer.error = (
                "this change needs a server restart and the sidecar has no server control: with "
                "KDTREE_SERVER_CONTROL=docker, set KDTREE_SERVER_CONTAINER and mount the Docker socket "
                "(or use KDTREE_SERVER_CONTROL=process)"
            )
            return 503, answer, None
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
        answer.accepted, answer.transition = True, t.model_copy()
        if req.force and not passed:
            answer.warning = "FORCED: the gate failed and was skipped; this is recorded in the audit log"
        return 202, answer, t

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

    async def gate_verdict(self, target: Mode) -> tuple[list[Criterion], str | None]:
        """GET /gate: the criteria for `target` from the background probe's latest verdict (no probe of its own)."""
        return await self._criteria(target, fresh=False)

    async def _criteria(self, target: Mode, fresh: bool = True) -> tuple[list[Criterion], str | None]:
        """The gate's criteria for `target`, and, when the server is down, what to do about that (a refusal then
        names the down server and how to start it, not the evidence). fresh=False (GET /gate, read-only and
        unauthenticated): the background probe's latest verdict, so that polling it sends no completion."""
        if target in (Mode.OFF, Mode.STANDBY):
            return (
                [],
                None,
            )  # the kill switch and the live remedy (Triton serves, kdtree idle) are never gated
        a = await self.readiness.assess(
            fresh=fresh
        )  # a probe of its own: a flip that could not bake is not started
        detail = "; ".join(a.reasons)
        down = server_down(a)
        if target == Mode.VALIDATE:
            up = a.probe is not None and a.probe.ok
            return [Criterion.check("server_up", up, "==", True, detail)], down
        # Not a.ready: a mode file that disagrees is what this transition rewrites; a failed write still refuses.
        ready = a.server_ready and self.readiness.volume.problem is None
        return gate_to_on(self.settings, a.ranks.ranks, ready, detail), down


START_THE_SERVER = (
    "start it: `docker compose up -d` (`docker compose logs server` says why it stopped; under Kubernetes the "
    "kubelet restarts it, `kubectl logs POD -c server` says why); `kdtreectl status` shows its crash excerpt; "
    "then ask again"
)


def server_down(a: Assessment) -> str | None:
    """How the server is down (crashed, not there, its port closed) or not up yet, with what to do; None when it
    answers: then the refusal is about the evidence."""
    state = a.server.state
    if state is not None and state.crashed:
        why = f"the server is down ({state.status}, exit code {state.exit_code})"
    elif a.server.missing:
        why = "the server is down (not started: no server process or container)"
    elif a.probe is not None and a.probe.reason == REFUSED:
        if a.server_phase == Phase.LOADING:
            return "the server is still loading (its port opens once it can serve): `kdtreectl wait`, then ask again"
        why = "the server is down (its port refuses connections)"
    else:
        return None
    return f"{why}: no evidence can pass until it serves; {START_THE_SERVER}"
