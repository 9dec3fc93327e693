"""kdtree/state/process_record.py and kdtree/state/restart_request.py: the server process's record and the
sidecar's restart request, written and read back as the launcher and the sidecar do."""

from __future__ import annotations

import pytest

from kdtree.state.process_record import (
    RECORD_CAP,
    ServerProcessRecord,
    process_path,
    read_process_record,
    start_mark,
    write_process_record,
)
from kdtree.state.restart_request import (
    RestartRequest,
    read_restart_request,
    request_path,
    write_restart_request,
)


def test_the_process_record_reads_back_as_written(tmp_path):
    assert read_process_record(tmp_path) is None  # no server has started on this volume
    rec = ServerProcessRecord(pid=7, starts=2, started_at=1767225600.0)
    write_process_record(tmp_path, rec)
    assert read_process_record(tmp_path) == rec


def test_an_unreadable_process_record_is_named_with_its_path(tmp_path):
    process_path(tmp_path).write_text('{"pid": "seven"}')
    with pytest.raises(ValueError, match="server-process.json is unreadable"):
        read_process_record(tmp_path)
    process_path(tmp_path).write_text(" " * (RECORD_CAP + 1))
    with pytest.raises(ValueError, match="more than the"):
        read_process_record(tmp_path)


def test_a_restart_request_reads_back_and_an_unreadable_one_is_none(tmp_path):
    req = RestartRequest(id="abc", start=3, requested_at=1.0, stop_timeout_s=60)
    write_restart_request(tmp_path, req)
    assert read_restart_request(tmp_path) == req
    request_path(tmp_path).write_text('{"id": ""}')  # not acted on: the sidecar reports it was not
    assert read_restart_request(tmp_path) is None


def test_the_start_mark_names_the_start_its_time_and_pid():
    assert start_mark(3, 1767225600.0, 7) == (
        "kdtree launcher: server start #3 at 2026-01-01T00:00:00.000Z (t=1767225600.000), pid 7"
    )
