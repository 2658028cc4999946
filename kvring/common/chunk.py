"""Chunk objects: one contiguous, layer-major buffer plus its metadata.

A chunk's payload is ``shape = [layers, ...]`` elements of ``dtype``, laid out layer-major, so
layers ``[a, b)`` are the contiguous byte range ``[a * layer_bytes, b * layer_bytes)`` and can
be sent as a zero-copy slice.  Every layer carries its own XXH3-64 checksum: the node verifies
all of them on PUT, and a client verifies each layer it receives, whole chunk or layer range.

A chunk may name the namespace it was computed in (the connector's model/layout/``cache_salt``
namespace), so a whole namespace can be flushed from the cluster at once.  ``""`` means none:
such chunks are never touched by a flush.  The field is the last one of the metadata array, so
chunks from clients that do not send it decode with ``""``, and older nodes ignore it.

A chunk may also carry ``blocks`` (``ChunkBlocks``): the vLLM prefix-cache blocks it holds —
their block hashes as vLLM computes them, the hash of the block before them, their token ids,
block size and LoRA name — which is what the nodes' KV events (``kvring.events``) tell routers
when the chunk is stored and when it goes.  kvring's own keys never depend on it.  Like
``namespace`` it is a trailing, defaulted field, so both ways of older peers still decode.

A chunk the connector stores as several parts (one per KV head and pipeline stage) names its
blocks on one part only, its *anchor* (head 0 of the first stage, full attention); each of its
other full-attention parts carries ``anchor``, the anchor's key.  A node that lets such a part go
by itself (evicted, dropped as corrupt) while no other node holds it deletes the anchor
(``cachenode/anchors.py``): the chunk can no longer be loaded whole, so the pool's KV events stop
crediting its blocks.  Also trailing and defaulted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import xxhash

from .errors import ErrorCode, ProtocolError

# Element sizes of the dtypes a KV cache is stored in.  bfloat16 and the fp8 types have no
# NumPy dtype; chunks are opaque bytes to kvring, so only the size matters here.
DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
MAX_DIMS = 8
MAX_NAMESPACE_BYTES = 256
MAX_BLOCKS_PER_CHUNK = 4096
MAX_BLOCK_HASH_BYTES = 64
MAX_LORA_NAME_BYTES = 256
MAX_EXTRA_KEYS_BYTES = 64 << 10
MAX_KEY_BYTES = 64  # a chunk's key, as the data protocol takes it (and an anchor)

# A block hash as vLLM publishes it (``ExternalBlockHash``): a 64-bit int by default, the hash's
# bytes when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
BlockHash = int | bytes


class ChunkBlocks(msgspec.Struct, frozen=True, array_like=True):
    """The vLLM prefix-cache blocks a chunk holds, as vLLM's ``BlockStored`` event names them.

    ``token_ids`` is packed (little-endian uint32), ``block_size`` tokens per block hash.
    ``extra_keys`` is msgpack of vLLM's per-block extra keys in the untagged form its events
    carry (``to_event_extra_keys``: LoRA name, ``(mm_identifier, offset)`` pairs, cache salt,
    prompt-embedding digests), passed through as it came."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: bytes
    block_size: int
    lora_name: str | None = None
    extra_keys: bytes | None = None

    @classmethod
    def of(cls, block_hashes: list[BlockHash], parent_block_hash: BlockHash | None, token_ids: list[int],
           block_size: int, lora_name: str | None = None, extra_keys: list | None = None) -> ChunkBlocks:
        packed = np.asarray(token_ids, dtype="<u4").tobytes()
        extra = None if extra_keys is None else msgspec.msgpack.encode(extra_keys)
        return cls(list(block_hashes), parent_block_hash, packed, int(block_size), lora_name, extra)

    def tokens(self) -> list[int]:
        return np.frombuffer(self.token_ids, dtype="<u4").tolist()

    def extra_key_list(self) -> list | None:
        return None if self.extra_keys is None else msgspec.msgpack.decode(self.extra_keys)

    @property
    def nbytes(self) -> int:
        """What holding it costs a node, about: its objects and their contents."""
        hashes = sum(len(h) + 33 if isinstance(h, bytes) else 36 for h in self.block_hashes)
        return 200 + hashes + 8 * len(self.block_hashes) + len(self.token_ids) + len(self.extra_keys or b"")


class ChunkMeta(msgspec.Struct, frozen=True, array_like=True):
    """Shape, dtype, token count, per-layer checksums and namespace of one chunk."""

    shape: list[int]
    dtype: str
    tokens: int
    checksums: list[int]
    namespace: str = ""  # trailing and defaulted: wire-compatible both ways
    blocks: ChunkBlocks | None = None  # likewise
    anchor: bytes | None = None  # likewise: the key of the part of this chunk that names its blocks

    @property
    def layers(self) -> int:
        return self.shape[0]

    @property
    def layer_bytes(self) -> int:
        return math.prod(self.shape[1:]) * DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.layers * self.layer_bytes


def layer_checksums(payload, layers: int) -> list[int]:
    """XXH3-64 of each of ``layers`` equal slices of ``payload``."""
    mv = memoryview(payload).cast("B")
    step = len(mv) // layers
    return [xxhash.xxh3_64_intdigest(mv[i * step:(i + 1) * step]) for i in range(layers)]


def make_meta(payload, shape: tuple[int, ...] | list[int], dtype: str, tokens: int,
              namespace: str = "") -> ChunkMeta:
    """Build and check the metadata of a payload (client side, before PUT)."""
    shape = [int(d) for d in shape]
    meta = ChunkMeta(shape=shape, dtype=str(dtype), tokens=int(tokens), checksums=[0] * (shape[0] if shape else 0),
                     namespace=str(namespace))
    validate_meta(meta, max_bytes=None)
    n = memoryview(payload).nbytes
    if n != meta.nbytes:
        raise ProtocolError(f"payload is {n} bytes but shape {shape} of {dtype} needs {meta.nbytes}",
                            ErrorCode.SIZE_MISMATCH)
    return msgspec.structs.replace(meta, checksums=layer_checksums(payload, shape[0]))


@dataclass(frozen=True, slots=True)
class ChunkItem:
    """One chunk to store: its key, its layer-major payload and the payload's metadata
    (checksums included).  Build it with ``of``/``of_array``, which compute and check the
    metadata; a chunk read back (``Chunk``) can be stored again with its own metadata."""

    key: bytes
    payload: Any  # a contiguous buffer: bytes, bytearray, memoryview, NumPy array
    meta: ChunkMeta

    @classmethod
    def of(cls, key: bytes, payload, shape, dtype: str, tokens: int, namespace: str = "") -> ChunkItem:
        if hasattr(payload, "__array__") and not isinstance(payload, (bytes, bytearray, memoryview)):
            payload = np.ascontiguousarray(payload)
        return cls(bytes(key), payload, make_meta(payload, shape, dtype, tokens, namespace))

    @classmethod
    def of_array(cls, key: bytes, arr: np.ndarray, tokens: int, dtype: str | None = None,
                 namespace: str = "") -> ChunkItem:
        """A NumPy array, layer-major (``dtype`` overrides, e.g. bf16 carried as uint16)."""
        arr = np.ascontiguousarray(arr)
        return cls(bytes(key), arr, make_meta(arr, arr.shape, dtype or arr.dtype.name, tokens, namespace))

    def with_blocks(self, blocks: ChunkBlocks | None) -> ChunkItem:
        """This chunk naming the vLLM blocks it holds (checked like any metadata)."""
        meta = msgspec.structs.replace(self.meta, blocks=blocks)
        if blocks is not None:
            validate_blocks(blocks, meta.tokens)
        return ChunkItem(self.key, self.payload, meta)

    def with_anchor(self, anchor: bytes | None) -> ChunkItem:
        """This chunk part naming its chunk's anchor (the part that names the chunk's blocks)."""
        if anchor is None and self.meta.anchor is None:
            return self
        meta = msgspec.structs.replace(self.meta, anchor=None if anchor is None else bytes(anchor))
        validate_anchor(meta.anchor)
        return ChunkItem(self.key, self.payload, meta)

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes


def validate_meta(meta: ChunkMeta, max_bytes: int | None) -> None:
    """Raise ``ProtocolError`` if ``meta`` cannot describe a valid chunk."""
    if meta.dtype not in DTYPE_SIZES:
        raise ProtocolError(f"unsupported dtype {meta.dtype!r}; one of {sorted(DTYPE_SIZES)}")
    if not 1 <= len(meta.shape) <= MAX_DIMS:
        raise ProtocolError(f"shape must have 1..{MAX_DIMS} dims, got {meta.shape}")
    if any(d <= 0 for d in meta.shape):
        raise ProtocolError(f"shape dims must be positive, got {meta.shape}")
    if meta.tokens <= 0:
        raise ProtocolError(f"token count must be positive, got {meta.tokens}")
    if len(meta.checksums) != meta.shape[0]:
        raise ProtocolError(f"{len(meta.checksums)} checksums for {meta.shape[0]} layers")
    if len(meta.namespace.encode()) > MAX_NAMESPACE_BYTES:
        raise ProtocolError(f"namespace of {len(meta.namespace.encode())} bytes exceeds {MAX_NAMESPACE_BYTES}")
    if meta.blocks is not None:
        validate_blocks(meta.blocks, meta.tokens)
    validate_anchor(meta.anchor)
    if max_bytes is not None and meta.nbytes > max_bytes:
        raise ProtocolError(f"chunk of {meta.nbytes} bytes exceeds the maximum of {max_bytes}", "too_large")


def validate_anchor(anchor: bytes | None) -> None:
    """Raise ``ProtocolError`` unless ``anchor`` is None or could be a key."""
    if anchor is not None and not 1 <= len(anchor) <= MAX_KEY_BYTES:
        raise ProtocolError(f"anchor: a key of 1..{MAX_KEY_BYTES} bytes, got {len(anchor)}")


def validate_blocks(blocks: ChunkBlocks, chunk_tokens: int) -> None:
    """Raise ``ProtocolError`` unless ``blocks`` names whole blocks within the chunk's tokens."""
    n = len(blocks.block_hashes)
    if not 1 <= n <= MAX_BLOCKS_PER_CHUNK:
        raise ProtocolError(f"blocks: 1..{MAX_BLOCKS_PER_CHUNK} block hashes per chunk, got {n}")
    if blocks.block_size <= 0 or n * blocks.block_size > chunk_tokens:
        raise ProtocolError(f"blocks: {n} blocks of {blocks.block_size} tokens do not fit a chunk of "
                            f"{chunk_tokens} tokens")
    if len(blocks.token_ids) != 4 * n * blocks.block_size:
        raise ProtocolError(f"blocks: {len(blocks.token_ids)} bytes of token ids for {n} blocks of "
                            f"{blocks.block_size} tokens (4 bytes each)")
    for h in (*blocks.block_hashes, blocks.parent_block_hash):
        if isinstance(h, int) and not 0 <= h < 1 << 64 or isinstance(h, bytes) and len(h) > MAX_BLOCK_HASH_BYTES:
            raise ProtocolError(f"blocks: a block hash must be a 64-bit unsigned int or at most "
                                f"{MAX_BLOCK_HASH_BYTES} bytes")
    if blocks.lora_name is not None and len(blocks.lora_name.encode()) > MAX_LORA_NAME_BYTES:
        raise ProtocolError(f"blocks: a LoRA name of more than {MAX_LORA_NAME_BYTES} bytes")
    if blocks.extra_keys is not None:
        if len(blocks.extra_keys) > MAX_EXTRA_KEYS_BYTES:
            raise ProtocolError(f"blocks: extra keys over {MAX_EXTRA_KEYS_BYTES} bytes")
        try:
            extra = blocks.extra_key_list()
        except (msgspec.DecodeError, ValueError, RecursionError):
            raise ProtocolError("blocks: extra keys are not msgpack") from None
        if not isinstance(extra, list) or len(extra) != n:
            raise ProtocolError(f"blocks: extra keys must be a list of one entry per block ({n})")
