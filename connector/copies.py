"""Copies between socket frames / chunk buffers and vLLM's paged KV cache, on CPU or CUDA.

The worker side moves KV in two directions, one layer at a time:

- loads: a chunk's layer arrives as a frame read from the socket (``[tokens, H, C]``, token-major) and
  is written into the layer's paged cache (``[blocks, H, block_size, C]``) through the request's
  slot mapping;
- saves: a layer's new-chunk slots are gathered out of the paged cache into the chunk's
  layer-major host buffer, which a background thread then sends.

``HostCopies`` (vLLM's CPU backend: the cache is host memory) works on NumPy integer views of
the same memory: it reads the frame in place (no staging copy) and moves each run of slots that
lies in one block as one strided slice copy, which NumPy does several times faster than a
PyTorch strided copy of bfloat16 on CPU (bytes are bytes: the copy never looks at the values).
``CudaCopies`` keeps the cache's compute stream free and batches: a layer's frames are staged
(NumPy copies on a few threads) into reused pinned buffers and sent with one host-to-device copy
and one scatter kernel per cache storage; a save is one gather kernel per layer and part and one
pitched device-to-host copy into that part's chunk buffers, carved evenly spaced out of pinned
slabs (``BatchedCopies``: the same logic, device-agnostic, tested on the CPU).  Every copy runs on
a side stream, and per-layer CUDA events order it with compute — the forward pass waits for a
layer on the GPU (``wait_event``), never on the host.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ints(t: torch.Tensor) -> np.ndarray:
    """A writable NumPy view of a CPU tensor's memory, as integers of its element size."""
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()


def slot_runs(slots: np.ndarray, bs: int, cuts=()) -> list[tuple[int, int, int, int]]:
    """Split ``slots`` into runs of consecutive slots inside one block (and at ``cuts``):
    ``(position in slots, block, offset in block, length)``.  The same for every layer, so
    callers compute it once per chunk or save, not per layer."""
    n = len(slots)
    if n == 0:
        return []
    brk = set((np.flatnonzero((np.diff(slots) != 1) | (slots[1:] % bs == 0)) + 1).tolist())
    brk.update(int(c) for c in cuts if 0 < c < n)
    starts = [0, *sorted(brk)]
    ends = [*starts[1:], n]
    return [(s, int(slots[s]) // bs, int(slots[s]) % bs, e - s) for s, e in zip(starts, ends)]


def buffer_runs(slots: np.ndarray, bs: int, rows: list[int]) -> list[tuple[int, int, int, int, int]]:
    """``slot_runs`` of a save whose tokens fill consecutive chunk buffers of ``rows`` tokens:
    ``(buffer, row in buffer, block, offset in block, length)``."""
    edges = np.cumsum([0, *rows])
    runs = []
    for pos, block, off, n in slot_runs(slots, bs, cuts=edges[1:-1]):
        i = int(np.searchsorted(edges, pos, side="right")) - 1
        runs.append((i, pos - int(edges[i]), block, off, n))
    return runs


def _rows_needed(runs: list[tuple[int, int, int, int]], row0: int) -> int:
    return row0 + (runs[-1][0] + runs[-1][3] if runs else 0)


# Cache tensors a ``HostCopies`` keeps views of (a worker's layers times heads), and slot runs it
# keeps the byte ranges of.
_VIEWS_MAX = 4096


class _HostView(NamedTuple):
    """A cache tensor's views, made once (``HostCopies._host_view``): the entry holds the tensor, so
    its id is not reused while the entry lives."""

    kv: torch.Tensor
    ints: np.ndarray  # ``_ints(kv)``
    # Its bytes from its first element to its last, where each block's rows of the (one) head
    # are one contiguous range (vLLM's CPU cache): a run of slots is then one slice of it.
    flat: memoryview | None
    block_bytes: int  # from one block to the next, in ``flat``
    row_bytes: int  # one token's row (a head's channels)


def _make_host_view(kv: torch.Tensor) -> _HostView:
    row = kv.shape[3] * kv.element_size()
    flat = None
    if kv.shape[1] == 1 and kv.stride(3) == 1 and kv.stride(2) == kv.shape[3] and kv.numel():
        span = sum((n - 1) * stride for n, stride in zip(kv.shape, kv.stride())) + 1
        flat = memoryview(torch.as_strided(kv, (span,), (1,)).view(torch.uint8).numpy())
    return _HostView(kv, _ints(kv), flat, kv.stride(0) * kv.element_size(), row)


class HostCopies:
    """The paged cache is host memory: synchronous slice copies on NumPy views."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._views: dict[int, _HostView] = {}  # id(tensor) -> its views
        # (id(runs), row0, block bytes, row bytes) -> the runs and their byte ranges in a ``flat``
        self._spans: dict[tuple[int, int, int, int], tuple[list, list[tuple[int, int]] | None]] = {}

    def _host_view(self, kv: torch.Tensor) -> _HostView:
        """``kv``'s views, made once per cache tensor: the worker hands the same head views of its
        layers over for every frame, and making a NumPy view of a tensor costs more than the
        frame's slicing (9 % of the loading thread's time in a profile of 128 KiB frames)."""
        entry = self._views.get(id(kv))
        if entry is not None and entry.kv is kv:
            return entry
        if len(self._views) >= _VIEWS_MAX:
            self._views.clear()
        entry = self._views[id(kv)] = _make_host_view(kv)
        return entry

    def _numpy(self, kv: torch.Tensor) -> np.ndarray:
        return self._host_view(kv).ints

    def _byte_spans(self, runs: list[tuple[int, int, int, int]], row0: int,
                    v: _HostView) -> list[tuple[int, int]] | None:
        """Where each run's slots are in ``v.flat``, computed once per runs (a load's are the same
        for every layer and head); ``None`` where the runs leave rows of the frame between them."""
        key = (id(runs), row0, v.block_bytes, v.row_bytes)
        hit = self._spans.get(key)
        if hit is None or hit[0] is not runs:
            if len(self._spans) >= _VIEWS_MAX:
                self._spans.clear()
            spans: list[tuple[int, int]] | None = []
            at = row0
            for pos, block, off, n in runs:
                if row0 + pos != at:
                    spans = None
                    break
                start = block * v.block_bytes + off * v.row_bytes
                spans.append((start, start + n * v.row_bytes))
                at += n
            hit = self._spans[key] = (runs, spans)
        return hit[1]

    def new_save_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def load(self, kv: torch.Tensor, runs: list[tuple[int, int, int, int]], frame, row0: int) -> None:
        """Write rows ``row0 + pos ..`` of ``frame`` (one chunk layer, ``[tokens, H, C]``) to the
        slot ``runs`` of one layer's cache ``kv``; ``ValueError`` if the frame is too short."""
        dst = self._numpy(kv)
        src = np.frombuffer(frame, dtype=dst.dtype).reshape(-1, kv.shape[1], kv.shape[3])
        if src.shape[0] < _rows_needed(runs, row0):
            raise ValueError(f"chunk holds {src.shape[0]} tokens, the load needs {_rows_needed(runs, row0)}")
        for pos, block, off, n in runs:
            dst[block, :, off:off + n] = src[row0 + pos:row0 + pos + n].transpose(1, 0, 2)

    def places(self, kv: torch.Tensor, runs: list[tuple[int, int, int, int]], size: int,
               row0: int) -> list[memoryview | int] | None:
        """Where a frame of ``size`` bytes (one chunk layer, ``[tokens, H, C]``) would go if
        received straight into ``kv`` (``cachenode/landing.py``): in the frame's order, bytes to
        drop (rows before ``row0`` and after the runs) and, for each run, the run's slots as one
        writable byte view.  ``None`` where a run's slots are not one contiguous range of
        memory (several heads per frame, or a layout with heads inside tokens) or the frame is
        not whole rows that cover the runs: then the frame is copied (``load``)."""
        v = self._host_view(kv)
        if v.flat is None:  # several heads a frame (token-major, the cache head-major), or rows apart
            return None
        row = v.row_bytes
        end = _rows_needed(runs, row0)
        if size % row or size // row < end:
            return None
        spans = self._byte_spans(runs, row0, v)
        if spans is None:
            return None
        flat = v.flat
        segments: list[memoryview | int] = [row0 * row] if row0 else []
        segments.extend([flat[a:b] for a, b in spans])
        if size > end * row:
            segments.append(size - end * row)
        return segments

    def gather_into(self, kv: torch.Tensor, runs: list[tuple[int, int, int, int, int]], bufs: list[torch.Tensor],
                    layer: int) -> None:
        """Copy the KV of the ``buffer_runs`` into layer ``layer`` of the chunk buffers ``bufs``."""
        src = self._numpy(kv)
        dsts = [_ints(b)[layer] for b in bufs]
        for i, r, block, off, n in runs:
            dsts[i][r:r + n] = src[block, :, off:off + n].transpose(1, 0, 2)

    def discard(self) -> None:
        """Drop the copies this thread staged and has not sent (an abandoned load's)."""

    def reset(self) -> None:
        """A new step's load starts."""

    def layer_loaded(self, layer: int) -> None:
        """All of layer ``layer``'s copies of this step are issued (-1: the whole load is)."""

    def before_layer(self, layer: int) -> None:
        """Called on the compute thread before layer ``layer`` reads its cache."""

    def order_before_forward(self) -> None:
        """Called on the compute thread before the forward: every load copy this thread issued
        lands before anything the forward then writes into the cache (a full hit's last chunk
        holds slots whose K/V vLLM writes itself, and its write must be the last)."""

    def saved(self):
        """A handle for the save copies issued so far (``wait_saved`` blocks on it)."""
        return None

    def wait_saved(self, handle) -> None:
        """Block until the copies behind ``handle`` are in host memory."""

    def synchronize(self) -> None:
        """Block until every copy issued so far has landed (an async load before it is reported)."""

    def order_saves_before_reuse(self) -> None:
        """``wait_for_save``: work vLLM issues after this (a later step writing these blocks)
        runs after every save copy issued so far has read them."""


# Rows of a paged cache as one kernel sees them: a layer view ``[blocks, H, block size, C]`` whose
# C channels are contiguous and whose other strides are whole multiples of C is a set of rows of C
# channels in its storage, and ``storage_rows(kv)[base + block * s0 + head * s1 + offset * s2]`` is one
# head's slot.  vLLM's layouts all are; anything else takes the per-run copies.
_ROW_INTS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
_STAGE_ALIGN = 512  # bytes: where each staged region starts
_SLAB = 64 << 20  # bytes: save buffers are carved out of pinned slabs of this size (or larger)
_COPY_BATCH = 4 << 20  # bytes of frames per staging task on the copy threads


class _Target(NamedTuple):
    """Where a cache view's rows lie in its storage, in rows of C channels."""

    storage: int  # the storage's data pointer: frames of one storage share one scatter kernel
    base: int  # the view's first row
    strides: tuple[int, int, int]  # block, head, offset in block
    heads: int
    row_bytes: int


def _target(kv: torch.Tensor) -> _Target | None:
    """``kv``'s rows in its storage, or ``None`` when its C channels are not whole rows of it."""
    b, h, n, c = kv.shape
    s0, s1, s2, s3 = kv.stride()
    off = kv.storage_offset()
    if s3 != 1 and c > 1:
        return None
    s1 = 0 if h == 1 else s1
    s2 = 0 if n == 1 else s2
    if s0 % c or s1 % c or s2 % c or off % c:
        return None
    return _Target(kv.data_ptr() - off * kv.element_size(), off // c, (s0 // c, s1 // c, s2 // c), h,
                   c * kv.element_size())


def _row_int(row_bytes: int) -> tuple[int, torch.dtype]:
    return next((size, dtype) for size, dtype in _ROW_INTS if row_bytes % size == 0)


def _storage_rows(kv: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """Every whole row of ``kv``'s storage, ``[rows, row_bytes]`` as the widest integers that fit."""
    storage = kv.untyped_storage()
    rows = storage.nbytes() // row_bytes
    flat = torch.empty(0, dtype=torch.uint8, device=kv.device).set_(storage, 0, (rows, row_bytes), (row_bytes, 1))
    return flat.view(_row_int(row_bytes)[1])


def _run_rows(runs: list, t: _Target) -> np.ndarray:
    """The storage rows (relative to ``t.base``) of the runs' tokens, token-major then head: the
    order of a frame's and of a chunk buffer's rows.  Runs are ``slot_runs`` or ``buffer_runs``."""
    blocks = np.fromiter((r[-3] for r in runs), dtype=np.int64, count=len(runs))
    offs = np.fromiter((r[-2] for r in runs), dtype=np.int64, count=len(runs))
    lens = np.fromiter((r[-1] for r in runs), dtype=np.int64, count=len(runs))
    run = np.repeat(np.arange(len(runs)), lens)
    k = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    s0, s1, s2 = t.strides
    tokens = blocks[run] * s0 + (offs[run] + k) * s2
    return (tokens[:, None] + np.arange(t.heads, dtype=np.int64) * s1).reshape(-1)


def _contiguous_positions(runs: list) -> bool:
    """``slot_runs`` cover positions ``0 ..`` without gaps (the staged rows are the runs' rows)."""
    pos = 0
    for r in runs:
        if r[0] != pos:
            return False
        pos += r[3]
    return True


def _copy_frames(pairs: list) -> None:
    """Runs on a copy thread: NumPy copies release the GIL, so several run at once."""
    for dst, src in pairs:
        dst[:] = src


class _Pending:
    """One loading thread's staged frames, not yet sent to the device."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.stage: list | None = None  # [host tensor, its NumPy view, ready-event] from the pool
        self.used = 0  # bytes of frame rows staged
        self.rows = 0
        self.row_bytes = 0
        self.entries: list[tuple] = []  # (target or None, kv, runs, first staged row, rows, rel rows or None)
        self.queue: list = []  # staging copies not yet handed to a copy thread
        self.queued = 0
        self.futures: list = []


class BatchedCopies(HostCopies):
    """Batched copies between frames / chunk buffers and a paged cache, device-agnostic.

    Loads: ``load`` checks a frame and stages its rows into a reused host buffer (the NumPy
    copies run on a few threads, a batch of frames at a time); ``layer_loaded`` (or a full
    buffer) sends everything the calling thread staged with ONE host-to-device copy (rows and
    their destination indices) and writes it with ONE ``index_copy_`` per cache storage into the
    storage's rows.  A staging buffer returns to the pool with an event; it is reused only after
    that event.  Frames must stay valid until then (the cluster client's views do).  Each
    loading thread (the layerwise job, async jobs) stages on its own.

    Saves: buffers are carved out of large host slabs (a chunk's layers stay one contiguous
    ``[layers, rows, 1, C]`` tensor; consecutive buffers of one part are evenly spaced); a
    ``gather_into`` is ONE ``index_select`` of the runs' rows into a contiguous device tensor,
    then one pitched copy per group of evenly spaced buffers (one per chunk where the device
    cannot do pitched copies).

    Here everything runs synchronously on the cache's device (the CPU: tests); ``CudaCopies``
    adds pinned memory, the side stream and events.
    """

    max_staging = 8  # staging buffers kept; past this a thread waits for the oldest

    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__(block_size)
        self.device = device
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pool: list[list] = []  # free staging buffers: [host tensor, NumPy view, event]
        self._staging = 0  # staging buffers alive
        self._hint = 1 << 20  # bytes a flush needed (a layer of a step): new buffers are this large
        self._copiers: ThreadPoolExecutor | None = None
        self._slab: torch.Tensor | None = None
        self._slab_used = 0
        self._save_plans: dict[tuple, tuple] = {}
        self._rel: dict[tuple, tuple] = {}
        self._kvs: dict[int, tuple] = {}

    # ---- hooks (CudaCopies: pinned memory, the side stream, events) ----------------------------

    def _host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def _on_side(self):
        return contextlib.nullcontext()

    def _mark(self):
        """An event after the work issued so far on the side stream (``None``: it is done)."""
        return None

    @staticmethod
    def _done(event) -> bool:
        return event is None or event.query()

    @staticmethod
    def _wait(event) -> None:
        if event is not None:
            event.synchronize()

    def _after_compute(self) -> None:
        """Order the side stream after what compute issued (a save reads what it just wrote)."""

    def _copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> bool:
        """Copy ``height`` rows of ``width`` bytes from the device to the host; ``False``: cannot."""
        for k in range(height):
            ctypes.memmove(dst + k * dpitch, src + k * spitch, width)
        return True

    # ---- loads ----------------------------------------------------------------------------------

    def _pending(self) -> _Pending:
        p = getattr(self._local, "pending", None)
        if p is None:
            p = self._local.pending = _Pending()
        return p

    def _view(self, kv: torch.Tensor) -> tuple:
        """``(kv, its target, heads, row bytes)``, kept per view (the worker passes the same views
        every step; ``reset`` forgets them)."""
        hit = self._kvs.get(id(kv))
        if hit is None or hit[0] is not kv:
            if len(self._kvs) > 4096:
                self._kvs.clear()
            hit = self._kvs[id(kv)] = (kv, _target(kv), kv.shape[1], kv.shape[3] * kv.element_size())
        return hit

    def places(self, kv: torch.Tensor, runs: list[tuple[int, int, int, int]], size: int,
               row0: int) -> list[memoryview | int] | None:
        """Never: frames are staged and sent to the cache in batches."""
        return None

    def load(self, kv: torch.Tensor, runs: list[tuple[int, int, int, int]], frame, row0: int) -> None:
        _, t, heads, row_bytes = self._view(kv)
        token_bytes = heads * row_bytes
        src = np.frombuffer(frame, dtype=np.uint8)
        needed = _rows_needed(runs, row0)
        if src.size // token_bytes < needed:
            raise ValueError(f"chunk holds {src.size // token_bytes} tokens, the load needs {needed}")
        if not runs:
            return
        p = self._pending()
        rows = (needed - row0) * heads
        size = rows * row_bytes
        reserve = -(-size // _STAGE_ALIGN) * _STAGE_ALIGN + 16 * rows  # the rows and two indices per row
        if p.stage is not None and (p.row_bytes != row_bytes or
                                    p.used + 16 * p.rows + reserve > p.stage[0].numel()):
            if p.row_bytes == row_bytes:  # a layer of a step needs more: later buffers are larger
                self._hint = max(self._hint, 2 * p.stage[0].numel())
            self._flush(p)  # a full buffer (or rows of another width): send what it holds
        if p.stage is None:
            p.stage = self._take(max(reserve, self._hint))
            p.row_bytes = row_bytes
        rel = self._rel_rows(runs, t) if t is not None else None
        p.entries.append((t, kv, runs, p.rows, rows, rel))
        p.queue.append((p.stage[1][p.used:p.used + size], src[row0 * token_bytes:needed * token_bytes]))
        p.queued += size
        p.used += size
        p.rows += rows
        if p.queued >= _COPY_BATCH:
            self._submit(p)

    def _submit(self, p: _Pending) -> None:
        if self._copiers is None:
            with self._lock:
                if self._copiers is None:
                    self._copiers = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                       thread_name_prefix="kvring-stage")
        p.futures.append(self._copiers.submit(_copy_frames, p.queue))
        p.queue, p.queued = [], 0

    def _rel_rows(self, runs: list, t: _Target) -> np.ndarray | None:
        """The runs' rows relative to the view's first (``None``: runs with gaps: per-run copies)."""
        key = (id(runs), t.strides, t.heads)
        hit = self._rel.get(key)
        if hit is None or hit[0] is not runs:
            if len(self._rel) > 4096:
                self._rel.clear()
            hit = self._rel[key] = (runs, _run_rows(runs, t) if _contiguous_positions(runs) else None)
        return hit[1]

    def _take(self, nbytes: int) -> list:
        """A free staging buffer of at least ``nbytes`` whose last copy has landed."""
        while True:
            with self._lock:
                for i, entry in enumerate(self._pool):
                    if entry[0].numel() >= nbytes and self._done(entry[2]):
                        return self._pool.pop(i)
                if self._staging < self.max_staging or not self._pool:
                    self._staging += 1
                    nbytes = -(-nbytes // (1 << 20)) << 20
                    break
                oldest = self._pool.pop(0)  # every buffer is busy or too small: wait for the oldest
            if oldest[0].numel() >= nbytes:
                self._wait(oldest[2])
                return oldest
            with self._lock:
                self._staging -= 1  # too small for what a flush needs now: let it go
        host = self._host(nbytes)
        return [host, host.numpy(), None]

    def _wait_staged(self, p: _Pending) -> None:
        if p.queue:
            _copy_frames(p.queue)  # the last frames on this thread, while the copy threads finish
            p.queue, p.queued = [], 0
        for future in p.futures:
            future.result()
        p.futures = []

    def _flush(self, p: _Pending) -> None:
        """Send the thread's staged rows to the device and scatter them into the cache."""
        if p.stage is None:
            return
        self._wait_staged(p)
        host, staged, _ = p.stage
        self._hint = max(self._hint, p.used + 16 * p.rows + _STAGE_ALIGN)
        fast = [e for e in p.entries if e[0] is not None and e[5] is not None]
        event = None
        if p.entries:
            size, row_int = _row_int(p.row_bytes)
            # Destination rows (and, where frames of several storages or per-run copies mix, which
            # staged row each one takes), written after the rows: one host-to-device copy for all.
            idx_at = -(-p.used // _STAGE_ALIGN) * _STAGE_ALIGN
            n = sum(e[4] for e in fast)
            if fast:
                storages = {e[0].storage: k for k, e in enumerate(dict((e[0].storage, e) for e in fast).values())}
                lens = np.fromiter((e[4] for e in fast), dtype=np.int64, count=len(fast))
                dst = np.concatenate([e[5] for e in fast]) + np.repeat([e[0].base for e in fast], lens)
                simple = len(storages) == 1 and len(fast) == len(p.entries)
                idx = staged[idx_at:idx_at + 16 * n].view(np.int64)
                if simple:
                    idx[:n] = dst
                else:
                    group = np.repeat([storages[e[0].storage] for e in fast], lens)
                    src = (np.repeat([e[3] for e in fast], lens) +
                           np.arange(n) - np.repeat(np.cumsum(lens) - lens, lens))
                    order = np.argsort(group, kind="stable")
                    idx[:n], idx[n:2 * n] = dst[order], src[order]
                    bounds = np.searchsorted(group[order], np.arange(len(storages) + 1))
            end = idx_at + 16 * n
            with self._on_side():
                dev = host[:end].to(self.device, non_blocking=True)
                event = self._mark()  # the staging buffer is free once this copy has landed
                rows = dev[:p.used].view(row_int).view(p.rows, p.row_bytes // size)
                if fast:
                    didx = dev[idx_at:end].view(torch.int64)
                    if simple:
                        _storage_rows(fast[0][1], p.row_bytes).index_copy_(0, didx[:n], rows)
                    else:
                        picked = rows.index_select(0, didx[n:2 * n])
                        firsts = list(dict((e[0].storage, e) for e in fast).values())
                        for k, e in enumerate(firsts):
                            a, b = int(bounds[k]), int(bounds[k + 1])
                            _storage_rows(e[1], p.row_bytes).index_copy_(0, didx[a:b], picked[a:b])
                for t, kv, runs, first, count, rel in p.entries:
                    if t is None or rel is None:  # per-run copies (a layout that is not rows of C)
                        frame = rows[first:first + count].view(kv.dtype).view(-1, kv.shape[1], kv.shape[3])
                        for pos, block, off, m in runs:
                            kv[block, :, off:off + m].copy_(frame[pos:pos + m].transpose(0, 1), non_blocking=True)
        with self._lock:
            self._pool.append([host, staged, event])
        p.clear()

    def layer_loaded(self, layer: int) -> None:
        self._flush(self._pending())

    def order_before_forward(self) -> None:
        self._flush(self._pending())

    def discard(self) -> None:
        """Drop what the calling thread staged and did not send (an abandoned load: nothing it
        staged may land after the abandon)."""
        p = self._pending()
        if p.stage is not None:
            self._wait_staged(p)
            with self._lock:
                self._pool.append(p.stage)
        p.clear()

    def synchronize(self) -> None:
        self._flush(self._pending())

    def reset(self) -> None:
        self._kvs.clear()

    # ---- saves ----------------------------------------------------------------------------------

    def new_save_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        step = -(-nbytes // _STAGE_ALIGN) * _STAGE_ALIGN
        with self._lock:
            if self._slab is None or self._slab_used + step > self._slab.numel():
                # The slab goes back to the host allocator's cache once its last buffer is dropped.
                self._slab, self._slab_used = self._host(max(_SLAB, step)), 0
            buf = self._slab[self._slab_used:self._slab_used + nbytes]
            self._slab_used += step
        return buf.view(dtype).view(shape)

    def _save_plan(self, runs: list, t: _Target):
        """The runs' rows as a device index, and per chunk buffer its ``(buffer, first row, rows)``
        (``None``: a buffer's rows are not one contiguous range)."""
        key = (id(runs), t.strides, t.heads)
        hit = self._save_plans.get(key)
        if hit is not None and hit[0] is runs:
            return hit[1]
        segments: list[list[int]] = []
        for i, r, _, _, n in runs:
            if segments and segments[-1][0] == i:
                if segments[-1][1] + segments[-1][2] != r:
                    plan = None
                    break
                segments[-1][2] += n
            else:
                segments.append([i, r, n])
        else:
            with self._on_side():
                index = torch.from_numpy(_run_rows(runs, t)).to(self.device)
            plan = (index, [tuple(s) for s in segments])
        if len(self._save_plans) > 256:
            self._save_plans.clear()
        self._save_plans[key] = (runs, plan)
        return plan

    def gather_into(self, kv: torch.Tensor, runs: list[tuple[int, int, int, int, int]], bufs: list[torch.Tensor],
                    layer: int) -> None:
        self._after_compute()
        t = _target(kv)
        plan = self._save_plan(runs, t) if t is not None and runs else None
        if plan is None or any(not b.is_contiguous() or b.stride(1) * b.element_size() != t.heads * t.row_bytes
                               for b in bufs):
            with self._on_side():  # per-run copies (a layout that is not rows of C)
                for i, r, block, off, n in runs:
                    bufs[i][layer, r:r + n].copy_(kv[block, :, off:off + n].transpose(0, 1), non_blocking=True)
            return
        index, segments = plan
        size, row_int = _row_int(t.row_bytes)
        token_bytes = t.heads * t.row_bytes
        with self._on_side():
            rows = _storage_rows(kv, t.row_bytes)[t.base:]
            gathered = rows.index_select(0, index)  # the runs' rows, in buffer order
            src, at = gathered.data_ptr(), 0
            es = [b.element_size() for b in bufs]
            dsts = [(bufs[i].data_ptr() + layer * bufs[i].stride(0) * es[i] + r * token_bytes, n * token_bytes)
                    for i, r, n in segments]
            k = 0
            while k < len(dsts):  # groups of evenly spaced buffers of the same size: one pitched copy
                ptr, width = dsts[k]
                end = k + 1
                pitch = dsts[k + 1][0] - ptr if k + 1 < len(dsts) else width
                while end < len(dsts) and dsts[end][1] == width and dsts[end][0] - dsts[end - 1][0] == pitch:
                    end += 1
                if pitch < width:
                    end, pitch = k + 1, width
                if not self._copy2d(ptr, pitch, src + at, width, width, end - k):
                    for j in range(k, end):
                        i, r, n = segments[j]
                        out = bufs[i][layer, r:r + n].view(torch.uint8).view(-1).view(row_int)
                        out.copy_(gathered[at // t.row_bytes + (j - k) * n * t.heads:][:n * t.heads].view(-1),
                                  non_blocking=True)
                at += width * (end - k)
                k = end


class CudaCopies(BatchedCopies):
    """Pinned host staging, copies on a side stream, ordered with compute by CUDA events."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__(block_size, device)
        self.stream = torch.cuda.Stream(device=device)
        self._events: dict[int, torch.cuda.Event] = {}
        self._memcpy2d = _cuda_memcpy2d(device, self.stream)

    def _host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _on_side(self):
        return torch.cuda.stream(self.stream)

    def _mark(self):
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _after_compute(self) -> None:
        # The layer was just written on the compute stream: order the side stream after it.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def _copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> bool:
        return self._memcpy2d is not None and self._memcpy2d(dst, dpitch, src, spitch, width, height)

    def layer_loaded(self, layer: int) -> None:
        super().layer_loaded(layer)
        self._events[layer] = self._mark()

    def order_before_forward(self) -> None:
        super().order_before_forward()
        torch.cuda.current_stream(self.device).wait_event(self._mark())

    def before_layer(self, layer: int) -> None:
        # A layer whose load failed part-way has no event of its own: wait for the whole load,
        # so no late copy can land on blocks vLLM is recomputing.
        event = self._events.pop(layer, None) or self._events.get(-1)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def saved(self):
        return self._mark()

    def wait_saved(self, handle) -> None:
        handle.synchronize()

    def synchronize(self) -> None:
        super().synchronize()
        self.stream.synchronize()

    def order_saves_before_reuse(self) -> None:
        # On the GPU, not the host: the compute stream waits for the side stream's save copies.
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def reset(self) -> None:
        super().reset()
        self._events.clear()


def _cuda_memcpy2d(device: torch.device, stream: torch.cuda.Stream):
    """``cudaMemcpy2DAsync`` (device to host, on ``stream``) from the CUDA runtime PyTorch loaded,
    checked once on a small copy; ``None`` where there is none (a static runtime) or it fails:
    then every chunk buffer gets its own copy."""
    path = None
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
    except OSError:
        pass
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).cudaMemcpy2DAsync
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                   ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    handle = stream.cuda_stream

    def copy(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> bool:
        with torch.cuda.device(device):
            return fn(dst, dpitch, src, spitch, width, height, 2, handle) == 0  # cudaMemcpyDeviceToHost

    # Checked once: three rows of 40 bytes into a host buffer with a pitch of 64.
    with torch.cuda.stream(stream):
        dev = torch.arange(120, dtype=torch.uint8, device=device)
    out = torch.zeros(192, dtype=torch.uint8, pin_memory=True)
    if not copy(out.data_ptr(), 64, dev.data_ptr(), 40, 40, 3):
        return None
    stream.synchronize()
    if not torch.equal(out.view(3, 64)[:, :40].reshape(-1), torch.arange(120, dtype=torch.uint8)):
        return None
    return copy


def copies_for(kv: torch.Tensor, block_size: int) -> HostCopies:
    """The copier for a cache tensor's device."""
    if kv.device.type == "cuda":
        return CudaCopies(block_size, kv.device)
    return HostCopies(block_size)
