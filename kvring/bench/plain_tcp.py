"""The loopback ceiling: a plain TCP socket moving the same bytes with the least protocol possible
(and, over Python's own ``ssl`` with the cluster's credentials, the bare TLS loop: ``tls``).

A child process (``serve``) keeps PUT payloads in memory and answers reads with them; the client
(``PlainTcp``) sends each request with one ``sendmsg`` of header, keys and payloads, and receives
each reply's data with ``recv_into`` straight into one preallocated buffer it reuses.  No
checksums, routing, metadata or eviction, and the server reuses a removed value's memory for the
next PUT of its size (as a store with its own memory pool does): what a kvring figure loses
against this one is the price of everything kvring adds to moving the bytes.

Lifecycle: the server serves one connection at a time, answering its requests in order; ``STOP``
(or SIGTERM) ends the server.

Format (little-endian):

- request: ``REQUEST`` = op ``u8``, key count ``n`` ``u32``, two ``u64`` arguments ``a``, ``b``,
  key table size ``u32``; then the key table: ``n`` keys, each a ``u16`` length and its bytes.
- ``PUT``: then ``n`` ``u64`` sizes and the ``n`` payloads back to back; reply ``u32`` stored.
- ``GET``: bytes ``[a, b)`` of each value (``b == 0``: the whole value); reply ``u32`` ``n``,
  ``n`` ``i64`` lengths (-1: missing), then the data of the present keys back to back.
- ``STREAM``: layer size ``a``, layer count ``b``; ``b`` replies, each shaped like a GET reply
  holding one layer of every key (as kvring's streamed GET sends one message per layer).
- ``EXISTS``: reply ``n`` bytes, 1 present / 0 missing.
- ``DELETE``: reply ``u32`` removed.   ``STOP``: reply ``u32`` 0, then the server exits.

Versioning and errors: none -- a benchmark peer that lives for one run, started by the same code
that talks to it.  An unknown op or a short read closes the connection; the client then raises
``BenchError``.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import subprocess
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from kvring.bench.system import BenchError, Buffer, ChunkSpec, Range, System, terminate, wait_for_port
from kvring.common.tls import ClusterCredentials
from kvring.local.cluster import free_port

PUT, GET, STREAM, EXISTS, DELETE, STOP = range(1, 7)
REQUEST = struct.Struct("<BIQQI")
KEY_LEN = struct.Struct("<H")
COUNT = struct.Struct("<I")
IOV_MAX = 1024  # buffers per sendmsg (Linux's UIO_MAXIOV)


def send_all(sock: socket.socket, buffers: Sequence[Buffer]) -> None:
    """``sendmsg`` the buffers back to back, resuming after a partial send (over TLS, ``sendall``
    of each: TLS cuts them into records anyway)."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            sock.sendall(view)
        return
    while views:
        sent = sock.sendmsg(views[:IOV_MAX])
        while sent:
            if sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            else:
                views[0], sent = views[0][sent:], 0


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket (``recv_into`` until it is full)."""
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed mid-message")
        got += n


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def _parse_keys(table: bytes, n: int) -> list[bytes]:
    keys, pos = [], 0
    for _ in range(n):
        (length,) = KEY_LEN.unpack_from(table, pos)
        keys.append(table[pos + KEY_LEN.size:pos + KEY_LEN.size + length])
        pos += KEY_LEN.size + length
    return keys


def _slices_reply(values: list[memoryview | None]) -> list[Buffer]:
    lengths = [-1 if v is None else v.nbytes for v in values]
    return [COUNT.pack(len(values)) + struct.pack(f"<{len(values)}q", *lengths), *(v for v in values if v is not None)]


class _Store(dict[bytes, bytearray]):
    """The server's values.  Removed values go to a free list by size and are reused by the next
    PUT of that size, as a store with its own memory pool (Mooncake's segment) would: a PUT then
    costs the copy, not the kernel's page faults on fresh memory."""

    def __init__(self) -> None:
        super().__init__()
        self.free: dict[int, list[bytearray]] = {}

    def buffer(self, size: int) -> bytearray:
        pool = self.free.get(size)
        return pool.pop() if pool else bytearray(size)

    def put(self, key: bytes, value: bytearray) -> None:
        self.remove(key)
        self[key] = value

    def remove(self, key: bytes) -> bool:
        old = self.pop(key, None)
        if old is not None:
            self.free.setdefault(len(old), []).append(old)
        return old is not None


def serve(port: int, tls_dir: str | None = None) -> None:
    """The server (a child process): in-memory values, replies as documented above.  Connections
    are served one after another (a readiness probe's connection simply ends); STOP exits.  With
    ``tls_dir``, every connection is wrapped in TLS with those cluster credentials."""
    store = _Store()
    context = ClusterCredentials.at(tls_dir).server_context() if tls_dir else None
    with socket.create_server(("127.0.0.1", port)) as listener:
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if context is not None:
                try:
                    conn = context.wrap_socket(conn, server_side=True)
                except OSError:  # a readiness probe, or a peer without the credentials
                    conn.close()
                    continue
            with conn:
                if _serve_connection(conn, store):
                    return


def _serve_connection(conn: socket.socket, store: _Store) -> bool:
    """Answer requests until the connection ends (False) or a STOP (True)."""
    while True:
        try:
            op, n, a, b, table = REQUEST.unpack(_recv(conn, REQUEST.size))
            keys = _parse_keys(_recv(conn, table), n)
            if op == PUT:
                sizes = struct.unpack(f"<{n}Q", _recv(conn, 8 * n))
                for key, size in zip(keys, sizes):
                    value = store.buffer(size)
                    recv_exact(conn, memoryview(value))
                    store.put(key, value)
                send_all(conn, [COUNT.pack(n)])
            elif op == GET:
                values = [store.get(k) for k in keys]
                send_all(conn, _slices_reply([None if v is None else memoryview(v)[a:b or len(v)] for v in values]))
            elif op == STREAM:
                values = [store.get(k) for k in keys]
                for lo in range(0, a * b, a):
                    send_all(conn, _slices_reply([None if v is None else memoryview(v)[lo:lo + a] for v in values]))
            elif op == EXISTS:
                send_all(conn, [bytes(k in store for k in keys)])
            elif op == DELETE:
                send_all(conn, [COUNT.pack(sum(store.remove(k) for k in keys))])
            elif op == STOP:
                send_all(conn, [COUNT.pack(0)])
                return True
            else:
                return False
        except OSError:  # the client went away (ConnectionError is an OSError)
            return False


class PlainTcp(System):
    """Client of ``serve`` in a child interpreter on a free loopback port; with ``tls``, the
    bare TLS loop: the same bytes through Python's ``ssl`` (TLS 1.3, the cluster's credentials)."""

    key, label = "tcp", "plain TCP"

    def __init__(self, timeout: float = 60.0, tls: ClusterCredentials | None = None) -> None:
        port = free_port()
        if tls is not None:
            self.key, self.label = "bare-tls", "bare ssl loop"
        tls_dir = repr(str(tls.directory)) if tls is not None else None
        # A plain child interpreter, not multiprocessing: works whatever the caller's __main__ is.
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", f"from {__name__} import serve; "
                                      f"serve({port}, {tls_dir})"], start_new_session=True)
        try:
            wait_for_port(port, self.proc, f"the {self.label} server")
            sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = tls.client_context().wrap_socket(sock) if tls is not None else sock
        except BaseException:
            terminate(self.proc)
            raise
        self.buf = np.empty(0, dtype=np.uint8)  # the preallocated receive buffer, grown when needed
        self.in_flight = False  # a request whose reply was not read to its end (see ``_exchange``)

    @contextlib.contextmanager
    def _exchange(self, op: int, keys: Sequence[bytes], a: int = 0, b: int = 0,
                  payloads: Sequence[Buffer] = ()) -> Iterator[None]:
        """One request and, inside the block, the reading of its whole reply.  A reply cut short
        (an error, or a signal unwinding the run) leaves the connection mid-stream: ``close`` then
        knows not to send the server another request and wait for an answer that never comes."""
        self.in_flight = True
        self._request(op, keys, a, b, payloads)
        yield
        self.in_flight = False

    def _request(self, op: int, keys: Sequence[bytes], a: int, b: int, payloads: Sequence[Buffer]) -> None:
        table = b"".join(KEY_LEN.pack(len(k)) + k for k in keys)
        head = [REQUEST.pack(op, len(keys), a, b, len(table)), table]
        if payloads:
            head.append(struct.pack(f"<{len(payloads)}Q", *(memoryview(p).nbytes for p in payloads)))
        try:
            send_all(self.sock, [b"".join(head), *payloads])
        except OSError as exc:
            raise BenchError(f"{self.label} server: {exc}") from exc

    def _recv(self, n: int) -> bytes:
        try:
            return _recv(self.sock, n)
        except OSError as exc:
            raise BenchError(f"{self.label} server: {exc}") from exc

    def _room(self, nbytes: int) -> None:
        if self.buf.nbytes < nbytes:
            self.buf = np.empty(nbytes, dtype=np.uint8)
            self.buf.fill(0)  # fault the pages in now, not inside a timed read

    def _slices(self, offset: int) -> tuple[list[memoryview | None], int]:
        """Receive one slices reply into ``buf`` at ``offset``; returns the views and the end offset."""
        (n,) = COUNT.unpack(self._recv(COUNT.size))
        lengths = struct.unpack(f"<{n}q", self._recv(8 * n))
        end = offset + sum(max(0, x) for x in lengths)
        self._room(end)
        view = memoryview(self.buf)
        try:
            recv_exact(self.sock, view[offset:end])
        except OSError as exc:
            raise BenchError(f"{self.label} server: {exc}") from exc
        out: list[memoryview | None] = []
        for length in lengths:
            out.append(None if length < 0 else view[offset:offset + length])
            offset += max(0, length)
        return out, end

    def attach(self, spec: ChunkSpec, payloads: Sequence[Buffer]) -> None:
        self._room(len(payloads) * spec.nbytes)

    def scrub(self) -> None:
        self.buf.fill(0)

    def put(self, keys: list[bytes], payloads: Sequence[Buffer], spec: ChunkSpec) -> bool:
        with self._exchange(PUT, keys, payloads=payloads):
            return COUNT.unpack(self._recv(COUNT.size))[0] == len(keys)

    def get(self, keys: list[bytes], spec: ChunkSpec, layers: Range) -> list[Buffer | None]:
        lo, hi = spec.span(layers)
        with self._exchange(GET, keys, lo, hi):
            return self._slices(0)[0]

    def stream(self, keys: list[bytes], spec: ChunkSpec) -> list[list[Buffer | None]]:
        out, offset = [], 0
        with self._exchange(STREAM, keys, spec.layer_bytes, spec.layers):
            for _ in range(spec.layers):
                views, offset = self._slices(offset)
                out.append(views)
        return out

    def exists(self, keys: list[bytes]) -> list[bool]:
        with self._exchange(EXISTS, keys):
            return [bool(x) for x in self._recv(len(keys))]

    def clear(self, keys: list[bytes]) -> None:
        with self._exchange(DELETE, keys):
            self._recv(COUNT.size)

    def close(self) -> None:
        try:
            if self.proc.poll() is None and not self.in_flight:
                with self._exchange(STOP, []):
                    self._recv(COUNT.size)
                self.proc.wait(5)
        except (BenchError, subprocess.TimeoutExpired):
            pass
        self.sock.close()
        terminate(self.proc)
