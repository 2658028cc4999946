"""A client's ``TlsStream`` (records decrypted from memory) against a node's side of TLS (an
``SSLSocket`` with the node's context, real sockets over loopback): messages cross whole both
ways through the frame reader and the send queue; records the socket has not taken keep the
queue pending until they are out; the peer's end, a tampered record and a peer that never
answers the handshake end the connection with an error, never with wrong bytes."""

from __future__ import annotations

import hashlib
import select
import socket
import ssl
import threading
import time

import numpy as np
import pytest

from kvring.cachenode.buffers import SlabPool
from kvring.cachenode.client.transport import REPLY_LIMITS, Connection
from kvring.cachenode.framing import ConnectionClosed, FrameReader, SendQueue, pack
from kvring.cachenode.tlsstream import SEND_PIECE, TlsStream
from kvring.common.errors import NodeUnavailable
from kvring.common.tls import generate


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("tls"), "tlsstream")


class _Node:
    """One TLS connection accepted with the node's context; ``serve(conn)`` runs on a thread."""

    def __init__(self, creds, serve) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.context = creds.server_context()
        self.serve = serve
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        raw, _ = self.listener.accept()
        try:
            with self.context.wrap_socket(raw, server_side=True) as conn:
                self.serve(conn)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            self.error = exc

    def close(self) -> None:
        self.thread.join(10)
        self.listener.close()


def _client(port: int, creds, sndbuf: int | None = None) -> TlsStream:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    stream = TlsStream(sock, creds.client_context())
    stream.setblocking(False)
    return stream


def _read_messages(stream: TlsStream, count: int, timeout: float = 20) -> list:
    reader, got = FrameReader(REPLY_LIMITS, eager=True), []
    end = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < end:
        select.select([stream.fileno()], [], [], 0.2)
        got += reader.read(stream)
    return got


def _send(stream: TlsStream, queue: SendQueue, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while queue and time.monotonic() < end:
        queue.write(stream)
        if queue:
            select.select([], [stream.fileno()], [], 0.2)
    assert not queue


def _recv_exactly(conn: ssl.SSLSocket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = conn.recv(min(1 << 20, n - len(out)))
        if not data:
            break
        out += data
    return bytes(out)


def test_messages_cross_whole_both_ways(creds):
    """Payloads of many records each (and a small one), from the node into the frame reader
    and from the send queue to the node, byte for byte."""
    rng = np.random.default_rng(1)
    down = [rng.bytes(n) for n in (3 << 20, 100, (1 << 20) + 7)]
    up = rng.bytes((5 << 20) + 3)

    def serve(conn: ssl.SSLSocket) -> None:
        for payload in down:
            conn.sendall(b"".join(bytes(b) for b in pack(b"head", [payload])))
        got = _recv_exactly(conn, len(up))
        conn.sendall(hashlib.sha256(got).digest())

    node = _Node(creds, serve)
    stream = _client(node.port, creds)
    messages = _read_messages(stream, len(down))
    assert [bytes(m.header) for m in messages] == [b"head"] * len(down)
    assert [bytes(m.payloads[0]) for m in messages] == down
    queue = SendQueue(stream)
    queue.add([up])
    _send(stream, queue)
    stream.setblocking(True)
    assert stream.read(32, bytearray(32)) == 32  # the node's digest of what it received
    node.close()
    assert node.error is None
    stream.close()


def test_records_the_socket_has_not_taken_keep_the_queue_pending_until_they_are_out(creds):
    """A piece of plaintext is taken whole, encrypted at once; what the socket cannot take yet
    (the node is not reading) stays in the stream, and the queue says it has more to send, so
    its owner polls for POLLOUT until the node has every byte."""
    rng = np.random.default_rng(2)
    data = bytearray()
    reading = threading.Event()

    def serve(conn: ssl.SSLSocket) -> None:
        reading.wait(20)  # set once every piece is queued: ``data`` is whole then
        conn.sendall(hashlib.sha256(_recv_exactly(conn, len(data))).digest())

    node = _Node(creds, serve)
    stream = _client(node.port, creds, sndbuf=16 << 10)
    queue = SendQueue(stream)
    for _ in range(10_000):  # a piece at a time until the socket (the node not reading) is full
        piece = rng.bytes(SEND_PIECE)
        queue.add([piece])
        data += piece
        queue.write(stream)
        if stream.unsent:
            break
    assert not queue.views and stream.unsent > 0  # every piece taken, not all of its records sent
    assert queue  # so the queue is not done
    with pytest.raises(ssl.SSLWantWriteError):
        stream.send(b"more")  # nothing new is taken before the earlier records are out
    reading.set()
    _send(stream, queue)
    assert stream.unsent == 0
    stream.setblocking(True)
    digest = bytearray(32)
    assert stream.read(32, digest) == 32 and bytes(digest) == hashlib.sha256(data).digest()
    node.close()
    assert node.error is None
    stream.close()


@pytest.mark.parametrize("how", ["close_notify", "tcp close"])
def test_the_peers_end_is_the_end_of_the_stream(creds, how):
    """After its last message the node ends the stream, with TLS's close_notify or by closing
    the TCP connection alone (a ragged end): the message is read whole, then the reader says
    the peer closed (at its next read when one read reaches both)."""
    def serve(conn: ssl.SSLSocket) -> None:
        conn.sendall(b"".join(bytes(b) for b in pack(b"last", [b"x" * 70_000])))
        if how == "close_notify":
            conn.settimeout(0.5)
            try:
                conn.unwrap()  # sends close_notify, then waits for the client's (which never comes)
            except OSError:
                pass
        else:
            socket.socket(fileno=conn.detach()).close()

    node = _Node(creds, serve)
    stream = _client(node.port, creds)
    reader, got = FrameReader(REPLY_LIMITS, eager=True), []
    with pytest.raises(ConnectionClosed, match="closed by the peer"):
        for _ in range(100):
            select.select([stream.fileno()], [], [], 0.2)
            got += reader.read(stream)
    assert [(bytes(m.header), bytes(m.payloads[0])) for m in got] == [(b"last", b"x" * 70_000)]
    stream.close()
    node.close()
    assert node.error is None


def test_a_tampered_record_breaks_the_connection_and_never_delivers_its_bytes(creds):
    """A byte flipped on the wire after the handshake (a proxy between the two): the record
    fails its authentication, the reader raises ``ConnectionClosed``, and no payload that
    includes it is delivered."""
    payload = np.random.default_rng(3).bytes(2 << 20)

    def serve(conn: ssl.SSLSocket) -> None:
        try:
            conn.sendall(b"".join(bytes(b) for b in pack(b"data", [payload])))
            time.sleep(2)
        except OSError:
            pass  # the client hung up on the bad record

    node = _Node(creds, serve)
    proxy = socket.create_server(("127.0.0.1", 0))

    def forward(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data = bytearray(data)
                    data[flip_at - seen] ^= 0x40
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def run_proxy() -> None:
        client_side, _ = proxy.accept()
        node_side = socket.create_connection(("127.0.0.1", node.port))
        threading.Thread(target=forward, args=(client_side, node_side, None), daemon=True).start()
        forward(node_side, client_side, 1 << 20)  # well past the handshake, inside the payload

    threading.Thread(target=run_proxy, daemon=True).start()
    stream = _client(proxy.getsockname()[1], creds)
    reader, delivered = FrameReader(REPLY_LIMITS, eager=True), []
    with pytest.raises(ConnectionClosed):
        for _ in range(200):
            select.select([stream.fileno()], [], [], 0.1)
            delivered += reader.read(stream)
    assert delivered == []
    stream.close()
    node.close()
    proxy.close()


def test_a_node_that_never_answers_the_handshake_is_unavailable_within_the_timeout(creds):
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never speaks TLS
    t0 = time.monotonic()
    with pytest.raises(NodeUnavailable, match="TLS handshake with node n0 .* failed"):
        Connection("n0", "127.0.0.1", silent.getsockname()[1], 1.0, SlabPool(1 << 20), creds.client_context)
    assert time.monotonic() - t0 < 5
    silent.close()
