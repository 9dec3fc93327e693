"""deploy/kubernetes/overlays/leaderworkerset, offline: rendered by kubectl's own kustomize, the LeaderWorkerSet
validated against LeaderWorkerSet's own CRD schema (tests/data/leaderworkerset-crd.yaml.gz, from kubernetes-sigs/lws:
its header names the commit) with `jsonschema`, plus the API server's strict field check (no field the schema does
not know); each pod template validated as a Kubernetes PodTemplate, and the Services, with `kubernetes-validate`
(1.30 and the newest it knows); and the group checked against the code: the server command LeaderWorkerSet's
example passes, the settings each sidecar loads in the pod's environment, the probes, the GPUs per node.
"""

from __future__ import annotations

import copy
import gzip
import subprocess
from pathlib import Path

import pytest
from test_kubernetes import (
    KUBE,
    VERSIONS,
    _load,
    arg,
    env_values,
    kubectl,
    kubernetes_validate,
    one,
    yaml,
)

from entrypoint.launch import _server_args
from sidecar.app import create_app
from sidecar.settings import SidecarSettings

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (the dev extra)")

REPO = Path(__file__).resolve().parents[2]
OVERLAY = KUBE / "overlays" / "leaderworkerset"
CRD = REPO / "tests" / "data" / "leaderworkerset-crd.yaml.gz"  # gzipped: it is 1.3 MB of text
LWS_ENV = {  # what LeaderWorkerSet injects into every container of group 0 (pkg/utils/pod/pod_utils.go)
    "LWS_LEADER_ADDRESS": "kdtree-0.kdtree.default",
    "LWS_GROUP_SIZE": "2",
}
TEMPLATES = ("leaderTemplate", "workerTemplate")


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    r = subprocess.run([kubectl(), "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def schema() -> dict:
    (crd,) = [d for d in yaml.safe_load_all(gzip.decompress(CRD.read_bytes())) if d]
    assert crd["spec"]["names"]["kind"] == "LeaderWorkerSet"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def unknown_fields(obj, schema: dict, path: str = "") -> list[str]:
    """Fields the structural schema does not declare: what the API server's strict field validation refuses (and
    what it would otherwise prune without a word)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(obj, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for k, v in obj.items():
            if props is not None and k in props:
                found += unknown_fields(v, props[k], f"{path}.{k}")
            elif isinstance(extra, dict):
                found += unknown_fields(v, extra, f"{path}.{k}")
            elif props is not None:
                found.append(f"{path}.{k}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(obj):
            found += unknown_fields(v, schema["items"], f"{path}[{i}]")
    return found


def check_against_crd(lws: dict, schema: dict) -> None:
    body = {k: v for k, v in lws.items() if k not in ("apiVersion", "kind", "metadata")}
    jsonschema.Draft7Validator(schema).validate(body)
    assert unknown_fields(body, schema) == []


def lws_of(objects) -> dict:
    return one(objects, "LeaderWorkerSet")


def template(objects, which: str) -> dict:
    return lws_of(objects)["spec"]["leaderWorkerTemplate"][which]


def pod_container(objects, which: str, name: str) -> dict:
    spec = template(objects, which)["spec"]
    (c,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    return c


# ---- schemas -------------------------------------------------------------------------------------------


def test_the_crd_is_kept_with_its_source():
    header = gzip.decompress(CRD.read_bytes())[:600].decode()
    assert "github.com/kubernetes-sigs/lws" in header and "config/crd/bases/" in header
    assert "060ab4da17eea1f0865fcbd3236bb1075e2cea32" in header


def test_the_leaderworkerset_matches_its_crd(objects, schema):
    check_against_crd(lws_of(objects), schema)


def test_the_crd_check_catches_a_misspelled_and_a_wrong_field(objects, schema):
    lws = copy.deepcopy(lws_of(objects))
    lws["spec"]["leaderWorkerTemplate"]["restartPolicyy"] = "None"
    with pytest.raises(AssertionError, match="restartPolicyy"):
        check_against_crd(lws, schema)
    lws = copy.deepcopy(lws_of(objects))
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
    with pytest.raises(jsonschema.ValidationError):
        check_against_crd(lws, schema)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("which", TEMPLATES)
def test_each_pod_template_matches_the_kubernetes_schema(objects, which, version):
    pod_template = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": f"kdtree-{which}"},
        "template": template(objects, which),
    }
    kubernetes_validate.validate(pod_template, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_services_match_the_kubernetes_schema(objects, version):
    services = [o for o in objects if o["kind"] == "Service"]
    assert sorted(s["metadata"]["name"] for s in services) == ["kdtree-api", "kdtree-sidecar"]
    for s in services:
        kubernetes_validate.validate(s, version, strict=True)
        # Node 0 of each group: the leader serves HTTP, the worker runs SGLang's dummy health server.
        assert s["spec"]["selector"] == {
            "leaderworkerset.sigs.k8s.io/name": lws_of(objects)["metadata"]["name"],
            "leaderworkerset.sigs.k8s.io/worker-index": "0",
        }
    # The sidecars' Service lists not-ready pods (a leader's sidecar must answer while its group is not ready: kubectl
    # port-forward, kdtreectl status); the API's lists Ready leaders only, ready being every rank of every node. The
    # workers are reached through LeaderWorkerSet's own headless Service, which publishes not-ready addresses too.
    ready_only = {s["metadata"]["name"]: not s["spec"].get("publishNotReadyAddresses") for s in services}
    assert ready_only == {"kdtree-api": True, "kdtree-sidecar": False}


# ---- the group -----------------------------------------------------------------------------------------


def test_the_group_shape(objects):
    spec = lws_of(objects)["spec"]["leaderWorkerTemplate"]
    assert spec["size"] == 2 and spec["restartPolicy"] == "RecreateGroupOnPodRestart"
    for which in TEMPLATES:
        sidecar = pod_container(objects, which, "sidecar")
        assert sidecar["restartPolicy"] == "Always"  # a native sidecar in both pods
        assert "sidecar" in [c["name"] for c in template(objects, which)["spec"]["initContainers"]]


@pytest.mark.parametrize("which", TEMPLATES)
def test_the_server_command_is_leaderworkersets(objects, which):
    args = pod_container(objects, which, "server")["args"]
    assert arg(args, "--nnodes") == "$(LWS_GROUP_SIZE)"
    assert arg(args, "--node-rank") == "$(LWS_WORKER_INDEX)"
    assert arg(args, "--dist-init-addr") == "$(LWS_LEADER_ADDRESS):20000"
    expanded = [a.replace("$(LWS_GROUP_SIZE)", "2").replace("$(LWS_WORKER_INDEX)", "1") for a in args]
    parsed = _server_args(expanded)  # the launcher's own reading
    gpus = pod_container(objects, which, "server")["resources"]["limits"]["nvidia.com/gpu"]
    assert parsed.tp_size // parsed.nnodes == int(gpus) and parsed.tp_size % parsed.nnodes == 0
    assert parsed.nnodes == lws_of(objects)["spec"]["leaderWorkerTemplate"]["size"]
    # A restart flip must not restart a container: LeaderWorkerSet would recreate the group, state volumes and all.
    assert env_values(pod_container(objects, which, "server"))["KDTREE_RESTART_IN_PLACE"] == "true"


@pytest.mark.parametrize("which, index", [("leaderTemplate", "0"), ("workerTemplate", "1")])
def test_each_sidecar_loads_its_role(objects, which, index, monkeypatch, tmp_path):
    sidecar = pod_container(objects, which, "sidecar")
    for name, value in {**LWS_ENV, "LWS_WORKER_INDEX": index}.items():
        monkeypatch.setenv(name, value)
    resolved = copy.deepcopy(sidecar)
    for e in resolved["env"]:  # the kubelet's $(VAR) expansion, with the downward API's group index
        if e["name"] == "LWS_GROUP_INDEX":
            e.pop("valueFrom")
            e["value"] = "0"
        elif "value" in e:
            e["value"] = e["value"].replace("$(LWS_GROUP_INDEX)", "0")
    s = _load(SidecarSettings, resolved, monkeypatch, tmp_path)
    tp = int(arg(pod_container(objects, which, "server")["args"], "--tp-size"))
    assert (s.nnodes, s.node_rank, s.expected_tp_size) == (2, int(index), tp)
    if which == "leaderTemplate":
        assert s.group_role == "leader"
        name = lws_of(objects)["metadata"]["name"]
        assert s.group_workers == [
            f"http://{name}-0-1.{name}:8080"
        ]  # LWS's pod DNS: <lws>-<group>-<index>.<lws>
        label = env_values(sidecar).get("LWS_GROUP_INDEX")
        assert label is None  # from the downward API, not a literal
    else:
        assert s.group_role == "worker" and s.group_workers == []
    assert s.group_token == "g"
    assert s.admin_token == (
        "t" if which == "leaderTemplate" else None
    )  # least privilege: none in a worker's pod


def test_probes_are_the_single_node_pods(objects, tmp_path):
    """The leader's probes are base/deployment.yaml's; the worker's readiness runs the healthcheck, which sends the
    token its sidecar requires, on a route the worker's app has."""
    base = yaml.safe_load((KUBE / "base" / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    base_sidecar, base_server = base["initContainers"][0], base["containers"][0]
    leader_sidecar = pod_container(objects, "leaderTemplate", "sidecar")
    leader_server = pod_container(objects, "leaderTemplate", "server")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert leader_sidecar[probe] == base_sidecar[probe], probe
    assert leader_server["startupProbe"] == base_server["startupProbe"]
    worker = pod_container(objects, "workerTemplate", "sidecar")
    assert worker["livenessProbe"] == base_sidecar["livenessProbe"]
    assert worker["readinessProbe"]["exec"]["command"] == ["python", "-m", "sidecar.healthcheck", "/ready"]
    settings = SidecarSettings(
        group_token="g",
        state_dir=str(tmp_path),
        group_role="worker",
        nnodes=2,
        node_rank=1,
        expected_tp_size=16,
    )
    routes = {getattr(r, "path", None) for r in create_app(settings).routes}
    assert {"/live", "/ready", "/status", "/group/mode", "/group/restart"} <= routes


def test_a_workers_pod_holds_the_group_token_and_no_admin_token(objects):
    """Least privilege: the group token is a Secret file in each sidecar (never the server's, never an environment);
    the admin token is in the leader's pod only, so a worker's pod taken over cannot change the group's mode."""
    for which in TEMPLATES:
        spec = template(objects, which)["spec"]
        sidecar, server = pod_container(objects, which, "sidecar"), pod_container(objects, which, "server")
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        mounted = {m["name"] for m in sidecar["volumeMounts"]}
        assert secrets["group-token"] == "kdtree-group" and "group-token" in mounted
        assert not {m["name"] for m in server["volumeMounts"]} & set(secrets)
        names = {e["name"] for c in (sidecar, server) for e in c.get("env", [])}
        assert "KDTREE_GROUP_TOKEN" not in names and "KDTREE_ADMIN_TOKEN" not in names
        if which == "leaderTemplate":
            assert secrets["admin-token"] == "kdtree-admin" and "admin-token" in mounted
        else:
            assert "kdtree-admin" not in secrets.values() and "KDTREE_ADMIN_TOKEN_FILE" not in names


def test_the_leader_holds_the_groups_desired_mode_and_a_worker_none(objects):
    """The cluster holds the group's desired mode as the leader pod's annotation, through the downward API as
    base/deployment.yaml's pod holds it (`kdtreectl rollout --selector` annotates the leaders); a worker's mode is
    its leader's to set, so its sidecar reads no desired mode."""
    base = yaml.safe_load((KUBE / "base" / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    base_volume = next(v for v in base["volumes"] if v["name"] == "podinfo")
    leader = pod_container(objects, "leaderTemplate", "sidecar")
    path = env_values(leader)["KDTREE_DESIRED_MODE_FILE"]
    assert path == env_values(base["initContainers"][0])["KDTREE_DESIRED_MODE_FILE"]
    mount = next(m for m in leader["volumeMounts"] if m["mountPath"] == path.rsplit("/", 1)[0])
    assert mount["readOnly"] is True
    volume = next(
        v for v in template(objects, "leaderTemplate")["spec"]["volumes"] if v["name"] == mount["name"]
    )
    assert volume["downwardAPI"]["items"] == base_volume["downwardAPI"]["items"]
    server = pod_container(objects, "leaderTemplate", "server")
    assert mount["name"] not in {m["name"] for m in server["volumeMounts"]}
    worker = pod_container(objects, "workerTemplate", "sidecar")
    assert "KDTREE_DESIRED_MODE_FILE" not in env_values(worker)


def test_the_fleets_selector_picks_the_pods_that_take_flips(objects):
    """deploy/kubernetes/README.md's `--selector`: the Deployment's pods and a group's leader, never its workers
    (their sidecars answer the leader only, with the group's token)."""
    import re

    readme = (KUBE / "README.md").read_text()
    selectors = set(re.findall(r"--selector (\S+)", readme)) | set(re.findall(r"get pods -l (\S+)", readme))
    selectors.discard("app.kubernetes.io/name=kdtree")  # `get pods -w`: watching every pod, no flip
    assert selectors, "no selector in the README"

    def picks(labels: dict) -> bool:
        return all(labels.get(k) == v for k, v in (p.split("=", 1) for p in sel.split(",")))

    deployment = yaml.safe_load((KUBE / "base" / "deployment.yaml").read_text())
    for sel in selectors:
        assert picks(deployment["spec"]["template"]["metadata"]["labels"]), sel
        assert picks(template(objects, "leaderTemplate")["metadata"]["labels"]), sel
        assert not picks(template(objects, "workerTemplate")["metadata"]["labels"]), sel


def test_the_leaders_sidecar_alone_holds_a_token_that_can_only_create_events(objects):
    """The leader's sidecar posts Events about the desired mode as base/'s pod does: the same service account and
    grant (../../sidecar-events), its token projected into the sidecar alone; a worker's pod holds no token."""
    from sidecar.pod_events import SERVICE_ACCOUNT_DIR

    base = yaml.safe_load((KUBE / "base" / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    leader = template(objects, "leaderTemplate")["spec"]
    assert (
        leader["serviceAccountName"] == base["serviceAccountName"]
        and leader["automountServiceAccountToken"] is False
    )
    sidecar = pod_container(objects, "leaderTemplate", "sidecar")
    mount = next(m for m in sidecar["volumeMounts"] if m["mountPath"] == str(SERVICE_ACCOUNT_DIR))
    volume = next(v for v in leader["volumes"] if v["name"] == mount["name"])
    assert volume == next(v for v in base["volumes"] if v["name"] == mount["name"])
    server = pod_container(objects, "leaderTemplate", "server")
    assert mount["name"] not in {m["name"] for m in server["volumeMounts"]}
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("ServiceAccount", "kdtree-sidecar"), ("Role", "kdtree-sidecar-events")} <= kinds
    worker = template(objects, "workerTemplate")["spec"]
    assert "serviceAccountName" not in worker and worker["automountServiceAccountToken"] is False
    assert not any("projected" in v for v in worker["volumes"])
