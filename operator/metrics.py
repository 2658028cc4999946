"""Prometheus metrics of the operator: what its status timer last wrote for each CacheCluster,
and the children it put back.

On a registry of its own (no process globals), served by ``main.run`` on ``--metrics-port``.
The status timer (``handlers.observe``) calls ``OperatorMetrics.observe`` with the status it
built; deleting a CacheCluster calls ``forget``, so a cluster that is gone leaves no series.
Every series carries ``namespace`` and ``cachecluster`` labels; conditions also ``type``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

CONDITIONS = ("Ready", "Degraded", "Rebalancing", "ConfigMismatch")


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["namespace", "cachecluster"]
        self.desired = Gauge("kvring_operator_cachecluster_replicas", "Nodes the CacheCluster's spec asks for",
                             labels, registry=r)
        self.pods = Gauge("kvring_operator_cachecluster_pods", "Node pods its StatefulSet runs", labels, registry=r)
        self.ready = Gauge("kvring_operator_cachecluster_ready_replicas", "Node pods ready", labels, registry=r)
        self.members = Gauge("kvring_operator_cachecluster_members", "Nodes registered in etcd, by state",
                             [*labels, "state"], registry=r)
        self.condition = Gauge("kvring_operator_cachecluster_condition", "1 if the CacheCluster's condition "
                               "(Ready, Degraded, Rebalancing, ConfigMismatch) is True, else 0",
                               [*labels, "type"], registry=r)
        self.observations = Counter("kvring_operator_observations", "Status observations of CacheClusters",
                                    labels, registry=r)
        self.restored = Counter("kvring_operator_children_restored", "Children a status pass made again "
                                "(deleted outside the operator), patched back (edited outside it) or deleted (not in the "
                                "spec)", labels, registry=r)
        self._children: dict[Any, set[tuple[str, ...]]] = {}  # metric -> the label values it has a series for

    def observe(self, namespace: str, name: str, desired: int | None, status: Mapping[str, Any]) -> None:
        """Gauge the status the timer wrote (``desired`` is None for a spec that cannot work)."""
        key = (namespace, name)
        self._child(self.observations, key).inc()
        if desired is not None:
            self._child(self.desired, key).set(desired)
        for gauge, field in ((self.pods, "replicas"), (self.ready, "readyReplicas")):
            if isinstance(status.get(field), int):
                self._child(gauge, key).set(status[field])
        nodes = status.get("nodes")
        if isinstance(nodes, list):
            self._remove(self.members, key)
            counts: dict[str, int] = {}
            for node in nodes:
                if isinstance(node, Mapping) and isinstance(node.get("state"), str):
                    counts[node["state"]] = counts.get(node["state"], 0) + 1
            for state, n in counts.items():
                self._child(self.members, (*key, state)).set(n)
        given = {c.get("type"): c.get("status") == "True" for c in status.get("conditions") or []
                 if isinstance(c, Mapping)}
        for kind in CONDITIONS:
            if kind in given:
                self._child(self.condition, (*key, kind)).set(1 if given[kind] else 0)

    def children_restored(self, namespace: str, name: str, count: int) -> None:
        """A status pass put ``count`` children back as the spec has them (``_converge_children``)."""
        self._child(self.restored, (namespace, name)).inc(count)

    def forget(self, namespace: str, name: str) -> None:
        """The CacheCluster is gone: drop its series."""
        for metric in (self.desired, self.pods, self.ready, self.members, self.condition, self.observations,
                       self.restored):
            self._remove(metric, (namespace, name))

    def _child(self, metric, values: tuple[str, ...]):
        self._children.setdefault(metric, set()).add(values)
        return metric.labels(*values)

    def _remove(self, metric, key: tuple[str, str]) -> None:
        held = self._children.get(metric, set())
        for values in [v for v in held if v[:2] == key]:
            metric.remove(*values)
            held.discard(values)
