"""What ``kvring bench data-plane`` measures: the chunks it moves, and the interface every system
under test (kvring and its peers) offers.

Chunks are real KV-cache chunks, bf16, layer-major ``[layers, K/V, tokens, kv_heads, head_dim]``,
256 tokens each (``--quick`` uses 32 tokens of the same models, so 1/8 of the bytes):

- 32 MiB: a Llama-3.1-8B chunk, 32 layers of 1 MiB (8 KV heads of 128);
- 3 MiB: a Qwen2.5-0.5B chunk, 24 layers of 128 KiB (2 KV heads of 64);
- 256 KiB: a small chunk, 8 layers of 32 KiB (1 KV head of 32, a draft model's size class).
"""

from __future__ import annotations

import math
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvring.common.threadclock import ThreadClock, ThreadTimes
from kvring.local.cluster import stop_process_group

TOKENS = 256
Range = tuple[int, int] | None  # a layer range [start, end); None = the whole chunk
Buffer = Any  # anything ``memoryview`` accepts: bytes, memoryview, a NumPy array, a zmq buffer


@dataclass(frozen=True)
class ChunkSpec:
    name: str
    model: str
    shape: tuple[int, ...]  # [layers, K/V, tokens, kv_heads, head_dim] of bf16 (or [layers, n] of bf16)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 2

    @property
    def layers(self) -> int:
        return self.shape[0]

    @property
    def layer_bytes(self) -> int:
        return self.nbytes // self.shape[0]

    @property
    def tokens(self) -> int:
        return self.shape[2] if len(self.shape) == 5 else TOKENS

    def span(self, layers: Range) -> tuple[int, int]:
        """The byte range ``[lo, hi)`` of a layer range within a chunk."""
        return (0, self.nbytes) if layers is None else (layers[0] * self.layer_bytes, layers[1] * self.layer_bytes)


def chunk_specs(tokens: int = TOKENS) -> tuple[ChunkSpec, ...]:
    """The three chunk kinds, ``tokens`` tokens each, named by their size."""
    shapes = (("Llama-3.1-8B", (32, 2, tokens, 8, 128)), ("Qwen2.5-0.5B", (24, 2, tokens, 2, 64)),
              ("8-layer draft model", (8, 2, tokens, 1, 32)))
    return tuple(ChunkSpec(_size_name(math.prod(shape) * 2), model, shape) for model, shape in shapes)


def _size_name(n: int) -> str:
    return f"{n >> 20}MiB" if n % (1 << 20) == 0 else f"{n >> 10}KiB"


class BenchError(RuntimeError):
    """A measurement returned wrong data (no figure is reported for it), or a system is not there."""


class System(ABC):
    """One system under test, behind the same calls for every case.

    Threading: the bench's one thread calls every method, one call at a time; each call blocks
    until its reply is complete.  Buffers a read returns stay valid until the next read on the
    same system (a system may receive into one preallocated buffer it reuses).  ``clear``,
    ``attach``, ``scrub`` and ``detach`` run outside the timed region.
    """

    key: str  # short id in the JSON: "kvring-3", "tcp", ...
    label: str  # column title: "kvring 3 nodes", "plain TCP", ...

    def attach(self, spec: ChunkSpec, payloads: Sequence[Buffer]) -> None:
        """The payloads of the next batch of calls live until ``detach`` (register them, size buffers)."""

    def detach(self) -> None:
        """The payloads given to ``attach`` are about to be freed."""

    def scrub(self) -> None:
        """Overwrite any receive buffer that is reused, so stale bytes can never pass a check."""

    @abstractmethod
    def put(self, keys: list[bytes], payloads: Sequence[Buffer], spec: ChunkSpec) -> bool:
        """Store every payload under its key; True if all were stored."""

    @abstractmethod
    def get(self, keys: list[bytes], spec: ChunkSpec, layers: Range) -> list[Buffer | None]:
        """The bytes of each key (whole, or a layer range); None where a key is missing."""

    @abstractmethod
    def stream(self, keys: list[bytes], spec: ChunkSpec) -> list[list[Buffer | None]]:
        """Every layer of every key, delivered layer by layer: ``result[layer][key index]``."""

    @abstractmethod
    def exists(self, keys: list[bytes]) -> list[bool]:
        """Presence of each key, in one round trip where the system allows it."""

    @abstractmethod
    def clear(self, keys: list[bytes]) -> None:
        """Remove the keys, so that a following PUT really stores."""

    @abstractmethod
    def close(self) -> None:
        """Stop whatever this system started (servers, clients, temporary files)."""


class Sharded:
    """One baseline from ``servers`` servers at once (``make`` starts each): each holds every
    ``servers``-th of ``payloads`` (as a cluster's nodes share a prompt's chunks, keys
    ``prefix`` + their index) and is read by a thread of its own."""

    def __init__(self, make: Callable[[], System], servers: int, spec: ChunkSpec, payloads: Sequence[Buffer],
                 prefix: bytes) -> None:
        self.spec = spec
        self.systems: list[System] = []
        self.shares: list[list[bytes]] = []
        try:
            for k in range(servers):
                system = make()
                self.systems.append(system)
                keys = [prefix + b"%d" % i for i in range(k, len(payloads), servers)]
                values = [payloads[i] for i in range(k, len(payloads), servers)]
                system.attach(spec, values)
                if not system.put(keys, values, spec):
                    raise BenchError(f"{system.label}: PUT failed")
                self.shares.append(keys)
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(servers)
        self.cpu_seconds: float | None = None  # the last ``stream``'s

    def stream(self) -> int:
        """Stream every server's share, layer by layer, all at once; the bytes that came back.
        ``cpu_seconds``: what the reading threads spent on a CPU for it, together (``None``
        where the kernel does not say)."""
        timed = list(self._pool.map(self._stream_timed, self.systems, self.shares))
        times = [t for _, t in timed]
        self.cpu_seconds = sum(t.on_cpu for t in times) if None not in times else None
        return sum(memoryview(v).nbytes for layers, _ in timed for layer in layers for v in layer if v is not None)

    def _stream_timed(self, system: System, keys: list[bytes]) -> tuple[list, ThreadTimes | None]:
        clock = ThreadClock()
        layers = system.stream(keys, self.spec)
        return layers, clock.elapsed()

    def close(self) -> None:
        if hasattr(self, "_pool"):
            self._pool.shutdown()
        for system in self.systems:
            system.close()

    def __enter__(self) -> Sharded:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def terminate(proc: subprocess.Popen) -> None:
    """Stop a server started with ``start_new_session=True`` (its whole process group)."""
    stop_process_group(proc)


def wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0) -> None:
    """Block until something accepts connections on loopback ``port``; fail if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with code {proc.returncode} at start")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise BenchError(f"{what} did not listen on port {port} within {timeout:.0f}s") from None
            time.sleep(0.05)
