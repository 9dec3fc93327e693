"""The readiness probe: one short greedy completion through SGLang's OpenAI endpoint, and SGLang's own /health.

The completion proves the whole serving path (tokenizer, scheduler, every TP rank, detokenizer, response schema),
and with more than one token it decodes with speculation: each speculative step is a target-verify call on every
rank, the call kdtree serves. It asks for KDTREE_PROBE_MAX_TOKENS tokens with ignore_eos (so an early end of text
cannot skip the verify steps) and for SGLang's speculative-decoding details (`spec_verify_ct`: the verify steps
this completion took). Concurrent callers share one probe in flight; the Prober counts consecutive failures.

Under load the completion queues behind real traffic and can miss its deadline while the server works. SGLang's
/health then tells the two apart: SGLang 0.5.23 answers 200 once any output arrives (another request's counts)
within SGLANG_HEALTH_CHECK_TIMEOUT (20 s) and 503 when none does (a dead or hung scheduler), starting or shutting
down; it polls once a second, so it never answers in less than one. With --api-key set, SGLang wants
`Authorization: Bearer <key>` on /v1/* (401 {"error": "Unauthorized"} without); /health needs none.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import httpx
from pydantic import BaseModel, computed_field

# Failure reasons, a closed set (they are metric label values).
REFUSED = "connection_refused"  # nothing listens: SGLang keeps its port closed while it loads
TIMEOUT = "timeout"
HTTP_STATUS = "http_status"
MALFORMED = "malformed_json"
NO_CHOICES = "no_choices"
NO_FINISH_REASON = "no_finish_reason"
DISCONNECTED = "disconnected"  # the connection broke mid-answer
NO_MODEL = "no_model"
T = TypeVar("T")

REASONS = (REFUSED, TIMEOUT, HTTP_STATUS, MALFORMED, NO_CHOICES, NO_FINISH_REASON, DISCONNECTED, NO_MODEL)
ANSWERED = (HTTP_STATUS, MALFORMED, NO_CHOICES, NO_FINISH_REASON, NO_MODEL)  # failures with an HTTP answer


class ProbeResult(BaseModel):
    ok: bool
    reason: str | None = None
    detail: str = ""
    status_code: int | None = None
    latency_s: float
    at: float  # epoch seconds when the probe finished
    model: str | None = None
    finish_reason: str | None = None
    text: str | None = None
    completion_tokens: int | None = None
    verify_steps: int | None = (
        None  # sglext.spec_tokens_details.spec_verify_ct; None when the server gave none
    )

    @computed_field
    @property
    def accept_length(self) -> float | None:
        """Tokens a verify step gave, as SGLang counts it (completion tokens over verify steps); None without both."""
        if self.completion_tokens and self.verify_steps:
            return self.completion_tokens / self.verify_steps
        return None


class HealthResult(BaseModel):
    """SGLang's GET /health: 200 while its scheduler produces output (anyone's), else 503 or no answer."""

    ok: bool
    status_code: int | None = None
    detail: str = ""
    latency_s: float
    at: float


class ProbeFailure(Exception):
    def __init__(self, reason: str, detail: str, status_code: int | None = None):
        super().__init__(detail)
        self.reason, self.detail, self.status_code = reason, detail, status_code


class SingleFlight(Generic[T]):
    """A value that is fetched at most once at a time and reused while younger than max_age."""

    def __init__(self, fetch: Callable[[], Awaitable[T]]):
        self._fetch = fetch
        self._task: asyncio.Task[T] | None = None
        self._value: T | None = None
        self._at = 0.0  # monotonic time the cached value was fetched
        self._generation = 0

    @property
    def cached(self) -> T | None:
        return self._value

    @property
    def generation(self) -> int:
        """Moves at each invalidate(): a fetch that began under another generation predates what invalidated it."""
        return self._generation

    def invalidate(self) -> None:
        """Forget the cached value; a fetch already in flight is not reused either."""
        self._generation += 1
        self._value, self._task = None, None

    def start(self) -> asyncio.Task[T]:
        """The fetch in flight, started now when none is."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(self._generation))
        return self._task

    async def get(self, max_age: float, wait: float | None = None) -> T | None:
        """The cached value if fresh, else the shared in-flight fetch; None when `wait` runs out first."""
        if self._value is not None and time.monotonic() - self._at <= max_age:
            return self._value
        # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation that lands as the fetch
        # completes, and the loop that awaited it runs on past its stop.
        try:
            async with asyncio.timeout(wait):
                return await asyncio.shield(self.start())
        except TimeoutError:
            return None

    async def _run(self, generation: int) -> T:
        try:
            value = await self._fetch()
        finally:
            if generation == self._generation:
                self._task = None
        if generation == self._generation:
            self._value, self._at = value, time.monotonic()
        return value


class Prober:
    def __init__(
        self,
        server_url: str,
        prompt: str,
        max_tokens: int,
        deadline_s: float,
        model: str | None = None,
        api_key: str | None = None,
    ):
        self.server_url = server_url.rstrip("/")
        # what the probe's verdicts (and so /status) say of it: credentials in the URL stay out
        self._shown_url = str(httpx.URL(self.server_url).copy_with(userinfo=b""))
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # One TLS context for every client: httpx builds a new one per client otherwise, about 50 ms of the event
        # loop each (for /ready's answers too), twice a round with /health beside the probe.
        self._tls = httpx.create_ssl_context()
        self.prompt, self.max_tokens, self.deadline_s = prompt, max_tokens, deadline_s
        # The probe gives up a little before the deadline, so callers bounded by it still get its verdict.
        self.timeout_s = deadline_s * 0.9
        self.configured_model = model
        self._discovered_model: str | None = None
        self.flight: SingleFlight[ProbeResult] = SingleFlight(self.probe)
        self.last_ok_at: float | None = None
        self.last_refused_at: float | None = None
        # The first probe answered over HTTP (ok or not) since the port was last seen closed (or a restart).
        self.answering_since: float | None = None
        self.failures = 0  # consecutive failed probes (since the last good one, or the restart)
        self.health: HealthResult | None = None  # the latest /health answer
        self.on_result: Callable[[ProbeResult], None] | None = None

    async def get(self, max_age: float) -> ProbeResult | None:
        return await self.flight.get(max_age, wait=self.deadline_s)

    @property
    def latest(self) -> ProbeResult | None:
        return self.flight.cached

    def invalidate(self) -> None:
        """After a restart: old answers and the discovered model name no longer hold."""
        self.flight.invalidate()
        self._discovered_model = None
        self.answering_since = None
        self.failures, self.health = 0, None

    async def check_health(self) -> HealthResult:
        """GET /health within the probe's timeout: ok only for a 200."""
        start = time.monotonic()
        try:
            async with httpx.AsyncClient(
                base_url=self.server_url, timeout=self.timeout_s, verify=self._tls
            ) as client:
                async with asyncio.timeout(self.timeout_s):
                    resp = await client.get("/health")
            ok, code = resp.status_code == 200, resp.status_code
            detail = f"GET /health answered {code}"
        except (TimeoutError, httpx.TimeoutException):
            ok, code, detail = False, None, f"GET /health did not answer within {self.timeout_s:.3g}s"
        except httpx.HTTPError as e:
            ok, code, detail = False, None, f"GET /health failed: {e!r}"
        self.health = HealthResult(
            ok=ok, status_code=code, detail=detail, latency_s=time.monotonic() - start, at=time.time()
        )
        return self.health

    async def probe_with_health(self) -> ProbeResult | None:
        """A fresh probe (joining one in flight) with SGLang's /health sent beside it, not after it: on an idle
        server with a dead scheduler /health answers 503 only after SGLANG_HEALTH_CHECK_TIMEOUT (20 s), so asked
        after a failed probe it would add its own timeout to the probe's, and a dead scheduler would take one
        round more than (KDTREE_PROBE_FAILURE_THRESHOLD + 1) x max(interval, timeout) to turn /ready 503.
        /health is waited for only when the probe fails (its verdict then tells busy from broken); a good probe
        stops it."""
        self.flight.start()  # first: the probe's timeout runs from before /health's client is even built
        health = asyncio.create_task(self.check_health())
        try:
            result = await self.get(0)
            if result is None or not result.ok:
                await health
            return result
        finally:
            health.cancel()

    async def probe(self) -> ProbeResult:
        start = time.monotonic()
        model = None
        try:
            async with asyncio.timeout(self.timeout_s):
                async with httpx.AsyncClient(
                    base_url=self.server_url, timeout=self.timeout_s, headers=self._headers, verify=self._tls
                ) as client:
                    model = self.configured_model or self._discovered_model or await self._discover(client)
                    self._discovered_model = None if self.configured_model else model
                    result = await self._complete(client, model, start)
        except ProbeFailure as f:
            result = self._failed(f.reason, f.detail, start, model, f.status_code)
        except TimeoutError:
            result = self._failed(TIMEOUT, f"no answer within {self.timeout_s:.3g}s", start, model)
        except httpx.ConnectError as e:
            result = self._failed(REFUSED, f"cannot connect to {self._shown_url}: {e}", start, model)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            result = self._failed(DISCONNECTED, f"connection broke: {e!r}", start, model)
        except httpx.TimeoutException:
            result = self._failed(TIMEOUT, f"no answer within {self.timeout_s:.3g}s", start, model)
        except httpx.HTTPError as e:
            result = self._failed(DISCONNECTED, f"HTTP transport failed: {e!r}", start, model)
        self.failures = 0 if result.ok else self.failures + 1
        if result.ok:
            self.last_ok_at = result.at
        elif result.reason == REFUSED:
            self.last_refused_at = result.at
            self.answering_since = None
        if (result.ok or result.reason in ANSWERED) and self.answering_since is None:
            self.answering_since = result.at
        if self.on_result:
            self.on_result(result)
        return result

    def _failed(self, reason, detail, start, model, status_code=None) -> ProbeResult:
        return ProbeResult(
            ok=False,
            reason=reason,
            detail=detail,
            status_code=status_code,
            latency_s=time.monotonic() - start,
            at=time.time(),
            model=model,
        )

    def _json(self, resp: httpx.Response, what: str):
        if resp.status_code != 200:
            hint = ""
            if resp.status_code == 401:
                hint = (
                    " (SGLang runs with --api-key: set KDTREE_SERVER_API_KEY, which the launcher passes to SGLang)"
                    if not self._headers
                    else " (KDTREE_SERVER_API_KEY is not the key SGLang was started with)"
                )
            raise ProbeFailure(
                HTTP_STATUS,
                f"{what} answered HTTP {resp.status_code}: {resp.text[:200]}{hint}",
                resp.status_code,
            )
        try:
            return resp.json()
        except ValueError:
            raise ProbeFailure(
                MALFORMED, f"{what} answered 200 with a body that is not JSON: {resp.text[:200]!r}", 200
            ) from None

    async def _discover(self, client: httpx.AsyncClient) -> str:
        body = self._json(await client.get("/v1/models"), "GET /v1/models")
        try:
            return str(body["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise ProbeFailure(
                NO_MODEL, f"GET /v1/models lists no model: {str(body)[:200]}; set KDTREE_SERVED_MODEL_NAME"
            ) from None

    async def _complete(self, client: httpx.AsyncClient, model: str, start: float) -> ProbeResult:
        request = {
            "model": model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # SGLang's extension: all max_tokens are decoded, so the verify steps happen
            "return_spec_tokens_details": True,
        }
        body = self._json(await client.post("/v1/completions", json=request), "POST /v1/completions")
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ProbeFailure(
                NO_CHOICES, f"POST /v1/completions answered 200 without choices: {str(body)[:200]}", 200
            )
        finish = choices[0].get("finish_reason")
        if not finish:
            raise ProbeFailure(
                NO_FINISH_REASON, f"the completion has no finish_reason: {str(choices[0])[:200]}", 200
            )
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        return ProbeResult(
            ok=True,
            status_code=200,
            latency_s=time.monotonic() - start,
            at=time.time(),
            model=model,
            finish_reason=str(finish),
            text=str(choices[0].get("text", ""))[:100],
            completion_tokens=_int(usage.get("completion_tokens")),
            verify_steps=verify_steps(body),
        )


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def verify_steps(body: dict) -> int | None:
    """The verify steps of a completion from SGLang's `sglext.spec_tokens_details` (one dict per request, or a
    list of them); None when the server did not report them (no speculative decoding, or an older server)."""
    details = (
        (body.get("sglext") or {}).get("spec_tokens_details")
        if isinstance(body.get("sglext"), dict)
        else None
    )
    if isinstance(details, dict):
        details = [details]
    if not isinstance(details, list) or not details:
        return None
    counts = [_int(d.get("spec_verify_ct")) for d in details if isinstance(d, dict)]
    return sum(c for c in counts if c is not None) if any(c is not None for c in counts) else None
