"""Payloads read straight into their final place (a KV cache's blocks) instead of a buffer.

A client's ``FrameReader`` asks its ``land`` callback, as each large payload begins, whether the
payload has a place of its own: a ``Landing``, the payload's bytes in order as ``segments``,
each a writable byte view to fill (a run of cache slots) or a count of bytes to read and drop
(rows the caller does not want).  The reader then receives the payload into those views, with
no buffer and no copy between the socket and the cache.

The place belongs to someone else, who may take it back at any moment (a load abandoned past
its deadline, whose blocks vLLM then gives to another request).  So each receive into a view
runs under the landing's ``guard`` and only while ``wanted()`` (checked once per view and turn,
and a turn reads only what has arrived); once it says no, the rest of the payload is read and
dropped.  The reader never waits for bytes while holding the guard: its
socket is non-blocking, so a receive under the guard takes what has arrived and returns.

``hasher`` (optional) sees every byte of the payload in order, dropped ones included, so that
its digest is the payload's checksum: the bytes in the views are checked, not a copy of them.
The finished payload is a ``Landed``: its size, whether every byte reached its view, and the
digest.  A payload that fails its checksum has already been written: the caller must treat its
place as not loaded (the connector reports those blocks failed, and vLLM recomputes them).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

_DROP_BYTES = 64 << 10  # scratch that dropped bytes are read into


@dataclass(slots=True)
class Landing:
    """Where one payload goes (see the module docstring)."""

    segments: list[memoryview | int]  # in the payload's order: a view to fill, or bytes to drop
    guard: AbstractContextManager  # held around each receive into a view (a lock)
    wanted: Callable[[], bool]  # checked under the guard before each receive into a view
    hasher: object | None = None  # ``update(view)`` with every byte, in order (an ``xxh3_64``)

    @property
    def nbytes(self) -> int:
        return sum(s if isinstance(s, int) else s.nbytes for s in self.segments)


@dataclass(slots=True)
class Landed:
    """A payload read into its ``Landing``: ``complete`` unless ``wanted`` said no partway (then
    some of its bytes were dropped, not written); ``digest``: the hasher's, if it had one."""

    nbytes: int
    complete: bool
    digest: int | None


class Sink:
    """One payload being received into its ``Landing``."""

    __slots__ = ("landing", "size", "filled", "complete", "_segment", "_offset", "_drop")

    def __init__(self, landing: Landing, size: int) -> None:
        if landing.nbytes != size:
            raise ValueError(f"a landing of {landing.nbytes} bytes for a payload of {size}")
        if any(isinstance(s, memoryview) and (s.readonly or s.itemsize != 1 or not s.c_contiguous)
               for s in landing.segments):
            raise ValueError("a landing's views must be writable, contiguous bytes")
        self.landing = landing
        self.size = size
        self.filled = 0
        self.complete = True
        self._segment = 0
        self._offset = 0
        self._drop: memoryview | None = None
        self._skip_empty()

    @property
    def done(self) -> bool:
        return self.filled == self.size

    def landed(self) -> Landed:
        hasher = self.landing.hasher
        return Landed(self.size, self.complete, hasher.intdigest() if hasher is not None else None)

    def receive(self, read: Callable[[memoryview], int]) -> int:
        """Receive once (``read(view)``: ``recv_into``; it may raise that nothing is there) into
        where the next bytes go; the bytes received (0: the peer closed).  ``fill`` with a
        budget of one read, so the guard's rule lives in one place."""
        return self.fill(read, 1, _nothing_pending, ())[0]

    def fill(self, read: Callable[[memoryview], int], budget: int, pending: Callable[[], int],
             blocked: tuple[type[BaseException], ...]) -> tuple[int, bool]:
        """Receive for as long as bytes are there (``read`` raises one of ``blocked`` when none
        is), up to ``budget`` bytes and then what ``pending()`` says is decrypted already: a
        TLS reader's turn, taking one record a read.  The guard is taken once per place, not
        once per read, and a place's bytes are hashed once per turn: what the reader pays per
        record is one read.  Returns the bytes received and whether the peer closed."""
        got = 0
        while not self.done and (got < budget or pending()):
            view, placed = self._room()
            try:
                if placed:
                    with self.landing.guard:
                        if not self.landing.wanted():
                            self.complete = False  # the place was taken back: the rest is dropped
                            continue
                        n, closed, stop = _reads(view, read, budget - got, pending, blocked)
                        self._advance(view, n)  # hashed under the guard: the place is still ours
                else:
                    n, closed, stop = _reads(view, read, budget - got, pending, blocked)
                    self._advance(view, n)
            except blocked:
                if got:  # nothing more there now: what this turn took
                    return got, False
                raise
            got += n
            if closed or stop:
                return got, closed
        return got, False

    def write(self, data: memoryview) -> None:
        """Put ``data`` (the payload's next bytes, received elsewhere) where they go."""
        at = 0
        while at < data.nbytes:
            at += self.receive(lambda view: _copy(view, data[at:at + view.nbytes]))

    def _room(self) -> tuple[memoryview, bool]:
        """Where the next bytes go, and whether that is the landing's place (not scratch)."""
        segment = self.landing.segments[self._segment]
        if isinstance(segment, memoryview) and self.complete:
            return segment[self._offset:], True
        left = (segment if isinstance(segment, int) else segment.nbytes) - self._offset
        if self._drop is None:
            self._drop = memoryview(bytearray(_DROP_BYTES))
        return self._drop[:min(left, _DROP_BYTES)], False

    def _advance(self, view: memoryview, n: int) -> None:
        if not n:
            return
        if self.landing.hasher is not None:
            self.landing.hasher.update(view[:n])
        self.filled += n
        self._offset += n
        self._skip_empty()

    def _skip_empty(self) -> None:
        segments = self.landing.segments
        while self._segment < len(segments):
            segment = segments[self._segment]
            if self._offset < (segment if isinstance(segment, int) else segment.nbytes):
                return
            self._segment += 1
            self._offset = 0


def _reads(view: memoryview, read: Callable[[memoryview], int], budget: int, pending: Callable[[], int],
           blocked: tuple[type[BaseException], ...]) -> tuple[int, bool, bool]:
    """Fill ``view`` by reads while bytes are there (see ``Sink.fill``): the bytes read, whether
    the peer closed, and whether to stop (nothing more there now)."""
    filled, size = 0, view.nbytes
    while filled < size and (filled < budget or pending()):
        try:
            n = read(view[filled:])
        except blocked:
            if filled:
                return filled, False, True
            raise
        if not n:
            return filled, True, True
        filled += n
    return filled, False, False


def _nothing_pending() -> int:
    return 0


def _copy(view: memoryview, data: memoryview) -> int:
    view[:data.nbytes] = data
    return data.nbytes
