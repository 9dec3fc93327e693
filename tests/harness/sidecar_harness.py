"""What the sidecar tests share: settings with short timings, the app behind an in-process client or
under uvicorn in a thread, and kdtreectl run as a user runs it."""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import subprocess
import sys
import threading
import time
from contextlib import asynccontextmanager, contextmanager

import httpx
import uvicorn
from standin_engine import free_port

from sidecar.app import create_app
from sidecar.http_server import server_config
from sidecar.settings import SidecarSettings
from sidecar.store import Store

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make_settings(state_dir, port, **overrides) -> SidecarSettings:
    """A sidecar for a stand-in engine on `port`, two ranks expected, every wait shortened for tests."""
    base = dict(
        server_url=f"http://127.0.0.1:{port}",
        state_dir=str(state_dir),
        admin_token=TOKEN,
        expected_tp_size=2,
        heartbeat_stale_s=3.0,
        probe_deadline_s=1.0,
        probe_interval_s=0.1,
        drain_s=0,
        ready_timeout_s=6.0,
        ready_poll_min_s=0.1,
        ready_poll_max_s=0.3,
        bake_probes=3,
        bake_interval_s=0.1,
        restart_stop_timeout_s=2,
        gate_min_calls=100,
    )
    return SidecarSettings(**{**base, **overrides})


@contextmanager
def sidecar_sized_heap():
    """The objects already in this process left out of garbage collection while a sidecar runs in it.

    The sidecar's own process holds a small heap, but this one also holds what the other tests imported (SGLang,
    torch: about a million objects), and a full collection of that stalls the event loop for 0.6 s or more, long
    enough for GET /ready's own deadline to answer 503 in a timing test. Unfrozen afterwards, so nothing leaks."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


STOP_S = 20.0  # the sidecar's stop (its lifespan's end): well within pytest's timeout (pyproject.toml)


class DeadlineASGITransport(httpx.ASGITransport):
    """httpx's ASGITransport applies no timeout: a request whose handler never returns would hang the test until
    pytest-timeout kills it, silently. This one fails the request at `timeout`, naming it."""

    def __init__(self, app, timeout: float):
        super().__init__(app=app)
        self.timeout = timeout

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            async with asyncio.timeout(self.timeout):
                return await super().handle_async_request(request)
        except TimeoutError:
            raise AssertionError(
                f"{request.method} {request.url.path} got no answer from the sidecar within {self.timeout:g}s"
            ) from None


@asynccontextmanager
async def sidecar(settings: SidecarSettings, server=None, timeout: float = 30, pod_events=None):
    """The sidecar app with its lifespan running, behind an httpx client (no socket; each request bounded by
    `timeout`); pod_events: where it posts Kubernetes Events (standins/kube_api.py). Its stop is bounded by STOP_S."""
    app = create_app(settings, server, pod_events)
    with sidecar_sized_heap():
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        try:
            async with httpx.AsyncClient(
                transport=DeadlineASGITransport(app, timeout), base_url="http://sidecar", timeout=timeout
            ) as client:
                yield client
        finally:
            try:
                async with asyncio.timeout(STOP_S):
                    await lifespan.__aexit__(None, None, None)
            except TimeoutError:
                raise AssertionError(
                    f"the sidecar did not stop within {STOP_S:g}s: a task of its own ignored its cancellation "
                    f"({[t.get_coro().__qualname__ for t in asyncio.all_tasks() if not t.done()]})"
                ) from None


async def until(check, timeout: float = 20.0, what: str = "", every: float = 0.1):
    """check()'s first truthy value, polled every `every` seconds; AssertionError saying what was waited for and the
    last value seen once `timeout` has passed. check is a function or a coroutine function; a tuple it returns is
    (the value, what it saw)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        got = await got if inspect.isawaitable(got) else got
        ok, seen = got if isinstance(got, tuple) else (got, got)
        if ok:
            return ok
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"not within {timeout:g}s: {what or check.__qualname__}; last seen: {seen!r}"
            )
        await asyncio.sleep(every)


async def wait_ready(c: httpx.AsyncClient, timeout: float = 30) -> dict:
    """Poll GET /ready until the sidecar's completion probe passes (a busy machine can take a few seconds
    to answer the stand-in's first completion); returns the /ready body."""

    async def ready():
        r = await c.get("/ready")
        return r.status_code == 200 and r.json(), r.json()

    return await until(ready, timeout, "GET /ready answering 200")


async def settle(c: httpx.AsyncClient, timeout: float = 30) -> dict:
    """Wait for the running transition to finish; returns it."""

    async def finished():
        st = (await c.get("/status")).json()
        return st["active_transition"] is None and st["transitions"][-1], st["active_transition"]

    return await until(finished, timeout, "the running transition to finish")


async def reach_step(c: httpx.AsyncClient, step: str, timeout: float = 30) -> dict:
    """Wait for the running transition to reach `step`; returns it."""

    async def there():
        t = (await c.get("/status")).json()["active_transition"]
        return t is not None and t["step"] == step and t, t

    return await until(there, timeout, f"the running transition at step {step}")


def audit_events(state_dir) -> list[str]:
    """The events of the audit log on disk, in order."""
    return [e["event"] for e in Store(state_dir, 50).audit_tail(1000)]


@contextmanager
def serve(settings: SidecarSettings, server):
    """The sidecar app under uvicorn in a thread; yields its URL."""
    port = free_port()
    uv = uvicorn.Server(server_config(create_app(settings, server), "127.0.0.1", port, "warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    with sidecar_sized_heap():
        thread.start()
        deadline = time.monotonic() + 10
        while not uv.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            uv.should_exit = True
            thread.join(10)


def kdtreectl(
    url: str | None, *args: str, token: str | None = None, timeout: float = 60, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m kdtreectl [--url URL] ARGS...` with no KDTREE_* from this environment but the token (and env)."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KDTREE_")}, **(env or {})}
    if token:
        env["KDTREE_ADMIN_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "kdtreectl", *(["--url", url] if url else []), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
