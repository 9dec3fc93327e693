"""Seeded serving traffic for the real SGLang server, and the invariants every run is held to.

`make_mix` draws, from one seed, the requests a production server meets at once: short and long prompts, prompts
sharing a long prefix (radix-cache hits), prompts at the context limit (the speculative window reserved past them),
greedy requests beside sampled ones (temperature 1 with top-p and top-k) in one batch, logprobs on some, streamed and
not, requests that stop on a stop token or a stop string in the middle of a step's accepted tokens, and clients that
abort (POST /abort_request) or hang up mid-stream. `run_phase` sends a list of them at a fixed concurrency through the
server's OpenAI API (/v1/completions, SGLang's extra fields) and keeps every answer (`Outcome`).

The invariants (`check_outcomes`, `check_greedy`, `chi2_homogeneity`) are pure functions of what came back, so the CPU
tests hold them to made-up outcomes; kernel_build/bench/benchmarks/bench_traffic.py runs the real servers and adds
what only a server can say (alive, its leak check, its counters).

A stop is placed where the reference (a server without speculation) put a token: `resolve_stops` turns a request's
`stop_at` (a position of its greedy output) into that token id or word once the reference has answered, so the stop
lands inside a multi-token verify step as often as the step accepts past it.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field, replace

import httpx

BOS = 0  # the tiny model's tokenizer (tiny_model.py): ids 0-3 are special, word w<i> is id i + 4
FIRST_WORD = 4
ABORT_KINDS = ("endpoint", "disconnect")


@dataclass(frozen=True)
class Request:
    rid: str
    kind: str  # which case of the mix: short, long, shared, limit, sampled
    prompt: tuple[int, ...]  # token ids, BOS first
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    stream: bool = False
    logprobs: int | None = None  # top logprobs a token (the API's `logprobs`)
    stop_at: int | None = None  # greedy: stop where the reference's token at this output position is
    stop_as: str = "token"  # the stop given as a token id (stop_token_ids) or as its word (stop)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    abort: str | None = (
        None  # endpoint (POST /abort_request) | disconnect (the client hangs up), streamed only
    )
    abort_after: int = 1  # chunks read before the abort
    ignore_eos: bool = True  # False where a stop is asked: SGLang's ignore_eos ignores stop_token_ids too

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def body(self, model: str) -> dict:
        b = {
            "model": model, "prompt": list(self.prompt), "max_tokens": self.max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream, "rid": self.rid, "ignore_eos": self.ignore_eos,
            "return_token_ids": True, "return_spec_tokens_details": True,
        }  # fmt: skip
        if self.logprobs is not None:
            b["logprobs"] = self.logprobs
        if self.stop_token_ids:
            b["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            b["stop"] = list(self.stop)
        return b


@dataclass
class Outcome:
    rid: str
    status: int = 0  # HTTP status; 0: no answer (a connection error: `error` says which)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list | None = None  # the emitted tokens' logprobs, in order
    accept: float | None = None  # SGLang's spec_accept_length for the request (tokens a step, bonus included)
    error: str = ""
    ttft_s: float | None = None  # from sending to the first token (streamed requests)
    total_s: float = 0.0
    aborted_by_client: bool = False


def word(token: int) -> str:
    return f"w{token - FIRST_WORD}"


def make_mix(
    seed: int, n: int, *, context_len: int, vocab: int, max_tokens: int = 96, sampled: float = 0.35
) -> list[Request]:
    """n requests drawn from `seed` (the same seed, the same list): see the module docstring. A prompt at the context
    limit leaves exactly its max_tokens free; a shared prompt is one of three long prefixes plus a short tail."""
    rng = random.Random(seed)

    def words(k: int) -> list[int]:
        return [rng.randrange(FIRST_WORD, vocab) for _ in range(k)]

    prefixes = [words(rng.randint(600, 1200)) for _ in range(3)]
    out = []
    for i in range(n):
        kind = rng.choices(("short", "long", "shared", "limit"), weights=(5, 2, 4, 1))[0]
        mt = rng.randint(8, max_tokens)
        if kind == "short":
            body = words(rng.randint(4, 64))
        elif kind == "long":
            body = words(rng.randint(300, 1500))
        elif kind == "shared":
            body = rng.choice(prefixes) + words(rng.randint(1, 40))
        else:  # at the limit: with BOS, prompt + max_tokens = the context length
            body = words(context_len - mt - 1)
        r = Request(
            rid=f"s{seed}-{i}", kind=kind, prompt=(BOS, *body), max_tokens=mt, stream=rng.random() < 0.5
        )
        if rng.random() < sampled:
            r = replace(r, temperature=1.0, top_p=rng.choice((1.0, 0.9)), top_k=rng.choice((-1, 20)))
        elif rng.random() < 0.3:
            r = replace(r, stop_at=rng.randint(1, mt - 1), stop_as=rng.choice(("token", "token", "word")),
                        ignore_eos=False)  # fmt: skip
        if rng.random() < 0.2:
            r = replace(r, logprobs=2)
        if r.stream and rng.random() < 0.25:
            r = replace(r, abort=rng.choice(ABORT_KINDS), abort_after=rng.randint(1, 6))
        out.append(r)
    return out


def resolve_stops(requests: list[Request], reference: dict[str, list[int]]) -> list[Request]:
    """Each request with a `stop_at` given the reference's token there, as a stop token id or its word."""
    out = []
    for r in requests:
        ref = reference.get(r.rid)
        if r.stop_at is not None and ref and r.stop_at < len(ref):
            tok = ref[r.stop_at]
            r = replace(r, stop_token_ids=(tok,)) if r.stop_as == "token" else replace(r, stop=(word(tok),))
        out.append(r)
    return out


def unstopped(r: Request) -> Request:
    """The request as the reference runs it: its whole greedy output, no stop, no abort, not streamed."""
    return replace(r, stop_token_ids=(), stop=(), abort=None, stream=False)


def expected_tokens(r: Request, ref: list[int]) -> list[int]:
    """What a correct server emits for greedy `r` where the reference emitted `ref` unstopped: up to and including the
    first stop token, or all of it. (A stop string's cut depends on the text: `check_greedy` takes a prefix there.)"""
    for i, t in enumerate(ref):
        if t in r.stop_token_ids:
            return ref[: i + 1]
    return ref


# ---- sending ----------------------------------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, url: str, model: str, r: Request) -> Outcome:
    o, t0 = Outcome(r.rid), time.perf_counter()
    try:
        if not r.stream:
            resp = await client.post(f"{url}/v1/completions", json=r.body(model))
            o.status = resp.status_code
            if resp.status_code == 200:
                c = resp.json()["choices"][0]
                o.token_ids, o.finish_reason = c.get("token_ids") or [], c.get("finish_reason")
                o.logprobs = (c.get("logprobs") or {}).get("token_logprobs")
                o.accept = _accept(resp.json())
            else:
                o.error = resp.text[:300]
        else:
            await _stream(client, url, model, r, o, t0)
    except httpx.HTTPError as e:
        o.error = f"{type(e).__name__}: {e}"[:300]
    o.total_s = time.perf_counter() - t0
    return o


async def _stream(client, url, model, r: Request, o: Outcome, t0: float) -> None:
    chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=r.body(model)) as resp:
        o.status = resp.status_code
        if resp.status_code != 200:
            o.error = (await resp.aread())[:300].decode(errors="replace")
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk or chunk.get("object") == "error":  # SGLang's streamed error chunk
                err = chunk.get("error", chunk)
                o.error, o.status = json.dumps(err)[:300], int(err.get("code") or 500)
                return
            o.accept = _accept(chunk) or o.accept
            for c in chunk.get("choices") or []:
                ids = c.get("token_ids") or []
                if ids and o.ttft_s is None:
                    o.ttft_s = time.perf_counter() - t0
                o.token_ids.extend(ids)
                lp = (c.get("logprobs") or {}).get("token_logprobs")
                if lp is not None:
                    o.logprobs = (o.logprobs or []) + lp
                o.finish_reason = c.get("finish_reason") or o.finish_reason
                chunks += bool(ids)
            if r.abort and chunks >= r.abort_after and not o.aborted_by_client:
                o.aborted_by_client = True
                if r.abort == "disconnect":
                    return  # leaving the block closes the connection mid-stream
                await client.post(f"{url}/abort_request", json={"rid": r.rid})


def _accept(body: dict) -> float | None:
    details = (body.get("sglext") or {}).get("spec_tokens_details")
    for d in [details] if isinstance(details, dict) else details or []:
        if d and d.get("spec_accept_length") is not None:
            return float(d["spec_accept_length"])
    return None


async def _phase(url: str, model: str, requests: list[Request], concurrency: int, timeout_s: float):
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10), limits=limits) as client:

        async def one(r):
            async with sem:
                try:  # a hung server fails its requests, not the run
                    return await asyncio.wait_for(send(client, url, model, r), timeout_s)
                except TimeoutError:
                    return Outcome(r.rid, error=f"no answer in {timeout_s:g} s")

        return await asyncio.gather(*(one(r) for r in requests))


def run_phase(
    url: str, model: str, requests: list[Request], concurrency: int, timeout_s: float = 300
) -> dict:
    """The requests at `concurrency` in flight: {rid: Outcome}, and the phase's wall time under key None."""
    t0 = time.perf_counter()
    outcomes = asyncio.run(_phase(url, model, requests, concurrency, timeout_s))
    return {o.rid: o for o in outcomes} | {None: time.perf_counter() - t0}


def metrics(url: str) -> dict[str, float]:
    """SGLang's /metrics (--enable-metrics), each sample summed over its label sets, by name."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


# ---- invariants -------------------------------------------------------------------------------------------------


def check_outcomes(requests: list[Request], outcomes: dict) -> list[str]:
    """What the API promises each request, whatever the server's speculation: a 200 with its tokens (finish_reason
    length, or stop where it has a stop; at most max_tokens), logprobs for every emitted token where asked; an aborted
    stream ends with finish_reason abort or is cut by its own client. Problems, one line each."""
    bad = []
    for r in requests:
        o = outcomes.get(r.rid)
        if o is None:
            bad.append(f"{r.rid}: never sent")
            continue
        if o.aborted_by_client:
            if (
                r.abort == "endpoint"
                and o.status == 200
                and o.finish_reason not in (None, "abort", "length", "stop")
            ):
                bad.append(f"{r.rid}: aborted through /abort_request, finish_reason {o.finish_reason!r}")
            continue
        if o.status != 200:
            bad.append(f"{r.rid} ({r.kind}): HTTP {o.status}: {o.error}")
            continue
        if not o.token_ids or len(o.token_ids) > r.max_tokens:
            bad.append(f"{r.rid} ({r.kind}): {len(o.token_ids)} tokens for max_tokens {r.max_tokens}")
        # ignore_eos: every token up to max_tokens; else a stop (EOS or the request's own) before it, or the length
        want = (
            {"length"}
            if r.ignore_eos
            else {"stop"}
            if len(o.token_ids) < r.max_tokens
            else {"stop", "length"}
        )
        if o.finish_reason not in want:
            bad.append(
                f"{r.rid} ({r.kind}): finish_reason {o.finish_reason!r}, expected {' or '.join(sorted(want))}"
            )
        if r.logprobs is not None and (
            o.logprobs is None or len(o.logprobs) != len(o.token_ids) or None in o.logprobs
        ):
            n = None if o.logprobs is None else len(o.logprobs)
            bad.append(f"{r.rid} ({r.kind}): {n} logprobs for {len(o.token_ids)} tokens")
    return bad


@dataclass
class Mismatch:
    rid: str
    position: int
    got: list[int]
    want: list[int]
    margin: float | None = None  # the reference's top-2 logprob gap at `position`, once asked (bench_traffic)


def check_greedy(requests: list[Request], outcomes: dict, reference: dict[str, list[int]]) -> list[Mismatch]:
    """Every greedy request answered in full (not aborted) against the reference's tokens: equal up to its stop (a
    stop string: a prefix of the reference ending where the word is emitted). The mismatches, first position each."""
    out = []
    for r in requests:
        o, ref = outcomes.get(r.rid), reference.get(r.rid)
        if not r.greedy or o is None or o.aborted_by_client or o.status != 200 or ref is None:
            continue
        want = expected_tokens(r, ref)[: r.max_tokens]
        got = o.token_ids
        if r.stop:  # cut by the text: the tokens must be the reference's up to where it stopped
            want = want[: len(got)]
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        if at is None and len(got) != len(want):
            at = min(len(got), len(want))
        if at is not None:
            out.append(Mismatch(r.rid, at, got, want))
    return out


NEAR_TIE = (
    0.05  # nats: a greedy difference where the reference's top two are this close is bf16 rounding order
)


def chi2_homogeneity(a: list, b: list, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Two samples of categories from one distribution? Pearson's chi-square on the 2 x k table (categories expected
    fewer than `min_expected` times pooled into one): (statistic, degrees of freedom, p-value)."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    n = na + nb
    cats, rest = [], [0, 0]
    for c in set(ca) | set(cb):
        tot = ca[c] + cb[c]
        if tot * min(na, nb) / n < min_expected:
            rest[0] += ca[c]
            rest[1] += cb[c]
        else:
            cats.append((ca[c], cb[c]))
    if sum(rest):
        cats.append(tuple(rest))
    stat = 0.0
    for x, y in cats:
        tot = x + y
        for obs, size in ((x, na), (y, nb)):
            exp = tot * size / n
            stat += (obs - exp) ** 2 / exp if exp else 0.0
    dof = max(len(cats) - 1, 1)
    return stat, dof, chi2_sf(stat, dof)


def chi2_sf(x: float, k: int) -> float:
    """P(X >= x) for X chi-square with k degrees of freedom: the regularised upper incomplete gamma Q(k/2, x/2)
    (series below a + 1, Lentz's continued fraction above: Numerical Recipes' gammq)."""
    a, z = k / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    lg = math.lgamma(a)
    if z < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= z / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - lg))
    tiny = 1e-300
    b, c, d = z + 1 - a, 1 / tiny, 1 / (z + 1 - a)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - lg) * h
