"""Evidence from the ranks' records: are they all there in the right mode, did kdtree do its work during a bake,
and does validate mode allow `on`. The records come in as read (kdtree.state.rank_records.read_records, on the state
volume's thread): nothing here touches a file.

Parity values may be non-finite (+inf where the reference is all zeros, NaN from a broken output): every
comparison with NaN is false, so a non-finite value is checked for by name and refuses the gate, never passes it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pydantic import BaseModel

from kdtree.config import FP8_PARITY_RTOL, Mode
from kdtree.state.rank_records import RankRecord, RankView, read_records

from .settings import SidecarSettings


class RankCheck(BaseModel):
    ok: bool
    problems: list[str]
    ranks: list[RankView]


def read_rank_views(settings: SidecarSettings) -> list[RankView]:
    """Every rank record in the state directory (blocking file reads: run it on the state volume's thread)."""
    return read_records(settings.state_dir, max_age_s=settings.heartbeat_stale_s)


def check_ranks(
    settings: SidecarSettings,
    views: list[RankView],
    modes: Mode | Iterable[Mode],
    started_after: float | None = None,
) -> RankCheck:
    """Every expected rank has a live record in one of `modes`, with the hook installed unless it is off.

    `modes` is one mode, or both ends of a live switch while the ranks make it (each rank switches on its own).
    started_after: records written by processes started before this time (the previous server) do not count.
    """
    modes = {modes} if isinstance(modes, Mode) else set(modes)
    expected = " or ".join(sorted(m.value for m in modes))
    by_rank = {v.record.tp_rank: v for v in views}
    problems = []
    for rank in range(settings.expected_tp_size):
        view = by_rank.get(rank)
        if view is None:
            problems.append(f"rank {rank}: no record in {settings.state_dir}")
            continue
        rec = view.record
        if view.stale:
            problems.append(f"rank {rank}: record is stale ({view.stale_reason})")
        elif started_after is not None and rec.started_at < started_after:
            problems.append(f"rank {rank}: record is from a server started before the restart")
        elif rec.mode not in {m.value for m in modes}:
            problems.append(f"rank {rank}: reports mode {rec.mode}, expected {expected}")
        elif rec.mode != Mode.OFF and not rec.installed:
            problems.append(
                f"rank {rank}: kdtree hook not installed ({rec.last_error or 'no error recorded'})"
            )
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
        if (a.pid, a.started_at) != (b.pid, b.started_at):
            problems.append(f"rank {rank}: restarted during the bake (pid {a.pid} -> {b.pid})")
            continue
        if mode == Mode.ON and b.served_kdtree <= a.served_kdtree:
            problems.append(
                f"rank {rank}: kdtree served no verify call during the bake "
                f"(served_kdtree {a.served_kdtree} -> {b.served_kdtree})"
            )
        if mode == Mode.VALIDATE and b.parity.calls_compared <= a.parity.calls_compared:
            problems.append(
                f"rank {rank}: no verify call was compared during the bake "
                f"(calls_compared {a.parity.calls_compared} -> {b.parity.calls_compared})"
            )
        grew = {r: n - a.fallbacks.get(r, 0) for r, n in b.fallbacks.items() if n > a.fallbacks.get(r, 0)}
        if grew:
            problems.append(
                f"rank {rank}: fallbacks grew during the bake: "
                + ", ".join(f"{r} +{n}" for r, n in sorted(grew.items()))
            )
    return problems


class Criterion(BaseModel):
    """One condition of a gate: passed when `value <op> threshold` (op: ==, >= or <=) holds."""

    name: str
    value: float | int | bool | None
    op: str
    threshold: float | int | bool | None
    passed: bool
    detail: str = ""


NON_FINITE_CHECKED = ("max_rel_l2", "max_abs_err", "rtol")  # the parity fields that are floats


def non_finite_parity(records: Iterable[RankRecord]) -> list[str]:
    """Each non-finite parity value, named: "rank 1: max_rel_l2 is nan"."""
    return [
        f"rank {r.tp_rank}: {name} is {value}"
        for r in records
        for name in NON_FINITE_CHECKED
        if not math.isfinite(value := getattr(r.parity, name))
    ]


def fp8_bound(record) -> float | None:
    """validate's bound for the fp8 KV pool a rank read (kdtree.config.FP8_PARITY_RTOL, by the dtype its record's
    `verify_inputs` name); None when its pool is not fp8. On an fp8 pool the original (SGLang's Triton kernel) runs fp8
    math and kdtree widens the pool exactly, so the two differ by Triton's own fp8 error, a few percent
    (kernel_build/NOTES.md, "fp8 pools")."""
    pools = {
        str(d["kv_pool"][0])
        for d in record.verify_inputs.values()
        if isinstance(d, dict) and d.get("kv_pool")
    }
    bounds = [FP8_PARITY_RTOL[p] for p in pools if p in FP8_PARITY_RTOL]
    return max(bounds) if bounds else None


def gate_to_on(
    settings: SidecarSettings, views: list[RankView], server_ready: bool, ready_detail: str
) -> list[Criterion]:
    """The criteria for switching to `on`, each with its value, threshold and verdict."""
    live = live_records(settings, views).values()
    in_validate = [r for r in live if r.mode == Mode.VALIDATE.value and r.installed]
    want = settings.expected_tp_size
    all_there = len(in_validate) == want and want > 0
    min_calls = min((r.parity.calls_compared for r in in_validate), default=0)
    rels = [r.parity.max_rel_l2 for r in in_validate]
    # max() skips a NaN that is not first: NaN is the value whenever a rank has one.
    max_rel = math.nan if any(math.isnan(x) for x in rels) else max(rels, default=None)
    fp8 = [b for b in (fp8_bound(r) for r in in_validate) if b is not None]
    rel_bound = max([settings.gate_max_rel_err, *fp8])
    fp8_detail = (
        f"an fp8 KV cache: the bound is the larger of KDTREE_GATE_MAX_REL_ERR and validate's for its dtype ({max(fp8):g})"
        if fp8
        else ""
    )
    non_finite = non_finite_parity(in_validate)
    nan_inf = sum(r.parity.nan_inf for r in in_validate)
    over_tol = sum(r.parity.calls_over_tol for r in in_validate)
    missing = sorted(set(range(want)) - {r.tp_rank for r in in_validate})
    if want == 0:
        ranks_detail = "KDTREE_EXPECTED_TP_SIZE=0: no rank evidence is read, so the gate cannot pass"
    else:
        ranks_detail = f"ranks without a live, installed validate record: {missing}" if missing else ""
    # Parity numbers only count when every rank is in validate: a partial picture is no evidence.
    no_evidence = "" if all_there else "not every rank reports validate mode"
    return [
        Criterion(
            name="server_ready",
            value=server_ready,
            op="==",
            threshold=True,
            passed=server_ready,
            detail=ready_detail,
        ),
        Criterion(
            name="ranks_in_validate",
            op="==",
            value=len(in_validate),
            threshold=want,
            passed=all_there,
            detail=ranks_detail,
        ),
        Criterion(
            name="min_calls_compared",
            op=">=",
            value=min_calls,
            threshold=settings.gate_min_calls,
            detail=no_evidence,
            passed=all_there and min_calls >= settings.gate_min_calls,
        ),
        Criterion(
            name="max_rel_err",
            op="<=",
            value=max_rel,
            threshold=rel_bound,
            detail="; ".join(x for x in (no_evidence, *non_finite, fp8_detail) if x),
            passed=all_there and not non_finite and max_rel is not None and max_rel <= rel_bound,
        ),
        Criterion(
            name="nan_inf",
            op="<=",
            value=nan_inf,
            threshold=settings.gate_max_nan_inf,
            detail=no_evidence,
            passed=all_there and nan_inf <= settings.gate_max_nan_inf,
        ),
        Criterion(
            name="calls_over_tol",
            op="<=",
            value=over_tol,
            threshold=settings.gate_max_calls_over_tol,
            detail=no_evidence,
            passed=all_there and over_tol <= settings.gate_max_calls_over_tol,
        ),
    ]
