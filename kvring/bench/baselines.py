"""Two of kvring's peers in ``kvring bench data-plane``: raw ZMQ and Redis.

Raw ZMQ: a DEALER here, a ROUTER in a child process over loopback TCP that keeps PUT frames
and answers GET with (slices of) them, both ways zero-copy (``copy=False``): the transport kvring
itself uses, with no checksums, routing or store.  Its "GET whole" replies with whole chunks in
one message, its "GET stream" with one message per layer (as kvring does); its existence check
is one request-reply carrying every key.

Redis: redis-py against a throw-away ``redis-server`` (no persistence) on a free loopback port,
the remote store LMCache users most often put behind a KV cache: pipelined SET / GET / GETRANGE,
for the stream one GETRANGE per layer and key, and a pipelined EXISTS per key.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvring.bench.system import Buffer, ChunkSpec, Range, System, terminate
from kvring.local.cluster import free_port


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
            frames = [store.get(k.bytes) for k in rest[1:]]
            sock.send_multipart([ident, b"ok" if all(f is not None for f in frames) else b"missing",
                                 *(f.buffer[lo:hi] for f in frames if f is not None)], copy=False)
            continue
        if op.bytes == b"stream":  # one message per layer, like a kvring GET
            lb, layers = struct.unpack("<QQ", rest[0].bytes)
            frames = [store.get(k.bytes) for k in rest[1:]]
            for lo in range(0, lb * layers, lb):
                sock.send_multipart([ident, b"ok" if all(f is not None for f in frames) else b"missing",
                                     *(f.buffer[lo:lo + lb] for f in frames if f is not None)], copy=False)
            continue
        if op.bytes == b"exists":
            sock.send_multipart([ident, bytes(k.bytes in store for k in rest)])
            continue
        if op.bytes == b"put":
            store[rest[0].bytes] = rest[1]
        elif op.bytes == b"delete":
            for k in rest:
                store.pop(k.bytes, None)
        sock.send_multipart([ident, b"ok"])
        if op.bytes == b"stop":
            break
    sock.close(linger=1000)
    ctx.term()


class RawZmq(System):
    key, label = "zmq", "raw ZMQ"

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

    def _reply(self) -> list[Any] | None:
        status, *frames = self.sock.recv_multipart(copy=False)
        return [f.buffer for f in frames] if status.bytes == b"ok" else None

    def put(self, keys: list[bytes], payloads: Sequence[Buffer], spec: ChunkSpec) -> bool:
        for key, payload in zip(keys, payloads):
            self.sock.send_multipart([b"put", key, payload], copy=False)
        return all(self.sock.recv() == b"ok" for _ in keys)

    def get(self, keys: list[bytes], spec: ChunkSpec, layers: Range) -> list[Buffer | None]:
        self.sock.send_multipart([b"get", struct.pack("<QQ", *spec.span(layers)), *keys])
        return self._reply() or [None] * len(keys)

    def stream(self, keys: list[bytes], spec: ChunkSpec) -> list[list[Buffer | None]]:
        self.sock.send_multipart([b"stream", struct.pack("<QQ", spec.layer_bytes, spec.layers), *keys])
        return [self._reply() or [None] * len(keys) for _ in range(spec.layers)]

    def exists(self, keys: list[bytes]) -> list[bool]:
        self.sock.send_multipart([b"exists", *keys])
        return [bool(x) for x in self.sock.recv()]

    def clear(self, keys: list[bytes]) -> None:
        self.sock.send_multipart([b"delete", *keys])
        self.sock.recv()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.sock.send(b"stop")
                self.sock.recv()
                self.proc.wait(5)
        except (zmq.ZMQError, subprocess.TimeoutExpired):
            pass
        self.sock.close(linger=0)
        self.ctx.term()
        terminate(self.proc)


class Redis(System):
    """redis-py against a throw-away ``redis-server`` on a free loopback port, no persistence."""

    key, label = "redis", "Redis"

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

    def put(self, keys: list[bytes], payloads: Sequence[Buffer], spec: ChunkSpec) -> bool:
        return all(self._batch(lambda pipe, k, i: pipe.set(k, memoryview(payloads[i])), keys))

    def get(self, keys: list[bytes], spec: ChunkSpec, layers: Range) -> list[Buffer | None]:
        if layers is None:
            return self._batch(lambda pipe, k, i: pipe.get(k), keys)
        lo, hi = spec.span(layers)
        return self._batch(lambda pipe, k, i: pipe.getrange(k, lo, hi - 1), keys)

    def stream(self, keys: list[bytes], spec: ChunkSpec) -> list[list[Buffer | None]]:
        lb, n = spec.layer_bytes, len(keys)
        flat = self._batch(lambda pipe, k, i: pipe.getrange(k, (i // n) * lb, (i // n + 1) * lb - 1),
                           keys * spec.layers)  # layer-major: entry i is layer i // n of key i % n
        return [flat[lo:lo + n] for lo in range(0, len(flat), n)]

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [bool(x) for x in self._batch(lambda pipe, k, i: pipe.exists(k), keys)]

    def clear(self, keys: list[bytes]) -> None:
        self.r.delete(*keys)

    def close(self) -> None:
        self.r.close()
        terminate(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)
