"""The oracle benchmark's bookkeeping (kernel_build/bench/benchmarks/bench_oracle.py) on the CPU: which budget each
server runs, the accept lengths it expects, how a row compares with the chain, and its refusals. The servers
themselves run on the GPU (device_run.sh oracle)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernel_build" / "bench" / "benchmarks"))
try:
    import bench_oracle
finally:
    sys.path.pop(0)

import ddtree_oracle  # noqa: E402

from kdtree.state.process_record import START_MARK  # noqa: E402


def test_each_server_runs_the_budget_its_name_says():
    assert bench_oracle.tree_budget("DFLASH-B16") is None
    assert [bench_oracle.tree_budget(a) for a in bench_oracle.DEFAULT_ALGORITHMS.split(",")[1:]] == [
        16,
        32,
        64,
        128,
        32,
        128,
    ]
    # fixed rows verify their whole tree, AUTO rows cut it (kdtree's setting), the chain has no such setting
    assert bench_oracle.server_env("DDTREE-B16-T64") == {"KDTREE_DDTREE_BUDGET": "fixed"}
    assert bench_oracle.server_env("DDTREE-B16-T128-AUTO") == {"KDTREE_DDTREE_BUDGET": "auto"}
    assert bench_oracle.server_key("DDTREE-B16-T128-AUTO") == "DDTREE-B16-T128"
    assert bench_oracle.server_env("DFLASH-B16") == {}


def test_expected_accept_lengths_count_the_bonus_and_grow_with_the_tree():
    paper = ddtree_oracle.PROFILES["paper"]
    chain = bench_oracle.expected_accept_length("DFLASH-B16", paper)
    assert chain == pytest.approx(1 + ddtree_oracle.expected_chain_accepted(paper, 15))
    trees = [
        bench_oracle.expected_accept_length(a, paper) for a in bench_oracle.DEFAULT_ALGORITHMS.split(",")[1:5]
    ]
    assert chain <= trees[0] and trees == sorted(trees)


def _round(tps: float, accept: float = 3.0) -> dict:
    return {"decode_tokens_per_s": tps, "accept_length": accept}


def test_a_row_is_ahead_or_behind_the_chain_only_where_their_rounds_are_apart():
    rounds = {
        "DFLASH-B16": [_round(100), _round(110), _round(105)],
        "DDTREE-B16-T16": [_round(120), _round(111), _round(125)],  # slowest 111 > the chain's fastest 110
        "DDTREE-B16": [_round(104), _round(108), _round(101)],  # within 100..110
        "DDTREE-B16-T64": [_round(90), _round(99), _round(95)],  # fastest 99 < the chain's slowest 100
        "DDTREE-B16-T128": [
            _round(96),
            _round(97),
            _round(103),
        ],  # median below the chain's slowest, a round in it
        "DDTREE-B16-AUTO": [
            _round(109),
            _round(112),
            _round(115),
        ],  # median above the chain's fastest, a round in it
    }
    rows = {r["algorithm"]: r for r in bench_oracle.rows_of("paper", 2048, 1, rounds, 61)}
    assert rows["DFLASH-B16"]["vs_chain"] == 1.0
    assert rows["DDTREE-B16-T16"]["beyond_noise"] == "ahead"
    assert rows["DDTREE-B16"]["beyond_noise"] == "within"
    assert rows["DDTREE-B16-T64"]["beyond_noise"] == "behind"
    assert rows["DDTREE-B16-T128"]["beyond_noise"] == rows["DDTREE-B16-AUTO"]["beyond_noise"] == "within"
    assert rows["DDTREE-B16-T64"]["vs_chain"] == pytest.approx(95 / 105)
    table = bench_oracle.markdown(list(rows.values()), ["head"])
    assert "| paper | 2048 | 1 | DDTREE-B16-T16 | 120.0; 111.0-125.0 | 1.14x | ahead | 3.00 / " in table
    assert table.splitlines()[5].endswith("| 17.0 | 25.00 |")  # T16: 17 tokens a request, 3 a step at 120 a s


def test_an_auto_row_reports_the_tokens_it_verified_and_the_caps_expected_accept_length():
    from kdtree.state.rank_records import DdtreeBudget

    before = DdtreeBudget(
        budgets=[4, 128], steps=10, request_steps=10, live_tokens=1290, steps_at={"128": 10}
    )
    after = DdtreeBudget(
        budgets=[4, 128], steps=30, request_steps=30, live_tokens=1290 + 15 * 5 + 5 * 129,
        steps_at={"4": 15, "128": 15}, fixed_ms=9.5, expected_accepted={"4": 1.2, "128": 2.9},
    )  # fmt: skip
    choices = bench_oracle.auto_choices(before, after)
    assert choices["verified_tokens"] == (15 * 5 + 5 * 129) / 20
    assert choices["steps_at"] == {"4": 15, "128": 5}  # the timed rounds' steps, not the server's whole life
    assert bench_oracle.auto_choices(None, None) is None and bench_oracle.auto_choices(after, after) is None
    rounds = {
        "DFLASH-B16": [_round(100)],
        "DDTREE-B16-T128-AUTO": [{**_round(130, accept=2.6), "auto": choices}],
    }
    rows = {r["algorithm"]: r for r in bench_oracle.rows_of("paper", 2048, 1, rounds, 61)}
    auto = rows["DDTREE-B16-T128-AUTO"]
    assert auto["budget"] == 128 and auto["verified_tokens"] == 36.0 and auto["auto"]["fixed_ms"] == 9.5
    assert auto["expected_accept_length"] == bench_oracle.expected_accept_length(
        "DDTREE-B16-T128", ddtree_oracle.PROFILES["paper"]
    )
    assert auto["step_ms"] == pytest.approx(20.0)  # 2.6 tokens a step at 130 tokens a second
    assert rows["DFLASH-B16"]["verified_tokens"] == 16 and rows["DFLASH-B16"]["auto"] is None
    assert rows["DFLASH-B16"]["step_ms"] == pytest.approx(30.0)
    # at batch 4, a request's tokens a second are a quarter of the batch's
    batch4 = bench_oracle.rows_of("paper", 2048, 4, {"DFLASH-B16": [_round(400)]}, 61)[0]
    assert batch4["step_ms"] == pytest.approx(30.0)


def test_the_profile_file_is_replaced_whole_and_reads_back_as_the_profile(tmp_path):
    path = tmp_path / "profile"
    ddtree_oracle.write_profile(path, ddtree_oracle.PROFILES["pessimistic"])
    assert ddtree_oracle.read_profile(str(path)) == ddtree_oracle.PROFILES["pessimistic"]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "arg",
    [
        ["--algorithms", "DFLASH-B16,DDTREE-B8"],
        ["--algorithms", "DFLASH-B16-AUTO"],
        ["--profiles", "optimistic"],
    ],
)
def test_an_unknown_server_or_profile_is_refused_before_anything_starts(arg):
    p = subprocess.run(
        [sys.executable, str(ROOT / "kernel_build/bench/benchmarks/bench_oracle.py"), *arg],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert "unknown" in p.stderr and any(
        x in p.stderr for x in ("DDTREE-B8", "DFLASH-B16-AUTO", "optimistic")
    )


def test_a_table_measured_with_the_host_report_says_its_rounds_were_slowed(monkeypatch):
    """DDTREE_HOST_REPORT profiles decode steps 80-140 of every server, inside the timed rounds: the table's head
    says so, and says nothing without it."""
    monkeypatch.delenv("DDTREE_HOST_REPORT", raising=False)
    assert bench_oracle.host_report_caveat() is None
    monkeypatch.setenv("DDTREE_HOST_REPORT", "/tmp/host")
    assert "cProfile" in bench_oracle.host_report_caveat()


class _Server:
    """A stand-in of RealServer's process side: its start count (the orchestrator starts it again when it exits),
    its process and the launcher's log (START_MARK at each start, as entrypoint/supervise.py writes it)."""

    def __init__(self, starts: int, *runs: list[str], exited: bool = False):
        self.starts = starts
        self.log = "\n".join(
            line for i, run in enumerate(runs, 1) for line in [f"{START_MARK} #{i} at t, pid {i}", *run]
        )
        self.proc = type("Proc", (), {"poll": lambda _self: 1 if exited else None})()

    def server_log(self) -> str:
        return self.log


NOISE = "[..] OpenAIServingResponses init failed (ModuleNotFoundError: No module named 'openai_harmony')"
READY = "[..] INFO: The server is fired up and ready to roll!"


def test_a_server_that_died_during_a_row_is_named_with_its_own_error():
    """The row's own error is the client's ("Server disconnected"): the server that died and the line that says why
    come from its start count and the launcher's log of the run that died, not its restart's; a server that runs on
    is not named."""
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    killed = "kdtree launcher: the server was killed by SIGKILL (exit status 137)"
    live = {
        "DFLASH-B16": _Server(1, [NOISE, READY, "[..] Decode batch, #running-req: 4"]),
        "DDTREE-B16-T128": _Server(
            2,
            [NOISE, READY, "[..] Prefill batch", oom, "kdtree launcher: the server exited with status 1"],
            [NOISE, "RuntimeError: the restart's own"],
        ),  # fmt: skip
        "DDTREE-B16-T64": _Server(2, [NOISE, READY, *["[..] Decode batch"] * 30, killed], [NOISE, READY]),
        "DDTREE-B16": _Server(1, [], exited=True),
    }
    dead = bench_oracle.exited_since(live, dict.fromkeys(live, 1), wait_s=0)
    assert set(dead) == {"DDTREE-B16-T128", "DDTREE-B16-T64", "DDTREE-B16"}
    assert dead["DDTREE-B16-T128"].endswith(oom)
    assert dead["DDTREE-B16-T64"].endswith(killed)
    assert dead["DDTREE-B16"].endswith("(none)")
    assert "openai_harmony" not in str(dead) and "the restart's own" not in str(dead)


def test_a_server_the_client_saw_go_is_waited_for_until_its_launcher_ends():
    """The client's error comes first; the launcher drains the server's output for up to 5 s before it exits."""
    server = _Server(1, [READY, "kdtree launcher: the server exited with status 1"])
    t0 = time.monotonic()
    threading.Timer(0.6, lambda: setattr(server, "starts", 2)).start()
    assert set(bench_oracle.exited_since({"DFLASH-B16": server}, {"DFLASH-B16": 1}, wait_s=5)) == {
        "DFLASH-B16"
    }
    assert 0.5 < time.monotonic() - t0 < 3
    t0 = time.monotonic()
    assert bench_oracle.exited_since({"DFLASH-B16": _Server(1, [])}, {"DFLASH-B16": 1}, wait_s=0.5) == {}
    assert time.monotonic() - t0 < 2
