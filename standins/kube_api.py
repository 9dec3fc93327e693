"""A stand-in for the Kubernetes API server (NOT Kubernetes): the one request the sidecar makes of it, creating a
core/v1 Event in its namespace, with what the real one does around it: the bearer token checked (401), the Role
deploy/kubernetes/sidecar-events/rbac.yaml grants applied (403 "forbidden" for any other verb or resource, as RBAC answers),
and the object validated against the Kubernetes schema (kubernetes-validate, strict: 422 as the API server's own
validation answers). It keeps the Events it created, with the name it generated, for the tests to read.
"""

from __future__ import annotations

import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

SCHEMA_VERSION = "1.30"  # the oldest Kubernetes deploy/kubernetes promises


def status(code: int, reason: str, message: str) -> JSONResponse:
    """The API server's metav1.Status error body."""
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason}
    return JSONResponse({**body, "code": code}, status_code=code)


def kube_api(
    token: str, namespace: str, granted: tuple[tuple[str, str], ...] = (("create", "events"),)
) -> FastAPI:
    """The stand-in; `granted`: the (verb, resource) pairs the service account's Role allows in `namespace`."""
    import kubernetes_validate

    app = FastAPI()
    app.state.events = []

    @app.api_route("/api/v1/namespaces/{ns}/{resource}", methods=["GET", "POST", "PATCH", "DELETE"])
    async def namespaced(ns: str, resource: str, request: Request):
        if request.headers.get("authorization") != f"Bearer {token}":
            return status(401, "Unauthorized", "Unauthorized")
        verb = {"GET": "list", "POST": "create", "PATCH": "patch", "DELETE": "deletecollection"}[
            request.method
        ]
        if ns != namespace or (verb, resource) not in granted:
            return status(
                403,
                "Forbidden",
                f'{resource} is forbidden: User "system:serviceaccount:{namespace}:kdtree-sidecar" cannot {verb} '
                f'resource "{resource}" in API group "" in the namespace "{ns}"',
            )
        obj = await request.json()
        try:
            kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            return status(422, "Invalid", f"Event is invalid: {e.message}")
        if obj["metadata"].get("namespace", ns) != ns:
            return status(
                400, "BadRequest", "the namespace of the object does not match the namespace on the request"
            )
        meta = obj["metadata"]
        meta["name"] = meta.pop("generateName", "") + secrets.token_hex(5)
        app.state.events.append(obj)
        return JSONResponse(obj, status_code=201)

    return app
