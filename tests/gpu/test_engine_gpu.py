"""GPU: kdtree inside the real SGLang 0.5.23 server, started as production starts it, and the real sidecar in front.

Every server here is `python -m entrypoint.launch` running `python -m sglang.launch_server` (scheduler process,
CUDA-graph runner, tree speculation) on a tiny DeepSeek-V3-architecture model with random weights (8 layers, MLA
576/512, 8 heads: kernel_build/bench/harness/real_server.py, kernel_build/bench/harness/tiny_model.py), Triton attention, CUDA graphs captured for
batch sizes 1-4 (larger batches run eagerly), KDTREE_STATE_DIR of its own. They all start at once when the module
starts (a start takes about a minute; in parallel the starts overlap):

  NGRAM (8 draft tokens):             off (the reference), validate, on, standby
  NEXTN (topk 4, 3 steps, 8 tokens):   off (the reference), validate, on, standby
  NGRAM on fp8 KV caches (e4m3, e5m2): validate (it serves the original: the reference), on, per dtype
  DFLASH, block 8 and block 16 (SGLang's DFlash worker, a one-layer drafter with dummy weights: a causal-chain
  verify of 8 / 16 tokens): off, validate, on, standby, per block size

  DDTREE (kdtree's plugin: the block-8 drafter, a tree of 16 nodes verified as 17 tokens with its ancestor mask):
  off, validate, on, standby, under SGLang's overlap scheduler; on with graphs off, and on synchronously; its greedy
  outputs equal the DFlash chain's (both the target's greedy decode)

The DFLASH and DDTREE servers are tests of their own (`-k "dflash or ddtree"`: kernel_build/bench/device_run.sh
engine-spec), so that each device call stays under its limit; `engine-tests` runs the rest.

half with kdtree found by SGLang's plugin loader (its entry point), half through sitecustomize (the server image's
import hook) with the entry point switched off. Greedy decoding only: the comparisons need determinism (the sampled
verify's rejection sampling runs through a slow Python stand-in here: standins/torch_standins.py). Run: bash
kernel_build/bench/device_run.sh engine-tests, and engine-spec for DFLASH.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import pytest
from ddtree_oracle import continuation, expected_accepted, teacher_table
from real_server import CAPTURED_BS, NONE, RealServer, ServerSpec, divergence, unavailable
from tiny_model import prompt_of, write_model

from kdtree.config import Mode
from kdtreectl.check import first_divergence
from sidecar.rank_evidence import fp8_bound

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

DRAFT_TOKENS = 8
TEACHER_TABLE = "teacher-table.json"  # in the fleet's folder: the servers run in its subfolders
MAX_REL_L2 = 2e-2  # the gate's default (KDTREE_GATE_MAX_REL_ERR): what validate must show on real traffic
SPECS = {
    s.name: s
    for s in (
        ServerSpec("ngram-off", "NGRAM", Mode.OFF),
        ServerSpec("ngram-validate", "NGRAM", Mode.VALIDATE, own_library=True),
        ServerSpec("ngram-on", "NGRAM", Mode.ON, install="sitecustomize"),
        ServerSpec("ngram-standby", "NGRAM", Mode.STANDBY),
        ServerSpec("nextn-off", "NEXTN", Mode.OFF, install="sitecustomize"),
        ServerSpec("nextn-validate", "NEXTN", Mode.VALIDATE, install="sitecustomize"),
        ServerSpec("nextn-on", "NEXTN", Mode.ON),
        ServerSpec("nextn-standby", "NEXTN", Mode.STANDBY, install="sitecustomize"),
        ServerSpec("ngram-e4m3-validate", "NGRAM", Mode.VALIDATE, kv_cache_dtype="fp8_e4m3"),
        ServerSpec("ngram-e4m3-on", "NGRAM", Mode.ON, install="sitecustomize", kv_cache_dtype="fp8_e4m3"),
        ServerSpec(
            "ngram-e5m2-validate", "NGRAM", Mode.VALIDATE, install="sitecustomize", kv_cache_dtype="fp8_e5m2"
        ),
        ServerSpec("ngram-e5m2-on", "NGRAM", Mode.ON, kv_cache_dtype="fp8_e5m2"),
        *(
            spec
            for b in (8, 16)
            for spec in (
                ServerSpec(f"dflash-b{b}-off", f"DFLASH-B{b}", Mode.OFF),
                ServerSpec(f"dflash-b{b}-validate", f"DFLASH-B{b}", Mode.VALIDATE, install="sitecustomize"),
                ServerSpec(
                    f"dflash-b{b}-on",
                    f"DFLASH-B{b}",
                    Mode.ON,
                    install="sitecustomize" if b == 8 else "plugin",
                ),
                ServerSpec(f"dflash-b{b}-standby", f"DFLASH-B{b}", Mode.STANDBY),
            )
        ),
        ServerSpec("ddtree-b8-off", "DDTREE-B8", Mode.OFF),
        # DDTREE is registered by kdtree's plugin (SGLang's registry): the entry point installs in all of them
        ServerSpec("ddtree-b8-validate", "DDTREE-B8", Mode.VALIDATE),
        ServerSpec("ddtree-b8-on", "DDTREE-B8", Mode.ON),
        ServerSpec("ddtree-b8-standby", "DDTREE-B8", Mode.STANDBY),
        # CUDA graphs off: the draft's tree and the verify run eagerly at every batch size
        ServerSpec("ddtree-b8-eager-on", "DDTREE-B8", Mode.ON, extra_args=("--disable-cuda-graph",)),
        # the others run under SGLang's overlap scheduler (its default); this one synchronously
        ServerSpec("ddtree-b8-sync-on", "DDTREE-B8", Mode.ON, extra_args=("--disable-overlap-schedule",)),
        # the oracle (kernel_build/bench/harness/ddtree_oracle.py): a bigram target, scripted draft ranks; the whole
        # tree each step (KDTREE_DDTREE_BUDGET=fixed), so that the reference walk of that tree predicts acceptance
        ServerSpec(
            "ddtree-b8-oracle-on",
            "DDTREE-B8",
            Mode.ON,
            env={"DDTREE_ORACLE_RANKS": "0,0,0,0,0,0,0", "KDTREE_DDTREE_BUDGET": "fixed"},
        ),
        # auto (the default) in off: nothing of kdtree's runs, the whole tree is verified
        ServerSpec(
            "ddtree-b8-oracle-off", "DDTREE-B8", Mode.OFF, env={"DDTREE_ORACLE_RANKS": "0,0,1,0,0,2,0"}
        ),
        # auto in on: the cut each step (kdtree.ddtree.budget), every decode step watched for host synchronisations
        ServerSpec(
            "ddtree-b8-oracle-auto-on",
            "DDTREE-B8",
            Mode.ON,
            env={"DDTREE_ORACLE_RANKS": "0,0,0,0,0,0,0", "DDTREE_SYNC_REPORT": "sync-report.json"},
        ),
        # the same target under DFlash's chain, its draft head scripted (rank 0 at depths 1-3, not at 4: 3 a step)
        ServerSpec("dflash-b8-oracle-on", "DFLASH-B8", Mode.ON, env={"DDTREE_ORACLE_RANKS": "0,0,0,1,0,0,0"}),
        # and under DDTREE's auto with its chain arm forced every step it can run (the harness's DDTREE_FORCE_ARM)
        ServerSpec(
            "ddtree-b8-oracle-chain-on",
            "DDTREE-B8",
            Mode.ON,
            env={
                "DDTREE_ORACLE_RANKS": "0,0,0,1,0,0,0",
                "DDTREE_FORCE_ARM": "chain",
                "DDTREE_SYNC_REPORT": "sync-report.json",
            },
        ),
        # the teacher (ddtree_oracle.Teacher): the target untouched, attention live; the drafter proposes the
        # reference's greedy continuation from the table the live-attention test writes (TEACHER_TABLE, beside the
        # servers' folders), so most drafts are accepted and every accepted token's KV is read by later steps
        *(
            ServerSpec(f"{algo.lower()}-b8-teacher{budget}-{mode.value}", f"{algo}-B8", mode, env={
                "DDTREE_ORACLE_RANKS": "0,0,0,0,0,0,0", "DDTREE_ORACLE_TEACHER": f"../{TEACHER_TABLE}",
                **({"KDTREE_DDTREE_BUDGET": budget.strip("-") or "fixed"} if algo == "DDTREE" else {})})
            for algo, budget, mode in (
                ("DDTREE", "", Mode.ON), ("DDTREE", "", Mode.OFF), ("DDTREE", "-auto", Mode.ON),
                ("DDTREE", "-auto", Mode.OFF), ("DFLASH", "", Mode.ON),
            )
        ),
        # no speculation: plain SGLang, the reference the teacher's servers are held to
        ServerSpec("none-reference", NONE, Mode.OFF),
    )
}  # fmt: skip
ALGOS = [
    "ngram",
    "nextn",
    "dflash-b8",
    "dflash-b16",
    "ddtree-b8",
]  # the bf16 servers' algorithms, as their names spell them
# the bf16 servers with a reference (the oracle's target is a different model)
BF16 = [
    n
    for n, s in SPECS.items()
    if s.kv_cache_dtype == "auto" and "oracle" not in n and "teacher" not in n and s.algorithm != NONE
]
PROMPTS = [prompt_of(n, seed) for seed, n in enumerate((12, 40, 97, 180, 333, 64, 250, 21))]
CAPTURE_BEGIN = re.compile(r"Capture target verify CUDA graph begin")


class Fleet:
    """The servers the selected tests use, started together; `fleet[name]` waits for that one (its failure, once)."""

    def __init__(self, root: Path, names: set[str]):
        self.root = root
        self.model = write_model(root / "model-8l", layers=8, nextn=True)
        self.servers = {
            n: RealServer(s, root / n, self.model).start() for n, s in SPECS.items() if n in names
        }
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.servers))
        self._ready = {n: self._pool.submit(s.wait_ready) for n, s in self.servers.items()}
        self.started = time.monotonic()

    def __getitem__(self, name: str) -> RealServer:
        self._ready[name].result()  # re-raises the start's failure, with the server's output
        return self.servers[name]

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop(timeout=30)
        self._pool.shutdown(wait=False, cancel_futures=True)


def servers_used(items) -> set[str]:
    """The servers the selected tests of this module use (`-k nextn` starts the NEXTN ones only)."""
    names = set()
    for item in items:
        if item.module.__name__ != __name__:
            continue
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if "name" in params:
            names |= {params["name"], f"{SPECS[params['name']].algorithm.lower()}-off"}
        elif "algo" in params:
            names |= {f"{params['algo']}-{mode}" for mode in ("off", "validate", "on")}
        elif "servers" in params:
            names |= set(params["servers"])
        else:
            names.add("ngram-validate")  # the markers and the sidecar
    return names


@pytest.fixture(scope="module")
def fleet(request, tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    f = Fleet(tmp_path_factory.mktemp("engine"), servers_used(request.session.items))
    yield f
    f.stop()


def verify_counts(server: RealServer) -> tuple[int, int, int, dict]:
    """(served_kdtree, calls_compared, served_original, fallbacks) of the server's one rank, after a fresh heartbeat."""
    time.sleep(1.5)  # KDTREE_HEARTBEAT_S=1: the record has caught up with the requests just answered
    r = server.record(0)
    return r.served_kdtree, r.parity.calls_compared, r.served_original, dict(r.fallbacks)


def assert_same_tokens(got, want, prompts, server, reference, max_tokens):
    """Token-for-token equality; a difference names the request, the first diverging position and both servers'
    top-2 logprobs there (a near-tie is bf16 rounding order, a wide margin a wrong result)."""
    diff = divergence(got, want, server, reference, prompts, max_tokens)
    assert diff is None, f"{server.spec.name} against {reference.spec.name}: {diff}"


# ---- installation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", [n for n, s in SPECS.items() if s.algorithm != NONE]
)  # NONE: no launcher, no kdtree
def test_kdtree_installs_once_in_every_sglang_process(fleet, name):
    server = fleet[name]
    lines = server.install_lines()
    pids = [pid for _, pid, _, _ in lines]
    assert lines and len(pids) == len(set(pids)), f"an install line twice for one process: {lines}"
    via = "entry-point" if server.spec.install == "plugin" else "import-hook"
    assert {v for *_, v in lines} == {via}, lines
    assert {m for m, *_ in lines} == {server.spec.mode.value}
    rank = server.record(0)
    assert rank.pid in pids, (rank.pid, lines)
    if (
        via == "entry-point"
    ):  # load_plugins() runs in the launcher too (the import hook acts only where the backend is)
        assert server.process_record()["server_pid"] in pids, lines  # the sglang.launch_server process
    assert rank.installed and rank.override_layers == 1
    assert rank.mode == server.spec.mode.value and rank.tp_size == 1


# ---- validate and on, against the reference -------------------------------------------------------------------


@pytest.mark.parametrize("algo", ALGOS)
def test_validate_compares_every_verify_step_within_tolerance(fleet, algo):
    server = fleet[f"{algo}-validate"]
    before = verify_counts(server)
    for batch in (PROMPTS[:1], PROMPTS[:3], PROMPTS):  # captured sizes, then 8 > 4: eager
        server.token_ids(batch, max_tokens=24)
    served, compared, original, fallbacks = verify_counts(server)
    assert compared > before[1] + 10, f"calls_compared {before[1]} -> {compared}"
    assert served == 0 and fallbacks == {}, (served, fallbacks)
    p = server.record(0).parity
    assert p.nan_inf == 0 and p.calls_over_tol == 0 and p.max_rel_l2 <= MAX_REL_L2, p
    assert {"eager", "captured"} <= set(server.record(0).verify_inputs)


@pytest.mark.parametrize("algo", ALGOS)
def test_on_serves_every_verify_step_and_matches_off_token_for_token(fleet, algo):
    on, off = fleet[f"{algo}-on"], fleet[f"{algo}-off"]
    before = verify_counts(on)
    for batch in ([PROMPTS[0]], [PROMPTS[4]], PROMPTS[:3], PROMPTS):  # captured (1, 3), then eager (8)
        assert len(batch) <= max(CAPTURED_BS) or len(batch) == len(PROMPTS)
        assert_same_tokens(on.token_ids(batch, 32), off.token_ids(batch, 32), batch, on, off, 32)
    served, compared, original, fallbacks = verify_counts(on)
    assert served > before[0] + 10, f"served_kdtree {before[0]} -> {served}"
    assert original == 0 and fallbacks == {}, (original, fallbacks)
    off_rec = off.record(0)
    assert off_rec.served_kdtree == 0 and off_rec.parity.calls_compared == 0  # off runs nothing of kdtree's


@pytest.mark.parametrize(
    "servers",
    [
        ("ddtree-b8-off", "dflash-b8-off"),
        ("ddtree-b8-on", "dflash-b8-off"),
        ("ddtree-b8-eager-on", "dflash-b8-off"),
        ("ddtree-b8-sync-on", "dflash-b8-off"),
    ],
)
def test_ddtree_greedy_outputs_equal_dflash_chain(fleet, servers):
    """Lossless: DDTREE's greedy tokens (Triton's verify in off, kdtree's in on) equal those of SGLang's DFlash chain
    with the same drafter (greedy and lossless itself: the target's own greedy decode; kdtree's launcher serves only
    speculative servers), at captured and eager batch sizes. Dummy weights make near-ties: a divergence names the
    position and both servers' top-2 logprobs there."""
    ddtree, reference = fleet[servers[0]], fleet[servers[1]]
    for batch in ([PROMPTS[0]], PROMPTS[:3], PROMPTS):
        assert_same_tokens(
            ddtree.token_ids(batch, 32), reference.token_ids(batch, 32), batch, ddtree, reference, 32
        )


@pytest.mark.parametrize("servers", [("ddtree-b8-on", "dflash-b8-off")])
def test_ddtree_logprobs_are_the_emitted_tokens_logprobs(fleet, servers):
    """Logprob requests (SGLang's compute_spec_logprobs on the accepted path's rows): every emitted token has its
    logprob and top-2, equal to those SGLang's DFlash chain reports for the same greedy tokens, batch 1 and 3."""
    ddtree, reference = fleet[servers[0]], fleet[servers[1]]
    for batch in ([PROMPTS[0]], PROMPTS[:3]):
        got, want = (
            sorted(s.complete(batch, 24, logprobs=2)["choices"], key=lambda c: c["index"])
            for s in (ddtree, reference)
        )
        for g, w in zip(got, want, strict=True):
            assert g["token_ids"] == w["token_ids"]
            lg, lw = g["logprobs"]["token_logprobs"], w["logprobs"]["token_logprobs"]
            assert len(lg) == len(g["token_ids"]) and None not in lg, lg
            assert max(abs(a - b) for a, b in zip(lg, lw, strict=True)) < 0.05, (lg, lw)
            assert [len(t) for t in g["logprobs"]["top_logprobs"]] == [
                len(t) for t in w["logprobs"]["top_logprobs"]
            ]


@pytest.mark.parametrize("servers", [("ddtree-b8-oracle-on",), ("ddtree-b8-oracle-off",)])
def test_ddtree_oracle_accepts_what_the_reference_walk_predicts_and_emits_the_targets_greedy_tokens(
    fleet, servers
):
    """The oracle: a bigram target (the greedy token after x is perm(x)) and a drafter whose top-K holds the true
    token at scripted ranks. Every step builds the same tree; the reference heap and walk say how many drafted
    tokens a step accepts; the outputs must be the bigram's continuation exactly (lossless), at captured and eager
    batch sizes, with kdtree's verify (on) and Triton's (off). It measures the system, not a drafter; the zeroed
    attention output means the KV cache's contents do not reach these outputs."""
    server = fleet[servers[0]]
    ranks = [int(r) for r in server.spec.env["DDTREE_ORACLE_RANKS"].split(",")]
    accepted = expected_accepted(ranks, K=16, budget=16)
    assert accepted >= 4  # the scripts reach deep: a step accepts several drafted tokens
    prompts = [[11, 22, 100 + 37 * i] for i in range(8)]
    max_tokens = 33
    for batch in (prompts[:1], prompts[:3], prompts):  # captured (1, 3), then eager (8)
        streams, accept = server.stream(batch, max_tokens)
        for prompt, got in zip(batch, streams, strict=True):
            assert got.token_ids == continuation(prompt[-1], max_tokens, 8192), (prompt, got.token_ids)
        # SGLang's accept length over the request: at most accepted + 1 a step, less only where the last step
        # was cut at max_tokens
        assert all(accepted + 1 - 1.5 <= a <= accepted + 1 + 1e-6 for a in accept), (accepted, accept)
    if server.spec.mode is Mode.ON:
        served, _, original, fallbacks = verify_counts(server)
        assert served > 0 and original == 0 and fallbacks == {}, (served, original, fallbacks)


@pytest.mark.parametrize("servers", [("dflash-b8-oracle-on",)])
def test_the_dflash_oracle_chain_accepts_its_rank_0_run_and_emits_the_targets_greedy_tokens(fleet, servers):
    """The oracle under SGLang's own DFlash worker (the benchmark's chain, kernel_build/bench/harness/ddtree_oracle.py):
    its captured draft head drafts the true token where the script puts it at rank 0, so every step accepts the
    leading run of zeros (3 here) and the bonus; outputs are the bigram's continuation, served by kdtree. Captured
    batch sizes only: the script replaces the head inside the draft graph."""
    server = fleet[servers[0]]
    ranks = [int(r) for r in server.spec.env["DDTREE_ORACLE_RANKS"].split(",")]
    accepted = ranks.index(1)
    prompts = [[11, 22, 500 + 37 * i] for i in range(4)]
    max_tokens = 33
    for batch in (prompts[:1], prompts[:3], prompts):
        streams, accept = server.stream(batch, max_tokens)
        for prompt, got in zip(batch, streams, strict=True):
            assert got.token_ids == continuation(prompt[-1], max_tokens, 8192), (prompt, got.token_ids)
        # SGLang's DFlash worker counts the prefill's token into a request's accept length: max_tokens over the
        # ceil((max_tokens - 1) / (accepted + 1)) verify steps after it (4.125 for a run of 3, measured on the H200)
        top = max_tokens / math.ceil((max_tokens - 1) / (accepted + 1))
        assert all(accepted + 1 - 1.5 <= a <= top + 1e-6 for a in accept), (accepted, top, accept)
    served, _, original, fallbacks = verify_counts(server)
    assert served > 0 and original == 0 and fallbacks == {}, (served, original, fallbacks)


TEACHER_SERVERS = [n for n in SPECS if "-teacher" in n]
TEACHER_TOKENS = 48


def teacher_reference(fleet) -> dict[int, list[int]]:
    """The reference's greedy outputs of PROMPTS[:4] (each alone and the four as one batch: both, where a near-tie
    parts them) and the teacher's table from them, written once for every teacher server."""
    if getattr(fleet, "teacher", None) is None:
        reference = fleet["none-reference"]
        alone = [reference.token_ids([p], TEACHER_TOKENS)[0] for p in PROMPTS[:4]]
        batched = reference.token_ids(PROMPTS[:4], TEACHER_TOKENS)
        last = [
            int(p.split()[-1][1:]) + 4 for p in PROMPTS[:4]
        ]  # the prompt's last word's id (tiny_model: w<i> is i + 4)
        seqs = [[t, *out] for t, out in zip(last + last, alone + batched, strict=True)]
        (fleet.root / TEACHER_TABLE).write_text(json.dumps(teacher_table(seqs, 8192)))
        fleet.teacher = {1: alone, 4: batched}
    return fleet.teacher


@pytest.mark.parametrize("servers", [(n, "none-reference") for n in TEACHER_SERVERS])
def test_the_commit_with_attention_live_keeps_the_targets_greedy_tokens_and_most_drafts(fleet, servers):
    """The commit checked with attention live: the target untouched and the teacher drafting the reference's own
    continuation (ddtree_oracle.Teacher), so that a step accepts several drafted tokens and every accepted token's KV
    (the slots the commit kept and permuted) is read by every later step. Greedy outputs equal those of a server
    without speculation at batch 1 and 4 (captured graphs), and the mean accepted length is at least 4 tokens a step;
    DDTREE at a fixed budget and auto, kdtree on (every verify kdtree's) and off; DFLASH's chain beside them."""
    server, reference = fleet[servers[0]], fleet[servers[1]]
    want = teacher_reference(fleet)
    server.token_ids(PROMPTS[:1], 2)  # a step after the table was written: the server has read it
    for batch in (PROMPTS[:1], PROMPTS[1:2], PROMPTS[:4]):
        streams, accept = server.stream(batch, TEACHER_TOKENS)
        ref = want[4] if len(batch) == 4 else [want[1][PROMPTS.index(batch[0])]]
        assert_same_tokens([s.token_ids for s in streams], ref, batch, server, reference, TEACHER_TOKENS)
        assert accept and sum(accept) / len(accept) >= 4, (len(batch), accept)
    if server.spec.mode is Mode.ON:
        served, _, original, fallbacks = verify_counts(server)
        assert served > 0 and original == 0 and fallbacks == {}, (served, original, fallbacks)


@pytest.mark.parametrize("servers", [("ddtree-b8-oracle-chain-on", "dflash-b8-oracle-on")])
def test_ddtree_autos_chain_arm_is_dflashs_chain_step(fleet, servers):
    """auto's chain arm (kdtree.ddtree.worker.ChainVerifyRunner, DFlashWorkerV2's own step) forced on every step: the
    same accept lengths as the DFLASH server on the same script, request by request, the bigram's continuation, every
    verify kdtree's, and the rank record counting the chain's steps, each a replay of its captured graph."""
    chain, dflash = (fleet[n] for n in servers)
    prompts = [[11, 22, 500 + 37 * i] for i in range(4)]
    for batch in (
        prompts[:1],
        prompts[:3],
        prompts,
    ):  # captured sizes: the chain's runner has the same as the tree's
        got, got_accept = chain.stream(batch, 33)
        want, want_accept = dflash.stream(batch, 33)
        for prompt, g in zip(batch, got, strict=True):
            assert g.token_ids == continuation(prompt[-1], 33, 8192), (prompt, g.token_ids)
        assert got_accept == pytest.approx(want_accept), (got_accept, want_accept)
    served, _, original, fallbacks = verify_counts(chain)
    assert served > 0 and original == 0 and fallbacks == {}, (served, original, fallbacks)
    # (a tree step would have accepted more than DFLASH: the script's rank 1 at depth 4 is in the tree; the sync test
    # also runs this server, at an eager batch size where the chain does not run, so the record may hold tree steps)
    d = chain.record(0).ddtree_budget
    assert d is not None and d.steps_at.get("chain", 0) > 10, d
    assert d.chain_replays == d.steps_at["chain"], d  # every one from the chain's captured graph, none eager
    assert d.chain_fixed_ms is None or d.chain_fixed_ms > 0, d
    print(f"chain arm: {d.model_dump()}")


@pytest.mark.parametrize("servers", [("ddtree-b8-oracle-on",)])
@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20}])
def test_ddtree_sampled_requests_accept_and_emit_what_the_target_samples(fleet, servers, sampling):
    """Sampled requests take the sampling walk (one draw a node from SGLang's verify distribution). The oracle's
    target puts all its probability on the bigram's token (ddtree_oracle.HEAD_SCALE), so a lossless walk emits the
    bigram's continuation and accepts as deep as the greedy walk, at captured and eager batch sizes."""
    server = fleet[servers[0]]
    ranks = [int(r) for r in server.spec.env["DDTREE_ORACLE_RANKS"].split(",")]
    accepted = expected_accepted(ranks, K=16, budget=16)
    prompts = [[11, 22, 300 + 37 * i] for i in range(8)]
    for batch in (prompts[:1], prompts[:3], prompts):
        streams, accept = server.stream(batch, 33, **sampling)
        for prompt, got in zip(batch, streams, strict=True):
            assert got.token_ids == continuation(prompt[-1], 33, 8192), (sampling, prompt, got.token_ids)
        assert all(accepted + 1 - 1.5 <= a <= accepted + 1 + 1e-6 for a in accept), (
            sampling,
            accepted,
            accept,
        )


@pytest.mark.parametrize("servers", [("ddtree-b8-oracle-auto-on",)])
def test_ddtree_auto_budget_is_lossless_serves_its_cut_and_reports_its_choices(fleet, servers):
    """KDTREE_DDTREE_BUDGET=auto (the default) in on: each step verifies the tree's first b nodes, b among 3, 7, 15 and
    16 (the cap), kdtree's kernel computing only those tokens, or runs DFlash's chain step (the chain arm). Greedy
    and sampled outputs are the bigram's continuation at captured and eager batch sizes (lossless whatever it
    chooses), every verify is kdtree's, and the rank record shows the steps at each choice and the tokens verified."""
    server = fleet[servers[0]]
    prompts = [[11, 22, 700 + 37 * i] for i in range(8)]
    for sampling in ({}, {"temperature": 0.7, "top_p": 0.9}):
        for batch in (prompts[:1], prompts[:3], prompts):
            streams, accept = server.stream(batch, 33, **sampling)
            for prompt, got in zip(batch, streams, strict=True):
                assert got.token_ids == continuation(prompt[-1], 33, 8192), (sampling, prompt, got.token_ids)
            # at most the 7 drafted depths and the bonus a step; a chain step's accounting is DFlash's, which
            # counts the prefill's token in (33 tokens over 4 steps: 8.25, as the DFLASH oracle test says)
            assert all(1 <= a <= 33 / 4 + 1e-6 for a in accept), accept
    served, _, original, fallbacks = verify_counts(server)
    assert served > 0 and original == 0 and fallbacks == {}, (served, original, fallbacks)
    d = server.record(0).ddtree_budget
    assert d is not None, "no ddtree_budget in the rank record: auto did not start"
    assert d.budgets == [3, 7, 15, 16] and d.steps > 20, d
    assert set(d.steps_at) <= {"3", "7", "15", "16", "chain"}, d
    assert sum(d.steps_at.values()) == d.steps and d.request_steps >= d.steps, d
    assert 4 <= d.mean_verify_tokens <= 17, d
    assert d.fixed_ms is not None and d.fixed_ms > 0, d  # the policy timed steps: it chose, not only the cap
    print(f"auto budget: {d.model_dump()}")


@pytest.mark.parametrize("servers", [("ddtree-b8-oracle-auto-on",), ("ddtree-b8-oracle-chain-on",)])
def test_a_ddtree_decode_step_does_not_synchronise_with_the_host(fleet, servers):
    """Every decode step of DDTreeWorker (draft graph, tree, verify, walk, commit) under
    torch.cuda.set_sync_debug_mode("warn"), in the server process (kernel_build/bench/harness/ddtree_oracle.py
    keeps what torch reported): no host synchronisation, at captured and eager batch sizes, tree steps and auto's
    chain steps (DFlash's own; the second server forces them wherever they can run) alike. Syncs inside the torch stand-ins of SGLang's compiled kernels (the device's
    set-up: standins/torch_standins.py, e.g. the chain's sampled acceptance) are counted apart: the real kernels run
    on the device."""
    server = fleet[servers[0]]
    prompts = [[11, 22, 500 + 37 * i] for i in range(8)]
    for batch in (prompts[:1], prompts[:3], prompts):
        server.token_ids(batch, 24)
    report = json.loads((server.root / "sync-report.json").read_text())
    assert report["decode_steps"] > 10
    where = {f"{s['at']}: {s['message']}" for s in report["syncs"]}
    assert report["syncs"] == [], "\n".join(sorted(where))
    print(f"decode steps {report['decode_steps']}, syncs inside stand-ins {report['standin_syncs']}")


# ---- an fp8 KV cache ---------------------------------------------------------------------------------------------


# --kv-cache-dtype: the torch dtype of SGLang's MLA pool
FP8_POOLS = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@pytest.mark.parametrize("servers", [(f"ngram-{d[4:]}-validate", f"ngram-{d[4:]}-on") for d in FP8_POOLS])
def test_fp8_kv_cache_is_served_in_validate_and_on(fleet, servers):
    """--kv-cache-dtype fp8_e4m3 and fp8_e5m2: validate compares every verify step within the fp8 bound and on serves
    every one, neither falling back for the pool's dtype. The greedy outputs of on against validate (which serves
    SGLang's Triton kernel on the same fp8 cache: off's numerics) are reported, not asserted: kdtree reads the fp8
    prefix exactly where Triton casts q and P to fp8, so a sequence may legitimately part late; the report names the
    first position."""
    import torch

    from kdtree.verify import FP8_PARITY_RTOL

    validate, on = (fleet[n] for n in servers)
    kv_cache_dtype = validate.spec.kv_cache_dtype
    pool_dtype = FP8_POOLS[kv_cache_dtype]
    before = {n: verify_counts(fleet[n]) for n in servers}
    agreement = []
    for batch in ([PROMPTS[0]], PROMPTS[:3], PROMPTS):  # captured (1, 3), then eager (8)
        got, want = on.token_ids(batch, 32), validate.token_ids(batch, 32)
        for prompt, a, b in zip(batch, got, want, strict=True):
            at = first_divergence(a, b)
            agreement.append(
                {"batch": len(batch), "prompt_chars": len(prompt), "tokens": len(b), "first_difference": at}
            )
    served, compared, original, fallbacks = verify_counts(on)
    assert served > before[on.spec.name][0] + 10 and original == 0 and fallbacks == {}, (
        served,
        original,
        fallbacks,
    )
    served_v, compared_v, _, fallbacks_v = verify_counts(validate)
    assert compared_v > before[validate.spec.name][1] + 10 and served_v == 0 and fallbacks_v == {}, (
        compared_v,
        fallbacks_v,
    )
    for server in (validate, on):  # the pool kdtree read was SGLang's fp8 cache, in captured and eager steps
        pools = {k: d["kv_pool"][0] for k, d in server.record(0).verify_inputs.items()}
        assert {"eager", "captured"} <= set(pools) and set(pools.values()) == {pool_dtype}, (
            server.spec.name,
            pools,
        )
    p = validate.record(0).parity
    bound = max(MAX_REL_L2, FP8_PARITY_RTOL[getattr(torch, pool_dtype)])
    assert fp8_bound(validate.record(0)) == bound  # what the sidecar's gate reads off the record
    assert p.rtol == pytest.approx(bound)  # the record names the bound its calls were counted by
    assert p.nan_inf == 0 and p.calls_over_tol == 0 and p.max_rel_l2 <= bound, p
    same = sum(a["first_difference"] is None for a in agreement)
    report = {"kv_cache_dtype": kv_cache_dtype, "validate_max_rel_l2": p.max_rel_l2, "requests": len(agreement),
              "identical": same, "per_request": agreement}  # fmt: skip
    (Path(os.environ.get("OUT", fleet.root)) / f"fp8-agreement-{kv_cache_dtype}.json").write_text(
        json.dumps(report, indent=1)
    )
    parted = [a["first_difference"] for a in agreement if a["first_difference"] is not None]
    print(
        f"{kv_cache_dtype}: validate max rel L2 {p.max_rel_l2:.3e}; on vs validate: {same} of {len(agreement)} "
        f"identical; first differences {parted}"
    )


# ---- live flips inside the running server ----------------------------------------------------------------------

FLIPS = {  # from each live start through the other two live modes and back
    Mode.VALIDATE: (Mode.ON, Mode.STANDBY, Mode.VALIDATE),
    Mode.ON: (Mode.VALIDATE, Mode.STANDBY, Mode.ON),
    Mode.STANDBY: (Mode.ON, Mode.VALIDATE, Mode.STANDBY),
}


@pytest.mark.parametrize(
    "name",  # the servers that captured graphs (not ddtree-b8-eager-on)
    [n for n in BF16 if SPECS[n].mode is not Mode.OFF and "--disable-cuda-graph" not in SPECS[n].extra_args],
)
def test_live_flips_serve_every_mode_from_the_graphs_captured_at_start(fleet, name):
    server = fleet[name]
    reference = fleet[f"{server.spec.algorithm.lower()}-off"]
    batch = PROMPTS[1:3]  # batch 2: verify steps replay captured graphs
    want = reference.token_ids(batch, 24)
    captures = len(CAPTURE_BEGIN.findall(server.server_log()))
    assert captures == 1, f"{captures} target-verify captures in this start's log"
    for mode in FLIPS[server.spec.mode]:
        confirmed = server.switch(mode)
        before = verify_counts(server)
        got = server.token_ids(batch, 24)
        after = verify_counts(server)
        assert_same_tokens(got, want, batch, server, reference, 24)
        grew = {"on": after[0] - before[0], "validate": after[1] - before[1]}
        if mode is Mode.ON:
            assert grew["on"] > 0 and grew["validate"] == 0, (mode, before, after)
        elif mode is Mode.VALIDATE:
            assert grew["validate"] > 0 and grew["on"] == 0, (mode, before, after)
        else:
            assert grew == {"on": 0, "validate": 0}, (mode, before, after)
        assert after[3] == {}, f"fallbacks after the flip to {mode}: {after[3]}"
        assert confirmed < 5, f"the rank took {confirmed:.1f}s to confirm {mode}"
    assert len(CAPTURE_BEGIN.findall(server.server_log())) == captures  # no graph was captured again


# ---- the metadata kdtree receives in the real runner -----------------------------------------------------------


@pytest.mark.parametrize("algo", ["ngram", "nextn"])
def test_verify_metadata_in_the_real_runner_is_what_the_unit_tests_assume(fleet, algo):
    """The real runner's verify calls, as the rank record describes them (kdtree.verify.describe_call), against the
    contract that kdtree.kernel checks and kernel_build/bench/harness/sglang_fixture.py builds (test_hook_gpu checks the fixture
    against the same EXPECTED_* descriptions)."""
    from sglang_fixture import (
        EXPECTED_CAPTURED,
        EXPECTED_EAGER,
        EXPECTED_POOL,
        described_dtypes,
        expected_scaling,
    )

    server = fleet[f"{algo}-validate"]
    server.token_ids(PROMPTS, max_tokens=8)  # batch 8 > 4: eager verify calls, whichever tests ran before
    verify_counts(server)  # a fresh heartbeat
    seen = server.record(0).verify_inputs
    for kind, expected in (("eager", EXPECTED_EAGER), ("captured", EXPECTED_CAPTURED)):
        got = seen[kind]
        assert described_dtypes(got) == expected, f"{kind}: {got}"
        assert got["kv_pool"] == EXPECTED_POOL and got["page_size"] == 1, got
        assert got["heads"] == 8 and got["max_extend_len"] == DRAFT_TOKENS, got
        assert math.isclose(got["scaling"], expected_scaling(fleet.model), rel_tol=1e-6), got["scaling"]
        assert got["q"][1][-1] == 576 and got["k"][1][-2:] == [1, 576] and got["v"][1][-2:] == [1, 512], got
    eager = seen["eager"]
    # SGLang's FULL layout: n x (prefix + n) a request. Over the kv_indices buffer as the backend sized it (exact
    # where the batch carries the prefix sum; NEXTN's carries none, and the backend sizes both for max context)...
    n = DRAFT_TOKENS
    assert eager["custom_mask"][1] == n * eager["kv_indices"][1] + eager["batch"] * n * n, eager
    # ...and from the host-side prefix lengths where the batch has them (NGRAM)
    if "full_mask_numel" in eager:
        assert eager["custom_mask"][1] == eager["full_mask_numel"], eager
    assert seen["captured"]["custom_mask"][1] >= max(CAPTURED_BS) * DRAFT_TOKENS * DRAFT_TOKENS


# ---- the real sidecar in front ---------------------------------------------------------------------------------


def test_log_markers_the_sidecar_reads_are_the_ones_sglang_prints(fleet):
    from sidecar.server_log import LOG_MARKERS, latest_marker

    log = fleet["ngram-validate"].server_log()
    at = -1
    for name, pattern in LOG_MARKERS:
        m = re.compile(pattern).search(log, at + 1)
        assert m, f"marker {name} ({pattern!r}) is not in the real server's log"
        at = m.start()
    assert latest_marker(log).name == "fired_up"
    # The marker lines, for tests/data/sglang-0.5.23-startup.log (the CPU test of the list): into $OUT on the device.
    excerpt = [line for line in log.splitlines() if latest_marker(line)]
    (Path(os.environ.get("OUT", fleet.root)) / "sglang-0.5.23-startup.log").write_text(
        "\n".join(excerpt) + "\n"
    )


def test_sidecar_gates_flips_bakes_checks_and_rolls_back_on_the_real_server(fleet, tmp_path):
    """The sidecar, process control, against ngram-validate: /ready on a real completion with verify steps, the gate
    on real parity, `kdtreectl check --flip`, a live flip to on baked on real counters, then a restart flip with the
    kernel library gone: the launcher refuses, the sidecar rolls back, the server serves on again."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sidecar_harness import TOKEN, kdtreectl, make_settings, serve

    server = fleet["ngram-validate"]
    settings = make_settings(server.state_dir, server.port, expected_tp_size=1, heartbeat_stale_s=10.0,
                             probe_deadline_s=60.0, probe_ttl_s=0.0, ready_timeout_s=420.0, ready_poll_min_s=1.0,
                             ready_poll_max_s=3.0, bake_probes=2, bake_interval_s=1.0, restart_stop_timeout_s=30,
                             gate_min_calls=200, live_flip_timeout_s=30.0)  # fmt: skip
    import httpx

    with serve(settings, server) as url:
        ready = httpx.get(f"{url}/ready", timeout=90).json()
        assert ready["ready"] and ready["condition"] == "ready", ready
        status = httpx.get(f"{url}/status", timeout=90).json()
        assert status["probe"]["ok"] and status["probe"]["verify_steps"] > 0, status["probe"]
        assert status["log"]["latest_marker"]["name"] == "fired_up"

        check = kdtreectl(url, "check", "--flip", "--server-url", server.url, "--concurrency", "1,4",
                          "--prompts", "6", "--max-tokens", "32", "--out", str(tmp_path / "check"),
                          token=TOKEN, timeout=600)  # fmt: skip
        assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-2000:]
        report = json.loads((tmp_path / "check" / "report.json").read_text())
        assert report["passed"] and report["flip"]["transition"]["outcome"] == "succeeded", report
        # One request at a time, off and on decode the same batches: identical. At concurrency 4 the batches are
        # formed by arrival and can differ between the two runs, so the count is reported, not required.
        assert not [d for d in report["flip"]["differences"] if d["concurrency"] == 1], report["flip"]
        print(f"kdtreectl check --flip: identical {report['flip']['identical']}/{report['flip']['compared']}")

        before = server.record(0).served_kdtree
        flip = kdtreectl(url, "mode", "on", "--wait", "--timeout", "300", token=TOKEN, timeout=360)
        assert flip.returncode == 0 and "mode is now on (live" in flip.stdout, flip.stdout + flip.stderr
        assert server.record(0).served_kdtree > before  # the bake's probes were served by kdtree

        lib = server.library  # this server's own copy (KDTREE_KERNEL_LIB)
        lib.rename(lib.with_name("moved-away.so"))  # the next start finds no kernel library
        accepted = kdtreectl(url, "mode", "validate", "--restart", token=TOKEN)
        assert accepted.returncode == 0, accepted.stdout + accepted.stderr
        deadline = time.monotonic() + 300
        while (t := (httpx.get(f"{url}/status", timeout=90).json().get("active_transition") or {})).get(
            "step"
        ) != "rolling_back":
            assert time.monotonic() < deadline, f"the failed restart flip was not rolled back: {t}"
            time.sleep(1)
        lib.with_name("moved-away.so").rename(lib)  # the rollback's start finds it again
        assert "crashed while starting in mode validate" in (t.get("failure") or ""), t
        deadline = time.monotonic() + 420
        while not (
            done := [
                x for x in httpx.get(f"{url}/status", timeout=90).json()["transitions"] if x["id"] == t["id"]
            ]
        ):
            assert time.monotonic() < deadline, "the rollback did not finish"
            time.sleep(2)
        assert done[0]["outcome"] == "rolled_back", done[0]
        final = httpx.get(f"{url}/ready", timeout=90).json()
        assert final["ready"] and final["mode"] == "on", final
        assert server.record(0).mode == "on" and server.record(0).fallbacks == {}
        refused = "kdtree launcher: error: KDTREE_VERIFY=validate but the kdtree kernel library is missing"
        assert refused in server.server_log(), "the failed start's refusal is not in the server log"
