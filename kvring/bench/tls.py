"""`kvring bench tls`: what the encrypted data plane costs, next to the plain one and next to
the best Python's ``ssl`` does on this machine.

One run: two 1-node clusters on one local etcd, one whose node requires the cluster's
credentials (mutual TLS 1.3) and one on plain TCP, each with its client; and two baselines
(``plain_tcp.py``): the bare TLS loop -- a server and a client with the least protocol
possible, the same credentials, TLS 1.3 through Python's ``ssl``, every message received with
``recv_into`` into one preallocated buffer -- and the same loop on a plain TCP socket (the
loopback ceiling).  Every repetition PUTs, then GETs (whole, and streamed layer by layer)
``chunks`` chunks of each size on all four, interleaved (their order rotating), every byte read
back compared (one size after the other, each node's memory sized so that a round reuses the
buffers the last one freed, as the baselines' servers do).  Reported: GB/s medians over the
repetitions with their spread, and kvring's TLS against the bare TLS loop and against kvring on
plain TCP as the median of each round's own ratio (``paired_ratio``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvring.bench.plain_tcp import PlainTcp
from kvring.bench.report import grouped_bars, spread, summary, write_outputs
from kvring.bench.system import ChunkSpec
from kvring.common.chunk import ChunkItem
from kvring.common.units import format_size
from kvring.local.cluster import LocalCluster, LocalEtcd
from kvring.local.rundir import run_directory

SYSTEMS = ("plain", "tls", "bare-tls", "tcp")
LABELS = {"plain": "kvring plain", "tls": "kvring TLS", "bare-tls": "bare ssl loop", "tcp": "raw TCP socket"}
OPS = ("PUT", "GET whole", "GET stream")


@dataclass(frozen=True)
class TlsSettings:
    sizes: tuple[int, ...] = (3 << 20, 32 << 20)
    chunks: int = 8
    layers: int = 32
    repetitions: int = 15


def _round(client, items: list[ChunkItem], data: bytes) -> dict[str, float]:
    """Seconds of one PUT, one whole GET and one streamed GET of ``items``."""
    keys = [it.key for it in items]
    t0 = time.perf_counter()
    assert all(client.put_many(items))
    t1 = time.perf_counter()
    chunks = client.get(keys)
    t2 = time.perf_counter()
    if any(c is None or c.data.nbytes != len(data) or bytes(c.data[:4096]) != data[:4096] for c in chunks):
        raise RuntimeError("a chunk came back wrong")
    got = 0
    for batch in client.iter_layers(keys):
        got += sum(memoryview(v).nbytes for v in batch.views)
    t3 = time.perf_counter()
    if got != len(data) * len(keys):
        raise RuntimeError(f"streamed {got} bytes, expected {len(data) * len(keys)}")
    client.delete(keys)
    return {"PUT": t1 - t0, "GET whole": t2 - t1, "GET stream": t3 - t2}


def _baseline_round(system, items: list[ChunkItem], data: bytes, layers: int) -> dict[str, float]:
    """The same round on a baseline (``plain_tcp.PlainTcp``, bare or over TLS)."""
    keys, payloads = [it.key for it in items], [it.payload for it in items]
    spec = ChunkSpec(format_size(len(data)), "", (layers, len(data) // layers // 2))
    system.attach(spec, payloads)
    t0 = time.perf_counter()
    assert system.put(keys, payloads, spec)
    t1 = time.perf_counter()
    got = system.get(keys, spec, None)
    t2 = time.perf_counter()
    if any(v is None or memoryview(v).nbytes != len(data) or bytes(memoryview(v)[:4096]) != data[:4096] for v in got):
        raise RuntimeError(f"{system.label}: a chunk came back wrong")
    streamed = system.stream(keys, spec)
    t3 = time.perf_counter()
    if sum(memoryview(v).nbytes for layer in streamed for v in layer) != len(data) * len(keys):
        raise RuntimeError(f"{system.label}: the streamed bytes do not add up")
    system.clear(keys)
    system.detach()
    return {"PUT": t1 - t0, "GET whole": t2 - t1, "GET stream": t3 - t2}


def paired_ratio(a: list[float], b: list[float]) -> dict[str, float]:
    """``a`` over ``b`` round by round (each round measures both, side by side), summarized: on a
    machine whose speed drifts between rounds, the rounds' own ratios are steadier than a ratio
    of medians taken from different rounds."""
    r = [x / y for x, y in zip(a, b, strict=True)]
    return {k: round(v, 3) for k, v in summary(r).items()}


def spread_text(v: list[float]) -> str:
    """Measurements as a table shows them: the median, then the range."""
    return spread(summary(v), ".2f")


def ratio_text(r: dict[str, float]) -> str:
    """A ``paired_ratio`` as a table shows it: the median, then the range."""
    return spread(r, ".2f")


def _measure(etcd: str, s: TlsSettings, gbps: dict, console: Console) -> None:
    from kvring.cachenode.client import ClusterClient

    # A node keeps the payload buffers it frees for reuse, up to an eighth of its memory: with
    # eight rounds' worth, each round's PUTs reuse the buffers the last round's deletes freed
    # (as a full node's PUTs reuse what they evict), like the baselines' servers, instead of
    # paying the kernel's page faults on fresh memory that no steady state pays.
    memory = 8 * max(s.sizes) * s.chunks
    with LocalCluster(nodes=1, memory=memory, etcd=etcd, cluster="bench-plain"), \
            LocalCluster(nodes=1, memory=memory, etcd=etcd, cluster="bench-tls", tls=True) as tls, \
            ClusterClient(etcd, cluster="bench-plain") as plain_client, \
            ClusterClient(etcd, cluster="bench-tls", tls=tls.tls) as tls_client, \
            contextlib.closing(PlainTcp(tls=tls.tls)) as bare_tls, contextlib.closing(PlainTcp()) as tcp, \
            Progress(console=console) as progress:
        clients = {"plain": plain_client, "tls": tls_client}
        baselines = {"bare-tls": bare_tls, "tcp": tcp}
        for c in clients.values():
            c.wait_for_nodes(1)
            c.reserve_buffers(min(256 << 20, max(s.sizes) * s.chunks))
        task = progress.add_task("interleaved rounds", total=s.repetitions * len(s.sizes))
        for size in s.sizes:  # one size at a time: a node's pool reuses buffers by exact size
            for rep in range(s.repetitions):
                data = np.random.default_rng(size + rep).bytes(size)
                items = [ChunkItem.of(b"tls-bench-%d-%d" % (size, i), data, (s.layers, size // s.layers), "uint8", 256)
                         for i in range(s.chunks)]
                order = SYSTEMS[rep % len(SYSTEMS):] + SYSTEMS[:rep % len(SYSTEMS)]
                for name in order:
                    seconds_by_op = (_round(clients[name], items, data) if name in clients
                                     else _baseline_round(baselines[name], items, data, s.layers))
                    for op, seconds in seconds_by_op.items():
                        gbps[format_size(size)][op][name].append(size * s.chunks / seconds / 1e9)
                progress.advance(task)


def run_bench_tls(settings: TlsSettings, json_out: Path | None = None, plot: Path | None = None) -> dict:
    console = Console(width=150)
    s = settings
    gbps: dict[str, dict[str, dict[str, list[float]]]] = {
        format_size(size): {op: {sys: [] for sys in SYSTEMS} for op in OPS} for size in s.sizes}
    with run_directory("bench-tls"):
        etcd = LocalEtcd().start()
        try:
            _measure(etcd.endpoint, s, gbps, console)
        finally:
            etcd.close()
    results = {"settings": {"sizes": list(s.sizes), "chunks": s.chunks, "layers": s.layers,
                            "repetitions": s.repetitions}, "gbps": gbps}
    ratios = {size: {op: {"tls / bare-tls": paired_ratio(by["tls"], by["bare-tls"]),
                          "tls / plain": paired_ratio(by["tls"], by["plain"])}
                     for op, by in ops.items()} for size, ops in gbps.items()}
    results["ratios"] = ratios
    table = Table(title=f"1 node over loopback, mutual TLS 1.3 vs the bare ssl loop and plain TCP: GB/s, median of "
                        f"{s.repetitions} interleaved rounds of {s.chunks} chunks (min-max); ratios: median of the "
                        f"rounds' own ratios (min-max)")
    for col in ("size", "operation", *(LABELS[sys] for sys in SYSTEMS), "TLS / bare ssl", "TLS / plain"):
        table.add_column(col, justify="right")
    for size, ops in gbps.items():
        for op, by in ops.items():
            table.add_row(size, op, *(spread_text(by[sys]) for sys in SYSTEMS),
                          *(ratio_text(ratios[size][op][name]) for name in ("tls / bare-tls", "tls / plain")))
    console.print(table)

    def draw(res: dict, path: Path) -> None:
        groups = [f"{op} {size}" for size, ops in res["gbps"].items() for op in ops]
        series = {sys: [statistics.median(by[sys]) for ops in res["gbps"].values() for by in ops.values()]
                  for sys in SYSTEMS}
        grouped_bars(path, groups, {LABELS[sys]: v for sys, v in series.items()}, "GB/s",
                     title="Data plane: mutual TLS vs the bare ssl loop and plain TCP (1 node, loopback)")
    write_outputs(console, results, json_out, plot, draw)
    return results
