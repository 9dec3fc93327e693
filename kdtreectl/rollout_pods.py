"""`kdtreectl rollout --selector`: a rollout whose intent is held by the cluster, so that it is resumable.

Each wave states the target in its pods' annotation kdtree.dev/desired-mode (kubectl annotate), and each pod's
sidecar converges to it through its own gate, bake and rollback (sidecar/desired_mode.py); the rollout then waits
for each pod's sidecar to report the annotation's value converged (GET /status, desired_mode). Nothing about the
rollout lives in this process: the pods are ordered by name, a pod whose annotation already names the target is not
annotated again, and a pod already converged there counts as done. So a rollout interrupted at any point (the
terminal gone after an annotation, during a wait) is finished by running the same command again, and undone by
running it with `--to` the previous mode. A pod whose sidecar holds the value (refused, rolled back, overridden by
POST /mode) stops the rollout, on every run, until `--retry` states it anew (a tagged value, `on@retry-...`).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

from sidecar.api import StatusDocument
from sidecar.vocabulary import DesiredState, HoldVerdict, Outcome

from .client import SidecarClient, Unreachable, criterion_line, fmt_elapsed, short
from .exit_codes import FAILED, OK, UNREACHABLE, USAGE
from .kube import Kubectl, KubeError, Pod
from .rollout import DONE, Replica, ReplicaOutcome, _dry_run_verdict, _line, _Lines, _table

# where a pod's sidecar address comes from, for the fix of a failed connection
POD_ADDRESS = (
    "the pod's IP from kubectl: run this where pod IPs route, e.g. a Job or a debug pod in the namespace"
)

HELD_OUTCOME = {
    HoldVerdict.REFUSED: ReplicaOutcome.REFUSED,
    HoldVerdict.ROLLED_BACK: Outcome.ROLLED_BACK,
    HoldVerdict.ROLLBACK_FAILED: Outcome.ROLLBACK_FAILED,
    HoldVerdict.ABORTED: Outcome.ABORTED,
    HoldVerdict.PREEMPTED: Outcome.PREEMPTED,
    HoldVerdict.OVERRIDDEN: ReplicaOutcome.OVERRIDDEN,
}


def names(value: str | None, mode: str) -> bool:
    """The annotation value states `mode` (with or without a tag)."""
    return value is not None and value.partition("@")[0] == mode


def _status(args, url: str | None) -> StatusDocument:
    if url is None:
        raise Unreachable("the pod has no IP yet")
    with SidecarClient(
        url, None, args.http_timeout, address_from=POD_ADDRESS
    ) as c:  # GET /status needs no token
        return c.status()


def _settle(args, pod: Pod, r: Replica, value: str) -> None:
    """Until the pod's sidecar reports `value` converged (or held, invalid, or --timeout)."""
    start = time.monotonic()
    deadline = start + args.timeout
    last = "the sidecar has not read the new value yet (the kubelet refreshes the annotation within about a minute)"
    while True:
        try:
            st = _status(args, pod.sidecar_url)
            d = st.desired_mode
            r.from_mode = r.from_mode or st.mode.current
            if d is None:
                r.outcome, r.detail = ReplicaOutcome.ERROR, "its sidecar has no KDTREE_DESIRED_MODE_FILE"
                break
            if d.content == value:
                if d.state == DesiredState.CONVERGED:
                    r.outcome = Outcome.SUCCEEDED if r.changed else ReplicaOutcome.ALREADY
                    r.detail = "" if r.changed else f"already in mode {args.to}"
                    break
                if d.state == DesiredState.HELD and d.hold is not None:
                    r.outcome = HELD_OUTCOME[d.hold.verdict]
                    r.detail = short(f"held: {d.hold.detail} (rerun with --retry to ask again)")
                    break
                if d.state == DesiredState.INVALID:
                    r.outcome, r.detail = ReplicaOutcome.ERROR, short(d.detail)
                    break
                last = f"{d.state}: {d.detail}"
        except Unreachable as e:
            last = f"unreachable: {e}"  # a sidecar restarting mid-flip: waited for
        if time.monotonic() >= deadline:
            r.outcome, r.detail = ReplicaOutcome.TIMEOUT, short(f"after {fmt_elapsed(args.timeout)}: {last}")
            break
        time.sleep(args.interval)
    r.duration_s = time.monotonic() - start


def cmd_rollout_pods(args) -> int:
    kube = Kubectl(args.kubectl, args.namespace)
    say = _Lines()
    try:
        pods = kube.pods(args.selector)
    except KubeError as e:
        print(f"kdtreectl rollout: {e}", file=sys.stderr)
        return UNREACHABLE
    if not pods:
        print(
            f"kdtreectl rollout: no pod in namespace {args.namespace} matches {args.selector!r}",
            file=sys.stderr,
        )
        return USAGE
    replicas = {p.name: Replica(url=f"pod/{p.name}", to_mode=args.to) for p in pods}
    if args.dry_run:
        return _dry_run(args, pods, replicas, say)

    held: set[str] = set()  # pods whose sidecar holds a value naming the target: --retry states it anew

    # Every sidecar first: one that cannot take part stops the rollout before anything is stated.
    def preflight(pod: Pod) -> Replica:
        r = replicas[pod.name]
        try:
            st = _status(args, pod.sidecar_url)
        except Unreachable as e:
            r.outcome, r.detail = ReplicaOutcome.UNREACHABLE, short(e)
            return r
        r.from_mode = st.mode.current
        d = st.desired_mode
        if d is None:
            r.outcome = ReplicaOutcome.ERROR
            r.detail = "its sidecar has no KDTREE_DESIRED_MODE_FILE: the annotation would not be read"
        # "already": converged on a value naming the target before this run; any other pod this run flips (or
        # follows, when an interrupted run stated the value).
        if d is not None and d.state == DesiredState.HELD and names(d.content, args.to):
            held.add(pod.name)
        r.changed = d is None or not (
            d.state == DesiredState.CONVERGED and names(d.content, args.to) and names(pod.desired, args.to)
        )
        return r

    with ThreadPoolExecutor(max(1, min(len(pods), 16))) as pool:
        blocked = [r for r in pool.map(preflight, pods) if r.outcome != ReplicaOutcome.SKIPPED]
    if blocked:
        for r in blocked:
            say(_line("preflight", r, args.to))
        print()
        print(_table(list(replicas.values())))
        print(f"rollout to {args.to} not started: {len(blocked)} pod(s) cannot take part; nothing changed")
        return UNREACHABLE if any(r.outcome == ReplicaOutcome.UNREACHABLE for r in blocked) else FAILED

    rest = [pods[i : i + args.wave] for i in range(args.canary, len(pods), args.wave)]
    waves = ([("canary", pods[: args.canary])] if args.canary else []) + [
        (f"wave {n}/{len(rest)}", wave) for n, wave in enumerate(rest, 1)
    ]
    stated: dict[str, str] = {}  # pod -> the value this run waits for
    previous: dict[str, str] = {}  # pod -> its value before this run changed it
    failed: Replica | None = None
    for label, wave in waves:
        for pod in wave:  # the wave's intent, in the cluster, before any wait
            r = replicas[pod.name]
            value = pod.desired
            if (args.retry and pod.name in held) or not names(value, args.to):
                value = f"{args.to}@retry-{int(time.time())}" if args.retry else args.to
                try:
                    kube.annotate(pod.name, value)
                except KubeError as e:
                    r.outcome, r.detail = ReplicaOutcome.ERROR, short(e)
                    break
                previous[pod.name] = pod.desired or r.from_mode or ""
            stated[pod.name] = value
        waiting = [p for p in wave if p.name in stated]
        with ThreadPoolExecutor(max(1, len(waiting))) as pool:
            list(pool.map(lambda p: _settle(args, p, replicas[p.name], stated[p.name]), waiting))
        for pod in wave:
            say(_line(label, replicas[pod.name], args.to))
        bad = [replicas[p.name] for p in wave if replicas[p.name].outcome not in DONE]
        if bad:
            failed = bad[0]
            break

    if failed is not None:
        for r in replicas.values():
            if r.outcome == ReplicaOutcome.SKIPPED:
                r.detail = f"not attempted: the rollout stopped at {failed.url}"
        if args.rollback_on_failure:
            for pod in reversed([p for p in pods if p.name in previous and replicas[p.name].outcome in DONE]):
                r, back_to = replicas[pod.name], previous[pod.name]
                back = Replica(url=r.url, to_mode=back_to.partition("@")[0], changed=True)
                try:
                    kube.annotate(pod.name, back_to)
                    _settle(args, pod, back, back_to)
                except KubeError as e:
                    back.outcome, back.detail = ReplicaOutcome.ERROR, short(e)
                if back.outcome in DONE:
                    r.outcome, r.changed = ReplicaOutcome.REVERTED, False
                    r.detail = f"its annotation is back at {back_to!r}"
                else:
                    r.outcome = ReplicaOutcome.REVERT_FAILED
                    r.detail = short(f"back to {back_to!r}: {back.outcome}: {back.detail}")
                say(_line("revert", r, args.to))

    rows = list(replicas.values())
    print()
    print(_table(rows))
    if failed is None:
        print(f"rollout to {args.to} done: {len(rows)} pod(s) in mode {args.to}, as their annotations state")
        return OK
    left = [r.url for r in rows if r.outcome in DONE]
    print(
        f"rollout to {args.to} stopped at {failed.url} ({failed.outcome})"
        + (f"; in mode {args.to}: {', '.join(left)}" if left else "")
        + f"; run it again to resume it (--retry asks a held pod again), or with --to {failed.from_mode or 'MODE'} "
        "to undo it",
        file=sys.stderr,
    )
    return UNREACHABLE if failed.outcome == ReplicaOutcome.UNREACHABLE else FAILED


def _dry_run(args, pods: list[Pod], replicas: dict[str, Replica], say) -> int:
    """Each pod's gate (GET /gate, read-only): nothing is stated."""

    def gate(pod: Pod) -> Replica:
        r = replicas[pod.name]
        try:
            if pod.sidecar_url is None:
                raise Unreachable("the pod has no IP yet")
            with SidecarClient(pod.sidecar_url, None, args.http_timeout, address_from=POD_ADDRESS) as c:
                v = c.gate(args.to)
        except Unreachable as e:
            r.outcome, r.detail = ReplicaOutcome.UNREACHABLE, short(e)
            return r
        r.from_mode, r.criteria = v.from_mode, v.criteria
        if v.from_mode == args.to:
            r.outcome = ReplicaOutcome.ALREADY
        elif v.passed:
            r.outcome = ReplicaOutcome.ALLOWED
        else:
            r.outcome = ReplicaOutcome.REFUSED
            r.detail = short("gate failed: " + ", ".join(v.failed) + (f" ({v.detail})" if v.detail else ""))
        return r

    with ThreadPoolExecutor(max(1, min(len(pods), 16))) as pool:
        for r in pool.map(gate, pods):
            say(_line("dry run", r, args.to))
            for c in r.criteria or []:
                say("  " + criterion_line(c))
    rows = list(replicas.values())
    print()
    print(_table(rows))
    blocked = [r for r in rows if r.outcome not in (ReplicaOutcome.ALLOWED, ReplicaOutcome.ALREADY)]
    print(f"dry run: {_dry_run_verdict(blocked)}; nothing stated")
    return (
        (UNREACHABLE if any(r.outcome == ReplicaOutcome.UNREACHABLE for r in blocked) else FAILED)
        if blocked
        else OK
    )
