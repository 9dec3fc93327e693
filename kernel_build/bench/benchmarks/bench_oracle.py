"""Oracle benchmark: decode tokens/s of DFlash's chain and of DDTREE at fixed tree budgets, at a scripted acceptance.

Every server runs kdtree on, on the same tiny DeepSeek-V3-architecture model (61 layers by default) turned into the
oracle's bigram target, with a drafter whose acceptance is scripted by a rank profile
(kernel_build/bench/harness/ddtree_oracle.py): at every drafted depth the true token sits at rank r with the profile's
probability, drawn on the device by a hash of the token (so every server meets the same draw at the same token of
the same prompt: the rows of a prompt are compared on the same luck, and its rounds repeat it; a step observes each
token's draw once, as a fresh draw a step would be), and the drafter's log-probs are the profile's. DFLASH-B16 drafts its
rank-0 tokens as a chain of 15; DDTREE-B16-T<n> builds the best tree of n nodes from the same block. So this measures
the system (the tree, the verify of its n + 1 tokens, the walk, the commit, the scheduler) at a known acceptance, not
a drafter: the accept lengths it reports are the profile's, and the expected ones are printed beside them.

The profiles are ddtree_oracle.PROFILES: "paper" (a chain accepts 5.9 drafted tokens a step, the best tree of 256
nodes 9.1: the mean acceptance lengths the DDTree paper reports for DFlash and DDTree) and "pessimistic" (a chain
accepts 1.5). One server per algorithm serves both: the profile file is rewritten between rows and each server reads
it again on its next step (the first round of a row is not timed).

For each prompt length, batch and profile: the batch's prompts once into every server's prefix cache, one untimed
round, then --repeats timed rounds interleaved over the servers (chain, T16, T32, ...), each decoding --max-tokens
tokens per request (ignore_eos, greedy, streamed). Columns: decode tokens/s (median; min-max), the ratio to the
chain's median, whether the row beats or trails the chain beyond noise (its slowest round above the chain's fastest,
or its fastest below the chain's slowest: the two servers' rounds apart; with 2 rounds each, two servers of equal
speed come apart so 1 time in 3), the accept length (tokens a step, bonus included) measured and expected (under
auto: the cap's), the tokens verified a request (under auto: the mean of the budget + 1 it chose, from the rank record), and a
step's wall time (the accept length over a request's share of the median round's tokens/s). Under auto the .json
also keeps, a row, the steps at each budget and the policy's estimates (F, expected acceptance a budget).

`DDTREE-...-AUTO` runs kdtree's auto budget (KDTREE_DDTREE_BUDGET=auto, kdtree/ddtree/budget.py) with that key's
budget as the cap; every other DDTREE row runs KDTREE_DDTREE_BUDGET=fixed, its whole tree each step.

    bash kernel_build/bench/device_run.sh oracle                    # on the GPU machine, into $OUT/oracle.md + .json
    python3 kernel_build/bench/benchmarks/bench_oracle.py --out oracle.md --prompts 2048 --batches 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "kernel_build" / "bench" / "harness"))
from bench_engine import beyond_noise, timed_round, write  # noqa: E402  (this script's folder is on sys.path)
from ddtree_oracle import (  # noqa: E402
    HOST_ENV,
    PROFILE_ENV,
    PROFILES,
    expected_chain_accepted,
    expected_tree_accepted,
    write_profile,
)
from real_server import (  # noqa: E402
    AUTO,
    DFLASH_BLOCK,
    SPECULATIVE,
    RealServer,
    ServerSpec,
    server_env,
    server_key,
    unavailable,
)
from source_id import checkout  # noqa: E402
from tiny_model import config, prompt_of, write_model  # noqa: E402

from kdtree.config import Mode  # noqa: E402
from kdtree.state.process_record import START_MARK  # noqa: E402
from sidecar.server_log import crash_excerpt  # noqa: E402

CHAIN = "DFLASH-B16"
HEARTBEAT_S = 0.5  # the servers' KDTREE_HEARTBEAT_S: a row's auto choices are read from rank 0's record
DEFAULT_ALGORITHMS = (
    f"{CHAIN},DDTREE-B16-T16,DDTREE-B16,DDTREE-B16-T64,DDTREE-B16-T128,DDTREE-B16{AUTO},DDTREE-B16-T128{AUTO}"
)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def tree_budget(algo: str) -> int | None:
    """The tree's node budget of a DDTREE algorithm key (N - 1; under AUTO the cap), None for a chain."""
    if not algo.startswith("DDTREE"):
        return None
    args = SPECULATIVE[server_key(algo)]
    return int(args[args.index("--speculative-num-draft-tokens") + 1]) - 1


def expected_accept_length(algo: str, profile: tuple[float, ...]) -> float:
    """Tokens a step (the bonus included) the profile gives this algorithm on average."""
    L = DFLASH_BLOCK[server_key(algo)] - 1
    budget = tree_budget(algo)
    if budget is None:
        return 1 + expected_chain_accepted(profile, L)
    return 1 + expected_tree_accepted(profile, budget, budget, L)  # K = budget, as the worker takes it


def measure(
    servers: dict[str, RealServer], prompts: list[str], repeats: int, max_tokens: int
) -> dict[str, list]:
    for s in servers.values():  # the prefix cache, and the profile read again: not timed
        s.complete(prompts, 2)
        timed_round(s, prompts, max_tokens)
    rounds: dict[str, list] = {a: [] for a in servers}
    time.sleep(2 * HEARTBEAT_S)  # the records are the ranks' as of now
    before = {a: s.record(0).ddtree_budget for a, s in servers.items()}
    for _ in range(repeats):  # interleaved, so that a slow spell of the machine falls on every server
        for algo, s in servers.items():
            r = timed_round(s, prompts, max_tokens)
            r.pop("token_ids")
            rounds[algo].append(r)
    time.sleep(2 * HEARTBEAT_S)
    for algo, s in servers.items():  # auto: what it chose over the timed rounds
        rounds[algo][0]["auto"] = auto_choices(before[algo], s.record(0).ddtree_budget)
    return rounds


def exited_since(live: dict, starts: dict[str, int], wait_s: float = 10.0) -> dict[str, str]:
    """The servers of `live` that exited since each had started starts[algo] times (their orchestrator starts them
    again), each with the last line of its crash excerpt (the sidecar's `crash_excerpt`) from the launcher's log of
    the run that died: a row's own error is only the client's side ("Server disconnected", then "Connection refused"
    while the server restarts), which names neither the server nor the cause. A server seen by the client as gone may
    still be in its launcher's last seconds (the output's drain): up to wait_s for one to be seen exited."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [
            a for a, s in live.items()
            if s.starts > starts[a] or (s.proc is not None and s.proc.poll() is not None)
        ]  # fmt: skip
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    out = {}
    for algo in dead:
        lines = live[algo].server_log().splitlines()
        marks = [i for i, line in enumerate(lines) if line.startswith(START_MARK)]
        if len(marks) > starts[algo]:  # the log of the run that died, not its restart's
            lines = lines[: marks[starts[algo]]]
        excerpt = crash_excerpt("\n".join(lines))
        out[algo] = (
            f"exited during the run; its log's last error: {excerpt[-1][:300] if excerpt else '(none)'}"
        )
    return out


def auto_choices(before, after) -> dict | None:
    """What DDTREE's auto budget did between two of rank 0's records (None without it): the tokens it verified a
    request, the steps at each budget, and the policy's estimates at the end (F, expected acceptance a budget)."""
    if before is None or after is None or after.request_steps <= before.request_steps:
        return None
    steps = {b: n - before.steps_at.get(b, 0) for b, n in after.steps_at.items()}
    return {
        "verified_tokens": (after.live_tokens - before.live_tokens)
        / (after.request_steps - before.request_steps),
        "steps_at": {b: n for b, n in steps.items() if n},
        "fixed_ms": after.fixed_ms,
        "chain_fixed_ms": after.chain_fixed_ms,
        "expected_accepted": after.expected_accepted,
    }


def rows_of(profile_name, plen, batch, rounds: dict[str, list], layers: int) -> list[dict]:
    profile = PROFILES[profile_name]
    chain = [x["decode_tokens_per_s"] for x in rounds.get(CHAIN, [])]
    out = []
    for algo, rs in rounds.items():
        tps = [x["decode_tokens_per_s"] for x in rs]
        r = {"layers": layers, "profile": profile_name, "prompt": plen, "batch": batch, "algorithm": algo,
             "budget": tree_budget(algo), "tokens_per_s": tps, "median": statistics.median(tps),
             "accept_length": statistics.mean(x["accept_length"] for x in rs),
             "expected_accept_length": expected_accept_length(algo, profile),
             "verified_tokens": (rs[0].get("auto") or {}).get("verified_tokens", (tree_budget(algo) or 15) + 1),
             "auto": rs[0].get("auto"), "chunks": [x.get("chunks") for x in rs]}  # fmt: skip
        # a step's wall time: a request's tokens a step over its tokens a second (the batch's, of the median round)
        r["step_ms"] = 1e3 * r["accept_length"] * batch / r["median"]
        if chain:
            r["vs_chain"] = r["median"] / statistics.median(chain)
            r["beyond_noise"] = beyond_noise(tps, chain)
        out.append(r)
    return out


def markdown(rows: list[dict], head: list[str]) -> str:
    lines = head + [
        "",
        "| profile | prompt | batch | algorithm | decode tokens/s (median; min-max) | / chain | vs chain beyond noise "
        "| accept length (measured / expected) | tokens verified a request | step (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tps = r["tokens_per_s"]
        lines.append(
            f"| {r['profile']} | {r['prompt']} | {r['batch']} | {r['algorithm']} | {r['median']:.1f}; "
            f"{min(tps):.1f}-{max(tps):.1f} | {r.get('vs_chain', float('nan')):.2f}x | "
            f"{r.get('beyond_noise', '-')} | {r['accept_length']:.2f} / {r['expected_accept_length']:.2f} | "
            f"{r['verified_tokens']:.1f} | {r['step_ms']:.2f} |"
        )
    return "\n".join(lines)


def host_report_caveat() -> str | None:
    """The table's warning when the servers ran with the host report: its cProfile window (each server's decode steps
    80-140) falls in the timed rounds and slows them."""
    if not os.environ.get(HOST_ENV):
        return None
    return (
        f"{HOST_ENV} was set: each server's host report profiled some of the timed rounds' steps under cProfile, "
        "which slows them; compare tokens/s from a run without it"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the table here (and .json beside it)")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument(
        "--algorithms", default=DEFAULT_ALGORITHMS, help=f"keys of real_server.SPECULATIVE, {CHAIN} first"
    )
    ap.add_argument(
        "--profiles", default=",".join(PROFILES), help=f"names in ddtree_oracle.PROFILES: {list(PROFILES)}"
    )
    ap.add_argument("--prompts", type=_ints, default=[2048, 32768], help="prompt lengths in tokens")
    ap.add_argument("--batches", type=_ints, default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--root", default="/tmp/kdtree-bench-oracle", help="model folders and server state")
    ap.add_argument(
        "--time-budget-s", type=float, default=None, help="start no new row after this many seconds"
    )
    args = ap.parse_args()
    algos = [a.strip().upper() for a in args.algorithms.split(",") if a.strip()]
    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    wrong = [
        a
        for a in algos
        if DFLASH_BLOCK.get(server_key(a)) != 16 or (a.endswith(AUTO) and not a.startswith("DDTREE"))
    ] + [p for p in profiles if p not in PROFILES]
    if wrong:
        print(f"bench_oracle: unknown {wrong}: algorithms are DFlash-drafted keys of block 16 of real_server.SPECULATIVE "
              f"({[a for a, b in DFLASH_BLOCK.items() if b == 16]}), profiles {list(PROFILES)}", file=sys.stderr)  # fmt: skip
        return 2
    reason = unavailable()
    if reason:
        print(f"bench_oracle: {reason}", file=sys.stderr)
        return 2
    import torch

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    profile_file = root / "profile"
    write_profile(profile_file, PROFILES[profiles[0]])
    tokens = max(args.batches) * (max(args.prompts) + args.max_tokens + 300) + 4096
    model = write_model(root / f"model-{args.layers}l", layers=args.layers, nextn=True)
    servers: dict[str, RealServer] = {}
    for algo in algos:
        # --sleep-on-idle: the servers not being measured must not busy-poll the CPUs the measured one needs;
        # mem_fraction 0.85: every server holds a pool of a batch of the longest prompts on the one GPU
        spec = ServerSpec(f"oracle-{algo.lower()}", server_key(algo), Mode.ON, layers=args.layers,
                          max_total_tokens=tokens, extra_args=("--sleep-on-idle",), mem_fraction=0.85,
                          env={PROFILE_ENV: str(profile_file), "KDTREE_HEARTBEAT_S": str(HEARTBEAT_S),
                               **server_env(algo)})  # fmt: skip
        servers[algo] = RealServer(spec, root / spec.name, model).start()
    props = torch.cuda.get_device_properties(0)
    cfg = config(layers=args.layers)
    head = [
        f"GPU: {props.name} ({props.multi_processor_count} SMs), {datetime.date.today()}, commit {checkout()}",
        f"Command: {' '.join(sys.argv)}",
        f"Model: the oracle's bigram target on a tiny DeepSeek-V3 architecture, {args.layers} layers, hidden "
        f"{cfg['hidden_size']}, {cfg['num_attention_heads']} heads, MLA 512 + 64 (its attention runs at full cost, "
        "its output does not reach the logits); a one-layer DFlash drafter (dummy weights) whose candidates the "
        "profile scripts. An oracle drafter measures the system, not a drafter.",
        "Profiles (P(true token at rank r), every depth, drawn by the token: the same draws for every server): "
        + "; ".join(f"{n} {PROFILES[n]}" for n in profiles),
        f"Server: tp 1, Triton attention, kdtree on, CUDA graphs for batch 1-4, greedy, ignore_eos, {args.max_tokens} "
        f"tokens per request, {args.repeats} timed rounds per server (interleaved) after one untimed, prompt in the "
        "prefix cache, --sleep-on-idle; decode tokens/s from the streamed chunks (after each request's first token)",
    ]
    caveat = host_report_caveat()
    if caveat is not None:
        head.append(caveat)
    t0 = time.monotonic()
    failed: dict[str, str] = {}
    rows: list[dict] = []
    try:
        for s in servers.values():
            try:
                s.wait_ready(timeout=540)
            except (RuntimeError, TimeoutError) as e:
                failed[s.spec.name] = str(e).splitlines()[0]
        live = {a: s for a, s in servers.items() if s.spec.name not in failed}
        print(f"{len(live)} servers ready after {time.monotonic() - t0:.0f} s", flush=True)
        for plen in args.prompts:  # profiles innermost: the second profile's prompts are in the prefix cache
            for batch in args.batches:
                for name in profiles:
                    write_profile(profile_file, PROFILES[name])
                    where = f"profile {name}, prompt {plen}, batch {batch}"
                    if args.time_budget_s and time.monotonic() - t0 > args.time_budget_s:
                        failed[where] = f"not run: past --time-budget-s {args.time_budget_s:g}"
                        continue
                    prompts = [prompt_of(plen, seed=1000 * plen + i) for i in range(batch)]
                    starts = {a: s.starts for a, s in live.items()}
                    try:
                        rounds = measure(live, prompts, args.repeats, args.max_tokens)
                    except (RuntimeError, OSError, KeyError, httpx.HTTPError) as e:  # a server crashed
                        failed[where] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                        for algo, why in exited_since(live, starts).items():  # the rest go on without it
                            dead = live.pop(algo)
                            dead.stop(timeout=30)  # its restart would take memory and time from the others
                            failed[dead.spec.name] = f"{why} ({where})"
                        continue
                    new = rows_of(name, plen, batch, rounds, args.layers)
                    rows += new
                    for r in new:
                        print(json.dumps({k: v for k, v in r.items() if k != "chunks"}), flush=True)
                    # row by row: a run cut short keeps its table
                    write(args.out, rows, failed, head, markdown)
        for s in live.values():
            rec = s.record(0)
            print(f"{s.spec.name}: served_kdtree {rec.served_kdtree}, served_original {rec.served_original}, "
                  f"fallbacks {rec.fallbacks}, auto budget {rec.ddtree_budget}", flush=True)  # fmt: skip
    finally:
        for s in servers.values():
            s.stop(timeout=30)
    print(write(args.out, rows, failed, head, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
