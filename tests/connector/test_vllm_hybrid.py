"""Models with sliding-window layers next to full-attention ones, served by the real vLLM engine
with its hybrid KV-cache manager on (one KV-cache group per attention kind, and a sliding-window
group keeps blocks only for its window's tokens).

Each group is loaded and saved as it needs: the full-attention layers of every chunk, the
sliding-window layers only of the chunks holding the window before the load's end (the only
blocks vLLM allocates for them), and a window's part of a chunk is saved only while all its
tokens are still in that group's blocks.  Loads of several groups are async, and a load that
fails fails its request, which vLLM recomputes whole.  In every case the output after a load
equals a recompute's.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvring.cachenode.client import ClusterClient
from kvring.connector.parts import window_start
from kvring.engine.run import (decision_between, layout_of, run_instance, start_instance, write_tiny_gemma3,
                               write_tiny_sliding_llama)
from kvring.local.cluster import LocalCluster
from placement import prompts_on, wait_saved

CHUNK = 256
WINDOW = 128  # smaller than a chunk (gpt-oss's window): a window's part can leave before its chunk is whole
LAYERS = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
BLOCK = 32  # the CPU backend's block size for these models (vLLM rounds smaller ones up to it)
BYTES = 2 * 64 * 4  # per token, layer and KV head: K and V of 64 channels, float32 (2 KV heads)


@pytest.fixture(scope="module")
def sliding_llama(tmp_path_factory):
    return str(write_tiny_sliding_llama(tmp_path_factory.mktemp("hybrid") / "sliding-llama", LAYERS, WINDOW))


def _spec(model: str, conn: dict, prompts: list, **more) -> dict:
    return {"model": model, "dtype": "float32", "max_model_len": 2048, "block_size": BLOCK, "connector": conn,
            "prompts": prompts, **more}


def test_a_sliding_window_model_loads_only_its_window_and_equals_a_recompute(etcd_server, sliding_llama, tmp_path):
    rng = np.random.default_rng(3)
    # A prefills in steps of 450 tokens: for each prompt, chunk 1 ([256, 512)) is completed by the
    # step from token 450, when vLLM has freed the windows' blocks before token 320.
    whole = rng.integers(10, 2000, size=1100).tolist()  # 4 whole chunks
    chunked = rng.integers(10, 2000, size=700).tolist()  # 2 whole chunks
    with LocalCluster(nodes=2, memory=128 << 20, etcd=etcd_server.endpoint, cluster="e2e-hybrid") as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "load_admission": False,
                "lookup_deadline_ms": 10_000}
        a = run_instance(tmp_path, "A", _spec(sliding_llama, conn, [{"tokens": whole}, {"tokens": chunked}],
                                              max_num_batched_tokens=450))
        b = run_instance(tmp_path, "B", _spec(sliding_llama, conn, [
            {"tokens": whole, "salt": "b"}, {"tokens": whole}, {"tokens": chunked, "salt": "b"}, {"tokens": chunked}]))
    assert a["layout"]["windows"] == [WINDOW, WINDOW, WINDOW, 0]
    ref, loaded, chunked_ref, chunked_loaded = b["results"]
    assert ref["cached"] == 0 and loaded["cached"] == 4 * CHUNK
    assert loaded["tokens"] == ref["tokens"]
    # What the load fetched: the full-attention layer of all 4 chunks, the 3 sliding layers only
    # of the chunk holding the window before token 1024 (vLLM allocates no blocks before it).
    first = window_start(4 * CHUNK, WINDOW, BLOCK)
    assert first // CHUNK == 3
    fetched = b["steps"][1]["counters"]["loaded_bytes"] - b["steps"][0]["counters"]["loaded_bytes"]
    assert fetched == (4 * 1 + 1 * 3) * CHUNK * 2 * BYTES
    # Chunk 1's sliding part was not saved (its first tokens were gone when it was completed): a
    # load of 4 chunks never needs it (its window is in chunk 3), but one of 2 chunks does, so
    # the 700-token prompt loads 1 chunk, whose window chunk 0 holds.
    assert window_start(450, WINDOW, BLOCK) > CHUNK
    assert chunked_ref["cached"] == 0 and chunked_loaded["cached"] == CHUNK
    assert chunked_loaded["tokens"] == chunked_ref["tokens"]


def test_a_gemma3_like_model_loads_what_another_instance_stored(etcd_server, tmp_path):
    model = str(write_tiny_gemma3(tmp_path / "gemma3", layers=6, window=512))
    rng = np.random.default_rng(5)
    prompt = rng.integers(10, 2000, size=1100).tolist()
    with LocalCluster(nodes=2, memory=128 << 20, etcd=etcd_server.endpoint, cluster="e2e-gemma3") as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "load_admission": False,
                "lookup_deadline_ms": 10_000}
        a = run_instance(tmp_path, "A", _spec(model, conn, [{"tokens": prompt}]))
        b = run_instance(tmp_path, "B", _spec(model, conn, [{"tokens": prompt, "salt": "b"}, {"tokens": prompt}]))
    assert a["layout"]["windows"] == [512] * 5 + [0]
    ref, loaded = b["results"]
    assert ref["cached"] == 0 and loaded["cached"] == 4 * CHUNK
    assert loaded["tokens"] == ref["tokens"] == a["results"][0]["tokens"]



def test_a_node_stopped_or_killed_during_a_hybrid_load_ends_in_a_recompute(etcd_server, sliding_llama, tmp_path):
    rng = np.random.default_rng(11)
    with LocalCluster(nodes=3, memory=128 << 20, etcd=etcd_server.endpoint, cluster="e2e-hybrid-fail",
                      node_args=["--fault-injection"]) as cluster:
        victim = cluster.nodes[1]
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            assert client.wait_for_nodes(3)
            layout = layout_of(_spec(sliding_llama, None, []), client.contract.chunk_size)
            assert layout.chunk_size == CHUNK and layout.windows == (WINDOW, WINDOW, WINDOW, 0)
            prompts = prompts_on(client, layout, victim.node_id, rng, 3, size=1100)  # each with parts on the victim
            conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "load_admission": False,
                    "lookup_deadline_ms": 5000.0, "timeout": 3.0}
            poison = f"{victim.admin_addr}/debug/signal-on-get?signal="
            steps = [*({"tokens": p} for p in prompts),  # 0-2: computed and saved (each prefilled in one step)
                     {"touch": str(tmp_path / "computed")}, {"wait_for": str(tmp_path / "saved"), "timeout": 300},
                     {"tokens": prompts[0]},  # 3: loaded, every node healthy
                     {"post": poison + "SIGSTOP", "headers": cluster.node_auth},
                     {"tokens": prompts[1]},  # 4: its load stops the victim: times out, recomputed
                     {"signal": [victim.pid, "SIGCONT"]},
                     {"post": poison + "SIGKILL", "headers": cluster.node_auth},
                     {"tokens": prompts[2]}]  # 5: its load kills the victim: recomputed
            (tmp_path / "vllm-tmp").mkdir()
            # vLLM's own processes (not the suite's one-process engines): the loads race a stopped and
            # a killed node against their deadlines, as they do beside a production engine.
            instance = start_instance(tmp_path, "engine",
                                      {**_spec(sliding_llama, conn, steps, max_tokens=6), "in_process": False},
                                      tmpdir=tmp_path / "vllm-tmp")
            try:
                instance.wait_file(tmp_path / "computed", 600)
                wait_saved(client, layout, prompts)
                (tmp_path / "saved").touch()
                out = instance.result(timeout=600)
            finally:
                instance.stop()
    r, counters = out["results"], [s["counters"] for s in out["steps"]]
    assert out["layout"]["windows"] == list(layout.windows)
    assert r[3]["cached"] == 4 * CHUNK and r[3]["tokens"] == r[0]["tokens"]
    for i, signal in ((4, "stopped"), (5, "killed")):
        # (a stopped node's share outlasts the async load's deadline, which abandons it)
        assert decision_between(counters[i - 1], counters[i]) in ("load failed", "abandoned"), signal
        # vLLM took the failed load of several groups as a failed request and recomputed it whole.
        assert r[i]["cached"] == 0 and r[i]["tokens"] == r[i - 3]["tokens"], signal
