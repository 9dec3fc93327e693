"""The transition: run an accepted flip, and roll it back when a step fails.

One of two methods:
  live     (between validate, on and standby, when every rank can): write KDTREE_STATE_DIR/mode -> every rank
           switches on its own and confirms in its record (KDTREE_LIVE_FLIP_TIMEOUT_S) -> bake -> done.
  restart  (to or from off, or asked for): write the mode file -> restart the server -> wait for readiness in
           the new mode -> bake -> done.
The bake is N consecutive good probes, every rank in the new mode, no rank error, and evidence that kdtree did
the new mode's work on every rank (rank_evidence.bake_evidence). Any failure rolls back to the previous mode:
live when the flip was live (by restart if that fails too), else by restart (none when the server was not
restarted yet: the mode file back is the whole rollback). Each step is persisted before it is taken, so a sidecar
that stops mid-way resolves the transition on its next start.

Except the kill switch: a flip to off is a one-way door. A failed one is not rolled back (it ends `failed`, the mode
stays off, every mode file says off and a group's node that did not take it stays owed it), and one that a sidecar
left unfinished is finished by the next (resume), never rolled back.

Drain: before a flip or a rollback stops a running server, /ready answers 503 for KDTREE_DRAIN_S (readiness's
draining_until), so that the load balancers that poll it stop routing to the server before it gets SIGTERM.

The state volume can fail under it. A failed write during a forward flip (the state file, the mode file, an
audit entry) ends it like any failed step. The rollback and the outcome write what they can: an outcome the
volume does not take stays in memory (/status shows it; the next request is not refused). When the rollback
cannot put the mode file back either, the ranks may keep serving the mode no bake approved: /ready says so.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tenacity import AsyncRetrying, retry_if_result, stop_after_delay, wait_exponential

from kdtree.config import Mode
from kdtree.state.mode_file import mode_path, write_desired_mode
from kdtree.state.rank_records import RankRecord, written_since

from .metrics import Metrics
from .rank_evidence import bake_evidence, live_records
from .readiness import Assessment, Readiness
from .server_control import ServerControl, ServerControlError
from .settings import SidecarSettings
from .store import SidecarState, Store, Transition
from .vocabulary import Method, Outcome, Step
from .volume import VolumeWriteFailed

log = logging.getLogger("kdtree.sidecar")


class StepFailed(Exception):
    pass


class TransitionRunner:
    """Runs one transition at a time (the controller holds the claim), persisting each step in `state`."""

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
        self.volume = store.volume
        self.state = state
        self.readiness = readiness
        self.restart_call: asyncio.Future | None = None  # the server restart under way, on a thread

    async def run(self, t: Transition, *, resume: bool = False) -> None:
        """Run t forward; resume: t is a flip to off that a previous sidecar left unfinished (controller.start)."""
        try:
            if not resume:
                self._step(t, Step.ACCEPTED, reason=t.reason, force=t.force)
            await self._forward(t, resume=resume)
        except asyncio.CancelledError:
            raise  # stopping (the persisted step makes the next start resolve it), or preempted
        except Exception as e:
            known = isinstance(e, StepFailed | VolumeWriteFailed)
            t.failure = str(e) if known else f"{type(e).__name__}: {e}"
            self.store.audit("flip_failed", t, logging.ERROR, step=t.step, failure=t.failure)
            if t.to_mode == Mode.OFF:
                self._keep_off(t)
            else:
                await self.rollback_and_finish(t)
            return
        self.state.current_mode = t.to_mode
        self.finish(t, Outcome.SUCCEEDED)

    def _keep_off(self, t: Transition) -> None:
        """A failed flip to off is not rolled back: the kill switch must not bring back the mode it was asked to
        stop. The mode stays off; /ready names what is not off yet."""
        t.rollback_note = (
            "off is never rolled back: the mode files say off (a group's node that did not take it is owed it, "
            "given when it answers); /ready names what does not run off yet, and POST /mode off asks again"
        )
        self.state.current_mode = Mode.OFF
        self.finish(t, Outcome.FAILED)

    async def abort(self, t: Transition) -> None:
        """Finish an interrupted transition by putting the mode file back: aborted, or rollback_failed when the
        file cannot be written back."""
        not_back = await self._restore_mode_file(t)
        if not_back:
            t.rollback_failure = not_back
        self.finish(t, Outcome.ROLLBACK_FAILED if not_back else Outcome.ABORTED)

    def save(self, *, fatal: bool) -> None:
        """Persist the state. fatal (a forward flip): a failed save ends the flip (VolumeWriteFailed). Else (a
        rollback, an outcome, the start) the state stays in memory, and the volume's problem says why."""
        try:
            self.store.save(self.state)
        except VolumeWriteFailed:
            if fatal:
                raise

    def _step(self, t: Transition, step: Step, **details) -> None:
        """Persist and audit the step. In a forward flip a write the volume does not take ends the flip; the
        rollback goes on regardless (its state stays in memory)."""
        t.step = step
        forward = step != Step.ROLLING_BACK
        self.save(fatal=forward)
        self.store.audit(step, t, **details)
        if forward and self.volume.problem is not None:  # the audit entry was not appended
            raise StepFailed(self.volume.problem.reason)

    async def _write_mode(self, mode: Mode, *, restart: bool, rollback: bool = False) -> None:
        """This node's mode file; a group's leader then every worker's (sidecar/group_leader.py). A worker that
        does not take it ends a forward flip (StepFailed), except the kill switch's and a rollback's: that node is
        owed the mode (and a restart, for a restart flip), given when its sidecar answers again; the ranks'
        confirmation waits for it."""
        d = self.settings.state_dir
        self.volume.write("writing the mode file", mode_path(d), lambda: write_desired_mode(d, mode))
        group = self.readiness.group
        if group is None:
            return
        owe = rollback or mode == Mode.OFF
        failed = await group.write_mode(mode, owe=owe, restart=restart)
        if failed and not owe:
            raise StepFailed(f"the mode file of every node must say {mode}: " + "; ".join(failed.values()))
        if failed:
            self.store.audit("group_mode_owed", None, logging.WARNING, mode=mode, nodes=sorted(failed),
                             detail="; ".join(failed.values()))  # fmt: skip

    async def _restore_mode_file(self, t: Transition) -> str | None:
        """Put the mode file back at t.from_mode: None when it says that afterwards, else why it does not."""
        try:
            await self._write_mode(t.from_mode, restart=t.method == Method.RESTART, rollback=True)
            return None
        except VolumeWriteFailed as e:
            failed = str(e)
        snap = await self.readiness.read_volume()
        if snap is not None and snap.mode_file == t.from_mode:
            return None  # it already did
        if snap is None or snap.mode_file is None:
            says = "it could not be read back" if snap is None else "there is none"
            return f"the mode file could not be written back to {t.from_mode} ({failed}); {says}"
        return (
            f"the mode file could not be written back to {t.from_mode} ({failed}); it still says "
            f"{snap.mode_file}, so the ranks may serve {snap.mode_file}"
        )

    async def _forward(self, t: Transition, *, resume: bool = False) -> None:
        """resume (an unfinished flip to off): every mode file is written again (a node still silent stays owed off),
        and the server is restarted again only when it has not started since this flip restarted it."""
        self._step(t, Step.WRITING_MODE)
        await self._write_mode(t.to_mode, restart=t.method == Method.RESTART)
        if t.method == Method.LIVE:
            self._step(t, Step.AWAITING_RANKS, timeout_s=self.settings.live_flip_timeout_s)
            await self._await_ranks(t, t.to_mode)
            t.confirmed_s = time.time() - t.requested_at
            self._step(t, Step.BAKING, probes=self.settings.bake_probes, confirmed_s=round(t.confirmed_s, 3))
            await self._bake(t, None)
            return
        restarts = await self._restarted_since(t) if resume else None
        if restarts is None:
            restarts = await self._restart(t)
        self._step(t, Step.WAITING_READY)
        await self._wait_ready(t.to_mode, t.restarted_at, restarts, forward=True)
        self._step(t, Step.BAKING, probes=self.settings.bake_probes)
        await self._bake(t, restarts)

    async def _restarted_since(self, t: Transition) -> int | None:
        """The server's restart count when it has started since t restarted it (a group's workers restart first),
        else None."""
        self.readiness.server_flight.invalidate()  # a view from before this sidecar's start may predate that start
        c = (await self.readiness.inspect()).state
        started = c.started_at if c is not None else None
        if t.restarted_at is None or started is None or started <= t.restarted_at:
            return None
        return c.restart_count

    async def _await_ranks(self, t: Transition, mode: Mode) -> None:
        """Until every expected rank's live record reports `mode` (each switches on its own, between verify steps);
        StepFailed naming the ranks that did not within KDTREE_LIVE_FLIP_TIMEOUT_S."""
        s = self.settings
        deadline = time.monotonic() + s.live_flip_timeout_s
        while True:
            snap = await self.readiness.read_volume()
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
                self.save(fatal=t.step != Step.ROLLING_BACK)
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
        previous = self.restart_call
        if previous is not None and not previous.done():
            self.store.audit("awaiting_previous_restart", t, detail="a preempted transition's restart runs")
            await asyncio.wait([previous])  # it cannot be taken back: this restart comes after it
        await self._drain(t, forward)
        if forward:
            self._step(t, Step.RESTARTING)
        t.restarted_at = time.time()  # rank records must come from processes started after this
        self.save(fatal=forward)
        call = asyncio.ensure_future(
            asyncio.to_thread(self.server.restart, self.settings.restart_stop_timeout_s)
        )
        call.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: this task may be gone
        self.restart_call = call
        try:
            await asyncio.shield(call)  # a preempted transition's restart runs to its end on its thread
        except ServerControlError as e:
            raise StepFailed(f"restart failed: {e}") from None
        finally:
            self.readiness.prober.invalidate()  # answers from before the restart say nothing about the new server
            self.readiness.server_flight.invalidate()
        view = await self.readiness.inspect()
        return view.state.restart_count if view.state else None

    async def _drain(self, t: Transition, forward: bool) -> None:
        """/ready answers 503 for KDTREE_DRAIN_S before a running server is stopped: a readinessProbe (periodSeconds x
        failureThreshold) takes the pod out of its Service first, so no new request meets the SIGTERM."""
        s = self.settings
        view = await self.readiness.inspect()
        if s.drain_s <= 0 or view.state is None or not view.state.running:
            return  # nothing serves that could be routed to
        self.readiness.draining_until = time.monotonic() + s.drain_s
        try:
            if forward:
                self._step(t, Step.DRAINING, drain_s=s.drain_s)
            else:
                self.store.audit(Step.DRAINING, t, drain_s=s.drain_s)
            await asyncio.sleep(s.drain_s)
        finally:
            self.readiness.draining_until = None

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
        a = await retrying(self.readiness.assess, mode=mode, started_after=started_after)
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
        c = a.server.state
        if c is None:
            return None
        if c.crashed:
            return f"container {c.status}, exit code {c.exit_code}, OOMKilled {c.oom_killed}"
        if restarts is not None and c.restart_count > restarts:
            return f"the container restarted by itself {c.restart_count - restarts} time(s)"
        return None

    async def _bake(self, t: Transition, restarts: int | None) -> None:
        """N consecutive good probes, all ranks in the new mode, no rank error, no crash since the restart; then
        the evidence that kdtree did the new mode's work on every rank during the window (rank_evidence.bake_evidence).
        The probes decode with speculation, so they produce verify calls when no client traffic does."""
        s = self.settings
        before = await self.readiness.live_records()
        steps: list[int | None] = []
        last_probe = time.time()
        for i in range(s.bake_probes):
            if i:
                await asyncio.sleep(s.bake_interval_s)
            a = await self.readiness.assess(fresh=True, mode=t.to_mode, started_after=t.restarted_at)
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
            records = await self.readiness.live_records()
            if written_since(records, range(s.expected_tp_size), at) or time.monotonic() >= deadline:
                return records
            await asyncio.sleep(min(0.5, s.ready_poll_min_s))

    async def rollback_and_finish(self, t: Transition) -> None:
        try:
            self._step(t, Step.ROLLING_BACK, failure=t.failure)
            not_back = await self._restore_mode_file(t)
            if not_back:
                raise StepFailed(not_back)  # neither a live switch nor a restart can reach the old mode now
            if t.method == Method.LIVE:
                try:
                    await self._await_ranks(t, t.from_mode)
                    a = await self.readiness.assess(fresh=True, mode=t.from_mode)
                    if not a.server_ready:
                        raise StepFailed("not ready after the live rollback: " + "; ".join(a.reasons))
                    self.finish(t, Outcome.ROLLED_BACK)
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
                self.finish(t, Outcome.ROLLED_BACK)
                return
            restarts = await self._restart(t)
            await self._wait_ready(t.from_mode, t.restarted_at, restarts, forward=False)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            known = isinstance(e, StepFailed | VolumeWriteFailed)
            t.rollback_failure = str(e) if known else f"{type(e).__name__}: {e}"
            self.finish(t, Outcome.ROLLBACK_FAILED)
            return
        self.finish(t, Outcome.ROLLED_BACK)

    def finish(self, t: Transition, outcome: Outcome) -> None:
        """Record the outcome; never raises: what the volume does not take stays in memory (/status shows it)."""
        t.outcome, t.finished_at = outcome, time.time()
        t.duration_s = t.finished_at - t.requested_at
        self.metrics.flip_duration.labels(method=t.method).observe(t.duration_s)
        self.state.active = None
        self.state.history.append(t)
        self.save(fatal=False)
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
