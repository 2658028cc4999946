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
and is reported done by ``get_finished``; a load past its deadline is abandoned — no copy
lands in its blocks after that — and its blocks recompute).

Nothing here raises into vLLM: a load that fails reports the block ids it should have filled
(``get_block_ids_with_load_errors``) so vLLM recomputes them; a failed save is logged, counted
and dropped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from kvring.cachenode.client import ClusterClient, ReadMeter
from kvring.common.chunk import ChunkItem

from .config import ConnectorConfig
from .copies import buffer_runs, copies_for, slot_runs
from .metadata import KVRingMetadata, ReqMeta, SaveSpec
from .parts import RankShard
from .stats import Counters

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class _PartLoad(NamedTuple):
    """Where one part of a load goes."""

    req: ReqMeta
    chunk: int  # index of its chunk in the request's load
    head: int  # index of its head in this worker's cache
    job_chunk: int  # its chunk's number in the job (slot runs are per chunk)


class _LoadJob:
    """Fetches every load of one step and scatters it layer by layer; layer events gate compute."""

    def __init__(self, worker: WorkerSide, requests: list[ReqMeta]) -> None:
        self.worker = worker
        self.layer_done = [threading.Event() for _ in worker.layer_names]
        self.finished = threading.Event()
        self.failed_blocks: set[int] = set()
        self.deadline = (time.monotonic() + max(r.load.deadline_s for r in requests)
                         if all(r.load.deadline_s > 0 for r in requests) else None)
        # Held by every copy into the cache; ``abandon`` takes it, so no copy lands after it.
        self._lock = threading.Lock()
        self.abandoned = False
        self.started = time.perf_counter()
        self.first_layer_s: float | None = None  # until layer 0 of every chunk was in the cache
        self.seconds = 0.0  # until the last layer was
        self.nbytes = 0
        self.meter = ReadMeter()  # what each node's share cost (admission learns from it)
        # One flat list of part keys over all requests: each chunk's parts of this worker's
        # heads in turn, and where each goes.
        heads = range(len(worker.shard.heads))
        parts = [worker.shard.part(j) for j in heads]
        self.keys: list[bytes] = []
        self.owner: list[_PartLoad] = []
        self.chunks = 0
        self._runs: dict[int, list] = {}  # job chunk -> its slot runs (the same for every head and layer)
        for req in requests:
            for k, key in enumerate(req.load.keys):
                for j in heads:
                    self.keys.append(parts[j].key(key))
                    self.owner.append(_PartLoad(req, k, j, self.chunks))
                self.chunks += 1

    def run(self) -> None:
        w = self.worker
        found: list = [None] * len(self.keys)
        got = np.zeros((len(w.layer_names), len(self.keys)), dtype=bool)
        unusable: set[int] = set()
        error = False
        try:
            for batch in w.client.iter_layers(self.keys, found=found, meter=self.meter):
                if self.abandoned:
                    break
                layer = batch.layer
                for i, view in zip(batch.indices, batch.views):
                    try:
                        with self._lock:
                            if self.abandoned:
                                break
                            self._scatter(layer, i, view)
                        got[layer, i] = True
                        self.nbytes += len(view)
                    except (ValueError, RuntimeError) as exc:  # a chunk of the wrong shape: recompute it
                        unusable.add(i)
                        logger.warning("kvring chunk part %d of this step is unusable (%s); recomputing its "
                                       "chunk", i, exc)
                if got[layer].all():
                    if layer == 0:
                        self.first_layer_s = time.perf_counter() - self.started
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
            w.copies.layer_loaded(-1)
            self.seconds = time.perf_counter() - self.started
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
            failed = sum(self._fail(i) for i in range(len(self.keys)))
            self.worker.counters.failed("abandoned", failed)
            self.worker.counters.add(loads_abandoned=1, loads=1, loaded_bytes=self.nbytes,
                                     load_seconds=time.perf_counter() - self.started)
            # The nodes that had not finished failed it (admission distrusts them now, rather
            # than taking their stall for their speed); the others' shares are measurements.
            self.worker.counters.transfers(self.meter.transfers(abandoned=True))

    def _tokens(self, i: int) -> tuple[ReqMeta, int, int, int]:
        req, k = self.owner[i].req, self.owner[i].chunk
        chunk = self.worker.chunk
        first = req.load.start + k * chunk
        lo, hi = max(first, req.load.write_from), min(first + chunk, req.load.end)
        return req, first, lo, hi

    def _scatter(self, layer: int, i: int, view) -> None:
        w = self.worker
        req, first, lo, hi = self._tokens(i)
        if hi <= lo:
            return
        part = self.owner[i]
        runs = self._runs.get(part.job_chunk)
        if runs is None:
            runs = self._runs[part.job_chunk] = slot_runs(req.slot_mapping[lo:hi], w.block_size)
        # Straight from the (read-only) socket frame into the paged cache, at the part's head.
        w.copies.load(w.head_views[layer][part.head], runs, view, lo - first)

    def _fail(self, i: int) -> int:
        """Fail the blocks chunk ``i`` was to write; how many new failed blocks."""
        req, _, lo, hi = self._tokens(i)
        if hi <= lo:
            return 0
        blocks = set((req.slot_mapping[lo:hi] // self.worker.block_size).tolist()) - self.failed_blocks
        self.failed_blocks |= blocks
        return len(blocks)

    def wait(self, layer: int) -> None:
        self.layer_done[layer].wait()


class WorkerSide:
    """One worker's loads and saves.  ``shard``: the KV heads and layers this worker holds
    (``instance.rank_shard``); ``None``: an instance without tensor or pipeline parallelism
    (every head and layer of the caches it registers)."""

    def __init__(self, config: ConnectorConfig, client: ClusterClient, chunk_size: int, block_size: int,
                 shard: RankShard | None = None) -> None:
        self.config = config
        self.client = client
        self.chunk = chunk_size
        self.block_size = block_size
        self.shard = shard
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.head_views: list[list[torch.Tensor]] = []  # [layer][head in the cache]: [B, 1, N, C] views
        self.layer_names: list[str] = []
        self._layer_index: dict[str, int] = {}
        self._load: _LoadJob | None = None
        self._load_thread: threading.Thread | None = None
        self._failed: set[int] = set()
        # req -> (per saved head, one layer-major buffer per chunk; the save's slot runs into them)
        self._saves: dict[str, tuple[list[list[torch.Tensor]], list]] = {}
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvring-save")
        # async mode: one job per request, a few at a time; req -> its job until get_finished
        self._async_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvring-async-load")
        self._async_jobs: dict[str, _LoadJob] = {}
        self.counters = Counters()
        self.saves_failed = 0  # chunk parts
        self.parts_saved = 0
        self.loads: list[dict] = []  # per-step load statistics (also appended to config.stats_path)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
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
        if first.shape[1] != len(shard.heads) or len(self.layer_names) != shard.end_layer - shard.first_layer:
            raise ValueError(f"KVRingConnector: this worker's KV cache holds {first.shape[1]} KV heads of "
                             f"{len(self.layer_names)} layers, but its tensor/pipeline-parallel rank should hold "
                             f"{len(shard.heads)} heads of layers [{shard.first_layer}, {shard.end_layer})")
        self.head_views = [[kv[:, j:j + 1] for j in range(len(shard.heads))] for kv in kv_caches.values()]

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
        if self.config.load_mode == "bulk":
            job.run()
            self._failed |= job.failed_blocks
        else:
            self._load_thread = threading.Thread(target=job.run, name="kvring-load", daemon=True)
            self._load_thread.start()

    def _start_async(self, req: ReqMeta) -> None:
        job = _LoadJob(self, [req])
        self._async_jobs[req.req_id] = job

        def run() -> None:
            if job.deadline is not None and time.monotonic() > job.deadline:
                return  # waited past its deadline for a free loader: get_finished abandons it
            job.run()
            self.copies.synchronize()  # on CUDA: its copies have landed before it is reported done

        self._async_pool.submit(run)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """async mode: the requests whose loads finished, or were abandoned past their deadline."""
        if not self._async_jobs:
            return None, None
        now = time.monotonic()
        done = set()
        for req_id, job in list(self._async_jobs.items()):
            if not job.finished.is_set() and (req_id in finished_req_ids or
                                              (job.deadline is not None and now > job.deadline)):
                job.abandon()  # past its deadline (or the request is gone): recompute its blocks
                if req_id not in finished_req_ids:
                    logger.warning("kvring: load of request %s abandoned after %.2f s (deadline); its blocks "
                                   "recompute", req_id, time.perf_counter() - job.started)
            if job.finished.is_set() or job.abandoned:
                if req_id not in finished_req_ids:  # an aborted request's blocks are freed, not recomputed
                    self._failed |= job.failed_blocks
                done.add(req_id)
                del self._async_jobs[req_id]
        return None, done or None

    def fail_loads(self, meta: KVRingMetadata) -> None:
        """Report every block this step meant to load as failed (the load could not start)."""
        self._load = None
        for req in meta.requests:
            if req.load is not None and req.load.end > req.load.write_from:
                slots = req.slot_mapping[req.load.write_from:req.load.end]
                blocks = set((slots // self.block_size).tolist())
                self.counters.failed("error", len(blocks - self._failed))
                self._failed |= blocks
                job = self._async_jobs.pop(req.req_id, None)
                if job is not None:
                    job.abandon()

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self._load
        if job is None:
            return
        job.wait(self._layer_index[layer_name])
        self.copies.before_layer(self._layer_index[layer_name])
        if self._layer_index[layer_name] == len(self.layer_names) - 1:
            self._join_load()

    def _join_load(self) -> None:
        """Wait for a layerwise load's thread and collect its failed blocks."""
        if self._load_thread is not None:
            self._load_thread.join()
            self._failed |= self._load.failed_blocks
            self._load_thread = None

    def record_load(self, job: _LoadJob) -> None:
        if not job.abandoned:  # an abandoned load was counted when it was abandoned
            self.counters.add(loads=1, loaded_bytes=job.nbytes, load_seconds=job.seconds)
            self.counters.transfers(job.meter.transfers())
        entry = {"mode": self.config.load_mode, "chunks": job.chunks, "parts": len(job.keys), "bytes": job.nbytes,
                 "seconds": job.seconds, "first_layer_seconds": job.first_layer_s,
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
        heads = self.shard.saved_heads
        if not heads:  # every head here is a replica another rank stores
            return
        for req in meta.requests:
            if req.save is None:
                continue
            save = req.save
            if req.req_id not in self._saves:  # per head, one buffer per chunk; only the last may be partial
                rows = [min(self.chunk, save.end - save.start - i * self.chunk) for i in range(len(save.keys))]
                bufs = [[self.copies.new_save_buffer((len(self.layer_names), n, *self.token_shape), self.dtype)
                         for n in rows] for _ in heads]
                runs = buffer_runs(req.slot_mapping[save.start:save.end], self.block_size, rows)
                self._saves[req.req_id] = (bufs, runs)
            bufs, runs = self._saves[req.req_id]
            for j, head_bufs in zip(heads, bufs):
                self.copies.gather_into(self.head_views[layer][j], runs, head_bufs, layer)
            if layer == len(self.layer_names) - 1:
                self._saver.submit(self._put, save, self._saves.pop(req.req_id)[0], self.copies.saved())

    def _put(self, save: SaveSpec, bufs: list[list[torch.Tensor]], copied=None) -> None:
        """Store the saved heads' parts of ``save``'s chunks (``bufs[head][chunk]``)."""
        start = time.perf_counter()
        blocks = save.blocks or [None] * len(save.keys)
        parts = [self.shard.part(j) for j in self.shard.saved_heads]
        n = len(parts) * len(save.keys)
        try:
            self.copies.wait_saved(copied)  # on CUDA: the device-to-host copies have landed
            items = [ChunkItem.of(part.key(key), buf.view(torch.uint8).numpy(), list(buf.shape), self.dtype_name,
                                  buf.shape[1], save.namespace).with_blocks(b if part.announces else None)
                     for part, head_bufs in zip(parts, bufs) for key, buf, b in zip(save.keys, head_bufs, blocks)]
            stored = self.client.put_many(items)
            saved = [item for item, s in zip(items, stored) if s]
            self.parts_saved += len(saved)
            self.counters.add(saved_parts=len(saved), saved_bytes=sum(i.nbytes for i in saved),
                              save_seconds=time.perf_counter() - start, failed_saves=n - len(saved))
        except Exception as exc:
            self.saves_failed += n
            self.counters.add(failed_saves=n, save_seconds=time.perf_counter() - start)
            logger.warning("kvring save of %d chunk parts failed (dropped): %s", n, exc)

    def wait_for_save(self) -> None:
        # The network part runs in the background (the forward pass never waits on it); the
        # copies out of the blocks are ordered before vLLM can reuse them.
        if self.kv_caches:
            self.copies.order_saves_before_reuse()

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for queued saves (shutdown, tests)."""
        self._saver.submit(lambda: None).result(timeout)

    def shutdown(self) -> None:
        for job in self._async_jobs.values():
            job.abandon()
        self._async_pool.shutdown(wait=True)
        self._saver.shutdown(wait=True)
