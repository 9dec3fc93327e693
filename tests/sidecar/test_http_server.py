"""sidecar/http_server.py: the sidecar under uvicorn (the real app, in a thread) closes a connection whose request has
not arrived whole within REQUEST_ARRIVAL_S (shortened here), head or body, and serves every other request as before,
including one whose handler outlasts that time."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from sidecar_harness import AUTH, make_settings, serve
from standin_engine import free_port

from sidecar import http_server

ARRIVAL_S = 0.6


@pytest.fixture
def url(tmp_path, monkeypatch):
    monkeypatch.setattr(http_server, "REQUEST_ARRIVAL_S", ARRIVAL_S)
    with serve(make_settings(tmp_path, free_port()), None) as u:
        yield u


def trickle(url: str, first: bytes, then: bytes, *, every_s: float = 0.1, for_s: float = 5.0) -> float:
    """Send `first`, then `then` a byte every `every_s`: seconds until the server closed the connection (or for_s)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=for_s) as s:
        t0 = time.monotonic()
        s.sendall(first)
        for i in range(int(for_s / every_s)):
            try:
                s.sendall(then[i % len(then) : i % len(then) + 1])
            except OSError:  # reset: closed by the server
                return time.monotonic() - t0
            s.settimeout(every_s)
            try:
                if s.recv(4096) == b"":
                    return time.monotonic() - t0
            except TimeoutError:
                pass
            except OSError:
                return time.monotonic() - t0
    return for_s


@pytest.mark.parametrize(
    "first, then",
    [
        (b"", b"GET /live HTTP/1.1\r\nHost: x\r\n"),  # its head, a byte at a time
        (b"GET /live HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a"),  # a header line that never ends
        (
            b"POST /mode HTTP/1.1\r\nHost: x\r\nAuthorization: " + AUTH["Authorization"].encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
            b" ",
        ),  # an authenticated body, a byte at a time
    ],
    ids=["head", "header-line", "body"],
)  # fmt: skip
def test_a_request_that_does_not_arrive_in_time_is_closed(url, first, then):
    assert ARRIVAL_S - 0.05 < trickle(url, first, then) < ARRIVAL_S + 1.5


def test_requests_that_arrive_are_served_on_a_kept_alive_connection_past_the_deadline(url):
    with httpx.Client(base_url=url, timeout=5) as c:  # one connection, kept alive
        for _ in range(3):
            assert c.get("/live").json() == {"live": True}
            time.sleep(ARRIVAL_S / 2)


def test_a_handler_may_take_longer_than_the_arrival_deadline(monkeypatch):
    """POST /mode waits out a flip's bake: a request that has arrived is answered however long its handler takes (a
    FastAPI app of one slow route, under the sidecar's server configuration)."""
    monkeypatch.setattr(http_server, "REQUEST_ARRIVAL_S", ARRIVAL_S)
    app = FastAPI()

    @app.post("/slow")
    async def slow(body: dict) -> dict:
        await asyncio.sleep(3 * ARRIVAL_S)
        return body

    port = free_port()
    uv = uvicorn.Server(http_server.server_config(app, "127.0.0.1", port, "warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        while not uv.started:
            time.sleep(0.05)
        r = httpx.post(f"http://127.0.0.1:{port}/slow", json={"a": 1}, timeout=10)
    finally:
        uv.should_exit = True
        thread.join(10)
    assert r.status_code == 200 and r.json() == {"a": 1}
