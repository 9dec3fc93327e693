"""A tensor-parallel group over several nodes (LeaderWorkerSet: one pod per node, a sidecar in each pod): a worker's
sidecar, the app that answers its group's leader.

SGLang spreads --tp-size over --nnodes: node n runs the global ranks n*per_node .. (n+1)*per_node-1, and each rank
writes its record into its own node's state volume. Only node 0 serves HTTP; the other nodes run SGLang's dummy
health server, which answers 200 whatever their ranks do. So:

- A worker's sidecar (KDTREE_GROUP_ROLE=worker) reads its own node's ranks and answers for them (GET /status, a
  NodeReport, and GET /ready: 200 only when every rank of its node is live, in its mode file's mode, with the hook
  installed unless off, and its server process runs). It writes its mode file and restarts its server when the
  leader's sidecar asks (POST /group/mode, POST /group/restart); POST /mode is the leader's. Every endpoint but
  /live wants the group token (KDTREE_GROUP_TOKEN: the same Secret in every pod, not the admin token, which a
  worker's sidecar never holds), checked before a body is read.

The leader's side, its client of these sidecars, and the faults it meets: sidecar/group_leader.py.
"""

# No `from __future__ import annotations`: FastAPI resolves the dependency annotations at run time (as in app.py).
import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from kdtree.config import Mode
from kdtree.state.atomic import json_safe
from kdtree.state.mode_file import mode_path, write_desired_mode
from kdtree.state.rank_records import RankView

from .api import ServerView
from .metrics import Metrics
from .rank_evidence import check_ranks, read_volume
from .request_body import json_body
from .server_control import ServerControl, ServerControlError
from .settings import SidecarSettings
from .volume import StateVolume, VolumeWriteFailed

log = logging.getLogger("kdtree.sidecar")

GROUP_BODY_MAX = 256  # bytes: POST /group/mode carries one field


class NodeReport(BaseModel):
    """A worker's GET /status: its node's ranks and what its sidecar makes of them."""

    node_rank: int
    ready: bool
    reasons: list[str]
    ranks: list[RankView]
    mode_file: str | None  # the mode its ranks follow; "unreadable: ..." when it cannot be read
    server: ServerView
    at: float


class GroupModeRequest(BaseModel):
    model_config = {"extra": "forbid"}
    mode: Mode


class _Json(JSONResponse):
    def render(self, content) -> bytes:
        return super().render(json_safe(content))


def _bearer_check(settings: SidecarSettings):
    bearer = HTTPBearer(auto_error=False)

    def require_token(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        if creds is None:
            raise HTTPException(
                401,
                "a worker's sidecar answers its group's leader only: send 'Authorization: Bearer <KDTREE_GROUP_TOKEN>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not hmac.compare_digest(creds.credentials.encode(), str(settings.group_token).encode()):
            raise HTTPException(403, "the bearer token does not match KDTREE_GROUP_TOKEN")

    return require_token


# ---- the worker's sidecar ---------------------------------------------------------------------------------


class WorkerNode:
    """A worker's own node: its ranks, its mode file and its server."""

    def __init__(self, settings: SidecarSettings, server: ServerControl | None):
        self.settings = settings
        self.server = server
        self.volume = StateVolume.of(settings)
        self.restarting = asyncio.Lock()

    async def inspect(self) -> ServerView:
        return await ServerView.inspect(self.server)

    async def report(self) -> NodeReport:
        s = self.settings
        snap, server = await asyncio.gather(
            self.volume.read("volume", lambda: read_volume(s)), self.inspect()
        )
        reasons: list[str] = []
        if snap is None:
            reasons.append(f"node {s.node_rank}: the state volume ({s.state_dir}) did not answer")
            views, mode_file = [], "unread: the state volume did not answer"
        else:
            views = [v for v in snap.views if v.record.tp_rank in s.node_ranks(s.node_rank)]
            mode_file = snap.mode_file.value if snap.mode_file else None
            if snap.mode_file_error:
                mode_file = f"unreadable: {snap.mode_file_error}"
                reasons.append(f"node {s.node_rank}: the mode file is unreadable ({snap.mode_file_error})")
            mode = snap.mode_file or s.verify
            started = server.state.started_at if server.state else None
            reasons += check_ranks(s, views, mode, started, ranks=s.node_ranks(s.node_rank)).problems
        c = server.state
        if c is not None and c.crashed:
            reasons.append(f"node {s.node_rank}: the server process is {c.status} (exit code {c.exit_code})")
        elif c is None:
            reasons.append(f"node {s.node_rank}: the server is not known: {server.error}")
        return NodeReport(
            node_rank=s.node_rank,
            ready=not reasons,
            reasons=reasons,
            ranks=views,
            mode_file=mode_file,
            server=server,
            at=time.time(),
        )

    def write_mode(self, mode: Mode) -> None:
        d = self.settings.state_dir
        self.volume.write("writing the mode file", mode_path(d), lambda: write_desired_mode(d, mode))


def create_worker_app(settings: SidecarSettings, server: ServerControl | None) -> FastAPI:
    node = WorkerNode(settings, server)
    metrics = Metrics(settings.expected_tp_size, settings.gate_max_rel_err)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        node.volume.close()

    app = FastAPI(title="kdtree sidecar (group worker)", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.node = node
    authorized = [Depends(_bearer_check(settings))]

    @app.get("/live")
    async def live() -> dict:
        return {"live": True, "node_rank": settings.node_rank}

    @app.get("/ready", dependencies=authorized)
    async def ready() -> _Json:
        r = await node.report()
        metrics.ready.set(1 if r.ready else 0)
        metrics.assessments.inc()
        body = {"ready": r.ready, "node_rank": r.node_rank, "reasons": r.reasons, "mode_file": r.mode_file}
        return _Json(body, status_code=200 if r.ready else 503)

    @app.get("/status", dependencies=authorized)
    async def status() -> _Json:
        return _Json((await node.report()).model_dump())

    @app.get("/metrics", dependencies=authorized)
    async def metrics_endpoint() -> Response:
        metrics.rank_views = (await node.report()).ranks
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/group/mode", dependencies=authorized)
    async def group_mode(request: Request) -> _Json:
        req = await json_body(request, GroupModeRequest, GROUP_BODY_MAX, "POST /group/mode")
        try:
            node.write_mode(req.mode)
        except VolumeWriteFailed as e:
            raise HTTPException(507, f"node {settings.node_rank}: {e}") from None
        log.info("node %d: mode file set to %s by the group's leader", settings.node_rank, req.mode)
        return _Json({"node_rank": settings.node_rank, "mode": req.mode.value})

    @app.post("/group/restart", dependencies=authorized)
    async def group_restart() -> _Json:
        if server is None:
            raise HTTPException(503, f"node {settings.node_rank}: the sidecar has no server control")
        async with node.restarting:  # one restart at a time; a second waits for the first
            try:
                await asyncio.to_thread(server.restart, settings.restart_stop_timeout_s)
            except ServerControlError as e:
                raise HTTPException(502, f"node {settings.node_rank}: restart failed: {e}") from None
        log.info("node %d: server restarted by the group's leader", settings.node_rank)
        return _Json({"node_rank": settings.node_rank, "restarted": True})

    @app.post("/mode", dependencies=authorized)
    async def mode() -> _Json:
        return _Json(
            {"error": f"node {settings.node_rank} is a worker of a group: its mode is set by the group's leader; "
                      "POST /mode to the leader's sidecar (node 0)"},
            status_code=409,
        )  # fmt: skip

    return app
