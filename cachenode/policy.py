"""Eviction policies: which stored chunk to give up first.

A policy only orders keys; the store owns the bytes and decides how many to evict.
Threading contract: policies are not thread-safe; the store calls them from its one owner
thread (the node's I/O thread) and never re-enters them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator


class EvictionPolicy(ABC):
    """Orders the keys of a store for eviction."""

    @abstractmethod
    def inserted(self, key: bytes) -> None: ...

    @abstractmethod
    def accessed(self, key: bytes) -> None: ...

    @abstractmethod
    def removed(self, key: bytes) -> None: ...

    @abstractmethod
    def candidates(self) -> Iterator[bytes]:
        """Keys in the order they should be evicted (the store may skip leased ones).

        The iterator is live: the caller must not insert or remove while iterating."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first; inserts and reads both count as use."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def inserted(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def accessed(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: bytes) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        return iter(self._order)


class FIFOPolicy(EvictionPolicy):
    """Oldest insert first; reads do not refresh (for comparison in trace replays)."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def inserted(self, key: bytes) -> None:
        self._order.setdefault(key, None)

    def accessed(self, key: bytes) -> None:
        pass

    def removed(self, key: bytes) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        return iter(self._order)


POLICIES = {"lru": LRUPolicy, "fifo": FIFOPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
