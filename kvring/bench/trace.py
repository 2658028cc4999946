"""Replay a Mooncake-format request trace against a kvring cluster (``kvring trace``).

Each line of the trace is ``{"timestamp", "input_length", "output_length", "hash_ids"}``,
where ``hash_ids`` are 512-token prefix blocks (``tracefile.py`` reads and checks the file).
Every id becomes a deterministic block of 512 token ids (a vectorised SplitMix64 of ``id * 512 + position``, modulo a 32k vocabulary),
and a request's keys are ``chained_hashes`` of its concatenated blocks, so equal id prefixes
give equal keys — the trace's prefix semantics.  The prompt is cut at ``input_length``
tokens and, as in a real prefix cache, only *full* blocks are keys: a partial last block is
never stored (``partial_blocks_dropped`` in the results counts them).

Requests are replayed in timestamp order, one at a time, each as a serving engine would:
LOOKUP all its keys (one batched call); hits = the longest present prefix; read the hit
prefix back (GET of the first layer by default, which refreshes the nodes' LRU as a real
load would, without moving every byte; ``load_hits="all"`` reads whole blocks, ``"none"``
skips the read, and then LOOKUP alone does not refresh recency); PUT the blocks that were not
present (``block_bytes`` each, ``[layers, block_bytes / layers]`` uint8, content from the key).
An in-process ideal LRU with the cluster's total capacity in blocks is replayed alongside
with the same prefix-hit rule.  Results: hit rate vs that ideal, stored bytes and key load
per node (primary owners of the looked-up and stored keys), the nodes' own counters, speed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from kvring.bench.report import write_outputs
from kvring.bench.tracefile import TraceRequest, load_trace
from kvring.cachenode.client import ClusterClient
from kvring.common.chunk import ChunkItem
from kvring.common.contract import Contract
from kvring.common.errors import KVRingError
from kvring.common.hashing import chained_hashes
from kvring.common.units import format_size
from kvring.local.cluster import LocalCluster
from kvring.local.rundir import run_directory

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 512
VOCAB = 32_000
PREFERRED_LAYERS = 32
LOAD_MODES = ("first-layer", "all", "none")
_U = np.uint64


def block_tokens(hash_ids: Sequence[int]) -> np.ndarray:
    """512 deterministic token ids per hash id, concatenated (SplitMix64, vectorised)."""
    x = np.asarray(hash_ids, dtype=_U)[:, None] * _U(BLOCK_TOKENS) + np.arange(BLOCK_TOKENS, dtype=_U)
    x += _U(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U(30))) * _U(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U(27))) * _U(0x94D049BB133111EB)
    x ^= x >> _U(31)
    return (x % _U(VOCAB)).astype(np.int64).reshape(-1)


def request_keys(request: TraceRequest, namespace: str) -> list[bytes]:
    """Chained keys of the request's full 512-token blocks."""
    tokens = block_tokens(request.hash_ids)[:request.input_length]
    return chained_hashes(namespace, tokens, BLOCK_TOKENS)


def block_shape(block_bytes: int) -> list[int]:
    """``[layers, bytes per layer]`` of a block, with as many layers (<= 32) as divide it."""
    layers = next(n for n in (PREFERRED_LAYERS, 16, 8, 4, 2, 1) if block_bytes % n == 0)
    return [layers, block_bytes // layers]


def block_payload(key: bytes, block_bytes: int) -> bytes:
    """Deterministic content of a block: its key repeated."""
    return (key * (block_bytes // len(key) + 1))[:block_bytes]


def prefix_hits(present: Sequence[bool]) -> int:
    """Length of the leading run of ``True``."""
    for i, hit in enumerate(present):
        if not hit:
            return i
    return len(present)


class IdealLRU:
    """One LRU cache of ``capacity`` blocks: the yardstick a partitioned cluster is held to."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def request(self, keys: Sequence[bytes]) -> int:
        """Prefix hits of one request, then insert (or refresh) all its blocks."""
        blocks = self._blocks
        hits = prefix_hits([k in blocks for k in keys])
        for key in keys:
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
                if len(blocks) > self.capacity:
                    blocks.popitem(last=False)
        return hits


def _max_mean(values: Sequence[float]) -> float:
    mean = float(np.mean(values)) if len(values) else 0.0
    return float(np.max(values)) / mean if mean > 0 else 0.0


@dataclass
class _Tally:
    """What the replay counts: prefix hits per request (kvring and ideal) and keys per primary owner."""

    hits_kv: np.ndarray
    hits_ideal: np.ndarray
    lookup: Counter[str] = field(default_factory=Counter)
    put: Counter[str] = field(default_factory=Counter)
    get: Counter[str] = field(default_factory=Counter)
    put_failed: int = 0
    get_lost: int = 0
    get_corrupt: int = 0


def _replay(client: ClusterClient, keys_of: list[list[bytes]], lru: IdealLRU, block_bytes: int,
            load_hits: str, console: Console, lease_ms: int = 0) -> _Tally:
    """Replay every request in order (LOOKUP, GET the hit prefix, PUT the absent blocks);
    ``lease_ms``: the LOOKUP's lease, as the connector's keeps what it found for its load."""
    n = len(keys_of)
    tally = _Tally(np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))
    sizes = np.cumsum([len(keys) for keys in keys_of])
    shape, layers = block_shape(block_bytes), {"first-layer": (0, 1), "all": None}.get(load_hits)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("hit {task.fields[hit]:.3f} ideal {task.fields[ideal]:.3f}"),
                  TimeRemainingColumn(), console=console) as progress:
        task = progress.add_task("replaying", total=n, hit=0.0, ideal=0.0)
        for i, keys in enumerate(keys_of):
            if keys:
                present = client.lookup(keys, lease_ms)
                hit = prefix_hits(present)
                owner = client.ring.primaries(keys)
                tally.lookup.update(owner)
                if hit and load_hits != "none":
                    tally.get.update(owner[:hit])
                    for key, chunk in zip(keys, client.get(keys[:hit], layers=layers)):
                        if chunk is None:
                            tally.get_lost += 1
                        elif bytes(chunk.data[:64]) != block_payload(key, min(64, chunk.data.size)):
                            tally.get_corrupt += 1
                absent = [j for j, p in enumerate(present) if not p]
                tally.put.update(owner[j] for j in absent)
                try:
                    stored = client.put_many([ChunkItem.of(keys[j], block_payload(keys[j], block_bytes), shape, "uint8",
                                               BLOCK_TOKENS) for j in absent])
                    tally.put_failed += stored.count(0)
                except KVRingError as exc:
                    logger.warning("PUT of %d blocks failed: %s", len(absent), exc)
                    tally.put_failed += len(absent)
                tally.hits_kv[i], tally.hits_ideal[i] = hit, lru.request(keys)
            if i % 64 == 0 or i == n - 1:
                done = max(int(sizes[i]), 1)
                progress.update(task, completed=i + 1, hit=tally.hits_kv[:i + 1].sum() / done,
                                ideal=tally.hits_ideal[:i + 1].sum() / done)
    return tally


def run_trace(file: Path, nodes: int = 3, memory: int = 1 << 30, etcd: str | None = None,
              limit: int | None = None, block_bytes: int = 64 << 10, json_out: Path | None = None,
              plot: Path | None = None, *, cluster: str = "default", load_hits: str = "first-layer") -> dict:
    """Replay ``file`` against the cluster at ``etcd`` (or a local one started here); see the module doc."""
    if load_hits not in LOAD_MODES:
        raise ValueError(f"load_hits must be one of {LOAD_MODES}, got {load_hits!r}")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    console = Console()
    requests = load_trace(file, limit)
    local = etcd is None  # start a cluster of its own
    # A fresh local cluster is empty; on a shared one a per-run namespace keeps old blocks from counting as hits.
    namespace = "trace" if local else f"trace-{os.getpid()}-{time.time_ns()}"
    with console.status("hashing the trace's blocks ..."):
        keys_of = [request_keys(req, namespace) for req in requests]
    blocks_requested = sum(map(len, keys_of))
    distinct = len({k for keys in keys_of for k in keys})

    with run_directory("trace"), contextlib.ExitStack() as stack:
        if local:
            console.print(f"starting etcd and {nodes} nodes of {format_size(memory)} ...")
            etcd = stack.enter_context(LocalCluster(nodes=nodes, memory=memory,
                                                    contract=Contract(chunk_size=BLOCK_TOKENS))).etcd
        with ClusterClient(etcd, cluster=cluster) as client:
            if not client.wait_for_nodes(nodes if local else 1, timeout=15):
                raise RuntimeError(f"only {len(client.ring)} nodes joined the ring")
            before = client.stats()
            capacity_blocks = sum(s.get("capacity", 0) for s in before.values()) // block_bytes
            if capacity_blocks >= distinct:
                logger.warning("all %d distinct blocks fit in %d blocks of capacity: the hit rate will equal the "
                               "ideal trivially; choose --memory below %s per node to make eviction matter",
                               distinct, capacity_blocks, format_size(distinct * block_bytes / len(client.ring)))
            t0 = time.perf_counter()
            tally = _replay(client, keys_of, IdealLRU(capacity_blocks), block_bytes, load_hits, console)
            wall = time.perf_counter() - t0
            after = client.stats()

    per_node: dict[str, dict] = {}
    for node_id in sorted(set(before) | set(after) | set(tally.lookup)):  # the ring may change during a run
        a, b = after.get(node_id, {}), before.get(node_id, {})
        per_node[node_id] = {
            "used": a.get("used", 0), "chunks": a.get("chunks", 0), "capacity": a.get("capacity", 0),
            "evictions": a.get("evictions", 0) - b.get("evictions", 0),
            "node_hits": a.get("hits", 0) - b.get("hits", 0), "node_misses": a.get("misses", 0) - b.get("misses", 0),
            "lookup_keys": tally.lookup[node_id], "put_keys": tally.put[node_id], "get_keys": tally.get[node_id],
            "load": tally.lookup[node_id] + tally.put[node_id], "errors": a.get("errors", {}),
        }
    hit_blocks, ideal_blocks = int(tally.hits_kv.sum()), int(tally.hits_ideal.sum())
    total = max(blocks_requested, 1)
    cum = np.maximum(np.cumsum([len(keys) for keys in keys_of]), 1)
    pick = np.unique(np.linspace(0, len(requests) - 1, min(len(requests), 400)).astype(int)) if requests else []
    results = {
        "trace": str(file), "requests": len(requests), "blocks_requested": blocks_requested,
        "partial_blocks_dropped": sum(len(r.hash_ids) for r in requests) - blocks_requested,
        "distinct_blocks": distinct, "nodes": len(per_node), "memory_per_node": memory if local else None,
        "block_bytes": block_bytes, "block_shape": block_shape(block_bytes), "capacity_blocks": capacity_blocks,
        "capacity_fraction_of_distinct": capacity_blocks / max(distinct, 1), "load_hits": load_hits,
        "hit_blocks": hit_blocks, "hit_rate": hit_blocks / total,
        "ideal_lru_hit_blocks": ideal_blocks, "ideal_lru_hit_rate": ideal_blocks / total,
        "ratio_to_ideal": hit_blocks / ideal_blocks if ideal_blocks else None,
        "compulsory_bound_hit_rate": (blocks_requested - distinct) / total,
        "put_blocks": tally.put.total(), "put_failed": tally.put_failed,
        "get_lost": tally.get_lost, "get_corrupt": tally.get_corrupt,
        "bytes_max_mean": _max_mean([p["used"] for p in per_node.values()]),
        "load_max_mean": _max_mean([p["load"] for p in per_node.values()]),
        "wall_s": wall, "requests_per_s": len(requests) / wall if wall > 0 else 0.0,
        "per_node": per_node,
        "curve": {"request": [int(i) + 1 for i in pick],
                  "kvring": [float(v) for v in (np.cumsum(tally.hits_kv) / cum)[pick]],
                  "ideal_lru": [float(v) for v in (np.cumsum(tally.hits_ideal) / cum)[pick]]},
    }
    _print_tables(console, results)
    write_outputs(console, results, json_out, plot, _plot)
    return results


def _print_tables(console: Console, r: dict) -> None:
    from rich.table import Table

    summary = Table(title=f"trace replay: {Path(r['trace']).name}", show_header=False)
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    rows = [
        ("requests", f"{r['requests']:,}"),
        ("blocks requested (full 512-token blocks)", f"{r['blocks_requested']:,}"),
        ("partial last blocks not cached", f"{r['partial_blocks_dropped']:,}"),
        ("distinct blocks", f"{r['distinct_blocks']:,}"),
        ("capacity (blocks)", f"{r['capacity_blocks']:,} ({r['capacity_fraction_of_distinct']:.1%} of distinct)"),
        ("kvring hit rate", f"{r['hit_rate']:.4f}"),
        ("ideal LRU hit rate", f"{r['ideal_lru_hit_rate']:.4f}"),
        ("ratio kvring / ideal", "n/a" if r["ratio_to_ideal"] is None else f"{r['ratio_to_ideal']:.4f}"),
        ("bound: all repeats hit", f"{r['compulsory_bound_hit_rate']:.4f}"),
        ("stored bytes max/mean", f"{r['bytes_max_mean']:.3f}"),
        ("key load max/mean (lookups+puts)", f"{r['load_max_mean']:.3f}"),
        ("puts / failed puts", f"{r['put_blocks']:,} / {r['put_failed']:,}"),
        ("hit reads lost / corrupt", f"{r['get_lost']:,} / {r['get_corrupt']:,}"),
        ("wall time", f"{r['wall_s']:.1f} s ({r['requests_per_s']:.0f} requests/s)"),
    ]
    for row in rows:
        summary.add_row(*row)
    console.print(summary)
    names = list(r["per_node"])
    nodes = Table(title="per node")
    nodes.add_column("")
    for name in [*names, "max/mean"]:
        nodes.add_column(name, justify="right")
    for label, column, fmt in (("stored", "used", format_size), ("chunks", "chunks", "{:,}".format),
                              ("evictions", "evictions", "{:,}".format), ("lookup keys", "lookup_keys", "{:,}".format),
                              ("put keys", "put_keys", "{:,}".format), ("get keys", "get_keys", "{:,}".format),
                              ("load (lookup+put)", "load", "{:,}".format), ("node hits", "node_hits", "{:,}".format),
                              ("node misses", "node_misses", "{:,}".format)):
        values = [r["per_node"][n][column] for n in names]
        nodes.add_row(label, *map(fmt, values), f"{_max_mean(values):.3f}")
    console.print(nodes)


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [2, 1, 1]})
    c = r["curve"]
    ax1.plot(c["request"], c["kvring"], label=f"kvring ({r['nodes']} nodes): {r['hit_rate']:.3f}")
    ax1.plot(c["request"], c["ideal_lru"], "--", label=f"ideal LRU: {r['ideal_lru_hit_rate']:.3f}")
    ax1.set(xlabel="requests replayed", ylabel="cumulative block hit rate",
            title=f"{r['capacity_blocks']:,} blocks of capacity, {r['distinct_blocks']:,} distinct")
    ax1.legend()
    ax1.grid(alpha=0.3)
    names = list(r["per_node"])
    per = r["per_node"]
    ax2.bar(names, [per[n]["used"] / 2**20 for n in names], color="tab:green", label="used")
    ax2.plot(names, [per[n]["capacity"] / 2**20 for n in names], "k_", markersize=30, label="capacity")
    ax2.set(ylabel="MiB", title=f"stored bytes (max/mean {r['bytes_max_mean']:.3f})")
    ax2.set_ylim(0, max(max(per[n]["capacity"] for n in names) / 2**20, 1) * 1.25)
    ax2.legend(loc="upper right", ncols=2)
    lookups = np.array([per[n]["lookup_keys"] for n in names])
    ax3.bar(names, lookups, label="lookup keys")
    ax3.bar(names, [per[n]["put_keys"] for n in names], bottom=lookups, label="put keys")
    ax3.set(ylabel="keys (primary owner)", title=f"key load (max/mean {r['load_max_mean']:.3f})")
    ax3.set_ylim(0, max(max(per[n]["load"] for n in names), 1) * 1.25)
    ax3.legend(loc="upper right", ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
