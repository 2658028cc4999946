"""Copies between host buffers and vLLM's paged KV cache: on the CPU backend, or on CUDA.

The worker side moves KV in two directions, one layer at a time:

- loads: a chunk's layer arrives as a read-only ZMQ frame; it is staged in a writable host
  tensor and scattered into the layer's paged cache through the request's slot mapping;
- saves: a layer's new-chunk slots are gathered out of the paged cache into the chunk's
  layer-major host buffer, which a background thread then sends.

``HostCopies`` does this with plain tensor ops (vLLM's CPU backend: the cache is host memory).
``CudaCopies`` keeps the cache's compute stream free: host staging buffers are pinned (PyTorch's
caching host allocator reuses them and keeps each alive until its non-blocking copy is done),
every copy runs on a side stream, and per-layer CUDA events order it with compute — the
forward pass waits for a layer on the GPU (``wait_event``), never on the host.
"""

from __future__ import annotations

import numpy as np
import torch


class HostCopies:
    """The paged cache is host memory: copies are plain, synchronous tensor ops."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def stage(self, view) -> torch.Tensor:
        """One copy out of a read-only socket frame into a writable uint8 tensor."""
        return torch.from_numpy(np.frombuffer(view, dtype=np.uint8).copy())

    def new_save_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def scatter(self, kv: torch.Tensor, slots: np.ndarray, src: torch.Tensor) -> None:
        """Write ``src`` ([tokens, H, C], on any device) to ``slots`` of one layer's cache ``kv``."""
        bs = self.block_size
        src = src.to(kv.device, non_blocking=True)
        if _whole_blocks(slots, bs):
            # The usual case (loads start and end on block boundaries): a strided copy per block,
            # [bs, H, C] -> [H, bs, C] (about twice as fast on CPU as one index_copy_ over them,
            # and several times faster than a per-token scatter).
            for i, block in enumerate((slots[::bs] // bs).tolist()):
                kv[block].copy_(src[i * bs:(i + 1) * bs].transpose(0, 1), non_blocking=True)
        else:
            t = torch.from_numpy(slots).to(kv.device, non_blocking=True)
            kv[t // bs, :, t % bs] = src

    def gather_into(self, kv: torch.Tensor, slots: np.ndarray, bufs: list[torch.Tensor], layer: int) -> None:
        """Copy the KV of ``slots`` into layer ``layer`` of consecutive chunk buffers ``bufs``."""
        t = torch.from_numpy(slots).to(kv.device, non_blocking=True)
        gathered = kv[t // self.block_size, :, t % self.block_size]
        first = 0
        for buf in bufs:
            rows = buf.shape[1]
            buf[layer].copy_(gathered[first:first + rows], non_blocking=True)
            first += rows

    def reset(self) -> None:
        """A new step's load starts."""

    def layer_loaded(self, layer: int) -> None:
        """All of layer ``layer``'s scatters of this step are issued (-1: the whole load is)."""

    def before_layer(self, layer: int) -> None:
        """Called on the compute thread before layer ``layer`` reads its cache."""

    def saved(self):
        """A handle for the save copies issued so far (``wait_saved`` blocks on it)."""
        return None

    def wait_saved(self, handle) -> None:
        """Block until the copies behind ``handle`` are in host memory."""


class CudaCopies(HostCopies):
    """Pinned host staging, copies on a side stream, ordered with compute by CUDA events."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__(block_size)
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._events: dict[int, torch.cuda.Event] = {}

    def stage(self, view) -> torch.Tensor:
        pinned = torch.empty(len(view), dtype=torch.uint8, pin_memory=True)
        pinned.numpy()[:] = np.frombuffer(view, dtype=np.uint8)
        return pinned

    def new_save_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def scatter(self, kv: torch.Tensor, slots: np.ndarray, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            super().scatter(kv, slots, src)

    def gather_into(self, kv: torch.Tensor, slots: np.ndarray, bufs: list[torch.Tensor], layer: int) -> None:
        # The layer was just written on the compute stream: order the side stream after it.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            super().gather_into(kv, slots, bufs, layer)

    def layer_loaded(self, layer: int) -> None:
        event = torch.cuda.Event()
        event.record(self.stream)
        self._events[layer] = event

    def before_layer(self, layer: int) -> None:
        # A layer whose load failed part-way has no event of its own: wait for the whole load,
        # so no late scatter can land on blocks vLLM is recomputing.
        event = self._events.pop(layer, None) or self._events.get(-1)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def saved(self):
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait_saved(self, handle) -> None:
        handle.synchronize()

    def reset(self) -> None:
        self._events.clear()


def _whole_blocks(slots: np.ndarray, bs: int) -> bool:
    n = len(slots)
    return (n > 0 and n % bs == 0 and slots[0] % bs == 0
            and not (slots.reshape(-1, bs) - slots[::bs, None] != np.arange(bs)).any())


def copies_for(kv: torch.Tensor, block_size: int) -> HostCopies:
    """The copier for a cache tensor's device."""
    if kv.device.type == "cuda":
        return CudaCopies(block_size, kv.device)
    return HostCopies(block_size)
