"""Chunk keys for vLLM requests: everything that changes a chunk's KV is in its key.

A chunk's key is a chained hash (``kvring.common.hashing.chained_hashes``) whose root, the
*namespace*, folds in:

- the instance's ``KVLayout``: model name, config fingerprint, ``weights_version``, KV dtype,
  layers, KV heads, head size, block layout, chunk size -- all of the model, none of how it is
  split over workers (tensor- and pipeline-parallel ranks store a chunk as parts, one per KV
  head and stage: ``parts.py``), so instances of every TP size compute the same keys;
- the request's ``KeyScope``: its ``cache_salt`` (tenant isolation), its LoRA adapter's
  identity (the digest of the adapter's files, or a name + version the user controls — never
  vLLM's per-process integer id) and the instance's weights epoch (advanced by
  ``reset_cache()``, which vLLM calls after an in-place weight update).

and each chunk's extras fold in what replaces its tokens: multimodal item hashes at their
positions, and the digest of the prompt embeddings it covers.  So two processes compute the
same keys exactly when the same model, layout, adapter, weights and inputs would compute the
same KV.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvring.common.hashing import ChunkHash, chained_hashes

from .parts import ChunkParts

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # others (fp8 variants): 1


@dataclass(frozen=True)
class KVLayout:
    """What a chunk's bytes depend on, besides its tokens: fixed for one vLLM instance."""

    model: str
    config_fingerprint: str  # hash of the model's config and revision
    kv_dtype: str
    num_layers: int  # the model's, whatever its pipeline stages
    num_kv_heads: int  # the model's, whatever its tensor-parallel size
    head_size: int
    block_layout: str  # e.g. "NHD", "HND", or the standardized "BHNC" view
    chunk_size: int
    weights_version: str = ""  # the user's name for the weights (checkpoint step, revision)
    # MLA: a token's KV is one compressed latent of ``head_size`` (shared by every attention
    # head and every tensor-parallel rank), not a K and a V per KV head.
    latent: bool = False
    # A hybrid model served with vLLM's hybrid KV-cache manager: each layer's sliding window in
    # tokens (0: full attention).  Its chunks are stored as one part per attention kind
    # (``parts.py``); empty for every other instance, which stores all layers together.
    windows: tuple[int, ...] = ()
    # A model with recurrent-state layers (``parts.STATE`` in ``windows``): the bytes of one
    # layer's state as this instance's workers keep them (each tensor's shape and dtype, and
    # vLLM's conv-state layout), which a state part's bytes depend on.  Empty for every other.
    state_format: str = ""

    @property
    def channels(self) -> int:
        """Values per token, layer and KV head: K and V, or one MLA latent."""
        return self.head_size if self.latent else 2 * self.head_size

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers and KV heads."""
        return self.num_layers * self.num_kv_heads * self.channels * _DTYPE_BYTES.get(self.kv_dtype, 1)

    def parts(self, stages: tuple[tuple[int, int], ...] | None = None, state_shards: int = 1) -> ChunkParts:
        """The parts of a chunk stored by instances whose pipeline stages hold ``stages`` (the
        layer range of each; ``None``: one stage with every layer), and whose recurrent state,
        if any, is in ``state_shards`` slices (``ChunkParts.state_shards``)."""
        return ChunkParts(self.num_kv_heads, stages or ((0, self.num_layers),), self.windows, state_shards)

    def namespace(self, scope: KeyScope | None = None) -> str:
        """The chain's root string for requests of ``scope``."""
        fields = asdict(self)
        if not fields["weights_version"]:
            del fields["weights_version"]  # keys of instances without one are unchanged
        if not fields["latent"]:
            del fields["latent"]  # nor those of models without MLA
        if not fields["windows"]:
            del fields["windows"]  # nor those of instances with one KV-cache group
        if not fields["state_format"]:
            del fields["state_format"]  # nor those of models without recurrent state
        fields.update(asdict(scope or KeyScope()))
        if not fields["adapter"] and not fields["weights_epoch"]:
            del fields["adapter"], fields["weights_epoch"]
        return "kvring/v1/" + hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(),
                                              digest_size=16).hexdigest()


@dataclass(frozen=True)
class KeyScope:
    """A request's inputs that change the KV of every one of its chunks."""

    cache_salt: str = ""
    adapter: str = ""  # LoRA adapter identity ("" = the base model); see ``adapters.py``
    weights_epoch: int = 0  # how many times this instance's weights were replaced in place


@dataclass(frozen=True)
class MMSpan:
    """A multimodal item: its content hash covers tokens ``[offset, offset + length)``."""

    offset: int
    length: int
    item_hash: str


def request_keys(layout: KVLayout, token_ids: Sequence[int], scope: KeyScope | None = None,
                 mm_spans: Sequence[MMSpan] = (), embed_digests: Sequence[bytes] | None = None,
                 full_chunks_only: bool = True) -> list[ChunkHash]:
    """Chained keys of a request's chunks (only whole chunks unless ``full_chunks_only=False``).

    Each chunk's extras are the hashes of the multimodal items overlapping it, with the
    overlap's position, so identical placeholder tokens with different images never collide,
    and ``embed_digests[c]``, the digest of the prompt embeddings chunk ``c`` covers.
    """
    extras = None
    if mm_spans or embed_digests:
        n = -(-len(token_ids) // layout.chunk_size)
        per_chunk: list[list[str]] = [[] for _ in range(n)]
        for span in mm_spans:
            first = span.offset // layout.chunk_size
            last = min((span.offset + span.length - 1) // layout.chunk_size, n - 1)
            for c in range(first, last + 1):
                per_chunk[c].append(f"{span.item_hash}@{span.offset - c * layout.chunk_size}+{span.length}")
        for c, digest in enumerate((embed_digests or [])[:n]):
            per_chunk[c].append(f"embeds:{digest.hex()}")
        extras = ["|".join(items).encode() for items in per_chunk]
    return chained_hashes(layout.namespace(scope), np.asarray(token_ids, dtype=np.int64),
                          layout.chunk_size, full_chunks_only=full_chunks_only, extras=extras)
