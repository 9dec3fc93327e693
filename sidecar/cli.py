"""kdtreectl: talk to the kdtree sidecar (status, wait for readiness, switch the verify mode), or to the
sidecars of several replicas at once (rollout).

Exit codes: 0 done/ready, 1 refused or rolled back, 3 server crashed, 4 timed out, 5 another transition
is running, 6 not authorized, 7 sidecar unreachable (2 is a usage error).
rollout: 0 every replica is in the mode, 1 it stopped on a failure, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import httpx

from kdtree.config import Mode

OK, FAILED, USAGE, CRASHED, TIMED_OUT, BUSY, UNAUTHORIZED, UNREACHABLE = 0, 1, 2, 3, 4, 5, 6, 7


def _client(args) -> httpx.Client:
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    return httpx.Client(base_url=args.url, headers=headers, timeout=args.http_timeout)


def _fmt_elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def _summary(st: dict) -> str:
    c = st.get("container") or {}
    cs = c.get("state") or {}
    marker = (st.get("log") or {}).get("latest_marker") or {}
    probe = st.get("probe") or {}
    lines = [
        f"phase:     {st['phase']}"
        + (f" (server: {st['server_phase']})" if st["server_phase"] != st["phase"] else ""),
        f"ready:     {st['ready']}",
        f"mode:      current {st['mode']['current']}, expected now {st['mode']['expected_now']}, "
        f"mode file {st['mode']['desired_file']}",
        "container: "
        + (
            f"{cs.get('status')} exit={cs.get('exit_code')} oom={cs.get('oom_killed')} "
            f"restarts={cs.get('restart_count')}"
            if cs
            else str(c.get("error"))
        ),
        f"log:       {marker.get('text', 'no startup marker yet')}",
        "probe:     "
        + ("ok" if probe.get("ok") else f"{probe.get('reason')}: {probe.get('detail')}" if probe else "none")
        + (f" ({probe['latency_s']:.3f}s)" if probe else ""),
        f"ranks:     {len(st['ranks'])} records, expected {st['expected_tp_size']}",
    ]
    lines += [f"  problem: {p}" for p in st["reasons"]]
    if st.get("active_transition"):
        t = st["active_transition"]
        lines.append(f"transition {t['id']}: {t['from_mode']} -> {t['to_mode']} at step {t['step']}")
    for line in (st.get("log") or {}).get("crash_excerpt") or []:
        lines.append(f"  | {line}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    try:
        with _client(args) as c:
            st = c.get("/status").raise_for_status().json()
    except httpx.HTTPError as e:
        print(f"kdtreectl: cannot read {args.url}/status: {e}", file=sys.stderr)
        return UNREACHABLE
    print(json.dumps(st, indent=2) if args.json else _summary(st))
    return OK


class _Progress:
    """One progress line, rewritten in place on a terminal; on a pipe, one line per change."""

    def __init__(self, stream=sys.stdout):
        self.stream, self.tty, self.last = stream, stream.isatty(), None

    def show(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
            self.stream.flush()
        elif text.split(" elapsed ")[0] != self.last:
            print(text, file=self.stream, flush=True)
        self.last = text.split(" elapsed ")[0]

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")


def cmd_wait(args) -> int:
    start = time.monotonic()
    progress = _Progress()
    with _client(args) as c:
        while True:
            elapsed = time.monotonic() - start
            try:
                st = c.get("/status").raise_for_status().json()
            except httpx.HTTPError as e:
                progress.show(f"sidecar unreachable ({type(e).__name__}) elapsed {_fmt_elapsed(elapsed)}")
                st = None
            if st:
                marker = ((st.get("log") or {}).get("latest_marker") or {}).get("text", "-")
                progress.show(f"{st['phase']} | {marker} elapsed {_fmt_elapsed(elapsed)}")
                if st["ready"] and st["phase"] == "ready":
                    progress.done()
                    print(f"ready after {_fmt_elapsed(elapsed)} in mode {st['mode']['current']}")
                    return OK
                if st["phase"] == "crashed":
                    progress.done()
                    print("the server crashed:", file=sys.stderr)
                    for r in st["reasons"]:
                        print(f"  {r}", file=sys.stderr)
                    for line in st["log"]["crash_excerpt"]:
                        print(f"  | {line}", file=sys.stderr)
                    return CRASHED
            if elapsed >= args.timeout:
                progress.done()
                why = "; ".join(st["reasons"]) if st else "the sidecar never answered"
                print(f"kdtreectl: not ready after {_fmt_elapsed(elapsed)}: {why}", file=sys.stderr)
                return TIMED_OUT
            time.sleep(min(args.interval, max(0.0, args.timeout - elapsed)))


def _print_criteria(body: dict) -> None:
    for c in body.get("criteria", []):
        verdict = "pass" if c["passed"] else "FAIL"
        print(
            f"  {verdict}  {c['name']}: {c['value']} (threshold {c['threshold']}) {c.get('detail') or ''}".rstrip()
        )


def cmd_mode(args) -> int:
    request = {"mode": args.mode, "dry_run": args.dry_run, "force": args.force, "reason": args.reason}
    try:
        with _client(args) as c:
            resp = c.post("/mode", json=request)
    except httpx.HTTPError as e:
        print(f"kdtreectl: cannot reach {args.url}: {e}", file=sys.stderr)
        return UNREACHABLE
    body = resp.json()
    if resp.status_code in (401, 403):
        print(f"kdtreectl: {body.get('detail')} (pass --token or set KDTREE_ADMIN_TOKEN)", file=sys.stderr)
        return UNAUTHORIZED
    if resp.status_code == 409:
        t = body.get("transition") or {}
        print(
            f"kdtreectl: {body['error']}: {t.get('from_mode')} -> {t.get('to_mode')} at step {t.get('step')}",
            file=sys.stderr,
        )
        return BUSY
    print(f"{body.get('from_mode')} -> {body.get('to_mode')}")
    _print_criteria(body)
    if resp.status_code == 200:
        if body.get("dry_run"):
            print("dry run: " + ("would be allowed" if body["allowed"] else "would be refused"))
            return OK if body["allowed"] else FAILED
        print(body.get("detail", "nothing to do"))
        return OK
    if resp.status_code != 202:
        print(f"kdtreectl: {body.get('error') or body}", file=sys.stderr)
        return FAILED
    if body.get("warning"):
        print(f"WARNING: {body['warning']}", file=sys.stderr)
    tid = body["transition"]["id"]
    print(f"transition {tid} accepted")
    return _follow(args, tid) if args.wait else OK


def _follow(args, tid: str) -> int:
    start = time.monotonic()
    progress = _Progress()
    with _client(args) as c:
        while time.monotonic() - start < args.timeout:
            try:
                st = c.get("/status").raise_for_status().json()
            except httpx.HTTPError:
                time.sleep(args.interval)
                continue
            done = [t for t in st["transitions"] if t["id"] == tid]
            if done:
                progress.done()
                t = done[0]
                if t["outcome"] == "succeeded":
                    print(f"mode is now {t['to_mode']}")
                    return OK
                print(f"transition {t['outcome']}: {t['failure']}", file=sys.stderr)
                if t.get("rollback_failure"):
                    print(f"rollback failed too: {t['rollback_failure']}", file=sys.stderr)
                return FAILED
            step = (st.get("active_transition") or {}).get("step", "?")
            progress.show(f"{step} | {st['server_phase']} elapsed {_fmt_elapsed(time.monotonic() - start)}")
            time.sleep(args.interval)
    progress.done()
    print(f"kdtreectl: transition {tid} still running after {_fmt_elapsed(args.timeout)}", file=sys.stderr)
    return TIMED_OUT


# ---- rollout: several replicas, canary first, then waves --------------------------------------------

DONE = ("succeeded", "already")  # a replica in the target mode


@dataclass
class Replica:
    url: str
    from_mode: str | None = None
    to_mode: str = ""
    outcome: str = "skipped"  # see ROLLOUT_HELP
    duration_s: float | None = None
    detail: str = ""
    changed: bool = False  # this rollout flipped it, and it is (still) in the new mode
    criteria: list | None = None  # the gate's criteria, as POST /mode answered them


ROLLOUT_HELP = """\
Switch several replicas' verify mode, each through its sidecar's POST /mode (where the gate, the bake and
the automatic rollback happen, as for `kdtreectl mode`): the canary replicas first (--canary, flipped
together), then the rest in waves of --wave replicas flipped concurrently, each wave after the previous one
has finished. A replica already in the mode counts as done. The rollout stops at the first failure (gate
refused, rolled back, unreachable, timed out, busy, not authorized) and leaves the replicas it flipped in
the new mode, unless --rollback-on-failure, which flips them back to their previous mode (forced: the way
back skips the gate, and each sidecar's audit log records it). Every sidecar is reached first: one that
does not answer, or is in a transition already, stops the rollout before anything is flipped.

One line per replica as its outcome is known, then a table. Outcomes: succeeded, already (in the mode),
refused (gate), rolled_back / rollback_failed / aborted (by its sidecar), timeout, unreachable, busy,
unauthorized, error, skipped (not attempted); after --rollback-on-failure: reverted, revert_failed;
with --dry-run: allowed, refused, already.
Exit codes: 0 every replica is in the mode (or, with --dry-run, would be allowed), 1 it stopped on a failure
(or a gate would refuse), 2 bad input.
"""


def _normalized_url(url: str) -> str:
    parsed = httpx.URL(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--sidecar {url!r} is not an http(s) URL with a host, e.g. http://10.0.0.5:8080")
    return str(parsed.copy_with(path=parsed.path.rstrip("/") or "/", query=None, fragment=None)).rstrip("/")


def _rollout_client(args, url: str) -> httpx.Client:
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    return httpx.Client(base_url=url, headers=headers, timeout=args.http_timeout)


def _short(text, limit: int = 300) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _post_mode(args, r: Replica, mode: str, *, dry_run: bool = False, force: bool = False) -> dict | None:
    """POST /mode; sets r's outcome for every answer but 202 (returns the body then, else None)."""
    request = {"mode": mode, "dry_run": dry_run, "force": force, "reason": args.reason}
    try:
        with _rollout_client(args, r.url) as c:
            resp = c.post("/mode", json=request)
    except httpx.HTTPError as e:
        r.outcome, r.detail = "unreachable", _short(f"{type(e).__name__}: {e}")
        return None
    try:
        body = resp.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    r.from_mode = body.get("from_mode", r.from_mode)
    if isinstance(body.get("criteria"), list):
        r.criteria = body["criteria"]
    if resp.status_code in (401, 403):
        r.outcome = "unauthorized"
        r.detail = _short(f"{body.get('detail')} (pass --token or set KDTREE_ADMIN_TOKEN)")
    elif resp.status_code == 409:
        t = body.get("transition") or {}
        r.outcome = "busy"
        r.detail = _short(
            f"a transition is running: {t.get('from_mode')} -> {t.get('to_mode')} at step {t.get('step')}"
        )
    elif resp.status_code == 412:
        criteria = [c for c in body.get("criteria", []) if not c.get("passed")]
        failed = [f"{c['name']}={c['value']} (threshold {c['threshold']})" for c in criteria]
        r.outcome, r.detail = "refused", _short("gate failed: " + ", ".join(failed))
    elif resp.status_code == 200 and dry_run and body.get("changed") is not False:
        r.outcome = "allowed" if body.get("allowed") else "refused"
        failed = [c["name"] for c in body.get("criteria", []) if not c.get("passed")]
        r.detail = _short("gate failed: " + ", ".join(failed)) if failed else ""
    elif resp.status_code == 200:
        r.outcome, r.detail = "already", _short(body.get("detail") or f"already in mode {mode}")
    elif resp.status_code == 202 and (body.get("transition") or {}).get("id"):
        return body
    else:
        r.outcome = "error"
        r.detail = _short(f"HTTP {resp.status_code}: {body.get('error') or body or resp.text}")
    return None


def _await_transition(args, r: Replica, tid: str) -> None:
    """Poll GET /status until transition tid has an outcome, or --timeout."""
    start = time.monotonic()
    step = "?"
    with _rollout_client(args, r.url) as c:
        while time.monotonic() - start < args.timeout:
            try:
                st = c.get("/status").raise_for_status().json()
            except (httpx.HTTPError, ValueError):
                # A sidecar restarting mid-flip answers again (it resolves the transition), or the timeout ends it.
                time.sleep(args.interval)
                continue
            done = [t for t in st.get("transitions", []) if t.get("id") == tid]
            if done:
                t = done[0]
                r.outcome = t.get("outcome") or "error"
                why = [t.get("failure")]
                if t.get("rollback_failure"):
                    why.append("rollback: " + t["rollback_failure"])
                r.detail = _short("; ".join(x for x in why if x))
                return
            step = (st.get("active_transition") or {}).get("step", step)
            time.sleep(args.interval)
    r.outcome = "timeout"
    r.detail = f"transition {tid} still at step {step} after {_fmt_elapsed(args.timeout)}"


def _flip(args, r: Replica, mode: str, force: bool = False) -> Replica:
    start = time.monotonic()
    body = _post_mode(args, r, mode, force=force)
    if body is not None:
        _await_transition(args, r, body["transition"]["id"])
    r.duration_s = time.monotonic() - start
    return r


class _Lines:
    """Progress lines from several threads, one whole line at a time."""

    def __init__(self):
        self.lock = threading.Lock()

    def __call__(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)


def _line(label: str, r: Replica, to_mode: str) -> str:
    took = f" in {r.duration_s:.1f}s" if r.duration_s is not None else ""
    return f"[{label}] {r.url}: {r.from_mode or '?'} -> {to_mode} {r.outcome}{took}" + (
        f": {r.detail}" if r.detail else ""
    )


def _table(replicas: list[Replica]) -> str:
    rows = [("replica", "from", "to", "outcome", "duration", "detail")]
    for r in replicas:
        took = f"{r.duration_s:.1f}s" if r.duration_s is not None else "-"
        rows.append((r.url, r.from_mode or "-", r.to_mode, r.outcome, took, r.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, [*widths, 0], strict=True)).rstrip() for row in rows
    )


def cmd_rollout(args) -> int:
    try:
        urls = [_normalized_url(u) for u in args.sidecar]
    except ValueError as e:
        print(f"kdtreectl rollout: {e}", file=sys.stderr)
        return USAGE
    dupes = sorted({u for u in urls if urls.count(u) > 1})
    if dupes:
        print(f"kdtreectl rollout: the same sidecar twice: {', '.join(dupes)}", file=sys.stderr)
        return USAGE
    replicas = [Replica(url=u, to_mode=args.to) for u in urls]
    say = _Lines()
    workers = max(1, min(len(replicas), 16))

    if args.dry_run:

        def gate(r: Replica) -> Replica:
            start = time.monotonic()
            _post_mode(args, r, args.to, dry_run=True)
            r.duration_s = time.monotonic() - start
            return r

        with ThreadPoolExecutor(workers) as pool:
            for r in pool.map(gate, replicas):
                say(_line("dry run", r, args.to))
                _print_criteria({"criteria": r.criteria or []})
        print()
        print(_table(replicas))
        ok = all(r.outcome in ("allowed", "already") for r in replicas)
        print(
            "dry run: "
            + ("every replica would be allowed" if ok else "a gate would refuse")
            + "; nothing changed"
        )
        return OK if ok else FAILED

    # Every sidecar first: one that cannot take part stops the rollout before anything changes.
    def preflight(r: Replica) -> Replica:
        try:
            with _rollout_client(args, r.url) as c:
                st = c.get("/status").raise_for_status().json()
        except (httpx.HTTPError, ValueError) as e:
            r.outcome, r.detail = "unreachable", _short(f"GET /status: {type(e).__name__}: {e}")
            return r
        r.from_mode = (st.get("mode") or {}).get("current")
        if st.get("active_transition"):
            t = st["active_transition"]
            r.outcome = "busy"
            r.detail = _short(
                f"a transition is running: {t.get('from_mode')} -> {t.get('to_mode')} at step {t.get('step')}"
            )
        return r

    with ThreadPoolExecutor(workers) as pool:
        blocked = [r for r in pool.map(preflight, replicas) if r.outcome != "skipped"]
    if blocked:
        for r in blocked:
            say(_line("preflight", r, args.to))
        for r in replicas:
            if r.outcome == "skipped":
                r.detail = "not attempted: a sidecar cannot take part"
        print()
        print(_table(replicas))
        print(
            f"rollout to {args.to} not started: {len(blocked)} sidecar(s) cannot take part; nothing changed"
        )
        return FAILED

    rest = [replicas[i : i + args.wave] for i in range(args.canary, len(replicas), args.wave)]
    waves = ([("canary", replicas[: args.canary])] if args.canary else []) + [
        (f"wave {n}/{len(rest)}", wave) for n, wave in enumerate(rest, 1)
    ]
    failed: Replica | None = None
    for label, wave in waves:
        with ThreadPoolExecutor(len(wave)) as pool:
            for f in as_completed([pool.submit(_flip, args, r, args.to) for r in wave]):
                r = f.result()
                r.changed = r.outcome == "succeeded"
                say(_line(label, r, args.to))
        bad = [r for r in wave if r.outcome not in DONE]
        if bad:
            failed = bad[0]
            break

    if failed is not None:
        for r in replicas:
            if r.outcome == "skipped":
                r.detail = f"not attempted: the rollout stopped at {failed.url}"
        if args.rollback_on_failure:
            for r in reversed([r for r in replicas if r.changed]):
                back = Replica(url=r.url, to_mode=r.from_mode or "")
                _flip(args, back, r.from_mode, force=True)
                if back.outcome in DONE:
                    r.outcome, r.changed = "reverted", False
                    r.detail = f"flipped back to {r.from_mode} after the rollout stopped"
                else:
                    r.outcome = "revert_failed"
                    r.detail = _short(f"flipping back to {r.from_mode}: {back.outcome}: {back.detail}")
                r.duration_s = (r.duration_s or 0) + (back.duration_s or 0)
                say(_line("revert", r, args.to))

    print()
    print(_table(replicas))
    if failed is None:
        print(f"rollout to {args.to} done: {len(replicas)} replica(s) in mode {args.to}")
        return OK
    left = [r.url for r in replicas if r.changed]
    print(
        f"rollout to {args.to} stopped at {failed.url} ({failed.outcome})"
        + (f"; left in mode {args.to}: {', '.join(left)}" if left else "; no replica was left flipped"),
        file=sys.stderr,
    )
    return FAILED


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kdtreectl", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--url",
        default=os.environ.get("KDTREE_SIDECAR_URL", "http://127.0.0.1:8080"),
        help="sidecar base URL (env KDTREE_SIDECAR_URL)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("KDTREE_ADMIN_TOKEN"),
        help="admin bearer token for mode changes (env KDTREE_ADMIN_TOKEN)",
    )
    p.add_argument("--http-timeout", type=float, default=60.0, help="seconds per HTTP request")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("status", help="phase, evidence, ranks and transitions")
    s.add_argument("--json", action="store_true", help="the whole /status document")
    s.set_defaults(func=cmd_status)

    w = sub.add_parser("wait", help="wait until the server is ready; fail fast when it crashed")
    w.add_argument("--timeout", type=float, default=1800.0, help="seconds (default 1800)")
    w.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    w.set_defaults(func=cmd_wait)

    m = sub.add_parser("mode", help="switch the verify mode (gated to on; off always allowed)")
    m.add_argument("mode", choices=[m.value for m in Mode])
    m.add_argument("--dry-run", action="store_true", help="evaluate the gate, change nothing")
    m.add_argument("--force", action="store_true", help="skip the gate (recorded in the audit log)")
    m.add_argument("--reason", default="", help="why, for the audit log")
    m.add_argument(
        "--wait", action="store_true", help="follow the transition until it succeeds or rolls back"
    )
    m.add_argument("--timeout", type=float, default=3900.0, help="seconds to follow with --wait")
    m.add_argument("--interval", type=float, default=2.0, help="seconds between polls with --wait")
    m.set_defaults(func=cmd_mode)

    r = sub.add_parser(
        "rollout",
        help="switch the mode of several replicas: canary first, then waves",
        description=ROLLOUT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("--to", required=True, choices=[m.value for m in Mode], help="the target mode")
    r.add_argument(
        "--sidecar",
        action="append",
        required=True,
        metavar="URL",
        help="a replica's sidecar URL; repeat for each replica, in rollout order",
    )
    r.add_argument("--canary", type=_count(0), default=1, help="replicas flipped first, together (default 1)")
    r.add_argument(
        "--wave", type=_count(1), default=1, help="replicas flipped concurrently after them (default 1)"
    )
    r.add_argument("--dry-run", action="store_true", help="show every replica's gate, flip nothing")
    r.add_argument(
        "--rollback-on-failure",
        action="store_true",
        help="on a failure, flip the replicas this rollout flipped back to their previous mode",
    )
    r.add_argument("--reason", default="", help="why, for each sidecar's audit log")
    r.add_argument("--timeout", type=float, default=3900.0, help="seconds one replica's transition may take")
    r.add_argument("--interval", type=float, default=2.0, help="seconds between polls of a transition")
    r.set_defaults(func=cmd_rollout)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
