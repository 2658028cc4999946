"""A node the operator marked restarting keeps its chunks when its preStop hook asks it to drain;
the repair report it publishes in etcd.  Real etcd, real node processes over loopback, and the
real `kvring drain --admin` command the pods' preStop hook runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import numpy as np
from polling import wait_for

from kvring.cachenode.client import ClusterClient
from kvring.common.chunk import ChunkItem
from kvring.common.records import RepairReport


def _stats(node) -> dict:
    with urllib.request.urlopen(f"{node.admin_addr}/stats", timeout=5) as resp:
        return json.loads(resp.read())


def _state(cluster, node_id: str) -> str | None:
    rec = cluster.etcd_run(lambda e: e.members())[0].get(node_id)
    return rec.state if rec is not None else None


def _prestop(cluster, node) -> subprocess.CompletedProcess:
    """What the pod's preStop hook runs (``render_nodes``: ``kvring drain --admin ... --wait``)."""
    return subprocess.run([sys.executable, "-P", "-m", "kvring.cli", "drain", "--admin", node.admin_addr,
                           "--node-token-file", str(cluster.node_token_file), "--wait", "30"],
                          capture_output=True, text=True, timeout=60)


def _put(client: ClusterClient, n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    keys = [os.urandom(16) for _ in range(n)]
    items = [ChunkItem.of(k, rng.integers(0, 256, size=256, dtype=np.uint8), [4, 64], "uint8", 16) for k in keys]
    assert all(s >= 1 for s in client.put_many(items))
    return keys


def test_a_node_marked_restarting_keeps_its_chunks_and_one_without_the_marker_drains(cluster_factory):
    cluster = cluster_factory(nodes=3)
    kept, drained = cluster.nodes[0], cluster.nodes[1]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(3)
        _put(client, 300, seed=1)
    held = _stats(kept)["chunks"]
    assert held > 0 and _stats(drained)["chunks"] > 0

    # The operator marks kvring's node-0 restarting before its pod goes; the preStop hook then
    # returns at once, and the node neither drains nor hands anything off.
    cluster.etcd_run(lambda e: e.request_restart(kept.node_id, "rev-2"))
    assert cluster.etcd_run(lambda e: e.restart_requests()) == {kept.node_id}
    done = _prestop(cluster, kept)
    assert done.returncode == 0, done.stderr
    assert "not draining" in done.stdout and f"keeps its {held} chunks" in done.stdout
    stats = _stats(kept)
    assert stats["state"] == "active" and stats["chunks"] == held and stats["handed_off"] == 0
    assert stats["drain"]["requested_by"] == [] and stats["drain"]["kept_for_restart_at"] is not None
    assert _state(cluster, kept.node_id) == "active"  # still on the ring until SIGTERM stops it

    # node-1 has no marker: the same hook drains it as before, handing off every chunk.
    done = _prestop(cluster, drained)
    assert done.returncode == 0, done.stderr
    assert f"{drained.admin_addr} drained" in done.stdout
    stats = _stats(drained)
    assert stats["state"] == "drained" and stats["chunks"] == 0 and stats["drain"]["handed_off"] > 0

    # The marker is gone (the pod is back): a drain hands off again.
    cluster.etcd_run(lambda e: e.cancel_restart(kept.node_id))
    done = _prestop(cluster, kept)
    assert done.returncode == 0, done.stderr
    assert f"{kept.admin_addr} drained" in done.stdout and _stats(kept)["chunks"] == 0


def test_a_drain_through_etcd_is_never_turned_into_a_restart(cluster_factory):
    """Scale-in asks through etcd; a restart marker left over does not stop that drain."""
    cluster = cluster_factory(nodes=2)
    node = cluster.nodes[1]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(2)
        _put(client, 100, seed=2)
    cluster.etcd_run(lambda e: e.request_restart(node.node_id))
    cluster.etcd_run(lambda e: e.request_drain(node.node_id))
    wait_for(lambda: _state(cluster, node.node_id) == "drained", 30, "drained")
    done = _prestop(cluster, node)  # the pod then goes: its hook finds the node drained already
    assert done.returncode == 0 and "drained" in done.stdout
    assert _stats(node)["chunks"] == 0


def test_nodes_publish_their_repair_state_under_their_lease(cluster_factory):
    """Each node's repair report says which ring epoch its last finished pass ran on; a node
    that comes back makes every node run a pass on the new ring; a node gone takes its report along."""
    cluster = cluster_factory(nodes=3, lease_ttl=3)
    def view():
        return cluster.etcd_run(lambda e: e.restart_view())

    def settled_since(revision: int) -> bool:
        v = view()
        return set(v.repair) == set(v.members) and all(
            v.repair[n].settled(revision) and v.repair[n].incarnation == v.members[n].incarnation for n in v.members)

    first = view()
    wait_for(lambda: settled_since(max(first.written.values())), 20, "every node reports a pass on the full ring")
    report = view().repair["node-2"]
    assert isinstance(report, RepairReport) and report.passes >= 1 and not report.running

    old = view().members["node-2"].incarnation
    back = cluster.restart_empty(2)
    v = wait_for(lambda: (x := view()) and x.members.get("node-2") and
                 x.members["node-2"].incarnation != old and x, 20, "node-2 registered again")
    written = v.written["node-2"]
    assert written > max(first.written.values())
    wait_for(lambda: settled_since(written), 30, "every node reports a pass on the ring with node-2 back")

    back.kill()
    wait_for(lambda: "node-2" not in view().repair, 15, "the report goes with the node's lease")
