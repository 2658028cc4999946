"""Data-plane benchmark: kvring PUT/GET throughput and LOOKUP latency against raw ZMQ and Redis.

Method
    Chunks are real KV-cache chunks of 256 tokens, bf16, layer-major
    ``[layers, K/V, tokens, kv_heads, head_dim]``: "large" is a Llama-3.1-8B chunk (32 MiB, 1 MiB a
    layer), "small" a Qwen2.5-0.5B chunk (3 MiB, 128 KiB a layer).  A batch of keys, picked so that
    their primaries spread evenly over the ring, holds distinct random bytes.  Each case runs once
    untimed (warm-up), then ``iterations`` times; a figure is the batch's bytes over the median
    time, in GB/s (1e9 B/s).  Setup (deleting the keys before a PUT, so every PUT really stores) and
    checks (every GET result is compared with the bytes put) stay outside the timed region, and a
    wrong or missing result aborts the run: no speed is reported for wrong data.

    kvring cases: PUT via ``put_many``; whole-chunk ``get``; one-layer ``get(layers=(l, l + 1))``;
    and "GET stream": ``iter_layers`` whose consumer only touches the zero-copy views (the
    connector's path).

    Baselines, on the same bytes in the same run: (a) raw ZMQ -- a DEALER here, a ROUTER in a child
    process over loopback TCP that keeps PUT frames and answers GET with (slices of) them, both ways
    zero-copy (``copy=False``): the transport's local ceiling, with no checksums, routing or store.
    Its "GET whole" replies with whole chunks in one message, its "GET stream" with one message per
    layer (as kvring does); large frames cost the receiver more, so the two differ.  (b) Redis via
    redis-py against a throw-away ``redis-server``: pipelined SET / GET / GETRANGE, and for the
    stream one GETRANGE per layer and key; skipped with a message if ``redis-server`` is missing.
    LOOKUP latency (p50/p99 of ``lookup`` of 32 and 128 present keys) is shown next to one raw ZMQ
    request-reply and a pipelined Redis EXISTS of the same keys.
"""

from __future__ import annotations

import logging
import math
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvring.cachenode.client import ClusterClient
from kvring.local import LocalCluster, free_port
from kvring.report import write_outputs

logger = logging.getLogger(__name__)

GB = 1e9
TOKENS = 256
CASES = ("PUT", "GET whole", "GET 1 layer", "GET stream")
SYSTEMS = {"kvring": "kvring", "zmq": "raw ZMQ", "redis": "Redis"}
Range = tuple[int, int] | None  # a layer range [start, end), None = the whole chunk


@dataclass(frozen=True)
class ChunkSpec:
    name: str
    model: str
    shape: tuple[int, ...]  # [layers, K/V, tokens, kv_heads, head_dim] of bf16

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 2

    @property
    def layer_bytes(self) -> int:
        return self.nbytes // self.shape[0]

    def span(self, layers: Range) -> tuple[int, int]:
        return (0, self.nbytes) if layers is None else (layers[0] * self.layer_bytes, layers[1] * self.layer_bytes)


SPECS = (ChunkSpec("large", "Llama-3.1-8B", (32, 2, TOKENS, 8, 128)),
         ChunkSpec("small", "Qwen2.5-0.5B", (24, 2, TOKENS, 2, 64)))


class BenchError(RuntimeError):
    """A measurement returned wrong data (no figure is reported for it), or the cluster is not there."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise BenchError(f"{what}: wrong or missing data")


def _same(buf: Any, expected: np.ndarray) -> bool:
    return buf is not None and np.array_equal(np.frombuffer(buf, dtype=np.uint8), expected)


def _terminate(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- the three systems, behind put(keys, payloads, spec) and get(keys, spec, layers) ----------

class Kvring:
    def __init__(self, client: ClusterClient) -> None:
        self.client = client

    def put(self, keys: list[bytes], payloads: list[np.ndarray], spec: ChunkSpec) -> bool:
        return all(n >= 1 for n in self.client.put_many(
            [(k, p, spec.shape, "bfloat16", TOKENS) for k, p in zip(keys, payloads)]))

    def get(self, keys: list[bytes], spec: ChunkSpec, layers: Range) -> list[Any]:
        return [c and c.data for c in self.client.get(keys, layers)]

    def stream(self, keys: list[bytes], spec: ChunkSpec) -> list[list[Any]]:
        """The connector's path: ``iter_layers``, keeping only references to the zero-copy views."""
        got: list[list[Any]] = [[None] * len(keys) for _ in range(spec.shape[0])]
        for batch in self.client.iter_layers(keys):
            for i, view in zip(batch.indices, batch.views):
                got[batch.layer][i] = view
        return got

    def delete(self, keys: list[bytes]) -> None:
        self.client.delete(keys)


def _zmq_server(endpoint: str) -> None:
    """Child process: keep PUT payload frames, answer GET with byte ranges of them, zero-copy."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    store: dict[bytes, zmq.Frame] = {}
    while True:
        ident, op, *rest = sock.recv_multipart(copy=False)
        if op.bytes == b"get":
            lo, hi = struct.unpack("<QQ", rest[0].bytes)
            sock.send_multipart([ident, b"ok", *(store[k.bytes].buffer[lo:hi] for k in rest[1:])], copy=False)
            continue
        if op.bytes == b"stream":  # one message per layer, like a kvring GET
            lb, layers = struct.unpack("<QQ", rest[0].bytes)
            for lo in range(0, lb * layers, lb):
                sock.send_multipart([ident, b"ok", *(store[k.bytes].buffer[lo:lo + lb] for k in rest[1:])],
                                    copy=False)
            continue
        if op.bytes == b"put":
            store[rest[0].bytes] = rest[1]
        sock.send_multipart([ident, b"ok"])
        if op.bytes == b"stop":
            break
    sock.close(linger=1000)
    ctx.term()


class RawZmq:
    def __init__(self) -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        # A plain child interpreter, not multiprocessing: works whatever the caller's __main__ is.
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", f"from {__name__} import _zmq_server; "
                                      f"_zmq_server({endpoint!r})"], start_new_session=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 30_000)
        self.sock.connect(endpoint)
        self.ping()  # queued in the DEALER until the child has bound

    def ping(self) -> bool:
        self.sock.send(b"ping")
        return self.sock.recv() == b"ok"

    def put(self, keys: list[bytes], payloads: list[np.ndarray], spec: ChunkSpec) -> bool:
        for key, payload in zip(keys, payloads):
            self.sock.send_multipart([b"put", key, payload], copy=False)
        return all(self.sock.recv() == b"ok" for _ in keys)

    def get(self, keys: list[bytes], spec: ChunkSpec, layers: Range) -> list[Any]:
        self.sock.send_multipart([b"get", struct.pack("<QQ", *spec.span(layers)), *keys])
        return [f.buffer for f in self.sock.recv_multipart(copy=False)[1:]]

    def stream(self, keys: list[bytes], spec: ChunkSpec) -> list[list[Any]]:
        self.sock.send_multipart([b"stream", struct.pack("<QQ", spec.layer_bytes, spec.shape[0]), *keys])
        return [[f.buffer for f in self.sock.recv_multipart(copy=False)[1:]] for _ in range(spec.shape[0])]

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.sock.send(b"stop")
                self.sock.recv()
        except zmq.ZMQError:
            pass
        self.sock.close(linger=0)
        self.ctx.term()
        _terminate(self.proc)


class Redis:
    """redis-py against a throw-away ``redis-server`` on a free loopback port, no persistence."""

    def __init__(self, binary: str) -> None:
        import redis

        self.dir = tempfile.mkdtemp(prefix="kvring-redis-")
        port = free_port()
        self.proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.dir, "--proto-max-bulk-len", "1gb"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.r.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise
                time.sleep(0.05)

    def _batch(self, op: Callable[[Any, bytes, int], Any], keys: list[bytes]) -> list[Any]:
        pipe = self.r.pipeline(transaction=False)
        for i, key in enumerate(keys):
            op(pipe, key, i)
        return pipe.execute()

    def put(self, keys: list[bytes], payloads: list[np.ndarray], spec: ChunkSpec) -> bool:
        return all(self._batch(lambda pipe, k, i: pipe.set(k, memoryview(payloads[i])), keys))

    def get(self, keys: list[bytes], spec: ChunkSpec, layers: Range) -> list[Any]:
        if layers is None:
            return self._batch(lambda pipe, k, i: pipe.get(k), keys)
        lo, hi = spec.span(layers)
        return self._batch(lambda pipe, k, i: pipe.getrange(k, lo, hi - 1), keys)

    def stream(self, keys: list[bytes], spec: ChunkSpec) -> list[list[Any]]:
        lb, n = spec.layer_bytes, len(keys)
        flat = self._batch(lambda pipe, k, i: pipe.getrange(k, (i // n) * lb, (i // n + 1) * lb - 1),
                           keys * spec.shape[0])  # layer-major: entry i is layer i // n of key i % n
        return [flat[lo:lo + n] for lo in range(0, len(flat), n)]

    def exists(self, keys: list[bytes]) -> list[Any]:
        return self._batch(lambda pipe, k, i: pipe.exists(k), keys)

    def close(self) -> None:
        self.r.close()
        _terminate(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- measuring -------------------------------------------------------------------------------

class Meter:
    """Timed repetitions (one untimed warm-up first), each advancing one progress bar."""

    def __init__(self, progress: Progress, total: int) -> None:
        self.progress = progress
        self.task = progress.add_task("starting", total=total)

    def times(self, label: str, n: int, run: Callable[[], Any], check: Callable[[Any], bool],
              setup: Callable[[], Any] | None = None) -> list[float]:
        self.progress.update(self.task, description=label)
        times = []
        for _ in range(n + 1):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - t0)
            _check(check(out), label)
            self.progress.advance(self.task)
        return times[1:]


def _spread_keys(client: ClusterClient, prefix: str, n: int) -> list[bytes]:
    """``n`` keys whose primary owners are spread as evenly as the ring's node count allows."""
    per_node = math.ceil(n / len(client.ring.nodes))
    counts = dict.fromkeys(client.ring.nodes, 0)
    keys: list[bytes] = []
    j = 0
    while len(keys) < n:
        key, j = f"{prefix}{j}".encode(), j + 1
        owner = client.owners(key)[0]
        if counts[owner] < per_node:
            counts[owner] += 1
            keys.append(key)
    return keys


def _bench_size(spec: ChunkSpec, systems: dict[str, Any], meter: Meter, iters: int, batch: int,
                prefix: str) -> list[dict[str, Any]]:
    kv: Kvring = systems["kvring"]
    keys = _spread_keys(kv.client, f"{prefix}/{spec.name}/", batch)
    rng = np.random.default_rng(spec.nbytes)
    payloads = [rng.integers(0, 256, spec.nbytes, dtype=np.uint8) for _ in keys]
    mid = spec.shape[0] // 2
    ranges: dict[str, Range] = {"GET whole": None, "GET 1 layer": (mid, mid + 1)}
    gbps: dict[str, dict[str, float | None]] = {c: dict.fromkeys(SYSTEMS) for c in CASES}

    def case_bytes(case: str) -> int:
        lo, hi = spec.span(ranges.get(case))
        return batch * (hi - lo)

    def rate(case: str, times: list[float]) -> float:
        return case_bytes(case) / statistics.median(times) / GB

    def matches(layers: Range) -> Callable[[list[Any]], bool]:
        lo, hi = spec.span(layers)
        return lambda got: len(got) == batch and all(_same(g, p[lo:hi]) for g, p in zip(got, payloads))

    def all_layers_match(got: list[list[Any]]) -> bool:
        return len(got) == spec.shape[0] and all(matches((i, i + 1))(bufs) for i, bufs in enumerate(got))

    for name, system in systems.items():
        label = f"[{spec.name}] {SYSTEMS[name]}"
        clear = (lambda: kv.delete(keys)) if name == "kvring" else None  # kvring skips a key it already has
        gbps["PUT"][name] = rate("PUT", meter.times(f"{label} PUT", iters, lambda: system.put(keys, payloads, spec),
                                                    bool, setup=clear))
        for case, layers in ranges.items():
            gbps[case][name] = rate(case, meter.times(f"{label} {case}", iters,
                                                      lambda: system.get(keys, spec, layers), matches(layers)))
        gbps["GET stream"][name] = rate("GET stream", meter.times(f"{label} GET stream", iters,
                                                                  lambda: system.stream(keys, spec), all_layers_match))
    kv.delete(keys)
    if "redis" in systems:
        systems["redis"].r.delete(*keys)
    return [{"case": c, "size": spec.name, "model": spec.model, "shape": list(spec.shape), "batch": batch,
             "bytes": case_bytes(c),
             **{f"{s}_gbps": v for s, v in gbps[c].items()}} for c in CASES]


def _bench_lookup(systems: dict[str, Any], meter: Meter, samples: int, sizes: Sequence[int],
                  prefix: str) -> list[dict[str, Any]]:
    client: ClusterClient = systems["kvring"].client
    keys = _spread_keys(client, f"{prefix}/lookup/", max(sizes))
    tiny = np.zeros(256, dtype=np.uint8)  # presence is metadata only: the chunk size does not matter
    _check(all(client.put_many([(k, tiny, [1, 256], "uint8", TOKENS) for k in keys])), "kvring PUT")
    probes: dict[str, Callable[[list[bytes]], Any]] = {"kvring": client.lookup,
                                                       "zmq": lambda _: [systems["zmq"].ping()]}
    if "redis" in systems:
        systems["redis"].r.mset({k: b"x" for k in keys})
        probes["redis"] = systems["redis"].exists
    out = []
    for n in sizes:
        res: dict[str, Any] = {"keys": n}
        for name, probe in probes.items():
            ms = 1e3 * np.array(meter.times(f"{SYSTEMS[name]} LOOKUP {n} keys", samples,
                                            lambda: probe(keys[:n]), lambda hits: all(hits)))
            res[name] = {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}
        out.append(res)
    client.delete(keys)
    return out


# ---- report ----------------------------------------------------------------------------------

def _fmt(x: float | None, suffix: str = "") -> str:
    return "—" if x is None else f"{x:.2f}{suffix}"


def _print_tables(console: Console, results: dict[str, Any]) -> None:
    batch = results["config"]["batch"]
    t = Table(title=f"Throughput, GB/s (median), {batch} chunks a request",
              caption="; ".join(f"{s.name}: {s.model} {list(s.shape)} bf16, {s.nbytes / 2**20:.3g} MiB"
                                for s in SPECS) + "\nGET stream: kvring iter_layers; ZMQ one message a layer; "
                                                  "Redis GETRANGE a layer")
    for col in ("case", "size", "kvring", "raw ZMQ", "Redis", "vs ZMQ", "vs Redis"):
        t.add_column(col, justify="left" if col in ("case", "size") else "right", no_wrap=True)
    for r in results["throughput"]:
        kv, zq, rd = r["kvring_gbps"], r["zmq_gbps"], r["redis_gbps"]
        t.add_row(r["case"], r["size"], _fmt(kv), _fmt(zq), _fmt(rd), _fmt(kv / zq if zq else None, "×"),
                  _fmt(kv / rd if rd else None, "×"))
    console.print(t)
    lt = Table(title="LOOKUP latency, ms", caption="ZMQ: one small request-reply; Redis: pipelined EXISTS")
    for col in ("keys", "kvring p50", "kvring p99", "ZMQ RTT p50", "Redis p50", "Redis p99"):
        lt.add_column(col, justify="right")
    for r in results["lookup"]:
        rd = r.get("redis", {})
        lt.add_row(str(r["keys"]), _fmt(r["kvring"]["p50"]), _fmt(r["kvring"]["p99"]), _fmt(r["zmq"]["p50"]),
                   _fmt(rd.get("p50")), _fmt(rd.get("p99")))
    console.print(lt)
    if results["redis_skipped"]:
        console.print(f"[yellow]Redis baseline skipped: {results['redis_skipped']}[/]")


def _plot(path: Path, results: dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, lookups = results["throughput"], results["lookup"]
    colors = {"kvring": "tab:blue", "zmq": "tab:orange", "redis": "tab:green"}
    fig, (ax, lx) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 1]})
    x = np.arange(len(rows))
    for j, (name, label) in enumerate(SYSTEMS.items()):
        ax.bar(x + (j - 1) * 0.27, [r[f"{name}_gbps"] or 0.0 for r in rows], 0.27, label=label, color=colors[name])
    ax.set_xticks(x, [f"{r['case']}\n{r['size']}" for r in rows], fontsize=8)
    ax.set(ylabel="GB/s (median)", title="Throughput (GET stream: kvring iter_layers, layer by layer)")
    ax.legend()
    series = [(name, p) for name in SYSTEMS for p in ("p50", "p99") if all(name in r for r in lookups)]
    lxx, w = np.arange(len(lookups)), 0.8 / len(series)
    for j, (name, p) in enumerate(series):
        lx.bar(lxx + (j - (len(series) - 1) / 2) * w, [r[name][p] for r in lookups], w, color=colors[name],
               alpha=1.0 if p == "p50" else 0.5, label=f"{SYSTEMS[name]} {p}")
    lx.set_xticks(lxx, [f"{r['keys']} keys" for r in lookups])
    lx.set(ylabel="ms", title="LOOKUP latency (ZMQ: one round trip)")
    lx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_data_plane_bench(etcd: str | None, cluster: str, iterations: int, json_out: Path | None,
                         plot: Path | None, quick: bool) -> dict[str, Any]:
    """Measure, print the tables, write ``json_out`` / ``plot`` if given; returns the results."""
    console = Console()
    iters = max(1, min(iterations, 3) if quick else iterations)
    batch, samples, sizes = (4, 100, (32, 128)) if quick else (8, 300, (32, 128))
    redis_bin = shutil.which("redis-server")
    redis_skipped = None if redis_bin else "no redis-server on PATH (install redis-server to compare)"
    if redis_skipped:
        console.print(f"[yellow]Redis baseline skipped: {redis_skipped}[/]")
    prefix = f"bench-{uuid.uuid4().hex[:8]}"  # never collides with (deduplicated) keys of an earlier run
    local = None if etcd else LocalCluster(nodes=3, memory=2 << 30, cluster=cluster).start()
    systems: dict[str, Any] = {}
    try:
        client = ClusterClient(etcd or local.etcd, cluster=cluster)
        systems["kvring"] = Kvring(client)
        if not client.wait_for_nodes(len(local.nodes) if local else 1, timeout=15):
            raise BenchError(f"cluster {cluster!r} has no node in its ring")
        systems["zmq"] = RawZmq()
        if redis_bin:
            systems["redis"] = Redis(redis_bin)
        steps = (iters + 1) * len(SPECS) * len(CASES) * len(systems) + (samples + 1) * len(sizes) * len(systems)
        columns = (TextColumn("{task.description:<30}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            meter = Meter(progress, steps)
            throughput = [r for spec in SPECS for r in _bench_size(spec, systems, meter, iters, batch, prefix)]
            lookup = _bench_lookup(systems, meter, samples, sizes, prefix)
        results = {"config": {"nodes": len(client.ring), "replication": client.contract.replication,
                              "iterations": iters, "batch": batch, "lookup_samples": samples, "quick": quick,
                              "cluster": etcd or "local (3 nodes)"},
                   "throughput": throughput, "lookup": lookup, "redis_skipped": redis_skipped}
    finally:
        for system in reversed(systems.values()):
            (system.client if isinstance(system, Kvring) else system).close()
        if local is not None:
            local.close()
    _print_tables(console, results)
    write_outputs(console, results, json_out, plot, lambda r, path: _plot(path, r))
    return results
