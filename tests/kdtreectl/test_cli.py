"""kdtreectl and `python -m sidecar`, as a user runs them, against a sidecar served by uvicorn.

The server behind the sidecar is standins/standin_engine.py, a stand-in for SGLang (a separate local process).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sidecar_harness import TOKEN, kdtreectl, make_settings, serve
from standin_engine import free_port

from kdtree.config import Mode
from kdtree.state.mode_file import read_desired_mode

REPO = Path(__file__).resolve().parents[2]


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
    assert any(line.startswith("loading | Capture target verify CUDA graph begin") for line in lines), lines
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


@pytest.mark.parametrize(
    "args,env,named",
    [
        (["--url", "localhost:8080", "status"], {}, "argument --url: 'localhost:8080' is not an http(s) URL"),
        (
            ["check", "--server-url", "127.0.0.1:30000"],
            {},
            "argument --server-url: '127.0.0.1:30000' is not an",
        ),
        (["--url", "http://127.0.0.1:abc", "status"], {}, "argument --url: 'http://127.0.0.1:abc' is not"),
        (["status"], {"KDTREE_SIDECAR_URL": "localhost:1"}, "argument --url: 'localhost:1' is not"),
        (["check"], {"KDTREE_SERVER_URL": "http://"}, "argument --server-url: 'http://' is not"),
    ],
)
def test_a_url_without_its_scheme_is_bad_input_that_names_the_flag_or_variable(args, env, named):
    """Bad input (exit 2, before any request), not an unreachable sidecar (exit 7 with httpx's complaint)."""
    r = kdtreectl(None, *args, env=env, timeout=30)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert named in r.stderr and "http://HOST:PORT" in r.stderr.split(named)[1], r.stderr
    assert not env or next(iter(env)) in r.stderr  # the variable that gave the default


@pytest.mark.parametrize(
    "args,env",
    [
        (["--url", f"https://[::1]:{free_port()}/base/", "status"], {}),  # https, IPv6, a path
        (
            ["--url", f"http://127.0.0.1:{free_port()}", "status"],
            {"KDTREE_SIDECAR_URL": "localhost:1"},
        ),  # overrides
        (
            ["--url", f"http://127.0.0.1:{free_port()}", "status"],
            {"KDTREE_SERVER_URL": "nonsense"},
        ),  # not read
    ],
)
def test_a_good_url_reaches_the_request_whatever_an_unused_variable_holds(args, env):
    r = kdtreectl(None, *args, "--http-timeout", "2", env=env, timeout=30)
    assert r.returncode == 7 and "cannot reach the sidecar" in r.stderr, (r.stdout, r.stderr)


def test_wait_exits_7_when_no_sidecar_answers():
    r = kdtreectl(f"http://127.0.0.1:{free_port()}", "wait", "--timeout", "0.5", "--interval", "0.1")
    assert r.returncode == 7 and "never answered" in r.stderr


class NotASidecar:
    """A URL that answers, but not as a sidecar: an HTML error page, or JSON that is not an object."""

    def __init__(self, body: bytes, code: int):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.mark.parametrize(("body", "code"), [(b"<html>bad gateway</html>", 502), (b"[1, 2]", 200)])
@pytest.mark.parametrize(
    "command", [["status"], ["mode", "off"], ["wait", "--timeout", "0.3"], ["mode", "on", "--dry-run"]]
)
def test_every_answer_is_parsed_defensively(body, code, command):
    """A URL that answers something other than a sidecar's JSON: one line and exit 7, never a traceback."""
    fake = NotASidecar(body, code)
    try:
        r = kdtreectl(fake.url, *command, token=TOKEN)
    finally:
        fake.server.shutdown()
    assert r.returncode == 7, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["wait", "--timeout", "0.5", "--interval", "0.1"],
        ["mode", "off"],
        ["mode", "on", "--dry-run"],
        ["check", "--out", "{out}"],
        ["rollout", "--to", "off", "--sidecar", "{url}"],
    ],
)
def test_every_command_pointed_at_sglangs_own_port_exits_7(engine, tmp_path, command):
    """SGLang's port is no sidecar: the stand-in answers unknown paths as SGLang's FastAPI does
    (404 {"detail": "Not Found"}), JSON but not a sidecar's."""
    url = f"http://127.0.0.1:{engine().port}"
    args = [a.format(url=url, out=tmp_path) for a in command]
    r = kdtreectl(None if command[0] == "rollout" else url, *args, token=TOKEN)
    assert r.returncode == 7, (r.stdout, r.stderr)
    assert "None -> None" not in r.stdout and "Traceback" not in r.stderr
    if command[0] == "mode":
        assert "POST /mode" in r.stderr and "HTTP 404" in r.stderr and "is this a kdtree sidecar?" in r.stderr


def test_status_summary_and_json(stack):
    url, proc = stack()
    proc.wait_port()
    r = kdtreectl(url, "status")
    assert (
        r.returncode == 0
        and "phase:     ready" in r.stdout
        and "ranks:     2 records, expected 2" in r.stdout
    )
    assert "mode:      current off, expected now off, no mode file" in r.stdout and "None" not in r.stdout
    # Each rank's counters and parity, one line each.
    ranks = [line for line in r.stdout.splitlines() if line.startswith("  rank ")]
    assert len(ranks) == 2 and all(
        "served kdtree" in x and "compared" in x and "fallbacks" in x for x in ranks
    )
    doc = json.loads(kdtreectl(url, "status", "--json").stdout)
    assert doc["phase"] == "ready" and doc["mode"]["current"] == "off"


def test_status_exits_with_the_stacks_readiness(stack):
    """0 ready (above), 3 crashed, 8 not ready: the documented exit codes, whatever --json says."""
    url, proc = stack("--load-seconds", "60")
    r = kdtreectl(url, "status")
    assert r.returncode == 8, (r.stdout, r.stderr)
    assert "phase:     loading" in r.stdout and "not_ready_yet" in r.stdout
    assert kdtreectl(url, "status", "--json").returncode == 8
    proc.stop()  # the stand-in ends while it loads: no exit status recorded, as an OOM kill leaves it
    crashed = kdtreectl(url, "wait", "--timeout", "30", "--interval", "0.1")
    assert crashed.returncode == 3, (crashed.stdout, crashed.stderr)
    r = kdtreectl(url, "status")
    assert r.returncode == 3 and "phase:     crashed" in r.stdout, r.stdout


def test_status_of_a_supervised_server_prints_no_none(supervised, tmp_path):
    """Process control (compose's default): a running server has no exit code yet, and says nothing of one."""
    proc = supervised("--tp-size", "2", "--heartbeat-s", "0.2")
    settings = make_settings(proc.state_dir, proc.port, server_control="process")
    with serve(settings, proc) as url:
        r = kdtreectl(url, "status")
    assert r.returncode == 0 and "server:    running oom=False restarts=0" in r.stdout, r.stdout
    assert "None" not in r.stdout


def test_global_flags_go_before_or_after_the_command(stack):
    url, proc = stack(mode=Mode.VALIDATE)
    proc.wait_port()
    after = kdtreectl(None, "status", "--url", url, "--http-timeout", "5")
    assert after.returncode == 0 and "phase:     ready" in after.stdout, after.stderr
    # The token after the command, the URL before it: neither resets the other.
    r = kdtreectl(url, "mode", "standby", "--dry-run", "--token", TOKEN)
    assert r.returncode == 0 and "would be allowed" in r.stdout, (r.stdout, r.stderr)
    bad = kdtreectl(None, "status", "--http-timeout", "soon")
    assert bad.returncode == 2 and "--http-timeout: invalid float value: 'soon'" in bad.stderr


def test_help_never_shows_the_token():
    env = {**os.environ, "KDTREE_ADMIN_TOKEN": "do-not-print-me"}
    for args in (["--help"], ["mode", "--help"], ["check", "--help"]):
        r = subprocess.run(
            [sys.executable, "-m", "kdtreectl", *args], capture_output=True, text=True, env=env
        )
        assert r.returncode == 0 and "--token" in r.stdout and "do-not-print-me" not in r.stdout, args


def test_readme_help_and_code_list_the_same_exit_codes():
    """docs/configuration.md's table under "Exit codes of every command", `kdtreectl --help` and
    kdtreectl.exit_codes."""
    from kdtreectl import exit_codes

    readme = (REPO / "docs" / "configuration.md").read_text().splitlines()
    start = readme.index("| code | meaning |")
    rows = {}
    for line in readme[start + 2 :]:
        if not line.startswith("| "):
            break
        code, meaning = (cell.strip() for cell in line.strip("|").split("|"))
        rows[int(code)] = meaning
    assert rows == exit_codes.MEANINGS
    assert "Exit codes of every command" in readme[start - 2]
    helped = subprocess.run([sys.executable, "-m", "kdtreectl", "--help"], capture_output=True, text=True)
    listed = re.findall(r"^  (\d)  (.+)$", helped.stdout.split("Exit codes:\n")[1], re.M)
    assert {int(c): t for c, t in listed} == exit_codes.MEANINGS
    # Every code a command returns is a listed one: the commands take them from kdtreectl.exit_codes.
    for module in ("cli", "check", "rollout"):
        source = (REPO / "kdtreectl" / f"{module}.py").read_text()
        assert not re.search(r"^(OK|FAILED|USAGE|UNREACHABLE)\b.*= *\d", source, re.M), module
        assert not re.search(r"[Ee]xit (codes: )?\d", source), f"{module}: an exit code written as a number"
    # A command's own help words its codes its way, numbered from the same list.
    for command in ("check", "rollout"):
        helped = subprocess.run(
            [sys.executable, "-m", "kdtreectl", command, "--help"], capture_output=True, text=True
        )
        own = helped.stdout.split("Exit codes: ")[1].split("\n\n")[0]
        codes = {int(c) for c in re.findall(r"(?:^|, )(\d) ", own.replace("\n", " "))}
        assert codes and codes <= set(exit_codes.MEANINGS), (command, own)


def test_mode_commands(stack, tmp_path):
    # The background probe's own compared calls (one verify call per step, one probe per 2 s) stay below the gate.
    url, proc = stack("--parity-calls", "10", "--layers", "1", mode=Mode.VALIDATE, probe_interval_s=2.0)
    proc.wait_port()
    denied = kdtreectl(url, "mode", "off")
    assert denied.returncode == 6 and "KDTREE_ADMIN_TOKEN" in denied.stderr
    dry = kdtreectl(url, "mode", "on", "--dry-run", token=TOKEN)
    assert dry.returncode == 1 and re.search(r"FAIL  min_calls_compared: need >= 100, got \d+", dry.stdout)
    assert "pass  nan_inf: need <= 0, got 0" in dry.stdout  # a comparison, not a bare threshold
    assert "would be refused" in dry.stdout
    refused = kdtreectl(url, "mode", "on", token=TOKEN)
    assert refused.returncode == 1 and "the gate to on failed" in refused.stderr
    flipped = kdtreectl(
        url, "mode", "off", "--reason", "kill switch drill", "--wait", "--interval", "0.1", token=TOKEN
    )
    assert flipped.returncode == 0, flipped.stderr
    assert "mode is now off (restart," in flipped.stdout and read_desired_mode(tmp_path) == Mode.OFF


def test_mode_wait_follows_a_live_switch_with_the_ranks_confirming(stack, tmp_path):
    url, proc = stack(mode=Mode.VALIDATE)
    proc.wait_port()
    r = kdtreectl(url, "mode", "standby", "--wait", "--interval", "0.05", token=TOKEN)
    assert r.returncode == 0, r.stderr
    assert "validate -> standby (live)" in r.stdout
    assert re.search(r"mode is now standby \(live, [\d.]+s; every rank confirmed after [\d.]+s\)", r.stdout)
    assert proc.starts == 1


def test_help_explains_the_mode_and_shows_defaults():
    r = subprocess.run([sys.executable, "-m", "kdtreectl", "mode", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    assert "standby: kdtree installed and idle" in r.stdout and "(default: 3900.0)" in r.stdout
    assert "--dry-run changes nothing and still needs the token" in r.stdout


def test_the_token_can_come_from_a_file_as_in_a_pods_sidecar(stack, tmp_path):
    """KDTREE_ADMIN_TOKEN_FILE, as a Kubernetes pod's sidecar holds the token (kubectl exec into it): read as the
    sidecar reads it. With both variables set or an unreadable file, a warning that names the setting: the commands
    that need no token still run, and one that needs it is refused by the sidecar (unless --token gives one)."""
    url, proc = stack(mode=Mode.VALIDATE)
    proc.wait_port()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    dry = kdtreectl(url, "mode", "on", "--dry-run", env={"KDTREE_ADMIN_TOKEN_FILE": str(token_file)})
    assert dry.returncode in (0, 1) and "dry run: would be" in dry.stdout  # authenticated: the gate answered
    for env, token in (
        ({"KDTREE_ADMIN_TOKEN_FILE": str(token_file)}, TOKEN),
        ({"KDTREE_ADMIN_TOKEN_FILE": "/x"}, None),
    ):
        status = kdtreectl(url, "status", token=token, env=env)
        assert status.returncode == 0 and "phase:" in status.stdout
        assert status.stderr.startswith("kdtreectl: warning: no admin token from the environment: ")
        assert "KDTREE_ADMIN_TOKEN_FILE" in status.stderr and "Traceback" not in status.stderr
        denied = kdtreectl(url, "mode", "off", token=token, env=env)
        assert denied.returncode == 6  # not authorized: no token was sent
    given = kdtreectl(url, "--token", TOKEN, "mode", "on", "--dry-run", env={"KDTREE_ADMIN_TOKEN_FILE": "/x"})
    assert given.returncode in (0, 1) and "dry run: would be" in given.stdout


def test_every_command_has_a_description_and_status_explains_its_verify_line():
    """A command's --help says what it does, beyond its options."""
    from kdtreectl.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    assert {name for name, parser in commands.items() if not parser.description} == set()
    r = subprocess.run(
        [sys.executable, "-m", "kdtreectl", "status", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "under DDTREE's auto budget the tokens it verified a" in r.stdout
    # and what a rank line's `served kdtree ... / original ...` counts
    assert "original, SGLang's own Triton kernel" in r.stdout


def test_mode_wait_and_status_report_a_rollback(stack, tmp_path):
    """`mode --wait` says the flip rolled back and why; `status` afterwards still shows it (the latest transition,
    once none runs), so that an operator who comes later sees what happened."""
    url, proc = stack("--fault", "crash-on-start", "--fault-in-mode", "validate")
    proc.wait_port()
    r = kdtreectl(url, "mode", "validate", "--wait", "--interval", "0.1", "--reason", "try it", token=TOKEN)
    assert r.returncode == 1 and re.search(
        r"transition rolled_back \(restart, [\d.]+s\): the server crashed while", r.stderr
    )
    assert read_desired_mode(tmp_path) == Mode.OFF
    status = kdtreectl(url, "status").stdout
    assert re.search(
        r"^last: +off -> validate \(restart\) rolled_back, took [\d.]+s, \d+s ago \(transition \w+\)$",
        status,
        re.M,
    ), status
    assert "\n  reason: try it\n" in status and "\n  failure: the server crashed while" in status, status


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


def test_python_m_sidecar_holds_a_refused_configuration_for_its_healthcheck(tmp_path):
    """Under compose (--on-config-error hold) a bad value keeps the sidecar up, not serving, and its healthcheck
    prints the refusal: the container's health output names the problem instead of a restart loop."""
    env = sidecar_env(tmp_path, KDTREE_ADMIN_TOKEN=TOKEN, KDTREE_GATE_MIN_CALLS="-1", TMPDIR=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "--on-config-error", "hold"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "kdtree-sidecar-refusal").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "python -m sidecar did not hold"
            time.sleep(0.1)
        check = subprocess.run(
            [sys.executable, "-m", "sidecar.healthcheck", "/live"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.poll() is None  # held, not exited
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert check.returncode == 1, check
    assert check.stdout.startswith("kdtree sidecar: KDTREE_GATE_MIN_CALLS='-1' is invalid"), check.stdout
    assert proc.returncode == 2 and "KDTREE_GATE_MIN_CALLS='-1' is invalid" in out and "holding" in out, out


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
        checks = [
            subprocess.run([sys.executable, "-m", "sidecar.healthcheck", *path], env=env, cwd=REPO, capture_output=True, text=True, timeout=30)
            for path in ([], ["/ready"])
        ]  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(10)
    assert checks[0].returncode == 0 and checks[0].stdout == "", checks[
        0
    ]  # /live: the container's healthcheck
    assert checks[1].returncode == 1 and checks[1].stdout.startswith("GET /ready answered 503: {"), checks[1]
    assert live.json() == {"live": True}
    assert ready.status_code == 503 and ready.json()["phase"] == "loading"


def test_sidecar_imports_neither_torch_nor_sglang(tmp_path):
    # Decoy packages that fail loudly if anything imports them, so the check holds where torch is absent too.
    for name in ("torch", "sglang"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the sidecar imported {name}')\n")
    code = (
        "import sys, sidecar.app, sidecar.__main__, kdtreectl.cli; "
        "bad = {'torch', 'sglang'} & set(sys.modules); assert not bad, bad; print('clean')"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "clean", r.stderr
