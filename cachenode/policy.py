"""Eviction policies: which stored chunk to give up first.

A policy only orders keys; the store owns the bytes and decides how many to evict.
Threading contract: policies are not thread-safe; the store calls them from its one owner
thread (the node's I/O thread) and never re-enters them.

A policy keeps no table of its own: the store attaches its table of entries (a plain dict,
which keeps insertion order, new keys at the end) and the policy orders that dict in place.
A hash table costs a chunk 30 to 120 bytes depending on where it is between resizes, and the
store charges its bookkeeping per chunk against the budget: one table instead of two is a
good part of what keeps that within ``ENTRY_OVERHEAD``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator


class EvictionPolicy(ABC):
    """Orders the keys of one store's table for eviction."""

    _table: dict[bytes, object] | None = None

    def attach(self, table: dict[bytes, object]) -> None:
        """Called once by the store that owns ``table`` before any other method."""
        if self._table is not None:
            raise ValueError("an eviction policy orders one store; make one per store (make_policy)")
        self._table = table

    @abstractmethod
    def accessed(self, key: bytes) -> None:
        """``key`` (stored) was read or looked up."""

    def accessed_many(self, keys: list[bytes]) -> None:
        """``accessed`` of each of ``keys`` (all stored), in order."""
        for key in keys:
            self.accessed(key)

    def candidates(self) -> Iterator[bytes]:
        """Keys in the order they should be evicted (the store may skip leased ones).

        The iterator is live: the caller must not insert or remove while iterating."""
        return iter(self._table)


class LRUPolicy(EvictionPolicy):
    """Least recently used first; inserts and reads both count as use."""

    def accessed(self, key: bytes) -> None:
        self._table[key] = self._table.pop(key)  # back in at the most recent end

    def accessed_many(self, keys: list[bytes]) -> None:
        table = self._table
        for key in keys:
            table[key] = table.pop(key)


class FIFOPolicy(EvictionPolicy):
    """Oldest insert first; reads do not refresh (for comparison in trace replays)."""

    def accessed(self, key: bytes) -> None:
        pass

    def accessed_many(self, keys: list[bytes]) -> None:
        pass


POLICIES = {"lru": LRUPolicy, "fifo": FIFOPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
