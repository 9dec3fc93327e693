"""The desired mode held by the cluster: the sidecar converges the server to the mode a file states, through the same
admission gate, transition, bake and rollback as POST /mode (it asks the controller exactly as POST /mode does).

The file (KDTREE_DESIRED_MODE_FILE; unset: this is off) is, under Kubernetes, the downward API's projection of the
pod annotation kdtree.dev/desired-mode alone (a fieldRef `metadata.annotations['kdtree.dev/desired-mode']`), which
the kubelet refreshes in place after `kubectl annotate` or a GitOps apply. The single annotation, not the whole
`metadata.annotations` map: the file then holds the value and nothing else, so the bounded read sees all of it (the
whole map can be 256 KB: kubectl's last-applied-configuration alone is the pod's spec), with no key="value" escaping
to parse. An absent annotation is an empty file: no desired mode, nothing done. Under compose an operator writes the
file on the state volume (docs/operations.md).

The value is a mode (off, validate, on, standby), optionally with a tag: `on@2026-12-04`. Its generation is a hash
of the whole text: the same text is the same intent. A tag makes a new intent of the same mode, which is how an
operator (or `kdtreectl rollout --retry`) asks again for a value that was held.

Each KDTREE_PROBE_INTERVAL_S the reconciler reads the file and:
- a bad value (no mode, too large, not a regular file) is reported (/status, /metrics, an Event) and never acted on;
- a value the server runs in is converged;
- while any transition runs it waits (and keeps following one it started itself);
- a value held is not acted on again: the gate refused it, its flip was rolled back (or failed, aborted, was
  preempted), or POST /mode asked for another mode while it stood (the kill switch sticks). The hold is persisted
  in the state file and is dropped when the value changes, or when POST /mode asks for the desired mode itself
  (that flip is then followed as the reconciler's own). A flip for the value that ended while no reconciler
  followed it (the sidecar restarted mid-way, and its next start rolled it back) holds the value too;
- otherwise it asks the controller for the mode, as POST /mode would, with a reason that names the value.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import stat
from pathlib import Path

from prometheus_client import Counter, Enum

from kdtree.config import Mode

from .api import DESIRED_MODE_ANNOTATION, DesiredModeStatus, ModeRequest
from .controller import Controller
from .metrics import Metrics
from .pod_events import PodEvents
from .store import DesiredHold, Transition
from .vocabulary import DesiredState, HoldVerdict, Outcome

log = logging.getLogger("kdtree.sidecar")

ANNOTATION = DESIRED_MODE_ANNOTATION
DESIRED_MAX = 256  # bytes: a mode and a tag; a larger file is refused unread
TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
READ_DEADLINE_S = 5.0

HOLD_FOR_OUTCOME = {
    Outcome.ROLLED_BACK: HoldVerdict.ROLLED_BACK,
    Outcome.ROLLBACK_FAILED: HoldVerdict.ROLLBACK_FAILED,
    Outcome.ABORTED: HoldVerdict.ABORTED,
    Outcome.PREEMPTED: HoldVerdict.PREEMPTED,
}


class DesiredValue:
    """One reading of the file: its text, generation and mode, or why it names none."""

    def __init__(self, content: str | None, mode: Mode | None = None, error: str | None = None):
        self.content, self.mode, self.error = content, mode, error
        self.generation = hashlib.sha256(content.encode()).hexdigest()[:12] if content else None


def parse_desired(text: str) -> Mode:
    """`MODE` or `MODE@TAG`; ValueError naming what is wrong and the fix."""
    mode, _, tag = text.partition("@")
    allowed = ", ".join(m.value for m in Mode)
    try:
        parsed = Mode(mode)
    except ValueError:
        raise ValueError(
            f"{text!r} names no mode: set {ANNOTATION} to one of {allowed}, optionally with @TAG"
        ) from None
    if "@" in text and not TAG.fullmatch(tag):
        raise ValueError(
            f"{text!r}: the tag after @ must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit"
        )
    return parsed


def read_desired(path: Path) -> DesiredValue:
    """The file's value. It may be a symbolic link (the downward API's files are), is opened without blocking (a
    FIFO is never waited on) and must be a regular file of at most DESIRED_MAX bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return DesiredValue(None)
    except OSError as e:
        return DesiredValue(
            None, error=f"{path} cannot be read ({e.strerror}): make it readable by uid {os.getuid()}"
        )
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return DesiredValue(None, error=f"{path} is not a regular file")
        data = f.read(DESIRED_MAX + 1)
    if len(data) > DESIRED_MAX:
        return DesiredValue(None, error=f"{path} is more than {DESIRED_MAX} bytes: it holds one mode")
    text = data.decode("utf-8", errors="replace").strip()
    if not text:
        return DesiredValue(None)
    try:
        return DesiredValue(text, parse_desired(text))
    except ValueError as e:
        return DesiredValue(text, error=str(e))


class DesiredModeMetrics:
    def __init__(self, metrics: Metrics):
        r = metrics.registry
        self.state = Enum(
            "kdtree_desired_mode_state",
            "where the sidecar stands with the desired mode the cluster holds (KDTREE_DESIRED_MODE_FILE)",
            states=[s.value for s in DesiredState],
            registry=r,
        )
        self.actions = Counter(
            "kdtree_desired_mode_actions",
            "what the sidecar did about the desired mode: flips asked for, converged, held (by verdict), invalid",
            ["action"],
            registry=r,
        )
        for action in ("flip", "converged", "invalid", *(v.value for v in HoldVerdict)):
            self.actions.labels(action=action)
        self.events = Counter(
            "kdtree_pod_events", "Kubernetes Events posted on the pod, by result", ["result"], registry=r
        )
        for result in ("posted", "failed"):
            self.events.labels(result=result)


class DesiredModeReconciler:
    def __init__(
        self,
        path: Path,
        controller: Controller,
        metrics: Metrics,
        events: PodEvents | None,
        events_note: str,
    ):
        self.path = path
        self.controller = controller
        self.state = controller.state
        self.interval_s = controller.settings.probe_interval_s
        self.metrics = DesiredModeMetrics(metrics)
        self.events, self.events_note = events, events_note
        self.value = DesiredValue(None)
        self.status_state = DesiredState.UNSET
        self.detail = "not read yet"
        self.own: str | None = None  # the transition started for the current value
        self.own_generation: str | None = None
        self.announced: set[tuple[str | None, str]] = set()  # (generation, reason): each Event once
        self._task: asyncio.Task | None = None

    # ---- the loop ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
        if self.events is not None:
            await self.events.close()

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let the loop die: say so, and look again
                log.exception("desired mode: the reconciler failed")
                self._set(
                    DesiredState.INVALID,
                    f"the sidecar failed reading or acting on it: {type(e).__name__}: {e}",
                )
            await asyncio.sleep(self.interval_s)

    async def tick(self) -> None:
        """Read the file once and act on it (the module's docstring)."""
        try:
            async with asyncio.timeout(READ_DEADLINE_S):  # not wait_for: see SingleFlight.get
                value = await asyncio.to_thread(read_desired, self.path)
        except TimeoutError:
            value = DesiredValue(None, error=f"{self.path} did not answer within {READ_DEADLINE_S:g}s")
        self.value = value
        if value.error:
            self._set(DesiredState.INVALID, f"{value.error}; nothing is done until it names a mode")
            await self._announce("Warning", "DesiredModeInvalid", value.error, action="invalid")
            return
        if await self._follow_own():
            return
        if value.mode is None:
            self._set(
                DesiredState.UNSET, f"no desired mode: the file is absent or empty ({ANNOTATION} unset)"
            )
            return
        hold = self.state.desired_hold
        if hold is not None and hold.generation != value.generation:
            self._audit("desired_mode_hold_dropped", held=hold.content, now=value.content)
            self._save_hold(None)
            self._set(DesiredState.WAITING, f"{value.content!r} replaces the held {hold.content!r}: deciding")
            hold = None
        if hold is not None:
            self._set(
                DesiredState.HELD,
                f"{value.content!r} is held ({hold.verdict}: {hold.detail}); not asked again until the value changes "
                f"(a new value or tag, e.g. {value.mode.value}@2), or POST /mode asks for {value.mode.value}",
            )
            return
        if self.controller.running():
            self._set(
                DesiredState.WAITING, "a transition runs; the desired mode is asked for when it has finished"
            )
            return
        if value.mode == self.state.current_mode and await self._mode_file_agrees():
            self._set(DesiredState.CONVERGED, f"the server runs in mode {value.mode}")
            await self._announce(
                "Normal", "DesiredModeConverged", f"the server runs in the desired mode {value.content!r}"
            )
            return
        last = self.state.history[-1] if self.state.history else None
        if (
            last is not None
            and f"generation {value.generation})" in last.reason
            and last.outcome != Outcome.SUCCEEDED
        ):
            # Its flip ended while no reconciler followed it (the sidecar restarted mid-way): as if it had.
            verdict = HOLD_FOR_OUTCOME.get(last.outcome, HoldVerdict.ROLLBACK_FAILED)
            why = "; ".join(x for x in (last.failure, last.rollback_failure) if x) or str(last.outcome)
            await self._hold(value, verdict, why, last.id)
            return
        await self._ask(value)

    async def _mode_file_agrees(self) -> bool:
        """As admission's "nothing to do": a mode file that says another mode is rewritten by a transition."""
        snap = await self.controller.readiness.read_volume()
        current = self.state.current_mode
        return snap is not None and snap.mode_file_error is None and snap.mode_file in (None, current)

    async def _ask(self, value: DesiredValue) -> None:
        """Ask the controller for the mode exactly as POST /mode does."""
        reason = f"desired mode {value.content!r} ({ANNOTATION}, generation {value.generation})"
        self._set(DesiredState.CONVERGING, f"asking for mode {value.mode}: the gate decides")
        code, answer = await self.controller.request_mode(ModeRequest(mode=value.mode, reason=reason))
        if code == 202 and isinstance(answer.transition, Transition):
            self.own, self.own_generation = answer.transition.id, value.generation
            self.metrics.actions.labels(action="flip").inc()
            self._set(
                DesiredState.CONVERGING, f"flipping {answer.from_mode} -> {value.mode} ({answer.method})"
            )
            await self._announce(
                "Normal",
                "DesiredModeFlip",
                f"flipping {answer.from_mode} -> {value.mode} ({answer.method}) for the desired mode {value.content!r}; "
                f"transition {answer.transition.id}",
            )
        elif code == 200:
            self._set(DesiredState.CONVERGED, answer.detail or f"the server runs in mode {value.mode}")
        elif code == 409:
            self._set(
                DesiredState.WAITING, "a transition runs; the desired mode is asked for when it has finished"
            )
        else:  # 412 (the gate), 503 (no server control): held until the value changes
            await self._hold(value, HoldVerdict.REFUSED, answer.error or f"HTTP {code}", None)

    async def _follow_own(self) -> bool:
        """While the transition started for the desired value runs: converging. When it has finished: converged,
        or the value held by its outcome. True while it still runs."""
        if self.own is None:
            return False
        active = self.state.active
        if active is not None and active.id == self.own:
            self._set(DesiredState.CONVERGING, f"transition {self.own} at step {active.step}")
            return True
        done = next((t for t in reversed(self.state.history) if t.id == self.own), None)
        own, generation = self.own, self.own_generation
        self.own = self.own_generation = None
        if done is None:
            return False  # pushed out of the history: read the state afresh
        value = self.value if self.value.generation == generation else None
        if done.outcome == Outcome.SUCCEEDED:
            self.metrics.actions.labels(action="converged").inc()
            if value is not None:
                self._set(
                    DesiredState.CONVERGED,
                    f"transition {own} succeeded: the server runs in mode {done.to_mode}",
                )
                await self._announce(
                    "Normal",
                    "DesiredModeConverged",
                    f"the server runs in the desired mode {value.content!r} ({own})",
                )
            return False
        verdict = HOLD_FOR_OUTCOME.get(done.outcome, HoldVerdict.ROLLBACK_FAILED)
        why = "; ".join(x for x in (done.failure, done.rollback_failure) if x) or str(done.outcome)
        if value is not None:
            await self._hold(value, verdict, why, own)
        return False

    # ---- POST /mode --------------------------------------------------------------------------------------------

    async def operator_asked(self, mode: Mode, transition: Transition) -> None:
        """POST /mode started `transition` to `mode`. To the desired mode: the operator asks again, so the hold is
        dropped and the flip followed as the reconciler's own. To another mode: the desired value is held
        (overridden), so the kill switch sticks until the value changes."""
        value = self.value
        if value.mode is None:
            return
        if mode == value.mode:
            if self.state.desired_hold is not None:
                self._audit(
                    "desired_mode_hold_dropped", held=self.state.desired_hold.content, by="POST /mode"
                )
                self._save_hold(None)
            self.own, self.own_generation = transition.id, value.generation
            self._set(DesiredState.CONVERGING, f"POST /mode asked for {mode}: transition {transition.id}")
            return
        await self._hold(
            value,
            HoldVerdict.OVERRIDDEN,
            f"POST /mode asked for {mode} while the desired mode is {value.content!r}",
            transition.id,
        )

    # ---- what it says --------------------------------------------------------------------------------------------

    async def _hold(
        self, value: DesiredValue, verdict: HoldVerdict, detail: str, transition: str | None
    ) -> None:
        hold = DesiredHold(
            content=value.content,
            generation=value.generation,
            verdict=verdict,
            detail=detail,
            transition=transition,
        )
        self._save_hold(hold)
        self._audit(
            "desired_mode_held", logging.WARNING, content=value.content, verdict=verdict, detail=detail
        )
        self.metrics.actions.labels(action=verdict.value).inc()
        self._set(
            DesiredState.HELD,
            f"{value.content!r} is held ({verdict}: {detail}); not asked again until the value changes",
        )
        reason = "DesiredModeOverridden" if verdict == HoldVerdict.OVERRIDDEN else "DesiredModeHeld"
        await self._announce(
            "Warning",
            reason,
            f"desired mode {value.content!r} {verdict}: {detail}; not retried until it changes",
        )

    def _save_hold(self, hold: DesiredHold | None) -> None:
        self.state.desired_hold = hold
        self.controller.runner.save(fatal=False)  # one the volume does not take stays in memory (/status)

    def _audit(self, event: str, level: int = logging.INFO, **details) -> None:
        self.controller.store.audit(event, None, level, generation=self.value.generation, **details)

    def _set(self, state: DesiredState, detail: str) -> None:
        self.status_state, self.detail = state, detail
        self.metrics.state.state(state.value)

    async def _announce(self, type_: str, reason: str, message: str, *, action: str | None = None) -> None:
        """One Event per (generation, reason) and one count of `action`: the loop's every tick says nothing new."""
        key = (self.value.generation or self.value.content or self.value.error, reason)
        if key in self.announced:
            return
        self.announced.add(key)
        if action:
            self.metrics.actions.labels(action=action).inc()
        log.log(
            logging.WARNING if type_ == "Warning" else logging.INFO, "desired mode: %s: %s", reason, message
        )
        if self.events is not None:
            ok = await self.events.emit(type_, reason, message)
            self.metrics.events.labels(result="posted" if ok else "failed").inc()

    def status(self) -> DesiredModeStatus:
        v = self.value
        events = self.events_note
        if self.events is not None and self.events.last_error:
            events += f"; {self.events.failed} failed, the latest: {self.events.last_error}"
        return DesiredModeStatus(
            file=str(self.path),
            state=self.status_state,
            content=v.content,
            generation=v.generation,
            mode=v.mode,
            detail=self.detail,
            hold=self.state.desired_hold.model_copy() if self.state.desired_hold else None,
            transition=self.own,
            events=events,
        )
