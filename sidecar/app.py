"""The sidecar's HTTP API (FastAPI): /live, /ready, /status, POST /mode, /metrics.

No `from __future__ import annotations` here: FastAPI resolves the dependency annotations at run time.
"""

import asyncio
import hmac
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .controller import Controller, ModeRequest
from .docker_control import ServerContainer, ServerControl
from .metrics import Metrics
from .process_control import ServerProcess
from .settings import SidecarSettings, load_sidecar_settings


def server_control(settings: SidecarSettings) -> ServerControl | None:
    """The configured control: the server process (KDTREE_SERVER_CONTROL=process), or the container named
    by KDTREE_SERVER_CONTAINER through the Docker socket (docker; None when no name is set)."""
    if settings.server_control == "process":
        return ServerProcess(settings.state_dir, restart_wait_s=settings.restart_wait_s)
    return ServerContainer(settings.server_container) if settings.server_container else None


def create_app(settings: SidecarSettings | None = None, server: ServerControl | None = None) -> FastAPI:
    """server: what observes and restarts the SGLang server; by default the one the settings name."""
    settings = settings or load_sidecar_settings()
    if server is None:
        server = server_control(settings)
    metrics = Metrics(settings.state_dir, settings.heartbeat_stale_s)
    controller = Controller(settings, server, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await controller.start()
        yield
        await controller.stop()

    app = FastAPI(title="kdtree sidecar", lifespan=lifespan)
    app.state.controller = controller
    bearer = HTTPBearer(auto_error=False)

    def require_admin(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        if not settings.admin_token:
            return  # KDTREE_ALLOW_OPEN_ADMIN=true: settings refuse to load otherwise
        if creds is None:
            raise HTTPException(
                401,
                "POST /mode needs 'Authorization: Bearer <KDTREE_ADMIN_TOKEN>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not hmac.compare_digest(creds.credentials.encode(), settings.admin_token.encode()):
            raise HTTPException(403, "the bearer token does not match KDTREE_ADMIN_TOKEN")

    @app.get("/live")
    async def live() -> dict:
        return {"live": True}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        try:
            a = await asyncio.wait_for(controller.assess(), settings.probe_deadline_s)
        except TimeoutError:
            metrics.ready.set(0)
            return JSONResponse(
                {"ready": False, "reasons": [f"no verdict within {settings.probe_deadline_s:g}s"]},
                status_code=503,
            )
        metrics.ready.set(1 if a.ready else 0)
        body = {
            "ready": a.ready,
            "phase": a.phase,
            "mode": a.mode,
            "reasons": a.reasons,
            "probe_latency_s": a.probe.latency_s if a.probe else None,
        }
        return JSONResponse(body, status_code=200 if a.ready else 503)

    @app.get("/status")
    async def status() -> dict:
        return await controller.status()

    @app.post("/mode", dependencies=[Depends(require_admin)])
    async def mode(req: ModeRequest) -> JSONResponse:
        code, body = await controller.request_mode(req)
        return JSONResponse(jsonable_encoder(body), status_code=code)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
