"""KDTREE_STATE_DIR/restart-request.json: the sidecar's request (process control) that the server's entrypoint stop one
start of the server, polled every REQUEST_POLL_S by entrypoint.supervise."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field

from kdtree.state.atomic import read_model, write_atomically

REQUEST_FILE = "restart-request.json"
REQUEST_POLL_S = 0.5  # how often the launcher looks for a restart request
REQUEST_MAX = 4096  # bytes: a restart request is a few fields; a larger file is ignored unread


class RestartRequest(BaseModel):
    """KDTREE_STATE_DIR/restart-request.json, written by the sidecar: stop start number `start` as the
    orchestrator's SIGTERM would, SIGKILL the server's process group after stop_timeout_s, and exit."""

    schema_version: int = 1
    id: str = Field(min_length=1, max_length=64)
    start: int = Field(ge=1)  # the start it is meant for (ServerProcessRecord.starts): a later one ignores it
    requested_at: float
    stop_timeout_s: float = Field(ge=0)
    reason: str = Field("", max_length=500)


def request_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / REQUEST_FILE


def write_restart_request(state_dir: str | os.PathLike, request: RestartRequest) -> Path:
    return write_atomically(request_path(state_dir), request.model_dump_json())


def read_restart_request(state_dir: str | os.PathLike) -> RestartRequest | None:
    """The standing restart request; None when there is none or it is unreadable (a request that cannot be read
    is not acted on: the sidecar then reports that its request was not acted on)."""
    try:
        return read_model(request_path(state_dir), REQUEST_MAX, RestartRequest)
    except (OSError, ValueError):
        return None
