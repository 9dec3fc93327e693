"""A stand-in for the SGLang 0.5.23 server, for the tests and the CPU demo: it is NOT SGLang and runs no model.

It speaks the parts of SGLang's contract the sidecar and kdtreectl rely on, with the same timing shape:
- while "loading" the port is closed (SGLang binds only after weights and CUDA graphs are in place), and
  it prints SGLang's real startup log markers to stdout as it goes;
- while "warming" GET /health answers 503 at once (SGLang's ServerStatus.Starting; POST /v1/completions too);
  GET /v1/models answers 200;
- then GET /health as SGLang 0.5.23's: it polls once a second for output and answers 200 (empty body) once any
  arrives, or 503 after SGLANG_HEALTH_CHECK_TIMEOUT (default 20 s) when none does (a dead scheduler: the `hang`
  fault); GET /v1/models, GET /server_info and POST /v1/completions with SGLang's OpenAI response shape: `usage`,
  `choices[].token_ids` with return_token_ids, `sglext.spec_tokens_details` (spec_verify_ct, spec_accept_length,
  ...) with return_spec_tokens_details, and ignore_eos honoured; streamed completions (`stream`: server-sent events,
  the prefill's token first, then one chunk a verify step of --accept-length tokens, --step-seconds apart, the finish
  reason on the last, the `sglext` chunk, `data: [DONE]`), stop_token_ids and stop strings (honoured only without
  ignore_eos, as SGLang's), logprobs, and POST /abort_request {"rid"} (the stream ends with finish_reason abort);
  GET /metrics with SGLang's counter names (sglang:num_requests_total counts every finished request, aborted ones
  too; sglang:num_used_tokens is 0: the stand-in holds no KV);
- with --api-key KEY, as SGLang's --api-key: every endpoint but /health, /health_generate, /ready and /metrics
  wants `Authorization: Bearer KEY` and answers 401 {"error": "Unauthorized"} without it.
It also stands in for the SGLang ranks with the kdtree plugin, through kdtree's own rank code: one
kdtree.state.heartbeat.Heartbeat and a kdtree.state.mode_file.ModeHolder per tensor-parallel rank, so each rank writes
its record into KDTREE_STATE_DIR and follows the sidecar's mode file live exactly as a real rank does. Each
completion counts as ceil(tokens / --accept-length) verify steps of --layers calls on every rank, in that
rank's mode: served_kdtree in on, compared (parity) in validate, served by the original otherwise.
Completions are deterministic: the same prompt and mode always give the same tokens.
With --no-speculation it serves as SGLang 0.5.23 does without speculative decoding: no verify call on any rank,
and no `sglext` in a completion even when asked for its details (SGLang builds spec_tokens_details only from
speculative metrics, finds none, and drops `sglext` when it is empty: serving_completions.py, protocol.py).

Faults (--fault, optionally only while the server is in --fault-in-mode, optionally after --fault-after good answers;
each but crash-on-start also switches at run time, through the test hook below):
  slow             completions answer after --fault-delay seconds
  saturated        completions queue behind load and answer after --fault-delay seconds, while /health answers 200
                   (other requests' output keeps arriving: what SGLang's /health says of a busy server)
  hang             a dead scheduler: completions never answer, and /health answers 503 after
                   SGLANG_HEALTH_CHECK_TIMEOUT, as SGLang's does when no output arrives
  malformed        200 with a body that is not JSON
  no-choices       200 with JSON that has no `choices`
  no-finish-reason 200 with a choice whose finish_reason is null
  http-500         500 with an error body
  die-mid-probe    the process exits while writing the completion answer
  crash-on-start   a traceback during CUDA graph capture, then exit with --exit-code (port never opens); at start
                   only
  rank-error       the ranks report a last_error
  no-verify-count  the ranks count no verify call (kdtree installed but never reached)
  fallback         every verify call falls back to the original, counted as kv_dtype
  stuck-rank       rank 1 keeps its mode: it never follows the mode file (never confirms a live switch)
  diverge          completions in mode on differ from position --diverge-at on (a wrong kdtree result: the other
                   modes serve the original)
  wedged-ranks     the ranks stop writing their records (a wedged scheduler) while HTTP answers as before
With --nnodes N --node-rank R (R > 0) it stands in for a node other than 0 of a multi-node group: its ranks are the
global tp ranks R*per_node .. +per_node-1, it takes the verify steps of the node 0 stand-in at --leader-url, and its
HTTP server is SGLang's dummy health server (200 on /health, /health_generate and /ping whatever the ranks do), with
the test hook POST /_standin/fault beside it.

Run: python standins/standin_engine.py --port P [--load-seconds S] [--warm-seconds S] [--fault F] [--tp-size N]
Test hooks: GET /_standin/stats (request counts), POST /_standin/fault {"fault": F} (switch at run time; 400 naming
the valid faults for any other name).

StandinProcess (below) runs it as a child process and controls it the way the sidecar controls the server
container (inspect, logs, restart), so the sidecar's state machine can be tested without Docker.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kdtree from this checkout when run as a script

from kdtree.config import Mode  # noqa: E402
from kdtree.state.heartbeat import Heartbeat  # noqa: E402
from kdtree.state.mode_file import ModeHolder, read_desired_mode  # noqa: E402

FAULTS = (
    "none",
    "slow",
    "saturated",
    "hang",
    "malformed",
    "no-choices",
    "no-finish-reason",
    "http-500",
    "die-mid-probe",
    "crash-on-start",
    "rank-error",
    "no-verify-count",
    "fallback",
    "stuck-rank",
    "diverge",
    "wedged-ranks",
)
RUN_TIME_FAULTS = tuple(f for f in FAULTS if f != "crash-on-start")
GOOD = (
    "none",
    "slow",
    "saturated",
    "rank-error",
    "no-verify-count",
    "fallback",
    "stuck-rank",
    "diverge",
    "wedged-ranks",
)  # still answer 200


def free_port() -> int:
    """A free loopback port (for the tests that start stand-ins and sidecars)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float, what: str, exited=lambda: None) -> None:
    """Wait until something listens on loopback `port`; `exited()` returns a reason when what should open it is
    gone (then fail at once with it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if (reason := exited()) is not None:
                raise RuntimeError(f"{what} {reason}") from None
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not open port {port} within {timeout}s")


HEALTH_POLL_S = 1.0  # SGLang's /health sleeps this long between its looks for output (http_server.py)
PUBLIC_PATHS = (
    "/health",
    "/ready",
    "/metrics",
    "/_standin/",
)  # open with --api-key (auth.py; the test hooks)


def log(msg: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp} TP0] {msg}", flush=True)


class Metrics:
    """SGLang's request counters (observability/metrics_collector.py names), in a registry of their own."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "sglang:num_requests", "Number of requests processed.", registry=self.registry
        )
        self.generation = Counter(
            "sglang:generation_tokens", "Number of generation tokens.", registry=self.registry
        )
        self.aborted = Counter(
            "sglang:num_aborted_requests", "Number of aborted requests.", registry=self.registry
        )
        Gauge("sglang:num_used_tokens", "The number of used tokens.", registry=self.registry).set(0)

    def finished(self, tokens: int) -> None:
        self.requests.inc()
        self.generation.inc(tokens)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class Engine:
    def __init__(self, args):
        self.args = args
        self.started_mode = self._mode()
        self.warm_until = 0.0
        self.stats = {"completions": 0, "good_completions": 0, "models": 0, "health": 0, "server_info": 0}
        self.lock = threading.Lock()
        # With --nnodes N this process stands in for one node: its ranks are the global tp ranks
        # node_rank*per_node .. +per_node-1 of a group of --tp-size, as SGLang assigns them (_calculate_rank_ranges).
        self.per_node = args.tp_size // args.nnodes
        self.first_rank = args.node_rank * self.per_node
        self.holders = [ModeHolder(self.started_mode) for _ in range(self.per_node)]
        self.ranks = [
            {"served_kdtree": 0, "served_original": 0, "fallbacks": {}, "compared": 0}
            for _ in range(self.per_node)
        ]
        self.stats["verify_steps"] = 0
        self.fault = args.fault
        self.aborted: set[str] = set()  # rids POST /abort_request named
        self.metrics = Metrics()

    def _mode(self) -> Mode:
        state_dir = self.args.state_dir
        return (read_desired_mode(state_dir) if state_dir else None) or Mode(
            os.environ.get("KDTREE_VERIFY", "off")
        )

    @property
    def mode(self) -> Mode:
        """The mode the server serves now (rank 0's; ranks may differ for a moment during a live switch)."""
        return self.holders[0].mode if self.holders else self.started_mode

    def active_fault(self) -> str:
        """The fault, while the server is in --fault-in-mode and once --fault-after good completions are served."""
        a = self.args
        if a.fault_in_mode is not None and a.fault_in_mode != self.mode.value:
            return "none"
        return self.fault if self.stats["good_completions"] >= a.fault_after else "none"

    # ---- the ranks: kdtree's own heartbeat and mode holder, with counters a completion moves -----------------

    def start_ranks(self) -> None:
        a = self.args
        for rank, holder in enumerate(self.holders):
            evidence = Heartbeat(
                a.state_dir,
                snapshot=lambda rank=rank: self.snapshot(rank),
                installed=lambda: self.started_mode != Mode.OFF and not a.not_installed,
                rank_source=lambda rank=rank: (self.first_rank + rank, a.tp_size),
                follow=lambda desired, rank=rank, holder=holder: self.follow(rank, holder, desired),
            )
            evidence.start(a.heartbeat_s)

    def follow(self, rank: int, holder: ModeHolder, desired: Mode | None) -> bool:
        """A rank follows the mode file as kdtree's does, but rank 1 not while stuck-rank is on."""
        if self.first_rank + rank == 1 and self.active_fault() == "stuck-rank":
            return False
        return holder.follow(desired)

    def snapshot(self, rank: int) -> dict:
        if self.active_fault() == "wedged-ranks":
            raise RuntimeError("stand-in: the rank is wedged")  # Heartbeat.beat writes no record
        a, holder = self.args, self.holders[rank]
        with self.lock:
            counts = dict(self.ranks[rank])
        return {
            "mode": a.report_mode or holder.mode.value,
            "mode_applied_at": holder.applied_at,
            "live_modes": sorted(m.value for m in holder.live_modes),
            "mode_pending": holder.pending.value if holder.pending else None,
            "served_kdtree": counts["served_kdtree"],
            "served_original": counts["served_original"],
            "fallbacks": counts["fallbacks"],
            "last_error": "stand-in: injected rank error" if self.active_fault() == "rank-error" else None,
            "gpu": "stand-in",
            "compute_capability": "9.0",
            "compiled_archs": ["sm_90"],
            "parity": {
                "calls_compared": a.parity_calls + counts["compared"],
                "max_abs_err": a.parity_max_rel,
                "max_rel_l2": a.parity_max_rel,
                "calls_over_tol": a.parity_over_tol,
                "nan_inf": a.parity_nan_inf,
                "rtol": 2e-2,
            },
        }

    def count_verify(self, steps: int) -> None:
        """`steps` verify steps of --layers target-verify calls each, on every rank, as that rank's mode serves them."""
        fault = self.active_fault()
        if fault == "no-verify-count":
            return
        calls = steps * self.args.layers
        with self.lock:
            self.stats["verify_steps"] += steps
            for holder, c in zip(self.holders, self.ranks, strict=True):
                if fault == "fallback" and holder.mode in (Mode.ON, Mode.VALIDATE):
                    c["fallbacks"] = {**c["fallbacks"], "kv_dtype": c["fallbacks"].get("kv_dtype", 0) + calls}
                    c["served_original"] += calls
                elif holder.mode == Mode.ON:
                    c["served_kdtree"] += calls
                else:
                    c["served_original"] += calls
                    if holder.mode == Mode.VALIDATE:
                        c["compared"] += calls

    # ---- startup ------------------------------------------------------------------------------

    def load(self) -> None:
        a = self.args
        log(f"stand-in engine (not SGLang): mode={self.mode.value} fault={self.fault} tp_size={a.tp_size}")
        log("Load weight begin. avail mem=139.20 GB")
        time.sleep(a.load_seconds / 2)
        log(
            "Load weight end. type=DeepseekV3ForCausalLM, dtype=torch.bfloat16, avail mem=60.10 GB, mem usage=79.10 GB."
        )
        log("Capture target verify CUDA graph begin. backend=full, num_tokens_per_req=8, avail mem=20.00 GB")
        if self.fault == "crash-on-start" and (a.fault_in_mode is None or a.fault_in_mode == self.mode.value):
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
            f"Capture target verify CUDA graph end. bs=[1, 2, 4, 8], elapsed={a.load_seconds:.2f} s, "
            "mem usage=3.10 GB, avail mem=16.90 GB."
        )

    # ---- completions --------------------------------------------------------------------------

    def completion(self, req: dict) -> tuple[list[int], str]:
        """A request's token ids and finish reason: `tokens`, cut at its first stop token id or where its text first
        holds a stop string (the stop included), as SGLang cuts them; without ignore_eos only (SGLang's ignore_eos
        ignores stop_token_ids too)."""
        ignore_eos = bool(req.get("ignore_eos"))
        ids, finish = self.tokens(str(req.get("prompt", "")), int(req.get("max_tokens") or 16), ignore_eos)
        if ignore_eos:
            return ids, finish
        stop_ids = set(req.get("stop_token_ids") or ())
        stops = req.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        text = ""
        for i, t in enumerate(ids):
            text += f" t{t}"
            if t in stop_ids or any(x in text for x in stops):
                return ids[: i + 1], "stop"
        return ids, finish

    def tokens(self, prompt: str, n: int, ignore_eos: bool) -> tuple[list[int], str]:
        """Deterministic token ids for a prompt (an end of text after 3/4 of max_tokens unless ignore_eos), and the
        finish reason; with the diverge fault the ids change from --diverge-at on."""
        seed = zlib.crc32(prompt.encode())
        length = n if ignore_eos else max(1, (3 * n) // 4)
        ids = [100 + (seed + 7919 * i) % 30000 for i in range(length)]
        if self.active_fault() == "diverge" and self.mode == Mode.ON:
            ids = ids[: self.args.diverge_at] + [i + 1 for i in ids[self.args.diverge_at :]]
        return ids, "length" if ignore_eos else "stop"


def spec_details(ids: list[int], steps: int) -> dict:
    """SGLang's sglext.spec_tokens_details of a request that emitted `ids` in `steps` verify steps (7 drafts a step)."""
    steps = max(steps, 1)
    return {
        "spec_tokens_details": {
            "spec_accept_rate": round((len(ids) / steps - 1) / 7, 4),
            "spec_accept_length": len(ids) / steps,
            "spec_num_correct_drafts": len(ids) - steps,
            "spec_num_proposed_drafts": 7 * steps,
            "spec_verify_ct": steps,
        }
    }


def logprobs(ids: list[int]) -> dict:
    """An OpenAI completion's logprobs for `ids` (made up: the stand-in runs no model)."""
    return {"tokens": [f" t{i}" for i in ids], "token_logprobs": [-0.25] * len(ids),
            "top_logprobs": [{f" t{i}": -0.25} for i in ids], "text_offset": [0] * len(ids)}  # fmt: skip


class Server(ThreadingHTTPServer):
    # uvicorn's backlog (SGLang's server): socketserver's 5 overflows when a client opens tens of connections at
    # once, and a connection accepted past a full queue is reset mid-request
    request_queue_size = 2048


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

        def _authorized(self) -> bool:
            """SGLang's --api-key check (utils/auth.py): Bearer KEY on every path but the public ones."""
            if not a.api_key or self.path.startswith(PUBLIC_PATHS):
                return True
            if self.headers.get("Authorization") == f"Bearer {a.api_key}":
                return True
            self._send(401, {"error": "Unauthorized"})
            return False

        def _health(self):
            """SGLang 0.5.23's /health: 503 while starting; else a look for output once a second, 200 once any
            arrives, 503 after SGLANG_HEALTH_CHECK_TIMEOUT when none does."""
            engine.stats["health"] += 1
            if self._warming():
                return self._send(503, b"")
            timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
            tic = time.time()
            while time.time() < tic + timeout:
                time.sleep(HEALTH_POLL_S)
                if engine.active_fault() != "hang":  # the scheduler produces output (its own or anyone's)
                    return self._send(200, b"")
            return self._send(503, b"")

        def do_GET(self):
            if not self._authorized():
                return None
            if self.path == "/health" or self.path == "/health_generate":
                return self._health()
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
            if self.path == "/server_info":
                engine.stats["server_info"] += 1
                accept = a.accept_length if engine.stats["good_completions"] else 0.0
                return self._send(
                    200,
                    {
                        "model_path": a.model_name,
                        "tp_size": a.tp_size or 1,
                        "speculative_algorithm": None if a.no_speculation else "NEXTN",
                        "speculative_num_draft_tokens": 8,
                        "internal_states": [{"avg_spec_accept_length": accept, "last_gen_throughput": 0.0}],
                        "version": "0.5.23 (stand-in)",
                    },
                )
            if self.path == "/metrics":  # public, as SGLang's (--enable-metrics)
                return self._send(200, engine.metrics.text(), "text/plain; version=0.0.4")
            if self.path == "/_standin/stats":
                return self._send(
                    200,
                    {**engine.stats, "mode": engine.mode.value, "fault": engine.fault, "pid": os.getpid()},
                )
            self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if not self._authorized():
                return None
            if self.path == "/_standin/fault":
                try:
                    fault = json.loads(raw)["fault"]
                except (ValueError, KeyError, TypeError):
                    return self._send(400, {"error": 'the body must be JSON: {"fault": NAME}'})
                if fault not in RUN_TIME_FAULTS:
                    why = "happens at start only (--fault)" if fault == "crash-on-start" else "is not a fault"
                    return self._send(
                        400, {"error": f"{fault!r} {why}; faults: {', '.join(RUN_TIME_FAULTS)}"}
                    )
                engine.fault = fault
                return self._send(200, {"fault": engine.fault})
            if self.path == "/abort_request":
                try:
                    engine.aborted.add(str(json.loads(raw)["rid"]))
                except (ValueError, KeyError, TypeError):
                    return self._send(400, {"error": 'the body must be JSON: {"rid": RID}'})
                engine.metrics.aborted.inc()
                return self._send(200, b"")
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
            if fault in ("slow", "saturated"):
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
            prompt = str(req.get("prompt", ""))
            ids, finish = engine.completion(req)
            steps = math.ceil(len(ids) / a.accept_length)  # the first token comes from prefill in SGLang too
            if not a.no_speculation:
                engine.count_verify(steps)
            if req.get("stream"):
                return self._stream(req, ids, finish, steps)
            choice = {
                "index": 0,
                "text": "".join(f" t{i}" for i in ids),
                "logprobs": None,
                "finish_reason": None if fault == "no-finish-reason" else finish,
                "matched_stop": None if finish == "length" else 1,
            }
            if req.get("return_token_ids"):
                choice["token_ids"] = ids
                choice["prompt_token_ids"] = [ord(ch) % 256 for ch in prompt]
            if req.get("logprobs") is not None:
                choice["logprobs"] = logprobs(ids)
            prompt_tokens = max(1, len(prompt) // 4)
            body = {
                "id": uuid.uuid4().hex,
                "object": "text_completion",
                "created": int(time.time()),
                "model": a.model_name,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "total_tokens": prompt_tokens + len(ids),
                    "completion_tokens": len(ids),
                    "prompt_tokens_details": None,
                    "reasoning_tokens": 0,
                },
                "metadata": {"weight_version": "default"},
            }
            if req.get("return_spec_tokens_details") and not a.no_speculation:
                body["sglext"] = spec_details(ids, steps)
            if fault == "no-choices":
                del body["choices"]
            with engine.lock:
                engine.stats["good_completions"] += fault in GOOD
            engine.metrics.finished(len(ids))
            self._send(200, body)

        def _stream(self, req: dict, ids: list[int], finish: str, steps: int) -> None:
            """SGLang's streamed completion: the prefill's token, then a chunk a verify step, --step-seconds apart;
            an abort of its rid ends it with finish_reason abort; a client that hangs up ends it at once."""
            rid, sent = str(req.get("rid") or uuid.uuid4().hex), 0
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")  # the stream ends with the connection: no chunked framing
            self.end_headers()
            self.close_connection = True

            def chunk(choice: dict | None, **extra) -> None:
                body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": a.model_name,
                        "choices": [choice] if choice else [], **extra}  # fmt: skip
                self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
                self.wfile.flush()

            try:
                while sent < len(ids):
                    if rid in engine.aborted:
                        finish = "abort"
                        break
                    step = ids[sent : sent + (1 if sent == 0 else max(1, round(a.accept_length)))]
                    sent += len(step)
                    last = sent == len(ids)
                    choice = {"index": 0, "text": "".join(f" t{i}" for i in step), "finish_reason": finish if last else None,
                              "matched_stop": None, "token_ids": step if req.get("return_token_ids") else None,
                              "logprobs": logprobs(step) if req.get("logprobs") is not None else None}  # fmt: skip
                    chunk(choice)
                    if not last:
                        time.sleep(a.step_seconds)
                if finish == "abort":
                    chunk(
                        {
                            "index": 0,
                            "text": "",
                            "finish_reason": "abort",
                            "matched_stop": None,
                            "token_ids": [],
                        }
                    )
                if req.get("return_spec_tokens_details") and not a.no_speculation:
                    chunk(None, sglext=spec_details(ids[:sent], steps))
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):  # the client hung up: SGLang aborts the request
                return
            engine.metrics.finished(sent)

    return Handler


def make_dummy_health_handler(engine: Engine):
    """A node other than 0, as SGLang 0.5.23 runs it (utils/common.py launch_dummy_health_check_server): 200 with
    no body on /health, /health_generate and /ping whatever its ranks do, 404 on everything else; and the test
    hook POST /_standin/fault {"fault": "wedged-ranks" | "none"}."""

    class DummyHealth(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            pass

        def _empty(self, code: int) -> None:
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self):
            self._empty(200 if self.path in ("/health", "/health_generate", "/ping") else 404)

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path != "/_standin/fault":
                return self._empty(404)
            fault = json.loads(raw).get("fault")
            if fault not in ("none", "wedged-ranks"):
                return self._empty(400)
            engine.fault = fault
            return self._empty(200)

    return DummyHealth


def follow_leader(engine: Engine, url: str) -> None:
    """This node's ranks take the verify steps node 0's scheduler runs (read from its /_standin/stats)."""
    import urllib.request

    seen = None
    while True:
        try:
            with urllib.request.urlopen(f"{url}/_standin/stats", timeout=2) as r:
                steps = json.loads(r.read())["verify_steps"]
        except (OSError, ValueError, KeyError):
            steps = None
        if steps is not None:
            if seen is not None and steps > seen:
                engine.count_verify(steps - seen)
            seen = steps
        time.sleep(0.1)


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
        def exited():
            if self.proc.poll() is not None:
                return f"exited with {self.proc.returncode}: {self.log_path.read_text()}"

        wait_port(self.port, timeout, "stand-in", exited)

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
        from sidecar.server_control import ServerState

        rc = self.proc.poll() if self.proc else None
        return ServerState(
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
        from sidecar.server_control import ServerControlError

        if self.restart_failures:
            self.restart_failures -= 1
            raise ServerControlError("stand-in: injected restart failure")
        self.stop(stop_timeout_s)
        self.start()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="stand-in for the SGLang server (tests and the CPU demo)")
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
    p.add_argument(
        "--api-key", default=None, help="as SGLang's --api-key: /v1/* want Authorization: Bearer KEY"
    )
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
    p.add_argument("--layers", type=int, default=4, help="target-verify calls per verify step on each rank")
    p.add_argument("--accept-length", type=float, default=3.0, help="tokens per verify step")
    p.add_argument("--step-seconds", type=float, default=0.02, help="between a streamed completion's chunks")
    p.add_argument(
        "--no-speculation", action="store_true", help="serve without speculative decoding (no verify calls)"
    )
    p.add_argument("--diverge-at", type=int, default=5, help="token position the diverge fault changes from")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the group (--tp-size spreads over them)")
    p.add_argument("--node-rank", type=int, default=0, help="the node this process stands in for")
    p.add_argument(
        "--leader-url",
        help="a node other than 0: the leader stand-in, whose verify steps this node's ranks take too (tensor "
        "parallelism: every rank runs every step)",
    )
    args = p.parse_args(argv)
    if args.tp_size % args.nnodes or not 0 <= args.node_rank < args.nnodes:
        p.error("--tp-size must be divisible by --nnodes, and --node-rank within 0 .. nnodes-1")
    if args.tp_size and not args.state_dir:
        p.error("--tp-size needs --state-dir or KDTREE_STATE_DIR")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `docker restart` sends SIGTERM first
    engine = Engine(args)
    engine.load()
    if args.tp_size:
        engine.start_ranks()
    handler = make_handler(engine) if args.node_rank == 0 else make_dummy_health_handler(engine)
    if args.leader_url:
        threading.Thread(target=follow_leader, args=(engine, args.leader_url), daemon=True).start()
    server = Server((args.host, args.port), handler)
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
