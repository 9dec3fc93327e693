"""kdtree/state/rank_records.py: what a rank did between two of its records (work_between, judged alike by the
sidecar's bake and `kdtreectl check`) and whether every rank has written since a moment (written_since)."""

from __future__ import annotations

from kdtree.state.rank_records import Parity, new_record, work_between, written_since


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
