"""Fenced membership, with real etcd and real node processes: a node id is claimed only if no
running node holds it, a record deleted behind a node's back comes back, and a node whose id
another node took over stops."""

from __future__ import annotations

import os
import signal
import time

import pytest
from polling import readyz, wait_for

from kvring.local.cluster import NodeProcess


def _members(cluster) -> dict:
    return cluster.etcd_run(lambda e: e.members())[0]


def _twin(cluster, node: NodeProcess, **kw) -> NodeProcess:
    """Another node process under ``node``'s id, on ports of its own."""
    return NodeProcess(node.node_id, node.memory, cluster.etcd, cluster.cluster, node.lease_ttl, cluster.contract,
                       **kw)


def test_a_duplicate_node_id_is_refused_and_the_live_node_stays_on_the_ring(cluster_factory):
    cluster = cluster_factory(nodes=1, lease_ttl=3)
    live = cluster.nodes[0]
    impostor = _twin(cluster, live)
    with pytest.raises(RuntimeError) as refused:
        impostor.start(timeout=20)
    message = str(refused.value)
    assert "exited (code 2)" in message
    assert f"node id 'node-0' is held by a running node at {live.data_addr}" in message
    assert "another --node-id" in message
    # The record is the live node's, and stays so after the impostor is gone (past its lease TTL).
    time.sleep(live.lease_ttl + 1)
    record = _members(cluster)["node-0"]
    assert record.data_addr == live.data_addr and record.pid == live.pid
    assert readyz(live.admin_addr) == 200


def test_a_record_deleted_behind_a_nodes_back_comes_back_within_the_ttl(cluster_factory):
    cluster = cluster_factory(nodes=1, lease_ttl=3)
    node = cluster.nodes[0]
    key = f"/kvring/{cluster.cluster}/nodes/node-0".encode()
    assert "node-0" in _members(cluster)
    deleted_keys = cluster.etcd_run(lambda e: e.call(lambda c: c.delete(key))).deleted
    deleted = time.monotonic()
    assert deleted_keys == 1  # (reading the members now would race with the node writing it back)
    wait_for(lambda: "node-0" in _members(cluster), node.lease_ttl + 2, "the record written again")
    assert time.monotonic() - deleted <= node.lease_ttl + 2
    assert _members(cluster)["node-0"].data_addr == node.data_addr


def test_a_restarted_node_takes_over_its_previous_record_at_once(cluster_factory):
    """A SIGKILLed node's record outlives it until its lease runs out; the node restarted under
    its id (on other ports, as a rescheduled pod) finds it not answering and takes it over."""
    cluster = cluster_factory(nodes=1, lease_ttl=10)
    old = cluster.nodes[0]
    old.kill()
    assert _members(cluster)["node-0"].data_addr == old.data_addr  # the lease still runs
    started = time.monotonic()
    new = _twin(cluster, old).start(timeout=20)
    cluster.nodes[0] = new
    assert time.monotonic() - started < old.lease_ttl / 2  # did not wait for the old lease
    assert _members(cluster)["node-0"].data_addr == new.data_addr


def test_a_node_whose_id_was_taken_over_stops(cluster_factory):
    """A node frozen (SIGSTOP) while a new process takes its id over must not come back as a
    second holder: at its next lease refresh it finds the record under another lease and exits."""
    cluster = cluster_factory(nodes=1, lease_ttl=3)
    frozen = cluster.nodes[0]
    os.killpg(frozen.pid, signal.SIGSTOP)
    try:
        successor = _twin(cluster, frozen).start(timeout=20)  # the frozen one does not answer PING
        cluster.nodes.append(successor)
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)
    code = frozen.proc.wait(timeout=frozen.lease_ttl + 5)
    assert code == 2
    assert _members(cluster)["node-0"].data_addr == successor.data_addr
    assert readyz(successor.admin_addr) == 200
