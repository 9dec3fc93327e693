"""The server under the entrypoint's supervisor, and the sidecar's process control that reads and signals it.

The supervised commands are small Python programs (no SGLang): what matters is what the supervisor does
with their output, their signals and their exit, and what ServerProcess makes of the files it writes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from entrypoint import launch
from entrypoint.supervise import MIN_LOG_MAX_BYTES, StopRequested, Supervisor
from kdtree.config import ConfigError, Mode
from kdtree.state.pids import own_pid_ns, pid_alive
from kdtree.state.process_record import (
    HEARTBEAT_S,
    ServerProcessRecord,
    log_path,
    process_path,
    read_process_record,
    write_process_record,
)
from kdtree.state.restart_request import (
    REQUEST_POLL_S,
    RestartRequest,
    read_restart_request,
    write_restart_request,
)
from sidecar.server_control import ServerMissing
from sidecar.server_control.process import STALE_S, ProcessControlError, ServerProcess
from sidecar.server_log import crash_excerpt
from sidecar.settings import SidecarSettings

REPO = Path(__file__).resolve().parents[2]

# Prints its pid and process group, then waits; SIGTERM: says so and exits 0 (as SGLang stops on it).
SERVER = textwrap.dedent(
    """
    import os, signal, sys, time
    def stop(signum, frame):
        print(f"got {signal.Signals(signum).name}", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop if sys.argv[1:] != ["ignore"] else signal.SIG_IGN)
    print(f"serving pid={os.getpid()} pgid={os.getpgrp()}", flush=True)
    time.sleep(120)
    """
)


def supervise(state_dir, *command, env=None, **popen) -> subprocess.Popen:
    """`python -m entrypoint.supervise COMMAND...` with state_dir as KDTREE_STATE_DIR."""
    env = {**os.environ, "KDTREE_STATE_DIR": str(state_dir), "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "entrypoint.supervise", *command],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def serving(state_dir) -> ServerProcessRecord:
    """The record once the server has started and printed its first line."""
    wait_for(lambda: "serving pid=" in log_path(state_dir).read_text() if log_path(state_dir).exists() else 0)
    return read_process_record(state_dir)


def log_lines(state_dir) -> list[str]:
    return log_path(state_dir).read_text().splitlines()


# ---- output ----------------------------------------------------------------------------------------


def test_output_goes_to_both_streams_and_the_log_and_the_exit_status_is_the_servers(tmp_path):
    code = (
        "import sys; print('to stdout'); print('to stderr', file=sys.stderr); "
        "sys.stdout.write('last words, no newline'); sys.exit(3)"
    )
    p = supervise(tmp_path, sys.executable, "-c", code)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 3
    assert out.decode() == "to stdout\nlast words, no newline"
    assert err.decode().splitlines() == ["to stderr", "kdtree launcher: the server exited with status 3"]
    lines = log_lines(tmp_path)
    assert lines[0].startswith("kdtree launcher: server start #1 at ") and lines[0].endswith(f"pid {p.pid}")
    assert set(lines[1:4]) == {"to stdout", "to stderr", "last words, no newline"}
    assert lines[4:] == ["kdtree launcher: the server exited with status 3"]
    rec = read_process_record(tmp_path)
    assert rec.pid == p.pid and rec.pid_ns == own_pid_ns() and rec.starts == 1
    assert rec.exit_code == 3 and rec.signal is None and rec.stop_signal is None
    assert rec.exited_at >= rec.started_at and rec.server_pid not in (None, p.pid)
    assert oct(log_path(tmp_path).stat().st_mode & 0o777) == "0o640"

    p = supervise(tmp_path, sys.executable, "-c", "pass")
    p.communicate(timeout=30)
    assert p.returncode == 0 and read_process_record(tmp_path).starts == 2


def test_the_log_rotates_at_its_cap_without_losing_or_splitting_lines(tmp_path):
    code = "for i in range(4000): print(f'line {i:05d} ' + 'x' * 90)"
    p = supervise(
        tmp_path, sys.executable, "-c", code, env={"KDTREE_SERVER_LOG_MAX_BYTES": str(MIN_LOG_MAX_BYTES)}
    )
    p.communicate(timeout=60)
    assert p.returncode == 0
    current, older = log_path(tmp_path), tmp_path / "server.log.1"
    assert current.stat().st_size <= MIN_LOG_MAX_BYTES and older.stat().st_size <= MIN_LOG_MAX_BYTES
    lines = [
        x for x in older.read_text().splitlines() + current.read_text().splitlines() if x.startswith("line")
    ]
    numbers = [int(x.split()[1]) for x in lines]
    assert numbers == list(range(numbers[0], 4000))  # consecutive and complete up to the last one
    assert all(len(x) == 101 for x in lines)
    assert log_lines(tmp_path)[-1] == "kdtree launcher: the server exited with status 0"


def test_a_long_run_without_newline_is_cut_into_lines(tmp_path):
    p = supervise(tmp_path, sys.executable, "-c", "import sys; sys.stdout.write('y' * 200000)")
    out, _ = p.communicate(timeout=30)
    assert len(out) == 200000  # passed on unchanged
    ys = [x for x in log_lines(tmp_path) if x.startswith("y")]
    assert "".join(ys) == "y" * 200000 and max(map(len, ys)) <= 64 * 1024


def test_no_log_file_when_the_cap_is_zero(tmp_path):
    p = supervise(tmp_path, sys.executable, "-c", "print('hi')", env={"KDTREE_SERVER_LOG_MAX_BYTES": "0"})
    assert p.communicate(timeout=30)[0] == b"hi\n" and p.returncode == 0
    assert not log_path(tmp_path).exists() and read_process_record(tmp_path).exit_code == 0
    with pytest.raises(ProcessControlError, match="KDTREE_SERVER_LOG_MAX_BYTES=0"):
        ServerProcess(tmp_path).logs(10)


def test_a_bad_log_cap_is_refused_naming_the_fix(tmp_path, monkeypatch, capsys):
    p = supervise(tmp_path, "true", env={"KDTREE_SERVER_LOG_MAX_BYTES": "100"})
    _, err = p.communicate(timeout=30)
    assert p.returncode == 2 and b"KDTREE_SERVER_LOG_MAX_BYTES='100' is invalid: must be 0" in err
    # The launcher names it like its other settings, in its one error line.
    monkeypatch.setenv("KDTREE_SERVER_LOG_MAX_BYTES", "100")
    with pytest.raises(
        ConfigError,
        match=r"KDTREE_SERVER_LOG_MAX_BYTES=.100. is invalid: must be 0 .*; fix: set it to a byte",
    ):
        launch.LauncherSettings.load()


# ---- signals ---------------------------------------------------------------------------------------


def test_sigterm_is_passed_on_and_the_last_lines_are_kept(tmp_path):
    p = supervise(tmp_path, sys.executable, "-c", SERVER)
    rec = serving(tmp_path)
    assert f"serving pid={rec.server_pid} pgid={rec.server_pid}" in log_lines(tmp_path)  # its own group
    sent = time.time()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0 and out.decode().splitlines()[-1] == "got SIGTERM"
    lines = log_lines(tmp_path)
    assert "got SIGTERM" in lines and lines[-1] == "kdtree launcher: the server exited with status 0"
    rec = read_process_record(tmp_path)
    assert rec.stop_signal == "SIGTERM" and rec.exit_code == 0 and rec.signal is None
    assert sent <= rec.stop_signal_at <= rec.exited_at
    # The stop and its time, in the log and on stderr (docker logs): when the server was told to stop.
    (stop,) = [x for x in lines if x.startswith("kdtree launcher: SIGTERM at ")]
    assert stop.endswith(f"(t={rec.stop_signal_at:.3f}): stopping the server") and stop in err.decode()
    state = ServerProcess(tmp_path).inspect()
    assert state.status == "exited" and state.exit_code == 0 and not state.oom_killed


def test_a_server_killed_by_a_signal_exits_128_plus_the_signal(tmp_path):
    p = supervise(tmp_path, sys.executable, "-c", SERVER)
    os.kill(serving(tmp_path).server_pid, signal.SIGKILL)  # as the OOM killer would
    _, err = p.communicate(timeout=30)
    assert p.returncode == 137
    assert (
        err.decode().splitlines()[-1] == "kdtree launcher: the server was killed by SIGKILL (exit status 137)"
    )
    rec = read_process_record(tmp_path)
    assert rec.signal == "SIGKILL" and rec.exit_code == 137 and rec.stop_signal is None
    state = ServerProcess(tmp_path).inspect()
    assert state.crashed and state.exit_code == 137 and state.oom_killed and "OOM" in state.error
    excerpt = crash_excerpt(ServerProcess(tmp_path).logs(100, since=rec.started_at))
    assert excerpt == ["kdtree launcher: the server was killed by SIGKILL (exit status 137)"]


def test_a_killed_launcher_takes_the_server_with_it_and_reads_as_killed(tmp_path):
    p = supervise(tmp_path, sys.executable, "-c", SERVER)
    rec = serving(tmp_path)
    assert ServerProcess(tmp_path).inspect().running
    p.kill()
    p.wait(10)
    wait_for(lambda: not pid_alive(rec.server_pid, rec.server_start_ticks))  # PDEATHSIG
    state = ServerProcess(tmp_path).inspect()
    assert state.status == "exited" and state.crashed and state.exit_code == 137 and state.oom_killed
    assert "recorded no exit status" in state.error
    assert read_process_record(tmp_path).exited_at is None


def test_a_stop_signal_before_the_server_started_ends_the_launcher(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    sup = Supervisor(tmp_path, MIN_LOG_MAX_BYTES).begin()
    with pytest.raises(StopRequested) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler raises in this thread
    assert sup.stopped(stop.value) == 128 + signal.SIGTERM
    rec = read_process_record(tmp_path)
    assert rec.exit_code == 143 and rec.stop_signal == "SIGTERM" and rec.server_pid is None
    assert log_lines(tmp_path)[-1] == "kdtree launcher: stopped by SIGTERM before the server started"
    assert signal.getsignal(signal.SIGTERM) == previous  # the handlers are back


# ---- the launcher ------------------------------------------------------------------------------------


def test_the_launcher_records_a_refused_configuration(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KDTREE_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("KDTREE_VERIFY", "shadow")
    assert launch.main(["--model-path", "/nowhere"]) == launch.EXIT_CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kdtree launcher: error: KDTREE_VERIFY='shadow'")
    rec = read_process_record(tmp_path)
    assert rec.exit_code == 2 and rec.server_pid is None
    control = ServerProcess(tmp_path)
    state = control.inspect()
    assert state.crashed and state.exit_code == 2
    assert crash_excerpt(control.logs(100, since=state.started_at)) == [err[0]]


def test_the_launcher_serves_through_the_supervisor(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("KDTREE_STATE_DIR", str(tmp_path))
    code = "import os; print('mode', os.environ['KDTREE_VERIFY'], os.environ['PYTHONUNBUFFERED'])"
    plan = launch.Plan(Mode.VALIDATE, "test", [sys.executable, "-c", code], "kdtree launcher: mode=validate")
    monkeypatch.setattr(launch, "plan", lambda argv, **probes: plan)
    assert launch.main([], environ={"PATH": os.environ["PATH"]}) == 0
    out, err = capfd.readouterr()
    assert out == "mode validate 1\n"
    assert err.splitlines() == [
        "kdtree launcher: mode=validate",
        "kdtree launcher: the server exited with status 0",
    ]
    assert log_lines(tmp_path)[1:] == [
        "kdtree launcher: mode=validate",
        "mode validate 1",
        "kdtree launcher: the server exited with status 0",
    ]


# ---- process control: the record, the log ----------------------------------------------------------


def test_no_record_means_no_server_yet(tmp_path):
    with pytest.raises(ServerMissing, match="server-process.json is absent"):
        ServerProcess(tmp_path).inspect()


def test_a_launcher_in_another_pid_namespace_is_judged_by_its_heartbeat(tmp_path):
    """Its pid means nothing here (pid 1 is the launcher of its own container): the heartbeat says whether it lives."""
    now = time.time()
    rec = ServerProcessRecord(pid=1, pid_ns="pid:[1]", started_at=now - 60, heartbeat_at=now - 1)
    write_process_record(tmp_path, rec)
    assert ServerProcess(tmp_path).inspect().running
    write_process_record(tmp_path, rec.model_copy(update={"heartbeat_at": now - STALE_S - 1}))
    state = ServerProcess(tmp_path).inspect()
    assert state.crashed and state.exit_code == 137 and "its heartbeat stopped" in state.error
    write_process_record(tmp_path, rec.model_copy(update={"heartbeat_at": None}))  # an older entrypoint
    with pytest.raises(
        ProcessControlError, match=r"no heartbeat .* run the server image of this sidecar's version"
    ):
        ServerProcess(tmp_path).inspect()


def test_the_launcher_keeps_its_heartbeat_while_the_server_runs(tmp_path):
    p = supervise(tmp_path, sys.executable, "-c", SERVER)
    serving(tmp_path)
    beats = []
    for _ in range(2):
        last = read_process_record(tmp_path).heartbeat_at
        wait_for(lambda last=last: read_process_record(tmp_path).heartbeat_at > last, timeout=HEARTBEAT_S * 3)
        beats.append(read_process_record(tmp_path).heartbeat_at)
    assert HEARTBEAT_S * 0.9 <= beats[1] - beats[0] <= HEARTBEAT_S + 1
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=30)


def test_a_reused_pid_is_not_the_server(tmp_path):
    rec = ServerProcessRecord(pid=os.getpid(), pid_ns=own_pid_ns(), pid_start_ticks=1, started_at=time.time())
    write_process_record(tmp_path, rec)
    state = ServerProcess(tmp_path).inspect()
    assert state.status == "exited" and state.exit_code == 137


def test_an_unreadable_record_is_an_error(tmp_path):
    process_path(tmp_path).write_text("{not json")
    with pytest.raises(ProcessControlError, match="unreadable"):
        ServerProcess(tmp_path).inspect()


def test_logs_since_a_start_leave_out_the_starts_before_it(tmp_path):
    for n in range(3):
        p = supervise(tmp_path, sys.executable, "-c", f"print('run {n}')")
        p.communicate(timeout=30)
    rec = read_process_record(tmp_path)
    control = ServerProcess(tmp_path)
    mine = control.logs(100, since=rec.started_at).splitlines()
    assert mine[0].startswith("kdtree launcher: server start #3") and "run 2" in mine and "run 1" not in mine
    everything = control.logs(100).splitlines()
    assert [x for x in everything if x.startswith("run")] == ["run 0", "run 1", "run 2"]
    assert control.logs(2).splitlines() == ["run 2", "kdtree launcher: the server exited with status 0"]


def test_logs_read_across_the_rotated_file(tmp_path):
    code = "for i in range(1000): print(f'line {i:05d} ' + 'x' * 90)"  # rotates once, at about line 640
    p = supervise(
        tmp_path, sys.executable, "-c", code, env={"KDTREE_SERVER_LOG_MAX_BYTES": str(MIN_LOG_MAX_BYTES)}
    )
    p.communicate(timeout=60)
    assert (tmp_path / "server.log.1").exists()
    rec = read_process_record(tmp_path)
    lines = ServerProcess(tmp_path).logs(900, since=rec.started_at).splitlines()
    assert len(lines) == 900 and lines[-1].startswith("kdtree launcher: the server exited")
    assert [int(x.split()[1]) for x in lines[:-1]] == list(range(101, 1000))


# ---- process control: restart ------------------------------------------------------------------------


class Orchestrator:
    """Starts the supervised server again whenever it exits, as a restart policy does."""

    def __init__(self, state_dir, *command):
        self.state_dir, self.command = state_dir, command
        self.procs: list[subprocess.Popen] = []
        self.closing = threading.Event()
        self.procs.append(self._spawn())
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _spawn(self) -> subprocess.Popen:
        env = {**os.environ, "KDTREE_STATE_DIR": str(self.state_dir), "PYTHONPATH": str(REPO)}
        return subprocess.Popen(
            [sys.executable, "-m", "entrypoint.supervise", *self.command],
            env=env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _watch(self) -> None:
        while not self.closing.is_set():
            self.procs[-1].wait()
            if not self.closing.wait(0.1):
                self.procs.append(self._spawn())

    def close(self) -> None:
        self.closing.set()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def orchestrated(tmp_path):
    made = []

    def start(*command) -> Orchestrator:
        o = Orchestrator(tmp_path, *command)
        made.append(o)
        return o

    yield start
    for o in made:
        o.close()


def test_restart_stops_the_server_and_waits_for_the_next_start(tmp_path, orchestrated):
    """No signal from the sidecar: a request in the state volume, which the launcher acts on as on a SIGTERM."""
    o = orchestrated(sys.executable, "-c", SERVER)
    first = serving(tmp_path)
    control = ServerProcess(tmp_path, restart_wait_s=10, poll_s=0.05)
    control.restart(stop_timeout_s=5)
    second = read_process_record(tmp_path)
    assert second.starts == first.starts + 1 and second.pid != first.pid
    assert len(o.procs) == 2 and o.procs[0].returncode == 0  # stopped by SIGTERM, passed on
    state = control.inspect()
    assert state.running and state.restart_count == 1 and state.started_at == second.started_at
    request = read_restart_request(tmp_path)
    assert request.start == first.starts and second.restart_request is None  # the new start ignores it
    log = "\n".join(log_lines(tmp_path))
    assert f"restart request {request.id} from the sidecar" in log and "got SIGTERM" in log


def test_the_launcher_acts_on_a_request_for_its_own_start_only(tmp_path):
    p = supervise(tmp_path, sys.executable, "-c", SERVER)
    rec = serving(tmp_path)
    stale = RestartRequest(id="old", start=rec.starts - 1 or 99, requested_at=time.time(), stop_timeout_s=5)
    write_restart_request(tmp_path, stale)
    time.sleep(REQUEST_POLL_S * 3)
    assert p.poll() is None and read_process_record(tmp_path).restart_request is None
    asked = time.time()
    write_restart_request(tmp_path, stale.model_copy(update={"id": "mine", "start": rec.starts}))
    assert p.wait(10) == 0
    done = read_process_record(tmp_path)
    assert done.restart_request == "mine" and done.stop_signal == "SIGTERM" and done.exit_code == 0
    assert asked <= done.stop_signal_at <= asked + REQUEST_POLL_S * 3


def test_restart_kills_a_server_that_ignores_sigterm(tmp_path, orchestrated):
    """The launcher itself SIGKILLs the server's group after the request's stop timeout, and exits as SIGKILL's."""
    o = orchestrated(sys.executable, "-c", SERVER, "ignore")
    first = serving(tmp_path)
    started = time.monotonic()
    ServerProcess(tmp_path, restart_wait_s=10, poll_s=0.05).restart(stop_timeout_s=1)
    assert time.monotonic() - started >= 1
    assert o.procs[0].returncode == 128 + signal.SIGKILL
    assert not pid_alive(first.server_pid, first.server_start_ticks)
    assert read_process_record(tmp_path).starts == 2
    assert (
        "did not stop within the restart request's stop_timeout_s: SIGKILL" in log_path(tmp_path).read_text()
    )


def test_a_restart_request_nobody_acts_on_is_a_failure_naming_the_fix(tmp_path):
    """A launcher that writes its heartbeat but never acts (hung, or an entrypoint of another version)."""
    now = time.time()
    write_process_record(
        tmp_path, ServerProcessRecord(pid=1, pid_ns="pid:[1]", started_at=now, heartbeat_at=now)
    )
    started = time.monotonic()
    with pytest.raises(
        ProcessControlError, match=r"did not act on the restart request .* within 0.5s.*by hand"
    ):
        ServerProcess(tmp_path, restart_wait_s=5, poll_s=0.05, ack_s=0.5).restart(stop_timeout_s=5)
    assert time.monotonic() - started < 2
    assert read_restart_request(tmp_path).start == 1


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare (util-linux)")
def test_as_pid_1_the_launcher_reaps_orphans(tmp_path):
    """In its own PID namespace (a container without an init), orphans come to the launcher: none stays a zombie."""
    script = tmp_path / "orphans.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, sys, time
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            for _ in range(3):  # grandchildren whose parent exits at once: orphans, reparented to pid 1
                child = os.fork()
                if child == 0:
                    if os.fork() == 0:
                        time.sleep(0.5)
                        os._exit(0)
                    os._exit(0)
                os.waitpid(child, 0)
            time.sleep(1.5)
            zombies = [p for p in os.listdir("/proc") if p.isdigit()
                       and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"]
            print("zombies", len(zombies), flush=True)
            time.sleep(120)
            """
        )
    )
    env = {**os.environ, "KDTREE_STATE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-m", "entrypoint.supervise",
           sys.executable, str(script)]  # fmt: skip
    p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = p.stdout.readline().decode()
    finally:
        p.kill()  # --kill-child: unshare's death SIGKILLs the namespace's pid 1, and with it the namespace
        p.communicate(timeout=30)
    if not line:
        pytest.skip("unshare --pid is not permitted here")
    assert line.strip() == "zombies 0"


def test_restart_names_the_restart_policy_when_nothing_starts_the_server(tmp_path):
    p = supervise(tmp_path, sys.executable, "-c", SERVER)
    serving(tmp_path)
    with pytest.raises(ProcessControlError, match="did not start again within .*restart: unless-stopped"):
        ServerProcess(tmp_path, restart_wait_s=1, poll_s=0.05).restart(stop_timeout_s=5)
    assert p.wait(10) == 0


# ---- settings --------------------------------------------------------------------------------------


def test_server_control_setting_is_validated_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("KDTREE_SERVER_CONTROL", "socket")
    with pytest.raises(ConfigError) as e:
        SidecarSettings.load(admin_token="t", state_dir=str(tmp_path))
    assert str(e.value).startswith("KDTREE_SERVER_CONTROL='socket' is invalid: set it to process")
    assert "compose/docker.yaml" in str(e.value)
    monkeypatch.setenv("KDTREE_SERVER_CONTROL", "docker")
    assert SidecarSettings.load(admin_token="t").server_control == "docker"
    monkeypatch.delenv("KDTREE_SERVER_CONTROL")
    assert SidecarSettings.load(admin_token="t").server_control == "process"


def test_record_format_is_plain_json(tmp_path):
    rec = ServerProcessRecord(
        pid=7, pid_ns="pid:[4]", starts=3, started_at=1.5, exit_code=143, stop_signal="SIGTERM"
    )
    write_process_record(tmp_path, rec)
    doc = json.loads(process_path(tmp_path).read_text())
    assert doc["schema_version"] == 1 and doc["pid"] == 7 and doc["starts"] == 3 and doc["exit_code"] == 143
    assert not list(tmp_path.glob("*.tmp"))
