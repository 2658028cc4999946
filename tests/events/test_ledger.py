"""``PoolLedger``: the pool stream's events from the nodes' events (pure logic, table tests)."""

from __future__ import annotations

import msgspec
import pytest
from vllm.distributed.kv_events import KVEventBatch

from kvring.events.ledger import PoolLedger
from kvring.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

BLOCK = 4


def chunk(i: int, per: int = 2, prompt: int = 0) -> BlockStored:
    """Chunk ``i`` of prompt ``prompt`` as a node announces it: ``per`` blocks hashed
    ``prompt*1000 + per*i ..``, parent the previous chunk's last block."""
    base = prompt * 1000
    hashes = [base + per * i + b for b in range(per)]
    return BlockStored(block_hashes=hashes, parent_block_hash=base + per * i - 1 if i else None,
                       token_ids=list(range(base + per * i * BLOCK, base + per * (i + 1) * BLOCK)),
                       block_size=BLOCK, lora_id=None, medium="CPU", lora_name=None,
                       extra_keys=[None] * per, locality="REMOTE", ownership="kvring/test")


def removed(i: int, per: int = 2, prompt: int = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=chunk(i, per, prompt).block_hashes, medium="CPU", locality="REMOTE",
                        ownership="kvring/test")


def stored(events) -> list:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def withdrawn(events) -> list:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def chained(events, published=()) -> bool:
    """Every stored run names as parent a block announced before it (or none: a first block)."""
    seen = set(published)
    for e in events:
        if isinstance(e, BlockStored):
            if e.parent_block_hash is not None and e.parent_block_hash not in seen:
                return False
            seen.update(e.block_hashes)
    return True


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0), (2, 0, 1)])
def test_a_prompt_spread_over_nodes_is_announced_as_one_chain_whatever_order_its_chunks_arrive(order):
    ledger, events = PoolLedger(), []
    for step, i in enumerate(order):
        new = ledger.apply(f"node-{i}", chunk(i))
        if step < order.index(0):
            assert new == []  # nothing before the prompt's first chunk is in the pool
        events += new
    assert sorted(stored(events)) == list(range(6)) and chained(events)
    assert all(e.locality is None and e.ownership is None and e.medium == "CPU" for e in events)


def test_a_chunk_that_goes_withdraws_what_chains_through_it_until_it_comes_back():
    ledger = PoolLedger()
    for i in range(4):
        ledger.apply(f"node-{i % 2}", chunk(i))
    events = ledger.apply("node-1", removed(1))  # chunk 1 (node-1) goes: chunks 2, 3 hang off it
    assert sorted(withdrawn(events)) == [2, 3, 4, 5, 6, 7] and stored(events) == []
    assert ledger.published == {0, 1}
    events = ledger.apply("node-2", chunk(1))  # a copy of it arrives elsewhere (repair)
    assert sorted(stored(events)) == [2, 3, 4, 5, 6, 7] and chained(events, {0, 1})
    assert ledger.published == set(range(8))


def test_a_block_held_twice_goes_when_its_last_copy_goes():
    ledger = PoolLedger()
    assert stored(ledger.apply("a", chunk(0))) == [0, 1]
    assert ledger.apply("b", chunk(0)) == []  # a replica: nothing new for the pool
    assert ledger.apply("a", removed(0)) == []
    assert sorted(withdrawn(ledger.apply("b", removed(0)))) == [0, 1]
    assert ledger.apply("b", removed(0)) == []  # a removal of what is not held: nothing


@pytest.mark.parametrize("how", ["drop", "clear", "replace"])
def test_a_node_that_leaves_or_comes_back_empty_withdraws_only_what_it_alone_held(how):
    ledger = PoolLedger()
    ledger.apply("a", chunk(0))
    ledger.apply("a", chunk(1))
    ledger.apply("b", chunk(1))
    ledger.apply("b", chunk(0, prompt=1))
    if how == "drop":
        events = ledger.drop("b")
    elif how == "clear":
        events = ledger.apply("b", AllBlocksCleared())
    else:
        from kvring.events.ledger import NodeHoldings
        events = ledger.replace("b", NodeHoldings())
    assert sorted(withdrawn(events)) == [1000, 1001] and ledger.published == {0, 1, 2, 3}


def test_a_node_rebuilt_from_its_history_announces_only_the_difference():
    from kvring.events.ledger import NodeHoldings
    ledger = PoolLedger()
    for i in range(3):
        ledger.apply("a", chunk(i))
    same = NodeHoldings()
    for e in (AllBlocksCleared(), chunk(0), chunk(1), chunk(2)):
        same.apply(e)
    assert ledger.replace("a", same) == []
    fewer = NodeHoldings()
    for e in (chunk(0), chunk(1), chunk(2), removed(2), chunk(0, prompt=2)):
        fewer.apply(e)
    events = ledger.replace("a", fewer)
    assert sorted(withdrawn(events)) == [4, 5] and stored(events) == [2000, 2001]


def test_the_snapshot_clears_then_announces_everything_published_parents_first():
    ledger = PoolLedger()
    for i in (3, 2, 1, 0):
        ledger.apply(f"n{i}", chunk(i, per=3))
    ledger.apply("n9", chunk(0, prompt=5))
    ledger.apply("n9", chunk(2, prompt=6))  # no first chunk: held, never announced
    snap = ledger.snapshot()
    assert isinstance(snap[0], AllBlocksCleared)
    assert sorted(stored(snap)) == [*range(12), 5000, 5001] and chained(snap[1:])
    assert ledger.held == 12 + 2 + 2


def test_long_chains_are_announced_in_runs_and_read_by_vllms_decoder():
    ledger = PoolLedger(medium="CPU")
    events = []
    for i in range(300):  # 600 blocks in one chain: runs of at most 512
        events += ledger.apply("a", chunk(i))
    assert stored(events) == list(range(600)) and chained(events)
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(encode_batch(ledger.snapshot()))
    runs = [e for e in batch.events if type(e).__name__ == "BlockStored"]
    assert [len(e.block_hashes) for e in runs] == [512, 88]
    assert runs[1].parent_block_hash == 511 and runs[0].parent_block_hash is None
    assert runs[1].token_ids == list(range(512 * BLOCK, 600 * BLOCK))
    assert all(e.locality is None and e.ownership is None for e in runs)
