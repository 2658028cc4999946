"""vLLM's KV-event records, field for field (vLLM 0.32, ``vllm/distributed/kv_events.py``).

A batch is a msgpack array ``[ts, events]`` (``data_parallel_rank`` is left out, as vLLM
leaves out a default); each event is a msgpack map tagged ``"type": "<class name>"``, its
fields without defaults always present.  ``tests/cachenode/test_kv_events.py`` decodes what
``encode_batch`` writes with vLLM's own ``KVEventBatch`` decoder.

``PoolIdentity`` is what every event of a kvring cluster says about where its blocks are:
``medium`` ``"CPU"`` (the nodes' memory), ``locality`` ``"REMOTE"`` (one network read away from
any vLLM instance) and ``ownership`` ``"kvring/<cluster>"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from kvring.common.chunk import BlockHash, ChunkBlocks

MEDIUM_CPU = "CPU"
LOCALITY_REMOTE = "REMOTE"


class _Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: list[Event], ts: float | None = None) -> bytes:
    return _encoder.encode(EventBatch(time.time() if ts is None else ts, events))


@dataclass(frozen=True)
class PoolIdentity:
    """Where a kvring cluster's blocks are, as each event says it."""

    cluster: str
    medium: str = MEDIUM_CPU
    locality: str = LOCALITY_REMOTE

    @property
    def ownership(self) -> str:
        return f"kvring/{self.cluster}"

    def stored(self, blocks: ChunkBlocks) -> BlockStored:
        return BlockStored(block_hashes=list(blocks.block_hashes), parent_block_hash=blocks.parent_block_hash,
                           token_ids=blocks.tokens(), block_size=blocks.block_size, lora_id=None,
                           medium=self.medium, lora_name=blocks.lora_name, extra_keys=blocks.extra_key_list(),
                           locality=self.locality, ownership=self.ownership)

    def removed(self, blocks: ChunkBlocks) -> BlockRemoved:
        return BlockRemoved(block_hashes=list(blocks.block_hashes), medium=self.medium, locality=self.locality,
                            ownership=self.ownership)
