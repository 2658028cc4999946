"""The prefix lookup (``POST /v1/lookup``) apart from its I/O: checking the request, computing its
keys and owners exactly as the connector does, and counting the cached prefix.

``keys_and_owners`` runs on the serving loop for short prompts and on a worker thread for long
ones (``INLINE_KEY_TOKENS``); the rest is cheap and runs on the serving loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import HTTPException, status

from kvring.common.errors import NoOwners
from kvring.common.hashing import chained_hashes
from kvring.common.ring import HashRing
from kvring.connector.keys import KeyScope, KVLayout, MMSpan, request_keys

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


def keys_and_owners(body: LookupIn, chunk_size: int, ring: HashRing | None,
                    cluster: str) -> tuple[str, list[bytes], list[list[str]]]:
    """The lookup's namespace, its chunk keys as the connector computes them, and each key's
    owners on ``ring``; ``NoOwners`` when there are keys but no active node."""
    if body.layout is None:
        namespace, keys = body.namespace, chained_hashes(body.namespace, body.token_ids, chunk_size)
    else:
        layout = KVLayout(**body.layout.model_dump())
        scope = KeyScope(cache_salt=body.cache_salt or "", adapter=body.adapter, weights_epoch=body.weights_epoch)
        spans = [MMSpan(**s.model_dump()) for s in body.mm_spans]
        namespace, keys = layout.namespace(scope), request_keys(layout, body.token_ids, scope, spans)
    if not keys:
        return namespace, [], []
    if ring is None or not ring.nodes:
        raise NoOwners(f"no active node in cluster {cluster!r}")
    return namespace, keys, ring.owners_many(keys)


def chunk_views(keys: Sequence[bytes], owners: Sequence[list[str]], held: Sequence[list[str]],
                chunk_size: int) -> tuple[int, list[ChunkView]]:
    """How many leading chunks are cached (one of their owners holds them, where the connector's
    lookup looks), and each chunk as the answer lists it."""
    matched = 0
    for own, holders in zip(owners, held):
        if not set(own) & set(holders):
            break
        matched += 1
    return matched, [ChunkView(index=i, key=k.hex(), tokens=(i * chunk_size, (i + 1) * chunk_size),
                               in_prefix=i < matched, owners=o, held_by=h)
                     for i, (k, o, h) in enumerate(zip(keys, owners, held))]
