"""Where a load ends, proven on the KV bytes: a fully cached prompt loads every token but the
last, what a load writes is byte for byte what the instance that stored it held, and a load that
fails partway leaves that before the failed chunk and vLLM's recompute from it after.

vLLM's CPU kernel keeps a block's K transposed behind the standardized ``[B, H, N, C]`` view, so
a copy of part of a block through view rows moves the wrong bytes (the V of most of its tokens
stays behind, and the K of the token vLLM computes is overwritten).  Loads therefore copy whole
blocks; these tests read every token's K|V where the kernel keeps it (``kv_dump.token_index``)
and compare the loading instance's cache with the storing one's at every loaded position.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from faults import inject
from greedy import greedy_difference

from kvring.cachenode.client import ClusterClient
from kvring.connector.keys import request_keys
from kvring.local.cluster import LocalCluster

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from kv_dump import token_index  # noqa: E402


def test_cpu_kernel_keeps_a_blocks_k_transposed():
    """Token ``t`` of a block is not view row ``t``: its K is column ``t`` of the first
    ``head_size`` rows, its V half of row ``block_size / 2 + t // 2``."""
    index = token_index(torch.bfloat16, 2, 128, 64)
    rows, cols = index // 128, index % 128
    for t in (0, 75, 127):
        assert rows[t, :64].tolist() == list(range(64)) and set(cols[t, :64].tolist()) == {t}
        assert set(rows[t, 64:].tolist()) == {64 + t // 2}


def _dump(tmp: Path, name: str, spec: dict) -> list[dict]:
    (tmp / f"{name}.json").write_text(json.dumps(spec))
    (tmp / name).mkdir()
    proc = subprocess.run([sys.executable, "-P", str(HERE / "kv_dump.py"), str(tmp / f"{name}.json"), str(tmp / name)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads((tmp / name / "out.json").read_text())["results"]


def _same(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per layer and token: every byte of K|V of every head equal."""
    return _same_heads(x, y).all(dim=2)


def _same_heads(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per layer, token and KV head: every byte of its K|V equal."""
    return (x.view(torch.int16) == y.view(torch.int16)).all(dim=3)


def _step(t: torch.Tensor) -> float:
    """One bfloat16 step at ``t``'s largest magnitude (7 bits of mantissa below its leading one)."""
    return 2.0 ** (math.floor(math.log2(t.float().abs().max().item())) - 7)


MODES = ("layerwise", "bulk", "async")
# 4 whole chunks (all cached: every token but the last); 4 chunks and a partial one of 76 tokens
# (save_unfull_chunk: loaded up to the block boundary before the last token); 3 chunks and a
# partial one ending mid-block; 8 whole chunks.
LENGTHS = (1024, 1100, 1000, 2048)
LOADED = [1023, 1024, 896, 2047]
# A fifth prompt of 8 chunks whose chunk 3 is corrupted on its node after A stored it: the first
# load of it fails there, and vLLM recomputes it from that chunk's first token.
BROKEN_CHUNK = 3


@pytest.fixture(scope="module")
def dumps(etcd_server, tmp_path_factory):
    """One instance (A) stores the prompts; one instance per load mode loads them (B), the
    layerwise one also recomputing them under salts of their own.  Each B loads the broken
    prompt last (after chunk ``BROKEN_CHUNK``'s corruption)."""
    from kvring.engine.run import layout_of, write_tiny_llama

    tmp = tmp_path_factory.mktemp("load-end")
    model = str(write_tiny_llama(tmp / "model"))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 2000, size=n).tolist() for n in LENGTHS]
    broken = rng.integers(10, 2000, size=8 * 256).tolist()
    with LocalCluster(nodes=2, memory=256 << 20, etcd=etcd_server.endpoint, cluster="load-end",
                      node_args=["--fault-injection"]) as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "save_unfull_chunk": True}
        a = _dump(tmp, "A", {"model": model, "connector": conn, "prompts": [{"tokens": p} for p in [*prompts, broken]]})
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            layout = layout_of({"model": model}, client.contract.chunk_size)
            key = layout.parts().keys(request_keys(layout, broken)[BROKEN_CHUNK:BROKEN_CHUNK + 1])[0]
            assert client.lookup([key]) == [True]
            assert inject(cluster, client.owners(key)[0], f"corrupt?key={key.hex()}") == 200
        b = {}
        for mode in MODES:
            recompute = [{"tokens": p, "salt": f"recompute-{i}"} for i, p in enumerate(prompts)] if mode == "layerwise" else []
            b[mode] = _dump(tmp, f"B-{mode}", {"model": model, "connector": {**conn, "load_mode": mode,
                                                                             "stats_path": str(tmp / f"{mode}.loads.jsonl")},
                                               "prompts": [*({"tokens": p} for p in prompts), *recompute,
                                                           {"tokens": broken}]})
    return tmp, a, b


def test_a_prefill_of_the_same_prompt_is_bit_stable(dumps):
    tmp, a, b = dumps
    k = len(LENGTHS)
    assert [r["cached"] for r in b["layerwise"][k:2 * k]] == [0] * k
    for i in range(k):
        stored, recomputed = torch.load(tmp / "A" / f"kv-{i}.pt"), torch.load(tmp / "B-layerwise" / f"kv-{k + i}.pt")
        assert _same(stored, recomputed).all()
        assert b["layerwise"][k + i]["tokens"] == a[i]["tokens"]


@pytest.mark.parametrize("mode", MODES)
def test_loaded_kv_is_the_stored_kv_to_the_byte(dumps, mode):
    tmp, a, b = dumps
    assert [r["cached"] for r in a] == [0] * (len(LENGTHS) + 1)
    assert [r["cached"] for r in b[mode][:len(LENGTHS)]] == LOADED
    for i, n in enumerate(LOADED):
        stored, got = torch.load(tmp / "A" / f"kv-{i}.pt"), torch.load(tmp / f"B-{mode}" / f"kv-{i}.pt")
        bad = (~_same(got, stored)[:, :n]).nonzero().tolist()
        assert not bad, f"prompt {i}: (layer, token) loaded with other bytes than stored: {bad[:8]}"
        assert b[mode][i]["tokens"] == a[i]["tokens"]


@pytest.mark.parametrize("mode", MODES)
def test_a_load_that_fails_partway_leaves_the_stored_kv_before_and_a_recompute_after(dumps, mode):
    """The broken prompt: the layerwise instance's load fails on chunk ``BROKEN_CHUNK`` (its 2
    blocks reported) and vLLM recomputes from its first token; the corrupt copy (of head 0's part)
    is deleted, so the bulk instance loads only the chunks before it, computes the rest and saves
    that part again; the async instance then loads all 8 chunks, the broken one with head 0 as the
    bulk instance saved it and head 1 as first stored.  Whichever way: every token before the
    broken chunk holds the stored K|V to the byte, and every head of every token from it holds, to
    the byte, either the stored K|V or what vLLM's recompute from that token wrote (the layerwise
    instance's), which is the stored K|V to within two bfloat16 steps of its largest values (one
    here; two leave room for another CPU's kernels): the prefill started at another token and
    summed in another order.  Wrong K/V (a corrupt byte
    kept, a block neither loaded nor recomputed, another prompt's) is none of these."""
    tmp, a, b = dumps
    k, split = len(LENGTHS), BROKEN_CHUNK * 256
    i = len(b[mode]) - 1  # the broken prompt: each instance's last
    stored, got = torch.load(tmp / "A" / f"kv-{k}.pt"), torch.load(tmp / f"B-{mode}" / f"kv-{i}.pt")
    recomputed = torch.load(tmp / "B-layerwise" / f"kv-{len(b['layerwise']) - 1}.pt")
    loads = [json.loads(line) for line in (tmp / f"{mode}.loads.jsonl").read_text().splitlines()]
    if mode == "layerwise":
        assert (loads[-1]["chunks"], loads[-1]["failed_blocks"]) == (8, 2)
    before = (~_same(got, stored)[:, :split]).nonzero().tolist()
    assert not before, f"(layer, token) before the failed chunk not as stored: {before[:8]}"
    off = (got.float() - stored.float()).abs().max().item()
    assert off <= 2 * _step(stored), f"{off} from the stored K|V, more than two bfloat16 steps ({_step(stored)})"
    either = _same_heads(got, stored) | _same_heads(got, recomputed)
    assert either.all(), f"(layer, token, head) neither stored nor recomputed: {(~either).nonzero().tolist()[:8]}"
    assert greedy_difference(b[mode][i], a[k]) is None
