"""The desired verify mode, shared on disk between the sidecar (writer) and the server (reader).

The sidecar flips the mode by writing KDTREE_STATE_DIR/mode and restarting the server container;
the server's entrypoint reads it at start and exports KDTREE_VERIFY for every SGLang process.
When the file is absent, the container's KDTREE_VERIFY environment value stands.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kdtree.config import ConfigError, Mode

MODE_FILE = "mode"


def mode_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / MODE_FILE


def read_desired_mode(state_dir: str | os.PathLike) -> Mode | None:
    path = mode_path(state_dir)
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    try:
        return Mode(text)
    except ValueError:
        allowed = ", ".join(m.value for m in Mode)
        raise ConfigError(
            f"{path} holds {text!r}: expected one of {allowed}; fix or delete the file"
        ) from None


def write_desired_mode(state_dir: str | os.PathLike, mode: Mode | str) -> Path:
    mode = Mode(mode)
    path = mode_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".mode.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(mode.value + "\n")
    os.replace(tmp, path)
    return path
