"""The chunk store on plain data: budget, LRU order, leases and their bound."""

from __future__ import annotations

import pytest

from kvring.cachenode.chunk import make_meta
from kvring.cachenode.policy import FIFOPolicy, make_policy
from kvring.cachenode.store import ChunkStore, StoreFull


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _chunk(n: int, fill: int = 1):
    buf = bytes([fill]) * n
    return make_meta(buf, [1, n], "uint8", 1), buf


def _put(store, key: bytes, n: int = 100) -> bool:
    meta, buf = _chunk(n)
    return store.put(key, meta, buf)


def test_budget_is_never_exceeded_and_lru_goes_first():
    store = ChunkStore(1000)
    for i in range(10):
        assert _put(store, b"k%d" % i)
    assert store.used == 1000
    store.get(b"k0")  # k0 becomes most recently used
    _put(store, b"new")
    assert store.used == 1000
    assert b"k1" not in store and b"k0" in store and b"new" in store
    assert store.evictions == 1
    for i in range(10, 40):
        _put(store, b"k%d" % i)
        assert store.used <= 1000


def test_duplicate_put_is_a_no_op_and_oversized_is_refused():
    store = ChunkStore(1000)
    assert _put(store, b"a") and not _put(store, b"a")
    assert store.used == 100
    with pytest.raises(StoreFull):
        _put(store, b"huge", 1001)


def test_leases_protect_until_they_expire():
    clock = Clock()
    store = ChunkStore(1000, clock=clock)
    for i in range(10):
        _put(store, b"k%d" % i)
    assert store.lookup([b"k0", b"k1", b"missing"], lease_ms=500) == [True, True, False]
    for i in range(2, 10):  # k0 and k1 become the least recently used ...
        store.get(b"k%d" % i)
    _put(store, b"x")
    _put(store, b"y")
    assert b"k0" in store and b"k1" in store  # ... but leased, so skipped
    assert b"k2" not in store and b"k3" not in store
    clock.t = 1.0  # leases ran out
    _put(store, b"z")
    assert b"k0" not in store


def test_leases_cannot_pin_the_store_full():
    clock = Clock()
    store = ChunkStore(1000, max_leased_fraction=0.5, clock=clock)
    for i in range(10):
        _put(store, b"k%d" % i)
    keys = [b"k%d" % i for i in range(10)]
    assert store.lookup(keys, lease_ms=10_000) == [True] * 10  # all reported ...
    assert store.leased_bytes() == 500  # ... but only half leased
    # Even a chunk needing more than the unleased half still fits: leases give way.
    assert _put(store, b"big", 800)
    assert store.used <= 1000


def test_lookup_hits_count_as_use():
    store = ChunkStore(300)
    for k in (b"a", b"b", b"c"):
        _put(store, k)
    assert store.lookup([b"a"]) == [True]
    _put(store, b"d")
    assert b"a" in store and b"b" not in store


def test_fifo_ignores_reads():
    store = ChunkStore(300, policy=FIFOPolicy())
    for k in (b"a", b"b", b"c"):
        _put(store, k)
    store.get(b"a")
    _put(store, b"d")
    assert b"a" not in store


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="lru"):
        make_policy("random")
