"""`kvring bench disk`, part 2: index rebuild and restart-to-first-hit with many chunks on disk.

For each chunk count: a 1-node cluster starts (recording its contract and the disk directory's
identity), its node is stopped, and the directory is filled in this process through the node's
own ``DiskTier`` (same cluster, node id and contract; syncing off, as this only prepares files:
the files are synced before any timing).  Then, per repetition: the segment files are synced
and dropped from the page cache (a cold start), the node process is spawned on the directory,
and the wall time is taken to READY (the index rebuilt from the journals, the node registered)
and to the first GET of a kept chunk (a random one, read from disk and compared byte for byte)
answered to a client that was connected all along.  The rebuild's own seconds come from the
node's ``/stats`` (``disk.rebuild.seconds``), with the chunk count it found.
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvring.bench.disk_io import DiskBenchError, chunk_key, drop_page_cache
from kvring.cachenode.disk.identity import DiskIdentity
from kvring.cachenode.disk.tier import DiskConfig, DiskTier
from kvring.common.chunk import ChunkItem
from kvring.common.errors import KVRingError
from kvring.local.cluster import LocalCluster

PER_CHUNK_OVERHEAD = 256  # record head + header + journal entry, generously


@dataclass(frozen=True)
class RestartRound:
    rebuild_s: float  # the node's own disk.rebuild.seconds
    ready_s: float  # spawn -> READY
    first_hit_s: float  # spawn -> first GET of a kept chunk answered
    chunks: int  # what the rebuild found
    segments: int


def _payload(i: int, nbytes: int) -> np.ndarray:
    out = np.full(nbytes, i & 0xFF, dtype=np.uint8)
    out[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
    return out


def capacity_for(chunks: int, payload_bytes: int) -> int:
    return max(64 << 20, int(chunks * (payload_bytes + PER_CHUNK_OVERHEAD) * 1.5))


def fill(directory: str, identity: DiskIdentity, capacity: int, chunks: int, payload_bytes: int,
         advance: Callable[[int], None]) -> None:
    """Write ``chunks`` chunks into ``directory`` through a ``DiskTier`` of this process."""
    tier = DiskTier(DiskConfig(directory, capacity, sync=False, write_queue=64 << 20), identity,
                    take=lambda n: np.empty(n, np.uint8))
    tier.open()
    try:
        shape = (4, payload_bytes // 4)
        for i in range(chunks):
            item = ChunkItem.of(chunk_key("rebuild", i), _payload(i, payload_bytes), shape, "uint8", 16)
            while not tier.write(item.key, item.meta, item.payload):  # the queue is full: let the writer catch up
                time.sleep(0.002)
            if i % 1000 == 999:
                advance(1000)
        while tier.stats()["queued"]:
            time.sleep(0.01)
        advance(chunks % 1000)
    finally:
        tier.close()
    if len(tier) != chunks:
        raise DiskBenchError(f"the tier holds {len(tier)} of the {chunks} chunks written into it")


def measure(etcd: str, root: Path, chunks: int, payload_bytes: int, repetitions: int, memory: int,
            progress: Callable[[str, int | None], Callable[[int], None]]) -> list[RestartRound]:
    """Fill a directory with ``chunks`` chunks and time ``repetitions`` cold starts of a node on it."""
    from kvring.cachenode.client import ClusterClient

    capacity = capacity_for(chunks, payload_bytes)
    name = f"bench-disk-rebuild-{chunks}"
    cluster = LocalCluster(nodes=1, memory=memory, etcd=etcd, cluster=name, disk=capacity, disk_root=str(root))
    rounds = []
    try:
        cluster.start()
        node = cluster.nodes[0]
        with ClusterClient(etcd, cluster=name, timeout=5.0, failure_backoff=0.05) as client:
            if not client.wait_for_nodes(1, timeout=20):
                raise DiskBenchError("the node did not join the ring")
            node.stop()
            identity = DiskIdentity(name, node.node_id, cluster.contract.to_json().decode())
            fill(node.disk_dir, identity, capacity, chunks, payload_bytes,
                 progress(f"writing {chunks:,} chunks of {payload_bytes} B into a disk directory", chunks))
            pick = random.Random(chunks)
            advance = progress(f"{repetitions} cold restarts on {chunks:,} chunks", repetitions)
            for _ in range(repetitions):
                cluster.nodes[0].stop()
                drop_page_cache(node.disk_dir)
                i = pick.randrange(chunks)
                key = chunk_key("rebuild", i)
                t0 = time.perf_counter()
                cluster.restart(0, timeout=600)
                ready = time.perf_counter() - t0
                chunk = _first_hit(client, key, deadline=time.monotonic() + 60)
                hit = time.perf_counter() - t0
                if not np.array_equal(np.frombuffer(chunk.data, np.uint8), _payload(i, payload_bytes)):
                    raise DiskBenchError(f"kept chunk {i} came back with other bytes")
                rebuild = client.stats()[node.node_id]["disk"]["rebuild"]
                if rebuild["chunks"] != chunks:
                    raise DiskBenchError(f"the rebuild found {rebuild['chunks']} of {chunks} chunks: {rebuild}")
                rounds.append(RestartRound(rebuild["seconds"], ready, hit, rebuild["chunks"], rebuild["segments"]))
                advance(1)
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
    return rounds


def _first_hit(client, key: bytes, deadline: float):
    while True:
        if len(client.ring):
            try:
                chunk = client.get([key])[0]
            except KVRingError:  # the client has not seen the node come back yet
                chunk = None
            if chunk is not None:
                return chunk
        if time.monotonic() > deadline:
            raise DiskBenchError("no GET of a kept chunk was answered within 60 s of READY")
        time.sleep(0.001)
