"""compose/two-node.yaml: a tensor-parallel group over two nodes on CPU, each node in its own network namespace
with its sidecar and state volume (the stand-in engine, NOT SGLang; node 1 answering as SGLang's dummy health
server). Rendered offline by docker-compose; run end to end (marker `docker`) with the CI images as
tests/stack/test_image.py runs the one-node stack.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from test_compose_files import arg, command, compose, env_file, rendered  # noqa: F401 - `compose` is a fixture

REPO = Path(__file__).resolve().parents[2]
GROUP_TOKEN = "ci-group-token"
FILES = [
    REPO / "compose.yaml",
    REPO / "tests" / "stack" / "compose.ci.yaml",
    REPO / "compose" / "two-node.yaml",
]


def test_the_two_node_file_renders_two_nodes_apart(compose, tmp_path):  # noqa: F811
    env = env_file(tmp_path)
    env.write_text(env.read_text() + "KDTREE_GROUP_TOKEN=g0up\n")
    services = rendered(compose, env, *FILES)
    leader, worker = services["sidecar"]["environment"], services["sidecar-worker"]["environment"]
    assert (leader["KDTREE_GROUP_ROLE"], leader["KDTREE_GROUP_WORKERS"]) == (
        "leader",
        "http://netns-worker:8080",
    )
    assert (worker["KDTREE_GROUP_ROLE"], worker["KDTREE_NODE_RANK"]) == ("worker", "1")
    assert leader["KDTREE_EXPECTED_TP_SIZE"] == worker["KDTREE_EXPECTED_TP_SIZE"] == "4"
    assert leader["KDTREE_GROUP_TOKEN"] == worker["KDTREE_GROUP_TOKEN"] == "g0up"
    assert (
        "KDTREE_ADMIN_TOKEN" not in worker
    )  # least privilege: a worker's sidecar holds the group token only
    for name in ("sidecar-worker", "server-worker"):
        assert services[name]["network_mode"] == "service:netns-worker", name  # node 1's own namespace
        (volume,) = [v for v in services[name]["volumes"] if "/var/run/kdtree" in str(v)]
        assert "kdtree-state-worker" in str(volume), name
    server, worker_server = (
        command(services["server"]),
        command(services["server-worker"]),
    )  # v1: a string, v2: a list
    assert (arg(server, "--nnodes"), arg(server, "--node-rank")) == ("2", "0")
    assert (arg(worker_server, "--nnodes"), arg(worker_server, "--node-rank")) == ("2", "1")
    assert arg(worker_server, "--leader-url") == "http://netns:30000"


# ---- end to end (Docker) -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def group_stack(tmp_path_factory):
    from test_image import SERVER, SIDECAR, Stack, require_compose, require_image

    require_image(SERVER)
    require_image(SIDECAR)
    require_compose()
    models = Path(tempfile.mkdtemp(prefix="kdtree-models-"))
    models.chmod(0o755)
    s = Stack(tmp_path_factory.mktemp("group"), models, files=FILES)
    s.env["KDTREE_TP_SIZE"] = "4"
    s.env["KDTREE_GROUP_TOKEN"] = GROUP_TOKEN
    try:
        s.compose("up", "-d")
        yield s
    finally:
        s.down()
        shutil.rmtree(models)


def from_leader(stack, method: str, url: str, token: str | None, body: dict | None = None) -> int:
    """The HTTP status the leader's sidecar container gets from `url` (the worker's port is not published)."""
    code = (
        "import json, sys, urllib.request as u, urllib.error as e\n"
        f"r = u.Request({url!r}, method={method!r}, data={json.dumps(body).encode() if body else None!r})\n"
        + (f"r.add_header('Authorization', 'Bearer {token}')\n" if token else "")
        + "try:\n    print(u.urlopen(r, timeout=10).status)\nexcept e.HTTPError as x:\n    print(x.code)\n"
    )
    r = stack.exec("sidecar", "python", "-c", code)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip())


@pytest.mark.docker
def test_compose_group_is_ready_only_with_both_nodes_ranks(group_stack):
    from test_image import TOKEN

    s = group_stack.wait("the group to become ready", lambda s: s["ready"], timeout=180)
    assert sorted(v["record"]["tp_rank"] for v in s["ranks"]) == [0, 1, 2, 3]
    assert [(n["node"], n["ranks_reporting"]) for n in s["group"]] == [(0, [0, 1]), (1, [2, 3])]
    worker = "http://netns-worker:8080"
    assert from_leader(group_stack, "GET", f"{worker}/live", None) == 200
    assert from_leader(group_stack, "POST", f"{worker}/group/mode", None, {"mode": "off"}) == 401
    assert (
        from_leader(group_stack, "GET", f"{worker}/ready", TOKEN) == 403
    )  # the admin token opens nothing there
    assert from_leader(group_stack, "GET", f"{worker}/ready", GROUP_TOKEN) == 200


@pytest.mark.docker
def test_compose_group_live_flip_confirmed_by_both_nodes(group_stack):
    group_stack.wait("the group to become ready", lambda s: s["ready"], timeout=180)
    n = len(group_stack.status()["transitions"])
    assert group_stack.post_mode("on").status_code == 202
    t = group_stack.wait_transition(n + 1)
    assert t["outcome"] == "succeeded" and t["method"] == "live" and t["ranks_confirmed"] == 4, t
    assert {v["record"]["mode"] for v in group_stack.status()["ranks"]} == {"on"}


@pytest.mark.docker
def test_compose_group_kill_switch_with_the_worker_partitioned(group_stack):
    group_stack.wait("the group to become ready", lambda s: s["ready"], timeout=180)
    netns = group_stack.container("netns-worker")
    network = f"{group_stack.project}_default"
    subprocess.run(["docker", "network", "disconnect", network, netns], check=True)
    try:
        group_stack.wait(
            "node 1 unread", lambda s: not s["ready"] and not s["group"][1]["reachable"], timeout=60
        )
        assert group_stack.post_mode("validate").status_code == 503  # refused while a node is unread
        n = len(group_stack.status()["transitions"])
        assert group_stack.post_mode("off").status_code == 202  # the kill switch still runs
        group_stack.wait("node 1 owed off", lambda s: s["group"][1]["owed"] == "off", timeout=60)
    finally:
        # the service's name back as its alias: a plain connect gives the container no DNS name in the network
        subprocess.run(
            ["docker", "network", "connect", "--alias", "netns-worker", network, netns], check=True
        )
    time.sleep(1)
    t = group_stack.wait_transition(n + 1, timeout=240)
    assert t["outcome"] == "succeeded", json.dumps(t, indent=1)[:6000]
    assert {v["record"]["mode"] for v in group_stack.status()["ranks"]} == {"off"}
