"""A model with recurrent state (a Qwen3-Next: gated-delta-net layers and full-attention ones)
served by the real vLLM engine in its ``align`` mode, through the connector.

Its chunks hold the attention layers' KV and, where vLLM handed one over, the state of the
linear-attention layers after the chunk's last token.  A load resumes from that state: it loads
the attention KV of every chunk of the hit and the state after the last one, so the hit ends
exactly where a state was saved.  The output after a load equals a recompute's, logprobs
included; a state that is not the one saved changes them (so the comparison sees the state),
and a chunk whose state is missing is not where a hit ends.  Under TP 2 each rank stores and
loads its own slice of the state; a node stopped or killed mid-load ends in a recompute.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvring.cachenode.client import ClusterClient
from kvring.common.chunk import ChunkItem
from kvring.connector.keys import KVLayout, request_keys
from kvring.connector.parts import STATE, ChunkPart
from kvring.engine.run import decision_between, run_instance, start_instance, write_tiny_qwen3_next
from kvring.local.cluster import LocalCluster
from polling import wait_for

CHUNK = 256
LAYERS = 4  # gated delta net, full attention, gated delta net, full attention
STATE_LAYERS = 2
# One gated-delta-net layer's state: its conv state (3 x 512 bfloat16) and its recurrent state
# (4 heads x 64 x 64 float32).
STATE_BYTES = 3 * 512 * 2 + 4 * 64 * 64 * 4
KV_BYTES = 2 * 2 * 64 * 2  # per token and attention layer: K and V of 2 KV heads of 64, bfloat16


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return str(write_tiny_qwen3_next(tmp_path_factory.mktemp("ssm") / "qwen3-next", layers=LAYERS))


def _spec(model: str, conn: dict, prompts: list, **more) -> dict:
    # --block-size as vLLM chooses it for this model (the connector asks for it: without it an
    # engine core of its own ends prefill steps on the platform's default blocks).
    return {"model": model, "dtype": "bfloat16", "max_model_len": 2048, "prefix_caching": True,
            "mamba_cache_mode": "align", "block_size": CHUNK, "connector": conn, "prompts": prompts, "logprobs": 5,
            **more}


def _loaded_bytes(run: dict, step: int) -> float:
    before = run["steps"][step - 1]["counters"]["loaded_bytes"] if step else 0.0
    return run["steps"][step]["counters"]["loaded_bytes"] - before


def test_a_model_with_recurrent_state_loads_what_another_instance_stored(etcd_server, qwen3_next, tmp_path):
    rng = np.random.default_rng(11)
    # 1,000 tokens: vLLM prefills [0, 768) and [768, 1000) (its align mode ends a step on the
    # last block boundary before the prompt's last token) and hands over the state at 768, the
    # end of chunk 2: a hit of 3 chunks.
    prompt = rng.integers(10, 2000, size=1000).tolist()
    with LocalCluster(nodes=2, memory=128 << 20, etcd=etcd_server.endpoint, cluster="e2e-ssm") as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "load_admission": False,
                "lookup_deadline_ms": 10_000}
        a = run_instance(tmp_path, "A", _spec(qwen3_next, conn, [{"tokens": prompt}]))
        assert a["layout"]["windows"] == [STATE, 0, STATE, 0]
        b = run_instance(tmp_path, "B", _spec(qwen3_next, conn, [{"tokens": prompt, "salt": "b"}, {"tokens": prompt}]))
        ref, loaded = b["results"]
        assert ref["cached"] == 0 and loaded["cached"] == 3 * CHUNK
        assert loaded["tokens"] == ref["tokens"] == a["results"][0]["tokens"]
        assert loaded["logprobs"] == ref["logprobs"]
        # What the load fetched: 3 chunks of both attention layers, and one state of both
        # state layers (not one per chunk).
        assert _loaded_bytes(b, 1) == 3 * CHUNK * 2 * KV_BYTES + STATE_LAYERS * STATE_BYTES

        # The state the load resumed from decides the output: the same chunks with another
        # state after them (the saved one, its recurrent state halved) load, and come out otherwise.
        state_key = ChunkPart(0, 0, LAYERS, STATE).key(bytes.fromhex(a["keys"][0][2]))
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            saved = client.get([state_key])[0]
            assert saved is not None and saved.meta.shape == [STATE_LAYERS, 1, 1, STATE_BYTES]
            other = saved.data.reshape(STATE_LAYERS, STATE_BYTES).copy()
            recurrent = other[:, 3 * 512 * 2:].view(np.float32)
            recurrent *= 0.5
            client.delete([state_key])
            assert client.put_many([ChunkItem.of(state_key, other, saved.meta.shape, "uint8", 1,
                                                 saved.meta.namespace)]) == [1]
        c = run_instance(tmp_path, "C", _spec(qwen3_next, conn, [{"tokens": prompt}]))
        assert c["results"][0]["cached"] == 3 * CHUNK
        assert c["results"][0]["logprobs"] != ref["logprobs"]

        # A state of the wrong size under its key (another writer, a damaged store): unusable,
        # so the load fails and vLLM recomputes the request, as if nothing were stored.
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            assert client.delete([state_key]) == 1
            short = other[:, :-64].copy()
            assert client.put_many([ChunkItem.of(state_key, short, [STATE_LAYERS, 1, 1, STATE_BYTES - 64], "uint8",
                                                 1, saved.meta.namespace)]) == [1]
        wrong = run_instance(tmp_path, "wrong-size", _spec(qwen3_next, conn, [{"tokens": prompt}]))
        assert decision_between({}, wrong["steps"][0]["counters"]) == "load failed"
        assert wrong["results"][0]["cached"] == 0 and wrong["results"][0]["logprobs"] == ref["logprobs"]

        # Without a state after chunk 2 no hit ends there, nor anywhere before it (no state was
        # saved at 256 or 512): the prompt is computed, and comes out as the recompute did.
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            assert client.delete([state_key]) == 1
        d = run_instance(tmp_path, "D", _spec(qwen3_next, conn, [{"tokens": prompt}]))
        assert d["results"][0]["cached"] == 0 and _loaded_bytes(d, 0) == 0
        assert d["results"][0]["logprobs"] == ref["logprobs"]


def test_a_node_stopped_or_killed_during_a_load_of_state_ends_in_a_recompute(etcd_server, qwen3_next, tmp_path):
    """The node that holds a prompt's state part is stopped (SIGSTOP) or killed as the load asks
    it for the state: the load fails (or is abandoned at its deadline), vLLM recomputes the request
    whole, and its output is the one computed without kvring."""
    rng = np.random.default_rng(12)
    with LocalCluster(nodes=3, memory=128 << 20, etcd=etcd_server.endpoint, cluster="e2e-ssm-fail",
                      node_args=["--fault-injection"]) as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "load_admission": False,
                "lookup_deadline_ms": 5000.0, "timeout": 3.0}
        # The keys' namespace names the model's directory and the state's format, which only an
        # engine knows: one started with no prompt gives the layout, which places the prompts.
        layout = KVLayout(**{**run_instance(tmp_path, "layout", _spec(qwen3_next, conn, []))["layout"],
                             "windows": (STATE, 0, STATE, 0)})
        stopped, killed = cluster.nodes[0], cluster.nodes[1]
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            assert client.wait_for_nodes(3)

            def state_owner(prompt: list[int]) -> str:
                return client.owners(ChunkPart(0, 0, LAYERS, STATE).key(request_keys(layout, prompt)[2]))[0]

            prompts = [rng.integers(10, 2000, size=1000).tolist()]
            for node in (stopped, killed):  # a prompt whose state part the node owns
                prompts.append(next(p for p in iter(lambda: rng.integers(10, 2000, size=1000).tolist(), None)
                                    if state_owner(p) == node.node_id))
        a = run_instance(tmp_path, "A", _spec(qwen3_next, conn, [{"tokens": p} for p in prompts]))
        assert a["layout"]["state_format"] == layout.state_format

        def poison(node, signal: str) -> dict:
            return {"post": f"{node.admin_addr}/debug/signal-on-get?signal={signal}", "headers": cluster.node_auth}

        steps = [{"tokens": prompts[0]},  # 0: loaded, every node healthy
                 poison(stopped, "SIGSTOP"), {"tokens": prompts[1]},  # 1: its load stops the state's node
                 {"signal": [stopped.pid, "SIGCONT"]},
                 poison(killed, "SIGKILL"), {"tokens": prompts[2]},  # 2: its load kills the state's node
                 # 3-5: the same prompts recomputed by this engine (an engine of vLLM's own processes
                 # and one in this process round bfloat16 sums differently: compare within one)
                 *({"tokens": p, "salt": "ref"} for p in prompts)]
        # vLLM's own processes (not the suite's one-process engines): the loads race a stopped and
        # a killed node against their deadlines, as they do beside a production engine.
        (tmp_path / "vllm-tmp").mkdir()
        instance = start_instance(tmp_path, "B", {**_spec(qwen3_next, conn, steps), "in_process": False},
                                  tmpdir=tmp_path / "vllm-tmp")
        try:
            out = instance.result(timeout=600)
        finally:
            instance.stop()
    r, counters = out["results"], [s["counters"] for s in out["steps"]]
    assert len(r) == 6 and all(x["cached"] == 0 for x in r[3:])
    assert r[0]["cached"] == 3 * CHUNK and r[0]["logprobs"] == r[3]["logprobs"]
    for i in (1, 2):
        assert decision_between(counters[i - 1], counters[i]) in ("load failed", "abandoned"), i
        # vLLM took the failed load of several groups as a failed request and recomputed it whole.
        assert r[i]["cached"] == 0 and r[i]["logprobs"] == r[i + 3]["logprobs"], i
    assert [x["tokens"] for x in r[:3]] == [x["tokens"] for x in a["results"]]


def test_under_tensor_parallelism_each_rank_saves_and_loads_its_slice_of_the_state(etcd_server, qwen3_next, tmp_path):
    """TP 2: each rank holds half the state's heads and stores its slice as a part of its own.
    One engine computes a prompt, forgets it (vLLM's own prefix cache reset) and loads it from
    the cluster: both ranks' slices and KV, output equal to the recompute's.  A TP 1 instance
    (whose state is one slice of other shapes) finds none of it: a miss, never another's slices."""
    rng = np.random.default_rng(13)
    prompt = rng.integers(10, 2000, size=1000).tolist()
    with LocalCluster(nodes=2, memory=128 << 20, etcd=etcd_server.endpoint, cluster="e2e-ssm-tp") as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "load_admission": False,
                "lookup_deadline_ms": 10_000}
        steps = [{"tokens": prompt, "salt": "ref"}, {"tokens": prompt}, {"touch": str(tmp_path / "computed")},
                 {"wait_for": str(tmp_path / "saved"), "timeout": 300}, {"reset_local_cache": True},
                 {"tokens": prompt}]
        (tmp_path / "vllm-tmp").mkdir()
        instance = start_instance(tmp_path, "TP2", _spec(qwen3_next, conn, steps, tensor_parallel_size=2),
                                  tmpdir=tmp_path / "vllm-tmp")
        try:
            instance.wait_file(tmp_path / "computed", 600)
            with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
                # 3 chunks of 2 KV heads, and the state after the third in 2 slices (the saves
                # run behind the steps): 8 parts.  The salted recompute stored as many.
                wait_for(lambda: sum(client.copies().values()) >= 16, timeout=60, what=f"16 parts: {client.copies()}")
            (tmp_path / "saved").touch()
            tp2 = instance.result(timeout=600)
        finally:
            instance.stop()
        tp1 = run_instance(tmp_path, "TP1", _spec(qwen3_next, conn, [{"tokens": prompt}]))
    ref, computed, loaded = tp2["results"]
    assert ref["cached"] == computed["cached"] == 0 and loaded["cached"] == 3 * CHUNK
    assert loaded["logprobs"] == ref["logprobs"] and computed["tokens"] == ref["tokens"]
    # Each rank fetched its half of the KV and of the state: together (the counters sum the
    # ranks') the bytes of a TP 1 load, the state in two halves.
    assert _loaded_bytes(tp2, 2) == 3 * CHUNK * 2 * KV_BYTES + STATE_LAYERS * STATE_BYTES
    assert tp1["results"][0]["cached"] == 0 and tp1["results"][0]["tokens"] == ref["tokens"]
