"""`kdtreectl check` against stand-in stacks: standins/standin_engine.py is a stand-in for SGLang (not SGLang: no
model), with SGLang's completion fields (token_ids, sglext.spec_tokens_details, usage) and ranks that count
verify calls the way the real ranks' records do, behind the real sidecar served by uvicorn."""

from __future__ import annotations

import json
from contextlib import ExitStack

import httpx
import pytest
from sidecar_harness import TOKEN, kdtreectl, make_settings, serve
from standin_engine import free_port

from kdtree.config import Mode
from kdtree.state.mode_file import read_desired_mode
from kdtreectl.check import BUILTIN_PROMPTS, compare_outputs, first_divergence, prompts
from kdtreectl.exit_codes import USAGE

GOOD_PARITY = ("--parity-calls", "500", "--parity-max-rel", "0.004")
FAST = ("--prompts", "9", "--max-tokens", "16", "--concurrency", "1,3", "--interval", "0.1")


@pytest.fixture
def stack(engine):
    """A stand-in engine (two ranks) and the sidecar in front of it: stack(*engine_args) -> (url, engine)."""
    with ExitStack() as contexts:

        def start(*args, mode: Mode = Mode.VALIDATE, wait: bool = True, **overrides):
            proc = engine("--tp-size", "2", "--heartbeat-s", "0.2", *args, mode=mode, wait=wait)
            settings = make_settings(proc.state_dir, proc.port, **{"bake_probes": 2, **overrides})
            return contexts.enter_context(serve(settings, proc)), proc

        yield start


def check(url: str, proc, tmp_path, *args: str, env: dict | None = None):
    out = tmp_path / "report"
    r = kdtreectl(
        url, "check", "--server-url", f"http://127.0.0.1:{proc.port}", "--out", str(out), *FAST, *args,
        token=TOKEN, timeout=120, env=env,
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
    return r, report


def test_the_prompt_set_is_deterministic_and_has_a_long_prompt():
    assert prompts(3) == prompts(3) == BUILTIN_PROMPTS[:3]
    assert max(len(p.split()) for p in BUILTIN_PROMPTS) > 2000  # thousands of tokens
    assert len(prompts(30)) == 30


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_a_healthy_stack_passes_with_evidence_on_every_rank(stack, tmp_path):
    url, proc = stack()
    r, report = check(url, proc, tmp_path)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert report["passed"] and report["failure"] is None and report["prompts"] == 9
    rows = {(x["mode"], x["concurrency"]): x for x in report["levels"]}
    assert set(rows) == {("validate", 1), ("validate", 3)}
    for row in rows.values():
        assert row["requests"] == 9 and row["failed"] == 0 and row["tokens_per_s"] > 0
        assert row["p50_s"] <= row["p99_s"] and row["accept_length"] == pytest.approx(3.0, rel=0.2)
    evidence = report["evidence"]["validate"]
    assert {e["rank"] for e in evidence} == {0, 1} and all(e["ok"] and e["compared"] > 0 for e in evidence)
    assert (tmp_path / "report" / "report.md").read_text().startswith("# kdtree check")
    assert "| validate | 3 | 9 | 0 |" in r.stdout  # the table in the terminal


def test_the_check_sends_the_servers_api_key(stack, tmp_path):
    """A server with --api-key (the stand-in checks it as SGLang does): check's completions carry the same
    KDTREE_SERVER_API_KEY that the sidecar's probe sends."""
    key = "sk-check-key"
    url, proc = stack("--api-key", key, server_api_key=key)
    r, report = check(url, proc, tmp_path, env={"KDTREE_SERVER_API_KEY": key})
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert report["passed"] and all(row["failed"] == 0 for row in report["levels"])
    assert key not in r.stdout + r.stderr + (tmp_path / "report" / "report.md").read_text()
    r, _ = check(url, proc, tmp_path)  # without the key: SGLang's 401 for every completion
    assert r.returncode != 0


@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ("no-verify-count", "no fallback either: did any target-verify call reach the override?"),
        ("fallback", "fallbacks grew instead: kv_dtype +"),
    ],
)
def test_ranks_whose_counters_do_not_move_fail_the_check_naming_the_fallbacks(stack, tmp_path, fault, named):
    url, proc = stack("--fault", fault)
    r, report = check(url, proc, tmp_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    line = r.stderr.strip().splitlines()[-1]
    assert "in validate, rank 0 shows no verify call served or compared by kdtree" in line and named in line
    assert report["passed"] is False and report["failure"] in line


@pytest.mark.parametrize("when", ["at start", "at run time"])
def test_flip_reports_diverging_outputs_with_their_positions_and_returns(stack, tmp_path, when):
    fault = ["--fault", "diverge", "--fault-in-mode", "on"] if when == "at start" else []
    url, proc = stack(*GOOD_PARITY, *fault, "--diverge-at", "5")
    if when == "at run time":  # the demo's way: diverge is a wrong kdtree result, so it shows in on only
        switched = httpx.post(f"http://127.0.0.1:{proc.port}/_standin/fault", json={"fault": "diverge"})
        assert switched.json() == {"fault": "diverge"}
    r, report = check(url, proc, tmp_path, "--flip")
    assert r.returncode == 0, (r.stdout, r.stderr)
    flip = report["flip"]
    assert flip["transition"]["outcome"] == "succeeded" and flip["transition"]["method"] == "live"
    assert flip["compared"] == 18 and flip["identical"] == 0
    assert {d["diverges_at"] for d in flip["differences"]} == {5}
    assert set(flip["tokens_per_s_ratio"]) == {"1", "3"} and flip["parity"]
    assert all(e["served"] > 0 for e in report["evidence"]["on"])
    assert flip["returned"] == "succeeded" and read_desired_mode(proc.state_dir) == Mode.VALIDATE
    assert "first differs at token 5" in (tmp_path / "report" / "report.md").read_text()


def test_flip_with_identical_outputs_and_stay(stack, tmp_path):
    url, proc = stack(*GOOD_PARITY)
    r, report = check(url, proc, tmp_path, "--flip", "--stay")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert report["flip"]["identical"] == report["flip"]["compared"] == 18
    assert "returned" not in report["flip"] and read_desired_mode(proc.state_dir) == Mode.ON


def test_a_flip_the_gate_refuses_fails_the_check(stack, tmp_path):
    url, proc = stack(gate_min_calls=10**6)  # the check's own load cannot gather that much evidence
    r, report = check(url, proc, tmp_path, "--flip")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "the gate refused the flip to on (min_calls_compared)" in r.stderr
    assert read_desired_mode(proc.state_dir) == Mode.VALIDATE


def test_an_unreachable_server_is_exit_2_and_an_unreachable_sidecar_exit_7(stack, tmp_path):
    url, proc = stack()
    r = kdtreectl(
        url, "check", "--server-url", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path), *FAST
    )
    assert r.returncode == 2 and "/v1/models gave no model" in r.stderr, r.stderr
    r = kdtreectl(f"http://127.0.0.1:{free_port()}", "check", "--out", str(tmp_path))
    assert r.returncode == 7 and "cannot reach the sidecar" in r.stderr and "Traceback" not in r.stderr
    assert "--url or KDTREE_SIDECAR_URL" in r.stderr  # where another address is given


def test_a_stack_that_is_not_ready_stops_early_with_exit_8(stack, tmp_path):
    url, proc = stack("--load-seconds", "30", wait=False)
    r = kdtreectl(url, "check", "--server-url", f"http://127.0.0.1:{proc.port}", "--out", str(tmp_path))
    assert r.returncode == 8 and "the stack is not ready (phase loading)" in r.stderr, r.stderr


def test_bad_input_is_exit_2():
    r = kdtreectl("http://127.0.0.1:9", "check", "--concurrency", "0,8")
    assert r.returncode == 2 and "levels from 1 to 256" in r.stderr


def test_compare_outputs_marks_failed_requests():
    from kdtreectl.check import Completion, Level

    def level(*completions):
        return Level(1, list(completions), 1.0, 1.0, 0.1, 0.1, None, 0)

    base = level(Completion(0, True, 0.1, 3, [1, 2, 3]), Completion(1, True, 0.1, 3, [4, 5, 6]))
    other = level(Completion(0, True, 0.1, 3, [1, 2, 3]), Completion(1, False, 0.1, error="HTTP 500"))
    rows = compare_outputs(base, other)
    assert rows[0]["identical"] and not rows[1]["identical"] and rows[1]["note"] == "a request failed"


@pytest.mark.sglang
def test_the_stand_in_and_the_requests_speak_sglangs_own_protocol(engine):
    """What the probe and kdtreectl check send is a valid SGLang 0.5.23 CompletionRequest, and what the stand-in
    answers parses as SGLang's CompletionResponse with the fields they read."""
    import httpx
    from sglang.srt.entrypoints.openai.protocol import CompletionRequest, CompletionResponse

    from sidecar.probe import verify_steps

    proc = engine("--tp-size", "1", "--heartbeat-s", "0.2")
    for request in (
        {"model": "stand-in/deepseek-v3", "prompt": "hi", "max_tokens": 32, "temperature": 0, "ignore_eos": True,
         "return_spec_tokens_details": True},  # the probe's
        {"model": "stand-in/deepseek-v3", "prompt": "hi", "max_tokens": 16, "temperature": 0,
         "return_token_ids": True, "return_spec_tokens_details": True},  # kdtreectl check's
    ):  # fmt: skip
        CompletionRequest.model_validate(request)
        body = httpx.post(f"http://127.0.0.1:{proc.port}/v1/completions", json=request, timeout=10).json()
        parsed = CompletionResponse.model_validate(body)
        assert parsed.sglext.spec_tokens_details.spec_verify_ct == verify_steps(body) > 0
        assert parsed.usage.completion_tokens == len(
            body["choices"][0].get("token_ids") or []
        ) or not request.get("return_token_ids")


def test_a_stack_in_off_is_refused_naming_validate(stack, tmp_path):
    """In off no verify reaches kdtree's kernel: the check refuses at once (USAGE) and sends no load."""
    url, proc = stack(mode=Mode.OFF)
    r, report = check(url, proc, tmp_path)
    assert r.returncode == USAGE, (r.stdout, r.stderr)
    line = r.stderr.strip().splitlines()[-1]
    assert "the server runs in off" in line and "kdtreectl mode validate" in line
    assert report is None
