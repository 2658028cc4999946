"""Tensor- and pipeline-parallel vLLM engines (CPU build, workers in processes of their own)
sharing chunks through a real cluster: what TP 2 stored, TP 2 and TP 1 load; what TP 1 stored,
TP 2 loads; a PP 2 engine loads what its stages stored; and a node stopped or killed in the
middle of a TP 2 load ends in a recompute.  Every engine compares its output after a load with
its own recompute of the same prompt (under a salt of its own, so nothing can be loaded for it):
a TP 2 engine's greedy tokens can differ from a TP 1 engine's in the last bits of their sums.

One cluster and five engines for the module; each engine runs all of its prompts in one start.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from polling import wait_for

from kvring.cachenode.client import ClusterClient
from kvring.connector.parts import ChunkPart, ChunkParts
from kvring.engine.run import run_instance, start_instance, write_tiny_llama
from kvring.local.cluster import LocalCluster

CHUNK = 256
TOKENS = 1100  # 4 whole chunks + 76 tokens
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64  # write_tiny_llama's defaults: hidden 256, 4 heads
# These tests are about what a load writes, so neither a slow lookup nor admission may turn a load
# into a recompute: two workers busy-polling this machine's 2 CPUs can starve the engine core's
# lookups past the default 250 ms deadline (a miss), and on this tiny model recomputing can be
# predicted faster than loading.
CONNECTOR = {"load_admission": False, "lookup_deadline_ms": 10_000}
# How long a node may stay silent before the connector fails its parts (and ejects it for a
# while): the module's stopped node shows it.  Not the default's 5 s, to keep the module short,
# nor much less: with two workers, two nodes and etcd on 2 CPUs, a healthy node has been seen
# silent for 2 s under extra load, and an ejected node's chunks are misses for that client.
NODE_TIMEOUT = 4.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(18)
    return {name: rng.integers(10, 2000, size=TOKENS).tolist() for name in ("tp2", "tp2b", "tp1", "pp")}


class _NodeLines(logging.Handler):
    """The nodes' output (``LocalCluster`` passes it on to its logger), kept for ``_why``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def node_lines():
    log = logging.getLogger("kvring.local.cluster")
    handler, level = _NodeLines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield handler.lines
    log.removeHandler(handler)
    log.setLevel(level)


@pytest.fixture(scope="module")
def cluster(etcd_server, node_lines):
    with LocalCluster(nodes=2, memory=256 << 20, etcd=etcd_server.endpoint, cluster="e2e-parallel",
                      node_args=["--fault-injection"]) as c:
        yield c


@pytest.fixture(scope="module")
def runs(cluster, node_lines, model, prompts, tmp_path_factory):
    """The module's engines, in order: A (TP 2) stores two prompts; B1 (TP 1) loads one and stores
    a third; B2 (TP 2) loads the other and the third, then loads while a node stops and while one
    dies; P (PP 2) stores a prompt and loads it back."""
    tmp = tmp_path_factory.mktemp("parallel")
    conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, **CONNECTOR, "timeout": NODE_TIMEOUT}
    base = {"model": model, "dtype": "float32", "connector": conn, "max_model_len": 2048}
    stop, die = cluster.nodes[0], cluster.nodes[1]
    out = {"A": run_instance(tmp, "A", {**base, "tensor_parallel_size": 2, "prompts": [
        {"tokens": prompts["tp2"]}, {"tokens": prompts["tp2b"]}]})}
    out["B1"] = run_instance(tmp, "B1", {**base, "prompts": [
        {"tokens": prompts["tp2"], "salt": "ref"}, {"tokens": prompts["tp2"]},  # 0-1: TP 2 -> TP 1
        {"tokens": prompts["tp1"]}]})  # 2: computed and stored by TP 1
    parts = ChunkParts(KV_HEADS, ((0, LAYERS),))
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:  # what each stored, node by node
        out["stored"] = {"tp2": _stored_parts(client, out["A"]["keys"][0], parts),
                         "tp1": _stored_parts(client, out["B1"]["keys"][2], parts)}
    out["B2"] = run_instance(tmp, "B2", {**base, "tensor_parallel_size": 2, "prompts": [
        {"tokens": prompts["tp2b"], "salt": "ref"}, {"tokens": prompts["tp2b"]},  # 0-1: TP 2 -> TP 2
        {"tokens": prompts["tp1"], "salt": "ref"}, {"tokens": prompts["tp1"]},  # 2-3: TP 1 -> TP 2
        {"tokens": prompts["tp2"], "salt": "ref"},  # 4
        {"post": f"{stop.admin_addr}/debug/signal-on-get?signal=SIGSTOP", "headers": cluster.node_auth},
        {"tokens": prompts["tp2"]},  # 5: the first GET of its load stops a node
        {"signal": [stop.pid, "SIGCONT"]},
        {"post": f"{die.admin_addr}/debug/signal-on-get?signal=SIGKILL", "headers": cluster.node_auth},
        {"tokens": prompts["tp2b"]}]})  # 6: the first GET of its load kills the other node
    assert die.proc.poll() is not None  # the node killed itself at that GET
    out["logs"] = {name: tmp / f"{name}.log" for name in ("A", "B1", "B2")}
    out["node_lines"] = node_lines
    return out


def _why(runs, name: str, i: int) -> str:
    """What instance ``name``'s connector counted during its prompt ``i`` (what changed), the
    kvring lines of its log and the nodes' last lines: a failed load or lookup says here whether
    a node was ejected, a lookup failed or ran past its deadline, or nothing was found."""
    steps = runs[name]["steps"]
    before = steps[i - 1]["counters"] if i else {}
    changed = {k: v - before.get(k, 0) for k, v in steps[i]["counters"].items() if v != before.get(k, 0)}
    lines = [line for line in runs["logs"][name].read_text(errors="replace").splitlines()
             if ("kvring" in line.lower() or "ejected" in line) and "KVRingConnector" not in line]
    return (f"{name} prompt {i}: counters changed {changed}; the run's kvring log lines:\n" + "\n".join(lines[-30:])
            + "\nthe nodes' last lines:\n" + "\n".join(runs["node_lines"][-30:]))


def _stored_parts(client: ClusterClient, keys: list[str], parts: ChunkParts) -> list[tuple[int, bytes | None]]:
    """Each part of the chunks ``keys`` as stored: its bytes (0: missing) and the anchor it names."""
    chunks = client.get(parts.keys([bytes.fromhex(k) for k in keys]))
    return [(c.meta.nbytes, c.meta.anchor) if c is not None else (0, None) for c in chunks]


def _anchors(keys: list[str], parts: ChunkParts) -> list[bytes | None]:
    """The anchor each part of the chunks ``keys`` must name: the chunk's announcing part's key,
    on every full-attention part but that one (``ChunkPart.anchored_by``)."""
    return [parts.anchor.key(k) if p.anchored_by(parts.anchor) else None
            for k in (bytes.fromhex(k) for k in keys) for p in parts.parts]


def test_tp2_stores_each_head_once_and_in_the_layout_tp1_stores(runs):
    """A chunk's parts are one KV head each, the same whatever the TP size that stored them, and
    a TP 2 instance stores exactly the bytes a TP 1 instance stores (no head twice)."""
    a, b1 = runs["A"], runs["B1"]
    assert a["layout"] == b1["layout"]  # the same keys: the layout names no TP size
    assert a["parts"] == b1["parts"] == [[h, 0, LAYERS] for h in range(KV_HEADS)]
    one_part = LAYERS * CHUNK * 2 * HEAD_DIM * 4  # K and V of one head, float32
    tp2, tp1 = runs["stored"]["tp2"], runs["stored"]["tp1"]
    assert [n for n, _ in tp2] == [n for n, _ in tp1] == [one_part] * (4 * KV_HEADS)
    # Head 1's parts (TP 2: rank 1's) name their chunk's anchor, head 0's part (rank 0's).
    parts = ChunkParts(KV_HEADS, ((0, LAYERS),))
    assert [anchor for _, anchor in tp2] == _anchors(a["keys"][0], parts)
    assert [anchor for _, anchor in tp1] == _anchors(b1["keys"][2], parts)
    assert sum(anchor is not None for _, anchor in tp2) == 4 * (KV_HEADS - 1)


def test_tp1_loads_what_tp2_stored(runs):
    b1 = runs["B1"]["results"]
    assert runs["A"]["results"][0]["cached"] == 0
    assert b1[0]["cached"] == 0 and b1[1]["cached"] == 4 * CHUNK, _why(runs, "B1", 1)
    assert b1[1]["tokens"] == b1[0]["tokens"]


def test_tp2_loads_what_tp2_and_tp1_stored(runs):
    b2 = runs["B2"]["results"]
    assert b2[1]["cached"] == 4 * CHUNK, _why(runs, "B2", 1)  # stored by TP 2
    assert b2[1]["tokens"] == b2[0]["tokens"]
    assert b2[3]["cached"] == 4 * CHUNK, _why(runs, "B2", 3)  # stored by TP 1
    assert b2[3]["tokens"] == b2[2]["tokens"]


def test_a_node_stopped_or_killed_during_a_tp2_load_ends_in_a_recompute(runs):
    b2 = runs["B2"]
    r, steps = b2["results"], b2["steps"]
    failed = [s["counters"]["failed_blocks"] for s in steps]  # cumulative, after each generate call
    assert failed[4] == 0  # every load before went through whole
    # Both loads lost the parts the node held (with 2 nodes each chunk has parts on both): their
    # blocks were reported and vLLM recomputed them ("Recovered from KV load failure"; its
    # num_cached_tokens still counts what the lookup found).  The output is the recompute's.
    assert failed[5] > failed[4] and r[5]["tokens"] == r[4]["tokens"]
    assert failed[6] > failed[5] and r[6]["tokens"] == r[0]["tokens"]
    # The step waited for the stopped node's parts until the load's deadline (twice the predicted
    # recompute, 1 s at least) or the connector's timeout, whichever came first.
    assert r[5]["ttft"] >= 1.0


@pytest.fixture(scope="module")
def pp_run(etcd_server, model, prompts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp")
    computed, stored_all = tmp / "computed", tmp / "stored"
    with LocalCluster(nodes=2, memory=256 << 20, etcd=etcd_server.endpoint, cluster="e2e-pp") as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, **CONNECTOR}
        instance = start_instance(tmp, "P", {
            "model": model, "dtype": "float32", "connector": conn, "max_model_len": 2048, "pipeline_parallel_size": 2,
            "prompts": [{"tokens": prompts["pp"], "salt": "ref"},  # 0: the recompute
                        {"tokens": prompts["pp"]},  # 1: computed, each stage saves its layer
                        {"touch": str(computed)}, {"wait_for": str(stored_all), "timeout": 120},
                        {"tokens": prompts["pp"]}]})  # 2: each stage loads its layer
        try:
            with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
                # Saves finish in the background, each stage's on its own: wait until the cluster
                # holds every part of both computed prompts (2 x 4 chunks x 2 heads x 2 stages).
                instance.wait_file(computed, timeout=600)
                wait_for(lambda: len({k for n in client.members for k in client.list_keys(n)}) >= 32, 30,
                         "every stage's parts stored")
                stored_all.touch()
                out = instance.result(timeout=600)
                stored = {k for n in client.members for k in client.list_keys(n)}
                stages = ChunkParts(KV_HEADS, ((0, 1), (1, 2)))
                out["anchors"] = [c.meta.anchor if c is not None else b"missing"
                                  for c in client.get(stages.keys([bytes.fromhex(k) for k in out["keys"][1]]))]
        finally:
            instance.stop()
    return out, stored


def test_pp2_stages_store_and_load_their_own_layers(pp_run, prompts):
    out, stored = pp_run
    r = out["results"]
    # One layer per stage: each chunk is stored as 2 heads x 2 stages, parts no PP 1 instance has.
    assert out["parts"] == [[0, 0, 1], [1, 0, 1], [0, 1, 2], [1, 1, 2]]
    keys = [bytes.fromhex(k) for k in out["keys"][1]]
    stages = ChunkParts(KV_HEADS, ((0, 1), (1, 2)))
    assert set(stages.keys(keys)) <= stored
    # Every part but head 0 of the first stage (both stages' workers) names that part as its anchor.
    assert out["anchors"] == _anchors(out["keys"][1], stages)
    assert out["anchors"][:4] == [None] + [ChunkPart(0, 0, 1).key(keys[0])] * 3
    assert stored.isdisjoint(ChunkPart(h, 0, LAYERS).key(k) for h in range(KV_HEADS) for k in keys)
    assert r[1]["cached"] == 0 and r[2]["cached"] == 4 * CHUNK
    assert r[1]["tokens"] == r[0]["tokens"] and r[2]["tokens"] == r[0]["tokens"]
