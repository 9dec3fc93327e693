"""KDTREE_STATE_DIR/owed-modes.json, on a group's leader: the worker nodes that the kill switch (or a rollback) could
not reach, each with the mode it is owed and whether a restart is owed too. The leader's sidecar writes it whenever
that changes and reads it at its start, so a node is still given its mode when it answers again after the leader's
sidecar restarted (sidecar/group_leader.py). A missing file owes nothing; so does one with no nodes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kdtree.config import Mode
from kdtree.state.atomic import StateFileError, first_error, read_model, write_atomically

OWED_FILE = "owed-modes.json"
OWED_MAX = 16 * 1024  # bytes: a few fields for each of at most 63 workers; a larger file is refused unread


class OwedMode(BaseModel):
    """What one worker node is owed."""

    model_config = ConfigDict(extra="forbid")

    mode: Mode
    restart: bool  # a restart too: the mode is one its running ranks cannot switch to live (to or from off)


class OwedModes(BaseModel):
    """KDTREE_STATE_DIR/owed-modes.json: by node index, each within 1 .. nnodes-1 (node 0 is the leader, never owed),
    so at most the group's workers (read_owed_modes holds it to the group)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    nodes: dict[int, OwedMode] = Field(default_factory=dict)


def owed_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / OWED_FILE


def write_owed_modes(state_dir: str | os.PathLike, nodes: dict[int, OwedMode]) -> Path:
    return write_atomically(owed_path(state_dir), OwedModes(nodes=nodes).model_dump_json(indent=1))


def read_owed_modes(state_dir: str | os.PathLike, nnodes: int) -> dict[int, OwedMode]:
    """What the file owes, by node; {} when there is no file. StateFileError naming the file and what is wrong with
    it when it is no regular file, too large, not the schema or names a node outside this group's workers
    (1 .. nnodes-1); OSError when it cannot be read."""
    path = owed_path(state_dir)
    try:
        owed = read_model(path, OWED_MAX, OwedModes)
    except FileNotFoundError:
        return {}
    except ValidationError as e:
        raise StateFileError(f"{path} is not an owed-modes file ({first_error(e)})") from None
    outside = sorted(n for n in owed.nodes if not 1 <= n < nnodes)
    if outside:
        raise StateFileError(
            f"{path} names node {', '.join(map(str, outside))}, outside this group's workers "
            f"(1 .. {nnodes - 1}, KDTREE_NNODES={nnodes})"
        )
    return owed.nodes
