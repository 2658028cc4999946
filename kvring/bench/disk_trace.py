"""`kvring bench disk`, part 3: the hit rate of a trace replay, memory only vs memory + disk.

The replay is ``kvring trace``'s own (``trace._replay``: LOOKUP a request's blocks, GET the hit
prefix's first layer, PUT the absent blocks, in timestamp order) against two 3-node clusters on
one etcd with the same memory per node, one of them with a disk tier per node.  The ideal LRU
replayed alongside has the memory's capacity in blocks (the same in both runs): the disk lets a
cluster go past it, up to the bound where every repeated block hits.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from kvring.bench.trace import BLOCK_TOKENS, IdealLRU, _replay, request_keys
from kvring.bench.tracefile import load_trace
from kvring.common.contract import Contract
from kvring.local.cluster import LocalCluster

SYSTEMS = ("memory only", "memory + disk")


def replay_both(etcd: str, file: Path, limit: int | None, memory: int, disk: int, block_bytes: int,
                console: Console) -> dict:
    """Replay ``file`` against a memory-only and a memory + disk cluster; their figures."""
    from kvring.cachenode.client import ClusterClient

    requests = load_trace(file, limit)
    with console.status("hashing the trace's blocks ..."):
        keys_of = [request_keys(req, "trace") for req in requests]
    requested = sum(map(len, keys_of))
    distinct = len({k for keys in keys_of for k in keys})
    out = {"trace": str(file), "requests": len(requests), "blocks_requested": requested, "distinct_blocks": distinct,
           "block_bytes": block_bytes, "memory_per_node": memory, "disk_per_node": disk, "nodes": 3,
           "compulsory_bound_hit_rate": (requested - distinct) / max(requested, 1), "systems": {}}
    for name in SYSTEMS:
        with_disk = name == "memory + disk"
        console.print(f"trace replay, {name}: 3 nodes of {memory >> 20} MiB memory"
                      + (f" and {disk >> 20} MiB disk" if with_disk else ""))
        cluster_name = "bench-disk-trace-" + ("disk" if with_disk else "memory")
        with LocalCluster(nodes=3, memory=memory, etcd=etcd, cluster=cluster_name,
                          contract=Contract(chunk_size=BLOCK_TOKENS), disk=disk if with_disk else 0), \
                ClusterClient(etcd, cluster=cluster_name) as client:
            if not client.wait_for_nodes(3, timeout=20):
                raise RuntimeError(f"only {len(client.ring)} nodes joined the ring")
            capacity = sum(s["capacity"] for s in client.stats().values()) // block_bytes
            t0 = time.perf_counter()
            tally = _replay(client, keys_of, IdealLRU(capacity), block_bytes, "first-layer", console)
            wall = time.perf_counter() - t0
            stats = client.stats()
        disks = [s["disk"] for s in stats.values() if s.get("disk")]
        out["systems"][name] = {
            "hit_rate": int(tally.hits_kv.sum()) / max(requested, 1),
            "ideal_lru_hit_rate": int(tally.hits_ideal.sum()) / max(requested, 1),
            "memory_capacity_blocks": capacity, "wall_s": wall,
            "put_failed": tally.put_failed, "get_lost": tally.get_lost, "get_corrupt": tally.get_corrupt,
            "evictions": sum(s.get("evictions", 0) for s in stats.values()),
            "disk_chunks": sum(d["chunks"] for d in disks), "disk_reads": sum(d["reads"] for d in disks),
            "disk_write_skipped": sum(d["write_skipped"] for d in disks),
            "disk_evicted": sum(d["evicted"] for d in disks),
        }
    return out
