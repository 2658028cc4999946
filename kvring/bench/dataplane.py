"""``kvring bench data-plane``: kvring's PUT/GET throughput and existence-check latency against the
loopback ceiling (a plain TCP socket) and its peers (raw ZMQ, Redis, Mooncake Store), in one run.

Method
    Chunks are real KV-cache chunk shapes (``system.py``: 32 MiB Llama-3.1-8B, 3 MiB Qwen2.5-0.5B,
    256 KiB small).  Per chunk size, a batch of keys (for kvring spread evenly over its ring's
    nodes) holds distinct random bytes.  Cases: PUT; GET whole; GET 1 layer (the middle one); GET
    stream, every layer delivered layer by layer (kvring: ``iter_layers``, the connector's path).
    kvring runs on a local 1-node and a local 3-node cluster (``--nodes``), or on the cluster at
    ``--etcd``.

    Systems are interleaved within every repetition: a repetition runs PUT on each system in
    turn, then GET whole on each, and so on, so the machine's noise hits all alike.  The first
    repetition is a warm-up and is not kept.  A figure is the batch's bytes over one call's time,
    in GB/s (1e9 B/s): the median over the repetitions, with their min-max spread.  Setup (removing
    the keys before a PUT, so every PUT really stores; overwriting reused receive buffers before a
    read) and checks (every byte read compared with the bytes put) stay outside the timed region;
    a wrong or missing result aborts the run: no figure is reported for wrong data.

    The existence check asks for 32 and 128 present keys in one call (kvring ``lookup``, one
    request for plain TCP and ZMQ, pipelined EXISTS for Redis, ``batch_is_exist`` for Mooncake),
    samples interleaved the same way; p50 and p99.  How each peer does each case is in its module:
    ``plain_tcp``, ``baselines`` (ZMQ, Redis), ``mooncake_store``.  A peer that cannot run here
    (no ``redis-server``, Mooncake not installed) is left out with one line saying why.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvring.bench.baselines import RawZmq, Redis
from kvring.bench.dataplane_report import plot, print_tables
from kvring.bench.mooncake_store import MooncakeStore, Unavailable
from kvring.bench.plain_tcp import PlainTcp
from kvring.bench.report import write_outputs
from kvring.bench.system import TOKENS, BenchError, Buffer, ChunkSpec, Range, System, chunk_specs
from kvring.cachenode.client import ClusterClient
from kvring.common.chunk import ChunkItem
from kvring.local.cluster import LocalCluster, LocalEtcd
from kvring.local.rundir import run_directory

__all__ = ["CASES", "BenchError", "ChunkSpec", "DataPlaneSettings", "PlainTcp", "RawZmq", "run_data_plane_bench"]

GB = 1e9
CASES = ("PUT", "GET whole", "GET 1 layer", "GET stream")
PEERS = ("tcp", "zmq", "redis", "mooncake")
LOOKUP_SPEC = ChunkSpec("256B", "presence only", (1, 128))  # the chunk size does not matter to a lookup


@dataclass(frozen=True)
class DataPlaneSettings:
    etcd: str | None = None  # measure the cluster there instead of starting local ones
    cluster: str = "default"  # its name (with ``etcd``)
    nodes: tuple[int, ...] = (1, 3)  # local clusters to start, by node count
    peers: tuple[str, ...] = PEERS
    repetitions: int = 20  # measured, after one warm-up
    batch: int = 8  # chunks per request
    lookup_keys: tuple[int, ...] = (32, 128)
    lookup_samples: int = 300
    tokens: int = TOKENS  # per chunk; fewer make every chunk proportionally smaller
    node_memory: int = 1 << 30
    quick: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not self.etcd and (not self.nodes or min(self.nodes) < 1 or len(set(self.nodes)) < len(self.nodes)):
            problems.append(f"nodes {self.nodes}: give distinct node counts of at least 1, e.g. 1,3")
        if unknown := [p for p in self.peers if p not in PEERS]:
            problems.append(f"unknown peers {unknown}: choose from {', '.join(PEERS)}")
        if len(set(self.peers)) < len(self.peers):
            problems.append(f"peers {self.peers}: name each peer once")
        for name in ("repetitions", "batch", "lookup_samples", "tokens"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.lookup_keys or min(self.lookup_keys) < 1:
            problems.append(f"lookup_keys {self.lookup_keys}: give key counts of at least 1")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def quick_run(cls, **overrides: Any) -> DataPlaneSettings:
        """A smoke test: 32-token chunks (1/8 of the bytes), 2 repetitions of 2 chunks, 20 samples."""
        return cls(**{"repetitions": 2, "batch": 2, "lookup_samples": 20, "tokens": 32, "quick": True,
                      **overrides})

    @property
    def specs(self) -> tuple[ChunkSpec, ...]:
        return chunk_specs(self.tokens)


class Kvring(System):
    """A ``ClusterClient``; PUT builds the chunks' metadata (checksums) inside the timed call, as a
    caller's PUT would."""

    def __init__(self, client: ClusterClient) -> None:
        self.client = client
        n = len(client.ring)
        self.key, self.label = f"kvring-{n}", f"kvring {n} node{'s' if n > 1 else ''}"

    def put(self, keys: list[bytes], payloads: Sequence[Buffer], spec: ChunkSpec) -> bool:
        items = [ChunkItem.of(k, p, spec.shape, "bfloat16", spec.tokens) for k, p in zip(keys, payloads)]
        return all(n >= 1 for n in self.client.put_many(items))

    def get(self, keys: list[bytes], spec: ChunkSpec, layers: Range) -> list[Buffer | None]:
        return [c and c.data for c in self.client.get(keys, layers)]

    def stream(self, keys: list[bytes], spec: ChunkSpec) -> list[list[Buffer | None]]:
        """The connector's path: ``iter_layers``, keeping only references to the zero-copy views."""
        got: list[list[Buffer | None]] = [[None] * len(keys) for _ in range(spec.layers)]
        for batch in self.client.iter_layers(keys):
            for i, view in zip(batch.indices, batch.views):
                got[batch.layer][i] = view
        return got

    def exists(self, keys: list[bytes]) -> list[bool]:
        return self.client.lookup(keys)

    def clear(self, keys: list[bytes]) -> None:
        self.client.delete(keys)

    def close(self) -> None:
        self.client.close()

    def keys(self, prefix: str, n: int) -> list[bytes]:
        """``n`` keys whose primary owners are spread as evenly as the ring's node count allows."""
        ring = self.client.ring
        per_node = math.ceil(n / len(ring.nodes))
        counts = dict.fromkeys(ring.nodes, 0)
        keys: list[bytes] = []
        j = 0
        while len(keys) < n:
            key, j = f"{prefix}{j}".encode(), j + 1
            owner = ring.owners(key)[0]
            if counts[owner] < per_node:
                counts[owner] += 1
                keys.append(key)
        return keys


def _keys(system: System, prefix: str, n: int) -> list[bytes]:
    return system.keys(prefix, n) if isinstance(system, Kvring) else [f"{prefix}{i}".encode() for i in range(n)]


# ---- starting the systems --------------------------------------------------------------------

def _kvring(etcd: str, cluster: str, nodes: int | None, stack: contextlib.ExitStack) -> Kvring:
    client = ClusterClient(etcd, cluster=cluster)
    stack.callback(client.close)
    if not client.wait_for_nodes(nodes or 1, timeout=20, exact=nodes is not None):
        raise BenchError(f"cluster {cluster!r} at {etcd} has {len(client.ring)} nodes in its ring, "
                         f"expected {nodes or 'one or more'}")
    return Kvring(client)


def start_systems(s: DataPlaneSettings, stack: contextlib.ExitStack) -> tuple[list[System], dict[str, str]]:
    """kvring and the peers, each stopped by ``stack``; and the peers left out, with the reason."""
    systems: list[System] = []
    if s.etcd:
        systems.append(_kvring(s.etcd, s.cluster, None, stack))
    else:
        etcd = LocalEtcd()
        stack.callback(etcd.close)
        etcd.start()
        for n in s.nodes:
            cluster = LocalCluster(nodes=n, memory=s.node_memory, etcd=etcd.endpoint, cluster=f"bench-{n}")
            stack.callback(cluster.close)
            cluster.start()
            systems.append(_kvring(etcd.endpoint, cluster.cluster, n, stack))
    skipped: dict[str, str] = {}
    for peer in s.peers:
        if peer == "tcp":
            system: System = PlainTcp()
        elif peer == "zmq":
            system = RawZmq()
        elif peer == "redis":
            binary = shutil.which("redis-server")
            if binary is None:
                skipped["redis"] = "no redis-server on PATH (Debian: apt-get install redis-server)"
                continue
            system = Redis(binary)
        else:
            held = s.batch * max(spec.nbytes for spec in s.specs) + max(s.lookup_keys) * LOOKUP_SPEC.nbytes
            try:
                system = MooncakeStore(segment_bytes=int(held / 0.8) + (64 << 20))  # under its 90 % eviction mark
            except Unavailable as exc:
                skipped["mooncake"] = str(exc)
                continue
        stack.callback(system.close)
        systems.append(system)
    return systems, skipped


# ---- measuring -------------------------------------------------------------------------------

def _check(ok: bool, what: str) -> None:
    if not ok:
        raise BenchError(f"{what}: wrong or missing data")


def _matches(got: Sequence[Buffer | None], payloads: Sequence[np.ndarray], span: tuple[int, int]) -> bool:
    lo, hi = span
    return len(got) == len(payloads) and all(
        g is not None and np.array_equal(np.frombuffer(g, dtype=np.uint8), p[lo:hi]) for g, p in zip(got, payloads))


class Meter:
    """Times one call of one case on one system, checks its result, advances the progress bar."""

    def __init__(self, progress: Progress, total: int) -> None:
        self.progress = progress
        self.task = progress.add_task("starting", total=total)
        self.checked: dict[tuple[str, str, str], int] = {}  # (size, case, system) -> calls whose result passed

    def case(self, system: System, case: str, spec: ChunkSpec, keys: list[bytes],
             payloads: Sequence[np.ndarray]) -> float:
        label = f"{system.label} {case} {spec.name}"
        self.progress.update(self.task, description=label)
        if case == "PUT":
            system.clear(keys)
            t0 = time.perf_counter()
            ok = system.put(keys, payloads, spec)
            seconds = time.perf_counter() - t0
        else:
            system.scrub()
            t0 = time.perf_counter()
            if case == "GET stream":
                layers = system.stream(keys, spec)
                seconds = time.perf_counter() - t0
                ok = len(layers) == spec.layers and all(
                    _matches(got, payloads, spec.span((i, i + 1))) for i, got in enumerate(layers))
            else:
                span = _case_layers(case, spec)
                got = system.get(keys, spec, span)
                seconds = time.perf_counter() - t0
                ok = _matches(got, payloads, spec.span(span))
        _check(ok, label)
        key = (spec.name, case, system.key)
        self.checked[key] = self.checked.get(key, 0) + 1
        self.progress.advance(self.task)
        return seconds

    def lookup(self, system: System, keys: list[bytes]) -> float:
        self.progress.update(self.task, description=f"{system.label} exists {len(keys)} keys")
        t0 = time.perf_counter()
        hits = system.exists(keys)
        seconds = time.perf_counter() - t0
        _check(len(hits) == len(keys) and all(hits), f"{system.label} existence check of {len(keys)} keys")
        self.progress.advance(self.task)
        return seconds


def _case_layers(case: str, spec: ChunkSpec) -> Range:
    return (spec.layers // 2, spec.layers // 2 + 1) if case == "GET 1 layer" else None


def _case_bytes(case: str, spec: ChunkSpec, batch: int) -> int:
    lo, hi = spec.span(_case_layers(case, spec))
    return batch * (hi - lo)


def _bench_size(spec: ChunkSpec, systems: list[System], s: DataPlaneSettings, meter: Meter,
                prefix: str) -> list[dict[str, Any]]:
    keys = {x.key: _keys(x, f"{prefix}/{spec.name}/", s.batch) for x in systems}
    rng = np.random.default_rng(spec.nbytes)
    payloads = [rng.integers(0, 256, spec.nbytes, dtype=np.uint8) for _ in range(s.batch)]
    seconds: dict[str, dict[str, list[float]]] = {case: {x.key: [] for x in systems} for case in CASES}
    for x in systems:
        x.attach(spec, payloads)
    for rep in range(s.repetitions + 1):  # repetition 0 warms up
        for case in CASES:
            for x in systems:
                t = meter.case(x, case, spec, keys[x.key], payloads)
                if rep:
                    seconds[case][x.key].append(t)
    for x in systems:
        x.clear(keys[x.key])
        x.detach()
    rows = []
    for case in CASES:
        nbytes = _case_bytes(case, spec, s.batch)
        results = {}
        for x in systems:
            gbps = [nbytes / t / GB for t in seconds[case][x.key]]
            results[x.key] = {"gbps": statistics.median(gbps), "min": min(gbps), "max": max(gbps), "runs": gbps,
                              "checked": meter.checked.get((spec.name, case, x.key), 0)}
        rows.append({"case": case, "size": spec.name, "model": spec.model, "shape": list(spec.shape),
                     "batch": s.batch, "bytes": nbytes, "results": results,
                     "vs_tcp": _ratios(results, "gbps")})
    return rows


def _bench_lookup(systems: list[System], s: DataPlaneSettings, meter: Meter, prefix: str) -> list[dict[str, Any]]:
    n = max(s.lookup_keys)
    keys = {x.key: _keys(x, f"{prefix}/lookup/", n) for x in systems}
    payloads = [np.full(LOOKUP_SPEC.nbytes, i % 251, dtype=np.uint8) for i in range(n)]
    for x in systems:
        x.attach(LOOKUP_SPEC, payloads)
        x.clear(keys[x.key])
        _check(x.put(keys[x.key], payloads, LOOKUP_SPEC), f"{x.label} PUT of the keys to look up")
    out = []
    for count in s.lookup_keys:
        ms: dict[str, list[float]] = {x.key: [] for x in systems}
        for sample in range(s.lookup_samples + 1):  # sample 0 warms up
            for x in systems:
                t = meter.lookup(x, keys[x.key][:count])
                if sample:
                    ms[x.key].append(1e3 * t)
        results = {k: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)),
                       "min": min(v), "max": max(v)} for k, v in ms.items()}
        out.append({"keys": count, "results": results, "vs_tcp": _ratios(results, "p50")})
    for x in systems:
        x.clear(keys[x.key])
        x.detach()
    return out


def _ratios(results: dict[str, dict[str, float]], field: str) -> dict[str, float]:
    """Each kvring figure over plain TCP's (the same field), where both were measured."""
    tcp = results.get("tcp", {}).get(field)
    return {k: v[field] / tcp for k, v in results.items() if k.startswith("kvring") and tcp}


def run_data_plane_bench(s: DataPlaneSettings, json_out: Path | None = None, plot_out: Path | None = None,
                         console: Console | None = None) -> dict[str, Any]:
    """Measure, print the tables, write ``json_out`` / ``plot_out`` if given; returns the results."""
    console = console or Console(width=None if Console().is_terminal else 160)
    prefix = f"bench-{uuid.uuid4().hex[:8]}"  # never collides with (deduplicated) keys of an earlier run
    with run_directory("bench-data-plane"), contextlib.ExitStack() as stack:
        with console.status("starting kvring and its peers"):
            systems, skipped = start_systems(s, stack)
        for key, reason in skipped.items():
            console.print(f"[yellow]{key}: left out, {escape(reason)}[/]", soft_wrap=True)
        steps = len(systems) * (len(s.specs) * (s.repetitions + 1) * len(CASES)
                                + len(s.lookup_keys) * (s.lookup_samples + 1))
        columns = (TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            meter = Meter(progress, steps)
            throughput = [row for spec in s.specs for row in _bench_size(spec, systems, s, meter, prefix)]
            lookup = _bench_lookup(systems, s, meter, prefix)
        results = {
            "config": {"repetitions": s.repetitions, "warm_up": 1, "batch": s.batch, "tokens": s.tokens,
                       "lookup_keys": list(s.lookup_keys), "lookup_samples": s.lookup_samples, "quick": s.quick,
                       "cluster": f"{s.cluster} at {s.etcd}" if s.etcd else f"local, nodes {list(s.nodes)}",
                       "chunks": [{"size": c.name, "model": c.model, "shape": list(c.shape), "bytes": c.nbytes,
                                   "layer_bytes": c.layer_bytes} for c in s.specs]},
            "systems": {x.key: x.label for x in systems},
            "skipped": skipped,
            "throughput": throughput,
            "lookup": lookup,
        }
    print_tables(console, results)
    write_outputs(console, results, json_out, plot_out, plot)
    return results
