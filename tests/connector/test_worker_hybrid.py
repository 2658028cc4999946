"""The worker side of a sliding-window hybrid (vLLM's hybrid KV-cache manager: a block table per
KV-cache group, a window's group keeping blocks only for its window) against a real cluster, on
real torch KV tensors: each layer through its own group's blocks, a window's parts saved only
while whole and loaded only where the window reaches, and failed loads reported per request.
Real engines serving such models are in test_vllm_hybrid.py."""

from __future__ import annotations

import time

import numpy as np
import torch

from kvring.cachenode.client import ClusterClient
from kvring.connector.config import ConnectorConfig
from kvring.connector.instance import KVGroups
from kvring.connector.keys import KVLayout
from kvring.connector.metadata import KVRingMetadata, LoadSpec, ReqMeta, SaveSpec
from kvring.connector.parts import window_start
from kvring.connector.worker import WorkerSide

CHUNK, BLOCK, HEADS, CH, BLOCKS, WINDOW = 32, 16, 2, 8, 64, 16
NAMES = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]
GROUPS = KVGroups({name: g for g, name in enumerate(NAMES)}, (WINDOW, WINDOW, 0))  # two windows, one full
LAYOUT = KVLayout(model="m", config_fingerprint="f", kv_dtype="bfloat16", num_layers=3, num_kv_heads=HEADS,
                  head_size=CH // 2, block_layout="BHNC", chunk_size=CHUNK, windows=GROUPS.windows)
KEYS = [bytes([i]) * 16 for i in range(4)]
TOKENS = 4 * CHUNK


def _worker(cluster, seed: int) -> WorkerSide:
    config = ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster, load_mode="async", timeout=2.0)
    worker = WorkerSide(config, ClusterClient(cluster.etcd, cluster=cluster.cluster), CHUNK, BLOCK, groups=GROUPS)
    g = torch.Generator().manual_seed(seed)
    worker.register_kv_caches({name: torch.randn(BLOCKS, HEADS, BLOCK, CH, generator=g).to(torch.bfloat16)
                               for name in NAMES})
    return worker


def _slots(block_ids: list[int], n: int = TOKENS) -> np.ndarray:
    t = np.arange(n)
    return np.asarray(block_ids)[t // BLOCK] * BLOCK + t % BLOCK


def _meta(req_id: str, tables: list[list[int]], load=None, save=None) -> KVRingMetadata:
    slots = [_slots(table) for table in tables]
    return KVRingMetadata([ReqMeta(req_id, slots[0], tables[0], load, save, group_slot_mappings=slots)])


def _finished(worker: WorkerSide, req_id: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, recving = worker.get_finished(set())
        if recving and req_id in recving:
            return
        time.sleep(0.01)
    raise AssertionError(f"{req_id} not reported by get_finished within {timeout} s")


def _saved(cluster) -> WorkerSide:
    """A worker that saved 4 chunks in a step scheduled at token 48: the windows' blocks before
    token 48 - 16 + 1 (rounded down to a block: 32) were already freed, so their parts of chunk 0
    are not saved; chunk 1 starts at 32 and is whole."""
    saver = _worker(cluster, 1)
    tables = [list(range(1, 9)), list(range(9, 17)), list(range(17, 25))]
    live = window_start(48, WINDOW, BLOCK)
    assert live == 32
    save = SaveSpec(KEYS, 0, TOKENS, "ns", live_from={WINDOW: live})
    meta = _meta("a", tables, save=save)
    for name in NAMES:
        saver.save_kv_layer(meta, name, saver.kv_caches[name])
    saver.flush()
    return saver


def test_each_group_is_saved_from_its_own_blocks_and_a_window_only_while_whole(cluster_factory):
    cluster = cluster_factory(nodes=2, memory=64 << 20)
    saver = _saved(cluster)
    parts = LAYOUT.parts()
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        present = client.lookup(parts.keys(KEYS))
        stored = client.get([parts.parts[0].key(KEYS[1]), parts.parts[2].key(KEYS[1])])
    per_chunk = np.asarray(present).reshape(4, len(parts.parts))
    kinds = [p.window for p in parts.parts]
    assert kinds == [0, 0, WINDOW, WINDOW]
    assert per_chunk[:, :2].all() and per_chunk[:, 2:].tolist() == [[False, False]] + [[True, True]] * 3
    assert saver.parts_saved == 4 * HEADS + 3 * HEADS
    # Chunk 1's full part holds layer 2 from group 2's blocks; its window part layers 0 and 1,
    # each from its own group's blocks.
    full, window = (np.frombuffer(bytes(c.data), dtype=np.uint16).reshape(c.meta.shape) for c in stored)
    assert full.shape[0] == 1 and window.shape[0] == 2
    for layer, got, table in ((2, full[0], range(17, 25)), (0, window[0], range(1, 9)), (1, window[1], range(9, 17))):
        cache = saver.kv_caches[NAMES[layer]].view(torch.int16).numpy().view(np.uint16)
        slots = _slots(list(table))[CHUNK:2 * CHUNK]
        assert np.array_equal(got[:, 0], cache[slots // BLOCK, 0, slots % BLOCK])


def test_a_load_writes_every_full_layer_and_a_window_only_into_the_blocks_vllm_kept(cluster_factory):
    cluster = cluster_factory(nodes=2, memory=64 << 20)
    saver = _saved(cluster)
    loader = _worker(cluster, 2)
    before = {n: t.clone() for n, t in loader.kv_caches.items()}
    end = TOKENS - 1
    first = window_start(end, WINDOW, BLOCK)  # 96: the windows keep the last 2 blocks only
    # vLLM's tables after allocating a 127-token hit: the windows' null block 0 before `first`.
    tables = [[0] * (first // BLOCK) + [40, 41], [0] * (first // BLOCK) + [42, 43], list(range(50, 58))]
    load = LoadSpec(KEYS, 0, 0, end, asynchronous=True, window_from={WINDOW: first})
    loader.start_load_kv(_meta("b", tables, load=load))
    _finished(loader, "b")
    assert loader.failed_loads() == set() and loader.get_block_ids_with_load_errors() == set()
    # The full-attention part of every chunk, the window part of chunk 3 only ([96, 128)).
    assert loader.loads[-1]["parts"] == 4 * HEADS + 1 * HEADS
    src_tables = [range(1, 9), range(9, 17), range(17, 25)]
    for layer, name in enumerate(NAMES):
        src = saver.kv_caches[name]
        dst, old = loader.kv_caches[name], before[name]
        src_slots, dst_slots = _slots(list(src_tables[layer])), _slots(tables[layer])
        lo = first if GROUPS.windows[layer] else 0
        for t in range(lo, end):
            assert torch.equal(dst[dst_slots[t] // BLOCK, :, dst_slots[t] % BLOCK],
                               src[src_slots[t] // BLOCK, :, src_slots[t] % BLOCK]), (name, t)
        assert torch.equal(dst[0], old[0]), name  # never vLLM's null block
        untouched = [b for b in range(BLOCKS) if b not in set(tables[layer])]
        assert torch.equal(dst[untouched], old[untouched]), name


def test_with_several_groups_a_failed_load_fails_its_request_not_blocks(cluster_factory):
    cluster = cluster_factory(nodes=2, memory=64 << 20)
    _saved(cluster)
    loader = _worker(cluster, 3)
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.delete([LAYOUT.parts().parts[1].key(KEYS[2])]) == 1  # one full part evicted
    tables = [[0] * 6 + [40, 41], [0] * 6 + [42, 43], list(range(50, 58))]
    load = LoadSpec(KEYS, 0, 0, TOKENS - 1, asynchronous=True, window_from={WINDOW: 96})
    loader.start_load_kv(_meta("c", tables, load=load))
    _finished(loader, "c")
    # vLLM raises on block ids with several groups: the request is reported, and recomputes whole.
    assert loader.get_block_ids_with_load_errors() == set() and loader.failed_loads() == {"c"}
    # A load that could not even start is reported done and failed too.
    loader.fail_loads(_meta("d", tables, load=load))
    _finished(loader, "d")
    assert loader.get_block_ids_with_load_errors() == set() and loader.failed_loads() == {"d"}
