"""A node whose data plane fails its own check leaves the ring and comes back (real etcd, real
node processes; the hang is a blocked data loop, from the node's fault injection)."""

from __future__ import annotations

from faults import inject
from polling import readyz, wait_for

from kvring.cachenode.client import ClusterClient


def test_a_node_whose_data_loop_hangs_leaves_the_ring_and_returns_when_it_answers(cluster_factory):
    cluster = cluster_factory(nodes=2, lease_ttl=3, node_args=["--fault-injection", "--self-check-interval", "0.5"])
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=1.0) as client:
        assert client.wait_for_nodes(2)
        hung = cluster.nodes[1]
        assert inject(cluster, hung, "stall?seconds=8") == 202
        # 3 PINGs missed (0.5 s apart, 0.5 s each): off the ring, record kept, saying why.
        assert client.wait_for_nodes(1, timeout=6, exact=True)
        assert client.ring.nodes == ("node-0",)
        assert client.members["node-1"].state == "unhealthy"
        assert readyz(hung.admin_addr) == 503
        assert client.put(b"k" * 16, b"x" * 64, (1, 64), "uint8", 16) == 1  # the healthy node takes the writes
        # The loop runs again: the first PING answered puts it back.
        assert client.wait_for_nodes(2, timeout=15, exact=True)
        assert client.members["node-1"].state == "active"
        wait_for(lambda: readyz(hung.admin_addr) == 200, 5, "node-1 ready again")
