"""The chunk store on plain data: budget (payload plus ``ENTRY_OVERHEAD``), LRU order, leases
and their bound, the lease heap's cost, per-chunk bookkeeping, paging and payload swaps."""

from __future__ import annotations

import gc
import heapq
import random
import tracemalloc
from collections import Counter

import msgspec
import pytest

import kvring.cachenode.store as store_module
from kvring.cachenode.policy import FIFOPolicy, LRUPolicy, make_policy
from kvring.cachenode.store import ENTRY_OVERHEAD, ChunkStore, StoreFull
from kvring.common.chunk import ChunkMeta, make_meta

C = 100 + ENTRY_OVERHEAD  # what a 100-byte chunk is charged


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _chunk(n: int, fill: int = 1, namespace: str = ""):
    buf = bytes([fill]) * n
    return make_meta(buf, [1, n], "uint8", 1, namespace), buf


def _put(store, key: bytes, n: int = 100, namespace: str = "") -> bool:
    meta, buf = _chunk(n, namespace=namespace)
    return store.put(key, meta, buf)


def _leased(store, now: float) -> set[bytes]:
    """The keys under lease at ``now`` (white box: the lease table once expired leases are out)."""
    store._expire_leases(now)
    return set(store._lease_until)


# ---- budget and order -------------------------------------------------------------------------

def test_budget_is_never_exceeded_and_lru_goes_first():
    store = ChunkStore(10 * C)
    for i in range(10):
        assert _put(store, b"k%d" % i)
    assert store.used == 10 * C
    store.get(b"k0")  # k0 becomes most recently used
    _put(store, b"new")
    assert store.used == 10 * C
    assert b"k1" not in store and b"k0" in store and b"new" in store
    assert store.evictions == 1 and store.evicted_bytes == 100  # payload bytes only
    for i in range(10, 40):
        _put(store, b"k%d" % i)
        assert store.used <= 10 * C


def test_duplicate_put_is_a_no_op_and_oversized_is_refused():
    store = ChunkStore(10 * C)
    assert _put(store, b"a") and not _put(store, b"a")
    assert store.used == C
    with pytest.raises(StoreFull):  # the payload fits the budget, its bookkeeping does not
        _put(store, b"huge", 10 * C - ENTRY_OVERHEAD + 1)
    assert _put(store, b"whole", 10 * C - ENTRY_OVERHEAD)
    assert store.used == 10 * C and list(store.keys()) == [b"whole"]


def test_the_budget_counts_each_chunks_bookkeeping():
    assert ENTRY_OVERHEAD > 0
    store = ChunkStore(1 << 20)
    for i in range(1024):
        _put(store, b"%04d" % i, 1024)
    held = (1 << 20) // (1024 + ENTRY_OVERHEAD)
    assert len(store) == held < 1024
    assert store.used == held * (1024 + ENTRY_OVERHEAD) <= store.capacity
    assert store.evictions == 1024 - held
    assert store.evicted_bytes == (1024 - held) * 1024


def test_put_keeps_the_payload_object_as_given():
    store = ChunkStore(10 * C)
    meta, payload = _chunk(100)
    buf = bytearray(payload)
    store.put(b"a", meta, buf)
    entry = store.peek(b"a")
    assert entry.buf is buf and entry.meta == meta
    assert bytes(memoryview(entry.buf)[10:20]) == payload[10:20]


def test_lookup_hits_count_as_use():
    store = ChunkStore(3 * C)
    for k in (b"a", b"b", b"c"):
        _put(store, k)
    assert store.lookup([b"a"]) == [True]
    _put(store, b"d")
    assert b"a" in store and b"b" not in store


def test_fifo_ignores_reads():
    store = ChunkStore(3 * C, policy=FIFOPolicy())
    for k in (b"a", b"b", b"c"):
        _put(store, k)
    store.get(b"a")
    _put(store, b"d")
    assert b"a" not in store


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="lru"):
        make_policy("random")


def test_a_policy_orders_one_store_only():
    policy = LRUPolicy()
    ChunkStore(C, policy=policy)
    with pytest.raises(ValueError, match="make_policy"):
        ChunkStore(C, policy=policy)


# ---- leases -----------------------------------------------------------------------------------

def test_leases_protect_until_they_expire():
    clock = Clock()
    store = ChunkStore(10 * C, clock=clock)
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
    assert store.leased_bytes() == 0  # k1's ran out too: the eviction noticed both


def test_leases_cannot_pin_the_store_full():
    clock = Clock()
    store = ChunkStore(10 * C, max_leased_fraction=0.5, clock=clock)
    for i in range(10):
        _put(store, b"k%d" % i)
    keys = [b"k%d" % i for i in range(10)]
    assert store.lookup(keys, lease_ms=10_000) == [True] * 10  # all reported ...
    assert store.leased_bytes() == 5 * C  # ... but only half leased
    # Even a chunk needing more than the unleased half still fits: leases give way.
    assert _put(store, b"big", 8 * C - ENTRY_OVERHEAD)
    assert store.used <= 10 * C
    assert store.leased_bytes() == sum(C for k in keys[:5] if k in store)


# Leases at t=0: a for 100 ms, b for 200 ms, c for 300 ms; at t=0.05 a is extended to 0.55, which
# leaves its first heap item (0.1, a) behind as stale.
@pytest.mark.parametrize("now, leased", [
    (0.09, {b"a", b"b", b"c"}),
    (0.15, {b"a", b"b", b"c"}),  # a's stale item came out first and was skipped
    (0.25, {b"a", b"c"}),
    (0.35, {b"a"}),
    (0.55, set()),  # an expiry is inclusive
])
def test_lease_heap_expires_in_order_and_skips_extended_leases(now, leased):
    clock = Clock()
    store = ChunkStore(10 * C, max_leased_fraction=1.0, clock=clock)
    for key, lease_ms in ((b"a", 100), (b"b", 200), (b"c", 300)):
        _put(store, key)
        store.lookup([key], lease_ms)
    clock.t = 0.05
    store.lookup([b"a"], 500)
    store.lookup([b"b"], 10)  # a shorter lease never cuts a longer one
    assert len(store._lease_heap) == 4
    assert _leased(store, now) == leased
    assert store.leased_bytes() == C * len(leased)


def test_an_extended_lease_still_protects_past_its_first_expiry():
    clock = Clock()
    store = ChunkStore(3 * C, clock=clock)
    for key in (b"a", b"b", b"c"):
        _put(store, key)
    store.lookup([b"a"], 100)
    clock.t = 0.05
    store.lookup([b"a"], 500)
    store.get(b"b")
    store.get(b"c")
    clock.t = 0.2  # past a's first lease, within its second
    _put(store, b"d")
    assert b"a" in store and b"b" not in store


def _check_leases(store) -> None:
    """The running counts against a brute-force recount of the store's own tables."""
    entries = store._entries
    assert set(store._lease_until) <= set(entries)
    assert store.leased_bytes() == sum(len(entries[k].buf) + ENTRY_OVERHEAD for k in store._lease_until)
    assert store.leased_bytes() <= store.max_leased_bytes
    assert store.used == sum(len(e.buf) + ENTRY_OVERHEAD for e in entries.values()) <= store.capacity
    heap_items = set(store._lease_heap)
    assert all((until, key) in heap_items for key, until in store._lease_until.items())
    assert len(store._lease_heap) <= 3 * len(store._lease_until)
    assert store.namespaces() == dict(Counter(e.meta.namespace for e in entries.values() if e.meta.namespace))


@pytest.mark.parametrize("seed", range(4))
def test_leased_bytes_stay_exact_over_random_operations(seed):
    rng = random.Random(seed)
    clock = Clock()
    store = ChunkStore(20 * C, max_leased_fraction=0.4, clock=clock,
                       policy=make_policy(rng.choice(["lru", "fifo"])))
    keys = [b"k%02d" % i for i in range(60)]
    ops = Counter()
    for _ in range(3000):
        op = rng.choice(["put", "put", "lookup", "lookup", "get", "delete", "tick", "flush"])
        ops[op] += 1
        if op == "put":
            _put(store, rng.choice(keys), rng.randint(1, 300), rng.choice(["", "x", "y"]))
        elif op == "lookup":
            lease_ms = rng.choice([0, 5, 50, 500])
            asked = rng.sample(keys, rng.randint(1, 8))
            assert store.lookup(asked, lease_ms) == [k in store for k in asked]
            if lease_ms and any(k in store for k in asked):
                leases = store._lease_until
                assert all(until > clock.t for until in leases.values())  # what ran out is gone
                for key in filter(store.__contains__, asked):  # leased at least this long, or refused
                    charge = len(store.peek(key).buf) + ENTRY_OVERHEAD
                    assert (leases[key] >= clock.t + lease_ms / 1000 if key in leases
                            else store.leased_bytes() + charge > store.max_leased_bytes)
        elif op == "get":
            store.get(rng.choice(keys))
        elif op == "delete":
            store.delete(rng.choice(keys))
        elif op == "tick":
            clock.t += rng.choice([0.001, 0.01, 0.1])
        else:
            store.delete_namespace(rng.choice(["x", "y"]))
        _check_leases(store)
    assert store.evictions > 0 and ops["flush"] > 0


def test_deleting_and_flushing_leased_chunks_frees_their_lease():
    clock = Clock()
    store = ChunkStore(10 * C, max_leased_fraction=1.0, clock=clock)
    for i in range(6):
        _put(store, b"k%d" % i, namespace="x" if i % 2 else "y")
    store.lookup([b"k%d" % i for i in range(6)], 1000)
    assert store.leased_bytes() == 6 * C
    assert store.delete(b"k0")
    assert store.leased_bytes() == 5 * C
    assert store.delete_namespace("x") == 3
    assert store.leased_bytes() == 2 * C and store.namespaces() == {"y": 2}
    _check_leases(store)


class _CountingHeapq:
    """``heapq`` counting its calls."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name):
        fn = getattr(heapq, name)

        def counted(*args):
            self.calls[name] += 1
            return fn(*args)
        return counted


class _UnscannableDict(dict):
    """A lease table that fails the test if anything walks it."""

    def _scan(self, *_):
        raise AssertionError("the lease table was scanned")

    __iter__ = keys = values = items = _scan


def test_many_live_leases_keep_a_lookup_cheap(monkeypatch):
    n = 50_000
    clock = Clock()
    store = ChunkStore(n * (10 + ENTRY_OVERHEAD), max_leased_fraction=1.0, clock=clock)
    meta, buf = _chunk(10)
    keys = [b"%08d" % i for i in range(n)]
    for key in keys:
        store.put(key, meta, buf)
    for i in range(0, n, 1000):
        store.lookup(keys[i:i + 1000], 60_000)
    assert store.leased_bytes() == n * (10 + ENTRY_OVERHEAD)

    counting = _CountingHeapq()
    monkeypatch.setattr(store_module, "heapq", counting)
    store._lease_until = _UnscannableDict(store._lease_until)
    clock.t = 1.0
    assert store.lookup(keys[:32], 60_000) == [True] * 32  # extends 32 leases
    assert counting.calls == {"heappush": 32}
    assert store.leased_bytes() == n * (10 + ENTRY_OVERHEAD)

    # Extending leases again and again leaves stale items behind; the heap stays bounded.
    store._lease_until = dict(dict.items(store._lease_until))
    rng = random.Random(0)
    biggest = 0
    for step in range(6000):
        clock.t = 2.0 + step * 1e-4
        store.lookup(rng.sample(keys, 32), 60_000)
        biggest = max(biggest, len(store._lease_heap))
    assert biggest <= 3 * n
    assert 1 <= counting.calls["heapify"] <= 3  # rebuilt now and then, not per lookup
    clock.t = 1000.0  # every lease runs out: each comes off the heap once
    _put(store, b"more")
    assert store.leased_bytes() == 0 and store._lease_heap == []


# ---- bookkeeping per chunk ----------------------------------------------------------------------

def _wire_chunks(n: int, rng: random.Random) -> list[bytes]:
    """PUT-like (key, meta) pairs as the node decodes them: every object fresh per chunk."""
    return [msgspec.msgpack.encode((rng.randbytes(16), ChunkMeta(
        shape=[2, 512], dtype="uint8", tokens=16, checksums=[rng.getrandbits(64), rng.getrandbits(64)],
        namespace="ns"))) for _ in range(n)]


@pytest.mark.parametrize("chunks, churn", [
    (20_000, False),  # filled once
    (22_000, True),  # reads and evictions have left the table of entries at its emptiest
])
def test_bookkeeping_per_chunk_stays_within_entry_overhead(chunks, churn):
    assert ENTRY_OVERHEAD <= 512
    extra = 1000 if churn else 0
    wires = _wire_chunks(chunks + extra, random.Random(chunks))
    decode = msgspec.msgpack.Decoder(tuple[bytes, ChunkMeta]).decode
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = ChunkStore(chunks * (1024 + ENTRY_OVERHEAD))
        for wire in wires[:chunks]:
            key, meta = decode(wire)
            store.put(key, meta, bytearray(1024))  # the node's payloads are bytearrays
        if churn:
            for key in store.keys():  # each read re-inserts its key at the end of the table
                store.get(key)
            for wire in wires[chunks:]:
                key, meta = decode(wire)
                store.put(key, meta, bytearray(1024))
            assert store.evictions == extra
        del key, meta
        gc.collect()
        per_chunk = (tracemalloc.get_traced_memory()[0] - before - len(store) * 1024) / len(store)
    finally:
        tracemalloc.stop()
    assert len(store) == chunks
    assert per_chunk <= ENTRY_OVERHEAD, f"{per_chunk:.0f} bytes of bookkeeping per chunk"


def test_equal_metadata_is_shared_and_checksums_are_not():
    store = ChunkStore(10 * C)
    for key, fill in ((b"a", 1), (b"b", 2)):
        meta, buf = _chunk(100, fill, namespace="n")
        meta = msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=ChunkMeta)  # fresh objects
        store.put(key, meta, buf)
        assert store.peek(key).meta == meta
    a, b = store.peek(b"a").meta, store.peek(b"b").meta
    assert a.shape is b.shape and a.dtype is b.dtype and a.namespace is b.namespace
    assert a.checksums != b.checksums


# ---- namespaces, paging, payload swaps ---------------------------------------------------------

def test_flush_deletes_one_namespace_only():
    store = ChunkStore(10 * C)
    for key, ns in ((b"a", "x"), (b"b", "x"), (b"c", "y"), (b"d", "")):
        _put(store, key, namespace=ns)
    assert store.namespaces() == {"x": 2, "y": 1}
    assert store.delete_namespace("x") == 2 and store.delete_namespace("x") == 0
    assert sorted(store.keys()) == [b"c", b"d"] and store.namespaces() == {"y": 1}
    assert store.used == 2 * C
    with pytest.raises(ValueError, match="empty namespace"):
        store.delete_namespace("")


@pytest.mark.parametrize("stored, after, limit, page", [
    ([], b"", 10, []),
    ([b"b", b"a", b"c"], b"", 0, []),
    ([b"b", b"a", b"c"], b"", 10, [b"a", b"b", b"c"]),
    ([b"b", b"a", b"c"], b"", 2, [b"a", b"b"]),
    ([b"b", b"a", b"c"], b"a", 10, [b"b", b"c"]),
    ([b"b", b"a", b"c"], b"ab", 1, [b"b"]),  # ``after`` need not be stored
    ([b"b", b"a", b"c"], b"c", 10, []),
    ([b"\x00", b"\xff", b"\x7f\x01"], b"\x00", 10, [b"\x7f\x01", b"\xff"]),  # byte order
])
def test_keys_after(stored, after, limit, page):
    store = ChunkStore(10 * C)
    for key in stored:
        _put(store, key)
    assert store.keys_after(after, limit) == page


def test_keys_after_pages_through_every_key_once():
    store = ChunkStore(500 * C)
    keys = [random.Random(1).randbytes(16) + b"%03d" % i for i in range(300)]
    for key in keys:
        _put(store, key)
    seen, after = [], b""
    while page := store.keys_after(after, 7):
        seen += page
        after = page[-1]
    assert seen == sorted(keys)


def test_replace_payload_swaps_the_bytes_and_keeps_the_metadata():
    store = ChunkStore(10 * C)
    _put(store, b"a")
    meta = store.peek(b"a").meta
    corrupt = bytearray(store.peek(b"a").buf)
    corrupt[0] ^= 0xFF
    assert store.replace_payload(b"a", corrupt)
    entry = store.peek(b"a")
    assert entry.buf is corrupt and entry.meta is meta and store.used == C
    assert not store.replace_payload(b"missing", corrupt)
    with pytest.raises(ValueError, match="100 bytes"):
        store.replace_payload(b"a", bytearray(99))
