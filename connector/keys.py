"""Chunk keys for vLLM requests: the namespace folds in everything that makes KV incompatible.

Two processes compute the same keys for the same tokens exactly when they run the same model
(name and config fingerprint) with the same KV layout (dtype, layers, KV heads, head size,
block layout, chunk size, tensor-parallel layout) and the request has the same ``cache_salt``.
Multimodal item hashes replace the placeholder tokens they cover, chunk by chunk.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvring.cachenode.hashing import ChunkHash, chained_hashes


@dataclass(frozen=True)
class KVLayout:
    """What a chunk's bytes depend on, besides its tokens."""

    model: str
    config_fingerprint: str  # hash of the model's config / weights revision
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_layout: str  # e.g. "NHD", "HND", or the standardized "BHNC" view
    chunk_size: int
    tp_size: int = 1
    tp_rank: int = 0

    def namespace(self, cache_salt: str | None = None) -> str:
        """The chain's root string; ``cache_salt`` isolates tenants completely."""
        fields = asdict(self)
        fields["cache_salt"] = cache_salt or ""
        return "kvring/v1/" + hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(),
                                              digest_size=16).hexdigest()


@dataclass(frozen=True)
class MMSpan:
    """A multimodal item: its content hash covers tokens ``[offset, offset + length)``."""

    offset: int
    length: int
    item_hash: str


def request_keys(layout: KVLayout, token_ids: Sequence[int], cache_salt: str | None = None,
                 mm_spans: Sequence[MMSpan] = (), full_chunks_only: bool = True) -> list[ChunkHash]:
    """Chained keys of a request's chunks (only whole chunks unless ``full_chunks_only=False``).

    Each chunk's extras are the hashes of the multimodal items overlapping it, with the
    overlap's position, so identical placeholder tokens with different images never collide.
    """
    extras = None
    if mm_spans:
        n = -(-len(token_ids) // layout.chunk_size)
        per_chunk: list[list[str]] = [[] for _ in range(n)]
        for span in mm_spans:
            first = span.offset // layout.chunk_size
            last = min((span.offset + span.length - 1) // layout.chunk_size, n - 1)
            for c in range(first, last + 1):
                per_chunk[c].append(f"{span.item_hash}@{span.offset - c * layout.chunk_size}+{span.length}")
        extras = ["|".join(items).encode() for items in per_chunk]
    return chained_hashes(layout.namespace(cache_salt), np.asarray(token_ids, dtype=np.int64),
                          layout.chunk_size, full_chunks_only=full_chunks_only, extras=extras)
