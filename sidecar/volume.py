"""The state volume (KDTREE_STATE_DIR) as the sidecar uses it.

Reads run on one dedicated thread, each kind shared by the callers that ask while it runs and waited for with a
deadline: a hung volume (a stuck network mount) holds that one thread, never the event loop, so GET /live, which
touches no file, always answers. Every file is read bounded and only when it is a regular file
(kdtree.state.atomic.open_regular), so a FIFO is never waited on.

Writes stay on the caller: each one that fails (ENOSPC, EROFS, EACCES, EIO) is logged at ERROR with its path and
errno and stands as the volume's `problem`, which /ready and /status name with its fix, until a later write
succeeds.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from .probe import SingleFlight

if TYPE_CHECKING:
    from .settings import SidecarSettings

log = logging.getLogger("kdtree.sidecar")
T = TypeVar("T")


class VolumeProblem(BaseModel):
    """The latest failed write, until a write succeeds again."""

    operation: str  # e.g. "saving the sidecar state"
    path: str
    errno: str  # its name, e.g. ENOSPC
    strerror: str
    uid: int  # who the sidecar runs as: whose permissions count
    at: float

    @property
    def fix(self) -> str:
        if self.errno in ("ENOSPC", "EDQUOT"):
            return "state volume full: free space or enlarge it"
        if self.errno in ("EACCES", "EPERM"):
            return f"state volume not writable by uid {self.uid}: fix its ownership/permissions"
        if self.errno == "EROFS":
            return f"state volume mounted read-only: mount it read-write for uid {self.uid}"
        if self.errno == "EIO":
            return "state volume I/O error: check the disk or the storage behind the volume"
        return f"writing the state volume failed: check {Path(self.path).parent}"

    @property
    def reason(self) -> str:
        return f"{self.fix} ({self.operation} {self.path} failed: {self.errno} {self.strerror})"


class VolumeWriteFailed(Exception):
    """A write to the state volume failed; str() is the problem with its fix."""

    def __init__(self, problem: VolumeProblem):
        super().__init__(problem.reason)
        self.problem = problem


class StateVolume:
    def __init__(self, state_dir: str | os.PathLike, deadline_s: float):
        self.dir = Path(state_dir)
        self.deadline_s = deadline_s
        self.problem: VolumeProblem | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kdtree-volume")
        self._flights: dict[str, SingleFlight[Any]] = {}

    @classmethod
    def of(cls, settings: SidecarSettings) -> StateVolume:
        """The sidecar's volume: reads give up a little before the probe's deadline, so /ready still has their
        verdict."""
        return cls(settings.state_dir, settings.probe_deadline_s * 0.9)

    # ---- reads ---------------------------------------------------------------------------------------

    async def read(self, key: str, fn: Callable[[], T]) -> T | None:
        """fn() on the volume's thread, shared with every caller of the same key while it runs (a key names one
        fn); None when it has not finished within the deadline (it goes on, and the next caller waits for it)."""
        flight = self._flights.get(key)
        if flight is None:
            loop = asyncio.get_running_loop()
            flight = self._flights[key] = SingleFlight(lambda: loop.run_in_executor(self._thread, fn))
        return await flight.get(0, wait=self.deadline_s)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    # ---- writes --------------------------------------------------------------------------------------

    def write(self, operation: str, path: Path, fn: Callable[[], object], *, retry: bool = False) -> None:
        """Run the write fn(); VolumeWriteFailed (logged, and kept as the problem) when it raises OSError.
        retry: a retry of a standing problem, logged at ERROR only when it fails differently."""
        try:
            fn()
        except OSError as e:
            name = errno.errorcode.get(e.errno or 0, str(e.errno))
            problem = VolumeProblem(
                operation=operation,
                path=str(path),
                errno=name,
                strerror=e.strerror or str(e),
                uid=os.getuid(),
                at=time.time(),
            )
            old = self.problem
            same = old is not None and (old.path, old.errno) == (problem.path, problem.errno)
            log.log(
                logging.DEBUG if retry and same else logging.ERROR,
                "state volume: %s %s failed: %s %s; %s",
                operation,
                path,
                name,
                problem.strerror,
                problem.fix,
            )
            self.problem = problem
            raise VolumeWriteFailed(problem) from e
        if self.problem is not None:
            log.warning("state volume: %s worked again; cleared: %s", operation, self.problem.reason)
            self.problem = None
