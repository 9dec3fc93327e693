"""The server as a supervised child: its output teed into a size-capped log, its life in a state file.

The launcher (entrypoint.launch) checks the configuration, then runs SGLang as its child through a
Supervisor instead of exec'ing it, so that the sidecar can follow and restart the server without the
Docker socket (KDTREE_SERVER_CONTROL=process, sidecar/server_control/process.py):

- output: each chunk the server writes goes straight on to the launcher's own stdout or stderr (what
  `docker logs` and `kubectl logs` show is unchanged), and line by line into KDTREE_STATE_DIR/server.log,
  which moves to server.log.1 when the next line would take it past KDTREE_SERVER_LOG_MAX_BYTES (so at most
  twice that on disk). Each start opens its part of the file with a START_MARK line (the file only).
- state: KDTREE_STATE_DIR/server-process.json, replaced atomically, holds the launcher's pid, pid
  namespace and kernel start time, the server's pid, the number of starts seen on this volume, and once the
  server has ended its exit status. It is written before the launcher reads the mode file, so a sidecar that
  restarts the server after writing the mode file never mistakes an older start for the new one. A pid that
  is gone while the file records no exit status was killed with SIGKILL (an OOM kill looks like that).
- heartbeat: while the launcher runs it rewrites the state file every HEARTBEAT_S seconds (`heartbeat_at`):
  how the sidecar, in another container and PID namespace, knows it is alive (a pid from another namespace
  means nothing there).
- signals: SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 are passed on to the server, which runs in
  its own process group (a terminal's Ctrl-C reaches it once, through the launcher) with PDEATHSIG=SIGKILL
  (it never outlives the launcher). A stop signal that arrives before the server has started ends the
  launcher at once. The launcher exits with the server's status, 128+N when signal N killed it, after
  the last line has been copied (whatever the server's own children left is killed with its group). The
  first stop signal and its time are recorded (`stop_signal`, `stop_signal_at`) and logged. An orchestrator's
  stop is bounded by the orchestrator's grace period (compose `stop_grace_period`, Kubernetes
  `terminationGracePeriodSeconds`): the launcher waits for the server as long as it lives.
- restart requests: the sidecar restarts the server without a signal across containers. It writes
  KDTREE_STATE_DIR/restart-request.json naming this start; the launcher, polling every REQUEST_POLL_S,
  records the request's id (`restart_request`: the sidecar's acknowledgement), stops the server as the
  orchestrator's SIGTERM would (it sends SIGTERM to itself), SIGKILLs the server's process group when it has
  not exited within the request's stop_timeout_s, and exits; the restart policy starts the container again.
  A request for an earlier start is ignored.
- init: as the container's PID 1 (its own PID namespace, no init of the runtime's), the launcher reaps the
  orphans that the kernel hands it while the server runs, so none stays a zombie.

`python -m entrypoint.supervise COMMAND [ARG...]` runs any command this way, without the launcher's checks:
the CPU stand-in stack in CI runs the stand-in engine through it, so that its log and state file come
from this code.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from pydantic import field_validator

from kdtree.config import StateDirSettings
from kdtree.state.pids import own_pid_ns, proc_stat
from kdtree.state.process_record import (
    HEARTBEAT_S,
    READER_DRAIN_S,
    ServerProcessRecord,
    iso_time,
    log_path,
    process_path,
    read_process_record,
    start_mark,
    write_process_record,
)
from kdtree.state.restart_request import REQUEST_POLL_S, RestartRequest, read_restart_request

DEFAULT_LOG_MAX_BYTES = 10 * 1024 * 1024
MIN_LOG_MAX_BYTES = 64 * 1024
MAX_LOG_LINE = 64 * 1024  # a longer run of output without a newline is written as several lines
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
FORWARDED = (*STOP_SIGNALS, signal.SIGUSR1, signal.SIGUSR2)
EXIT_USAGE = 2


class SupervisorSettings(StateDirSettings):
    """Where the state file and the log go (state_dir), and the log's cap (KDTREE_SERVER_LOG_MAX_BYTES=0: no log
    file)."""

    fixes: ClassVar[dict[str, str]] = {
        "KDTREE_SERVER_LOG_MAX_BYTES": "set it to a byte count, e.g. 10485760 (10 MiB), or 0 for no log file",
    }

    server_log_max_bytes: int = DEFAULT_LOG_MAX_BYTES

    @field_validator("server_log_max_bytes")
    @classmethod
    def _cap(cls, v: int) -> int:
        if v != 0 and not MIN_LOG_MAX_BYTES <= v <= 2**40:
            raise ValueError(f"must be 0 (no log file) or between {MIN_LOG_MAX_BYTES} and 2**40 bytes")
        return v


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RotatingLog:
    """Lines appended to one file that moves to `<file>.1` when the next line would pass max_bytes.

    Written by one process (the launcher; its reader threads share it under a lock). A write that fails
    (disk full, volume gone) turns the file off with one warning: the server keeps running."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.size = 0
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._open()
        except OSError as e:
            self._fail(e)

    def _open(self) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        self.size = os.fstat(self.fd).st_size

    def _fail(self, e: OSError) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.fd = None
        print(f"kdtree launcher: warning: not writing {self.path} any more: {e}", file=sys.stderr, flush=True)

    def write_line(self, line: bytes) -> None:
        """One line, newline included."""
        with self.lock:
            if self.fd is None:
                return
            try:
                if self.size and self.size + len(line) > self.max_bytes:
                    os.close(self.fd)
                    self.fd = None
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                    self._open()
                view = memoryview(line)
                while view:
                    view = view[os.write(self.fd, view) :]
                self.size += len(line)
            except OSError as e:
                self._fail(e)

    def close(self) -> None:
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


class StopRequested(Exception):
    """A stop signal arrived before the server was started."""

    def __init__(self, signum: int):
        super().__init__(signal_name(signum))
        self.signum = signum


def _die_with_parent():
    """preexec_fn for the server: SIGKILL when the launcher dies (Linux prctl), exit if it already has."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, before the fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


class Supervisor:
    """One start of the server: its state record, its log file, the child, and the signals.

    begin() records the start, then takes over the signals (from then on a stop signal raises StopRequested
    until the server runs, and is passed on to it after); run() starts the command and returns its exit
    status once it has ended and been recorded; finish() records an end without a server (a refused
    configuration), stopped() one by a stop signal before the start. After each, the old handlers are back."""

    def __init__(self, state_dir: str | os.PathLike, log_max_bytes: int):
        self.state_dir = Path(state_dir)
        self.log = RotatingLog(log_path(state_dir), log_max_bytes) if log_max_bytes else None
        self.child: subprocess.Popen | None = None
        self._phase = "before"  # before -> spawning -> running -> done
        self._pending: list[int] = []
        self._saved: dict[int, object] = {}
        self.record: ServerProcessRecord | None = None
        self._lock = threading.Lock()  # the record's writes, and the phase against the watcher's SIGKILL
        self._done = threading.Event()
        self._stop_noted = False  # the watcher has persisted and logged the stop signal
        self._kill_at: float | None = None  # monotonic time of the SIGKILL a restart request set
        self._watcher: threading.Thread | None = None
        self._save_error: str | None = None

    def begin(self) -> Supervisor:
        self._record_start()
        self._take_signals()
        self._watcher = threading.Thread(target=self._watch, name="kdtree-supervisor", daemon=True)
        self._watcher.start()
        return self

    # ---- state -----------------------------------------------------------------------------------

    def _record_start(self) -> None:
        try:
            previous = read_process_record(self.state_dir)
        except ValueError:
            previous = None
        pid = os.getpid()
        stat = proc_stat(pid)
        self.record = ServerProcessRecord(
            pid=pid,
            pid_ns=own_pid_ns(),
            pid_start_ticks=stat[1] if stat else None,
            hostname=socket.gethostname(),
            starts=(previous.starts + 1) if previous else 1,
            started_at=time.time(),
        )
        self.record.heartbeat_at = self.record.started_at
        self._save()
        self.log_line(start_mark(self.record.starts, self.record.started_at, pid))

    def _save(self) -> None:
        try:
            with self._lock:
                write_process_record(self.state_dir, self.record)
        except OSError as e:
            if str(e) != self._save_error:  # once per problem, not at every heartbeat
                print(
                    f"kdtree launcher: warning: cannot write {process_path(self.state_dir)}: {e}",
                    file=sys.stderr,
                    flush=True,
                )
            self._save_error = str(e)
        else:
            self._save_error = None

    def log_line(self, text: str) -> None:
        """A line of the launcher's own into the log file (not to stdout/stderr)."""
        if self.log is not None:
            self.log.write_line(text.encode(errors="replace") + b"\n")

    # ---- signals ---------------------------------------------------------------------------------

    def _take_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers (tests calling in from elsewhere)
        for sig in FORWARDED:
            self._saved[sig] = signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def _on_signal(self, signum: int, frame) -> None:
        # No file or lock here (the main thread may hold either): the watcher persists and logs the stop.
        if signum in STOP_SIGNALS and self.record and self.record.stop_signal is None:
            self.record.stop_signal, self.record.stop_signal_at = signal_name(signum), time.time()
        if self._phase == "before":
            if signum in STOP_SIGNALS:
                raise StopRequested(signum)
        elif self._phase == "spawning":
            self._pending.append(signum)
        elif self._phase == "running":
            try:
                os.kill(self.child.pid, signum)
            except ProcessLookupError:
                pass

    # ---- the watcher: heartbeat, restart requests, orphans -----------------------------------------

    def _watch(self) -> None:
        next_beat = 0.0
        while not self._done.wait(REQUEST_POLL_S):
            request = read_restart_request(self.state_dir)
            if (
                request is not None
                and request.start == self.record.starts
                and not self.record.restart_request
            ):
                self._act_on(request)
            if self._note_stop():
                next_beat = 0.0  # persist it now
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self._kill_at = None
                self._kill_server()
            if os.getpid() == 1:
                self._reap_orphans()
            if time.monotonic() >= next_beat:
                self.record.heartbeat_at = time.time()
                self._save()
                next_beat = time.monotonic() + HEARTBEAT_S

    def _act_on(self, request: RestartRequest) -> None:
        """Stop as the orchestrator's SIGTERM would: the signal goes to this process, whose handler passes it on."""
        self.record.restart_request = request.id
        self._save()  # the sidecar's acknowledgement
        why = f" ({request.reason})" if request.reason else ""
        self._say(
            f"kdtree launcher: restart request {request.id} from the sidecar{why}: SIGTERM to the server, "
            f"SIGKILL after {request.stop_timeout_s:g}s; the restart policy starts the container again"
        )
        self._kill_at = time.monotonic() + request.stop_timeout_s
        os.kill(os.getpid(), signal.SIGTERM)

    def _kill_server(self) -> None:
        """The restart request's stop timeout passed: SIGKILL the server's process group (its pid is not reaped
        while the phase is running, so it still names that group)."""
        with self._lock:
            if self._phase == "running":
                self._say(
                    "kdtree launcher: the server did not stop within the restart request's stop_timeout_s: "
                    "SIGKILL to its process group"
                )
                _killpg(self.child.pid)

    def _reap_orphans(self) -> None:
        """PID 1 inherits every orphan of its namespace: reap the dead ones, never the server (run() waits for it)."""
        with self._lock:
            if self._phase != "running":
                return  # before the server runs, a child is the launcher's own (subprocess.run reaps it)
            while True:
                try:
                    info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    return
                if info is None or info.si_pid == self.child.pid:
                    return
                try:
                    os.waitpid(info.si_pid, 0)
                except ChildProcessError:
                    return

    def _note_stop(self) -> bool:
        """Log the stop signal and its time once (True the first time)."""
        if not self.record.stop_signal or self._stop_noted:
            return False
        self._stop_noted = True
        at = self.record.stop_signal_at or time.time()
        self._say(
            f"kdtree launcher: {self.record.stop_signal} at {iso_time(at)} (t={at:.3f}): stopping the server"
        )
        return True

    def _stop_watcher(self) -> None:
        self._done.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5.0)
        self._note_stop()  # one the watcher had no time to log

    def _say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        self.log_line(line)

    # ---- the server ------------------------------------------------------------------------------

    def run(self, argv: Sequence[str], env: Mapping[str, str]) -> int:
        env = {**env}
        env.setdefault("PYTHONUNBUFFERED", "1")  # a pipe makes Python block-buffer; the log must keep up
        self._phase = "spawning"
        try:
            self.child = subprocess.Popen(
                list(argv),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                process_group=0,
                preexec_fn=_die_with_parent(),
            )
        except OSError as e:
            self._phase = "before"
            print(f"kdtree launcher: error: cannot start {argv[0]}: {e}", file=sys.stderr, flush=True)
            self.log_line(f"kdtree launcher: error: cannot start {argv[0]}: {e}")
            return self.finish(127)
        pid = self.child.pid
        stat = proc_stat(pid)
        self.record.server_pid, self.record.server_start_ticks = pid, (stat[1] if stat else None)
        self._save()
        pumps = [
            threading.Thread(target=self._pump, args=(self.child.stdout, 1), daemon=True),
            threading.Thread(target=self._pump, args=(self.child.stderr, 2), daemon=True),
        ]
        for t in pumps:
            t.start()
        self._phase = "running"
        for signum in self._pending:  # arrived while the process was being created
            os.kill(pid, signum)
        self._pending.clear()

        # Wait without reaping, so the pid (the process group's id) cannot be reused while the group's
        # leftovers are killed: the server's own children must not outlive it, holding GPUs and our pipes.
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        with self._lock:
            self._phase = "done"  # from here on the pid may be reused: no more signals to it
        _killpg(pid)
        rc = self.child.wait()
        deadline = time.monotonic() + READER_DRAIN_S
        for t in pumps:  # the rest of the output (a pipe keeps what was written before its writer died)
            t.join(max(0.0, deadline - time.monotonic()))
        self._stop_watcher()
        if rc < 0:
            self.record.signal = signal_name(-rc)
            line = f"kdtree launcher: the server was killed by {self.record.signal} (exit status {128 - rc})"
            code = 128 - rc
        else:
            line = f"kdtree launcher: the server exited with status {rc}"
            code = rc
        print(line, file=sys.stderr, flush=True)
        self.log_line(line)
        return self.finish(code)

    def _pump(self, pipe, out_fd: int) -> None:
        """Copy the server's stream to ours as it comes, and into the log file line by line."""
        fd = pipe.fileno()
        passthrough = True
        pending = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            if passthrough:
                try:
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(out_fd, view) :]
                except OSError:
                    passthrough = False  # nobody reads our output any more; the log file still does
            if self.log is None:
                continue
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self.log.write_line(line + b"\n")
            while len(pending) > MAX_LOG_LINE:
                self.log.write_line(pending[:MAX_LOG_LINE] + b"\n")
                pending = pending[MAX_LOG_LINE:]
        if pending and self.log is not None:
            self.log.write_line(pending + b"\n")
        pipe.close()

    def finish(self, exit_code: int) -> int:
        """Record the end of this start; returns exit_code."""
        with self._lock:
            self._phase = "done"
        self._stop_watcher()
        self.record.exited_at = time.time()
        self.record.exit_code = exit_code
        self._save()
        if self.log is not None:
            self.log.close()
        self._restore_signals()
        return exit_code

    def stopped(self, e: StopRequested) -> int:
        """The launcher was asked to stop before the server started: exit as that signal would."""
        self._stop_watcher()
        line = f"kdtree launcher: stopped by {signal_name(e.signum)} before the server started"
        print(line, file=sys.stderr, flush=True)
        self.log_line(line)
        return self.finish(128 + e.signum)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[0].startswith("-"):
        print("usage: python -m entrypoint.supervise COMMAND [ARG...]", file=sys.stderr)
        return EXIT_USAGE
    try:
        settings = SupervisorSettings.load()
    except ValueError as e:
        print(f"kdtree supervisor: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    sup = Supervisor(settings.state_dir, settings.server_log_max_bytes).begin()
    try:
        return sup.run(argv, os.environ)
    except StopRequested as e:
        return sup.stopped(e)


if __name__ == "__main__":
    sys.exit(main())
