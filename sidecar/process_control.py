"""The server seen and restarted as a process, without the Docker socket (KDTREE_SERVER_CONTROL=process).

The server's entrypoint (entrypoint.supervise) records each start in KDTREE_STATE_DIR/server-process.json
and copies the server's output into KDTREE_STATE_DIR/server.log (+ server.log.1). ServerProcess reads
both and maps them onto the same ContainerState the Docker control reports, so the controller's state
machine is the same for both:

  record                                               ContainerState
  no file                                              ContainerMissing (no server has started yet)
  no exit status, launcher alive                       running
  no exit status, launcher gone                        exited, exit code 137, oom_killed (a guess: SIGKILL)
  exit status                                          exited, its exit code; oom_killed when SIGKILL
                                                       killed the server without a stop request
  restart_count = starts seen on the volume - 1, started_at = the start's time

Restarting signals the launcher: SIGTERM (passed on to SGLang), then after the stop timeout SIGKILL to
the server's process group and the launcher; then the orchestrator's restart policy starts the container
again (compose: restart: unless-stopped; Kubernetes: restartPolicy: Always), which shows as a new start
in the record. This needs the sidecar in the server's PID namespace (compose: `pid: service:sidecar` on
the server; Kubernetes: shareProcessNamespace: true) and the same uid (10001 in both images): no
capability and no socket.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from pydantic import ValidationError

from entrypoint.supervise import START_MARK, ServerProcessRecord, log_path, pid_alive, process_path
from kdtree.status import open_regular, own_pid_ns, read_bounded, tail_of

from .docker_control import ContainerMissing, ContainerState, DockerError

_MARK = re.compile(re.escape(START_MARK) + r" #\d+ at \S+ \(t=(\d+(?:\.\d+)?)\)")
LOG_READ_CAP = 4 * 1024 * 1024  # bytes read from the end of the log files per logs() call
RECORD_CAP = 64 * 1024  # bytes: the process record is well under 1 KiB; a larger file is refused unread
KILL_WAIT_S = 10.0  # after SIGKILL: how long the processes may take to disappear


class ProcessControlError(DockerError):
    """The server process could not be seen or signalled; the message names the fix."""


class ServerProcess:
    """inspect, logs and restart of the server through the state volume and signals (a ServerControl)."""

    def __init__(self, state_dir: str | os.PathLike, restart_wait_s: float = 300.0, poll_s: float = 0.2):
        self.name = "server process"
        self.state_dir = Path(state_dir)
        self.restart_wait_s = restart_wait_s
        self.poll_s = poll_s

    # ---- the record ------------------------------------------------------------------------------

    def _record(self) -> ServerProcessRecord:
        try:
            rec = read_process_record(self.state_dir)
        except ValueError as e:
            raise ProcessControlError(f"{e}; the server rewrites it at its next start") from None
        except OSError as e:
            raise ProcessControlError(f"cannot read {process_path(self.state_dir)}: {e}") from None
        if rec is None:
            raise ContainerMissing(
                f"no server has started: {process_path(self.state_dir)} is absent (the server's entrypoint "
                "writes it; the server and the sidecar must share KDTREE_STATE_DIR's volume; with the Docker "
                "socket instead, set KDTREE_SERVER_CONTROL=docker)"
            )
        return rec

    def _alive(self, rec: ServerProcessRecord) -> bool:
        """Is the launcher of a start without exit status still there? Only answerable in its namespace."""
        mine = own_pid_ns()
        if rec.pid_ns and mine and rec.pid_ns != mine:
            raise ProcessControlError(
                f"the server runs in another PID namespace ({rec.pid_ns}; the sidecar's is {mine}): share it "
                "(compose: `pid: service:sidecar` on the server; Kubernetes: shareProcessNamespace: true), "
                "or set KDTREE_SERVER_CONTROL=docker"
            )
        return pid_alive(rec.pid, rec.pid_start_ticks)

    def inspect(self) -> ContainerState:
        rec = self._record()
        base = dict(
            name=self.name,
            restart_count=max(rec.starts - 1, 0),
            started_at=rec.started_at,
        )
        if rec.exited_at is not None:
            killed = rec.signal == "SIGKILL" and rec.stop_signal is None
            error = None
            if rec.signal:
                error = f"the server was killed by {rec.signal}" + (
                    " without a stop request (an OOM kill looks like this)" if killed else ""
                )
            return ContainerState(
                **base,
                status="exited",
                running=False,
                exit_code=rec.exit_code,
                oom_killed=killed,
                finished_at=rec.exited_at,
                error=error,
            )
        if self._alive(rec):
            return ContainerState(**base, status="running", running=True)
        return ContainerState(
            **base,
            status="exited",
            running=False,
            exit_code=128 + signal.SIGKILL,
            oom_killed=True,
            error=f"pid {rec.pid} is gone and recorded no exit status: it was killed with SIGKILL "
            "(an OOM kill looks like this)",
        )

    # ---- the log ---------------------------------------------------------------------------------

    def logs(self, tail: int, since: float | None = None) -> str:
        """The last `tail` lines of the server log (both files); with since, only the start at or after it."""
        path = log_path(self.state_dir)
        try:
            lines = _tail_lines(path, tail)
        except FileNotFoundError:
            raise ProcessControlError(
                f"{path} does not exist: the server's entrypoint writes it unless KDTREE_SERVER_LOG_MAX_BYTES=0"
            ) from None
        except (OSError, ValueError) as e:  # ValueError: not a regular file
            raise ProcessControlError(f"reading {path} failed: {e}") from None
        if since is not None:
            # Lines before the first start mark at or after `since` belong to earlier starts (the mark
            # carries the recorded start time, to the millisecond).
            for i, line in enumerate(lines):
                m = _MARK.match(line)
                if m and float(m.group(1)) >= since - 0.01:
                    lines = lines[i:]
                    break
            else:
                marks = [i for i, line in enumerate(lines) if _MARK.match(line)]
                if marks:  # only older starts' marks: this start's lines are after the last one
                    lines = lines[marks[-1] + 1 :]
        return "\n".join(lines[-tail:])

    # ---- restart ---------------------------------------------------------------------------------

    def restart(self, stop_timeout_s: int) -> None:
        """SIGTERM, SIGKILL after stop_timeout_s, then wait for the orchestrator to start the server again."""
        rec = self._record()
        if rec.exited_at is None and self._alive(rec):
            self._signal(rec.pid, signal.SIGTERM)  # the launcher passes it on to the server
            if not self._wait_gone(rec, stop_timeout_s):
                if rec.server_pid and pid_alive(rec.server_pid, rec.server_start_ticks):
                    self._signal(rec.server_pid, signal.SIGKILL, group=True)
                self._signal(rec.pid, signal.SIGKILL)
                if not self._wait_gone(rec, KILL_WAIT_S):
                    raise ProcessControlError(f"pid {rec.pid} survived SIGKILL for {KILL_WAIT_S:g}s")
        deadline = time.monotonic() + self.restart_wait_s
        while time.monotonic() < deadline:
            try:
                new = read_process_record(self.state_dir)
            except (ValueError, OSError):
                new = None
            if new is not None and (new.starts != rec.starts or new.started_at != rec.started_at):
                return
            time.sleep(self.poll_s)
        raise ProcessControlError(
            f"the server was stopped but did not start again within KDTREE_RESTART_WAIT_S="
            f"{self.restart_wait_s:g}s: its restart policy must start it (compose: restart: unless-stopped; "
            "Kubernetes: restartPolicy: Always)"
        )

    def _signal(self, pid: int, sig: int, group: bool = False) -> None:
        try:
            (os.killpg if group else os.kill)(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            raise ProcessControlError(
                f"not allowed to signal pid {pid}: run the sidecar as the server's uid (10001 in the images)"
            ) from None

    def _wait_gone(self, rec: ServerProcessRecord, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while pid_alive(rec.pid, rec.pid_start_ticks):
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(self.poll_s, 0.05))
        return True


def read_process_record(state_dir: str | os.PathLike) -> ServerProcessRecord | None:
    """The latest start's record (entrypoint.supervise writes it), read as every state file is (bounded, a regular
    file only); None when no server has started on this volume; ValueError (with the path) when unreadable."""
    path = process_path(state_dir)
    try:
        data = read_bounded(path, RECORD_CAP)
    except FileNotFoundError:
        return None
    try:
        return ServerProcessRecord.model_validate_json(data)
    except ValidationError as e:
        raise ValueError(f"{path} is unreadable: {e.errors()[0]['msg']}") from None


def _tail_lines(path: Path, n: int) -> list[str]:
    """The last n lines of path.1 + path (the rotated file first), reading at most LOG_READ_CAP bytes."""
    with open_regular(path) as current:
        lines = tail_of(current, n, LOG_READ_CAP)
        if len(lines) < n:
            older = path.with_name(path.name + ".1")
            try:
                with open_regular(older) as f:
                    # The same file twice: it was rotated between the two opens; what we read is all there is.
                    if os.fstat(f.fileno()).st_ino != os.fstat(current.fileno()).st_ino:
                        lines = tail_of(f, n - len(lines), LOG_READ_CAP) + lines
            except FileNotFoundError:
                pass
    return [line.decode("utf-8", errors="replace") for line in lines]
