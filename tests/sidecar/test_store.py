"""sidecar/store.py and sidecar/volume.py on a temporary directory: the state file and the audit log, writes that
fail (injected at the filesystem boundary: tests run as root in CI, where a read-only mode stops nothing), and
bounded reads."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import os
import threading
import time

import pytest

from kdtree.config import ConfigError, Mode
from kdtree.state.atomic import STATE_FILE_MODE
from sidecar import store as store_module
from sidecar.store import AUDIT_FILE, STATE_FILE, SidecarState, Store, Transition
from sidecar.vocabulary import Method, Step
from sidecar.volume import StateVolume, VolumeProblem, VolumeWriteFailed


def failing(code: int):
    def write(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return write


def test_state_round_trips_with_a_non_finite_gate_value(tmp_path):
    store = Store(tmp_path, 50)
    t = Transition(
        from_mode=Mode.VALIDATE, to_mode=Mode.ON, gate=[{"name": "max_rel_err", "value": math.inf}]
    )
    store.save(SidecarState(current_mode=Mode.VALIDATE, active=t))
    assert '"value": "Infinity"' in (tmp_path / STATE_FILE).read_text()
    loaded = store.load(Mode.OFF)
    assert loaded.active.id == t.id and loaded.current_mode == Mode.VALIDATE


def test_history_is_trimmed_to_its_limit(tmp_path):
    store = Store(tmp_path, 2)
    state = SidecarState(current_mode=Mode.OFF)
    state.history = [Transition(from_mode=Mode.OFF, to_mode=Mode.VALIDATE) for _ in range(5)]
    store.save(state)
    assert len(store.load(Mode.OFF).history) == 2


@pytest.mark.parametrize(
    ("code", "fix"),
    [
        (errno.ENOSPC, "state volume full: free space or enlarge it"),
        (errno.EACCES, f"state volume not writable by uid {os.getuid()}: fix its ownership/permissions"),
        (errno.EROFS, f"state volume mounted read-only: mount it read-write for uid {os.getuid()}"),
        (errno.EIO, "state volume I/O error: check the disk or the storage behind the volume"),
    ],
)
def test_a_failed_save_raises_names_path_errno_and_fix_and_is_logged(
    tmp_path, monkeypatch, caplog, code, fix
):
    store = Store(tmp_path, 50)
    monkeypatch.setattr(store_module, "write_atomically", failing(code))
    with caplog.at_level(logging.ERROR, "kdtree.sidecar"), pytest.raises(VolumeWriteFailed) as e:
        store.save(SidecarState(current_mode=Mode.OFF))
    name = errno.errorcode[code]
    problem = store.volume.problem
    assert problem.path == str(tmp_path / STATE_FILE) and problem.errno == name and problem.fix == fix
    assert (
        str(e.value)
        == f"{fix} (saving the sidecar state {tmp_path / STATE_FILE} failed: {name} {os.strerror(code)})"
    )
    (rec,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert str(tmp_path / STATE_FILE) in rec.getMessage() and name in rec.getMessage()


def test_the_problem_stands_until_a_write_succeeds(tmp_path, monkeypatch, caplog):
    store = Store(tmp_path, 50)
    real = store_module.write_atomically
    monkeypatch.setattr(store_module, "write_atomically", failing(errno.ENOSPC))
    with pytest.raises(VolumeWriteFailed):
        store.save(SidecarState(current_mode=Mode.OFF))
    caplog.clear()
    with caplog.at_level(logging.DEBUG, "kdtree.sidecar"), pytest.raises(VolumeWriteFailed):
        store.save(SidecarState(current_mode=Mode.OFF), retry=True)  # the same problem again: quiet
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    monkeypatch.setattr(store_module, "write_atomically", real)
    store.save(SidecarState(current_mode=Mode.ON))
    assert store.volume.problem is None and store.load(Mode.OFF).current_mode == Mode.ON


def test_a_failed_audit_append_never_raises_and_keeps_the_entry_in_the_process_log(
    tmp_path, monkeypatch, caplog
):
    store = Store(tmp_path, 50)
    monkeypatch.setattr(store_module, "append_line", failing(errno.EIO))
    with caplog.at_level(logging.INFO, "kdtree.sidecar"):
        store.audit("accepted", Transition(from_mode=Mode.OFF, to_mode=Mode.VALIDATE), reason="drill")
    assert (
        store.volume.problem.errno == "EIO" and store.volume.problem.operation == "appending to the audit log"
    )
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("audit ") and '"event": "accepted"' in m and '"reason": "drill"' in m for m in messages
    )
    assert any("sidecar-audit.jsonl" in m and "EIO" in m for m in messages)
    assert store.audit_tail(10) == []


def test_audit_entries_are_standard_json_and_the_tail_is_bounded(tmp_path, monkeypatch):
    store = Store(tmp_path, 50)
    for i in range(3000):
        store.audit("step", None, n=i, value=math.nan, pad="x" * 40)
    monkeypatch.setattr(store_module, "AUDIT_TAIL_MAX", 1000)  # read in 64 KiB steps: one step, then stop
    tail = store.audit_tail(10_000)
    assert 100 < len(tail) < 3000 and tail[-1]["n"] == 2999 and tail[-1]["value"] == "NaN"
    assert [e["n"] for e in store.audit_tail(2)] == [2998, 2999]


@pytest.mark.parametrize("kind", ["fifo", "directory", "huge"])
def test_a_state_file_that_is_no_regular_record_stops_the_sidecar_with_its_fix(tmp_path, monkeypatch, kind):
    path = tmp_path / STATE_FILE
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        monkeypatch.setattr(store_module, "STATE_MAX", 100)
        path.write_text(SidecarState(current_mode=Mode.OFF).model_dump_json() + " " * 200)
    with pytest.raises(ConfigError, match="move it aside to start from the mode file"):
        Store(tmp_path, 50).load(Mode.OFF)


def test_volume_reads_share_one_thread_and_give_up_at_the_deadline(tmp_path):
    """A hung read holds the volume's one thread; every caller waits at most the deadline and shares it."""
    volume = StateVolume(tmp_path, deadline_s=0.2)
    release = threading.Event()
    calls = []

    def hung():
        calls.append(threading.current_thread().name)
        release.wait(10)
        return "done"

    async def main():
        start = time.monotonic()
        results = await asyncio.gather(*(volume.read("x", hung) for _ in range(20)))
        waited = time.monotonic() - start
        release.set()
        await asyncio.sleep(0.1)
        return results, waited, await volume.read("x", hung)

    try:
        results, waited, after = asyncio.run(main())
    finally:
        release.set()
        volume.close()
    assert results == [None] * 20 and waited < 0.5
    assert len(calls) == 2 and all(name.startswith("kdtree-volume") for name in calls) and after == "done"


def test_volume_problem_texts_name_an_unknown_errno_with_its_directory():
    p = VolumeProblem(operation="x", path="/s/mode", errno="EXDEV", strerror="cross", uid=7, at=0)
    assert p.fix == "writing the state volume failed: check /s"


@pytest.mark.parametrize(
    ("field", "bad", "allowed"),
    [
        ("step", "bakng", "'baking'"),
        ("method", "hot", "'live' or 'restart'"),
        ("outcome", "done", "'preempted'"),
    ],
)
def test_a_state_file_with_a_word_outside_the_vocabulary_is_refused_naming_it(tmp_path, field, bad, allowed):
    """A typo in the state file (or a sidecar of another version) stops the sidecar with the value, the allowed ones
    and the fix: never a transition at an unknown step."""
    store = Store(tmp_path, history_limit=5)
    t = Transition(from_mode=Mode.VALIDATE, to_mode=Mode.ON)
    store.save(SidecarState(current_mode=Mode.VALIDATE, active=t))
    doc = json.loads(store.path.read_text())
    doc["active"][field] = bad
    store.path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as e:
        store.load(Mode.OFF)
    msg = str(e.value)
    assert f"at active.{field}, got {bad!r}" in msg and allowed in msg, msg
    assert "move it aside" in msg


def test_the_vocabulary_is_saved_as_its_values_and_read_back_as_its_members(tmp_path):
    store = Store(tmp_path, history_limit=5)
    t = Transition(from_mode=Mode.VALIDATE, to_mode=Mode.ON, method=Method.LIVE, step=Step.AWAITING_RANKS)
    store.save(SidecarState(current_mode=Mode.VALIDATE, active=t))
    saved = json.loads(store.path.read_text())["active"]
    assert (saved["method"], saved["step"], saved["outcome"]) == ("live", "awaiting_ranks", None)
    back = store.load(Mode.OFF).active
    assert back.method is Method.LIVE and back.step is Step.AWAITING_RANKS


@pytest.mark.parametrize(
    "method, step, expected, ranks_may_report",
    [
        (None, None, Mode.VALIDATE, {Mode.VALIDATE}),  # settled
        (Method.LIVE, Step.ACCEPTED, Mode.VALIDATE, {Mode.VALIDATE}),  # nothing written yet
        (
            Method.LIVE,
            Step.AWAITING_RANKS,
            Mode.ON,
            {Mode.VALIDATE, Mode.ON},
        ),  # each rank switches on its own
        (Method.RESTART, Step.WRITING_MODE, Mode.VALIDATE, {Mode.VALIDATE}),  # the old server still runs
        (Method.RESTART, Step.WAITING_READY, Mode.ON, {Mode.ON}),
        (Method.LIVE, Step.ROLLING_BACK, Mode.VALIDATE, {Mode.VALIDATE, Mode.ON}),
        (Method.RESTART, Step.ROLLING_BACK, Mode.VALIDATE, {Mode.VALIDATE}),
    ],
)
def test_the_mode_the_server_should_be_in_follows_the_running_transition(
    method, step, expected, ranks_may_report
):
    state = SidecarState(current_mode=Mode.VALIDATE)
    if method is not None:
        state.active = Transition(from_mode=Mode.VALIDATE, to_mode=Mode.ON, method=method, step=step)
    assert state.expected_mode() is expected
    assert state.expected_modes() == ranks_may_report


def test_the_audit_append_never_follows_a_link_planted_in_the_volume(tmp_path, caplog):
    """The server's processes can write the state volume: a link named like the audit log is a failed append (the
    volume's problem, ELOOP), and the file it points at is untouched."""
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    state = tmp_path / "state"
    state.mkdir()
    (state / AUDIT_FILE).symlink_to(target)
    store = Store(state, 50)
    store.audit("accepted", Transition(from_mode=Mode.OFF, to_mode=Mode.VALIDATE))
    assert target.read_text() == "keep\n" and store.volume.problem.errno == "ELOOP"


def test_a_new_audit_log_is_group_readable_as_every_file_in_the_volume(tmp_path):
    store = Store(tmp_path, 50)
    store.audit("accepted", Transition(from_mode=Mode.OFF, to_mode=Mode.VALIDATE))
    assert (tmp_path / AUDIT_FILE).stat().st_mode & 0o777 == STATE_FILE_MODE
    assert store.audit_tail(1)[0]["event"] == "accepted"
