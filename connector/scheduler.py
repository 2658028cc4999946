"""Scheduler side: chunk keys, prefix lookups that never hold the scheduler, the per-step plan.

Everything here runs on vLLM's scheduler thread; lookups travel on the cluster client's I/O
loop.  A request's lookup goes out when it arrives (``on_new_request``, or the first
``get_num_new_matched_tokens`` of a request that is back after a preemption) and its answer
is kept until the request is scheduled, however often vLLM asks.  While the answer is out,
``get_num_new_matched_tokens`` answers ``None`` (vLLM asks again next step), after waiting at
most ``lookup_wait_ms`` per step in total; a lookup not answered ``lookup_deadline_ms`` after it
went out is a miss, so a hung node delays only the requests whose chunks it owns, and only
that long.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from kvring.cachenode.client import ClusterClient, ReadMeter
from kvring.common.chunk import ChunkBlocks

from .adapters import AdapterIdentities
from .admission import LoadBytes, LoadCostModel
from .block_events import chunk_blocks
from .broken_chunks import BrokenChunks
from .config import ConnectorConfig
from .keys import KVLayout
from .metadata import KVRingMetadata, LoadSpec, ReqMeta, SaveSpec, StateSave
from .parts import STATE, ChunkParts, window_start
from .request_inputs import RequestInputs, read_request
from .stats import Counters, transfers_of

logger = logging.getLogger(__name__)


@dataclass
class Lookup:
    """One request's prefix lookup: in flight until ``hit_chunks`` is set."""

    inputs: RequestInputs | None  # None: the request's keys could not be made (it recomputes)
    keys: list[bytes]
    sent: float  # time.monotonic() when it went out
    future: concurrent.futures.Future | None = None
    hit_chunks: int | None = None  # leading chunks present in the cluster
    hit_tokens: int = 0  # what vLLM was told it can load, counted from the prompt's start
    admitted: bool | None = None  # admission's decision, made once per lookup however often vLLM asks
    load_failed: bool = False  # its async load failed: vLLM asks again, and it recomputes
    counted: bool = False  # its tokens are in the hit-rate counters
    meter: ReadMeter = field(default_factory=ReadMeter)  # what each node's answer cost
    shares: dict[str, float] = field(default_factory=dict)  # node -> its fraction of the present parts


@dataclass
class RequestTracker:
    """What the scheduler side remembers of a running request."""

    req_id: str
    prompt_len: int
    keys: list[bytes]  # keys of the prompt's whole chunks (then decode chunks), maybe a partial last
    block_ids: list[list[int]]  # per KV-cache group (a sliding window's freed blocks stay listed)
    saved_chunks: int  # whole chunks known to be in the cluster (hit or saved)
    inputs: RequestInputs | None = None
    request: object = None  # vLLM's Request (its all_token_ids grow while decoding)
    tail_done: bool = False  # the prompt's partial last chunk was hit, saved or is not wanted
    namespace: str = ""  # the request's key namespace, tagged on its saves (flushable as one)
    hit_chunks: int = 0  # leading chunks its lookup found (their states are in the cluster)


class _LateLookups:
    """Warns of lookups past their deadline at most every ``every`` seconds (a hung node makes many)."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self._last = -every
        self._since = 0

    def note(self, req_id: str, deadline_ms: float) -> None:
        self._since += 1
        now = time.monotonic()
        if now - self._last >= self.every:
            logger.warning("kvring: %d lookup(s) not answered within %.0f ms (the last: request %s) are "
                           "recomputed; is a cache node hung or overloaded?", self._since, deadline_ms, req_id)
            self._last, self._since = now, 0


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, layout: KVLayout, client: ClusterClient, block_size: int,
                 bytes_per_token: int | LoadBytes, parts: ChunkParts | None = None,
                 state_group: int | None = None) -> None:
        self.config = config
        self.layout = layout
        # What a chunk's load needs: every KV head of every pipeline stage (None: one stage).
        self.parts = parts or layout.parts()
        self.client = client
        self.block_size = block_size
        self.chunk = layout.chunk_size
        self.windows = sorted(set(layout.windows) - {0, STATE})  # a hybrid layout's sliding windows
        # A model with recurrent state: the KV-cache group holding it (its hits end on a state).
        self.state_group = state_group
        self.adapters = AdapterIdentities(config.adapter_identity)
        self.weights_epoch = 0
        self.counters = Counters()
        self.cost = LoadCostModel(bytes_per_token, config.timeout, config.load_deadline_ms / 1000)
        self._lookups: dict[str, Lookup] = {}
        self._pending_load: dict[str, LoadSpec] = {}
        self._async_loads: dict[str, tuple[LoadSpec, list[list[int]]]] = {}  # req -> (load, its blocks per group)
        self._loading: dict[str, set[int]] = {}  # async loads under way: req -> its blocks in group 0
        self._trackers: dict[str, RequestTracker] = {}
        self._requests: dict[str, object] = {}
        self._wait_left = 0.0  # seconds this step may still wait for lookups in flight
        # Meters of lookups answered after their deadline (appended by lookup threads), for admission.
        self._late_meters: collections.deque[ReadMeter] = collections.deque()
        self.new_step()
        self._late = _LateLookups()
        self.broken = (BrokenChunks(client, self.counters, config.withdraw_broken_after_ms / 1000)
                       if config.withdraw_broken_after_ms > 0 and self.parts.anchor is not None else None)

    def shutdown(self) -> None:
        if self.broken is not None:
            self.broken.close()

    # ---- lookups --------------------------------------------------------------------------

    def new_step(self) -> None:
        """A scheduler step begins: its allowance for waiting on lookups in flight starts over."""
        self._wait_left = self.config.lookup_wait_ms / 1000
        while self._late_meters:  # how the late lookups ended: nodes that answered, or failed
            self.cost.looked_up(self._late_meters.popleft().transfers())

    def on_new_request(self, request) -> None:
        start = time.perf_counter()
        self._requests[request.request_id] = request
        self._lookups[request.request_id] = self._send_lookup(request)
        self.counters.add(scheduler_hook_seconds=time.perf_counter() - start)

    def _send_lookup(self, request) -> Lookup:
        now = time.monotonic()
        try:
            inputs = read_request(request, self.layout, self.adapters, self.weights_epoch)
        except OSError as exc:
            logger.warning("kvring: request %s recomputes, its keys cannot be made: %s", request.request_id, exc)
            return Lookup(None, [], now, hit_chunks=0)
        keys = inputs.keys(self.layout, full_chunks_only=not self.config.save_unfull_chunk)
        if not keys:
            return Lookup(inputs, keys, now, hit_chunks=0)
        self.counters.add(lookups=1)
        meter = ReadMeter()
        future = self.client.lookup_async(self.parts.keys(keys), lease_ms=self.config.lookup_lease_ms, meter=meter)
        return Lookup(inputs, keys, now, future, meter=meter)

    def _answer(self, req_id: str, lookup: Lookup) -> int | None:
        """Leading chunks present, or ``None`` while the lookup is in flight (within its deadline)."""
        if lookup.hit_chunks is not None:
            return lookup.hit_chunks
        fut = lookup.future
        left = self.config.lookup_deadline_ms / 1000 - (time.monotonic() - lookup.sent)
        if not fut.done() and self._wait_left > 0 and left > 0:
            t0 = time.monotonic()
            concurrent.futures.wait([fut], timeout=min(self._wait_left, left))
            self._wait_left -= time.monotonic() - t0
        if fut.done():
            n_tokens = len(lookup.inputs.tokens)
            try:
                # A chunk is a hit when the load that ends with it finds every part it needs.
                present = fut.result()
                lookup.hit_chunks = self.parts.leading_hits(present, self.chunk,
                                                            lambda k: self._load_end(k, n_tokens), self.block_size)
            except Exception as exc:  # the cluster could not answer: a miss, never an error in vLLM
                logger.warning("kvring lookup for request %s failed, recomputing: %s", req_id, exc)
                self.counters.add(lookup_errors=1)
                lookup.hit_chunks = 0
            else:
                if self.broken is not None:
                    self._report_broken(lookup.keys, present)
            transfers = lookup.meter.transfers()
            self.cost.looked_up(transfers)
            hits = sum(t.hits for t in transfers)
            lookup.shares = {t.node_id: t.hits / hits for t in transfers if t.hits}
        elif time.monotonic() - lookup.sent >= self.config.lookup_deadline_ms / 1000:
            if not fut.cancel():  # under way: admission learns how it ends
                fut.add_done_callback(lambda _, meter=lookup.meter: self._late_meters.append(meter))
            self.counters.add(lookups_past_deadline=1)
            self._late.note(req_id, self.config.lookup_deadline_ms)
            lookup.hit_chunks = 0
        return lookup.hit_chunks

    def _report_broken(self, keys: list[bytes], present: list[bool]) -> None:
        """Hand the chunks the lookup found broken (anchor held, a part it carries gone) to
        ``broken_chunks.py``, which withdraws them if no owner holds the part."""
        anchor = self.parts.anchor
        for broken in self.parts.broken(present):
            chunk_key = keys[broken.chunk]
            self.broken.found(anchor.key(chunk_key), [part.key(chunk_key) for part in broken.missing])

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        start = time.perf_counter()
        try:
            return self._matched(request, num_computed_tokens)
        finally:
            self.counters.add(scheduler_hook_seconds=time.perf_counter() - start)

    def _matched(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        lookup = self._lookups.get(req_id)
        lease_s = self.config.lookup_lease_ms / 1000
        if lookup is None or (lookup.hit_chunks and lease_s and time.monotonic() - lookup.sent > lease_s / 2):
            # New here (back after a preemption), or its answer is old enough for its lease to
            # lapse while it waits for blocks: ask again.
            self._requests[req_id] = request
            lookup = self._lookups[req_id] = self._send_lookup(request)
        hit = self._answer(req_id, lookup)
        if hit is None:
            return None, False
        n_tokens = len(lookup.inputs.tokens) if lookup.inputs is not None else 0
        hit_tokens = self._load_end(hit, n_tokens)
        lookup.hit_tokens = 0
        if hit_tokens <= num_computed_tokens:
            return 0, False
        new = hit_tokens - num_computed_tokens
        if self.config.load_admission and lookup.admitted is None:
            decision = self.cost.decide(new, lookup.shares)
            lookup.admitted = decision.admit
            if decision.admit:
                self.counters.add(loads_admitted=1, load_probes=int(decision.probe))
            else:
                self.counters.by_reason("loads_refused", decision.refusal)
                logger.info("kvring: request %s recomputes %d tokens instead of loading them (%s; load %s "
                            "predicted, recompute %s)", req_id, new, decision.refusal,
                            _seconds(decision.load_s), _seconds(decision.recompute_s))
        if lookup.admitted is False or lookup.load_failed:
            return 0, False
        lookup.hit_tokens = hit_tokens
        return new, self.config.load_mode == "async"

    def _load_end(self, chunks: int, n_tokens: int) -> int:
        """The token a load of a prompt's first ``chunks`` chunks ends at (what vLLM is told)."""
        # vLLM computes at least the prompt's last token.  Loads copy whole blocks only: vLLM's
        # CPU kernel keeps a block's K transposed ([head_size, block_size]) behind the
        # standardized view, so part of a block is not a run of view rows.  A hit of whole
        # chunks that ends exactly at the prompt's end therefore loads every token but the last
        # (its copy takes the last block whole, ``_copy_end``); any other full hit (a partial
        # last chunk, a hybrid layout's windows) ends at the last block boundary before it.
        end = min(chunks * self.chunk, n_tokens)
        if self.state_group is not None:
            # A model with recurrent state resumes from the state after the hit's last chunk,
            # so the hit ends exactly there (``leading_hits`` takes no other), before the last token.
            return end if end < n_tokens else (n_tokens - 1) // self.block_size * self.block_size
        if end < n_tokens:
            return max(0, end)
        if not self.windows and n_tokens % self.block_size == 0 and chunks * self.chunk == n_tokens:
            return n_tokens - 1
        return max(0, (n_tokens - 1) // self.block_size * self.block_size)

    def _copy_end(self, hit_tokens: int, n_tokens: int) -> int:
        """One past the last token a load that ends (for vLLM) at ``hit_tokens`` copies: the
        prompt's end when vLLM computes only its last token (that block is copied whole)."""
        whole_last = hit_tokens == n_tokens - 1 and n_tokens % self.block_size == 0
        return n_tokens if whole_last and self.state_group is None else hit_tokens

    # ---- allocation and the step plan -------------------------------------------------------

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        lookup = self._lookups.get(request.request_id)
        if lookup is not None and not lookup.counted and lookup.inputs is not None:
            lookup.counted = True
            self.counters.add(queried_tokens=len(lookup.inputs.tokens), hit_tokens=max(num_external_tokens, 0))
            rate = self.cost.prefill_rate  # tokens/s of recent steps that computed and loaded nothing
            if rate and num_external_tokens > 0:
                self.counters.add(prefill_seconds_avoided=num_external_tokens / rate)
        if num_external_tokens <= 0 or lookup is None:
            return
        hit_tokens = lookup.hit_tokens
        vllm_cached = hit_tokens - num_external_tokens
        start = vllm_cached // self.chunk * self.chunk  # round down to a chunk boundary
        last = -(-hit_tokens // self.chunk)
        keys = lookup.keys[start // self.chunk:last]
        window_from = {w: window_start(hit_tokens, w, self.block_size) for w in self.windows}
        end = self._copy_end(hit_tokens, len(lookup.inputs.tokens))
        # The state after the hit goes to the state group's block of its last token (vLLM
        # allocates that one block there: ``MambaManager.allocate_external_computed_blocks``).
        state_block = (blocks.get_block_ids()[self.state_group][(hit_tokens - 1) // self.block_size]
                       if self.state_group is not None else None)
        if self.config.load_mode == "async":
            load = LoadSpec(keys, start, vllm_cached, end, asynchronous=True, computed_from=hit_tokens,
                            deadline_s=self.cost.deadline_s(num_external_tokens), window_from=window_from,
                            state_block=state_block)
            self._async_loads[request.request_id] = (load, [list(b) for b in blocks.get_block_ids()])
        else:
            self._pending_load[request.request_id] = LoadSpec(
                keys, start, vllm_cached, end, computed_from=hit_tokens, window_from=window_from,
                deadline_s=self.cost.deadline_s(num_external_tokens, asynchronous=False))

    def build_connector_meta(self, scheduler_output) -> KVRingMetadata:
        start = time.perf_counter()
        self.cost.step_started(scheduler_output.total_num_scheduled_tokens,
                               loads=bool(self._pending_load or self._async_loads))
        self.new_step()
        meta = KVRingMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0)
        for req_id, (load, block_ids) in self._async_loads.items():
            meta.requests.append(self._req_meta(req_id, block_ids, load.end, load, None))
            self._loading[req_id] = set(block_ids[0])
        self._async_loads.clear()
        for new in scheduler_output.scheduled_new_reqs:
            lookup = self._lookups.pop(new.req_id, None)
            prompt_len = len(new.prompt_token_ids) if new.prompt_token_ids is not None else \
                len(lookup.inputs.tokens) if lookup and lookup.inputs else 0
            keys = lookup.keys if lookup is not None else []
            hit = (lookup.hit_chunks or 0) if lookup is not None else 0
            whole = prompt_len // self.chunk
            inputs = lookup.inputs if lookup is not None else None
            tracker = RequestTracker(new.req_id, prompt_len, keys, [list(b) for b in new.block_ids],
                                     saved_chunks=min(hit, whole), inputs=inputs,
                                     request=self._requests.get(new.req_id),
                                     tail_done=hit > whole or len(keys) == whole,
                                     namespace=self.layout.namespace(inputs.scope) if inputs else "",
                                     hit_chunks=hit)
            self._trackers[new.req_id] = tracker
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._plan(meta, tracker, self._pending_load.pop(new.req_id, None), new.num_computed_tokens, done)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            if tracker is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted: all blocks were replaced
                tracker.block_ids = [list(b) for b in new_blocks] if new_blocks else [[] for _ in tracker.block_ids]
                self._lookups.pop(req_id, None)
            elif new_blocks is not None:
                for table, more in zip(tracker.block_ids, new_blocks):
                    table.extend(more)
            computed = cached.num_computed_tokens[i]
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan(meta, tracker, self._pending_load.pop(req_id, None), computed, done)
        if self.state_group is not None:
            self._plan_states(meta, scheduler_output)
        self.counters.add(scheduler_hook_seconds=time.perf_counter() - start)
        return meta

    def _plan_states(self, meta: KVRingMetadata, scheduler_output) -> None:
        """The recurrent states vLLM hands over this step that end a chunk of a prompt: saved by
        the workers after this step's forward, which computes them (``StateSave``).

        vLLM offers the state block of each block boundary a step reaches
        (``kv_connector_block_state.boundary_state_offloads``).  The block is the request's
        until a later step: vLLM frees a state block two steps on, and a request's blocks only
        after the step that finishes it, so the copy made in this step's ``wait_for_save``
        reads it whole.  A request preempted while this step was scheduled has lost its blocks
        already: its offers are dropped."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None) or {}
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or set()
        for req_id, entries in offers.items():
            tracker = self._trackers.get(req_id)
            if tracker is None or tracker.inputs is None or req_id in preempted:
                continue
            for group, block, tokens in entries:
                chunks, rest = divmod(tokens, self.chunk)
                # Only a chunk's end, of a chunk whose key is known, and not one its lookup found.
                if group != self.state_group or rest or not tracker.hit_chunks < chunks <= len(tracker.keys):
                    continue
                meta.states.append(StateSave(tracker.keys[chunks - 1], block, tracker.namespace))

    def _slots(self, block_ids: list[int], end: int) -> np.ndarray:
        """slot_mapping[t] = block_id * block_size + offset, for tokens [0, end)."""
        blocks = np.asarray(block_ids, dtype=np.int64)
        t = np.arange(end, dtype=np.int64)
        return blocks[t // self.block_size] * self.block_size + t % self.block_size

    def _req_meta(self, req_id: str, block_ids: list[list[int]], end: int, load: LoadSpec | None,
                  save: SaveSpec | None) -> ReqMeta:
        # (a state group's blocks are not slots: a load and a save name their block)
        slots = [self._slots(table, end) if g != self.state_group else np.zeros(0, dtype=np.int64)
                 for g, table in enumerate(block_ids)]
        return ReqMeta(req_id, slots[0], list(block_ids[0]), load, save,
                       group_slot_mappings=slots if len(slots) > 1 else [])

    def _plan(self, meta: KVRingMetadata, tracker: RequestTracker, load: LoadSpec | None, computed: int,
              done: int) -> None:
        save = self._save_spec(tracker, computed, done)
        if load is None and save is None:
            return
        end = max(load.end if load else 0, save.end if save else 0)
        meta.requests.append(self._req_meta(tracker.req_id, tracker.block_ids, end, load, save))

    def _save_spec(self, tracker: RequestTracker, computed: int, done: int) -> SaveSpec | None:
        """The chunks whose KV is complete at the end of this step (which computes tokens
        ``[computed, done)``) and not yet in the cluster."""
        c = self.chunk
        if tracker.inputs is None:
            return None
        if self.config.save_decode_cache and tracker.request is not None:
            tokens = tracker.request.all_token_ids
            full = min(done, len(tokens)) // c
            if full * c > tracker.prompt_len and full > tracker.saved_chunks:
                # Decode filled a chunk: extend the chain over prompt + generated tokens (the
                # prompt's keys are a prefix of it, so only the new chunks' keys are new).
                tracker.keys = tracker.inputs.keys(self.layout, tokens=list(tokens[:full * c]))
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
        if not keys:
            return None
        # vLLM freed each sliding window's blocks before its window when this step was scheduled
        # (from ``computed``, or fewer): its parts of chunks reaching before that are not saved.
        live_from = {w: window_start(computed, w, self.block_size) for w in self.windows}
        return SaveSpec(keys, start, end, tracker.namespace, self._blocks(tracker, start, end, len(keys)), live_from)

    def _blocks(self, tracker: RequestTracker, start: int, end: int, n: int) -> list[ChunkBlocks | None]:
        """The vLLM blocks of each of the ``n`` chunks saved from token ``start`` (for KV events)."""
        if tracker.request is None:
            return [None] * n
        c = self.chunk
        return [chunk_blocks(tracker.request, start + i * c, min(start + (i + 1) * c, end), self.block_size)
                for i in range(n)]

    # ---- worker output, finish, weights --------------------------------------------------------

    def update_connector_output(self, connector_output) -> None:
        stats = getattr(connector_output, "kv_connector_stats", None)
        data = getattr(stats, "data", None) or {}
        self.cost.loaded(transfers_of(data))
        # An async load that failed (its request, or blocks of it) sends the request back to
        # waiting, and vLLM asks for its hit again: it recomputes instead of loading again.
        invalid = getattr(connector_output, "invalid_block_ids", None) or set()
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        failed |= {req_id for req_id, blocks in self._loading.items() if blocks & invalid}
        for req_id in failed:
            lookup = self._lookups.get(req_id)
            if lookup is not None:
                lookup.load_failed = True
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._loading.pop(req_id, None)

    def request_finished(self, request) -> None:
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is not None and lookup.future is not None:
            lookup.future.cancel()
        for table in (self._pending_load, self._async_loads, self._loading, self._trackers, self._requests):
            table.pop(request.request_id, None)

    def reset_cache(self) -> bool:
        """The model's weights changed in place: move to a new key namespace (weights epoch).

        Chunks stored under the old weights are never looked up again by this instance; lookups
        made under the old epoch are sent again, and running requests save nothing more (their
        KV was computed partly under the old weights).
        """
        self.weights_epoch += 1
        for lookup in self._lookups.values():
            if lookup.future is not None:
                lookup.future.cancel()
        self._lookups.clear()
        for tracker in self._trackers.values():
            tracker.inputs = None
        logger.info("kvring: weights epoch %d (reset_cache): chunks of earlier weights will not be loaded",
                    self.weights_epoch)
        return True


def _seconds(value: float | None) -> str:
    return "unmeasured" if value is None else f"{value:.3f} s"
