"""An MLA model (a small random DeepSeek-V2) served by the real vLLM engine (CPU build) through
the connector, across tensor-parallel sizes: an instance loads what another stored, and its
greedy output equals its own recompute of the same prompt.  A chunk of an MLA model is one part:
the compressed latent (576 values per token and layer, no separate K and V), the same on every
rank, so one rank stores it and every rank loads it.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvring.cachenode.client import ClusterClient
from kvring.connector.parts import ChunkPart
from kvring.engine.run import run_instance, write_tiny_deepseek
from kvring.local.cluster import LocalCluster

CHUNK = 256
TOKENS = 1100  # 4 whole chunks + 76 tokens
LAYERS, LATENT = 2, 576  # write_tiny_deepseek: 2 layers, kv_lora_rank 512 + rope 64
# This test is about what a load writes: neither a slow lookup, nor a node kept off the CPUs
# past the node timeout (a TP 2 engine's processes spin on both of this machine's cores), nor
# admission may turn it into a recompute (on this tiny model recomputing can be predicted
# faster than loading).
CONNECTOR = {"load_admission": False, "lookup_deadline_ms": 10_000, "timeout": 30.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_deepseek(tmp_path_factory.mktemp("model") / "tiny-deepseek"))


def test_mla_chunks_are_shared_across_tp_sizes(etcd_server, model, tmp_path):
    """A (TP 2) stores a prompt, B (TP 1) loads it and stores another, C (TP 2) loads that one;
    each compares its output after the load with its own recompute (a salt of its own)."""
    rng = np.random.default_rng(20)
    p, q = (rng.integers(10, 2000, size=TOKENS).tolist() for _ in range(2))
    with LocalCluster(nodes=2, memory=256 << 20, etcd=etcd_server.endpoint, cluster="e2e-mla") as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, **CONNECTOR}
        base = {"model": model, "dtype": "float32", "block_size": 16, "max_model_len": 2048, "connector": conn}
        a = run_instance(tmp_path, "A", {**base, "tensor_parallel_size": 2, "prompts": [{"tokens": p}]})
        assert a["layout"]["latent"] and a["layout"]["head_size"] == LATENT and a["layout"]["num_kv_heads"] == 1
        assert a["parts"] == [[0, 0, LAYERS]]  # one part per chunk: the latent of every layer
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            part = ChunkPart(0, 0, LAYERS)
            stored = client.get([part.key(bytes.fromhex(k)) for k in a["keys"][0][:4]])
            # Both ranks hold the same latent; one copy is stored (the first rank's).
            assert sum(client.copies().values()) == 4
        # Stored as the latent only: 576 float32 values per token and layer (no K/V factor of 2).
        assert all(c is not None and c.meta.shape == [LAYERS, CHUNK, 1, LATENT] for c in stored)
        assert all(c.data.nbytes == CHUNK * LAYERS * LATENT * 4 for c in stored)
        b = run_instance(tmp_path, "B", {**base, "prompts": [{"tokens": p, "salt": "b"}, {"tokens": p},
                                                              {"tokens": q}]})
        c = run_instance(tmp_path, "C", {**base, "tensor_parallel_size": 2,
                                         "prompts": [{"tokens": q, "salt": "c"}, {"tokens": q}]})
    for ref, loaded in (b["results"][:2], c["results"]):
        assert ref["cached"] == 0 and loaded["cached"] == 4 * CHUNK
        assert loaded["tokens"] == ref["tokens"]
