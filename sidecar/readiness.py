"""Readiness: is the server ready? The background probe, and the one assessment that /ready, /status, the gate
and a transition all read.

A background task probes on its own cadence (KDTREE_PROBE_INTERVAL_S: the sidecar, not whoever polls /ready, decides
when a completion is sent), and /ready answers from the latest verdicts without waiting on a probe. A server that
has served since its latest start stays ready through failed probes until KDTREE_PROBE_FAILURE_THRESHOLD of them in
a row, and past that, for probes that queued behind traffic (a timeout, a 503 or 429), for as long as SGLang's
load-aware /health answers 200; a refused connection, a dead or stale rank and a crashed server count at once. A
server that has not served since its start is judged by the completion probe alone, and so are the bake and a
flip's wait for readiness (a fresh probe each, strictly). /ready also answers 503 while `draining_until`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from pydantic import BaseModel

from kdtree.config import Mode
from kdtree.state.rank_records import RankRecord, RankView

from .api import ServerView
from .group_leader import GroupClient
from .metrics import Metrics
from .probe import HTTP_STATUS, REFUSED, TIMEOUT, Prober, ProbeResult, SingleFlight
from .rank_evidence import (
    RankCheck,
    VolumeReading,
    check_ranks,
    live_records,
    mode_file_problems,
    mode_file_text,
    node_mode_file_problems,
    read_volume,
)
from .server_control import ServerControl, ServerState
from .settings import SidecarSettings
from .store import SidecarState, Store
from .vocabulary import Condition, Method, Phase, Step
from .volume import StateVolume, VolumeWriteFailed

log = logging.getLogger("kdtree.sidecar")

BUSY_STATUS = (429, 503)  # a completion refused for load (or while SGLang drains): /health decides


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
    server: ServerView  # the server control's view (/status: "container")
    ranks: RankCheck
    mode_file: str | None  # what the mode file says, for /status


class Readiness:
    """The server's observed state: the background probe, the server control's view, the state volume's reading,
    and the verdict built from them (assess). `state` is the sidecar's (shared with the transition): a running
    transition decides which mode the server is expected in."""

    def __init__(
        self,
        settings: SidecarSettings,
        server: ServerControl | None,
        metrics: Metrics,
        volume: StateVolume,
        store: Store,
        state: SidecarState,
        group: GroupClient | None = None,
    ):
        self.settings = settings
        self.group = group  # a group's leader: the workers' ranks join the reading (sidecar/group_leader.py)
        self.server = server
        self.metrics = metrics
        self.volume = volume
        self.store = store
        self.state = state
        self.prober = Prober(
            settings.server_url,
            settings.probe_prompt,
            settings.probe_max_tokens,
            settings.probe_deadline_s,
            settings.served_model_name,
            settings.server_api_key.get_secret_value() if settings.server_api_key else None,
        )
        self.prober.on_result = self._observe_probe
        self.draining_until: float | None = None  # monotonic: /ready is 503 until the server is stopped
        self.server_flight: SingleFlight[ServerView] = SingleFlight(self.inspect)
        self._monitor_task: asyncio.Task | None = None
        self._born = time.monotonic()
        self._retried_at = 0.0  # when a save was last retried while the volume had a problem

    def start(self) -> None:
        self._monitor_task = asyncio.create_task(self._monitor())

    async def stop(self) -> None:
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            await asyncio.wait([self._monitor_task])

    async def read_volume(self, *, workers: bool = True) -> VolumeReading | None:
        """The rank records and the mode file; None when the volume did not answer within the deadline. A group's
        leader: with every worker's ranks and facts (GroupClient.merge); workers=False: their latest reports, read
        before, so that nothing waits on a worker that does not answer (the kill switch)."""
        snap = await self.volume.read("volume", lambda: read_volume(self.settings))
        if snap is not None and self.group is not None:
            snap = await self.group.merge(snap, fresh=workers)
        return snap

    async def rank_views(self) -> list[RankView]:
        snap = await self.read_volume()
        return snap.views if snap else []

    async def live_records(self) -> dict[int, RankRecord]:
        snap = await self.read_volume()
        return live_records(self.settings, snap.views) if snap else {}

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
        if result.accept_length is not None:
            self.metrics.accept_length.set(result.accept_length)
        if not result.ok:
            self.metrics.probe_failures.labels(reason=result.reason).inc()

    async def inspect(self) -> ServerView:
        return await ServerView.inspect(self.server)

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
        modes = {mode} if mode else self.state.expected_modes()
        mode = mode or self.state.expected_mode()
        self._retry_save()
        probe, server, snap = await asyncio.gather(
            self._probe_for(fresh),
            self.server_flight.get(1.0, wait=s.probe_deadline_s),  # at most one inspection a second
            self.read_volume(),
        )
        server = server or ServerView(error=f"Docker did not answer within {s.probe_deadline_s:g}s")
        # What came before the server's latest start (a crash and the restart policy, a restart by hand) is the
        # previous server's: neither its last probe nor its ranks' records speak for this one.
        begun = server.state.started_at if server.state else None
        requested_after = started_after  # a worker's server starts apart from this one: its own start counts
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
            node_after = {0: started_after} | {
                n: max((x for x in (requested_after, at) if x is not None), default=None)
                for n, at in snap.node_started_at.items()
            }
            ranks = check_ranks(s, snap.views, modes, started_after, unreachable=snap.unreachable,
                                node_after=node_after if self.group else None)  # fmt: skip
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
            problem, note = self._failed_probe(probe, server.state, fresh)
            reasons += [problem] if problem else []
            notes += [note] if note else []
        tolerated = bool(notes)
        current = None if stale_probe else probe
        server_phase = self._server_phase(current, server.state, ranks, tolerated)
        if server.state and server.state.crashed:
            reasons.append(
                f"server container is {server.state.status} (exit code {server.state.exit_code}, "
                f"OOMKilled {server.state.oom_killed})"
            )
        reasons += ranks.problems + (snap.node_problems if snap else [])
        server_ready = not reasons
        state_problems = [self.volume.problem.reason] if self.volume.problem else []
        if self.state.active is None:  # a transition rewrites the mode file
            state_problems += mode_file_problems(snap, self.state.current_mode)
            state_problems += node_mode_file_problems(snap, self.state.current_mode)
        reasons += state_problems
        if self.draining_until is not None:
            left = max(0.0, self.draining_until - time.monotonic())
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
        condition, evidence = self._condition(ready, server, current, state_problems)
        if self.group is not None and not ready:
            # What the other nodes lack comes first: the leader's own view says less about them.
            others = [r for r in reasons if r.startswith("node ") and not r.startswith("node 0 ")]
            evidence = others[:4] + evidence
        # The latest assessment is the sidecar's verdict, whoever asked for it (/ready, /status, a transition).
        self.metrics.ready.set(1 if ready else 0)
        self.metrics.condition.state(condition)
        self.metrics.assessments.inc()
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
            server=server,
            ranks=ranks,
            mode_file=mode_file_text(snap),
        )

    def _served_since_start(self, c: ServerState | None) -> bool:
        ok_at, started = self.prober.last_ok_at, c.started_at if c is not None else None
        return ok_at is not None and (started is None or ok_at > started)

    def _failed_probe(
        self, probe: ProbeResult, c: ServerState | None, fresh: bool
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

    def _condition(
        self, ready: bool, server: ServerView, probe: ProbeResult | None, state_problems: list[str]
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
        s, c = self.settings, server.state
        if c is not None and c.crashed:
            return Condition.BROKEN, [f"the server process is {c.status} (exit code {c.exit_code})"]
        if server.missing:
            up, grace = time.monotonic() - self._born, s.start_grace_s
            if up > grace:
                return Condition.BROKEN, [
                    f"no server has started in the {up:.0f}s since the sidecar started "
                    f"(KDTREE_START_GRACE_S={grace:g}): the server container is not running, or does not "
                    f"share the state volume {s.state_dir} with the sidecar",
                    str(server.error),
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
        self, probe: ProbeResult | None, server: ServerState | None, ranks: RankCheck, tolerated: bool
    ) -> Phase:
        if server is not None:
            if server.crashed:
                return Phase.CRASHED
            if server.status == "created":
                return Phase.STARTING
        if probe is None:
            return Phase.STARTING
        if probe.ok or tolerated:
            return Phase.READY if ranks.ok else Phase.DEGRADED
        started = (server.started_at if server else None) or 0.0
        served_since_start = self.prober.last_ok_at is not None and self.prober.last_ok_at > started
        if probe.reason == REFUSED:
            # SGLang keeps its port closed until weights and CUDA graphs are in place; after serving, a closed
            # port means it stopped answering.
            return Phase.DEGRADED if served_since_start and server is not None else Phase.LOADING
        since = max(self.prober.last_refused_at or 0.0, started)
        served_since_start = self.prober.last_ok_at is not None and self.prober.last_ok_at > since
        answering_busy = probe.reason == TIMEOUT or (probe.reason == HTTP_STATUS and probe.status_code == 503)
        if answering_busy and not served_since_start:
            return Phase.WARMING  # the port is open, the first completions are not through yet
        return Phase.DEGRADED
