"""Scheduler side: chunk keys, prefix lookups, and the per-step load/save plan."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from kvring.cachenode import ClusterClient, KVRingError

from .config import ConnectorConfig
from .keys import KVLayout, MMSpan, request_keys
from .metadata import KVRingMetadata, LoadSpec, ReqMeta, SaveSpec

logger = logging.getLogger(__name__)


@dataclass
class RequestTracker:
    """What the scheduler side remembers of a running request."""

    req_id: str
    prompt_len: int
    keys: list[bytes]  # keys of the prompt's whole chunks (then decode chunks), maybe a partial last
    block_ids: list[int]
    saved_chunks: int  # whole chunks known to be in the cluster (hit or saved)
    request: object = None  # vLLM's Request (its all_token_ids grow while decoding)
    tail_done: bool = False  # the prompt's partial last chunk was hit, saved or is not wanted
    namespace: str = ""  # the request's key namespace (model, layout, cache_salt), tagged on its saves


def _mm_spans(request) -> list[MMSpan]:
    spans = []
    for f in getattr(request, "mm_features", None) or []:
        pos = getattr(f, "mm_position", None)
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        if pos is not None and ident:
            spans.append(MMSpan(offset=int(pos.offset), length=int(pos.length), item_hash=str(ident)))
    return spans


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, layout: KVLayout, client: ClusterClient, block_size: int) -> None:
        self.config = config
        self.layout = layout
        self.client = client
        self.block_size = block_size
        self.chunk = layout.chunk_size
        self._lookups: dict[str, tuple[list[bytes], int, int]] = {}  # req -> (keys, hit chunks, hit tokens)
        self._pending_load: dict[str, LoadSpec] = {}
        self._trackers: dict[str, RequestTracker] = {}
        self._requests: dict[str, object] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        tokens = list(request.prompt_token_ids or [])
        self._requests[request.request_id] = request
        keys = request_keys(self.layout, tokens, getattr(request, "cache_salt", None), _mm_spans(request),
                            full_chunks_only=not self.config.save_unfull_chunk)
        try:
            hit = self.client.lookup_prefix(keys, lease_ms=self.config.lookup_lease_ms) if keys else 0
        except KVRingError as exc:
            logger.warning("kvring lookup failed, recomputing: %s", exc)
            hit = 0
        # A partial last chunk (save_unfull_chunk) covers only the prompt's remaining tokens.
        hit_tokens = min(hit * self.chunk, len(tokens))
        # At least the last prompt token is always computed, and vLLM takes external hits in
        # whole blocks: a full hit loads up to the last block boundary before the last token.
        hit_tokens = min(hit_tokens, (len(tokens) - 1) // self.block_size * self.block_size)
        self._lookups[request.request_id] = (keys, hit, hit_tokens)
        if hit_tokens <= num_computed_tokens:
            return 0, False
        return hit_tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        keys, _, hit_tokens = self._lookups[request.request_id]
        vllm_cached = hit_tokens - num_external_tokens
        start = vllm_cached // self.chunk * self.chunk  # round down to a chunk boundary
        last = -(-hit_tokens // self.chunk)
        self._pending_load[request.request_id] = LoadSpec(keys[start // self.chunk:last], start, vllm_cached,
                                                          hit_tokens)

    def build_connector_meta(self, scheduler_output) -> KVRingMetadata:
        meta = KVRingMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            keys, hit, _ = self._lookups.pop(new.req_id, ([], 0, 0))
            prompt_len = len(new.prompt_token_ids or [])
            whole = prompt_len // self.chunk
            request = self._requests.get(new.req_id)
            tracker = RequestTracker(new.req_id, prompt_len, keys, list(new.block_ids[0]),
                                     saved_chunks=min(hit, whole), request=request,
                                     tail_done=hit > whole or len(keys) == whole,
                                     namespace=self.layout.namespace(getattr(request, "cache_salt", None)))
            self._trackers[new.req_id] = tracker
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._plan(meta, tracker, self._pending_load.pop(new.req_id, None), done)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            if tracker is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted: all blocks were replaced
                tracker.block_ids = list(new_blocks[0]) if new_blocks else []
                self._lookups.pop(req_id, None)
            elif new_blocks is not None:
                tracker.block_ids.extend(new_blocks[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan(meta, tracker, self._pending_load.pop(req_id, None), done)
        return meta

    def _plan(self, meta: KVRingMetadata, tracker: RequestTracker, load: LoadSpec | None, done: int) -> None:
        save = self._save_spec(tracker, done)
        if load is None and save is None:
            return
        end = max(load.end if load else 0, save.end if save else 0)
        blocks = np.asarray(tracker.block_ids, dtype=np.int64)
        t = np.arange(end, dtype=np.int64)
        slots = blocks[t // self.block_size] * self.block_size + t % self.block_size
        meta.requests.append(ReqMeta(tracker.req_id, slots, list(tracker.block_ids), load, save))

    def _save_spec(self, tracker: RequestTracker, done: int) -> SaveSpec | None:
        """The chunks whose KV is complete at the end of this step and not yet in the cluster."""
        c = self.chunk
        if self.config.save_decode_cache and tracker.request is not None:
            tokens = tracker.request.all_token_ids
            full = min(done, len(tokens)) // c
            if full * c > tracker.prompt_len and full > tracker.saved_chunks:
                # Decode filled a chunk: extend the chain over prompt + generated tokens (the
                # prompt's keys are a prefix of it, so only the new chunks' keys are new).
                tracker.keys = request_keys(self.layout, list(tokens[:full * c]),
                                            getattr(tracker.request, "cache_salt", None),
                                            _mm_spans(tracker.request))
        else:
            full = min(done, tracker.prompt_len) // c  # prompt chunks computed by this step's end
        full = min(full, len(tracker.keys))
        start, end, keys = tracker.saved_chunks * c, full * c, tracker.keys[tracker.saved_chunks:full]
        if (not tracker.tail_done and done >= tracker.prompt_len and full == tracker.prompt_len // c
                and len(tracker.keys) > full):
            # save_unfull_chunk: the prompt's partial last chunk, keyed over its exact tokens.
            keys, end = keys + [tracker.keys[full]], tracker.prompt_len
            tracker.tail_done = True
        tracker.saved_chunks = max(tracker.saved_chunks, full)
        return SaveSpec(keys, start, end, tracker.namespace) if keys else None

    def request_finished(self, request) -> None:
        for table in (self._lookups, self._pending_load, self._trackers, self._requests):
            table.pop(request.request_id, None)
