"""sidecar/group_leader.py's GroupClient with a worker whose sidecar does not answer (nothing listens on its port):
what the kill switch owes that node, kept on the leader's state volume. A new GroupClient on the same state
directory is what a restarted leader's sidecar builds at its start. The debt paid once the node answers again, with
the group as processes: tests/sidecar/test_group.py.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time

import pytest
from sidecar_harness import make_settings
from standin_engine import free_port

from kdtree.config import Mode
from kdtree.state import owed_modes as owed_module
from kdtree.state.owed_modes import OwedMode, owed_path, read_owed_modes
from sidecar.group_leader import GroupClient, GroupCollector
from sidecar.server_control import ServerControlError
from sidecar.settings import SidecarSettings

pytestmark = pytest.mark.anyio
TP, NODES = 4, 2


def silent_worker_settings(tmp_path) -> SidecarSettings:
    """A leader whose one worker's sidecar does not answer (nothing listens on its port)."""
    return make_settings(
        tmp_path,
        free_port(),
        expected_tp_size=TP,
        nnodes=NODES,
        group_role="leader",
        verify=Mode.VALIDATE,
        group_workers=[f"http://127.0.0.1:{free_port()}"],
        group_token="test-group-token",
    )


async def test_what_the_kill_switch_owes_an_unreachable_node_is_kept_on_the_volume(tmp_path):
    settings = silent_worker_settings(tmp_path)
    leader = GroupClient(settings)
    assert await leader.write_mode(Mode.ON, owe=False, restart=False)  # a forward flip: refused, nothing owed
    assert leader.owed == {} and not owed_path(tmp_path).exists()
    failed = await leader.write_mode(Mode.OFF, owe=True, restart=True)
    assert "node 1's sidecar" in failed[1] and "did not answer" in failed[1]
    assert read_owed_modes(tmp_path, NODES) == {1: OwedMode(mode=Mode.OFF, restart=True)}
    restarted = GroupClient(settings)  # the leader's sidecar restarted
    assert restarted.owed == {1: (Mode.OFF, True)} and restarted.owed_problem is None
    assert [n["owed"] for n in restarted.node_status([], [], None)] == [None, "off"]


async def test_a_node_not_read_since_the_sidecar_started_is_not_reported_reachable(tmp_path):
    """Until its sidecar has answered a read of this leader's sidecar, a node is not up in /status or /metrics
    (before: reachable, kdtree_group_node_up 1, for as long as the first read of a silent node took)."""
    leader = GroupClient(silent_worker_settings(tmp_path))
    node0, node1 = leader.node_status([], [], "validate")
    assert (node0["reachable"], node0["mode_file"]) == (True, "validate")
    assert node1["reachable"] is False and "has not been read since this sidecar started" in node1["error"]
    (up, _) = GroupCollector(leader).collect()
    assert {s.labels["node"]: s.value for s in up.samples} == {"0": 1, "1": 0}
    await leader.read()  # it does not answer
    assert leader.node_status([], [], None)[1]["reachable"] is False and not leader.answered(1)


async def test_an_owed_mode_the_volume_refuses_is_written_again_at_the_next_read(
    tmp_path, monkeypatch, caplog
):
    real = owed_module.write_atomically
    refused = []

    def full_once(path, text):
        if not refused:
            refused.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, text)

    monkeypatch.setattr(owed_module, "write_atomically", full_once)
    leader = GroupClient(silent_worker_settings(tmp_path))
    with caplog.at_level(logging.ERROR, logger="kdtree.sidecar"):
        await leader.write_mode(Mode.OFF, owe=True, restart=True)
    assert refused == [owed_path(tmp_path)] and leader.volume.problem.errno == "ENOSPC"  # /ready names it
    assert any("owed-modes.json failed: ENOSPC" in r.getMessage() for r in caplog.records)
    assert leader.owed == {1: (Mode.OFF, True)}  # still paid from memory
    await leader.read()
    assert read_owed_modes(tmp_path, NODES) == {1: OwedMode(mode=Mode.OFF, restart=True)}
    assert leader.volume.problem is None


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"nodes": {"5": {"mode": "off", "restart": true}}}',  # outside a group of 2
        '{"nodes": {}}' + " " * 20_000,  # larger than the file can be
    ],
)
async def test_an_unreadable_owed_file_is_kept_aside_and_reported_not_forgotten(tmp_path, caplog, content):
    owed_path(tmp_path).write_text(content)
    with caplog.at_level(logging.ERROR, logger="kdtree.sidecar"):
        leader = GroupClient(silent_worker_settings(tmp_path))  # the sidecar starts
    aside = tmp_path / "owed-modes.json.unreadable"
    assert leader.owed == {} and not owed_path(tmp_path).exists() and aside.read_text() == content
    (logged,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert str(owed_path(tmp_path)) in logged and f"moved to {aside}" in logged
    assert "POST /mode with the mode every node should run (off for the kill switch)" in logged
    node0, node1 = leader.node_status([], [], None)
    assert node0["problems"] == [] and node1["problems"] == [f"node 1 may be owed a mode: {logged}"]
    await leader.write_mode(Mode.OFF, owe=True, restart=True)  # still unreachable: owed, and known again
    assert (
        leader.node_status([], [], None)[1]["owed"] == "off"
        and leader.node_status([], [], None)[1]["problems"] == []
    )
    assert read_owed_modes(tmp_path, NODES) == {1: OwedMode(mode=Mode.OFF, restart=True)}


# ---- a worker's sidecar that answers badly: the leader's time, memory and logs stay bounded ----------------------


async def hostile_worker(behaviour: str):
    """A stand-in for a worker's sidecar that misbehaves (NOT the sidecar: raw HTTP/1.1 over asyncio), as a node
    whose sidecar hangs, or a node taken over, may: `trickle` sends its headers, then a byte every 0.3 s; `flood`
    answers 500 with a 64 MiB body; `forge` answers 500 with line breaks and an escape in its text."""

    async def answer(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        try:
            if behaviour == "trickle":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
                for _ in range(200):
                    writer.write(b" ")
                    await writer.drain()
                    await asyncio.sleep(0.3)
            elif behaviour == "flood":
                size = 64 * 1024 * 1024
                writer.write(b"HTTP/1.1 500 Boom\r\nContent-Length: %d\r\n\r\n" % size)
                for _ in range(size // 65536):
                    writer.write(b"x" * 65536)
                    await writer.drain()
            else:
                body = b"no\r\n2026-12-05 ERROR kdtree.sidecar forged line\x1b[2J"
                writer.write(b"HTTP/1.1 500 Boom\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def leader_of(tmp_path, url: str) -> GroupClient:
    settings = make_settings(tmp_path, free_port(), expected_tp_size=TP, nnodes=NODES, group_role="leader",
                             verify=Mode.VALIDATE, group_workers=[url], probe_deadline_s=1.0,
                             group_token="test-group-token")  # fmt: skip
    return GroupClient(settings)


async def test_a_worker_that_trickles_its_answer_is_unread_within_the_deadline(tmp_path):
    server, url = await hostile_worker("trickle")
    async with server:
        leader = leader_of(tmp_path, url)
        t0 = time.monotonic()
        reports = await leader.read()
        assert "did not answer whole within 0.8s" in reports[1]
        failed = await leader.write_mode(
            Mode.OFF, owe=True, restart=True
        )  # the kill switch is not held up either
        assert "did not answer whole" in failed[1] and leader.owed == {1: (Mode.OFF, True)}
        assert time.monotonic() - t0 < 4
        t0 = time.monotonic()
        with pytest.raises(ServerControlError, match="node 1's sidecar"):
            await asyncio.to_thread(
                leader._restart_one, 1, 1.0
            )  # a restart's answer: by its timeout, give or take
        assert time.monotonic() - t0 < 4


@pytest.mark.parametrize("behaviour", ["flood", "forge"])
async def test_what_a_worker_answers_is_read_bounded_and_shown_escaped(tmp_path, behaviour):
    server, url = await hostile_worker(behaviour)
    async with server:
        leader = leader_of(tmp_path, url)
        failed = await leader.write_mode(Mode.ON, owe=False, restart=False)
        with pytest.raises(ServerControlError) as restart:
            await asyncio.to_thread(leader._restart_one, 1, 5.0)
    for text in (failed[1], str(restart.value)):
        assert "500" in text and "\n" not in text and "\r" not in text and "\x1b" not in text
        assert len(text) < 500
    if behaviour == "forge":
        assert "\\r\\n2026-12-05 ERROR" in failed[1] and "\\x1b" in failed[1]


async def test_a_read_that_began_before_a_write_to_the_workers_does_not_replace_a_newer_one(
    tmp_path, monkeypatch
):
    """The leader shares one read of its workers between callers; a read still in flight when a write to the workers
    (the kill switch, say) began may predate it, so it never becomes `latest` (what /status and the metrics show)."""
    leader = GroupClient(silent_worker_settings(tmp_path))
    release = asyncio.Event()

    async def slow_report(client, node):
        await release.wait()
        return "from before the write"

    monkeypatch.setattr(leader, "_report", slow_report)
    in_flight = asyncio.create_task(leader.read())
    await asyncio.sleep(0.05)
    await leader.write_mode(Mode.OFF, owe=True, restart=True)  # the worker does not answer: owed off
    leader.latest = {1: "newer"}
    release.set()
    assert await in_flight == {1: "from before the write"}  # its callers asked before the write
    assert leader.latest == {1: "newer"}
    monkeypatch.setattr(leader, "_report", lambda client, node: asyncio.sleep(0, "after the write"))
    assert await leader.read() == {1: "after the write"} and leader.latest == {1: "after the write"}


async def test_a_debt_paid_while_a_flip_writes_the_same_node_never_lands_after_the_flip(
    tmp_path, monkeypatch
):
    """The kill switch's debt to node 1 is being paid (its POST in flight) when an operator's flip writes every node's
    mode file: the node ends with the flip's mode, whichever write began first."""
    leader = GroupClient(silent_worker_settings(tmp_path))
    leader.owed = {1: (Mode.OFF, False)}
    landed: list[Mode] = []  # node 1's mode file, write by write
    debt_posting, release = asyncio.Event(), asyncio.Event()

    async def post_mode(client, node, mode):  # a stand-in for the worker's POST /group/mode
        if mode is Mode.OFF:
            debt_posting.set()
            await release.wait()
        landed.append(mode)
        return None

    monkeypatch.setattr(leader, "_post_mode", post_mode)
    paying = asyncio.create_task(leader._pay([1]))
    await debt_posting.wait()
    flip = asyncio.create_task(leader.write_mode(Mode.ON, owe=False, restart=False))
    await asyncio.sleep(0.05)
    release.set()
    await asyncio.gather(paying, flip)
    assert landed == [Mode.OFF, Mode.ON] and leader.owed == {}
    assert read_owed_modes(tmp_path, NODES) == {}
