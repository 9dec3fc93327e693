"""Prometheus metrics: kdtree_ prefix, base units, counters end in _total.

Per-rank series come from the rank records read at scrape time (GET /metrics reads them on the state volume's
thread first, then a custom collector turns them into series), so they are never stale copies; the rank counters
reset when the server restarts, which Prometheus' rate() handles. A non-finite parity value is exported as
Prometheus writes it (+Inf, -Inf, NaN). Records of ranks at or above the expected count (left in the state volume
by an earlier, larger --tp-size) are not this server's ranks and are not exported as ranks.

The sidecar's labelled counters start with every known label value at 0, so that increase() sees their first
event (a series that appears at 1 has no earlier sample to increase from).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kdtree.config import Mode
from kdtree.state.rank_records import RankView

from .probe import REASONS as PROBE_FAILURE_REASONS
from .rank_evidence import fp8_bound
from .vocabulary import Condition, Method, Outcome, Phase


class RankCollector(Collector):
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        up = GaugeMetricFamily(
            "kdtree_rank_up", "1 when the rank's record is live, 0 when stale", labels=["rank"]
        )
        installed = GaugeMetricFamily(
            "kdtree_rank_installed", "1 when the kdtree hook is installed", labels=["rank"]
        )
        compared = CounterMetricFamily(
            "kdtree_rank_parity_calls_compared", "verify calls compared in validate mode", labels=["rank"]
        )
        over_tol = CounterMetricFamily(
            "kdtree_rank_parity_calls_over_tol", "compared calls over tolerance", labels=["rank"]
        )
        nan_inf = CounterMetricFamily(
            "kdtree_rank_parity_nan_inf", "compared calls with NaN/Inf in kdtree's output", labels=["rank"]
        )
        rel = GaugeMetricFamily(
            "kdtree_rank_parity_max_rel_l2", "largest relative L2 error seen", labels=["rank"]
        )
        abs_err = GaugeMetricFamily(
            "kdtree_rank_parity_max_abs_err", "largest absolute error seen", labels=["rank"]
        )
        bound = GaugeMetricFamily(
            "kdtree_rank_parity_bound",
            "the gate's bound on the rank's largest relative L2 error: KDTREE_GATE_MAX_REL_ERR, or validate's "
            "tolerance for its fp8 KV pool where larger",
            labels=["rank"],
        )
        served = CounterMetricFamily(
            "kdtree_rank_verify_calls",
            "target-verify calls by the path that served them",
            labels=["rank", "path"],
        )
        fallbacks = CounterMetricFamily(
            "kdtree_rank_fallbacks", "calls kdtree declined, by reason", labels=["rank", "reason"]
        )
        verify_tokens = GaugeMetricFamily(
            "kdtree_rank_verify_tokens",
            "tokens one verify reads a request (the draft tree's size N), from the verify calls the rank recorded",
            labels=["rank"],
        )
        ddtree_steps = CounterMetricFamily(
            "kdtree_rank_ddtree_steps",
            "DDTREE's auto budget: decode steps at each budget it chose",
            labels=["rank", "budget"],
        )
        ddtree_tokens = CounterMetricFamily(
            "kdtree_rank_ddtree_verify_tokens",
            "DDTREE's auto budget: tokens verified a request, summed over requests and steps",
            labels=["rank"],
        )
        ddtree_requests = CounterMetricFamily(
            "kdtree_rank_ddtree_request_steps",
            "DDTREE's auto budget: requests verified, summed over steps (verify_tokens over this: the mean)",
            labels=["rank"],
        )
        for view in self.metrics.rank_views:
            r = view.record
            if self.metrics.expected_ranks and r.tp_rank >= self.metrics.expected_ranks:
                continue  # an earlier, larger server's record (kdtreectl status still shows the file)
            rank = str(r.tp_rank)
            up.add_metric([rank], 0 if view.stale else 1)
            installed.add_metric([rank], 1 if r.installed else 0)
            compared.add_metric([rank], r.parity.calls_compared)
            over_tol.add_metric([rank], r.parity.calls_over_tol)
            nan_inf.add_metric([rank], r.parity.nan_inf)
            rel.add_metric([rank], r.parity.max_rel_l2)
            abs_err.add_metric([rank], r.parity.max_abs_err)
            if self.metrics.gate_max_rel_err is not None:
                bound.add_metric([rank], max(self.metrics.gate_max_rel_err, fp8_bound(r) or 0.0))
            served.add_metric([rank, "kdtree"], r.served_kdtree)
            served.add_metric([rank, "original"], r.served_original)
            for reason, count in r.fallbacks.items():
                fallbacks.add_metric([rank, reason], count)
            if r.verify_tokens is not None:
                verify_tokens.add_metric([rank], r.verify_tokens)
            if (d := r.ddtree_budget) is not None:
                for budget, steps in d.steps_at.items():
                    ddtree_steps.add_metric([rank, budget], steps)
                ddtree_tokens.add_metric([rank], d.live_tokens)
                ddtree_requests.add_metric([rank], d.request_steps)
        yield from (
            up,
            installed,
            compared,
            over_tol,
            nan_inf,
            rel,
            abs_err,
            bound,
            served,
            fallbacks,
            verify_tokens,
            ddtree_steps,
            ddtree_tokens,
            ddtree_requests,
        )


class Metrics:
    """One registry per app, so several apps (tests) never share series.

    expected_ranks: KDTREE_EXPECTED_TP_SIZE (0: the rank checks are off, every record is exported), exported as
    kdtree_expected_ranks; None where the caller does not say (no gauge, every record exported).
    gate_max_rel_err: KDTREE_GATE_MAX_REL_ERR, from which each rank's kdtree_rank_parity_bound (the bound the gate
    holds its largest error to) is exported; None where the caller does not say (no such series)."""

    def __init__(self, expected_ranks: int | None = None, gate_max_rel_err: float | None = None):
        self.rank_views: list[RankView] = []  # the records read for the scrape in progress
        self.expected_ranks = expected_ranks
        self.gate_max_rel_err = gate_max_rel_err
        self.registry = CollectorRegistry()
        r = self.registry
        self.probe_duration = Histogram(
            "kdtree_probe_duration_seconds",
            "completion probe latency",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.probe_failures = Counter(
            "kdtree_probe_failures", "failed completion probes, by reason", ["reason"], registry=r
        )
        self.accept_length = Gauge(
            "kdtree_probe_accept_length",
            "tokens a verify step gave the latest successful probe (SGLang's accept length); 0 before one",
            registry=r,
        )
        self.assessments = Counter(
            "kdtree_readiness_assessments",
            "the sidecar's readiness assessments (GET /ready, GET /status, a transition's checks); kdtree_ready, "
            "kdtree_condition and kdtree_server_phase are the latest one's, and only as fresh",
            registry=r,
        )
        self.ready = Gauge(
            "kdtree_ready",
            "1 when the sidecar's latest assessment (GET /ready, GET /status, a transition's checks) is ready",
            registry=r,
        )
        self.phase = Enum(
            "kdtree_server_phase",
            "the server's phase as the sidecar sees it",
            states=[p.value for p in Phase],
            registry=r,
        )
        self.condition = Enum(
            "kdtree_condition",
            "ready, not_ready_yet (starting within its budget, or a transition runs) or broken (needs someone)",
            states=[c.value for c in Condition],
            registry=r,
        )
        self.mode = Enum(
            "kdtree_mode", "the verify mode the server runs in", states=[m.value for m in Mode], registry=r
        )
        self.transitions = Counter(
            "kdtree_transitions",
            "mode transitions, by outcome",
            ["from_mode", "to_mode", "outcome"],
            registry=r,
        )
        self.gate_refusals = Counter(
            "kdtree_gate_refusals", "POST /mode requests refused by the gate", ["to_mode"], registry=r
        )
        self.flip_duration = Histogram(
            "kdtree_flip_duration_seconds",
            "mode transitions, from the request to the outcome, by method (live or restart)",
            ["method"],
            buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600),
            registry=r,
        )
        # Every known label value from the start, at 0: increase() then sees each first event.
        for method in Method:
            self.flip_duration.labels(method=method.value)
        for reason in PROBE_FAILURE_REASONS:
            self.probe_failures.labels(reason=reason)
        modes = [m.value for m in Mode]
        for to_mode in modes:
            self.gate_refusals.labels(to_mode=to_mode)
            for from_mode in modes:
                for outcome in Outcome if from_mode != to_mode else ():
                    self.transitions.labels(from_mode=from_mode, to_mode=to_mode, outcome=outcome.value)
        if expected_ranks is not None:
            Gauge(
                "kdtree_expected_ranks",
                "tensor-parallel ranks the sidecar expects to report (KDTREE_EXPECTED_TP_SIZE; 0: not checked)",
                registry=r,
            ).set(expected_ranks)
        r.register(RankCollector(self))
