"""The worker side's loads and saves against a real cluster, on real torch KV tensors laid out
as vLLM hands them to connectors ([blocks, KV heads, block size, K|V channels]); the engine
itself is exercised in test_vllm_e2e.py.  Also the connector's start-up contract check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvring.cachenode import ClusterClient, ContractMismatch
from kvring.connector.config import ConnectorConfig
from kvring.connector.connector import connect
from kvring.connector.metadata import KVRingMetadata, LoadSpec, ReqMeta, SaveSpec
from kvring.connector.worker import WorkerSide

CHUNK, BLOCK, HEADS, CH, LAYERS, BLOCKS = 32, 16, 2, 8, 3, 64


# The CUDA path (pinned staging, side stream, events) runs only where a GPU is present.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _caches(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(BLOCKS, HEADS, BLOCK, CH, generator=g).to(torch.bfloat16).to(device)
            for i in range(LAYERS)}


def _worker(cluster, mode: str) -> WorkerSide:
    config = ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster, load_mode=mode, timeout=2.0)
    return WorkerSide(config, ClusterClient(cluster.etcd, cluster=cluster.cluster), CHUNK, BLOCK)


def _slots(block_ids: list[int], n: int) -> np.ndarray:
    t = np.arange(n)
    return np.asarray(block_ids)[t // BLOCK] * BLOCK + t % BLOCK


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["layerwise", "bulk"])
def test_saved_chunks_load_into_other_blocks_and_a_lost_chunk_is_reported(cluster_factory, mode, device):
    cluster = cluster_factory(nodes=2, memory=64 << 20)
    keys = [bytes([i]) * 16 for i in range(4)]
    src_blocks = list(range(8, 16))  # 4 chunks x 2 blocks
    saver = _worker(cluster, mode)
    saver.register_kv_caches(_caches(1, device))
    meta = KVRingMetadata([ReqMeta("a", _slots(src_blocks, 4 * CHUNK), src_blocks,
                                   save=SaveSpec(keys, 0, 4 * CHUNK, f"ns-{mode}-{device}"))])
    for name in saver.layer_names:
        saver.save_kv_layer(meta, name, saver.kv_caches[name])
    saver.flush()
    assert saver.chunks_saved == 4

    loader = _worker(cluster, mode)
    loader.register_kv_caches(_caches(2, device))
    before = {n: t.clone() for n, t in loader.kv_caches.items()}
    assert loader.client.delete([keys[2]]) == 1  # evicted between lookup and load
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
            if CHUNK // 2 <= t < 4 * CHUNK - 1 and not 2 * CHUNK <= t < 3 * CHUNK:
                assert torch.equal(got, src[src_slots[t] // BLOCK, :, src_slots[t] % BLOCK]), (name, t)
            else:  # before write_from, the lost chunk, and the last token: untouched
                assert torch.equal(got, old[dst_slots[t] // BLOCK, :, dst_slots[t] % BLOCK]), (name, t)
        other = [b for b in range(BLOCKS) if b not in dst_blocks]
        assert torch.equal(dst[other], old[other])
    # Saved chunks carry the request's namespace: flushing it removes the 3 that are left.
    assert loader.client.flush_namespace("ns-other") == 0
    assert loader.client.flush_namespace(f"ns-{mode}-{device}") == 3
    assert not any(loader.client.lookup(keys))
    for w in (saver, loader):
        w.shutdown()
        w.client.close()


def test_connector_refuses_a_cluster_with_another_chunk_size(cluster_factory):
    cluster = cluster_factory(nodes=1, memory=16 << 20)
    with pytest.raises(ContractMismatch, match="chunk_size: this connector has 512, the cluster has 256"):
        connect(ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster, chunk_size=512))
    connect(ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster)).close()
