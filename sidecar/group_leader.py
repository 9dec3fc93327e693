"""A tensor-parallel group over several nodes: the leader's sidecar, a client of its workers' sidecars (their
NodeReport, POST /group/mode and POST /group/restart: sidecar/group_worker.py, with how SGLang spreads a group).

- The leader's sidecar (KDTREE_GROUP_ROLE=leader) reads every worker's NodeReport along with its own volume
  (GroupClient.merge): readiness, the gate, the live flip's confirmation and the bake see every rank of every node
  through the one VolumeReading they already read. A flip writes every node's mode file (GroupClient.write_mode)
  and a restart restarts the workers' servers first, then its own (GroupServerControl): SGLang's node 0 holds the
  group's rendezvous (--dist-init-addr), and workers wait there for it. The drain is the leader's (/ready).

Faults, and what the leader does (tests/sidecar/test_group.py):
- a worker's sidecar that does not answer (node lost, a partition): its ranks are named unread, /ready is 503; a
  flip other than to `off` is refused (503) naming the node; `off` (the kill switch) is accepted at once, from the
  workers' latest reports: the leader and every node that answers go to off, and a node that does not is owed off
  (mode file and restart), given as soon as its sidecar answers again; the flip succeeds once every rank reports
  off within KDTREE_READY_TIMEOUT_S, and is never rolled back (transition.py).
- a worker's server that restarts alone: its ranks are named until they report again in the group's mode.
- the leader's sidecar restarted: it reads the workers again at its first assessment (a node is not reachable
  until it has answered this sidecar); what a node is owed is kept on the leader's state volume (owed-modes.json)
  and given when the node answers, as before the restart; a flip to off it left unfinished is finished.
- a worker's mode file that disagrees with the group's (changed by hand, a lost debt): /ready names it, and
  POST /mode with the group's own mode (a repair, not gated: admission.py) or off rewrites every node's.
"""

import asyncio
import logging
import os
import time

import httpx
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import ValidationError

from kdtree.config import Mode
from kdtree.state.owed_modes import OwedMode, owed_path, read_owed_modes, write_owed_modes
from kdtree.state.rank_records import RankView

from .group_worker import NodeReport
from .probe import SingleFlight
from .rank_evidence import VolumeReading
from .server_control import ServerControl, ServerControlError, ServerState
from .settings import SidecarSettings
from .volume import StateVolume, VolumeWriteFailed

log = logging.getLogger("kdtree.sidecar")

REPORT_MAX = (
    4 * 1024 * 1024
)  # bytes: a worker's NodeReport the leader reads (records of at most a node's ranks)
ANSWER_MAX = 4096  # bytes: what the leader reads of a worker's answer to POST /group/mode or /group/restart
READ_REUSE_S = (
    0.5  # callers within this of a read of every worker share it (/status, /metrics, /ready at once)
)


def shown(text: str, limit: int = 300) -> str:
    """A worker's text as the leader logs and shows it: at most `limit` characters, control characters escaped (a
    worker's answer cannot forge the leader's log lines or /status)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])


def _read_capped(r: httpx.Response, deadline: float) -> str | None:
    """At most ANSWER_MAX bytes of a streamed answer; None when it was not whole by `deadline` (monotonic): a worker
    that trickles or floods its answer costs the leader a bounded time and memory."""
    body = bytearray()
    for chunk in r.iter_bytes():
        body += chunk
        if len(body) >= ANSWER_MAX:
            break
        if time.monotonic() > deadline:
            return None
    return body[:ANSWER_MAX].decode(errors="replace")


class GroupClient:
    """The leader's side: the workers' reports, their mode files and their restarts, over authenticated HTTP.

    `owed`: nodes whose mode file the kill switch could not write (their sidecar did not answer), with the mode and
    whether a restart is owed too; given when the node's sidecar answers again (merge). A debt of off is not
    replaced by another mode the node did not take either (a rollback's): the kill switch stays owed. Kept on the leader's state
    volume (kdtree.state.owed_modes) whenever it changes and read back at the start, so it outlives this sidecar.

    volume: the leader's state volume (the controller shares it: a failed write stands as its problem in /ready)."""

    def __init__(self, settings: SidecarSettings, volume: StateVolume | None = None):
        self.settings = settings
        self.volume = volume or StateVolume.of(settings)
        self.nodes = {i + 1: url for i, url in enumerate(settings.group_workers)}
        self.headers = {"Authorization": f"Bearer {settings.group_token}"}  # the workers take no other
        self.timeout = settings.probe_deadline_s * 0.8
        self.owed_problem: str | None = None  # why what the workers are owed is unknown (an unreadable file)
        self.owed: dict[int, tuple[Mode, bool]] = self._load_owed()
        self._owed_unsaved = False  # the volume did not take the latest change: retried at each read
        self.latest: dict[int, NodeReport | str] = {}
        self._paying: asyncio.Task | None = None
        self._reads = SingleFlight(self._read_all)
        # one write of the workers' mode files at a time: a debt's POST that began before a flip's must not land after
        # it (the node would keep the older mode), and the debt is read again under the lock
        self._writes = asyncio.Lock()

    def _load_owed(self) -> dict[int, tuple[Mode, bool]]:
        """What a previous sidecar left owed. An unreadable file does not stop the sidecar, and is not taken as
        "nothing owed" quietly either: guessing a debt could restart a node into a mode nobody asked for, and an
        empty map would forget the kill switch. So the file is moved aside for the operator (the next write would
        replace it), the error is logged and stands in /status (each worker's problems) until a mode reaches every
        node, and /ready names any worker whose mode file disagrees with the group's (what a lost debt leaves)."""
        path = owed_path(self.settings.state_dir)
        try:
            found = read_owed_modes(self.settings.state_dir, self.settings.nnodes)
        except (OSError, ValueError) as e:
            aside = path.with_name(path.name + ".unreadable")
            try:
                os.replace(path, aside)
                kept = f"moved to {aside} for inspection"
            except OSError as e2:
                kept = f"left in place (moving it to {aside} failed: {e2.strerror})"
            self.owed_problem = (
                f"what the worker nodes are owed is unreadable ({e}); the file is {kept}. What the kill switch "
                "or a rollback owed them is unknown: POST /mode with the mode every node should run (off for the "
                "kill switch) rewrites every node's mode file; /ready names a node whose mode file disagrees"
            )
            log.error("%s", self.owed_problem)
            return {}
        for n, o in found.items():
            log.warning("node %d is owed %s%s from before this sidecar started (%s): given when it answers",
                        n, o.mode.value, " and a restart" * o.restart, path)  # fmt: skip
        return {n: (o.mode, o.restart) for n, o in found.items()}

    def _save_owed(self, *, retry: bool = False) -> None:
        """Replace the owed-modes file with `owed`. A write the volume does not take is logged and stands as the
        volume's problem (/ready names it); the map in memory still pays, and the write is retried at each read."""
        d = self.settings.state_dir
        owed = {n: OwedMode(mode=m, restart=r) for n, (m, r) in self.owed.items()}
        try:
            self.volume.write("saving what the worker nodes are owed", owed_path(d),
                              lambda: write_owed_modes(d, owed), retry=retry)  # fmt: skip
        except VolumeWriteFailed:
            self._owed_unsaved = True
            return
        self._owed_unsaved = False

    def _client(self, timeout: float) -> httpx.AsyncClient:
        return httpx.AsyncClient(headers=self.headers, timeout=timeout, follow_redirects=False)

    async def _fetch(
        self, client: httpx.AsyncClient, node: int, method: str, path: str, limit: int, **kwargs
    ) -> tuple[int, bytes] | str:
        """A worker's answer (status, body), or why there is none: whole within the deadline (httpx's timeout bounds
        each read, which a trickle never trips), and at most `limit` + one chunk of it read (a longer body is cut)."""
        url = self.nodes[node]
        body = bytearray()
        try:
            async with asyncio.timeout(self.timeout), client.stream(method, f"{url}{path}", **kwargs) as r:
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        break
        except TimeoutError:
            return f"node {node}'s sidecar ({url}) did not answer whole within {self.timeout:g}s"
        except httpx.HTTPError as e:
            return f"node {node}'s sidecar ({url}) did not answer: {type(e).__name__}: {shown(str(e)) or 'no detail'}"
        return r.status_code, bytes(body)

    async def _report(self, client: httpx.AsyncClient, node: int) -> NodeReport | str:
        url = self.nodes[node]
        answer = await self._fetch(client, node, "GET", "/status", REPORT_MAX)
        if isinstance(answer, str):
            return answer
        status, body = answer
        if len(body) > REPORT_MAX:  # a report is a node's records
            return f"node {node}'s sidecar ({url}) sent a report larger than {REPORT_MAX} bytes"
        if status != 200:
            return f"node {node}'s sidecar ({url}) answered {status}: {shown(body.decode(errors='replace'))}"
        try:
            report = NodeReport.model_validate_json(bytes(body))
        except ValidationError as e:
            return f"node {node}'s sidecar ({url}) sent an unreadable report: {e.errors()[0]['msg']}"
        if report.node_rank != node:
            return (
                f"{url} reports node {report.node_rank}, listed as node {node}: KDTREE_GROUP_WORKERS lists the "
                "workers in node order (node 1 first)"
            )
        return report

    async def read(self) -> dict[int, NodeReport | str]:
        """Every worker's report, or why there is none, at once (bounded by the probe deadline); callers within
        READ_REUSE_S of one read share it, so the workers see one read whatever the leader's callers."""
        return await self._reads.get(READ_REUSE_S)

    async def _read_all(self) -> dict[int, NodeReport | str]:
        generation = self._reads.generation
        async with self._client(self.timeout) as client:
            found = await asyncio.gather(*(self._report(client, n) for n in self.nodes))
        reports = dict(zip(self.nodes, found, strict=True))
        if generation != self._reads.generation:
            # a write to the workers began meanwhile: this read may predate it, so `latest` keeps a newer one
            return reports
        self.latest = reports
        if self._owed_unsaved:
            self._save_owed(retry=True)
        if self.owed and (self._paying is None or self._paying.done()):
            answering = [n for n in self.owed if isinstance(self.latest.get(n), NodeReport)]
            if answering:
                self._paying = asyncio.create_task(self._pay(answering))
        return self.latest

    async def merge(self, snap: VolumeReading, *, fresh: bool = True) -> VolumeReading:
        """The leader's own reading, with every worker's ranks and facts added; fresh=False: from their latest
        reports (a node not read yet adds nothing)."""
        reports = await self.read() if fresh else dict(self.latest)
        s = self.settings
        views = [v for v in snap.views if s.node_of(v.record.tp_rank) == 0]
        merged = snap.model_copy(update={"views": views})
        merged.unreachable, merged.node_started_at, merged.node_mode_files, merged.node_problems = (
            {},
            {},
            {},
            [],
        )
        for node, r in reports.items():
            if isinstance(r, str):
                merged.unreachable[node] = r
                continue
            merged.views += [v for v in r.ranks if s.node_of(v.record.tp_rank) == node]
            merged.node_started_at[node] = r.server.state.started_at if r.server.state else None
            merged.node_mode_files[node] = r.mode_file
            c = r.server.state
            if c is not None and c.crashed:
                merged.node_problems.append(
                    f"node {node}: the server process is {c.status} (exit code {c.exit_code})"
                )
        merged.views.sort(key=lambda v: v.record.tp_rank)
        return merged

    async def unreachable(self) -> dict[int, str]:
        return {n: r for n, r in (await self.read()).items() if isinstance(r, str)}

    async def write_mode(self, mode: Mode, *, owe: bool, restart: bool) -> dict[int, str]:
        """Write `mode` into every worker's mode file; returns the nodes that did not take it (why). owe (the kill
        switch, a rollback): those nodes are owed the mode, and a restart when `restart`, until their sidecar
        answers."""
        async with self._writes:
            try:
                async with self._client(self.timeout) as client:
                    results = await asyncio.gather(*(self._post_mode(client, n, mode) for n in self.nodes))
            finally:
                self._reads.invalidate()  # a read from before these writes says nothing of them
            failed = {n: why for n, why in zip(self.nodes, results, strict=True) if why}
            before = dict(self.owed)
            for n in self.nodes:
                if n in failed and owe:
                    # a node owed off stays owed off (with its restart): the kill switch is paid by running off only
                    was = self.owed.get(n)
                    self.owed[n] = (
                        (Mode.OFF, was[1] or restart) if was and was[0] == Mode.OFF else (mode, restart)
                    )
                elif n not in failed and self.owed.get(n) != (mode, True):
                    self.owed.pop(n, None)  # the latest mode written replaces what was owed
                # (a node that took the mode it is owed with a restart is still owed the restart: _pay gives it)
            if self.owed != before:
                self._save_owed()
        if not failed and self.owed_problem is not None:
            log.warning("every node took mode %s: cleared: %s", mode.value, self.owed_problem)
            self.owed_problem = None  # whatever the unreadable file owed, every node now has the latest mode
        return failed

    async def _post_mode(self, client: httpx.AsyncClient, node: int, mode: Mode) -> str | None:
        answer = await self._fetch(client, node, "POST", "/group/mode", ANSWER_MAX, json={"mode": mode.value})
        if isinstance(answer, str):
            return answer
        status, body = answer
        return (
            None
            if status == 200
            else f"node {node}'s sidecar answered {status}: {shown(body.decode(errors='replace'))}"
        )

    def restart_workers(self, stop_timeout_s: int) -> None:
        """Restart every worker's server, node 1 first (blocking: the server control's thread). A node owed the kill
        switch is skipped (it restarts when it answers again); any other failure is a ServerControlError."""
        s = self.settings
        timeout = stop_timeout_s + s.restart_wait_s + 30
        try:
            for node in self.nodes:
                if node not in self.owed:
                    self._restart_one(node, timeout)
        finally:
            self._reads.invalidate()

    async def _pay(self, nodes: list[int]) -> None:
        """Give the nodes that answer again what the kill switch owes them: the mode file, then the restart."""
        for node in nodes:
            async with self._writes:
                if node not in self.owed:  # paid meanwhile by a newer write of every node's mode file
                    continue
                mode, restart = self.owed[node]
                async with self._client(self.timeout) as client:
                    failed = await self._post_mode(client, node, mode)
                self._reads.invalidate()
            if failed:
                continue
            log.warning(
                "node %d answers again: its mode file is now %s (owed by the kill switch)", node, mode
            )
            if restart:
                s = self.settings
                try:
                    await asyncio.to_thread(
                        self._restart_one, node, s.restart_stop_timeout_s + s.restart_wait_s + 30
                    )
                except ServerControlError as e:
                    log.error("node %d: the owed restart failed: %s", node, e)
                    continue
                finally:
                    self._reads.invalidate()
            if self.owed.get(node) == (mode, restart):  # not replaced by a newer debt meanwhile
                del self.owed[node]
                self._save_owed()

    def _restart_one(self, node: int, timeout: float) -> None:
        """POST /group/restart to one worker (blocking), its answer read by `timeout` from the start, give or take
        one read's timeout; ServerControlError naming the node when it did not restart its server."""
        url = self.nodes[node]
        deadline = time.monotonic() + timeout
        try:
            with (
                httpx.Client(headers=self.headers, timeout=timeout, follow_redirects=False) as client,
                client.stream("POST", f"{url}/group/restart") as r,
            ):
                text = _read_capped(r, deadline)
        except httpx.HTTPError as e:
            raise ServerControlError(
                f"node {node}'s sidecar ({url}) did not restart its server: {type(e).__name__}: {shown(str(e))}"
            ) from None
        if text is None:
            raise ServerControlError(
                f"node {node}'s sidecar ({url}) did not answer whole within {timeout:g}s"
            )
        if r.status_code != 200:
            raise ServerControlError(
                f"node {node}'s sidecar ({url}) did not restart its server: {r.status_code} {shown(text)}"
            )

    def answered(self, node: int) -> bool:
        """Whether the node's sidecar answered the latest read; a node not read since this sidecar started has not.
        Node 0 is this sidecar's own."""
        return node == 0 or isinstance(self.latest.get(node), NodeReport)

    def node_status(
        self, views: list[RankView], problems: list[str], own_mode_file: str | None
    ) -> list[dict]:
        """/status's `group`: each node, its ranks with a record, its mode file (node 0's: `own_mode_file`) and the
        problems that name it."""
        s = self.settings
        out = []
        for node in range(s.nnodes):
            latest = self.latest.get(node)
            unknown = self.owed_problem if node in self.nodes and node not in self.owed else None
            if node in self.nodes and latest is None:
                latest = f"node {node}'s sidecar has not been read since this sidecar started"
            out.append(
                {
                    "node": node,
                    "sidecar": self.nodes.get(node, "this sidecar"),
                    "reachable": self.answered(node),
                    "error": latest if isinstance(latest, str) else None,
                    "ranks": list(s.node_ranks(node)),
                    "ranks_reporting": [
                        v.record.tp_rank for v in views if s.node_of(v.record.tp_rank) == node
                    ],
                    "mode_file": own_mode_file if node == 0 else getattr(latest, "mode_file", None),
                    "owed": self.owed[node][0].value if node in self.owed else None,
                    "problems": [p for p in problems if p.startswith(f"node {node} ")]
                    + ([f"node {node} may be owed a mode: {unknown}"] if unknown else []),
                }
            )
        return out


class GroupServerControl:
    """The leader's server control: inspect and logs are its own server's; a restart restarts the workers' servers
    (node 1 first), then its own."""

    def __init__(self, local: ServerControl, group: GroupClient):
        self.local, self.group = local, group

    def inspect(self) -> ServerState:
        return self.local.inspect()

    def logs(self, tail: int, since: float | None = None) -> str:
        return self.local.logs(tail, since)

    def restart(self, stop_timeout_s: int) -> None:
        self.group.restart_workers(stop_timeout_s)
        self.local.restart(stop_timeout_s)


class GroupCollector(Collector):
    """The leader's /metrics: which node each rank runs on, and whether each node's sidecar answered."""

    def __init__(self, group: GroupClient):
        self.group = group

    def collect(self):
        s = self.group.settings
        up = GaugeMetricFamily("kdtree_group_node_up", "1 when the node's sidecar answered the leader's latest read "
                               "(0 until it has answered one since the leader's sidecar started)",
                               labels=["node"])  # fmt: skip
        where = GaugeMetricFamily("kdtree_group_rank_node", "the node each tensor-parallel rank runs on (always 1)",
                                  labels=["rank", "node"])  # fmt: skip
        for node in range(s.nnodes):
            up.add_metric([str(node)], 1 if self.group.answered(node) else 0)
        for rank in range(s.expected_tp_size):
            where.add_metric([str(rank), str(s.node_of(rank))], 1)
        yield from (up, where)
