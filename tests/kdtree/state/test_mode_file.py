"""kdtree/state/mode_file.py by itself: the mode file (read bounded, refused by name) and ModeHolder's rule for a live
switch. No SGLang, no server: the files are written here."""

from __future__ import annotations

import os

import pytest

from kdtree.config import LIVE_MODES, ConfigError, Mode
from kdtree.state.mode_file import MODE_MAX, ModeHolder, mode_path, read_desired_mode, write_desired_mode


def test_no_mode_file_means_no_desired_mode(tmp_path):
    assert read_desired_mode(tmp_path) is None


@pytest.mark.parametrize("mode", list(Mode))
def test_a_written_mode_reads_back_as_itself(tmp_path, mode):
    write_desired_mode(tmp_path, mode)
    assert mode_path(tmp_path).read_text() == f"{mode.value}\n"
    assert read_desired_mode(tmp_path) is mode
    assert os.stat(mode_path(tmp_path)).st_mode & 0o777 == 0o640  # the other container's group reads it


def test_writing_a_word_that_is_no_mode_is_refused_before_the_file_changes(tmp_path):
    write_desired_mode(tmp_path, Mode.VALIDATE)
    with pytest.raises(ValueError):
        write_desired_mode(tmp_path, "fast")
    assert read_desired_mode(tmp_path) is Mode.VALIDATE


def test_a_mode_file_holding_no_mode_names_the_value_the_modes_and_the_fix(tmp_path):
    mode_path(tmp_path).write_text("shadow\n")
    with pytest.raises(
        ConfigError, match=r"holds 'shadow': expected one of off, validate, on, standby; fix or"
    ):
        read_desired_mode(tmp_path)


def test_a_mode_file_too_large_or_not_a_file_is_refused_unread(tmp_path):
    mode_path(tmp_path).write_text("on" + " " * MODE_MAX)
    with pytest.raises(ConfigError, match="more than the 64 it can be; fix or delete the file"):
        read_desired_mode(tmp_path)
    mode_path(tmp_path).unlink()
    os.mkfifo(mode_path(tmp_path))  # never waited on
    with pytest.raises(ConfigError, match="is a FIFO"):
        read_desired_mode(tmp_path)


@pytest.mark.parametrize("started", sorted(LIVE_MODES))
@pytest.mark.parametrize("desired", sorted(LIVE_MODES))
def test_a_process_started_in_a_live_mode_follows_every_live_mode(started, desired):
    holder = ModeHolder(started)
    changed = holder.follow(desired)
    assert holder.mode is desired and holder.pending is None
    assert changed == (desired is not started)


@pytest.mark.parametrize("started", list(Mode))
def test_to_or_from_off_waits_for_a_restart(started):
    desired = Mode.VALIDATE if started is Mode.OFF else Mode.OFF
    holder = ModeHolder(started)
    assert holder.follow(desired) is False
    assert holder.mode is started and holder.pending is desired
    assert holder.follow(None) is False and holder.pending is None  # the file removed: nothing is pending


def test_a_process_started_in_off_has_no_live_modes():
    assert ModeHolder(Mode.OFF).live_modes == frozenset()
    assert ModeHolder(Mode.STANDBY).live_modes == LIVE_MODES


class Word:
    """Stands in for kernel.ModeWord (the pinned host word the device reads): records what was stored."""

    def __init__(self):
        self.stored: list[str] = []

    def set(self, value: str) -> None:
        self.stored.append(value)


def test_a_switch_reaches_the_attached_word_and_its_time_moves_only_on_a_change():
    holder = ModeHolder(Mode.VALIDATE)
    word = Word()
    holder.attach(word)
    first = holder.applied_at
    holder.set(Mode.VALIDATE)
    assert holder.applied_at == first
    holder.follow(Mode.ON)
    assert word.stored == ["validate", "validate", "on"] and holder.applied_at >= first
