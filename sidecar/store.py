"""The sidecar's memory on disk: the current mode, the transition in progress, the history, the audit log.

The state file is replaced atomically after every step of a transition, so a sidecar that dies mid-way
finds the transition on its next start and resolves it. The audit log is append-only JSON lines; each entry
goes to the process log too, so an entry the volume cannot take is not lost.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kdtree.config import ConfigError, Mode
from kdtree.state.atomic import (
    STATE_FILE_MODE,
    json_safe,
    open_regular,
    read_model,
    tail_of,
    write_atomically,
)

from .vocabulary import HoldVerdict, Method, Outcome, Step
from .volume import StateVolume, VolumeWriteFailed

STATE_FILE = "sidecar-state.json"
AUDIT_FILE = "sidecar-audit.jsonl"
STATE_MAX = 8 * 1024 * 1024  # bytes: the history of KDTREE_HISTORY_LIMIT transitions is far smaller
AUDIT_TAIL_MAX = 4 * 1024 * 1024  # bytes read from the end of the audit log for its last lines

log = logging.getLogger("kdtree.sidecar")


class Transition(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")  # the gate's criteria may hold a rank's NaN

    id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    from_mode: Mode
    to_mode: Mode
    reason: str = ""
    force: bool = False
    requested_at: float = Field(default_factory=time.time)
    # The steps of each method: vocabulary.Step. A value outside the vocabulary makes the file unreadable, named.
    method: Method = Method.RESTART
    step: Step = Step.ACCEPTED
    ranks_confirmed: int = 0  # live: ranks that report the mode being switched to (progress)
    confirmed_s: float | None = None  # live: seconds from the request until every rank confirmed
    outcome: Outcome | None = None
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


class DesiredHold(BaseModel):
    """A desired value (sidecar/desired_mode.py) the sidecar will not act on again until it changes: persisted, so a
    restarted sidecar does not flip into what was refused or rolled back."""

    content: str  # the desired-mode file's text, as read
    generation: str  # its content hash: the same text is the same intent
    verdict: HoldVerdict
    detail: str = ""
    at: float = Field(default_factory=time.time)
    transition: str | None = None  # the transition whose outcome held it


class SidecarState(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")

    current_mode: Mode
    active: Transition | None = None
    history: list[Transition] = Field(default_factory=list)
    desired_hold: DesiredHold | None = None

    def expected_mode(self) -> Mode:
        """The mode the server should be in now (by a transition still running, or the settled one)."""
        t = self.active
        if (
            t is None
            or t.step == Step.ACCEPTED
            or (t.method == Method.RESTART and t.step == Step.WRITING_MODE)
        ):
            return self.current_mode
        return t.from_mode if t.step == Step.ROLLING_BACK else t.to_mode

    def expected_modes(self) -> set[Mode]:
        """The modes the ranks may report now: both ends while a live switch runs (each rank switches on its own)."""
        t = self.active
        if t is not None and t.method == Method.LIVE and t.step != Step.ACCEPTED:
            return {t.from_mode, t.to_mode}
        return {self.expected_mode()}


def append_line(path: Path, line: str) -> None:
    """Append one line, never through a symbolic link (the server's processes can write the volume: a link planted
    there must not aim the sidecar's writes at another file); a new file gets the state volume's mode."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, STATE_FILE_MODE)
    with os.fdopen(fd, "a") as f:
        f.write(line + "\n")


class Store:
    """Writes go through the StateVolume (the controller's, or one of its own): a failed one is logged with its
    path and errno and stands as the volume's problem."""

    def __init__(self, state_dir: str | os.PathLike, history_limit: int, volume: StateVolume | None = None):
        self.volume = volume or StateVolume(state_dir, deadline_s=10.0)
        self.dir = Path(state_dir)
        self.path = self.dir / STATE_FILE
        self.audit_path = self.dir / AUDIT_FILE
        self.history_limit = history_limit

    def load(self, initial_mode: Mode) -> SidecarState:
        try:
            return read_model(self.path, STATE_MAX, SidecarState)
        except FileNotFoundError:
            return SidecarState(current_mode=initial_mode)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ()))
            got = (
                f", got {err['input']!r}"
                if "input" in err and not isinstance(err["input"], dict | list)
                else ""
            )
            raise ConfigError(
                f"{self.path} is unreadable ({err['msg']} at {where}{got}); move it aside to start from the mode file"
            ) from None
        except ValueError as e:  # not a regular file, or too large
            raise ConfigError(f"{e}; move it aside to start from the mode file") from None
        except OSError as e:  # e.g. a file an earlier sidecar (another uid) wrote 0600
            raise ConfigError(
                f"{self.path} cannot be read by uid {os.getuid()} ({e.strerror}): make the state volume the group "
                "10001's (docs/troubleshooting.md: the chgrp/chmod line)"
            ) from None

    def save(self, state: SidecarState, *, retry: bool = False) -> None:
        """Replace the state file; VolumeWriteFailed when the volume does not take it."""
        state.history = state.history[-self.history_limit :]
        text = state.model_dump_json(indent=1)
        self.volume.write(
            "saving the sidecar state", self.path, lambda: write_atomically(self.path, text), retry=retry
        )

    def audit(
        self, event: str, transition: Transition | None = None, level: int = logging.INFO, **details
    ) -> None:
        """Append an entry (and log it); never raises: a failed append stands as the volume's problem."""
        entry = {"ts": time.time(), "event": event, **details}
        if transition is not None:
            entry["transition"] = transition.id
            entry["from_mode"], entry["to_mode"] = transition.from_mode.value, transition.to_mode.value
        line = json.dumps(json_safe(entry), default=str)
        log.log(level, "audit %s", line)

        def append() -> None:
            self.dir.mkdir(parents=True, exist_ok=True)
            append_line(self.audit_path, line)

        try:
            self.volume.write("appending to the audit log", self.audit_path, append)
        except VolumeWriteFailed:
            pass  # logged with the entry above; the problem stands

    def audit_tail(self, n: int) -> list[dict]:
        """The last n entries (bounded: read from the end of the file)."""
        try:
            with open_regular(self.audit_path) as f:
                lines = tail_of(f, n, AUDIT_TAIL_MAX)
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]
