"""Streamed layers received straight into their places (``iter_layers(place=...)``, ``landing.py``):
real etcd, real TLS node processes over loopback, the real cluster client, with reader threads
off and on (a round whose layers have places stays on the caller's thread either way).

What must hold: every placed byte is the stored byte when its layer is delivered, nothing outside
the places is written, a layer that fails its checksum is never delivered (the replica's bytes
land over it), a place taken back gets no byte after, and a reader never waits for a node while
holding the place's guard (an abandon does not wait for a hung node)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from faults import inject

from kvring.cachenode.client import ClusterClient
from kvring.cachenode.dispatch import MISNUMBERINGS
from kvring.cachenode.landing import Landed, Landing
from kvring.common.chunk import ChunkItem
from kvring.common.contract import Contract

LAYERS, LAYER_BYTES = 6, 192 << 10
DROP = 4096  # each placed layer's first bytes are dropped, as rows before a load's first token are


@pytest.fixture(scope="module", params=[True, False], ids=["tls", "plain"])
def cluster(etcd_server, request):
    from kvring.local.cluster import LocalCluster

    with LocalCluster(nodes=3, memory=256 << 20, etcd=etcd_server.endpoint, cluster=f"test-landing-{request.param}",
                      contract=Contract(replication=2), tls=request.param, node_args=["--fault-injection"]) as cluster:
        yield cluster


@pytest.fixture(scope="module", params=[False, True], ids=["read-threads-off", "read-threads-on"])
def client(cluster, request):
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=cluster.tls, read_threads=request.param,
                       timeout=3.0) as client:
        assert client.wait_for_nodes(3)
        yield client


@pytest.fixture
def stored(client):
    return _store(client, 24)


def _store(client: ClusterClient, keys: int) -> dict[bytes, np.ndarray]:
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    data = {os.urandom(16): rng.integers(0, 256, size=LAYERS * LAYER_BYTES, dtype=np.uint8) for _ in range(keys)}
    items = [ChunkItem.of(k, v, [LAYERS, LAYER_BYTES], "uint8", 16) for k, v in data.items()]
    assert client.put_many(items) == [2] * len(items)
    return data


class _Cache:
    """Places for the layers of the keys at even positions: each layer's bytes after ``DROP``
    in two pieces, swapped and apart, in one array (as a chunk's rows lie in scattered blocks)."""

    def __init__(self, keys: int, wanted=lambda: True) -> None:
        self.span = 2 * LAYER_BYTES
        self.memory = np.zeros(keys * LAYERS * self.span, np.uint8)
        self.lock = threading.Lock()
        self.wanted = wanted
        self.asked: list[tuple[int, int, int]] = []

    def pieces(self, pos: int, layer: int) -> list[tuple[int, int, int]]:
        """(offset in the layer, length, offset in memory) of each placed piece."""
        base = (pos * LAYERS + layer) * self.span
        half = (LAYER_BYTES - DROP) // 2
        return [(DROP, half, base + LAYER_BYTES + 512), (DROP + half, LAYER_BYTES - DROP - half, base)]

    def place(self, pos: int, layer: int, size: int) -> Landing | None:
        self.asked.append((pos, layer, size))
        if pos % 2 or size != LAYER_BYTES:
            return None
        view = memoryview(self.memory)
        return Landing([DROP, *(view[at:at + n] for _, n, at in self.pieces(pos, layer))], self.lock, self.wanted)

    def holds(self, pos: int, layer: int, data: np.ndarray) -> bool:
        return all(np.array_equal(self.memory[at:at + n], data[layer * LAYER_BYTES + off:][:n])
                   for off, n, at in self.pieces(pos, layer))

    def placed_mask(self) -> np.ndarray:
        mask = np.zeros(len(self.memory), bool)
        for pos in range(0, len(self.memory) // (LAYERS * self.span), 2):
            for layer in range(LAYERS):
                for _, n, at in self.pieces(pos, layer):
                    mask[at:at + n] = True
        return mask


def _deliveries(client: ClusterClient, keys: list[bytes], cache: _Cache, data: dict, found: list | None = None):
    """Every delivery, checked as it arrives: a ``Landed`` layer's place already holds its bytes."""
    got: dict[tuple[int, int], list[str]] = {}
    for batch in client.iter_layers(keys, found=found, place=cache.place):
        for i, view in zip(batch.indices, batch.views):
            expected = data[keys[i]][batch.layer * LAYER_BYTES:(batch.layer + 1) * LAYER_BYTES]
            if isinstance(view, Landed):
                assert view.complete and view.nbytes == LAYER_BYTES
                assert cache.holds(i, batch.layer, data[keys[i]]), f"key {i} layer {batch.layer} delivered wrong"
                got.setdefault((i, batch.layer), []).append("landed")
            else:
                assert bytes(view) == expected.tobytes()
                got.setdefault((i, batch.layer), []).append("view")
    return got


def test_layers_land_in_their_places_and_the_others_come_as_views(client, stored, monkeypatch):
    keys = list(stored)
    cache = _Cache(len(keys))
    readers: list[str] = []
    original = type(client.reads)._read_node

    def recorded(self, node_id, *args):
        readers.append(node_id)
        return original(self, node_id, *args)

    monkeypatch.setattr(type(client.reads), "_read_node", recorded)
    got = _deliveries(client, keys, cache, stored)
    assert not readers  # the round stayed on this thread, read threads or not
    assert set(got) == {(i, layer) for i in range(len(keys)) for layer in range(LAYERS)}
    assert all(d == ["landed" if i % 2 == 0 else "view"] for (i, _), d in got.items())
    assert not cache.memory[~cache.placed_mask()].any()  # the dropped bytes and the gaps: never written
    assert sorted({(p, layer) for p, layer, _ in cache.asked}) == sorted(got)  # asked once per layer


def test_a_corrupt_layer_that_landed_is_never_delivered_and_the_replicas_bytes_land_over_it(cluster, client, stored):
    keys = list(stored)
    victim = keys[4]  # an even position: placed
    owner = client.owners(victim)[0]
    inject(cluster, owner, f"corrupt?key={victim.hex()}")
    dropped = client.reads.corrupt_dropped
    cache = _Cache(len(keys))
    found: list = [None] * len(keys)
    got = _deliveries(client, keys, cache, stored, found)  # each delivery checked as it came
    assert client.reads.corrupt_dropped == dropped + 1  # caught by the checksum taken as it landed
    assert all(m is not None for m in found)
    assert all(cache.holds(4, layer, stored[victim]) for layer in range(LAYERS))
    assert len([p for p, _, _ in cache.asked if p == 4]) > LAYERS  # read again from the replica, into the same places
    assert set(got) == {(i, layer) for i in range(len(keys)) for layer in range(LAYERS)}


@pytest.mark.parametrize("how", MISNUMBERINGS)
def test_a_layer_numbered_out_of_turn_is_never_delivered_as_another(cluster, client, stored, how, caplog):
    """A node with a numbering bug (``/debug/misnumber-on-get``): every frame matches the
    checksums sent with it, only its layer number is wrong -- the first two layers each numbered
    as the other, the first sent twice, the first numbered -1, or a layer of zeros after the last
    numbered as the first.  No layer is delivered as one it is not; every key ends whole, the
    misnumbering node's from their replicas, into the same places; nothing outside them written."""
    keys = list(stored)
    owner = client.owners(keys[0])[0]

    def refused() -> bool:  # the client saw the layer out of turn (then read its key from the replica)
        return any("sent a layer numbered" in r.getMessage() and owner in r.getMessage() for r in caplog.records)

    inject(cluster, owner, f"misnumber-on-get?how={how}")
    cache = _Cache(len(keys))
    found: list = [None] * len(keys)
    got = _deliveries(client, keys, cache, stored, found)  # each delivery checked as it came
    assert all(m is not None for m in found)
    assert set(got) == {(i, layer) for i in range(len(keys)) for layer in range(LAYERS)}
    assert all(cache.holds(i, layer, stored[keys[i]]) for i in range(0, len(keys), 2) for layer in range(LAYERS))
    assert not cache.memory[~cache.placed_mask()].any()
    assert refused()
    if how == "swap":  # layer 1's bytes came numbered 0 after a frame out of turn: no place for them
        owned = [i for i, k in enumerate(keys) if i % 2 == 0 and client.owners(k)[0] == owner]
        assert owned and all(cache.asked.count((i, 0, LAYER_BYTES)) == 1 for i in owned)  # the replica's only
    # Again without places: every layer a view (read by reader threads where they are on).
    caplog.clear()
    inject(cluster, owner, f"misnumber-on-get?how={how}")
    found = [None] * len(keys)
    for batch in client.iter_layers(keys, found=found):
        for i, view in zip(batch.indices, batch.views):
            assert bytes(view) == stored[keys[i]][batch.layer * LAYER_BYTES:][:LAYER_BYTES].tobytes()
    assert all(m is not None for m in found)
    assert refused()


def test_a_place_taken_back_gets_no_byte_after_and_its_keys_are_not_found(client, stored):
    keys = list(stored)
    receives, snapshot = [0], []

    def wanted() -> bool:  # called under the guard before each receive into a place
        receives[0] += 1
        if receives[0] <= 40:
            return True
        if not snapshot:
            snapshot.append(cache.memory.copy())
        return False

    cache = _Cache(len(keys), wanted)
    found: list = [None] * len(keys)
    for batch in client.iter_layers(keys, found=found, place=cache.place):
        for i, view in zip(batch.indices, batch.views):
            if isinstance(view, Landed):  # only what landed before the place was taken back
                assert view.complete and cache.holds(i, batch.layer, stored[keys[i]])
    assert snapshot and np.array_equal(cache.memory, snapshot[0])  # not one byte after
    assert any(m is None for i, m in enumerate(found) if i % 2 == 0)  # those keys are not loaded
    assert all(m is not None for i, m in enumerate(found) if i % 2)  # the others are


def test_a_node_killed_while_its_layer_lands_ends_in_the_replicas_bytes(cluster, client):
    """A node SIGKILLed while one of its layers is being received into its place: the layer it
    cut short is never delivered, every key comes whole from its replica into the same places,
    and nothing outside the places is written.  The node has some 24 MiB to send, more than the
    sockets' buffers hold, so it dies with part of it unsent."""
    stored = _store(client, 72)
    keys = list(stored)
    index = next(i for i, n in enumerate(cluster.nodes) if n.node_id == client.owners(keys[0])[0])
    victim = cluster.nodes[index]
    owned = {i for i, k in enumerate(keys) if i % 2 == 0 and client.owners(k)[0] == victim.node_id}
    killed: list[tuple[int, int]] = []

    class _KillingCache(_Cache):
        def place(self, pos: int, layer: int, size: int) -> Landing | None:
            landing = super().place(pos, layer, size)
            if landing is None or pos not in owned or killed:
                return landing

            def wanted() -> bool:  # the first receive into this layer's place: the node is sending it
                if not killed:
                    os.kill(victim.pid, signal.SIGKILL)
                    killed.append((pos, layer))
                return True
            return Landing(landing.segments, landing.guard, wanted)

    cache = _KillingCache(len(keys))
    found: list = [None] * len(keys)
    try:
        got = _deliveries(client, keys, cache, stored, found)  # every delivery checked as it came
        assert killed, "no layer of the victim's was landing"
        # What the node had not sent when it died was landed again, from the replica, in the same places.
        assert any(cache.asked.count(a) == 2 for a in set(cache.asked) if a[0] in owned)
        assert all(m is not None for m in found)  # the killed node's keys from their replicas
        assert set(got) == {(i, layer) for i in range(len(keys)) for layer in range(LAYERS)}
        assert all(cache.holds(i, layer, stored[keys[i]]) for i in range(0, len(keys), 2) for layer in range(LAYERS))
        assert not cache.memory[~cache.placed_mask()].any()
    finally:
        cluster.restart(index, graceful=False)
        _until_two_copies(client, victim.node_id)
        client.delete(keys)


def _until_two_copies(client: ClusterClient, node_id: str, timeout: float = 15.0) -> None:
    """Until the client writes to ``node_id`` again (it skips a node it saw fail until the node
    registers anew), so the next test's keys get both their copies."""
    key = next(k for k in (b"probe-%d" % i for i in range(100)) if node_id in client.owners(k))
    item = ChunkItem.of(key, np.zeros(LAYERS * 16, np.uint8), [LAYERS, 16], "uint8", 16)
    deadline = time.monotonic() + timeout
    while client.put_many([item]) != [2]:
        assert time.monotonic() < deadline, f"{node_id} takes no writes {timeout:.0f} s after its restart"
        time.sleep(0.1)
    client.delete([key])


def test_a_reader_waiting_on_a_hung_node_does_not_hold_the_guard(cluster, client, stored):
    """A node stopped (SIGSTOP) mid-read: while the client waits for it, taking the guard (what
    an abandon does) never waits for the node."""
    keys = list(stored)
    victim = next(n for n in cluster.nodes if n.node_id == client.owners(keys[0])[0])
    cache = _Cache(len(keys))
    waits: list[float] = []
    done = threading.Event()

    def abandoner() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            with cache.lock:
                waits.append(time.monotonic() - t0)
            time.sleep(0.01)

    os.killpg(victim.pid, signal.SIGSTOP)
    thread = threading.Thread(target=abandoner)
    thread.start()
    try:
        t0 = time.monotonic()
        found: list = [None] * len(keys)
        got = _deliveries(client, keys, cache, stored, found)
        elapsed = time.monotonic() - t0
    finally:
        done.set()
        thread.join(5)
        os.killpg(victim.pid, signal.SIGCONT)
    assert elapsed >= 2.5  # the client did wait on the hung node (its timeout is 3 s)
    assert len(waits) > 50 and max(waits) < 0.5
    assert all(m is not None for m in found)  # every key from its replica
    assert set(got) == {(i, layer) for i in range(len(keys)) for layer in range(LAYERS)}
    client.wait_for_nodes(3)

