"""`kvring bench reads`: a prompt's load from a 3-node TLS cluster into a paged KV cache, read on
the caller's thread or by a reader thread per node, next to the bare TLS loop moving the same bytes.

What ``bench e2e`` measures inside vLLM, without vLLM (so it runs where vLLM does not, such as a
GPU machine's many cores): one local etcd and 3 nodes requiring the cluster's credentials (as
`kvring up` runs them), holding one prompt's chunk parts (one part per KV head, layer-major,
float32, as the connector saves them); a client streams every part's layers (``iter_layers``)
into a host paged cache (``[blocks, heads, block size, C]`` per layer) as a load does: each
layer received straight into its blocks where the connector's ``HostCopies.places`` gives it
places (``landing.py``), else copied there from its buffer (``HostCopies.load``).  Three ways:
every node read on the caller's thread, each layer received into the cache (what a load does);
the same with each layer copied from a buffer (what every load did before); and a reader thread
per node (``read_threads=True``), the copies on the caller's thread meanwhile (what loads did
where there were cores for it; a round whose layers have places does not use readers).  Two baselines (``plain_tcp.py``): the bare TLS loop from one server holding every
chunk, and from as many servers as the cluster has nodes, each holding every third chunk and
read by a thread of its own.  Every repetition runs all four, their order rotating; after each
kvring round (untimed) every byte of the cache is compared with what was stored.

Reported per system: GB/s (median of the repetitions, with the range), this process's CPU time
per byte moved (all its threads: reading, decrypting, checking, copying), and kvring's GB/s over
each baseline's as the median of the rounds' own ratios (``paired_ratio``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvring.bench.plain_tcp import PlainTcp
from kvring.bench.report import grouped_bars, machine, write_outputs
from kvring.bench.system import BenchError, ChunkSpec, Sharded
from kvring.bench.tls import paired_ratio, ratio_text, spread_text
from kvring.cachenode.landing import Landed, Landing
from kvring.common.chunk import ChunkItem
from kvring.local.cluster import LocalCluster
from kvring.local.rundir import run_directory

NODES = 3
SYSTEMS = ("kvring-1", "kvring-n", "kvring-copy", "bare-1", "bare-n")
KVRING = SYSTEMS[:3]
LABELS = {"kvring-1": "kvring TLS, received into the cache", "kvring-n": "kvring TLS, reader per node, copied",
          "kvring-copy": "kvring TLS, caller's thread, copied", "bare-1": "bare TLS loop, 1 server",
          "bare-n": f"bare TLS loop, {NODES} servers"}
LANDS = {"kvring-1"}  # the systems whose layers are received straight into the cache


@dataclass(frozen=True)
class ReadsSettings:
    tokens: int = 4096
    layers: int = 6
    heads: int = 4  # KV heads: one part each
    channels: int = 256  # K|V channels of a head (float32)
    chunk: int = 256  # tokens per chunk
    block: int = 128  # tokens per cache block
    repetitions: int = 9

    @property
    def chunks(self) -> int:
        return self.tokens // self.chunk


class _PagedCache:
    """A host paged KV cache and the connector's copies into it, one prompt's worth of blocks."""

    def __init__(self, s: ReadsSettings) -> None:
        import torch

        from kvring.connector.copies import HostCopies, slot_runs

        self.s = s
        blocks = s.tokens // s.block
        self.layers = [torch.zeros(blocks, s.heads, s.block, s.channels) for _ in range(s.layers)]
        self.heads = [[kv[:, h:h + 1] for h in range(s.heads)] for kv in self.layers]
        self.copies = HostCopies(s.block)
        self.runs = [slot_runs(np.arange(c * s.chunk, (c + 1) * s.chunk), s.block) for c in range(s.chunks)]
        self.lock = threading.Lock()  # a load's guard, as the connector's
        self.landed = 0  # bytes received straight into the cache, over every load

    def load(self, client, keys: list[bytes], land: bool = True) -> int:
        """Stream every part into the cache (part ``i``: chunk ``i // heads``, head ``i % heads``):
        received straight into it (``land``), or copied from each layer's buffer."""
        moved = 0
        for batch in client.iter_layers(keys, place=self.place if land else None):
            for i, view in zip(batch.indices, batch.views):
                if isinstance(view, Landed):
                    moved += view.nbytes
                    self.landed += view.nbytes
                    continue
                self.copies.load(self.heads[batch.layer][i % self.s.heads], self.runs[i // self.s.heads], view, 0)
                moved += len(view)
        return moved

    def place(self, i: int, layer: int, size: int) -> Landing | None:
        segments = self.copies.places(self.heads[layer][i % self.s.heads], self.runs[i // self.s.heads], size, 0)
        return Landing(segments, self.lock, _always) if segments is not None else None

    def check(self, parts: list[np.ndarray]) -> None:
        """Every byte of the cache is the stored parts' (and then cleared for the next round)."""
        s = self.s
        for layer, kv in enumerate(self.layers):
            got = kv.numpy().reshape(s.chunks, s.chunk // s.block, s.heads, s.block, s.channels)
            for i, part in enumerate(parts):
                rows = got[i // s.heads, :, i % s.heads].reshape(s.chunk, s.channels)
                if not np.array_equal(rows, part[layer]):
                    raise BenchError(f"part {i}, layer {layer}: the cache does not hold the stored bytes")
            kv.zero_()


def _always() -> bool:
    return True


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def run_bench_reads(s: ReadsSettings, json_out: Path | None = None, plot: Path | None = None) -> dict:
    from kvring.cachenode.client import ClusterClient

    console = Console(width=160)
    if s.tokens % s.chunk or s.chunk % s.block:
        raise BenchError(f"--tokens must be a whole number of {s.chunk}-token chunks")
    rng = np.random.default_rng(11)
    parts = [rng.standard_normal((s.layers, s.chunk, s.channels), dtype=np.float32)
             for _ in range(s.chunks * s.heads)]
    keys = [b"reads-part-%d" % i for i in range(len(parts))]
    nbytes = sum(p.nbytes for p in parts)
    # A chunk's parts as one value, for the baselines: layer-major, every head's layer together.
    chunks = [np.ascontiguousarray(np.stack(parts[c * s.heads:(c + 1) * s.heads], axis=1)).view(np.uint8).reshape(-1)
              for c in range(s.chunks)]
    seconds: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    cpu: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    landed: dict[str, int] = {name: 0 for name in KVRING}  # bytes received straight into the cache
    with run_directory("bench-reads"), \
            LocalCluster(nodes=NODES, memory=2 * nbytes + (256 << 20), cluster="bench-reads", tls=True) as cluster, \
            ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=cluster.tls, read_threads=False) as one, \
            ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=cluster.tls, read_threads=True) as each, \
            Progress(console=console) as progress:
        one.wait_for_nodes(NODES)
        items = [ChunkItem.of(k, p.view(np.uint8).reshape(-1), [s.layers, s.chunk, 1, s.channels], "float32", s.chunk)
                 for k, p in zip(keys, parts)]
        if not all(one.put_many(items)):
            raise BenchError("the cluster did not store every part")
        cache = _PagedCache(s)
        with contextlib.ExitStack() as stack:
            make = partial(PlainTcp, tls=cluster.tls)
            spec = ChunkSpec("reads", "bench", (s.layers, s.heads * s.chunk * s.channels * 4 // 2))
            bare = {name: stack.enter_context(Sharded(make, servers, spec, chunks, b"reads-"))
                    for name, servers in (("bare-1", 1), ("bare-n", NODES))}
            clients = {"kvring-1": one, "kvring-n": each, "kvring-copy": one}
            for name, client in clients.items():  # a first load: connections, buffers, reader threads
                cache.load(client, keys, land=name in LANDS)
                cache.check(parts)
            task = progress.add_task("interleaved rounds", total=s.repetitions)
            for rep in range(s.repetitions):
                for name in SYSTEMS[rep % len(SYSTEMS):] + SYSTEMS[:rep % len(SYSTEMS)]:
                    c0, t0, l0 = _cpu(), time.perf_counter(), cache.landed
                    moved = (cache.load(clients[name], keys, land=name in LANDS) if name in clients
                             else bare[name].stream())
                    seconds[name].append(time.perf_counter() - t0)
                    cpu[name].append(_cpu() - c0)
                    if moved != nbytes:
                        raise BenchError(f"{LABELS[name]} moved {moved} bytes of {nbytes}")
                    if name in clients:
                        landed[name] += cache.landed - l0
                        cache.check(parts)
                progress.advance(task)

    gbps = {name: [nbytes / t / 1e9 for t in times] for name, times in seconds.items()}
    results = {"settings": {"tokens": s.tokens, "layers": s.layers, "heads": s.heads, "channels": s.channels,
                            "chunk": s.chunk, "block": s.block, "repetitions": s.repetitions, "bytes": nbytes,
                            "nodes": NODES, "cpus": len(os.sched_getaffinity(0)), "machine": machine()},
               "landed_share": {n: landed[n] / (nbytes * s.repetitions) for n in KVRING},
               "gbps": gbps, "cpu_ns_per_byte": {n: [c / nbytes * 1e9 for c in v] for n, v in cpu.items()},
               "ratios": {k: {b: paired_ratio(gbps[k], gbps[b]) for b in ("bare-1", "bare-n")}
                          for k in KVRING}}
    table = Table(title=f"A {s.tokens}-token prompt ({nbytes / 2**20:.0f} MiB: {len(parts)} parts of {s.layers} layers) "
                        f"into a paged host cache, {NODES} nodes, mutual TLS 1.3, {results['settings']['cpus']} CPUs: "
                        f"median of {s.repetitions} interleaved rounds (min-max)")
    for col in ("system", "GB/s", "CPU ns / byte (this process)", "over bare 1 server", f"over bare {NODES} servers"):
        table.add_column(col, justify="right")
    for name in SYSTEMS:
        ratio = results["ratios"].get(name)
        table.add_row(LABELS[name], spread_text(gbps[name]), f"{statistics.median(results['cpu_ns_per_byte'][name]):.2f}",
                      *((ratio_text(ratio[b]) for b in ("bare-1", "bare-n")) if ratio else ("", "")))
    console.print(table)

    def draw(res: dict, path: Path) -> None:
        grouped_bars(path, ["GB/s"], {LABELS[n]: [statistics.median(v)] for n, v in res["gbps"].items()}, "GB/s",
                     title=f"A prompt's load into a paged cache over TLS, {NODES} nodes, "
                           f"{res['settings']['cpus']} CPUs")
    write_outputs(console, results, json_out, plot, draw)
    return results
