"""The worker side's loads and saves against a real cluster, on real torch KV tensors laid out
as vLLM hands them to connectors ([blocks, KV heads, block size, K|V channels]); the engine
itself is exercised in test_vllm_e2e.py.  Also the connector's start-up contract check."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from kvring.cachenode.client import ClusterClient
from kvring.common.errors import ContractMismatch
from kvring.connector import worker as worker_module
from kvring.connector.config import ConnectorConfig
from kvring.connector.metadata import KVRingMetadata, LoadSpec, ReqMeta, SaveSpec
from kvring.connector.parts import ChunkPart
from kvring.connector.worker import WorkerSide

CHUNK, BLOCK, HEADS, CH, LAYERS, BLOCKS = 32, 16, 2, 8, 3, 64


# The CUDA path (pinned staging, side stream, events) runs only where a GPU is present.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


# Channels per head: frames of 8 are small (copied from a buffer), frames of 2048 are large
# enough to be received straight into the cache (``HostCopies.places``), on the CPU.
WIDTHS = [CH, 2048]


def _caches(seed: int, device: str = "cpu", ch: int = CH) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(BLOCKS, HEADS, BLOCK, ch, generator=g).to(torch.bfloat16).to(device)
            for i in range(LAYERS)}


def _worker(cluster, mode: str) -> WorkerSide:
    config = ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster, load_mode=mode, timeout=2.0)
    return WorkerSide(config, ClusterClient(cluster.etcd, cluster=cluster.cluster), CHUNK, BLOCK)


def _slots(block_ids: list[int], n: int) -> np.ndarray:
    t = np.arange(n)
    return np.asarray(block_ids)[t // BLOCK] * BLOCK + t % BLOCK


def _parts(key: bytes, heads=range(HEADS)) -> list[bytes]:
    """The part keys of chunk ``key`` (one per KV head: ``kvring.connector.parts``)."""
    return [ChunkPart(h, 0, LAYERS).key(key) for h in heads]


def _saved(cluster, keys: list[bytes], blocks: list[int], ch: int = CH) -> WorkerSide:
    """A worker that saved ``keys`` (one chunk each) from ``blocks`` of its random cache."""
    saver = _worker(cluster, "layerwise")
    saver.register_kv_caches(_caches(1, ch=ch))
    meta = KVRingMetadata([ReqMeta("a", _slots(blocks, len(keys) * CHUNK), blocks,
                                   save=SaveSpec(keys, 0, len(keys) * CHUNK))])
    for name in saver.layer_names:
        saver.save_kv_layer(meta, name, saver.kv_caches[name])
    saver.flush()
    assert saver.parts_saved == len(keys) * HEADS
    return saver


def _finished(worker: WorkerSide, req_id: str, timeout: float) -> float:
    """Poll get_finished once per 'step' until ``req_id`` is reported; seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        _, recving = worker.get_finished(set())
        if recving and req_id in recving:
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"{req_id} not reported by get_finished within {timeout} s")


@pytest.mark.parametrize("ch", WIDTHS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["layerwise", "bulk"])
def test_saved_chunks_load_into_other_blocks_and_a_lost_chunk_is_reported(cluster_factory, mode, device, ch):
    """Rows before ``write_from`` and the last token are never written, nor any other block,
    whether the frames are copied in or received straight into the cache."""
    cluster = cluster_factory(nodes=2, memory=64 << 20)
    keys = [bytes([i]) * 16 for i in range(4)]
    src_blocks = list(range(8, 16))  # 4 chunks x 2 blocks
    saver = _worker(cluster, mode)
    saver.register_kv_caches(_caches(1, device, ch))
    meta = KVRingMetadata([ReqMeta("a", _slots(src_blocks, 4 * CHUNK), src_blocks,
                                   save=SaveSpec(keys, 0, 4 * CHUNK, f"ns-{mode}-{device}"))])
    for name in saver.layer_names:
        saver.save_kv_layer(meta, name, saver.kv_caches[name])
    saver.flush()
    assert saver.parts_saved == 4 * HEADS

    loader = _worker(cluster, mode)
    loader.register_kv_caches(_caches(2, device, ch))
    before = {n: t.clone() for n, t in loader.kv_caches.items()}
    assert loader.client.delete(_parts(keys[2], [1])) == 1  # one part evicted between lookup and load
    dst_blocks = list(range(30, 38))
    load = LoadSpec(keys, start=0, write_from=CHUNK // 2, end=4 * CHUNK - 1)
    loader.start_load_kv(KVRingMetadata([ReqMeta("b", _slots(dst_blocks, 4 * CHUNK), dst_blocks, load=load)]))
    for name in loader.layer_names:
        loader.wait_for_layer_load(name)
    failed = loader.get_block_ids_with_load_errors()
    assert failed == {34, 35}  # exactly chunk 2's blocks

    src_slots, dst_slots = _slots(src_blocks, 4 * CHUNK), _slots(dst_blocks, 4 * CHUNK)
    for name in loader.layer_names:
        src, dst, old = (t[name].cpu() for t in (saver.kv_caches, loader.kv_caches, before))
        for t in range(4 * CHUNK):
            got = dst[dst_slots[t] // BLOCK, :, dst_slots[t] % BLOCK]
            want_src, want_old = (x[src_slots[t] // BLOCK if x is src else dst_slots[t] // BLOCK, :,
                                    (src_slots[t] if x is src else dst_slots[t]) % BLOCK] for x in (src, old))
            if 2 * CHUNK <= t < 3 * CHUNK:
                # The chunk with a lost part: that head is untouched (its blocks are reported, and
                # vLLM recomputes them whole, the other head's loaded KV included).
                assert torch.equal(got[1], want_old[1]), (name, t)
            elif CHUNK // 2 <= t < 4 * CHUNK - 1:
                assert torch.equal(got, want_src), (name, t)
            else:  # before write_from, and the last token: untouched
                assert torch.equal(got, want_old), (name, t)
        other = [b for b in range(BLOCKS) if b not in dst_blocks]
        assert torch.equal(dst[other], old[other])
    stats = loader.counters.take().data
    assert stats["loaded_bytes"] > 0
    assert stats["landed_bytes"] == (stats["loaded_bytes"] if ch > CH and device == "cpu" else 0)
    # Saved parts carry the request's namespace: flushing it removes the 7 that are left.
    assert loader.client.flush_namespace("ns-other") == 0
    assert loader.client.flush_namespace(f"ns-{mode}-{device}") == 7
    assert not any(loader.client.lookup([p for k in keys for p in _parts(k)]))
    for w in (saver, loader):
        w.shutdown()
        w.client.close()


def test_connector_refuses_a_cluster_with_another_chunk_size(cluster_factory):
    from kvring.connector.attach import connect

    cluster = cluster_factory(nodes=1, memory=16 << 20)
    with pytest.raises(ContractMismatch, match="chunk_size: this connector has 512, the cluster has 256"):
        connect(ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster, chunk_size=512))
    client, chunk_size = connect(ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster))
    assert chunk_size == 256 and client.attached
    client.close()


def test_an_async_load_is_reported_through_get_finished(cluster_factory):
    cluster = cluster_factory(nodes=2, memory=64 << 20)
    keys = [bytes([i]) * 16 for i in range(10, 14)]
    src_blocks, dst_blocks = list(range(8, 16)), list(range(30, 38))
    saver = _saved(cluster, keys, src_blocks)
    loader = _worker(cluster, "async")
    loader.register_kv_caches(_caches(2))
    assert loader.client.delete(_parts(keys[1])) == HEADS
    load = LoadSpec(keys, start=0, write_from=0, end=4 * CHUNK - 1, asynchronous=True, deadline_s=5.0)
    loader.start_load_kv(KVRingMetadata([ReqMeta("b", _slots(dst_blocks, 4 * CHUNK), dst_blocks, load=load)]))
    _finished(loader, "b", timeout=5)
    assert loader.get_block_ids_with_load_errors() == {32, 33}  # exactly chunk 1's blocks
    src_slots, dst_slots = _slots(src_blocks, 4 * CHUNK), _slots(dst_blocks, 4 * CHUNK)
    for name in loader.layer_names:
        src, dst = saver.kv_caches[name], loader.kv_caches[name]
        for t in list(range(CHUNK)) + list(range(2 * CHUNK, 4 * CHUNK - 1)):
            assert torch.equal(dst[dst_slots[t] // BLOCK, :, dst_slots[t] % BLOCK],
                               src[src_slots[t] // BLOCK, :, src_slots[t] % BLOCK]), (name, t)
    stats = loader.counters.take().data
    assert stats["loads"] == 1 and stats["failed_blocks"] == {"missing": 2} and stats["loaded_bytes"] > 0
    for w in (saver, loader):
        w.shutdown()
        w.client.close()


def _async_pair(cluster, first: int, seed: int, device: str = "cpu") -> tuple[list[bytes], WorkerSide, WorkerSide]:
    """Two chunks (keys from byte ``first``) saved from blocks 8-11, and an async worker with a
    random cache of its own (``seed``) on ``device``."""
    keys = [bytes([i]) * 16 for i in range(first, first + 2)]
    saver = _saved(cluster, keys, list(range(8, 12)))
    loader = _worker(cluster, "async")
    loader.register_kv_caches(_caches(seed, device))
    return keys, saver, loader


@pytest.mark.parametrize("device", DEVICES)
def test_an_idle_step_waits_for_its_async_load_and_reports_it_when_it_ends(cluster_factory, monkeypatch, device):
    """A step that computes nothing (its requests wait for loads) blocks in get_finished until a
    load ends, so vLLM's engine loop does not spin against the loading threads; a step that
    computes returns at once.  The node is stopped, so the load cannot end before it is resumed.
    On CUDA the load is reported once its copies are synchronized."""
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 10.0)  # the wait ends with the load, not the bound
    cluster = cluster_factory(nodes=1, memory=64 << 20)
    keys, saver, loader = _async_pair(cluster, 30, seed=4, device=device)
    src_blocks, dst_blocks = list(range(8, 12)), list(range(50, 54))
    node = cluster.nodes[0]
    os.kill(node.pid, signal.SIGSTOP)
    resume = threading.Timer(0.5, os.kill, (node.pid, signal.SIGCONT))
    try:
        load = LoadSpec(keys, start=0, write_from=0, end=2 * CHUNK, asynchronous=True, deadline_s=10.0)
        loader.start_load_kv(KVRingMetadata([ReqMeta("d", _slots(dst_blocks, 2 * CHUNK), dst_blocks, load=load)]))
        t0 = time.monotonic()
        assert loader.get_finished(set(), idle=False) == (None, None)  # a step that computes: no wait
        assert time.monotonic() - t0 < 0.4
        resume.start()
        _, recving = loader.get_finished(set(), idle=True)  # one idle step: it waits for the load
        waited = time.monotonic() - t0
    finally:
        resume.cancel()
        os.kill(node.pid, signal.SIGCONT)
    assert recving == {"d"}
    assert 0.5 <= waited < 5.0  # woken by the load's end: after the node resumed, long before the bound
    assert loader.get_block_ids_with_load_errors() == set()
    src_slots, dst_slots = _slots(src_blocks, 2 * CHUNK), _slots(dst_blocks, 2 * CHUNK)
    for name in loader.layer_names:
        src, dst = saver.kv_caches[name], loader.kv_caches[name]
        assert torch.equal(dst[dst_slots // BLOCK, :, dst_slots % BLOCK].cpu(),
                           src[src_slots // BLOCK, :, src_slots % BLOCK])
    for w in (saver, loader):
        w.shutdown()
        w.client.close()


def test_an_async_load_whose_copies_cannot_be_synchronized_recomputes_every_block(cluster_factory):
    """If the copies cannot be synchronized (a CUDA error), whether they landed is unknown: the
    request is reported done with every block failed, never as loaded and never left waiting."""
    cluster = cluster_factory(nodes=1, memory=64 << 20)
    keys, saver, loader = _async_pair(cluster, 36, seed=6)
    dst_blocks = list(range(60, 64))

    def broken() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    loader.copies.synchronize = broken
    load = LoadSpec(keys, start=0, write_from=0, end=2 * CHUNK, asynchronous=True, deadline_s=5.0)
    loader.start_load_kv(KVRingMetadata([ReqMeta("f", _slots(dst_blocks, 2 * CHUNK), dst_blocks, load=load)]))
    _finished(loader, "f", timeout=5)
    assert loader.get_block_ids_with_load_errors() == set(dst_blocks)
    assert loader.counters.take().data["failed_blocks"] == {"error": 4}
    for w in (saver, loader):
        w.shutdown()
        w.client.close()


def test_an_idle_step_waits_no_longer_than_an_async_loads_deadline(cluster_factory, monkeypatch):
    """An idle step's wait ends at the earliest deadline: the load is abandoned and reported
    then, every block failed, even though the bound on idle waits is longer."""
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 10.0)
    cluster = cluster_factory(nodes=1, memory=64 << 20)
    keys, saver, loader = _async_pair(cluster, 33, seed=5)
    dst_blocks = list(range(56, 60))
    node = cluster.nodes[0]
    os.kill(node.pid, signal.SIGSTOP)
    try:
        load = LoadSpec(keys, start=0, write_from=0, end=2 * CHUNK, asynchronous=True, deadline_s=0.3)
        t0 = time.monotonic()
        loader.start_load_kv(KVRingMetadata([ReqMeta("e", _slots(dst_blocks, 2 * CHUNK), dst_blocks, load=load)]))
        recving = None
        while not recving and time.monotonic() - t0 < 5.0:
            _, recving = loader.get_finished(set(), idle=True)
        waited = time.monotonic() - t0
        assert recving == {"e"}
        assert 0.3 <= waited < 1.5  # at the deadline, not at the idle bound or the node timeout
        assert loader.get_block_ids_with_load_errors() == set(dst_blocks)
    finally:
        os.kill(node.pid, signal.SIGCONT)
    for w in (saver, loader):
        w.shutdown()
        w.client.close()


@pytest.mark.parametrize("ch", WIDTHS)
def test_an_async_load_past_its_deadline_is_abandoned_and_writes_nothing_after(cluster_factory, ch):
    """A node that hangs mid-load: the request is reported at its deadline with every block
    failed, and when the node wakes up and delivers, not one byte lands in those blocks (copied
    in, or received straight into the cache)."""
    cluster = cluster_factory(nodes=1, memory=64 << 20)
    keys = [bytes([i]) * 16 for i in range(20, 23)]
    dst_blocks = list(range(40, 46))
    saver = _saved(cluster, keys, list(range(8, 14)), ch)
    loader = _worker(cluster, "async")
    loader.register_kv_caches(_caches(3, ch=ch))
    before = {n: t.clone() for n, t in loader.kv_caches.items()}
    node = cluster.nodes[0]
    os.kill(node.pid, signal.SIGSTOP)
    try:
        load = LoadSpec(keys, start=0, write_from=0, end=3 * CHUNK, asynchronous=True, deadline_s=0.3)
        started = time.monotonic()  # before the load starts: its deadline runs from then on
        loader.start_load_kv(KVRingMetadata([ReqMeta("c", _slots(dst_blocks, 3 * CHUNK), dst_blocks, load=load)]))
        _finished(loader, "c", timeout=3)
        waited = time.monotonic() - started
        assert 0.3 <= waited < 1.5  # at the deadline, not at the client's 5 s node timeout
        assert loader.get_block_ids_with_load_errors() == set(dst_blocks)
    finally:
        os.kill(node.pid, signal.SIGCONT)
    loader.shutdown()  # waits for the abandoned job's thread: the node answers now, and it must drop it all
    for name in loader.layer_names:
        assert torch.equal(loader.kv_caches[name], before[name])
    stats = loader.counters.take().data
    assert stats["loads_abandoned"] == 1 and stats["failed_blocks"] == {"abandoned": 6}
    saver.shutdown()
    for w in (saver, loader):
        w.client.close()


@pytest.mark.parametrize("mode", ["layerwise", "bulk"])
def test_a_step_waits_for_a_hung_node_no_longer_than_the_loads_deadline(cluster_factory, mode):
    """A node that hangs mid-load holds a layerwise or bulk step (the forward waits for its
    layers) only until the load's deadline, not for the node timeout: the load is abandoned then,
    every block is reported failed (vLLM recomputes them), and when the node wakes up and
    delivers, not one byte lands in those blocks.  The next step's load is not held by it."""
    cluster = cluster_factory(nodes=1, memory=64 << 20)
    keys = [bytes([i]) * 16 for i in range(30, 33)]
    dst_blocks = list(range(40, 46))
    saver = _saved(cluster, keys, list(range(8, 14)), 2048)
    loader = _worker(cluster, mode)
    loader.register_kv_caches(_caches(3, ch=2048))
    before = {n: t.clone() for n, t in loader.kv_caches.items()}
    node = cluster.nodes[0]
    os.kill(node.pid, signal.SIGSTOP)
    try:
        load = LoadSpec(keys, start=0, write_from=0, end=3 * CHUNK, deadline_s=0.3)
        started = time.monotonic()
        loader.start_load_kv(KVRingMetadata([ReqMeta("h", _slots(dst_blocks, 3 * CHUNK), dst_blocks, load=load)]))
        for name in loader.layer_names:  # the forward
            loader.wait_for_layer_load(name)
        waited = time.monotonic() - started
        assert 0.3 <= waited < 1.5  # at the deadline, not at the client's 5 s node timeout
        assert loader.get_block_ids_with_load_errors() == set(dst_blocks)
    finally:
        os.kill(node.pid, signal.SIGCONT)
    # The next step loads the same chunks into other blocks while the abandoned job may still run.
    others = list(range(50, 56))
    load = LoadSpec(keys, start=0, write_from=0, end=3 * CHUNK, deadline_s=10.0)
    loader.start_load_kv(KVRingMetadata([ReqMeta("i", _slots(others, 3 * CHUNK), others, load=load)]))
    for name in loader.layer_names:
        loader.wait_for_layer_load(name)
    assert loader.get_block_ids_with_load_errors() == set()
    loader.shutdown()  # waits for the abandoned job's thread: the node answers now, and it must drop it all
    for name in loader.layer_names:
        assert torch.equal(loader.kv_caches[name][dst_blocks], before[name][dst_blocks])  # nothing landed late
        assert torch.equal(loader.kv_caches[name][others], saver.kv_caches[name][8:14])
    stats = loader.counters.take().data
    assert stats["loads_abandoned"] == 1 and stats["failed_blocks"] == {"abandoned": 6}
    saver.shutdown()
    for w in (saver, loader):
        w.client.close()
