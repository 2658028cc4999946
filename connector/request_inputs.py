"""What of a vLLM ``Request`` goes into its chunk keys (the only place that reads a Request for it).

Tokens, ``cache_salt``, the LoRA adapter, multimodal items (``mm_features``) and prompt
embeddings (``prompt_embeds``, with ``prompt_is_token_ids`` for prompts that mix token ids and
embeddings).  A prompt given as embeddings has placeholder token ids (zeros), so its chunks
are told apart only by the digest of their embeddings.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .adapters import AdapterIdentities
from .keys import KeyScope, KVLayout, MMSpan, request_keys


@dataclass(frozen=True)
class RequestInputs:
    """A request's key inputs, read once when it arrives."""

    tokens: list[int]  # the prompt's token ids (placeholders where embeddings stand)
    scope: KeyScope
    mm_spans: tuple[MMSpan, ...] = ()
    embed_digests: tuple[bytes, ...] | None = None  # one per chunk of the prompt, if embeddings

    def keys(self, layout: KVLayout, full_chunks_only: bool = True, tokens: list[int] | None = None) -> list[bytes]:
        """Chunk keys of the prompt, or of ``tokens`` (the prompt followed by generated tokens)."""
        return request_keys(layout, self.tokens if tokens is None else tokens, self.scope, self.mm_spans,
                            self.embed_digests, full_chunks_only=full_chunks_only)


def read_request(request, layout: KVLayout, adapters: AdapterIdentities, weights_epoch: int) -> RequestInputs:
    """``request``'s key inputs; ``OSError`` if its LoRA adapter's files cannot be read."""
    tokens = list(request.prompt_token_ids) if request.prompt_token_ids is not None else \
        [0] * int(request.num_prompt_tokens)
    scope = KeyScope(cache_salt=getattr(request, "cache_salt", None) or "",
                     adapter=adapters.identity(getattr(request, "lora_request", None)),
                     weights_epoch=weights_epoch)
    embeds = getattr(request, "prompt_embeds", None)
    digests = None
    if embeds is not None:
        digests = tuple(embed_digests(embeds, getattr(request, "prompt_is_token_ids", None), layout.chunk_size))
    return RequestInputs(tokens, scope, tuple(_mm_spans(request)), digests)


def embed_digests(embeds, is_token_ids, chunk_size: int) -> list[bytes]:
    """blake2b of each chunk's rows of ``embeds`` (``[tokens, hidden]``), and of its token-id mask."""
    import torch

    rows = embeds.detach().to("cpu").contiguous()
    raw = rows.reshape(rows.shape[0], -1).view(torch.uint8).numpy()  # the exact bytes, any dtype
    mask = None if is_token_ids is None else np.asarray(is_token_ids, dtype=np.uint8)
    out = []
    for start in range(0, rows.shape[0], chunk_size):
        h = hashlib.blake2b(raw[start:start + chunk_size].tobytes(), digest_size=16)
        h.update(str(rows.dtype).encode())
        if mask is not None:
            h.update(mask[start:start + chunk_size].tobytes())
        out.append(h.digest())
    return out


def _mm_spans(request) -> list[MMSpan]:
    spans = []
    for f in getattr(request, "mm_features", None) or []:
        pos = getattr(f, "mm_position", None)
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        if pos is not None and ident:
            spans.append(MMSpan(offset=int(pos.offset), length=int(pos.length), item_hash=str(ident)))
    return spans
