"""The sidecar never wedges: a state volume that fills up, turns unwritable or hangs, rank records that are no
records (a FIFO, 64 MiB, an unknown schema) or carry non-finite parity, a server that never starts or answers
garbage, a sidecar stopped at any step of a transition, and the kill switch preempting a wedged transition.

The server is standins/standin_engine.py, a stand-in for SGLang 0.5.23 (NOT SGLang: it keeps SGLang's startup and
HTTP contract, and its ranks write their records through kdtree's own code) run as a local process, restarted
through StandinProcess. Write failures are injected at the filesystem boundary (the tests run as root in CI,
where a read-only mode stops nothing): VolumeFaults below makes the sidecar's writes raise OSError, while the
stand-in's ranks, other processes, go on writing their records. Each test ends with the kill switch accepted.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from sidecar_harness import AUTH, audit_events, make_settings, reach_step, settle, sidecar, until, wait_ready
from standin_engine import free_port

from kdtree.config import Mode
from kdtree.state import mode_file as control_module
from kdtree.state.mode_file import read_desired_mode, write_desired_mode
from kdtree.state.owed_modes import OWED_FILE, read_owed_modes
from kdtree.state.pids import own_pid_ns
from kdtree.state.rank_records import RECORD_MAX, new_record, read_records, record_path
from sidecar import readiness as readiness_module
from sidecar import store as store_module
from sidecar.server_control.process import ServerProcess
from sidecar.store import STATE_FILE, SidecarState, Store, Transition
from sidecar.transition import TransitionRunner

pytestmark = pytest.mark.anyio
UID = os.getuid()


@pytest.fixture
def standin(engine):
    """Stand-in engines reporting two ranks with a fast heartbeat (the plain `engine`: StandinProcess control)."""
    return lambda *args, **kw: engine("--tp-size", "2", "--heartbeat-s", "0.2", *args, **kw)


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.INFO, logger="kdtree.sidecar")
    return caplog


class VolumeFaults:
    """The sidecar's writes fail with OSError(code), from the first one that `trigger(path, text)` matches on,
    until heal() (once: that write only): the state file and the mode file (write_atomically, as sidecar.store
    and kdtree.state.mode_file call it) and the audit append (sidecar.store.append_line)."""

    def __init__(self, monkeypatch):
        self.code: int | None = None
        self.failing = self.once = False
        self.trigger = None
        self.failed: list[str] = []  # the file names whose writes failed
        real_write, real_append = store_module.write_atomically, store_module.append_line

        def write(path, text):
            self._check(Path(path), text)
            return real_write(path, text)

        def append(path, line):
            self._check(Path(path), line)
            real_append(path, line)

        monkeypatch.setattr(store_module, "write_atomically", write)
        monkeypatch.setattr(control_module, "write_atomically", write)
        monkeypatch.setattr(store_module, "append_line", append)

    def fail(self, code: int, trigger=lambda path, text: True, once: bool = False) -> None:
        self.code, self.trigger, self.once, self.failing = code, trigger, once, False

    def heal(self) -> None:
        self.code, self.failing = None, False

    def _check(self, path: Path, text: str) -> None:
        if self.code is None:
            return
        if not self.failing and self.trigger(path, text):
            self.failing = True
        if self.failing:
            self.failed.append(path.name)
            code = self.code
            if self.once:
                self.heal()
            raise OSError(code, os.strerror(code))


@pytest.fixture
def faults(monkeypatch):
    return VolumeFaults(monkeypatch)


def at_step(step: str):
    """A trigger: the state file written with the transition at `step`."""
    return lambda path, text: path.name == STATE_FILE and f'"step": "{step}"' in text


def logged(caplog, event: str) -> bool:
    return any(
        r.getMessage().startswith("audit ") and f'"event": "{event}"' in r.getMessage()
        for r in caplog.records
    )


async def kill_switch_works(c: httpx.AsyncClient, state_dir, proc) -> None:
    """POST /mode off is accepted and reaches off: the mode file, every rank, /ready 200, the audit log."""
    r = await c.post("/mode", json={"mode": "off", "reason": "kill switch"}, headers=AUTH)
    assert r.status_code in (200, 202), r.json()
    if r.status_code == 202:
        t = await settle(c)
        assert t["outcome"] == "succeeded", t
        assert audit_events(state_dir)[-1] == "succeeded"
    else:
        assert r.json()["changed"] is False
    body = await wait_ready(c)
    st = (await c.get("/status")).json()
    assert body["mode"] == "off" and st["mode"]["current"] == "off"
    assert read_desired_mode(state_dir) == Mode.OFF or (
        r.status_code == 200 and st["mode"]["desired_file"] is None
    )


async def broken_naming(c: httpx.AsyncClient, *texts: str) -> dict:
    """/ready is 503 broken, its evidence holding each of texts; /status says the same."""
    ready = await c.get("/ready")
    body = ready.json()
    evidence = " | ".join(body["condition_evidence"])
    assert ready.status_code == 503 and body["condition"] == "broken", body
    for text in texts:
        assert text in evidence, (text, evidence)
    st = (await c.get("/status")).json()
    assert st["condition"] == "broken" and st["active_transition"] is None
    return st


# ---- writes that fail: the flip ends in a defined state, the sidecar says why, the kill switch works -------


async def test_a_volume_that_fills_during_the_bake(standin, tmp_path, faults, logs):
    proc = standin("--parity-calls", "500", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        await wait_ready(c)
        faults.fail(errno.ENOSPC, at_step("baking"))
        assert (await c.post("/mode", json={"mode": "on"}, headers=AUTH)).status_code == 202
        t = await settle(c)
        full = "state volume full: free space or enlarge it"
        assert t["outcome"] == "rollback_failed", t
        assert t["failure"].startswith(
            f"{full} (saving the sidecar state {tmp_path / STATE_FILE} failed: ENOSPC"
        )
        assert t["rollback_failure"].startswith("the mode file could not be written back to validate (")
        assert t["rollback_failure"].endswith("it still says on, so the ranks may serve on")
        # Persisted where possible: the volume kept the last step it took; the rest is in the process log.
        saved = SidecarState.model_validate_json((tmp_path / STATE_FILE).read_text())
        assert saved.active.step == "awaiting_ranks" and audit_events(tmp_path)[-1] == "awaiting_ranks"
        assert logged(logs, "flip_failed") and logged(logs, "rollback_failed")
        errors = [
            r.getMessage() for r in logs.records if r.levelno == logging.ERROR and "ENOSPC" in r.getMessage()
        ]
        assert any(str(tmp_path / "mode") in m for m in errors) and any(STATE_FILE in m for m in errors)
        # The ranks serve on, which no bake approved: /ready says so, with both modes and the fixes.
        st = await broken_naming(c, full, "the mode file says on and the sidecar expects validate")
        assert st["mode"]["current"] == "validate" and read_desired_mode(tmp_path) == Mode.ON
        assert {v["record"]["mode"] for v in st["ranks"]} == {"on"}
        assert st["state_volume"]["problem"]["errno"] == "ENOSPC" and st["transitions"][-1]["id"] == t["id"]
        # Still full: the kill switch is accepted (nothing runs: no 409) and ends defined: failed, and never rolled
        # back (off is a one-way door), so the mode stays off and the next POST /mode off writes the file again.
        r = await c.post("/mode", json={"mode": "off"}, headers=AUTH)
        assert r.status_code == 202
        again = await settle(c)
        assert again["outcome"] == "failed" and again["failure"].startswith(full)
        assert (await c.get("/status")).json()["mode"]["current"] == "off"
        faults.heal()
        await kill_switch_works(c, tmp_path, proc)


async def test_a_volume_made_unwritable_while_the_ranks_switch(standin, tmp_path, faults):
    proc = standin(mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        await wait_ready(c)
        # The first save of the ranks' progress: the mode file says standby, the ranks are switching.
        faults.fail(
            errno.EACCES,
            lambda path, text: '"step": "awaiting_ranks"' in text and '"ranks_confirmed": 0' not in text,
        )
        assert (await c.post("/mode", json={"mode": "standby"}, headers=AUTH)).status_code == 202
        t = await settle(c)
        denied = f"state volume not writable by uid {UID}: fix its ownership/permissions"
        assert t["outcome"] == "rollback_failed" and t["failure"].startswith(denied), t
        assert "EACCES" in t["failure"] and "it still says standby" in t["rollback_failure"]
        await broken_naming(c, denied, "the mode file says standby and the sidecar expects validate")
        assert read_desired_mode(tmp_path) == Mode.STANDBY
        faults.heal()
        await kill_switch_works(c, tmp_path, proc)


async def test_a_volume_that_fills_during_the_rollback(standin, tmp_path, faults):
    proc = standin("--fault", "stuck-rank", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port, live_flip_timeout_s=1.0), server=proc) as c:
        await wait_ready(c)
        faults.fail(errno.ENOSPC, at_step("rolling_back"))
        assert (await c.post("/mode", json={"mode": "standby"}, headers=AUTH)).status_code == 202
        t = await settle(c)
        assert t["outcome"] == "rollback_failed" and "1/2 ranks confirmed mode standby" in t["failure"], t
        assert "ENOSPC" in t["rollback_failure"] and "it still says standby" in t["rollback_failure"]
        st = await broken_naming(c, "state volume full", "the mode file says standby")
        assert {v["record"]["tp_rank"]: v["record"]["mode"] for v in st["ranks"]} == {
            0: "standby",
            1: "validate",
        }
        faults.heal()
        await kill_switch_works(c, tmp_path, proc)


async def test_an_audit_entry_the_volume_refuses_ends_the_flip_and_is_kept_in_the_process_log(
    standin, tmp_path, faults, logs
):
    proc = standin()
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        await wait_ready(c)
        audit = tmp_path / "sidecar-audit.jsonl"
        faults.fail(
            errno.EIO, lambda path, text: path == audit and '"event": "writing_mode"' in text, once=True
        )
        assert (await c.post("/mode", json={"mode": "validate"}, headers=AUTH)).status_code == 202
        t = await settle(c)
        assert t["outcome"] == "rolled_back", t
        assert t["failure"].startswith(f"state volume I/O error: check the disk or the storage behind the volume "
                                       f"(appending to the audit log {audit} failed: EIO")  # fmt: skip
        assert t["rollback_note"] == "the server was not restarted: the mode file is back at off"
        events = audit_events(tmp_path)
        assert "writing_mode" not in events and events[-3:] == ["flip_failed", "rolling_back", "rolled_back"]
        assert logged(logs, "writing_mode")  # the entry the volume refused
        ready = await c.get("/ready")  # the next write cleared the problem
        assert ready.status_code == 200 and read_desired_mode(tmp_path) == Mode.OFF and proc.starts == 1
        await kill_switch_works(c, tmp_path, proc)


async def test_a_task_that_fails_is_logged_and_holds_no_claim(standin, tmp_path, monkeypatch, logs):
    proc = standin(mode=Mode.VALIDATE)
    real = TransitionRunner.finish

    def finish_then_fail(self, t, outcome):
        real(self, t, outcome)
        if t.to_mode == Mode.STANDBY:
            raise RuntimeError("injected after the outcome")

    monkeypatch.setattr(TransitionRunner, "finish", finish_then_fail)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        await wait_ready(c)
        assert (await c.post("/mode", json={"mode": "standby"}, headers=AUTH)).status_code == 202
        assert (await settle(c))["outcome"] == "succeeded"
        await asyncio.sleep(0.1)
        assert any(
            "the mode transition task failed: RuntimeError: injected" in r.getMessage() for r in logs.records
        )
        r = await c.post("/mode", json={"mode": "validate"}, headers=AUTH)
        assert r.status_code == 202, r.json()  # not 409: the claim ended with its task
        assert (await settle(c))["outcome"] == "succeeded"
        await kill_switch_works(c, tmp_path, proc)


# ---- reads: only regular files, bounded, off the event loop ------------------------------------------------


async def test_a_fifo_among_the_records_is_reported_never_waited_on(standin, tmp_path):
    proc = standin()
    os.mkfifo(record_path(tmp_path, 7))  # nobody writes it: reading it would block forever
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        start = time.monotonic()
        body = await wait_ready(c, timeout=10)
        assert time.monotonic() - start < 5 and body["condition"] == "ready"
        st = (await c.get("/status")).json()
        (seven,) = [v for v in st["ranks"] if v["record"]["tp_rank"] == 7]
        assert seven["stale"] and seven["stale_reason"].endswith("rank-7.json is a FIFO, not a regular file")
        assert (await c.get("/live")).json() == {"live": True}
        metrics = await c.get(
            "/metrics"
        )  # answers; rank 7 is beyond the expected 2 ranks: not exported as a rank
        assert metrics.status_code == 200 and 'kdtree_rank_up{rank="1"} 1.0' in metrics.text
        assert 'rank="7"' not in metrics.text
        await kill_switch_works(c, tmp_path, proc)


async def test_live_answers_while_a_state_volume_read_hangs(standin, tmp_path, monkeypatch):
    """A hung mount: the volume's one thread waits, /ready and /status answer within their deadline naming it,
    /live at once; when the volume answers again, so does everything else."""
    proc = standin()
    release = threading.Event()
    real = readiness_module.read_volume

    def hung(settings):
        release.wait(30)
        return real(settings)

    settings = make_settings(tmp_path, proc.port, probe_deadline_s=0.8)
    volume_threads = lambda: {t for t in threading.enumerate() if t.name.startswith("kdtree-volume")}  # noqa: E731
    others = volume_threads()  # an earlier test's sidecar may still be finishing a read on its own
    try:
        async with sidecar(settings, server=proc) as c:
            await wait_ready(c)
            monkeypatch.setattr(readiness_module, "read_volume", hung)
            start = time.monotonic()
            pending = [asyncio.create_task(c.get(path)) for path in ("/ready", "/status", "/metrics") * 4]
            await asyncio.sleep(0.05)
            live_start = time.monotonic()
            assert (await c.get("/live")).status_code == 200
            assert time.monotonic() - live_start < 0.2
            answers = await asyncio.gather(*pending)
            assert time.monotonic() - start < 0.8 + 0.5
            ready = answers[0].json()
            assert answers[0].status_code == 503
            assert any("the state volume" in r and "did not answer within" in r for r in ready["reasons"]), (
                ready
            )
            assert answers[1].json()["mode"]["desired_file"] == "unread: the state volume did not answer"
            assert all(a.status_code in (200, 503) for a in answers)
            assert len(volume_threads() - others) == 1
            release.set()
            monkeypatch.setattr(readiness_module, "read_volume", real)
            await wait_ready(c)
            await kill_switch_works(c, tmp_path, proc)
    finally:
        release.set()


@pytest.mark.parametrize(
    ("name", "read"),
    [
        ("mode", read_desired_mode),
        ("server-process.json", lambda d: ServerProcess(d).inspect()),
        ("server.log", lambda d: ServerProcess(d).logs(10)),
        (STATE_FILE, lambda d: Store(d, 50).load(Mode.OFF)),
        ("sidecar-audit.jsonl", lambda d: Store(d, 50).audit_tail(10)),
        (OWED_FILE, lambda d: read_owed_modes(d, nnodes=2)),
    ],
)
def test_every_file_the_sidecar_reads_is_refused_as_a_fifo_never_waited_on(tmp_path, name, read):
    os.mkfifo(tmp_path / name)
    outcome = []

    def run():
        try:
            read(tmp_path)
        except Exception as e:  # noqa: BLE001 - the error is the finding
            outcome.append(str(e))

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), f"reading a FIFO named {name} blocked"
    (error,) = outcome
    assert f"{name} is a FIFO, not a regular file" in error


@pytest.mark.parametrize("kind", ["huge", "schema"])
async def test_a_record_that_is_no_record_is_refused_naming_why(standin, tmp_path, kind):
    proc = standin("--parity-calls", "500", mode=Mode.VALIDATE)
    path = record_path(tmp_path, 2)  # a third rank, expected below
    if kind == "huge":
        with path.open("wb") as f:
            f.truncate(64 * 1024 * 1024)
        why = f"rank-2.json is 67108864 bytes, more than the {RECORD_MAX} it can be"
    else:
        rec = new_record("validate", tp_rank=2, tp_size=3)
        path.write_text(rec.model_dump_json().replace('"schema_version":1', '"schema_version":99'))
        why = "schema_version 99; this sidecar reads 1: upgrade the sidecar image to the server's"
    async with sidecar(make_settings(tmp_path, proc.port, expected_tp_size=3), server=proc) as c:
        ready = await c.get("/ready")
        assert ready.status_code == 503
        assert any(
            r.startswith("rank 2: record is stale (unreadable: ") and why in r
            for r in ready.json()["reasons"]
        )
        doc = (await c.get("/status")).json()
        assert len(json.dumps(doc)) < 64 * 1024  # the record is never returned whole
        dry = (await c.post("/mode", json={"mode": "on", "dry_run": True}, headers=AUTH)).json()
        assert {x["name"] for x in dry["criteria"] if not x["passed"]} >= {"ranks_in_validate"}
    path.unlink()
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:  # two ranks expected again
        await kill_switch_works(c, tmp_path, proc)


# ---- non-finite parity: the gate names it, nothing answers 500 ---------------------------------------------


@pytest.mark.parametrize(("value", "shown"), [("inf", "Infinity"), ("-inf", "-Infinity"), ("nan", "NaN")])
async def test_non_finite_parity_from_the_ranks_refuses_the_gate_by_name(standin, tmp_path, value, shown):
    """Written by the ranks' own code (kdtree.state.heartbeat through the stand-in), read back by the sidecar."""
    proc = standin("--parity-calls", "500", f"--parity-max-rel={value}", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        await wait_ready(c)
        dry = await c.post("/mode", json={"mode": "on", "dry_run": True}, headers=AUTH)
        assert dry.status_code == 200 and dry.json()["allowed"] is False
        crit = {x["name"]: x for x in dry.json()["criteria"]}
        assert crit["max_rel_err"]["value"] == shown and not crit["max_rel_err"]["passed"]
        assert f"rank 0: max_rel_l2 is {value}" in crit["max_rel_err"]["detail"]
        assert f"rank 1: max_rel_l2 is {value}" in crit["max_rel_err"]["detail"]
        assert {n for n, x in crit.items() if not x["passed"]} == {"max_rel_err"}
        refused = await c.post("/mode", json={"mode": "on"}, headers=AUTH)
        assert refused.status_code == 412 and "max_rel_err" in refused.json()["error"]
        st = await c.get("/status")
        assert st.status_code == 200 and st.json()["ranks"][0]["record"]["parity"]["max_rel_l2"] == shown
        metrics = (await c.get("/metrics")).text
        prom = {"inf": "+Inf", "-inf": "-Inf", "nan": "NaN"}[value]
        assert f'kdtree_rank_parity_max_rel_l2{{rank="0"}} {prom}' in metrics
        forced = await c.post("/mode", json={"mode": "on", "force": True}, headers=AUTH)
        assert forced.status_code == 202 and forced.json()["transition"]["gate"][3]["value"] == shown
        assert (await settle(c))["outcome"] == "succeeded"
        await kill_switch_works(c, tmp_path, proc)


@pytest.mark.parametrize("literal", ["NaN", "Infinity"])
@pytest.mark.parametrize("rank", [0, 1])
async def test_nan_and_infinity_literals_from_another_writer_refuse_the_gate(engine, tmp_path, rank, literal):
    """JSON's non-standard literals, as another writer may put them: read, named, refused; never a pass or a 500."""
    proc = engine(mode=Mode.VALIDATE)  # no ranks of its own: the records are written here
    for r in range(2):
        rec = new_record("validate", tp_rank=r, tp_size=2)
        rec.pid_ns, rec.installed = own_pid_ns(), True
        rec.live_modes = ["on", "standby", "validate"]
        rec.parity.calls_compared, rec.parity.max_rel_l2 = 500, 0.001
        raw = rec.model_dump_json()
        if r == rank:
            raw = raw.replace('"max_rel_l2":0.001', f'"max_rel_l2":{literal}')
        record_path(tmp_path, r).write_text(raw)
    (view,) = [v for v in read_records(tmp_path) if v.record.tp_rank == rank]
    assert not view.stale and not math.isfinite(view.record.parity.max_rel_l2)
    async with sidecar(make_settings(tmp_path, proc.port, heartbeat_stale_s=60), server=proc) as c:
        await wait_ready(c)
        dry = await c.post("/mode", json={"mode": "on", "dry_run": True}, headers=AUTH)
        assert dry.status_code == 200 and dry.json()["allowed"] is False
        (rel,) = [x for x in dry.json()["criteria"] if x["name"] == "max_rel_err"]
        named = "nan" if literal == "NaN" else "inf"
        assert not rel["passed"] and f"rank {rank}: max_rel_l2 is {named}" in rel["detail"]
        assert (await c.post("/mode", json={"mode": "on"}, headers=AUTH)).status_code == 412
        assert (await c.get("/status")).status_code == 200 and (await c.get("/metrics")).status_code == 200


# ---- readiness: servers that will not get ready by themselves are broken, after their budgets --------------


async def test_a_server_that_never_started_is_broken_after_the_start_grace(tmp_path):
    settings = make_settings(tmp_path, free_port(), start_grace_s=0.6, server_control="process")
    async with sidecar(settings, server=ServerProcess(tmp_path)) as c:
        early = (await c.get("/ready")).json()
        await asyncio.sleep(0.7)
        late = (await c.get("/ready")).json()
        assert (
            early["condition"] == "not_ready_yet"
            and "KDTREE_START_GRACE_S=0.6" in early["condition_evidence"][0]
        )
        assert late["condition"] == "broken", late
        assert (
            "(KDTREE_START_GRACE_S=0.6): the server container is not running, or does not share the state volume"
            in (late["condition_evidence"][0])
        )
        assert "server-process.json is absent" in late["condition_evidence"][1]
        off = await c.post("/mode", json={"mode": "off"}, headers=AUTH)
        assert off.status_code == 200 and off.json()["changed"] is False


async def test_a_server_answering_garbage_is_broken_after_the_answering_budget(standin, tmp_path):
    """Counted from the first answer after the start: the time the port stayed closed while loading is not."""
    proc = standin("--fault", "malformed", "--load-seconds", "1.2", wait=False)
    settings = make_settings(
        tmp_path,
        proc.port,
        answering_budget_s=0.5,
        ready_timeout_s=60,
        probe_interval_s=0.05,
        probe_deadline_s=0.5,
    )
    async with sidecar(settings, server=proc) as c:
        seen = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            body = (await c.get("/ready")).json()
            seen.append((round(time.time() - proc.started_at, 1), body["phase"], body["condition"]))
            if body["condition"] == "broken":
                break
            await asyncio.sleep(0.1)
        assert body["condition"] == "broken", seen
        assert "KDTREE_ANSWERING_BUDGET_S=0.5" in body["condition_evidence"][0]
        assert "the latest: malformed_json" in body["condition_evidence"][0]
        loading = [x for x in seen if x[1] == "loading"]
        assert loading and all(cond == "not_ready_yet" for _, _, cond in loading)
        assert seen[-1][0] >= 1.2 + 0.5  # the budget started when the port first answered
        off = await c.post("/mode", json={"mode": "off"}, headers=AUTH)
        assert off.status_code == 200 and off.json()["changed"] is False


# ---- a sidecar stopped at each step of a transition, and started again ---------------------------------------


LIVE_STEPS = ["accepted", "writing_mode", "awaiting_ranks", "baking", "rolling_back"]
RESTART_STEPS = ["restarting", "waiting_ready", "baking", "rolling_back"]


@pytest.mark.parametrize(
    ("method", "step"), [("live", s) for s in LIVE_STEPS] + [("restart", s) for s in RESTART_STEPS]
)
async def test_a_sidecar_stopped_at_each_step_resolves_it_at_its_next_start(standin, tmp_path, method, step):
    """The state file as the sidecar left it at `step` (and the mode file, the server as that step leaves them);
    the next sidecar ends the transition: aborted before anything changed, else rolled back."""
    live = method == "live"
    before, after = (Mode.VALIDATE, Mode.ON) if live else (Mode.OFF, Mode.VALIDATE)
    proc = standin("--parity-calls", "500", mode=before)
    restarted = not live and step != "restarting"  # at `restarting` it stopped before the restart call
    t = Transition(from_mode=before, to_mode=after, method=method, step=step)
    t.restarted_at = time.time() if restarted else None
    if step == "rolling_back":
        t.failure = "bake probe 1/3: injected"
    Store(tmp_path, 50).save(SidecarState(current_mode=before, active=t))
    if step != "accepted":
        write_desired_mode(tmp_path, after)
    if restarted:
        proc.restart(2)
        proc.wait_port()
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        done = await settle(c)
        assert done["id"] == t.id and done["interrupted"] is True
        expected = "aborted" if step in ("accepted", "writing_mode") else "rolled_back"
        assert done["outcome"] == expected, done
        assert f"stopped at step {step}" in done["failure"] or step == "rolling_back"
        body = await wait_ready(c)
        st = (await c.get("/status")).json()
        assert (
            body["mode"] == before
            and st["mode"]["current"] == before
            and read_desired_mode(tmp_path) == before
        )
        assert {v["record"]["mode"] for v in st["ranks"]} == {before.value}
        assert proc.starts == (3 if restarted else 1)  # a live rollback needs no restart
        events = audit_events(tmp_path)
        assert events[0] == "interrupted_transition_found" and events[-1] == expected
        await kill_switch_works(c, tmp_path, proc)


# ---- the kill switch preempts -----------------------------------------------------------------------------------


async def test_off_preempts_a_wedged_transition(standin, tmp_path):
    proc = standin("--fault", "hang", "--fault-in-mode", "validate")
    settings = make_settings(tmp_path, proc.port, ready_timeout_s=60, probe_deadline_s=0.5)
    async with sidecar(settings, server=proc) as c:
        await wait_ready(c)
        first = await c.post("/mode", json={"mode": "validate"}, headers=AUTH)
        assert first.status_code == 202
        await reach_step(c, "waiting_ready")
        busy = await c.post("/mode", json={"mode": "on", "force": True}, headers=AUTH)
        assert busy.status_code == 409 and "POST /mode off preempts it" in busy.json()["error"]
        off = await c.post("/mode", json={"mode": "off", "reason": "drill"}, headers=AUTH)
        assert off.status_code == 202 and off.json()["method"] == "restart"
        again = await c.post("/mode", json={"mode": "off"}, headers=AUTH)
        assert again.status_code == 409  # the kill switch runs: it is not preempted by itself
        t = await settle(c)
        st = (await c.get("/status")).json()
    preempted, kill = st["transitions"][-2:]
    assert preempted["id"] == first.json()["transition"]["id"] and preempted["outcome"] == "preempted"
    assert preempted["failure"] == "preempted at step waiting_ready by POST /mode off (drill)"
    assert (
        kill["id"] == t["id"]
        and t["outcome"] == "succeeded"
        and (t["from_mode"], t["to_mode"]) == ("off", "off")
    )
    assert read_desired_mode(tmp_path) == Mode.OFF and st["ready"] and st["mode"]["current"] == "off"
    events = audit_events(tmp_path)
    assert events[events.index("preempted") :][:2] == ["preempted", "accepted"]


class RestartHeld:
    """The stand-in, whose first restart waits for `release`: a restart under way when the kill switch comes."""

    def __init__(self, proc):
        self.proc, self.name = proc, proc.name
        self.entered, self.release = threading.Event(), threading.Event()

    def inspect(self):
        return self.proc.inspect()

    def logs(self, tail, since=None):
        return self.proc.logs(tail, since)

    def restart(self, stop_timeout_s):
        if not self.release.is_set():
            self.entered.set()
            self.release.wait(30)
        self.proc.restart(stop_timeout_s)


async def test_off_preempting_a_restart_waits_for_it_then_restarts_into_off(standin, tmp_path):
    proc = standin()
    server = RestartHeld(proc)
    try:
        async with sidecar(make_settings(tmp_path, proc.port), server=server) as c:
            await wait_ready(c)
            assert (await c.post("/mode", json={"mode": "validate"}, headers=AUTH)).status_code == 202
            assert await asyncio.to_thread(server.entered.wait, 10)
            assert (await c.post("/mode", json={"mode": "off"}, headers=AUTH)).status_code == 202
            await until(lambda: "awaiting_previous_restart" in audit_events(tmp_path), 30, "the audit event")
            assert proc.starts == 1
            server.release.set()
            t = await settle(c)
            assert (
                t["outcome"] == "succeeded" and proc.starts == 3
            )  # the held restart, then the kill switch's
            await kill_switch_works(c, tmp_path, proc)
    finally:
        server.release.set()
