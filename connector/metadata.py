"""What the scheduler side tells the worker side each step (plain, picklable data)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvring.common.chunk import ChunkBlocks

from .vllm_types import KVConnectorMetadata


@dataclass
class LoadSpec:
    """Load chunks ``keys`` into the slots of tokens ``[start, end)`` of the request."""

    keys: list[bytes]
    start: int  # first token of the first chunk (vLLM's cached prefix rounded down to a chunk)
    write_from: int  # first token actually written (tokens before it are already in vLLM)
    end: int  # one past the last token to write: the end of a block (at most the prompt's end)
    # The token vLLM computes from (the hit it was told); a load whose ``end`` is past it also
    # writes the slots vLLM computes in this step (the rest of the last token's block), so it
    # lands before the forward, and vLLM's own write of those tokens after it.
    computed_from: int | None = None
    # async mode: load between steps while the request waits (done through get_finished).
    asynchronous: bool = False
    # Abandon the load (its blocks recompute) after this many seconds (0: never; a layerwise or
    # bulk load's step waits for it up to then).
    deadline_s: float = 0.0
    # A hybrid layout: per sliding window, the first token its layers are written from (vLLM
    # keeps that window's group blocks only from there: ``parts.window_start``).
    window_from: dict[int, int] = field(default_factory=dict)
    # A model with recurrent state: the block of the state group the state after ``end`` goes
    # to (the state part of the load's last chunk).
    state_block: int | None = None


@dataclass
class SaveSpec:
    """Save chunks ``keys``, covering tokens ``[start, end)`` of the request (only the last may be partial)."""

    keys: list[bytes]
    start: int
    end: int
    namespace: str = ""  # the request's key namespace (model, layout, cache_salt): flushable as one
    # per key: the vLLM blocks the chunk holds, for the cluster's KV events (None: unannounced)
    blocks: list[ChunkBlocks | None] = field(default_factory=list)
    # A hybrid layout: per sliding window, the first token still in its group's blocks during
    # this step; that window's parts are saved only for chunks starting there or later.
    live_from: dict[int, int] = field(default_factory=dict)


@dataclass
class StateSave:
    """Save the recurrent state vLLM holds in ``block`` (of the state group) after this step's
    forward: the state after chunk ``key``'s last token, its chunk's state part."""

    key: bytes
    block: int
    namespace: str = ""


@dataclass
class ReqMeta:
    req_id: str
    # slot_mapping[t] = block_id * block_size + offset, for every token of the request so far
    # (in the block table of KV-cache group 0).
    slot_mapping: np.ndarray
    block_ids: list[int]
    load: LoadSpec | None = None
    save: SaveSpec | None = None
    # Several KV-cache groups (a hybrid model): each group's slot mapping, group 0's first.
    group_slot_mappings: list[np.ndarray] = field(default_factory=list)

    def slots(self, group: int) -> np.ndarray:
        """The slot mapping of KV-cache group ``group``."""
        return self.group_slot_mappings[group] if self.group_slot_mappings else self.slot_mapping


@dataclass
class KVRingMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = field(default_factory=list)
    # vLLM computes no token this step (its requests wait, e.g. for async loads): a worker
    # with async loads in flight may block in get_finished until one ends (``IDLE_WAIT_S``).
    idle: bool = False
    states: list[StateSave] = field(default_factory=list)  # recurrent states to save after the forward
