"""The server process's record in the state directory (server-process.json) and its log: the one format the server's
entrypoint (entrypoint.supervise) writes and the sidecar's process control (sidecar/server_control/process.py) reads,
as kdtree.state.rank_records is for the ranks' records.

- server-process.json (ServerProcessRecord): one start of the server, rewritten every HEARTBEAT_S while it runs;
- server.log (+ server.log.1): the server's output, each start opened by a start_mark line.
The sidecar's request to stop one start is kdtree.state.restart_request.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from kdtree.state.atomic import read_model, write_atomically

LOG_FILE = "server.log"
PROCESS_FILE = "server-process.json"
HEARTBEAT_S = 2.0  # the state file's heartbeat_at is rewritten this often while the launcher runs
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


def process_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / PROCESS_FILE


def log_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / LOG_FILE


def read_process_record(state_dir: str | os.PathLike) -> ServerProcessRecord | None:
    """The latest start's record, read as every state file is (bounded, a regular file only); None when no server
    has started on this volume; ValueError (with the path) when it is unreadable."""
    path = process_path(state_dir)
    try:
        return read_model(path, RECORD_CAP, ServerProcessRecord)
    except FileNotFoundError:
        return None
    except ValidationError as e:
        raise ValueError(f"{path} is unreadable: {e.errors()[0]['msg']}") from None


def write_process_record(state_dir: str | os.PathLike, record: ServerProcessRecord) -> Path:
    """Atomically replace the record (a reader never sees half of one)."""
    return write_atomically(process_path(state_dir), record.model_dump_json())


def start_mark(starts: int, started_at: float, pid: int) -> str:
    return f"{START_MARK} #{starts} at {iso_time(started_at)} (t={started_at:.3f}), pid {pid}"


def iso_time(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
