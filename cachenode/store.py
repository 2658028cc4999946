"""The chunk store: chunks in RAM under a byte budget, with eviction and lookup leases.

Threading contract: a ``ChunkStore`` is owned by one thread (the node's I/O thread); no method
blocks or takes a lock.  Other threads may read the integer counters for metrics.

Leases: a LOOKUP leases the chunks it reports for a short time so that eviction passes them
over until the worker that was told about them has loaded them.  Leases are bounded: leased
bytes never exceed ``max_leased_fraction`` of the budget (a lookup past the bound still reports
the chunk, it just does not lease it), and when nothing unleased is left to evict, leased
chunks are evicted too — a lease can never pin the store full.

Namespaces: chunks whose metadata names a namespace are indexed by it, so a flush of one
namespace deletes its chunks without scanning the store.  Chunks without a namespace (``""``)
are not indexed and no flush reaches them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .chunk import ChunkMeta
from .policy import EvictionPolicy, LRUPolicy


@dataclass(slots=True)
class Entry:
    meta: ChunkMeta
    buf: memoryview  # the whole layer-major chunk, read-only
    lease_until: float = 0.0


class StoreFull(Exception):
    """The chunk cannot fit even in an empty store."""


class ChunkStore:
    def __init__(
        self,
        capacity_bytes: int,
        policy: EvictionPolicy | None = None,
        max_leased_fraction: float = 0.5,
        clock=time.monotonic,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity must be positive, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.policy = policy or LRUPolicy()
        self.max_leased_bytes = int(capacity_bytes * max_leased_fraction)
        self._clock = clock
        self._entries: dict[bytes, Entry] = {}
        self._leased: dict[bytes, float] = {}
        self._by_namespace: dict[str, set[bytes]] = {}
        self.used = 0
        self.evictions = 0
        self.evicted_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def keys(self) -> list[bytes]:
        return list(self._entries)

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
            return False
        mv = memoryview(buf).cast("B")
        size = mv.nbytes
        if size > self.capacity:
            raise StoreFull(f"chunk of {size} bytes exceeds the store's capacity of {self.capacity}")
        self._make_room(size)
        self._entries[key] = Entry(meta, mv.toreadonly())
        if meta.namespace:
            self._by_namespace.setdefault(meta.namespace, set()).add(key)
        self.used += size
        self.policy.inserted(key)
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
        keys = self._by_namespace.pop(namespace, set())
        for key in keys:
            entry = self._entries.pop(key)
            self._forget(key, entry)
        return len(keys)

    def namespaces(self) -> dict[str, int]:
        """Chunks held per namespace (chunks without one are not listed)."""
        return {ns: len(keys) for ns, keys in self._by_namespace.items()}

    def lookup(self, keys: list[bytes], lease_ms: int = 0) -> list[bool]:
        """Presence of each key; present ones count as used and are leased for ``lease_ms``
        within the bound."""
        present = [k in self._entries for k in keys]
        for key, hit in zip(keys, present):
            if hit:  # a lookup is demand: the chunk is about to be loaded
                self.policy.accessed(key)
        if lease_ms > 0 and any(present):
            now = self._clock()
            self._expire_leases(now)
            until = now + lease_ms / 1000.0
            leased = self.leased_bytes()
            for key, hit in zip(keys, present):
                if not hit:
                    continue
                entry = self._entries[key]
                if key not in self._leased:
                    if leased + entry.buf.nbytes > self.max_leased_bytes:
                        continue
                    leased += entry.buf.nbytes
                entry.lease_until = max(entry.lease_until, until)
                self._leased[key] = entry.lease_until
        return present

    def leased_bytes(self) -> int:
        return sum(self._entries[k].buf.nbytes for k in self._leased if k in self._entries)

    def _expire_leases(self, now: float) -> None:
        for key in [k for k, t in self._leased.items() if t <= now]:
            del self._leased[key]

    def _make_room(self, size: int) -> None:
        if self.used + size <= self.capacity:
            return
        now = self._clock()
        self._expire_leases(now)
        for honour_leases in (True, False):
            needed = self.used + size - self.capacity
            victims = []
            for key in self.policy.candidates():
                if needed <= 0:
                    break
                if honour_leases and key in self._leased:
                    continue
                victims.append(key)
                needed -= self._entries[key].buf.nbytes
            for key in victims:
                entry = self._entries.pop(key)
                self._forget(key, entry)
                self.evictions += 1
                self.evicted_bytes += entry.buf.nbytes
            if self.used + size <= self.capacity:
                return

    def _forget(self, key: bytes, entry: Entry) -> None:
        self.used -= entry.buf.nbytes
        self._leased.pop(key, None)
        self.policy.removed(key)
        ns = entry.meta.namespace
        if ns and ns in self._by_namespace:
            members = self._by_namespace[ns]
            members.discard(key)
            if not members:
                del self._by_namespace[ns]
