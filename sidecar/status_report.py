"""The /status document: the latest assessment, the mode, the state volume, the server's log marker and crash
excerpt, the ranks, and the transitions."""

from __future__ import annotations

import asyncio

from .api import (
    LogStatus,
    ModeStatus,
    SpeculationStatus,
    StateVolumeStatus,
    StatusDocument,
    VolumeProblemReport,
)
from .probe import SingleFlight
from .readiness import Readiness
from .server_control import ServerControlError
from .server_log import LogMarker, crash_excerpt, latest_marker
from .store import SidecarState
from .vocabulary import Phase


class StatusReport:
    def __init__(self, readiness: Readiness, state: SidecarState):
        self.readiness = readiness
        self.settings = readiness.settings
        self.server = readiness.server
        self.prober = readiness.prober
        self.volume = readiness.volume
        self.state = state
        self.log_flight: SingleFlight[str] = SingleFlight(self._logs)

    async def _logs(self) -> str:
        c = self.readiness.server_flight.cached
        since = c.state.started_at if c is not None and c.state is not None else None
        return await asyncio.to_thread(self.server.logs, self.settings.log_tail_lines, since)

    async def document(self) -> StatusDocument:
        a = await self.readiness.assess()
        marker: LogMarker | None = None
        excerpt: list[str] = []
        log_error = None
        c = a.server.state
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
        return StatusDocument(
            phase=a.phase,
            server_phase=a.server_phase,
            ready=a.ready,
            condition=a.condition,
            condition_evidence=a.condition_evidence,
            reasons=a.reasons,
            notes=a.notes,
            mode=ModeStatus(current=self.state.current_mode, expected_now=a.mode, desired_file=a.mode_file),
            state_volume=StateVolumeStatus(
                path=str(self.settings.state_dir),
                problem=VolumeProblemReport(**problem.model_dump(), fix=problem.fix) if problem else None,
            ),
            container=a.server,
            log=LogStatus(latest_marker=marker, crash_excerpt=excerpt, error=log_error),
            probe=a.probe,
            probe_failures_in_a_row=self.prober.failures,
            server_health=self.prober.health,
            ranks=a.ranks.ranks,
            rank_problems=a.ranks.problems,
            expected_tp_size=self.settings.expected_tp_size,
            active_transition=self.state.active.model_copy() if self.state.active else None,
            transitions=[t.model_copy() for t in self.state.history[-10:]],
            speculation=SpeculationStatus(
                accept_length=a.probe.accept_length if a.probe else None,
                verify_tokens=max(
                    (v.record.verify_tokens for v in a.ranks.ranks if v.record.verify_tokens is not None),
                    default=None,
                ),
                mean_verify_tokens=next(
                    (
                        v.record.ddtree_budget.mean_verify_tokens
                        for v in a.ranks.ranks
                        if v.record.tp_rank == 0 and v.record.ddtree_budget is not None
                    ),
                    None,
                ),
            ),
            group=self.readiness.group.node_status(a.ranks.ranks, a.reasons, a.mode_file)
            if self.readiness.group
            else None,
        )
