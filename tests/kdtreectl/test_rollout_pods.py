"""kdtreectl rollout --selector: the waves state the mode in the pods' annotation, each pod's sidecar converges to
it (sidecar/desired_mode.py), and a rollout interrupted at any point is finished by running it again, or undone by
running it with the previous mode.

A pod is standins/standin_engine.py (a stand-in for SGLang, NOT SGLang) behind a real sidecar app under uvicorn, its
desired-mode file where the downward API would put it. kubectl and the cluster are standins/kubectl_standin.py (a
stand-in, NOT kubectl or Kubernetes: kubectl's two commands, their output and errors, and the kubelet's refresh of the
downward API file). kdtreectl runs as a user runs it, in a subprocess.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from sidecar_harness import audit_events, kdtreectl, make_settings, serve
from standin_engine import StandinProcess, free_port

from kdtree.config import Mode
from kdtree.state.mode_file import read_desired_mode, write_desired_mode

REPO = Path(__file__).resolve().parents[2]
GOOD_PARITY = ("--parity-calls", "500", "--parity-max-rel", "0.004")
THIN_PARITY = ("--parity-calls", "10", "--layers", "1")
# A pod whose gate refuses however long the test runs (the sidecars' own probes add compared calls).
NEVER_ENOUGH = {"gate_min_calls": 10**9}
SELECTOR = "app.kubernetes.io/name=kdtree"


def pod_object(name: str, port: int) -> dict:
    """A Pod as `kubectl get pods -o json` lists it, with what kdtreectl reads: name, labels, annotations, the
    sidecar container's port named sidecar, the pod IP."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "kdtree", "labels": {"app.kubernetes.io/name": "kdtree"}},
        "spec": {
            "initContainers": [
                {
                    "name": "sidecar",
                    "restartPolicy": "Always",
                    "ports": [{"name": "sidecar", "containerPort": port}],
                }
            ],
            "containers": [{"name": "server", "ports": [{"name": "api", "containerPort": 30000}]}],
        },
        "status": {"phase": "Running", "podIP": "127.0.0.1"},
    }


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.file = root / "cluster.json"
        self.kubectl = root / "kubectl"
        self.kubectl.write_text(
            f'#!/bin/sh\nexec {sys.executable} {REPO / "standins/kubectl_standin.py"} "$@"\n'
        )
        self.kubectl.chmod(0o755)
        self.pods: list[tuple[str, StandinProcess, Path]] = []  # (name, engine, state dir)

    def save(self, pods: list[dict], downward: dict[str, str]) -> None:
        self.file.write_text(json.dumps({"pods": pods, "downward": downward}))

    def read(self) -> dict:
        return json.loads(self.file.read_text())

    def annotation(self, name: str) -> str | None:
        (pod,) = [p for p in self.read()["pods"] if p["metadata"]["name"] == name]
        return pod["metadata"].get("annotations", {}).get("kdtree.dev/desired-mode")

    def rollout(self, *args: str, die_after: int | None = None):
        env = {"KUBECTL_STANDIN_CLUSTER": str(self.file)}
        if die_after is not None:
            env["KUBECTL_STANDIN_DIE_AFTER_ANNOTATE"] = str(die_after)
        argv = ["rollout", "--selector", SELECTOR, "-n", "kdtree", "--kubectl", str(self.kubectl)]
        return kdtreectl(None, *argv, "--interval", "0.1", "--timeout", "60", *args, env=env)

    def modes(self) -> list[Mode | None]:
        return [read_desired_mode(state) for _, _, state in self.pods]

    def flips(self) -> list[int]:
        """Transitions each pod's sidecar accepted."""
        return [audit_events(state).count("accepted") for _, _, state in self.pods]


@pytest.fixture
def cluster(tmp_path):
    """cluster(*per_pod_engine_args, mode=M) -> Cluster with one pod per argument tuple, named kdtree-0, -1, ..."""
    engines, contexts = [], []
    c = Cluster(tmp_path)

    def start(
        *per_pod: tuple[str, ...], mode: Mode = Mode.VALIDATE, overrides: dict | None = None
    ) -> Cluster:
        """overrides: pod index -> sidecar settings of its own."""
        objects, downward = [], {}
        for i, args in enumerate(per_pod):
            name = f"kdtree-{i}"
            state = tmp_path / name / "state"
            podinfo = tmp_path / name / "podinfo"
            state.mkdir(parents=True)
            podinfo.mkdir()
            write_desired_mode(state, mode)
            proc = StandinProcess(free_port(), str(state), ["--tp-size", "2", "--heartbeat-s", "0.2", *args])
            engines.append(proc.start())
            settings = make_settings(
                state,
                proc.port,
                verify=mode,
                bake_probes=2,
                probe_interval_s=0.2,
                desired_mode_file=podinfo / "desired-mode",
                **(overrides or {}).get(i, {}),
            )
            ctx = serve(settings, proc)
            contexts.append(ctx)
            url = ctx.__enter__()
            objects.append(pod_object(name, urlsplit(url).port))
            downward[name] = str(podinfo / "desired-mode")
            c.pods.append((name, proc, state))
        for _, proc, _ in c.pods:
            proc.wait_port()
        c.save(objects, downward)
        return c

    yield start
    for ctx in contexts:
        ctx.__exit__(None, None, None)
    for proc in engines:
        proc.stop()


def rows(stdout: str) -> dict[str, str]:
    """The final table: pod -> outcome."""
    return {line.split()[0]: line.split()[3] for line in stdout.splitlines() if line.startswith("pod/")}


def test_waves_state_the_mode_and_wait_for_each_pod_to_converge(cluster):
    c = cluster(GOOD_PARITY, GOOD_PARITY, GOOD_PARITY)
    r = c.rollout("--to", "on", "--canary", "1", "--wave", "2")
    assert r.returncode == 0, (r.stdout, r.stderr)
    progress = [line for line in r.stdout.splitlines() if line.startswith("[")]
    assert progress[0].startswith("[canary] pod/kdtree-0: validate -> on succeeded")
    assert all(line.startswith("[wave 1/1]") for line in progress[1:3])
    assert rows(r.stdout) == {f"pod/kdtree-{i}": "succeeded" for i in range(3)}
    assert [c.annotation(f"kdtree-{i}") for i in range(3)] == ["on"] * 3
    assert c.modes() == [Mode.ON] * 3 and c.flips() == [1, 1, 1]
    assert [proc.starts for _, proc, _ in c.pods] == [1, 1, 1]  # live switches
    # The canary converged before the wave was stated.
    canary_done = max(e["ts"] for e in _audit(c, 0) if e["event"] == "succeeded")
    assert all(canary_done < min(e["ts"] for e in _audit(c, i) if e["event"] == "accepted") for i in (1, 2))
    port = c.read()["pods"][0]["spec"]["initContainers"][0]["ports"][0]["containerPort"]
    status = kdtreectl(f"http://127.0.0.1:{port}", "status")
    assert "desired:   converged 'on': the server runs in mode on" in status.stdout, status.stdout
    again = c.rollout("--to", "on", "--canary", "1", "--wave", "2")
    assert again.returncode == 0 and set(rows(again.stdout).values()) == {"already"}
    assert c.flips() == [1, 1, 1] and c.read()["annotations_made"] == 3  # nothing stated twice


@pytest.mark.parametrize("die_after", [1, 2, 3])
def test_a_rollout_interrupted_after_any_annotation_is_finished_by_running_it_again(cluster, die_after):
    c = cluster(GOOD_PARITY, GOOD_PARITY, GOOD_PARITY)
    killed = c.rollout("--to", "on", "--canary", "1", "--wave", "1", die_after=die_after)
    assert killed.returncode == -9, (killed.stdout, killed.stderr)  # the terminal gone, right after that step
    assert [c.annotation(f"kdtree-{i}") for i in range(3)] == ["on"] * die_after + [None] * (3 - die_after)
    r = c.rollout("--to", "on", "--canary", "1", "--wave", "1")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert c.modes() == [Mode.ON] * 3 and c.flips() == [1, 1, 1]  # each pod flipped once, whoever stated it
    assert c.read()["annotations_made"] == 3


def test_an_interrupted_rollout_is_undone_by_running_it_to_the_previous_mode(cluster):
    c = cluster(GOOD_PARITY, GOOD_PARITY, GOOD_PARITY)
    killed = c.rollout("--to", "on", "--canary", "1", "--wave", "2", die_after=2)
    assert killed.returncode == -9
    r = c.rollout("--to", "validate", "--canary", "1", "--wave", "2")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert c.modes() == [Mode.VALIDATE] * 3
    assert [c.annotation(f"kdtree-{i}") for i in range(3)] == ["validate"] * 3


def test_a_held_pod_stops_every_run_until_retry_asks_again(cluster):
    c = cluster(GOOD_PARITY, THIN_PARITY, GOOD_PARITY, overrides={1: NEVER_ENOUGH})
    r = c.rollout("--to", "on")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert rows(r.stdout) == {
        "pod/kdtree-0": "succeeded",
        "pod/kdtree-1": "refused",
        "pod/kdtree-2": "skipped",
    }
    assert "min_calls_compared" in r.stdout and "--retry" in r.stderr
    again = c.rollout("--to", "on")  # no loop: the held value is not asked again
    assert again.returncode == 1 and rows(again.stdout)["pod/kdtree-1"] == "refused"
    assert audit_events(c.pods[1][2]).count("refused") == 1 and c.annotation("kdtree-2") is None
    retry = c.rollout("--to", "on", "--retry")
    assert retry.returncode == 1 and rows(retry.stdout)["pod/kdtree-1"] == "refused"
    assert audit_events(c.pods[1][2]).count("refused") == 2  # asked once more
    assert c.annotation("kdtree-1").startswith("on@retry-") and c.modes() == [
        Mode.ON,
        Mode.VALIDATE,
        Mode.VALIDATE,
    ]


def test_dry_run_reads_each_pods_gate_and_states_nothing(cluster):
    c = cluster(GOOD_PARITY, THIN_PARITY, overrides={1: NEVER_ENOUGH})
    r = c.rollout("--to", "on", "--dry-run")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert rows(r.stdout) == {"pod/kdtree-0": "allowed", "pod/kdtree-1": "refused"}
    assert "  FAIL  min_calls_compared: need >= 1000000000" in r.stdout
    assert "dry run: 1 refused by its gate (pod/kdtree-1); nothing stated" in r.stdout
    assert "annotations_made" not in c.read() and c.flips() == [0, 0]


def test_rollback_on_failure_states_the_previous_value_again(cluster):
    c = cluster(GOOD_PARITY, THIN_PARITY, overrides={1: NEVER_ENOUGH})
    r = c.rollout("--to", "on", "--wave", "1", "--rollback-on-failure")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert rows(r.stdout) == {"pod/kdtree-0": "reverted", "pod/kdtree-1": "refused"}
    assert c.modes() == [Mode.VALIDATE, Mode.VALIDATE] and c.annotation("kdtree-0") == "validate"


def test_a_pod_without_the_desired_mode_file_stops_it_before_anything_is_stated(cluster, tmp_path):
    c = cluster(GOOD_PARITY)
    data = c.read()
    state = tmp_path / "plain"
    state.mkdir()
    proc = StandinProcess(free_port(), str(state), ["--tp-size", "2"]).start()
    try:
        with serve(make_settings(state, proc.port), proc) as url:
            data["pods"].append(pod_object("kdtree-9", urlsplit(url).port))
            c.save(data["pods"], data["downward"])
            r = c.rollout("--to", "on")
    finally:
        proc.stop()
    assert r.returncode == 1 and "has no KDTREE_DESIRED_MODE_FILE" in r.stdout
    assert "nothing changed" in r.stdout and c.annotation("kdtree-0") is None


def test_kubectl_failing_is_named(cluster, tmp_path):
    c = cluster(GOOD_PARITY)
    r = kdtreectl(
        None, "rollout", "--selector", SELECTOR, "--to", "on", "--kubectl", str(tmp_path / "absent")
    )
    assert r.returncode == 7 and "no kubectl at" in r.stderr
    assert c.annotation("kdtree-0") is None
    # a kubectl that runs and fails (no cluster): its own words, and the command as it ran, namespace included
    failing = tmp_path / "kubectl"
    failing.write_text("#!/bin/sh\necho 'error: no configuration has been provided' >&2\nexit 1\n")
    failing.chmod(0o755)
    r = kdtreectl(
        None, "rollout", "--selector", SELECTOR, "--to", "on", "-n", "kdtree", "--kubectl", str(failing)
    )
    assert r.returncode == 7 and "no configuration has been provided" in r.stderr
    assert f"{failing} --namespace kdtree get pods --selector {SELECTOR}" in r.stderr


def _audit(c: Cluster, i: int) -> list[dict]:
    from sidecar.store import Store

    return Store(c.pods[i][2], 50).audit_tail(1000)
