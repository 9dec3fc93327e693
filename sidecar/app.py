"""The sidecar's HTTP API (FastAPI): /live, /ready, /status, POST /mode, /metrics, and GET/POST /gate (the gate's
verdict, read-only, for Argo Rollouts and Flagger).

No `from __future__ import annotations` here: FastAPI resolves the dependency annotations at run time.
"""

import asyncio
import hmac
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kdtree.config import Mode
from kdtree.state.atomic import json_safe

from .api import GateVerdict, ModeRequest
from .controller import Controller
from .desired_mode import DesiredModeReconciler
from .group_leader import GroupClient, GroupCollector, GroupServerControl
from .group_worker import create_worker_app
from .metrics import Metrics
from .pod_events import PodEvents
from .request_body import json_body, validation_detail
from .server_control import ServerControl
from .server_control.docker import ServerContainer
from .server_control.process import ServerProcess
from .settings import SidecarSettings
from .store import Transition
from .vocabulary import Condition

MODE_BODY_MAX = 4096  # bytes: a POST /mode body is a few fields; a larger one is refused (413) unread


class ApiJSON(JSONResponse):
    """Every body of the API: JSON has no NaN or Infinity, so a non-finite float (a rank's parity) goes out as the
    string a rank record writes for it ("Infinity", "-Infinity", "NaN")."""

    def render(self, content) -> bytes:
        return super().render(json_safe(content))


def server_control(settings: SidecarSettings) -> ServerControl | None:
    """The configured control: the server process (KDTREE_SERVER_CONTROL=process), or the container named
    by KDTREE_SERVER_CONTAINER through the Docker socket (docker; None when no name is set)."""
    if settings.server_control == "process":
        return ServerProcess(settings.state_dir, restart_wait_s=settings.restart_wait_s)
    return ServerContainer(settings.server_container) if settings.server_container else None


def create_app(
    settings: SidecarSettings | None = None,
    server: ServerControl | None = None,
    pod_events: PodEvents | None = None,
) -> FastAPI:
    """server: what observes and restarts the SGLang server; by default the one the settings name. pod_events: where
    the desired-mode reconciler posts Kubernetes Events; by default the pod's own API server when in a pod."""
    settings = settings or SidecarSettings.load()
    if server is None:
        server = server_control(settings)
    if settings.group_role == "worker":
        return create_worker_app(
            settings, server
        )  # its node's ranks, for the group's leader (sidecar/group_worker.py)
    metrics = Metrics(settings.expected_tp_size, settings.gate_max_rel_err)
    group = None
    if settings.group_role == "leader":
        group = GroupClient(settings)
        server = GroupServerControl(server, group) if server is not None else None
        metrics.registry.register(GroupCollector(group))
    controller = Controller(settings, server, metrics, group)
    desired: DesiredModeReconciler | None = None
    if settings.desired_mode_file is not None:
        note = f"on: Events on pod {pod_events.namespace}/{pod_events.pod_name}" if pod_events else ""
        if pod_events is None:
            pod_events, note = PodEvents.in_cluster(settings.desired_mode_file.parent)
        desired = DesiredModeReconciler(settings.desired_mode_file, controller, metrics, pod_events, note)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await controller.start()
        if desired is not None:
            desired.start()  # after the controller has resolved what a previous sidecar left unfinished
        yield
        if desired is not None:
            await desired.stop()
        await controller.stop()

    # No /docs, /redoc or /openapi.json: the README documents the API, and nothing here should map it for whoever
    # reaches the port.
    app = FastAPI(title="kdtree sidecar", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.controller = controller
    app.state.desired_mode = desired

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> ApiJSON:  # /gate?to=...: no echo of it
        return ApiJSON({"detail": validation_detail(e.errors())}, status_code=422)

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
        return {"live": True}  # the loop answers: nothing here reads the state volume or waits on anything

    @app.get("/ready")
    async def ready() -> ApiJSON:
        try:
            async with asyncio.timeout(settings.probe_deadline_s):  # not wait_for: see SingleFlight.get
                a = await controller.assess()
        except TimeoutError:
            metrics.ready.set(0)  # what this answer says (an assessment that finishes sets it again)
            return ApiJSON(
                {
                    "ready": False,
                    "condition": Condition.NOT_READY_YET,
                    "condition_evidence": ["the sidecar's own check did not finish in time"],
                    "reasons": [f"no verdict within {settings.probe_deadline_s:g}s"],
                },
                status_code=503,
            )
        body = {
            "ready": a.ready,
            "condition": a.condition,
            "condition_evidence": a.condition_evidence,
            "phase": a.phase,
            "mode": a.mode,
            "reasons": a.reasons,
            "notes": a.notes,
            "probe_latency_s": a.probe.latency_s if a.probe else None,
        }
        return ApiJSON(body, status_code=200 if a.ready else 503)

    @app.get("/status")
    async def status() -> ApiJSON:  # a Response, not `dict`: FastAPI would serialize a NaN as null
        document = await controller.status()
        if desired is not None:
            document.desired_mode = desired.status()
        return ApiJSON(document.model_dump())

    # The gate's verdict, read-only: it flips nothing, and tells no more than /status does, so like /status it asks
    # for no token (Flagger's webhooks cannot send one, and the admin token would let a rollout tool flip modes).
    # The query is one enum; the body (Flagger's POST payload) is never read. It answers from the background probe's
    # latest verdict, so polling it sends no completion to the server.
    # GET: 200 with the verdict in `pass` (Argo Rollouts' web metric counts any non-2xx as an error, not a failure).
    # POST: the same body, 200 when the gate passes and 412 when not (Flagger's webhooks: a status above 202 fails).
    @app.api_route("/gate", methods=["GET", "POST"])
    async def gate(request: Request, to: Mode = Mode.ON) -> ApiJSON:
        try:
            async with asyncio.timeout(settings.probe_deadline_s):
                criteria, down = await controller.admission.gate_verdict(to)
        except TimeoutError:
            raise HTTPException(503, f"no verdict within {settings.probe_deadline_s:g}s") from None
        failed = [c.name for c in criteria if not c.passed]
        verdict = GateVerdict(
            passed=not failed,
            from_mode=controller.state.current_mode,
            to_mode=to,
            failed=failed,
            criteria=criteria,
            detail=down or ("" if not failed else "the evidence does not pass: GET /status shows the ranks"),
        )
        code = 412 if failed and request.method == "POST" else 200
        return ApiJSON(verdict.model_dump(by_alias=True), status_code=code)

    # The body is read here, not by FastAPI: authentication (the dependency) comes first, then the size limit,
    # then parsing, so an unauthenticated or oversized request is answered without reading its body.
    @app.post("/mode", dependencies=[Depends(require_admin)])
    async def mode(request: Request) -> ApiJSON:
        req = await json_body(request, ModeRequest, MODE_BODY_MAX, "POST /mode")
        code, answer = await controller.request_mode(req)
        if desired is not None and code == 202 and isinstance(answer.transition, Transition):
            await desired.operator_asked(req.mode, answer.transition)  # the desired mode yields to it
        return ApiJSON(jsonable_encoder(answer.wire()), status_code=code)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        metrics.rank_views = await controller.rank_views()  # read on the state volume's thread
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
