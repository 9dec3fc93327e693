"""The sidecar's probe, /ready, /status and /metrics against standins/standin_engine.py.

The stand-in engine stands in for the SGLang server (no model, no GPU): a separate local process that
keeps its port closed while loading, answers 503 while warming, then serves SGLang's OpenAI endpoints,
with injected faults. It also writes the per-rank records the SGLang ranks write.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from sidecar_harness import TOKEN, make_settings, sidecar, wait_ready
from standin_engine import free_port

from kdtree.config import ConfigError, Mode
from kdtree.state.process_record import START_MARK, read_process_record
from sidecar import probe as P
from sidecar.app import create_app
from sidecar.server_log import crash_excerpt, latest_marker
from sidecar.settings import SidecarSettings

pytestmark = pytest.mark.anyio
DATA = Path(__file__).resolve().parents[1] / "data"


def prober(port, deadline=1.0, model=None) -> P.Prober:
    return P.Prober(f"http://127.0.0.1:{port}", "The capital of France is", 1, deadline, model)


# ---- the probe against each fault ---------------------------------------------------------------------


async def test_probe_follows_loading_warming_ready(engine):
    proc = engine("--load-seconds", "1.0", "--warm-seconds", "0.8", wait=False)
    p = prober(proc.port)
    seen = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = await p.probe()
        seen.append("ok" if r.ok else f"{r.reason}:{r.status_code}")
        if r.ok:
            break
        await asyncio.sleep(0.1)
    # Port closed while loading, 503 while warming, then a completion with a finish reason.
    assert seen[0] == "connection_refused:None"
    assert "http_status:503" in seen
    assert seen[-1] == "ok"
    assert seen.index("http_status:503") > seen.index("connection_refused:None")
    assert r.model == "stand-in/deepseek-v3" and r.finish_reason == "length"


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("malformed", P.MALFORMED),
        ("no-choices", P.NO_CHOICES),
        ("no-finish-reason", P.NO_FINISH_REASON),
        ("http-500", P.HTTP_STATUS),
        ("hang", P.TIMEOUT),
    ],
)
async def test_probe_names_each_fault(engine, fault, reason):
    proc = engine("--fault", fault)
    start = time.monotonic()
    r = await prober(proc.port, deadline=0.8).probe()
    assert not r.ok and r.reason == reason, r
    assert time.monotonic() - start < 0.8 + 0.3  # a hang costs the deadline, no more


async def test_a_refused_probe_names_the_server_without_the_urls_credentials():
    """The verdict's detail reaches GET /status: a password in KDTREE_SERVER_URL stays out of it."""
    port = free_port()
    r = await P.Prober(f"http://probe:s3cret@127.0.0.1:{port}", "Hi", 2, 1.0, "m").probe()
    assert r.reason == P.REFUSED and f"cannot connect to http://127.0.0.1:{port}" in r.detail
    assert "s3cret" not in r.detail and "probe:" not in r.detail


def test_the_standin_refuses_a_fault_it_does_not_have(engine):
    """The demo switches faults by name: a misspelt one is refused, naming the valid ones, and changes nothing."""
    url = f"http://127.0.0.1:{engine().port}/_standin/fault"
    r = httpx.post(url, json={"fault": "fallbak"})
    assert r.status_code == 400 and "'fallbak' is not a fault; faults: none, slow," in r.json()["error"], (
        r.text
    )
    assert "fallback" in r.json()["error"] and "crash-on-start" not in r.json()["error"]
    r = httpx.post(url, json={"fault": "crash-on-start"})
    assert r.status_code == 400 and "happens at start only (--fault)" in r.json()["error"], r.text
    assert httpx.post(url, content=b"fallback").status_code == 400
    assert httpx.get(url.replace("fault", "stats")).json()["fault"] == "none"


async def test_probe_slow_answer_within_and_past_deadline(engine):
    proc = engine("--fault", "slow", "--fault-delay", "0.4")
    ok = await prober(proc.port, deadline=2.0).probe()
    assert ok.ok and ok.latency_s >= 0.4
    late = await prober(proc.port, deadline=0.2).probe()
    assert not late.ok and late.reason == P.TIMEOUT


async def test_probe_server_dying_mid_answer(engine):
    proc = engine("--fault", "die-mid-probe")
    r = await prober(proc.port).probe()
    assert not r.ok and r.reason == P.DISCONNECTED, r
    assert proc.proc.wait(5) == 137
    after = await prober(proc.port).probe()
    assert after.reason == P.REFUSED


async def test_probe_wrong_configured_model_is_an_http_error(engine):
    proc = engine()
    r = await prober(proc.port, model="no-such-model").probe()
    assert not r.ok and r.reason == P.HTTP_STATUS and r.status_code == 404


# ---- /live and /ready --------------------------------------------------------------------------------


async def test_ready_needs_completion_and_every_rank(engine, tmp_path):
    proc = engine("--tp-size", "2")
    async with sidecar(make_settings(tmp_path, proc.port)) as c:
        r = await c.get("/ready")
        assert r.status_code == 200, r.json()
        assert r.json()["ready"] is True and r.json()["phase"] == "ready"
    # Three ranks expected, two report: not ready, and the reason names the missing rank.
    async with sidecar(make_settings(tmp_path, proc.port, expected_tp_size=3)) as c:
        r = await c.get("/ready")
        assert r.status_code == 503
        assert any("rank 2: no record" in reason for reason in r.json()["reasons"])
        assert r.json()["phase"] == "degraded"


async def test_ready_rejects_ranks_in_the_wrong_mode_or_without_the_hook(engine, tmp_path):
    proc = engine("--tp-size", "2", "--not-installed", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port)) as c:
        body = (await c.get("/ready")).json()
        assert not body["ready"] and any("hook not installed" in r for r in body["reasons"])
    proc.stop()
    proc = engine("--tp-size", "2", "--report-mode", "off", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port)) as c:
        body = (await c.get("/ready")).json()
        assert not body["ready"] and any("reports mode off, expected validate" in r for r in body["reasons"])


async def test_ready_sees_dead_ranks(engine, tmp_path):
    proc = engine("--tp-size", "2")
    async with sidecar(make_settings(tmp_path, proc.port, probe_interval_s=0.05)) as c:
        assert (await c.get("/ready")).status_code == 200
        proc.stop()
        r = await c.get("/ready")  # at once: the records' writer pid is gone (same PID namespace here)
        assert r.status_code == 503 and "is gone" in " ".join(r.json()["reasons"])
        await asyncio.sleep(0.5)  # the background probe's next round: a closed port counts at once too
        reasons = " ".join((await c.get("/ready")).json()["reasons"])
        assert "connection_refused" in reasons and "is gone" in reasons


async def test_live_never_touches_the_server(tmp_path):
    async with sidecar(make_settings(tmp_path, free_port())) as c:
        assert (await c.get("/live")).json() == {"live": True}


async def test_ready_never_exceeds_the_deadline(engine, tmp_path):
    proc = engine("--tp-size", "2", "--fault", "hang")
    async with sidecar(make_settings(tmp_path, proc.port, probe_deadline_s=0.7, probe_interval_s=0.05)) as c:
        for _ in range(3):
            start = time.monotonic()
            r = await c.get("/ready")
            assert time.monotonic() - start < 0.7 + 0.25
            assert r.status_code == 503 and "timeout" in " ".join(r.json()["reasons"])


async def test_a_ready_storm_sends_no_completion_of_its_own(engine, tmp_path):
    """The background probe decides when a completion is sent: once per KDTREE_PROBE_INTERVAL_S, however many
    GET /ready arrive, and none of them waits on it."""
    proc = engine("--tp-size", "2", "--fault", "slow", "--fault-delay", "0.2")
    interval, deadline = 0.5, 1.0
    settings = make_settings(tmp_path, proc.port, probe_interval_s=interval, probe_deadline_s=deadline)
    async with sidecar(settings) as c:
        durations, refusals = [], []

        async def one():
            start = time.monotonic()
            r = await c.get("/ready")
            durations.append(time.monotonic() - start)
            if r.status_code != 200:
                refusals.append((round(start - storm, 3), r.json()))
            return r.status_code

        storm = time.monotonic()
        codes = []
        while time.monotonic() - storm < 2.0:
            codes += await asyncio.gather(*(one() for _ in range(25)))
        elapsed = time.monotonic() - storm
    stats = httpx.get(f"http://127.0.0.1:{proc.port}/_standin/stats").json()
    assert len(codes) >= 100 and set(codes) == {200}, refusals[:3]
    assert stats["completions"] <= elapsed / interval + 2, stats  # one per interval, and the first
    assert (
        sorted(durations)[len(durations) // 2] < 0.15
    )  # answered from the latest verdict, not after a probe
    assert max(durations) < deadline + 0.25


# ---- /status: phases and evidence -------------------------------------------------------------------


async def test_status_reports_loading_then_warming_then_ready_with_log_markers(engine, tmp_path):
    proc = engine("--tp-size", "2", "--load-seconds", "1.2", "--warm-seconds", "1.0", wait=False)
    settings = make_settings(tmp_path, proc.port, probe_interval_s=0.05)
    phases, markers = [], []
    async with sidecar(settings, server=proc) as c:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = (await c.get("/status")).json()
            if not phases or phases[-1] != st["phase"]:
                phases.append(st["phase"])
            markers.append((st["log"]["latest_marker"] or {}).get("name"))
            if st["phase"] == "ready" and st["probe"]["ok"]:  # ready with a late probe tolerated is ready too
                break
            await asyncio.sleep(0.1)
        assert st["container"]["state"]["status"] == "running"
        assert [r["record"]["tp_rank"] for r in st["ranks"]] == [0, 1]
        assert st["probe"]["ok"] and st["probe"]["latency_s"] > 0
        metrics = (await c.get("/metrics")).text
    assert phases[0] == "loading" and "warming" in phases and phases[-1] == "ready", phases
    assert "capturing_cuda_graphs" in markers and markers[-1] == "fired_up"
    assert 'kdtree_probe_failures_total{reason="connection_refused"}' in metrics
    assert 'kdtree_server_phase{kdtree_server_phase="ready"} 1.0' in metrics
    assert "kdtree_probe_duration_seconds_bucket" in metrics
    assert 'kdtree_rank_up{rank="1"} 1.0' in metrics


async def test_status_reports_a_crash_with_the_traceback(engine, tmp_path):
    proc = engine("--load-seconds", "0.2", "--fault", "crash-on-start", "--exit-code", "3", wait=False)
    proc.proc.wait(10)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        st = (await c.get("/status")).json()
        ready = await c.get("/ready")
    assert st["phase"] == "crashed"
    assert st["container"]["state"]["exit_code"] == 3
    excerpt = "\n".join(st["log"]["crash_excerpt"])
    assert "Traceback (most recent call last)" in excerpt and "torch.OutOfMemoryError" in excerpt
    assert st["log"]["latest_marker"]["name"] == "capturing_cuda_graphs"
    assert ready.status_code == 503 and ready.json()["phase"] == "crashed"


async def test_metrics_export_rank_parity(engine, tmp_path):
    proc = engine("--tp-size", "2", "--parity-calls", "1234", "--parity-max-rel", "0.004", mode=Mode.VALIDATE)
    async with sidecar(make_settings(tmp_path, proc.port)) as c:
        await c.get("/ready")
        text = (await c.get("/metrics")).text
    assert 'kdtree_rank_parity_calls_compared_total{rank="0"} 1234.0' in text
    assert 'kdtree_rank_parity_max_rel_l2{rank="1"} 0.004' in text
    assert 'kdtree_mode{kdtree_mode="validate"} 1.0' in text
    assert "kdtree_ready 1.0" in text


async def test_the_ready_gauge_is_the_latest_verdict_whichever_endpoint_asked(engine, tmp_path):
    """GET /status alone moves kdtree_ready (as it moves kdtree_condition), and /metrics never reads 0 while
    /status says ready."""
    proc = engine("--tp-size", "2")
    async with sidecar(make_settings(tmp_path, proc.port)) as c:
        assert "kdtree_ready 0.0" in (await c.get("/metrics")).text  # nothing assessed yet
        deadline = time.monotonic() + 30
        while not (st := (await c.get("/status")).json())["ready"]:
            assert time.monotonic() < deadline, st["reasons"]
            await asyncio.sleep(0.1)
        text = (await c.get("/metrics")).text
        assert "kdtree_ready 1.0" in text and 'kdtree_condition{kdtree_condition="ready"} 1.0' in text
        proc.stop()
        while (st := (await c.get("/status")).json())["ready"]:
            assert time.monotonic() < deadline + 30
            await asyncio.sleep(0.1)
        text = (await c.get("/metrics")).text
    assert (
        "kdtree_ready 0.0" in text and f'kdtree_condition{{kdtree_condition="{st["condition"]}"}} 1.0' in text
    )


def sample(text: str, name: str) -> float:
    """One unlabelled sample of the /metrics exposition."""
    return next(float(v) for n, _, v in (ln.partition(" ") for ln in text.splitlines()) if n == name)


async def test_background_probes_are_not_assessments_only_ready_status_and_transitions_are(engine, tmp_path):
    """kdtree_readiness_assessments_total (what KdtreeReadinessNotPolled watches) counts what refreshes kdtree_ready:
    the background probe runs every KDTREE_PROBE_INTERVAL_S whoever polls, so its count says nothing of that."""
    proc = engine("--tp-size", "2")
    async with sidecar(make_settings(tmp_path, proc.port)) as c:
        deadline = time.monotonic() + 30
        while sample(text := (await c.get("/metrics")).text, "kdtree_probe_duration_seconds_count") < 3:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert sample(text, "kdtree_readiness_assessments_total") == 0.0
        await c.get("/ready")
        await c.get("/status")
        assert sample((await c.get("/metrics")).text, "kdtree_readiness_assessments_total") == 2.0


# ---- pure pieces ----------------------------------------------------------------------------------------


def test_crash_excerpt_keeps_whole_tracebacks_and_error_lines():
    log = "\n".join(
        [
            "[TP0] Load weight begin. avail mem=10 GB",
            "[TP0] all good",
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in <module>',
            "    boom()",
            "RuntimeError: NCCL error: unhandled system error",
            "[TP0] WARNING something",
            "[TP3] ERROR Scheduler hit an exception",
        ]
    )
    excerpt = crash_excerpt(log)
    assert excerpt[0] == "Traceback (most recent call last):"
    assert "RuntimeError: NCCL error: unhandled system error" in excerpt
    assert "[TP3] ERROR Scheduler hit an exception" in excerpt
    assert not any("all good" in line or "WARNING" in line for line in excerpt)
    assert latest_marker(log).name == "loading_weights"
    assert latest_marker("nothing here") is None


def test_crash_excerpt_is_this_runs_last_incident():
    """A run that served through a hang (its abandoned requests left BrokenPipeError tracebacks, and a transient
    error line long before the end), then stopped: the excerpt is the lines that explain this exit, not the
    hang's tracebacks, not that old line, not the previous run's crash."""
    startup = (DATA / "sglang-0.5.23-startup.log").read_text().splitlines()
    hang_up = [
        "----------------------------------------",
        "Exception occurred during processing of request from ('127.0.0.1', 40312)",
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3.11/socketserver.py", line 691, in process_request_thread',
        "    self.finish_request(request, client_address)",
        '  File "/usr/lib/python3.11/http/server.py", line 432, in handle',
        "    self.wfile.write(data)",
        "BrokenPipeError: [Errno 32] Broken pipe",
        "----------------------------------------",
    ]
    end = [
        "[2026-12-01 19:40:02 TP0] Scheduler hit an exception: Traceback (most recent call last):",
        '  File "/sgl/python/sglang/srt/managers/scheduler.py", line 2801, in run_scheduler_process',
        "    scheduler.event_loop_overlap()",
        "torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
        "[2026-12-01 19:40:02] Received sigquit from a child process. It usually means the child failed.",
        "kdtree launcher: the server was killed by SIGKILL (exit status 137)",
    ]
    log = "\n".join(
        [
            f"{START_MARK} #1 at 2026-12-01T19:00:00.000Z (t=1796151600.000), pid 7",
            "Traceback (most recent call last):",
            "RuntimeError: the previous run's crash",
            "kdtree launcher: the server exited with status 1",
            f"{START_MARK} #2 at 2026-12-01T19:24:57.000Z (t=1796153097.000), pid 7",
            "kdtree launcher: mode=on (from the mode file); model=/models/dsv3; tp=8 ...",
            *startup,
            "[2026-12-01 19:26:00 TP0] ERROR transient: a request with a bad sampling parameter",
            *[f"[2026-12-01 19:27:{i:02d} TP0] Decode batch. #running-req: 1" for i in range(30)],
            *hang_up * 5,  # 45 lines of a client's hang-ups
            *[f"[2026-12-01 19:39:{i:02d} TP0] Prefill batch. #new-seq: 1" for i in range(3)],
            *end,
        ]
    )
    errors = [line for line in end if "sigquit" not in line]  # error lines and whole tracebacks
    assert crash_excerpt(log) == errors
    # An incident's errors may lie apart (ranks failing one after another, shutdown lines between them).
    apart = ["[TP3] ERROR rank 3 lost its peer", *[f"[TP0] shutting down {i}" for i in range(15)], *end]
    assert crash_excerpt("\n".join(apart)) == [apart[0], *errors]
    # A log without a start mark (Docker's, read since the container's start) is one run.
    assert crash_excerpt("\n".join([*startup, *end])) == errors
    # Only hang-ups: nothing explains an exit.
    assert crash_excerpt("\n".join(hang_up)) == []


def test_settings_refuse_to_start_without_an_admin_decision(monkeypatch):
    monkeypatch.delenv("KDTREE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("KDTREE_ALLOW_OPEN_ADMIN", raising=False)
    with pytest.raises(ConfigError, match="KDTREE_ADMIN_TOKEN.*KDTREE_ALLOW_OPEN_ADMIN=true"):
        SidecarSettings.load()
    monkeypatch.setenv("KDTREE_ALLOW_OPEN_ADMIN", "true")
    assert SidecarSettings.load().allow_open_admin
    monkeypatch.setenv("KDTREE_PROBE_DEADLINE_S", "soon")
    with pytest.raises(
        ConfigError, match="KDTREE_PROBE_DEADLINE_S='soon' is invalid: .*; fix: .*default \\(10.0\\)"
    ):
        SidecarSettings.load()
    monkeypatch.delenv("KDTREE_PROBE_DEADLINE_S")
    # the probe would fail later, naming no setting
    monkeypatch.setenv("KDTREE_SERVER_URL", "localhost:13000")
    with pytest.raises(ConfigError, match="KDTREE_SERVER_URL='localhost:13000' is invalid: .*as http://"):
        SidecarSettings.load()
    monkeypatch.setenv("KDTREE_SERVER_URL", "http://server:30x")  # httpx: InvalidURL at every probe
    with pytest.raises(ConfigError, match="KDTREE_SERVER_URL='http://server:30x' is invalid: .*valid port"):
        SidecarSettings.load()
    monkeypatch.setenv("KDTREE_SERVER_URL", "https://[fd00::1]:30000/base/")
    assert SidecarSettings.load().server_url == "https://[fd00::1]:30000/base/"
    # a field read through an alias: its default still named
    monkeypatch.setenv("KDTREE_READY_TIMEOUT_S", "-1")
    with pytest.raises(ConfigError, match=r"KDTREE_READY_TIMEOUT_S='-1' is invalid: .*default \(1800.0\)"):
        SidecarSettings.load()
    monkeypatch.delenv("KDTREE_READY_TIMEOUT_S")
    # its own fix: the default (1) is wrong for most servers
    monkeypatch.setenv("KDTREE_EXPECTED_TP_SIZE", "-8")
    with pytest.raises(
        ConfigError, match="KDTREE_EXPECTED_TP_SIZE='-8' is invalid: .*fix: set it to the server's"
    ):
        SidecarSettings.load()


def test_docker_timestamps_parse_with_nanoseconds_and_zero_time():
    from sidecar.server_control.docker import _docker_time

    assert _docker_time("2026-11-29T09:20:00.123456789Z") == pytest.approx(1795944000.123456)
    assert _docker_time("2026-11-29T10:20:00.5+01:00") == pytest.approx(1795944000.5)
    assert _docker_time("0001-01-01T00:00:00Z") is None
    assert _docker_time("") is None and _docker_time(None) is None


def test_an_unreadable_state_file_stops_the_sidecar_with_its_path(tmp_path):
    (tmp_path / "sidecar-state.json").write_text("{broken")
    with pytest.raises(ConfigError, match="sidecar-state.json is unreadable.*move it aside"):
        create_app(make_settings(tmp_path, free_port()))
    (tmp_path / "sidecar-state.json").unlink()
    (tmp_path / "mode").write_text("fast\n")
    with pytest.raises(ConfigError, match="holds 'fast': expected one of off, validate, on"):
        create_app(make_settings(tmp_path, free_port()))


def test_ready_timeout_is_read_under_both_names(monkeypatch):
    monkeypatch.setenv("KDTREE_ADMIN_TOKEN", TOKEN)
    assert SidecarSettings.load().ready_timeout_s == 1800
    monkeypatch.setenv("KDTREE_READY_TIMEOUT", "600")
    assert SidecarSettings.load().ready_timeout_s == 600
    monkeypatch.setenv("KDTREE_READY_TIMEOUT_S", "900")
    assert SidecarSettings.load().ready_timeout_s == 900


# ---- condition: will a server that is not ready get there by itself? ---------------------------------------


async def test_condition_not_ready_yet_while_loading_then_ready(engine, tmp_path):
    proc = engine("--tp-size", "2", "--load-seconds", "1.0", wait=False)
    async with sidecar(make_settings(tmp_path, proc.port, probe_interval_s=0.05), server=proc) as c:
        first = (await c.get("/ready")).json()
        body = await wait_ready(c)
    assert (
        first["condition"] == "not_ready_yet"
        and "not ready yet (KDTREE_READY_TIMEOUT_S=6)" in first["condition_evidence"][0]
    )
    assert body["condition"] == "ready" and body["condition_evidence"] == []


async def test_condition_broken_for_a_crash(engine, tmp_path):
    proc = engine("--load-seconds", "0.2", "--fault", "crash-on-start", wait=False)
    proc.proc.wait(10)
    async with sidecar(make_settings(tmp_path, proc.port), server=proc) as c:
        body = (await c.get("/ready")).json()
        metrics = (await c.get("/metrics")).text
    assert body["condition"] == "broken" and "the server process is exited" in body["condition_evidence"][0]
    assert 'kdtree_condition{kdtree_condition="broken"} 1.0' in metrics


async def test_condition_broken_when_a_fresh_start_never_gets_ready(engine, tmp_path):
    """A server that hangs from its start stays `warming` as a phase; past its budget the condition says broken."""
    proc = engine("--fault", "hang")
    settings = make_settings(
        tmp_path, proc.port, ready_timeout_s=2.0, probe_deadline_s=0.5, probe_interval_s=0.05
    )
    async with sidecar(settings, server=proc) as c:
        early = (await c.get("/ready")).json()  # the stand-in's and the sidecar's starts take up to ~1 s
        await asyncio.sleep(2.2)
        late = (await c.get("/ready")).json()
    assert early["condition"] == "not_ready_yet" and early["phase"] == "warming"
    assert late["condition"] == "broken" and late["phase"] == "warming"
    assert "never ready (KDTREE_READY_TIMEOUT_S=2)" in late["condition_evidence"][0]


@pytest.mark.parametrize("fault", ["hang", "http-500"])
async def test_condition_broken_when_it_stops_answering_after_serving(engine, tmp_path, fault):
    """A dead scheduler (hang: /health fails too) or wrong answers (500: /health does not excuse those), past the
    failure threshold."""
    proc = engine("--fault", fault, "--fault-after", "1")
    settings = make_settings(
        tmp_path, proc.port, expected_tp_size=0, probe_deadline_s=1.5, probe_interval_s=0.05
    )
    async with sidecar(settings, server=proc) as c:
        assert (await c.get("/ready")).status_code == 200
        body = await wait_not_ready(c, timeout=10)
    assert body["condition"] == "broken" and body["phase"] == "degraded", body
    assert "and fails now" in body["condition_evidence"][0]
    assert any("3 probes in a row failed (KDTREE_PROBE_FAILURE_THRESHOLD=3)" in r for r in body["reasons"])


async def wait_not_ready(c, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while (r := await c.get("/ready")).status_code == 200:
        assert time.monotonic() < deadline, f"still ready after {timeout}s: {r.json()}"
        await asyncio.sleep(0.05)
    return r.json()


# ---- readiness under load: the stand-in saturated (a stand-in: its /health answers as SGLang 0.5.23's does) ------


async def test_ready_holds_while_saturated_and_drops_for_a_dead_scheduler(engine, tmp_path, monkeypatch):
    """Completions queue behind load past the probe's deadline while SGLang's /health answers 200 (any output
    counts): the pod stays ready, however many probes fail. A dead scheduler (completions hang, /health answers 503
    when no output arrives within SGLANG_HEALTH_CHECK_TIMEOUT) turns it not ready within the stated bound:
    (KDTREE_PROBE_FAILURE_THRESHOLD + 1) x max(KDTREE_PROBE_INTERVAL_S, 0.9 x KDTREE_PROBE_DEADLINE_S)."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "3")
    proc = engine("--tp-size", "2", "--fault-delay", "30")
    interval, deadline, threshold = 0.2, 1.5, 3
    settings = make_settings(tmp_path, proc.port, probe_interval_s=interval, probe_deadline_s=deadline)
    stand_in = f"http://127.0.0.1:{proc.port}"
    async with sidecar(settings, server=proc) as c:
        await wait_ready(c)
        httpx.post(f"{stand_in}/_standin/fault", json={"fault": "saturated"})
        codes, start = [], time.monotonic()
        while (st := (await c.get("/status")).json())["probe_failures_in_a_row"] <= threshold + 1:
            assert time.monotonic() - start < 30, st["probe"]
            codes.append((await c.get("/ready")).status_code)
            await asyncio.sleep(0.1)
        assert set(codes) == {200}, codes  # through every failed probe, below the threshold and past it
        assert st["probe"]["reason"] == "timeout", st["probe"]
        assert st["server_health"]["ok"] and st["phase"] == "ready" and st["condition"] == "ready"
        assert any("busy, not broken" in n for n in st["notes"]), st["notes"]

        httpx.post(f"{stand_in}/_standin/fault", json={"fault": "hang"})
        died = time.monotonic()
        body = await wait_not_ready(c, timeout=(threshold + 1) * max(interval, 0.9 * deadline) + 1.0)
        took = time.monotonic() - died
    assert body["condition"] == "broken" and "GET /health did not answer" in " ".join(body["reasons"]), body
    print(f"a dead scheduler turned the pod not ready after {took:.2f}s")


async def test_a_dead_scheduler_on_an_idle_server_turns_ready_503_within_the_bound(
    engine, tmp_path, monkeypatch
):
    """The scheduler dies right after a good probe on an idle server, and /health takes SGLang's real
    SGLANG_HEALTH_CHECK_TIMEOUT (20 s) to answer 503, past the probe's own timeout: /ready turns 503 within
    (KDTREE_PROBE_FAILURE_THRESHOLD + 1) x max(KDTREE_PROBE_INTERVAL_S, 0.9 x KDTREE_PROBE_DEADLINE_S). The
    interval here is 0.9 x the deadline, where asking /health only after a failed probe took a whole interval
    longer (at the defaults: 41 s for a bound of 36 s)."""
    monkeypatch.delenv("SGLANG_HEALTH_CHECK_TIMEOUT", raising=False)  # SGLang's default, 20 s
    proc = engine("--fault", "hang", "--fault-after", "2")  # dies right after the second good completion
    deadline, threshold = 2.0, 3
    interval = 0.9 * deadline
    bound = (threshold + 1) * max(interval, 0.9 * deadline)
    settings = make_settings(
        tmp_path, proc.port, expected_tp_size=0, probe_interval_s=interval, probe_deadline_s=deadline
    )
    async with sidecar(settings, server=proc) as c:
        await wait_ready(c)
        died = None  # when the last good probe was answered: the scheduler's death
        deadline = time.monotonic() + 60
        while (r := await c.get("/ready")).status_code == 200:
            assert time.monotonic() < deadline, f"still ready after 60s: {r.json()}"
            probe = (await c.get("/status")).json()["probe"]
            if probe["ok"]:
                died = probe["at"]
            assert died is None or time.time() - died < 2 * bound, f"still ready: {r.json()}"
            await asyncio.sleep(0.05)
        assert died is not None, "no good probe seen before the scheduler died"
        took = time.time() - died
        st = (await c.get("/status")).json()
    print(
        f"a dead scheduler on an idle server turned the pod not ready after {took:.2f}s (bound {bound:.2f}s)"
    )
    # 0.6 s for this loop's polling and a busy machine; asking /health after the failed probe took 1.8 s more.
    assert took <= bound + 0.6, f"not ready only after {took:.2f}s, past the bound of {bound:.2f}s"
    assert r.json()["condition"] == "broken", r.json()
    assert "GET /health did not answer within 1.8s" in " ".join(r.json()["reasons"]), r.json()
    assert st["probe_failures_in_a_row"] == threshold, st


async def test_a_server_that_never_served_is_judged_by_the_completion_probe(engine, tmp_path):
    """Saturated from its start: SGLang's /health says 200, but no completion has proven the serving path yet."""
    proc = engine("--tp-size", "2", "--fault", "saturated", "--fault-delay", "30")
    settings = make_settings(
        tmp_path, proc.port, probe_interval_s=0.1, probe_deadline_s=1.5, ready_timeout_s=60
    )
    async with sidecar(settings, server=proc) as c:
        await asyncio.sleep(5 * 1.35)  # past the failure threshold
        body = (await c.get("/ready")).json()
        st = (await c.get("/status")).json()
    assert not body["ready"] and body["condition"] == "not_ready_yet", body
    assert "probe failed (timeout)" in body["reasons"][0] and st["server_health"]["ok"]


async def test_a_verdict_from_before_the_servers_latest_start_does_not_count(supervised, tmp_path):
    """The server restarts without the sidecar (a crash, then its restart policy): the last probe and the ranks'
    records are the previous server's, so /ready waits for a probe of the new one (none comes for a minute here)."""
    proc = supervised("--tp-size", "2", "--heartbeat-s", "0.2")
    async with sidecar(make_settings(tmp_path, proc.port, probe_interval_s=60), server=proc) as c:
        await wait_ready(c)
        first = read_process_record(tmp_path)
        os.kill(first.server_pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (read_process_record(tmp_path) or first).starts == first.starts:
            assert time.monotonic() < deadline, "the stand-in orchestrator did not start the server again"
            await asyncio.sleep(0.1)
        body = (await c.get("/ready")).json()
    assert not body["ready"], body
    assert any("no probe since the server's latest start yet" in r for r in body["reasons"]), body["reasons"]


# ---- SGLang's --api-key ----------------------------------------------------------------------------------------


async def test_the_probe_sends_the_servers_api_key(engine, tmp_path):
    """A server started with --api-key (the stand-in checks it as SGLang's middleware does) becomes ready only with
    KDTREE_SERVER_API_KEY; the key never shows in /ready or /status."""
    key = "sk-standin-0123456789"
    proc = engine("--tp-size", "2", "--api-key", key)
    async with sidecar(make_settings(tmp_path, proc.port)) as c:
        body = (await c.get("/ready")).json()
    assert not body["ready"] and "answered HTTP 401" in body["reasons"][0], body
    assert "set KDTREE_SERVER_API_KEY" in body["reasons"][0]
    async with sidecar(make_settings(tmp_path, proc.port, server_api_key=key)) as c:
        body = await wait_ready(c)
        status = (await c.get("/status")).text
    assert body["ready"] and key not in status and key not in str(body)
    assert repr(make_settings(tmp_path, proc.port, server_api_key=key)).count(key) == 0


async def test_the_api_docs_are_not_served(tmp_path):
    """No /docs, /redoc or /openapi.json: docs/configuration.md documents the API, and an open schema maps the admin endpoint."""
    async with sidecar(make_settings(tmp_path, free_port())) as c:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await c.get(path)).status_code == 404, path
