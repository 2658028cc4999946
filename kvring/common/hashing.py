"""The hashing contract every kvring process shares.

Chunk keys are chained: ``h_i = H(h_{i-1} || tokens_i || extras_i)`` with
``h_{-1} = H(namespace)``.  ``H`` is BLAKE2b with a 16-byte digest, from the standard library,
never Python's seeded ``hash()``: two pods compute identical keys for identical tokens.
Token ids are hashed as little-endian uint32, so the key does not depend on the caller's int
type.  Ring positions are a second, fixed hash of the key (``ring_position``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from .types import ChunkHash

HASH_ALGORITHM = "blake2b-128"
DIGEST_SIZE = 16
# 2: a chunk is stored as one object per KV head and pipeline stage (``kvring.connector.parts``),
# so chunks of every tensor-parallel size are shared; 1 stored each rank's heads under one key.
FORMAT_VERSION = 2
DEFAULT_CHUNK_SIZE = 256


def namespace_hash(namespace: str) -> ChunkHash:
    """``h_{-1}``: the root of every chain, from the namespace string."""
    return ChunkHash(hashlib.blake2b(namespace.encode(), digest_size=DIGEST_SIZE).digest())


def chunk_hash(prev: bytes, tokens: Sequence[int] | np.ndarray, extras: bytes = b"") -> ChunkHash:
    """One link of the chain: the key of a chunk given its predecessor's key."""
    h = hashlib.blake2b(prev, digest_size=DIGEST_SIZE)
    h.update(np.asarray(tokens, dtype="<u4").tobytes())
    if extras:
        h.update(b"\x00extras\x00")
        h.update(extras)
    return ChunkHash(h.digest())


def chained_hashes(
    namespace: str,
    tokens: Sequence[int] | np.ndarray,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    full_chunks_only: bool = True,
    extras: Iterable[bytes] | None = None,
) -> list[ChunkHash]:
    """Keys of the chunks of ``tokens``; a trailing partial chunk only if not ``full_chunks_only``."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    arr = np.asarray(tokens, dtype=np.int64)
    n = len(arr) // chunk_size if full_chunks_only else -(-len(arr) // chunk_size)
    extra_list = list(extras) if extras is not None else []
    keys: list[ChunkHash] = []
    prev = namespace_hash(namespace)
    for i in range(n):
        extra = extra_list[i] if i < len(extra_list) else b""
        prev = chunk_hash(prev, arr[i * chunk_size:(i + 1) * chunk_size], extra)
        keys.append(prev)
    return keys


def ring_position(key: bytes) -> int:
    """The fixed 64-bit ring position of an opaque key (or of a virtual node's label)."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def ring_positions(keys: Sequence[bytes]) -> np.ndarray:
    """``ring_position`` of many keys as a uint64 array."""
    blake = hashlib.blake2b
    joined = b"".join([blake(k, digest_size=8).digest() for k in keys])
    return np.frombuffer(joined, dtype=">u8").astype(np.uint64)
