"""KVRingConnector with the real vLLM engine (CPU build), real etcd and real nodes.

Each vLLM instance runs in a process of its own (``kvring.engine.run``), as separate pods would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from faults import inject
from greedy import greedy_difference
from kv_event_tap import EventTap, removed_hashes, replay, stored_hashes, vllm_block_hashes
from polling import wait_for
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

from kvring.cachenode.client import ClusterClient
from kvring.connector.parts import ChunkPart
from kvring.local.cluster import LocalCluster

CHUNK = 256


def _run(tmp: Path, name: str, spec: dict) -> dict:
    (tmp / f"{name}.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-P", "-m", "kvring.engine.run", str(tmp / f"{name}.json"),
                           str(tmp / f"{name}.out")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads((tmp / f"{name}.out").read_text())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvring.engine.run import write_tiny_llama
    return str(write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    p1 = rng.integers(10, 2000, size=1100).tolist()  # 4 whole chunks + 76 tokens
    p2 = p1[:600] + rng.integers(10, 2000, size=500).tolist()  # shares chunks 0-1 with p1
    return p1, p2


@pytest.fixture(scope="module")
def reference(etcd_server, model, prompts, tmp_path_factory):
    """The prompts recomputed by vLLM: each under a salt of its own, so nothing can be loaded.

    The reference engine has the connector configured too: with this vLLM CPU build any
    kv_transfer_config (vLLM's own ExampleConnector as well) changes greedy tokens of some
    prompts against an engine configured without one, even when nothing is loaded; the
    property tested here is that loading from kvring never changes what that engine computes.
    """
    p1, p2 = prompts
    tmp = tmp_path_factory.mktemp("ref")
    with LocalCluster(nodes=1, memory=256 << 20, etcd=etcd_server.endpoint, cluster="e2e-ref") as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster}
        out = _run(tmp, "ref", {"model": model, "connector": conn, "prompts": [
            {"tokens": p, "salt": f"ref-{i}"} for i, p in enumerate([p1, p2, p1[:512] + p2[700:], p1[:1024]])]})
    assert all(r["cached"] == 0 for r in out["results"])
    return [r["tokens"] for r in out["results"]]


def _stored_keys(client: ClusterClient) -> set[str]:
    return {k.hex() for n in client.members for k in client.list_keys(n)}


def _part_keys(run: dict, chunk_keys) -> set[str]:
    """The keys of every part (one per KV head) of chunks ``chunk_keys`` (hex), as ``run`` stores them."""
    return {ChunkPart(*p).key(bytes.fromhex(k)).hex() for k in chunk_keys for p in run["parts"]}


@pytest.mark.parametrize("mode", ["layerwise", "bulk"])
def test_second_instance_loads_what_the_first_computed(etcd_server, model, prompts, reference, mode, tmp_path):
    p1, p2 = prompts
    encrypted = mode == "layerwise"  # one of the two runs goes over the mutual-TLS data plane
    with LocalCluster(nodes=3, memory=256 << 20, etcd=etcd_server.endpoint, cluster=f"e2e-{mode}",
                      tls=encrypted) as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "load_mode": mode,
                **({"tls_dir": str(cluster.tls.directory)} if encrypted else {})}
        with ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=cluster.tls) as client:
            nodes = list(client.members.values())
        tap = EventTap([n.events_addr for n in nodes])  # the pool's KV events, followed live
        try:
            a = _run(tmp_path, "A", {"model": model, "connector": conn, "prompts": [{"tokens": p1}, {"tokens": p2}]})
            with ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=cluster.tls) as client:
                # Exactly the whole chunks of both prompts (their shared 2 chunks once).
                expected = {k for keys in a["keys"] for k in keys}
                assert len(a["keys"][0]) == 4 and len(a["keys"][1]) == 4 and len(expected) == 6
                assert _stored_keys(client) == _part_keys(a, expected)  # 2 KV heads: 2 parts a chunk
                _check_kv_events(tap, nodes, cluster.cluster, p1, p2)
            stats = tmp_path / "B.loads.jsonl"
            b = _run(tmp_path, "B", {"model": model, "connector": {**conn, "stats_path": str(stats)}, "prompts": [
                {"tokens": p1}, {"tokens": p2}, {"tokens": p1[:512] + p2[700:]}, {"tokens": p1, "salt": "tenant-b"},
                {"tokens": p1[:1024]}]})
            # Deleting a chunk (p2's last: both its parts) announces the removal of exactly its 2 blocks.
            with ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=cluster.tls) as client:
                assert client.delete([bytes.fromhex(k) for k in _part_keys(a, [a["keys"][1][3]])]) == 2
            wait_for(lambda: removed_hashes(tap.events()), 10, "the deleted chunk's removal announced")
            assert removed_hashes(tap.events()) == vllm_block_hashes(p2[:4 * CHUNK], 128)[6:8]
        finally:
            tap.close()
    outs = [r["tokens"] for r in b["results"]]
    cached = [r["cached"] for r in b["results"]]
    loads = [json.loads(line) for line in stats.read_text().splitlines()]
    assert loads and all(x["landed_bytes"] == x["bytes"] > 0 for x in loads)  # received straight into the cache
    # Where each load's time went on its thread: some on a CPU (it decrypts), and no more on a CPU
    # or runnable than the load took (the clock runs over the job, inside its seconds; the kernel's
    # figures lag by up to a scheduler tick, 10 ms at most).
    assert all(0 < x["thread_cpu_seconds"] and 0 <= x["thread_runqueue_seconds"]
               and x["thread_cpu_seconds"] + x["thread_runqueue_seconds"] <= x["seconds"] + 0.011 for x in loads)
    assert outs[:3] == reference[:3] and outs[3] == reference[0] and outs[4] == reference[3]
    assert [r["tokens"] for r in a["results"]] == reference[:2]
    # Every whole chunk; k chunks; another salt: nothing; a prompt that is all cached (exactly 4
    # chunks): every token but the last (vLLM computes it; the load copies its block whole).
    assert cached == [4 * CHUNK, 4 * CHUNK, 2 * CHUNK, 0, 1024 - 1]


def _check_kv_events(tap: EventTap, nodes: list, cluster: str, p1: list[int], p2: list[int]) -> None:
    """The pool announced every block A saved under the hash vLLM gives it, to a live subscriber
    and through each node's replay."""
    block = 128  # the CPU backend's block size: 2 blocks per chunk
    p1_hashes, p2_hashes = vllm_block_hashes(p1[:4 * CHUNK], block), vllm_block_hashes(p2[:4 * CHUNK], block)
    assert p1_hashes[:4] == p2_hashes[:4] and len(set(p1_hashes + p2_hashes)) == 12  # 2 chunks shared
    wait_for(lambda: len(stored_hashes(tap.events())) >= 12, 10, "the stores of 6 chunks announced")
    live = [e for e in tap.events() if not isinstance(e, AllBlocksCleared)]  # (the nodes started before)
    assert sorted(stored_hashes(live)) == sorted(set(p1_hashes + p2_hashes))  # each chunk once (R=1)
    tokens_of = {h: p[i * block:(i + 1) * block] for p, hs in ((p1, p1_hashes), (p2, p2_hashes))
                 for i, h in enumerate(hs)}
    for e in live:
        assert isinstance(e, BlockStored)
        assert (e.medium, e.locality, e.ownership, e.block_size) == ("CPU", "REMOTE", f"kvring/{cluster}", block)
        assert e.token_ids == [t for h in e.block_hashes for t in tokens_of[h]]
        parent = {h: p for hs in (p1_hashes, p2_hashes) for p, h in zip([None, *hs], hs)}[e.block_hashes[0]]
        assert e.parent_block_hash == parent
    # A subscriber that joins now gets each node's history through its replay socket: the node
    # starting empty (AllBlocksCleared), then every store it announced.
    replayed = []
    for node in nodes:
        batches = replay(node.events_replay_addr)
        assert [seq for seq, _ in batches] == list(range(len(batches)))
        assert isinstance(batches[0][1].events[0], AllBlocksCleared)
        replayed += [e for _, batch in batches for e in batch.events if not isinstance(e, AllBlocksCleared)]
    assert sorted(stored_hashes(replayed)) == sorted(stored_hashes(live))


def test_node_killed_between_instances_gives_the_recomputes_output(etcd_server, model, prompts, tmp_path):
    p1, p2 = prompts
    with LocalCluster(nodes=3, memory=256 << 20, etcd=etcd_server.endpoint, cluster="e2e-kill") as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "timeout": 1.0}
        a = _run(tmp_path, "A", {"model": model, "connector": conn, "prompts": [{"tokens": p1}, {"tokens": p2}]})
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            owners = [client.owners(ChunkPart(*a["parts"][0]).key(bytes.fromhex(k)))[0] for k in a["keys"][0]]
        victim = next(n for n in cluster.nodes if n.node_id == owners[1])  # holds a part of p1's second chunk
        victim.kill()
        # Top logprobs kept, and the recompute in the same engine: vLLM's sampler with logprobs can
        # take the other side of an exact tie than without, so both sides must run alike.
        b = _run(tmp_path, "B", {"model": model, "connector": conn, "logprobs": 5, "prompts": [
            {"tokens": p1}, {"tokens": p2}, {"tokens": p1, "salt": "ref-0"}, {"tokens": p2, "salt": "ref-1"}]})
    # Recomputed from the first chunk the victim held, which its ring position decides: equal to
    # the recompute but for a near tie (``greedy.py``).
    r = b["results"]
    assert [r[2]["cached"], r[3]["cached"]] == [0, 0]
    assert [greedy_difference(r[0], r[2]), greedy_difference(r[1], r[3])] == [None, None]
    assert b["results"][0]["cached"] < 4 * CHUNK  # the lost chunks were recomputed, not loaded


def test_unfull_chunk_and_decode_cache_are_saved_and_loaded(etcd_server, model, prompts, tmp_path):
    """save_unfull_chunk stores a prompt's partial last chunk, save_decode_cache the chunks that
    decoding fills; a second instance loads both and computes the same tokens as a recompute."""
    from kvring.connector.keys import KeyScope, KVLayout, request_keys

    q = prompts[0] + prompts[1][-100:]  # 1200 tokens: 4 whole chunks + 176 (one whole 128-block)
    with LocalCluster(nodes=3, memory=256 << 20, etcd=etcd_server.endpoint, cluster="e2e-saves") as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "save_unfull_chunk": True,
                "save_decode_cache": True}
        # A computes q twice: under a salt (the recompute reference) and plainly; 100 new tokens
        # take the sequence past 1280, so decoding fills chunk 4.
        a = _run(tmp_path, "A", {"model": model, "connector": conn, "max_tokens": 100,
                                 "prompts": [{"tokens": q, "salt": "ref"}, {"tokens": q}]})
        ref_q, out_q = (r["tokens"] for r in a["results"])
        assert out_q == ref_q and len(out_q) == 100
        layout = KVLayout(**a["layout"])
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            stored = _stored_keys(client)
        for salt in ("ref", None):
            prompt_keys = request_keys(layout, q, KeyScope(cache_salt=salt or ""), full_chunks_only=False)  # 4 whole + the partial
            decode_keys = request_keys(layout, q + out_q, KeyScope(cache_salt=salt or ""))[:5]  # whole chunks of prompt + output
            assert len(prompt_keys) == 5 and prompt_keys[:4] == decode_keys[:4]
            assert _part_keys(a, [k.hex() for k in prompt_keys + decode_keys]) <= stored
        assert len(stored) == 2 * 6 * 2  # exactly those, for both namespaces, 2 parts each
        follow_up = q + out_q  # 1300 tokens: chunks 0-4 in the cluster
        b = _run(tmp_path, "B", {"model": model, "connector": conn, "prompts": [
            {"tokens": q}, {"tokens": follow_up}, {"tokens": follow_up, "salt": "ref-b"}]})
    outs = [r["tokens"] for r in b["results"]]
    cached = [r["cached"] for r in b["results"]]
    assert outs[0] == out_q[:8] and outs[1] == outs[2]
    # q: 4 chunks + the partial one, up to the block boundary before the last token (1152);
    # the follow-up: 5 whole chunks, the fifth saved while A was decoding.
    assert cached == [1152, 1280, 0]


def test_corrupt_chunk_is_recomputed_in_both_modes(etcd_server, model, prompts, reference, tmp_path):
    """A chunk whose bytes no longer match their checksums is never loaded: both load modes
    report its blocks, vLLM recomputes them, and the corrupt copy is deleted from the node."""
    p1, p2 = prompts
    with LocalCluster(nodes=3, memory=256 << 20, etcd=etcd_server.endpoint, cluster="e2e-corrupt",
                      node_args=["--fault-injection"]) as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster}
        a = _run(tmp_path, "A", {"model": model, "connector": conn, "prompts": [{"tokens": p1}, {"tokens": p2}]})
        # A part of p1's chunk 2 and of p2's chunk 3 (not shared).
        bad = [ChunkPart(*a["parts"][0]).key(bytes.fromhex(k)).hex() for k in (a["keys"][0][2], a["keys"][1][3])]
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            for key in bad:
                # Flip a stored byte of the chunk part on its owner.
                assert inject(cluster, client.owners(bytes.fromhex(key))[0], f"corrupt?key={key}") == 200
            assert client.lookup([bytes.fromhex(k) for k in bad]) == [True, True]  # lookups cannot tell
            outs = []
            for mode, prompt in (("layerwise", p1), ("bulk", p2)):
                stats = tmp_path / f"{mode}.loads.jsonl"
                b = _run(tmp_path, f"B-{mode}", {"model": model, "prompts": [{"tokens": prompt}],
                                                 "connector": {**conn, "load_mode": mode, "stats_path": str(stats)}})
                outs.append(b["results"][0])
                loads = [json.loads(line) for line in stats.read_text().splitlines()]
                # One load of the 4 chunks; exactly the corrupt chunk's 2 blocks (256 / 128) failed.
                assert [(x["chunks"], x["failed_blocks"]) for x in loads] == [(4, 2)]
                # Every frame was received straight into the paged cache (the CPU cache's layout),
                # the corrupt one too: its blocks were written, failed their checksum, were reported.
                assert all(x["landed_bytes"] == x["bytes"] > 0 and x["copy_seconds"] == 0 for x in loads)
            deadline = time.monotonic() + 10
            while any(client.lookup([bytes.fromhex(k) for k in bad])) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert client.lookup([bytes.fromhex(k) for k in bad]) == [False, False]
    # vLLM recomputed those blocks (kv_load_failure_policy "recompute", which the connector sets):
    # the output is the recompute's.
    assert [o["tokens"] for o in outs] == reference[:2]
