"""The sidecar's Docker control (ServerContainer, KDTREE_SERVER_CONTROL=docker) against a real Docker engine.

Containers run from kdtree-test-base:bookworm, the minimal Debian image .ci/docker.sh builds with
debootstrap (no registry is needed); the fixture builds it when missing. The last test runs standins/standin_engine.py (a stand-in for SGLang, not
SGLang) inside a container and lets the sidecar flip its mode through a real `docker restart`.
"""

from __future__ import annotations

import asyncio
import site
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from sidecar_harness import AUTH, make_settings, sidecar
from standin_engine import free_port

from kdtree.config import Mode
from kdtree.state.mode_file import read_desired_mode
from sidecar.server_control import ServerMissing
from sidecar.server_control.docker import DockerError, ServerContainer
from sidecar.server_log import crash_excerpt, latest_marker

pytestmark = pytest.mark.docker
IMAGE = "kdtree-test-base:bookworm"
REPO = Path(__file__).resolve().parents[2]


def build_base_image() -> None:
    """The one way the base image is made: .ci/docker.sh base (debootstrap + docker import, reused when present)."""
    r = subprocess.run(["bash", str(REPO / ".ci" / "docker.sh"), "base"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f".ci/docker.sh base failed:\n{r.stdout}\n{r.stderr}")


@pytest.fixture(scope="session")
def docker_client():
    import docker

    return docker.from_env()


@pytest.fixture(scope="session")
def base_image(docker_client):
    from docker.errors import ImageNotFound

    try:
        docker_client.images.get(IMAGE)
    except ImageNotFound:
        build_base_image()
    return IMAGE


@pytest.fixture
def run_container(docker_client, base_image):
    """Start containers with unique names; all are removed at the end of the test."""
    made = []

    def run(command: list[str], **kwargs):
        name = f"kdtree-test-{uuid.uuid4().hex[:10]}"
        container = docker_client.containers.run(base_image, command, name=name, detach=True, **kwargs)
        made.append(container)
        return container

    yield run
    for c in made:
        c.remove(force=True)


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


SGLANG_START = (
    'echo "[2026-11-29 10:00:00 TP0] Load weight begin. avail mem=139.20 GB"; '
    'echo "[2026-11-29 10:00:09 TP0] Capture target verify CUDA graph begin. backend=full, num_tokens_per_req=8, avail mem=20.00 GB"; '
)


def test_running_container_state_and_latest_marker(run_container):
    c = run_container(["sh", "-c", SGLANG_START + "exec sleep 300"])
    server = ServerContainer(c.name)
    state = wait_for(lambda: (s := server.inspect()).running and s)
    assert state.status == "running" and not state.crashed and state.exit_code == 0
    assert abs(state.started_at - time.time()) < 60
    marker = wait_for(lambda: latest_marker(server.logs(tail=100, since=state.started_at)))
    assert marker.name == "capturing_cuda_graphs"


def test_exited_container_reports_exit_code_and_the_traceback(run_container):
    # The markers (stdout) come well before the crash (stderr), as in a real start: Docker orders lines of
    # the two streams only by arrival, so lines written in the same instant may interleave.
    script = SGLANG_START + (
        "sleep 0.5; "
        'echo "Traceback (most recent call last):" >&2; '
        'echo "  File \\"/sgl/cuda_graph_runner.py\\", line 412, in capture" >&2; '
        'echo "torch.OutOfMemoryError: CUDA out of memory" >&2; exit 3'
    )
    c = run_container(["sh", "-c", script])
    server = ServerContainer(c.name)
    state = wait_for(lambda: (s := server.inspect()).status == "exited" and s)
    assert state.crashed and state.exit_code == 3 and not state.oom_killed
    # Docker stamps a container that exits at once with FinishedAt a hair before StartedAt: no ordering check.
    assert state.finished_at is not None and abs(state.finished_at - state.started_at) < 60
    excerpt = crash_excerpt(server.logs(tail=100, since=state.started_at))
    assert excerpt == [
        "Traceback (most recent call last):",
        '  File "/sgl/cuda_graph_runner.py", line 412, in capture',
        "torch.OutOfMemoryError: CUDA out of memory",
    ]


def test_restart_count_under_a_restart_policy(run_container):
    c = run_container(
        ["sh", "-c", "echo boom; exit 1"], restart_policy={"Name": "on-failure", "MaximumRetryCount": 2}
    )
    server = ServerContainer(c.name)
    state = wait_for(lambda: (s := server.inspect()).restart_count == 2 and s.status == "exited" and s)
    assert state.exit_code == 1 and state.crashed


def test_restart_starts_the_same_container_again(run_container):
    c = run_container(["sh", "-c", "echo started; exec sleep 300"])
    server = ServerContainer(c.name)
    first = wait_for(lambda: (s := server.inspect()).running and s)
    time.sleep(1.1)  # Docker's StartedAt has sub-second precision; keep the two starts apart anyway
    server.restart(stop_timeout_s=1)
    second = server.inspect()
    assert second.running and second.started_at > first.started_at
    assert second.restart_count == 0  # Docker counts only restart-policy restarts
    c.reload()
    assert c.attrs["State"]["Running"]


def test_missing_container_is_a_clear_error(docker_client):
    with pytest.raises(ServerMissing, match="no container named 'kdtree-no-such-container'"):
        ServerContainer("kdtree-no-such-container").inspect()


def test_unreachable_docker_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(DockerError, match="Docker is unreachable.*docker.sock"):
        ServerContainer("anything").inspect()


# ---- the sidecar with a real container --------------------------------------------------------------------


def test_status_of_a_crashed_server_container(run_container, tmp_path):
    c = run_container(["sh", "-c", SGLANG_START + 'echo "RuntimeError: NCCL error" >&2; exit 7'])
    wait_for(lambda: ServerContainer(c.name).inspect().status == "exited")
    settings = make_settings(
        tmp_path, free_port(), server_control="docker", server_container=c.name, expected_tp_size=1
    )

    async def check():
        async with sidecar(settings, timeout=60) as client:
            return (await client.get("/status")).json(), (await client.get("/ready"))

    st, ready = asyncio.run(check())
    assert st["phase"] == "crashed" and st["container"]["state"]["exit_code"] == 7
    assert st["log"]["crash_excerpt"] == ["RuntimeError: NCCL error"]
    assert st["log"]["latest_marker"]["name"] == "capturing_cuda_graphs"
    assert ready.status_code == 503


def test_mode_flip_through_a_real_docker_restart(run_container, tmp_path):
    """The stand-in engine runs in a container sharing the state dir; the sidecar flips off -> validate."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    port = free_port()
    site_packages = site.getsitepackages()[0]  # pydantic for kdtree; the image's Python is the same 3.11
    c = run_container(
        [
            "python3",
            "/src/standins/standin_engine.py",
            "--host",
            "0.0.0.0",
            "--port",
            "30000",
            "--state-dir",
            "/state",
            "--tp-size",
            "2",
            "--heartbeat-s",
            "0.2",
            "--load-seconds",
            "0.5",
        ],
        ports={"30000/tcp": ("127.0.0.1", port)},
        volumes={
            str(REPO): {"bind": "/src", "mode": "ro"},
            site_packages: {"bind": "/sp", "mode": "ro"},
            str(state_dir): {"bind": "/state", "mode": "rw"},
        },
        environment={"PYTHONPATH": "/src:/sp"},
    )
    settings = make_settings(
        state_dir,
        port,
        server_control="docker",
        server_container=c.name,
        ready_timeout_s=30,
        ready_poll_min_s=0.2,
        ready_poll_max_s=0.5,
        restart_stop_timeout_s=5,
    )

    async def flip():
        async with sidecar(settings, timeout=60) as client:
            deadline = time.monotonic() + 30
            while not (ready := await client.get("/ready")).status_code == 200:
                assert time.monotonic() < deadline, ready.json()
                await asyncio.sleep(0.2)
            assert ready.json()["mode"] == "off"
            r = await client.post("/mode", json={"mode": "validate"}, headers=AUTH)
            assert r.status_code == 202, r.json()
            while (st := (await client.get("/status")).json())["active_transition"]:
                assert time.monotonic() < deadline + 60, st["active_transition"]
                await asyncio.sleep(0.2)
            return st

    st = asyncio.run(flip())
    t = st["transitions"][-1]
    assert t["outcome"] == "succeeded", t
    assert read_desired_mode(state_dir) == Mode.VALIDATE
    assert st["container"]["state"]["running"] and st["mode"]["current"] == "validate"
    assert {r["record"]["mode"] for r in st["ranks"]} == {"validate"}
    assert st["log"]["latest_marker"]["name"] == "fired_up"
