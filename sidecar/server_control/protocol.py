"""What the sidecar sees of and does to the server: inspect, logs, restart.

Everything the sidecar does to the server goes through a ServerControl: docker.ServerContainer (the Docker SDK,
KDTREE_SERVER_CONTROL=docker) or process.ServerProcess (the entrypoint's record and log in the state volume, a
restart request there, no socket: KDTREE_SERVER_CONTROL=process). Both report the same ServerState and raise a
ServerControlError when they cannot answer or act, so the state machine is the same for both, and can be tested
with any object that has the three methods.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel


class ServerControlError(RuntimeError):
    """The server control could not answer or act; the message says what was attempted and the fix."""


class ServerMissing(ServerControlError):
    """Docker answers, but no container has the configured name (e.g. compose has not created it yet);
    process control: no server has started on the state volume yet."""


class ServerState(BaseModel):
    name: str
    status: str  # created | running | paused | restarting | removing | exited | dead
    running: bool
    exit_code: int | None = None
    oom_killed: bool = False
    restart_count: int = 0
    started_at: float | None = None  # epoch seconds of the latest start
    finished_at: float | None = None
    error: str | None = None
    health: str | None = None

    @property
    def crashed(self) -> bool:
        """Down, or in Docker's own restart loop: the server process died."""
        return self.status in ("exited", "dead", "restarting") or self.oom_killed


class ServerControl(Protocol):
    name: str

    def inspect(self) -> ServerState: ...

    def logs(self, tail: int, since: float | None = None) -> str: ...

    def restart(self, stop_timeout_s: int) -> None: ...
