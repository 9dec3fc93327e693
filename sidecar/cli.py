"""kdtreectl: talk to the kdtree sidecar (status, wait for readiness, switch the verify mode).

Exit codes: 0 done/ready, 1 refused or rolled back, 3 server crashed, 4 timed out, 5 another transition
is running, 6 not authorized, 7 sidecar unreachable (2 is a usage error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import httpx

OK, FAILED, CRASHED, TIMED_OUT, BUSY, UNAUTHORIZED, UNREACHABLE = 0, 1, 3, 4, 5, 6, 7


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
    m.add_argument("mode", choices=["on", "validate", "off"])
    m.add_argument("--dry-run", action="store_true", help="evaluate the gate, change nothing")
    m.add_argument("--force", action="store_true", help="skip the gate (recorded in the audit log)")
    m.add_argument("--reason", default="", help="why, for the audit log")
    m.add_argument(
        "--wait", action="store_true", help="follow the transition until it succeeds or rolls back"
    )
    m.add_argument("--timeout", type=float, default=3900.0, help="seconds to follow with --wait")
    m.add_argument("--interval", type=float, default=2.0, help="seconds between polls with --wait")
    m.set_defaults(func=cmd_mode)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
