"""Per-rank status records (rank-<N>.json): the one format the SGLang ranks write (kdtree.state.heartbeat) and the
sidecar reads.

Each tensor-parallel rank owns one JSON file in KDTREE_STATE_DIR, replaced atomically
(write to a temporary file, then rename), so a reader never sees half a record.
Non-finite parity values (a relative error of +inf where the reference is all zeros, NaN from a broken
output) are written as the JSON strings "Infinity", "-Infinity" and "NaN", so the file stays standard JSON;
the reader takes those and JSON's non-standard NaN/Infinity literals alike.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, ValidationError

from kdtree.state.atomic import first_error, read_bounded, write_atomically
from kdtree.state.pids import own_pid_ns, pid_exists

SCHEMA = 1
RECORD_MAX = 16 * 1024  # bytes: a rank record is about 1 KiB; a larger file is refused unread
RECORD_NAME = re.compile(r"rank-([0-9]{1,6})\.json")  # ASCII digits only: "rank-².json" is no rank's record
# A counter as the ranks write it (an int64 on the device); bounded so that no reader's arithmetic or float() of it
# can overflow on a record the server's process wrote by mistake or on purpose.
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
Rank = Annotated[int, Field(ge=-1, le=2**20)]  # -1: a record whose file name carries no rank


class Parity(BaseModel):
    """Validate-mode comparison of kdtree's output against the original, accumulated on the device."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    calls_compared: Count = 0
    max_abs_err: float = 0.0
    max_rel_l2: float = 0.0
    calls_over_tol: Count = 0
    nan_inf: Count = 0  # compared calls where kdtree's output held a NaN or Inf
    rtol: float = 0.0


class DdtreeBudget(BaseModel):
    """DDTREE's auto budget on this rank (kdtree.ddtree.budget; absent unless KDTREE_DDTREE_BUDGET=auto serves)."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    budgets: list[Count] = Field(
        default_factory=list
    )  # what it chooses among (the last: the captured budget)
    steps: Count = 0  # decode steps it chose a budget for
    request_steps: Count = 0  # those steps' requests, summed
    live_tokens: Count = 0  # tokens verified a request (budget + 1), summed over the same
    steps_at: dict[str, Count] = Field(default_factory=dict)  # budget or "chain" -> steps
    # the step's time besides the verify's attention, as the policy estimates it: a tree's step, the chain's
    fixed_ms: float | None = None
    chain_fixed_ms: float | None = None
    chain_replays: Count = 0  # chain steps whose verify replayed the chain's captured graph
    # budget or "chain" -> drafted tokens a request is expected to accept there
    expected_accepted: dict[str, float | None] = Field(default_factory=dict)

    @property
    def mean_verify_tokens(self) -> float | None:
        return self.live_tokens / self.request_steps if self.request_steps else None


class RankRecord(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")

    schema_version: int = SCHEMA
    pid: Annotated[int, Field(ge=0, le=2**31)]
    pid_ns: str = ""  # /proc/self/ns/pid of the writer: pids are only comparable inside one namespace
    hostname: str = ""
    tp_rank: Rank = 0
    tp_size: Annotated[int, Field(ge=1, le=2**20)] = 1
    mode: str  # the mode this rank serves now
    mode_applied_at: FiniteFloat = 0.0  # when it switched to it (its start, until a live switch)
    # the modes it switches to without a restart ([]: it started in off)
    live_modes: list[str] = Field(default_factory=list)
    mode_pending: str | None = None  # the sidecar's desired mode when this rank cannot switch to it live
    installed: bool = False
    override_layers: Count = (
        0  # kdtree wrappers in forward_extend's chain in this process: 1 when installed, never 2
    )
    gpu: str | None = None
    compute_capability: str | None = None
    compiled_archs: list[str] = Field(default_factory=list)
    served_kdtree: Count = 0  # target-verify calls answered by the kdtree kernel
    served_original: Count = 0  # target-verify calls answered by SGLang's Triton path
    fallbacks: dict[str, Count] = Field(default_factory=dict)  # reason -> count
    parity: Parity = Field(default_factory=Parity)
    # the first eager and the first captured verify call this rank handled, as metadata (kdtree.verify.describe_call)
    verify_inputs: dict[str, dict] = Field(default_factory=dict)
    ddtree_budget: DdtreeBudget | None = None
    last_error: str | None = None
    # Times are finite: a NaN heartbeat would never look old.
    started_at: FiniteFloat = Field(default_factory=time.time)
    heartbeat: FiniteFloat = Field(default_factory=time.time)

    @property
    def verify_tokens(self) -> int | None:
        """Tokens one verify reads a request (the draft tree's size N: max_extend_len of the verify calls recorded
        in verify_inputs); None before the rank saw one."""
        sizes = [c.get("max_extend_len") for c in self.verify_inputs.values() if isinstance(c, dict)]
        sizes = [n for n in sizes if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 2**20]
        return max(sizes) if sizes else None


class RankView(BaseModel):
    """A record as a reader sees it: the record plus whether its writer is still alive."""

    record: RankRecord
    path: str
    stale: bool
    stale_reason: str | None = None
    age_s: float


def record_path(state_dir: str | os.PathLike, tp_rank: int) -> Path:
    return Path(state_dir) / f"rank-{tp_rank}.json"


def write_record(state_dir: str | os.PathLike, record: RankRecord) -> Path:
    """Atomically replace this rank's record."""
    return write_atomically(record_path(state_dir, record.tp_rank), record.model_dump_json())


def read_record(path: str | os.PathLike) -> RankRecord:
    """One rank record; ValueError naming what is wrong (not a regular file, too large, not a record, a schema
    this reader does not know)."""
    data = read_bounded(path, RECORD_MAX)
    try:
        version = _Schema.model_validate_json(data).schema_version
    except ValidationError as e:
        raise ValueError(f"not a rank record: {first_error(e)}") from None
    if version != SCHEMA:
        raise ValueError(
            f"schema_version {version}; this sidecar reads {SCHEMA}: upgrade the sidecar image to the server's"
        )
    try:
        return RankRecord.model_validate_json(data)
    except ValidationError as e:
        raise ValueError(f"not a rank record: {first_error(e)}") from None


class _Schema(BaseModel):
    schema_version: int = SCHEMA


def read_records(
    state_dir: str | os.PathLike, max_age_s: float = 30.0, now: float | None = None, limit: int = 1024
) -> list[RankView]:
    """Every rank record in state_dir, sorted by rank, each marked stale when its writer is gone.

    Stale means: the heartbeat is older than max_age_s, or the writer shares our pid namespace and
    its pid no longer exists. A record that cannot be read is reported stale ("unreadable: why"), never dropped.
    At most `limit` files are read, the lowest ranks first; the rest are counted in one unreadable view (each
    reader's work and answer stay bounded whatever the server's processes leave in the volume).
    """
    now = time.time() if now is None else now
    views: list[RankView] = []
    my_ns = own_pid_ns()
    paths = sorted(Path(state_dir).glob("rank-*.json"), key=_rank_order)
    if len(paths) > limit:
        why = f"{len(paths) - limit} more rank-*.json files than the {limit} read: remove the ones no rank writes"
        rec = RankRecord(pid=0, mode="unknown", tp_rank=-1, heartbeat=0, last_error=why)
        views.append(RankView(record=rec, path=str(paths[limit]), stale=True, stale_reason=why, age_s=now))
        paths = paths[:limit]
    for path in paths:
        try:
            rec = read_record(path)
        except (OSError, ValueError) as e:
            named = RECORD_NAME.fullmatch(path.name)
            rec = RankRecord(
                pid=0,
                mode="unknown",
                tp_rank=int(named.group(1)) if named else -1,
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


def _rank_order(path: Path) -> tuple[int, str]:
    named = RECORD_NAME.fullmatch(path.name)
    return (int(named.group(1)) if named else 2**21, path.name)


def new_record(mode: str, tp_rank: int = 0, tp_size: int = 1) -> RankRecord:
    return RankRecord(
        pid=os.getpid(),
        pid_ns=own_pid_ns(),
        hostname=socket.gethostname(),
        mode=mode,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


class RankWork(BaseModel):
    """What one rank did between two of its records: the evidence that the sidecar's bake and `kdtreectl check`
    both judge (kdtree served verify calls in on, compared them in validate, no fallback grew, same process)."""

    restarted: bool  # another process (pid, start) wrote the later record: the counters started again
    served: int  # verify calls kdtree answered (served_kdtree grew by)
    compared: int  # verify calls compared with the original (parity.calls_compared grew by)
    fallbacks_grew: dict[str, int]  # reason -> how many more


def work_between(before: RankRecord, after: RankRecord) -> RankWork:
    b, a = before, after
    return RankWork(
        restarted=(b.pid, b.started_at) != (a.pid, a.started_at),
        served=a.served_kdtree - b.served_kdtree,
        compared=a.parity.calls_compared - b.parity.calls_compared,
        fallbacks_grew={
            r: n - b.fallbacks.get(r, 0) for r, n in a.fallbacks.items() if n > b.fallbacks.get(r, 0)
        },
    )


def written_since(records: dict[int, RankRecord], ranks: Iterable[int], at: float) -> bool:
    """Every one of `ranks` has a record written (its heartbeat) at or after `at`: counters read then include all
    that happened before `at`."""
    return all(r in records and records[r].heartbeat >= at for r in ranks)
