"""How chunks are cut into parts (one per KV head and pipeline stage) and which parts each
tensor- or pipeline-parallel worker holds, saves and loads: table tests on the pure records.
The same layouts against a real cluster are in test_worker_shards.py, with real engines in
test_vllm_parallel.py."""

from __future__ import annotations

import itertools

import pytest

from kvring.connector.keys import KVLayout, request_keys
from kvring.connector.instance import stage_layers
from kvring.connector.parts import ChunkPart, ChunkParts, RankShard

LAYOUT = KVLayout(model="m", config_fingerprint="f", kv_dtype="bfloat16", num_layers=4, num_kv_heads=4,
                  head_size=16, block_layout="BHNC", chunk_size=16)


@pytest.mark.parametrize("heads, tp, expected", [
    (4, 1, [((0, 1, 2, 3), (True,) * 4)]),
    (4, 2, [((0, 1), (True, True)), ((2, 3), (True, True))]),
    (4, 4, [((h,), (True,)) for h in range(4)]),
    # Fewer KV heads than ranks: vLLM replicates each head on tp / heads ranks; the first stores it.
    (2, 4, [((0,), (True,)), ((0,), (False,)), ((1,), (True,)), ((1,), (False,))]),
    (1, 8, [((0,), (r == 0,)) for r in range(8)]),  # e.g. an MLA latent: one "head", on every rank
])
def test_each_rank_holds_vllms_heads_and_each_head_is_saved_once(heads, tp, expected):
    shards = [RankShard.of_rank(heads, tp, r, (0, 4)) for r in range(tp)]
    assert [(s.heads, s.saves) for s in shards] == expected
    saved = [s.heads[j] for s in shards for j in s.saved_heads]
    assert sorted(saved) == list(range(heads))  # every head stored exactly once, whatever the TP size


@pytest.mark.parametrize("heads, tp", [(4, 3), (3, 2), (2, 3), (6, 4)])
def test_a_split_vllm_would_not_make_is_refused(heads, tp):
    with pytest.raises(ValueError, match="cannot be"):
        RankShard.of_rank(heads, tp, 0, (0, 4))


def test_parts_of_every_tp_size_are_the_same_keys():
    """TP 1, 2 and 4 store and load the same part keys: what one stores, the others load."""
    keys = request_keys(LAYOUT, list(range(64)))
    by_tp = {}
    for tp in (1, 2, 4):
        shards = [RankShard.of_rank(4, tp, r, (0, 4)) for r in range(tp)]
        by_tp[tp] = {shard.part(j).key(k) for shard in shards for j in range(len(shard.heads)) for k in keys}
    assert by_tp[1] == by_tp[2] == by_tp[4] == set(LAYOUT.parts().keys(keys))
    assert len(by_tp[1]) == 4 * len(keys)


def test_pipeline_stages_never_share_a_key():
    keys = request_keys(LAYOUT, list(range(64)))
    one = set(LAYOUT.parts().keys(keys))
    stages = LAYOUT.parts(((0, 2), (2, 4)))
    two = stages.keys(keys)
    assert len(set(two)) == len(two) == 2 * 4 * len(keys)
    assert one.isdisjoint(two)
    first, second = ({ChunkPart(h, a, b).key(k) for h in range(4) for k in keys} for a, b in stages.stages)
    assert first.isdisjoint(second) and first | second == set(two)


def test_a_chunk_is_present_only_when_all_its_parts_are():
    parts = LAYOUT.parts(((0, 2), (2, 4)))  # 8 parts a chunk
    n = len(parts.parts)
    for missing in itertools.chain([None], range(n)):
        flags = [True] * n + [True] * n
        if missing is not None:
            flags[n + missing] = False  # one part of the second chunk (a rank's save that never landed)
        assert parts.present(flags) == [True, missing is None]


def test_one_part_per_chunk_announces_its_blocks():
    parts = LAYOUT.parts(((0, 2), (2, 4))).parts
    assert [p for p in parts if p.announces] == [ChunkPart(0, 0, 2)]


def test_stage_layers_are_vllms_split():
    assert stage_layers(4, 1) == ((0, 4),)
    assert stage_layers(4, 2) == ((0, 2), (2, 4))
    assert stage_layers(5, 2) in (((0, 3), (3, 5)), ((0, 2), (2, 5)))  # vLLM's rounding, whichever it is
    assert ChunkParts(2, stage_layers(6, 3)).parts[-1] == ChunkPart(1, 4, 6)
