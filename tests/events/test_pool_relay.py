"""The pool stream (``PoolEvents``) over real etcd and real node processes, read with vLLM's own
decoder: one sequence, chains across nodes, a lapse in a node's subscription, a late subscriber,
a node restarted empty, a node whose history no longer starts at 0, and ``kvring up`` printing it
and its admin API showing it."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np
import zmq
from kv_event_tap import EventTap, credited, removed_hashes, replay, stored_hashes
from polling import read_until, wait_for
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

from kvring.cachenode.client import ClusterClient
from kvring.cachenode.events import NodeEvents
from kvring.cachenode.pool_events import PoolEvents
from kvring.common.chunk import ChunkBlocks, ChunkItem
from kvring.common.contract import Contract
from kvring.events.publisher import PublisherSettings
from kvring.events.relay import PoolRelay, RelaySettings, Source

BLOCK = 16
CHUNK = 64  # 4 blocks a chunk


def _chunk(i: int, prompt: int = 0) -> ChunkItem:
    """Chunk ``i`` of prompt ``prompt``: blocks ``prompt*1000 + 4i ..``, parent the block before."""
    base = prompt * 1000
    payload = np.full(4096, i, dtype=np.float32).reshape(2, -1)
    item = ChunkItem.of_array(bytes([prompt]) + i.to_bytes(15, "big"), payload, tokens=CHUNK, namespace="ns")
    hashes = [base + 4 * i + b for b in range(4)]
    return item.with_blocks(ChunkBlocks.of(hashes, base + 4 * i - 1 if i else None,
                                           list(range(base + CHUNK * i, base + CHUNK * (i + 1))), BLOCK))


def _chained(events) -> bool:
    seen: set = set()
    for e in events:
        if isinstance(e, AllBlocksCleared):
            seen.clear()
        elif isinstance(e, BlockStored):
            if e.parent_block_hash is not None and e.parent_block_hash not in seen:
                return False
            seen.update(e.block_hashes)
    return True


def test_one_stream_chains_a_prompt_across_nodes_and_recovers_a_lapse_and_a_restart(cluster_factory):
    cluster = cluster_factory(nodes=3, memory=8 << 20, contract=Contract(chunk_size=CHUNK))
    with PoolEvents(cluster.etcd, cluster.cluster, RelaySettings(check_interval=0.5), interval=0.2) as stream, \
            ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        tap = EventTap([stream.events_addr])
        try:
            wait_for(lambda: stream.stats()["nodes"] == 3, 10, "the relay following the three nodes")
            items = [_chunk(i) for i in range(8)]
            assert client.put_many(items) == [1] * 8
            assert len({client.owners(i.key)[0] for i in items}) == 3  # spread over the nodes
            wait_for(lambda: credited(tap.events()) == set(range(32)), 10, "the prompt's 32 blocks on the stream")
            assert _chained(tap.events())
            seqs = [seq for _, seq, _ in tap.batches]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one sequence, no gap
            assert all(e.locality is None and e.ownership is None and e.medium == "CPU"
                       for e in tap.events() if isinstance(e, BlockStored))

            # A lapse in one node's subscription (what a dropped connection amounts to): the relay
            # sees the gap in that node's sequence and replays what it missed from the node.
            owner = client.owners(_chunk(0, prompt=1).key)[0]
            stream.relay.on_thread(lambda r: r.followed()[owner].setsockopt(zmq.UNSUBSCRIBE, b"")).result(5)
            time.sleep(0.2)
            missed = [i for i in range(12) if client.owners(_chunk(i, prompt=1).key)[0] == owner]
            for i in missed:  # one batch each on the owner's stream
                assert client.put_many([_chunk(i, prompt=1)]) == [1]
                time.sleep(0.03)
            stream.relay.on_thread(lambda r: r.followed()[owner].setsockopt(zmq.SUBSCRIBE, b"")).result(5)
            time.sleep(0.3)
            assert client.put_many([_chunk(0, prompt=2)]) == [1]
            later = [_chunk(i, prompt=1) for i in range(12) if i not in missed]
            assert client.put_many(later) == [1] * len(later)
            every = set(range(32)) | {1000 + b for b in range(48)} | {2000, 2001, 2002, 2003}
            wait_for(lambda: credited(tap.events()) == every, 10, "the missed batches recovered")
            assert stream.stats()["recovered"] >= len(missed) and _chained(tap.events())

            # A subscriber that joins now gets the whole pool at once (the publisher is an XPUB).
            late = EventTap([stream.events_addr])
            try:
                wait_for(lambda: credited(late.events()) == every, 10, "the late subscriber's snapshot")
                assert isinstance(late.events()[0], AllBlocksCleared) and _chained(late.events())
            finally:
                late.close()
            assert credited(tap.events()) == every  # the others applied the same reset

            # A node restarted empty: exactly what it held is withdrawn, with what chains through it.
            index = next(i for i, n in enumerate(cluster.nodes) if n.node_id == owner)
            held = {h for i in range(8) if client.owners(_chunk(i).key)[0] == owner for h in range(4 * i, 4 * i + 4)}
            cluster.restart_empty(index)
            first_gone = min(held) // 4 if held else 8
            expected = set(range(4 * first_gone)) | {2000, 2001, 2002, 2003}
            first_gone_1 = min(i for i in range(12) if client.owners(_chunk(i, prompt=1).key)[0] == owner)
            expected |= {1000 + b for b in range(4 * first_gone_1)}
            if client.owners(_chunk(0, prompt=2).key)[0] == owner:
                expected -= {2000, 2001, 2002, 2003}
            wait_for(lambda: credited(tap.events()) == expected, 30, "the restarted node's chunks withdrawn")
            assert removed_hashes(tap.events()) and stored_hashes(tap.events())

            # Its replay socket serves the stream's history from the start, as vLLM's does.
            history = replay(stream.replay_addr)
            assert credited(e for _, b in history for e in b.events) == expected
        finally:
            tap.close()


def _blocks(*items: ChunkItem) -> set:
    return {h for item in items for h in item.meta.blocks.block_hashes}


class _Node:
    """A node's KV events (its own ``NodeEvents``) with a replay buffer of ``buffer`` batches; each
    store or removal is sent as a batch of its own, and what the node holds is kept alongside."""

    def __init__(self, buffer: int) -> None:
        self.events = NodeEvents("relay-test", PublisherSettings(buffer_batches=buffer))
        self.held: dict[bytes, ChunkItem] = {}
        wait_for(lambda: self.last_seq() == 0, 5, "the node's first batch (AllBlocksCleared)")
        port, replay_port = self.events.publisher.port, self.events.publisher.replay_port
        self.source = Source("node-a", "1", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")

    def last_seq(self) -> int:
        return self.events.publisher.stats()["last_seq"]

    def store(self, item: ChunkItem) -> None:
        self.held[item.key] = item
        self._sent(lambda: self.events.stored(item.key, item.meta))

    def remove(self, item: ChunkItem) -> None:
        del self.held[item.key]
        self._sent(lambda: self.events.removed(item.key, item.meta))

    def _sent(self, change) -> None:
        seq = self.last_seq() + 1
        change()
        wait_for(lambda: self.last_seq() == seq, 5, f"the node's batch {seq}")

    def holds(self) -> set:
        return _blocks(*self.held.values())


def test_a_node_whose_history_no_longer_starts_at_0_is_under_credited_never_over_credited(caplog):
    node = _Node(buffer=5)
    relay = tap = None
    try:
        a = [_chunk(i) for i in range(5)]  # prompt 0: blocks 0..19
        b = [_chunk(i, prompt=1) for i in range(3)]  # prompt 1: blocks 1000..1011
        c0 = _chunk(0, prompt=2)
        # Batches 1..7; a buffer of 5 keeps 3..7: AllBlocksCleared and the stores of a[0], a[1] are gone.
        for item in (a[0], a[1], b[0], a[2], b[1]):
            node.store(item)
        node.remove(a[0])  # evicted: the removal of a block the relay never hears stored
        node.store(a[3])
        assert replay(node.source.replay_addr)[0][0] == 3

        relay = PoolRelay(RelaySettings(check_interval=0.5))
        tap = EventTap([relay.events_addr])
        relay.set_sources({"node-a": node.source})
        # a[1]'s store is gone, so a[2], a[3] (held, chained through it) wait; b's chain is credited.
        wait_for(lambda: credited(tap.events()) == _blocks(b[0], b[1]), 10, "prompt 1's chain on the stream")
        stats = relay.stats()
        assert stats["incomplete"] == 1 and stats["nodes"] == 1
        assert stats["blocks_held"] == len(_blocks(b[0], b[1], a[2], a[3])) and stats["blocks_published"] == 8
        assert credited(tap.events()) < node.holds()

        # Live batches are followed: a chain that grows from a credited block, a new prompt, a
        # first block stored again; a[4] still waits behind a[1], and a removal withdraws what
        # chains through it (b[2]) even though the node holds it.
        for item in (b[2], c0, a[4], a[0]):
            node.store(item)
        wait_for(lambda: credited(tap.events()) == _blocks(*b, c0, a[0]), 10, "the live stores on the stream")
        node.remove(b[1])
        expected = _blocks(b[0], c0, a[0])
        wait_for(lambda: credited(tap.events()) == expected, 10, "the live removal on the stream")
        assert expected < node.holds() and _chained(tap.events())
        assert not _blocks(a[1], a[2], a[3], a[4]) & credited(tap.events())
        seqs = [seq for _, seq, _ in tap.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert credited(e for _, batch in replay(relay.replay_addr) for e in batch.events) == expected
        assert relay.stats()["incomplete"] == 1  # the live batches came in sequence: no other resync
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        if tap is not None:
            tap.close()
        if relay is not None:
            relay.close()
        node.events.close()


def test_kvring_up_prints_the_pool_stream_and_its_admin_api_shows_it():
    proc = subprocess.Popen([sys.executable, "-P", "-m", "kvring.cli", "up", "--nodes", "2", "--memory", "64MiB",
                             "--no-tls"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text = read_until(proc.stdout, "Press Ctrl-C")
        found = re.search(r"KV events of the whole pool, as one worker for a KV-aware router: (tcp://\S+) "
                          r"\(replay (tcp://\S+)\)", text)
        assert found, text
        events_addr, replay_addr = found.groups()
        admin = re.search(r"Admin API: (http://127\.0\.0\.1:\d+)", text).group(1)

        def shown():
            with urllib.request.urlopen(f"{admin}/v1/cluster", timeout=5) as r:
                return json.loads(r.read()).get("pool_events")
        assert wait_for(shown, 15, "/v1/cluster showing the pool stream") == {
            "events_addr": events_addr, "replay_addr": replay_addr, "topic": ""}
        tap = EventTap([events_addr])
        try:
            wait_for(lambda: any(isinstance(e, AllBlocksCleared) for e in tap.events()), 10,
                     "the snapshot a new subscriber gets")
        finally:
            tap.close()
        assert replay(replay_addr)[0][0] == 0
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        finally:
            proc.stdout.close()


def test_kvring_events_runs_the_stream_as_a_process_of_its_own(cluster_factory):
    cluster = cluster_factory(nodes=2, memory=8 << 20, contract=Contract(chunk_size=CHUNK))
    proc = subprocess.Popen([sys.executable, "-P", "-m", "kvring.cli", "events", "--etcd", cluster.etcd,
                             "--cluster", cluster.cluster, "--port", "0", "--replay-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        found = re.search(r"(tcp://\S+) \(replay (tcp://\S+)\)", line)
        assert found, line + (proc.stdout.read() if proc.poll() is not None else "")
        tap = EventTap([found.group(1)])
        try:
            with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
                wait_for(lambda: isinstance((tap.events() or [None])[0], AllBlocksCleared), 10, "the snapshot")
                assert client.put_many([_chunk(i, prompt=3) for i in range(3)]) == [1] * 3
            wait_for(lambda: credited(tap.events()) == set(range(3000, 3012)), 10, "the prompt on the stream")
        finally:
            tap.close()
        proc.terminate()
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
