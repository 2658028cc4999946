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

MAGIC = b"KVR1"
PREFIX = struct.Struct("<4sIHI")
RECV_BUFFER = 256 << 10  # a reader's receive buffer: many small messages per recv
_DIRECT = 64 << 10  # segments this large are read straight into a buffer of their own
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
# A non-blocking socket (plain or TLS) that cannot move bytes now.
WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


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
    """Buffers waiting to go out on one non-blocking socket: views, never copies."""

    __slots__ = ("views", "bytes")

    def __init__(self) -> None:
        self.views: deque[memoryview] = deque()
        self.bytes = 0

    def __bool__(self) -> bool:
        return bool(self.views)

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
        tls = isinstance(sock, ssl.SSLSocket)
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
    """Incremental parser of the messages arriving on one socket (see the module docstring)."""

    def __init__(self, limits: FrameLimits, bufsize: int = RECV_BUFFER,
                 allocate: Callable[[int], np.ndarray] | None = None) -> None:
        self.limits = limits
        # Where a payload read straight from the socket lands (a node reuses evicted buffers).
        self.allocate = allocate or _empty
        self._buf = bytearray(bufsize)
        self._view = memoryview(self._buf)
        self._start = 0  # parsed up to here
        self._end = 0  # received up to here
        # A message whose body is being read: its segment sizes, the buffers filled so far, and
        # the one being filled straight from the socket (with its fill offset).
        self._sizes: list[int] | None = None
        self._parts: list = []
        self._target: np.ndarray | None = None
        self._filled = 0
        self.received = 0  # bytes the last ``read`` got (0: nothing was there)

    def read(self, sock: socket.socket) -> list[Message]:
        """One ``recv_into`` (the socket is non-blocking) and every message it completes; over
        TLS, more while the TLS layer holds decrypted bytes (a poll would not see those).

        Raises ``ConnectionClosed`` on EOF or a broken connection, ``FramingError`` on input
        beyond the limits; returns ``[]`` if nothing could be read yet."""
        messages = self._read_once(sock)
        if isinstance(sock, ssl.SSLSocket):
            got = self.received
            while self.received and sock.pending():
                messages += self._read_once(sock)
                got += self.received
            self.received = got
        return messages

    def _read_once(self, sock: socket.socket) -> list[Message]:
        try:
            if self._target is not None:
                n = sock.recv_into(memoryview(self._target)[self._filled:])
            else:
                if self._end == len(self._buf):
                    self._compact()
                n = sock.recv_into(self._view[self._end:])
        except WOULD_BLOCK:
            self.received = 0
            return []
        except OSError as exc:
            raise ConnectionClosed(f"connection broken: {exc}") from None
        self.received = n
        if n == 0:
            raise ConnectionClosed("connection closed by the peer")
        if self._target is not None:
            self._filled += n
            if self._filled < len(self._target):
                return []
            self._parts.append(self._target)
            self._target = None
        else:
            self._end += n
        return self._parse()

    def _compact(self) -> None:
        pending = self._end - self._start
        self._buf[:pending] = self._buf[self._start:self._end]
        self._start, self._end = 0, pending

    def _parse(self) -> list[Message]:
        out: list[Message] = []
        while True:
            if self._sizes is None and not self._parse_prefix():
                return out
            # Fill the body's segments in order: from the buffer, then (for a large one) the socket.
            while len(self._parts) < len(self._sizes):
                index = len(self._parts)
                size = self._sizes[index]
                have = self._end - self._start
                if size >= _DIRECT:  # large: a buffer of its own, filled straight from the socket
                    # (not zero-filled: every byte is read into it)
                    target = self.allocate(size) if index else bytearray(size)
                    n = min(have, size)
                    target[:n] = self._view[self._start:self._start + n]
                    self._start += n
                    if n == size:
                        self._parts.append(target)
                        continue
                    self._start = self._end = 0
                    self._target, self._filled = target, n
                    return out
                if have >= size:  # small and all here: copied out of the receive buffer
                    self._parts.append(bytearray(self._view[self._start:self._start + size]))
                    self._start += size
                    continue
                if self._start + size > len(self._buf):
                    self._compact()
                return out
            header, *payloads = self._parts
            out.append(Message(header, payloads))
            self._sizes, self._parts = None, []
            if self._start == self._end:
                self._start = self._end = 0

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
        if have < PREFIX.size + 8 * count:
            if PREFIX.size + 8 * count > len(self._buf):
                raise FramingError(f"{count} payload frames do not fit a receive buffer", ErrorCode.FRAME_COUNT)
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
        return True
