"""The server seen and restarted as a process, without the Docker socket (KDTREE_SERVER_CONTROL=process).

The server's entrypoint (entrypoint.supervise) records each start in KDTREE_STATE_DIR/server-process.json
(kdtree.state.process_record's format), rewrites it every HEARTBEAT_S seconds while it runs, and copies the server's
output into KDTREE_STATE_DIR/server.log (+ server.log.1). ServerProcess reads both and maps them onto the same
ServerState the Docker control reports, so the controller's state machine is the same for both:

  record                                               ServerState
  no file                                              ServerMissing (no server has started yet)
  no exit status, launcher alive                       running
  no exit status, launcher gone                        exited, exit code 137, oom_killed (a guess: SIGKILL)
  exit status                                          exited, its exit code; oom_killed when SIGKILL
                                                       killed the server without a stop request
  restart_count = starts seen on the volume - 1, started_at = the start's time

Alive means: a heartbeat younger than STALE_S (the launcher is in another container and PID namespace, where
its pid means nothing to the sidecar); where the record's pid namespace is the sidecar's own (a test, or a
pod sharing one), the pid itself is checked, which sees a SIGKILL at once.

Restarting sends no signal across containers: the sidecar writes a restart request for the running start into
the state volume (kdtree.state.restart_request.RestartRequest); the launcher acknowledges it in its record, stops the
server as the orchestrator's SIGTERM would (SIGKILL to its process group after the request's stop timeout)
and exits; the orchestrator's restart policy starts the container again (compose: restart: unless-stopped;
Kubernetes: restartPolicy: Always), which shows as a new start in the record. The two containers share only
the state volume (and, for the probe, the network): no PID namespace, no uid, no capability, no socket.
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from pathlib import Path

from kdtree.state.atomic import open_regular, tail_of
from kdtree.state.pids import own_pid_ns, pid_alive
from kdtree.state.process_record import (
    HEARTBEAT_S,
    READER_DRAIN_S,
    START_MARK,
    ServerProcessRecord,
    log_path,
    process_path,
    read_process_record,
)
from kdtree.state.restart_request import REQUEST_POLL_S, RestartRequest, request_path, write_restart_request

from .protocol import ServerControlError, ServerMissing, ServerState

_MARK = re.compile(re.escape(START_MARK) + r" #\d+ at \S+ \(t=(\d+(?:\.\d+)?)\)")
LOG_READ_CAP = 4 * 1024 * 1024  # bytes read from the end of the log files per logs() call
STALE_S = 5 * HEARTBEAT_S  # a launcher whose record has not been rewritten for this long is gone
ACK_S = 10.0  # how long the launcher has to acknowledge a restart request (it looks every REQUEST_POLL_S)
KILL_WAIT_S = 10.0  # after the stop timeout: how long the launcher may take to SIGKILL the server and exit


class ProcessControlError(ServerControlError):
    """The server process could not be seen or signalled; the message names the fix."""


class ServerProcess:
    """inspect, logs and restart of the server through the state volume and signals (a ServerControl)."""

    def __init__(
        self,
        state_dir: str | os.PathLike,
        restart_wait_s: float = 300.0,
        poll_s: float = 0.2,
        ack_s: float = ACK_S,
    ):
        self.name = "server process"
        self.state_dir = Path(state_dir)
        self.restart_wait_s = restart_wait_s
        self.poll_s = poll_s
        self.ack_s = ack_s

    # ---- the record ------------------------------------------------------------------------------

    def _record(self) -> ServerProcessRecord:
        try:
            rec = read_process_record(self.state_dir)
        except ValueError as e:
            raise ProcessControlError(f"{e}; the server rewrites it at its next start") from None
        except OSError as e:
            raise ProcessControlError(f"cannot read {process_path(self.state_dir)}: {e}") from None
        if rec is None:
            raise ServerMissing(
                f"no server has started: {process_path(self.state_dir)} is absent (the server's entrypoint "
                "writes it; the server and the sidecar must share KDTREE_STATE_DIR's volume; with the Docker "
                "socket instead, set KDTREE_SERVER_CONTROL=docker)"
            )
        return rec

    def _alive(self, rec: ServerProcessRecord) -> bool:
        """Is the launcher of a start without exit status still there: its pid where it is in our PID namespace,
        else its heartbeat."""
        mine = own_pid_ns()
        if not rec.pid_ns or rec.pid_ns == mine:
            return pid_alive(rec.pid, rec.pid_start_ticks)
        if rec.heartbeat_at is None:
            raise ProcessControlError(
                f"{process_path(self.state_dir)} has no heartbeat and comes from another PID namespace: the server "
                "runs an older entrypoint; run the server image of this sidecar's version"
            )
        return time.time() - rec.heartbeat_at <= STALE_S

    def inspect(self) -> ServerState:
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
            return ServerState(
                **base,
                status="exited",
                running=False,
                exit_code=rec.exit_code,
                oom_killed=killed,
                finished_at=rec.exited_at,
                error=error,
            )
        if self._alive(rec):
            return ServerState(**base, status="running", running=True)
        gone = (
            f"its heartbeat stopped {time.time() - rec.heartbeat_at:.0f}s ago"
            if rec.heartbeat_at is not None and rec.pid_ns and rec.pid_ns != own_pid_ns()
            else f"pid {rec.pid} is gone"
        )
        return ServerState(
            **base,
            status="exited",
            running=False,
            exit_code=128 + signal.SIGKILL,
            oom_killed=True,
            error=f"the launcher recorded no exit status and {gone}: it was killed with SIGKILL "
            "(an OOM kill or `docker kill` looks like this)",
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
        """Ask the running start's launcher to stop (SIGKILL after stop_timeout_s) and exit, then wait for the
        orchestrator to start the server again."""
        rec = self._record()
        if rec.exited_at is None and self._alive(rec):
            request = RestartRequest(
                id=uuid.uuid4().hex[:16],
                start=rec.starts,
                requested_at=time.time(),
                stop_timeout_s=stop_timeout_s,
            )
            path = request_path(self.state_dir)
            try:
                write_restart_request(self.state_dir, request)
            except OSError as e:
                raise ProcessControlError(f"cannot write the restart request {path}: {e}") from None
            acked = self._wait_record(
                lambda r: r.restart_request == request.id or _other_start(r, rec), self.ack_s
            )
            if acked is None:
                raise ProcessControlError(
                    f"the server's launcher did not act on the restart request {path} within {self.ack_s:g}s (it looks "
                    f"every {REQUEST_POLL_S:g}s): it is hung or not this version's entrypoint. Restart the server "
                    "container by hand (compose: docker compose restart server; Kubernetes: kubectl delete pod), "
                    "and run the server image of this sidecar's version"
                )
            stop_s = stop_timeout_s + KILL_WAIT_S + READER_DRAIN_S
            if self._wait_record(lambda r: r.exited_at is not None or _other_start(r, rec), stop_s) is None:
                raise ProcessControlError(
                    f"the server's launcher acknowledged the restart request {request.id} but recorded no exit "
                    f"within {stop_s:g}s: restart the server container by hand (compose: docker compose restart "
                    "server; Kubernetes: kubectl delete pod)"
                )
        if self._wait_record(lambda r: _other_start(r, rec), self.restart_wait_s) is None:
            raise ProcessControlError(
                f"the server was stopped but did not start again within KDTREE_RESTART_WAIT_S="
                f"{self.restart_wait_s:g}s: its restart policy must start it (compose: restart: unless-stopped; "
                "Kubernetes: restartPolicy: Always)"
            )

    def _wait_record(self, done, timeout: float) -> ServerProcessRecord | None:
        """The first record for which done(record) holds, polled for up to timeout seconds; None when none did."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                rec = read_process_record(self.state_dir)
            except (ValueError, OSError):
                rec = None
            if rec is not None and done(rec):
                return rec
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.poll_s)


def _other_start(new: ServerProcessRecord, old: ServerProcessRecord) -> bool:
    return new.starts != old.starts or new.started_at != old.started_at


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
