"""The one HTTP client of a sidecar that kdtreectl's commands share: every answer is parsed defensively, and a
sidecar that cannot be reached, or answers something that is not a sidecar's JSON, is one `Unreachable` error
with a one-line message."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from kdtree.state.atomic import first_error
from sidecar.api import Criterion, GateVerdict, ModeAnswer, StatusDocument
from sidecar.store import Transition

M = TypeVar("M", bound=BaseModel)


class Unreachable(Exception):
    """The sidecar did not answer, or answered with something that is not its JSON."""


# What a sidecar's POST /mode answer carries, by status: anything else (another server's 404, a proxy's 502,
# JSON without these fields) is no sidecar's answer.
MODE_ANSWER_FIELDS = {
    200: ("from_mode", "to_mode"),  # a dry run, or nothing to do
    202: ("from_mode", "to_mode", "transition"),
    412: ("from_mode", "to_mode", "criteria"),
    503: ("from_mode", "to_mode", "error"),
    409: ("error", "transition"),
    **{code: ("detail",) for code in (400, 401, 403, 413, 422)},
}


def fmt_elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def short(text, limit: int = 300) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def criterion_line(c: Criterion) -> str:
    """A gate criterion as `pass  name: need >= 1000, got 1200` (its comparison, not a bare threshold)."""
    verdict = "pass" if c.passed else "FAIL"
    detail = f" ({c.detail})" if c.detail else ""
    return f"{verdict}  {c.name}: need {c.op} {c.threshold}, got {c.value}{detail}"


def busy_with(t: Transition | dict | None) -> str:
    """A 409's transition: the one running, or the request still being decided."""
    if isinstance(t, Transition):
        return f"{t.from_mode} -> {t.to_mode} at step {t.step}"
    return f"None -> None at step {(t or {}).get('step')}"


class SidecarClient:
    def __init__(
        self, url: str, token: str | None, timeout: float, address_from: str = "--url or KDTREE_SIDECAR_URL"
    ):
        self.url = url.rstrip("/")
        self.address_from = address_from  # where the address came from, for the fix of a failed connection
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()

    def _json(self, resp: httpx.Response, what: str) -> dict:
        try:
            body = resp.json()
        except ValueError:
            raise Unreachable(
                f"{what} at {self.url} answered HTTP {resp.status_code} with a body that is not JSON "
                f"({short(resp.text, 120)!r}): is this a kdtree sidecar?"
            ) from None
        if not isinstance(body, dict):
            raise Unreachable(f"{what} at {self.url} answered JSON that is not an object: {short(body, 120)}")
        return body

    def _send(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            return self.http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise Unreachable(
                f"cannot reach the sidecar at {self.url}: {type(e).__name__}: {e} "
                f"(another address: {self.address_from})"
            ) from None

    def _parse(self, model: type[M], body: dict, what: str) -> M:
        try:
            return model.model_validate(body)
        except ValidationError as e:
            raise Unreachable(
                f"{what} at {self.url} answered a document this kdtreectl cannot read ({first_error(e)}): "
                "run kdtreectl of the sidecar's version"
            ) from None

    def status(self) -> StatusDocument:
        """GET /status, read as the sidecar built it (sidecar.api.StatusDocument)."""
        return self.parse_status(self.status_json())

    def parse_status(self, body: dict) -> StatusDocument:
        return self._parse(StatusDocument, body, "GET /status")

    def status_json(self) -> dict:
        """GET /status: the document (Unreachable for anything but a 200 with the sidecar's JSON)."""
        resp = self._send("GET", "/status")
        body = self._json(resp, "GET /status")
        if resp.status_code != 200 or "phase" not in body:
            raise Unreachable(
                f"GET /status at {self.url} answered HTTP {resp.status_code}: {short(body, 200)}"
            )
        return body

    def gate(self, mode: str) -> GateVerdict:
        """GET /gate?to=MODE: the gate's verdict, read-only (no token)."""
        resp = self._send("GET", "/gate", params={"to": mode})
        body = self._json(resp, "GET /gate")
        if resp.status_code != 200 or "pass" not in body:
            raise Unreachable(f"GET /gate at {self.url} answered HTTP {resp.status_code}: {short(body, 200)}")
        return self._parse(GateVerdict, body, "GET /gate")

    def post_mode(
        self, mode: str, *, dry_run=False, force=False, restart=False, reason=""
    ) -> tuple[int, ModeAnswer]:
        """POST /mode: (HTTP status, body) of a sidecar's answer (MODE_ANSWER_FIELDS); Unreachable for anything
        else. A 401/403 body carries `detail`."""
        request = {"mode": mode, "dry_run": dry_run, "force": force, "restart": restart, "reason": reason}
        resp = self._send("POST", "/mode", json=request)
        body = self._json(resp, "POST /mode")
        fields = MODE_ANSWER_FIELDS.get(resp.status_code)
        if fields is None or any(f not in body for f in fields):
            raise Unreachable(
                f"POST /mode at {self.url} answered HTTP {resp.status_code} with JSON no sidecar sends "
                f"({short(body, 120)}): is this a kdtree sidecar?"
            )
        return resp.status_code, self._parse(ModeAnswer, body, "POST /mode")

    def follow(
        self,
        tid: str,
        timeout: float,
        interval: float,
        progress: Callable[[StatusDocument], None] | None = None,
    ) -> Transition | None:
        """The finished transition `tid` from /status, or None after `timeout` seconds. A sidecar that does not
        answer for a while (restarting mid-flip) is waited for: it resolves the transition on its next start."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                st = self.status()
            except Unreachable:
                time.sleep(interval)
                continue
            done = [t for t in st.transitions if t.id == tid]
            if done:
                return done[0]
            if progress:
                progress(st)
            time.sleep(interval)
        return None
