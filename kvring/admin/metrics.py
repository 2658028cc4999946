"""Prometheus metrics of the admin API, on a registry of its own (no process globals).

The admin's own request counters and latencies, plus gauges of the cluster set from the cached
cluster view (``view.py``) each time ``/metrics`` is scraped, and that view's age.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvring.common.types import NodeState

from .models import NodeView

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class AdminMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvring_admin_requests", "Requests served by the admin API",
                                ["method", "route", "status"], registry=r)
        self.latency = Histogram("kvring_admin_request_seconds", "Time to serve an admin API request",
                                 ["route"], buckets=_BUCKETS, registry=r)
        self.etcd_up = Gauge("kvring_admin_etcd_up", "1 if the last read of the cluster from etcd succeeded",
                             registry=r)
        self.view_age = Gauge("kvring_admin_view_age_seconds", "Age of the cluster view the admin answers reads "
                              "from (it is read about once a second; it grows while reads fail)", registry=r)
        self.nodes = Gauge("kvring_cluster_nodes", "Registered nodes by state ('unreachable': registered, but "
                           "its /stats did not answer)", ["state"], registry=r)
        self.capacity = Gauge("kvring_cluster_capacity_bytes", "Sum of the registered nodes' cache budgets",
                              registry=r)
        self.used = Gauge("kvring_cluster_used_bytes", "Bytes stored on the nodes that answered", registry=r)
        self.chunks = Gauge("kvring_cluster_chunks", "Chunks stored on the nodes that answered", registry=r)
        self.epoch = Gauge("kvring_cluster_ring_epoch", "etcd revision of the admin's current ring", registry=r)
        self.node_used = Gauge("kvring_cluster_node_used_bytes", "Bytes stored, per node", ["node"], registry=r)
        self.node_capacity = Gauge("kvring_cluster_node_capacity_bytes", "Cache budget, per node", ["node"],
                                   registry=r)
        self.node_chunks = Gauge("kvring_cluster_node_chunks", "Chunks stored, per node", ["node"], registry=r)
        self.node_hits = Gauge("kvring_cluster_node_lookup_hits", "Keys LOOKUPs found, per node (counter on the "
                               "node; a gauge here because a restarted node starts again at 0)", ["node"],
                               registry=r)
        self.node_misses = Gauge("kvring_cluster_node_lookup_misses", "Keys LOOKUPs did not find, per node",
                                 ["node"], registry=r)
        self.node_reachable = Gauge("kvring_cluster_node_up", "1 if the node's /stats answered", ["node"],
                                    registry=r)

    def observe(self, method: str, route: str, status: int, started: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(route).observe(time.perf_counter() - started)

    def set_cluster(self, views: list[NodeView], states: dict[str, int], epoch: int, etcd_up: bool,
                    age_s: float) -> None:
        self.etcd_up.set(1 if etcd_up else 0)
        self.view_age.set(age_s)
        for gauge in (self.nodes, self.node_used, self.node_capacity, self.node_chunks, self.node_hits,
                      self.node_misses, self.node_reachable):
            gauge.clear()  # nodes that left must not linger
        for state in (*NodeState, "unreachable", *states):
            self.nodes.labels(state).set(states.get(state, 0))
        self.capacity.set(sum(v.capacity for v in views))
        self.used.set(sum(v.used or 0 for v in views))
        self.chunks.set(sum(v.chunks or 0 for v in views))
        self.epoch.set(epoch)
        for v in views:
            self.node_capacity.labels(v.node_id).set(v.capacity)
            self.node_reachable.labels(v.node_id).set(0 if v.error else 1)
            if v.error is None:
                self.node_used.labels(v.node_id).set(v.used or 0)
                self.node_chunks.labels(v.node_id).set(v.chunks or 0)
                self.node_hits.labels(v.node_id).set(v.hits or 0)
                self.node_misses.labels(v.node_id).set(v.misses or 0)

    def set_no_view(self) -> None:
        """Before the first read of the view: etcd has not been read, and there is nothing to gauge."""
        self.etcd_up.set(0)
