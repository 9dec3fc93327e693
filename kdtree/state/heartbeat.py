"""The rank's heartbeat: who this process is (tp rank/size), a thread that rewrites its status record, and the
sidecar's mode file followed.

The heartbeat thread never makes a CUDA call (one could break a graph capture running in the scheduler's
main thread): it reads host-side counters and the kernel library's pinned host mirrors only, it switches the
mode with a store to pinned host memory, and it finds the tp rank in SGLang's already-imported runtime
context (plain Python objects) without importing anything.

A process writes a record only once it knows it is a tensor-parallel scheduler (SGLang publishes the
"scheduler" role and its ranks right after loading plugins). Other processes that install the override
(the launcher, the detokenizer, the DP controller) never write one, so they cannot clobber a rank's file.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kdtree.config import ConfigError, Mode
from kdtree.state.mode_file import read_desired_mode
from kdtree.state.rank_records import DdtreeBudget, Parity, RankRecord, new_record, write_record

log = logging.getLogger("kdtree")

RUNTIME_CONTEXT = "sglang.srt.runtime_context"
UNKNOWN_RANK_POLL_S = 0.5  # how often to look for the tp rank until SGLang publishes it
MODE_POLL_S = 0.5  # how often to read the sidecar's mode file: a live switch is confirmed within about this


def scheduler_tp_rank() -> tuple[int, int] | None:
    """(tp_rank, tp_size) when this process is a published SGLang scheduler, else None. No imports, no CUDA."""
    rc = sys.modules.get(RUNTIME_CONTEXT)
    if rc is None:
        return None
    try:
        if rc.publish_role() != "scheduler":
            return None
        parallel = rc.get_parallel()
        return int(parallel.tp_rank), int(parallel.tp_size)
    except Exception:  # not published yet: ParallelContext raises on unset names
        return None


class Heartbeat:
    """Builds and writes this process's RankRecord from the override's host-side snapshot."""

    def __init__(
        self,
        state_dir: str,
        snapshot: Callable[[], dict],
        installed: Callable[[], bool],
        rank_source: Callable[[], tuple[int, int] | None] = scheduler_tp_rank,
        follow: Callable[[Mode | None], bool] | None = None,
        layers: Callable[[], int] | None = None,
    ):
        self.state_dir = state_dir
        self._snapshot = snapshot
        self._installed = installed
        self._layers = layers or (lambda: int(installed()))  # kdtree wrappers on forward_extend
        self._rank_source = rank_source
        self._follow = follow  # applies the desired mode (ModeHolder.follow); True when the mode changed
        self.mode_file_error: str | None = None
        self.rank: tuple[int, int] | None = None
        self.started_at = time.time()
        self.write_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def resolve_rank(self) -> tuple[int, int] | None:
        if self.rank is None:
            self.rank = self._rank_source()
        return self.rank

    def record(self) -> RankRecord | None:
        """This rank's record now, or None while the process is not (yet) a known tp rank."""
        rank = self.resolve_rank()
        if rank is None:
            return None
        snap = self._snapshot()
        rec = new_record(mode=snap["mode"], tp_rank=rank[0], tp_size=rank[1])
        rec.mode_applied_at = snap.get("mode_applied_at", rec.started_at)
        rec.live_modes = snap.get("live_modes", [])
        rec.mode_pending = snap.get("mode_pending")
        rec.installed = self._installed()
        rec.override_layers = self._layers()
        rec.started_at = self.started_at
        rec.gpu = snap.get("gpu")
        rec.compute_capability = snap.get("compute_capability")
        rec.compiled_archs = snap.get("compiled_archs", [])
        rec.served_kdtree = snap["served_kdtree"]
        rec.served_original = snap["served_original"]
        rec.fallbacks = snap["fallbacks"]
        if snap.get("parity"):
            rec.parity = Parity(**snap["parity"])
        rec.verify_inputs = snap.get("verify_inputs", {})
        if snap.get("ddtree_budget"):
            rec.ddtree_budget = DdtreeBudget(**snap["ddtree_budget"])
        rec.last_error = snap.get("last_error") or self.mode_file_error or self.write_error
        return rec

    def follow_mode_file(self) -> bool:
        """Apply the sidecar's mode file (KDTREE_STATE_DIR/mode) if it asks for a live switch; True when the
        mode changed. Never raises: an unreadable file is reported in the record and changes nothing."""
        if self._follow is None:
            return False
        try:
            desired = read_desired_mode(self.state_dir)
        except (ConfigError, OSError) as e:
            self.mode_file_error = f"mode file: {e}"
            return False
        self.mode_file_error = None
        return self._follow(desired)

    def beat(self) -> Path | None:
        """Write the record if this process is a known tp rank; never raises (the record shows the error)."""
        try:
            rec = self.record()
            if rec is None:
                return None
            path = write_record(self.state_dir, rec)
            self.write_error = None
            return path
        except Exception as e:
            if self.write_error is None:
                log.warning("kdtree: cannot write the status record in %s: %s", self.state_dir, e)
            self.write_error = f"status record: {e}"
            return None

    def start(self, interval_s: float) -> None:
        """Start the daemon heartbeat thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, args=(interval_s,), name="kdtree-heartbeat", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self, interval_s: float) -> None:
        """Read the mode file every MODE_POLL_S; write the record every interval_s, and at once on a switch."""
        due = 0.0
        while True:
            switched = self.follow_mode_file()
            now = time.monotonic()
            if switched or now >= due or self.rank is None:
                self.beat()
                due = now + interval_s
            if self._stop.wait(
                min(interval_s, MODE_POLL_S if self.rank is not None else UNKNOWN_RANK_POLL_S)
            ):
                return
