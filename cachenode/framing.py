"""Message framing of the data protocol over a stream socket, for nodes and clients alike.

A message is ``prefix | lengths | header | payload...``:

- ``prefix``: 14 bytes, ``<4sIHI``: the magic ``KVR1``, the header's length, the number of
  payloads, and a reserved word (0);
- ``lengths``: one little-endian u64 per payload;
- the header (msgpack, ``kvring.common.protocol``) and the payloads, back to back.

``pack`` turns a header and payloads into the buffers to hand to ``socket.sendmsg`` (the small
parts joined, the payloads as given: never copied).  ``FrameReader`` is the receiving side, an
incremental parser fed by non-blocking ``recv_into`` calls: small messages are parsed out of one
receive buffer, and each payload is read into a buffer of its own (directly from the
socket once it is larger than what is buffered), so a stored or returned payload never pins a
receive buffer.  ``FrameLimits`` bound what a reader accepts *from the prefix alone*, before
any allocation: the header's size, the payload count, each payload's and all payloads' size.
A violation raises ``FramingError`` with the ``ErrorCode`` to answer with; the stream cannot be
resynchronised after it, so the connection is closed.

A reader's memory follows what arrived, never what a prefix declared: its receive buffer is
taken at the first read (``FIRST_BUFFER``), doubles after each recv that filled it (up to
``RECV_BUFFER``) and can be let go while it holds nothing (``trim``); a large header is gathered
as its bytes arrive; a large payload's own buffer is taken once its first byte is here (a
client's reader, ``eager``, which trusts its nodes, takes it as soon as the socket is readable at
the payload's start, so that every byte of it is read straight into it).  An eager reader with a
``land`` callback asks it, as each large payload begins, for a place of its own (``landing.py``:
views into a KV cache's blocks), and receives the payload there instead of into a buffer.
``held`` is what the reader holds of messages not yet complete, and ``declared`` the size the
message under way announced, for a server that bounds the total (``server.py``).
"""

from __future__ import annotations

import itertools
import os
import socket
import ssl
import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvring.common.errors import ErrorCode, KVRingError

from .landing import Landing, Sink
from .tlsstream import TlsStream

MAGIC = b"KVR1"
PREFIX = struct.Struct("<4sIHI")
RECV_BUFFER = 256 << 10  # the most a receive buffer grows to: many small messages per recv
FIRST_BUFFER = 16 << 10  # a receive buffer's size at a connection's first read
_DIRECT = 64 << 10  # segments this large are not waited for in the receive buffer (see FrameReader)
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
# A non-blocking socket (plain or TLS) that cannot move bytes now.
TLS_READ_BYTES = 1 << 20  # read on one TLS socket in one ``FrameReader.read`` while it has more
# While a large payload is read straight from the socket, the caller's poll wakes only once this
# much more of it is here (``SO_RCVLOWAT``), not at every segment or TLS record that arrives.
LOW_WATER = 256 << 10
_LOW_WATER_STEP = 64 << 10  # the mark is lowered in these steps as the payload's end nears
_TLS_RECORD = 17 << 10  # the most of one record OpenSSL can hold, read but not yet returned
WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
# TLS connections: a node's ``SSLSocket``, a client's ``TlsStream`` (records decrypted from memory).
TLS_SOCKETS = (ssl.SSLSocket, TlsStream)


class FramingError(KVRingError):
    """A peer broke the framing (or a bound): answer ``code`` if possible, then close."""

    def __init__(self, message: str, code: ErrorCode) -> None:
        super().__init__(message)
        self.code = code


class ConnectionClosed(KVRingError):
    """The peer closed the connection (or it broke)."""


@dataclass(frozen=True)
class FrameLimits:
    max_header: int
    max_payloads: int
    max_payload: int  # bytes of one payload
    max_total: int  # bytes of all payloads of one message


@dataclass(slots=True)
class Message:
    """One received message: its header bytes and its payloads, each a buffer of its own."""

    header: bytearray
    payloads: list  # bytearray, or (large ones) a uint8 ndarray: read straight from the socket


def _empty(size: int) -> np.ndarray:
    return np.empty(size, dtype=np.uint8)


def pack(header: bytes, payloads: Sequence = ()) -> list:
    """The buffers of one message, ready for ``sendmsg`` (payloads by reference)."""
    n = len(payloads)
    lengths = struct.pack(f"<{n}Q", *(memoryview(p).nbytes for p in payloads)) if n else b""
    return [PREFIX.pack(MAGIC, len(header), n, 0) + lengths + header, *payloads]


class SendQueue:
    """Buffers waiting to go out on one non-blocking socket: views, never copies.  ``records``:
    the connection's ``TlsStream``, whose encrypted records the socket has not taken yet count
    as this queue's (its owner keeps polling for ``POLLOUT`` until they are out)."""

    __slots__ = ("views", "bytes", "records")

    def __init__(self, records: TlsStream | None = None) -> None:
        self.views: deque[memoryview] = deque()
        self.bytes = 0
        self.records = records

    def __bool__(self) -> bool:
        return bool(self.views) or (self.records is not None and self.records.unsent > 0)

    def add(self, frames: Sequence) -> None:
        for buf in frames:
            view = memoryview(buf).cast("B")
            if view.nbytes:
                self.views.append(view)
                self.bytes += view.nbytes

    def write(self, sock: socket.socket) -> None:
        """Write what the socket takes now (``sendmsg``; over TLS, ``send`` of one buffer at a
        time, which TLS cuts into records anyway); raises ``ConnectionClosed``."""
        views = self.views
        tls = isinstance(sock, TLS_SOCKETS)
        if self.records is not None:
            try:
                self.records.flush()
            except OSError as exc:
                raise ConnectionClosed(f"send failed: {exc}") from None
        while views:
            try:
                sent = sock.send(views[0]) if tls else sock.sendmsg(list(itertools.islice(views, _IOV_MAX)))
            except WOULD_BLOCK:
                return
            except OSError as exc:
                raise ConnectionClosed(f"send failed: {exc}") from None
            self.bytes -= sent
            while sent:
                head = views[0]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    views.popleft()
                else:
                    views[0] = head[sent:]
                    sent = 0

    def clear(self) -> None:
        self.views.clear()
        self.bytes = 0


class FrameReader:
    """Incremental parser of the messages arriving on one socket (see the module docstring).

    A segment (header or payload) under ``_DIRECT`` bytes is waited for in the receive buffer and
    copied out whole.  A larger header is gathered into a bytearray of its own as its bytes
    arrive; a larger payload goes into ``allocate(size)`` once its first byte is here, and the
    rest of it is read straight from the socket into that buffer."""

    def __init__(self, limits: FrameLimits, bufsize: int = RECV_BUFFER,
                 allocate: Callable[[int], np.ndarray] | None = None, eager: bool = False) -> None:
        assert bufsize >= 2 * _DIRECT, "a receive buffer must hold a small segment and the prefix before it"
        self.limits = limits
        # A reader of a trusted peer (a client reading its nodes' replies) takes a large payload's
        # buffer as soon as the bytes before it are parsed and the socket is readable, and reads
        # it straight from the socket from its first byte: none of it passes the receive buffer.
        # Consecutive large payloads of one message (a streamed layer of many keys) share one
        # buffer, filled in one pass and cut into the payloads when full.
        self.eager = eager
        # Where a payload read straight from the socket lands (a node reuses evicted buffers).
        self.allocate = allocate or _empty
        self._max = bufsize
        self._buf: np.ndarray | None = None  # taken at the first read; let go by ``trim``
        self._view: memoryview | None = None
        self._start = 0  # parsed up to here
        self._end = 0  # received up to here
        self._hungry = False  # the last recv filled the buffer: it doubles before the next
        # A message whose body is being read: its segment sizes, the segments complete so far
        # (and their bytes), a large header being gathered, and the large payload being filled
        # straight from the socket (with its fill offset).
        self._sizes: list[int] | None = None
        self._parts: list = []
        self._kept = 0
        self.declared = 0  # the whole size of the message under way, once its prefix is here
        self._gather: bytearray | None = None
        self._target: np.ndarray | None = None
        self._filled = 0
        self._splits: list[int] | None = None  # the payloads a shared target holds, by size
        self.received = 0  # bytes the last ``read`` got (0: nothing was there)
        self._low_water = 1  # the socket's SO_RCVLOWAT as this reader last set it
        # (Eager readers) asked, as each large payload begins, for a place of its own:
        # ``land(header, payload index, size)`` -> a ``Landing`` or None (``landing.py``).
        self.land: Callable[[bytearray, int, int], Landing | None] | None = None
        self._sink: Sink | None = None  # the payload being received into its landing

    @property
    def held(self) -> int:
        """Bytes received of messages not complete yet (buffered, gathered or in their payloads)."""
        gathered = len(self._gather) if self._gather is not None else 0
        landed = self._sink.filled if self._sink is not None else 0
        return self._end - self._start + self._kept + gathered + self._filled + landed

    def trim(self) -> None:
        """Let the receive buffer go if it holds nothing (an idle connection); the next read
        takes a fresh ``FIRST_BUFFER``."""
        if self._start == self._end:
            self._buf = self._view = None
            self._start = self._end = 0
            self._hungry = False

    def read(self, sock: socket.socket) -> list[Message]:
        """One ``recv_into`` (the socket is non-blocking) and every message it completes; over
        TLS, which gives at most one record (16 KiB) a call, more: while the TLS layer holds
        decrypted bytes (a poll would not see those), and on up to ``TLS_READ_BYTES`` while the
        socket has more, so that a large message costs the caller's loop one turn per
        ``TLS_READ_BYTES``, not one per record.

        Raises ``ConnectionClosed`` on EOF or a broken connection (a read that completed messages
        first returns them, and the next one raises), ``FramingError`` on input beyond the
        limits; returns ``[]`` if nothing could be read yet."""
        messages = self._read_once(sock)
        if isinstance(sock, TLS_SOCKETS):
            got = self.received
            try:
                while self.received and (sock.pending() or got < TLS_READ_BYTES):
                    if self._target is not None:
                        messages += self._fill_target_tls(sock, TLS_READ_BYTES - got)
                    elif self._sink is not None:
                        messages += self._fill_sink_tls(sock, TLS_READ_BYTES - got)
                    else:
                        messages += self._read_once(sock)
                    got += self.received
            except ConnectionClosed:
                if not messages:
                    raise
                # The peer's last messages, then its end: these first, the end at the next read
                # (a closed stream reads as closed again).
            self.received = got
        self._set_low_water(sock)
        return messages

    def _fill_target_tls(self, sock: ssl.SSLSocket | TlsStream, budget: int) -> list[Message]:
        """Read TLS records straight into the payload being filled, up to ``budget`` bytes (and
        then what OpenSSL holds decrypted) or until the socket has none: one tight loop, since
        each call returns one record (16 KiB) at most.  ``SSLSocket.read`` is the documented
        call under ``recv_into``."""
        target = self._target
        view = memoryview(target)
        size, filled, got = len(target), self._filled, 0
        read = sock.read
        try:
            while filled < size and (got < budget or sock.pending()):  # decrypted bytes: no poll sees them
                n = read(size - filled, view[filled:])
                if not n:
                    raise ConnectionClosed("connection closed by the peer")
                filled += n
                got += n
        except WOULD_BLOCK:
            pass
        except OSError as exc:
            raise ConnectionClosed(f"connection broken: {exc}") from None
        finally:
            self._filled = filled
            self.received = got
        if filled < size:
            return []
        self._take_target()
        return self._parse()

    def _fill_sink_tls(self, sock: ssl.SSLSocket | TlsStream, budget: int) -> list[Message]:
        """``_fill_target_tls`` for a payload received into its landing."""
        sink = self._sink
        read = sock.read
        got = 0
        try:
            got, closed = sink.fill(lambda view: read(view.nbytes, view), budget, sock.pending, WOULD_BLOCK)
            if closed:
                raise ConnectionClosed("connection closed by the peer")
        except WOULD_BLOCK:
            pass
        except OSError as exc:
            raise ConnectionClosed(f"connection broken: {exc}") from None
        finally:
            self.received = got
        if not sink.done:
            return []
        self._take_sink()
        return self._parse()

    def _take_sink(self) -> None:
        """The payload being received into its landing is complete: a ``Landed`` part."""
        sink, self._sink = self._sink, None
        self._parts.append(sink.landed())
        self._kept += sink.size

    def _landing(self) -> Sink | None:
        """The next payload's landing, if the ``land`` callback gives it one."""
        if self.land is None:
            return None
        index = len(self._parts)
        landing = self.land(self._parts[0], index - 1, self._sizes[index])
        return Sink(landing, self._sizes[index]) if landing is not None else None

    def _take_target(self) -> None:
        """The payload being filled is complete: it becomes the message's next part (a shared
        target: the next parts, one slice each)."""
        target = self._target
        if self._splits is None:
            self._parts.append(target)
        else:
            at = 0
            for size in self._splits:
                self._parts.append(target[at:at + size])
                at += size
            self._splits = None
        self._kept += len(target)
        self._target, self._filled = None, 0

    def _set_low_water(self, sock: socket.socket) -> None:
        """While a large payload is read straight from the socket, have the caller's poll wake
        only once ``LOW_WATER`` more bytes of it are here: a reader that keeps up with its sender
        would otherwise wake, read one segment (or TLS record) and go back to sleep, and those
        turns of the caller's loop cost more than the bytes.  The mark never exceeds what the
        payload still lacks (less one TLS record, which OpenSSL may already hold), so the bytes
        the sender owes always reach it; near the payload's end, and between payloads, it is 1."""
        want = 1
        left = (len(self._target) - self._filled if self._target is not None else
                self._sink.size - self._sink.filled if self._sink is not None else None)
        if left is not None:
            if isinstance(sock, TLS_SOCKETS):
                left -= _TLS_RECORD
            if left >= _LOW_WATER_STEP:
                want = min(LOW_WATER, left - left % _LOW_WATER_STEP)
        if want != self._low_water:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            except OSError:  # a socket that takes no mark (closed under us): wake at every byte
                pass
            self._low_water = want

    def _read_once(self, sock: socket.socket) -> list[Message]:
        target = self._target
        if (target is None and self._sink is None and self.eager and self._start == self._end
                and self._next_is_payload()):
            self._sink = self._landing()
            if self._sink is None:
                run = self._payload_run()
                target = self._target = self.allocate(sum(run))
                self._splits = run if len(run) > 1 else None
                self._filled = 0
        sink = self._sink
        try:
            if sink is not None:
                n = sink.receive(sock.recv_into)
            elif target is not None:
                n = sock.recv_into(memoryview(target)[self._filled:])
            else:
                room = self._room()
                n = sock.recv_into(room)
        except WOULD_BLOCK:
            self.received = 0
            return []
        except OSError as exc:
            raise ConnectionClosed(f"connection broken: {exc}") from None
        self.received = n
        if n == 0:
            raise ConnectionClosed("connection closed by the peer")
        if sink is not None:
            if not sink.done:
                return []
            self._take_sink()
        elif target is not None:
            self._filled += n
            if self._filled < len(target):
                return []
            self._take_target()
        else:
            self._hungry = n == room.nbytes
            self._end += n
        return self._parse()

    def _next_is_payload(self) -> bool:
        """Whether the next segment of the message under way is a payload read straight from the
        socket (a large one, not the header)."""
        sizes = self._sizes
        return sizes is not None and 0 < len(self._parts) < len(sizes) and sizes[len(self._parts)] >= _DIRECT

    def _payload_run(self) -> list[int]:
        """The sizes of the large payloads from the next segment on, up to the message's end, its
        next small segment or ``max_payload`` bytes in all (what one payload may make this reader
        allocate before its bytes arrive): what an eager reader reads into one buffer."""
        sizes = self._sizes
        if self.land is not None:  # each payload may have a landing of its own: asked one at a time
            return [sizes[len(self._parts)]]
        run, total = [], 0
        for size in sizes[len(self._parts):]:
            if size < _DIRECT or (run and total + size > self.limits.max_payload):
                break
            run.append(size)
            total += size
        return run

    def _room(self) -> memoryview:
        """The free end of the receive buffer: taken at the first read, doubled after a recv
        that filled it, compacted when full at its largest."""
        buf = self._buf
        if buf is None:
            self._resize(min(FIRST_BUFFER, self._max))
        elif self._hungry and len(buf) < self._max:
            self._resize(min(2 * len(buf), self._max))
        elif self._end == len(buf):
            self._resize(len(buf))
        # Never full of one incomplete segment: a waited-for segment is under _DIRECT bytes, and
        # the payload lengths before it under ``self._max - _DIRECT`` (see ``_parse_prefix``).
        assert self._end < len(self._buf)
        return self._view[self._end:]

    def _resize(self, size: int) -> None:
        """Move the unparsed bytes to the start of a buffer of ``size`` bytes (this one if it is
        that size already)."""
        pending = self._end - self._start
        if self._buf is not None and size == len(self._buf):
            self._buf[:pending] = self._buf[self._start:self._end]
        else:
            buf = _empty(size)
            if pending:
                buf[:pending] = self._buf[self._start:self._end]
            self._buf, self._view = buf, memoryview(buf)
        self._start, self._end = 0, pending

    def _parse(self) -> list[Message]:
        out: list[Message] = []
        while (self._sizes is not None or self._parse_prefix()) and self._fill():
            header, *payloads = self._parts
            out.append(Message(header, payloads))
            self._sizes, self._parts, self._kept, self.declared = None, [], 0, 0
        if self._start == self._end:
            self._start = self._end = 0
        return out

    def _fill(self) -> bool:
        """Take the body's segments out of the receive buffer, in order; whether all are here."""
        sizes, parts, view = self._sizes, self._parts, self._view
        while len(parts) < len(sizes):
            index = len(parts)
            size = sizes[index]
            have = self._end - self._start
            if size < _DIRECT:  # small: waited for here, then copied out whole
                if have < size:
                    return False
                part = bytearray(view[self._start:self._start + size]) if size else bytearray()
                self._start += size
            elif index == 0:  # a large header: gathered as it arrives, never allocated up front
                if self._gather is None:
                    self._gather = bytearray()
                n = min(have, size - len(self._gather))
                if n:
                    self._gather += view[self._start:self._start + n]
                    self._start += n
                if len(self._gather) < size:
                    return False
                part, self._gather = self._gather, None
            else:  # a large payload: a buffer of its own once its first byte is here
                if not have:
                    return False
                sink = self._landing()
                if sink is not None:  # or its landing
                    self._sink = sink
                    n = min(have, size)
                    sink.write(view[self._start:self._start + n])
                    self._start += n
                    if not sink.done:  # the rest straight from the socket
                        return False
                    self._take_sink()
                    continue
                part = self.allocate(size)  # not zero-filled: every byte is read into it
                n = min(have, size)
                part[:n] = view[self._start:self._start + n]
                self._start += n
                if n < size:  # the rest straight from the socket (the receive buffer is empty now)
                    self._target, self._filled = part, n
                    return False
            parts.append(part)
            self._kept += size
        return True

    def _parse_prefix(self) -> bool:
        have = self._end - self._start
        if have < PREFIX.size:
            return False
        magic, header_len, count, _ = PREFIX.unpack_from(self._buf, self._start)
        limits = self.limits
        if magic != MAGIC:
            raise FramingError("not a kvring data-protocol message (bad magic)", ErrorCode.BAD_HEADER)
        if header_len > limits.max_header:
            raise FramingError(f"header of {header_len} bytes exceeds {limits.max_header}", ErrorCode.BAD_HEADER)
        if count > limits.max_payloads:
            raise FramingError(f"{count} payload frames; at most {limits.max_payloads} allowed here",
                               ErrorCode.FRAME_COUNT)
        if PREFIX.size + 8 * count > self._max - _DIRECT:
            raise FramingError(f"{count} payload frames do not fit a receive buffer", ErrorCode.FRAME_COUNT)
        if have < PREFIX.size + 8 * count:
            return False
        lengths = struct.unpack_from(f"<{count}Q", self._buf, self._start + PREFIX.size) if count else ()
        for n in lengths:
            if n > limits.max_payload:
                raise FramingError(f"payload of {n} bytes exceeds the maximum of {limits.max_payload}",
                                   ErrorCode.TOO_LARGE)
        if sum(lengths) > limits.max_total:
            raise FramingError(f"payloads of {sum(lengths)} bytes exceed the maximum of {limits.max_total}",
                               ErrorCode.TOO_LARGE)
        self._start += PREFIX.size + 8 * count
        self._sizes = [header_len, *lengths]
        self._parts = []
        self._kept = PREFIX.size + 8 * count  # so a message under way always holds something
        self.declared = self._kept + header_len + sum(lengths)
        return True
