"""The pool's KV events as one stream (``PoolEvents``), read by NVIDIA Dynamo's real KV indexer.

Real etcd, three real node processes, one real vLLM engine (CPU build, tiny random Llama) saving
prompts through the connector, and ``python -m dynamo.indexer`` with the pool stream registered
as one worker.  After every change -- the prompts stored, the relay restarted, the indexer
restarted, a delete, a node restarted empty, evictions, a flush -- the indexer must credit each
prompt with exactly the blocks the pool holds for it (the leading run of its chunks present on the
nodes, asked of the nodes themselves), and a prompt never stored with nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from dynamo_indexer import DynamoIndexer
from polling import wait_for

from kvring.cachenode.client import ClusterClient
from kvring.cachenode.pool_events import PoolEvents
from kvring.common.chunk import ChunkItem
from kvring.connector.parts import ChunkPart
from kvring.events.publisher import PublisherSettings
from kvring.events.relay import RelaySettings
from kvring.local.cluster import LocalCluster

BLOCK = 128  # the CPU backend's block size
CHUNK = 256  # the cluster's chunk size: 2 blocks a chunk
WORKER = 7  # the pool's worker id at the indexer


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(23)
    a = rng.integers(10, 2000, size=1100).tolist()  # 4 whole chunks (8 blocks) + 76 tokens
    b = a[:600] + rng.integers(10, 2000, size=500).tolist()  # shares chunks 0-1 with a
    c = rng.integers(10, 2000, size=800).tolist()  # 3 chunks
    never = rng.integers(10, 2000, size=1100).tolist()  # never stored
    return {"a": a, "b": b, "c": c, "never": never}


class Pool:
    """The cluster, its pool stream and the indexer following it, and what the engine stored."""

    def __init__(self, cluster: LocalCluster, indexer: DynamoIndexer, prompts: dict) -> None:
        self.cluster, self.indexer, self.prompts = cluster, indexer, prompts
        self.stream: PoolEvents | None = None
        self.keys: dict[str, list[bytes]] = {}
        self.saved: list[ChunkItem] = []  # every part the engine stored, as it stored it

    def stored(self, run: dict) -> None:
        """Take the engine run's chunk keys: each chunk's blocks are announced under the key of its
        first KV head's part."""
        announcing = next(ChunkPart(*p) for p in run["parts"] if ChunkPart(*p).announces)
        names = [n for n in self.prompts if n != "never"]
        self.keys = {n: [announcing.key(bytes.fromhex(k)) for k in keys] for n, keys in zip(names, run["keys"])}
        self.keys["never"] = []
        parts = [ChunkPart(*p) for p in run["parts"]]
        with ClusterClient(self.cluster.etcd, cluster=self.cluster.cluster) as client:
            chunks = client.get([p.key(bytes.fromhex(k)) for keys in run["keys"] for k in keys for p in parts])
        assert all(chunks), "a part the engine stored is missing"
        self.saved = [ChunkItem(c.key, c.data, c.meta) for c in chunks]

    def start_stream(self, ports: tuple[int, int] = (0, 0)) -> PoolEvents:
        settings = RelaySettings(publisher=PublisherSettings(port=ports[0], replay_port=ports[1], xpub=True),
                                 check_interval=0.5)
        self.stream = PoolEvents(self.cluster.etcd, self.cluster.cluster, settings, interval=0.2)
        return self.stream

    def held(self) -> dict[str, int]:
        """Blocks of each prompt the pool holds, asked of the nodes: its leading chunks present."""
        with ClusterClient(self.cluster.etcd, cluster=self.cluster.cluster) as client:
            out = {}
            for name, keys in self.keys.items():
                present = client.lookup(keys) if keys else []
                lead = next((i for i, p in enumerate(present) if not p), len(present))
                out[name] = lead * CHUNK // BLOCK
            return out

    def credited(self) -> dict[str, int]:
        """Blocks of each prompt the indexer credits to the pool's worker."""
        return {name: self.indexer.credited(tokens).get(WORKER, 0) // BLOCK for name, tokens in self.prompts.items()}

    def agree(self, what: str, timeout: float = 15.0) -> dict[str, int]:
        held = self.held()
        wait_for(lambda: self.credited() == held, timeout, f"the indexer to credit what the pool holds ({what}): "
                 f"{held}")
        return held


@pytest.fixture(scope="module")
def pool(etcd_server, prompts, tmp_path_factory):
    from kvring.engine.run import write_tiny_llama

    tmp = tmp_path_factory.mktemp("dynamo")
    model = str(write_tiny_llama(tmp / "tiny-llama"))
    with LocalCluster(nodes=3, memory=4 << 20, etcd=etcd_server.endpoint, cluster="dynamo-pool") as cluster:
        indexer = DynamoIndexer(BLOCK, tmp_path_factory.mktemp("dynamo-indexer")).start()
        pool = Pool(cluster, indexer, prompts)
        try:
            stream = pool.start_stream()
            indexer.register(WORKER, stream.events_addr, stream.replay_addr)
            spec = {"model": model, "connector": cluster.connector(),
                    "prompts": [{"tokens": prompts[n]} for n in ("a", "b", "c")]}
            (tmp / "spec.json").write_text(json.dumps(spec))
            proc = subprocess.run([sys.executable, "-P", "-m", "kvring.engine.run", str(tmp / "spec.json"),
                                   str(tmp / "out.json")], capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-5000:]
            pool.stored(json.loads((tmp / "out.json").read_text()))
            yield pool
        finally:
            if pool.stream is not None:
                pool.stream.close()
            indexer.stop()


def test_the_indexer_credits_every_block_the_pool_holds_and_nothing_for_a_prompt_never_stored(pool):
    held = pool.agree("the prompts stored")
    assert held == {"a": 8, "b": 8, "c": 6, "never": 0}
    # The prompts' chunks are spread over the nodes: crediting each node as a worker of its own
    # would credit a prompt only up to its first chunk held elsewhere than its first.
    with ClusterClient(pool.cluster.etcd, cluster=pool.cluster.cluster) as client:
        owners = {name: [client.owners(k)[0] for k in keys] for name, keys in pool.keys.items() if keys}
    assert any(len(set(nodes)) > 1 for nodes in owners.values()), owners
    # Credited in the indexer's CPU tier (the events say medium "CPU"), not its device tier.
    tiers = pool.indexer.query(pool.prompts["a"])["instances"][str(WORKER)]
    assert (tiers["cpu"], tiers["gpu"]) == (8 * BLOCK, 0)
    print(f"\nowners {owners}\nindexer credits (blocks) {pool.credited()}\npool holds (blocks) {held}\n"
          f"answer for a: {pool.indexer.query(pool.prompts['a'])}\n"
          f"answer for never: {pool.indexer.query(pool.prompts['never'])}")


def test_a_restarted_relay_is_followed_again_on_its_ports(pool):
    ports = (pool.stream.relay.publisher.port, pool.stream.relay.publisher.replay_port)
    pool.stream.close()
    pool.start_stream(ports)
    assert pool.agree("the relay restarted") == {"a": 8, "b": 8, "c": 6, "never": 0}


def test_a_restarted_indexer_learns_the_whole_pool(pool):
    pool.indexer.stop()
    pool.indexer.start()
    assert pool.indexer.workers() == []  # it starts knowing nothing
    pool.indexer.register(WORKER, pool.stream.events_addr, pool.stream.replay_addr)
    assert pool.agree("the indexer restarted") == {"a": 8, "b": 8, "c": 6, "never": 0}


def test_a_deleted_chunk_takes_what_chains_through_it(pool):
    with ClusterClient(pool.cluster.etcd, cluster=pool.cluster.cluster) as client:
        assert client.delete([pool.keys["b"][2]]) == 1  # b's third chunk: b keeps 2 chunks
    assert pool.agree("a delete") == {"a": 8, "b": 4, "c": 6, "never": 0}


def test_a_node_restarted_empty_withdraws_its_chunks(pool):
    with ClusterClient(pool.cluster.etcd, cluster=pool.cluster.cluster) as client:
        node = client.owners(pool.keys["c"][1])[0]
    pool.cluster.restart_empty(next(i for i, n in enumerate(pool.cluster.nodes) if n.node_id == node))
    held = pool.agree("a node restarted empty", timeout=30)
    assert held["c"] <= 2


def test_evictions_are_followed(pool):
    with ClusterClient(pool.cluster.etcd, cluster=pool.cluster.cluster) as client:
        key = pool.keys["a"][0]
        node = client.owners(key)[0]
        filler = [ChunkItem.of_array(i.to_bytes(16, "big"), np.zeros((2, 64 << 10), dtype=np.float32),
                                     tokens=CHUNK) for i in range(1, 40)]  # 512 KiB each, no blocks

        def evicted() -> bool:
            """Fill the key's node again; a chunk still under a lookup's lease outlives the
            fillers until its lease runs out."""
            client.put_to({node: filler})
            return client.lookup([key]) == [False]

        wait_for(evicted, 30, "the chunk evicted by the fillers", interval=0.5)
    assert pool.agree("evictions")["a"] == 0


def test_a_flushed_namespace_is_withdrawn(pool):
    # The evictions took every chunk with a part on the flooded node (their anchors were deleted):
    # the prompts are stored again as the engine stored them, then their namespace is flushed.
    with ClusterClient(pool.cluster.etcd, cluster=pool.cluster.cluster) as client:
        client.put_many(pool.saved)
        assert pool.agree("the prompts stored again") == {"a": 8, "b": 8, "c": 6, "never": 0}
        assert client.flush_namespace(pool.saved[0].meta.namespace) > 0
    assert pool.agree("a flush") == {"a": 0, "b": 0, "c": 0, "never": 0}
