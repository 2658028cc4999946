"""The chart's Prometheus wiring with the real helm: off by default (scrape annotations instead),
and when asked, monitors that select the pods kvring really runs, on ports they really have, and
a PrometheusRule that is the promtool-tested rules file itself.

The PodMonitor, ServiceMonitor and PrometheusRule kinds are the Prometheus operator's CRDs, which
``kubernetes-validate`` does not bundle and which cannot be fetched here: their required fields
(``selector`` and ``podMetricsEndpoints``/``endpoints``; ``groups`` with ``name`` and ``rules``)
are checked by hand below; every other object of the same renders validates against the
Kubernetes 1.35 schemas as in ``test_chart.py``.
"""

from __future__ import annotations

import re

import kubernetes_validate
import yaml
from test_chart import CHART, K8S_VERSION, NAMESPACE, by_kind, parse_cli, template

from kvring.operator.render import render_statefulset
from kvring.operator.spec import ClusterSpec

MONITORING_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
ALL_ON = ["--set", "cacheCluster.enabled=true", "--set", "admin.enabled=true", "--set", "vllm.enabled=true"]
MONITORS = [*ALL_ON, "--set", "monitoring.monitors.enabled=true", "--set", "monitoring.prometheusRule.enabled=true",
            "--set", "monitoring.labels.release=kube-prometheus-stack"]


def _pod_template(docs, kind: str, name: str) -> dict:
    return docs[(kind, name)]["spec"]["template"]


def _port_names(pod: dict) -> set[str]:
    return {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector["matchLabels"]) and selector["matchLabels"].items() <= labels.items()


def test_monitoring_objects_are_off_by_default_and_pods_carry_scrape_annotations():
    docs = by_kind(template(*ALL_ON))
    assert not {kind for kind, _ in docs} & MONITORING_KINDS
    for name, port in (("kv-kvring-admin", "http"), ("kv-kvring-operator", "metrics")):
        pod = _pod_template(docs, "Deployment", name)
        notes = pod["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
        ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert notes["prometheus.io/port"] == str(ports[port])
    # The operator serves /metrics on that port: its command line says so to the real CLI.
    (operator,) = _pod_template(docs, "Deployment", "kv-kvring-operator")["spec"]["containers"]
    assert parse_cli(operator["args"])["metrics_port"] == 8082


def test_monitors_select_the_pods_kvring_runs_on_their_metrics_ports():
    docs = by_kind(template(*MONITORS))
    for doc in docs.values():
        if doc["kind"] == "CacheCluster":
            continue  # validated against its CRD by test_chart.py
        if doc["kind"] not in MONITORING_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        else:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert doc["metadata"]["namespace"] == NAMESPACE
            assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # With monitors on, the chart's pods drop the annotations (no second scrape of the same target).
    assert "prometheus.io/scrape" not in _pod_template(docs, "Deployment", "kv-kvring-admin")["metadata"].get(
        "annotations", {})

    # Nodes: the pods the operator renders for any CacheCluster, in any namespace.
    nodes = docs[("PodMonitor", "kv-kvring-nodes")]["spec"]
    assert nodes["namespaceSelector"] == {"any": True}
    node_pod = render_statefulset("other", "team-a", ClusterSpec.from_dict({"memoryPerNode": "1Gi"}))["spec"]["template"]
    assert _selects(nodes["selector"], node_pod["metadata"]["labels"])
    (endpoint,) = nodes["podMetricsEndpoints"]
    assert endpoint["port"] in _port_names(node_pod) and endpoint["path"] == "/metrics"
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["cachecluster"]["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"]
    # The scheme comes from the pod's annotation: https for a TLS cluster's nodes (the default),
    # http for one with tls off; the scrape is encrypted with the chart's tlsConfig.
    scheme = relabel["__scheme__"]
    assert scheme["sourceLabels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scheme"]
    plain_pod = render_statefulset("other", "team-a", ClusterSpec.from_dict({"memoryPerNode": "1Gi", "tls": False}))
    for pod, want in ((node_pod, "https"), (plain_pod["spec"]["template"], "http")):
        annotation = pod["metadata"]["annotations"]["prometheus.io/scheme"]
        assert re.fullmatch(scheme["regex"], annotation) and annotation == want
    assert endpoint["tlsConfig"] == {"insecureSkipVerify": True}

    for kind, name, target_kind, target, key in (
            ("PodMonitor", "kv-kvring-operator", "Deployment", "kv-kvring-operator", "podMetricsEndpoints"),
            ("PodMonitor", "kv-kvring-vllm", "Deployment", "kv-kvring-vllm", "podMetricsEndpoints")):
        spec = docs[(kind, name)]["spec"]
        pod = _pod_template(docs, target_kind, target)
        assert _selects(spec["selector"], pod["metadata"]["labels"]), name
        assert {e["port"] for e in spec[key]} <= _port_names(pod), name
        # Selects nothing of the other components.
        assert not _selects(spec["selector"], _pod_template(docs, "Deployment", "kv-kvring-admin")["metadata"]["labels"])

    admin = docs[("ServiceMonitor", "kv-kvring-admin")]["spec"]
    service = docs[("Service", "kv-kvring-admin")]
    assert _selects(admin["selector"], service["metadata"]["labels"])
    assert {e["port"] for e in admin["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}


def test_the_prometheus_rule_is_the_tested_rules_file():
    docs = by_kind(template(*MONITORS))
    rule = docs[("PrometheusRule", "kv-kvring")]
    rules_file = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    assert rule["spec"] == rules_file
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for r in group["rules"]:
            assert ("alert" in r) != ("record" in r) and r["expr"]


def test_the_operator_alone_has_its_monitor_and_no_metrics_port_means_none():
    docs = by_kind(template("--set", "monitoring.monitors.enabled=true"))
    assert {name for kind, name in docs if kind in MONITORING_KINDS} == {"kv-kvring-nodes", "kv-kvring-operator"}
    docs = by_kind(template("--set", "monitoring.monitors.enabled=true", "--set", "operator.metricsPort=0"))
    assert ("PodMonitor", "kv-kvring-operator") not in docs
    (operator,) = _pod_template(docs, "Deployment", "kv-kvring-operator")["spec"]["containers"]
    assert parse_cli(operator["args"])["metrics_port"] == 0
    assert "metrics" not in _port_names(_pod_template(docs, "Deployment", "kv-kvring-operator"))
