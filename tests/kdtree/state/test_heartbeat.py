"""Per-rank status records: round trip, stale detection, and the heartbeat that writes them (no sglang needed)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from types import ModuleType, SimpleNamespace

import pytest

from kdtree.state.atomic import json_safe, read_bounded
from kdtree.state.heartbeat import Heartbeat, scheduler_tp_rank
from kdtree.state.rank_records import RECORD_MAX, Parity, new_record, read_records, record_path, write_record


def _record(**fields):
    rec = new_record(mode="validate", tp_rank=fields.pop("tp_rank", 0), tp_size=2)
    for k, v in fields.items():
        setattr(rec, k, v)
    return rec


def test_a_record_round_trips_through_its_file(tmp_path):
    rec = _record(tp_rank=1, installed=True, gpu="NVIDIA H200", compute_capability="9.0", compiled_archs=["sm_90"],
                  served_kdtree=12, served_original=3, fallbacks={"draft_runner": 3}, last_error=None,
                  parity=Parity(calls_compared=12, max_abs_err=0.004, max_rel_l2=0.002, rtol=0.02))  # fmt: skip
    path = write_record(tmp_path, rec)
    assert path == record_path(tmp_path, 1) and not list(tmp_path.glob("*.tmp"))
    (view,) = read_records(tmp_path)
    assert view.record == rec and not view.stale and view.stale_reason is None


def test_a_record_with_an_old_heartbeat_is_stale(tmp_path):
    write_record(tmp_path, _record(heartbeat=time.time() - 120))
    (view,) = read_records(tmp_path, max_age_s=30)
    assert view.stale and "heartbeat" in view.stale_reason


def test_a_record_whose_writer_died_is_stale(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    write_record(
        tmp_path, _record(pid=int(proc.stdout))
    )  # same pid namespace: the pid is comparable, and gone
    (view,) = read_records(tmp_path)
    assert view.stale and view.stale_reason == f"pid {int(proc.stdout)} is gone"


def test_a_dead_pid_from_another_pid_namespace_is_judged_by_heartbeat_only(tmp_path):
    write_record(tmp_path, _record(pid=2**22 - 1, pid_ns="pid:[1]"))
    (view,) = read_records(tmp_path)
    assert not view.stale


def test_an_unreadable_record_is_reported_stale_not_dropped(tmp_path):
    write_record(tmp_path, _record(tp_rank=0))
    (tmp_path / "rank-1.json").write_text("{half a record")
    views = read_records(tmp_path)
    assert [(v.record.tp_rank, v.stale) for v in views] == [(0, False), (1, True)]
    assert views[1].stale_reason.startswith("unreadable: not a rank record: Invalid JSON")


@pytest.mark.parametrize(
    ("value", "text"), [(math.inf, '"Infinity"'), (-math.inf, '"-Infinity"'), (math.nan, '"NaN"')]
)
def test_non_finite_parity_round_trips_as_standard_json(tmp_path, value, text):
    """The parity kernel gives +inf where the reference is all zeros: the record keeps it (standard JSON: a
    string), and the reader gets the same float back instead of an unreadable record."""
    rec = _record(parity=Parity(calls_compared=3, max_rel_l2=value, max_abs_err=value, rtol=0.02))
    path = write_record(tmp_path, rec)
    raw = path.read_text()
    assert f'"max_rel_l2":{text}' in raw and "NaN," not in raw.replace('"NaN"', "")
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    (view,) = read_records(tmp_path)
    got = view.record.parity.max_rel_l2
    assert not view.stale and (math.isnan(got) if math.isnan(value) else got == value)


def test_a_reader_takes_nan_and_infinity_literals_from_other_writers(tmp_path):
    rec = _record()
    raw = rec.model_dump_json().replace('"max_rel_l2":0.0', '"max_rel_l2":NaN')
    raw = raw.replace('"max_abs_err":0.0', '"max_abs_err":-Infinity')
    record_path(tmp_path, 0).write_text(raw)
    (view,) = read_records(tmp_path)
    assert not view.stale, view.stale_reason
    assert math.isnan(view.record.parity.max_rel_l2) and view.record.parity.max_abs_err == -math.inf


def test_a_non_finite_heartbeat_is_refused_not_taken_for_fresh(tmp_path):
    """NaN compares false with everything: a NaN heartbeat would never be too old."""
    record_path(tmp_path, 0).write_text(
        _record().model_dump_json().replace('"heartbeat":', '"heartbeat":NaN,"x":')
    )
    (view,) = read_records(tmp_path)
    assert view.stale and "finite number at heartbeat" in view.stale_reason


def test_an_unknown_schema_version_is_refused_naming_both_versions(tmp_path):
    record_path(tmp_path, 0).write_text(
        _record().model_dump_json().replace('"schema_version":1', '"schema_version":99')
    )
    (view,) = read_records(tmp_path)
    assert view.stale and view.stale_reason == (
        "unreadable: schema_version 99; this sidecar reads 1: upgrade the sidecar image to the server's"
    )


def test_only_regular_files_of_bounded_size_are_read(tmp_path):
    """A FIFO is never waited on, a symbolic link never followed, a huge record never read whole: each is an
    unreadable record that says what it is."""
    os.mkfifo(record_path(tmp_path, 7))  # nobody writes it: reading it would block forever
    (tmp_path / "target.json").write_text(_record(tp_rank=3).model_dump_json())
    record_path(tmp_path, 3).symlink_to(tmp_path / "target.json")
    record_path(tmp_path, 4).mkdir()
    with record_path(tmp_path, 5).open("wb") as f:
        f.truncate(64 * 1024 * 1024)  # 64 MiB, sparse
    write_record(tmp_path, _record(tp_rank=0))
    start = time.monotonic()
    views = {v.record.tp_rank: v for v in read_records(tmp_path)}
    assert time.monotonic() - start < 1
    assert not views[0].stale
    assert views[7].stale_reason.endswith("rank-7.json is a FIFO, not a regular file")
    assert views[3].stale_reason.endswith("rank-3.json is a symbolic link, not a regular file")
    assert views[4].stale_reason.endswith("rank-4.json is a directory, not a regular file")
    assert views[5].stale_reason.endswith(
        f"rank-5.json is 67108864 bytes, more than the {RECORD_MAX} it can be"
    )
    with pytest.raises(ValueError, match="more than the 10 it can be"):
        read_bounded(tmp_path / "target.json", 10)


def test_json_safe_spells_non_finite_floats_as_the_records_do():
    assert json_safe({"a": [math.inf, -math.inf, {"b": math.nan}], "c": 1.5, "d": "x"}) == {
        "a": ["Infinity", "-Infinity", {"b": "NaN"}],
        "c": 1.5,
        "d": "x",
    }


# ---- evidence: the writer side -------------------------------------------------------------------------


def _snapshot():
    return {"mode": "on", "served_kdtree": 5, "served_original": 2, "fallbacks": {"kernel_unavailable": 2},
            "last_error": None, "gpu": "NVIDIA H200", "compute_capability": "9.0", "compiled_archs": ["sm_90"],
            "parity": {"calls_compared": 0, "max_abs_err": 0.0, "max_rel_l2": 0.0, "calls_over_tol": 0, "nan_inf": 0,
                       "rtol": 0.02}}  # fmt: skip


def test_evidence_writes_nothing_until_the_process_is_a_known_tp_rank(tmp_path):
    rank = None
    ev = Heartbeat(str(tmp_path), snapshot=_snapshot, installed=lambda: True, rank_source=lambda: rank)
    assert ev.beat() is None and not list(tmp_path.iterdir())
    rank = (3, 8)
    path = ev.beat()
    rec = json.loads(path.read_text())
    assert path.name == "rank-3.json"
    assert rec["tp_rank"] == 3 and rec["tp_size"] == 8 and rec["mode"] == "on" and rec["installed"] is True
    assert rec["served_kdtree"] == 5 and rec["fallbacks"] == {"kernel_unavailable": 2}
    assert (
        rec["gpu"] == "NVIDIA H200" and rec["compiled_archs"] == ["sm_90"] and rec["parity"]["rtol"] == 0.02
    )


def test_the_heartbeat_thread_keeps_the_record_fresh(tmp_path):
    ev = Heartbeat(str(tmp_path), snapshot=_snapshot, installed=lambda: True, rank_source=lambda: (0, 1))
    ev.start(0.05)
    try:
        deadline = time.time() + 10
        while not record_path(tmp_path, 0).exists() and time.time() < deadline:
            time.sleep(0.02)
        first = read_records(tmp_path)[0].record.heartbeat
        time.sleep(0.3)
        (view,) = read_records(tmp_path, max_age_s=1)
        assert view.record.heartbeat > first and not view.stale
    finally:
        ev.stop()


def test_a_write_failure_is_kept_for_the_record_and_never_raised(tmp_path):
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state directory should be")
    ev = Heartbeat(str(blocker), snapshot=_snapshot, installed=lambda: True, rank_source=lambda: (0, 1))
    assert ev.beat() is None
    assert ev.write_error.startswith("status record:")


@pytest.mark.parametrize("role,expected", [("scheduler", (1, 4)), ("detokenizer", None), (None, None)])
def test_tp_rank_comes_from_a_published_scheduler_only(monkeypatch, role, expected):
    # Stands in for sglang.srt.runtime_context: publish_role() and get_parallel().tp_rank/.tp_size, as in 0.5.23.
    rc = ModuleType("sglang.srt.runtime_context")
    rc.publish_role = lambda: role
    rc.get_parallel = lambda: SimpleNamespace(tp_rank=1, tp_size=4)
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", rc)
    assert scheduler_tp_rank() == expected


def test_evidence_module_imports_neither_torch_nor_sglang():
    code = "import sys, kdtree.state.heartbeat, kdtree.install; print(sorted(m for m in ('torch', 'sglang') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- live mode switches: the heartbeat follows the sidecar's mode file ------------------------------------


@pytest.mark.parametrize(
    ("started", "desired", "mode", "pending", "changed"),
    [
        ("validate", "on", "on", None, True),
        ("on", "standby", "standby", None, True),
        ("standby", "validate", "validate", None, True),
        ("validate", "validate", "validate", None, False),
        ("validate", None, "validate", None, False),  # no mode file: the start mode stands
        ("validate", "off", "validate", "off", False),  # off is reached by a restart only
        ("off", "on", "off", "on", False),  # nothing is installed in off: a restart brings on
    ],
)
def test_the_mode_holder_switches_live_between_live_modes_only(started, desired, mode, pending, changed):
    from kdtree.config import Mode
    from kdtree.state.mode_file import ModeHolder

    holder = ModeHolder(started)
    before = holder.applied_at
    time.sleep(0.01)
    assert holder.follow(Mode(desired) if desired else None) is changed
    assert holder.mode == mode and holder.pending == (Mode(pending) if pending else None)
    assert (holder.applied_at > before) is changed


class Word:
    """Stands in for kernel.ModeWord (pinned host memory the device reads)."""

    value = None

    def set(self, mode):
        self.value = mode


def test_a_switch_is_stored_where_the_device_reads_it():
    from kdtree.config import Mode
    from kdtree.state.mode_file import ModeHolder

    holder, word = ModeHolder("validate"), Word()
    holder.attach(word)
    assert word.value == "validate"
    holder.follow(Mode.ON)
    assert word.value == "on"


def test_the_heartbeat_applies_the_mode_file_and_confirms_at_once(tmp_path):
    """Each rank reads the mode file every MODE_POLL_S and rewrites its record as soon as it switched, long before
    its next regular heartbeat (60 s here)."""
    from kdtree.state.heartbeat import MODE_POLL_S
    from kdtree.state.mode_file import ModeHolder, write_desired_mode

    holder = ModeHolder("validate")

    def snap():
        return {**_snapshot(), "mode": holder.mode.value, "mode_applied_at": holder.applied_at,
                "live_modes": sorted(m.value for m in holder.live_modes), "mode_pending": None}  # fmt: skip

    ev = Heartbeat(
        str(tmp_path), snapshot=snap, installed=lambda: True, rank_source=lambda: (0, 1), follow=holder.follow
    )
    ev.start(60)
    try:
        deadline = time.time() + 10
        while not record_path(tmp_path, 0).exists() and time.time() < deadline:
            time.sleep(0.02)
        assert read_records(tmp_path)[0].record.mode == "validate"
        written = time.time()
        write_desired_mode(tmp_path, "on")
        while read_records(tmp_path)[0].record.mode != "on" and time.time() < deadline:
            time.sleep(0.02)
        (view,) = read_records(tmp_path)
        assert view.record.mode == "on" and view.record.mode_applied_at >= written
        assert view.record.live_modes == ["on", "standby", "validate"]
        assert time.time() - written < 5 * MODE_POLL_S + 1
    finally:
        ev.stop()


def test_an_unreadable_mode_file_is_reported_and_changes_nothing(tmp_path):
    from kdtree.state.mode_file import ModeHolder

    holder = ModeHolder("validate")
    (tmp_path / "mode").write_text("fastest\n")
    ev = Heartbeat(
        str(tmp_path),
        snapshot=_snapshot,
        installed=lambda: True,
        rank_source=lambda: (0, 1),
        follow=holder.follow,
    )
    assert ev.follow_mode_file() is False and holder.mode == "validate"
    rec = ev.record()
    assert "mode file" in rec.last_error and "fastest" in rec.last_error
