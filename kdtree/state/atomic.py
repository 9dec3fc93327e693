"""How every file in the state directory (KDTREE_STATE_DIR) is written (atomically, group-readable) and read
(bounded, regular files only, then validated), and how non-finite floats are written into them.

Non-finite values (a relative error of +inf where the reference is all zeros, NaN from a broken output) are written
as the JSON strings "Infinity", "-Infinity" and "NaN", so the files stay standard JSON.
"""

from __future__ import annotations

import errno
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, TypeVar

from pydantic import BaseModel, ValidationError


class StateFileError(ValueError):
    """A state-directory file that is no regular file, or larger than its kind can be; the message names it."""


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


M = TypeVar("M", bound=BaseModel)


def read_model(path: str | os.PathLike, limit: int, model: type[M]) -> M:
    """The one way a state file is read: bounded (StateFileError when larger than `limit` or no regular file,
    FileNotFoundError when absent), then validated as `model` (pydantic's ValidationError, for the caller to name)."""
    return model.model_validate_json(read_bounded(path, limit))


def first_error(e: ValidationError) -> str:
    """pydantic's first complaint, with where it is: "Input should be a valid integer at pid"."""
    err = e.errors()[0]
    where = ".".join(str(x) for x in err.get("loc", ()))
    return f"{err['msg']}" + (f" at {where}" if where else "")
