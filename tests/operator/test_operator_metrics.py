"""The operator's /metrics: what the status timer wrote for each CacheCluster, gone with it."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvring.operator.metrics import OperatorMetrics


def _samples(m: OperatorMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(m.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if not s.name.endswith("_created")}


STATUS = {"replicas": 3, "readyReplicas": 2,
          "nodes": [{"id": "kv-0", "state": "active"}, {"id": "kv-1", "state": "active"},
                    {"id": "kv-2", "state": "unhealthy"}],
          "conditions": [{"type": "Ready", "status": "False"}, {"type": "Degraded", "status": "True"},
                         {"type": "Rebalancing", "status": "Unknown"}]}


def test_status_becomes_gauges_and_a_deleted_cluster_leaves_none():
    m = OperatorMetrics()
    m.observe("ns", "kv", 3, STATUS)
    m.observe("ns", "other", 1, {"readyReplicas": 1, "conditions": [{"type": "Ready", "status": "True"}]})
    got = _samples(m)
    key = (("cachecluster", "kv"), ("namespace", "ns"))
    assert got[("kvring_operator_cachecluster_replicas", key)] == 3
    assert got[("kvring_operator_cachecluster_ready_replicas", key)] == 2
    assert got[("kvring_operator_cachecluster_members", (*key, ("state", "unhealthy")))] == 1
    assert got[("kvring_operator_cachecluster_members", (*key, ("state", "active")))] == 2
    assert got[("kvring_operator_cachecluster_condition", (*key, ("type", "Degraded")))] == 1
    assert got[("kvring_operator_cachecluster_condition", (*key, ("type", "Ready")))] == 0
    assert got[("kvring_operator_cachecluster_condition", (*key, ("type", "Rebalancing")))] == 0

    # A node that recovered is no longer counted in its old state.
    m.observe("ns", "kv", 3, {**STATUS, "nodes": [{"id": f"kv-{i}", "state": "active"} for i in range(3)]})
    got = _samples(m)
    assert ("kvring_operator_cachecluster_members", (*key, ("state", "unhealthy"))) not in got

    m.children_restored("ns", "kv", 2)
    m.children_restored("ns", "kv", 1)
    assert _samples(m)[("kvring_operator_children_restored_total", key)] == 3

    m.forget("ns", "kv")
    left = {labels for _, labels in _samples(m)}
    assert left and all(("cachecluster", "other") in labels for labels in left)
