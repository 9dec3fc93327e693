"""kdtreectl: talk to the kdtree sidecar (status, wait for readiness, switch the verify mode, check the stack on
its own hardware), or to the sidecars of several replicas at once (rollout).

--url, --token and --http-timeout go before or after the command."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kdtree.config import ConfigError, Mode
from sidecar.api import StatusDocument
from sidecar.store import Transition
from sidecar.vocabulary import Outcome, Step

from . import check, exit_codes, rollout, rollout_pods
from .client import SidecarClient, Unreachable, busy_with, criterion_line, fmt_elapsed
from .exit_codes import BUSY, CRASHED, FAILED, OK, TIMED_OUT, UNAUTHORIZED, UNREACHABLE, USAGE, readiness
from .settings import CtlSettings, url_flag


def _client(args) -> SidecarClient:
    return SidecarClient(args.url, args.token, args.http_timeout)


def _fail(message: str, code: int) -> int:
    print(f"kdtreectl: {message}", file=sys.stderr)
    return code


def _rank_lines(st: StatusDocument) -> list[str]:
    """One line per rank record: mode, installed, served and fallback counts, parity."""
    lines = []
    for view in st.ranks:
        r, p = view.record, view.record.parity
        fallbacks = ", ".join(f"{k} {v}" for k, v in sorted(r.fallbacks.items())) or "none"
        lines.append(
            f"  rank {r.tp_rank}: {r.mode}"
            + (f" (stale: {view.stale_reason})" if view.stale else "")
            + ("" if r.installed else " NOT installed")
            + f", served kdtree {r.served_kdtree} / original {r.served_original}"
            + f", fallbacks {fallbacks}"
            + f", compared {p.calls_compared} (max rel L2 {p.max_rel_l2}, over tol "
            f"{p.calls_over_tol}, NaN/Inf {p.nan_inf})"
            + (f", pending {r.mode_pending}" if r.mode_pending else "")
        )
    return lines


def _summary(st: StatusDocument) -> str:
    c, cs, probe, mode = st.container, st.container.state, st.probe, st.mode
    marker = st.log.latest_marker
    lines = [
        f"phase:     {st.phase}" + (f" (server: {st.server_phase})" if st.server_phase != st.phase else ""),
        f"ready:     {st.ready} ({st.condition})",
        f"mode:      current {mode.current}, expected now {mode.expected_now}, "
        + (f"mode file {mode.desired_file}" if mode.desired_file else "no mode file"),
        "server:    "
        + (
            f"{cs.status}"
            + (f" exit={cs.exit_code}" if cs.exit_code is not None else "")
            + f" oom={cs.oom_killed} restarts={cs.restart_count}"
            if cs
            else str(c.error or "not known")
        ),
        *(
            [f"desired:   {st.desired_mode.state} {st.desired_mode.content!r}: {st.desired_mode.detail}"]
            if st.desired_mode
            else []
        ),
        f"log:       {marker.text if marker else 'no startup marker yet'}",
        "probe:     "
        + ("none" if probe is None else "ok" if probe.ok else f"{probe.reason}: {probe.detail}")
        + (f" ({probe.latency_s:.3f}s" if probe and probe.latency_s is not None else "")
        + (f", {probe.verify_steps} verify steps" if probe and probe.verify_steps is not None else "")
        + (")" if probe and probe.latency_s is not None else ""),
        "verify:    "
        + (
            f"accept length {sp.accept_length:.2f}"
            if (sp := st.speculation).accept_length
            else "accept length not known"
        )
        + (f", {sp.verify_tokens} tokens a request" if sp.verify_tokens else "")
        + (
            f" (auto budget: {sp.mean_verify_tokens:.1f} verified on average)"
            if sp.mean_verify_tokens
            else ""
        ),
        f"ranks:     {len(st.ranks)} records, expected {st.expected_tp_size}",
        *_rank_lines(st),
    ]
    lines += [f"  problem: {p}" for p in st.reasons]
    t = st.active_transition
    if t:
        lines.append(f"transition {t.id}: {t.from_mode} -> {t.to_mode} ({t.method}) at step {t.step}")
    elif st.transitions:
        lines += _last_transition(st.transitions[-1])
    for line in st.log.crash_excerpt:
        lines.append(f"  | {line}")
    return "\n".join(lines)


def _last_transition(t: Transition) -> list[str]:
    """The latest finished transition: how it ended, how long ago, and why it failed or was rolled back."""
    took = f", took {t.duration_s:.1f}s" if t.duration_s is not None else ""
    ago = f", {fmt_elapsed(max(0.0, time.time() - t.finished_at))} ago" if t.finished_at else ""
    lines = [
        f"last:      {t.from_mode} -> {t.to_mode} ({t.method}{', forced' if t.force else ''}) {t.outcome}"
        f"{took}{ago} (transition {t.id})"
    ]
    lines += [f"  reason: {t.reason}"] if t.reason else []
    lines += [f"  failure: {t.failure}"] if t.failure else []
    lines += [f"  rollback: {t.rollback_note}"] if t.rollback_note else []
    lines += [f"  rollback failed too: {t.rollback_failure}"] if t.rollback_failure else []
    return lines


def cmd_status(args) -> int:
    """The summary (or the document), and the stack's readiness as the exit code: 0, 3 crashed, 8 not ready."""
    try:
        with _client(args) as c:
            raw = c.status_json()
            st = c.parse_status(raw)
    except Unreachable as e:
        return _fail(str(e), UNREACHABLE)
    print(json.dumps(raw, indent=2) if args.json else _summary(st))
    return readiness(st)


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
    st, answered = None, False
    with _client(args) as c:
        while True:
            elapsed = time.monotonic() - start
            try:
                st = c.status()
                answered = True
            except Unreachable as e:
                progress.show(f"sidecar unreachable ({e}) elapsed {fmt_elapsed(elapsed)}")
                st = None
            if st:
                marker = st.log.latest_marker.text if st.log.latest_marker else "-"
                progress.show(f"{st.phase} | {marker} elapsed {fmt_elapsed(elapsed)}")
                verdict = readiness(st)
                if verdict == OK:
                    progress.done()
                    print(f"ready after {fmt_elapsed(elapsed)} in mode {st.mode.current}")
                    return OK
                if verdict == CRASHED:
                    progress.done()
                    print("the server crashed:", file=sys.stderr)
                    for r in st.reasons:
                        print(f"  {r}", file=sys.stderr)
                    for line in st.log.crash_excerpt:
                        print(f"  | {line}", file=sys.stderr)
                    return CRASHED
            if elapsed >= args.timeout:
                progress.done()
                if not answered:
                    return _fail(
                        f"the sidecar at {args.url} never answered in {fmt_elapsed(elapsed)}", UNREACHABLE
                    )
                why = "; ".join(st.reasons) if st else "the sidecar stopped answering"
                return _fail(f"not ready after {fmt_elapsed(elapsed)}: {why}", TIMED_OUT)
            time.sleep(min(args.interval, max(0.0, args.timeout - elapsed)))


def cmd_mode(args) -> int:
    try:
        with _client(args) as c:
            code, body = c.post_mode(
                args.mode, dry_run=args.dry_run, force=args.force, restart=args.restart, reason=args.reason
            )
    except Unreachable as e:
        return _fail(str(e), UNREACHABLE)
    if code in (401, 403):
        return _fail(f"{body.detail} (pass --token or set KDTREE_ADMIN_TOKEN)", UNAUTHORIZED)
    if code == 409:
        return _fail(f"{body.error}: {busy_with(body.transition)}", BUSY)
    if code in (413, 422):
        return _fail(f"the sidecar refused the request ({code}): {body.detail}", USAGE)
    print(f"{body.from_mode} -> {body.to_mode}" + (f" ({body.method})" if body.method else ""))
    for criterion in body.criteria:
        print("  " + criterion_line(criterion))
    if code == 200:
        if body.dry_run and body.changed is not False:
            print("dry run: " + ("would be allowed" if body.allowed else "would be refused"))
            return OK if body.allowed else FAILED
        print(body.detail or "nothing to do")
        return OK
    if code != 202 or not isinstance(body.transition, Transition):
        return _fail(str(body.error or body.wire()), FAILED)
    if body.warning:
        print(f"WARNING: {body.warning}", file=sys.stderr)
    tid = body.transition.id
    print(f"transition {tid} accepted")
    return _follow(args, tid) if args.wait else OK


def _follow(args, tid: str) -> int:
    """Show the transition's steps (and, live, the ranks confirming) until its outcome."""
    start = time.monotonic()
    progress = _Progress()

    def show(st: StatusDocument) -> None:
        t = st.active_transition
        step = t.step if t else "?"
        if t and step == Step.AWAITING_RANKS:
            step += f" | {t.ranks_confirmed}/{st.expected_tp_size} ranks in {t.to_mode}"
        progress.show(f"{step} | {st.server_phase} elapsed {fmt_elapsed(time.monotonic() - start)}")

    with _client(args) as c:
        t = c.follow(tid, args.timeout, args.interval, show)
    progress.done()
    if t is None:
        return _fail(f"transition {tid} still running after {fmt_elapsed(args.timeout)}", TIMED_OUT)
    took = f"{t.method}, {t.duration_s:.1f}s" if t.duration_s is not None else t.method
    if t.outcome == Outcome.SUCCEEDED:
        confirmed = f"; every rank confirmed after {t.confirmed_s:.1f}s" if t.confirmed_s else ""
        print(f"mode is now {t.to_mode} ({took}{confirmed})")
        return OK
    print(f"transition {t.outcome} ({took}): {t.failure}", file=sys.stderr)
    if t.rollback_note:
        print(t.rollback_note, file=sys.stderr)
    if t.rollback_failure:
        print(f"rollback failed too: {t.rollback_failure}", file=sys.stderr)
    return FAILED


def count_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return value

    return parse


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown (never the token's: it comes from the environment), descriptions kept as written."""

    def _get_help_string(self, action):
        return action.help if action.dest == "token" else super()._get_help_string(action)


STATUS_HELP = """\
The sidecar's GET /status, summarised: the phase and readiness, the verify mode (current, expected, the mode
file's), the server container, the latest startup marker, the latest completion probe, the verify line, then
each rank's record (mode, calls served by kdtree and by SGLang's kernel, fallbacks, validate's parity), and the
transition running or, when none runs, the latest one: how it ended and, after a rollback, why.

A rank's "served kdtree ... / original ...": the target-verify calls answered by kdtree's kernel, and by the
original, SGLang's own Triton kernel that kdtree's hook wraps (by the mode's choice, or as a fallback, whose reason
"fallbacks" names). Both count from the rank's start and a live flip resets neither: in on, original holds what
was served before the flip. On a real server original counts calls made from Python (eager calls and CUDA-graph
captures) and kdtree counts graph replays too: compare each with itself over time, not with the other.

The verify line, with speculative decoding: the probe's accept length (tokens a verify step gave it), the tokens
one verify reads a request (N: DDTREE's budget + 1), and under DDTREE's auto budget the tokens it verified a
request on average (rank 0's record: auto cuts the tree, or runs DFlash's chain, where that pays).
"""

WAIT_HELP = """\
Poll the sidecar's GET /status until the server is ready (its completion probe passed), printing the
phase and the latest startup marker as it goes; return at once when the server crashed, with the reasons and the
last lines of its log, or when --timeout passes. An unreachable sidecar is waited for, up to --timeout.
"""

MODE_HELP = """\
Switch the verify mode through the sidecar's POST /mode: the gate first (to on: validate-mode evidence on every
rank; to validate: the server answers; to standby, the live remedy, and to off, the kill switch: never gated),
then the flip and a bake, rolled back on failure; off preempts a transition that is running. Between validate,
on and standby the ranks switch live (seconds, no restart); to or from off, or with --restart, the server
restarts (minutes on a large model).

--dry-run changes nothing and still needs the token: POST /mode is one admin endpoint, authenticated before
its body is read, so that nobody without the token makes the sidecar parse anything or evaluate the gate on
demand. The same evidence is public in `kdtreectl status` (each rank's counters and parity).
"""


def _global_flags(*, defaults: bool) -> argparse.ArgumentParser:
    """--url, --token, --http-timeout, as a parent parser: kdtreectl's own with their defaults, and every
    command's without (argparse.SUPPRESS), so that they go after the command too and a command never resets
    one given before it."""

    def default(value):
        return value if defaults else argparse.SUPPRESS

    env = CtlSettings.load()
    if defaults and env.token_problem:  # once: the commands that need no token still run
        print(
            f"kdtreectl: warning: no admin token from the environment: {env.token_problem}", file=sys.stderr
        )
    token = env.admin_token.get_secret_value() if env.admin_token else None
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--url",
        type=url_flag("KDTREE_SIDECAR_URL"),
        default=default(env.sidecar_url),
        help="sidecar base URL (env KDTREE_SIDECAR_URL)",
    )
    p.add_argument(
        "--token",
        default=default(token),
        help="admin bearer token for mode changes (env KDTREE_ADMIN_TOKEN or KDTREE_ADMIN_TOKEN_FILE; never shown here)",
    )
    p.add_argument("--http-timeout", type=float, default=default(60.0), help="seconds per HTTP request")
    return p


def _rollout(args) -> int:
    """--selector: the rollout the cluster holds (rollout_pods.py); --sidecar: the one this process holds (rollout.py)."""
    return rollout_pods.cmd_rollout_pods(args) if args.selector is not None else rollout.cmd_rollout(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kdtreectl",
        description=__doc__,
        epilog=exit_codes.help_text(),
        formatter_class=_Help,
        parents=[_global_flags(defaults=True)],
    )
    common = {"formatter_class": _Help, "parents": [_global_flags(defaults=False)]}
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "status", help="phase, evidence, ranks and transitions", description=STATUS_HELP, **common
    )
    s.add_argument("--json", action="store_true", help="the whole /status document")
    s.set_defaults(func=cmd_status)

    w = sub.add_parser(
        "wait",
        help="wait until the server is ready; fail fast when it crashed",
        description=WAIT_HELP,
        **common,
    )
    w.add_argument("--timeout", type=float, default=1800.0, help="seconds")
    w.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    w.set_defaults(func=cmd_wait)

    m = sub.add_parser(
        "mode",
        help="switch the verify mode (gated to on; off always allowed)",
        description=MODE_HELP,
        **common,
    )
    m.add_argument(
        "mode",
        choices=[m.value for m in Mode],
        help="off: SGLang's Triton path only (kill switch); validate: Triton serves, kdtree is compared; "
        "on: kdtree serves; standby: kdtree installed and idle",
    )
    m.add_argument("--dry-run", action="store_true", help="evaluate the gate, change nothing")
    m.add_argument("--force", action="store_true", help="skip the gate (recorded in the audit log)")
    m.add_argument(
        "--restart", action="store_true", help="restart the server even where a live switch would do"
    )
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
        description=rollout.ROLLOUT_HELP,
        **common,
    )
    r.add_argument("--to", required=True, choices=[m.value for m in Mode], help="the target mode")
    which = r.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--sidecar",
        action="append",
        metavar="URL",
        help="a replica's sidecar URL; repeat for each replica, in rollout order",
    )
    which.add_argument(
        "--selector",
        metavar="LABELS",
        help="the pods of a label selector (e.g. app.kubernetes.io/name=kdtree,app.kubernetes.io/component=inference: "
        "the Deployment's pods, or a LeaderWorkerSet group's leaders and not its workers), in name order: each wave "
        "states the mode in its pods' annotation kdtree.dev/desired-mode and waits for their sidecars to converge; "
        "resumable (run it again)",
    )
    r.add_argument("--namespace", "-n", default="default", help="--selector: the pods' namespace")
    r.add_argument("--kubectl", default="kubectl", metavar="PATH", help="--selector: the kubectl to run")
    r.add_argument(
        "--retry",
        action="store_true",
        help="--selector: state the mode anew (a tagged value) on pods whose sidecar holds it (refused, rolled "
        "back), so that they ask their gate again",
    )
    r.add_argument("--canary", type=count_at_least(0), default=1, help="replicas flipped first, together")
    r.add_argument(
        "--wave", type=count_at_least(1), default=1, help="replicas flipped concurrently after them"
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
    r.set_defaults(func=_rollout)

    check.add_parser(sub, common)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        parser = (
            build_parser()
        )  # reads kdtreectl's variables (their token file included) for the flags' defaults
    except ConfigError as e:
        return _fail(f"error: {e}", USAGE)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
