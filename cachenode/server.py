"""The node's data-protocol server: one thread, one ``epoll`` loop, many connections.

Threading contract: ``serve_forever`` (an ``epoll`` loop) runs on the node's I/O thread, and everything here (the
connections, the handler it calls, the store behind it) is owned by that thread.  Other
threads reach it only through ``call`` (run a function on the loop and wait for its result),
``post`` (run one soon, without waiting), ``stop`` and ``keep_peer``; the first three wake the
loop through a socket pair.  ``later`` runs a function on the loop after a delay (its timers
bound the loop's wait).

Per connection, the loop reads with a ``FrameReader`` (bounded by ``FrameLimits`` before any
allocation) and hands each complete message to the handler, which answers with ``send``
(frames queued and written as the socket takes them) or ``stream`` (a generator of messages,
produced only while the connection's send queue is below ``SEND_WATERMARK``).  So a reply of
gigabytes costs the node a bounded queue of zero-copy views, a client that stops reading stalls
only itself, and each turn of the loop gives every streaming connection a slice before it
looks at the sockets again: no request holds the loop for long, however large its reply.

What peers send costs the node what arrived, bounded in total:

- Partly received messages share ``receive_budget`` bytes.  A connection may hold up to
  ``FIRST_BUFFER`` bytes of an incomplete message as it likes (a small request split across
  reads is never held up); to hold more it must be admitted, which reserves the size its
  message declared (``FrameReader.declared``).  While the reservations leave no room for it,
  it is ``paused``: not read, its bytes wait in the kernel and its peer's sends block.  Paused
  connections are admitted in the order they came, as reservations are released (a message
  completes, a connection closes); when none is admitted the first one always is, so one
  message larger than the budget gets through too.  An admitted connection is never paused, so
  it either finishes its message or falls silent and is closed: what holds the budget always
  moves.  In all, a node holds at most the budget plus, per connection, one receive buffer.
- A connection silent for ``receive_timeout`` seconds (nothing received, none of its replies
  taken) in the middle of a message or of its TLS handshake is closed; time spent paused does
  not count.  Idle receive buffers are let go (``FrameReader.trim``).
- Descriptors: the node accepts at most ``connection_limit`` connections, its descriptor limit
  (``RLIMIT_NOFILE``, read again every sweep) less ``FD_RESERVE`` for the rest of the process
  (etcd, the admin HTTP port, the self-check, hand-off, KV events), so those never starve.  At
  that limit, or when an accept fails anyway for lack of descriptors (EMFILE, ENFILE), it sheds
  idle connections (no partial message, nothing to send, no stream), least recently active
  first, then half-open ones silent for ``SHED_SILENT`` seconds; with nothing to shed it stops
  accepting for a while (the listener leaves the epoll set for 10 ms, doubling up to 1 s, so a
  readable listener cannot spin the loop).  The node's own self-check connection
  (``keep_peer``) is never shed, so it keeps answering it and stays on the ring.  What happened
  is logged as one summary line per ``LOG_EVERY`` seconds at most, and counted (``stats``).
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import resource
import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from kvring.common.tls import ContextSource

from .framing import (FIRST_BUFFER, WOULD_BLOCK, ConnectionClosed, FrameLimits, FrameReader, FramingError, Message,
                      SendQueue)

logger = logging.getLogger(__name__)

SEND_WATERMARK = 4 << 20  # bytes queued on a connection before its streams pause
SLICE_SECONDS = 0.005  # a streaming connection's share of one loop turn
MAX_CONNECTIONS = 4096
FD_RESERVE = 128  # descriptors left to the rest of the process (at most half the limit)
ACCEPT_PAUSE = (0.01, 1.0)  # the first and the longest pause of accepting, doubling in between
SHED_SILENT = 1.0  # seconds a half-open connection must have been silent to be shed
LOG_EVERY = 10.0  # seconds between summaries of refused or shed connections
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

Frames = list  # the buffers of one framed message (see ``framing.pack``)


class Connection:
    """One client connection: its reader, its send queue and its streamed replies."""

    __slots__ = ("sock", "peer", "reader", "out", "streams", "closing", "events", "handshaking", "held", "reserved",
                 "paused", "active")

    def __init__(self, sock: socket.socket, peer: str, limits: FrameLimits, allocate, now: float) -> None:
        self.sock = sock
        self.handshaking = isinstance(sock, ssl.SSLSocket)  # a TLS handshake is still under way
        self.peer = peer
        self.reader = FrameReader(limits, allocate=allocate)
        self.out = SendQueue()
        self.streams: deque[Iterator[Frames]] = deque()
        self.closing = False  # close once ``out`` is written (after a framing error)
        self.events = select.EPOLLIN  # what the loop watches for
        self.held = 0  # bytes of an incomplete message, as last counted in the server's total
        self.reserved = 0  # of the receive budget, while admitted to hold more than FIRST_BUFFER
        self.paused = False  # not read until the receive budget admits it
        self.active = now  # monotonic time of its last bytes received or sent (or of its admission)

    @property
    def idle(self) -> bool:
        """Nothing under way: no partial message, nothing to send, no stream, no handshake."""
        return not (self.held or self.out or self.streams or self.handshaking or self.closing)


class Server:
    def __init__(self, host: str, port: int, handler: Callable[[Connection, Message], None],
                 limits: FrameLimits, allocate: Callable[[int], object] | None = None,
                 tls: ContextSource | None = None, receive_budget: int = 32 << 20,
                 receive_timeout: float = 10.0) -> None:
        self.handler = handler
        # The cluster's credentials as they are now: every connection must complete a TLS handshake.
        self.tls = tls
        self.limits = limits
        self.allocate = allocate  # where large payloads are read into (see ``FrameReader``)
        self.receive_budget = receive_budget
        self.receive_timeout = receive_timeout
        self.listener = socket.create_server((host, port), backlog=512, reuse_port=False)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.epoll = select.epoll()
        self.epoll.register(self.listener.fileno(), select.EPOLLIN)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.epoll.register(self._wake_r.fileno(), select.EPOLLIN)
        self._calls: deque[tuple[Callable, Future | None]] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []  # (when, order, fn): ``later``
        self._timer_seq = itertools.count()
        self._loop_thread: int | None = None
        self._stopping = False
        self.conns: set[Connection] = set()
        self._by_fd: dict[int, Connection] = {}
        self._streaming: deque[Connection] = deque()
        # Called with the connection and the error before the connection is closed (the node
        # answers with the error's code there).
        self.on_framing_error: Callable[[Connection, FramingError], None] = lambda conn, exc: None
        self.on_refused: Callable[[Connection, Exception], None] = lambda conn, exc: None  # a failed TLS handshake
        # The receive budget: bytes held by incomplete messages, bytes reserved by admitted
        # connections, and the connections waiting to be admitted (oldest first).
        self.held = 0
        self.reserved = 0
        self._paused: dict[Connection, None] = {}
        self.own_peers: frozenset[str] = frozenset()  # never shed (``keep_peer``)
        self.descriptor_limit = 0
        self.connection_limit = 0
        self._read_descriptor_limit()
        self._accept_at: float | None = None  # while accepting is paused: when it resumes
        self._accept_pause = ACCEPT_PAUSE[0]
        self._sweep_every = min(1.0, receive_timeout / 4)
        self._next_sweep = time.monotonic() + self._sweep_every
        # Totals (``/stats``, metrics) and what the last summary line reported of them.
        self.accept_failures = 0  # accepts that failed (for lack of descriptors, mostly)
        self.accept_pauses = 0  # times accepting was paused
        self.shed = 0  # connections closed to make room
        self.timed_out = 0  # connections closed for silence in the middle of a message
        self.tls_closed = 0  # connections closed because a CA that admitted them was dropped
        self._last_error = ""
        self._reported = (0, 0, 0, 0)
        self._reported_at = time.monotonic()

    @property
    def paused(self) -> int:
        """Connections not read now, waiting to be admitted to the receive budget."""
        return len(self._paused)

    # ---- other threads ---------------------------------------------------------------------

    def call(self, fn: Callable, timeout: float = 5.0):
        """Run ``fn()`` on the loop thread and return its result (from any other thread)."""
        fut: Future = Future()
        self._calls.append((fn, fut))
        self._wake()
        return fut.result(timeout)

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the loop thread soon, without waiting for it (from any thread)."""
        self._calls.append((fn, None))
        self._wake()

    def on_loop(self) -> bool:
        """Whether the calling thread is the loop's."""
        return threading.get_ident() == self._loop_thread

    def later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the loop thread once ``delay`` seconds have passed (loop thread only)."""
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._timer_seq), fn))

    def stop(self) -> None:
        self._stopping = True
        self._wake()

    def close_tls_before(self) -> int:
        """Close every connection whose TLS handshake ran under credentials since replaced (loop
        thread only): once a CA is no longer trusted, the peers it admitted go too, and come back
        under what is trusted now.  Returns how many were closed."""
        assert self.tls is not None
        current = self.tls()
        replaced = [c for c in self.conns if isinstance(c.sock, ssl.SSLSocket) and c.sock.context is not current]
        for conn in replaced:
            self._close(conn)
        self.tls_closed += len(replaced)
        return len(replaced)

    def keep_peer(self, peer: str) -> None:
        """Never shed the connection from ``peer`` ("host:port"): the node's own self-check,
        which must keep answering when descriptors run out (any thread)."""
        self.own_peers = frozenset({peer})

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake (the pipe is full) or shutting down

    # ---- the loop -------------------------------------------------------------------------

    def serve_forever(self) -> None:
        listener, wake, by_fd = self.listener.fileno(), self._wake_r.fileno(), self._by_fd
        self._loop_thread = threading.get_ident()
        try:
            while not self._stopping:
                if self._streaming and self._runnable():
                    timeout = 0.0
                else:  # until the next sweep, or until accepting resumes
                    now = time.monotonic()
                    timeout = min(now + 0.5, self._next_sweep, self._accept_at or self._next_sweep,
                                  self._timers[0][0] if self._timers else now + 0.5) - now
                for fd, mask in self.epoll.poll(max(timeout, 0.0)):
                    conn = by_fd.get(fd)
                    if conn is not None:
                        if conn.handshaking:
                            self._handshake(conn)
                            continue
                        if mask & select.EPOLLOUT:
                            self._flush(conn)
                        if mask & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and conn in self.conns:
                            if not conn.paused:
                                self._read(conn)
                            elif mask & (select.EPOLLHUP | select.EPOLLERR):  # gone while paused
                                self._close(conn)
                    elif fd == listener:
                        self._accept()
                    elif fd == wake:
                        self._run_calls()
                if self._streaming:
                    self._run_streams()
                if self._paused:
                    self._resume()
                now = time.monotonic()
                if self._timers and self._timers[0][0] <= now:
                    self._run_timers(now)
                if self._accept_at is not None and now >= self._accept_at:
                    self._accept_at = None
                    self.epoll.modify(listener, select.EPOLLIN)
                if now >= self._next_sweep:
                    self._sweep(now)
        finally:
            for conn in list(self.conns):
                self._close(conn)
            self.epoll.close()
            self.listener.close()
            self._wake_r.close()
            self._wake_w.close()

    # ---- accepting ------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):
            if len(self.conns) >= self.connection_limit and not self._shed():
                self._pause_accepting()
                return
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # the peer gave up while queued
                continue
            except OSError as exc:  # out of descriptors (or kernel memory): no spinning on it
                self.accept_failures += 1
                self._last_error = str(exc)
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    self._read_descriptor_limit()
                    self._shed()
                self._pause_accepting()
                return
            self._accept_pause = ACCEPT_PAUSE[0]
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            conn = Connection(sock, f"{addr[0]}:{addr[1]}", self.limits, self.allocate, time.monotonic())
            self.conns.add(conn)
            self._by_fd[sock.fileno()] = conn
            self.epoll.register(sock.fileno(), select.EPOLLIN)

    def _pause_accepting(self) -> None:
        """Take the listener out of the epoll set for a while (doubling while it keeps failing)."""
        self.accept_pauses += 1
        self._accept_at = time.monotonic() + self._accept_pause
        self._accept_pause = min(2 * self._accept_pause, ACCEPT_PAUSE[1])
        self.epoll.modify(self.listener.fileno(), 0)

    def _shed(self) -> int:
        """Close a batch of idle connections, least recently active first (then half-open ones
        silent for ``SHED_SILENT``), to make room for new ones; returns how many."""
        count = max(1, len(self.conns) // 32)
        own = self.own_peers
        victims = heapq.nsmallest(count, (c for c in self.conns if c.idle and c.peer not in own),
                                  key=lambda c: c.active)
        if len(victims) < count:
            silent = time.monotonic() - SHED_SILENT
            victims += heapq.nsmallest(
                count - len(victims),
                (c for c in self.conns if (c.held or c.handshaking) and not c.paused and c.active < silent
                 and c.peer not in own), key=lambda c: c.active)
        for conn in victims:
            self._close(conn)
        self.shed += len(victims)
        return len(victims)

    def _read_descriptor_limit(self) -> None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = 1 << 20 if soft == resource.RLIM_INFINITY else soft
        self.descriptor_limit = limit
        self.connection_limit = max(1, min(MAX_CONNECTIONS, limit - min(FD_RESERVE, limit // 2)))

    # ---- connections ----------------------------------------------------------------------

    def _handshake(self, conn: Connection) -> None:
        """Drive a TLS handshake on: done, wait for the socket, or refuse the peer."""
        conn.active = time.monotonic()
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

    def _rearm(self, conn: Connection) -> None:
        """Watch for writing while replies are queued, and for reading unless the queue is full
        (a client that sends requests and never reads the answers holds a bounded queue, then
        nothing more), the connection is closing, or it waits for the receive budget."""
        out = conn.out
        self._watch(conn, (select.EPOLLOUT if out else 0) | (
            select.EPOLLIN if out.bytes < SEND_WATERMARK and not conn.closing and not conn.paused else 0))

    def _run_calls(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._calls:
            fn, fut = self._calls.popleft()
            if fut is None:  # posted: nobody waits for it
                try:
                    fn()
                except Exception:
                    logger.exception("a function posted to the data loop failed")
            elif fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # handed to the calling thread
                    fut.set_exception(exc)

    def _run_timers(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            try:
                heapq.heappop(self._timers)[2]()
            except Exception:
                logger.exception("a timer of the data loop failed")

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
        if conn.reader.received:
            conn.active = time.monotonic()
        self._count_held(conn, bool(messages))
        for msg in messages:
            self.handler(conn, msg)
            if conn not in self.conns:
                return

    # ---- the receive budget ---------------------------------------------------------------

    def _count_held(self, conn: Connection, completed: bool) -> None:
        """Count what ``conn`` holds now; release its reservation once its message completed,
        and admit or pause it once it holds more than ``FIRST_BUFFER``."""
        held = conn.reader.held
        self.held += held - conn.held
        conn.held = held
        if completed and conn.reserved:
            self.reserved -= conn.reserved
            conn.reserved = 0
        if held > FIRST_BUFFER and not conn.reserved:
            if self._paused or not self._admit(conn):  # none overtakes a connection already waiting
                conn.paused = True
                self._paused[conn] = None
                conn.reader.trim()
                self._rearm(conn)

    def _admit(self, conn: Connection) -> bool:
        want = max(conn.held, conn.reader.declared)
        if self.reserved and self.reserved + want > self.receive_budget:
            return False
        conn.reserved = want
        self.reserved += want
        return True

    def _resume(self) -> None:
        """Admit paused connections, oldest first, while the budget has room for them (the first
        one always when none is admitted), and read what waits for them."""
        while self._paused:
            conn = next(iter(self._paused))
            if not self._admit(conn):
                return
            del self._paused[conn]
            conn.paused = False
            conn.active = time.monotonic()  # its silence counts from now
            self._rearm(conn)
            self._read(conn)  # (TLS may hold decrypted bytes that no poll would report)

    def _sweep(self, now: float) -> None:
        """Close connections silent too long mid-message, let idle receive buffers go, read the
        descriptor limit again and log a summary if one is due."""
        self._next_sweep = now + self._sweep_every
        self._read_descriptor_limit()
        quiet, deadline = now - self._sweep_every, now - self.receive_timeout
        for conn in list(self.conns):
            if conn.paused:
                conn.active = max(conn.active, quiet)  # not read by the node's choice: not silence
            elif conn.active < deadline and (conn.held or conn.handshaking):
                self.timed_out += 1
                self._close(conn)
            elif conn.active < quiet:
                conn.reader.trim()
        self._report(now)

    def _report(self, now: float) -> None:
        if now - self._reported_at < LOG_EVERY:
            return
        totals = (self.accept_failures, self.accept_pauses, self.shed, self.timed_out)
        failed, pauses, shed, timed_out = (a - b for a, b in zip(totals, self._reported))
        if failed or pauses or shed or timed_out:
            logger.warning(
                "data port, last %.0f s: %d accepts failed%s, accepting paused %d times, %d idle connections "
                "shed, %d closed silent mid-request; %d connections open (at most %d of %d descriptors)",
                now - self._reported_at, failed, f" ({self._last_error})" if failed else "", pauses, shed, timed_out,
                len(self.conns), self.connection_limit, self.descriptor_limit)
        self._reported, self._reported_at = totals, now

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
        queued = out.bytes
        try:
            out.write(conn.sock)
        except ConnectionClosed:
            self._close(conn)
            return
        if out.bytes < queued:
            conn.active = time.monotonic()
        if not out and conn.closing:
            self._close(conn)
            return
        self._rearm(conn)

    def _close(self, conn: Connection) -> None:
        if conn not in self.conns:
            return
        self.conns.discard(conn)
        self.held -= conn.held
        self.reserved -= conn.reserved
        conn.held = conn.reserved = 0
        self._paused.pop(conn, None)
        fd = conn.sock.fileno()
        self._by_fd.pop(fd, None)
        try:
            self.epoll.unregister(fd)
        except (OSError, ValueError):
            pass
        conn.sock.close()
        conn.out.clear()
        conn.streams.clear()
