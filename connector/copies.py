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
``CudaCopies`` keeps the cache's compute stream free: frames are staged in pinned host memory
(PyTorch's caching host allocator reuses it and keeps each buffer alive until its non-blocking
copy is done), every copy runs on a side stream, and per-layer CUDA events order it with compute
— the forward pass waits for a layer on the GPU (``wait_event``), never on the host.
"""

from __future__ import annotations

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


class HostCopies:
    """The paged cache is host memory: synchronous slice copies on NumPy views."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def new_save_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def load(self, kv: torch.Tensor, runs: list[tuple[int, int, int, int]], frame, row0: int) -> None:
        """Write rows ``row0 + pos ..`` of ``frame`` (one chunk layer, ``[tokens, H, C]``) to the
        slot ``runs`` of one layer's cache ``kv``; ``ValueError`` if the frame is too short."""
        dst = _ints(kv)
        src = np.frombuffer(frame, dtype=dst.dtype).reshape(-1, kv.shape[1], kv.shape[3])
        if src.shape[0] < _rows_needed(runs, row0):
            raise ValueError(f"chunk holds {src.shape[0]} tokens, the load needs {_rows_needed(runs, row0)}")
        for pos, block, off, n in runs:
            dst[block, :, off:off + n] = src[row0 + pos:row0 + pos + n].transpose(1, 0, 2)

    def gather_into(self, kv: torch.Tensor, runs: list[tuple[int, int, int, int, int]], bufs: list[torch.Tensor],
                    layer: int) -> None:
        """Copy the KV of the ``buffer_runs`` into layer ``layer`` of the chunk buffers ``bufs``."""
        src = _ints(kv)
        dsts = [_ints(b)[layer] for b in bufs]
        for i, r, block, off, n in runs:
            dsts[i][r:r + n] = src[block, :, off:off + n].transpose(1, 0, 2)

    def reset(self) -> None:
        """A new step's load starts."""

    def layer_loaded(self, layer: int) -> None:
        """All of layer ``layer``'s copies of this step are issued (-1: the whole load is)."""

    def before_layer(self, layer: int) -> None:
        """Called on the compute thread before layer ``layer`` reads its cache."""

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


class CudaCopies(HostCopies):
    """Pinned host staging, copies on a side stream, ordered with compute by CUDA events."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__(block_size)
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._events: dict[int, torch.cuda.Event] = {}

    def new_save_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def load(self, kv: torch.Tensor, runs: list[tuple[int, int, int, int]], frame, row0: int) -> None:
        pinned = torch.empty(len(frame), dtype=torch.uint8, pin_memory=True)
        pinned.numpy()[:] = np.frombuffer(frame, dtype=np.uint8)
        src = pinned.view(kv.dtype).view(-1, kv.shape[1], kv.shape[3])
        needed = _rows_needed(runs, row0)
        if src.shape[0] < needed:
            raise ValueError(f"chunk holds {src.shape[0]} tokens, the load needs {needed}")
        with torch.cuda.stream(self.stream):
            dev = src[row0:needed].to(kv.device, non_blocking=True)
            for pos, block, off, n in runs:
                kv[block, :, off:off + n].copy_(dev[pos:pos + n].transpose(0, 1), non_blocking=True)

    def gather_into(self, kv: torch.Tensor, runs: list[tuple[int, int, int, int, int]], bufs: list[torch.Tensor],
                    layer: int) -> None:
        # The layer was just written on the compute stream: order the side stream after it.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for i, r, block, off, n in runs:
                bufs[i][layer, r:r + n].copy_(kv[block, :, off:off + n].transpose(0, 1), non_blocking=True)

    def layer_loaded(self, layer: int) -> None:
        event = torch.cuda.Event()
        event.record(self.stream)
        self._events[layer] = event

    def before_layer(self, layer: int) -> None:
        # A layer whose load failed part-way has no event of its own: wait for the whole load,
        # so no late copy can land on blocks vLLM is recomputing.
        event = self._events.pop(layer, None) or self._events.get(-1)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def saved(self):
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait_saved(self, handle) -> None:
        handle.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()

    def order_saves_before_reuse(self) -> None:
        # On the GPU, not the host: the compute stream waits for the side stream's save copies.
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def reset(self) -> None:
        self._events.clear()


def copies_for(kv: torch.Tensor, block_size: int) -> HostCopies:
    """The copier for a cache tensor's device."""
    if kv.device.type == "cuda":
        return CudaCopies(block_size, kv.device)
    return HostCopies(block_size)
