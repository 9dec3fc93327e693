"""The cluster as `kdtreectl rollout --selector` sees it, through kubectl (which brings the user's kubeconfig, context
and credentials): the pods a label selector picks, and their desired-mode annotation. Two kubectl commands only:
`get pods -o json` and `annotate --overwrite`; their RBAC: `list` and `patch` on pods in the namespace."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

from sidecar.api import DESIRED_MODE_ANNOTATION as ANNOTATION

KUBECTL_TIMEOUT_S = 60.0


class KubeError(Exception):
    """kubectl failed or answered what no kubectl answers; the message says which and what it said."""


@dataclass
class Pod:
    name: str
    namespace: str
    desired: str | None  # the annotation's value (None: not set)
    sidecar_url: str | None  # http://POD_IP:PORT of the container named sidecar (None: no IP yet)


class Kubectl:
    def __init__(self, exe: str, namespace: str):
        self.exe, self.namespace = exe, namespace

    def _run(self, *args: str) -> str:
        argv = [self.exe, "--namespace", self.namespace, *args]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_S)
        except FileNotFoundError:
            raise KubeError(f"no kubectl at {self.exe!r}: install it, or pass --kubectl PATH") from None
        except subprocess.TimeoutExpired:
            raise KubeError(f"`{' '.join(argv)}` took longer than {KUBECTL_TIMEOUT_S:g}s") from None
        if r.returncode != 0:
            raise KubeError(f"`{' '.join(argv)}` failed: {r.stderr.strip() or r.stdout.strip()}")
        return r.stdout

    def pods(self, selector: str) -> list[Pod]:
        """The pods the selector picks, by name (the rollout's order, the same on every run)."""
        out = self._run("get", "pods", "--selector", selector, "--output", "json")
        try:
            items = json.loads(out)["items"]
            return sorted((pod_of(item) for item in items), key=lambda p: p.name)
        except (ValueError, KeyError, TypeError) as e:
            raise KubeError(
                f"`kubectl get pods` answered what no kubectl answers ({type(e).__name__}: {e})"
            ) from None

    def annotate(self, pod: str, value: str) -> None:
        """Set the pod's desired mode (the kubelet then refreshes the sidecar's downward API file in place)."""
        self._run("annotate", "--overwrite", f"pod/{pod}", f"{ANNOTATION}={value}")


def pod_of(item: dict) -> Pod:
    meta, spec = item["metadata"], item.get("spec", {})
    ip = item.get("status", {}).get("podIP")
    port = None
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        if c.get("name") == "sidecar":
            port = next((p["containerPort"] for p in c.get("ports", []) if p.get("name") == "sidecar"), None)
    if port is None:
        raise KeyError(f"pod {meta['name']} has no container `sidecar` with a port named `sidecar`")
    url = f"http://{ip}:{port}" if ip else None
    return Pod(meta["name"], meta.get("namespace", ""), (meta.get("annotations") or {}).get(ANNOTATION), url)
