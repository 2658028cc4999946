"""The chart's Grafana dashboard with the real helm: a ConfigMap for Grafana's dashboard sidecar,
rendered only when asked, carrying ``files/grafana-dashboard.json`` unchanged; and the dashboard
itself well formed: every panel queries the dashboard's Prometheus data source, uses only the
variables it defines, and reads only series kvring exports (vLLM's own series are checked against
a running vLLM by ``tests/test_dashboard.py``, which evaluates every query in a real Prometheus).
"""

from __future__ import annotations

import json
import re

import kubernetes_validate
from test_alerts import _metric_names, kvring_series
from test_chart import CHART, K8S_VERSION, NAMESPACE, by_kind, template

DASHBOARD = CHART / "files" / "grafana-dashboard.json"
CONFIGMAP = ("ConfigMap", "kv-kvring-dashboard")
ALL_ON = ["--set", "cacheCluster.enabled=true", "--set", "admin.enabled=true", "--set", "vllm.enabled=true",
          "--set", "monitoring.monitors.enabled=true", "--set", "monitoring.prometheusRule.enabled=true"]
# Grafana's own variables a query may use (the test substitutes them as Grafana would).
GRAFANA_VARIABLES = {"__rate_interval"}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _graph_panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_the_dashboard_configmap_is_off_unless_asked():
    assert CONFIGMAP not in by_kind(template())
    assert CONFIGMAP not in by_kind(template(*ALL_ON))  # monitors and rules on do not bring it


def test_the_configmap_carries_the_dashboard_unchanged_with_the_sidecar_label():
    docs = by_kind(template(*ALL_ON, "--set", "monitoring.dashboard.enabled=true"))
    configmap = docs[CONFIGMAP]
    kubernetes_validate.validate(configmap, K8S_VERSION, strict=True)
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"  # kube-prometheus-stack's sidecar
    assert "annotations" not in configmap["metadata"]
    assert list(configmap["data"]) == ["kvring.json"]
    # The file as it is, byte for byte (less the final newline a "|-" block drops).
    assert configmap["data"]["kvring.json"] == DASHBOARD.read_text().rstrip("\n")
    assert json.loads(configmap["data"]["kvring.json"]) == _dashboard()


def test_the_sidecar_settings_reach_the_configmap():
    docs = by_kind(template("--set", "monitoring.dashboard.enabled=true",
                            "--set", "monitoring.dashboard.namespace=monitoring",
                            "--set", "monitoring.dashboard.labels.grafana_dashboard=null",
                            "--set", "monitoring.dashboard.labels.team-dashboards=kvring",
                            "--set", "monitoring.dashboard.annotations.grafana_folder=Caches"))
    meta = docs[CONFIGMAP]["metadata"]
    assert meta["namespace"] == "monitoring"
    assert meta["labels"]["team-dashboards"] == "kvring" and "grafana_dashboard" not in meta["labels"]
    assert meta["annotations"] == {"grafana_folder": "Caches"}


def test_every_panel_queries_the_dashboards_prometheus_with_known_variables():
    dashboard = _dashboard()
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "cachecluster"}
    (source,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert source["query"] == "prometheus"
    panels = _graph_panels(dashboard)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert len(panels) >= 10
    for panel in panels:
        title = panel["title"]
        assert panel["description"].strip(), title
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, title
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), title
        for t in panel["targets"]:
            assert t["datasource"] == panel["datasource"], title
            used = set(re.findall(r"\$\{?(\w+)", t["expr"]))
            assert used <= variables | GRAFANA_VARIABLES, f"{title}: unknown variables {used}"
        # Overrides name targets that exist.
        for override in panel["fieldConfig"]["overrides"]:
            if override["matcher"]["id"] == "byFrameRefID":
                assert override["matcher"]["options"] in refs, title


def test_panels_read_only_series_kvring_exports():
    exported = kvring_series()
    for panel in _graph_panels(_dashboard()):
        for t in panel["targets"]:
            names = _metric_names(t["expr"])
            assert names, f"{panel['title']}: no series in {t['expr']!r}"
            ours = {n for n in names if n.startswith(("kvring_", "vllm:kvring_"))}
            assert ours <= exported, f"{panel['title']} reads series nothing exports: {ours - exported}"
            # The rest are vLLM's own (its /metrics), checked against a running vLLM elsewhere.
            assert all(n.startswith("vllm:") for n in names - ours), panel["title"]
