"""`kdtreectl check`: prove on the user's own stack that tree verify runs through kdtree, whether `on` changes
what the model says, and what it gains, in one command and one report.

Preflight through the sidecar (/status: ready, every rank installed); a deterministic built-in prompt set, sent
as greedy completions at each concurrency level to the server (tokens/s, p50/p99 latency, accept length from
SGLang's speculative-decoding details); the rank records before and after each level, for the verify calls
kdtree served or compared on every rank (none: the check fails and names the fallback reasons that grew).
With --flip: the same load in the current mode, a gated flip to `on` through the sidecar, the load again, the
completions compared token by token, and back to the starting mode unless --stay.
Output: progress and a table on the terminal, report.json and report.md in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kdtree.config import Mode
from kdtree.state.atomic import json_safe
from kdtree.state.rank_records import RankView, work_between, written_since
from sidecar.api import StatusDocument
from sidecar.vocabulary import Outcome

from .client import SidecarClient, Unreachable, criterion_line, short
from .exit_codes import BUSY, CRASHED, FAILED, NOT_READY, OK, UNREACHABLE, USAGE, listing, readiness
from .settings import CtlSettings, url_flag


class ServerUnreachable(Exception):
    """The SGLang server (--server-url) gave no usable answer."""


# ---- the built-in prompt set (no download): short instructions, mid-size tasks, and one long document -------

_PASSAGE = (
    "The lighthouse keeper kept a log of every ship that passed the point: its name, its flag, the hour, the "
    "state of the sea and the colour of the sky. Over forty years the log grew to sixty volumes. Storms came in "
    "from the west in autumn and from the north in late winter; fog came in spring, thick enough that the horn "
    "sounded for days. The keeper noted which captains answered the horn and which did not, which ships came "
    "back every year and which were never seen again, and how the harbour changed as the fishing fleet shrank "
    "and the ferries grew. "
)
_LONG = (
    "Read the following record carefully, then answer the question at the end.\n\n"
    + "".join(f"Volume {i + 1}. " + _PASSAGE for i in range(40))
    + "\nQuestion: in one paragraph, what does this record say changed in the harbour over the years, and why "
    "might the keeper have noted which captains answered the horn?\nAnswer:"
)
BUILTIN_PROMPTS = [
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.\n",
    "Explain in three sentences why the sky is blue.",
    "List the first ten prime numbers, separated by commas:",
    "Translate into French: 'The train to the coast leaves at seven in the morning.'",
    "Summarize the plot of a heist story in which nothing goes to plan, in under 100 words.",
    "def quicksort(xs):\n    ",
    "Q: A farmer has 17 sheep and all but 9 run away. How many are left?\nA: Let's think step by step.",
    _LONG,
    "Write a haiku about speculative decoding.",
    "Give three tips for writing clear error messages in command-line tools.",
    "Continue the sequence and explain the rule: 2, 6, 12, 20, 30,",
]


def prompts(n: int) -> list[str]:
    """The first n prompts of the built-in set (it repeats beyond its length): the same n gives the same set."""
    return [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(n)]


# ---- load --------------------------------------------------------------------------------------------------


@dataclass
class Completion:
    prompt: int
    ok: bool
    latency_s: float
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    accept_length: float | None = None
    error: str | None = None


@dataclass
class Level:
    concurrency: int
    completions: list[Completion]
    wall_s: float
    tokens_per_s: float
    p50_s: float | None
    p99_s: float | None
    accept_length: float | None
    failed: int


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def complete(
    client: httpx.AsyncClient, model: str, index: int, prompt: str, max_tokens: int
) -> Completion:
    """One greedy completion with SGLang's token ids and speculative-decoding details."""
    request = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "return_spec_tokens_details": True,
    }
    start = time.monotonic()
    try:
        resp = await client.post("/v1/completions", json=request)
        body = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as e:
        return Completion(index, False, time.monotonic() - start, error=f"{type(e).__name__}: {e}"[:300])
    latency = time.monotonic() - start
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
        return Completion(index, False, latency, error=f"HTTP {resp.status_code}: {resp.text[:200]}")
    choice = body["choices"][0]
    usage = body.get("usage") or {}
    details = (body.get("sglext") or {}).get("spec_tokens_details")
    details = details[0] if isinstance(details, list) and details else details
    accept = details.get("spec_accept_length") if isinstance(details, dict) else None
    ids = choice.get("token_ids") or []
    return Completion(
        index,
        True,
        latency,
        tokens=int(usage.get("completion_tokens") or len(ids)),
        token_ids=[int(t) for t in ids],
        accept_length=float(accept) if isinstance(accept, int | float) else None,
    )


async def run_level(
    client: httpx.AsyncClient, model: str, texts: list[str], concurrency: int, max_tokens: int
) -> Level:
    """Every prompt once, `concurrency` requests in flight."""
    queue = list(enumerate(texts))
    done: list[Completion] = []

    async def worker():
        while queue:
            i, text = queue.pop(0)
            done.append(await complete(client, model, i, text, max_tokens))

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.monotonic() - start
    ok = [c for c in done if c.ok]
    accepts = [c.accept_length for c in ok if c.accept_length is not None]
    return Level(
        concurrency=concurrency,
        completions=sorted(done, key=lambda c: c.prompt),
        wall_s=wall,
        tokens_per_s=sum(c.tokens for c in ok) / wall if wall > 0 else 0.0,
        p50_s=_percentile([c.latency_s for c in ok], 0.5),
        p99_s=_percentile([c.latency_s for c in ok], 0.99),
        accept_length=statistics.fmean(accepts) if accepts else None,
        failed=len(done) - len(ok),
    )


# ---- evidence from the rank records ------------------------------------------------------------------------


def rank_counts(status: StatusDocument) -> dict[int, RankView]:
    """Per tensor-parallel rank: its record (and whether it is stale) in a /status document."""
    return {v.record.tp_rank: v for v in status.ranks}


def verify_evidence(before: dict[int, RankView], after: dict[int, RankView], expected: int) -> list[dict]:
    """Per rank, what kdtree did between two /status reads (kdtree.state.rank_records.work_between, as the
    sidecar's bake judges it): served (on) and compared (validate) verify calls, and the fallback reasons that
    grew. `ok` when kdtree served or compared at least one call."""
    rows = []
    for rank in range(max(expected, len(after))):
        a, b = before.get(rank), after.get(rank)
        work = work_between(a.record, b.record) if a is not None and b is not None else None
        if work is None or work.restarted:
            rows.append({"rank": rank, "ok": False, "served": 0, "compared": 0, "fallbacks_grew": {},
                         "problem": "no record" if b is None else "the rank restarted during the load"})  # fmt: skip
            continue
        rows.append({"rank": rank, "ok": work.served + work.compared > 0, "served": work.served,
                     "compared": work.compared, "fallbacks_grew": work.fallbacks_grew, "problem": None})  # fmt: skip
    return rows


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first token position where two completions differ (a shorter one differs where it ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(base: Level, other: Level) -> list[dict]:
    by_prompt = {c.prompt: c for c in other.completions}
    rows = []
    for c in base.completions:
        d = by_prompt.get(c.prompt)
        if not (c.ok and d is not None and d.ok):
            rows.append(
                {"prompt": c.prompt, "identical": False, "diverges_at": None, "note": "a request failed"}
            )
            continue
        at = first_divergence(c.token_ids, d.token_ids)
        rows.append({"prompt": c.prompt, "identical": at is None, "diverges_at": at, "note": None})
    return rows


# ---- the report ---------------------------------------------------------------------------------------------


def level_row(mode: str, level: Level) -> dict:
    return {
        "mode": mode,
        "concurrency": level.concurrency,
        "requests": len(level.completions),
        "failed": level.failed,
        "tokens_per_s": round(level.tokens_per_s, 2),
        "p50_s": level.p50_s,
        "p99_s": level.p99_s,
        "accept_length": level.accept_length,
    }


def markdown(report: dict) -> str:
    def f(v, spec=".3g"):
        return "-" if v is None else format(v, spec)

    lines = [
        f"# kdtree check, {report['started']}",
        "",
        f"Sidecar {report['sidecar_url']}, server {report['server_url']}, model {report['model']}; "
        f"{report['prompts']} prompts, max_tokens {report['max_tokens']}, concurrency {report['concurrency']}.",
        f"Result: **{'PASS' if report['passed'] else 'FAIL'}**"
        + (f": {report['failure']}" if report.get("failure") else ""),
        "",
        "## Load",
        "",
        "| mode | concurrency | requests | failed | tokens/s | p50 (s) | p99 (s) | accept length |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["levels"]:
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {r['requests']} | {r['failed']} | {f(r['tokens_per_s'], '.1f')} | "
            f"{f(r['p50_s'])} | {f(r['p99_s'])} | {f(r['accept_length'])} |"
        )
    lines += ["", "## Verify calls through kdtree, per rank and load", "",
              "| mode | concurrency | rank | served by kdtree | compared | fallbacks that grew | ok |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for mode, rows in report["evidence"].items():
        for r in rows:
            grew = ", ".join(f"{k} +{v}" for k, v in r["fallbacks_grew"].items()) or r.get("problem") or "-"
            lines.append(
                f"| {mode} | {r.get('concurrency', '-')} | {r['rank']} | {r['served']} | {r['compared']} | {grew} | "
                f"{'yes' if r['ok'] else 'NO'} |"
            )
    flip = report.get("flip")
    if flip:
        lines += ["", "## Flip to on", ""]
        t = flip.get("transition") or {}
        lines.append(
            f"{flip['from_mode']} -> on: {t.get('outcome', flip.get('error'))}, method {t.get('method')}, "
            f"{f(t.get('duration_s'))} s (ranks confirmed after {f(t.get('confirmed_s'))} s)"
        )
        if flip.get("identical") is not None:
            lines.append(
                f"Identical greedy completions: {flip['identical']}/{flip['compared']}"
                + "".join(
                    f"\n- prompt {d['prompt']} (concurrency {d['concurrency']}): first differs at token {d['diverges_at']}"
                    + (f" ({d['note']})" if d["note"] else "")
                    for d in flip["differences"]
                )
            )
        for k in ("tokens_per_s_ratio", "p50_ratio"):
            if flip.get(k):
                lines.append(f"{k.replace('_', ' ')} (on / {flip['from_mode']}): " + ", ".join(
                    f"concurrency {c}: {v:.3g}" for c, v in flip[k].items()))  # fmt: skip
        for rank, p in sorted((flip.get("parity") or {}).items()):
            lines.append(
                f"Parity, rank {rank}: {p.get('calls_compared')} calls compared, max relative L2 "
                f"{p.get('max_rel_l2')}, over tolerance {p.get('calls_over_tol')}, NaN/Inf {p.get('nan_inf')}"
            )
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))


def levels_of(levels: list[Level]) -> dict[int, Level]:
    return {lv.concurrency: lv for lv in levels}


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


# ---- the command ---------------------------------------------------------------------------------------------

CHECK_HELP = f"""\
Prove on this stack, in one command and one report, that tree verify runs through kdtree, whether `on` changes
what the model says, and what it gains.

1. Preflight: the sidecar's /status must be ready with every rank installed (else one line, and exit {NOT_READY};
   {CRASHED} when the server crashed, {BUSY} while a transition runs).
2. Load: the built-in prompts (mixed lengths, one of thousands of tokens; nothing is downloaded) as greedy
   completions at each --concurrency level, asking SGLang for token ids and speculative-decoding details:
   tokens/s, p50/p99 latency, accept length.
3. Evidence: the rank records before and after each load; every rank must show verify calls that kdtree
   served (on) or compared (validate). None: the check fails and names the fallback reasons that grew.
4. --flip: the load in the current mode, a gated flip to on (as `kdtreectl mode on`), the same load again,
   and the greedy completions compared token by token (identical ones, and where each other one first
   differs); tokens/s and latency ratios, the parity statistics, the flip's method and duration; then back to
   the starting mode unless --stay.
Output: progress and a table here; report.json and report.md in --out.
""" + listing(
    {
        OK: "everything checked holds",
        FAILED: "a check failed (the reason in one line)",
        USAGE: "bad input, a server that is not reachable, or a stack in off",
        CRASHED: "the server crashed",
        BUSY: "a transition is running",
        UNREACHABLE: "the sidecar unreachable or not a sidecar",
        NOT_READY: "a stack that is not ready (or has ranks missing or stale)",
    }
)


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected concurrency levels like 1,8") from None
    if not levels or min(levels) < 1 or max(levels) > 256:
        raise argparse.ArgumentTypeError(f"{text!r}: levels from 1 to 256, e.g. 1,8")
    return levels


def _bounded(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is not in {lo}..{hi}")
        return value

    return parse


def add_parser(sub, common: dict) -> None:
    """kdtreectl's `check` command; common: the formatter and parents every command has."""
    c = sub.add_parser(
        "check",
        help="prove kdtree serves on this stack, and what on changes",
        description=CHECK_HELP,
        **common,
    )
    c.add_argument(
        "--server-url",
        type=url_flag("KDTREE_SERVER_URL"),
        default=CtlSettings.load().server_url,
        help="the SGLang server's base URL (env KDTREE_SERVER_URL)",
    )
    c.add_argument(
        "--flip", action="store_true", help="also flip to on, run the load again and compare outputs"
    )
    c.add_argument("--stay", action="store_true", help="with --flip: stay in on afterwards")
    c.add_argument("--concurrency", type=_levels, default=[1, 8], help="concurrency levels, e.g. 1,8")
    c.add_argument(
        "--prompts", type=_bounded(1, 1000), default=len(BUILTIN_PROMPTS), help="prompts per level"
    )
    c.add_argument("--max-tokens", type=_bounded(2, 4096), default=128, help="tokens per completion")
    c.add_argument("--out", default="kdtree-check", help="folder for report.json and report.md")
    c.add_argument("--request-timeout", type=float, default=600.0, help="seconds one completion may take")
    c.add_argument("--timeout", type=float, default=3900.0, help="seconds the flip may take")
    c.add_argument("--interval", type=float, default=2.0, help="seconds between polls of the flip")
    c.set_defaults(func=cmd_check)


def say(text: str) -> None:
    print(text, flush=True)


def _fail_line(message: str, code: int) -> int:
    print(f"kdtreectl check: {message}", file=sys.stderr)
    return code


def _preflight(st: StatusDocument) -> tuple[str, int] | None:
    """Why the stack cannot be checked now, with the exit code; or None."""
    if st.active_transition:
        return "a mode transition is running; run the check when it has finished", BUSY
    if readiness(st) != OK:
        reasons = "; ".join(st.reasons or ["?"])
        return f"the stack is not ready (phase {st.phase}): {reasons}", readiness(st)
    ranks = rank_counts(st)
    missing = [r for r in range(st.expected_tp_size) if r not in ranks]
    bad = [r for r, v in ranks.items() if v.stale or (v.record.mode != "off" and not v.record.installed)]
    if missing or bad:
        return f"ranks missing {missing} or stale / not installed {bad}: see kdtreectl status", NOT_READY
    if st.mode.current == Mode.OFF:
        return (
            "the server runs in off, where kdtree's kernel serves no verify and there is nothing to check: switch to "
            "validate first (kdtreectl mode validate)",
            USAGE,
        )
    return None


async def _load(
    args, model: str, texts: list[str], mode: str, side: SidecarClient
) -> tuple[list[Level], list[dict]]:
    """Every level once, with the rank records read before and after each."""
    levels, evidence = [], []
    limits = httpx.Limits(max_connections=max(args.concurrency))
    async with httpx.AsyncClient(
        base_url=args.server_url, timeout=args.request_timeout, limits=limits, headers=server_headers()
    ) as http:
        for c in args.concurrency:
            before = _fresh_counts(side, time.time())
            say(f"[{mode}] concurrency {c}: {len(texts)} completions of up to {args.max_tokens} tokens ...")
            level = await run_level(http, model, texts, c, args.max_tokens)
            after = _fresh_counts(side, time.time())
            rows = verify_evidence(before, after, len(after))
            levels.append(level)
            evidence.append({"concurrency": c, "ranks": rows})
            say(
                f"[{mode}] concurrency {c}: {level.tokens_per_s:.1f} tokens/s, p50 {level.p50_s or 0:.2f}s, "
                f"p99 {level.p99_s or 0:.2f}s, accept length {level.accept_length or 0:.2f}, "
                f"{level.failed} failed; kdtree served {sum(r['served'] for r in rows)}, "
                f"compared {sum(r['compared'] for r in rows)} verify calls over {len(rows)} ranks"
            )
    return levels, evidence


def _fresh_counts(side: SidecarClient, at: float, timeout: float = 30.0) -> dict[int, RankView]:
    """The rank counters once every rank has rewritten its record after `at` (a rank heartbeats every
    KDTREE_HEARTBEAT_S, 5 s by default), or what there is after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        views = rank_counts(side.status())
        records = {r: v.record for r, v in views.items()}
        if (records and written_since(records, records, at)) or time.monotonic() >= deadline:
            return views
        time.sleep(0.2)


def server_headers() -> dict[str, str]:
    """SGLang's --api-key, as the sidecar's probe sends it (KDTREE_SERVER_API_KEY): Authorization: Bearer."""
    key = CtlSettings.load().server_api_key
    return {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}


def _model(args) -> str:
    try:
        url = f"{args.server_url.rstrip('/')}/v1/models"
        body = httpx.get(url, timeout=args.http_timeout, headers=server_headers()).json()
        return str(body["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ServerUnreachable(f"GET {args.server_url}/v1/models gave no model: {short(e, 200)}") from None


def _accept_from_server(args) -> float | None:
    """SGLang's average accept length (/server_info internal_states), where responses carried none."""
    try:
        url = f"{args.server_url.rstrip('/')}/server_info"
        states = httpx.get(url, timeout=args.http_timeout, headers=server_headers()).json()
        values = [s.get("avg_spec_accept_length") for s in states.get("internal_states") or []]
        values = [v for v in values if isinstance(v, int | float) and v > 0]
        return statistics.fmean(values) if values else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def _request_and_follow(side: SidecarClient, args, mode: str, report: dict) -> dict | None:
    """POST /mode (gated) and follow it; the transition, or None with report['failure'] set."""
    code, body = side.post_mode(mode, reason="kdtreectl check")
    for c in body.criteria:
        say("  " + criterion_line(c))
    if code == 200 and body.changed is False:
        return {"outcome": Outcome.SUCCEEDED.value, "method": "none", "duration_s": 0.0, "to_mode": mode}
    if code != 202:
        failed = [c.name for c in body.criteria if not c.passed]
        why = f"the gate refused the flip to {mode} ({', '.join(failed)})" if code == 412 else None
        report["failure"] = (
            why
            or f"POST /mode {mode} answered {code}: {short(body.error or body.detail or body.wire(), 200)}"
        )
        return None
    say(f"flip to {mode} accepted ({body.method}); following it ...")
    followed = side.follow(body.transition.id, args.timeout, args.interval)
    if followed is None:
        report["failure"] = f"the flip to {mode} did not finish within {args.timeout:g}s"
        return None
    t = json_safe(followed.model_dump())  # the report's JSON
    say(f"flip to {mode}: {t.get('outcome')} ({t.get('method')}, {t.get('duration_s') or 0:.1f}s)")
    if t.get("outcome") != Outcome.SUCCEEDED:
        report["failure"] = f"the flip to {mode} {t.get('outcome')}: {short(t.get('failure'), 200)}"
    return t


def _evidence_failure(mode: str, evidence: list[dict]) -> str | None:
    for level in evidence:
        for r in level["ranks"]:
            if not r["ok"]:
                grew = ", ".join(f"{k} +{v}" for k, v in r["fallbacks_grew"].items())
                why = r.get("problem") or (
                    f"fallbacks grew instead: {grew}" if grew
                    else "no fallback either: did any target-verify call reach the override? (speculative "
                    "decoding on, --attention-backend triton)"
                )  # fmt: skip
                return (
                    f"in {mode}, rank {r['rank']} shows no verify call served or compared by kdtree ({why})"
                )
    return None


def cmd_check(args) -> int:
    out = Path(args.out)
    texts = prompts(args.prompts)
    report: dict = {
        "started": now_iso(),
        "sidecar_url": args.url,
        "server_url": args.server_url,
        "prompts": len(texts),
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "model": None,
        "levels": [],
        "evidence": {},
        "failure": None,
        "passed": False,
    }
    try:
        with SidecarClient(args.url, args.token, args.http_timeout) as side:
            st = side.status()
            not_ready = _preflight(st)
            if not_ready:
                return _fail_line(*not_ready)
            start_mode = st.mode.current.value
            report["model"] = model = _model(args)
            say(
                f"stack ready in mode {start_mode}; model {model}; {len(texts)} prompts, levels {args.concurrency}"
            )
            runs = {start_mode: asyncio.run(_load(args, model, texts, start_mode, side))}
            if args.flip and start_mode != Mode.ON and report["failure"] is None:
                flip: dict = {"from_mode": start_mode}
                report["flip"] = flip
                t = _request_and_follow(side, args, Mode.ON.value, report)
                flip["transition"] = t
                if t is not None and t.get("outcome") == Outcome.SUCCEEDED:
                    runs["on"] = asyncio.run(_load(args, model, texts, "on", side))
                    flip["parity"] = {
                        r: json_safe(v.record.parity.model_dump())
                        for r, v in rank_counts(side.status()).items()
                    }
                    _compare(flip, runs[start_mode][0], runs["on"][0])
                    if not args.stay:
                        back = _request_and_follow(side, args, start_mode, {})
                        flip["returned"] = back.get("outcome") if back else "failed"
                        if not back or back.get("outcome") != Outcome.SUCCEEDED:
                            report["failure"] = (
                                report["failure"] or f"the flip back to {start_mode} did not succeed"
                            )
    except (Unreachable, ServerUnreachable) as e:  # the sidecar: 7, like every command; the server: 2
        report["failure"] = str(e)
        write_report(out, report)
        return _fail_line(str(e), UNREACHABLE if isinstance(e, Unreachable) else USAGE)
    accept = _accept_from_server(args)
    for mode, (levels, evidence) in runs.items():
        report["evidence"][mode] = [
            r | {"concurrency": e["concurrency"]} for e in evidence for r in e["ranks"]
        ]
        for level in levels:
            row = level_row(mode, level)
            row["accept_length"] = row["accept_length"] if row["accept_length"] is not None else accept
            report["levels"].append(row)
        report["failure"] = report["failure"] or _evidence_failure(mode, evidence)
        failed = sum(level.failed for level in levels)
        if failed and not report["failure"]:
            report["failure"] = f"{failed} completion(s) failed in {mode}"
    report["passed"] = report["failure"] is None
    write_report(out, report)
    say("")
    say(markdown(report))
    say(f"report: {out / 'report.json'}, {out / 'report.md'}")
    if report["failure"]:
        return _fail_line(report["failure"], FAILED)
    return OK


def _compare(flip: dict, base: list[Level], on: list[Level]) -> None:
    by = levels_of(on)
    diffs, identical, compared = [], 0, 0
    tps, p50 = {}, {}
    for lv in base:
        other = by.get(lv.concurrency)
        if other is None:
            continue
        for row in compare_outputs(lv, other):
            compared += 1
            identical += row["identical"]
            if not row["identical"]:
                diffs.append(row | {"concurrency": lv.concurrency})
        if lv.tokens_per_s:
            tps[lv.concurrency] = other.tokens_per_s / lv.tokens_per_s
        if lv.p50_s and other.p50_s:
            p50[lv.concurrency] = other.p50_s / lv.p50_s
    flip.update(
        identical=identical, compared=compared, differences=diffs, tokens_per_s_ratio=tps, p50_ratio=p50
    )
