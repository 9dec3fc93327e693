"""GET/POST /gate: the gate's verdict, read-only, in the shapes Argo Rollouts' web metric (200 with JSON, `pass` read
by jsonPath "{$.pass}") and Flagger's webhooks (a status above 202 fails the check) consume.

The server is standins/standin_engine.py (a stand-in for SGLang, NOT SGLang: its HTTP contract and per-rank records).
"""

from __future__ import annotations

import httpx
import pytest
from sidecar_harness import make_settings, sidecar, wait_ready

from kdtree.config import Mode
from sidecar.api import GateVerdict

pytestmark = pytest.mark.anyio

GOOD_PARITY = ("--parity-calls", "500", "--parity-max-rel", "0.004")
# What Flagger POSTs to a webhook (CanaryWebhookPayload): the sidecar never reads it.
FLAGGER_PAYLOAD = {
    "name": "kdtree",
    "namespace": "kdtree",
    "phase": "Progressing",
    "checksum": "6d4c5f",
    "metadata": {"type": "pre-rollout"},
}


@pytest.fixture
def engine(engine):
    return lambda *args, **kw: engine("--tp-size", "2", "--heartbeat-s", "0.2", *args, **kw)


def completions(proc) -> int:
    return httpx.get(f"http://127.0.0.1:{proc.port}/_standin/stats").json()["completions"]


def verdict(body: dict) -> tuple:
    """A gate's verdict without its live values: what passed, and what failed."""
    criteria = [(c["name"], c["op"], c["threshold"], c["passed"]) for c in body["criteria"]]
    return body["pass"], body["failed"], body["from_mode"], body["to_mode"], criteria


async def test_a_passing_gate_is_200_for_both_shapes_and_sends_no_completion(engine, tmp_path):
    proc = engine(*GOOD_PARITY, mode=Mode.VALIDATE)
    # One background probe a minute: any completion during the test would be the gate's own.
    settings = make_settings(tmp_path, proc.port, probe_interval_s=60, gate_min_calls=100)
    async with sidecar(settings, server=proc) as c:
        await wait_ready(c)
        before = completions(proc)
        got = await c.get("/gate", params={"to": "on"})
        hook = await c.post("/gate?to=on", json=FLAGGER_PAYLOAD)
        for _ in range(5):
            await c.get("/gate")
        assert completions(proc) == before
    assert got.status_code == 200 and hook.status_code == 200
    # the same verdict for both shapes; the stand-in's ranks go on comparing calls between the two reads, so the
    # counts it reports may have grown
    assert verdict(got.json()) == verdict(hook.json())
    body = got.json()
    assert (
        body["pass"] is True
        and body["failed"] == []
        and (body["from_mode"], body["to_mode"]) == ("validate", "on")
    )
    assert {c["name"] for c in body["criteria"]} >= {"ranks_in_validate", "min_calls_compared", "max_rel_err"}
    assert GateVerdict.model_validate(body).passed is True  # kdtreectl and tests read it back typed


async def test_a_failing_gate_is_200_for_argo_and_412_for_flagger(engine, tmp_path):
    proc = engine("--parity-calls", "10", "--layers", "1", mode=Mode.VALIDATE)
    settings = make_settings(tmp_path, proc.port, gate_min_calls=10**9)
    async with sidecar(settings, server=proc) as c:
        await wait_ready(c)
        argo = await c.get("/gate?to=on")
        flagger = await c.post("/gate?to=on", json=FLAGGER_PAYLOAD)
        never_gated = await c.post("/gate?to=off", content=b"not JSON at all")  # the body is never read
        st = (await c.get("/status")).json()
    assert argo.status_code == 200 and argo.json()["pass"] is False
    assert argo.json()["failed"] == ["min_calls_compared"]
    assert flagger.status_code == 412 and flagger.json()["failed"] == ["min_calls_compared"]
    assert never_gated.status_code == 200 and never_gated.json()["pass"] is True
    assert never_gated.json()["criteria"] == []  # the kill switch is never gated
    assert st["transitions"] == [] and st["mode"]["current"] == "validate"  # read-only: nothing flipped


async def test_a_down_server_fails_the_gate_and_says_what_to_do(tmp_path):
    from standin_engine import free_port

    settings = make_settings(tmp_path, free_port(), probe_interval_s=0.2)
    async with sidecar(settings) as c:
        body = (await c.get("/gate?to=validate")).json()
    assert body["pass"] is False and body["failed"] == ["server_up"]
    assert "the server is down" in body["detail"]


async def test_the_target_is_one_mode_and_nothing_else_is_taken(tmp_path):
    from standin_engine import free_port

    async with sidecar(make_settings(tmp_path, free_port())) as c:
        bad = await c.get("/gate?to=turbo%0d%0aforged")
        put = await c.put("/gate")
    assert bad.status_code == 422 and put.status_code == 405
    assert (
        bad.json()["detail"][0]["loc"] == ["query", "to"] and "turbo" not in bad.text
    )  # named, never echoed
