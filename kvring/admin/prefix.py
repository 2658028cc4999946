"""The prefix lookup (``POST /v1/lookup``) apart from its I/O: checking the request, computing its
keys, its chunks' part keys and their owners exactly as the connector does, and counting the
cached prefix (a chunk counts when every one of its parts is held).

``keys_and_owners`` runs on the serving loop for short prompts and on a worker thread for long
ones (``INLINE_KEY_TOKENS``); the rest is cheap and runs on the serving loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import HTTPException, status

from kvring.common.errors import NoOwners
from kvring.common.hashing import chained_hashes
from kvring.common.ring import HashRing
from kvring.connector.keys import KeyScope, KVLayout, MMSpan, request_keys
from kvring.connector.parts import ChunkParts

from .models import ChunkView, LookupIn
from .settings import AdminSettings

# Prompts of at most this many tokens have their keys computed on the serving loop: hashing a
# few chunks costs less than the hop to a worker thread.
INLINE_KEY_TOKENS = 4096


def check(body: LookupIn, settings: AdminSettings, chunk_size: int) -> None:
    """422 for a lookup the cluster cannot answer as asked (what pydantic cannot check alone)."""
    n = len(body.token_ids)
    if n > settings.max_lookup_tokens:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"{n} tokens exceed this admin's limit of {settings.max_lookup_tokens}")
    for span in body.mm_spans:
        if span.offset + span.length > n:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                                f"mm span [{span.offset}, {span.offset + span.length}) ends past the prompt's "
                                f"{n} tokens")
    if body.layout is not None and body.layout.chunk_size != chunk_size:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"layout.chunk_size is {body.layout.chunk_size} but the cluster's chunk size is "
                            f"{chunk_size}; keys computed with it would never match")


@dataclass(frozen=True)
class PromptKeys:
    """A lookup's namespace, its chunk keys as the connector computes them, the keys of every
    part each chunk is stored as (``kvring.connector.parts``: ``per_chunk`` parts each, chunk after
    chunk) and each part key's owners on the ring."""

    namespace: str
    chunks: list[bytes]
    parts: list[bytes]
    per_chunk: int
    part_owners: list[list[str]]
    layout_parts: ChunkParts  # what each chunk is stored as (and which of it a load needs)


def keys_and_owners(body: LookupIn, chunk_size: int, ring: HashRing | None, cluster: str) -> PromptKeys:
    """The lookup's keys and owners; ``NoOwners`` when there are keys but no active node."""
    stages = tuple(tuple(s) for s in body.stages) if body.stages else None
    if body.layout is None:
        namespace, keys = body.namespace, chained_hashes(body.namespace, body.token_ids, chunk_size)
        parts = ChunkParts(body.num_kv_heads, stages or ((0, body.num_layers),))
    else:
        layout = KVLayout(**{**body.layout.model_dump(), "windows": tuple(body.layout.windows)})
        scope = KeyScope(cache_salt=body.cache_salt or "", adapter=body.adapter, weights_epoch=body.weights_epoch)
        spans = [MMSpan(**s.model_dump()) for s in body.mm_spans]
        namespace, keys = layout.namespace(scope), request_keys(layout, body.token_ids, scope, spans)
        parts = layout.parts(stages, body.state_shards)
    part_keys = parts.keys(keys)
    if not keys:
        return PromptKeys(namespace, [], [], len(parts.parts), [], parts)
    if ring is None or not ring.nodes:
        raise NoOwners(f"no active node in cluster {cluster!r}")
    return PromptKeys(namespace, keys, part_keys, len(parts.parts), ring.owners_many(part_keys), parts)


def chunk_views(keys: PromptKeys, held: Sequence[list[str]], chunk_size: int) -> tuple[int, list[ChunkView]]:
    """How many leading chunks are cached (every part a load of them needs held by one of its
    owners, where the connector's lookup looks: of a hybrid layout's sliding windows, only the
    parts of the chunks holding each window before the last chunk's end), and each chunk as the
    answer lists it (``held``: the members holding each part key)."""
    n = keys.per_chunk
    flags = [bool(set(own) & set(h)) for own, h in zip(keys.part_owners, held)]
    # Block size unknown here: a window's first block is taken to start on a chunk boundary,
    # which covers every block size that divides the chunk.
    matched = keys.layout_parts.leading_hits(flags, chunk_size, lambda k: k * chunk_size, block_size=chunk_size)
    views = []
    for i, key in enumerate(keys.chunks):
        owners = keys.part_owners[i * n:(i + 1) * n]
        holders = held[i * n:(i + 1) * n]
        parts_held = sum(flags[i * n:(i + 1) * n])
        views.append(ChunkView(index=i, key=key.hex(), tokens=(i * chunk_size, (i + 1) * chunk_size),
                               in_prefix=i < matched, owners=_union(owners), held_by=_union(holders),
                               parts=n, parts_held=parts_held))
    return matched, views


def _union(lists: Sequence[list[str]]) -> list[str]:
    """The members of ``lists``, each once, in order of first appearance."""
    return list(dict.fromkeys(m for members in lists for m in members))
