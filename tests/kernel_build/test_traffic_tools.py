"""The traffic harness's mix and invariants (kernel_build/bench/harness/traffic.py) and the live-attention oracle's
table (ddtree_oracle.teacher_table), on the CPU. The real server runs under them on the GPU machine
(kernel_build/bench/device_run.sh traffic); here each invariant is shown to fail on the outcome it exists to catch."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "kernel_build" / "bench" / "harness"))

import traffic  # noqa: E402
from ddtree_oracle import teacher_table  # noqa: E402
from traffic import Outcome, Request  # noqa: E402

VOCAB = 8192


def test_the_mix_is_fixed_by_its_seed_and_holds_every_case():
    a = traffic.make_mix(77, 120, context_len=4096, vocab=VOCAB)
    assert (
        a
        == traffic.make_mix(77, 120, context_len=4096, vocab=VOCAB)
        != traffic.make_mix(78, 120, context_len=4096, vocab=VOCAB)
    )
    kinds = Counter(r.kind for r in a)
    assert set(kinds) == {"short", "long", "shared", "limit"}
    assert all(len(r.prompt) + r.max_tokens == 4096 for r in a if r.kind == "limit")  # at the context limit
    assert all(len(r.prompt) + r.max_tokens <= 4096 and r.prompt[0] == traffic.BOS for r in a)
    assert all(traffic.FIRST_WORD <= t < VOCAB for r in a for t in r.prompt[1:])
    # shared prompts share one of three long prefixes: the radix cache's hits
    shared = [r.prompt[:600] for r in a if r.kind == "shared"]
    assert 1 < len(set(shared)) <= 3 < len(shared)
    greedy, sampled = [r for r in a if r.greedy], [r for r in a if not r.greedy]
    assert (
        greedy
        and sampled
        and {r.top_k for r in sampled} == {-1, 20}
        and {r.top_p for r in sampled} == {1.0, 0.9}
    )
    assert {r.abort for r in a} == {None, "endpoint", "disconnect"} and all(r.stream for r in a if r.abort)
    assert any(r.logprobs for r in a) and any(r.stream for r in a) and any(not r.stream for r in a)
    stops = [r for r in a if r.stop_at is not None]
    assert stops and all(r.greedy and not r.ignore_eos and 1 <= r.stop_at < r.max_tokens for r in stops)
    assert {r.stop_as for r in stops} == {"token", "word"}


def test_stops_are_placed_on_the_references_tokens_and_cut_what_is_expected():
    r = Request("a", "short", (0, 5, 6), 10, stop_at=3, ignore_eos=False)
    w = Request("b", "short", (0, 5, 6), 10, stop_at=2, stop_as="word", ignore_eos=False)
    ref = [10, 11, 12, 11, 14, 15]
    got_r, got_w = traffic.resolve_stops([r, w], {"a": ref, "b": ref})
    assert got_r.stop_token_ids == (11,) and got_w.stop == ("w8",)  # id 12 is word w8 (ids 0-3 are special)
    # the first occurrence of the stop token ends the output (included), even before stop_at
    assert traffic.expected_tokens(got_r, ref) == [10, 11]
    body = got_r.body("m")
    assert body["stop_token_ids"] == [11] and body["ignore_eos"] is False and body["rid"] == "a"
    assert traffic.unstopped(got_r).body("m").get("stop_token_ids") is None


def outcome(rid, tokens, finish="length", **kw):
    return Outcome(rid, status=200, token_ids=list(tokens), finish_reason=finish, **kw)


def test_check_outcomes_names_each_broken_promise():
    reqs = [
        Request("ok", "short", (0, 5), 4),
        Request("err", "long", (0, 5), 4),
        Request("long", "short", (0, 5), 4),
        Request("stop", "short", (0, 5), 4, stop_token_ids=(9,), ignore_eos=False),
        Request("lp", "short", (0, 5), 3, logprobs=2),
        Request("ab", "short", (0, 5), 8, stream=True, abort="disconnect"),
        Request("missing", "short", (0, 5), 4),
    ]
    outs = {
        "ok": outcome("ok", [1, 2, 3, 4]),
        "err": Outcome("err", status=500, error="boom"),
        "long": outcome("long", [1, 2, 3, 4, 5]),
        "stop": outcome("stop", [1, 9], finish="length"),
        "lp": outcome("lp", [1, 2, 3], logprobs=[-0.1, None, -0.2]),
        "ab": Outcome("ab", status=200, token_ids=[1], aborted_by_client=True),
    }
    bad = traffic.check_outcomes(reqs, outs)
    assert [b.split(":")[0].split()[0] for b in bad] == ["err", "long", "stop", "lp", "missing"], bad
    assert "HTTP 500: boom" in bad[0] and "5 tokens for max_tokens 4" in bad[1]
    assert "expected stop" in bad[2] and "3 logprobs for 3 tokens" in bad[3] and "never sent" in bad[4]
    outs["stop"] = outcome("stop", [1, 9], finish="stop")
    outs["lp"] = outcome("lp", [1, 2, 3], logprobs=[-0.1, -0.3, -0.2])
    assert [b.split(":")[0] for b in traffic.check_outcomes(reqs, outs)] == [
        "err (long)",
        "long (short)",
        "missing",
    ]


def test_check_greedy_finds_the_first_difference_and_skips_what_it_cannot_judge():
    reqs = [
        Request("same", "short", (0, 5), 4),
        Request("differs", "short", (0, 5), 4),
        Request("short", "short", (0, 5), 4),
        Request("sampled", "short", (0, 5), 4, temperature=1.0),
        Request("stopped", "short", (0, 5), 6, stop_token_ids=(3,), ignore_eos=False),
        Request("word", "short", (0, 5), 6, stop=("w9",), ignore_eos=False),
        Request("aborted", "short", (0, 5), 6, stream=True, abort="endpoint"),
    ]
    ref = {r.rid: [1, 2, 3, 4, 5, 6][: r.max_tokens] for r in reqs}
    outs = {
        "same": outcome("same", [1, 2, 3, 4]),
        "differs": outcome("differs", [1, 2, 7, 4]),
        "short": outcome("short", [1, 2]),
        "sampled": outcome("sampled", [9, 9, 9, 9]),
        "stopped": outcome("stopped", [1, 2, 3], finish="stop"),
        "word": outcome("word", [1, 2], finish="stop"),  # a stop string's cut: a prefix of the reference
        "aborted": Outcome("aborted", status=200, token_ids=[8], aborted_by_client=True),
    }
    got = traffic.check_greedy(reqs, outs, ref)
    assert [(m.rid, m.position) for m in got] == [("differs", 2), ("short", 2)]
    outs["stopped"] = outcome("stopped", [1, 2, 3, 4], finish="stop")  # ran past its stop token
    outs["word"] = outcome("word", [1, 8], finish="stop")
    got = traffic.check_greedy(reqs, outs, ref)
    assert [(m.rid, m.position) for m in got] == [("differs", 2), ("short", 2), ("stopped", 3), ("word", 1)]


def test_chi_square_keeps_one_distribution_and_rejects_a_shifted_one():
    """The sampled-token check's power at the harness's size (bench_traffic's --samples 800 a server, pairs of top-4
    tokens: 16 cells, p < 1e-3 fails): a tenth of the mass moved from one cell to another (total variation 0.1) is
    found in most draws (86% of 200 seeded draws; 41% at 480 samples, 15% at 240), two samples of one distribution
    pass (seeded: the draws are fixed)."""
    assert traffic.chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert traffic.chi2_sf(30.578, 15) == pytest.approx(0.01, abs=1e-3)
    rng = random.Random(5)
    cells = list(range(16))
    p = [0.25, 0.2, 0.15, 0.1] + [0.3 / 12] * 12
    shifted = [0.15, 0.3] + p[2:]  # what a verify that over-accepted one token would do
    same = [
        traffic.chi2_homogeneity(rng.choices(cells, p, k=800), rng.choices(cells, p, k=800))[2]
        for _ in range(50)
    ]
    apart = [
        traffic.chi2_homogeneity(rng.choices(cells, p, k=800), rng.choices(cells, shifted, k=800))[2]
        for _ in range(50)
    ]
    assert min(same) > 1e-3
    assert sum(x < 1e-3 for x in apart) >= 35, sorted(apart)[:10]


def test_the_teacher_table_keeps_only_successors_every_sequence_agrees_on():
    assert teacher_table([[5, 6, 7, 5, 6, 8]], 10) == [-1, -1, -1, -1, -1, 6, -1, 5, -1, -1]
    t = teacher_table([[1, 2, 3], [4, 2, 3], [3, 4]], 6)
    assert t == [-1, 2, 3, 4, 2, -1]
    assert teacher_table([[2, 3], [2, 4], [2, 3]], 5)[2] == -1  # once two successors differ, never again one


def test_bench_traffic_refuses_an_unknown_configuration_before_it_looks_for_a_gpu():
    script = REPO / "kernel_build" / "bench" / "benchmarks" / "bench_traffic.py"
    r = subprocess.run(
        [sys.executable, str(script), "--configs", "none,ddtree-onn"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "ddtree-onn" in r.stderr and "ddtree-on" in r.stderr, r.stderr


# ---- the harness against the stand-in server ---------------------------------------------------------------------


@pytest.fixture
def standins(tmp_path):
    """Two stand-in servers (standins/standin_engine.py: NOT SGLang; they speak its streaming, stop, abort, logprobs
    and /metrics contract): one without speculation (the reference), one speculative, 3 tokens a verify step."""
    sys.path.insert(0, str(REPO / "standins"))
    from standin_engine import StandinProcess, free_port

    from kdtree.config import Mode
    from kdtree.state.mode_file import write_desired_mode

    procs = []
    for name, extra in (("reference", ["--no-speculation"]), ("spec", [])):
        (tmp_path / name).mkdir()
        write_desired_mode(tmp_path / name, Mode.ON)  # kdtree serving every verify (the diverge fault's mode)
        procs.append(
            StandinProcess(free_port(), str(tmp_path / name), ["--step-seconds", "0.03", *extra]).start()
        )
    for p in procs:
        p.wait_port()
    yield procs
    for p in procs:
        p.stop()


def test_the_harness_drives_a_server_through_the_mix_and_holds_it_to_the_invariants(standins):
    """The mix at concurrency 4 and 16 through the harness's client (streams, stops, aborts through /abort_request,
    clients hanging up, logprobs) against the stand-ins: every promise kept, greedy outputs equal the reference's
    up to their stops, the aborted streams cut short, and SGLang's request counter within what was sent. Then the
    stand-in's diverge fault (a wrong result in mode on) is caught by the greedy check at the position it starts."""
    reference, spec = (f"http://127.0.0.1:{p.port}" for p in standins)
    model = "stand-in/deepseek-v3"
    mix = traffic.make_mix(3, 40, context_len=512, vocab=VOCAB, max_tokens=24)
    # an aborting stream runs 40 chunks (1.2 s): its client's abort, sent after the first, lands well before the end
    mix = [r if r.abort is None else traffic.replace(r, abort_after=1, max_tokens=120) for r in mix]
    greedy = [traffic.unstopped(r) for r in mix if r.greedy]
    ref = traffic.run_phase(reference, model, greedy, 8)
    ref.pop(None)
    ref_tokens = {rid: o.token_ids for rid, o in ref.items()}
    assert all(o.status == 200 for o in ref.values()) and len(ref_tokens) == len(greedy)
    mix = traffic.resolve_stops(mix, ref_tokens)
    assert any(r.stop_token_ids for r in mix) and any(r.stop for r in mix)
    out = {}
    for c, part in ((4, mix[:12]), (16, mix[12:])):
        got = traffic.run_phase(spec, model, part, c)
        assert got.pop(None) > 0
        out |= got
    assert traffic.check_outcomes(mix, out) == []
    assert traffic.check_greedy(mix, out, ref_tokens) == []
    stopped = [r for r in mix if r.stop_token_ids and r.greedy]
    assert any(
        out[r.rid].finish_reason == "stop" and len(out[r.rid].token_ids) < r.max_tokens for r in stopped
    )
    aborted = [o for o in out.values() if o.aborted_by_client]
    assert aborted and all(len(o.token_ids) < 120 for o in aborted), aborted
    assert all(o.accept == pytest.approx(len(o.token_ids) / -(-len(o.token_ids) // 3)) for o in out.values()
               if o.accept and not o.aborted_by_client and o.status == 200)  # fmt: skip
    counted = traffic.metrics(spec)["sglang:num_requests_total"]
    clients = sum(o.aborted_by_client for o in out.values())
    assert len(mix) - clients <= counted <= len(mix), (counted, len(mix), clients)
    assert traffic.metrics(spec)["sglang:num_used_tokens"] == 0

    httpx.post(f"{spec}/_standin/fault", json={"fault": "diverge"}, timeout=5).raise_for_status()
    plain = [r for r in greedy if r.max_tokens > 5][:6]
    got = traffic.run_phase(spec, model, plain, 4)
    got.pop(None)
    assert [(m.rid, m.position) for m in traffic.check_greedy(plain, got, ref_tokens)] == [
        (r.rid, 5) for r in plain
    ]


class _Served:
    """A stand-in server dressed as bench_traffic's RealServer (url, process, log, rank records), so that the
    benchmark's own drive, judge and table run here; the stand-in is NOT SGLang."""

    def __init__(self, proc, name, algorithm, mode):
        from types import SimpleNamespace

        self.proc, self.starts = proc.proc, proc.starts
        self.url, self.model_dir, self.state_dir = (
            f"http://127.0.0.1:{proc.port}",
            "stand-in/deepseek-v3",
            proc.state_dir,
        )
        self.spec = SimpleNamespace(name=name, algorithm=algorithm, mode=mode)
        self._log = proc.log_path

    def server_log(self) -> str:
        return self._log.read_text()

    def record(self, rank: int = 0):
        from kdtree.state.rank_records import read_records

        return {v.record.tp_rank: v.record for v in read_records(self.state_dir, max_age_s=60)}[rank]


def test_bench_traffic_drives_judges_and_tabulates_a_run(tmp_path, monkeypatch):
    """bench_traffic's drive, judge and table end to end against stand-ins (a reference without speculation, and one
    speculative server in on whose one rank writes its record): a run that keeps every promise passes; with the
    stand-in's diverge fault the same run fails naming the greedy differences (the stand-in has no top-2 to call
    them near-ties) and on's counters; the table has a row each."""
    sys.path.insert(0, str(REPO / "kernel_build" / "bench" / "benchmarks"))
    sys.path.insert(0, str(REPO / "standins"))
    import bench_traffic
    from standin_engine import StandinProcess, free_port

    from kdtree.config import Mode
    from kdtree.state.mode_file import write_desired_mode

    monkeypatch.setattr(bench_traffic, "PHASE_REQUESTS", {1: 2, 4: 6, 16: 12, 32: 16})
    procs = {}
    for name, extra in (
        ("none", ["--no-speculation"]),
        ("ngram-on", ["--tp-size", "1", "--heartbeat-s", "0.2"]),
    ):
        (tmp_path / name).mkdir()
        write_desired_mode(tmp_path / name, Mode.ON)
        procs[name] = StandinProcess(
            free_port(), str(tmp_path / name), ["--step-seconds", "0.01", *extra]
        ).start()
    try:
        for p in procs.values():
            p.wait_port()
        ref = _Served(procs["none"], "none", bench_traffic.NONE, Mode.OFF)
        spec = _Served(procs["ngram-on"], "ngram-on", "NGRAM", Mode.ON)
        mix = traffic.make_mix(5, 36, context_len=512, vocab=VOCAB, max_tokens=24)
        got = traffic.run_phase(ref.url, ref.model_dir, [traffic.unstopped(r) for r in mix if r.greedy], 8)
        got.pop(None)
        ref_tokens = {rid: o.token_ids for rid, o in got.items()}
        mix = traffic.resolve_stops(mix, ref_tokens)
        runs = {s.spec.name: bench_traffic.drive(s, mix, 20, deadline=float("inf")) for s in (ref, spec)}
        import time

        time.sleep(0.5)  # the rank's record catches up
        rows = [bench_traffic.judge(s, mix, runs[s.spec.name], ref_tokens, ref, runs["none"]["samples"])
                for s in (ref, spec)]  # fmt: skip
        assert [r["problems"] for r in rows] == [[], []]
        e = rows[1]["evidence"]
        assert e["requests_sent"] == 36 + 20 and e["kdtree"]["served_kdtree"] > 0 and e["chi2"][2] == 1.0
        assert len(rows[1]["phases"]) == 4 and all(p["tokens_per_s"] > 0 for p in rows[1]["phases"])
        table = bench_traffic.markdown(rows, ["head"], 1e-3)
        assert "| none | pass |" in table and "| ngram-on | pass |" in table
        httpx.post(f"{spec.url}/_standin/fault", json={"fault": "diverge"}, timeout=5).raise_for_status()
        run = bench_traffic.drive(spec, mix, 0, deadline=float("inf"))
        bad = bench_traffic.judge(spec, mix, run, ref_tokens, ref, {})
        assert not bad["ok"] and any(
            "greedy differs at token 5" in p and "gap inf" in p for p in bad["problems"]
        )
    finally:
        for p in procs.values():
            p.stop()
