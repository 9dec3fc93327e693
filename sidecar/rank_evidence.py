"""The ranks' evidence, read once per look at the state volume and shared by readiness, the gate, the bake and
/status: every rank record and the mode file (read_volume, on the state volume's thread), and what they show (are
all ranks there in the right mode; did kdtree do its work during a bake). Nothing here but read_volume touches a file.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel

from kdtree.config import FP8_PARITY_RTOL, Mode
from kdtree.state.mode_file import read_desired_mode
from kdtree.state.rank_records import RankRecord, RankView, read_records, work_between

from .settings import SidecarSettings


class RankCheck(BaseModel):
    ok: bool
    problems: list[str]
    ranks: list[RankView]


class VolumeReading(BaseModel):
    """What the sidecar reads from the state volume for one assessment (on the volume's thread)."""

    views: list[RankView]
    mode_file: Mode | None = None  # None: no mode file
    mode_file_error: str | None = None
    # A group's leader (sidecar/group_leader.py) adds what its workers' sidecars reported, by node: why a node's
    # ranks are unread, when each node's server started, what each node's mode file says, and what is wrong with a
    # node.
    unreachable: dict[int, str] = {}
    node_started_at: dict[int, float | None] = {}
    node_mode_files: dict[int, str | None] = {}
    node_problems: list[str] = []


def fp8_bound(record: RankRecord) -> float | None:
    """validate's bound for the fp8 KV pool a rank read (kdtree.config.FP8_PARITY_RTOL, by the dtype its record's
    `verify_inputs` name); None when its pool is not fp8. On an fp8 pool the original (SGLang's Triton kernel) runs fp8
    math and kdtree widens the pool exactly, so the two differ by Triton's own fp8 error, a few percent
    (kernel_build/NOTES.md, "fp8 pools")."""
    # describe_call writes kv_pool as [dtype, shape, width]; anything else names no pool (a record is the server
    # process's writing: its shape is checked here, not trusted)
    pools = {
        d["kv_pool"][0]
        for d in record.verify_inputs.values()
        if isinstance(d, dict) and isinstance(d.get("kv_pool"), list) and d["kv_pool"]
    }
    pools = {p for p in pools if isinstance(p, str)}
    bounds = [FP8_PARITY_RTOL[p] for p in pools if p in FP8_PARITY_RTOL]
    return max(bounds) if bounds else None


def read_rank_views(settings: SidecarSettings) -> list[RankView]:
    """Every rank record in the state directory (blocking file reads: run it on the state volume's thread)."""
    # the expected ranks and a margin (a larger earlier --tp-size's leftovers are shown, not counted)
    limit = settings.expected_tp_size + 64 if settings.expected_tp_size else 1024
    return read_records(settings.state_dir, max_age_s=settings.heartbeat_stale_s, limit=limit)


def read_volume(settings: SidecarSettings) -> VolumeReading:
    """The rank records and the mode file (blocking reads: StateVolume.read runs it on its thread)."""
    try:
        mode, error = read_desired_mode(settings.state_dir), None
    except (OSError, ValueError) as e:
        mode, error = None, str(e)
    return VolumeReading(views=read_rank_views(settings), mode_file=mode, mode_file_error=error)


def mode_file_text(snap: VolumeReading | None) -> str | None:
    """The mode file as /status shows it."""
    if snap is None:
        return "unread: the state volume did not answer"
    if snap.mode_file_error:
        return f"unreadable: {snap.mode_file_error}"
    return snap.mode_file.value if snap.mode_file else None


def repair(expected: Mode) -> str:
    """The request that rewrites every mode file from the mode `expected`: that mode again, which the gate does
    not hold up (admission), or the kill switch."""
    return f"POST /mode {expected}" + ("" if expected == Mode.OFF else " (or off)")


def mode_file_problems(snap: VolumeReading | None, expected: Mode) -> list[str]:
    """A mode file that is unreadable or disagrees with the mode the sidecar expects (no transition running): the
    ranks follow the file all the same."""
    if snap is None:
        return []
    if snap.mode_file_error:
        return [
            f"the mode file is unreadable ({snap.mode_file_error}): the ranks keep the mode they have; "
            f"{repair(expected)} rewrites it"
        ]
    if snap.mode_file is not None and snap.mode_file != expected:
        return [
            f"the mode file says {snap.mode_file} and the sidecar expects {expected}: the ranks follow the "
            f"file, so they may serve {snap.mode_file}, which no bake approved; {repair(expected)} rewrites it"
        ]
    return []


def node_mode_file_problems(snap: VolumeReading | None, expected: Mode) -> list[str]:
    """A group's worker whose mode file disagrees with the group's mode (no transition running). A node without a
    mode file is no problem here, as on one node: its ranks run the mode they started in, which the rank check
    holds against the group's."""
    if snap is None:
        return []
    return [
        f"node {node}: its mode file says {says} and the group's mode is {expected}: its ranks follow "
        f"their file; {repair(expected)} to the leader rewrites every node's"
        for node, says in sorted(snap.node_mode_files.items())
        if says and says != expected.value
    ]


def check_ranks(
    settings: SidecarSettings,
    views: list[RankView],
    modes: Mode | Iterable[Mode],
    started_after: float | None = None,
    *,
    ranks: range | None = None,
    unreachable: dict[int, str] | None = None,
    node_after: dict[int, float | None] | None = None,
) -> RankCheck:
    """Every expected rank has a live record in one of `modes`, with the hook installed unless it is off.

    `modes` is one mode, or both ends of a live switch while the ranks make it (each rank switches on its own).
    started_after: records written by processes started before this time (the previous server) do not count.
    A group: `ranks` a worker's own node's (sidecar/group_worker.py); on the leader (sidecar/group_leader.py),
    `unreachable` the nodes whose sidecar did not answer (why), `node_after` each node's own started_after (its
    server starts apart from the leader's).
    """
    modes = {modes} if isinstance(modes, Mode) else set(modes)
    expected = " or ".join(sorted(m.value for m in modes))
    by_rank = {v.record.tp_rank: v for v in views}
    problems = []
    for rank in ranks if ranks is not None else range(settings.expected_tp_size):
        view, name, node = by_rank.get(rank), settings.rank_name(rank), settings.node_of(rank)
        after = node_after.get(node) if node_after is not None and node in node_after else started_after
        if view is None:
            if unreachable and node in unreachable:
                problems.append(f"{name}: unread: {unreachable[node]}")
            elif node == settings.node_rank:
                problems.append(f"{name}: no record in {settings.state_dir}")
            else:
                problems.append(f"{name}: no record on its node")
            continue
        rec = view.record
        if view.stale:
            problems.append(f"{name}: record is stale ({view.stale_reason})")
        elif after is not None and rec.started_at < after:
            problems.append(f"{name}: record is from a server started before the restart")
        elif rec.mode not in {m.value for m in modes}:
            problems.append(f"{name}: reports mode {rec.mode}, expected {expected}")
        elif rec.mode != Mode.OFF and not rec.installed:
            problems.append(f"{name}: kdtree hook not installed ({rec.last_error or 'no error recorded'})")
    return RankCheck(ok=not problems, problems=problems, ranks=views)


def live_records(settings: SidecarSettings, views: list[RankView]) -> dict[int, RankRecord]:
    """The expected ranks' records that are not stale, by rank."""
    return {
        v.record.tp_rank: v.record
        for v in views
        if not v.stale and 0 <= v.record.tp_rank < settings.expected_tp_size
    }


def bake_evidence(
    settings: SidecarSettings, mode: Mode, before: dict[int, RankRecord], after: dict[int, RankRecord]
) -> list[str]:
    """What the bake window must show on every expected rank, records taken at its start and its end.

    on: kdtree served verify calls (served_kdtree grew); validate: calls were compared (calls_compared grew).
    In both: no new fallback, no rank restarted or stale. standby and off ask nothing of kdtree.
    """
    if mode not in (Mode.ON, Mode.VALIDATE):
        return []
    problems = []
    for rank in range(settings.expected_tp_size):
        a, b = before.get(rank), after.get(rank)
        if a is None or b is None:
            problems.append(
                f"rank {rank}: no live record at the {'start' if a is None else 'end'} of the bake"
            )
            continue
        work = work_between(a, b)
        if work.restarted:
            problems.append(f"rank {rank}: restarted during the bake (pid {a.pid} -> {b.pid})")
            continue
        if mode == Mode.ON and work.served <= 0:
            problems.append(
                f"rank {rank}: kdtree served no verify call during the bake "
                f"(served_kdtree {a.served_kdtree} -> {b.served_kdtree})"
            )
        if mode == Mode.VALIDATE and work.compared <= 0:
            problems.append(
                f"rank {rank}: no verify call was compared during the bake "
                f"(calls_compared {a.parity.calls_compared} -> {b.parity.calls_compared})"
            )
        if work.fallbacks_grew:
            problems.append(
                f"rank {rank}: fallbacks grew during the bake: "
                + ", ".join(f"{r} +{n}" for r, n in sorted(work.fallbacks_grew.items()))
            )
    return problems
