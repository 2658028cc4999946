"""Tensor- and pipeline-parallel workers against a real cluster: each rank's worker side saves
and loads its own heads and layers, and what instances of one TP size stored loads right into
instances of another.  The workers run in this process, each with the slice of a model's KV
cache its rank would hold (``[blocks, its KV heads, block size, C]``, its stage's layers); the
same with vLLM's real engines in processes of their own is in test_vllm_parallel.py.

Where a GPU is present the same runs on CUDA caches (pinned staging, a side stream, per-layer
events), and deployment shapes run on both: each rank's cache as one of vLLM's physical layouts
lays it out (``cache_layouts.vllm_views``), and an MLA latent (``[blocks, 1, block size, 576]``)
replicated on every rank.
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import pytest
import torch

from kvring.cachenode.client import ClusterClient
from kvring.common.chunk import ChunkItem
from kvring.connector.config import ConnectorConfig
from kvring.connector.keys import KVLayout
from kvring.connector.metadata import KVRingMetadata, LoadSpec, ReqMeta, SaveSpec
from kvring.connector.parts import ChunkParts, RankShard
from kvring.connector.worker import WorkerSide
from kvring.connector.cache_layouts import vllm_views

CHUNK, BLOCK, CH, BLOCKS = 32, 16, 8, 48
SRC_BLOCKS, DST_BLOCKS = list(range(4, 12)), list(range(20, 28))  # 4 chunks x 2 blocks
# The CUDA path (pinned staging, side stream, events) runs only where a GPU is present.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _slots(block_ids: list[int], n: int) -> np.ndarray:
    t = np.arange(n)
    return np.asarray(block_ids)[t // BLOCK] * BLOCK + t % BLOCK


def _model(heads: int, layers: int, seed: int, ch: int = CH) -> list[torch.Tensor]:
    """A whole model's KV cache: one [blocks, heads, block, C] tensor per layer."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, heads, BLOCK, ch, generator=g).to(torch.bfloat16) for _ in range(layers)]


def _rank_caches(model: list[torch.Tensor], shard: RankShard, device: str = "cpu",
                 layout: str | None = None) -> dict[str, torch.Tensor]:
    """What the rank of ``shard`` holds of ``model``: its heads (in its order), its stage's layers;
    on ``device``, contiguous or (``layout``) in views of one allocation as vLLM lays it out."""
    idx = torch.tensor(shard.heads)
    mine = [model[i].index_select(1, idx) for i in range(shard.first_layer, shard.end_layer)]
    if layout is None:
        caches = [m.contiguous().to(device) for m in mine]
    else:
        raw = torch.empty(sum(m.numel() for m in mine), dtype=torch.bfloat16, device=device)
        caches = vllm_views(raw, len(mine), BLOCKS, len(shard.heads), BLOCK, mine[0].shape[-1], layout)
        for cache, m in zip(caches, mine):
            cache.copy_(m)
    return {f"layers.{shard.first_layer + i}.attn": cache for i, cache in enumerate(caches)}


def _shards(heads: int, tp: int, stages: tuple[tuple[int, int], ...]) -> list[RankShard]:
    return [RankShard.of_rank(heads, tp, r, stage) for stage in stages for r in range(tp)]


class Instance:
    """The workers of one vLLM instance (all its TP ranks of all its PP stages), over one model."""

    def __init__(self, cluster, model: list[torch.Tensor], heads: int, tp: int = 1,
                 stages: tuple[tuple[int, int], ...] | None = None, mode: str = "layerwise",
                 device: str = "cpu", layout: str | None = None) -> None:
        stages = stages or ((0, len(model)),)
        self.mode = mode
        self.client = ClusterClient(cluster.etcd, cluster=cluster.cluster)
        config = ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster, timeout=2.0, load_mode=mode)
        self.workers = []
        for shard in _shards(heads, tp, stages):
            w = WorkerSide(config, self.client, CHUNK, BLOCK, shard)
            w.register_kv_caches(_rank_caches(model, shard, device, layout))
            self.workers.append(w)

    def save(self, keys: list[bytes], ranks: list[int] | None = None) -> None:
        meta = KVRingMetadata([ReqMeta("s", _slots(SRC_BLOCKS, len(keys) * CHUNK), SRC_BLOCKS,
                                       save=SaveSpec(keys, 0, len(keys) * CHUNK, "ns-shards"))])
        for i, w in enumerate(self.workers):
            if ranks is not None and i not in ranks:
                continue  # this rank's save never lands (it died, its node refused it, ...)
            for name in w.layer_names:
                w.save_kv_layer(meta, name, w.kv_caches[name])
            w.flush()

    def load(self, keys: list[bytes]) -> set[int]:
        """Load ``keys`` into DST_BLOCKS (up to the last token) on every worker; the failed blocks."""
        failed = set()
        asynchronous = self.mode == "async"
        load = LoadSpec(keys, start=0, write_from=0, end=len(keys) * CHUNK - 1, asynchronous=asynchronous,
                        deadline_s=5.0 if asynchronous else 0.0)
        for w in self.workers:
            w.start_load_kv(KVRingMetadata([ReqMeta("l", _slots(DST_BLOCKS, len(keys) * CHUNK), DST_BLOCKS,
                                                    load=load)]))
            if asynchronous:  # vLLM asks every step until each worker reports the request done
                deadline = time.monotonic() + 10
                while "l" not in (w.get_finished(set())[1] or ()):
                    assert time.monotonic() < deadline, "the async load was never reported done"
                    time.sleep(0.01)
            for name in w.layer_names:
                w.wait_for_layer_load(name)
            failed |= w.get_block_ids_with_load_errors()
        return failed

    def view(self) -> list[torch.Tensor]:
        """The instance's cache as the whole model's: every head of every layer, from the rank
        that holds it."""
        heads = max(h for w in self.workers for h in w.shard.heads) + 1
        layers: dict[int, torch.Tensor] = {}
        for w in self.workers:
            for i, name in enumerate(w.layer_names):
                cache = w.kv_caches[name].cpu()
                full = layers.setdefault(w.shard.first_layer + i,
                                         torch.zeros(BLOCKS, heads, BLOCK, cache.shape[-1], dtype=torch.bfloat16))
                for j, h in enumerate(w.shard.heads):
                    full[:, h] = cache[:, j]
        return [layers[i] for i in sorted(layers)]

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.client.close()


def _loaded_right(model: list[torch.Tensor], got: list[torch.Tensor], chunks: int) -> None:
    """Every head of every layer of the loaded tokens (all but the last) equals the model's."""
    src, dst = _slots(SRC_BLOCKS, chunks * CHUNK), _slots(DST_BLOCKS, chunks * CHUNK)
    for layer, (want, have) in enumerate(zip(model, got)):
        for t in range(chunks * CHUNK - 1):
            assert torch.equal(have[dst[t] // BLOCK, :, dst[t] % BLOCK], want[src[t] // BLOCK, :, src[t] % BLOCK]), \
                (layer, t)


@pytest.fixture(scope="module")
def cluster(etcd_server):
    from kvring.local.cluster import LocalCluster

    with LocalCluster(nodes=3, memory=64 << 20, etcd=etcd_server.endpoint, cluster="shards") as c:
        yield c


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("saver_tp, loader_tp", [(2, 1), (1, 2), (2, 2), (4, 2), (1, 4)])
def test_what_one_tp_size_stores_every_tp_size_loads(cluster, saver_tp, loader_tp, device):
    heads, layers = 4, 3
    model = _model(heads, layers, seed=saver_tp * 10 + loader_tp)
    keys = [bytes([saver_tp, loader_tp, i, len(device)]) * 4 for i in range(4)]
    saver = Instance(cluster, model, heads, saver_tp, device=device)
    loader = Instance(cluster, _model(heads, layers, seed=99), heads, loader_tp, device=device)
    try:
        saver.save(keys)
        # Every head of every chunk stored once, whatever the TP size: 4 parts of [3, 32, 1, 8] each.
        assert sum(w.parts_saved for w in saver.workers) == 4 * heads
        assert loader.load(keys) == set()
        _loaded_right(model, loader.view(), 4)
    finally:
        saver.close()
        loader.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["bulk", "async"])
def test_every_load_mode_loads_another_tp_sizes_parts(cluster, mode, device):
    """TP 2 stores; TP 1 and TP 4 load in bulk (before the forward) and async (between steps)."""
    heads, layers = 4, 2
    model = _model(heads, layers, seed=31)
    keys = [bytes([31, len(mode), i, len(device)]) * 4 for i in range(4)]
    saver = Instance(cluster, model, heads, tp=2, device=device)
    loaders = [Instance(cluster, _model(heads, layers, seed=32 + tp), heads, tp=tp, mode=mode, device=device)
               for tp in (1, 4)]
    try:
        saver.save(keys)
        for loader in loaders:
            assert loader.load(keys) == set()
            _loaded_right(model, loader.view(), 4)
    finally:
        for inst in (saver, *loaders):
            inst.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads, ch, layout", [(4, CH, "LBNHC"), (4, CH, "LBHNC"), (4, CH, "BLHNC"), (4, CH, "BLNHC"),
                                              (1, 576, "LBNHC"), (1, 576, "BLHNC")],
                         ids=["gqa-LBNHC", "gqa-LBHNC", "gqa-BLHNC", "gqa-BLNHC", "mla-LBNHC", "mla-BLHNC"])
def test_deployment_caches_as_vllm_lays_them_out(cluster, device, heads, ch, layout):
    """Each TP 2 rank's cache as vLLM allocates it: its own head slice of every layer (GQA) or the
    whole MLA latent on both ranks (one 576-wide "head", rank 0 stores it), all layers' views over
    one allocation in ``layout``.  TP 2 saves; TP 1 and TP 2 load every head of every layer right."""
    layers = 3
    model = _model(heads, layers, seed=zlib.crc32(f"{heads}{layout}".encode()), ch=ch)
    keys = [f"{layout}-{heads}-{device}-{i}".encode().ljust(16, b".") for i in range(4)]
    saver = Instance(cluster, model, heads, tp=2, device=device, layout=layout)
    loaders = [Instance(cluster, _model(heads, layers, seed=7, ch=ch), heads, tp=tp, device=device, layout=layout)
               for tp in (1, 2)]
    try:
        saver.save(keys)
        assert sum(w.parts_saved for w in saver.workers) == 4 * heads
        for loader in loaders:
            assert loader.load(keys) == set()
            _loaded_right(model, loader.view(), 4)
    finally:
        for inst in (saver, *loaders):
            inst.close()


def test_replicated_heads_are_stored_once_and_load_on_every_rank(cluster):
    """2 KV heads over 4 ranks: vLLM gives ranks 0-1 head 0 and ranks 2-3 head 1; only ranks 0 and 2
    store, every rank loads its head, and TP 1 loads what they stored."""
    heads, layers = 2, 2
    model = _model(heads, layers, seed=5)
    keys = [bytes([40 + i]) * 16 for i in range(4)]
    tp4 = Instance(cluster, model, heads, tp=4)
    tp1 = Instance(cluster, _model(heads, layers, seed=6), heads, tp=1)
    tp4_loader = Instance(cluster, _model(heads, layers, seed=7), heads, tp=4)
    try:
        tp4.save(keys)
        assert [w.parts_saved for w in tp4.workers] == [4, 0, 4, 0]
        parts = ChunkParts(heads, ((0, layers),))
        assert all(tp1.client.lookup(parts.keys(keys)))
        assert tp1.load(keys) == set() and tp4_loader.load(keys) == set()
        _loaded_right(model, tp1.view(), 4)
        for w in tp4_loader.workers:  # each replica holds its head's KV
            h = w.shard.heads[0]
            view = [torch.zeros(BLOCKS, heads, BLOCK, CH, dtype=torch.bfloat16) for _ in range(layers)]
            for i, name in enumerate(w.layer_names):
                view[i][:, h] = w.kv_caches[name][:, 0]
            _loaded_right([m[:, h:h + 1] for m in model], [v[:, h:h + 1] for v in view], 4)
    finally:
        for inst in (tp4, tp1, tp4_loader):
            inst.close()


def test_a_save_only_some_ranks_finished_is_never_a_hit_nor_loaded(cluster):
    heads, layers = 4, 2
    model = _model(heads, layers, seed=8)
    keys = [bytes([60 + i]) * 16 for i in range(4)]
    tp2 = Instance(cluster, model, heads, tp=2)
    tp1 = Instance(cluster, _model(heads, layers, seed=9), heads, tp=1)
    try:
        tp2.save(keys[:2])
        tp2.save(keys[2:], ranks=[0])  # chunks 2-3: rank 1's heads never arrive
        parts = ChunkParts(heads, ((0, layers),))
        assert parts.present(tp1.client.lookup(parts.keys(keys))) == [True, True, False, False]
        # A load that is told to take them anyway (the parts went between lookup and load) reports
        # exactly the blocks of chunks 2-3, and vLLM recomputes them.
        assert tp1.load(keys) == set(DST_BLOCKS[4:])
        _loaded_right(model, tp1.view(), 2)
    finally:
        tp2.close()
        tp1.close()


def test_pipeline_stages_save_and_load_their_own_layers(cluster):
    """PP 2 (layers 0-1 and 2) with TP 2 in each stage: each of the 4 workers stores its heads of its
    layers, another PP 2 instance loads them all, and a PP 1 instance finds none of them."""
    heads, layers = 2, 3
    stages = ((0, 2), (2, 3))
    model = _model(heads, layers, seed=11)
    keys = [bytes([80 + i]) * 16 for i in range(4)]
    saver = Instance(cluster, model, heads, tp=2, stages=stages)
    loader = Instance(cluster, _model(heads, layers, seed=12), heads, tp=2, stages=stages)
    whole = Instance(cluster, _model(heads, layers, seed=13), heads, tp=1)
    try:
        assert [(w.shard.heads, w.shard.first_layer) for w in saver.workers] == [((0,), 0), ((1,), 0), ((0,), 2),
                                                                                  ((1,), 2)]
        saver.save(keys)
        assert loader.load(keys) == set()
        _loaded_right(model, loader.view(), 4)
        staged = ChunkParts(heads, stages)
        assert all(staged.present(whole.client.lookup(staged.keys(keys))))
        assert not any(whole.client.lookup(ChunkParts(heads, ((0, layers),)).keys(keys)))
        assert whole.load(keys) == set(DST_BLOCKS)  # told to load anyway: every block fails, none is wrong
    finally:
        for inst in (saver, loader, whole):
            inst.close()


def test_a_cache_that_does_not_match_its_rank_is_refused(cluster):
    config = ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster)
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        w = WorkerSide(config, client, CHUNK, BLOCK, RankShard.of_rank(4, 2, 0, (0, 2)))
        with pytest.raises(ValueError, match="holds 4 KV heads of 2 layers, but its tensor/pipeline-parallel "
                                             "rank should hold 2 heads"):
            w.register_kv_caches(_rank_caches(_model(4, 2, seed=1), RankShard.whole(4, 2)))
        w.shutdown()


def test_parts_are_stored_one_head_wide(cluster):
    """A part's bytes are one head of its layers: what a rank stores for a chunk is its heads' share."""
    heads, layers = 4, 2
    model = _model(heads, layers, seed=21)
    key = b"\x99" * 16
    tp2 = Instance(cluster, model, heads, tp=2)
    try:
        tp2.save([key])
        parts = ChunkParts(heads, ((0, layers),))
        chunks = tp2.client.get(parts.keys([key]))
        assert [c.meta.shape for c in chunks] == [[layers, CHUNK, 1, CH]] * heads
        assert sum(c.meta.nbytes for c in chunks) == layers * CHUNK * heads * CH * 2  # no duplication
        for part, chunk in zip(parts.parts, chunks):
            arr = torch.frombuffer(bytearray(chunk.data), dtype=torch.bfloat16).view(layers, CHUNK, CH)
            src = _slots(SRC_BLOCKS, CHUNK)
            for layer in range(layers):
                want = torch.stack([model[layer][s // BLOCK, part.head, s % BLOCK] for s in src])
                assert torch.equal(arr[layer], want)
    finally:
        tp2.close()


def test_a_stored_part_of_another_shape_fails_its_chunk(cluster):
    """A part whose bytes do not fit a rank's head (another head size) is never copied in."""
    heads, layers = 2, 2
    keys = [b"\x77" * 16]
    parts = ChunkParts(heads, ((0, layers),))
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        small = np.zeros(layers * 4 * 1 * CH * 2, dtype=np.uint8)
        assert all(client.put_many([ChunkItem.of(k, small, [layers, 4, 1, CH], "bfloat16", 4)
                                    for k in parts.keys(keys)]))
    inst = Instance(cluster, _model(heads, layers, seed=3), heads, tp=1)
    try:
        assert inst.load(keys) == set(DST_BLOCKS[:2])
    finally:
        inst.close()


def test_layout_parts_match_the_keys_the_scheduler_looks_up():
    layout = KVLayout(model="m", config_fingerprint="f", kv_dtype="bfloat16", num_layers=3, num_kv_heads=2,
                      head_size=4, block_layout="BHNC", chunk_size=CHUNK)
    stored = {w.part(j).key(b"k" * 16) for w in _shards(2, 2, ((0, 3),)) for j in w.saved_heads}
    assert set(layout.parts().keys([b"k" * 16])) == stored
