"""`kdtreectl rollout`: switch the verify mode of several replicas through their sidecars, canary first, then
in waves; stop at the first failure."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from enum import StrEnum

import httpx

from kdtree.config import http_url
from sidecar.api import Criterion, ModeAnswer, StatusDocument
from sidecar.store import Transition
from sidecar.vocabulary import Outcome

from .client import SidecarClient, Unreachable, busy_with, criterion_line, fmt_elapsed, short
from .exit_codes import FAILED, OK, UNREACHABLE, USAGE, listing


class ReplicaOutcome(StrEnum):
    """A replica's outcome where it is the rollout's own, not its sidecar's (vocabulary.Outcome)."""

    ALREADY = "already"  # in the mode before the rollout
    ALLOWED = "allowed"  # --dry-run: its gate would allow it
    REFUSED = "refused"  # its gate refused
    OVERRIDDEN = "overridden"  # --selector: POST /mode asked for another mode while the annotation stood
    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"  # or not a sidecar
    BUSY = "busy"  # its sidecar runs another transition
    UNAUTHORIZED = "unauthorized"
    ERROR = "error"
    SKIPPED = "skipped"  # not attempted
    REVERTED = "reverted"  # --rollback-on-failure: flipped back
    REVERT_FAILED = "revert_failed"


DONE = (Outcome.SUCCEEDED, ReplicaOutcome.ALREADY)  # a replica in the target mode


@dataclass
class Replica:
    url: str
    from_mode: str | None = None
    to_mode: str = ""
    outcome: Outcome | ReplicaOutcome = ReplicaOutcome.SKIPPED  # see ROLLOUT_HELP
    duration_s: float | None = None
    detail: str = ""
    changed: bool = False  # this rollout flipped it, and it is (still) in the new mode
    criteria: list[Criterion] | None = None  # the gate's criteria, as POST /mode answered them


ROLLOUT_HELP = """\
Switch several replicas' verify mode, each through its sidecar's POST /mode (where the gate, the bake and
the automatic rollback happen, as for `kdtreectl mode`): the canary replicas first (--canary, flipped
together), then the rest in waves of --wave replicas flipped concurrently, each wave after the previous one
has finished. A replica already in the mode counts as done. The rollout stops at the first failure (gate
refused, rolled back, unreachable, timed out, busy, not authorized) and leaves the replicas it flipped in
the new mode, unless --rollback-on-failure, which flips them back to their previous mode (forced: the way
back skips the gate, and each sidecar's audit log records it). Every sidecar is reached first: one that
does not answer, or is in a transition already, stops the rollout before anything is flipped.

With --selector (and -n) instead of --sidecar URLs the intent is held by the cluster, and the rollout is resumable:
each wave annotates its pods' kdtree.dev/desired-mode (kubectl annotate) and waits until every pod's sidecar
reports the value converged (through its own gate, bake and rollback). Run it again to finish an interrupted
rollout, or with --to the previous mode to undo it; a pod whose sidecar holds the value (refused, rolled back,
overridden) stops every run until --retry states it anew.

One line per replica as its outcome is known, then a table. Outcomes: succeeded, already (in the mode),
refused (gate), rolled_back / rollback_failed / aborted / preempted (by its sidecar), overridden (--selector:
POST /mode asked for another mode), timeout, unreachable, busy,
unauthorized, error, skipped (not attempted); after --rollback-on-failure: reverted, revert_failed;
with --dry-run: allowed, refused, already.
""" + listing(
    {
        OK: "every replica is in the mode (or, with --dry-run, would be allowed)",
        FAILED: "it stopped on a failure (or, with --dry-run, a gate would refuse or a replica cannot take part)",
        USAGE: "bad input",
        UNREACHABLE: "a sidecar unreachable or not a sidecar",
    }
)


def _normalized_url(url: str) -> str:
    try:
        http_url(url.strip(), "http://10.0.0.5:8080")  # the one check of a URL (kdtree.config)
    except ValueError as e:
        raise ValueError(f"--sidecar {url!r} is {e}") from None
    parsed = httpx.URL(url.strip())
    return str(parsed.copy_with(path=parsed.path.rstrip("/") or "/", query=None, fragment=None)).rstrip("/")


def _client(args, url: str) -> SidecarClient:
    return SidecarClient(url, args.token, args.http_timeout, address_from="the --sidecar that names it")


def _post_mode(
    args, r: Replica, mode: str, *, dry_run: bool = False, force: bool = False
) -> ModeAnswer | None:
    """POST /mode; sets r's outcome for every answer but 202 (returns the answer then, else None)."""
    try:
        with _client(args, r.url) as c:
            code, body = c.post_mode(mode, dry_run=dry_run, force=force, reason=args.reason)
    except Unreachable as e:
        r.outcome, r.detail = ReplicaOutcome.UNREACHABLE, short(e)
        return None
    r.from_mode = body.from_mode or r.from_mode
    if "criteria" in body.model_fields_set:
        r.criteria = body.criteria
    failed = [c for c in r.criteria or [] if not c.passed]
    if code in (401, 403):
        r.outcome = ReplicaOutcome.UNAUTHORIZED
        r.detail = short(f"{body.detail} (pass --token or set KDTREE_ADMIN_TOKEN)")
    elif code == 409:
        r.outcome = ReplicaOutcome.BUSY
        r.detail = short(f"a transition is running: {busy_with(body.transition)}")
    elif code == 412 or (code == 200 and dry_run and body.changed is not False):
        r.outcome = ReplicaOutcome.REFUSED if code == 412 or not body.allowed else ReplicaOutcome.ALLOWED
        r.detail = short("gate failed: " + "; ".join(_need(c) for c in failed)) if failed else ""
    elif code == 200:
        r.outcome, r.detail = ReplicaOutcome.ALREADY, short(body.detail or f"already in mode {mode}")
    elif code == 202 and isinstance(body.transition, Transition):
        return body
    else:
        r.outcome = ReplicaOutcome.ERROR
        r.detail = short(f"HTTP {code}: {body.error or body.detail or body.wire()}")
    return None


def _need(c: Criterion) -> str:
    return f"{c.name} need {c.op} {c.threshold}, got {c.value}"


def _await_transition(args, r: Replica, tid: str) -> None:
    """Poll GET /status until transition tid has an outcome, or --timeout."""
    step = ["?"]

    def seen(st: StatusDocument) -> None:
        step[0] = st.active_transition.step if st.active_transition else step[0]

    with _client(args, r.url) as c:
        t = c.follow(tid, args.timeout, args.interval, seen)
    if t is None:
        r.outcome = ReplicaOutcome.TIMEOUT
        r.detail = f"transition {tid} still at step {step[0]} after {fmt_elapsed(args.timeout)}"
        return
    r.outcome = t.outcome if t.outcome is not None else ReplicaOutcome.ERROR
    why = [t.failure]
    if t.rollback_failure:
        why.append("rollback: " + t.rollback_failure)
    r.detail = short("; ".join(x for x in why if x))


def _flip_replica(args, r: Replica, mode: str, force: bool = False) -> Replica:
    start = time.monotonic()
    body = _post_mode(args, r, mode, force=force)
    if body is not None:
        _await_transition(args, r, body.transition.id)
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
    """`kdtreectl rollout --sidecar URL ...`: each replica flipped through its own sidecar, in order (--selector is
    rollout_pods.py's, chosen in cli.py)."""
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
                for c in r.criteria or []:
                    say("  " + criterion_line(c))
        print()
        print(_table(replicas))
        blocked = [r for r in replicas if r.outcome not in (ReplicaOutcome.ALLOWED, ReplicaOutcome.ALREADY)]
        print(f"dry run: {_dry_run_verdict(blocked)}; nothing changed")
        return _failed(blocked) if blocked else OK

    # Every sidecar first: one that cannot take part stops the rollout before anything changes.
    def preflight(r: Replica) -> Replica:
        try:
            with _client(args, r.url) as c:
                st = c.status()
        except Unreachable as e:
            r.outcome, r.detail = ReplicaOutcome.UNREACHABLE, short(e)
            return r
        r.from_mode = st.mode.current
        if st.active_transition:
            r.outcome = ReplicaOutcome.BUSY
            r.detail = short(f"a transition is running: {busy_with(st.active_transition)}")
        return r

    with ThreadPoolExecutor(workers) as pool:
        blocked = [r for r in pool.map(preflight, replicas) if r.outcome != ReplicaOutcome.SKIPPED]
    if blocked:
        for r in blocked:
            say(_line("preflight", r, args.to))
        for r in replicas:
            if r.outcome == ReplicaOutcome.SKIPPED:
                r.detail = "not attempted: a sidecar cannot take part"
        print()
        print(_table(replicas))
        print(
            f"rollout to {args.to} not started: {len(blocked)} sidecar(s) cannot take part; nothing changed"
        )
        return _failed(blocked)

    rest = [replicas[i : i + args.wave] for i in range(args.canary, len(replicas), args.wave)]
    waves = ([("canary", replicas[: args.canary])] if args.canary else []) + [
        (f"wave {n}/{len(rest)}", wave) for n, wave in enumerate(rest, 1)
    ]
    failed: Replica | None = None
    for label, wave in waves:
        with ThreadPoolExecutor(len(wave)) as pool:
            for f in as_completed([pool.submit(_flip_replica, args, r, args.to) for r in wave]):
                r = f.result()
                r.changed = r.outcome == Outcome.SUCCEEDED
                say(_line(label, r, args.to))
        bad = [r for r in wave if r.outcome not in DONE]
        if bad:
            failed = bad[0]
            break

    if failed is not None:
        for r in replicas:
            if r.outcome == ReplicaOutcome.SKIPPED:
                r.detail = f"not attempted: the rollout stopped at {failed.url}"
        if args.rollback_on_failure:
            for r in reversed([r for r in replicas if r.changed]):
                back = Replica(url=r.url, to_mode=r.from_mode or "")
                _flip_replica(args, back, r.from_mode, force=True)
                if back.outcome in DONE:
                    r.outcome, r.changed = ReplicaOutcome.REVERTED, False
                    r.detail = f"flipped back to {r.from_mode} after the rollout stopped"
                else:
                    r.outcome = ReplicaOutcome.REVERT_FAILED
                    r.detail = short(f"flipping back to {r.from_mode}: {back.outcome}: {back.detail}")
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
    return _failed([failed])


def _dry_run_verdict(blocked: list[Replica]) -> str:
    """What stands in the way, by outcome: `1 unreachable or not a sidecar (URL), 2 refused by its gate (URL, URL)`."""
    if not blocked:
        return "every replica would be allowed"
    what = {
        ReplicaOutcome.REFUSED: "refused by its gate",
        ReplicaOutcome.UNREACHABLE: "unreachable or not a sidecar",
    }
    by: dict[Outcome | ReplicaOutcome, list[str]] = {}
    for r in blocked:
        by.setdefault(r.outcome, []).append(r.url)
    return ", ".join(f"{len(urls)} {what.get(o, o)} ({', '.join(urls)})" for o, urls in by.items())


def _failed(replicas: list[Replica]) -> int:
    """7 when a sidecar did not answer as one (unreachable, or not a sidecar), like every kdtreectl command;
    else 1."""
    return UNREACHABLE if any(r.outcome == ReplicaOutcome.UNREACHABLE for r in replicas) else FAILED
