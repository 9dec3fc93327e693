"""The sidecar's controller: it holds the claim (one request or transition at a time) and wires the three questions
together: readiness ("is the server ready?", readiness.py), admission ("may this flip run?", admission.py) and the
transition ("run it", transition.py); /status is status_report.py.

A transition runs iff its task runs: the task is the claim, so none outlives it, whatever ends it.

The kill switch: `off` is never gated and is accepted whenever no transition is running; a request for off
while one runs preempts it (unless it already heads to off). The running task is cancelled where it waits,
its transition is finished as `preempted` (history, audit log), and the off transition starts from the mode
the preempted one started from. What the preempted task had set in motion is not taken back: a server restart
under way (a call into Docker or the process control, on a thread) runs to its end, and the off transition
waits for it before it restarts the server itself, so the server comes up in off whatever step the preempted
transition was at; ranks it had switched live are restarted into off with the rest. `standby` (Triton
serves, kdtree idle: the live remedy) is never gated either, and does not preempt. Nor is the mode the server runs in,
asked again while a mode file disagrees (a repair). A flip to off is never rolled back, and one that a previous
sidecar left unfinished is finished at the start (transition.py).
"""

from __future__ import annotations

import asyncio
import logging

from kdtree.config import Mode
from kdtree.state.mode_file import read_desired_mode
from kdtree.state.rank_records import RankView

from .admission import Admission
from .api import ModeAnswer, ModeRequest, StatusDocument
from .group_leader import GroupClient
from .metrics import Metrics
from .readiness import Assessment, Readiness
from .server_control import ServerControl
from .settings import SidecarSettings
from .status_report import StatusReport
from .store import SidecarState, Store
from .transition import TransitionRunner
from .vocabulary import Outcome, Step
from .volume import StateVolume

log = logging.getLogger("kdtree.sidecar")


class Controller:
    def __init__(
        self,
        settings: SidecarSettings,
        server: ServerControl | None,
        metrics: Metrics,
        group: GroupClient | None = None,
    ):
        self.settings = settings
        self.group = group  # a group's leader: the workers' sidecars (sidecar/group_leader.py)
        self.server = server
        self.metrics = metrics
        # A group's leader shares the group's volume: a write of what the workers are owed that fails stands as its
        # problem too.
        self.volume = group.volume if group else StateVolume.of(settings)
        self.store = Store(settings.state_dir, settings.history_limit, self.volume)
        self.state: SidecarState = self.store.load(read_desired_mode(settings.state_dir) or settings.verify)
        self.readiness = Readiness(settings, server, metrics, self.volume, self.store, self.state, group)
        self.admission = Admission(settings, server, metrics, self.store, self.state, self.readiness)
        self.runner = TransitionRunner(settings, server, metrics, self.store, self.state, self.readiness)
        self.report = StatusReport(self.readiness, self.state)
        self._task: asyncio.Task | None = None  # the running request or transition: the claim
        self._requested: Mode | None = None  # what the running request asked for
        self._cancel_reason = ""
        metrics.mode.state(self.state.current_mode.value)

    async def assess(self, fresh: bool = False) -> Assessment:
        return await self.readiness.assess(fresh)

    async def rank_views(self) -> list[RankView]:
        return await self.readiness.rank_views()

    async def status(self) -> StatusDocument:
        return await self.report.document()

    async def start(self) -> None:
        """Resolve a transition that a previous sidecar left unfinished, or adopt a mode file written while no
        sidecar ran (the kill switch by hand: README, "Reaching off when the sidecar is down")."""
        self.readiness.start()
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
                self.runner.save(fatal=False)
                self.metrics.mode.state(written.value)
            return
        t.interrupted = True
        self.store.audit("interrupted_transition_found", t, logging.WARNING, step=t.step)
        if t.to_mode == Mode.OFF:
            # The kill switch is a one-way door: finished, never rolled back (a partition can outlast this sidecar).
            self._start_task(self.runner.run(t, resume=True))
            return
        if t.step in (Step.ACCEPTED, Step.WRITING_MODE):
            # The server was not restarted: putting the mode file back is the whole resolution.
            t.failure = t.failure or f"the sidecar stopped at step {t.step}, before the server was restarted"
            await self.runner.abort(t)
            return
        if self.server is None or (await self.readiness.inspect()).missing:
            # No server (a stack coming back up): it will start from the restored mode file.
            t.failure = t.failure or (
                f"the sidecar stopped at step {t.step}; the server container is gone, and the mode file is "
                f"back at {t.from_mode.value} for its next start"
            )
            await self.runner.abort(t)
            return
        t.failure = t.failure or f"the sidecar stopped at step {t.step}; the server's mode is unverified"
        self._start_task(self.runner.rollback_and_finish(t))

    async def stop(self) -> None:
        """Stop the background probe and a running transition (its persisted state makes the next start resolve it)."""
        await self.readiness.stop()
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
            self.runner.finish(t, Outcome.ROLLBACK_FAILED)

    async def request_mode(self, req: ModeRequest) -> tuple[int, ModeAnswer]:
        """Evaluate and, when allowed, start a transition. Returns (HTTP status, body)."""
        if self.group is not None and req.mode != Mode.OFF:
            # Every node's mode file and ranks take part in a flip: with one unread, only the kill switch runs.
            down = await self.group.unreachable()
            if down:
                return 503, ModeAnswer(
                    from_mode=self.state.current_mode,
                    to_mode=req.mode,
                    error="a flip needs every node of the group, and "
                    + "; ".join(down.values())
                    + ": nothing changed; bring the node back (or POST /mode off, the kill switch, which reaches "
                    "it when it answers again)",
                )
        if req.dry_run:
            status, body, _ = await self.admission.evaluate(req)
            return status, body
        preempted = None
        if self.running():
            if req.mode != Mode.OFF or self._heading_to() == Mode.OFF:
                active = self.state.active
                return 409, ModeAnswer(
                    error="a mode transition is already running; retry when it has finished"
                    + ("" if req.mode == Mode.OFF else " (POST /mode off preempts it)"),
                    transition=active.model_copy() if active else {"step": "evaluating the gate"},
                )
            preempted = self._task
            self._cancel_reason = "preempted by POST /mode off" + (f" ({req.reason})" if req.reason else "")
            preempted.cancel()  # it unwinds at its next await, and touches the state no more
            self._preempt(req)
        # No await since the check above: the new task is the claim before any other request runs.
        answer: asyncio.Future[tuple[int, ModeAnswer]] = asyncio.get_running_loop().create_future()
        self._requested = req.mode
        self._start_task(self._decide_and_run(req, answer, preempted))
        return await asyncio.shield(answer)  # a client that goes away does not cancel the transition

    def _heading_to(self) -> Mode | None:
        """The mode the running request or transition heads to."""
        t = self.state.active
        if t is None:
            return self._requested
        return t.from_mode if t.step == Step.ROLLING_BACK else t.to_mode

    async def _decide_and_run(
        self, req: ModeRequest, answer: asyncio.Future, preempted: asyncio.Task | None
    ) -> None:
        """The request's task: end what it preempts, decide, answer, and run the transition it accepted."""
        try:
            if preempted is not None:
                await asyncio.wait([preempted])  # returns once it has unwound
            status, body, t = await self.admission.evaluate(req)
        except asyncio.CancelledError:
            if not answer.done():
                answer.set_result((409, ModeAnswer(
                    error=f"{self._cancel_reason or 'cancelled'} before this request was decided; nothing changed",
                    transition=None,
                )))  # fmt: skip
            raise
        except BaseException as e:
            if not answer.done():
                answer.set_exception(e)
            raise
        answer.set_result((status, body))
        if t is not None:
            await self.runner.run(t)

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
        self.runner.finish(t, Outcome.PREEMPTED)
