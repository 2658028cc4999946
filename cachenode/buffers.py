"""Payload buffers the store let go, kept for the next payload of the same size.

A received payload is read into a buffer of its exact size.  A fresh buffer costs a page fault
(and the kernel's zeroing) per 4 KiB as it fills -- the node maps every buffer over 128 KiB
anew, so that its RSS follows what it stores.  Under a full store every PUT evicts chunks whose
buffers usually have the very size the next PUT needs; reusing them saves those faults.

A buffer is reused only once nothing else refers to it: a GET still sending from a deleted
chunk holds views of it, and they count in its reference count.  The pool keeps at most
``limit`` bytes (counted in the node's fixed overhead, not its budget); the rest is freed.

Threading contract: the node's I/O thread only.
"""

from __future__ import annotations

import sys

import numpy as np

MIN_POOLED = 64 << 10  # smaller payloads come from the allocator's own free lists


class BufferPool:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self.reused = 0
        self._free: dict[int, list[np.ndarray]] = {}

    def give(self, buf) -> None:
        """A buffer the store no longer holds (it may still be in use by a send)."""
        if type(buf) is not np.ndarray or buf.nbytes < MIN_POOLED or self.bytes + buf.nbytes > self.limit:
            return
        self._free.setdefault(buf.nbytes, []).append(buf)
        self.bytes += buf.nbytes

    def take(self, size: int) -> np.ndarray:
        """A uint8 buffer of ``size`` bytes (contents undefined): a pooled one if one is free."""
        free = self._free.get(size)
        if free:
            for i in range(len(free) - 1, -1, -1):
                # Two references: the list's, and getrefcount's argument.  More: a view of it
                # is still queued on a connection.
                if sys.getrefcount(free[i]) == 2:
                    buf = free.pop(i)
                    self.bytes -= size
                    self.reused += 1
                    return buf
        return np.empty(size, dtype=np.uint8)
