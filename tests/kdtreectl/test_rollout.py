"""kdtreectl rollout across several replicas, each a stand-in stack on loopback.

A replica is standins/standin_engine.py (a stand-in for SGLang, NOT SGLang: its startup and HTTP contract, and
per-rank records in its own state dir) behind a real sidecar app served by uvicorn in a thread, restarting
its stand-in through StandinProcess. kdtreectl runs as a user runs it, in a subprocess.
"""

from __future__ import annotations

import re

import pytest
from sidecar_harness import TOKEN, kdtreectl, make_settings, serve
from standin_engine import StandinProcess, free_port

from kdtree.config import Mode
from kdtree.state.mode_file import read_desired_mode, write_desired_mode
from kdtreectl.cli import main as kdtreectl_main
from sidecar.store import Store

GOOD_PARITY = ("--parity-calls", "500", "--parity-max-rel", "0.004")


@pytest.fixture
def replicas(tmp_path):
    """replicas(*per_replica_engine_args, mode=M or modes=[M, ...]) -> [(sidecar URL, StandinProcess, state dir)]."""
    engines, contexts = [], []

    def start(*per_replica: tuple[str, ...], mode: Mode = Mode.OFF, modes: list[Mode] | None = None):
        made = []
        for i, args in enumerate(per_replica):
            mode = modes[i] if modes else mode
            state = tmp_path / f"replica-{len(engines)}"
            state.mkdir()
            write_desired_mode(state, mode)
            proc = StandinProcess(free_port(), str(state), ["--tp-size", "2", "--heartbeat-s", "0.2", *args])
            engines.append(proc.start())
            # The background probe at a slow cadence: its compared calls are evidence the gate counts.
            settings = make_settings(
                state, proc.port, ready_timeout_s=10, bake_probes=2, verify=mode, probe_interval_s=2.0
            )
            ctx = serve(settings, proc)
            contexts.append(ctx)
            made.append((ctx.__enter__(), proc, state))
        for _, proc, _ in made:
            proc.wait_port()
        return made

    yield start
    for ctx in contexts:
        ctx.__exit__(None, None, None)
    for proc in engines:
        proc.stop()


def rollout(stacks, *args: str, token: str | None = TOKEN):
    sidecars = [a for url, _, _ in stacks for a in ("--sidecar", url)]
    return kdtreectl(None, "rollout", *sidecars, "--interval", "0.1", *args, token=token)


def table(stdout: str) -> dict[str, list[str]]:
    """The final table: replica URL -> [from, to, outcome, duration, detail...]."""
    lines = stdout.splitlines()
    head = max(i for i, line in enumerate(lines) if line.startswith("replica "))
    assert lines[head].split() == ["replica", "from", "to", "outcome", "duration", "detail"]
    return {line.split()[0]: line.split()[1:] for line in lines[head + 1 :] if line.startswith("http://")}


def transitions(state) -> list[dict]:
    """Finished transitions in the replica's audit log."""
    return [e for e in Store(state, 50).audit_tail(1000) if e["event"] in ("succeeded", "rolled_back")]


def test_canary_first_then_waves_and_a_replica_already_in_the_mode(replicas):
    stacks = replicas((), (), (), (), modes=[Mode.OFF, Mode.OFF, Mode.VALIDATE, Mode.OFF])

    r = rollout(stacks, "--to", "validate", "--canary", "1", "--wave", "2", "--reason", "rollout test")
    assert r.returncode == 0, (r.stdout, r.stderr)
    progress = [line for line in r.stdout.splitlines() if line.startswith("[")]
    assert progress[0].startswith(f"[canary] {stacks[0][0]}: off -> validate succeeded in ")
    assert {re.search(r"(http://\S+):", line)[1] for line in progress[1:3]} == {stacks[1][0], stacks[2][0]}
    assert all(line.startswith("[wave 1/2]") for line in progress[1:3])
    assert progress[3].startswith(f"[wave 2/2] {stacks[3][0]}: off -> validate succeeded")
    rows = table(r.stdout)
    assert [rows[url][2] for url, _, _ in stacks] == ["succeeded", "succeeded", "already", "succeeded"]
    assert rows[stacks[2][0]][:2] == ["validate", "validate"]
    assert re.fullmatch(r"\d+\.\ds", rows[stacks[0][0]][3])
    assert [read_desired_mode(state) for _, _, state in stacks] == [Mode.VALIDATE] * 4
    assert [proc.starts for _, proc, _ in stacks] == [2, 2, 1, 2]  # the one already there was not restarted
    # Each wave was asked only after the previous one had finished.
    finished = [transitions(state)[-1]["ts"] for _, _, state in stacks if transitions(state)]
    asked = [
        [e["ts"] for e in Store(state, 50).audit_tail(100) if e["event"] == "accepted"]
        for _, _, state in stacks
    ]
    assert finished[0] < asked[1][0] and max(finished[1], asked[1][0]) < asked[3][0]
    assert "rollout test" in {e.get("reason") for e in Store(stacks[0][2], 50).audit_tail(100)}


def test_a_refused_gate_stops_the_rollout_and_leaves_the_flipped_replicas(replicas):
    stacks = replicas(GOOD_PARITY, ("--parity-calls", "10", "--layers", "1"), GOOD_PARITY, mode=Mode.VALIDATE)
    r = rollout(stacks, "--to", "on")
    assert r.returncode == 1, (r.stdout, r.stderr)
    rows = table(r.stdout)
    assert [rows[url][2] for url, _, _ in stacks] == ["succeeded", "refused", "skipped"]
    # 10 compared calls, plus those of the sidecar's own probes: still below the gate's 100.
    got = re.search(r"gate failed: min_calls_compared need >= 100, got (\d+)", " ".join(rows[stacks[1][0]]))
    assert got and 10 <= int(got[1]) < 100, rows[stacks[1][0]]
    assert "not attempted: the rollout stopped at " + stacks[1][0] in " ".join(rows[stacks[2][0]])
    assert f"rollout to on stopped at {stacks[1][0]} (refused); left in mode on: {stacks[0][0]}" in r.stderr
    assert [read_desired_mode(state) for _, _, state in stacks] == [Mode.ON, Mode.VALIDATE, Mode.VALIDATE]
    assert [proc.starts for _, proc, _ in stacks] == [1, 1, 1]  # validate -> on is a live switch: no restart


def test_a_failed_bake_stops_the_rollout_and_rollback_on_failure_flips_back(replicas):
    bad_bake = ("--fault", "http-500", "--fault-in-mode", "on", "--fault-after", "1")
    stacks = replicas(GOOD_PARITY, (*GOOD_PARITY, *bad_bake), GOOD_PARITY, mode=Mode.VALIDATE)
    r = rollout(stacks, "--to", "on", "--rollback-on-failure")
    assert r.returncode == 1, (r.stdout, r.stderr)
    rows = table(r.stdout)
    assert [rows[url][2] for url, _, _ in stacks] == ["reverted", "rolled_back", "skipped"]
    assert "bake probe" in " ".join(rows[stacks[1][0]])  # the replica's sidecar rolled it back
    assert "flipped back to validate" in " ".join(rows[stacks[0][0]])
    assert any(line.startswith(f"[revert] {stacks[0][0]}") for line in r.stdout.splitlines())
    assert "no replica was left flipped" in r.stderr
    assert [read_desired_mode(state) for _, _, state in stacks] == [Mode.VALIDATE] * 3
    assert [proc.starts for _, proc, _ in stacks] == [
        1,
        1,
        1,
    ]  # there and back, live; there and rolled back, live
    forced = [e for e in Store(stacks[0][2], 50).audit_tail(100) if e["event"] == "FORCED"]
    assert forced and forced[0]["to_mode"] == "validate"  # the way back skips the gate, loudly


def test_dry_run_shows_every_gate_and_flips_nothing(replicas):
    stacks = replicas(GOOD_PARITY, ("--parity-calls", "10", "--layers", "1"), GOOD_PARITY, mode=Mode.VALIDATE)
    r = rollout(stacks, "--to", "on", "--dry-run")
    assert r.returncode == 1, (r.stdout, r.stderr)
    rows = table(r.stdout)
    assert [rows[url][2] for url, _, _ in stacks] == ["allowed", "refused", "allowed"]
    assert "gate failed: min_calls_compared" in " ".join(rows[stacks[1][0]])
    # Each gate in full (the sidecars' own probes add compared calls to the 10 and 500 the stand-ins start with).
    fails = re.findall(r"^  FAIL  min_calls_compared: need >= 100, got (\d+)$", r.stdout, re.M)
    passes = re.findall(r"^  pass  min_calls_compared: need >= 100, got (\d+)$", r.stdout, re.M)
    assert len(fails) == 1 and 10 <= int(fails[0]) < 100 and len(passes) == 2, r.stdout
    assert f"dry run: 1 refused by its gate ({stacks[1][0]}); nothing changed" in r.stdout
    assert [read_desired_mode(state) for _, _, state in stacks] == [Mode.VALIDATE] * 3
    assert [proc.starts for _, proc, _ in stacks] == [1, 1, 1]
    ok = rollout([stacks[0], stacks[2]], "--to", "on", "--dry-run")
    assert ok.returncode == 0 and "every replica would be allowed" in ok.stdout


def test_a_dry_run_names_an_unreachable_sidecar_as_unreachable(replicas):
    stacks = replicas(GOOD_PARITY, mode=Mode.VALIDATE)
    gone = (f"http://127.0.0.1:{free_port()}", None, None)
    r = rollout([stacks[0], gone], "--to", "on", "--dry-run")
    assert r.returncode == 7, (r.stdout, r.stderr)
    assert [table(r.stdout)[url][2] for url in (stacks[0][0], gone[0])] == ["allowed", "unreachable"]
    assert f"dry run: 1 unreachable or not a sidecar ({gone[0]}); nothing changed" in r.stdout
    assert "gate" not in r.stdout.splitlines()[-1]
    # the fix points at the flag the address came from, not at kdtreectl's --url
    assert "another address: the --sidecar that names it" in r.stdout and "KDTREE_SIDECAR_URL" not in r.stdout


def test_an_unreachable_sidecar_stops_the_rollout_before_anything_changes(replicas):
    stacks = replicas((), ())
    gone = (f"http://127.0.0.1:{free_port()}", None, None)
    r = rollout([stacks[0], gone, stacks[1]], "--to", "validate")
    assert r.returncode == 7  # like every kdtreectl command when a sidecar does not answer as one
    rows = table(r.stdout)
    assert [rows[url][2] for url in (stacks[0][0], gone[0], stacks[1][0])] == [
        "skipped",
        "unreachable",
        "skipped",
    ]
    assert [proc.starts for _, proc, _ in stacks] == [1, 1] and "nothing changed" in r.stdout


def test_without_the_token_the_first_replica_is_not_authorized(replicas):
    stacks = replicas((), ())
    r = rollout(stacks, "--to", "validate", token=None)
    assert r.returncode == 1
    assert [table(r.stdout)[url][2] for url, _, _ in stacks] == ["unauthorized", "skipped"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["rollout", "--to", "on"], "one of the arguments --sidecar --selector is required"),
        (
            ["rollout", "--to", "on", "--sidecar", "http://a:1", "--selector", "app=kdtree"],
            "argument --selector: not allowed with argument --sidecar",
        ),
        (["rollout", "--to", "shadow", "--sidecar", "http://a:1"], "invalid choice: 'shadow'"),
        (
            ["rollout", "--to", "on", "--sidecar", "http://a:1", "--sidecar", "http://a:1/"],
            "the same sidecar twice",
        ),
        (["rollout", "--to", "on", "--sidecar", "a:1"], "is not an http(s) URL"),
        (["rollout", "--to", "on", "--sidecar", "http://a:1", "--wave", "0"], "--wave: must be at least 1"),
        (
            ["rollout", "--to", "on", "--sidecar", "http://a:1", "--canary", "-1"],
            "--canary: must be at least 0",
        ),
    ],
)
def test_bad_input_exits_2(argv, message, capsys):
    try:
        rc = kdtreectl_main(argv)
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    assert rc == 2 and message in capsys.readouterr().err
