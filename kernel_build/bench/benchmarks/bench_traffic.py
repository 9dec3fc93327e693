"""Traffic: the real SGLang server under a seeded serving mix, each speculative configuration held to the invariants.

Every server runs the tiny DeepSeek-V3-architecture model (kernel_build/bench/harness/tiny_model.py, 8 layers), as the
engine suite starts it (kdtree's launcher, `sglang.launch_server`, CUDA graphs for batch 1-4, eager above), with a KV
pool small enough that SGLang retracts requests at concurrency 16 and 32 (--pool-tokens) and a context limit that
some prompts reach (--context-len). The mix (kernel_build/bench/harness/traffic.py `make_mix`, --seed) runs at
concurrency 1, 4, 16 and 32 in turn: short, long, shared-prefix and context-limit prompts, greedy and sampled
(temperature 1, top-p, top-k) requests in one batch, logprobs on some, streamed and not, stops (a token id or a word
the reference emits mid-output), aborts through /abort_request and clients that hang up mid-stream.

DFLASH and DDTREE draft with the oracle's teacher (kernel_build/bench/harness/ddtree_oracle.py): the target untouched
(attention live) and a drafter that proposes the reference's greedy continuation, so most drafted tokens of a greedy
request are accepted and every accepted token's KV is read by the later steps; --no-teacher drafts with the dummy
drafter's weights instead (almost nothing accepted).

First the reference (no speculation: plain SGLang) answers every greedy request unstopped; its outputs place the
stops and fill the teacher's table. Then every server takes the mix (all at once by default; --sequential runs one
server at a time, for the throughput columns), then --samples sampled requests of one prompt (temperature 1, top-k 4,
3 tokens) for the distribution check. At the end, for every server:
- alive: the server process never restarted and answers /health; SGLang's own idle leak check (strict by default: a
  leaked KV slot or request slot raises in the scheduler) never fired, and sglang:num_used_tokens is 0 once idle;
- every request answered with what the API promises (traffic.check_outcomes);
- greedy requests equal the reference's tokens (up to their stop); a difference is kept only where the reference's
  top-2 logprob gap at that position is a near-tie (traffic.NEAR_TIE), else it fails;
- the sampled requests' first two tokens distributed as the reference's (Pearson's chi-square, p >= --alpha);
- kdtree's counters: in on every verify kdtree's (served_original 0, no fallback), in validate every compared call
  within tolerance, in off nothing of kdtree's; SGLang's /metrics counted every request that finished (an
  aborted one too; one whose client hung up may be left out).
Exit status 1 if any invariant fails in any server.

    bash kernel_build/bench/device_run.sh traffic                 # on the GPU machine, into $OUT/traffic.md + .json
    python3 kernel_build/bench/benchmarks/bench_traffic.py --configs none,ddtree-auto-on,dflash-on --sequential
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import re
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "kernel_build" / "bench" / "harness"))
from ddtree_oracle import ENV as ORACLE_RANKS  # noqa: E402  (this script's folder is on sys.path)
from ddtree_oracle import TEACHER_ENV, teacher_table  # noqa: E402
from real_server import NONE, RealServer, ServerSpec, unavailable  # noqa: E402
from source_id import checkout  # noqa: E402
from tiny_model import config, write_model  # noqa: E402
from traffic import (  # noqa: E402
    NEAR_TIE,
    Request,
    check_greedy,
    check_outcomes,
    chi2_homogeneity,
    make_mix,
    metrics,
    resolve_stops,
    run_phase,
    unstopped,
)

from kdtree.config import Mode  # noqa: E402

CONCURRENCY = (1, 4, 16, 32)
PHASE_REQUESTS = {1: 4, 4: 12, 16: 40, 32: 64}  # requests a phase, at each concurrency
REFERENCE = "none"
BLOCK = 8  # DFLASH and DDTREE: block 8 (7 drafted depths; DDTREE's tree of 16 nodes)
# name -> (algorithm, mode, env, extra arguments); DDTREE runs auto unless the name says fixed
CONFIGS = {
    REFERENCE: (NONE, Mode.OFF, {}, ()),
    **{
        f"{algo.lower()}{budget}-{mode.value}{sync}": (
            key, mode, {"KDTREE_DDTREE_BUDGET": budget.strip("-") or "auto"} if algo == "DDTREE" else {},
            ("--disable-overlap-schedule",) if sync else (),
        )
        for algo, key in (("DDTREE", f"DDTREE-B{BLOCK}"), ("DFLASH", f"DFLASH-B{BLOCK}"), ("NGRAM", "NGRAM"))
        for budget in (("-fixed", "") if algo == "DDTREE" else ("",))
        for mode in (Mode.ON, Mode.OFF, Mode.VALIDATE)
        for sync in ("", "-sync")
    },
}  # fmt: skip
DEFAULT_CONFIGS = (
    "none,ddtree-on,ddtree-off,ddtree-validate,ddtree-on-sync,ddtree-fixed-on,dflash-on,dflash-off,dflash-validate,"
    "dflash-on-sync,ngram-on,ngram-off"
)
LEAK = re.compile(
    r"memory leak detected|KV double free|use-after-free"
)  # SGLang's idle check (strict: raises)
TRACEBACK = "Traceback (most recent call last)"  # counted, not judged: a crash is judged by the process
RETRACT = "KV cache pool is full. Retract requests."
SAMPLE_PROMPT = (0, *range(100, 124))  # the distribution check's prompt: BOS and 24 words


def top2_margin(server: RealServer, r: Request, position: int) -> float:
    """The reference's gap between its two likeliest tokens at `position` of r's greedy output."""
    body = replace(unstopped(r), max_tokens=position + 1, logprobs=2).body(str(server.model_dir))
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    top = resp.json()["choices"][0]["logprobs"]["top_logprobs"][position]
    a, b = sorted(top.values(), reverse=True)[:2]
    return a - b


def sampled_requests(n: int, tag: str) -> list[Request]:
    return [
        Request(
            rid=f"{tag}-sample-{i}",
            kind="sampled",
            prompt=SAMPLE_PROMPT,
            max_tokens=3,
            temperature=1.0,
            top_k=4,
        )
        for i in range(n)
    ]


def drive(server: RealServer, mix: list[Request], samples: int, deadline: float) -> dict:
    """The mix's phases, then the samples: every outcome, and a row a phase (tokens/s, time to first token)."""
    model, outcomes, phases, start = str(server.model_dir), {}, [], 0
    try:
        before = metrics(server.url)
    except (
        httpx.HTTPError,
        ValueError,
    ):  # judged at the end (a server that cannot answer /metrics fails there)
        before = {}
    for c in CONCURRENCY:
        batch = mix[start : start + PHASE_REQUESTS[c]]
        start += PHASE_REQUESTS[c]
        if time.monotonic() > deadline:
            phases.append({"concurrency": c, "skipped": "past the time budget"})
            continue
        got = run_phase(server.url, model, batch, c)
        wall = got.pop(None)
        outcomes |= got
        tokens = sum(len(o.token_ids) for o in got.values())
        ttft = [o.ttft_s for o in got.values() if o.ttft_s is not None]
        accept = [o.accept for o in got.values() if o.accept]
        phases.append({"concurrency": c, "requests": len(batch), "tokens": tokens, "wall_s": wall,
                       "tokens_per_s": tokens / wall, "ttft_ms": 1e3 * statistics.median(ttft) if ttft else None,
                       "accept": statistics.mean(accept) if accept else None})  # fmt: skip
    sample = sampled_requests(samples, server.spec.name)
    got = run_phase(server.url, model, sample, 32) if samples else {None: 0}
    got.pop(None)
    return {"outcomes": outcomes, "phases": phases, "samples": got, "metrics_before": before}


def judge(server: RealServer, mix, run: dict, reference_tokens, reference: RealServer, ref_samples) -> dict:
    """The invariants of one server after its traffic (module docstring): a verdict and its evidence."""
    name, problems = server.spec.name, []
    alive = server.proc is not None and server.proc.poll() is None and server.starts == 1
    try:
        health = httpx.get(f"{server.url}/health", timeout=10).status_code
    except httpx.HTTPError as e:
        health = f"{type(e).__name__}"
    if not alive or health != 200:
        problems.append(
            f"not alive: process {'running' if alive else 'exited or restarted'}, /health {health}"
        )
    log = server.server_log()
    leaks = [m.group(0) for m in LEAK.finditer(log)]
    if leaks:
        problems.append(f"the log has {len(leaks)} of: {sorted(set(leaks))}")
    sent = [r for r in mix if r.rid in run["outcomes"]]
    problems += check_outcomes(sent, run["outcomes"])
    mismatches = check_greedy(sent, run["outcomes"], reference_tokens) if server is not reference else []
    by_rid = {r.rid: r for r in mix}
    ties = []
    for m in mismatches:
        try:
            m.margin = top2_margin(reference, by_rid[m.rid], m.position)
        except (
            httpx.HTTPError,
            KeyError,
            IndexError,
            ValueError,
        ):  # no gap to judge by: a failure, never a tie
            m.margin = float("inf")
        (ties if m.margin <= NEAR_TIE else problems).append(
            f"{m.rid}: greedy differs at token {m.position} (got {m.got[m.position : m.position + 3]}, reference "
            f"{m.want[m.position : m.position + 3]}), reference top-2 gap {m.margin:.4f}"
        )
    chi = None
    if run["samples"] and server is not reference:
        a = [tuple(o.token_ids[:2]) for o in run["samples"].values() if o.status == 200]
        b = [tuple(o.token_ids[:2]) for o in ref_samples.values() if o.status == 200]
        chi = chi2_homogeneity(a, b)
    evidence = {"retractions": log.count(RETRACT), "leak_lines": len(leaks), "tracebacks": log.count(TRACEBACK),
                "greedy_near_ties": ties,
                "greedy_compared": sum(1 for r in sent if r.greedy and r.rid in reference_tokens),
                "aborted_by_client": sum(o.aborted_by_client for o in run["outcomes"].values()),
                "chi2": chi}  # fmt: skip
    try:
        after = metrics(server.url)
        before = run["metrics_before"]
        evidence["num_used_tokens_idle"] = after.get("sglang:num_used_tokens")
        evidence["requests_counted"] = after.get("sglang:num_requests_total", 0) - before.get(
            "sglang:num_requests_total", 0
        )
        sent, hung_up = len(run["outcomes"]) + len(run["samples"]), evidence["aborted_by_client"]
        evidence["requests_sent"] = sent
        evidence["retracted_counted"] = after.get("sglang:num_retracted_requests_total", 0)
        if evidence["num_used_tokens_idle"]:
            problems.append(
                f"sglang:num_used_tokens {evidence['num_used_tokens_idle']:g} once idle (expected 0)"
            )
        # every request finished is counted, an aborted one too; one whose client hung up may not be
        if not sent - hung_up <= evidence["requests_counted"] <= sent:
            problems.append(f"sglang:num_requests_total counted {evidence['requests_counted']:g} requests; "
                            f"{sent} were sent, {hung_up} of them aborted by their client")  # fmt: skip
    except (httpx.HTTPError, ValueError) as e:
        problems.append(f"/metrics unreadable: {e}")
    if server.spec.algorithm != NONE:
        try:
            rec = server.record(0)
            evidence["kdtree"] = {"served_kdtree": rec.served_kdtree, "served_original": rec.served_original,
                                  "calls_compared": rec.parity.calls_compared, "fallbacks": dict(rec.fallbacks),
                                  "calls_over_tol": rec.parity.calls_over_tol}  # fmt: skip
            mode = server.spec.mode
            if mode == Mode.ON and (rec.served_original or rec.fallbacks or not rec.served_kdtree):
                problems.append(f"on: not every verify kdtree's: {evidence['kdtree']}")
            if mode == Mode.VALIDATE and (
                rec.parity.calls_over_tol or rec.parity.nan_inf or not rec.parity.calls_compared
            ):
                problems.append(f"validate: {evidence['kdtree']}, nan/inf {rec.parity.nan_inf}")
            if mode == Mode.OFF and (rec.served_kdtree or rec.parity.calls_compared):
                problems.append(f"off: kdtree ran: {evidence['kdtree']}")
        except (KeyError, ValueError) as e:
            problems.append(f"no rank record: {e}")
    return {
        "server": name,
        "ok": not problems,
        "problems": problems,
        "evidence": evidence,
        "phases": run["phases"],
    }


def markdown(rows: list[dict], head: list[str], alpha: float) -> str:
    lines = head + ["", "Invariants:", "",
        "| server | verdict | retractions (log / counter) | requests sent / counted | aborted by client | greedy compared "
        "(near-ties) | sampled: chi-square p | kdtree served / original / compared |",
        "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        e, k = r["evidence"], r["evidence"].get("kdtree") or {}
        chi = e.get("chi2")
        lines.append(
            f"| {r['server']} | {'pass' if r['ok'] else 'FAIL'} | {e['retractions']} / {e.get('retracted_counted', 0):g} "
            f"| {e.get('requests_sent', '?')} / {e.get('requests_counted', 0):g} | {e['aborted_by_client']} | "
            f"{e['greedy_compared']} ({len(e['greedy_near_ties'])}) | "
            + (f"{chi[2]:.3f} (chi2 {chi[0]:.1f}, {chi[1]} dof)" if chi else "-")
            + f" | {k.get('served_kdtree', '-')} / {k.get('served_original', '-')} / {k.get('calls_compared', '-')} |"
        )
    lines += ["", "Throughput under the mix (tokens/s: every token the phase's requests received over the phase's wall "
              "time; time to first token: median of its streamed requests):", "",
              "| server | " + " | ".join(f"c={c} tokens/s, TTFT ms, accept" for c in CONCURRENCY) + " |",
              "|---|" + "---|" * len(CONCURRENCY)]  # fmt: skip
    for r in rows:
        cells = []
        for p in r["phases"]:
            if "skipped" in p:
                cells.append(p["skipped"])
                continue
            ttft = f"{p['ttft_ms']:.0f}" if p["ttft_ms"] is not None else "-"
            acc = f"{p['accept']:.2f}" if p["accept"] else "-"
            cells.append(f"{p['tokens_per_s']:.0f}, {ttft}, {acc}")
        lines.append(f"| {r['server']} | " + " | ".join(cells) + " |")
    for r in rows:
        for p in r["problems"]:
            lines.append(f"\nFAIL {r['server']}: {p}")
        for t in r["evidence"]["greedy_near_ties"]:
            lines.append(f"\nnear-tie {r['server']}: {t}")
    lines.append(f"\nChi-square: the pair of the first two sampled tokens, pooled cells below 5 expected; fails below p "
                 f"{alpha:g}.")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the table here (and .json beside it)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"of: {', '.join(CONFIGS)}")
    ap.add_argument("--seed", type=int, default=77)
    ap.add_argument("--pool-tokens", type=int, default=12288, help="--max-total-tokens of every server")
    ap.add_argument("--context-len", type=int, default=4096, help="--context-length of every server")
    ap.add_argument(
        "--samples",
        type=int,
        default=800,
        help="sampled requests for the distribution check (power: its tests)",
    )
    ap.add_argument("--alpha", type=float, default=1e-3)
    ap.add_argument(
        "--no-teacher", action="store_true", help="DFLASH and DDTREE draft with their dummy weights"
    )
    ap.add_argument("--sequential", action="store_true", help="one server's traffic at a time (throughput)")
    ap.add_argument("--root", default="/tmp/kdtree-bench-traffic")
    ap.add_argument("--time-budget-s", type=float, default=480, help="start no phase after this many seconds")
    args = ap.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(
            f"bench_traffic: no configuration {unknown}; the configurations: {', '.join(CONFIGS)}",
            file=sys.stderr,
        )
        return 2
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    reason = unavailable()
    if reason:
        print(f"bench_traffic: {reason}", file=sys.stderr)
        return 2
    import torch

    t0 = time.monotonic()
    root = Path(args.root)
    model = write_model(root / "model-8l", layers=8, nextn=True)
    table_path = root / "teacher-table.json"
    table_path.unlink(missing_ok=True)
    servers = {}
    for n in names:
        algo, mode, env, extra = CONFIGS[n]
        env = dict(env)
        if algo.startswith(("DFLASH", "DDTREE")) and not args.no_teacher:
            env |= {ORACLE_RANKS: ",".join(["0"] * (BLOCK - 1)), TEACHER_ENV: str(table_path)}
        spec = ServerSpec(n, algo, mode, max_total_tokens=args.pool_tokens, env=env,
                          extra_args=("--context-length", str(args.context_len), "--enable-metrics", *extra))  # fmt: skip
        servers[n] = RealServer(spec, root / n, model).start()
    vocab = config()["vocab_size"]
    mix = make_mix(args.seed, sum(PHASE_REQUESTS.values()), context_len=args.context_len, vocab=vocab)
    props = torch.cuda.get_device_properties(0)
    head = [
        f"GPU: {props.name} ({props.multi_processor_count} SMs), {datetime.date.today()}, commit {checkout()}",
        f"Command: {' '.join(sys.argv)}",
        f"Mix: seed {args.seed}, {len(mix)} requests ({', '.join(f'{k} {sum(r.kind == k for r in mix)}' for k in ('short', 'long', 'shared', 'limit'))}; "
        f"{sum(r.greedy for r in mix)} greedy, {sum(bool(r.stop_token_ids or r.stop or r.stop_at is not None) for r in mix)} "
        f"with a stop, {sum(r.abort is not None for r in mix)} aborting, {sum(r.stream for r in mix)} streamed, "
        f"{sum(r.logprobs is not None for r in mix)} with logprobs) at concurrency "
        + ", ".join(f"{c} ({PHASE_REQUESTS[c]})" for c in CONCURRENCY),
        f"Servers: tiny DeepSeek-V3 architecture, 8 layers, random weights; pool {args.pool_tokens} tokens, context "
        f"{args.context_len}, CUDA graphs for batch 1-4; DFLASH/DDTREE block {BLOCK}, "
        + ("the teacher drafter (attention live)" if not args.no_teacher else "the dummy drafter")
        + ("; traffic one server at a time" if args.sequential else "; traffic to every server at once"),
    ]
    rows, failed = [], {}
    try:
        ready = concurrent.futures.ThreadPoolExecutor(len(servers))
        waits = {n: ready.submit(s.wait_ready, 540) for n, s in servers.items()}
        for n, w in waits.items():
            try:
                w.result()
            except (RuntimeError, TimeoutError) as e:
                failed[n] = str(e)[-2000:]
        print(
            f"{len(servers) - len(failed)} of {len(servers)} servers ready after {time.monotonic() - t0:.0f} s",
            flush=True,
        )
        if REFERENCE in failed:
            raise RuntimeError(f"the reference did not start: {failed[REFERENCE]}")
        reference = servers[REFERENCE]
        greedy = [unstopped(r) for r in mix if r.greedy]
        got = run_phase(reference.url, str(model), greedy, 16)
        got.pop(None)
        reference_tokens = {rid: o.token_ids for rid, o in got.items() if o.status == 200}
        if len(reference_tokens) != len(greedy):
            raise RuntimeError(
                f"the reference answered {len(reference_tokens)} of {len(greedy)} greedy requests"
            )
        seqs = [[r.prompt[-1], *reference_tokens[r.rid]] for r in greedy]
        table_path.write_text(json.dumps(teacher_table(seqs, vocab)))
        mix = resolve_stops(mix, reference_tokens)
        print(f"reference: {len(greedy)} greedy requests after {time.monotonic() - t0:.0f} s", flush=True)
        deadline = t0 + args.time_budget_s
        live = {n: s for n, s in servers.items() if n not in failed}
        runs: dict[str, dict] = {}
        lock = threading.Lock()

        def one(n):
            r = drive(live[n], mix, args.samples, deadline)
            with lock:
                runs[n] = r
            print(f"{n}: traffic done after {time.monotonic() - t0:.0f} s", flush=True)

        order = [REFERENCE] + [n for n in live if n != REFERENCE]
        if args.sequential:
            for n in order:
                one(n)
        else:
            one(REFERENCE)  # its samples are what the others are compared with
            with concurrent.futures.ThreadPoolExecutor(len(live)) as pool:
                for f in [pool.submit(one, n) for n in order[1:]]:
                    f.result()
        time.sleep(3.0)  # every server idle: SGLang's idle check has run, the heartbeats have caught up
        for n in order:
            row = judge(live[n], mix, runs[n], reference_tokens, reference, runs[REFERENCE]["samples"])
            row["evidence"]["chi2"] = row["evidence"]["chi2"] and list(row["evidence"]["chi2"])
            if row["evidence"]["chi2"] and row["evidence"]["chi2"][2] < args.alpha:
                row["ok"] = False
                row["problems"].append(f"sampled tokens' distribution differs from the reference's: p "
                                       f"{row['evidence']['chi2'][2]:.2e}")  # fmt: skip
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("server", "ok", "problems")}), flush=True)
    finally:
        for s in servers.values():
            s.stop(timeout=30)
    text = markdown(rows, head, args.alpha) + "".join(
        f"\n\nDid not start: {k}: {v}" for k, v in failed.items()
    )
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(
            json.dumps({"head": head, "rows": rows, "did_not_start": failed}, indent=1, default=str)
        )
    print(text)
    return 0 if rows and all(r["ok"] for r in rows) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
