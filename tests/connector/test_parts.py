"""How chunks are cut into parts (one per KV head and pipeline stage) and which parts each
tensor- or pipeline-parallel worker holds, saves and loads: table tests on the pure records.
The same layouts against a real cluster are in test_worker_shards.py, with real engines in
test_vllm_parallel.py."""

from __future__ import annotations

import itertools

import pytest

from kvring.connector.keys import KVLayout, request_keys
from kvring.connector.instance import stage_layers
from kvring.connector.parts import STATE, BrokenChunk, ChunkPart, ChunkParts, RankShard, window_start

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


def test_every_other_full_attention_part_names_the_announcing_part_as_its_anchor():
    """A node that lets one of them go deletes the anchor (``cachenode/anchors.py``): the chunk
    can no longer be loaded whole.  A window's parts name none: a chunk a load takes may lack them."""
    stages = LAYOUT.parts(((0, 2), (2, 4)))
    assert stages.anchor == ChunkPart(0, 0, 2)
    assert [p for p in stages.parts if p.anchored_by(stages.anchor)] == [p for p in stages.parts if p != stages.anchor]
    hybrid = HYBRID.parts()
    assert hybrid.anchor == ChunkPart(0, 0, 4, 0)
    assert [p for p in hybrid.parts if p.anchored_by(hybrid.anchor)] == [ChunkPart(1, 0, 4, 0)]
    single = ChunkParts(1, ((0, 4),))  # MLA: one latent "head", one stage: nothing to anchor
    assert single.anchor == ChunkPart(0, 0, 4) and not single.anchor.anchored_by(single.anchor)
    no_full = ChunkParts(2, ((0, 2), (2, 4)), windows=(64, 64, 0, 0))  # the first stage slides only
    assert no_full.anchor is None and not any(p.anchored_by(no_full.anchor) for p in no_full.parts)


def test_a_chunk_is_broken_when_its_anchor_is_present_and_a_part_carrying_it_is_not():
    """What a lookup reports to ``broken_chunks.py``, in every shape: the chunks whose anchor is
    present and some part that carries it missing, with those parts.  A chunk without its anchor
    is not credited (nothing to withdraw); a window's part missing does not break a chunk."""
    stages = LAYOUT.parts(((0, 2), (2, 4)))  # 4 heads x 2 stages: the anchor first
    lost = ChunkPart(2, 2, 4)  # head 2 of the second stage
    whole = [True] * len(stages.parts)
    broken = [p != lost for p in stages.parts]
    unanchored = [p != stages.anchor and p != lost for p in stages.parts]
    assert stages.broken(whole + broken + unanchored + whole) == [BrokenChunk(1, (lost,))]
    hybrid = HYBRID.parts()
    missing_window = [p.window == 0 for p in hybrid.parts]
    missing_full = [p != ChunkPart(1, 0, 4, 0) for p in hybrid.parts]
    assert hybrid.broken(missing_window + missing_full) == [BrokenChunk(1, (ChunkPart(1, 0, 4, 0),))]
    assert ChunkParts(1, ((0, 4),)).broken([True, False]) == []  # MLA, one stage: one part, nothing to break
    mla_stages = ChunkParts(1, ((0, 2), (2, 4)))
    assert mla_stages.broken([True, False, True, True]) == [BrokenChunk(0, (ChunkPart(0, 2, 4),))]
    no_full = ChunkParts(2, ((0, 2), (2, 4)), windows=(64, 64, 0, 0))
    assert no_full.broken([False] * len(no_full.parts)) == []


def test_stage_layers_are_vllms_split():
    assert stage_layers(4, 1) == ((0, 4),)
    assert stage_layers(4, 2) == ((0, 2), (2, 4))
    assert stage_layers(5, 2) in (((0, 3), (3, 5)), ((0, 2), (2, 5)))  # vLLM's rounding, whichever it is
    assert ChunkParts(2, stage_layers(6, 3)).parts[-1] == ChunkPart(1, 4, 6)


# A hybrid layout: layers 0 and 2 slide over 64 tokens, layer 1 over 256, layer 3 is full attention.
HYBRID = KVLayout(model="m", config_fingerprint="f", kv_dtype="bfloat16", num_layers=4, num_kv_heads=2,
                  head_size=16, block_layout="BHNC", chunk_size=16, windows=(64, 256, 64, 0))


def test_a_hybrid_layout_stores_a_part_per_attention_kind_under_keys_of_its_own():
    parts = HYBRID.parts().parts
    assert [(p.head, p.window, p.layers(HYBRID.windows)) for p in parts] == [
        (0, 0, (3,)), (1, 0, (3,)), (0, 64, (0, 2)), (1, 64, (0, 2)), (0, 256, (1,)), (1, 256, (1,))]
    assert [p for p in parts if p.announces] == [ChunkPart(0, 0, 4, 0)]
    plain = KVLayout(**{**HYBRID.__dict__, "windows": ()})
    assert HYBRID.namespace() != plain.namespace()  # never the chunks of the same model with one group
    assert plain.parts().parts == (ChunkPart(0, 0, 4), ChunkPart(1, 0, 4))
    keys = {p.key(b"k" * 16) for p in parts}
    assert len(keys) == 6 and keys.isdisjoint(p.key(b"k" * 16) for p in plain.parts().parts)


@pytest.mark.parametrize("end, window, block, first", [(64, 64, 16, 0), (65, 64, 16, 0), (80, 64, 16, 16),
                                                       (100, 64, 16, 32), (100, 64, 32, 32), (10, 256, 16, 0)])
def test_a_window_keeps_the_blocks_from_the_oldest_token_the_next_one_attends_to(end, window, block, first):
    assert window_start(end, window, block) == first


def _flags(chunks: int, missing: dict[int, set[int | None]]) -> list[bool]:
    """Part presence of ``chunks`` chunks of HYBRID, without the parts of kinds ``missing[c]``."""
    parts = HYBRID.parts().parts
    return [p.window not in missing.get(c, set()) for c in range(chunks) for p in parts]


def _hits(flags: list[bool], n_tokens: int) -> int:
    return HYBRID.parts().leading_hits(flags, 16, lambda k: min(k * 16, n_tokens - 1), block_size=16)


@pytest.mark.parametrize("missing, hits", [
    ({}, 20),  # every part there: every chunk
    ({5: {0}}, 5),  # a full-attention part missing: no load reaches past it
    ({2: {64, 256}}, 20),  # window parts long before the end: no window reaches them
    # The 64-token window of a load ending at token 320 needs chunks 16-19; one of 19 chunks
    # (ending at 304) needs 15-18.
    ({19: {64}}, 19),
    # The 256-token window of loads of 18 to 20 chunks reaches chunk 17; that of 17 (ending at
    # 272) needs chunks 1-16.
    ({17: {256}}, 17),
    ({17: {256}, 16: {64}}, 16),  # and the 64-token window of that load (chunks 13-16) reaches chunk 16
])
def test_a_hit_needs_the_full_parts_of_every_chunk_and_each_windows_parts_before_its_end(missing, hits):
    assert _hits(_flags(20, missing), n_tokens=20 * 16 + 1) == hits


# A model with recurrent state: layers 0 and 2 keep a state (Mamba, gated delta net), 1 and 3
# are full attention.
RECURRENT = KVLayout(model="m", config_fingerprint="f", kv_dtype="bfloat16", num_layers=4, num_kv_heads=2,
                     head_size=16, block_layout="BHNC", chunk_size=16, windows=(STATE, 0, STATE, 0),
                     state_format="gdn|(3, 8):bfloat16|conv=SD")


def test_a_model_with_recurrent_state_stores_one_state_part_per_chunk_beside_its_attention_parts():
    parts = RECURRENT.parts().parts
    assert [(p.head, p.window, p.layers(RECURRENT.windows)) for p in parts] == [
        (0, STATE, (0, 2)), (0, 0, (1, 3)), (1, 0, (1, 3))]
    state = parts[0]
    assert state.state and not state.announces and not state.anchored_by(RECURRENT.parts().anchor)
    assert RECURRENT.parts().anchor == ChunkPart(0, 0, 4, 0)
    # The state's format is in the namespace: a state of other bytes is never another's key.
    other = KVLayout(**{**RECURRENT.__dict__, "state_format": "gdn|(3, 8):bfloat16|conv=DS"})
    assert other.namespace() != RECURRENT.namespace()
    assert len({p.key(b"k" * 16) for p in parts}) == 3
    # A window's part keys end with the window as before (big-endian), the state's with -1.
    assert ChunkPart(0, 0, 4, 64).key(b"k").endswith((64).to_bytes(4, "big"))
    assert state.key(b"k").endswith(b"\xff" * 4)


def _state_flags(chunks: int, missing: dict[int, set[int]]) -> list[bool]:
    parts = RECURRENT.parts().parts
    return [p.window not in missing.get(c, set()) for c in range(chunks) for p in parts]


def _state_end(k: int, n_tokens: int) -> int:
    """Where the scheduler ends a load of ``k`` chunks of a model with state (before the last token)."""
    return k * 16 if k * 16 < n_tokens else (n_tokens - 1) // 16 * 16


@pytest.mark.parametrize("missing, n_tokens, hits", [
    ({}, 20 * 16 + 1, 20),  # every part there: every chunk
    ({c: {STATE} for c in range(19)}, 20 * 16 + 1, 20),  # only the last chunk's state is needed
    ({19: {STATE}}, 20 * 16 + 1, 19),  # without it the hit ends on the last state before it
    ({c: {STATE} for c in range(10, 20)}, 20 * 16 + 1, 10),
    ({5: {0}}, 20 * 16 + 1, 5),  # an attention part missing: no load reaches past it
    ({5: {0}, 4: {STATE}}, 20 * 16 + 1, 4),
    # A prompt of exactly 20 chunks: vLLM computes its last token, so no hit ends at 320 and
    # the state there is no use; the hit ends on chunk 19's state.
    ({}, 20 * 16, 19),
    ({18: {STATE}}, 20 * 16, 18),
    ({c: {STATE} for c in range(20)}, 20 * 16 + 1, 0),  # no state anywhere: no hit
])
def test_a_hit_of_a_model_with_state_ends_on_a_saved_state_with_every_attention_part_before_it(missing, n_tokens,
                                                                                             hits):
    flags = _state_flags(20, missing)
    assert RECURRENT.parts().leading_hits(flags, 16, lambda k: _state_end(k, n_tokens), block_size=16) == hits


def test_under_tensor_parallelism_each_rank_stores_and_loads_its_own_slice_of_the_state():
    """Ranks hold slices of a recurrent state (its heads): a chunk has one state part per rank,
    each rank's named by its rank; a state every rank holds whole is one part, rank 0's."""
    parts = RECURRENT.parts(state_shards=2).parts
    assert [(p.head, p.window) for p in parts] == [(0, STATE), (1, STATE), (0, 0), (1, 0)]
    ranks = [RankShard.of_rank(2, 2, r, (0, 4)) for r in range(2)]
    assert [s.state_part(replicated=False) for s in ranks] == [parts[0], parts[1]]
    assert [s.state_part(replicated=True) for s in ranks] == [parts[0], parts[0]]
    # A hit needs every rank's state after its last chunk.
    flags = [not (c == 3 and p == parts[1]) for c in range(4) for p in parts]
    assert RECURRENT.parts(state_shards=2).leading_hits(flags, 16, lambda k: _state_end(k, 4 * 16 + 1), 16) == 3
