"""Per-rank status records: the one format the SGLang ranks write and the sidecar reads; and how every file in
the state directory is written (atomically) and read (bounded, regular files only).

Each tensor-parallel rank owns one JSON file in KDTREE_STATE_DIR, replaced atomically
(write to a temporary file, then rename), so a reader never sees half a record.
Non-finite parity values (a relative error of +inf where the reference is all zeros, NaN from a broken
output) are written as the JSON strings "Infinity", "-Infinity" and "NaN", so the file stays standard JSON;
the reader takes those and JSON's non-standard NaN/Infinity literals alike.
"""

from __future__ import annotations

import errno
import math
import os
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, ValidationError

SCHEMA = 1
RECORD_MAX = 16 * 1024  # bytes: a rank record is about 1 KiB; a larger file is refused unread


class StateFileError(ValueError):
    """A state-directory file that is no regular file, or larger than its kind can be; the message names it."""


class Parity(BaseModel):
    """Validate-mode comparison of kdtree's output against the original, accumulated on the device."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    calls_compared: int = 0
    max_abs_err: float = 0.0
    max_rel_l2: float = 0.0
    calls_over_tol: int = 0
    nan_inf: int = 0  # compared calls where kdtree's output held a NaN or Inf
    rtol: float = 0.0


class RankRecord(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")

    schema_version: int = SCHEMA
    pid: int
    pid_ns: str = ""  # /proc/self/ns/pid of the writer: pids are only comparable inside one namespace
    hostname: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    mode: str  # the mode this rank serves now
    mode_applied_at: FiniteFloat = 0.0  # when it switched to it (its start, until a live switch)
    # the modes it switches to without a restart ([]: it started in off)
    live_modes: list[str] = Field(default_factory=list)
    mode_pending: str | None = None  # the sidecar's desired mode when this rank cannot switch to it live
    installed: bool = False
    override_layers: int = (
        0  # kdtree wrappers in forward_extend's chain in this process: 1 when installed, never 2
    )
    gpu: str | None = None
    compute_capability: str | None = None
    compiled_archs: list[str] = Field(default_factory=list)
    served_kdtree: int = 0  # target-verify calls answered by the kdtree kernel
    served_original: int = 0  # target-verify calls answered by SGLang's Triton path
    fallbacks: dict[str, int] = Field(default_factory=dict)  # reason -> count
    parity: Parity = Field(default_factory=Parity)
    # the first eager and the first captured verify call this rank handled, as metadata (kdtree.verify.describe_call)
    verify_inputs: dict[str, dict] = Field(default_factory=dict)
    last_error: str | None = None
    # Times are finite: a NaN heartbeat would never look old.
    started_at: FiniteFloat = Field(default_factory=time.time)
    heartbeat: FiniteFloat = Field(default_factory=time.time)


class RankView(BaseModel):
    """A record as a reader sees it: the record plus whether its writer is still alive."""

    record: RankRecord
    path: str
    stale: bool
    stale_reason: str | None = None
    age_s: float


def json_safe(value):
    """`value` (dicts, lists, scalars) with each non-finite float as the string the records write for it
    ("Infinity", "-Infinity", "NaN"): JSON has no NaN, and a reader that follows the standard refuses it."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def own_pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def record_path(state_dir: str | os.PathLike, tp_rank: int) -> Path:
    return Path(state_dir) / f"rank-{tp_rank}.json"


STATE_FILE_MODE = 0o640  # owner writes; the group (the other container's user, gid 10001) reads


def write_atomically(path: Path, text: str) -> Path:
    """Replace `path` with `text` through a temporary file and a rename, so that a reader sees the old file or the
    new one, never half of one. Every file in the state directory is written this way, group-readable: the server
    (uid 10001) and the sidecar (uid 10002) share the group 10001 and each reads what the other writes (mkstemp
    alone makes 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, STATE_FILE_MODE)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """`path` opened for reading if it is a regular file; StateFileError for a FIFO, a device, a directory or a
    symbolic link (opened without following it and without blocking, so a FIFO is never waited on);
    FileNotFoundError when it is absent. Every file the sidecar reads in the state directory goes through here."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StateFileError(f"{path} is a symbolic link, not a regular file") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "no regular file"
        raise StateFileError(f"{path} is {kind}, not a regular file")
    return os.fdopen(fd, "rb")


def read_bounded(path: str | os.PathLike, limit: int) -> bytes:
    """The whole of regular file `path`, refused (StateFileError) unread when it is larger than `limit` bytes."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise StateFileError(f"{path} is {max(size, len(data))} bytes, more than the {limit} it can be")
    return data


def tail_of(f: BinaryIO, n: int, cap: int) -> list[bytes]:
    """The last n lines of an open file, reading at most about `cap` bytes from its end."""
    end = f.seek(0, os.SEEK_END)
    pos, data = end, b""
    while pos > 0 and data.count(b"\n") <= n and end - pos < cap:
        step = min(65536, pos)
        pos -= step
        f.seek(pos)
        data = f.read(step) + data
    lines = data.split(b"\n")
    if pos > 0:
        lines = lines[1:]  # the first one may have started before what was read
    if lines and lines[-1] == b"":
        lines.pop()
    return lines[-n:] if n > 0 else []


def write_record(state_dir: str | os.PathLike, record: RankRecord) -> Path:
    """Atomically replace this rank's record."""
    return write_atomically(record_path(state_dir, record.tp_rank), record.model_dump_json())


def pid_exists(pid: int) -> bool:
    """The process exists (a signal 0 reaches it, or it is another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_record(path: str | os.PathLike) -> RankRecord:
    """One rank record; ValueError naming what is wrong (not a regular file, too large, not a record, a schema
    this reader does not know)."""
    data = read_bounded(path, RECORD_MAX)
    try:
        version = _Schema.model_validate_json(data).schema_version
    except ValidationError as e:
        raise ValueError(f"not a rank record: {_first_error(e)}") from None
    if version != SCHEMA:
        raise ValueError(
            f"schema_version {version}; this sidecar reads {SCHEMA}: upgrade the sidecar image to the server's"
        )
    try:
        return RankRecord.model_validate_json(data)
    except ValidationError as e:
        raise ValueError(f"not a rank record: {_first_error(e)}") from None


class _Schema(BaseModel):
    schema_version: int = SCHEMA


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err.get("loc", ()))
    return f"{err['msg']}" + (f" at {where}" if where else "")


def read_records(
    state_dir: str | os.PathLike, max_age_s: float = 30.0, now: float | None = None
) -> list[RankView]:
    """Every rank record in state_dir, sorted by rank, each marked stale when its writer is gone.

    Stale means: the heartbeat is older than max_age_s, or the writer shares our pid namespace and
    its pid no longer exists. A record that cannot be read is reported stale ("unreadable: why"), never dropped.
    """
    now = time.time() if now is None else now
    views: list[RankView] = []
    my_ns = own_pid_ns()
    for path in sorted(Path(state_dir).glob("rank-*.json")):
        try:
            rec = read_record(path)
        except (OSError, ValueError) as e:
            rank = path.stem.removeprefix("rank-")
            rec = RankRecord(
                pid=0,
                mode="unknown",
                tp_rank=int(rank) if rank.isdigit() else -1,
                heartbeat=0,
                last_error=f"unreadable record: {e}",
            )
            views.append(
                RankView(record=rec, path=str(path), stale=True, stale_reason=f"unreadable: {e}", age_s=now)
            )
            continue
        age = now - rec.heartbeat
        reason = None
        if age > max_age_s:
            reason = f"heartbeat {age:.0f}s old (limit {max_age_s:.0f}s)"
        elif rec.pid_ns and rec.pid_ns == my_ns and not pid_exists(rec.pid):
            reason = f"pid {rec.pid} is gone"
        views.append(
            RankView(record=rec, path=str(path), stale=reason is not None, stale_reason=reason, age_s=age)
        )
    views.sort(key=lambda v: v.record.tp_rank)
    return views


def new_record(mode: str, tp_rank: int = 0, tp_size: int = 1) -> RankRecord:
    return RankRecord(
        pid=os.getpid(),
        pid_ns=own_pid_ns(),
        hostname=socket.gethostname(),
        mode=mode,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
