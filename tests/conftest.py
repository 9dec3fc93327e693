"""Shared test switches: `gpu`, `docker` and `sglang` tests skip with a visible reason where they cannot run."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from process_harness import SupervisedStandin
from standin_engine import StandinProcess, free_port

from kdtree.config import Mode
from kdtree.state.mode_file import write_desired_mode


def _cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (run on the device: see docs/development.md, 'GPU tests')"
    return None


def _docker_reason() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client"
    r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if r.returncode != 0:
        return "no Docker engine answers (start dockerd; .ci/run does)"
    return None


def _sglang_reason() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("sglang")
    except PackageNotFoundError:
        return "sglang is not installed (pip install -e '.[server,dev]')"
    if found != "0.5.23":
        return f"sglang {found} is installed; these tests target sglang 0.5.23"
    return None


@pytest.fixture
def anyio_backend():
    """The async tests (anyio's pytest plugin) run on asyncio."""
    return "asyncio"


def _starter(tmp_path, cls):
    """start(*engine_args, port=None, wait=True, mode=None) for stand-ins of `cls` with tmp_path as their state
    dir, and the list of those started (the fixtures stop them at the end)."""
    started = []

    def start(*args, port=None, wait=True, mode: Mode | None = None):
        if mode is not None:
            write_desired_mode(tmp_path, mode)
        proc = cls(port or free_port(), str(tmp_path), args).start()
        started.append(proc)
        if wait:
            proc.wait_port()
        return proc

    return start, started


@pytest.fixture
def engine(tmp_path):
    """Start stand-in SGLang engines (standins/standin_engine.py) with tmp_path as their state dir:
    engine(*engine_args, port=None, wait=True, mode=None) -> StandinProcess; all are stopped at the end."""
    start, started = _starter(tmp_path, StandinProcess)
    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def supervised(tmp_path):
    """Like `engine`, but each stand-in runs under the server entrypoint's supervisor behind a stand-in
    orchestrator, and is controlled through the sidecar's process control (standins/process_harness.py):
    supervised(*engine_args, port=None, wait=True, mode=None) -> SupervisedStandin."""
    start, started = _starter(tmp_path, SupervisedStandin)
    yield start
    for proc in started:
        proc.stop()


def pytest_collection_modifyitems(config, items):
    reasons = {}
    for item in items:
        for marker, probe in (("gpu", _cuda_reason), ("docker", _docker_reason), ("sglang", _sglang_reason)):
            if marker in item.keywords:
                if marker not in reasons:
                    reasons[marker] = probe()
                if reasons[marker]:
                    item.add_marker(pytest.mark.skip(reason=f"{marker}: {reasons[marker]}"))
