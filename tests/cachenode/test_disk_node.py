"""The disk tier with real node processes over loopback, real etcd and real files: a cache larger
than memory, restarts that keep the cache (a rolling restart under a reader; SIGKILL in a burst
of PUTs), repair that counts what a restarted node kept, a full filesystem and a stalled disk."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import threading
import time
import urllib.request

import numpy as np
import pytest
from chunk_reader import Reader
from faults import inject
from polling import wait_for

from kvring.cachenode.client import ClusterClient
from kvring.cachenode.disk.marks import MARKS_FILE
from kvring.common.chunk import ChunkItem
from kvring.common.contract import Contract
from kvring.local.cluster import LocalCluster

CHUNK = 256 << 10


def _payload(i: int, size: int = CHUNK) -> bytes:
    seed = hashlib.blake2b(i.to_bytes(4, "little"), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(seed, "little")).bytes(size)


def _key(i: int) -> bytes:
    return hashlib.blake2b(b"disk-%d" % i, digest_size=16).digest()


def _item(i: int, size: int = CHUNK) -> ChunkItem:
    return ChunkItem.of(_key(i), _payload(i, size), (4, size // 4), "uint8", 16)


def _served(client: ClusterClient, indices, size: int = CHUNK) -> tuple[list[int], list[int]]:
    """Which chunks come back byte-identical, and which come back wrong (must be none)."""
    indices = list(indices)
    chunks = client.get([_key(i) for i in indices])
    good = [i for i, c in zip(indices, chunks) if c is not None and bytes(c.data) == _payload(i, size)]
    wrong = [i for i, c in zip(indices, chunks) if c is not None and bytes(c.data) != _payload(i, size)]
    return good, wrong


def _disk(client: ClusterClient, node: str) -> dict:
    return client.stats()[node]["disk"]


def _settled(client: ClusterClient, nodes) -> bool:
    stats = client.stats()
    return all(stats[n]["disk"]["queued"] == 0 for n in nodes)


def test_a_cache_four_times_memory_is_served_whole_from_disk(cluster_factory):
    cluster = cluster_factory(nodes=1, memory=16 << 20, disk=256 << 20)
    n = 256  # 64 MiB of chunks
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(1)
        for start in range(0, n, 32):
            assert client.put_many([_item(i) for i in range(start, start + 32)]) == [1] * 32
        wait_for(lambda: _settled(client, ["node-0"]), 20, "the disk writes")
        stats = client.stats()["node-0"]
        assert stats["evictions"] > n // 2 and stats["disk"]["chunks"] == n
        assert all(client.lookup([_key(i) for i in range(n)]))  # present: in memory or on disk
        good, wrong = _served(client, range(n))
        assert wrong == [] and len(good) == n
        disk = _disk(client, "node-0")
        assert disk["reads"] >= n // 2 and disk["corrupt"] == 0
        assert sorted(client.list_keys("node-0")) == sorted(_key(i) for i in range(n))  # repair pages both tiers
        with urllib.request.urlopen(cluster.nodes[0].admin_addr + "/metrics", timeout=5) as reply:
            metrics = dict(line.rsplit(" ", 1) for line in reply.read().decode().splitlines()
                           if line.startswith("kvring_node_disk_"))
        assert float(metrics["kvring_node_disk_chunks"]) == n and float(metrics["kvring_node_disk_read_total"]) >= n // 2
        assert float(metrics["kvring_node_disk_corrupt_total"]) == 0
        assert client.delete([_key(0)]) == 1 and not client.lookup([_key(0)])[0]


def test_a_chunk_in_use_outlasts_the_disks_cycling_and_a_restart(cluster_factory):
    """The disk evicts whole 16 MiB segments, oldest first.  A chunk memory still holds when its
    segment goes (a hot prefix, read all along) is written again to the newest segment, so it
    stays on disk through the cycling and a restart, while the cold chunks stored with it go."""
    cluster = cluster_factory(nodes=1, memory=4 << 20, disk=48 << 20)
    hot, cold = 0, range(1, 321)  # 80 MiB through a 48 MiB disk: its first segments go
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(1)
        assert client.put_many([_item(hot)]) == [1]
        for start in range(cold.start, cold.stop, 8):
            assert client.put_many([_item(i) for i in range(start, start + 8)]) == [1] * 8
            assert _served(client, [hot]) == ([hot], [])  # in use: memory keeps it
        wait_for(lambda: _settled(client, ["node-0"]), 20, "the disk writes")
        disk = _disk(client, "node-0")
        assert disk["evicted_segments"] >= 2 and disk["rewritten"] >= 1
        with urllib.request.urlopen(cluster.nodes[0].admin_addr + "/metrics", timeout=5) as reply:
            assert f"kvring_node_disk_rewritten_total {float(disk['rewritten'])}" in reply.read().decode()
    cluster.restart(0)
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(1)
        assert client.lookup([_key(hot), _key(1), _key(2)]) == [True, False, False]
        assert _served(client, [hot]) == ([hot], [])
        assert _disk(client, "node-0")["reads"] == 1  # from the disk: memory restarted empty


@pytest.mark.parametrize("eviction,restart,marks_interval", [
    ("second-chance", None, "60"), ("second-chance", "graceful", "60"), ("second-chance", "killed", "0.5"),
    ("second-chance", "killed", "0"), ("fifo", None, "60")],
    ids=["second-chance", "second-chance, restarted after the read", "second-chance, killed after a marks save",
         "second-chance, killed, marks saved at a stop only", "fifo"])
def test_a_chunk_read_from_disk_gets_a_second_chance_when_its_segment_goes(cluster_factory, eviction, restart,
                                                                          marks_interval):
    """A chunk read from disk once (promoted into memory, then let go by memory again) is copied to
    the newest segment when its own goes, so a later request finds it: with the default
    ``second-chance`` eviction, also where the node was restarted between the read and the
    eviction -- gracefully (SIGTERM: a rolling upgrade), or killed (SIGKILL: a crash, an OOM kill)
    after the writer's periodic save of the marks (``--disk-marks-interval``).  Killed with marks
    saved only at a stop, it has lost its mark; ``--disk-eviction fifo`` lets it go with its
    segment."""
    cluster = cluster_factory(nodes=1, memory=4 << 20, disk=48 << 20,
                              node_args=["--disk-eviction", eviction, "--disk-marks-interval", marks_interval])
    warm = 0
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(1)
        assert client.put_many([_item(i) for i in range(33)]) == [1] * 33  # memory (16 chunks) lets warm go
        wait_for(lambda: _settled(client, ["node-0"]), 20, "the disk writes")
        assert _served(client, [warm]) == ([warm], []) and _disk(client, "node-0")["reads"] == 1
        saved_in_time = restart != "killed" or float(marks_interval) > 0
        if restart == "killed" and saved_in_time:
            marks = os.path.join(cluster.nodes[0].disk_dir, MARKS_FILE)
            wait_for(lambda: os.path.exists(marks), 10, "the writer's save of the read marks")
        if restart:
            cluster.restart(0, graceful=restart == "graceful")  # memory comes back empty; the disk's marks come back
            assert client.wait_for_nodes(1)
            assert _disk(client, "node-0")["rebuild"]["read_marks"] == int(saved_in_time)
        for start in range(33, 321, 8):  # 80 MiB through a 48 MiB disk: warm's segment goes
            assert client.put_many([_item(i) for i in range(start, start + 8)]) == [1] * 8
        wait_for(lambda: _settled(client, ["node-0"]), 20, "the disk writes")
        disk = _disk(client, "node-0")
        assert disk["eviction"] == eviction and disk["evicted_segments"] >= 1 and not client.lookup([_key(1)])[0]
        assert disk["rewritten"] == 0  # memory had let it go: only the second chance can keep it
        kept = eviction == "second-chance" and saved_in_time
        assert disk["carried"] == int(kept)
        with urllib.request.urlopen(cluster.nodes[0].admin_addr + "/metrics", timeout=5) as reply:
            assert f"kvring_node_disk_carried_total {float(int(kept))}" in reply.read().decode()
        assert client.lookup([_key(warm)]) == [kept]
        assert _served(client, [warm]) == ([warm] if kept else [], [])


def test_a_disk_too_small_to_keep_what_memory_holds_stays_first_in_first_out_and_settles(cluster_factory):
    """With a disk no larger than memory, every segment that goes holds only chunks memory has:
    writing them again would push out the next segment, and so on without end.  Such a disk
    writes each chunk once and keeps first in, first out."""
    cluster = cluster_factory(nodes=1, memory=32 << 20, disk=32 << 20)
    n = 192  # 48 MiB through memory and disk of 32 MiB
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(1)
        for start in range(0, n, 32):
            assert client.put_many([_item(i) for i in range(start, start + 32)]) == [1] * 32
        wait_for(lambda: _settled(client, ["node-0"]), 20, "the disk writes")
        time.sleep(1.0)
        disk = _disk(client, "node-0")
        assert disk["evicted_segments"] >= 1 and disk["rewritten"] == 0 and disk["written"] == n
        assert _settled(client, ["node-0"])


def test_every_node_restarted_in_turn_under_a_reader_keeps_its_chunks(cluster_factory):
    """One copy per chunk, three nodes restarted one after another: without a disk the roll
    loses every chunk (each node comes back empty); with one, at least 99 % (in practice all)
    are served byte-identical after it."""
    n = 300
    cluster = cluster_factory(nodes=3, memory=32 << 20, disk=256 << 20, lease_ttl=3)
    node_ids = [node.node_id for node in cluster.nodes]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=2.0, failure_backoff=0.5) as client, \
            ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=2.0, failure_backoff=0.5) as reading:
        assert client.wait_for_nodes(3)
        for start in range(0, n, 50):
            assert client.put_many([_item(i) for i in range(start, start + 50)]) == [1] * 50
        wait_for(lambda: _settled(client, node_ids), 20, "the disk writes")
        reader = Reader(reading, n, _key, _payload, batch=8)
        thread = threading.Thread(target=reader.run, daemon=True)
        thread.start()
        try:
            for index in range(3):
                old_pid = cluster.nodes[index].pid
                new = cluster.restart(index)  # SIGTERM, then the same id and directory
                assert new.pid != old_pid
                assert client.wait_for_nodes(3, timeout=20, exact=True)
                rebuild = client.stats()[new.node_id]["disk"]["rebuild"]
                assert rebuild["chunks"] > 0 and not any(rebuild["dropped"].values())
        finally:
            reader.stop.set()
            thread.join(10)
        good, wrong = _served(client, range(n))
        assert wrong == [] and reader.wrong == []
        assert len(good) >= 0.99 * n, f"{len(good)} of {n} chunks readable after the roll"
        assert reader.reads > 0


def test_a_node_sigkilled_in_a_burst_of_puts_serves_every_chunk_stored_before_it(cluster_factory):
    before, burst = 120, 600
    cluster = cluster_factory(nodes=1, memory=256 << 20, disk=512 << 20, lease_ttl=3)
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=2.0, failure_backoff=0.5) as client:
        assert client.wait_for_nodes(1)
        for start in range(0, before, 40):
            assert client.put_many([_item(i) for i in range(start, start + 40)]) == [1] * 40
        # Stored before the burst: on disk once the node's write queue has taken them (/stats).
        wait_for(lambda: _settled(client, ["node-0"]), 20, "the disk writes")

        acked: list[int] = []

        def put_burst() -> None:
            for i in range(before, before + burst):
                try:
                    if client.put_many([_item(i)]) == [1]:
                        acked.append(i)
                except Exception:
                    return

        thread = threading.Thread(target=put_burst, daemon=True)
        thread.start()
        wait_for(lambda: len(acked) >= 100, 30, "100 PUTs of the burst")
        cluster.nodes[0].kill()  # SIGKILL in the middle of the burst
        thread.join(30)
        cluster.restart_empty(0)
        assert client.wait_for_nodes(1, timeout=20)
        good, wrong = _served(client, range(before))
        assert wrong == [] and good == list(range(before))
        kept, wrong_burst = _served(client, range(before, before + burst))
        assert wrong_burst == []  # only whole, correct chunks
        assert set(kept) <= set(range(before, before + burst)) and len(kept) >= 1
        dropped = _disk(client, "node-0")["rebuild"]["dropped"]
        assert dropped["entries_past_end"] == 0  # a journal entry never names bytes not on disk


def test_a_graceful_stop_writes_every_queued_chunk_first(cluster_factory):
    """SIGTERM right after the last PUT is answered, with chunks still queued for the disk: the
    node writes them all before it exits, so its restart serves every one."""
    n = 200
    cluster = cluster_factory(nodes=1, memory=256 << 20, disk=512 << 20, lease_ttl=3,
                              node_args=["--fault-injection"])
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=5.0) as client:
        assert client.wait_for_nodes(1)
        inject(cluster, cluster.nodes[0], "disk-stall?seconds=1")  # a slow disk: the PUTs outrun it
        for start in range(0, n, 50):
            assert client.put_many([_item(i) for i in range(start, start + 50)]) == [1] * 50
        assert _disk(client, "node-0")["queued"] > 0
        cluster.restart(0)  # SIGTERM: the queue is written, then the node exits
        assert client.wait_for_nodes(1, timeout=20)
        assert _disk(client, "node-0")["rebuild"]["chunks"] == n
        good, wrong = _served(client, range(n))
        assert wrong == [] and good == list(range(n))


def test_repair_counts_the_copies_a_restarted_node_kept(cluster_factory):
    """Two copies per chunk: a node SIGKILLed and restarted with its disk holds its copies again at
    once, so the survivors' repair passes find nothing missing and copy nothing to it."""
    n = 120
    cluster = cluster_factory(nodes=3, memory=64 << 20, disk=256 << 20, lease_ttl=3,
                              contract=Contract(replication=2))
    node_ids = [node.node_id for node in cluster.nodes]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=2.0, failure_backoff=0.5) as client:
        assert client.wait_for_nodes(3)
        for start in range(0, n, 40):
            assert client.put_many([_item(i, 64 << 10) for i in range(start, start + 40)]) == [2] * 40
        wait_for(lambda: _settled(client, node_ids), 20, "the disk writes")
        stats = client.stats()
        passes = {node: stats[node]["repair"]["passes"] for node in node_ids[1:]}
        copied = sum(stats[node]["repair"]["copied_total"] for node in node_ids)
        cluster.restart_empty(0)
        assert client.wait_for_nodes(3, timeout=20, exact=True)
        # Each survivor runs a pass for the ring change (node-0's new incarnation).
        wait_for(lambda: all((st := client.stats())[node]["repair"]["passes"] > passes[node]
                             and not st[node]["repair"]["active"] for node in node_ids[1:]), 30,
                 "the survivors' repair passes after the restart")
        stats = client.stats()
        assert sum(stats[node]["repair"]["copied_total"] for node in node_ids) == copied
        assert sum(stats[node]["repair"]["missing"] for node in node_ids[1:]) == 0
        assert all(c == 2 for c in client.copies(node_ids).values()) and len(client.copies(node_ids)) == n


@pytest.mark.skipif(os.geteuid() != 0, reason="a real full filesystem needs a small tmpfs mounted, which needs root")
def test_a_full_filesystem_leaves_the_node_serving_from_memory(etcd_server):
    mount = tempfile.mkdtemp(prefix="kvring-full-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", mount], check=True)
    cluster = LocalCluster(nodes=1, memory=128 << 20, etcd=etcd_server.endpoint, cluster="disk-full",
                           disk=1 << 30)
    cluster.nodes[0].disk_dir = os.path.join(mount, "node-0")  # a filesystem far smaller than --disk-capacity
    try:
        cluster.start()
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            assert client.wait_for_nodes(1)
            n = 96  # 24 MiB: three times the filesystem
            for start in range(0, n, 16):
                assert client.put_many([_item(i) for i in range(start, start + 16)]) == [1] * 16
            wait_for(lambda: _settled(client, ["node-0"]), 20, "the disk writes")
            disk = _disk(client, "node-0")
            assert disk["full"] > 0 and disk["written"] < n  # ENOSPC met, counted
            good, wrong = _served(client, range(n))
            assert wrong == [] and len(good) == n  # every chunk served, from memory
            assert client.ping("node-0") < 1.0
    finally:
        cluster.close()
        subprocess.run(["umount", mount], check=False)
        os.rmdir(mount)


def test_a_stalled_disk_never_stalls_the_data_loop_or_other_clients(cluster_factory):
    cluster = cluster_factory(nodes=1, memory=16 << 20, disk=256 << 20, node_args=["--fault-injection"])
    n = 128  # 32 MiB: the first chunks are on disk only
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=5.0) as client:
        assert client.wait_for_nodes(1)
        for start in range(0, n, 32):
            assert client.put_many([_item(i) for i in range(start, start + 32)]) == [1] * 32
        wait_for(lambda: _settled(client, ["node-0"]), 20, "the disk writes")
        inject(cluster, cluster.nodes[0], "disk-stall?seconds=4")
        stalled = time.monotonic()
        t0 = time.monotonic()
        assert client.put_many([_item(n)]) == [1]  # a PUT: stored in memory, queued for the disk
        good, _ = _served(client, [n - 1, n])  # chunks in memory
        assert good == [n - 1, n]
        assert client.ping("node-0") < 0.5
        assert time.monotonic() - t0 < 1.5  # none of it waited on the disk
        t0 = time.monotonic()
        chunk = client.get([_key(0)])[0]  # on disk only: answered as a miss once the read times out
        assert chunk is None and 1.5 < time.monotonic() - t0 < 3.5
        assert _disk(client, "node-0")["read_timeouts"] >= 1
        time.sleep(max(0.0, stalled + 4.5 - time.monotonic()))
        good, wrong = _served(client, [0, 1, n])  # the disk is back: served, byte-identical
        assert wrong == [] and good == [0, 1, n]
