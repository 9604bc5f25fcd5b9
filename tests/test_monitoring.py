"""The operators' monitoring artefacts in k8s/monitoring: Grafana dashboard, alert rules, kustomization.

promtool comes from Debian's `prometheus` package. Without it the rule tests fail, never skip: rules
nobody checked would page at 3 a.m. with a template error, or never page at all.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "k8s" / "monitoring"
DASHBOARD_FILE = MONITORING / "grafana-dashboard.json"
RULES_FILE = MONITORING / "alerts.rules.yml"
PROMETHEUS_RULE_FILE = MONITORING / "prometheus-rule.yaml"
RULE_TESTS_FILE = MONITORING / "alerts.test.yml"
KUSTOMIZATION_FILE = MONITORING / "kustomization.yaml"
OPERATOR_DOC = ROOT / "docs" / "monitoring.md"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

#: What the sidecar's /metrics serves: its own metrics, histograms by base name.
SIDECAR_METRICS = frozenset({
    "triton_sidecar_probes_total",
    "triton_sidecar_probe_consecutive_failures",
    "triton_sidecar_model_state",
    "triton_sidecar_heal_attempts_total",
    "triton_sidecar_escalations_total",
    "triton_sidecar_restart_escalations_total",
    "triton_sidecar_proxy_requests_total",
    "triton_sidecar_proxy_rejections_total",
    "triton_sidecar_outputs_filtered_total",
    "triton_sidecar_proxy_quarantined_total",
    "triton_sidecar_proxy_in_flight",
    "triton_sidecar_streams_in_flight",
    "triton_sidecar_stream_endings_total",
    "triton_sidecar_triton_up",
    "triton_sidecar_triton_ready",
    "triton_sidecar_build_info",
    "triton_sidecar_drift_psi",
    "triton_sidecar_drift_max_psi",
    "triton_sidecar_feature_missing_ratio",
    "triton_sidecar_rollout_share",
    "triton_sidecar_rollout_state",
    "triton_sidecar_rollout_compared_total",
    "triton_sidecar_routed_total",
    "triton_sidecar_shadow_dropped_total",
})
SIDECAR_HISTOGRAMS = frozenset({
    "triton_sidecar_probe_duration_seconds",
    "triton_sidecar_heal_duration_seconds",
    "triton_sidecar_time_to_recover_seconds",
    "triton_sidecar_proxy_request_duration_seconds",
    "triton_sidecar_stream_first_event_seconds",
    "triton_sidecar_stream_inter_event_seconds",
    "triton_sidecar_stream_events",
    "triton_sidecar_output_value",
})
#: TLS (tls.cert_file set): the alert reads the expiry; no dashboard panel draws them yet.
TLS_METRICS = frozenset({
    "triton_sidecar_tls_cert_expiry_timestamp_seconds",
    "triton_sidecar_tls_handshake_failures_total",
    "triton_sidecar_reload_failures_total",
})
#: The HTTP listener's connection bounds (sidecar/fronts/http_listener.py): per pod, not per model;
#: the dashboard's "Client connections" row draws them.
CONNECTION_METRICS = frozenset({
    "triton_sidecar_http_connections",
    "triton_sidecar_http_connections_refused_total",
    "triton_sidecar_http_connection_timeouts_total",
    "triton_sidecar_http_lingering_ends_total",
})
#: Tracing's (tracing.endpoint set), per pod: the dashboard's "Tracing" row draws them.
TRACING_METRICS = frozenset({
    "triton_sidecar_tracing_spans_exported_total",
    "triton_sidecar_tracing_spans_dropped_total",
})
#: Triton's own, passed through on the same scrape when metrics.include_triton is on.
TRITON_METRICS = frozenset({
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_request_duration_us",
    "nv_inference_pending_request_count",
})
#: The prometheus-client process collector, on the same scrape.
PROCESS_METRICS = frozenset({"process_resident_memory_bytes", "process_cpu_seconds_total"})
#: Series without a model label: the dashboard cannot filter them by $model.
METRICS_WITHOUT_MODEL = frozenset({
    # Per pod: a restart of Triton is every model's.
    "triton_sidecar_restart_escalations_total",
    "triton_sidecar_triton_up", "triton_sidecar_triton_ready", "triton_sidecar_build_info", *PROCESS_METRICS,
    *CONNECTION_METRICS, *TRACING_METRICS,
})

CATALOG = frozenset(
    SIDECAR_METRICS
    | TLS_METRICS
    | CONNECTION_METRICS
    | TRACING_METRICS
    | TRITON_METRICS
    | PROCESS_METRICS
    | {f"{h}{suffix}" for h in SIDECAR_HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
)
#: A name in a query that claims to be one of ours or Triton's; each must be in the catalog.
OUR_METRIC_NAME = re.compile(r"\b(?:triton_sidecar|nv|process)_[A-Za-z0-9_]+")
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}")


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(
            "promtool is not installed: install Debian's `prometheus` package "
            "(apt-get install -y prometheus), which provides /usr/bin/promtool",
            pytrace=False,
        )
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120, check=False)


def assert_promtool_ok(*args: str) -> None:
    result = run_promtool(*args)
    assert result.returncode == 0, f"promtool {' '.join(args)} failed:\n{result.stdout}{result.stderr}"


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_FILE.read_text())


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows included; a collapsed row keeps its panels inside it."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard) if p["type"] != "row"]


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, expr) for every query of every panel."""
    return [
        (f"panel {p['id']} {p['title']!r} target {t['refId']}", t["expr"])
        for p in query_panels(load_dashboard())
        for t in p["targets"]
    ]


def load_rules() -> dict[str, Any]:
    return yaml.safe_load(RULES_FILE.read_text())


def alerting_rules() -> list[dict[str, Any]]:
    return [rule for group in load_rules()["groups"] for rule in group["rules"] if "alert" in rule]


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair in a JSON tree, depth first."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item)


def as_parseable_promql(expr: str) -> str:
    """Grafana's variables replaced by values that keep the query valid PromQL."""
    expr = re.sub(r"\$__(?:rate_interval|interval|range)\b", "5m", expr)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


# --- dashboard ----------------------------------------------------------------------------------------


def test_the_dashboard_is_a_current_grafana_dashboard_with_a_stable_uid() -> None:
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] == "triton-sidecar"
    assert dashboard["title"]
    # `__inputs` belongs to "export for sharing": it makes provisioning leave ${DS_...} unresolved.
    assert "__inputs" not in dashboard


def test_the_datasource_is_a_prometheus_datasource_variable() -> None:
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


@pytest.mark.parametrize("name", ["job", "namespace", "pod", "model"])
def test_job_namespace_pod_and_model_are_label_values_variables(name: str) -> None:
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    variable = variables[name]
    assert variable["type"] == "query"
    assert variable["datasource"] == DATASOURCE
    assert variable["definition"].startswith("label_values(")
    assert variable["definition"].endswith(f", {name})")
    assert variable["query"]["query"] == variable["definition"]


def test_every_panel_and_query_goes_through_the_datasource_variable() -> None:
    for panel in query_panels(load_dashboard()):
        assert panel.get("datasource") == DATASOURCE, f"panel {panel['id']} {panel['title']!r}"
        assert panel["targets"], f"panel {panel['id']} {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target.get("datasource") == DATASOURCE, f"panel {panel['id']} target {target['refId']}"


def test_no_datasource_uid_is_hard_coded() -> None:
    dashboard = load_dashboard()
    for key, value in walk(dashboard["panels"] + dashboard["templating"]["list"]):
        if key == "datasource" and isinstance(value, dict):
            assert value == DATASOURCE
        assert key != "uid" or value == "${datasource}", f"hard-coded uid {value!r}"


def test_panel_ids_are_unique_and_panels_tile_the_grid_without_overlap() -> None:
    panels = all_panels(load_dashboard())
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    taken: dict[tuple[int, int], str] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= pos.keys(), f"panel {panel['id']} gridPos {pos}"
        assert pos["h"] > 0 and pos["w"] > 0 and pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        columns = range(pos["x"], pos["x"] + pos["w"])
        lines = range(pos["y"], pos["y"] + pos["h"])
        for cell in ((x, y) for x in columns for y in lines):
            assert cell not in taken, f"{panel['title']!r} overlaps {taken[cell]!r} at {cell}"
            taken[cell] = panel["title"]


def test_every_query_reads_only_metrics_from_the_catalog() -> None:
    for where, expr in dashboard_queries():
        names = set(OUR_METRIC_NAME.findall(expr))
        assert names, f"{where} reads no metric of the sidecar or Triton: {expr}"
        assert names <= CATALOG, f"{where} reads unknown metrics {sorted(names - CATALOG)}"


def test_every_series_follows_the_job_namespace_pod_and_model_pickers() -> None:
    for where, expr in dashboard_queries():
        for metric, matchers in SELECTOR.findall(expr):
            for label in ("job", "namespace", "pod"):
                assert f'{label}=~"${label}"' in matchers, f"{where}: {metric} ignores ${label}"
            if metric not in METRICS_WITHOUT_MODEL:
                assert 'model=~"$model"' in matchers, f"{where}: {metric} ignores $model"


def test_the_dashboard_draws_every_metric_the_sidecar_and_triton_export() -> None:
    drawn = {name for _, expr in dashboard_queries() for name in OUR_METRIC_NAME.findall(expr)}
    drawn |= {re.sub(r"_(bucket|sum|count)$", "", name) for name in drawn}
    missing = (SIDECAR_METRICS | SIDECAR_HISTOGRAMS | TRITON_METRICS | CONNECTION_METRICS | TRACING_METRICS) - drawn
    assert not missing, f"no panel shows {sorted(missing)}"


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    # promtool has no bare PromQL parser in Debian's version; as recording rules it parses them.
    rules = [
        {"record": f"dashboard:query_{i}", "expr": as_parseable_promql(expr)}
        for i, (_, expr) in enumerate(dashboard_queries())
    ]
    rules_file = tmp_path / "dashboard-queries.rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert_promtool_ok("check", "rules", str(rules_file))


# --- alert rules -----------------------------------------------------------------------------------


def test_promtool_accepts_the_plain_rules_file() -> None:
    assert_promtool_ok("check", "rules", str(RULES_FILE))


def test_promtool_accepts_the_spec_of_the_prometheus_rule(tmp_path: Path) -> None:
    spec_file = tmp_path / "prometheus-rule-spec.yml"
    spec_file.write_text(yaml.safe_dump(yaml.safe_load(PROMETHEUS_RULE_FILE.read_text())["spec"]))
    assert_promtool_ok("check", "rules", str(spec_file))


def test_the_promtool_unit_tests_of_the_alerts_pass() -> None:
    assert_promtool_ok("test", "rules", str(RULE_TESTS_FILE))


def test_the_prometheus_rule_holds_the_same_groups_as_the_rules_file() -> None:
    manifest = yaml.safe_load(PROMETHEUS_RULE_FILE.read_text())
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["metadata"]["name"] == "triton-sidecar"
    assert manifest["spec"] == load_rules(), (
        "prometheus-rule.yaml is out of date: run python3 k8s/monitoring/render_prometheus_rule.py"
    )


def test_every_alert_has_a_severity_and_tells_the_on_call_what_to_do() -> None:
    doc = OPERATOR_DOC.read_text()
    for rule in alerting_rules():
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        annotations = rule["annotations"]
        assert annotations["summary"].strip(), name
        assert "First" in annotations["description"], f"{name}: the description must say what to do first"
        assert annotations["runbook"] == f"docs/monitoring.md#{name.lower()}", name
        assert f"### {name}\n" in doc, f"docs/monitoring.md has no section for {name}"


def test_every_alert_reads_only_metrics_from_the_catalog() -> None:
    for rule in alerting_rules():
        names = set(OUR_METRIC_NAME.findall(rule["expr"]))
        assert names <= CATALOG, f"{rule['alert']} reads unknown metrics {sorted(names - CATALOG)}"
        assert names or re.search(r"\bup\{", rule["expr"]), f"{rule['alert']} reads no known metric"


def test_every_alert_has_a_unit_test_in_which_it_fires() -> None:
    tests = yaml.safe_load(RULE_TESTS_FILE.read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    untested = {rule["alert"] for rule in alerting_rules()} - fired
    assert not untested, f"no promtool test expects {sorted(untested)} to fire"


# --- kustomization ---------------------------------------------------------------------------------


def test_the_kustomization_ships_the_prometheus_rule_and_the_dashboard_config_map() -> None:
    kustomization = yaml.safe_load(KUSTOMIZATION_FILE.read_text())
    assert kustomization["resources"] == ["prometheus-rule.yaml"]
    (generator,) = kustomization["configMapGenerator"]
    assert generator["name"] == "triton-sidecar-dashboard"
    assert generator["files"] == ["triton-sidecar.json=grafana-dashboard.json"]
    assert generator["options"]["disableNameSuffixHash"] is True
    assert generator["options"]["labels"] == {"grafana_dashboard": "1"}


def test_kustomize_renders_the_dashboard_config_map_and_the_prometheus_rule() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render k8s/monitoring (its structure is checked above)")
    result = subprocess.run(
        [kubectl, "kustomize", str(MONITORING)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(result.stdout)}
    config_map = objects["ConfigMap", "triton-sidecar-dashboard"]
    assert config_map["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert json.loads(config_map["data"]["triton-sidecar.json"]) == load_dashboard()
    assert objects["PrometheusRule", "triton-sidecar"]["spec"] == load_rules()


# -- the Argo Rollouts AnalysisTemplate (k8s/rollouts, issue 20 §7) ----------------------------------------

ANALYSIS_TEMPLATE_FILE = ROOT / "k8s" / "rollouts" / "analysis-template.yaml"


def _argo_condition(condition: str, result: list[float]) -> bool:
    """Argo's success/failure expression on a Prometheus result, evaluated the way Argo does for the
    operators these templates use (len, indexing, comparisons, && and ||)."""
    python = condition.replace("&&", " and ").replace("||", " or ")
    return bool(eval(python, {"__builtins__": {}, "len": len}, {"result": result}))


def test_the_analysis_template_gates_a_step_on_the_pods_summed_comparisons(tmp_path: Path) -> None:
    template = yaml.safe_load(ANALYSIS_TEMPLATE_FILE.read_text())
    assert (template["apiVersion"], template["kind"]) == ("argoproj.io/v1alpha1", "AnalysisTemplate")
    metrics = {m["name"]: m for m in template["spec"]["metrics"]}
    args = {"namespace": "ml", "model": "credit_risk", "candidate": "2"}
    assert set(args) <= {a["name"] for a in template["spec"]["args"]}

    def query(name: str) -> str:
        text = metrics[name]["provider"]["prometheus"]["query"]
        for key, value in args.items():
            text = text.replace("{{args." + key + "}}", value)
        assert "{{" not in text, text
        return text

    # Two pods, 12 compared pairs a minute each; pod triton-1 finds 200 differing pairs by minute 25
    # and aborts at minute 22.
    def series(pod: str, outcome: str, values: str) -> dict[str, str]:
        return {"series": f'triton_sidecar_rollout_compared_total{{namespace="ml", pod="{pod}", model="credit_risk", '
                          f'candidate="2", outcome="{outcome}"}}', "values": values}

    def state(pod: str, values: str) -> dict[str, str]:
        return {"series": f'triton_sidecar_rollout_state{{namespace="ml", pod="{pod}", model="credit_risk", '
                          f'state="aborted"}}', "values": values}

    differ, aborted = query("compared-answers-differ"), query("no-pod-aborted")
    expectations = [  # (query, minute, expected samples, what Argo must conclude)
        (differ, 5, [], "inconclusive"),     # 120 compared across pods: too few yet, the step waits
        (differ, 15, [0.0], "successful"),   # 360 compared, none differ
        (differ, 25, [0.25], "failed"),      # 200 of 800 differ
        (aborted, 15, [0.0], "successful"),
        (aborted, 25, [1.0], "failed"),
    ]
    unit = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                series("triton-0", "same", "0+12x30"), series("triton-0", "differs", "0+0x30"),
                series("triton-1", "same", "0+12x30"), series("triton-1", "differs", "0x20 200+0x10"),
                state("triton-0", "0+0x30"), state("triton-1", "0x21 1+0x9"),
            ],
            "promql_expr_test": [
                {"expr": expr, "eval_time": f"{minute}m",
                 "exp_samples": [{"labels": "{}", "value": value} for value in values]}
                for expr, minute, values, _ in expectations
            ],
        }],
    }
    path = tmp_path / "analysis.test.yml"
    path.write_text(yaml.safe_dump(unit, sort_keys=False))
    assert_promtool_ok("test", "rules", str(path))
    for expr, minute, values, verdict in expectations:
        name = "compared-answers-differ" if expr == differ else "no-pod-aborted"
        success = _argo_condition(metrics[name]["successCondition"], values)
        failure = "failureCondition" in metrics[name] and _argo_condition(metrics[name]["failureCondition"], values)
        # Argo: success when successCondition holds; without a failureCondition, failed otherwise.
        if "failureCondition" not in metrics[name]:
            failure = not success
        concluded = "successful" if success else "failed" if failure else "inconclusive"
        assert concluded == verdict, (name, minute, values, concluded)
