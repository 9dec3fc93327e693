"""A tensor-parallel group over two nodes (sidecar/group_worker.py, sidecar/group_leader.py), simulated as
processes: no Docker, no cluster.

Each node is standins/standin_engine.py (NOT SGLang) under the server entrypoint's real supervisor and a stand-in
orchestrator (standins/process_harness.py), with its own state directory, four ranks spread two per node: node 0
serves the HTTP API, node 1 runs SGLang's dummy health server (200 on /health whatever its ranks do) and takes the
verify steps node 0 runs. Node 1's sidecar (KDTREE_GROUP_ROLE=worker) runs under uvicorn; node 0's (leader) reads
it through a TCP relay the test cuts to make a partition between the two sidecars.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from contextlib import ExitStack, contextmanager, suppress

import httpx
import pytest
from process_harness import SupervisedStandin
from sidecar_harness import AUTH, TOKEN, make_settings, reach_step, serve, settle, sidecar, until, wait_ready
from standin_engine import free_port

from kdtree.config import ConfigError, Mode
from kdtree.state.mode_file import read_desired_mode, write_desired_mode
from kdtree.state.owed_modes import OwedMode, owed_path, read_owed_modes
from kdtree.state.rank_records import read_records
from sidecar.group_leader import READ_REUSE_S, GroupClient
from sidecar.settings import SidecarSettings

pytestmark = pytest.mark.anyio
TP, NODES = 4, 2
ENGINE = ("--tp-size", str(TP), "--nnodes", str(NODES), "--heartbeat-s", "0.2", "--parity-calls", "5000")


class Relay:
    """A TCP relay to the worker's sidecar that a test can cut (open=False, a partition: connections are closed at
    once) or silence (silent=True, a stopped sidecar, as after SIGSTOP: connections are taken and never answered)."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.open = True
        self.silent = False
        self.held: list[socket.socket] = []  # the connections a silent sidecar took and does not answer
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            if not self.open:
                conn.close()
                continue
            if self.silent:
                self.held.append(conn)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                conn.close()
                continue
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst):
        with suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self):
        self.server.close()
        for conn in self.held:
            conn.close()


class Group:
    """Stand-in nodes (two unless told), each worker's sidecar behind a relay, and the settings of the leader's
    sidecar; `relay`, `worker_url` and `worker_settings` are node 1's."""

    def __init__(self, tmp_path, mode: Mode | None = Mode.VALIDATE, worker_args=(), nnodes: int = NODES):
        """mode: written into each node's mode file; None writes none (a fresh stack: the ranks start in
        KDTREE_VERIFY's mode, as compose/two-node.yaml's do). nnodes: two ranks on each node."""
        self.nnodes, self.tp = nnodes, nnodes * TP // NODES
        self.dirs = [tmp_path / f"node{i}" for i in range(nnodes)]
        for d in self.dirs:
            d.mkdir()
            if mode is not None:
                write_desired_mode(d, mode)
        self.ports = [free_port() for _ in range(nnodes)]
        env = {
            "KDTREE_VERIFY": (mode or Mode.VALIDATE).value
        }  # the mode a server starts in without a mode file
        engine = (*ENGINE, "--tp-size", str(self.tp), "--nnodes", str(nnodes))  # the later flags win
        leader = ("--leader-url", f"http://127.0.0.1:{self.ports[0]}", *worker_args)
        self.nodes = [
            SupervisedStandin(port, str(d), [*engine, "--node-rank", str(i), *(leader * (i > 0))], env=env)
            for i, (port, d) in enumerate(zip(self.ports, self.dirs, strict=True))
        ]
        self.all_worker_settings = [
            self.settings(self.dirs[i], self.ports[i], "worker", node_rank=i) for i in range(1, nnodes)
        ]
        self.worker_settings = self.all_worker_settings[0]
        self.relays: list[Relay] = []  # node 1's first
        self.worker_urls: list[str] = []

    def settings(self, state_dir, port, role, **overrides) -> SidecarSettings:
        return group_settings(
            state_dir, port, role, expected_tp_size=self.tp, nnodes=self.nnodes, **overrides
        )

    def leader_settings(self, **overrides) -> SidecarSettings:
        urls = [f"http://127.0.0.1:{r.port}" for r in self.relays]
        return self.settings(self.dirs[0], self.ports[0], "leader", group_workers=urls, **overrides)

    @property
    def relay(self) -> Relay:
        return self.relays[0]

    @property
    def worker_url(self) -> str:
        return self.worker_urls[0]

    @property
    def relay_url(self) -> str:
        return f"http://127.0.0.1:{self.relay.port}"


GROUP_TOKEN = (
    "test-group-token"  # the leader sends it to its workers; a worker holds no other (not the admin token)
)
GROUP_AUTH = {"Authorization": f"Bearer {GROUP_TOKEN}"}


def group_settings(state_dir, port, role, **overrides) -> SidecarSettings:
    tokens = dict(group_token=GROUP_TOKEN, **({"admin_token": None} if role == "worker" else {}))
    base = dict(expected_tp_size=TP, nnodes=NODES, group_role=role, verify=Mode.VALIDATE, **tokens)
    return make_settings(state_dir, port, **{**base, **overrides})


@pytest.fixture
def group(tmp_path, request):
    with running(Group(tmp_path, worker_args=getattr(request, "param", ()))) as g:
        yield g


@contextmanager
def running(g: Group):
    for n in g.nodes:
        n.start()
    try:
        for n in g.nodes:
            n.wait_port()
        with ExitStack() as workers:
            for settings, node in zip(g.all_worker_settings, g.nodes[1:], strict=True):
                url = workers.enter_context(serve(settings, node))
                g.worker_urls.append(url)
                g.relays.append(relay := Relay(int(url.rsplit(":", 1)[1])))
                workers.callback(relay.close)
            yield g
    finally:
        for n in g.nodes:
            n.stop()


async def ready_reasons(c: httpx.AsyncClient) -> list[str]:
    r = await c.get("/ready")
    return [] if r.status_code == 200 else r.json()["reasons"]


async def not_ready_naming(c, *texts: str, timeout: float = 20.0) -> list[str]:
    """/ready's reasons once every text is in one of them (ranks go stale each on its own heartbeat)."""

    async def check():
        reasons = await ready_reasons(c)
        return all(any(t in r for r in reasons) for t in texts) and reasons, reasons

    return await until(check, timeout, f"/ready's reasons naming {texts}")


def modes_of_ranks(g: Group) -> dict[int, str]:
    views = [v for d in g.dirs for v in read_records(d, max_age_s=3.0) if not v.stale]
    return {v.record.tp_rank: v.record.mode for v in views}


# ---- settings -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, names",
    [
        (dict(group_role="worker", nnodes=2, node_rank=1, group_workers="http://a:8080"), "only the leader"),
        (dict(group_role="leader", nnodes=2, group_workers="ftp://a"), "not an http\\(s\\) URL"),
        (dict(group_role="leader", nnodes=2, group_workers=",".join(["http://a:1"] * 64)), "at most 63"),
        (
            dict(group_role="leader", nnodes=3, group_workers="http://a:8080"),
            "one sidecar URL for each other",
        ),
        (dict(group_role="worker", nnodes=2, node_rank=2), "node 1 .. nnodes-1"),
        (
            dict(group_role="worker", nnodes=2, node_rank=1, admin_token=None, desired_mode_file="/x"),
            "a worker's mode is its leader's to set",
        ),
        (dict(group_role="single", nnodes=2), "KDTREE_GROUP_ROLE=leader on node 0"),
        (dict(group_role="leader", nnodes=2, group_workers="http://a", expected_tp_size=3), "not divisible"),
        (
            dict(
                group_role="worker",
                nnodes=2,
                node_rank=1,
                admin_token=None,
                allow_open_admin=True,
                group_token=None,
            ),
            "without a group token",
        ),  # fmt: skip
        (dict(group_role="worker", nnodes=2, node_rank=1), "unset KDTREE_ADMIN_TOKEN"),  # least privilege
        (
            dict(group_role="leader", nnodes=2, group_workers="http://a", group_token=TOKEN),
            "equals KDTREE_ADMIN",
        ),
        (dict(group_token="g"), "only a group's sidecars use it"),
        (dict(group_role="leader", nnodes=2, group_workers="http://a", group_token="a b"), "printable ASCII"),
    ],
)
def test_group_settings_are_refused_with_the_fix(fields, names, tmp_path):
    base = dict(state_dir=str(tmp_path), admin_token=TOKEN, expected_tp_size=4, group_token=GROUP_TOKEN)
    if fields.get("group_role", "single") == "single":
        base.pop("group_token")
    with pytest.raises(ConfigError, match=names):
        SidecarSettings.load(**{**base, **fields})


def test_group_settings_from_leaderworkerset_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LWS_GROUP_SIZE", "2")
    monkeypatch.setenv("LWS_WORKER_INDEX", "1")
    monkeypatch.setenv("KDTREE_GROUP_ROLE", "worker")
    s = SidecarSettings.load(state_dir=str(tmp_path), group_token=GROUP_TOKEN, expected_tp_size=8)
    assert (s.nnodes, s.node_rank, list(s.node_ranks(1)), s.rank_name(5)) == (
        2,
        1,
        [4, 5, 6, 7],
        "node 1 rank 5",
    )


# ---- the worker's sidecar --------------------------------------------------------------------------------


async def test_a_worker_answers_its_leader_only(group):
    async with httpx.AsyncClient(base_url=group.worker_url, timeout=10) as w:
        assert (await w.get("/live")).status_code == 200
        for method, path in [("GET", "/ready"), ("GET", "/status"), ("GET", "/metrics"),
                             ("POST", "/group/mode"), ("POST", "/group/restart"), ("POST", "/mode")]:  # fmt: skip
            r = await w.request(method, path, content=b"x" * 100_000)  # refused before the body is read
            assert r.status_code == 401, (path, r.status_code)
            r = await w.request(method, path, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 403, path
        assert read_desired_mode(group.dirs[1]) == Mode.VALIDATE and group.nodes[1].starts == 1
        r = await w.post(
            "/group/mode", content=b"{" * 1000, headers={**GROUP_AUTH, "Content-Type": "application/json"}
        )
        assert r.status_code == 413
        r = await w.post(
            "/group/mode", content=b'{"mode": "on"}', headers={**GROUP_AUTH, "Content-Type": "text/plain"}
        )
        assert r.status_code == 415 and read_desired_mode(group.dirs[1]) == Mode.VALIDATE
        r = await w.post("/mode", json={"mode": "on"}, headers=GROUP_AUTH)
        assert r.status_code == 409 and "POST /mode to the leader's sidecar" in r.json()["error"]
        r = await until(lambda: _ok(w.get("/ready", headers=GROUP_AUTH)))
        assert r.json()["node_rank"] == 1


async def test_the_group_token_a_worker_holds_cannot_change_the_groups_mode(group):
    """Least privilege: a worker's pod holds the group token only, and the leader's POST /mode takes the admin token
    only, so a worker taken over cannot flip the group."""
    async with sidecar(group.leader_settings()) as c:
        r = await c.post("/mode", json={"mode": "off"}, headers=GROUP_AUTH)
        assert r.status_code == 403 and "KDTREE_ADMIN_TOKEN" in r.text
    assert (
        read_desired_mode(group.dirs[0]) == Mode.VALIDATE
        and read_desired_mode(group.dirs[1]) == Mode.VALIDATE
    )


async def test_the_workers_readiness_probe_sends_the_token(group, monkeypatch, capsys, tmp_path):
    """The LeaderWorkerSet worker's readinessProbe: `python -m sidecar.healthcheck /ready` with the pod's token file."""
    from sidecar import healthcheck

    async with httpx.AsyncClient(base_url=group.worker_url, timeout=10) as w:
        await until(lambda: _ok(w.get("/ready", headers=GROUP_AUTH)))
    for var in (
        "KDTREE_ADMIN_TOKEN",
        "KDTREE_ADMIN_TOKEN_FILE",
        "KDTREE_GROUP_TOKEN",
        "KDTREE_GROUP_TOKEN_FILE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KDTREE_SIDECAR_PORT", group.worker_url.rsplit(":", 1)[1])
    monkeypatch.setenv("KDTREE_GROUP_ROLE", "worker")
    assert await asyncio.to_thread(healthcheck.main, ["/ready"]) == 1
    assert "GET /ready answered 401" in capsys.readouterr().out
    monkeypatch.setenv(
        "KDTREE_ADMIN_TOKEN", TOKEN
    )  # a worker's sidecar takes no admin token, even if one is there
    assert await asyncio.to_thread(healthcheck.main, ["/ready"]) == 1
    assert "GET /ready answered 401" in capsys.readouterr().out
    (tmp_path / "token").write_text(GROUP_TOKEN + "\n")
    monkeypatch.setenv("KDTREE_GROUP_TOKEN_FILE", str(tmp_path / "token"))
    assert await asyncio.to_thread(healthcheck.main, ["/ready"]) == 0
    assert await asyncio.to_thread(healthcheck.main, ["/live"]) == 0


async def _ok(request):
    r = await request
    return r if r.status_code == 200 else None


# ---- readiness -------------------------------------------------------------------------------------------


async def test_ready_only_with_every_rank_of_every_node(group):
    async with sidecar(group.leader_settings()) as c:
        await wait_ready(c)
        st = (await c.get("/status")).json()
        assert sorted(v["record"]["tp_rank"] for v in st["ranks"]) == [0, 1, 2, 3]
        assert [(n["node"], n["ranks_reporting"], n["reachable"], n["mode_file"]) for n in st["group"]] == [
            (0, [0, 1], True, "validate"),  # the leader's own mode file too
            (1, [2, 3], True, "validate"),
        ]
        text = (await c.get("/metrics")).text
        assert 'kdtree_group_rank_node{node="1",rank="3"} 1.0' in text
        assert 'kdtree_group_node_up{node="1"} 1.0' in text and 'kdtree_rank_up{rank="3"} 1.0' in text

        # Node 1's ranks wedge; its HTTP server, SGLang's dummy, still answers 200.
        async with httpx.AsyncClient(timeout=5) as h:
            await h.post(f"http://127.0.0.1:{group.ports[1]}/_standin/fault", json={"fault": "wedged-ranks"})
            reasons = await not_ready_naming(
                c, "node 1 rank 2: record is stale", "node 1 rank 3: record is stale"
            )
            assert not any("node 0" in r for r in reasons)
            assert (await h.get(f"http://127.0.0.1:{group.ports[1]}/health")).status_code == 200
            async with httpx.AsyncClient(base_url=group.worker_url, timeout=10) as w:
                r = await w.get("/ready", headers=GROUP_AUTH)
                assert r.status_code == 503 and "node 1 rank 2: record is stale" in r.json()["reasons"][0]
            await h.post(f"http://127.0.0.1:{group.ports[1]}/_standin/fault", json={"fault": "none"})
        await wait_ready(c)


async def test_a_fresh_group_without_mode_files_is_ready(tmp_path):
    """No node has a mode file yet (a first start: every server starts in KDTREE_VERIFY's mode): the group is ready;
    a node's missing mode file is no problem, as on one node, while its ranks run the group's mode."""
    with running(Group(tmp_path, mode=None)) as g:
        async with sidecar(g.leader_settings()) as c:
            await wait_ready(c)
            st = (await c.get("/status")).json()
            assert [n["mode_file"] for n in st["group"]] == [None, None] and st["reasons"] == []


async def test_a_worker_killed_and_back(group):
    async with sidecar(group.leader_settings()) as c:
        await wait_ready(c)
        group.nodes[1].proc.kill()  # the node's server dies; the orchestrator starts it again after a while
        reasons = await not_ready_naming(c, "node 1 rank 2")
        assert not any(r.startswith("node 0") for r in reasons)
        await wait_ready(c, timeout=30)
        assert group.nodes[1].starts == 2


async def test_a_partition_between_the_sidecars(group):
    async with sidecar(group.leader_settings()) as c:
        await wait_ready(c)
        group.relay.open = False
        reasons = await not_ready_naming(c, "node 1 rank 2: unread: node 1's sidecar")
        st = (await c.get("/status")).json()
        assert st["group"][1]["reachable"] is False and st["group"][1]["error"]
        assert 'kdtree_group_node_up{node="1"} 0.0' in (await c.get("/metrics")).text
        # The worker itself is fine: its own readiness says so to whoever reaches it.
        async with httpx.AsyncClient(base_url=group.worker_url, timeout=10) as w:
            assert (await w.get("/ready", headers=GROUP_AUTH)).status_code == 200
        # A flip other than the kill switch is refused while a node is unread, naming it; nothing changes.
        r = await c.post("/mode", json={"mode": "on"}, headers=AUTH)
        assert r.status_code == 503 and "node 1's sidecar" in r.json()["error"], r.json()
        assert read_desired_mode(group.dirs[0]) == Mode.VALIDATE
        group.relay.open = True
        await wait_ready(c)
        assert reasons


async def test_the_leaders_sidecar_restarted(group):
    async with sidecar(group.leader_settings()) as c:
        await wait_ready(c)
    async with sidecar(group.leader_settings()) as c:
        body = await wait_ready(c)
        assert body["mode"] == "validate"


async def test_a_worker_restarting_alone(group):
    async with sidecar(group.leader_settings()) as c:
        await wait_ready(c)
        await asyncio.to_thread(group.nodes[1].restart, 2)  # its own restart, not the leader's
        await wait_ready(c, timeout=30)
        assert group.nodes[1].starts == 2 and group.nodes[0].starts == 1
        assert set(modes_of_ranks(group).values()) == {"validate"}


# ---- the gate ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [("--parity-calls", "0", "--layers", "1")], indirect=True)
async def test_the_gate_reads_every_rank_of_every_node(group):
    """Node 1's ranks compared too few calls (node 0's 5000 and more): the gate to on fails on their evidence."""
    async with sidecar(group.leader_settings(gate_min_calls=4000)) as c:
        await wait_ready(c)
        r = await c.post("/mode", json={"mode": "on", "dry_run": True}, headers=AUTH)
        body = r.json()
        assert r.status_code == 200 and body["allowed"] is False, body
        (failed,) = [x for x in body["criteria"] if not x["passed"]]
        assert failed["name"] == "min_calls_compared" and failed["value"] < 4000, failed
        assert [x["value"] for x in body["criteria"] if x["name"] == "ranks_in_validate"] == [TP]
        r = await c.post("/mode", json={"mode": "on"}, headers=AUTH)
        assert r.status_code == 412 and read_desired_mode(group.dirs[1]) == Mode.VALIDATE


# ---- flips -----------------------------------------------------------------------------------------------


async def test_a_live_flip_is_confirmed_by_every_rank_of_both_nodes(group):
    async with sidecar(group.leader_settings()) as c:
        await wait_ready(c)
        r = await c.post("/mode", json={"mode": "on", "reason": "group"}, headers=AUTH)
        assert r.status_code == 202 and r.json()["method"] == "live", r.json()
        t = await settle(c)
        assert t["outcome"] == "succeeded", t
        assert t["ranks_confirmed"] == TP
        assert [read_desired_mode(d) for d in group.dirs] == [Mode.ON, Mode.ON]
        assert modes_of_ranks(group) == {0: "on", 1: "on", 2: "on", 3: "on"}
        assert [n.starts for n in group.nodes] == [1, 1]  # live: no restart anywhere
        await wait_ready(c)


async def test_a_restart_flip_restarts_the_group(group):
    async with sidecar(group.leader_settings()) as c:
        await wait_ready(c)
        r = await c.post("/mode", json={"mode": "off", "reason": "group restart"}, headers=AUTH)
        assert r.status_code == 202 and r.json()["method"] == "restart"
        t = await settle(c, timeout=60)
        assert t["outcome"] == "succeeded", t
        assert [n.starts for n in group.nodes] == [2, 2]
        assert [read_desired_mode(d) for d in group.dirs] == [Mode.OFF, Mode.OFF]
        assert modes_of_ranks(group) == {0: "off", 1: "off", 2: "off", 3: "off"}
        # The worker was restarted first, the leader after it.
        w0 = min(v.record.started_at for v in read_records(group.dirs[1]))
        l0 = min(v.record.started_at for v in read_records(group.dirs[0]))
        assert w0 < l0


async def test_the_kill_switch_with_a_worker_unreachable(group):
    async with sidecar(group.leader_settings(ready_timeout_s=40.0)) as c:
        await wait_ready(c)
        group.relay.open = False
        await not_ready_naming(c, "node 1's sidecar")
        r = await c.post("/mode", json={"mode": "off", "reason": "kill"}, headers=AUTH)
        assert r.status_code == 202, r.json()
        await until(lambda: group.nodes[0].starts == 2, timeout=30)
        assert read_desired_mode(group.dirs[0]) == Mode.OFF
        assert read_desired_mode(group.dirs[1]) == Mode.VALIDATE  # unreachable: owed, not written
        st = (await c.get("/status")).json()
        assert st["group"][1]["owed"] == "off"
        assert read_owed_modes(group.dirs[0], NODES) == {1: OwedMode(mode=Mode.OFF, restart=True)}
        group.relay.open = True  # the node answers again: it gets off and its restart
        t = await settle(c, timeout=60)
        assert t["outcome"] == "succeeded", t
        assert read_desired_mode(group.dirs[1]) == Mode.OFF and group.nodes[1].starts == 2
        assert read_owed_modes(group.dirs[0], NODES) == {}
        assert modes_of_ranks(group) == {0: "off", 1: "off", 2: "off", 3: "off"}


# ---- the kill switch is a one-way door ----------------------------------------------------------------------


@pytest.mark.parametrize("restarts", [1, 2])
async def test_off_owed_to_a_silent_worker_outlives_restarts_of_the_leaders_sidecar(group, restarts):
    """Node 1's sidecar stops (as after SIGSTOP) and the kill switch is asked: node 0 goes off, node 1 is owed off.
    The leader's sidecar restarted before node 1 answers (once, twice) finishes the off flip, never rolls it back:
    node 1 stays owed off and runs off once it answers. (Before: the first restart rolled the flip back, node 0 to
    validate and node 1's debt with it.)"""
    settings = group.leader_settings(ready_timeout_s=60.0)
    d0, d1 = group.dirs
    owed_off = {1: OwedMode(mode=Mode.OFF, restart=True)}
    async with sidecar(settings) as c:
        await wait_ready(c)
        group.relay.silent = True
        r = await c.post("/mode", json={"mode": "off", "reason": "kill"}, headers=AUTH)
        assert r.status_code == 202, r.json()
        await until(lambda: group.nodes[0].starts == 2, timeout=30)
        assert read_owed_modes(d0, NODES) == owed_off
    for _ in range(restarts):
        async with sidecar(settings) as c:
            st = (await c.get("/status")).json()
            t = st["active_transition"]
            assert (t["to_mode"], t["interrupted"], st["phase"]) == ("off", True, "restarting"), st
            await asyncio.sleep(1.5)  # a rollback wrote validate within this
            assert read_desired_mode(d0) == Mode.OFF and read_owed_modes(d0, NODES) == owed_off
            assert (await c.get("/status")).json()["group"][1]["owed"] == "off"
    assert group.nodes[0].starts == 2 and read_desired_mode(d1) == Mode.VALIDATE  # node 0 ran off already
    group.relay.silent = False
    async with sidecar(settings) as c:
        t = await settle(c, timeout=60)
        assert (t["to_mode"], t["outcome"]) == ("off", "succeeded"), t
        await wait_ready(c)
    assert [read_desired_mode(d) for d in group.dirs] == [Mode.OFF, Mode.OFF] and group.nodes[1].starts == 2
    assert read_owed_modes(d0, NODES) == {}
    assert modes_of_ranks(group) == {0: "off", 1: "off", 2: "off", 3: "off"}


async def test_off_answers_at_once_while_a_worker_is_silent_and_another_answers(tmp_path):
    """Three nodes; node 2's sidecar stops (as after SIGSTOP), node 1's answers. POST /mode off answers within a
    second, not after the silent worker's deadline (0.8 x KDTREE_PROBE_DEADLINE_S: 3.2 s here, 8 s by default): nodes
    0 and 1 go off, node 2 is owed off and gets it when it answers."""
    with running(Group(tmp_path, nnodes=3)) as g:
        async with sidecar(g.leader_settings(probe_deadline_s=4.0, ready_timeout_s=60.0)) as c:
            await wait_ready(c)
            g.relays[1].silent = True
            await not_ready_naming(c, "node 2 rank 4: unread: node 2's sidecar")
            # no read of the workers left to share: an answer that waited on one would wait for the silent node
            await asyncio.sleep(READ_REUSE_S)
            began = time.monotonic()
            r = await c.post("/mode", json={"mode": "off", "reason": "kill"}, headers=AUTH)
            took = time.monotonic() - began
            assert r.status_code == 202 and took < 1.0, (r.json(), took)
            await until(lambda: [n.starts for n in g.nodes] == [2, 2, 1], timeout=30)
            assert [read_desired_mode(d) for d in g.dirs] == [Mode.OFF, Mode.OFF, Mode.VALIDATE]
            assert read_owed_modes(g.dirs[0], 3) == {2: OwedMode(mode=Mode.OFF, restart=True)}
            g.relays[1].silent = False
            t = await settle(c, timeout=60)
            assert t["outcome"] == "succeeded", t
        assert [read_desired_mode(d) for d in g.dirs] == [Mode.OFF] * 3 and g.nodes[2].starts == 2
        assert set(modes_of_ranks(g).values()) == {"off"} and len(modes_of_ranks(g)) == 6


async def test_the_leaders_sidecar_restarted_during_a_live_flip_to_on(group):
    """The leader's sidecar stops while a live flip to on bakes: the next one rolls it back on every node (a flip
    other than off may be), and the group is ready in validate, every mode file and rank agreeing."""
    settings = group.leader_settings(bake_probes=30)  # a bake of 3 s or more: stopped in it
    async with sidecar(settings) as c:
        await wait_ready(c)
        r = await c.post("/mode", json={"mode": "on", "reason": "live"}, headers=AUTH)
        assert r.status_code == 202 and r.json()["method"] == "live", r.json()
        await reach_step(c, "baking")
        assert [read_desired_mode(d) for d in group.dirs] == [Mode.ON, Mode.ON]
    async with sidecar(settings) as c:
        t = await settle(c)
        assert (t["to_mode"], t["outcome"], t["interrupted"]) == ("on", "rolled_back", True), t
        body = await wait_ready(c)
    assert body["mode"] == "validate" and [read_desired_mode(d) for d in group.dirs] == [Mode.VALIDATE] * 2
    assert modes_of_ranks(group) == {0: "validate", 1: "validate", 2: "validate", 3: "validate"}
    assert [n.starts for n in group.nodes] == [1, 1]  # live both ways: no restart
    assert read_owed_modes(group.dirs[0], NODES) == {}


async def test_a_worker_whose_mode_file_disagrees_is_rewritten_by_a_flip_to_the_groups_mode(group):
    """What a lost debt leaves (node 1's mode file not the group's): /ready names it, and POST /mode with the group's
    own mode is no no-op: it rewrites every node's mode file."""
    async with sidecar(group.leader_settings()) as c:
        await wait_ready(c)
        write_desired_mode(group.dirs[1], Mode.ON)  # the ranks of node 1 follow it live
        await not_ready_naming(c, "node 1: its mode file says on and the group's mode is validate")
        r = await c.post("/mode", json={"mode": "validate", "reason": "rewrite"}, headers=AUTH)
        assert r.status_code == 202, r.json()  # before: 200, "the server already runs in mode validate"
        t = await settle(c)
        assert t["outcome"] == "succeeded", t
        assert [read_desired_mode(d) for d in group.dirs] == [Mode.VALIDATE, Mode.VALIDATE]
        assert modes_of_ranks(group) == {0: "validate", 1: "validate", 2: "validate", 3: "validate"}
        await wait_ready(c)


@pytest.mark.parametrize(
    "mode, by_hand",
    [
        (Mode.VALIDATE, Mode.ON),
        (Mode.ON, Mode.VALIDATE),
        (Mode.STANDBY, Mode.VALIDATE),
        (Mode.OFF, Mode.VALIDATE),
    ],
)
async def test_a_group_mismatched_by_hand_is_repaired_by_the_request_its_readiness_names(
    tmp_path, mode, by_hand
):
    """Node 1's mode file changed by hand in each mode: /ready names it and a request that repairs it, which is
    accepted without force and puts every node back in the group's mode. (Before: in `on` the request named was
    refused 412, the gate to on wanting every rank in validate.)"""
    with running(Group(tmp_path, mode=mode)) as g:
        async with sidecar(g.leader_settings(ready_timeout_s=30.0)) as c:
            await wait_ready(c)
            write_desired_mode(g.dirs[1], by_hand)
            named = f"node 1: its mode file says {by_hand}"
            reason = next(r for r in await not_ready_naming(c, named) if named in r)
            asked = re.search(r"POST /mode (\w+)", reason).group(1)
            assert asked == mode.value, reason
            r = await c.post("/mode", json={"mode": asked, "reason": "repair"}, headers=AUTH)
            assert r.status_code == 202, r.json()
            t = await settle(c, timeout=60)
            assert t["outcome"] == "succeeded", t
            await wait_ready(c)
        assert [read_desired_mode(d) for d in g.dirs] == [mode, mode]
        assert set(modes_of_ranks(g).values()) == {mode.value}


# ---- what the kill switch owes, across a restart of the leader's sidecar ----------------------------------------
# GroupClient is the leader's side of the group; a new one on the same state directory is what a restarted leader's
# sidecar builds at its start. GroupClient with a worker that never answers: tests/sidecar/test_group_leader.py.


async def test_a_restarted_leader_pays_what_a_node_is_owed_when_it_answers(group):
    """The debt outlives the leader's GroupClient: a new one on the same state volume gives node 1 its mode file, and
    its restart when one is owed, once its sidecar answers, then removes the debt from the file."""
    settings = group.leader_settings()
    d0, d1 = group.dirs

    async def paid(leader: GroupClient, mode: Mode, starts: int) -> bool:
        await leader.read()  # the leader's assessment: a node that answers is paid
        modes = modes_of_ranks(group)
        return (
            not leader.owed
            and read_desired_mode(d1) == mode
            and group.nodes[1].starts == starts
            and (modes.get(2), modes.get(3)) == (mode.value, mode.value)
        )

    # A live mode: the mode file only (the ranks follow it), no restart.
    group.relay.open = False
    assert await GroupClient(settings).write_mode(Mode.ON, owe=True, restart=False)
    assert read_desired_mode(d1) == Mode.VALIDATE
    group.relay.open = True
    restarted = GroupClient(settings)
    assert restarted.owed == {1: (Mode.ON, False)}
    await until(lambda: paid(restarted, Mode.ON, starts=1), timeout=30)
    assert read_owed_modes(d0, NODES) == {}

    # The kill switch: off and a restart.
    group.relay.open = False
    assert await restarted.write_mode(Mode.OFF, owe=True, restart=True)
    assert read_desired_mode(d1) == Mode.ON and group.nodes[1].starts == 1
    group.relay.open = True
    again = GroupClient(settings)
    assert again.owed == {1: (Mode.OFF, True)}
    await until(lambda: paid(again, Mode.OFF, starts=2), timeout=60)
    assert read_owed_modes(d0, NODES) == {}

    # An unreadable file: reported until a mode reaches every node.
    owed_path(d0).write_text("{")
    broken = GroupClient(settings)
    assert broken.owed_problem and broken.node_status([], [], None)[1]["problems"]
    assert await broken.write_mode(Mode.OFF, owe=True, restart=True) == {}
    assert broken.owed_problem is None and broken.node_status([], [], None)[1]["problems"] == []
