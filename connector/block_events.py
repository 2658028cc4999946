"""What a saved chunk tells the cluster's KV events (``ChunkBlocks``), read from vLLM's Request.

vLLM hashes a request's full blocks as it goes (``Request.block_hashes``, chained from the
prompt's start, with the LoRA adapter, multimodal items, cache salt and prompt embeddings as
extra keys); its own KV events name blocks by those hashes.  A chunk of ``chunk_size`` tokens
holds ``chunk_size / block_size`` of those blocks, so the chunk carries their hashes in the
form vLLM publishes them (``maybe_convert_block_hash``), the hash of the block before them,
their token ids and extra keys, and the LoRA name: exactly what vLLM's ``BlockStored`` carries
for the same blocks, so a router that follows vLLM's events credits the pool's copy too.

Only whole blocks are named (a partial last chunk names the whole blocks in it, if any).  A
request whose hashes do not match the connector's block size (a hybrid model hashing at
another granularity) names none: its chunks are saved and loaded as always, unannounced.
"""

from __future__ import annotations

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys

from kvring.common.chunk import ChunkBlocks


def chunk_blocks(request, start: int, end: int, block_size: int) -> ChunkBlocks | None:
    """The vLLM blocks in tokens ``[start, end)`` of ``request`` (``start`` on a block boundary)."""
    hashes = getattr(request, "block_hashes", None)
    tokens = request.all_token_ids
    if not hashes or len(hashes) != len(tokens) // block_size or start % block_size:
        return None
    first, last = start // block_size, min(end // block_size, len(hashes))
    if last <= first:
        return None
    extra, mm_index = [], 0
    for i in range(first, last):
        keys, mm_index = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, mm_index)
        extra.append(keys)
    lora = getattr(request, "lora_request", None)
    return ChunkBlocks.of(
        block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:last]],
        parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
        token_ids=list(tokens[first * block_size:last * block_size]),
        block_size=block_size,
        lora_name=lora.name if lora is not None else None,
        extra_keys=to_event_extra_keys(extra),
    )
