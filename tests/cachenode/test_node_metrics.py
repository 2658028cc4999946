"""A node's /metrics shows its place in the ring and its repair passes (the series the chart's
alerting rules read), with real etcd and real node processes."""

from __future__ import annotations

import hashlib
import urllib.request

from polling import wait_for
from prometheus_client.parser import text_string_to_metric_families

from kvring.cachenode.client import ClusterClient
from kvring.common.chunk import ChunkItem
from kvring.common.contract import Contract
from kvring.common.types import NodeState


def _scrape(admin_addr: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"{admin_addr}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _key(i: int) -> bytes:
    return hashlib.blake2b(b"metrics-%d" % i, digest_size=16).digest()


def test_state_registration_and_repair_are_on_the_metrics_port(cluster_factory):
    cluster = cluster_factory(nodes=2, lease_ttl=3, contract=Contract(chunk_size=16, replication=2),
                              node_args=["--repair-interval", "1"])
    node0 = next(n for n in cluster.nodes if n.node_id == "node-0")
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(2)
        got = _scrape(node0.admin_addr)
        assert got[("kvring_node_registered", ())] == 1
        assert {s.value: got[("kvring_node_state", (("state", s.value),))] for s in NodeState} == {
            s.value: (1 if s == NodeState.ACTIVE else 0) for s in NodeState}

        keys = [_key(i) for i in range(30)]
        client.put_many([ChunkItem.of(k, b"v" * 512, (1, 512), "uint8", 16) for k in keys])
        wait_for(lambda: _scrape(node0.admin_addr)[("kvring_node_repair_passes_total", ())] >= 1, 10,
                 "node-0's first repair pass")
        assert client.delete(keys, node="node-1") == 30  # node-1's copies lost behind the ring's back
        wait_for(lambda: all(client.holders("node-1", keys)), 15, "the missing copies restored")
        # A pass's copies join the totals when the pass ends, which may be just after the last copy lands.
        wait_for(lambda: _scrape(node0.admin_addr)[("kvring_node_repair_copied_total", ())] >= 1, 10,
                 "the pass that restored them counted on node-0's metrics port")
        got = _scrape(node0.admin_addr)
        assert got[("kvring_node_repair_copied_bytes_total", ())] >= 512
        for name in ("active", "moving", "incomplete", "missing", "copied"):
            assert ("kvring_node_repair_" + name, ()) in got
