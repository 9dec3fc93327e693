"""The verify mode: the desired one, shared on disk between the sidecar (writer) and the server (reader), and
the one a process serves now (ModeHolder).

The sidecar writes KDTREE_STATE_DIR/mode. The server's entrypoint reads it at start and exports KDTREE_VERIFY
for every SGLang process; while the server runs, each rank's heartbeat reads it too and switches live between
validate, on and standby (kdtree.state.heartbeat). To or from off the sidecar restarts the server instead.
When the file is absent, the container's KDTREE_VERIFY environment value stands.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from kdtree.config import LIVE_MODES, ConfigError, Mode
from kdtree.state.atomic import read_bounded, write_atomically

MODE_FILE = "mode"
MODE_MAX = 64  # bytes: the file holds one mode name


def mode_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / MODE_FILE


def read_desired_mode(state_dir: str | os.PathLike) -> Mode | None:
    """The mode in the mode file; None when there is none; ConfigError naming the fix when it holds anything but
    a mode (or is no regular file, or too large)."""
    path = mode_path(state_dir)
    try:
        text = read_bounded(path, MODE_MAX).decode("utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ConfigError(f"{e}; fix or delete the file") from None
    try:
        return Mode(text)
    except ValueError:
        allowed = ", ".join(m.value for m in Mode)
        raise ConfigError(
            f"{path} holds {text!r}: expected one of {allowed}; fix or delete the file"
        ) from None


def write_desired_mode(state_dir: str | os.PathLike, mode: Mode | str) -> Path:
    return write_atomically(mode_path(state_dir), Mode(mode).value + "\n")


class ModeHolder:
    """The process's verify mode. The serving thread reads it once per eager verify step; calls captured into
    CUDA graphs read its pinned copy (kernel.ModeWord) on the device once per replay. So the heartbeat thread
    switches it (`follow`) with a plain store: no CUDA call, no recapture."""

    def __init__(self, mode: Mode | str):
        self.started = Mode(mode)
        self.mode = self.started
        self.applied_at = time.time()
        self.pending: Mode | None = None  # a desired mode this process cannot switch to while it runs
        self._word = None
        self._lock = threading.Lock()

    @property
    def live_modes(self) -> frozenset[Mode]:
        """The modes this process switches between while it runs: none when it started in off."""
        return LIVE_MODES if self.started in LIVE_MODES else frozenset()

    def set(self, mode: Mode | str) -> None:
        mode = Mode(mode)
        with self._lock:
            if mode is not self.mode:
                self.applied_at = time.time()
            self.mode = mode
            if self._word is not None:
                self._word.set(mode.value)

    def follow(self, desired: Mode | None) -> bool:
        """Switch to the sidecar's desired mode when both it and the current mode are live modes; True when the
        mode changed. Any other change (to or from off) stays pending until the server restarts into it."""
        if desired is None or desired is self.mode:
            self.pending = None
            return False
        if desired in self.live_modes and self.mode in self.live_modes:
            self.set(desired)
            self.pending = None
            return True
        self.pending = desired
        return False

    def attach(self, word) -> None:
        """Back the mode with pinned memory the device reads (once, when the first device state is made)."""
        with self._lock:
            word.set(self.mode.value)
            self._word = word
