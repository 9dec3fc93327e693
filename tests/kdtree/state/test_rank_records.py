"""kdtree/state/rank_records.py: what a rank did between two of its records (work_between, judged alike by the
sidecar's bake and `kdtreectl check`), whether every rank has written since a moment (written_since), and what
read_records makes of files no rank wrote as it writes."""

from __future__ import annotations

import json

import pytest

from kdtree.state.rank_records import (
    Parity,
    new_record,
    read_records,
    work_between,
    write_record,
    written_since,
)


def test_work_between_counts_what_grew():
    a = new_record("on")
    a.served_kdtree, a.fallbacks, a.parity = 10, {"shape": 1}, Parity(calls_compared=3)
    b = a.model_copy(deep=True)
    b.served_kdtree, b.fallbacks, b.parity = 25, {"shape": 1, "dtype": 2}, Parity(calls_compared=3)
    w = work_between(a, b)
    assert (w.restarted, w.served, w.compared, w.fallbacks_grew) == (False, 15, 0, {"dtype": 2})


def test_another_process_is_a_restart_even_with_the_same_pid():
    a = new_record("on")
    b = a.model_copy(update={"started_at": a.started_at + 5})
    assert work_between(a, b).restarted and not work_between(a, a).restarted


def test_written_since_needs_every_rank_at_or_after_the_moment():
    old, new = new_record("on", tp_rank=0), new_record("on", tp_rank=1)
    old.heartbeat, new.heartbeat = 100.0, 200.0
    assert written_since({0: old, 1: new}, [1], 150.0)
    assert not written_since({0: old, 1: new}, [0, 1], 150.0)
    assert not written_since({1: new}, [0, 1], 150.0)  # a rank without a record has not written
    assert written_since({}, [], 150.0)  # no rank expected: nothing to wait for


# ---- what the server's processes may leave in the volume (the sidecar reads it; they may run a model's own code) ----


def test_a_file_named_like_a_record_without_ascii_digits_is_one_unreadable_view(tmp_path):
    write_record(tmp_path, new_record("on", tp_rank=0))
    (tmp_path / "rank-\u00b2.json").write_text("{")  # "²".isdigit() holds, int("²") raises
    (tmp_path / "rank-x.json").write_text("{}")
    views = read_records(tmp_path)
    assert [v.record.tp_rank for v in views] == [-1, -1, 0]
    assert all(v.stale and "unreadable" in v.stale_reason for v in views[:2]) and not views[2].stale


@pytest.mark.parametrize(
    "field, value",
    [("served_kdtree", 10**400), ("parity", {"calls_compared": 10**30}), ("fallbacks", {"dtype": -1}),
     ("tp_rank", 2**40), ("ddtree_budget", {"live_tokens": 10**400, "request_steps": 1})],
)  # fmt: skip
def test_a_record_with_a_counter_no_rank_writes_is_unreadable_not_an_overflow_later(tmp_path, field, value):
    body = json.loads(new_record("on").model_dump_json())
    body[field] = value
    (tmp_path / "rank-0.json").write_text(json.dumps(body))
    (view,) = read_records(tmp_path)
    assert view.stale and "not a rank record" in view.stale_reason


def test_reading_stops_at_the_limit_and_says_how_many_files_were_left(tmp_path):
    for rank in (0, 1, 2, 10, 11):
        write_record(tmp_path, new_record("on", tp_rank=rank))
    views = read_records(tmp_path, limit=3)
    assert [v.record.tp_rank for v in views] == [-1, 0, 1, 2]  # the lowest ranks by number, not by name
    assert "2 more rank-*.json files than the 3 read" in views[0].stale_reason
