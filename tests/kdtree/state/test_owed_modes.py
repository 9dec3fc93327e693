"""kdtree/state/owed_modes.py by itself: what a group's leader owes its worker nodes, written atomically and read
bounded, validated and held to the group's size. The files are written here."""

from __future__ import annotations

import json
import os

import pytest

from kdtree.config import Mode
from kdtree.state.atomic import StateFileError
from kdtree.state.owed_modes import OWED_MAX, OwedMode, owed_path, read_owed_modes, write_owed_modes


def test_no_file_owes_nothing(tmp_path):
    assert read_owed_modes(tmp_path, nnodes=2) == {}


def test_what_is_written_reads_back(tmp_path):
    owed = {1: OwedMode(mode=Mode.OFF, restart=True), 3: OwedMode(mode=Mode.VALIDATE, restart=False)}
    write_owed_modes(tmp_path, owed)
    assert read_owed_modes(tmp_path, nnodes=4) == owed
    assert json.loads(owed_path(tmp_path).read_text())["nodes"]["1"] == {"mode": "off", "restart": True}
    assert os.stat(owed_path(tmp_path)).st_mode & 0o777 == 0o640
    write_owed_modes(tmp_path, {})  # every debt paid
    assert read_owed_modes(tmp_path, nnodes=4) == {}


@pytest.mark.parametrize(
    "text, names",
    [
        ("{not json", "is not an owed-modes file"),
        (
            '{"nodes": {"1": {"mode": "fast", "restart": true}}}',
            "is not an owed-modes file .* at nodes.1.mode",
        ),
        ('{"nodes": {"1": {"mode": "off"}}}', "at nodes.1.restart"),
        ('{"schema_version": 2, "nodes": {}}', "at schema_version"),
        ('{"nodes": {}, "extra": 1}', "at extra"),
        (
            '{"nodes": {"2": {"mode": "off", "restart": true}}}',
            r"names node 2, outside this group's workers \(1 .. 1",
        ),
        ('{"nodes": {"0": {"mode": "off", "restart": true}}}', "names node 0, outside"),
    ],
)
def test_a_broken_file_or_a_node_outside_the_group_is_refused_by_name(tmp_path, text, names):
    owed_path(tmp_path).write_text(text)
    with pytest.raises(StateFileError, match=names) as e:
        read_owed_modes(tmp_path, nnodes=2)
    assert str(owed_path(tmp_path)) in str(e.value)


def test_more_nodes_than_the_group_has_workers_are_refused(tmp_path):
    nodes = {str(n): {"mode": "off", "restart": True} for n in range(1, 5)}
    owed_path(tmp_path).write_text(json.dumps({"nodes": nodes}))
    assert len(read_owed_modes(tmp_path, nnodes=5)) == 4
    with pytest.raises(StateFileError, match=r"names node 3, 4, outside .* KDTREE_NNODES=3"):
        read_owed_modes(tmp_path, nnodes=3)


def test_a_file_too_large_or_not_a_file_is_refused_unread(tmp_path):
    owed_path(tmp_path).write_text('{"nodes": {}}' + " " * OWED_MAX)
    with pytest.raises(StateFileError, match=f"more than the {OWED_MAX} it can be"):
        read_owed_modes(tmp_path, nnodes=2)
    owed_path(tmp_path).unlink()
    os.mkfifo(owed_path(tmp_path))  # never waited on
    with pytest.raises(StateFileError, match="is a FIFO"):
        read_owed_modes(tmp_path, nnodes=2)
