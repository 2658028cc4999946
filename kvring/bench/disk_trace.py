"""`kvring bench disk`, part 3: the hit rate of a trace replay, memory only vs memory + disk.

The replay is ``kvring trace``'s own (``trace._replay``: LOOKUP a request's blocks, GET the hit
prefix's first layer, PUT the absent blocks, in timestamp order) against 3-node clusters on one
etcd with the same memory per node: one without a disk, two with a disk smaller than the trace's
blocks (where what the disk evicts matters), one evicting first in, first out and one giving the
chunks read since they were written a second chance, and one with a large disk.  Each is held to
an ideal LRU of its capacity in blocks (its memory's, or its disk's, which holds what memory does
too), replayed alongside: the disk lets a cluster go past its memory's, up to the bound where
every repeated block hits.

Its LOOKUPs lease what they find, as the connector's do (``LEASE_MS``), so a chunk found only on
disk is read ahead and held for the GET.  Without a lease a LOOKUP's answer is only a hint: the
disk's writer, writing the last request's PUTs, may evict a segment between the LOOKUP and the
GET and take the hit prefix with it (the misses an unleased replay saw on small disks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from kvring.bench.trace import BLOCK_TOKENS, IdealLRU, _replay, request_keys
from kvring.bench.tracefile import load_trace
from kvring.cachenode.disk.tier import Eviction
from kvring.common.contract import Contract
from kvring.local.cluster import LocalCluster

# The LOOKUP's lease: enough to cover the GET right after it; the connector's 30 s would, in a
# replay running far ahead of the trace's clock, hold the chunks of hundreds of later requests.
LEASE_MS = 1_000


@dataclass(frozen=True)
class TraceCluster:
    """One cluster a trace is replayed against: its disk per node (0: none) and how it evicts."""

    name: str
    disk: int
    eviction: Eviction = Eviction.SECOND_CHANCE


def trace_clusters(small_disk: int, large_disk: int) -> tuple[TraceCluster, ...]:
    return (TraceCluster("memory only", 0), TraceCluster("small disk, fifo", small_disk, Eviction.FIFO),
            TraceCluster("small disk, second chance", small_disk), TraceCluster("large disk", large_disk))


def replay_all(etcd: str, file: Path, limit: int | None, memory: int, clusters: tuple[TraceCluster, ...],
               block_bytes: int, console: Console) -> dict:
    """Replay ``file`` against each of ``clusters``; their figures."""
    from kvring.cachenode.client import ClusterClient

    requests = load_trace(file, limit)
    with console.status("hashing the trace's blocks ..."):
        keys_of = [request_keys(req, "trace") for req in requests]
    requested = sum(map(len, keys_of))
    distinct = len({k for keys in keys_of for k in keys})
    out = {"trace": str(file), "requests": len(requests), "blocks_requested": requested, "distinct_blocks": distinct,
           "block_bytes": block_bytes, "memory_per_node": memory, "nodes": 3,
           "compulsory_bound_hit_rate": (requested - distinct) / max(requested, 1), "systems": {}}
    for i, c in enumerate(clusters):
        console.print(f"trace replay, {c.name}: 3 nodes of {memory >> 20} MiB memory"
                      + (f" and {c.disk >> 20} MiB disk ({c.eviction.value})" if c.disk else ""))
        cluster_name = f"bench-disk-trace-{i}"
        with LocalCluster(nodes=3, memory=memory, etcd=etcd, cluster=cluster_name,
                          contract=Contract(chunk_size=BLOCK_TOKENS), disk=c.disk,
                          node_args=["--disk-eviction", c.eviction.value] if c.disk else None), \
                ClusterClient(etcd, cluster=cluster_name) as client:
            if not client.wait_for_nodes(3, timeout=20):
                raise RuntimeError(f"only {len(client.ring)} nodes joined the ring")
            capacity = sum(s["capacity"] for s in client.stats().values()) // block_bytes
            t0 = time.perf_counter()
            # The disk holds what memory does too: a cluster keeps its disk's worth of distinct blocks.
            tally = _replay(client, keys_of, IdealLRU(max(capacity, 3 * c.disk // block_bytes)), block_bytes,
                            "first-layer", console, lease_ms=LEASE_MS)
            wall = time.perf_counter() - t0
            stats = client.stats()
        disks = [s["disk"] for s in stats.values() if s.get("disk")]
        out["systems"][c.name] = {
            "disk_per_node": c.disk, "eviction": c.eviction.value if c.disk else None,
            "hit_rate": int(tally.hits_kv.sum()) / max(requested, 1),
            "ideal_lru_hit_rate": int(tally.hits_ideal.sum()) / max(requested, 1),
            "memory_capacity_blocks": capacity, "wall_s": wall,
            "prefetched": sum(d["prefetched"] for d in disks),
            "kept_for_reads": sum(d["kept_for_reads"] for d in disks),
            "put_failed": tally.put_failed, "get_lost": tally.get_lost, "get_corrupt": tally.get_corrupt,
            "evictions": sum(s.get("evictions", 0) for s in stats.values()),
            "disk_chunks": sum(d["chunks"] for d in disks), "disk_reads": sum(d["reads"] for d in disks),
            "disk_write_skipped": sum(d["write_skipped"] for d in disks),
            "disk_evicted": sum(d["evicted"] for d in disks), "disk_carried": sum(d["carried"] for d in disks),
        }
    return out
