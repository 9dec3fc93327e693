"""The server process's records in the state directory: the one format the server's entrypoint (entrypoint.supervise)
writes and the sidecar's process control (sidecar/server_control/process.py) reads, as kdtree.status is for the
ranks' records.

- server-process.json (ServerProcessRecord): one start of the server, rewritten every HEARTBEAT_S while it runs;
- restart-request.json (RestartRequest): the sidecar's request to stop one start, polled every REQUEST_POLL_S;
- server.log (+ server.log.1): the server's output, each start opened by a start_mark line.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from kdtree.status import pid_exists, read_bounded, write_atomically

LOG_FILE = "server.log"
PROCESS_FILE = "server-process.json"
REQUEST_FILE = "restart-request.json"
HEARTBEAT_S = 2.0  # the state file's heartbeat_at is rewritten this often while the launcher runs
REQUEST_POLL_S = 0.5  # how often the launcher looks for a restart request
REQUEST_MAX = 4096  # bytes: a restart request is a few fields; a larger file is ignored unread
RECORD_CAP = 64 * 1024  # bytes: the process record is well under 1 KiB; a larger file is refused unread
START_MARK = "kdtree launcher: server start"  # "... #3 at 2026-01-01T00:00:00.000Z (t=1767225600.000), pid 7"
READER_DRAIN_S = 5.0  # after the server exits: how long its output may still take to arrive


class ServerProcessRecord(BaseModel):
    """KDTREE_STATE_DIR/server-process.json: one start of the server, as the launcher saw it."""

    schema_version: int = 1
    pid: int  # the launcher: the container's main process, the one to signal
    pid_ns: str = ""  # /proc/self/ns/pid of the launcher: its pids mean something only in that namespace
    pid_start_ticks: int | None = None  # /proc/<pid>/stat starttime: tells a reused pid apart
    server_pid: int | None = None  # the server (sglang.launch_server), leader of its own process group
    server_start_ticks: int | None = None
    hostname: str = ""
    starts: int = Field(1, ge=1)  # launcher starts seen on this state volume, this one included
    started_at: float
    exited_at: float | None = None
    exit_code: int | None = None  # the launcher's exit status: the server's, or 128+N when signal N killed it
    signal: str | None = None  # the signal that killed the server, e.g. SIGKILL
    stop_signal: str | None = None  # the first stop signal the launcher received (and passed on)
    stop_signal_at: float | None = None  # when it arrived
    restart_request: str | None = None  # the id of the sidecar's restart request this start acted on
    heartbeat_at: float | None = None  # rewritten every HEARTBEAT_S while the launcher runs


class RestartRequest(BaseModel):
    """KDTREE_STATE_DIR/restart-request.json, written by the sidecar: stop start number `start` as the
    orchestrator's SIGTERM would, SIGKILL the server's process group after stop_timeout_s, and exit."""

    schema_version: int = 1
    id: str = Field(min_length=1, max_length=64)
    start: int = Field(ge=1)  # the start it is meant for (ServerProcessRecord.starts): a later one ignores it
    requested_at: float
    stop_timeout_s: float = Field(ge=0)
    reason: str = Field("", max_length=500)


def process_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / PROCESS_FILE


def log_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / LOG_FILE


def read_process_record(state_dir: str | os.PathLike) -> ServerProcessRecord | None:
    """The latest start's record, read as every state file is (bounded, a regular file only); None when no server
    has started on this volume; ValueError (with the path) when it is unreadable."""
    path = process_path(state_dir)
    try:
        data = read_bounded(path, RECORD_CAP)
    except FileNotFoundError:
        return None
    try:
        return ServerProcessRecord.model_validate_json(data)
    except ValidationError as e:
        raise ValueError(f"{path} is unreadable: {e.errors()[0]['msg']}") from None


def write_process_record(state_dir: str | os.PathLike, record: ServerProcessRecord) -> Path:
    """Atomically replace the record (a reader never sees half of one)."""
    return write_atomically(process_path(state_dir), record.model_dump_json())


def request_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / REQUEST_FILE


def write_restart_request(state_dir: str | os.PathLike, request: RestartRequest) -> Path:
    return write_atomically(request_path(state_dir), request.model_dump_json())


def read_restart_request(state_dir: str | os.PathLike) -> RestartRequest | None:
    """The standing restart request; None when there is none or it is unreadable (a request that cannot be read
    is not acted on: the sidecar then reports that its request was not acted on)."""
    try:
        return RestartRequest.model_validate_json(read_bounded(request_path(state_dir), REQUEST_MAX))
    except (OSError, ValueError):
        return None


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a pid in our namespace; None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0].decode(), int(fields[19])


def pid_alive(pid: int, start_ticks: int | None) -> bool:
    """The process is there, not a zombie, and (when start_ticks is known) the same one as recorded."""
    stat = proc_stat(pid)
    if stat is None:
        if Path("/proc/self/stat").exists():
            return False
        return pid_exists(pid)  # no procfs: a plain existence check
    state, ticks = stat
    if state in ("Z", "X"):
        return False
    return start_ticks is None or ticks == start_ticks


def start_mark(starts: int, started_at: float, pid: int) -> str:
    return f"{START_MARK} #{starts} at {iso_time(started_at)} (t={started_at:.3f}), pid {pid}"


def iso_time(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
