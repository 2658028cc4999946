"""Payload buffers kept for reuse, so that large payloads do not cost fresh memory each time.

A received payload is read into a buffer of its own.  A fresh buffer costs a page fault (and
the kernel's zeroing) per 4 KiB as it fills, and on this kind of machine that is slower than
the socket: a node maps every buffer over 128 KiB anew, so that its RSS follows what it
stores, and glibc maps a client's large buffers anew too.  Reusing memory that is already
mapped saves that, and it is where a plain socket that reads into one preallocated buffer gets
its speed.  Two pools, one per side:

- ``BufferPool`` (node): the store hands over the payloads it lets go (evicted, deleted,
  flushed) with ``give``, and a PUT of the same size takes one back.  Stored payloads live
  long and die one by one, so they are buffers of their own, reused by exact size.
- ``SlabPool`` (client): payloads handed to a caller are carved out of a few large slabs, back
  to back, whatever their sizes; a slab is carved again from its start once its caller has
  dropped every view of every payload in it.  A reader's payloads die together (a load's
  layers, a GET's chunks), so slabs come back whole, and the same mapped memory serves reads
  of any mix of sizes.

Either way memory is reused only once nothing refers to it -- a GET still sending from a
deleted chunk, or a caller still holding a chunk it read, holds a reference -- which the
buffer's reference count shows (a NumPy view, and a ``memoryview`` of one, refer to the
array that owns the memory).  Each pool holds at most ``limit`` bytes; past it, buffers are
simply allocated and freed (a node counts its pool in its fixed overhead, not its budget).

Threading contract: any thread (one lock per pool).
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import numpy as np

MIN_POOLED = 64 << 10  # smaller payloads come from the allocator's own free lists
SLAB = 32 << 20  # a client slab, unless one payload is larger
_ALIGN = 64  # carved payloads start on a cache line


class BufferPool:
    """The node's freed payload buffers, reused by exact size (see the module docstring).

    Full, it lets the buffers freed longest ago go first, so sizes no longer stored do not keep
    out the sizes being stored now."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self.reused = 0
        self._free: dict[int, dict[int, np.ndarray]] = {}  # size -> buffers by id, oldest first
        self._age: OrderedDict[int, int] = OrderedDict()  # every pooled buffer's id -> size, oldest first
        self._lock = threading.Lock()

    def give(self, buf) -> None:
        """A buffer its owner no longer holds (it may still be in use elsewhere for a while)."""
        if type(buf) is not np.ndarray or buf.nbytes < MIN_POOLED or buf.nbytes > self.limit:
            return
        with self._lock:
            while self.bytes + buf.nbytes > self.limit:
                old, size = self._age.popitem(last=False)
                del self._free[size][old]
                self.bytes -= size
            self._free.setdefault(buf.nbytes, {})[id(buf)] = buf
            self._age[id(buf)] = buf.nbytes
            self.bytes += buf.nbytes

    def take(self, size: int) -> np.ndarray:
        """A uint8 buffer of ``size`` bytes (contents undefined): a pooled one if one is free."""
        with self._lock:
            free = self._free.get(size)
            if free:
                for key in reversed(list(free)):
                    buf = free[key]
                    # Three references: the pool's, ``buf``, and getrefcount's argument.  More:
                    # a view of it is still queued on a connection.
                    if sys.getrefcount(buf) == 3:
                        del free[key], self._age[key]
                        self.reused += 1
                        self.bytes -= size
                        return buf
        return np.empty(size, dtype=np.uint8)


class _Slab:
    __slots__ = ("buf", "used")

    def __init__(self, size: int) -> None:
        self.buf = np.empty(size, dtype=np.uint8)
        self.used = 0  # carved up to here

    def idle(self) -> bool:
        # Two references: this slab's, and getrefcount's argument; each live payload adds one.
        return sys.getrefcount(self.buf) == 2

    def carve(self, size: int) -> np.ndarray | None:
        start = -(-self.used // _ALIGN) * _ALIGN
        if start + size > self.buf.nbytes:
            return None
        self.used = start + size
        return self.buf[start:start + size]


class SlabPool:
    """The client's payload memory: slabs carved back to back (see the module docstring)."""

    def __init__(self, limit: int, slab: int = SLAB) -> None:
        self.limit = limit
        self.slab = slab
        self.bytes = 0  # in slabs
        self.reused = 0  # slabs carved again from their start
        self._slabs: list[_Slab] = []
        self._current: _Slab | None = None
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> None:
        """Map slabs of ``nbytes`` in all (within the limit) now, so that the first reads do not
        pay the page faults (a serving process's start-up, as a pinned staging pool would be)."""
        with self._lock:
            while self.bytes < nbytes and self.bytes + self.slab <= self.limit:
                slab = _Slab(self.slab)
                slab.buf.fill(0)  # touch every page
                self._slabs.append(slab)
                self.bytes += self.slab

    def take(self, size: int) -> np.ndarray:
        """A uint8 buffer of ``size`` bytes (contents undefined), carved from a slab if one has room."""
        if size < MIN_POOLED:
            return np.empty(size, dtype=np.uint8)
        with self._lock:
            current = self._current
            if current is not None:
                rewound = current.used > 0 and current.idle()  # everything carved so far was dropped
                if rewound:
                    current.used = 0
                piece = current.carve(size)
                if piece is not None:
                    self.reused += rewound
                    return piece
            slab = self._idle_slab(size) or self._new_slab(size)
            if slab is None:
                return np.empty(size, dtype=np.uint8)
            self._current = slab
            return slab.carve(size)

    def _idle_slab(self, size: int) -> _Slab | None:
        """An idle slab other than the current one, large enough; carved from its start."""
        for slab in self._slabs:
            if slab is not self._current and slab.buf.nbytes >= size and slab.idle():
                self.reused += slab.used > 0
                slab.used = 0
                return slab
        return None

    def _new_slab(self, size: int) -> _Slab | None:
        """A new slab, if it fits the limit (idle slabs too small for ``size`` make room)."""
        size = max(size, self.slab)
        for slab in [s for s in self._slabs if s.buf.nbytes < size]:
            if self.bytes + size <= self.limit:
                break
            if slab.idle():
                self._slabs.remove(slab)
                self.bytes -= slab.buf.nbytes
                if slab is self._current:
                    self._current = None
        if self.bytes + size > self.limit:
            return None
        slab = _Slab(size)
        self._slabs.append(slab)
        self.bytes += size
        return slab
