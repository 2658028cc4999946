"""The chunk store: chunks in RAM under a byte budget, with eviction and lookup leases.

Threading contract: a ``ChunkStore`` is owned by one thread (the node's I/O thread); no method
blocks or takes a lock.  Other threads may read ``capacity``, ``used``, ``evictions``,
``evicted_bytes`` and ``leased_bytes()`` for metrics: they only read one integer.

Budget: every chunk is charged its payload bytes plus ``ENTRY_OVERHEAD`` for the bookkeeping
that holds it, so the budget bounds what the store really keeps alive.  ``used`` and
``leased_bytes()`` count charged bytes, like the budget they are compared with;
``evicted_bytes`` counts payload bytes only (the data given up).

Payloads are kept as given to ``put``, never copied or wrapped: the store takes the buffer
over, and its size must not change while it is stored.

Leases: a LOOKUP leases the chunks it reports for a short time so that eviction passes them
over until the worker that was told about them has loaded them.  Leases are bounded: leased
bytes never exceed ``max_leased_fraction`` of the budget (a lookup past the bound still reports
the chunk, it just does not lease it), and when nothing unleased is left to evict, leased
chunks are evicted too — a lease can never pin the store full.  Their bookkeeping costs
O(log n) per lease taken or extended and per lease that runs out: a running byte count, the
expiry of each leased key, and a min-heap of ``(expiry, key)`` where extending a lease pushes
a new item and the one it replaces stays behind as stale, skipped when it comes to the top.

Namespaces: the store counts the chunks of each namespace their metadata names, and a flush
of one namespace scans the store once for them (tens of milliseconds at 200,000 chunks; flushes
are rare admin operations, while an index would cost every chunk another hash-table slot).
Chunks without a namespace (``""``) are not counted and no flush reaches them.

Watchers: ``watch(StoreWatcher)`` is told of every chunk that comes (``stored``) and every one
that goes, deleted, flushed or evicted (``removed``), on the owning thread, as it happens; a
watcher must not block (the node's KV events queue them for their own thread).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from kvring.common.chunk import ChunkMeta
from kvring.common.errors import KVRingError

from .policy import EvictionPolicy, LRUPolicy

# Bytes charged per chunk on top of its payload: what the store keeps alive for one chunk of
# up to 2 layers, measured on CPython 3.11 with tracemalloc (tests/cachenode/test_store.py
# asserts the measurement stays within it).  It covers
#   - the payload object's own header (a bytearray: 57 bytes; its data is the payload),
#   - the key (a 16-byte ``bytes``: 49),
#   - the ``ChunkMeta`` struct (72) and its checksums list (72 + 36 per 64-bit checksum); the
#     shape list, dtype, token count and namespace are shared between chunks (``_shared``),
#   - the ``Entry`` record (48),
#   - its slot in the one table of entries, which the eviction policy orders in place: 30 to
#     120 bytes as the table fills up with live and deleted keys between resizes.
# That makes 400 bytes in a freshly filled table and 490 in one left at its emptiest by reads
# and evictions (1 KiB chunks, the test's figures).  Not covered: leases (a few hundred bytes
# per leased chunk while it lasts, bounded by ``max_leased_fraction``), checksums past the
# second layer (44 bytes each; chunks with many layers have payloads far larger than that) and
# the shared metadata objects (at most ``_MAX_TEMPLATES`` sets, not per chunk).
ENTRY_OVERHEAD = 512

# Distinct (shape, dtype, tokens, namespace) combinations whose objects are shared; past it the
# table starts again (a node sees a handful: one per model layout and namespace).
_MAX_TEMPLATES = 256


@dataclass(slots=True)
class Entry:
    """One stored chunk."""

    meta: ChunkMeta
    buf: Any  # the payload, the very object given to ``put``: a contiguous, layer-major buffer

    @property
    def charge(self) -> int:
        """Bytes charged to the budget: payload, bookkeeping, and the vLLM blocks and anchor it names."""
        blocks, anchor = self.meta.blocks, self.meta.anchor
        return (_payload_bytes(self.buf) + ENTRY_OVERHEAD + (blocks.nbytes if blocks is not None else 0)
                + (len(anchor) if anchor is not None else 0))


class StoreWatcher(Protocol):
    def stored(self, key: bytes, meta: ChunkMeta) -> None: ...

    def removed(self, key: bytes, meta: ChunkMeta, evicted: bool) -> None:
        """``key`` left the store: ``evicted`` by the store itself, else deleted or flushed."""


class StoreFull(KVRingError):
    """The chunk cannot fit even in an empty store."""


def _payload_bytes(buf) -> int:
    return memoryview(buf).nbytes


class ChunkStore:
    """Chunks under a byte budget (see the module docstring); ``policy`` orders this store
    only (``make_policy`` makes a fresh one), ``clock`` gives lease times in seconds."""

    def __init__(
        self,
        capacity_bytes: int,
        policy: EvictionPolicy | None = None,
        max_leased_fraction: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        recycle: Callable[[Any], None] | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity must be positive, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.recycle = recycle  # given each payload the store lets go (deleted, evicted, flushed)
        self.policy = policy or LRUPolicy()
        self._entries: dict[bytes, Entry] = {}  # in the policy's eviction order
        self.policy.attach(self._entries)
        self.max_leased_bytes = int(capacity_bytes * max_leased_fraction)
        self._clock = clock
        self._namespace_chunks: dict[str, int] = {}
        self._templates: dict[tuple, ChunkMeta] = {}
        self._lease_until: dict[bytes, float] = {}  # leased key -> expiry (clock seconds)
        self._lease_heap: list[tuple[float, bytes]] = []  # (expiry, key), stale items included
        self._leased_bytes = 0
        self.used = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self._watchers: list[StoreWatcher] = []

    def watch(self, watcher: StoreWatcher) -> None:
        self._watchers.append(watcher)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def keys_after(self, after: bytes, limit: int) -> list[bytes]:
        """Up to ``limit`` stored keys greater than ``after``, in byte order (for paging)."""
        if limit <= 0 or not self._entries:
            return []
        # One pass over the store per page: O(n log limit), no sorted index to keep up to date.
        return heapq.nsmallest(limit, [key for key in self._entries if key > after])

    def peek(self, key: bytes) -> Entry | None:
        """The entry of ``key`` without counting it as a use."""
        return self._entries.get(key)

    def get(self, key: bytes) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self.policy.accessed(key)
        return entry

    def put(self, key: bytes, meta: ChunkMeta, buf) -> bool:
        """Store a chunk; False if the key is already stored. Raises ``StoreFull``."""
        if key in self._entries:
            self.policy.accessed(key)
            if self.recycle is not None:  # the copy already stored stays; this one's buffer can serve again
                self.recycle(buf)
            return False
        entry = Entry(self._shared(meta), buf)
        charge = entry.charge
        if charge > self.capacity:
            raise StoreFull(f"chunk of {_payload_bytes(buf)} bytes (+{charge - _payload_bytes(buf)} of bookkeeping) "
                            f"exceeds the store's capacity of {self.capacity}")
        self._make_room(charge)
        self._entries[key] = entry
        if meta.namespace:
            self._namespace_chunks[meta.namespace] = self._namespace_chunks.get(meta.namespace, 0) + 1
        self.used += charge
        for watcher in self._watchers:
            watcher.stored(key, entry.meta)
        return True

    def replace_payload(self, key: bytes, buf) -> bool:
        """Swap a chunk's payload for ``buf`` of the same size, keeping its metadata and
        checksums (fault injection); False if ``key`` is not stored.  Not a use."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        old, new = _payload_bytes(entry.buf), _payload_bytes(buf)
        if new != old:
            raise ValueError(f"a replacement payload must be {old} bytes like the chunk it replaces, got {new}")
        entry.buf = buf
        return True

    def delete(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._forget(key, entry)
        return True

    def delete_namespace(self, namespace: str) -> int:
        """Delete every chunk stored under ``namespace`` (never ``""``); returns how many."""
        if not namespace:
            raise ValueError("refusing to flush the empty namespace (it would mean chunks that have none)")
        if namespace not in self._namespace_chunks:
            return 0
        doomed = [key for key, entry in self._entries.items() if entry.meta.namespace == namespace]
        for key in doomed:
            self._forget(key, self._entries.pop(key))
        return len(doomed)

    def namespaces(self) -> dict[str, int]:
        """Chunks held per namespace (chunks without one are not listed)."""
        return dict(self._namespace_chunks)

    def lookup(self, keys: list[bytes], lease_ms: int = 0) -> list[bool]:
        """Presence of each key; present ones count as used and are leased for ``lease_ms``
        within the bound."""
        entries = self._entries
        present = [key in entries for key in keys]
        # A lookup is demand: the chunks found are about to be loaded.
        self.policy.accessed_many([key for key, hit in zip(keys, present) if hit])
        if lease_ms > 0 and any(present):
            now = self._clock()
            self._expire_leases(now)
            until = now + lease_ms / 1000.0
            for key, hit in zip(keys, present):
                if hit:
                    self._lease(key, until)
            self._compact_leases()
        return present

    def leased_bytes(self) -> int:
        """Charged bytes under lease; leases past their expiry count until the next lookup or
        eviction notices them (this only reads a counter, so any thread may call it)."""
        return self._leased_bytes

    # ---- leases -----------------------------------------------------------------------------

    def _lease(self, key: bytes, until: float) -> None:
        current = self._lease_until.get(key)
        if current is None:
            charge = self._entries[key].charge
            if self._leased_bytes + charge > self.max_leased_bytes:
                return  # past the bound: reported present, not protected
            self._leased_bytes += charge
        elif until <= current:
            return
        self._lease_until[key] = until
        heapq.heappush(self._lease_heap, (until, key))

    def _expire_leases(self, now: float) -> None:
        heap = self._lease_heap
        while heap and heap[0][0] <= now:
            until, key = heapq.heappop(heap)
            if self._lease_until.get(key) == until:  # else stale: extended or dropped since
                del self._lease_until[key]
                self._leased_bytes -= self._entries[key].charge
        self._compact_leases()

    def _compact_leases(self) -> None:
        """Rebuild the heap from the live leases once stale items outnumber them twice, so it
        never holds more than three items per live lease (amortised O(1) per stale item)."""
        if len(self._lease_heap) > 3 * len(self._lease_until):
            self._lease_heap = [(until, key) for key, until in self._lease_until.items()]
            heapq.heapify(self._lease_heap)

    # ---- budget -----------------------------------------------------------------------------

    def _shared(self, meta: ChunkMeta) -> ChunkMeta:
        """``meta`` sharing its shape list, dtype, token count and namespace with the chunks
        stored before it that have equal ones: only its checksums, blocks and anchor are its own."""
        fields = (tuple(meta.shape), meta.dtype, meta.tokens, meta.namespace)
        template = self._templates.get(fields)
        if template is None:
            if len(self._templates) >= _MAX_TEMPLATES:
                self._templates.clear()
            self._templates[fields] = meta
            return meta
        return msgspec.structs.replace(template, checksums=meta.checksums, blocks=meta.blocks, anchor=meta.anchor)

    def _make_room(self, charge: int) -> None:
        if self.used + charge <= self.capacity:
            return
        self._expire_leases(self._clock())
        for honour_leases in (True, False):
            needed = self.used + charge - self.capacity
            victims = []
            for key in self.policy.candidates():
                if needed <= 0:
                    break
                if honour_leases and key in self._lease_until:
                    continue
                victims.append(key)
                needed -= self._entries[key].charge
            for key in victims:
                entry = self._entries.pop(key)
                self._forget(key, entry, evicted=True)
                self.evictions += 1
                self.evicted_bytes += _payload_bytes(entry.buf)
            if self.used + charge <= self.capacity:
                return

    def _forget(self, key: bytes, entry: Entry, evicted: bool = False) -> None:
        charge = entry.charge
        self.used -= charge
        if self.recycle is not None:
            self.recycle(entry.buf)
        if self._lease_until.pop(key, None) is not None:
            self._leased_bytes -= charge
            self._compact_leases()
        ns = entry.meta.namespace
        if ns:
            left = self._namespace_chunks[ns] - 1
            if left:
                self._namespace_chunks[ns] = left
            else:
                del self._namespace_chunks[ns]
        for watcher in self._watchers:
            watcher.removed(key, entry.meta, evicted)
