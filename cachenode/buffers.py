"""Payload buffers kept for reuse, so that large payloads do not cost fresh memory each time.

A received payload is read into a buffer of its exact size.  A fresh buffer costs a page fault
(and the kernel's zeroing) per 4 KiB as it fills: a node maps every buffer over 128 KiB anew,
so that its RSS follows what it stores, and a client's 32 MiB buffers are mapped anew by
glibc too.  Reusing a buffer of the same size saves that, and it is where a plain socket that
reads into one preallocated buffer gets its speed.

Two ways buffers come back:
- ``give``: a node's store hands over the payloads it lets go (evicted, deleted, flushed);
- ``lend=True``: a client keeps every buffer it hands out (within ``limit``) and reuses one once
  its caller has dropped every view of it.

Either way a buffer is reused only once nothing else refers to it -- a GET still sending from a
deleted chunk, or a caller still holding a chunk it read, holds a reference -- which its
reference count shows.  The pool holds at most ``limit`` bytes; past it, buffers are simply
freed (a node counts the pool in its fixed overhead, not its budget).

Threading contract: any thread (one lock).
"""

from __future__ import annotations

import sys
import threading

import numpy as np

MIN_POOLED = 64 << 10  # smaller payloads come from the allocator's own free lists


class BufferPool:
    def __init__(self, limit: int, lend: bool = False) -> None:
        self.limit = limit
        self.lend = lend
        self.bytes = 0
        self.reused = 0
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def give(self, buf) -> None:
        """A buffer its owner no longer holds (it may still be in use elsewhere for a while)."""
        if type(buf) is not np.ndarray or buf.nbytes < MIN_POOLED:
            return
        with self._lock:
            if self.bytes + buf.nbytes <= self.limit:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self.bytes += buf.nbytes

    def take(self, size: int) -> np.ndarray:
        """A uint8 buffer of ``size`` bytes (contents undefined): a pooled one if one is free."""
        with self._lock:
            free = self._free.get(size)
            if free:
                for i in range(len(free) - 1, -1, -1):
                    # Two references: the list's, and getrefcount's argument.  More: a view of
                    # it is still queued on a connection, or a caller still holds it.
                    if sys.getrefcount(free[i]) == 2:
                        self.reused += 1
                        if self.lend:  # it stays in the pool, lent again
                            return free[i]
                        self.bytes -= size
                        return free.pop(i)
            buf = np.empty(size, dtype=np.uint8)
            if self.lend and size >= MIN_POOLED and self._room_for(size):
                self._free.setdefault(size, []).append(buf)
                self.bytes += size
            return buf

    def _room_for(self, size: int) -> bool:
        """Whether ``size`` more bytes fit, dropping idle buffers of other sizes to make room (the
        sizes a client reads change with what it reads)."""
        for other in list(self._free):
            if self.bytes + size <= self.limit:
                break
            if other == size:
                continue
            keep = [b for b in self._free[other] if sys.getrefcount(b) > 3]  # list, loop variable, argument
            self.bytes -= other * (len(self._free[other]) - len(keep))
            if keep:
                self._free[other] = keep
            else:
                del self._free[other]
        return self.bytes + size <= self.limit
