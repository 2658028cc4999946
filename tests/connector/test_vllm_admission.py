"""Load admission with the real vLLM engine, when a cache node stalls in the middle of a load.

The scenario that used to turn the cache off: a node stops (SIGSTOP) while it sends a load, the
load is abandoned at its deadline (its step held about a second, not the 5 s node timeout) and
its blocks recompute, the node resumes.  Admission once took that stalled
load for a measurement of the cluster's speed and refused every load afterwards ("load 1.5 s
predicted, recompute 0.2 s") although every chunk was there.  Now the stall is a failure of
that node, and the node is trusted again by the first request after it answers: every request
after the resume loads its chunks, and its output equals the one computed.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvring.cachenode.client import ClusterClient
from kvring.engine.run import decision_between, layout_of, start_instance, write_tiny_llama
from kvring.local.cluster import LocalCluster
from greedy import greedy_difference
from placement import prompts_on, wait_saved

CHUNK = 256
TOKENS = 8 * CHUNK + 1  # 8 whole chunks: 2048 tokens to load
LOADED = 8 * CHUNK


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))



def test_a_node_stalled_mid_load_is_trusted_again_once_it_resumes(etcd_server, model, tmp_path):
    rng = np.random.default_rng(19)
    with LocalCluster(nodes=3, memory=256 << 20, etcd=etcd_server.endpoint, cluster="e2e-admission",
                      node_args=["--fault-injection"]) as cluster:
        victim = cluster.nodes[1]
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            assert client.wait_for_nodes(3)
            layout = layout_of({"model": model}, client.contract.chunk_size)
            assert layout.chunk_size == CHUNK
            prompts = prompts_on(client, layout, victim.node_id, rng, 6, size=TOKENS)  # each with parts on the victim
            # Admission, layerwise loads and the 5 s timeout that ends the stalled load: the defaults.
            conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "lookup_deadline_ms": 1000.0}
            steps = [{"tokens": rng.integers(10, 2000, size=300).tolist()},  # 0: warm-up
                     {"batch": [{"tokens": p} for p in prompts]},  # 1-6: computed and saved
                     {"touch": str(tmp_path / "computed")}, {"wait_for": str(tmp_path / "saved"), "timeout": 300},
                     {"tokens": prompts[0]}, {"tokens": prompts[1]},  # 7-8: loaded, every node healthy
                     {"post": f"{victim.admin_addr}/debug/signal-on-get?signal=SIGSTOP", "headers": cluster.node_auth},
                     {"tokens": prompts[2]},  # 9: its load stops the victim: abandoned, recomputed
                     {"signal": [victim.pid, "SIGCONT"]},
                     *({"tokens": p} for p in (prompts[3], prompts[4], prompts[5], prompts[0]))]  # 10-13
            (tmp_path / "vllm-tmp").mkdir()
            # Top logprobs kept: row 9 may differ from the batch's prefill at a near tie (``greedy.py``).
            instance = start_instance(tmp_path, "engine", {"model": model, "connector": conn, "prompts": steps,
                                                           "max_tokens": 4, "logprobs": 5}, tmpdir=tmp_path / "vllm-tmp")
            try:
                instance.wait_file(tmp_path / "computed", 600)
                wait_saved(client, layout, prompts)
                (tmp_path / "saved").touch()
                out = instance.result(timeout=900)
            finally:
                instance.stop()
    r, steps_out = out["results"], out["steps"]
    counters = [s["counters"] for s in steps_out]  # cumulative, after each generate call
    computed = {i: r[1 + i] for i in range(6)}
    rows = [(7, 0, "before"), (8, 1, "before"), (9, 2, "during"),
            (10, 3, "after"), (11, 4, "after"), (12, 5, "after"), (13, 0, "after")]
    # generate calls: 0 warm-up, 1 the batch, then one per prompt (result i is call i - 5)
    decisions = {i: decision_between(counters[i - 6], counters[i - 5]) for i, _, _ in rows}
    print("\nadmission around a stall (prompt: phase, decision, tokens loaded, TTFT):")
    for i, p, phase in rows:
        print(f"  {i:2d} prompt {p}: {phase:6s} {decisions[i]:22s} {r[i]['cached']:5d} {r[i]['ttft'] * 1000:7.0f} ms")
    for i, p, phase in rows:
        if phase == "during":  # recomputed from the stalled node's first block: equal but for a near tie
            assert (why := greedy_difference(r[i], computed[p])) is None, f"result {i}: {why}"
        else:  # loaded whole: the stored K/V, bit for bit
            assert r[i]["tokens"] == computed[p]["tokens"], f"result {i}: wrong output after a load"
    for i in (7, 8):
        assert decisions[i] == "loaded" and r[i]["cached"] == LOADED
    assert decisions[9] == "abandoned"  # the victim stopped in the middle of sending it
    # The step waited for the stalled load until its deadline (twice the predicted recompute, at
    # least 1 s), not for the 5 s node timeout, then recomputed.
    assert r[9]["ttft"] < 3.0, r[9]["ttft"]
    # After the resume every request loads all its chunks: the first as the probe of the victim.
    assert decisions[10] == "loaded (probe)" and [decisions[i] for i in (11, 12, 13)] == ["loaded"] * 3
    assert all(r[i]["cached"] == LOADED for i in (10, 11, 12, 13))
    assert counters[-1]["node_failures"] >= 1 and counters[-1].get("loads_refused:slower", 0) == 0
