"""The sidecar's memory on disk: the current mode, the transition in progress, the history, the audit log.

The state file is replaced atomically after every step of a transition, so a sidecar that dies mid-way
finds the transition on its next start and resolves it. The audit log is append-only JSON lines.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from kdtree.config import ConfigError, Mode
from kdtree.status import write_atomically

STATE_FILE = "sidecar-state.json"
AUDIT_FILE = "sidecar-audit.jsonl"

log = logging.getLogger("kdtree.sidecar")


class Transition(BaseModel):
    id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    from_mode: Mode
    to_mode: Mode
    reason: str = ""
    force: bool = False
    requested_at: float = Field(default_factory=time.time)
    # live:    accepted -> writing_mode -> awaiting_ranks -> baking -> (succeeded)
    # restart: accepted -> writing_mode -> restarting -> waiting_ready -> baking -> (succeeded)
    # any failure -> rolling_back (live, then by restart if that fails) -> (rolled_back | rollback_failed)
    method: str = "restart"  # live | restart
    step: str = "accepted"
    ranks_confirmed: int = 0  # live: ranks that report the mode being switched to (progress)
    confirmed_s: float | None = None  # live: seconds from the request until every rank confirmed
    outcome: str | None = None  # succeeded | rolled_back | rollback_failed | aborted
    failure: str | None = None  # why the forward flip failed
    rollback_failure: str | None = None
    restarted_at: float | None = None
    finished_at: float | None = None
    duration_s: float | None = None  # from the request until the outcome
    rollback_note: str | None = None  # e.g. the live rollback failed and the server was restarted instead
    gate: list[dict] = Field(default_factory=list)
    interrupted: bool = False  # the sidecar stopped mid-way; resolved on its next start

    @property
    def active(self) -> bool:
        return self.outcome is None


class SidecarState(BaseModel):
    current_mode: Mode
    active: Transition | None = None
    history: list[Transition] = Field(default_factory=list)


class Store:
    def __init__(self, state_dir: str | os.PathLike, history_limit: int):
        self.dir = Path(state_dir)
        self.path = self.dir / STATE_FILE
        self.audit_path = self.dir / AUDIT_FILE
        self.history_limit = history_limit

    def load(self, initial_mode: Mode) -> SidecarState:
        try:
            return SidecarState.model_validate_json(self.path.read_text())
        except FileNotFoundError:
            return SidecarState(current_mode=initial_mode)
        except ValidationError as e:
            err = e.errors()[0]
            raise ConfigError(
                f"{self.path} is unreadable ({err['msg']} at {err.get('loc')}); "
                "move it aside to start from the mode file"
            ) from None

    def save(self, state: SidecarState) -> None:
        state.history = state.history[-self.history_limit :]
        write_atomically(self.path, state.model_dump_json(indent=1))

    def audit(
        self, event: str, transition: Transition | None = None, level: int = logging.INFO, **details
    ) -> None:
        entry = {"ts": time.time(), "event": event, **details}
        if transition is not None:
            entry["transition"] = transition.id
            entry["from_mode"], entry["to_mode"] = transition.from_mode.value, transition.to_mode.value
        log.log(level, "audit %s", json.dumps(entry, default=str))
        self.dir.mkdir(parents=True, exist_ok=True)
        with self.audit_path.open("a") as f:
            f.write(json.dumps(entry, default=str) + "\n")

    def audit_tail(self, n: int) -> list[dict]:
        try:
            lines = self.audit_path.read_text().splitlines()[-n:]
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]
