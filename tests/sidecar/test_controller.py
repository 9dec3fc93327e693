"""sidecar/controller.py's decisions by themselves, without HTTP, a probe or a server: which method a transition
takes, the server's phase, the readiness condition, and an interrupted transition resolved at start. The server
control is a stand-in object with ServerControl's three methods; the ranks are records made here."""

from __future__ import annotations

import asyncio
import time

import pytest
from sidecar_harness import make_settings

from kdtree.config import Mode
from kdtree.state.mode_file import read_desired_mode, write_desired_mode
from kdtree.state.rank_records import RankView, new_record
from sidecar.api import ServerView
from sidecar.controller import Controller
from sidecar.metrics import Metrics
from sidecar.probe import HTTP_STATUS, REFUSED, TIMEOUT, ProbeResult
from sidecar.rank_evidence import RankCheck
from sidecar.server_control import ServerMissing, ServerState
from sidecar.store import SidecarState, Store, Transition
from sidecar.vocabulary import Condition, Method, Outcome, Phase, Step


class Server:
    """A stand-in ServerControl: a running server started at `started_at`, or none (ServerMissing)."""

    name = "stand-in server"

    def __init__(self, started_at: float | None = None, status: str = "running"):
        self.started_at, self.status = started_at, status
        self.restarts = 0

    def inspect(self) -> ServerState:
        if self.started_at is None:
            raise ServerMissing("no server has started (stand-in)")
        running = self.status == "running"
        return ServerState(name=self.name, status=self.status, running=running, started_at=self.started_at)

    def logs(self, tail: int, since: float | None = None) -> str:
        return ""

    def restart(self, stop_timeout_s: int) -> None:
        self.restarts += 1


def controller(tmp_path, server=None, **overrides) -> Controller:
    # Port 9 (discard): nothing listens, so a probe the monitor makes is refused at once.
    return Controller(make_settings(tmp_path, 9, **overrides), server, Metrics())


def view(rank: int, mode: str = "validate", live_modes=("on", "standby", "validate")) -> RankView:
    rec = new_record(mode, tp_rank=rank, tp_size=2)
    rec.live_modes = list(live_modes)
    return RankView(record=rec, path=f"rank-{rank}.json", stale=False, age_s=0.0)


def probe(ok: bool, reason: str | None = None, status_code: int | None = None) -> ProbeResult:
    return ProbeResult(ok=ok, reason=reason, status_code=status_code, latency_s=0.01, at=time.time())


def running(started_at: float, status: str = "running") -> ServerState:
    return ServerState(name="s", status=status, running=status == "running", started_at=started_at)


RANKS_OK = RankCheck(ok=True, problems=[], ranks=[])
RANKS_MISSING = RankCheck(ok=False, problems=["rank 1 has no record"], ranks=[])


# ---- the method -----------------------------------------------------------------------------------------------


def test_live_between_live_modes_when_every_rank_can_switch(tmp_path):
    c = controller(tmp_path)
    assert c.admission._method(Mode.VALIDATE, Mode.ON, False, [view(0), view(1)]) is Method.LIVE


@pytest.mark.parametrize(
    ("current", "target", "restart", "views", "why"),
    [
        (Mode.VALIDATE, Mode.ON, True, [view(0), view(1)], "asked for a restart"),
        (Mode.OFF, Mode.VALIDATE, False, [view(0), view(1)], "from off"),
        (Mode.VALIDATE, Mode.OFF, False, [view(0), view(1)], "to off"),
        (Mode.VALIDATE, Mode.ON, False, [view(0)], "a rank without a record"),
        (Mode.VALIDATE, Mode.ON, False, [view(0), view(1, live_modes=())], "a rank started in off"),
    ],
)
def test_restart_otherwise(tmp_path, current, target, restart, views, why):
    assert controller(tmp_path).admission._method(current, target, restart, views) is Method.RESTART, why


def test_restart_when_the_rank_check_is_off(tmp_path):
    c = controller(tmp_path, expected_tp_size=0)
    assert c.admission._method(Mode.VALIDATE, Mode.ON, False, [view(0), view(1)]) is Method.RESTART


# ---- the server's phase ---------------------------------------------------------------------------------------


def test_the_phase_from_the_container_and_the_probe(tmp_path):
    c = controller(tmp_path)
    t0 = time.time() - 10
    assert c.readiness._server_phase(probe(True), running(t0, "exited"), RANKS_OK, False) is Phase.CRASHED
    assert c.readiness._server_phase(None, running(t0, "created"), RANKS_OK, False) is Phase.STARTING
    assert c.readiness._server_phase(None, running(t0), RANKS_OK, False) is Phase.STARTING
    assert c.readiness._server_phase(probe(True), running(t0), RANKS_OK, False) is Phase.READY
    assert c.readiness._server_phase(probe(True), running(t0), RANKS_MISSING, False) is Phase.DEGRADED
    assert c.readiness._server_phase(probe(False, REFUSED), running(t0), RANKS_OK, False) is Phase.LOADING
    assert c.readiness._server_phase(probe(False, TIMEOUT), running(t0), RANKS_OK, False) is Phase.WARMING
    assert (
        c.readiness._server_phase(probe(False, HTTP_STATUS, 503), running(t0), RANKS_OK, False)
        is Phase.WARMING
    )
    assert (
        c.readiness._server_phase(probe(False, HTTP_STATUS, 500), running(t0), RANKS_OK, False)
        is Phase.DEGRADED
    )
    # Probes failing under load, tolerated: the phase stays what the server has shown.
    assert c.readiness._server_phase(probe(False, TIMEOUT), running(t0), RANKS_OK, True) is Phase.READY


def test_a_closed_port_after_serving_is_degraded_not_loading(tmp_path):
    c = controller(tmp_path)
    t0 = time.time() - 10
    c.readiness.prober.last_ok_at = time.time() - 1  # it served since its start
    assert c.readiness._server_phase(probe(False, REFUSED), running(t0), RANKS_OK, False) is Phase.DEGRADED


# ---- the condition ----------------------------------------------------------------------------------------------


def test_ready_and_state_problems(tmp_path):
    c = controller(tmp_path)
    up = ServerView(state=running(time.time()))
    assert c.readiness._condition(True, up, probe(True), []) == (Condition.READY, [])
    assert c.readiness._condition(False, up, probe(True), ["the volume refused a write"]) == (
        Condition.BROKEN,
        ["the volume refused a write"],
    )


def test_no_server_yet_is_not_ready_yet_until_the_start_grace_is_spent(tmp_path):
    c = controller(tmp_path, start_grace_s=60.0)
    missing = ServerView(error="no server has started", missing=True)
    condition, evidence = c.readiness._condition(False, missing, None, [])
    assert condition is Condition.NOT_READY_YET and "KDTREE_START_GRACE_S=60" in evidence[0]
    c.readiness._born -= 61
    condition, evidence = c.readiness._condition(False, missing, None, [])
    assert condition is Condition.BROKEN and "no server has started in the 61s" in evidence[0]


def test_a_crashed_server_is_broken_and_a_slow_one_only_past_its_budget(tmp_path):
    c = controller(tmp_path, ready_timeout_s=100.0)
    crashed = ServerView(state=running(time.time() - 5, "exited"))
    assert c.readiness._condition(False, crashed, None, [])[0] is Condition.BROKEN
    slow = ServerView(state=running(time.time() - 50))
    assert c.readiness._condition(False, slow, probe(False, REFUSED), [])[0] is Condition.NOT_READY_YET
    stuck = ServerView(state=running(time.time() - 150))
    condition, evidence = c.readiness._condition(False, stuck, probe(False, REFUSED), [])
    assert condition is Condition.BROKEN and "never ready (KDTREE_READY_TIMEOUT_S=100)" in evidence[0]


def test_a_server_that_served_since_its_start_and_fails_now_is_broken(tmp_path):
    c = controller(tmp_path)
    started = time.time() - 30
    c.readiness.prober.last_ok_at = started + 10
    condition, evidence = c.readiness._condition(
        False, ServerView(state=running(started)), probe(False, TIMEOUT), []
    )
    assert condition is Condition.BROKEN and "and fails now" in evidence[0]


def test_a_running_transition_is_not_ready_yet_naming_its_step(tmp_path):
    c = controller(tmp_path)
    c.state.active = Transition(
        from_mode=Mode.VALIDATE, to_mode=Mode.ON, method=Method.LIVE, step=Step.BAKING
    )
    condition, evidence = c.readiness._condition(False, ServerView(state=running(time.time())), None, [])
    assert condition is Condition.NOT_READY_YET
    assert evidence == ["a live transition validate -> on is at step baking"]


# ---- an interrupted transition, resolved at start ----------------------------------------------------------------


def interrupted(tmp_path, step: Step, method: Method = Method.RESTART) -> None:
    """A state file as a sidecar leaves it when it stops during `step` of validate -> on."""
    t = Transition(from_mode=Mode.VALIDATE, to_mode=Mode.ON, method=method, step=step)
    Store(tmp_path, history_limit=5).save(SidecarState(current_mode=Mode.VALIDATE, active=t))
    write_desired_mode(tmp_path, Mode.ON if step is not Step.ACCEPTED else Mode.VALIDATE)


async def started(c: Controller) -> None:
    await c.start()
    if c._task is not None:
        await asyncio.wait_for(c._task, 10)


@pytest.mark.anyio
@pytest.mark.parametrize("step", [Step.ACCEPTED, Step.WRITING_MODE])
async def test_stopped_before_the_restart_the_mode_file_goes_back_and_the_transition_is_aborted(
    tmp_path, step
):
    interrupted(tmp_path, step)
    server = Server(started_at=time.time() - 60)
    c = controller(tmp_path, server)
    try:
        await started(c)
        assert c.state.active is None
        (t,) = c.state.history
        assert t.outcome is Outcome.ABORTED and t.interrupted and f"at step {step}" in t.failure
        assert read_desired_mode(tmp_path) is Mode.VALIDATE and server.restarts == 0
    finally:
        await c.stop()


@pytest.mark.anyio
async def test_stopped_mid_restart_with_no_server_left_the_next_start_takes_the_restored_mode(tmp_path):
    interrupted(tmp_path, Step.RESTARTING)
    c = controller(tmp_path, Server(started_at=None))
    try:
        await started(c)
        (t,) = c.state.history
        assert t.outcome is Outcome.ABORTED and "the server container is gone" in t.failure
        assert read_desired_mode(tmp_path) is Mode.VALIDATE
        assert Store(tmp_path, 5).load(Mode.OFF).history[-1].outcome is t.outcome  # saved, not only in memory
    finally:
        await c.stop()
