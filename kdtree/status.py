"""Per-rank status records: the one format the SGLang ranks write and the sidecar reads.

Each tensor-parallel rank owns one JSON file in KDTREE_STATE_DIR, replaced atomically
(write to a temporary file, then rename), so a reader never sees half a record.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, Field

SCHEMA = 1


class Parity(BaseModel):
    """Validate-mode comparison of kdtree's output against the original, accumulated on the device."""

    calls_compared: int = 0
    max_abs_err: float = 0.0
    max_rel_l2: float = 0.0
    calls_over_tol: int = 0
    nan_inf: int = 0  # compared calls where kdtree's output held a NaN or Inf
    rtol: float = 0.0


class RankRecord(BaseModel):
    schema_version: int = SCHEMA
    pid: int
    pid_ns: str = ""  # /proc/self/ns/pid of the writer: pids are only comparable inside one namespace
    hostname: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    mode: str  # the mode this rank serves now
    mode_applied_at: float = 0.0  # when it switched to it (its start, until a live switch)
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
    started_at: float = Field(default_factory=time.time)
    heartbeat: float = Field(default_factory=time.time)


class RankView(BaseModel):
    """A record as a reader sees it: the record plus whether its writer is still alive."""

    record: RankRecord
    path: str
    stale: bool
    stale_reason: str | None = None
    age_s: float


def own_pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def record_path(state_dir: str | os.PathLike, tp_rank: int) -> Path:
    return Path(state_dir) / f"rank-{tp_rank}.json"


def write_atomically(path: Path, text: str) -> Path:
    """Replace `path` with `text` through a temporary file and a rename, so that a reader sees the old file or the
    new one, never half of one. Every file in the state directory is written this way."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_record(state_dir: str | os.PathLike, record: RankRecord) -> Path:
    """Atomically replace this rank's record."""
    return write_atomically(record_path(state_dir, record.tp_rank), record.model_dump_json())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_records(
    state_dir: str | os.PathLike, max_age_s: float = 30.0, now: float | None = None
) -> list[RankView]:
    """Every rank record in state_dir, sorted by rank, each marked stale when its writer is gone.

    Stale means: the heartbeat is older than max_age_s, or the writer shares our pid namespace and
    its pid no longer exists. A record that cannot be parsed is reported stale, never dropped.
    """
    now = time.time() if now is None else now
    views: list[RankView] = []
    my_ns = own_pid_ns()
    for path in sorted(Path(state_dir).glob("rank-*.json")):
        try:
            rec = RankRecord.model_validate(json.loads(path.read_text()))
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
                RankView(record=rec, path=str(path), stale=True, stale_reason="unreadable", age_s=now)
            )
            continue
        age = now - rec.heartbeat
        reason = None
        if age > max_age_s:
            reason = f"heartbeat {age:.0f}s old (limit {max_age_s:.0f}s)"
        elif rec.pid_ns and rec.pid_ns == my_ns and not _pid_alive(rec.pid):
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
