"""The sidecar's state machine: what phase the server is in, and the gated, self-reverting mode flip.

A flip runs as one background task, one at a time, by one of two methods:
  live     (between validate, on and standby, when every rank can): write KDTREE_STATE_DIR/mode -> every rank
           switches on its own and confirms in its record (KDTREE_LIVE_FLIP_TIMEOUT_S) -> bake -> done.
  restart  (to or from off, or asked for): write the mode file -> restart the server -> wait for readiness in
           the new mode -> bake -> done.
The bake is N consecutive good probes, every rank in the new mode, no rank error, and evidence that kdtree did
the new mode's work on every rank: verify calls served (on) or compared (validate), no new fallback.
Any failure rolls back to the previous mode: live when the flip was live (by restart if that fails too), else
by restart (none when the server was not restarted yet: the mode file back is the whole rollback). Each step is
persisted before it is taken, so a sidecar that stops mid-way resolves the transition on its next start.

A transition runs iff its task runs: the task is the claim, so none outlives it, whatever ends it.

Readiness holds under load. A background task probes on its own cadence (KDTREE_PROBE_INTERVAL_S: the sidecar,
not whoever polls /ready, decides when a completion is sent), and /ready answers from the latest verdicts
without waiting on a probe. A server that has served since its latest start stays ready through failed probes
until KDTREE_PROBE_FAILURE_THRESHOLD of them in a row, and past that, for probes that queued behind traffic
(a timeout, a 503 or 429), for as long as SGLang's load-aware /health answers 200; a refused connection, a dead
or stale rank and a crashed server count at once. A server that has not served since its start is judged by the
completion probe alone, and so are the bake and a flip's wait for readiness (a fresh probe each, strictly).

Drain: before a flip or a rollback stops a running server, /ready answers 503 for KDTREE_DRAIN_S, so that the
load balancers that poll it (a readinessProbe) stop routing to the server before it gets SIGTERM.

The state volume can fail under it. A failed write during a forward flip (the state file, the mode file, an
audit entry) ends it like any failed step. The rollback and the outcome write what they can: an outcome the
volume does not take stays in memory (/status shows it; the next request is not refused), and the volume's
problem makes /ready and /status `broken`, with its fix, until a write succeeds again. When the rollback cannot
put the mode file back either, the ranks may keep serving the mode no bake approved: /ready says so, naming
both modes, for as long as the file disagrees with the mode the sidecar expects.

The kill switch: `off` is never gated and is accepted whenever no transition is running; a request for off
while one runs preempts it (unless it already heads to off). The running task is cancelled where it waits,
its transition is finished as `preempted` (history, audit log), and the off transition starts from the mode
the preempted one started from. What the preempted task had set in motion is not taken back: a server restart
under way (a call into Docker or the process control, on a thread) runs to its end, and the off transition
waits for it before it restarts the server itself, so the server comes up in off whatever step the preempted
transition was at; ranks it had switched live are restarted into off with the rest. `standby` (Triton
serves, kdtree idle: the live remedy) is never gated either, and does not preempt.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from pydantic import BaseModel, Field, StrictBool
from tenacity import AsyncRetrying, retry_if_result, stop_after_delay, wait_exponential

from kdtree.config import LIVE_MODES, Mode
from kdtree.control import mode_path, read_desired_mode, write_desired_mode
from kdtree.status import RankRecord, RankView

from .gate import (
    Criterion,
    RankCheck,
    bake_evidence,
    check_ranks,
    gate_to_on,
    live_records,
    read_rank_views,
)
from .metrics import Metrics
from .probe import HTTP_STATUS, REFUSED, TIMEOUT, Prober, ProbeResult, SingleFlight
from .server_control import ContainerMissing, ContainerState, ServerControl, ServerControlError
from .server_log import LogMarker, crash_excerpt, latest_marker
from .settings import SidecarSettings
from .store import SidecarState, Store, Transition
from .vocabulary import Condition, Method, Outcome, Phase, Step
from .volume import StateVolume, VolumeWriteFailed

log = logging.getLogger("kdtree.sidecar")
BUSY_STATUS = (429, 503)  # a completion refused for load (or while SGLang drains): /health decides


class ContainerView(BaseModel):
    state: ContainerState | None = None
    error: str | None = None
    missing: bool = False  # Docker answered: there is no such container


class VolumeSnapshot(BaseModel):
    """What the sidecar reads from the state volume for one assessment (on the volume's thread)."""

    views: list[RankView]
    mode_file: Mode | None = None  # None: no mode file
    mode_file_error: str | None = None


def read_snapshot(settings: SidecarSettings) -> VolumeSnapshot:
    """The rank records and the mode file (blocking reads: StateVolume.read runs it on its thread)."""
    try:
        mode, error = read_desired_mode(settings.state_dir), None
    except (OSError, ValueError) as e:
        mode, error = None, str(e)
    return VolumeSnapshot(views=read_rank_views(settings), mode_file=mode, mode_file_error=error)


def _mode_file_text(snap: VolumeSnapshot | None) -> str | None:
    """The mode file as /status shows it."""
    if snap is None:
        return "unread: the state volume did not answer"
    if snap.mode_file_error:
        return f"unreadable: {snap.mode_file_error}"
    return snap.mode_file.value if snap.mode_file else None


class Assessment(BaseModel):
    phase: Phase  # what /status reports (a running transition overrides the server's own phase)
    server_phase: Phase  # what the server itself looks like
    ready: bool  # server_ready, and nothing wrong with the state volume or the mode file
    server_ready: bool  # the probe, the server's process and every rank as expected
    condition: Condition
    condition_evidence: list[str]
    reasons: list[str]
    notes: list[str] = []  # what is wrong but tolerated (probes failing under load), for people
    mode: Mode  # the mode the server is expected to run in right now
    probe: ProbeResult | None
    container: ContainerView
    ranks: RankCheck
    mode_file: str | None  # what the mode file says, for /status


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
        # Reads give up a little before the deadline, like the probe, so /ready still has their verdict.
        self.volume = StateVolume(settings.state_dir, settings.probe_deadline_s * 0.9)
        self.store = Store(settings.state_dir, settings.history_limit, self.volume)
        self.state: SidecarState = self.store.load(read_desired_mode(settings.state_dir) or settings.verify)
        self.prober = Prober(
            settings.server_url,
            settings.probe_prompt,
            settings.probe_max_tokens,
            settings.probe_deadline_s,
            settings.served_model_name,
            settings.server_api_key.get_secret_value() if settings.server_api_key else None,
        )
        self.prober.on_result = self._observe_probe
        self._monitor_task: asyncio.Task | None = None
        self._draining_until: float | None = None  # monotonic: /ready is 503 until the server is stopped
        self.container_flight: SingleFlight[ContainerView] = SingleFlight(self._inspect)
        self.log_flight: SingleFlight[str] = SingleFlight(self._logs)
        self._task: asyncio.Task | None = None  # the running request or transition: the claim
        self._requested: Mode | None = None  # what the running request asked for
        self._cancel_reason = ""
        self._restart_call: asyncio.Future | None = None  # the server restart under way, on a thread
        self._born = time.monotonic()
        self._retried_at = 0.0  # when a save was last retried while the volume had a problem
        metrics.mode.state(self.state.current_mode.value)

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve a transition that a previous sidecar left unfinished, or adopt a mode file written while no
        sidecar ran (the kill switch by hand: README, "Reaching off when the sidecar is down")."""
        self._monitor_task = asyncio.create_task(self._monitor())
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
                self._save(fatal=False)
                self.metrics.mode.state(written.value)
            return
        t.interrupted = True
        self.store.audit("interrupted_transition_found", t, logging.WARNING, step=t.step)
        if t.step in (Step.ACCEPTED, Step.WRITING_MODE):
            # The server was not restarted: putting the mode file back is the whole resolution.
            t.failure = t.failure or f"the sidecar stopped at step {t.step}, before the server was restarted"
            await self._abort(t)
            return
        if self.server is None or (await self._inspect()).missing:
            # No server container (a stack coming back up): it will start from the restored mode file.
            t.failure = t.failure or (
                f"the sidecar stopped at step {t.step}; the server container is gone, and the mode file is "
                f"back at {t.from_mode.value} for its next start"
            )
            await self._abort(t)
            return
        t.failure = t.failure or f"the sidecar stopped at step {t.step}; the server's mode is unverified"
        self._start_task(self._rollback_and_finish(t))

    async def _abort(self, t: Transition) -> None:
        """Finish an interrupted transition by putting the mode file back: aborted, or rollback_failed when the
        file cannot be written back."""
        not_back = await self._restore_mode_file(t)
        if not_back:
            t.rollback_failure = not_back
        self._finish(t, Outcome.ROLLBACK_FAILED if not_back else Outcome.ABORTED)

    async def stop(self) -> None:
        """Stop the background probe and a running transition (its persisted state makes the next start resolve it)."""
        # Cancelled again until it ends: asyncio.wait_for (in SingleFlight, Python 3.11) can swallow a cancellation
        # that lands as the probe finishes.
        while self._monitor_task is not None and not self._monitor_task.done():
            self._monitor_task.cancel()
            await asyncio.wait([self._monitor_task], timeout=0.5)
        if self.running():
            self._cancel_reason = "the sidecar is stopping"
            self._task.cancel()
            await asyncio.wait([self._task])
        self.volume.close()

    def running(self) -> bool:
        """A request is being decided or a transition runs: the claim is the task itself."""
        return self._task is not None and not self._task.done()

    def _start_task(self, coro) -> None:
        self._task = asyncio.create_task(coro)
        self._task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        """Nothing a task ends with goes unreported, and no transition outlives its task."""
        if task.cancelled():
            return  # stopped (its persisted step resolves it at the next start) or preempted (finished there)
        e = task.exception()
        if e is None:
            return
        log.error("the mode transition task failed: %s: %s", type(e).__name__, e, exc_info=e)
        t = self.state.active
        if t is not None and task is self._task:
            t.rollback_failure = t.rollback_failure or f"the sidecar failed: {type(e).__name__}: {e}"
            self._finish(t, Outcome.ROLLBACK_FAILED)

    def _save(self, *, fatal: bool) -> None:
        """Persist the state. fatal (a forward flip): a failed save ends the flip (VolumeWriteFailed). Else (a
        rollback, an outcome, the start) the state stays in memory, and the volume's problem says why."""
        try:
            self.store.save(self.state)
        except VolumeWriteFailed:
            if fatal:
                raise

    async def _snapshot(self) -> VolumeSnapshot | None:
        """The rank records and the mode file; None when the volume did not answer within the deadline."""
        return await self.volume.read("snapshot", lambda: read_snapshot(self.settings))

    async def rank_views(self) -> list[RankView]:
        snap = await self._snapshot()
        return snap.views if snap else []

    async def _live_records(self) -> dict[int, RankRecord]:
        snap = await self._snapshot()
        return live_records(self.settings, snap.views) if snap else {}

    # ---- observation -----------------------------------------------------------------------------

    async def _monitor(self) -> None:
        """The background probe: a completion every KDTREE_PROBE_INTERVAL_S (joining one in flight, e.g. a bake's),
        and SGLang's /health beside it (Prober.probe_with_health)."""
        s = self.settings
        while True:
            began = time.monotonic()
            try:
                await self.prober.probe_with_health()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the next round tries again; the verdict ages meanwhile
                log.error("the background probe failed: %s: %s", type(e).__name__, e, exc_info=e)
            await asyncio.sleep(max(0.0, s.probe_interval_s - (time.monotonic() - began)))

    def _observe_probe(self, result: ProbeResult) -> None:
        self.metrics.probe_duration.observe(result.latency_s)
        if not result.ok:
            self.metrics.probe_failures.labels(reason=result.reason).inc()

    async def _inspect(self) -> ContainerView:
        if self.server is None:
            return ContainerView(error="no server container configured (set KDTREE_SERVER_CONTAINER)")
        try:
            return ContainerView(state=await asyncio.to_thread(self.server.inspect))
        except ServerControlError as e:
            return ContainerView(error=str(e), missing=isinstance(e, ContainerMissing))

    def expected_mode(self) -> Mode:
        """The mode the server should be in now (by a transition still running, or the settled one)."""
        t = self.state.active
        if (
            t is None
            or t.step == Step.ACCEPTED
            or (t.method == Method.RESTART and t.step == Step.WRITING_MODE)
        ):
            return self.state.current_mode
        return t.from_mode if t.step == Step.ROLLING_BACK else t.to_mode

    def expected_modes(self) -> set[Mode]:
        """The modes the ranks may report now: both ends while a live switch runs (each rank switches on its own)."""
        t = self.state.active
        if t is not None and t.method == Method.LIVE and t.step != Step.ACCEPTED:
            return {t.from_mode, t.to_mode}
        return {self.expected_mode()}

    async def _probe_for(self, fresh: bool) -> ProbeResult | None:
        """A probe of its own (fresh), or the background probe's latest verdict (the first one, waited for)."""
        if fresh:
            return await self.prober.get(0)
        return self.prober.latest or await self.prober.get(math.inf)

    async def assess(
        self, fresh: bool = False, mode: Mode | None = None, started_after: float | None = None
    ) -> Assessment:
        """What the server looks like. fresh (a flip's wait, the bake): a probe of its own, which must pass;
        else the latest verdicts, with the tolerance for load (the module's docstring)."""
        s = self.settings
        modes = {mode} if mode else self.expected_modes()
        mode = mode or self.expected_mode()
        self._retry_save()
        probe, container, snap = await asyncio.gather(
            self._probe_for(fresh),
            self.container_flight.get(1.0, wait=s.probe_deadline_s),  # at most one inspection a second
            self._snapshot(),
        )
        container = container or ContainerView(error=f"Docker did not answer within {s.probe_deadline_s:g}s")
        # What came before the server's latest start (a crash and the restart policy, a restart by hand) is the
        # previous server's: neither its last probe nor its ranks' records speak for this one.
        begun = container.state.started_at if container.state else None
        if begun is not None:
            started_after = max(started_after or begun, begun)
        stale_probe = probe is not None and begun is not None and probe.at < begun
        if snap is None:
            unread = (
                f"the state volume ({s.state_dir}) did not answer within {self.volume.deadline_s:.3g}s: "
                "the rank records and the mode file are unread (a hung mount?)"
            )
            ranks = RankCheck(ok=False, problems=[unread], ranks=[])
        elif s.expected_tp_size:
            ranks = check_ranks(s, snap.views, modes, started_after)
        else:
            ranks = RankCheck(ok=True, problems=[], ranks=[])
        reasons, notes = [], []
        if probe is None:
            reasons.append(f"the probe did not finish within {s.probe_deadline_s:g}s")
        elif stale_probe:
            reasons.append(
                "no probe since the server's latest start yet (the background probe runs every "
                f"KDTREE_PROBE_INTERVAL_S={s.probe_interval_s:g}s)"
            )
        elif not probe.ok:
            problem, note = self._failed_probe(probe, container.state, fresh)
            reasons += [problem] if problem else []
            notes += [note] if note else []
        tolerated = bool(notes)
        current = None if stale_probe else probe
        server_phase = self._server_phase(current, container.state, ranks, tolerated)
        if container.state and container.state.crashed:
            reasons.append(
                f"server container is {container.state.status} (exit code {container.state.exit_code}, "
                f"OOMKilled {container.state.oom_killed})"
            )
        reasons += ranks.problems
        server_ready = not reasons
        state_problems = self._state_problems(snap)
        reasons += state_problems
        if self._draining_until is not None:
            left = max(0.0, self._draining_until - time.monotonic())
            reasons.append(
                f"draining: the server is stopped in {left:.0f}s (KDTREE_DRAIN_S={s.drain_s:g}), once load "
                "balancers that poll /ready have stopped routing to it"
            )
        t = self.state.active
        if t is None:
            phase = server_phase
        elif t.step == Step.ROLLING_BACK:
            phase = Phase.ROLLING_BACK
        else:
            phase = Phase.SWITCHING if t.method == Method.LIVE else Phase.RESTARTING
        self.metrics.phase.state(phase)
        ready = not reasons
        condition, evidence = self._condition(ready, container, current, state_problems)
        # The latest assessment is the sidecar's verdict, whoever asked for it (/ready, /status, a transition).
        self.metrics.ready.set(1 if ready else 0)
        self.metrics.condition.state(condition)
        return Assessment(
            phase=phase,
            server_phase=server_phase,
            ready=ready,
            server_ready=server_ready,
            condition=condition,
            condition_evidence=evidence,
            reasons=reasons,
            notes=notes,
            mode=mode,
            probe=probe,
            container=container,
            ranks=ranks,
            mode_file=_mode_file_text(snap),
        )

    def _served_since_start(self, c: ContainerState | None) -> bool:
        ok_at, started = self.prober.last_ok_at, c.started_at if c is not None else None
        return ok_at is not None and (started is None or ok_at > started)

    def _failed_probe(
        self, probe: ProbeResult, c: ContainerState | None, fresh: bool
    ) -> tuple[str | None, str | None]:
        """(a reason the server is not ready, or None; a note when the failure is tolerated)."""
        s = self.settings
        failed = f"probe failed ({probe.reason}): {probe.detail}"
        if fresh or probe.reason == REFUSED or not self._served_since_start(c):
            return failed, None
        n, limit, h = self.prober.failures, s.probe_failure_threshold, self.prober.health
        busy = probe.reason == TIMEOUT or (probe.reason == HTTP_STATUS and probe.status_code in BUSY_STATUS)
        health = f"SGLang's {h.detail}" if h is not None else "SGLang's /health not asked yet"
        if n < limit:
            return None, (
                f"{n} probe(s) in a row failed, tolerated up to KDTREE_PROBE_FAILURE_THRESHOLD={limit} for a server "
                f"that has served since its start ({health}); the latest: {failed}"
            )
        if busy and h is not None and h.ok:
            return None, (
                f"{n} probes in a row queued past the deadline or were refused for load, and {health}: its "
                f"scheduler produces output, so the server is busy, not broken; the latest: {failed}"
            )
        why = f"and {health}" if busy else "with an answer that is wrong, not late"
        return (
            f"{n} probes in a row failed (KDTREE_PROBE_FAILURE_THRESHOLD={limit}) {why}; the latest: {failed}",
            None,
        )

    def _retry_save(self) -> None:
        """While the volume has a problem, try the state again (at most once a second): the first write it takes
        clears the problem and persists what was kept in memory."""
        if self.volume.problem is None or time.monotonic() - self._retried_at < 1.0:
            return
        self._retried_at = time.monotonic()
        try:
            self.store.save(self.state, retry=True)
        except VolumeWriteFailed:
            pass

    def _state_problems(self, snap: VolumeSnapshot | None) -> list[str]:
        """What is wrong on the sidecar's side of the volume: a failed write, or (no transition running) a mode
        file that disagrees with the mode the sidecar expects, which the ranks follow all the same."""
        problems = [self.volume.problem.reason] if self.volume.problem else []
        if snap is None or self.state.active is not None:
            return problems
        expected = self.state.current_mode
        if snap.mode_file_error:
            problems.append(
                f"the mode file is unreadable ({snap.mode_file_error}): the ranks keep the mode they have; "
                f"POST /mode {expected} rewrites it"
            )
        elif snap.mode_file is not None and snap.mode_file != expected:
            problems.append(
                f"the mode file says {snap.mode_file} and the sidecar expects {expected}: the ranks follow the "
                f"file, so they may serve {snap.mode_file}, which no bake approved; POST /mode {expected} "
                "(or off) rewrites it"
            )
        return problems

    def _condition(
        self, ready: bool, container: ContainerView, probe: ProbeResult | None, state_problems: list[str]
    ) -> tuple[Condition, list[str]]:
        """Whether a server that is not ready will get there by itself (not_ready_yet) or needs someone
        (broken), with the facts behind the verdict. Unlike the phase, it does not depend on what happened
        before the server's latest start."""
        if ready:
            return Condition.READY, []
        if state_problems:
            return Condition.BROKEN, state_problems
        t = self.state.active
        if t is not None:
            return Condition.NOT_READY_YET, [
                f"a {t.method} transition {t.from_mode} -> {t.to_mode} is at step {t.step}"
            ]
        s, c = self.settings, container.state
        if c is not None and c.crashed:
            return Condition.BROKEN, [f"the server process is {c.status} (exit code {c.exit_code})"]
        if container.missing:
            up, grace = time.monotonic() - self._born, s.start_grace_s
            if up > grace:
                return Condition.BROKEN, [
                    f"no server has started in the {up:.0f}s since the sidecar started "
                    f"(KDTREE_START_GRACE_S={grace:g}): the server container is not running, or does not "
                    f"share the state volume {s.state_dir} with the sidecar",
                    str(container.error),
                ]
            return Condition.NOT_READY_YET, [
                f"no server has started yet, {up:.0f}s after the sidecar (KDTREE_START_GRACE_S={grace:g})"
            ]
        started = c.started_at if c is not None else None
        if started is None:
            return Condition.NOT_READY_YET, [
                "the server's start time is unknown (no server control, or no start yet)"
            ]
        now, budget = time.time(), s.ready_timeout_s
        ok_at = self.prober.last_ok_at
        if ok_at is not None and ok_at > started:
            return Condition.BROKEN, [
                f"it answered a completion {now - ok_at:.0f}s ago, {ok_at - started:.0f}s after its latest start, "
                "and fails now"
            ]
        answering = self.prober.answering_since
        if answering is not None and answering < started:  # an answer from before this start
            answering = self.prober.answering_since = None
        if answering is not None and probe is not None and not probe.ok:
            if now - answering > s.answering_budget_s:
                return Condition.BROKEN, [
                    f"it has answered HTTP for {now - answering:.0f}s since its latest start and failed every "
                    f"probe (KDTREE_ANSWERING_BUDGET_S={s.answering_budget_s:g}); the latest: {probe.reason}: "
                    f"{probe.detail}"
                ]
        if now - started > budget:
            return Condition.BROKEN, [
                f"started {now - started:.0f}s ago and never ready (KDTREE_READY_TIMEOUT_S={budget:g})"
            ]
        return Condition.NOT_READY_YET, [
            f"started {now - started:.0f}s ago and not ready yet (KDTREE_READY_TIMEOUT_S={budget:g})"
        ]

    def _server_phase(
        self, probe: ProbeResult | None, container: ContainerState | None, ranks: RankCheck, tolerated: bool
    ) -> Phase:
        if container is not None:
            if container.crashed:
                return Phase.CRASHED
            if container.status == "created":
                return Phase.STARTING
        if probe is None:
            return Phase.STARTING
        if probe.ok or tolerated:
            return Phase.READY if ranks.ok else Phase.DEGRADED
        started = (container.started_at if container else None) or 0.0
        served_since_start = self.prober.last_ok_at is not None and self.prober.last_ok_at > started
        if probe.reason == REFUSED:
            # SGLang keeps its port closed until weights and CUDA graphs are in place; after serving, a closed
            # port means it stopped answering.
            return Phase.DEGRADED if served_since_start and container is not None else Phase.LOADING
        since = max(self.prober.last_refused_at or 0.0, started)
        served_since_start = self.prober.last_ok_at is not None and self.prober.last_ok_at > since
        answering_busy = probe.reason == TIMEOUT or (probe.reason == HTTP_STATUS and probe.status_code == 503)
        if answering_busy and not served_since_start:
            return Phase.WARMING  # the port is open, the first completions are not through yet
        return Phase.DEGRADED

    async def _logs(self) -> str:
        c = self.container_flight.cached
        since = c.state.started_at if c is not None and c.state is not None else None
        return await asyncio.to_thread(self.server.logs, self.settings.log_tail_lines, since)

    async def status(self) -> dict:
        a = await self.assess()
        marker: LogMarker | None = None
        excerpt: list[str] = []
        log_error = None
        c = a.container.state
        if self.server is not None and c is not None:
            try:
                # One read at a time (a hung volume under process control holds one thread), bounded.
                text = await self.log_flight.get(0, wait=self.settings.probe_deadline_s)
                if text is None:
                    log_error = f"reading the logs took longer than {self.settings.probe_deadline_s:g}s"
                else:
                    marker = latest_marker(text)
                    if c.crashed or a.phase == Phase.CRASHED:
                        excerpt = crash_excerpt(text)
            except ServerControlError as e:
                log_error = str(e)
        problem = self.volume.problem
        return {
            "phase": a.phase,
            "server_phase": a.server_phase,
            "ready": a.ready,
            "condition": a.condition,
            "condition_evidence": a.condition_evidence,
            "reasons": a.reasons,
            "notes": a.notes,
            "mode": {
                "current": self.state.current_mode,
                "expected_now": a.mode,
                "desired_file": a.mode_file,
            },
            "state_volume": {
                "path": self.settings.state_dir,
                "problem": {**problem.model_dump(), "fix": problem.fix} if problem else None,
            },
            "container": a.container.model_dump(),
            "log": {
                "latest_marker": marker.model_dump() if marker else None,
                "crash_excerpt": excerpt,
                "error": log_error,
            },
            "probe": a.probe.model_dump() if a.probe else None,
            "probe_failures_in_a_row": self.prober.failures,
            "server_health": self.prober.health.model_dump() if self.prober.health else None,
            "ranks": [v.model_dump() for v in a.ranks.ranks],
            "rank_problems": a.ranks.problems,
            "expected_tp_size": self.settings.expected_tp_size,
            "active_transition": self.state.active.model_dump() if self.state.active else None,
            "transitions": [t.model_dump() for t in self.state.history[-10:]],
        }

    # ---- the mode switch ---------------------------------------------------------------------------

    async def request_mode(self, req: ModeRequest) -> tuple[int, dict]:
        """Evaluate and, when allowed, start a transition. Returns (HTTP status, body)."""
        if req.dry_run:
            status, body, _ = await self._evaluate(req)
            return status, body
        preempted = None
        if self.running():
            if req.mode != Mode.OFF or self._heading_to() == Mode.OFF:
                active = self.state.active
                return 409, {
                    "error": "a mode transition is already running; retry when it has finished"
                    + ("" if req.mode == Mode.OFF else " (POST /mode off preempts it)"),
                    "transition": active.model_dump() if active else {"step": "evaluating the gate"},
                }
            preempted = self._task
            self._cancel_reason = "preempted by POST /mode off" + (f" ({req.reason})" if req.reason else "")
            preempted.cancel()  # it unwinds at its next await, and touches the state no more
            self._preempt(req)
        # No await since the check above: the new task is the claim before any other request runs.
        answer: asyncio.Future[tuple[int, dict]] = asyncio.get_running_loop().create_future()
        self._requested = req.mode
        self._start_task(self._serve(req, answer, preempted))
        return await asyncio.shield(answer)  # a client that goes away does not cancel the transition

    def _heading_to(self) -> Mode | None:
        """The mode the running request or transition heads to."""
        t = self.state.active
        if t is None:
            return self._requested
        return t.from_mode if t.step == Step.ROLLING_BACK else t.to_mode

    async def _serve(self, req: ModeRequest, answer: asyncio.Future, preempted: asyncio.Task | None) -> None:
        """The request's task: end what it preempts, decide, answer, and run the transition it accepted."""
        try:
            if preempted is not None:
                await asyncio.wait([preempted])  # returns once it has unwound
            status, body, t = await self._evaluate(req)
        except asyncio.CancelledError:
            if not answer.done():
                answer.set_result((409, {
                    "error": f"{self._cancel_reason or 'cancelled'} before this request was decided; "
                    "nothing changed",
                    "transition": None,
                }))  # fmt: skip
            raise
        except BaseException as e:
            if not answer.done():
                answer.set_exception(e)
            raise
        answer.set_result((status, body))
        if t is not None:
            await self._transition(t)

    def _preempt(self, req: ModeRequest) -> None:
        """Finish the transition of a task just cancelled for the kill switch as preempted."""
        t = self.state.active
        if t is None:
            return  # it was still deciding: it answers its request itself
        why = f"preempted at step {t.step} by POST /mode off" + (f" ({req.reason})" if req.reason else "")
        if t.failure is None:
            t.failure = why
        else:  # it was rolling back
            t.rollback_failure = why
        self._finish(t, Outcome.PREEMPTED)

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

    async def _evaluate(self, req: ModeRequest) -> tuple[int, dict, Transition | None]:
        """The answer to a request, and the transition it starts (made active here) when it is accepted."""
        current = self.state.current_mode
        target = req.mode
        snap = await self._snapshot()
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

    async def _criteria(self, target: Mode) -> list[Criterion]:
        if target in (Mode.OFF, Mode.STANDBY):
            return []  # the kill switch and the live remedy (Triton serves, kdtree idle) are never gated
        a = await self.assess(fresh=True)  # a probe of its own: a flip that could not bake is not started
        detail = "; ".join(a.reasons)
        if target == Mode.VALIDATE:
            up = a.probe is not None and a.probe.ok
            return [Criterion(name="server_up", value=up, op="==", threshold=True, passed=up, detail=detail)]
        # Not a.ready: a mode file that disagrees is what this transition rewrites; a failed write still refuses.
        ready = a.server_ready and self.volume.problem is None
        return gate_to_on(self.settings, a.ranks.ranks, ready, detail)

    async def _transition(self, t: Transition) -> None:
        try:
            self._step(t, Step.ACCEPTED, reason=t.reason, force=t.force)
            await self._flip(t)
        except asyncio.CancelledError:
            raise  # stopping (the persisted step makes the next start resolve it), or preempted
        except Exception as e:
            known = isinstance(e, StepFailed | VolumeWriteFailed)
            t.failure = str(e) if known else f"{type(e).__name__}: {e}"
            self.store.audit("flip_failed", t, logging.ERROR, step=t.step, failure=t.failure)
            await self._rollback_and_finish(t)
            return
        self.state.current_mode = t.to_mode
        self._finish(t, Outcome.SUCCEEDED)

    def _step(self, t: Transition, step: Step, **details) -> None:
        """Persist and audit the step. In a forward flip a write the volume does not take ends the flip; the
        rollback goes on regardless (its state stays in memory)."""
        t.step = step
        forward = step != Step.ROLLING_BACK
        self._save(fatal=forward)
        self.store.audit(step, t, **details)
        if forward and self.volume.problem is not None:  # the audit entry was not appended
            raise StepFailed(self.volume.problem.reason)

    def _write_mode(self, mode: Mode) -> None:
        d = self.settings.state_dir
        self.volume.write("writing the mode file", mode_path(d), lambda: write_desired_mode(d, mode))

    async def _restore_mode_file(self, t: Transition) -> str | None:
        """Put the mode file back at t.from_mode: None when it says that afterwards, else why it does not."""
        try:
            self._write_mode(t.from_mode)
            return None
        except VolumeWriteFailed as e:
            failed = str(e)
        snap = await self._snapshot()
        if snap is not None and snap.mode_file == t.from_mode:
            return None  # it already did
        if snap is None or snap.mode_file is None:
            says = "it could not be read back" if snap is None else "there is none"
            return f"the mode file could not be written back to {t.from_mode} ({failed}); {says}"
        return (
            f"the mode file could not be written back to {t.from_mode} ({failed}); it still says "
            f"{snap.mode_file}, so the ranks may serve {snap.mode_file}"
        )

    async def _flip(self, t: Transition) -> None:
        self._step(t, Step.WRITING_MODE)
        self._write_mode(t.to_mode)
        if t.method == Method.LIVE:
            self._step(t, Step.AWAITING_RANKS, timeout_s=self.settings.live_flip_timeout_s)
            await self._await_ranks(t, t.to_mode)
            t.confirmed_s = time.time() - t.requested_at
            self._step(t, Step.BAKING, probes=self.settings.bake_probes, confirmed_s=round(t.confirmed_s, 3))
            await self._bake(t, None)
            return
        restarts = await self._restart(t)
        self._step(t, Step.WAITING_READY)
        await self._wait_ready(t.to_mode, t.restarted_at, restarts, forward=True)
        self._step(t, Step.BAKING, probes=self.settings.bake_probes)
        await self._bake(t, restarts)

    async def _await_ranks(self, t: Transition, mode: Mode) -> None:
        """Until every expected rank's live record reports `mode` (each switches on its own, between verify steps);
        StepFailed naming the ranks that did not within KDTREE_LIVE_FLIP_TIMEOUT_S."""
        s = self.settings
        deadline = time.monotonic() + s.live_flip_timeout_s
        while True:
            snap = await self._snapshot()
            records = live_records(s, snap.views) if snap else {}
            waiting = {}
            for rank in range(s.expected_tp_size):
                rec = records.get(rank)
                if snap is None:
                    waiting[rank] = "its record is unread: the state volume did not answer"
                elif rec is None:
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
                self._save(fatal=t.step != Step.ROLLING_BACK)
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
        """Drain, then restart the server container; returns its restart count right after (to spot crash loops)."""
        forward = t.step != Step.ROLLING_BACK
        previous = self._restart_call
        if previous is not None and not previous.done():
            self.store.audit("awaiting_previous_restart", t, detail="a preempted transition's restart runs")
            await asyncio.wait([previous])  # it cannot be taken back: this restart comes after it
        await self._drain(t, forward)
        if forward:
            self._step(t, Step.RESTARTING)
        t.restarted_at = time.time()  # rank records must come from processes started after this
        self._save(fatal=forward)
        call = asyncio.ensure_future(
            asyncio.to_thread(self.server.restart, self.settings.restart_stop_timeout_s)
        )
        call.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: this task may be gone
        self._restart_call = call
        try:
            await asyncio.shield(call)  # a preempted transition's restart runs to its end on its thread
        except ServerControlError as e:
            raise StepFailed(f"restart failed: {e}") from None
        finally:
            self.prober.invalidate()  # answers from before the restart say nothing about the new server
            self.container_flight.invalidate()
        view = await self._inspect()
        return view.state.restart_count if view.state else None

    async def _drain(self, t: Transition, forward: bool) -> None:
        """/ready answers 503 for KDTREE_DRAIN_S before a running server is stopped: a readinessProbe (periodSeconds x
        failureThreshold) takes the pod out of its Service first, so no new request meets the SIGTERM."""
        s = self.settings
        view = await self._inspect()
        if s.drain_s <= 0 or view.state is None or not view.state.running:
            return  # nothing serves that could be routed to
        self._draining_until = time.monotonic() + s.drain_s
        try:
            if forward:
                self._step(t, Step.DRAINING, drain_s=s.drain_s)
            else:
                self.store.audit(Step.DRAINING, t, drain_s=s.drain_s)
            await asyncio.sleep(s.drain_s)
        finally:
            self._draining_until = None

    async def _wait_ready(
        self, mode: Mode, started_after: float | None, restarts: int | None, *, forward: bool
    ) -> Assessment:
        """Until the server is ready in `mode`, crashed, or KDTREE_READY_TIMEOUT_S. forward (a flip): the state
        volume must be sound too, and a problem with it ends the wait; a rollback needs the server only."""
        s = self.settings

        def settled(a: Assessment) -> bool:
            if self._crash_reason(a, restarts) is not None:
                return True
            return (a.ready or self.volume.problem is not None) if forward else a.server_ready

        retrying = AsyncRetrying(
            stop=stop_after_delay(s.ready_timeout_s),
            wait=wait_exponential(
                multiplier=s.ready_poll_min_s, min=s.ready_poll_min_s, max=s.ready_poll_max_s
            ),
            retry=retry_if_result(lambda a: not settled(a)),
            retry_error_callback=lambda state: state.outcome.result(),
        )
        # The sidecar's own verdict, as /ready gives it: the background probe's, strict until the server has served
        # since this start (the bake's probes are its own).
        a = await retrying(self.assess, mode=mode, started_after=started_after)
        crash = self._crash_reason(a, restarts)
        if crash:
            raise StepFailed(f"the server crashed while starting in mode {mode}: {crash}")
        if forward and self.volume.problem is not None:
            raise StepFailed(self.volume.problem.reason)
        if not (a.ready if forward else a.server_ready):
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
        before = await self._live_records()
        steps: list[int | None] = []
        last_probe = time.time()
        for i in range(s.bake_probes):
            if i:
                await asyncio.sleep(s.bake_interval_s)
            a = await self.assess(fresh=True, mode=t.to_mode, started_after=t.restarted_at)
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
                new = t.method == Method.RESTART or old is None or old.last_error != rec.last_error
                if rec.last_error and rec.tp_rank < s.expected_tp_size and new:
                    raise StepFailed(f"{where}: rank {rec.tp_rank} reported an error: {rec.last_error}")
        after = await self._records_after(last_probe)
        problems = bake_evidence(s, t.to_mode, before, after)
        if problems:
            # SGLang 0.5.23 leaves out sglext.spec_tokens_details when speculative decoding is off (None here),
            # and reports spec_verify_ct 0 when no step ran.
            if steps and all(not n for n in steps):
                problems.append("the probe's completions took no verify step: is speculative decoding on?")
            raise StepFailed("bake: no evidence that kdtree served: " + "; ".join(problems))

    async def _records_after(self, at: float) -> dict[int, RankRecord]:
        """The live records once every expected rank has written one after `at` (its heartbeat), or what there is
        after KDTREE_HEARTBEAT_STALE_S."""
        s = self.settings
        deadline = time.monotonic() + s.heartbeat_stale_s
        while True:
            records = await self._live_records()
            fresh = all(r in records and records[r].heartbeat >= at for r in range(s.expected_tp_size))
            if fresh or time.monotonic() >= deadline:
                return records
            await asyncio.sleep(min(0.5, s.ready_poll_min_s))

    async def _rollback_and_finish(self, t: Transition) -> None:
        try:
            self._step(t, Step.ROLLING_BACK, failure=t.failure)
            not_back = await self._restore_mode_file(t)
            if not_back:
                raise StepFailed(not_back)  # neither a live switch nor a restart can reach the old mode now
            if t.method == Method.LIVE:
                try:
                    await self._await_ranks(t, t.from_mode)
                    a = await self.assess(fresh=True, mode=t.from_mode)
                    if not a.server_ready:
                        raise StepFailed("not ready after the live rollback: " + "; ".join(a.reasons))
                    self._finish(t, Outcome.ROLLED_BACK)
                    return
                except StepFailed as e:
                    t.rollback_note = (
                        f"the live rollback failed ({e}); restarting the server in {t.from_mode}"
                    )
                    self.store.audit("live_rollback_failed", t, logging.ERROR, note=t.rollback_note)
                    if self.server is None:
                        raise StepFailed(f"{e}; and the sidecar cannot restart the server") from None
            elif t.restarted_at is None:
                t.rollback_note = f"the server was not restarted: the mode file is back at {t.from_mode}"
                self._finish(t, Outcome.ROLLED_BACK)
                return
            restarts = await self._restart(t)
            await self._wait_ready(t.from_mode, t.restarted_at, restarts, forward=False)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            known = isinstance(e, StepFailed | VolumeWriteFailed)
            t.rollback_failure = str(e) if known else f"{type(e).__name__}: {e}"
            self._finish(t, Outcome.ROLLBACK_FAILED)
            return
        self._finish(t, Outcome.ROLLED_BACK)

    def _finish(self, t: Transition, outcome: Outcome) -> None:
        """Record the outcome; never raises: what the volume does not take stays in memory (/status shows it)."""
        t.outcome, t.finished_at = outcome, time.time()
        t.duration_s = t.finished_at - t.requested_at
        self.metrics.flip_duration.labels(method=t.method).observe(t.duration_s)
        self.state.active = None
        self.state.history.append(t)
        self._save(fatal=False)
        level = logging.INFO if outcome == Outcome.SUCCEEDED else logging.ERROR
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
