"""The client's transport: TCP connections to nodes, pooled, and exchanges of requests over them.

Threading contract: a ``Links`` table (every node's ``NodeLink``: address and idle
connections) is shared by all threads; its methods take a short lock.  An ``Exchange`` belongs
to the one thread that made it: it runs that thread's requests to completion on that thread,
with no hand-off to another (the caller's thread does the I/O).

An exchange checks out one connection per node it talks to, queues every request for that node
on it (pipelined: each carries its ``rid``), and then ``events()`` pumps the sockets -- writing
what is queued as each socket takes it, reading replies as they arrive, in one ``poll`` loop
across all of them -- and yields one ``Reply`` per reply message, unary or streamed alike, and a
``Failure`` for the requests of a connection that broke, or whose node stayed silent for the
exchange's ``timeout`` while a request waited on it.
When the exchange closes, connections with nothing outstanding go back to their pool; any other
is closed, so a late reply can never be read as the answer to a later request.
"""

from __future__ import annotations

import itertools
import logging
import math
import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec

from kvring.common import protocol as P
from kvring.common.errors import NodeUnavailable, RemoteError, remote_error
from kvring.common.records import split_data_addr
from kvring.common.tls import ContextSource

from ..buffers import SlabPool
from ..framing import ConnectionClosed, FrameLimits, FrameReader, FramingError, SendQueue, pack
from ..landing import Landing
from ..tlsstream import TlsStream

logger = logging.getLogger(__name__)

# Replies come from nodes of the same cluster; bound them anyway (a GetLayer carries one
# payload per key of its request).
REPLY_LIMITS = FrameLimits(max_header=256 << 20, max_payloads=P.MAX_KEYS_PER_REQUEST, max_payload=16 << 30,
                           max_total=64 << 30)
MAX_IDLE = 8  # idle connections kept per node
UNSENT = math.inf  # ``Connection.heard`` of a request queued and not yet sent
_rids = itertools.count(1)


def next_rid() -> int:
    return next(_rids)


@dataclass(slots=True)
class Reply:
    """One reply message: ``msg`` is a decoded reply (never ``Error``: that is a ``Failure``)."""

    node_id: str
    rid: int
    msg: object
    payloads: list


@dataclass(slots=True)
class Failure:
    """Requests that ended without (all of) their reply: a node error, a broken connection or
    the deadline."""

    node_id: str
    rids: list[int]
    error: NodeUnavailable | RemoteError


class Connection:
    """A non-blocking TCP connection to one node, with its reader and send queue."""

    __slots__ = ("node_id", "sock", "context", "reader", "out", "streamed", "outstanding", "heard", "poller")

    def __init__(self, node_id: str, host: str, port: int, timeout: float, buffers: SlabPool,
                 tls: ContextSource | None = None) -> None:
        self.node_id = node_id
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise NodeUnavailable(f"cannot connect to node {node_id} at {host}:{port}: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.context = tls() if tls is not None else None  # the credentials it was opened under
        if self.context is not None:  # the handshake runs here, within ``timeout``
            try:
                self.sock = TlsStream(self.sock, self.context)
            except (ssl.SSLError, OSError) as exc:
                self.sock.close()
                raise NodeUnavailable(f"TLS handshake with node {node_id} at {host}:{port} failed: {exc} (are "
                                      "this client's cluster credentials the node's?)") from None
        self.sock.setblocking(False)
        self.poller = select.poll()  # this socket alone, for POLLIN (reused: one wait costs one syscall)
        self.poller.register(self.sock.fileno(), select.POLLIN)
        self.reader = FrameReader(REPLY_LIMITS, allocate=buffers.take, eager=True)
        self.out = SendQueue(self.sock if isinstance(self.sock, TlsStream) else None)
        self.outstanding: set[int] = set()  # rids without their last reply yet
        self.streamed: set[int] = set()  # those whose reply is a stream (GET)
        self.heard = 0.0  # monotonic time of the last bytes received (or of the first request's sending)

    def stale(self) -> bool:
        """An idle connection with something to read has been closed (or broken) by the node:
        nothing else arrives unasked."""
        return bool(self.poller.poll(0))

    def close(self) -> None:
        self.sock.close()


class NodeLink:
    """One node's address and its idle connections (shared by threads)."""

    def __init__(self, node_id: str, data_addr: str, connect_timeout: float, buffers: SlabPool,
                 tls: ContextSource | None = None) -> None:
        try:
            self.host, self.port = split_data_addr(data_addr)
        except ValueError as exc:
            raise ValueError(f"node {node_id}: {exc}") from None
        self.node_id = node_id
        self.data_addr = data_addr
        self.connect_timeout = connect_timeout
        self.buffers = buffers
        self.tls = tls
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self.closed = False

    def acquire(self) -> Connection:
        """An idle connection that is still open, or a new one (raises ``NodeUnavailable``)."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return Connection(self.node_id, self.host, self.port, self.connect_timeout, self.buffers, self.tls)
            if not conn.stale() and (self.tls is None or conn.context is self.tls()):
                return conn
            # The node closed it (it restarted, or it dropped an idle client), or it was opened
            # under credentials since replaced (which may no longer be trusted).
            conn.close()

    def release(self, conn: Connection) -> None:
        with self._lock:
            if not self.closed and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class Links:
    """Every member's ``NodeLink``, replaced as membership changes."""

    def __init__(self, connect_timeout: float, buffer_pool_bytes: int, tls: ContextSource | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.tls = tls  # the cluster's credentials as they are now (client side), or None for plain TCP
        # Where large payloads handed to callers are read into, reused once they drop them.
        self.buffers = SlabPool(buffer_pool_bytes)
        self._links: dict[str, NodeLink] = {}
        self._lock = threading.Lock()

    def get(self, node_id: str) -> NodeLink | None:
        return self._links.get(node_id)

    def __contains__(self, node_id: str) -> bool:
        return node_id in self._links

    def update(self, addresses: dict[str, str]) -> None:
        """Members and their data addresses: links of nodes gone or moved are closed."""
        with self._lock:
            links = dict(self._links)
            for node_id, link in list(links.items()):
                if addresses.get(node_id) != link.data_addr:
                    links.pop(node_id).close()
            for node_id, addr in addresses.items():
                if node_id not in links:
                    try:
                        links[node_id] = NodeLink(node_id, addr, self.connect_timeout, self.buffers, self.tls)
                    except ValueError as exc:
                        logger.warning("ignoring member: %s", exc)
            self._links = links

    def close(self) -> None:
        with self._lock:
            links, self._links = self._links, {}
        for link in links.values():
            link.close()


class Exchange:
    """Requests to any nodes, run to completion on the calling thread (see the module docstring)."""

    def __init__(self, links: Links, timeout: float, land: Callable[[bytearray, int, int], Landing | None] | None = None
                 ) -> None:
        self.links = links
        self.timeout = timeout  # how long a node may stay silent while a request waits on it
        self.land = land  # the readers' ``land`` callback while this exchange has their connections
        self._conns: dict[str, Connection] = {}
        self._rid_conn: dict[int, Connection] = {}
        self._failed: deque[Failure] = deque()

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, node_id: str, msg, payloads=(), streamed: bool = False) -> int:
        """Queue ``msg`` (and its payloads) for ``node_id``; returns its rid.  A node that cannot
        be reached becomes a ``Failure`` event, not an exception."""
        conn = self._conns.get(node_id)
        if conn is None:
            link = self.links.get(node_id)
            try:
                if link is None:
                    raise NodeUnavailable(f"node {node_id} is not a member")
                conn = self._conns[node_id] = link.acquire()
                conn.reader.land = self.land
            except NodeUnavailable as exc:
                self._failed.append(Failure(node_id, [msg.rid], exc))
                return msg.rid
        conn.out.add(pack(P.encode(msg), payloads))
        if not conn.outstanding:
            conn.heard = UNSENT  # the node's silence counts from when ``events`` sends it
        conn.outstanding.add(msg.rid)
        if streamed:
            conn.streamed.add(msg.rid)
        self._rid_conn[msg.rid] = conn
        return msg.rid

    def finish(self, rid: int) -> None:
        """The caller needs nothing more of a streamed request (its last reply, or an abandon)."""
        conn = self._rid_conn.pop(rid, None)
        if conn is not None:
            conn.outstanding.discard(rid)
            conn.streamed.discard(rid)

    def events(self) -> Iterator[Reply | Failure]:
        """Pump the sockets until no request is outstanding; yield replies and failures."""
        readable = False
        while True:
            while self._failed:
                yield self._failed.popleft()
            live = [c for c in self._conns.values() if c.outstanding or c.out]
            if not live:
                return
            broke = False
            for conn in live:  # write first: requests go out before we wait
                if conn.out:
                    try:
                        conn.out.write(conn.sock)
                    except ConnectionClosed as exc:
                        self._break(conn, NodeUnavailable(f"node {conn.node_id}: {exc}"))
                        broke = True
            if broke:  # that connection is closed now: yield its failure, and wait on the others only
                continue
            now = time.monotonic()
            for conn in live:
                if conn.heard == UNSENT:
                    conn.heard = now
            if readable:  # after a wake-up or a read that got bytes; not right after sending
                progressed = False
                for conn in live:
                    yield from self._read(conn)
                    if conn.reader.received:  # the timeout bounds silence, not the length of a reply
                        conn.heard, progressed = now, True
                if progressed:
                    continue
                live = [c for c in self._conns.values() if c.outstanding or c.out]
                if not live or self._failed:
                    continue
            # Silent only if nothing came in the last look: a thread kept off a CPU past the
            # timeout (a starved machine) reads what arrived meanwhile before blaming a node.
            silent = [c for c in live if now - c.heard >= self.timeout] if readable else []
            for conn in silent:
                self._break(conn, NodeUnavailable(f"node {conn.node_id} did not answer within {self.timeout:.1f}s"))
            if silent:
                continue
            left = min(c.heard for c in live) + self.timeout - now
            if len(live) == 1 and not live[0].out:
                poller = live[0].poller
            else:
                poller = select.poll()
                for conn in live:
                    poller.register(conn.sock.fileno(), select.POLLIN | (select.POLLOUT if conn.out else 0))
            poller.poll(max(left, 0.0) * 1000)  # the next turn writes and reads every live connection
            readable = True

    def _read(self, conn: Connection) -> Iterator[Reply | Failure]:
        if self._conns.get(conn.node_id) is not conn:
            return
        try:
            messages = conn.reader.read(conn.sock)
        except (ConnectionClosed, FramingError) as exc:
            self._break(conn, NodeUnavailable(f"node {conn.node_id}: {exc}"))
            return
        for message in messages:
            try:
                reply = P.decode_reply(message.header)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._break(conn, NodeUnavailable(f"node {conn.node_id} sent an undecodable reply: {exc}"))
                return
            rid = reply.rid
            if rid not in conn.outstanding:
                if isinstance(reply, P.Error) and rid == 0:  # the node refused the stream itself
                    self._break(conn, remote_error(reply.code, reply.message, conn.node_id))
                    return
                continue  # the rest of a stream the caller finished early
            if isinstance(reply, P.Error):
                self.finish(rid)
                yield Failure(conn.node_id, [rid], remote_error(reply.code, reply.message, conn.node_id))
                continue
            if rid not in conn.streamed or _ends_stream(reply):
                self.finish(rid)
            yield Reply(conn.node_id, rid, reply, message.payloads)

    def _break(self, conn: Connection, error: NodeUnavailable | RemoteError) -> None:
        rids = sorted(conn.outstanding)
        for rid in rids:
            self._rid_conn.pop(rid, None)
        conn.outstanding.clear()
        conn.out.clear()
        conn.close()
        if self._conns.get(conn.node_id) is conn:
            del self._conns[conn.node_id]
        if rids:
            self._failed.append(Failure(conn.node_id, rids, error))

    def close(self) -> None:
        for node_id, conn in self._conns.items():
            conn.reader.land = None
            link = self.links.get(node_id)
            if conn.outstanding or conn.out or link is None:
                conn.close()
            else:
                link.release(conn)
        self._conns.clear()
        self._rid_conn.clear()


def _ends_stream(reply) -> bool:
    return (isinstance(reply, P.GetLayer) and reply.last) or (
        isinstance(reply, P.GetHead) and not any(m is not None for m in reply.metas))

