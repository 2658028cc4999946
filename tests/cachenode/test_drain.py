"""Node drain against a real etcd and real node processes: requested through etcd, through the
node's admin port (the preStop path, via the real `kvring drain` command), and with nowhere to go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
from polling import wait_for

from kvring.cachenode.client import ClusterClient
from kvring.common.chunk import ChunkItem


def _state(cluster, node_id: str) -> str | None:
    rec = cluster.etcd_run(lambda e: e.members())[0].get(node_id)
    return rec.state if rec is not None else None


def _http(url: str, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method, data=b"" if method != "GET" else None)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _stats(node) -> dict:
    code, body = _http(f"{node.admin_addr}/stats")
    assert code == 200
    return json.loads(body)



def _chunks(n: int, seed: int, namespaces=("", "ns-a")):
    rng = np.random.default_rng(seed)
    return [(os.urandom(16), rng.integers(0, 256, size=4 * 64, dtype=np.uint8), namespaces[i % len(namespaces)])
            for i in range(n)]


def _put(client: ClusterClient, chunks) -> None:
    stored = client.put_many([ChunkItem.of(k, d, [4, 64], "uint8", 16, ns) for k, d, ns in chunks])
    assert all(s >= 1 for s in stored)


def _unreadable(cluster, chunks) -> list[str]:
    """Keys a fresh client (no previous ring to fall back on) cannot read back intact."""
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as fresh:
        got = fresh.get([k for k, _, _ in chunks])
    return [key.hex() for (key, data, ns), chunk in zip(chunks, got)
            if chunk is None or not np.array_equal(chunk.data, data) or chunk.meta.namespace != ns]


def _all_readable(cluster, chunks) -> None:
    assert _unreadable(cluster, chunks) == []


def _kvring(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "kvring.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_drain_through_etcd_hands_off_every_chunk(cluster_factory):
    cluster = cluster_factory(nodes=3)
    chunks = _chunks(300, seed=1)
    target = cluster.nodes[1]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(3)
        _put(client, chunks)
        held = _stats(target)["chunks"]
        assert held > 0
        assert _http(f"{target.admin_addr}/readyz")[0] == 200

        cluster.etcd_run(lambda e: e.request_drain(target.node_id))
        assert wait_for(lambda: _http(f"{target.admin_addr}/readyz")[0] == 503, 5, "readyz 503 while draining")
        # The ring drops the node as soon as its record says draining; GETs keep working meanwhile.
        assert client.wait_for_nodes(2, timeout=5, exact=True)
        assert target.node_id not in client.ring.nodes
        wait_for(lambda: _state(cluster, target.node_id) == "drained", 30, "the record to say drained")

    stats = _stats(target)
    assert stats["state"] == "drained" and stats["chunks"] == 0
    drain = stats["drain"]
    assert drain["handed_off"] == held and drain["remaining"] == 0 and drain["waiting"] == ""
    assert drain["requested_by"] == ["etcd"] and drain["finished_at"] >= drain["started_at"]
    assert _http(f"{target.admin_addr}/readyz")[0] == 503
    _all_readable(cluster, chunks)  # every chunk, its bytes and its namespace, through a fresh client

    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        # Namespaces travelled with the handed-off chunks: a flush still finds all of ns-a.
        assert client.flush_namespace("ns-a") == 150
        assert sum(client.lookup([k for k, _, ns in chunks if ns == ""])) == 150

    # A drained node that stops removes its (fulfilled) drain request.
    assert cluster.etcd_run(lambda e: e.drain_requests()) == {target.node_id}
    target.stop()
    assert cluster.etcd_run(lambda e: e.drain_requests()) == set()


def test_drain_over_the_admin_port_with_the_cli_then_cancel(cluster_factory):
    cluster = cluster_factory(nodes=2)
    chunks = _chunks(100, seed=2)
    target = cluster.nodes[0]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(2)
        _put(client, chunks)
        assert _stats(target)["chunks"] > 0

        token = ("--node-token-file", str(cluster.node_token_file))  # the node's POST /drain needs it
        done = _kvring("drain", "--admin", target.admin_addr, *token, "--wait", "30")
        assert done.returncode == 0, done.stderr
        assert f"{target.admin_addr} drained" in done.stdout
        assert _stats(target)["chunks"] == 0 and _state(cluster, target.node_id) == "drained"
        assert _stats(target)["drain"]["requested_by"] == ["http"]
        _all_readable(cluster, chunks)

        undo = _kvring("drain", "--admin", target.admin_addr, *token, "--cancel")
        assert undo.returncode == 0, undo.stderr
        wait_for(lambda: _state(cluster, target.node_id) == "active", 5, "the node to be active again")
        assert client.wait_for_nodes(2, timeout=5, exact=True)
        assert _http(f"{target.admin_addr}/readyz")[0] == 200
        # Back on the ring, it gets its share of new chunks again.
        more = _chunks(100, seed=3)
        _put(client, more)
        assert _stats(target)["chunks"] > 0
        # The chunks it gave away come back to it by the other node's background handoff.
        wait_for(lambda: not _unreadable(cluster, chunks + more), 15, "handoff back to the returning node")


def test_drain_with_nowhere_to_go_keeps_every_chunk(cluster_factory):
    cluster = cluster_factory(nodes=1)
    chunks = _chunks(50, seed=4)
    node = cluster.nodes[0]
    code, body = _http(f"{node.admin_addr}/drain")
    assert code == 200 and json.loads(body)["state"] == "active" and json.loads(body)["requested_by"] == []
    assert _http(f"{node.admin_addr}/drainx", "POST")[0] == 404
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(1)
        _put(client, chunks)

    unknown = _kvring("drain", "--etcd", cluster.etcd, "--cluster", cluster.cluster, "--node", "nope")
    assert unknown.returncode == 1 and "no node 'nope'" in unknown.stderr and node.node_id in unknown.stderr

    timed_out = _kvring("drain", "--etcd", cluster.etcd, "--cluster", cluster.cluster, "--node", node.node_id,
                        "--wait", "4")
    assert timed_out.returncode == 1
    assert "not drained after 4s" in timed_out.stderr and "no active node is left" in timed_out.stderr

    stats = _stats(node)
    assert stats["state"] == "draining" and stats["chunks"] == 50
    assert stats["drain"]["reason"] == "no_owners" and stats["drain"]["remaining"] == 50
    assert "stay here" in stats["drain"]["waiting"]
    assert _state(cluster, node.node_id) == "draining"

    cancelled = _kvring("drain", "--etcd", cluster.etcd, "--cluster", cluster.cluster, "--node", node.node_id,
                        "--cancel")
    assert cancelled.returncode == 0, cancelled.stderr
    wait_for(lambda: _state(cluster, node.node_id) == "active", 5, "the node to be active again")
    _all_readable(cluster, chunks)


def test_only_loopback_may_drain_through_the_admin_port():
    """POST /drain has no token; only the pod itself (its preStop hook) may use it."""
    from kvring.cachenode.http import _is_loopback

    for host, expected in [("127.0.0.1", True), ("127.5.0.1", True), ("::1", True), ("10.0.0.7", False),
                           ("192.168.1.2", False), ("fe80::1%eth0", False), ("not-an-ip", False)]:
        assert _is_loopback(host) is expected, host


def test_a_drain_requested_before_start_holds(etcd_server):
    """A pod restarted mid-drain comes back draining, not active (its request is still in etcd)."""
    from kvring.local.cluster import LocalCluster

    cluster = LocalCluster(nodes=2, memory=16 << 20, etcd=etcd_server.endpoint, cluster="drain-before-start")
    cluster.etcd_run(lambda e: e.request_drain("node-1"))
    with cluster:
        node = cluster.nodes[1]
        assert _state(cluster, node.node_id) in ("draining", "drained")
        assert _http(f"{node.admin_addr}/readyz")[0] == 503
        wait_for(lambda: _state(cluster, node.node_id) == "drained", 10, "the empty node to report drained")
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            assert client.ring.nodes == ("node-0",)
    assert cluster.etcd_run(lambda e: e.drain_requests()) == set()  # drained and stopped: request fulfilled


def test_waiting_gives_up_early_when_there_is_nowhere_to_go():
    """`kvring drain --wait` stops waiting once the node has said for a while that no node can take
    its chunks (a whole cluster shutting down drains every pod at once); other reasons wait on."""
    import pytest

    from kvring.cli.drain import DrainFailed, _follow

    nowhere = {"state": "draining", "reason": "no_owners", "remaining": 3, "waiting": "no active node is left"}
    start = time.monotonic()
    with pytest.raises(DrainFailed, match="giving up before --wait: draining, 3 chunks left, no active node"):
        _follow("n", lambda: nowhere, wait=30, echo=lambda _: None, nowhere_grace=0.6)
    assert time.monotonic() - start < 5
    retrying = {**nowhere, "reason": "retrying"}
    with pytest.raises(DrainFailed, match="not drained after 1.5s"):
        _follow("n", lambda: retrying, wait=1.5, echo=lambda _: None, nowhere_grace=0.6)
    statuses = iter([nowhere, nowhere, {"state": "drained", "handed_off": 3}])
    assert _follow("n", lambda: next(statuses), wait=30, echo=lambda _: None, nowhere_grace=5)["state"] == "drained"
