"""Commands under a stand-in orchestrator (`Orchestrated`, a restart policy), controlled through the sidecar's real
process control; and the stand-in engine under the server entrypoint's real supervisor (`SupervisedStandin`).

SupervisedStandin runs `python -m entrypoint.supervise python standins/standin_engine.py ...`: the supervising
code the server image's launcher runs SGLang with (entrypoint/supervise.py), around standins/standin_engine.py,
a stand-in that is NOT SGLang (it keeps SGLang's startup log and HTTP contract and writes the per-rank
records). So the state file (server-process.json) and the log (server.log) the sidecar reads are produced
by the real entrypoint code. The launcher's configuration checks are not run: they need a GPU. The real
server on a GPU runs the same way with the launcher itself (kernel_build/bench/harness/real_server.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from standin_engine import wait_port

from kdtree.state.process_record import read_process_record
from sidecar.server_control.process import ServerProcess

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "standins" / "standin_engine.py"


class Orchestrated:
    """A command under a stand-in orchestrator, as a container under its restart policy: when the command exits it
    is started again, after restart_delay_s when it was stopped on request (the sidecar's SIGTERM) and after
    crash_restart_delay_s when it ended by itself (Docker's backoff, stretched so a test sees the crash). Its output
    goes to `console` (what `docker logs` would show). The sidecar controls it through `control`, a
    sidecar.server_control.process.ServerProcess over `state_dir`: the process control `python -m sidecar` uses with
    KDTREE_SERVER_CONTROL=process. Subclasses say what runs (`command()`)."""

    name = "orchestrated command"

    def __init__(
        self,
        state_dir: str,
        *,
        env: dict | None = None,
        console: Path | None = None,
        restart_wait_s: float = 3.0,
        restart_delay_s: float = 0.05,
        crash_restart_delay_s: float = 2.0,
    ):
        self.state_dir = str(state_dir)
        self.control = ServerProcess(state_dir, restart_wait_s=restart_wait_s, poll_s=0.05)
        self.restart_wait_s = restart_wait_s
        self.restart_delay_s, self.crash_restart_delay_s = restart_delay_s, crash_restart_delay_s
        self.env = {**os.environ, **(env or {}), "KDTREE_STATE_DIR": self.state_dir}
        self.console = console or Path(state_dir) / "console.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._hold_until = 0.0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self.cwd = REPO

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def restart_failures(self) -> int:
        return 0

    @restart_failures.setter
    def restart_failures(self, n: int) -> None:
        """The next n restarts fail: the orchestrator does not start the server again within the sidecar's
        KDTREE_RESTART_WAIT_S for each of them (as a slow or stopped restart policy would), then does."""
        self._hold_until = time.monotonic() + n * self.restart_wait_s + 1.5

    def start(self):
        self._spawn()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()
        return self

    def _spawn(self) -> None:
        with self._lock:
            if self._closing.is_set():
                return
            with self.console.open("ab") as out:
                self.proc = subprocess.Popen(
                    self.command(), stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd
                )
            self.starts += 1

    def _watch(self) -> None:
        while not self._closing.is_set():
            proc = self.proc
            proc.wait()
            if self._closing.is_set():
                return
            try:
                rec = read_process_record(self.state_dir)
            except ValueError:
                rec = None
            requested = rec is not None and rec.stop_signal is not None
            delay = self.restart_delay_s if requested else self.crash_restart_delay_s
            delay = max(delay, self._hold_until - time.monotonic())
            if self._closing.wait(delay):
                return
            self._spawn()

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closing.set()
            proc = self.proc
        if proc and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._watcher:
            self._watcher.join(timeout)

    # ---- the ServerControl interface: the real process control -------------------------------------

    def inspect(self):
        return self.control.inspect()

    def logs(self, tail: int, since: float | None = None) -> str:
        return self.control.logs(tail, since)

    def restart(self, stop_timeout_s: int) -> None:
        self.control.restart(stop_timeout_s)


class SupervisedStandin(Orchestrated):
    """standins/standin_engine.py under the server entrypoint's supervisor (python -m entrypoint.supervise), orchestrated.
    It has StandinProcess's attributes (port, proc, starts, restart_failures, logs/inspect/restart), so the same tests
    drive either."""

    name = "stand-in (process control)"

    def __init__(self, port: int, state_dir: str, args=(), *, env: dict | None = None, **timing):
        pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        super().__init__(state_dir, env={**(env or {}), "PYTHONPATH": pythonpath},
                         console=Path(state_dir) / f"console-{port}.log", **timing)  # fmt: skip
        self.port, self.args = port, list(args)

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "entrypoint.supervise", sys.executable, str(STANDIN)]
        return cmd + ["--port", str(self.port), "--state-dir", self.state_dir, *self.args]

    def wait_port(self, timeout: float = 10.0) -> None:
        wait_port(self.port, timeout, "supervised stand-in")
