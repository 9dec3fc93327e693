"""The sidecar's state machine: what phase the server is in, and the gated, self-reverting mode flip.

A flip runs as one background task, one at a time, by one of two methods:
  live     (between validate, on and standby, when every rank can): write KDTREE_STATE_DIR/mode -> every rank
           switches on its own and confirms in its record (KDTREE_LIVE_FLIP_TIMEOUT_S) -> bake -> done.
  restart  (to or from off, or asked for): write the mode file -> restart the server -> wait for readiness in
           the new mode -> bake -> done.
The bake is N consecutive good probes, every rank in the new mode, no rank error, and evidence that kdtree did
the new mode's work on every rank: verify calls served (on) or compared (validate), no new fallback.
Any failure rolls back to the previous mode: live when the flip was live (by restart if that fails too), else
by restart. Each step is persisted before it is taken, so a sidecar that stops mid-way resolves the transition
on its next start.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pydantic import BaseModel, Field, StrictBool
from tenacity import AsyncRetrying, retry_if_result, stop_after_delay, wait_exponential

from kdtree.config import LIVE_MODES, Mode
from kdtree.control import read_desired_mode, write_desired_mode

from .docker_control import ContainerMissing, ContainerState, DockerError, ServerControl
from .evidence import LogMarker, crash_excerpt, latest_marker
from .gate import Criterion, RankCheck, bake_evidence, check_ranks, gate_to_on, live_records
from .metrics import Metrics
from .probe import HTTP_STATUS, REFUSED, TIMEOUT, Prober, ProbeResult, SingleFlight
from .settings import SidecarSettings
from .store import SidecarState, Store, Transition

log = logging.getLogger("kdtree.sidecar")


class ContainerView(BaseModel):
    state: ContainerState | None = None
    error: str | None = None
    missing: bool = False  # Docker answered: there is no such container


class Assessment(BaseModel):
    phase: str  # what /status reports (a running transition overrides the server's own phase)
    server_phase: str  # what the server itself looks like
    ready: bool
    # ready | not_ready_yet (starting within its budget, or a transition runs) | broken (needs someone)
    condition: str
    condition_evidence: list[str]
    reasons: list[str]
    mode: Mode  # the mode the server is expected to run in right now
    probe: ProbeResult | None
    container: ContainerView
    ranks: RankCheck


REASON_MAX = 500  # characters of `reason` a request may carry (it goes into the audit log and the logs)


class ModeRequest(BaseModel):
    """POST /mode's body. Flags take JSON booleans only: a string such as "yes" is refused (422), never truthy."""

    model_config = {"extra": "forbid"}

    mode: Mode
    dry_run: StrictBool = False
    force: StrictBool = False
    restart: StrictBool = False  # restart the server even where a live switch would do
    reason: str = Field("", max_length=REASON_MAX)


class StepFailed(Exception):
    pass


class Controller:
    def __init__(self, settings: SidecarSettings, server: ServerControl | None, metrics: Metrics):
        self.settings = settings
        self.server = server
        self.metrics = metrics
        self.store = Store(settings.state_dir, settings.history_limit)
        self.state: SidecarState = self.store.load(read_desired_mode(settings.state_dir) or settings.verify)
        self.prober = Prober(
            settings.server_url,
            settings.probe_prompt,
            settings.probe_max_tokens,
            settings.probe_deadline_s,
            settings.served_model_name,
        )
        self.prober.on_result = self._observe_probe
        self.container_flight: SingleFlight[ContainerView] = SingleFlight(self._inspect)
        self._claimed = False  # a transition is being evaluated or run; checked and set without awaiting
        self._task: asyncio.Task | None = None
        metrics.mode.state(self.state.current_mode.value)

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve a transition that a previous sidecar left unfinished, or adopt a mode file written while no
        sidecar ran (the kill switch by hand: README, "Reaching off when the sidecar is down")."""
        t = self.state.active
        if t is None:
            try:
                written = read_desired_mode(self.settings.state_dir)
            except ValueError:
                written = None  # /status names an unreadable file
            if written is not None and written != self.state.current_mode:
                self.store.audit("mode_file_adopted", None, logging.WARNING, from_mode=self.state.current_mode,
                                 to_mode=written, detail="the mode file changed while no sidecar ran")  # fmt: skip
                self.state.current_mode = written
                self.store.save(self.state)
                self.metrics.mode.state(written.value)
            return
        t.interrupted = True
        self.store.audit("interrupted_transition_found", t, logging.WARNING, step=t.step)
        if t.step in ("accepted", "writing_mode"):
            # The server was not restarted: putting the mode file back is the whole resolution.
            write_desired_mode(self.settings.state_dir, t.from_mode)
            t.failure = t.failure or f"the sidecar stopped at step {t.step}, before the server was restarted"
            self._finish(t, "aborted")
            return
        if self.server is None or (await self._inspect()).missing:
            # No server container (a stack coming back up): it will start from the restored mode file.
            write_desired_mode(self.settings.state_dir, t.from_mode)
            t.failure = t.failure or (
                f"the sidecar stopped at step {t.step}; the server container is gone, and the mode file is "
                f"back at {t.from_mode.value} for its next start"
            )
            self._finish(t, "aborted")
            return
        t.failure = t.failure or f"the sidecar stopped at step {t.step}; the server's mode is unverified"
        self._claimed = True
        self._task = asyncio.create_task(self._rollback_and_finish(t))

    async def stop(self) -> None:
        """Stop a running transition; its persisted state makes the next start resolve it."""
        if self._task and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    # ---- observation -----------------------------------------------------------------------------

    def _observe_probe(self, result: ProbeResult) -> None:
        self.metrics.probe_duration.observe(result.latency_s)
        if not result.ok:
            self.metrics.probe_failures.labels(reason=result.reason).inc()

    async def _inspect(self) -> ContainerView:
        if self.server is None:
            return ContainerView(error="no server container configured (set KDTREE_SERVER_CONTAINER)")
        try:
            return ContainerView(state=await asyncio.to_thread(self.server.inspect))
        except DockerError as e:
            return ContainerView(error=str(e), missing=isinstance(e, ContainerMissing))

    def expected_mode(self) -> Mode:
        """The mode the server should be in now (by a transition still running, or the settled one)."""
        t = self.state.active
        if t is None or t.step == "accepted" or (t.method == "restart" and t.step == "writing_mode"):
            return self.state.current_mode
        return t.from_mode if t.step == "rolling_back" else t.to_mode

    def expected_modes(self) -> set[Mode]:
        """The modes the ranks may report now: both ends while a live switch runs (each rank switches on its own)."""
        t = self.state.active
        if t is not None and t.method == "live" and t.step != "accepted":
            return {t.from_mode, t.to_mode}
        return {self.expected_mode()}

    async def assess(
        self, max_age: float | None = None, mode: Mode | None = None, started_after: float | None = None
    ) -> Assessment:
        s = self.settings
        max_age = s.probe_ttl_s if max_age is None else max_age
        modes = {mode} if mode else self.expected_modes()
        mode = mode or self.expected_mode()
        probe, container = await asyncio.gather(
            self.prober.get(max_age),
            self.container_flight.get(max(max_age, 1.0), wait=s.probe_deadline_s),
        )
        container = container or ContainerView(error=f"Docker did not answer within {s.probe_deadline_s:g}s")
        if s.expected_tp_size:
            ranks = check_ranks(s, modes, started_after)
        else:
            ranks = RankCheck(ok=True, problems=[], ranks=[])
        server_phase = self._server_phase(probe, container.state, ranks)
        reasons = []
        if probe is None:
            reasons.append(f"the probe did not finish within {s.probe_deadline_s:g}s")
        elif not probe.ok:
            reasons.append(f"probe failed ({probe.reason}): {probe.detail}")
        if container.state and container.state.crashed:
            reasons.append(
                f"server container is {container.state.status} (exit code {container.state.exit_code}, "
                f"OOMKilled {container.state.oom_killed})"
            )
        reasons += ranks.problems
        t = self.state.active
        if t is None:
            phase = server_phase
        elif t.step == "rolling_back":
            phase = "rolling_back"
        else:
            phase = "switching" if t.method == "live" else "restarting"
        self.metrics.phase.state(phase)
        ready = not reasons
        condition, evidence = self._condition(ready, container.state)
        self.metrics.condition.state(condition)
        return Assessment(
            phase=phase,
            server_phase=server_phase,
            ready=ready,
            condition=condition,
            condition_evidence=evidence,
            reasons=reasons,
            mode=mode,
            probe=probe,
            container=container,
            ranks=ranks,
        )

    def _condition(self, ready: bool, c: ContainerState | None) -> tuple[str, list[str]]:
        """Whether a server that is not ready will get there by itself (not_ready_yet) or needs someone
        (broken), with the facts behind the verdict. Unlike the phase, it does not depend on what happened
        before the server's latest start."""
        if ready:
            return "ready", []
        t = self.state.active
        if t is not None:
            return "not_ready_yet", [
                f"a {t.method} transition {t.from_mode} -> {t.to_mode} is at step {t.step}"
            ]
        if c is not None and c.crashed:
            return "broken", [f"the server process is {c.status} (exit code {c.exit_code})"]
        started = c.started_at if c is not None else None
        if started is None:
            return "not_ready_yet", [
                "the server's start time is unknown (no server control, or no start yet)"
            ]
        now, budget = time.time(), self.settings.ready_timeout_s
        ok_at = self.prober.last_ok_at
        if ok_at is not None and ok_at > started:
            return "broken", [
                f"it answered a completion {now - ok_at:.0f}s ago, {ok_at - started:.0f}s after its latest start, "
                "and fails now"
            ]
        if now - started > budget:
            return "broken", [
                f"started {now - started:.0f}s ago and never ready (KDTREE_READY_TIMEOUT_S={budget:g})"
            ]
        return "not_ready_yet", [
            f"started {now - started:.0f}s ago and not ready yet (KDTREE_READY_TIMEOUT_S={budget:g})"
        ]

    def _server_phase(
        self, probe: ProbeResult | None, container: ContainerState | None, ranks: RankCheck
    ) -> str:
        if container is not None:
            if container.crashed:
                return "crashed"
            if container.status == "created":
                return "starting"
        if probe is None:
            return "starting"
        if probe.ok:
            return "ready" if ranks.ok else "degraded"
        started = (container.started_at if container else None) or 0.0
        served_since_start = self.prober.last_ok_at is not None and self.prober.last_ok_at > started
        if probe.reason == REFUSED:
            # SGLang keeps its port closed until weights and CUDA graphs are in place; after serving, a closed
            # port means it stopped answering.
            return "degraded" if served_since_start and container is not None else "loading"
        since = max(self.prober.last_refused_at or 0.0, started)
        served_since_start = self.prober.last_ok_at is not None and self.prober.last_ok_at > since
        answering_busy = probe.reason == TIMEOUT or (probe.reason == HTTP_STATUS and probe.status_code == 503)
        if answering_busy and not served_since_start:
            return "warming"  # the port is open, the first completions are not through yet
        return "degraded"

    async def status(self) -> dict:
        a = await self.assess()
        marker: LogMarker | None = None
        excerpt: list[str] = []
        log_error = None
        c = a.container.state
        if self.server is not None and c is not None:
            try:
                text = await asyncio.wait_for(
                    asyncio.to_thread(self.server.logs, self.settings.log_tail_lines, c.started_at),
                    self.settings.probe_deadline_s,
                )
                marker = latest_marker(text)
                if c.crashed or a.phase == "crashed":
                    excerpt = crash_excerpt(text)
            except (DockerError, TimeoutError) as e:
                log_error = str(e) or "reading the logs timed out"
        return {
            "phase": a.phase,
            "server_phase": a.server_phase,
            "ready": a.ready,
            "condition": a.condition,
            "condition_evidence": a.condition_evidence,
            "reasons": a.reasons,
            "mode": {
                "current": self.state.current_mode,
                "expected_now": a.mode,
                "desired_file": self._desired_file(),
            },
            "container": a.container.model_dump(),
            "log": {
                "latest_marker": marker.model_dump() if marker else None,
                "crash_excerpt": excerpt,
                "error": log_error,
            },
            "probe": a.probe.model_dump() if a.probe else None,
            "ranks": [v.model_dump() for v in a.ranks.ranks],
            "rank_problems": a.ranks.problems,
            "expected_tp_size": self.settings.expected_tp_size,
            "active_transition": self.state.active.model_dump() if self.state.active else None,
            "transitions": [t.model_dump() for t in self.state.history[-10:]],
        }

    def _desired_file(self) -> str | None:
        try:
            m = read_desired_mode(self.settings.state_dir)
        except ValueError as e:
            return f"unreadable: {e}"
        return m.value if m else None

    # ---- the mode switch ---------------------------------------------------------------------------

    async def request_mode(self, req: ModeRequest) -> tuple[int, dict]:
        """Evaluate and, when allowed, start a transition. Returns (HTTP status, body)."""
        if not req.dry_run:
            if self._claimed:
                active = self.state.active
                return 409, {
                    "error": "a mode transition is already running; retry when it has finished",
                    "transition": active.model_dump() if active else {"step": "evaluating the gate"},
                }
            self._claimed = True  # no await since the check: concurrent requests cannot both get here
        try:
            status, body = await self._evaluate_and_start(req)
        except BaseException:
            if not req.dry_run:
                self._claimed = False
            raise
        if not req.dry_run and status != 202:
            self._claimed = False
        return status, body

    def _method(self, current: Mode, target: Mode, restart: bool) -> str:
        """live when both modes are live modes and every expected rank says it can switch to the target."""
        if (
            restart
            or current not in LIVE_MODES
            or target not in LIVE_MODES
            or not self.settings.expected_tp_size
        ):
            return "restart"
        records = live_records(self.settings)
        able = all(
            r in records and target.value in records[r].live_modes
            for r in range(self.settings.expected_tp_size)
        )
        return "live" if able else "restart"

    async def _evaluate_and_start(self, req: ModeRequest) -> tuple[int, dict]:
        current = self.state.current_mode
        target = req.mode
        method = await asyncio.to_thread(self._method, current, target, req.restart)
        base = {
            "from_mode": current,
            "to_mode": target,
            "method": method,
            "dry_run": req.dry_run,
            "force": req.force,
        }
        if target == current:
            return 200, {**base, "changed": False, "detail": f"the server already runs in mode {current}"}
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
            return 200, body
        if not allowed:
            self.metrics.gate_refusals.labels(to_mode=target.value).inc()
            failed = ", ".join(c.name for c in criteria if not c.passed)
            self.store.audit(
                "refused", None, from_mode=current, to_mode=target, failed=failed, reason=req.reason
            )
            return 412, {
                **body,
                "error": f"the gate to {target} failed: {failed}; nothing changed "
                "(fix the evidence, or pass force to override, which is audited)",
            }
        if method == "restart" and self.server is None:
            return 503, {
                **body,
                "error": "this change needs a server restart and the sidecar has no server control: with "
                "KDTREE_SERVER_CONTROL=docker, set KDTREE_SERVER_CONTAINER and mount the Docker socket "
                "(or use KDTREE_SERVER_CONTROL=process)",
            }
        t = Transition(
            from_mode=current,
            to_mode=target,
            method=method,
            reason=req.reason,
            force=req.force,
            gate=[c.model_dump() for c in criteria],
        )
        self.state.active = t
        self.store.save(self.state)
        if req.force:  # loud whether or not the gate would have passed: someone chose to skip it
            self.store.audit(
                "FORCED",
                t,
                logging.WARNING,
                reason=req.reason,
                failed=[c.name for c in criteria if not c.passed],
                warning="the gate was skipped by force",
            )
        self.store.audit("accepted", t, reason=req.reason, force=req.force)
        self._task = asyncio.create_task(self._transition(t))
        body = {**body, "accepted": True, "transition": t.model_dump()}
        if req.force and not passed:
            body["warning"] = "FORCED: the gate failed and was skipped; this is recorded in the audit log"
        return 202, body

    async def _criteria(self, target: Mode) -> list[Criterion]:
        if target == Mode.OFF:
            return []  # the kill switch is never gated
        a = await self.assess()
        detail = "; ".join(a.reasons)
        if target in (Mode.VALIDATE, Mode.STANDBY):
            up = a.probe is not None and a.probe.ok
            return [Criterion(name="server_up", value=up, op="==", threshold=True, passed=up, detail=detail)]
        return await asyncio.to_thread(gate_to_on, self.settings, a.ready, detail)

    async def _transition(self, t: Transition) -> None:
        try:
            await self._flip(t)
        except asyncio.CancelledError:
            raise  # the sidecar is stopping: the persisted step makes the next start resolve it
        except Exception as e:
            t.failure = str(e) if isinstance(e, StepFailed) else f"{type(e).__name__}: {e}"
            self.store.audit("flip_failed", t, logging.ERROR, step=t.step, failure=t.failure)
            await self._rollback_and_finish(t)
            return
        self.state.current_mode = t.to_mode
        self._finish(t, "succeeded")

    def _step(self, t: Transition, step: str, **details) -> None:
        t.step = step
        self.store.save(self.state)
        self.store.audit(step, t, **details)

    async def _flip(self, t: Transition) -> None:
        self._step(t, "writing_mode")
        write_desired_mode(self.settings.state_dir, t.to_mode)
        if t.method == "live":
            self._step(t, "awaiting_ranks", timeout_s=self.settings.live_flip_timeout_s)
            await self._await_ranks(t, t.to_mode)
            t.confirmed_s = time.time() - t.requested_at
            self._step(t, "baking", probes=self.settings.bake_probes, confirmed_s=round(t.confirmed_s, 3))
            await self._bake(t, None)
            return
        restarts = await self._restart(t)
        self._step(t, "waiting_ready")
        await self._wait_ready(t.to_mode, t.restarted_at, restarts)
        self._step(t, "baking", probes=self.settings.bake_probes)
        await self._bake(t, restarts)

    async def _await_ranks(self, t: Transition, mode: Mode) -> None:
        """Until every expected rank's live record reports `mode` (each switches on its own, between verify steps);
        StepFailed naming the ranks that did not within KDTREE_LIVE_FLIP_TIMEOUT_S."""
        s = self.settings
        deadline = time.monotonic() + s.live_flip_timeout_s
        while True:
            records = await asyncio.to_thread(live_records, s)
            waiting = {}
            for rank in range(s.expected_tp_size):
                rec = records.get(rank)
                if rec is None:
                    waiting[rank] = "no live record"
                elif rec.mode_pending is not None:
                    waiting[rank] = (
                        f"cannot switch to {rec.mode_pending} while it runs (live modes {rec.live_modes})"
                    )
                elif rec.mode != mode.value:
                    waiting[rank] = f"still reports {rec.mode}"
            confirmed = s.expected_tp_size - len(waiting)
            if confirmed != t.ranks_confirmed:
                t.ranks_confirmed = confirmed
                self.store.save(self.state)
            if not waiting:
                return
            if time.monotonic() >= deadline:
                raise StepFailed(
                    f"{confirmed}/{s.expected_tp_size} ranks confirmed mode {mode} within "
                    f"KDTREE_LIVE_FLIP_TIMEOUT_S={s.live_flip_timeout_s:g}s: "
                    + "; ".join(f"rank {r}: {why}" for r, why in sorted(waiting.items()))
                )
            await asyncio.sleep(min(0.5, s.ready_poll_min_s))

    async def _restart(self, t: Transition) -> int | None:
        """Restart the server container; returns its restart count right after (to spot crash loops)."""
        if t.step != "rolling_back":
            self._step(t, "restarting")
        t.restarted_at = time.time()  # rank records must come from processes started after this
        self.store.save(self.state)
        try:
            await asyncio.to_thread(self.server.restart, self.settings.restart_stop_timeout_s)
        except DockerError as e:
            raise StepFailed(f"restart failed: {e}") from None
        finally:
            self.prober.invalidate()  # answers from before the restart say nothing about the new server
            self.container_flight.invalidate()
        view = await self._inspect()
        return view.state.restart_count if view.state else None

    async def _wait_ready(self, mode: Mode, started_after: float | None, restarts: int | None) -> Assessment:
        s = self.settings

        def settled(a: Assessment) -> bool:
            return a.ready or self._crash_reason(a, restarts) is not None

        retrying = AsyncRetrying(
            stop=stop_after_delay(s.ready_timeout_s),
            wait=wait_exponential(
                multiplier=s.ready_poll_min_s, min=s.ready_poll_min_s, max=s.ready_poll_max_s
            ),
            retry=retry_if_result(lambda a: not settled(a)),
            retry_error_callback=lambda state: state.outcome.result(),
        )
        a = await retrying(self.assess, max_age=0, mode=mode, started_after=started_after)
        crash = self._crash_reason(a, restarts)
        if crash:
            raise StepFailed(f"the server crashed while starting in mode {mode}: {crash}")
        if not a.ready:
            raise StepFailed(
                f"not ready in mode {mode} within KDTREE_READY_TIMEOUT_S={s.ready_timeout_s:g}s: "
                + "; ".join(a.reasons)
            )
        return a

    @staticmethod
    def _crash_reason(a: Assessment, restarts: int | None) -> str | None:
        c = a.container.state
        if c is None:
            return None
        if c.crashed:
            return f"container {c.status}, exit code {c.exit_code}, OOMKilled {c.oom_killed}"
        if restarts is not None and c.restart_count > restarts:
            return f"the container restarted by itself {c.restart_count - restarts} time(s)"
        return None

    async def _bake(self, t: Transition, restarts: int | None) -> None:
        """N consecutive good probes, all ranks in the new mode, no rank error, no crash since the restart; then
        the evidence that kdtree did the new mode's work on every rank during the window (gate.bake_evidence).
        The probes decode with speculation, so they produce verify calls when no client traffic does."""
        s = self.settings
        before = await asyncio.to_thread(live_records, s)
        steps: list[int | None] = []
        last_probe = time.time()
        for i in range(s.bake_probes):
            if i:
                await asyncio.sleep(s.bake_interval_s)
            a = await self.assess(max_age=0, mode=t.to_mode, started_after=t.restarted_at)
            where = f"bake probe {i + 1}/{s.bake_probes}"
            crash = self._crash_reason(a, restarts)
            if crash:
                raise StepFailed(f"{where}: {crash}")
            if not a.ready:
                raise StepFailed(f"{where}: " + "; ".join(a.reasons))
            steps.append(a.probe.verify_steps if a.probe else None)
            last_probe = a.probe.at if a.probe else time.time()
            # After a restart every error is the new processes'; a live switch keeps the processes, and with
            # them an error from before it, which says nothing about this flip: only a changed one counts.
            for v in a.ranks.ranks:
                rec, old = v.record, before.get(v.record.tp_rank)
                new = t.method == "restart" or old is None or old.last_error != rec.last_error
                if rec.last_error and rec.tp_rank < s.expected_tp_size and new:
                    raise StepFailed(f"{where}: rank {rec.tp_rank} reported an error: {rec.last_error}")
        after = await self._records_after(last_probe)
        problems = bake_evidence(s, t.to_mode, before, after)
        if problems:
            if steps and all(n == 0 for n in steps):
                problems.append("the probe's completions took no verify step: is speculative decoding on?")
            raise StepFailed("bake: no evidence that kdtree served: " + "; ".join(problems))

    async def _records_after(self, at: float) -> dict:
        """The live records once every expected rank has written one after `at` (its heartbeat), or what there is
        after KDTREE_HEARTBEAT_STALE_S."""
        s = self.settings
        deadline = time.monotonic() + s.heartbeat_stale_s
        while True:
            records = await asyncio.to_thread(live_records, s)
            fresh = all(r in records and records[r].heartbeat >= at for r in range(s.expected_tp_size))
            if fresh or time.monotonic() >= deadline:
                return records
            await asyncio.sleep(min(0.5, s.ready_poll_min_s))

    async def _rollback_and_finish(self, t: Transition) -> None:
        try:
            self._step(t, "rolling_back", failure=t.failure)
            write_desired_mode(self.settings.state_dir, t.from_mode)
            if t.method == "live":
                try:
                    await self._await_ranks(t, t.from_mode)
                    a = await self.assess(max_age=0, mode=t.from_mode)
                    if not a.ready:
                        raise StepFailed("not ready after the live rollback: " + "; ".join(a.reasons))
                    self._finish(t, "rolled_back")
                    return
                except StepFailed as e:
                    t.rollback_note = (
                        f"the live rollback failed ({e}); restarting the server in {t.from_mode}"
                    )
                    self.store.audit("live_rollback_failed", t, logging.ERROR, note=t.rollback_note)
                    if self.server is None:
                        raise StepFailed(f"{e}; and the sidecar cannot restart the server") from None
            restarts = await self._restart(t)
            await self._wait_ready(t.from_mode, t.restarted_at, restarts)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            t.rollback_failure = str(e) if isinstance(e, StepFailed) else f"{type(e).__name__}: {e}"
            self._finish(t, "rollback_failed")
            return
        self._finish(t, "rolled_back")

    def _finish(self, t: Transition, outcome: str) -> None:
        t.outcome, t.finished_at = outcome, time.time()
        t.duration_s = t.finished_at - t.requested_at
        self.metrics.flip_duration.labels(method=t.method).observe(t.duration_s)
        self.state.active = None
        self.state.history.append(t)
        self.store.save(self.state)
        level = logging.INFO if outcome == "succeeded" else logging.ERROR
        self.store.audit(
            outcome,
            t,
            level,
            method=t.method,
            duration_s=round(t.duration_s, 3),
            failure=t.failure,
            rollback_failure=t.rollback_failure,
            interrupted=t.interrupted,
        )
        self.metrics.transitions.labels(
            from_mode=t.from_mode.value, to_mode=t.to_mode.value, outcome=outcome
        ).inc()
        self.metrics.mode.state(self.state.current_mode.value)
        self._claimed = False
