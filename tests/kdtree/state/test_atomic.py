"""kdtree/state/atomic.py: every state file is read bounded, from a regular file only, then validated (read_model),
and written whole or not at all (write_atomically)."""

from __future__ import annotations

import os

import pytest
from pydantic import BaseModel, ValidationError

from kdtree.state.atomic import StateFileError, first_error, read_model, write_atomically


class Small(BaseModel):
    n: int


def test_read_model_reads_and_validates(tmp_path):
    path = write_atomically(tmp_path / "small.json", '{"n": 3}')
    assert read_model(path, 64, Small) == Small(n=3)
    assert oct(path.stat().st_mode & 0o777) == "0o640"  # the other container's group reads it


def test_read_model_refuses_a_file_larger_than_its_kind_unread(tmp_path):
    path = write_atomically(tmp_path / "big.json", '{"n": 3}' + " " * 100)
    with pytest.raises(StateFileError, match="more than the 64 it can be"):
        read_model(path, 64, Small)


def test_read_model_refuses_what_is_no_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(StateFileError, match="a FIFO, not a regular file"):
        read_model(tmp_path / "fifo", 64, Small)  # never waited on
    with pytest.raises(FileNotFoundError):
        read_model(tmp_path / "absent.json", 64, Small)


def test_an_invalid_file_is_named_by_its_first_error(tmp_path):
    path = write_atomically(tmp_path / "bad.json", '{"n": "three"}')
    with pytest.raises(ValidationError) as e:
        read_model(path, 64, Small)
    assert first_error(e.value).endswith(" at n")
