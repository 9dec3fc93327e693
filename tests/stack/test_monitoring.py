"""monitoring/: the Prometheus config, the alert rules and the Grafana dashboard, checked against the sidecar.

Every PromQL expression in them (alert rules, dashboard panels, dashboard annotations and variables) is parsed
with promql-parser (PyPI: Python bindings of the Rust PromQL parser GreptimeDB uses), and every metric it
selects must be one the sidecar exports, read from a real `sidecar.metrics.Metrics` registry. A real parser
rather than a regular expression: function names, keywords (by, on, offset, bool), label names, label values
and durations are never taken for metric names, and an expression Prometheus would reject fails here too.

promtool (Prometheus' own checker) runs where it is found: on PATH, or in build/tools/ where tests/run puts it
(unpacked from Debian's prometheus package). It checks the rule file and the config, and runs the alert
cases in tests/stack/monitoring_alerts_test.yml.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

promql_parser = pytest.importorskip(
    "promql_parser", reason="promql-parser is not installed (the dev extra: pip install -e '.[sidecar,dev]')"
)
yaml = pytest.importorskip(
    "yaml", reason="pyyaml is not installed (the dev extra: pip install -e '.[sidecar,dev]')"
)

from kdtree.config import Mode  # noqa: E402
from kdtree.state.rank_records import new_record, read_records, write_record  # noqa: E402
from sidecar.desired_mode import DesiredModeMetrics  # noqa: E402
from sidecar.metrics import Metrics  # noqa: E402
from sidecar.probe import REASONS  # noqa: E402
from sidecar.settings import SidecarSettings  # noqa: E402
from sidecar.vocabulary import Outcome  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RUNBOOK = REPO / "docs" / "runbook.md"
MONITORING = REPO / "monitoring"
ALERTS = MONITORING / "alerts.yml"
PROMETHEUS = MONITORING / "prometheus.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
ALERT_CASES = Path(__file__).with_name("monitoring_alerts_test.yml")
JOB = "kdtree-sidecar"  # the scrape job: prometheus.yml names it, alerts.yml selects up{job=...} by it

PROMETHEUS_OWN = {"up"}  # written by Prometheus for every target, not by the sidecar

# Names a family's samples take in the exposition format, by type. Needed besides the samples themselves:
# a labelled metric (kdtree_transitions_total{...}) has no sample until its first label set is used.
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "gauge": ("",),
    "stateset": ("",),  # prometheus_client's Enum: one gauge series per state
    "info": ("_info",),
}
# Grafana's variables, replaced by values Prometheus would see, before parsing a dashboard query.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}


# ---- what the sidecar exports ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, str]:
    """{sample name: its metric family's name} for everything a sidecar's GET /metrics can show.

    One rank record is written and read first, as GET /metrics reads them for a scrape, so the per-rank
    collector yields its families with samples."""
    state = tmp_path_factory.mktemp("state")
    record = new_record("validate")
    record.fallbacks = {"dtype": 1}
    write_record(state, record)
    names: dict[str, str] = {}
    metrics = Metrics(expected_ranks=1, gate_max_rel_err=0.02)
    DesiredModeMetrics(metrics)  # registered beside them when KDTREE_DESIRED_MODE_FILE is set
    metrics.rank_views = read_records(state)
    for family in metrics.registry.collect():
        assert family.type in SAMPLE_SUFFIXES, f"{family.name}: type {family.type} not in SAMPLE_SUFFIXES"
        for suffix in SAMPLE_SUFFIXES[family.type]:
            names[family.name + suffix] = family.name
        for sample in family.samples:
            names[sample.name] = family.name
    return names


def family_of(name: str, exported: dict[str, str]) -> str | None:
    """The exported family a sample name belongs to; None when the sidecar has no such metric."""
    return exported.get(name)


def test_the_registry_shows_sidecar_and_rank_metrics(exported):
    """The reference list itself: sidecar metrics, labelled counters without samples, rank metrics."""
    for name in (
        "kdtree_ready",
        "kdtree_probe_duration_seconds_bucket",
        "kdtree_transitions_total",
        "kdtree_rank_up",
        "kdtree_rank_verify_calls_total",
        "kdtree_rank_fallbacks_total",
    ):
        assert name in exported
    assert "kdtree_transitions" not in exported, "a counter is exposed only with _total (and _created)"


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in metrics.registry.collect()
        for s in family.samples
    }


def test_ddtree_auto_budget_counters_come_from_the_rank_record(tmp_path):
    """A rank under KDTREE_DDTREE_BUDGET=auto writes its steps at each budget and the tokens it verified; the sidecar
    exports them per rank (their ratio: tokens verified a request). A record without them exports none."""
    from kdtree.state.rank_records import DdtreeBudget

    record = new_record("on")
    record.ddtree_budget = DdtreeBudget(
        budgets=[3, 7, 15, 16], steps=10, request_steps=30, live_tokens=348, steps_at={"7": 6, "16": 4}
    )
    write_record(tmp_path, record)
    metrics = Metrics(expected_ranks=1)
    metrics.rank_views = read_records(tmp_path)
    got = samples(metrics)
    assert got[("kdtree_rank_ddtree_steps_total", (("budget", "7"), ("rank", "0")))] == 6
    assert got[("kdtree_rank_ddtree_steps_total", (("budget", "16"), ("rank", "0")))] == 4
    assert (
        got[("kdtree_rank_ddtree_verify_tokens_total", (("rank", "0"),))] == 348
    )  # 3 requests x (6 x 8 + 4 x 17)
    assert got[("kdtree_rank_ddtree_request_steps_total", (("rank", "0"),))] == 30
    assert read_records(tmp_path)[0].record.ddtree_budget.mean_verify_tokens == 11.6
    write_record(tmp_path, new_record("on"))
    metrics.rank_views = read_records(tmp_path)
    assert not [k for k in samples(metrics) if k[0].startswith("kdtree_rank_ddtree")]


def test_labelled_counters_start_at_zero_for_every_known_label(tmp_path):
    """So that increase() sees the first event: a series that appears at 1 has nothing to increase from."""
    got = samples(Metrics())
    modes = [m.value for m in Mode]
    for reason in REASONS:
        assert got[("kdtree_probe_failures_total", (("reason", reason),))] == 0
    for to_mode in modes:
        assert got[("kdtree_gate_refusals_total", (("to_mode", to_mode),))] == 0
        for from_mode in modes:
            for outcome in Outcome:
                key = (
                    "kdtree_transitions_total",
                    (("from_mode", from_mode), ("outcome", outcome.value), ("to_mode", to_mode)),
                )
                assert (key in got) == (from_mode != to_mode), key
                assert got.get(key, 0) == 0


def test_records_beyond_the_expected_ranks_are_not_ranks(tmp_path):
    """Rank files left by an earlier, larger --tp-size must not look like stale ranks of this server."""
    for rank in range(4):  # an earlier tp 4 server's records; the current server runs tp 2
        write_record(tmp_path, new_record("validate", tp_rank=rank, tp_size=4 if rank >= 2 else 2))

    def metrics(expected):
        m = Metrics(expected_ranks=expected)
        m.rank_views = read_records(tmp_path)
        return m

    def ranks(m):
        return sorted(dict(labels)["rank"] for name, labels in samples(m) if name == "kdtree_rank_up")

    two = metrics(2)
    assert ranks(two) == ["0", "1"]
    assert samples(two)[("kdtree_expected_ranks", ())] == 2
    assert ranks(metrics(0)) == ["0", "1", "2", "3"]  # rank checks off


# ---- PromQL ----------------------------------------------------------------------------------------------


def selected_metrics(expr: str) -> set[str]:
    """Metric names an expression selects; raises ValueError where Prometheus would reject it."""
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name
            if not name:  # {__name__="..."}
                by_name = [m for m in node.matchers.matchers if m.name == "__name__"]
                if len(by_name) != 1 or by_name[0].op != promql_parser.MatchOp.Equal:
                    raise ValueError(f"select metrics by exact name, not {node}")
                name = by_name[0].value
            names.add(name)

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return names


def unknown_metrics(expr: str, exported: dict[str, str]) -> set[str]:
    return {n for n in selected_metrics(expr) if n not in PROMETHEUS_OWN and family_of(n, exported) is None}


def grafana_to_promql(query: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    assert "$" not in query, f"a Grafana variable GRAFANA_VARIABLES does not know: {query}"
    return query


def test_the_checker_finds_metric_names_only(exported):
    """Functions, keywords, label names and values, durations and numbers are not metrics; a typo is one."""
    expr = (
        'histogram_quantile(0.95, sum by (le, rank) (rate(kdtree_probe_duration_seconds_bucket{rank="up"}[5m])))'
        ' > bool 2 and on (instance) kdtree_mode{kdtree_mode="on"} offset 1h == 1'
        ' or absent(up{job="kdtree-sidecar"}) unless {__name__="kdtree_ready"}'
    )
    assert selected_metrics(expr) == {
        "kdtree_probe_duration_seconds_bucket",
        "kdtree_mode",
        "up",
        "kdtree_ready",
    }
    assert unknown_metrics(expr, exported) == set()
    assert unknown_metrics("kdtree_raedy == 0", exported) == {"kdtree_raedy"}
    assert unknown_metrics("rate(kdtree_transitions[5m])", exported) == {"kdtree_transitions"}  # no _total
    assert unknown_metrics("kdtree_flip_duration_seconds_count", exported) == set()
    assert unknown_metrics("kdtree_flip_duration_seconds_total", exported) == {
        "kdtree_flip_duration_seconds_total"  # a histogram has no _total
    }
    assert unknown_metrics("kdtree_flip_duration_seconds_bucket_x", exported) == {
        "kdtree_flip_duration_seconds_bucket_x"
    }
    with pytest.raises(ValueError):
        selected_metrics("sum(rate(kdtree_ready[5m])")
    with pytest.raises(ValueError):
        selected_metrics('{__name__=~"kdtree_.*"}')


# ---- the files ------------------------------------------------------------------------------------------


def load_alerts() -> dict:
    return yaml.safe_load(ALERTS.read_text())


def alert_rules() -> list[dict]:
    return [rule for group in load_alerts()["groups"] for rule in group["rules"]]


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for panel targets, annotations and query variables, Grafana variables replaced."""
    out = []
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", grafana_to_promql(target["expr"])))
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            out.append((f"annotation {annotation['name']!r}", grafana_to_promql(annotation["expr"])))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
            assert m, f"variable {variable['name']}: only label_values(SELECTOR, LABEL) is checked here"
            out.append((f"variable {variable['name']!r}", grafana_to_promql(m.group(1))))
    return out


def all_queries() -> list[tuple[str, str]]:
    alerts = [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]
    return alerts + dashboard_queries(load_dashboard())


@pytest.mark.parametrize("where, expr", all_queries(), ids=[w for w, _ in all_queries()])
def test_every_query_selects_exported_metrics_only(where, expr, exported):
    unknown = unknown_metrics(expr, exported)
    assert not unknown, f"{where} selects {sorted(unknown)}, which the sidecar does not export: {expr}"


def test_prometheus_config_scrapes_the_compose_sidecar_and_loads_the_rules():
    config = yaml.safe_load(PROMETHEUS.read_text())
    rule_files = [PROMETHEUS.parent / f for f in config["rule_files"]]
    assert ALERTS in rule_files and all(f.is_file() for f in rule_files)
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == JOB]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    # compose.yaml publishes the sidecar on ${KDTREE_BIND_ADDRESS:-A}:${KDTREE_PUBLISH_SIDECAR_PORT:-P}
    published = re.search(
        r"\$\{KDTREE_BIND_ADDRESS:-([^}]+)\}:\$\{KDTREE_PUBLISH_SIDECAR_PORT:-(\d+)\}:8080",
        (REPO / "compose.yaml").read_text(),
    )
    assert published, "compose.yaml no longer publishes the sidecar port as expected"
    assert [t for sc in job["static_configs"] for t in sc["targets"]] == [
        f"{published.group(1)}:{published.group(2)}"
    ]


def commented_jobs() -> list[str]:
    """The scrape jobs prometheus.yml gives in comments (Kubernetes, static Service), uncommented."""
    jobs, current = [], None
    for line in PROMETHEUS.read_text().splitlines():
        if line.startswith("  # - job_name:"):
            current = [line.replace("  # ", "", 1)]
            jobs.append(current)
        elif current is not None and line.startswith("  #   "):
            current.append(line.replace("  # ", "", 1))
        else:
            current = None
    return ["\n".join(job) for job in jobs]


def test_sglang_metrics_are_scraped_from_the_published_server_port():
    """--enable-metrics (compose's command, the manifests' args) serves sglang:* on port 30000; job sglang reads it."""
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "sglang"]
    published = re.search(
        r"\$\{KDTREE_BIND_ADDRESS:-([^}]+)\}:\$\{KDTREE_PUBLISH_SERVER_PORT:-(\d+)\}:30000",
        (REPO / "compose.yaml").read_text(),
    )
    assert published and "--enable-metrics" in (REPO / "compose.yaml").read_text()
    assert [t for sc in job["static_configs"] for t in sc["targets"]] == [f"{published[1]}:{published[2]}"]


def test_commented_scrape_jobs_are_valid_yaml_for_the_same_jobs():
    """Kubernetes pod discovery for both jobs, by the manifests' container port names; and a static Service."""
    deployment = (REPO / "deploy" / "kubernetes" / "base" / "deployment.yaml").read_text()
    jobs = [yaml.safe_load(text)[0] for text in commented_jobs()]
    assert [j["job_name"] for j in jobs] == [JOB, "sglang", JOB]
    for job in jobs[:2]:
        assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
        (port,) = [
            r["regex"]
            for r in job["relabel_configs"]
            if r["source_labels"] == ["__meta_kubernetes_pod_container_port_name"]
        ]
        assert f"- name: {port}\n" in deployment, port
    assert "static_configs" in jobs[2]
    # the sidecar job leaves out a LeaderWorkerSet's workers, whose sidecars answer their leader only
    lws = (
        REPO / "deploy" / "kubernetes" / "overlays" / "leaderworkerset" / "leaderworkerset.yaml"
    ).read_text()
    worker = yaml.safe_load(lws)["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
    dropped = [
        r["regex"]
        for r in jobs[0]["relabel_configs"]
        if r.get("action") == "drop"
        and r["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
    ]
    assert dropped == [worker["app.kubernetes.io/component"]]


REQUIRED_ALERTS = {
    "KdtreeSidecarDown",  # the scrape target is down
    "KdtreeNotReady",  # kdtree_ready == 0 for 10m
    "KdtreeRankStale",  # kdtree_rank_up == 0
    "KdtreeParityOverTolerance",  # validate: calls over tolerance, or the largest error over the gate's
    "KdtreeFallbacksInOn",  # fallbacks growing in on
    "KdtreeTransitionRolledBack",  # outcome rolled_back
    "KdtreeRollbackFailed",  # outcome rollback_failed, or failed (a flip to off that did not complete)
    "KdtreeOnServesNothing",  # on, probes succeed, no kdtree-served verify call
}


def test_alert_rule_file_structure():
    doc = load_alerts()
    assert set(doc) == {"groups"} and doc["groups"]
    names = []
    for group in doc["groups"]:
        assert set(group) == {"name", "rules"} and group["rules"], group.get("name")
        for rule in group["rules"]:
            name = rule.get("alert")
            assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, name
            names.append(name)
            assert re.fullmatch(r"Kdtree[A-Z][A-Za-z]+", name)
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            assert re.fullmatch(r"\d+[smh]", rule["for"]), f"{name}: for {rule['for']!r}"
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
            annotations = rule["annotations"]
            assert set(annotations) == {"summary", "description", "runbook_url"}, name
            # Into docs/runbook.md: an anchor there named after the alert.
            assert annotations["runbook_url"] == f"docs/runbook.md#{name.lower()}", name
            assert f'<a id="{name.lower()}"></a>' in RUNBOOK.read_text(), (
                f"docs/runbook.md: no entry for {name}"
            )
            assert annotations["summary"].strip() and "\n" not in annotations["summary"], name
            # What to do, not only what happened: every description names a kdtreectl command to run.
            assert re.search(
                r"`kdtreectl (status|wait|mode (off|on|validate|standby|\{\{ \$labels\.\w+ \}\}))`",
                annotations["description"],
            ), name
            # `off` is a full restart (minutes of loading): a remedy that names it says why a restart it is.
            if "`kdtreectl mode off`" in annotations["description"]:
                assert "restart" in annotations["description"], name
    assert len(names) == len(set(names)), "alert names repeat"
    listed = set(re.findall(r"`(Kdtree[A-Za-z]+)`", (REPO / "monitoring" / "README.md").read_text()))
    assert listed == set(names), (
        f"monitoring/README.md's list of alerts differs from alerts.yml: {listed ^ set(names)}"
    )
    assert REQUIRED_ALERTS <= set(names), REQUIRED_ALERTS - set(names)


def test_remedies_in_on_are_the_live_standby_switch():
    """Where kdtree serves and misbehaves but the server is healthy, the remedy is standby (live, about a second),
    not off (a restart)."""
    rules = {r["alert"]: r for r in alert_rules()}
    for name in ("KdtreeFallbacksInOn", "KdtreeOnServesNothing"):
        text = rules[name]["annotations"]["description"]
        assert "`kdtreectl mode standby`" in text and "`kdtreectl mode off`" not in text, name


def test_not_ready_pages_only_past_the_startup_budget():
    """A healthy start is not_ready_yet for up to KDTREE_READY_TIMEOUT_S; KdtreeNotReady waits longer than that."""
    (rule,) = [r for r in alert_rules() if r["alert"] == "KdtreeNotReady"]
    minutes = int(rule["for"].removesuffix("m"))
    assert (
        rule["for"].endswith("m") and minutes * 60 > SidecarSettings.model_fields["ready_timeout_s"].default
    )
    assert 'kdtree_condition{kdtree_condition="not_ready_yet"}' in rule["expr"]


def test_the_parity_alert_fires_past_the_gates_tolerance():
    """KdtreeParityOverTolerance's threshold is the gate's, as each rank exports it (KDTREE_GATE_MAX_REL_ERR, or its
    fp8 pool's tolerance): a constant would fire where the gate passes (an fp8 pool), or stay quiet where it refuses."""
    (rule,) = [r for r in alert_rules() if r["alert"] == "KdtreeParityOverTolerance"]
    assert re.search(
        r"kdtree_rank_parity_max_rel_l2 > on \(instance, rank\) group_left kdtree_rank_parity_bound",
        rule["expr"],
    )


@pytest.mark.parametrize("pool, bound", [("bfloat16", 0.02), ("float8_e4m3fn", 0.06), ("float8_e5m2", 0.12)])
def test_each_rank_exports_the_bound_the_gate_holds_it_to(tmp_path, pool, bound):
    from sidecar.admission import gate_to_on

    record = new_record("validate")
    record.installed = True
    record.verify_inputs = {
        "captured": {"kv_pool": [pool, [1, 576], 576]}
    }  # as kdtree.verify.describe_call writes it
    write_record(tmp_path, record)
    metrics = Metrics(expected_ranks=1, gate_max_rel_err=0.02)
    metrics.rank_views = read_records(tmp_path)
    exported = [
        s.value for f in metrics.registry.collect() for s in f.samples if s.name == "kdtree_rank_parity_bound"
    ]
    assert exported == [pytest.approx(bound)]
    settings = SidecarSettings(expected_tp_size=1, gate_max_rel_err=0.02, admin_token="t")
    (rel,) = [c for c in gate_to_on(settings, metrics.rank_views, True, "") if c.name == "max_rel_err"]
    assert rel.threshold == pytest.approx(bound)  # the gate's own bound for the same record


def test_a_healthy_cold_start_case_checks_every_alert():
    """tests/stack/monitoring_alerts_test.yml's 20-minute cold start: every alert is evaluated over it, none fires."""
    (case,) = [
        c
        for c in yaml.safe_load(ALERT_CASES.read_text())["tests"]
        if c["name"].startswith("healthy cold start")
    ]
    checked: dict[str, set[str]] = {}
    for check in case["alert_rule_test"]:
        assert not check.get("exp_alerts"), check
        checked.setdefault(check["alertname"], set()).add(check["eval_time"])
    for rule in alert_rules():
        assert {"10m", "20m", "30m", "40m"} <= checked.get(rule["alert"], set()), rule["alert"]


def test_up_is_selected_by_the_scrape_job():
    """alerts.yml reads the target's health from up{job=...}: the job must be prometheus.yml's."""
    for rule in alert_rules():
        if "up" in selected_metrics(rule["expr"]):
            assert f'up{{job="{JOB}"}}' in rule["expr"], rule["alert"]


def test_dashboard_is_importable_with_a_prometheus_input():
    dashboard = load_dashboard()
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    assert dashboard["id"] is None and dashboard["uid"] and dashboard["title"]
    ds = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    # the variable named like the input resolves ${DS_PROMETHEUS} where a dashboard is provisioned, not imported
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["instance"]["datasource"] == ds
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            assert annotation["datasource"] == ds
    panels = dashboard_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells = set()
    for panel in panels:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == ds and panel["targets"], panel["title"]
        assert all(t["datasource"] == ds for t in panel["targets"]), panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_dashboard_shows_every_metric_the_sidecar_exports(exported):
    """A metric added to the sidecar needs a panel (or is deliberately left out here, with the reason)."""
    shown = set()
    for _, expr in dashboard_queries(load_dashboard()):
        shown |= {family_of(n, exported) for n in selected_metrics(expr)}
    missing = set(exported.values()) - shown
    assert not missing, f"no panel in {DASHBOARD.name} shows {sorted(missing)}"


# ---- promtool ----------------------------------------------------------------------------------------------


def find_promtool() -> str | None:
    local = REPO / "build" / "tools" / "promtool"
    return shutil.which("promtool") or (str(local) if local.is_file() else None)


PROMTOOL = find_promtool()
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="no promtool: on PATH (apt-get install prometheus) or build/tools/promtool (tests/run unpacks it)",
)


def promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


@needs_promtool
def test_promtool_checks_rules_and_config():
    r = promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    r = promtool("check", "config", str(PROMETHEUS))  # the rule file again, as the config loads it
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_accepts_the_commented_scrape_jobs(tmp_path):
    for i, job in enumerate(commented_jobs()):
        config = yaml.safe_load(PROMETHEUS.read_text())
        config["rule_files"] = []
        config["scrape_configs"] = yaml.safe_load(job)
        # Debian's promtool is built without Kubernetes discovery ("field kubernetes_sd_configs not found"):
        # a static target stands in for it, so the relabelling, the part that can be wrong, is still checked.
        for scrape in config["scrape_configs"]:
            if scrape.pop("kubernetes_sd_configs", None):
                scrape["static_configs"] = [{"targets": ["10.0.0.1:8080"]}]
        path = tmp_path / f"prometheus-{i}.yml"
        path.write_text(yaml.safe_dump(config))
        r = promtool("check", "config", str(path))
        assert r.returncode == 0, r.stdout + r.stderr


def alerts_without_annotations(dest: Path) -> None:
    doc = load_alerts()
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))


@needs_promtool
def test_promtool_alert_cases(tmp_path):
    """tests/stack/monitoring_alerts_test.yml: synthetic series in, the alerts that fire (and do not) out."""
    alerts_without_annotations(tmp_path / "alerts.yml")
    shutil.copy(ALERT_CASES, tmp_path / ALERT_CASES.name)
    r = promtool("test", "rules", ALERT_CASES.name, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_has_a_firing_case_with_the_labels_its_text_uses():
    """Each alert fires in some case of the promtool tests, and the labels its annotations print
    ({{ $labels.X }}) are labels it fires with there: an aggregation that drops one prints nothing."""
    fired: dict[str, list[set[str]]] = {}
    for case in yaml.safe_load(ALERT_CASES.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            for alert in check.get("exp_alerts") or []:
                fired.setdefault(check["alertname"], []).append(set(alert["exp_labels"]))
    for rule in alert_rules():
        name = rule["alert"]
        assert name in fired, f"{ALERT_CASES.name} has no case in which {name} fires"
        used = set(re.findall(r"\$labels\.(\w+)", " ".join(rule["annotations"].values())))
        for labels in fired[name]:
            assert used <= labels, f"{name} prints {sorted(used - labels)}, which it does not carry"
