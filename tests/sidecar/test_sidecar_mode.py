"""POST /mode: the gate, the flip, rollback at each failure point, concurrency, auth, persistence.

The server is standins/standin_engine.py, a stand-in for SGLang (NOT SGLang: it keeps SGLang's startup and
HTTP contract and writes the per-rank records) run as a separate local process. Every test that uses it
runs twice, once per server control:
- standin: the sidecar restarts it through StandinProcess, which has the same inspect/logs/restart methods
  as the Docker-backed ServerContainer (that one is tested against a real dockerd in test_sidecar_docker.py);
- process: it runs under the server entrypoint's real supervisor behind a stand-in orchestrator that
  restarts it like a restart policy, and the sidecar sees and restarts it through its process control
  (sidecar/server_control/process.py, reading the state file and log the supervisor writes; standins/process_harness.py).
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from process_harness import SupervisedStandin
from sidecar_harness import AUTH, audit_events, make_settings, reach_step, settle, sidecar, until, wait_ready
from standin_engine import free_port

from kdtree.config import Mode
from kdtree.state.mode_file import read_desired_mode, write_desired_mode
from sidecar.server_control import ServerMissing
from sidecar.store import STATE_FILE, SidecarState, Store, Transition

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["standin", "process"])
def engine(request, engine, supervised):
    """Stand-in engines that report two ranks with a fast heartbeat, under either server control."""
    start = engine if request.param == "standin" else supervised
    return lambda *args, **kw: start("--tp-size", "2", "--heartbeat-s", "0.2", *args, **kw)


def process_controlled(proc) -> bool:
    return isinstance(proc, SupervisedStandin)


# ---- auth -----------------------------------------------------------------------------------------------


async def test_no_token_no_mutation(engine, tmp_path):
    proc = engine()
    pid = proc.proc.pid
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        r = await c.post("/mode", json={"mode": "validate"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = await c.post("/mode", json={"mode": "validate"}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 403
        r = await c.post("/mode", json={"mode": "validate", "dry_run": True})
        assert r.status_code == 401
        st = (await c.get("/status")).json()
    assert st["transitions"] == [] and st["active_transition"] is None
    assert read_desired_mode(tmp_path) is None and proc.proc.pid == pid and proc.starts == 1
    assert audit_events(tmp_path) == []


@pytest.mark.parametrize("token", ["s3cr\u20acT", "two words", "tab\there", "line\x7f"])
def test_an_admin_token_no_header_can_carry_is_refused_at_start_without_showing_it(tmp_path, token):
    """A token outside printable ASCII could never match a client's header (or the leader's, in a group); refused
    when the settings load, naming the setting and the fix, never the token."""
    with pytest.raises(ValueError, match="KDTREE_ADMIN_TOKEN must be printable ASCII without spaces") as e:
        make_settings(tmp_path, 1, admin_token=token)
    assert token not in str(e.value)
    (tmp_path / "token").write_text(token + "\n")
    with pytest.raises(ValueError, match="KDTREE_ADMIN_TOKEN_FILE's secret must be printable ASCII"):
        make_settings(tmp_path, 1, admin_token=None, admin_token_file=tmp_path / "token")


async def test_open_admin_needs_no_token(engine, tmp_path):
    proc = engine()
    settings = make_settings(tmp_path, proc.port, admin_token=None, allow_open_admin=True)
    async with sidecar(settings, server=proc) as c:
        r = await c.post("/mode", json={"mode": "validate", "dry_run": True})
    assert r.status_code == 200 and r.json()["allowed"] is True


# ---- the flip ----------------------------------------------------------------------------------------------


async def test_off_to_validate_restarts_the_server_into_validate(engine, tmp_path):
    proc = engine()
    old_pid = proc.proc.pid
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        assert (await c.get("/ready")).json()["mode"] == "off"
        r = await c.post("/mode", json={"mode": "validate", "reason": "collect parity"}, headers=AUTH)
        assert r.status_code == 202, r.json()
        t = await settle(c)
        ready = (await c.get("/ready")).json()
        metrics = (await c.get("/metrics")).text
    assert t["outcome"] == "succeeded" and t["reason"] == "collect parity" and t["failure"] is None
    assert read_desired_mode(tmp_path) == Mode.VALIDATE
    assert proc.proc.pid != old_pid and proc.starts == 2
    assert ready["ready"] and ready["mode"] == "validate"
    assert 'kdtree_transitions_total{from_mode="off",outcome="succeeded",to_mode="validate"} 1.0' in metrics
    assert audit_events(tmp_path) == [
        "accepted",
        "writing_mode",
        "restarting",
        "waiting_ready",
        "baking",
        "succeeded",
    ]


async def test_same_mode_is_a_no_op(engine, tmp_path):
    proc = engine()
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        r = await c.post("/mode", json={"mode": "off"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["changed"] is False and proc.starts == 1


async def test_gate_to_on_refuses_thin_evidence_and_dry_run_changes_nothing(engine, tmp_path):
    # One verify call per step (--layers 1): the probes' own compared calls keep the total below the threshold.
    proc = engine("--parity-calls", "50", "--layers", "1", "--parity-max-rel", "0.001", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        dry = await c.post("/mode", json={"mode": "on", "dry_run": True}, headers=AUTH)
        refused = await c.post("/mode", json={"mode": "on"}, headers=AUTH)
        metrics = (await c.get("/metrics")).text
    assert dry.status_code == 200 and dry.json()["allowed"] is False
    crit = {c["name"]: c for c in dry.json()["criteria"]}
    thin = crit["min_calls_compared"]
    assert thin["threshold"] == 100 and 50 <= thin["value"] < 100 and thin["passed"] is False
    assert crit["server_ready"]["passed"] and crit["ranks_in_validate"]["value"] == 2
    assert crit["max_rel_err"]["passed"] and crit["nan_inf"]["passed"] and crit["calls_over_tol"]["passed"]
    assert refused.status_code == 412 and "min_calls_compared" in refused.json()["error"]
    assert read_desired_mode(tmp_path) == Mode.VALIDATE and proc.starts == 1
    assert audit_events(tmp_path) == ["refused"]
    assert 'kdtree_gate_refusals_total{to_mode="on"} 1.0' in metrics


@pytest.mark.parametrize(
    ("args", "failing"),
    [
        (["--parity-max-rel", "0.5"], "max_rel_err"),
        (["--parity-nan-inf", "1"], "nan_inf"),
        (["--parity-over-tol", "3"], "calls_over_tol"),
        (["--not-installed"], "ranks_in_validate"),
    ],
)
async def test_gate_to_on_names_each_failed_criterion(engine, tmp_path, args, failing):
    proc = engine("--parity-calls", "500", *args, mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        r = await c.post("/mode", json={"mode": "on", "dry_run": True}, headers=AUTH)
    failed = {c["name"] for c in r.json()["criteria"] if not c["passed"]}
    assert failing in failed and r.json()["allowed"] is False


async def test_gate_to_on_passes_and_flips(engine, tmp_path):
    proc = engine("--parity-calls", "500", "--parity-max-rel", "0.004", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        r = await c.post("/mode", json={"mode": "on", "reason": "parity clean"}, headers=AUTH)
        assert r.status_code == 202 and r.json()["gate_passed"] is True
        t = await settle(c)
        st = (await c.get("/status")).json()
    assert t["outcome"] == "succeeded" and st["mode"]["current"] == "on"
    assert {r["record"]["mode"] for r in st["ranks"]} == {"on"}
    assert all(r["record"]["installed"] for r in st["ranks"])


async def test_force_skips_the_gate_loudly(engine, tmp_path):
    proc = engine("--parity-calls", "0", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        r = await c.post("/mode", json={"mode": "on", "force": True, "reason": "incident 42"}, headers=AUTH)
        assert r.status_code == 202 and r.json()["gate_passed"] is False
        assert "FORCED" in r.json()["warning"]
        t = await settle(c)
    assert t["force"] is True and t["outcome"] == "succeeded"
    forced = [e for e in Store(tmp_path, 50).audit_tail(100) if e["event"] == "FORCED"]
    assert forced and forced[0]["reason"] == "incident 42" and "min_calls_compared" in forced[0]["failed"]


async def test_validate_needs_the_server_up_and_off_and_standby_never_do(engine, tmp_path):
    proc = engine("--fault", "crash-on-start", "--fault-in-mode", "on", mode=Mode.ON, wait=False)
    proc.proc.wait(10)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        assert (await c.get("/status")).json()["phase"] == "crashed"
        refused = await c.post("/mode", json={"mode": "validate"}, headers=AUTH)
        assert refused.status_code == 412
        assert refused.json()["criteria"][0]["name"] == "server_up"
        standby = await c.post("/mode", json={"mode": "standby", "dry_run": True}, headers=AUTH)
        assert standby.json()["allowed"] is True and standby.json()["criteria"] == []  # the live remedy
        kill = await c.post("/mode", json={"mode": "off", "reason": "kill switch"}, headers=AUTH)
        assert kill.status_code == 202 and kill.json()["criteria"] == []
        t = await settle(c)
        ready = await c.get("/ready")
    assert t["outcome"] == "succeeded" and ready.status_code == 200 and ready.json()["mode"] == "off"


async def test_without_a_server_container_nothing_is_flipped(engine, tmp_path):
    proc = engine()
    settings = make_settings(tmp_path, proc.port, server_control="docker")  # and no KDTREE_SERVER_CONTAINER
    async with sidecar(settings, server=None) as c:
        r = await c.post("/mode", json={"mode": "validate"}, headers=AUTH)
        again = await c.post("/mode", json={"mode": "validate"}, headers=AUTH)
    assert r.status_code == 503 and "KDTREE_SERVER_CONTAINER" in r.json()["error"]
    assert again.status_code == 503  # the refusal released the claim: no stale 409
    assert read_desired_mode(tmp_path) is None


async def test_concurrent_requests_make_exactly_one_transition(engine, tmp_path):
    proc = engine()
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        # Every request could pass the gate (server up; "on" would fail its own gate and release the claim,
        # so which request wins the race must not matter): the race below is about the claim alone.
        await wait_ready(c)
        requests = [c.post("/mode", json={"mode": "validate"}, headers=AUTH) for _ in range(12)]
        responses = await asyncio.gather(*requests)
        codes = sorted(r.status_code for r in responses)
        busy = [r.json() for r in responses if r.status_code == 409]
        assert codes.count(202) == 1 and codes.count(409) == 11, [r.json() for r in responses]
        t = await settle(c)
        st = (await c.get("/status")).json()
    assert all("already running" in b["error"] for b in busy)
    assert len(st["transitions"]) == 1 and t["outcome"] == "succeeded"
    assert proc.starts == 2


# ---- rollback at each failure point ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "args", "overrides", "failure"),
    [
        ("restart fails", [], {}, "restart failed: stand-in: injected restart failure"),
        (
            "crash on start",
            ["--fault", "crash-on-start", "--fault-in-mode", "validate", "--load-seconds", "0.2"],
            {},
            "crashed while starting in mode validate: container exited, exit code 1",
        ),
        (
            "readiness timeout",
            ["--fault", "hang", "--fault-in-mode", "validate"],
            {"ready_timeout_s": 2.0, "probe_deadline_s": 0.5},
            "not ready in mode validate within",
        ),
        (
            "ranks keep the old mode",
            ["--report-mode", "off"],
            {"ready_timeout_s": 2.0},
            "rank 0: reports mode off, expected validate",
        ),
        (
            "bake probe fails",  # from the bake's second probe on (below): the server got ready first
            [],
            {"bake_interval_s": 1.0},
            "/3: probe failed (http_status)",
        ),
        (
            "rank error during bake",
            ["--fault", "rank-error", "--fault-in-mode", "validate"],
            {},
            "reported an error: stand-in: injected rank error",
        ),
    ],
)
async def test_each_failure_rolls_back(engine, tmp_path, case, args, overrides, failure):
    proc = engine(*args)
    if case == "restart fails":
        proc.restart_failures = 1
        if process_controlled(proc):  # the orchestrator did not start the stopped server in time
            failure = "restart failed: the server was stopped but did not start again within"
    async with sidecar(make_settings(tmp_path, proc.port, **overrides), server=proc) as c:
        r = await c.post("/mode", json={"mode": "validate"}, headers=AUTH)
        assert r.status_code == 202
        if case == "bake probe fails":
            await fail_completions_once_baking(c, proc.port)
        t = await settle(c)
        st = (await c.get("/status")).json()
        ready = await c.get("/ready")
        metrics = (await c.get("/metrics")).text
    assert t["outcome"] == "rolled_back", t
    assert failure in t["failure"], t["failure"]
    assert case != "bake probe fails" or t["failure"].startswith("bake probe "), t["failure"]
    assert st["mode"]["current"] == "off" and read_desired_mode(tmp_path) == Mode.OFF
    assert ready.status_code == 200 and ready.json()["mode"] == "off"
    events = audit_events(tmp_path)
    assert "flip_failed" in events and "rolling_back" in events and events[-1] == "rolled_back"
    assert 'kdtree_transitions_total{from_mode="off",outcome="rolled_back",to_mode="validate"} 1.0' in metrics


async def fail_completions_once_baking(c, port: int) -> None:
    """The restarted server answers 500 to completions once the flip has reached its bake."""
    await reach_step(c, "baking")
    httpx.post(f"http://127.0.0.1:{port}/_standin/fault", json={"fault": "http-500"}).raise_for_status()


async def test_a_failed_rollback_is_reported(engine, tmp_path):
    proc = engine()
    proc.restart_failures = 2
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        assert (await c.post("/mode", json={"mode": "validate"}, headers=AUTH)).status_code == 202
        t = await settle(c)
        await wait_ready(c)  # process control: the orchestrator starts the server again, late
        assert (
            await c.post("/mode", json={"mode": "validate"}, headers=AUTH)
        ).status_code == 202  # not stuck
        await settle(c)
    assert t["outcome"] == "rollback_failed"
    assert "restart failed" in t["failure"] and "restart failed" in t["rollback_failure"]


# ---- persistence -----------------------------------------------------------------------------------------


async def test_mode_and_history_survive_a_sidecar_restart(engine, tmp_path):
    proc = engine()
    settings = make_settings(tmp_path, proc.port)
    async with sidecar(settings, server=proc) as c:
        await c.post("/mode", json={"mode": "validate"}, headers=AUTH)
        first = await settle(c)
    async with sidecar(settings, server=proc) as c:
        st = (await c.get("/status")).json()
        ready = await c.get("/ready")
    assert st["mode"]["current"] == "validate" and ready.json()["mode"] == "validate"
    assert [t["id"] for t in st["transitions"]] == [first["id"]]
    assert json.loads((tmp_path / STATE_FILE).read_text())["current_mode"] == "validate"


async def test_interrupted_transition_is_rolled_back_on_start(engine, tmp_path):
    # The new mode never gets ready, and the sidecar stops while it waits.
    proc = engine("--fault", "hang", "--fault-in-mode", "validate")
    settings = make_settings(tmp_path, proc.port, ready_timeout_s=60, probe_deadline_s=0.5)
    async with sidecar(settings, server=proc) as c:
        assert (await c.post("/mode", json={"mode": "validate"}, headers=AUTH)).status_code == 202
        await reach_step(c, "waiting_ready")
    saved = SidecarState.model_validate_json((tmp_path / STATE_FILE).read_text())
    assert saved.active is not None and saved.active.step == "waiting_ready"
    assert read_desired_mode(tmp_path) == Mode.VALIDATE

    async with sidecar(settings, server=proc) as c:
        st = (await c.get("/status")).json()
        assert st["phase"] == "rolling_back" and st["active_transition"]["interrupted"] is True
        t = await settle(c)
        ready = await c.get("/ready")
    assert t["outcome"] == "rolled_back" and t["interrupted"] is True
    assert "stopped at step waiting_ready" in t["failure"]
    assert read_desired_mode(tmp_path) == Mode.OFF and ready.status_code == 200
    assert "interrupted_transition_found" in audit_events(tmp_path)


async def test_transition_interrupted_before_the_restart_is_aborted_without_one(engine, tmp_path):
    proc = engine()
    store = Store(tmp_path, 50)
    t = Transition(from_mode=Mode.OFF, to_mode=Mode.VALIDATE, step="writing_mode")
    store.save(SidecarState(current_mode=Mode.OFF, active=t))
    write_desired_mode(tmp_path, Mode.VALIDATE)  # it got as far as writing the mode file
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        st = (await c.get("/status")).json()
    assert st["active_transition"] is None
    assert st["transitions"][-1]["outcome"] == "aborted" and st["transitions"][-1]["interrupted"] is True
    assert read_desired_mode(tmp_path) == Mode.OFF and proc.starts == 1


class GoneServer:
    """A server container that does not exist (yet): what Docker reports while a stack comes back up."""

    name = "kdtree-server"

    def inspect(self):
        raise ServerMissing("no container named 'kdtree-server' (check KDTREE_SERVER_CONTAINER)")

    def logs(self, tail, since=None):
        self.inspect()

    def restart(self, stop_timeout_s):
        raise AssertionError("nothing to restart")


async def test_interrupted_transition_without_a_server_container_restores_the_mode_file(tmp_path):
    store = Store(tmp_path, 50)
    store.save(
        SidecarState(
            current_mode=Mode.VALIDATE,
            active=Transition(from_mode=Mode.VALIDATE, to_mode=Mode.ON, step="baking"),
        )
    )
    write_desired_mode(tmp_path, Mode.ON)
    async with sidecar(make_settings(tmp_path, free_port()), server=GoneServer()) as c:
        st = (await c.get("/status")).json()
    t = st["transitions"][-1]
    assert st["active_transition"] is None and t["outcome"] == "aborted" and t["interrupted"]
    assert "container is gone" in t["failure"] and read_desired_mode(tmp_path) == Mode.VALIDATE
    assert st["container"]["missing"] is True and st["mode"]["current"] == "validate"


def test_server_logs_stay_readable_while_it_restarts(engine):
    """The sidecar reads the server's logs from a worker thread while a transition restarts it (CI once
    caught the stand-in between naming its next log file and creating it). Docker's logs of a restarting
    container never fail for a missing file, so neither may the stand-in's."""
    proc = engine(wait=False)
    if process_controlled(proc):
        proc.wait_port()  # its log and state file exist from its first start on; before it, nothing does
    errors: list[Exception] = []
    done = threading.Event()

    def read():
        while not done.is_set():
            try:
                proc.logs(20)
            except Exception as e:  # noqa: BLE001 - any failure is the finding
                errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(5 if process_controlled(proc) else 20):
            proc.restart(5)
    finally:
        done.set()
        reader.join()
    assert errors == []


# ---- live switches (validate, on, standby: no restart) --------------------------------------------------


def metric(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[-1])


async def test_live_flips_switch_the_ranks_without_a_restart(engine, tmp_path):
    """validate -> on -> standby -> validate: every rank follows the mode file and confirms; the server process
    is never restarted; each transition records its method and duration, and the bake saw kdtree's work."""
    proc = engine("--parity-calls", "500", "--parity-max-rel", "0.004", mode=Mode.VALIDATE)
    pid = proc.proc.pid
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        await wait_ready(c)
        outcomes = []
        for mode in ("on", "standby", "validate"):
            r = await c.post("/mode", json={"mode": mode, "reason": "live"}, headers=AUTH)
            assert r.status_code == 202 and r.json()["method"] == "live", r.json()
            outcomes.append(await settle(c))
            st = (await c.get("/status")).json()
            assert {v["record"]["mode"] for v in st["ranks"]} == {mode}
        metrics = (await c.get("/metrics")).text
    assert proc.proc.pid == pid and proc.starts == 1  # no restart
    for t in outcomes:
        assert t["outcome"] == "succeeded" and t["method"] == "live", t
        assert 0 < t["confirmed_s"] <= t["duration_s"] and t["confirmed_s"] < 10
    assert read_desired_mode(tmp_path) == Mode.VALIDATE
    assert metric(metrics, 'kdtree_flip_duration_seconds_count{method="live"}') == 3
    assert metric(metrics, 'kdtree_flip_duration_seconds_count{method="restart"}') == 0
    assert "awaiting_ranks" in audit_events(tmp_path) and "restarting" not in audit_events(tmp_path)


async def test_restart_true_takes_the_restart_path_between_live_modes(engine, tmp_path):
    proc = engine(mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        await wait_ready(c)
        r = await c.post("/mode", json={"mode": "standby", "restart": True}, headers=AUTH)
        assert r.status_code == 202 and r.json()["method"] == "restart"
        t = await settle(c)
    assert t["outcome"] == "succeeded" and t["method"] == "restart" and proc.starts == 2


async def test_a_live_flip_works_without_server_control(engine, tmp_path):
    """Only a restart needs the server container: a live switch goes through the mode file and the records."""
    proc = engine(mode=Mode.VALIDATE)
    settings = make_settings(tmp_path, proc.port, server_control="docker")  # and no container named: none
    async with sidecar(settings, server=None) as c:
        await wait_ready(c)
        live = await c.post("/mode", json={"mode": "standby"}, headers=AUTH)
        assert live.status_code == 202
        assert (await settle(c))["outcome"] == "succeeded"
        restart = await c.post("/mode", json={"mode": "off"}, headers=AUTH)
    assert restart.status_code == 503 and "needs a server restart" in restart.json()["error"]


@pytest.mark.parametrize("when", ["at start", "at run time"])
async def test_a_rank_that_never_confirms_is_rolled_back_live(engine, tmp_path, when):
    proc = engine(*(["--fault", "stuck-rank"] if when == "at start" else []), mode=Mode.VALIDATE)
    settings = make_settings(tmp_path, proc.port, live_flip_timeout_s=1.5)
    async with sidecar(settings, server=proc) as c:
        await wait_ready(c)
        if when == "at run time":  # the stand-in's test hook, as the demo's users switch faults
            fault = httpx.post(f"http://127.0.0.1:{proc.port}/_standin/fault", json={"fault": "stuck-rank"})
            assert fault.json() == {"fault": "stuck-rank"}
        r = await c.post("/mode", json={"mode": "standby"}, headers=AUTH)
        assert r.status_code == 202
        t = await settle(c)
        ready = await c.get("/ready")
    assert t["outcome"] == "rolled_back" and t["method"] == "live"
    assert "1/2 ranks confirmed mode standby within KDTREE_LIVE_FLIP_TIMEOUT_S=1.5s" in t["failure"]
    assert "rank 1: still reports validate" in t["failure"]
    assert t["rollback_note"] is None and proc.starts == 1  # the live rollback sufficed: no restart
    assert read_desired_mode(tmp_path) == Mode.VALIDATE and ready.status_code == 200


@pytest.mark.parametrize(
    ("fault", "to", "failure"),
    [
        (
            "no-verify-count",
            "on",
            "rank 0: kdtree served no verify call during the bake (served_kdtree 0 -> 0)",
        ),
        ("fallback", "on", "rank 1: fallbacks grew during the bake: kv_dtype +"),
    ],
)
async def test_a_bake_without_evidence_that_kdtree_served_rolls_back(engine, tmp_path, fault, to, failure):
    """The ranks switch and the probes pass, but kdtree's counters show it did not serve: rolled back, named."""
    proc = engine("--fault", fault, "--fault-in-mode", to, "--parity-calls", "500", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        await wait_ready(c)
        assert (await c.post("/mode", json={"mode": to}, headers=AUTH)).status_code == 202
        t = await settle(c)
    assert t["outcome"] == "rolled_back" and t["method"] == "live", t
    assert "bake: no evidence that kdtree served" in t["failure"] and failure in t["failure"], t["failure"]
    assert read_desired_mode(tmp_path) == Mode.VALIDATE and proc.starts == 1


async def test_a_bake_without_speculative_decoding_asks_whether_it_is_on(engine, tmp_path):
    """SGLang 0.5.23 without speculative decoding runs no verify step and leaves `sglext` out of its completions
    (the stand-in does as it does): the probe's verify steps are None, and the failed bake names the cause."""
    proc = engine("--no-speculation", "--parity-calls", "500", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        await wait_ready(c)
        assert (await c.get("/status")).json()["probe"]["verify_steps"] is None
        assert (await c.post("/mode", json={"mode": "on"}, headers=AUTH)).status_code == 202
        t = await settle(c)
    assert t["outcome"] == "rolled_back" and "kdtree served no verify call during the bake" in t["failure"]
    assert t["failure"].endswith("the probe's completions took no verify step: is speculative decoding on?")


async def test_a_restart_flip_to_validate_needs_compared_calls(engine, tmp_path):
    proc = engine("--fault", "no-verify-count", "--fault-in-mode", "validate")
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        await wait_ready(c)
        assert (await c.post("/mode", json={"mode": "validate"}, headers=AUTH)).status_code == 202
        t = await settle(c)
    assert t["outcome"] == "rolled_back" and t["method"] == "restart"
    assert "rank 0: no verify call was compared during the bake (calls_compared 0 -> 0)" in t["failure"]


async def test_a_failed_live_rollback_falls_back_to_a_restart(engine, tmp_path, monkeypatch):
    from sidecar.transition import StepFailed, TransitionRunner

    proc = engine(
        "--fault", "no-verify-count", "--fault-in-mode", "on", "--parity-calls", "500", mode=Mode.VALIDATE
    )
    real = TransitionRunner._await_ranks

    async def confirm_forward_only(self, t, mode):
        if t.step == "rolling_back":
            raise StepFailed("0/2 ranks confirmed mode validate (injected)")
        await real(self, t, mode)

    monkeypatch.setattr(TransitionRunner, "_await_ranks", confirm_forward_only)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        await wait_ready(c)
        assert (await c.post("/mode", json={"mode": "on"}, headers=AUTH)).status_code == 202
        t = await settle(c)
    assert t["outcome"] == "rolled_back" and proc.starts == 2
    assert "the live rollback failed (0/2 ranks confirmed mode validate (injected))" in t["rollback_note"]
    assert "live_rollback_failed" in audit_events(tmp_path)


async def test_ready_stays_200_while_the_ranks_switch(engine, tmp_path):
    """A live switch keeps serving: while it runs, a rank in either mode is as expected."""
    proc = engine("--fault", "stuck-rank", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port, live_flip_timeout_s=2.0), server=proc) as c:
        await wait_ready(c)
        assert (await c.post("/mode", json={"mode": "standby"}, headers=AUTH)).status_code == 202
        seen = []

        async def finished():
            st = (await c.get("/status")).json()
            if st["active_transition"] is not None and st["active_transition"]["step"] == "awaiting_ranks":
                seen.append(((await c.get("/ready")).status_code, st["phase"]))
            return st["active_transition"] is None, st["active_transition"]

        await until(finished, 30, "the live flip to end")
    assert seen and all(code == 200 and phase == "switching" for code, phase in seen), seen


# ---- POST /mode input handling ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "body", "code"),
    [
        ({}, b"hello", 401),  # authentication before the body is parsed
        ({"Authorization": "Bearer wrong"}, b"hello", 403),
        (AUTH, b"hello", 422),
        (AUTH, json.dumps({"mode": "on", "force": "yes"}).encode(), 422),  # a string is not a boolean
        (AUTH, json.dumps({"mode": "on", "dry_run": "yes"}).encode(), 422),
        (AUTH, json.dumps({"mode": "on", "restart": 1}).encode(), 422),
        (AUTH, json.dumps({"mode": "on", "dry_run": True, "<script>": "red"}).encode(), 422),  # unknown field
        (AUTH, json.dumps({"mode": "on", "dry_run": True, "reason": "x" * 501}).encode(), 422),
        ({}, b"x" * 10_000_000, 401),  # no token: refused before the body is read
        (AUTH, json.dumps({"mode": "on", "dry_run": True, "reason": "x" * 5000}).encode(), 413),
        (AUTH, json.dumps({"mode": "on", "reason": "drill\n2026 forged line"}).encode(), 422),
        (
            {**AUTH, "Content-Type": "application/x-www-form-urlencoded"},
            b'{"mode": "on"}',
            415,
        ),  # curl -d's default
    ],
    ids=[
        "no-token",
        "bad-token",
        "not-json",
        "force-str",
        "dry-run-str",
        "restart-int",
        "extra",
        "long-reason",
        "huge-unauthenticated",
        "too-large",
        "reason-line-break",
        "not-json-content-type",
    ],  # fmt: skip
)
async def test_post_mode_authenticates_first_then_bounds_then_validates(
    engine, tmp_path, headers, body, code
):
    proc = engine(mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        r = await c.post("/mode", content=body, headers={"Content-Type": "application/json", **headers})
    assert r.status_code == code, r.text
    assert audit_events(tmp_path) == [] and read_desired_mode(tmp_path) == Mode.VALIDATE
    if code == 422:
        assert "yes" not in r.text and "hello" not in r.text  # the error names the field, not the input
        assert "script" not in r.text  # nor an unknown field's name: the fields it takes instead
        assert b"<script>" not in body or "the fields are: mode, dry_run, force, restart, reason" in r.text


async def test_a_mode_file_written_while_no_sidecar_ran_is_adopted(engine, tmp_path):
    """The kill switch by hand (docs/operations.md): `echo off > state/mode` and a server restart while the sidecar is down;
    the next sidecar takes the file's mode as the current one instead of expecting the old mode."""
    proc = engine(mode=Mode.VALIDATE)
    settings = make_settings(tmp_path, proc.port)
    async with sidecar(settings, server=proc) as c:
        await wait_ready(c)
        assert (await c.post("/mode", json={"mode": "standby"}, headers=AUTH)).status_code == 202
        assert (await settle(c))["outcome"] == "succeeded"
    write_desired_mode(tmp_path, Mode.OFF)
    proc.restart(2)
    async with sidecar(settings, server=proc) as c:
        body = await wait_ready(c)
        st = (await c.get("/status")).json()
    assert body["mode"] == "off" and st["mode"]["current"] == "off"
    assert "mode_file_adopted" in audit_events(tmp_path)


async def test_an_error_a_rank_had_before_a_live_flip_does_not_fail_its_bake(engine, tmp_path):
    """Live, the ranks keep their processes and a last_error they reported earlier: only a new one counts."""
    proc = engine("--fault", "rank-error", "--parity-calls", "500", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        # The stand-in's ranks report the injected error throughout: /ready shows it, the bake must not.
        assert (await c.post("/mode", json={"mode": "standby"}, headers=AUTH)).status_code == 202
        t = await settle(c)
    assert t["outcome"] == "succeeded" and t["method"] == "live", t
