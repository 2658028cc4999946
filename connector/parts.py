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
- a chunk is a hit only when every part a load needs is present (``ChunkParts.leading_hits``), so
  a save that only some ranks finished is never one.

A hybrid model served with vLLM's hybrid KV-cache manager (sliding-window layers next to
full-attention ones, one KV-cache group each) stores each KV head of a stage as one part per
attention kind: its full-attention layers, and the layers of each sliding window (``window``,
in tokens).  A load needs every chunk's full-attention parts, but a window's parts only of the
chunks that hold its last ``window`` tokens (``window_start``): the blocks vLLM keeps for that
group.  Such parts are saved only while all their tokens are still in the group's blocks, so a
window part may be missing where its full-attention parts are present; ``leading_hits`` counts
a chunk as a hit only when the load that ends with it finds every part it needs.

A model with recurrent state (Mamba, gated delta net: vLLM's ``MambaSpec`` layers, served with
``mamba_cache_mode="align"``) has no per-token KV in those layers: each keeps one state, that
of every token before it.  Its chunks store the attention layers as above, and the state layers
as one more part per stage (``STATE``): their states *after the chunk's last token*, one frame
per state layer.  vLLM has that state only where a step ended on a block boundary, so a chunk's
state part is saved where vLLM hands one over (``connector/scheduler.py``) and is missing
elsewhere; a load of ``k`` chunks needs the attention parts of all of them and the state part of
the last one only, and it must end exactly there (``leading_hits``' ``load_end``).  Tensor-
parallel ranks hold slices of the state (its heads), so each rank stores and loads its own
state part (``RankShard.state_part``); the slices' shapes are in the key namespace, so instances
of other TP sizes never read them.

Parts are placed on the ring by their own keys, so a chunk's parts spread over the nodes and a
rank's load draws from all of them in parallel.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_COORDS = struct.Struct(">HHH")  # head, first layer, end layer: the 6 bytes after a part's chunk key
_WINDOW = struct.Struct(">i")  # a hybrid layout's part: its kind (0: full attention, a window, or STATE)
# The kind of a layer whose cache is recurrent state (Mamba, linear attention), in a layout's
# ``windows`` and a part's ``window``: stored once per chunk, its state after the chunk's end.
STATE = -1


def window_start(end: int, window: int, block_size: int) -> int:
    """The first token a sliding-window group keeps blocks for once ``end`` tokens are computed:
    the start of the block holding the oldest token the next one attends to (vLLM frees the
    blocks before it, ``SlidingWindowManager.get_num_skipped_tokens``)."""
    return max(0, end - window + 1) // block_size * block_size


@dataclass(frozen=True, slots=True)
class ChunkPart:
    """One stored object of a chunk: KV head ``head`` over layers ``[first_layer, end_layer)`` --
    all of them, or (a hybrid layout) those whose attention has ``window`` (0: full attention)."""

    head: int
    first_layer: int
    end_layer: int
    window: int | None = None

    def key(self, chunk_key: bytes) -> bytes:
        key = chunk_key + _COORDS.pack(self.head, self.first_layer, self.end_layer)
        return key if self.window is None else key + _WINDOW.pack(self.window)

    @property
    def state(self) -> bool:
        """Whether this part holds the state layers' state after its chunk (``STATE``)."""
        return self.window == STATE

    def layers(self, windows: Sequence[int] = ()) -> tuple[int, ...]:
        """The model layers this part holds, in order (``windows``: each layer's window, 0 full)."""
        span = range(self.first_layer, self.end_layer)
        return tuple(span) if self.window is None else tuple(i for i in span if windows[i] == self.window)

    @property
    def announces(self) -> bool:
        """Whether this part names the chunk's vLLM blocks for the pool's KV events: head 0 of
        the first stage (its full-attention layers), so each chunk is announced once.  It is
        the chunk's anchor: the chunk's other full-attention parts carry its key
        (``ChunkMeta.anchor``), and a node that lets one of them go deletes it
        (``cachenode/anchors.py``)."""
        return self.head == 0 and self.first_layer == 0 and not self.window

    def anchored_by(self, anchor: ChunkPart | None) -> bool:
        """Whether this part carries ``anchor``'s key: a full-attention part other than it (a
        window's part may be missing from a chunk a load takes, so it does not)."""
        return anchor is not None and not self.window and self != anchor


@dataclass(frozen=True, slots=True)
class BrokenChunk:
    """A chunk a lookup found with its anchor and without some of the parts that carry it."""

    chunk: int  # its position in the lookup
    missing: tuple[ChunkPart, ...]


@dataclass(frozen=True, slots=True)
class ChunkParts:
    """Every part of a chunk of one model served with ``stages`` (the layer range of each
    pipeline stage, in order): what a lookup must find before a chunk counts as present."""

    num_kv_heads: int
    stages: tuple[tuple[int, int], ...]
    windows: tuple[int, ...] = ()  # a hybrid layout: each model layer's sliding window (0: full attention)
    # A model with recurrent state: the state parts of a stage, one per tensor-parallel rank when
    # the ranks hold slices of the state (``RankShard.state_part``), else one.
    state_shards: int = 1

    @property
    def parts(self) -> tuple[ChunkPart, ...]:
        return tuple(ChunkPart(h, first, end, w) for first, end in self.stages for w in kinds(self.windows, first, end)
                     for h in range(self.state_shards if w == STATE else self.num_kv_heads))

    @property
    def anchor(self) -> ChunkPart | None:
        """The part that names the chunk's vLLM blocks (``ChunkPart.announces``); None if no part
        does (a hybrid whose first stage has no full-attention layer)."""
        return next((p for p in self.parts if p.announces), None)

    def keys(self, chunk_keys: Sequence[bytes]) -> list[bytes]:
        """The part keys of ``chunk_keys``, chunk after chunk (``len(parts)`` each)."""
        parts = self.parts
        return [p.key(k) for k in chunk_keys for p in parts]

    def present(self, part_present: Sequence[bool]) -> list[bool]:
        """Per chunk: all of its parts present (``part_present`` in the order of ``keys``)."""
        n = len(self.parts)
        return [all(part_present[i:i + n]) for i in range(0, len(part_present), n)]

    def broken(self, part_present: Sequence[bool]) -> list[BrokenChunk]:
        """The chunks whose anchor is present and one of the parts that carry it is not, each
        with the parts missing (``part_present`` in the order of ``keys``): chunks the pool's KV
        events credit that no load can take whole (``broken_chunks.py``)."""
        parts = self.parts
        anchor = self.anchor
        if anchor is None:
            return []
        at = parts.index(anchor)
        carried = [i for i, p in enumerate(parts) if p.anchored_by(anchor)]
        n = len(parts)
        found = []
        for c, start in enumerate(range(0, len(part_present), n)):
            if part_present[start + at]:
                missing = tuple(parts[i] for i in carried if not part_present[start + i])
                if missing:
                    found.append(BrokenChunk(c, missing))
        return found

    def leading_hits(self, part_present: Sequence[bool], chunk_size: int, load_end: Callable[[int], int],
                     block_size: int) -> int:
        """How many leading chunks a load can take (``part_present`` in the order of ``keys``):
        the most ``k`` such that the chunks before ``k`` have every full-attention part, and for
        each sliding window, the chunks holding that window's tokens before ``load_end(k)`` (the
        token a load of ``k`` chunks ends at) have its parts."""
        parts = self.parts
        n = len(parts)
        chunks = [part_present[i:i + n] for i in range(0, len(part_present), n)]
        full = [i for i, p in enumerate(parts) if not p.window]
        run = next((c for c, got in enumerate(chunks) if not all(got[i] for i in full)), len(chunks))
        windowed = {w: [i for i, p in enumerate(parts) if p.window == w]
                    for w in {p.window for p in parts if p.window and p.window != STATE}}
        states = [i for i, p in enumerate(parts) if p.state]
        for k in range(run, 0, -1):
            end = load_end(k)
            if states and (end != k * chunk_size or not all(chunks[k - 1][i] for i in states)):
                continue  # a state is loaded at its chunk's end only, and only where it was saved
            if all(chunks[c][i] for w, idx in windowed.items()
                   for c in range(window_start(end, w, block_size) // chunk_size, -(-end // chunk_size)) for i in idx):
                return k
        return 0


@dataclass(frozen=True, slots=True)
class RankShard:
    """The KV one worker holds: the model's KV heads in the order of its cache's head dimension,
    which of them it stores (one replica of each head), and its stage's layers."""

    heads: tuple[int, ...]
    saves: tuple[bool, ...]
    first_layer: int
    end_layer: int
    rank: int = 0  # its tensor-parallel rank

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
            return cls(tuple(range(tp_rank * per, (tp_rank + 1) * per)), (True,) * per, *layers, rank=tp_rank)
        if tp_size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {tp_size} tensor-parallel ranks")
        replicas = tp_size // num_kv_heads
        return cls((tp_rank // replicas,), (tp_rank % replicas == 0,), *layers, rank=tp_rank)

    @classmethod
    def whole(cls, num_kv_heads: int, num_layers: int) -> RankShard:
        """The only worker of an instance without tensor or pipeline parallelism."""
        return cls.of_rank(num_kv_heads, 1, 0, (0, num_layers))

    def part(self, local_head: int, window: int | None = None) -> ChunkPart:
        """The part of the head at index ``local_head`` of this worker's cache (of the layers with
        ``window``, in a hybrid layout)."""
        return ChunkPart(self.heads[local_head], self.first_layer, self.end_layer, window)

    def state_part(self, replicated: bool) -> ChunkPart:
        """The state part of this worker's stage: its own slice of the state (its rank's), or,
        where every rank holds the whole state (``replicated``), the one rank 0 stores."""
        return ChunkPart(0 if replicated else self.rank, self.first_layer, self.end_layer, STATE)

    @property
    def saved_heads(self) -> tuple[int, ...]:
        """Indices (in this worker's cache) of the heads it stores."""
        return tuple(i for i, s in enumerate(self.saves) if s)


def kinds(windows: Sequence[int], first: int, end: int) -> tuple[int | None, ...]:
    """The kinds layers ``[first, end)`` are stored by: ``(None,)`` (all together) for a layout
    without windows, else each kind among them: ``STATE`` first, then full attention (0), then
    each window."""
    return (None,) if not windows else tuple(sorted(set(windows[first:end])))
