"""kdtreectl and `python -m sidecar`, as a user runs them, against a sidecar served by uvicorn.

The server behind the sidecar is tests/standin_engine.py, a stand-in for SGLang (a separate local process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sidecar_harness import TOKEN, kdtreectl, make_settings, serve
from standin_engine import free_port

from kdtree.config import Mode
from kdtree.control import read_desired_mode

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def stack(engine):
    """A stand-in engine and a sidecar in front of it: stack(*engine_args) -> (sidecar URL, engine)."""
    contexts = []

    def start(*args, mode: Mode | None = None, **overrides):
        proc = engine("--tp-size", "2", "--heartbeat-s", "0.2", *args, mode=mode, wait=False)
        settings = make_settings(
            proc.state_dir, proc.port, **{"ready_timeout_s": 10, "bake_probes": 2, **overrides}
        )
        ctx = serve(settings, proc)
        contexts.append(ctx)
        return ctx.__enter__(), proc

    yield start
    for ctx in contexts:
        ctx.__exit__(None, None, None)


def test_wait_follows_the_startup_and_exits_0_when_ready(stack):
    url, _ = stack("--load-seconds", "1.5", "--warm-seconds", "0.8")
    r = kdtreectl(url, "wait", "--timeout", "30", "--interval", "0.1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith("loading | Capture cuda graph begin") for line in lines), lines
    assert any(line.startswith("warming |") for line in lines), lines
    assert lines[-1].startswith("ready after") and lines[-1].endswith("in mode off")


def test_wait_exits_3_with_the_crash_excerpt(stack):
    url, _ = stack("--load-seconds", "0.4", "--fault", "crash-on-start", "--exit-code", "9")
    r = kdtreectl(url, "wait", "--timeout", "30", "--interval", "0.1")
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "the server crashed" in r.stderr and "exit code 9" in r.stderr
    assert "| torch.OutOfMemoryError: CUDA out of memory" in r.stderr


def test_wait_exits_4_on_timeout(stack):
    url, _ = stack("--load-seconds", "60")
    r = kdtreectl(url, "wait", "--timeout", "1", "--interval", "0.2")
    assert r.returncode == 4 and "not ready after" in r.stderr and "connection_refused" in r.stderr


def test_wait_exits_4_when_no_sidecar_answers():
    r = kdtreectl(f"http://127.0.0.1:{free_port()}", "wait", "--timeout", "0.5", "--interval", "0.1")
    assert r.returncode == 4 and "the sidecar never answered" in r.stderr


def test_status_summary_and_json(stack):
    url, proc = stack()
    proc.wait_port()
    r = kdtreectl(url, "status")
    assert (
        r.returncode == 0
        and "phase:     ready" in r.stdout
        and "ranks:     2 records, expected 2" in r.stdout
    )
    doc = json.loads(kdtreectl(url, "status", "--json").stdout)
    assert doc["phase"] == "ready" and doc["mode"]["current"] == "off"


def test_mode_commands(stack, tmp_path):
    url, proc = stack("--parity-calls", "10", mode=Mode.VALIDATE)
    proc.wait_port()
    denied = kdtreectl(url, "mode", "off")
    assert denied.returncode == 6 and "KDTREE_ADMIN_TOKEN" in denied.stderr
    dry = kdtreectl(url, "mode", "on", "--dry-run", token=TOKEN)
    assert dry.returncode == 1 and "FAIL  min_calls_compared: 10 (threshold 100)" in dry.stdout
    assert "would be refused" in dry.stdout
    refused = kdtreectl(url, "mode", "on", token=TOKEN)
    assert refused.returncode == 1 and "the gate to on failed" in refused.stderr
    flipped = kdtreectl(
        url, "mode", "off", "--reason", "kill switch drill", "--wait", "--interval", "0.1", token=TOKEN
    )
    assert flipped.returncode == 0, flipped.stderr
    assert "mode is now off" in flipped.stdout and read_desired_mode(tmp_path) == Mode.OFF


def test_mode_wait_reports_a_rollback(stack, tmp_path):
    url, proc = stack("--fault", "crash-on-start", "--fault-in-mode", "validate")
    proc.wait_port()
    r = kdtreectl(url, "mode", "validate", "--wait", "--interval", "0.1", token=TOKEN)
    assert r.returncode == 1 and "transition rolled_back: the server crashed while starting" in r.stderr
    assert read_desired_mode(tmp_path) == Mode.OFF


def test_kdtreectl_console_script_is_installed():
    script = Path(sys.executable).parent / "kdtreectl"
    if not script.exists():
        pytest.skip("the package is not installed in this environment (pip install -e '.[sidecar]')")
    r = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "wait" in r.stdout and "mode" in r.stdout


# ---- python -m sidecar ------------------------------------------------------------------------------------


def sidecar_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDTREE_")}
    return {**env, "KDTREE_STATE_DIR": str(tmp_path), **extra}


def test_python_m_sidecar_refuses_to_start_without_an_admin_decision(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "sidecar"],
        capture_output=True,
        text=True,
        timeout=30,
        env=sidecar_env(tmp_path),
        cwd=REPO,
    )
    assert r.returncode == 2
    assert "KDTREE_ADMIN_TOKEN" in r.stderr and "KDTREE_ALLOW_OPEN_ADMIN=true" in r.stderr


def test_python_m_sidecar_serves_on_the_configured_port(tmp_path):
    port = free_port()
    env = sidecar_env(
        tmp_path,
        KDTREE_ADMIN_TOKEN=TOKEN,
        KDTREE_SIDECAR_HOST="127.0.0.1",
        KDTREE_SIDECAR_PORT=str(port),
        KDTREE_SERVER_URL=f"http://127.0.0.1:{free_port()}",
        KDTREE_PROBE_DEADLINE_S="0.5",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                live = httpx.get(f"http://127.0.0.1:{port}/live", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, "python -m sidecar did not serve"
                time.sleep(0.1)
        ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
    finally:
        proc.terminate()
        proc.wait(10)
    assert live.json() == {"live": True}
    assert ready.status_code == 503 and ready.json()["phase"] == "loading"


def test_sidecar_imports_neither_torch_nor_sglang(tmp_path):
    # Decoy packages that fail loudly if anything imports them, so the check holds where torch is absent too.
    for name in ("torch", "sglang"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the sidecar imported {name}')\n")
    code = (
        "import sys, sidecar.app, sidecar.cli, sidecar.__main__; "
        "bad = {'torch', 'sglang'} & set(sys.modules); assert not bad, bad; print('clean')"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "clean", r.stderr
