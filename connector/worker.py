"""Worker side: layerwise loads into and saves out of vLLM's paged KV cache.

vLLM hands connectors one tensor per attention layer in the standardized ``[B, H, N, C]``
view (blocks, this worker's KV heads, block size, K|V channels); slot ``s`` lives at
``[s // block_size, :, s % block_size]``.  A kvring chunk of ``chunk_size`` tokens is stored as
parts (``parts.py``), one per KV head and pipeline stage, each layer-major
``[layers, chunk_size, 1, C]``: one layer of one part is a contiguous ``[chunk_size, 1, C]``
slice, and each of this worker's heads (its ``RankShard``) is copied from and to its own parts,
through a view of the cache at that head.

The copies themselves (host staging, scatter, gather; pinned buffers and a side stream on
CUDA) are in ``copies.py``.

Three load modes: ``layerwise`` (one job per step on a thread; layer ``l`` of every chunk
gates ``wait_for_layer_load(l)``), ``bulk`` (the whole job before the forward) and ``async``
(one job per request on a pool, between steps: the request waits in vLLM's remote-KV state
and is reported done by ``get_finished``).  A load past its deadline (``LoadSpec.deadline_s``)
is abandoned — no copy lands in its blocks after that — and its blocks recompute: an async one
when ``get_finished`` finds it late, a layerwise or bulk one when the forward has waited for it
that long (a node that hangs mid-load holds the step until then, not for the node timeout).

A hybrid model (vLLM's hybrid KV-cache manager: a block table per KV-cache group, sliding-window
groups keeping only their window's blocks) is loaded and saved group by group: each layer goes
through its own group's slot mapping, a sliding-window part is fetched and written only for the
tokens the load's window keeps (``LoadSpec.window_from``) and saved only for chunks still whole
in its group's blocks (``SaveSpec.live_from``), and its loads are async.

A model with recurrent state (Mamba, gated delta net, in vLLM's ``align`` mode) has a state
group besides its attention groups (``StateGroup``).  No attention hook runs for those layers,
so their state part is saved from ``wait_for_save`` (after the forward that computed it, from
the block vLLM handed over: ``KVRingMetadata.states``), and loaded with the chunks' attention
parts, only for a load's last chunk, into the one state block vLLM allocated at the load's end
(``LoadSpec.state_block``); its loads are async.

Nothing here raises into vLLM: a load that fails reports the block ids it should have filled
(``get_block_ids_with_load_errors``) so vLLM recomputes them -- or, with several KV-cache groups,
whose block ids vLLM cannot map back to requests, fails the request's whole load
(``get_transfer_results``' ``failed_recving``) so vLLM recomputes it; a failed save is logged,
counted and dropped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from kvring.cachenode.client import ClusterClient, ReadMeter
from kvring.cachenode.landing import Landed, Landing
from kvring.common.chunk import ChunkItem
from kvring.common.threadclock import ThreadClock, ThreadTimes

from .config import ConnectorConfig
from .copies import buffer_runs, copies_for, slot_runs
from .instance import KVGroups
from .metadata import KVRingMetadata, ReqMeta, SaveSpec, StateSave
from .parts import STATE, ChunkPart, RankShard, kinds
from .stats import Counters

logger = logging.getLogger(__name__)

# An idle step (vLLM computes nothing: its requests wait for async loads) blocks in
# get_finished until a load ends, this long at most.  Without it vLLM's engine loop runs empty
# steps back to back (~2 ms each on a CPU), contending with the loading threads for the GIL and
# the cores; with it a request arriving meanwhile waits this much longer to be scheduled.
IDLE_WAIT_S = 0.02

_TORCH_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class WorkerPart(NamedTuple):
    """One part this worker stores and loads: its head's index in this worker's cache and the
    positions (in ``WorkerSide.layer_names``) of the part's layers, in the part's order."""

    part: ChunkPart
    head: int
    layers: tuple[int, ...]


class _PartLoad(NamedTuple):
    """Where one part of a load goes."""

    req: ReqMeta
    chunk: int  # index of its chunk in the request's load
    part: WorkerPart
    job_chunk: int  # its chunk's number in the job (slot runs are per chunk)


class _Where(NamedTuple):
    """Where one part's layer goes in the paged cache."""

    kv: torch.Tensor  # its head's view of the layer
    runs: list  # the slot runs it writes (``slot_runs``)
    row0: int  # the frame row of the first


class _LoadJob:
    """Fetches every load of one step and scatters it layer by layer; layer events gate compute."""

    def __init__(self, worker: WorkerSide, requests: list[ReqMeta]) -> None:
        self.worker = worker
        self.layer_done = [threading.Event() for _ in worker.layer_names]
        self.state_loads = 0  # state parts among ``keys`` (a model with recurrent state)
        self.finished = threading.Event()
        self.ready = threading.Event()  # async: finished, and its copies in the cache (CUDA: synchronized)
        self.failed_blocks: set[int] = set()
        self.failed_reqs: set[str] = set()  # requests with a block that could not be loaded
        self.deadline = (time.monotonic() + max(r.load.deadline_s for r in requests)
                         if all(r.load.deadline_s > 0 for r in requests) else None)
        # Held by every copy into the cache; ``abandon`` takes it, so no copy lands after it.
        self._lock = threading.Lock()
        self.abandoned = False
        self.started = time.perf_counter()
        self.first_layer_s: float | None = None  # until layer 0 of every chunk was in the cache
        self.seconds = 0.0  # until the last layer was
        self.copy_seconds = 0.0  # of which copying into the paged cache (the rest: fetching and verifying)
        self.landed = 0  # bytes of ``nbytes`` received straight into the cache (``_place``), not copied
        self.thread_times: ThreadTimes | None = None  # the loading thread's, over ``run``
        self.nbytes = 0
        self.meter = ReadMeter()  # what each node's share cost (admission learns from it)
        # One flat list of part keys over all requests: each chunk's parts of this worker in
        # turn (a sliding window's only where the load's window keeps tokens), and where each goes.
        self.keys: list[bytes] = []
        self.owner: list[_PartLoad] = []
        self.chunks = 0
        self._runs: dict[tuple, list] = {}  # (job chunk, group, window) -> its slot runs
        for req in requests:
            for k, key in enumerate(req.load.keys):
                first = req.load.start + k * worker.chunk
                for wp in worker.parts:
                    if wp.part.state:
                        if k < len(req.load.keys) - 1 or req.load.state_block is None:
                            continue  # a load resumes from the state after its last chunk only
                        self.state_loads += 1
                    elif wp.part.window and first + worker.chunk <= req.load.window_from[wp.part.window]:
                        continue  # before the window: vLLM keeps no blocks of this group there
                    self.keys.append(wp.part.key(key))
                    self.owner.append(_PartLoad(req, k, wp, self.chunks))
                self.chunks += 1
        # Layerwise loads gate layer l on layer l of every part: parts of one kind only.
        self.uniform = not self.state_loads and len({o.part.layers for o in self.owner}) <= 1

    def run(self) -> None:
        clock = ThreadClock()
        w = self.worker
        found: list = [None] * len(self.keys)
        got = np.zeros((max([len(w.layer_names), *(len(o.part.layers) for o in self.owner)]), len(self.keys)),
                       dtype=bool)
        for i, owner in enumerate(self.owner):
            got[len(owner.part.layers):, i] = True  # layers a part does not have
        unusable: set[int] = set()
        error = False
        try:
            for batch in w.client.iter_layers(self.keys, found=found, meter=self.meter, place=self._place):
                if self.abandoned:
                    break
                layer = batch.layer
                for i, view in zip(batch.indices, batch.views):
                    if isinstance(view, Landed):  # received into the cache already, and checked
                        got[layer, i] = True
                        self.nbytes += view.nbytes
                        self.landed += view.nbytes
                        continue
                    try:
                        with self._lock:
                            if self.abandoned:
                                break
                            t0 = time.perf_counter()
                            self._scatter(layer, i, view)
                            self.copy_seconds += time.perf_counter() - t0
                        got[layer, i] = True
                        self.nbytes += len(view)
                    except (ValueError, RuntimeError) as exc:  # a chunk of the wrong shape: recompute it
                        unusable.add(i)
                        logger.warning("kvring chunk part %d of this step is unusable (%s); recomputing its "
                                       "chunk", i, exc)
                if self.uniform and got[layer].all():
                    if layer == 0:
                        self.first_layer_s = time.perf_counter() - self.started
                    with self._lock:  # copies may be sent only here: never after an abandon
                        if self.abandoned:
                            break
                        w.copies.layer_loaded(layer)
                    self.layer_done[layer].set()
        except Exception:
            logger.exception("kvring load failed; the affected blocks will be recomputed")
            error = True
        with self._lock:
            if not self.abandoned:  # an abandoned load's blocks were reported when it was abandoned
                for i, meta in enumerate(found):
                    if error or meta is None or not got[:, i].all():
                        reason = "error" if error else "unusable" if i in unusable else "missing"
                        w.counters.failed(reason, self._fail(i))
            else:  # nothing it staged may land after the abandon (batched copies send at flushes)
                w.copies.discard()
            w.copies.layer_loaded(-1)
            self.seconds = time.perf_counter() - self.started
            self.thread_times = clock.elapsed()
            for event in self.layer_done:
                event.set()
            self.finished.set()
        self.worker.record_load(self)

    def abandon(self) -> None:
        """Stop copying (an in-flight copy finishes first) and fail every block not yet loaded."""
        with self._lock:
            if self.finished.is_set() or self.abandoned:
                return
            self.abandoned = True
            self._fail_every("abandoned")
            self.worker.counters.add(loads_abandoned=1, loads=1, loaded_bytes=self.nbytes, landed_bytes=self.landed,
                                     load_seconds=time.perf_counter() - self.started)
            # The nodes that had not finished failed it (admission distrusts them now, rather
            # than taking their stall for their speed); the others' shares are measurements.
            self.worker.counters.transfers(self.meter.transfers(abandoned=True))

    def fail_all(self, reason: str) -> None:
        """Fail every block of the load, counted as ``reason`` (those failed already count once)."""
        with self._lock:
            self._fail_every(reason)

    def _fail_every(self, reason: str) -> None:  # holding ``_lock``
        self.worker.counters.failed(reason, sum(self._fail(i) for i in range(len(self.keys))))

    def _tokens(self, i: int) -> tuple[ReqMeta, int, int, int]:
        """Part ``i``'s request, its chunk's first token and the tokens ``[lo, hi)`` it writes."""
        owner = self.owner[i]
        req, chunk, window = owner.req, self.worker.chunk, owner.part.part.window
        first = req.load.start + owner.chunk * chunk
        if window == STATE:  # the state after the load's last token
            return req, first, req.load.end - 1, req.load.end
        lo = max(first, req.load.write_from, req.load.window_from[window] if window else 0)
        return req, first, lo, min(first + chunk, req.load.end)

    def _scatter(self, layer: int, i: int, view) -> None:
        """Copy part ``i``'s frame of ``layer`` into the paged cache, at the part's head."""
        page = self._state_page(layer, i)
        if page is not None:
            if len(view) != len(page):
                raise ValueError(f"a state of {len(view)} bytes, this model's are {len(page)}")
            page[:] = view
            return
        where = self._where(layer, i)
        if where is not None:
            self.worker.copies.load(where.kv, where.runs, view, where.row0)

    def _place(self, i: int, layer: int, size: int) -> Landing | None:
        """Where part ``i``'s frame of ``layer`` is received straight into the paged cache, if it
        can be (``HostCopies.places``): asked by the client's frame reader as the frame begins.  Each
        receive into the cache holds the load's lock and checks ``abandoned`` under it, as a
        copy does, so no byte lands after an abandon."""
        if not 0 <= layer < len(self.owner[i].part.layers):
            return None
        page = self._state_page(layer, i)
        if page is not None:
            return Landing([page], self._lock, self._wanted) if size == len(page) else None
        try:
            where = self._where(layer, i)
        except ValueError:  # copied, and refused there
            return None
        segments = self.worker.copies.places(where.kv, where.runs, size, where.row0) if where is not None else None
        if segments is None:
            return None
        return Landing(segments, self._lock, self._wanted)

    def _wanted(self) -> bool:
        return not self.abandoned

    def _state_page(self, layer: int, i: int) -> memoryview | None:
        """Where part ``i``'s frame of ``layer`` goes if it is a state part: the state bytes of
        that state layer's page of the load's state block (``None``: an attention part)."""
        owner = self.owner[i]
        if not owner.part.part.state:
            return None
        return self.worker.state_page(owner.part.layers[layer], owner.req.load.state_block)

    def _where(self, layer: int, i: int) -> _Where | None:
        """Part ``i``'s layer ``layer`` in the cache: its head's view, the slot runs it writes
        and the frame row of the first (``None``: it writes nothing)."""
        w = self.worker
        req, first, lo, hi = self._tokens(i)
        if hi <= lo:
            return None
        owner = self.owner[i]
        target = owner.part.layers[layer]
        group = w.layer_groups[target]
        runs = self._runs.get((owner.job_chunk, group, owner.part.part.window))
        if runs is None:
            slots = req.slots(group)[lo:hi]
            if w.groups.hybrid and (slots < w.block_size).any():
                raise ValueError("its window reaches a block vLLM did not allocate")  # never vLLM's null block
            runs = self._runs[(owner.job_chunk, group, owner.part.part.window)] = slot_runs(slots, w.block_size)
        return _Where(w.head_views[target][owner.part.head], runs, lo - first)

    def _fail(self, i: int) -> int:
        """Fail the blocks part ``i`` was to write (with several KV-cache groups, its request's
        whole load); how many new failed blocks."""
        req, _, lo, hi = self._tokens(i)
        if hi <= lo:
            return 0
        self.failed_reqs.add(req.req_id)
        part = self.owner[i].part
        if part.part.state:
            blocks = {req.load.state_block}
        else:  # (each group's blocks: block ids are the pool's, one group's at a time)
            slots = req.slots(self.worker.layer_groups[part.layers[0]]) if part.layers else req.slot_mapping
            blocks = set((slots[lo:hi] // self.worker.block_size).tolist())
        blocks -= self.failed_blocks
        self.failed_blocks |= blocks
        return len(blocks)

    def wait(self, event: threading.Event) -> None:
        """Wait for ``event`` (a layer's, or ``finished``), up to the load's deadline; past it,
        abandon the load (its blocks recompute).  An abandoned load waits for nothing."""
        if self.abandoned:
            return
        if self.deadline is None:
            event.wait()
        elif not event.wait(max(0.0, self.deadline - time.monotonic())):
            self.abandon()
            if self.abandoned:  # (it may have finished just then)
                logger.warning("kvring: load of %d chunk parts abandoned after %.2f s (deadline); its blocks "
                               "recompute", len(self.keys), time.perf_counter() - self.started)
                # Nothing it issued may land later, on blocks vLLM recomputes.
                self.worker.copies.synchronize()


class _SavePart(NamedTuple):
    """One part of a save: its buffers, one per chunk from ``first_chunk`` on."""

    part: WorkerPart
    first_chunk: int
    bufs: list[torch.Tensor]


@dataclass
class _Save:
    """One request's save of one step, filled layer by layer during the forward."""

    spec: SaveSpec
    rows: list[int]  # tokens of each chunk (only the last may be partial)
    parts: dict[WorkerPart, _SavePart]
    block_size: int
    chunk: int
    _runs: dict[tuple[int, int], list] = field(default_factory=dict)  # (group, first chunk) -> runs

    def runs(self, req: ReqMeta, group: int, first_chunk: int) -> list:
        """Where the tokens of chunks ``first_chunk..`` are in ``group``'s blocks: ``buffer_runs``."""
        runs = self._runs.get((group, first_chunk))
        if runs is None:
            slots = req.slots(group)[self.spec.start + first_chunk * self.chunk:self.spec.end]
            runs = self._runs[(group, first_chunk)] = buffer_runs(slots, self.block_size, self.rows[first_chunk:])
        return runs


class WorkerSide:
    """One worker's loads and saves.  ``shard``: the KV heads and layers this worker holds
    (``instance.rank_shard``); ``None``: an instance without tensor or pipeline parallelism
    (every head and layer of the caches it registers)."""

    def __init__(self, config: ConnectorConfig, client: ClusterClient, chunk_size: int, block_size: int,
                 shard: RankShard | None = None, groups: KVGroups | None = None,
                 anchor: ChunkPart | None = None) -> None:
        self.config = config
        self.client = client
        self.chunk = chunk_size
        self.block_size = block_size
        self.shard = shard
        self.groups = groups or KVGroups({})
        # The part of every chunk that names its blocks (``ChunkParts.anchor``): the instance's
        # first stage's; without one given, an instance of one stage's (once the caches are known).
        self.anchor = anchor
        self.layer_groups: list[int] = []  # per layer here: its KV-cache group (block table)
        self.state_caches: list[torch.Tensor] = []  # a model with recurrent state: its layers' caches, in order
        self._state_part: WorkerPart | None = None  # and the part it saves them as
        self.parts: list[WorkerPart] = []  # the parts this worker loads
        self._saved_parts: list[WorkerPart] = []
        self._save_rows: list[list[tuple[WorkerPart, int]]] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.head_views: list[list[torch.Tensor]] = []  # [layer][head in the cache]: [B, 1, N, C] views
        self.layer_names: list[str] = []
        self._layer_index: dict[str, int] = {}
        self._load: _LoadJob | None = None
        self._load_thread: threading.Thread | None = None
        self._abandoned: list[threading.Thread] = []  # abandoned loads' threads, ending by themselves
        self._failed: set[int] = set()
        self._failed_loads: set[str] = set()  # several KV-cache groups: requests whose load failed
        self._unstarted: set[str] = set()  # async loads that failed before they started
        self._saves: dict[str, _Save] = {}  # req -> its save of this step, filled layer by layer
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvring-save")
        # async mode: one job per request, a few at a time; req -> its job until get_finished
        self._async_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvring-async-load")
        self._async_jobs: dict[str, _LoadJob] = {}
        self._async_ended = threading.Event()  # set when an async job ends (idle steps wait on it)
        self.counters = Counters()
        self.saves_failed = 0  # chunk parts
        self.parts_saved = 0
        self.loads: list[dict] = []  # per-step load statistics (also appended to config.stats_path)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        state = self.groups.state
        if state is not None:  # the recurrent-state layers are saved and loaded apart (``state_page``)
            self.state_caches = [kv_caches[name] for name in state.layer_names if name in kv_caches]
            kv_caches = {name: kv for name, kv in kv_caches.items() if name not in state.layer_names}
        self.kv_caches = kv_caches
        self.layer_names = list(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(self.layer_names)}
        first = kv_caches[self.layer_names[0]]
        self.copies = copies_for(first, self.block_size)
        self.dtype = first.dtype
        self.dtype_name = _TORCH_DTYPES.get(first.dtype, str(first.dtype).removeprefix("torch."))
        self.token_shape = (1, *first.shape[3:])  # one part's token: (1 head, C)
        if first.shape[2] != self.block_size:
            logger.warning("KV cache block dim %d differs from block_size %d", first.shape[2], self.block_size)
        if self.shard is None:
            self.shard = RankShard.whole(first.shape[1], len(self.layer_names))
        shard = self.shard
        windows = self.groups.windows[shard.first_layer:shard.end_layer]
        attention_layers = len(windows) - windows.count(STATE) if windows else shard.end_layer - shard.first_layer
        if first.shape[1] != len(shard.heads) or len(self.layer_names) != attention_layers:
            raise ValueError(f"KVRingConnector: this worker's KV cache holds {first.shape[1]} KV heads of "
                             f"{len(self.layer_names)} layers, but its tensor/pipeline-parallel rank should hold "
                             f"{len(shard.heads)} heads of layers [{shard.first_layer}, {shard.end_layer})")
        self.head_views = [[kv[:, j:j + 1] for j in range(len(shard.heads))] for kv in kv_caches.values()]
        self.layer_groups = [self.groups.group_of(name) for name in self.layer_names]
        self.parts = self._parts()
        self._saved_parts = [p for p in self.parts if self.shard.saves[p.head]]  # one replica of each head
        self._state_part = next((p for p in self.parts if p.part.state), None)
        if self.anchor is None and shard.first_layer == 0:
            self.anchor = next((p.part for p in self.parts if p.part.head == 0 and p.part.announces), None)
        # per layer: the saved parts holding it, and its row in them
        self._save_rows: list[list[tuple[WorkerPart, int]]] = [[] for _ in self.layer_names]
        for part in self._saved_parts:
            if part.part.state:
                continue  # saved from ``wait_for_save``, not by layer
            for row, layer in enumerate(part.layers):
                self._save_rows[layer].append((part, row))

    def _parts(self) -> list[WorkerPart]:
        """This worker's parts: one per head (per head and attention kind in a hybrid layout)."""
        shard, windows = self.shard, self.groups.windows
        if not windows:
            every = tuple(range(len(self.layer_names)))
            return [WorkerPart(shard.part(j), j, every) for j in range(len(shard.heads))]
        from vllm.model_executor.models.utils import extract_layer_index

        position = {extract_layer_index(name): i for i, name in enumerate(self.layer_names)}
        parts = []
        for window in kinds(windows, shard.first_layer, shard.end_layer):
            if window == STATE:  # one part of every state layer here, in order
                part = shard.state_part(self.groups.state.replicated)
                parts.append(WorkerPart(part, 0, tuple(range(len(self.state_caches)))))
                continue
            for j in range(len(shard.heads)):
                part = shard.part(j, window)
                parts.append(WorkerPart(part, j, tuple(position[layer] for layer in part.layers(windows))))
        return parts

    # ---- loads ----------------------------------------------------------------------------

    def start_load_kv(self, meta: KVRingMetadata) -> None:
        self._load = None
        for req in meta.requests:
            if req.load is not None and req.load.asynchronous:
                self._start_async(req)
        loads = [r for r in meta.requests if r.load is not None and r.load.keys and not r.load.asynchronous]
        if not loads:
            return
        self.copies.reset()
        job = _LoadJob(self, loads)
        self._load = job
        # A load that reaches slots this step computes (a full hit's last block) is written
        # before the forward: vLLM writes those tokens' K/V before it waits for a layer's load
        # (on CUDA the forward's stream is ordered after the load's copies, its writes last).
        before_forward = self.config.load_mode == "bulk" or any(
            r.load.computed_from is not None and r.load.end > r.load.computed_from for r in loads)
        self._load_thread = threading.Thread(target=job.run, name="kvring-load", daemon=True)
        self._load_thread.start()
        if before_forward:
            job.wait(job.finished)
            self._join_load()
            self.copies.order_before_forward()

    def _start_async(self, req: ReqMeta) -> None:
        job = _LoadJob(self, [req])
        self._async_jobs[req.req_id] = job

        def run() -> None:
            try:
                if job.deadline is not None and time.monotonic() > job.deadline:
                    return  # waited past its deadline for a free loader: get_finished abandons it
                job.run()
                try:
                    self.copies.synchronize()  # on CUDA: its copies have landed before it is reported done
                except Exception:  # whether they landed is unknown: recompute them all
                    logger.exception("kvring: an async load's copies could not be synchronized; its blocks recompute")
                    job.fail_all("error")
                job.ready.set()
            finally:
                self._async_ended.set()

        self._async_pool.submit(run)

    def get_finished(self, finished_req_ids: set[str], idle: bool = False) -> tuple[set[str] | None, set[str] | None]:
        """async mode: the requests whose loads finished, or were abandoned past their deadline
        (with several KV-cache groups, those that failed are also in ``failed_loads``).  ``idle``:
        this step computed nothing, so it first waits for a load to end (``IDLE_WAIT_S`` at most)."""
        if not self._async_jobs and not self._unstarted:
            return None, None
        if idle and not self._unstarted and not finished_req_ids & self._async_jobs.keys():
            self._await_async()
        now = time.monotonic()
        done, self._unstarted = self._unstarted, set()
        if self.groups.several:
            self._failed_loads |= done - finished_req_ids
        for req_id, job in list(self._async_jobs.items()):
            if not job.ready.is_set() and (req_id in finished_req_ids or
                                           (job.deadline is not None and now > job.deadline)):
                job.abandon()  # past its deadline (or the request is gone): recompute its blocks
                if req_id not in finished_req_ids:
                    logger.warning("kvring: load of request %s abandoned after %.2f s (deadline); its blocks "
                                   "recompute", req_id, time.perf_counter() - job.started)
            if job.ready.is_set() or job.abandoned:
                if req_id not in finished_req_ids:  # an aborted request's blocks are freed, not recomputed
                    if not self.groups.several:
                        self._failed |= job.failed_blocks
                    elif job.failed_reqs:
                        self._failed_loads.add(req_id)
                done.add(req_id)
                del self._async_jobs[req_id]
        return None, done or None

    def _await_async(self) -> None:
        """Block until an async load ends: ``IDLE_WAIT_S`` at most, and never past a load's
        deadline (get_finished abandons it then)."""
        self._async_ended.clear()
        jobs = self._async_jobs.values()
        if any(job.ready.is_set() or job.abandoned for job in jobs):
            return
        now = time.monotonic()
        wait = min([IDLE_WAIT_S, *(job.deadline - now for job in jobs if job.deadline is not None)])
        if wait > 0:
            self._async_ended.wait(wait)

    def failed_loads(self) -> set[str]:
        """Several KV-cache groups: the requests ``get_finished`` reported whose loads failed
        (vLLM recomputes each whole: it cannot map block ids of several groups to requests)."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def fail_loads(self, meta: KVRingMetadata) -> None:
        """Report every block this step meant to load as failed (the load could not start)."""
        self._load = None
        for req in meta.requests:
            if req.load is None or req.load.end <= req.load.write_from:
                continue
            job = self._async_jobs.get(req.req_id)
            if job is not None:  # get_finished reports it done, with its blocks (or itself) failed
                job.abandon()
                continue
            # (group 0 may be a state group, which has no slots: an attention group's blocks)
            slots = req.slots(self.layer_groups[0] if self.layer_groups else 0)[req.load.write_from:req.load.end]
            blocks = set((slots // self.block_size).tolist())
            self.counters.failed("error", len(blocks - self._failed))
            if req.load.asynchronous:  # never started: get_finished reports it done (and failed)
                self._unstarted.add(req.req_id)
            if not self.groups.several:
                self._failed |= blocks

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self._load
        if job is None:
            return
        layer = self._layer_index[layer_name]
        job.wait(job.layer_done[layer])
        self.copies.before_layer(layer)
        if layer == len(self.layer_names) - 1:
            self._join_load()

    def _join_load(self) -> None:
        """Wait for the step's load thread and collect its failed blocks.  An abandoned load's
        thread is left to end by itself (its node may hang until the timeout): nothing it
        receives lands any more."""
        if self._load_thread is not None:
            if self._load.abandoned:
                self._abandoned = [t for t in self._abandoned if t.is_alive()] + [self._load_thread]
            else:
                self._load_thread.join()
            self._failed |= self._load.failed_blocks
            self._load_thread = None

    def record_load(self, job: _LoadJob) -> None:
        if not job.abandoned:  # an abandoned load was counted when it was abandoned
            self.counters.add(loads=1, loaded_bytes=job.nbytes, landed_bytes=job.landed, load_seconds=job.seconds)
            self.counters.transfers(job.meter.transfers())
        entry = {"mode": self.config.load_mode, "chunks": job.chunks, "parts": len(job.keys), "bytes": job.nbytes,
                 "seconds": job.seconds, "first_layer_seconds": job.first_layer_s, "copy_seconds": job.copy_seconds,
                 "landed_bytes": job.landed,
                 # the loading thread's seconds on a CPU and runnable waiting for one (the rest of
                 # ``seconds`` it was blocked: on the nodes' bytes, or a lock)
                 "thread_cpu_seconds": job.thread_times.on_cpu if job.thread_times else None,
                 "thread_runqueue_seconds": job.thread_times.waiting if job.thread_times else None,
                 "failed_blocks": len(job.failed_blocks),
                 # which worker: under tensor or pipeline parallelism each appends its own lines
                 "heads": list(self.shard.heads), "layers": [self.shard.first_layer, self.shard.end_layer]}
        self.loads.append(entry)
        del self.loads[:-1000]
        logger.debug("kvring load: %(chunks)d chunks, %(bytes)d bytes in %(seconds).4f s", entry)
        if self.config.stats_path:
            try:
                with open(self.config.stats_path, "a") as f:
                    f.write(json.dumps(entry) + "\n")
            except OSError as exc:
                logger.warning("cannot append load statistics to %s: %s", self.config.stats_path, exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._join_load()  # a step without attention calls: finish the load first
        failed, self._failed = self._failed, set()
        return failed

    # ---- saves ----------------------------------------------------------------------------

    def save_kv_layer(self, meta: KVRingMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        layer = self._layer_index[layer_name]
        if not self._saved_parts:  # every head here is a replica another rank stores
            return
        for req in meta.requests:
            if req.save is None:
                continue
            save = self._saves.get(req.req_id)
            if save is None:
                save = self._saves[req.req_id] = self._new_save(req)
            for part, row in self._save_rows[layer]:
                entry = save.parts.get(part)
                if entry is not None:
                    self.copies.gather_into(self.head_views[layer][part.head],
                                            save.runs(req, self.layer_groups[layer], entry.first_chunk),
                                            entry.bufs, row)
            if layer == len(self.layer_names) - 1:
                self._saver.submit(self._put, self._saves.pop(req.req_id), self.copies.saved())

    def _new_save(self, req: ReqMeta) -> _Save:
        """Buffers for ``req``'s save: per part this worker stores, one layer-major buffer per
        chunk it saves (a sliding window's only for chunks still whole in its blocks)."""
        save = req.save
        rows = [min(self.chunk, save.end - save.start - i * self.chunk) for i in range(len(save.keys))]
        entries = {}
        for part in self._saved_parts:
            if part.part.state:
                continue  # saved from ``wait_for_save`` (``save_states``)
            window = part.part.window
            skip = -(-(save.live_from[window] - save.start) // self.chunk) if window else 0
            first = min(max(skip, 0), len(rows))
            bufs = [self.copies.new_save_buffer((len(part.layers), n, *self.token_shape), self.dtype)
                    for n in rows[first:]]
            if bufs:
                entries[part] = _SavePart(part, first, bufs)
        return _Save(save, rows, entries, self.block_size, self.chunk)

    def _put(self, save: _Save, copied=None) -> None:
        """Store the parts of ``save``'s chunks this worker holds."""
        spec = save.spec
        blocks = spec.blocks or [None] * len(spec.keys)

        def items() -> list[ChunkItem]:
            self.copies.wait_saved(copied)  # on CUDA: the device-to-host copies have landed
            return [ChunkItem.of(entry.part.part.key(spec.keys[c]), buf.view(torch.uint8).numpy(), list(buf.shape),
                                 self.dtype_name, buf.shape[1], spec.namespace)
                    .with_blocks(blocks[c] if entry.part.part.announces else None)
                    .with_anchor(self.anchor.key(spec.keys[c]) if entry.part.part.anchored_by(self.anchor) else None)
                    for entry in save.parts.values() for c, buf in enumerate(entry.bufs, start=entry.first_chunk)]

        self._store(items, sum(len(entry.bufs) for entry in save.parts.values()))

    def _store(self, items: Callable[[], list[ChunkItem]], n: int) -> None:
        """Put the ``n`` chunk parts ``items()`` makes (on the saver thread), counting what was
        stored and what was dropped."""
        start = time.perf_counter()
        try:
            chunk_items = items()
            stored = self.client.put_many(chunk_items)
            saved = [item for item, s in zip(chunk_items, stored) if s]
            self.parts_saved += len(saved)
            self.counters.add(saved_parts=len(saved), saved_bytes=sum(i.nbytes for i in saved),
                              save_seconds=time.perf_counter() - start, failed_saves=n - len(saved))
        except Exception as exc:
            self.saves_failed += n
            self.counters.add(failed_saves=n, save_seconds=time.perf_counter() - start)
            logger.warning("kvring save of %d chunk parts failed (dropped): %s", n, exc)

    def state_page(self, layer: int, block: int) -> memoryview:
        """The state bytes of state layer ``layer`` (its position in ``state_caches``) in
        ``block``: the first ``StateGroup.nbytes`` of the layer's page there, writable."""
        page = self.state_caches[layer][block]
        if not page.is_contiguous():
            raise ValueError("a state page that is not one range of memory")
        return memoryview(page.view(torch.uint8).numpy()).cast("B")[:self.groups.state.nbytes]

    def save_states(self, states: list[StateSave]) -> None:
        """Copy each state vLLM handed over this step out of its block (after the forward that
        computed it, before vLLM can reuse the block) and store them as their chunks' state
        parts (one put, on the saver thread)."""
        part = self._state_part
        if part is None or not states or part.part.head != self.shard.rank:
            return  # (a state every rank holds whole is stored by rank 0)
        copied: list[tuple[StateSave, np.ndarray]] = []
        for state in states:
            try:
                buf = np.empty((len(self.state_caches), 1, 1, self.groups.state.nbytes), dtype=np.uint8)
                for layer in range(len(self.state_caches)):
                    buf[layer, 0, 0] = np.frombuffer(self.state_page(layer, state.block), dtype=np.uint8)
            except (ValueError, IndexError) as exc:
                self.saves_failed += 1
                self.counters.add(failed_saves=1)
                logger.warning("kvring: the recurrent state of block %d cannot be saved (dropped): %s", state.block,
                               exc)
                continue
            copied.append((state, buf))
        if copied:
            self._saver.submit(self._store, lambda: [ChunkItem.of(part.part.key(state.key), buf, list(buf.shape),
                                                                  "uint8", 1, state.namespace)
                                                     for state, buf in copied], len(copied))

    def wait_for_save(self, meta: KVRingMetadata | None = None) -> None:
        # The network part runs in the background (the forward pass never waits on it); the
        # copies out of the blocks are ordered before vLLM can reuse them.
        if self.kv_caches:
            self.copies.order_saves_before_reuse()
        if meta is not None and meta.states:
            self.save_states(meta.states)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for queued saves (shutdown, tests)."""
        self._saver.submit(lambda: None).result(timeout)

    def shutdown(self) -> None:
        for job in self._async_jobs.values():
            job.abandon()
        self._async_pool.shutdown(wait=True)
        for thread in self._abandoned:  # each ends within the node timeout
            thread.join()
        self._saver.shutdown(wait=True)
