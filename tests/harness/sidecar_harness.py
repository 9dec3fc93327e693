"""What the sidecar tests share: settings with short timings, the app behind an in-process client or
under uvicorn in a thread, and kdtreectl run as a user runs it."""

from __future__ import annotations

import asyncio
import gc
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


@asynccontextmanager
async def sidecar(settings: SidecarSettings, server=None, timeout: float = 30, pod_events=None):
    """The sidecar app with its lifespan running, behind an httpx client (no socket); pod_events: where it posts
    Kubernetes Events (standins/kube_api.py)."""
    app = create_app(settings, server, pod_events)
    with sidecar_sized_heap():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://sidecar", timeout=timeout
            ) as client:
                yield client


async def wait_ready(c: httpx.AsyncClient, timeout: float = 30) -> dict:
    """Poll GET /ready until the sidecar's completion probe passes (a busy machine can take a few seconds
    to answer the stand-in's first completion); returns the /ready body."""
    deadline = time.monotonic() + timeout
    while True:
        r = await c.get("/ready")
        if r.status_code == 200:
            return r.json()
        if time.monotonic() > deadline:
            raise AssertionError(f"the sidecar was not ready within {timeout:g}s: {r.json()}")
        await asyncio.sleep(0.1)


async def settle(c: httpx.AsyncClient, timeout: float = 30) -> dict:
    """Wait for the running transition to finish; returns it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = (await c.get("/status")).json()
        if st["active_transition"] is None:
            return st["transitions"][-1]
        await asyncio.sleep(0.1)
    raise AssertionError(f"transition still running: {st['active_transition']}")


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
