"""How a chunk is stored as parts, and which parts one vLLM worker holds.

Under tensor parallelism a worker (a TP rank) holds a slice of the model's KV heads; under
pipeline parallelism a stage holds a range of its layers.  A chunk's KV is therefore stored as
one object per *part*: one KV head over one stage's layers, layer-major
``[layers, tokens, 1, K|V channels]``.  A part's key is the chunk's key followed by the part's
coordinates (``ChunkPart.key``), so

- every rank saves exactly its own heads and loads exactly its own heads, whatever the TP size
  of the instance that stored them: the layout of a part does not depend on the TP size, and
  instances of one model with TP 1, 2 and 4 share every chunk;
- a head that several ranks hold (fewer KV heads than ranks: vLLM replicates them) is stored
  once, by the first rank that holds it;
- two pipeline stages can never share a key (their layer ranges differ), and a chunk stored by an
  instance with other stages has other part keys (a miss, never wrong KV);
- a chunk is a hit only when every part a load needs is present (``ChunkParts.present``), so a
  save that only some ranks finished is never one.

Parts are placed on the ring by their own keys, so a chunk's parts spread over the nodes and a
rank's load draws from all of them in parallel.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

_COORDS = struct.Struct(">HHH")  # head, first layer, end layer: the 6 bytes after a part's chunk key


@dataclass(frozen=True, slots=True)
class ChunkPart:
    """One stored object of a chunk: KV head ``head`` over layers ``[first_layer, end_layer)``."""

    head: int
    first_layer: int
    end_layer: int

    def key(self, chunk_key: bytes) -> bytes:
        return chunk_key + _COORDS.pack(self.head, self.first_layer, self.end_layer)

    @property
    def announces(self) -> bool:
        """Whether this part names the chunk's vLLM blocks for the pool's KV events: head 0 of
        the first stage, so each chunk is announced once, not once per part."""
        return self.head == 0 and self.first_layer == 0


@dataclass(frozen=True, slots=True)
class ChunkParts:
    """Every part of a chunk of one model served with ``stages`` (the layer range of each
    pipeline stage, in order): what a lookup must find before a chunk counts as present."""

    num_kv_heads: int
    stages: tuple[tuple[int, int], ...]

    @property
    def parts(self) -> tuple[ChunkPart, ...]:
        return tuple(ChunkPart(h, first, end) for first, end in self.stages for h in range(self.num_kv_heads))

    def keys(self, chunk_keys: Sequence[bytes]) -> list[bytes]:
        """The part keys of ``chunk_keys``, chunk after chunk (``len(parts)`` each)."""
        parts = self.parts
        return [p.key(k) for k in chunk_keys for p in parts]

    def present(self, part_present: Sequence[bool]) -> list[bool]:
        """Per chunk: all of its parts present (``part_present`` in the order of ``keys``)."""
        n = len(self.parts)
        return [all(part_present[i:i + n]) for i in range(0, len(part_present), n)]


@dataclass(frozen=True, slots=True)
class RankShard:
    """The KV one worker holds: the model's KV heads in the order of its cache's head dimension,
    which of them it stores (one replica of each head), and its stage's layers."""

    heads: tuple[int, ...]
    saves: tuple[bool, ...]
    first_layer: int
    end_layer: int

    @classmethod
    def of_rank(cls, num_kv_heads: int, tp_size: int, tp_rank: int, layers: tuple[int, int]) -> RankShard:
        """The heads TP rank ``tp_rank`` of ``tp_size`` holds, as vLLM's ``QKVParallelLinear``
        shards them: ``num_kv_heads / tp_size`` consecutive heads each, or, with fewer heads than
        ranks, head ``tp_rank // (tp_size / num_kv_heads)`` replicated on that many ranks, of
        which the first stores it.  ``ValueError`` for a split vLLM would not make."""
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tensor-parallel rank {tp_rank} is not in [0, {tp_size})")
        if num_kv_heads >= tp_size:
            if num_kv_heads % tp_size:
                raise ValueError(f"{num_kv_heads} KV heads cannot be split over {tp_size} tensor-parallel ranks")
            per = num_kv_heads // tp_size
            return cls(tuple(range(tp_rank * per, (tp_rank + 1) * per)), (True,) * per, *layers)
        if tp_size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {tp_size} tensor-parallel ranks")
        replicas = tp_size // num_kv_heads
        return cls((tp_rank // replicas,), (tp_rank % replicas == 0,), *layers)

    @classmethod
    def whole(cls, num_kv_heads: int, num_layers: int) -> RankShard:
        """The only worker of an instance without tensor or pipeline parallelism."""
        return cls.of_rank(num_kv_heads, 1, 0, (0, num_layers))

    def part(self, local_head: int) -> ChunkPart:
        """The part of the head at index ``local_head`` of this worker's cache."""
        return ChunkPart(self.heads[local_head], self.first_layer, self.end_layer)

    @property
    def saved_heads(self) -> tuple[int, ...]:
        """Indices (in this worker's cache) of the heads it stores."""
        return tuple(i for i, s in enumerate(self.saves) if s)
