"""The node's data-protocol server: one thread, one ``epoll`` loop, many connections.

Threading contract: ``serve_forever`` (an ``epoll`` loop) runs on the node's I/O thread, and everything here (the
connections, the handler it calls, the store behind it) is owned by that thread.  Other
threads reach it only through ``call`` (run a function on the loop and wait for its result)
and ``stop``; both wake the loop through a socket pair.

Per connection, the loop reads with a ``FrameReader`` (bounded by ``FrameLimits`` before any
allocation) and hands each complete message to the handler, which answers with ``send``
(frames queued and written as the socket takes them) or ``stream`` (a generator of messages,
produced only while the connection's send queue is below ``SEND_WATERMARK``).  So a reply of
gigabytes costs the node a bounded queue of zero-copy views, a client that stops reading stalls
only itself, and each turn of the loop gives every streaming connection a slice before it
looks at the sockets again: no request holds the loop for long, however large its reply.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from .framing import WOULD_BLOCK, ConnectionClosed, FrameLimits, FrameReader, FramingError, Message, SendQueue

logger = logging.getLogger(__name__)

SEND_WATERMARK = 4 << 20  # bytes queued on a connection before its streams pause
SLICE_SECONDS = 0.005  # a streaming connection's share of one loop turn
MAX_CONNECTIONS = 4096

Frames = list  # the buffers of one framed message (see ``framing.pack``)


class Connection:
    """One client connection: its reader, its send queue and its streamed replies."""

    __slots__ = ("sock", "peer", "reader", "out", "streams", "closing", "events", "handshaking")

    def __init__(self, sock: socket.socket, peer: str, limits: FrameLimits, allocate) -> None:
        self.sock = sock
        self.handshaking = isinstance(sock, ssl.SSLSocket)  # a TLS handshake is still under way
        self.peer = peer
        self.reader = FrameReader(limits, allocate=allocate)
        self.out = SendQueue()
        self.streams: deque[Iterator[Frames]] = deque()
        self.closing = False  # close once ``out`` is written (after a framing error)
        self.events = select.EPOLLIN  # what the loop watches for


class Server:
    def __init__(self, host: str, port: int, handler: Callable[[Connection, Message], None],
                 limits: FrameLimits, allocate: Callable[[int], object] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls  # the cluster's credentials: every connection must complete a TLS handshake
        self.limits = limits
        self.allocate = allocate  # where large payloads are read into (see ``FrameReader``)
        self.listener = socket.create_server((host, port), backlog=512, reuse_port=False)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.epoll = select.epoll()
        self.epoll.register(self.listener.fileno(), select.EPOLLIN)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.epoll.register(self._wake_r.fileno(), select.EPOLLIN)
        self._calls: deque[tuple[Callable, Future]] = deque()
        self._stopping = False
        self.conns: set[Connection] = set()
        self._by_fd: dict[int, Connection] = {}
        self._streaming: deque[Connection] = deque()
        # Called with the connection and the error before the connection is closed (the node
        # answers with the error's code there).
        self.on_framing_error: Callable[[Connection, FramingError], None] = lambda conn, exc: None
        self.on_refused: Callable[[Connection, Exception], None] = lambda conn, exc: None  # a failed TLS handshake

    # ---- other threads ---------------------------------------------------------------------

    def call(self, fn: Callable, timeout: float = 5.0):
        """Run ``fn()`` on the loop thread and return its result (from any other thread)."""
        fut: Future = Future()
        self._calls.append((fn, fut))
        self._wake()
        return fut.result(timeout)

    def stop(self) -> None:
        self._stopping = True
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake (the pipe is full) or shutting down

    # ---- the loop -------------------------------------------------------------------------

    def serve_forever(self) -> None:
        listener, wake, by_fd = self.listener.fileno(), self._wake_r.fileno(), self._by_fd
        try:
            while not self._stopping:
                timeout = 0 if self._streaming and self._runnable() else 0.5
                for fd, mask in self.epoll.poll(timeout):
                    conn = by_fd.get(fd)
                    if conn is not None:
                        if conn.handshaking:
                            self._handshake(conn)
                            continue
                        if mask & select.EPOLLOUT:
                            self._flush(conn)
                        if mask & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and conn in self.conns:
                            self._read(conn)
                    elif fd == listener:
                        self._accept()
                    elif fd == wake:
                        self._run_calls()
                if self._streaming:
                    self._run_streams()
        finally:
            for conn in list(self.conns):
                self._close(conn)
            self.epoll.close()
            self.listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: the client retries
                logger.warning("cannot accept a connection: %s", exc)
                return
            if len(self.conns) >= MAX_CONNECTIONS:
                sock.close()
                logger.warning("refused a connection: %d open already", MAX_CONNECTIONS)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            conn = Connection(sock, f"{addr[0]}:{addr[1]}", self.limits, self.allocate)
            self.conns.add(conn)
            self._by_fd[sock.fileno()] = conn
            self.epoll.register(sock.fileno(), select.EPOLLIN)

    def _handshake(self, conn: Connection) -> None:
        """Drive a TLS handshake on: done, wait for the socket, or refuse the peer."""
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._watch(conn, select.EPOLLIN)
            return
        except ssl.SSLWantWriteError:
            self._watch(conn, select.EPOLLOUT)
            return
        except (ssl.SSLError, OSError) as exc:
            self.on_refused(conn, exc)
            self._close(conn)
            return
        conn.handshaking = False
        self._watch(conn, select.EPOLLIN)
        self._read(conn)  # what came with the handshake's last flight

    def _watch(self, conn: Connection, events: int) -> None:
        if events != conn.events and conn in self.conns:
            conn.events = events
            self.epoll.modify(conn.sock.fileno(), events)

    def _run_calls(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._calls:
            fn, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # handed to the calling thread
                    fut.set_exception(exc)

    def _read(self, conn: Connection) -> None:
        if conn.closing:
            return
        try:
            messages = conn.reader.read(conn.sock)
        except ConnectionClosed:
            self._close(conn)
            return
        except FramingError as exc:
            self.on_framing_error(conn, exc)
            conn.closing = True
            conn.streams.clear()
            self._flush(conn)
            return
        for msg in messages:
            self.handler(conn, msg)
            if conn not in self.conns:
                return

    # ---- replies --------------------------------------------------------------------------

    def send(self, conn: Connection, frames: Frames) -> None:
        """Queue one framed message (header and payloads) and write what the socket takes now."""
        if not conn.out and len(frames) == 1 and conn in self.conns:  # a small reply: straight out
            data = frames[0]
            try:
                sent = conn.sock.send(data)
            except WOULD_BLOCK:
                sent = 0
            except OSError:
                self._close(conn)
                return
            if sent == len(data):
                return
            frames = [memoryview(data)[sent:]]
        conn.out.add(frames)
        self._flush(conn)

    def stream(self, conn: Connection, messages: Iterator[Frames]) -> None:
        """Send a generator's messages as the connection takes them (see the module docstring)."""
        conn.streams.append(messages)
        if len(conn.streams) == 1:
            self._streaming.append(conn)

    def _runnable(self) -> bool:
        return any(c.out.bytes < SEND_WATERMARK for c in self._streaming)

    def _run_streams(self) -> None:
        """Give each streaming connection below its watermark one slice of production."""
        for _ in range(len(self._streaming)):
            conn = self._streaming.popleft()
            if conn not in self.conns or not conn.streams:
                continue
            deadline = time.perf_counter() + SLICE_SECONDS
            while conn.streams and conn.out.bytes < SEND_WATERMARK and time.perf_counter() < deadline:
                frames = next(conn.streams[0], None)
                if frames is None:
                    conn.streams.popleft()
                    continue
                conn.out.add(frames)
            self._flush(conn)
            if conn.streams and conn in self.conns:
                self._streaming.append(conn)

    def _flush(self, conn: Connection) -> None:
        out = conn.out
        try:
            out.write(conn.sock)
        except ConnectionClosed:
            self._close(conn)
            return
        if not out and conn.closing:
            self._close(conn)
            return
        # Reading pauses while the replies already queued are not taken (a client that sends
        # requests and never reads the answers holds a bounded queue, then nothing more).
        self._watch(conn, (select.EPOLLOUT if out else 0) | (
            select.EPOLLIN if out.bytes < SEND_WATERMARK and not conn.closing else 0))

    def _close(self, conn: Connection) -> None:
        if conn not in self.conns:
            return
        self.conns.discard(conn)
        fd = conn.sock.fileno()
        self._by_fd.pop(fd, None)
        try:
            self.epoll.unregister(fd)
        except (OSError, ValueError):
            pass
        conn.sock.close()
        conn.out.clear()
        conn.streams.clear()
