"""Kubernetes Events on the sidecar's own pod: what the desired-mode reconciler did and why, where `kubectl describe pod`
and `kubectl get events` show it.

Least privilege: the sidecar only ever creates core/v1 Events in its namespace (a Role with `create` on `events`,
deploy/kubernetes/sidecar-events/rbac.yaml), with a service-account token projected into the sidecar container alone (the pod
keeps automountServiceAccountToken: false, so the server container holds no token). A pod annotation or a pod
condition would need `patch` on pods (or pods/status), which also lets the holder rewrite any pod of the namespace:
its labels (and so which Service sends it traffic), and this very desired-mode annotation.

Events are best effort: one that cannot be posted is logged and counted (kdtree_pod_events_total{result="failed"})
and changes nothing else; /status and /metrics always carry the same facts.
"""

from __future__ import annotations

import datetime
import logging
import os
import ssl
from pathlib import Path

import httpx

from kdtree.state.atomic import read_bounded

log = logging.getLogger("kdtree.sidecar")

SERVICE_ACCOUNT_DIR = Path(
    "/var/run/secrets/kubernetes.io/serviceaccount"
)  # where in-cluster clients read it
TOKEN_MAX = 16384  # bytes: a projected token is about 1 KB
NAME_MAX = 253  # a DNS subdomain: a pod's name and a namespace
MESSAGE_MAX = 1024  # characters of an Event's message (the API server keeps up to 1 KB for kubectl describe)
COMPONENT = "kdtree-sidecar"


def _read_line(path: Path, limit: int) -> str:
    return read_bounded(path, limit).decode("utf-8", errors="replace").strip()


class PodEvents:
    """Posts Events whose involvedObject is this pod (its name and uid from the downward API)."""

    def __init__(
        self,
        api_url: str,
        namespace: str,
        pod_name: str,
        pod_uid: str,
        token_file: Path,
        ca_file: Path | None,
        timeout_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,  # tests: a stand-in API server in process
    ):
        self.api_url = api_url.rstrip("/")
        self.namespace, self.pod_name, self.pod_uid = namespace, pod_name, pod_uid
        self.token_file = token_file
        self.http = httpx.AsyncClient(
            base_url=self.api_url,
            timeout=timeout_s,
            verify=ssl.create_default_context(cafile=str(ca_file)) if ca_file else True,
            transport=transport,
        )
        self.posted = 0
        self.failed = 0
        self.last_error: str | None = None

    @classmethod
    def in_cluster(
        cls, downward_dir: Path, sa_dir: Path = SERVICE_ACCOUNT_DIR
    ) -> tuple[PodEvents | None, str]:
        """From the pod's own files: the projected service-account token (token, ca.crt, namespace) and the pod's
        name and uid beside the desired-mode file (the downward API volume's pod-name and pod-uid). (None, why not)
        when something is missing: then no Event is posted, and /status says why."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            return None, "off: not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST)"
        try:
            namespace = _read_line(sa_dir / "namespace", NAME_MAX)
            name = _read_line(downward_dir / "pod-name", NAME_MAX)
            uid = _read_line(downward_dir / "pod-uid", NAME_MAX)
            if not (sa_dir / "token").is_file():
                raise FileNotFoundError(str(sa_dir / "token"))
        except (OSError, ValueError) as e:
            return None, (
                f"off: {e} (mount the projected service-account token at {sa_dir} and the downward API's "
                "pod-name and pod-uid beside the desired-mode file: deploy/kubernetes/base/deployment.yaml)"
            )
        ca = sa_dir / "ca.crt"
        url = f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
        events = cls(url, namespace, name, uid, sa_dir / "token", ca if ca.is_file() else None)
        return events, f"on: Events on pod {namespace}/{name}"

    def event(self, type_: str, reason: str, message: str) -> dict:
        """The core/v1 Event (the API server's own schema: tests validate it with kubernetes-validate)."""
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{self.pod_name}.kdtree-", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": self.pod_name,
                "namespace": self.namespace,
                "uid": self.pod_uid,
                "fieldPath": "spec.initContainers{sidecar}",
            },
            "type": type_,
            "reason": reason,
            "message": message[:MESSAGE_MAX],
            "source": {"component": COMPONENT},
            "reportingComponent": "kdtree.dev/sidecar",
            "reportingInstance": self.pod_name,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }

    async def emit(self, type_: str, reason: str, message: str) -> bool:
        """Post one Event; False (logged, counted) when the API server does not take it."""
        try:
            token = _read_line(self.token_file, TOKEN_MAX)  # re-read: the kubelet rotates a projected token
            resp = await self.http.post(
                f"/api/v1/namespaces/{self.namespace}/events",
                json=self.event(type_, reason, message),
                headers={"Authorization": f"Bearer {token}"},
            )
            if resp.status_code not in (200, 201):
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        except Exception as e:  # best effort: /status and /metrics carry the same facts
            self.failed += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("could not post the Event %s to pod %s: %s", reason, self.pod_name, self.last_error)
            return False
        self.posted += 1
        return True

    async def close(self) -> None:
        await self.http.aclose()
