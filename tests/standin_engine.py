"""A stand-in for the SGLang 0.5.23 server, for tests only: it is NOT SGLang and runs no model.

It speaks the parts of SGLang's contract the sidecar relies on, with the same timing shape:
- while "loading" the port is closed (SGLang binds only after weights and CUDA graphs are in place), and
  it prints SGLang's real startup log markers to stdout as it goes;
- while "warming" GET /health answers 503 (POST /v1/completions too); GET /v1/models answers 200;
- then GET /health 200, GET /v1/models and POST /v1/completions with SGLang's OpenAI response shape.
It also stands in for the SGLang ranks with the kdtree plugin: it writes one record per tensor-parallel
rank into KDTREE_STATE_DIR (kdtree.status.write_record), heartbeating, in the mode the server entrypoint
would use (KDTREE_STATE_DIR/mode, else KDTREE_VERIFY), with parity numbers chosen on the command line.

Faults (--fault, optionally only when started in --fault-in-mode, optionally after --fault-after good answers):
  slow             completions answer after --fault-delay seconds
  hang             completions never answer
  malformed        200 with a body that is not JSON
  no-choices       200 with JSON that has no `choices`
  no-finish-reason 200 with a choice whose finish_reason is null
  http-500         500 with an error body
  die-mid-probe    the process exits while writing the completion answer
  crash-on-start   a traceback during CUDA graph capture, then exit with --exit-code (port never opens)
  rank-error       the ranks report a last_error

Run: python tests/standin_engine.py --port P [--load-seconds S] [--warm-seconds S] [--fault F] [--tp-size N]
Test hooks: GET /_standin/stats (request counts), POST /_standin/fault {"fault": F} (switch at run time).

StandinProcess (below) runs it as a child process and controls it the way the sidecar controls the server
container (inspect, logs, restart), so the sidecar's state machine can be tested without Docker.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kdtree from this checkout when run as a script

from kdtree.config import Mode  # noqa: E402
from kdtree.control import read_desired_mode  # noqa: E402
from kdtree.status import Parity, new_record, write_record  # noqa: E402

FAULTS = (
    "none",
    "slow",
    "hang",
    "malformed",
    "no-choices",
    "no-finish-reason",
    "http-500",
    "die-mid-probe",
    "crash-on-start",
    "rank-error",
)


def free_port() -> int:
    """A free loopback port (for the tests that start stand-ins and sidecars)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp} TP0] {msg}", flush=True)


class Engine:
    def __init__(self, args):
        self.args = args
        self.mode = self._mode()
        applies = args.fault_in_mode is None or args.fault_in_mode == self.mode.value
        self.fault = args.fault if applies else "none"
        self.warm_until = 0.0
        self.stats = {"completions": 0, "good_completions": 0, "models": 0, "health": 0}
        self.lock = threading.Lock()

    def _mode(self) -> Mode:
        state_dir = self.args.state_dir
        return (read_desired_mode(state_dir) if state_dir else None) or Mode(
            os.environ.get("KDTREE_VERIFY", "off")
        )

    def active_fault(self) -> str:
        """The fault, once --fault-after good completions have been served."""
        return self.fault if self.stats["good_completions"] >= self.args.fault_after else "none"

    # ---- the ranks ------------------------------------------------------------------------------

    def heartbeat_forever(self) -> None:
        a = self.args
        records = [new_record(a.report_mode or self.mode.value, rank, a.tp_size) for rank in range(a.tp_size)]
        for rec in records:
            rec.installed = self.mode != Mode.OFF and not a.not_installed
            rec.gpu, rec.compute_capability = "stand-in", "9.0"
            rec.parity = Parity(
                calls_compared=a.parity_calls,
                max_rel_l2=a.parity_max_rel,
                max_abs_err=a.parity_max_rel,
                nan_inf=a.parity_nan_inf,
                calls_over_tol=a.parity_over_tol,
                rtol=2e-2,
            )
        while True:
            for rec in records:
                rec.heartbeat = time.time()
                rec.served_original = self.stats["completions"]
                if self.active_fault() == "rank-error":
                    rec.last_error = "stand-in: injected rank error"
                write_record(a.state_dir, rec)
            time.sleep(a.heartbeat_s)

    # ---- startup ------------------------------------------------------------------------------

    def load(self) -> None:
        a = self.args
        log(f"stand-in engine (not SGLang): mode={self.mode.value} fault={self.fault} tp_size={a.tp_size}")
        log("Load weight begin. avail mem=139.20 GB")
        time.sleep(a.load_seconds / 2)
        log(
            "Load weight end. type=DeepseekV3ForCausalLM, dtype=torch.bfloat16, avail mem=60.10 GB, mem usage=79.10 GB."
        )
        log("Capture cuda graph begin. This can take up to several minutes. avail mem=20.00 GB")
        if self.fault == "crash-on-start":
            time.sleep(a.load_seconds / 4)
            print(
                "Traceback (most recent call last):\n"
                '  File "/sgl/python/sglang/srt/model_executor/cuda_graph_runner.py", line 412, in capture\n'
                "    self.capture_one_batch_size(bs, forward)\n"
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (stand-in fault)",
                file=sys.stderr,
                flush=True,
            )
            log("ERROR Scheduler hit an exception; exiting")
            sys.exit(a.exit_code)
        time.sleep(a.load_seconds / 2)
        log(
            f"Capture cuda graph end. Time elapsed: {a.load_seconds:.2f} s. mem usage=3.10 GB. avail mem=16.90 GB."
        )


def make_handler(engine: Engine):
    a = engine.args

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # SGLang logs requests at INFO; keep test output readable
            pass

        def _send(self, code: int, body, content_type: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _warming(self) -> bool:
            return time.time() < engine.warm_until

        def do_GET(self):
            if self.path == "/health" or self.path == "/health_generate":
                engine.stats["health"] += 1
                return self._send(503 if self._warming() else 200, b"" if not self._warming() else b"{}")
            if self.path == "/v1/models":
                engine.stats["models"] += 1
                return self._send(
                    200,
                    {
                        "object": "list",
                        "data": [
                            {
                                "id": a.model_name,
                                "object": "model",
                                "created": int(time.time()),
                                "owned_by": "sglang",
                                "root": a.model_name,
                                "parent": None,
                                "max_model_len": 163840,
                            }
                        ],
                    },
                )
            if self.path == "/_standin/stats":
                return self._send(
                    200,
                    {**engine.stats, "mode": engine.mode.value, "fault": engine.fault, "pid": os.getpid()},
                )
            self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if self.path == "/_standin/fault":
                engine.fault = json.loads(raw)["fault"]
                return self._send(200, {"fault": engine.fault})
            if self.path != "/v1/completions":
                return self._send(404, {"detail": "Not Found"})
            with engine.lock:
                engine.stats["completions"] += 1
            if self._warming():
                return self._send(503, {"object": "error", "message": "server is warming up", "code": 503})
            try:
                req = json.loads(raw)
            except ValueError:
                return self._send(400, {"object": "error", "message": "invalid JSON body", "code": 400})
            if req.get("model") not in (a.model_name, None):
                return self._send(
                    404,
                    {
                        "object": "error",
                        "message": f"The model `{req.get('model')}` does not exist.",
                        "type": "NotFoundError",
                        "code": 404,
                    },
                )
            fault = engine.active_fault()
            if fault == "slow":
                time.sleep(a.fault_delay)
            elif fault == "hang":
                time.sleep(3600)
            elif fault == "malformed":
                return self._send(200, b'{"id": "cmpl-1", "choices": [{"text": "Par', "application/json")
            elif fault == "http-500":
                return self._send(
                    500, {"object": "error", "message": "stand-in: injected internal error", "code": 500}
                )
            elif fault == "die-mid-probe":
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "400")
                self.end_headers()
                self.wfile.write(b'{"id": "cmpl-')
                self.wfile.flush()
                os._exit(137)
            n = int(req.get("max_tokens") or 16)
            choice = {
                "index": 0,
                "text": " Paris" * n,
                "logprobs": None,
                "finish_reason": None if fault == "no-finish-reason" else "length",
                "matched_stop": None,
            }
            body = {
                "id": uuid.uuid4().hex,
                "object": "text_completion",
                "created": int(time.time()),
                "model": a.model_name,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": 5,
                    "total_tokens": 5 + n,
                    "completion_tokens": n,
                    "prompt_tokens_details": None,
                    "reasoning_tokens": 0,
                },
                "metadata": None,
            }
            if fault == "no-choices":
                del body["choices"]
            with engine.lock:
                engine.stats["good_completions"] += fault in ("none", "slow", "rank-error")
            self._send(200, body)

    return Handler


class StandinProcess:
    """The stand-in as a child process, with the sidecar's ServerControl methods (inspect, logs, restart).

    It plays the server container: `restart` stops the process (SIGTERM, then SIGKILL) and starts it again
    with the same arguments, so it picks up the mode file like the real entrypoint does.
    """

    def __init__(
        self,
        port: int,
        state_dir: str,
        args: list[str] = (),
        log_dir: str | None = None,
        env: dict | None = None,
    ):
        self.name = "stand-in"
        self.port, self.state_dir, self.args = port, state_dir, list(args)
        self.log_dir = Path(log_dir or state_dir)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.starts = 0
        self.restart_failures = 0  # the next N restarts raise, as a Docker error would

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"standin-{self.port}-{self.starts}.log"

    def start(self) -> StandinProcess:
        cmd = [sys.executable, __file__, "--port", str(self.port), "--state-dir", self.state_dir, *self.args]
        path = self.log_dir / f"standin-{self.port}-{self.starts + 1}.log"
        with path.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        # Only now does log_path name the new file: the sidecar reads the logs from another thread while it
        # restarts the server, and Docker's logs of a restarting container never fail for a missing file.
        self.starts += 1
        self.started_at = time.time()
        return self

    def wait_port(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"stand-in exited with {self.proc.returncode}: {self.log_path.read_text()}"
                    ) from None
                time.sleep(0.05)
        raise TimeoutError(f"stand-in did not open port {self.port} within {timeout}s")

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # ---- the ServerControl interface (imports the sidecar only here: the engine itself does not need it)

    def inspect(self):
        from sidecar.docker_control import ContainerState

        rc = self.proc.poll() if self.proc else None
        return ContainerState(
            name=self.name,
            status="running" if rc is None else "exited",
            running=rc is None,
            exit_code=0 if rc is None else rc,
            started_at=self.started_at,
        )

    def logs(self, tail: int, since: float | None = None) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-tail:])

    def restart(self, stop_timeout_s: int) -> None:
        from sidecar.docker_control import DockerError

        if self.restart_failures:
            self.restart_failures -= 1
            raise DockerError("stand-in: injected restart failure")
        self.stop(stop_timeout_s)
        self.start()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="stand-in for the SGLang server (tests only)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--load-seconds", type=float, default=0.0)
    p.add_argument("--warm-seconds", type=float, default=0.0)
    p.add_argument("--model-name", default="stand-in/deepseek-v3")
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-in-mode", choices=[m.value for m in Mode], default=None)
    p.add_argument(
        "--fault-after", type=int, default=0, help="good completions served before the fault starts"
    )
    p.add_argument("--fault-delay", type=float, default=2.0)
    p.add_argument("--exit-code", type=int, default=1)
    p.add_argument("--state-dir", default=os.environ.get("KDTREE_STATE_DIR"))
    p.add_argument("--tp-size", type=int, default=0, help="ranks to stand in for (0: write no records)")
    p.add_argument("--heartbeat-s", type=float, default=0.5)
    p.add_argument(
        "--report-mode", default=None, help="the mode the ranks report (default: the mode started in)"
    )
    p.add_argument("--not-installed", action="store_true")
    p.add_argument("--parity-calls", type=int, default=0)
    p.add_argument("--parity-max-rel", type=float, default=0.0)
    p.add_argument("--parity-nan-inf", type=int, default=0)
    p.add_argument("--parity-over-tol", type=int, default=0)
    args = p.parse_args(argv)
    if args.tp_size and not args.state_dir:
        p.error("--tp-size needs --state-dir or KDTREE_STATE_DIR")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `docker restart` sends SIGTERM first
    engine = Engine(args)
    engine.load()
    if args.tp_size:
        threading.Thread(target=engine.heartbeat_forever, daemon=True).start()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine))
    server.daemon_threads = True
    engine.warm_until = time.time() + args.warm_seconds
    log(f"Uvicorn running on http://{args.host}:{args.port} (stand-in)")

    def announce_ready():
        time.sleep(args.warm_seconds)
        log("The server is fired up and ready to roll!")

    threading.Thread(target=announce_ready, daemon=True).start()
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
