"""The words of the sidecar's state machine, each a StrEnum (as kdtree.config.Mode is): the state file, /status,
the metrics, the audit log and kdtreectl spell them as their values, and a value outside them is refused by name."""

from __future__ import annotations

from enum import StrEnum


class Method(StrEnum):
    """How a transition reaches its mode."""

    LIVE = "live"  # every rank switches through the mode file, the server keeps serving
    RESTART = "restart"  # the server restarts in the new mode


class Step(StrEnum):
    """Where a transition is; each step is saved before it is taken.

    live:    accepted -> writing_mode -> awaiting_ranks -> baking -> (succeeded)
    restart: accepted -> writing_mode -> draining (when the server runs) -> restarting -> waiting_ready -> baking
             -> (succeeded)
    any failure -> rolling_back (live, then by restart if that fails) -> (rolled_back | rollback_failed), except
    a flip to off: the kill switch is never rolled back -> (failed), the mode stays off
    """

    ACCEPTED = "accepted"
    WRITING_MODE = "writing_mode"
    AWAITING_RANKS = "awaiting_ranks"  # live: every expected rank must report the new mode
    DRAINING = "draining"  # /ready answers 503 for KDTREE_DRAIN_S before the server is stopped
    RESTARTING = "restarting"
    WAITING_READY = "waiting_ready"
    BAKING = "baking"  # consecutive good probes, kdtree's own work on every rank
    ROLLING_BACK = "rolling_back"


class Outcome(StrEnum):
    """How a transition ended."""

    SUCCEEDED = "succeeded"
    ROLLED_BACK = "rolled_back"  # the forward flip failed, the previous mode is back
    ROLLBACK_FAILED = "rollback_failed"  # neither mode is sure: someone must act
    ABORTED = "aborted"  # interrupted before the mode file changed (the sidecar stopped): nothing to undo
    PREEMPTED = "preempted"  # POST /mode off while it ran; the off transition runs next
    FAILED = "failed"  # a flip to off that did not complete: never rolled back, the mode stays off (a one-way door)


class Phase(StrEnum):
    """What the server looks like to the sidecar (/status' phase; a running transition overrides it)."""

    STARTING = "starting"  # created, or not probed yet
    LOADING = "loading"  # its port is closed: weights and CUDA graphs are loading
    WARMING = "warming"  # the port is open, the first completions are not through yet
    READY = "ready"
    DEGRADED = "degraded"  # it served since its start and fails now, or a rank is missing
    CRASHED = "crashed"
    SWITCHING = "switching"  # a live transition runs
    RESTARTING = "restarting"  # a restart transition runs
    ROLLING_BACK = "rolling_back"


class Condition(StrEnum):
    """Whether a server that is not ready gets there by itself."""

    READY = "ready"
    NOT_READY_YET = "not_ready_yet"  # starting within its budget, or a transition runs
    BROKEN = "broken"  # someone must act


class DesiredState(StrEnum):
    """Where the sidecar stands with the desired mode the cluster holds (sidecar/desired_mode.py)."""

    UNSET = "unset"  # no desired mode stated (the annotation is absent or empty)
    CONVERGED = "converged"  # the server runs in the desired mode
    CONVERGING = "converging"  # the sidecar's flip to it runs
    WAITING = "waiting"  # another transition runs (POST /mode, a rollback): it is asked again afterwards
    HELD = "held"  # refused, rolled back or overridden by POST /mode: not asked again until the value changes
    INVALID = "invalid"  # the file holds no mode (or cannot be read): reported, never acted on


class HoldVerdict(StrEnum):
    """Why a desired value is held (not acted on again until it changes)."""

    REFUSED = "refused"  # the gate refused it (or the sidecar could not restart the server)
    ROLLED_BACK = "rolled_back"  # its flip failed and was rolled back
    ROLLBACK_FAILED = "rollback_failed"
    ABORTED = "aborted"
    PREEMPTED = "preempted"  # POST /mode off preempted its flip
    OVERRIDDEN = "overridden"  # POST /mode asked for another mode while it stood
