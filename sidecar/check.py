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

import asyncio
import datetime
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kdtree.config import Mode

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


def rank_counts(status: dict) -> dict[int, dict]:
    """Per tensor-parallel rank: the counters of its record in a /status document."""
    out = {}
    for view in status.get("ranks") or []:
        rec = view.get("record") or {}
        out[int(rec.get("tp_rank", -1))] = {
            "mode": rec.get("mode"),
            "installed": bool(rec.get("installed")),
            "stale": bool(view.get("stale")),
            "pid": rec.get("pid"),
            "served_kdtree": int(rec.get("served_kdtree") or 0),
            "served_original": int(rec.get("served_original") or 0),
            "compared": int((rec.get("parity") or {}).get("calls_compared") or 0),
            "fallbacks": dict(rec.get("fallbacks") or {}),
            "parity": rec.get("parity") or {},
        }
    return out


def verify_evidence(before: dict[int, dict], after: dict[int, dict], expected: int) -> list[dict]:
    """Per rank, what kdtree did between two /status reads: served (on) and compared (validate) verify calls,
    and the fallback reasons that grew. `ok` when kdtree served or compared at least one call."""
    rows = []
    for rank in range(max(expected, len(after))):
        a, b = before.get(rank), after.get(rank)
        if a is None or b is None or a["pid"] != b["pid"]:
            rows.append({"rank": rank, "ok": False, "served": 0, "compared": 0, "fallbacks_grew": {},
                         "problem": "no record" if b is None else "the rank restarted during the load"})  # fmt: skip
            continue
        grew = {
            r: n - a["fallbacks"].get(r, 0) for r, n in b["fallbacks"].items() if n > a["fallbacks"].get(r, 0)
        }
        served, compared = b["served_kdtree"] - a["served_kdtree"], b["compared"] - a["compared"]
        rows.append({"rank": rank, "ok": served + compared > 0, "served": served, "compared": compared,
                     "fallbacks_grew": grew, "problem": None})  # fmt: skip
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
    lines += ["", "## Verify calls through kdtree, per rank", "",
              "| mode | rank | served by kdtree | compared | fallbacks that grew | ok |", "|---|---|---|---|---|---|"]  # fmt: skip
    for mode, rows in report["evidence"].items():
        for r in rows:
            grew = ", ".join(f"{k} +{v}" for k, v in r["fallbacks_grew"].items()) or r.get("problem") or "-"
            lines.append(
                f"| {mode} | {r['rank']} | {r['served']} | {r['compared']} | {grew} | {'yes' if r['ok'] else 'NO'} |"
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
        if flip.get("parity"):
            lines.append("Parity (validate, per rank): " + json.dumps(flip["parity"]))
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))


def levels_of(levels: list[Level]) -> dict[int, Level]:
    return {lv.concurrency: lv for lv in levels}


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


__all__ = [
    "BUILTIN_PROMPTS",
    "Completion",
    "Level",
    "Mode",
    "asdict",
    "compare_outputs",
    "first_divergence",
    "level_row",
    "markdown",
    "now_iso",
    "prompts",
    "rank_counts",
    "run_level",
    "verify_evidence",
    "write_report",
]
