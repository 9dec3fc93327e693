"""kdtreectl's exit codes: one list for every command, its --help and docs/configuration.md (a test keeps them equal)."""

from __future__ import annotations

import textwrap

from sidecar.api import StatusDocument
from sidecar.vocabulary import Phase

OK, FAILED, USAGE, CRASHED, TIMED_OUT, BUSY, UNAUTHORIZED, UNREACHABLE, NOT_READY = range(9)

MEANINGS = {
    OK: "ok: ready, done, or a dry run that would be allowed",
    FAILED: "refused by a gate (or would be, in a dry run), rolled back, a rollout stopped, or a check failed",
    USAGE: "bad input (check: also a server not reachable at --server-url, or a stack in off)",
    CRASHED: "the server crashed (status, wait, check)",
    TIMED_OUT: "timed out (wait, mode --wait)",
    BUSY: "another transition is running (mode, check)",
    UNAUTHORIZED: "not authorized (mode)",
    UNREACHABLE: "the sidecar is unreachable or not a sidecar (every command), or kubectl failed (rollout --selector)",
    NOT_READY: "the stack is not ready and has not crashed: starting, switching or broken (status, check)",
}


def help_text() -> str:
    """The codes as --help lists them."""
    return "Exit codes:\n" + "\n".join(f"  {code}  {text}" for code, text in MEANINGS.items())


def listing(meanings: dict[int, str]) -> str:
    """One command's own wording of the codes it returns, as its --help ends: "Exit codes: 0 ..., 1 ..."."""
    text = ", ".join(f"{code} {meanings[code]}" for code in sorted(meanings))
    return textwrap.fill(f"Exit codes: {text}.", width=110) + "\n"


def readiness(status: StatusDocument) -> int:
    """What a /status document means for a command that needs the stack ready: OK, CRASHED or NOT_READY."""
    if status.ready and status.phase == Phase.READY:
        return OK
    return CRASHED if status.phase == Phase.CRASHED else NOT_READY
