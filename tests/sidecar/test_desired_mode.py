"""The desired mode held by the cluster (sidecar/desired_mode.py): the sidecar converges to the mode a file states,
through the same gate, bake and rollback as POST /mode, holds what was refused or rolled back (no loop), reports a bad
value without acting on it, and yields to POST /mode; what it did is in /status, /metrics and Events on the pod.

The server is standins/standin_engine.py (a stand-in for SGLang, NOT SGLang: its HTTP contract and per-rank records).
The Events go to standins/kube_api.py, a stand-in for the Kubernetes API server (NOT Kubernetes: the token, the Role's
one grant and the Event schema checked as the API server checks them).
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from kube_api import kube_api
from sidecar_harness import AUTH, audit_events, make_settings, settle, sidecar, until
from standin_engine import free_port

from kdtree.config import Mode
from kdtree.state.mode_file import read_desired_mode
from sidecar.desired_mode import DESIRED_MAX, parse_desired, read_desired
from sidecar.pod_events import PodEvents
from sidecar.store import SidecarState, Store, Transition
from sidecar.vocabulary import Outcome

pytestmark = pytest.mark.anyio

GOOD_PARITY = ("--parity-calls", "500", "--parity-max-rel", "0.004")
THIN_PARITY = ("--parity-calls", "10", "--layers", "1")
BAD_BAKE = ("--fault", "http-500", "--fault-in-mode", "on", "--fault-after", "1")
SA_TOKEN = "service-account-token"


@pytest.fixture
def engine(engine):
    return lambda *args, **kw: engine("--tp-size", "2", "--heartbeat-s", "0.2", *args, **kw)


@pytest.fixture
def cluster(tmp_path):
    """(the desired-mode file, the stand-in API server app, PodEvents posting to it)."""
    downward = tmp_path / "podinfo"
    downward.mkdir()
    token = tmp_path / "token"
    token.write_text(SA_TOKEN + "\n")
    api = kube_api(SA_TOKEN, "kdtree")
    events = PodEvents(
        "http://kube-api",
        "kdtree",
        "kdtree-7d9f-abcde",
        "0b6c2a55-2f7e-4c43-9a51-3d2f0f4a1e11",
        token,
        None,
        transport=httpx.ASGITransport(app=api),
    )
    return downward / "desired-mode", api, events


def desire(path, text: str) -> None:
    """Write the file as the kubelet refreshes a downward API volume: the new content swapped in whole."""
    tmp = path.with_name(".desired-mode.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def desired_state(c, state: str, content: str | None = "any", timeout: float = 30) -> dict:
    """/status once the desired mode is in `state` (for `content`, unless "any") and no transition runs."""

    async def there():
        doc = (await c.get("/status")).json()
        d = doc["desired_mode"]
        done = d["state"] == state and content in ("any", d["content"]) and doc["active_transition"] is None
        return done and doc, (d, doc["active_transition"])

    return await until(there, timeout, f"the desired mode {state} ({content}), no transition running")


def settings_for(tmp_path, proc, path, **kw):
    return make_settings(tmp_path, proc.port, desired_mode_file=path, bake_probes=2, **kw)


def reasons(api) -> list[str]:
    return [e["reason"] for e in api.state.events]


# ---- the value ----------------------------------------------------------------------------------------------------


def test_the_value_is_a_mode_with_an_optional_tag():
    assert parse_desired("on") == Mode.ON and parse_desired("validate@rollout-2026.12.04") == Mode.VALIDATE
    for bad, words in [
        ("turbo", "names no mode"),
        ("ON", "names no mode"),
        ("on@", "the tag"),
        ("on@a b", "the tag"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_desired(bad)


def test_the_file_is_read_bounded_through_the_downward_apis_symbolic_links(tmp_path):
    # The kubelet's layout: desired-mode -> ..data/desired-mode, ..data -> ..<timestamp>/
    stamp = tmp_path / "..2026_12_04_12_00_00.1"
    stamp.mkdir()
    (stamp / "desired-mode").write_text("on@2")
    (tmp_path / "..data").symlink_to(stamp.name)
    (tmp_path / "desired-mode").symlink_to("..data/desired-mode")
    v = read_desired(tmp_path / "desired-mode")
    assert (v.mode, v.content, v.error) == (Mode.ON, "on@2", None) and len(v.generation) == 12
    assert read_desired(tmp_path / "absent").mode is None and read_desired(tmp_path / "absent").error is None
    (tmp_path / "empty").write_text("\n")  # the annotation absent: the downward API writes an empty file
    assert read_desired(tmp_path / "empty").content is None
    (tmp_path / "big").write_text("on" + " " * DESIRED_MAX)
    assert "more than 256 bytes" in read_desired(tmp_path / "big").error
    os.mkfifo(tmp_path / "fifo")  # never waited on
    assert "not a regular file" in read_desired(tmp_path / "fifo").error
    assert read_desired(tmp_path / "desired-mode").generation != read_desired(tmp_path / "big").generation


# ---- converging ---------------------------------------------------------------------------------------------------


async def test_it_converges_through_the_gate_and_the_bake_and_says_so_on_the_pod(engine, tmp_path, cluster):
    path, api, events = cluster
    proc = engine(*GOOD_PARITY, mode=Mode.VALIDATE)
    desire(path, "validate")
    async with sidecar(settings_for(tmp_path, proc, path), server=proc, pod_events=events) as c:
        doc = await desired_state(c, "converged")
        assert doc["transitions"] == []  # already there: nothing flipped
        desire(path, "on")
        doc = await desired_state(c, "converged", "on")
        metrics = (await c.get("/metrics")).text
    (t,) = doc["transitions"]
    assert (t["from_mode"], t["to_mode"], t["outcome"], t["method"]) == (
        "validate",
        "on",
        "succeeded",
        "live",
    )
    assert "desired mode 'on' (kdtree.dev/desired-mode, generation" in t["reason"]
    assert t["gate"] and all(c["passed"] for c in t["gate"])  # the gate to on, as for POST /mode
    d = doc["desired_mode"]
    assert (d["mode"], d["content"], d["hold"], d["file"]) == ("on", "on", None, str(path))
    assert d["events"].startswith("on: Events on pod kdtree/kdtree-7d9f-abcde")
    assert read_desired_mode(tmp_path) == Mode.ON and proc.starts == 1
    assert "baking" in audit_events(tmp_path) and audit_events(tmp_path)[-1] == "succeeded"
    assert reasons(api) == ["DesiredModeConverged", "DesiredModeFlip", "DesiredModeConverged"]
    flip = api.state.events[1]
    assert flip["type"] == "Normal" and "flipping validate -> on (live)" in flip["message"]
    assert flip["involvedObject"]["uid"] == "0b6c2a55-2f7e-4c43-9a51-3d2f0f4a1e11"
    assert flip["metadata"]["name"].startswith("kdtree-7d9f-abcde.kdtree-")
    assert 'kdtree_desired_mode_state{kdtree_desired_mode_state="converged"} 1.0' in metrics
    assert 'kdtree_desired_mode_actions_total{action="flip"} 1.0' in metrics
    assert 'kdtree_desired_mode_actions_total{action="converged"} 1.0' in metrics
    assert 'kdtree_pod_events_total{result="posted"} 3.0' in metrics


async def test_off_is_reached_by_a_restart_and_unset_means_nothing_is_done(engine, tmp_path, cluster):
    path, api, events = cluster
    proc = engine(mode=Mode.VALIDATE)
    async with sidecar(settings_for(tmp_path, proc, path), server=proc, pod_events=events) as c:
        doc = await desired_state(c, "unset")
        assert doc["desired_mode"]["content"] is None and doc["transitions"] == []
        desire(path, "off")  # the kill switch, declared: never gated
        doc = await desired_state(c, "converged", "off")
    assert [(t["to_mode"], t["outcome"], t["method"]) for t in doc["transitions"]] == [
        ("off", "succeeded", "restart")
    ]
    assert proc.starts == 2 and read_desired_mode(tmp_path) == Mode.OFF


# ---- no loop --------------------------------------------------------------------------------------------------------


async def test_a_refused_value_is_held_not_retried_until_it_changes(engine, tmp_path, cluster):
    path, api, events = cluster
    proc = engine(*THIN_PARITY, mode=Mode.VALIDATE)
    desire(path, "on")
    # Far more compared calls than the stand-in and the probes ever make: refused however long the test runs.
    settings = settings_for(tmp_path, proc, path, gate_min_calls=10**9)
    async with sidecar(settings, server=proc, pod_events=events) as c:
        doc = await desired_state(c, "held")
        await asyncio.sleep(1.0)  # ten more ticks of the reconciler
        doc = await desired_state(c, "held")
        metrics = (await c.get("/metrics")).text
        hold = doc["desired_mode"]["hold"]
        assert (hold["verdict"], hold["content"]) == ("refused", "on")
        assert "min_calls_compared" in hold["detail"]
        assert 'kdtree_gate_refusals_total{to_mode="on"} 1.0' in metrics  # asked once
        assert audit_events(tmp_path).count("refused") == 1 and doc["transitions"] == []
        assert reasons(api) == ["DesiredModeHeld"] and api.state.events[0]["type"] == "Warning"
        desire(path, "on@2")  # a new intent of the same mode: asked once more
        doc = await desired_state(c, "held", "on@2")
    assert audit_events(tmp_path).count("refused") == 2
    assert doc["desired_mode"]["hold"]["content"] == "on@2"
    assert "desired_mode_hold_dropped" in audit_events(tmp_path)
    assert read_desired_mode(tmp_path) == Mode.VALIDATE and proc.starts == 1


async def test_a_rolled_back_value_is_held_across_a_sidecar_restart(engine, tmp_path, cluster):
    path, api, events = cluster
    proc = engine(*GOOD_PARITY, *BAD_BAKE, mode=Mode.VALIDATE)
    desire(path, "on")
    settings = settings_for(tmp_path, proc, path)
    async with sidecar(settings, server=proc, pod_events=events) as c:
        doc = await desired_state(c, "held")
        await asyncio.sleep(1.0)
        doc = await desired_state(c, "held")
    (t,) = doc["transitions"]
    assert (t["to_mode"], t["outcome"]) == ("on", "rolled_back") and "bake probe" in t["failure"]
    hold = doc["desired_mode"]["hold"]
    assert (hold["verdict"], hold["transition"]) == ("rolled_back", t["id"])
    assert reasons(api) == ["DesiredModeFlip", "DesiredModeHeld"]
    # A new sidecar on the same state volume (the hold is in the state file): no second try.
    async with sidecar(settings, server=proc) as c:
        await asyncio.sleep(1.0)
        doc = await desired_state(c, "held")
    assert len(doc["transitions"]) == 1 and doc["desired_mode"]["events"].startswith(
        "off: not in a Kubernetes pod"
    )
    assert read_desired_mode(tmp_path) == Mode.VALIDATE and audit_events(tmp_path).count("accepted") == 1


async def test_a_flip_for_the_value_that_ended_while_no_sidecar_followed_it_holds_it(
    engine, tmp_path, cluster
):
    """The sidecar stopped mid-flip and its next start rolled the flip back: the value is held, not asked again."""
    path, api, events = cluster
    proc = engine(*GOOD_PARITY, mode=Mode.VALIDATE)
    desire(path, "on")
    generation = read_desired(path).generation
    interrupted = Transition(
        from_mode=Mode.VALIDATE,
        to_mode=Mode.ON,
        reason=f"desired mode 'on' (kdtree.dev/desired-mode, generation {generation})",
        outcome=Outcome.ROLLED_BACK,
        failure="the sidecar stopped at step baking; the server's mode is unverified",
        interrupted=True,
    )
    Store(tmp_path, 50).save(SidecarState(current_mode=Mode.VALIDATE, history=[interrupted]))
    async with sidecar(settings_for(tmp_path, proc, path), server=proc, pod_events=events) as c:
        doc = await desired_state(c, "held")
        await asyncio.sleep(0.5)
        doc = await desired_state(c, "held")
    hold = doc["desired_mode"]["hold"]
    assert (hold["verdict"], hold["transition"]) == ("rolled_back", interrupted.id)
    assert "stopped at step baking" in hold["detail"] and len(doc["transitions"]) == 1
    assert "accepted" not in audit_events(tmp_path)


async def test_a_bad_value_is_reported_and_never_acted_on(engine, tmp_path, cluster):
    path, api, events = cluster
    proc = engine(mode=Mode.VALIDATE)
    desire(path, "turbo")
    async with sidecar(settings_for(tmp_path, proc, path), server=proc, pod_events=events) as c:
        doc = await desired_state(c, "invalid")
        await asyncio.sleep(0.5)
        metrics = (await c.get("/metrics")).text
        ready = await c.get("/ready")
    d = doc["desired_mode"]
    assert d["mode"] is None and d["content"] == "turbo" and "names no mode" in d["detail"]
    assert "off, validate, on, standby" in d["detail"]
    assert doc["transitions"] == [] and proc.starts == 1 and ready.status_code == 200
    assert reasons(api) == ["DesiredModeInvalid"]  # once, however many ticks
    assert 'kdtree_desired_mode_actions_total{action="invalid"} 1.0' in metrics


# ---- POST /mode ------------------------------------------------------------------------------------------------------


async def test_post_mode_overrides_the_desired_mode_and_the_kill_switch_sticks(engine, tmp_path, cluster):
    path, api, events = cluster
    proc = engine(mode=Mode.VALIDATE)
    desire(path, "validate")
    async with sidecar(settings_for(tmp_path, proc, path), server=proc, pod_events=events) as c:
        await desired_state(c, "converged")
        r = await c.post("/mode", json={"mode": "off", "reason": "incident"}, headers=AUTH)
        assert r.status_code == 202
        await settle(c)
        await asyncio.sleep(1.0)
        doc = await desired_state(c, "held")
        assert doc["desired_mode"]["hold"]["verdict"] == "overridden" and proc.starts == 2
        assert [t["to_mode"] for t in doc["transitions"]] == ["off"]  # not flipped back to validate
        # The operator asks for the desired mode itself: the hold is dropped and that flip is followed.
        r = await c.post("/mode", json={"mode": "validate"}, headers=AUTH)
        assert r.status_code == 202
        doc = await desired_state(c, "converged")
    assert doc["desired_mode"]["hold"] is None and [t["to_mode"] for t in doc["transitions"]] == [
        "off",
        "validate",
    ]
    assert "DesiredModeOverridden" in reasons(api)


async def test_the_sidecar_stops_whenever_its_stop_lands(tmp_path, cluster):
    """Its stop cancels the desired-mode loop wherever it waits. Python 3.11's asyncio.wait_for returns the result of
    a read that completed as the cancellation landed, and drops the cancellation: the loop read on, and the stop
    waited for it forever (how the kill-switch test above hung for 15 minutes on a loaded machine). The loop reads
    every millisecond here, so that stops land on reads."""
    path, _, events = cluster
    desire(path, "validate")
    settings = make_settings(tmp_path, free_port(), desired_mode_file=path, probe_interval_s=0.001)
    for _ in range(20):
        async with sidecar(settings, pod_events=events):
            await asyncio.sleep(0.05)


async def test_events_the_role_does_not_grant_are_counted_and_change_nothing(engine, tmp_path, cluster):
    path, _, _ = cluster
    api = kube_api(SA_TOKEN, "kdtree", granted=())  # a Role without create on events
    events = PodEvents(
        "http://kube-api",
        "kdtree",
        "p",
        "u",
        tmp_path / "token",
        None,
        transport=httpx.ASGITransport(app=api),
    )
    proc = engine(mode=Mode.VALIDATE)
    desire(path, "validate")
    async with sidecar(settings_for(tmp_path, proc, path), server=proc, pod_events=events) as c:
        doc = await desired_state(c, "converged")
        metrics = (await c.get("/metrics")).text
    assert "1 failed, the latest: RuntimeError: HTTP 403" in doc["desired_mode"]["events"]
    assert 'kdtree_pod_events_total{result="failed"} 1.0' in metrics and api.state.events == []


# ---- the pod's own API server -------------------------------------------------------------------------------------


def test_events_are_addressed_from_the_pods_own_files_or_say_why_not(tmp_path, monkeypatch):
    sa, downward = tmp_path / "serviceaccount", tmp_path / "podinfo"
    sa.mkdir()
    downward.mkdir()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    events, why = PodEvents.in_cluster(downward, sa)
    assert events is None and why == "off: not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST)"
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    events, why = PodEvents.in_cluster(downward, sa)
    assert events is None and why.startswith("off: ") and "namespace" in why and "deployment.yaml" in why
    (sa / "namespace").write_text("kdtree")
    (downward / "pod-name").write_text("kdtree-7d9f-abcde")
    (downward / "pod-uid").write_text("0b6c2a55\n")
    events, why = PodEvents.in_cluster(downward, sa)
    assert events is None and "token" in why  # no token: no Events
    (sa / "token").write_text(SA_TOKEN)
    events, why = PodEvents.in_cluster(downward, sa)
    assert why == "on: Events on pod kdtree/kdtree-7d9f-abcde"
    assert (events.api_url, events.namespace, events.pod_uid) == (
        "https://10.96.0.1:443",
        "kdtree",
        "0b6c2a55",
    )
    event = events.event("Warning", "DesiredModeHeld", "x" * 5000)
    assert (
        len(event["message"]) == 1024
        and event["involvedObject"]["fieldPath"] == "spec.initContainers{sidecar}"
    )
