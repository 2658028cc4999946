"""Loads into and gathers out of a paged KV cache, against a per-token reference: runs of slots
in one block, unaligned ranges, an offset into the chunk frame, a frame too short, and (where a
GPU is present) the CUDA path with pinned staging and a side stream.  "batched" is the CUDA path's
batching (staging, one index per flush, one gather per save) on the CPU: ``BatchedCopies``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvring.connector.cache_layouts import LAYOUTS, vllm_views
from kvring.connector.copies import (BatchedCopies, CudaCopies, HostCopies, buffer_runs,
                                     slot_runs)

BS, H, C, BLOCKS = 16, 2, 8, 40
DEVICES = ["cpu", "batched", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _copies(device: str) -> HostCopies:
    if device == "cpu":
        return HostCopies(BS)
    if device == "batched":
        return BatchedCopies(BS, torch.device("cpu"))
    return CudaCopies(BS, torch.device(device))


def _device(device: str) -> str:
    return "cpu" if device == "batched" else device


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int16)  # compare bit patterns (random bytes may be NaNs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lo, hi, row0", [(0, 64, 0), (16, 48, 0), (3, 64, 0), (0, 61, 0), (5, 9, 0), (16, 48, 7)])
def test_load_and_gather_match_a_per_token_reference(device, lo, hi, row0):
    rng = np.random.default_rng(lo * 100 + hi + row0)
    blocks = rng.permutation(BLOCKS)[:4]
    slots = ((blocks[:, None] * BS + np.arange(BS)).reshape(-1))[lo:hi]
    kv = torch.randn(BLOCKS, H, BS, C).to(torch.bfloat16)
    frame_rows = torch.randn(row0 + len(slots), H, C).to(torch.bfloat16)
    frame = memoryview(frame_rows.view(torch.uint8).numpy().tobytes())
    expected = kv.clone()
    for i, s in enumerate(slots):
        expected[s // BS, :, s % BS] = frame_rows[row0 + i]

    copies = _copies(device)
    dev_kv = kv.to(_device(device))
    copies.load(dev_kv, slot_runs(slots, BS), frame, row0)
    copies.layer_loaded(0)
    copies.before_layer(0)
    assert torch.equal(_bits(dev_kv), _bits(expected))

    # Gather the same slots back into two chunk buffers (the second partial), layer 1 of 2.
    split = len(slots) // 2 + 1
    rows = [split, len(slots) - split]
    bufs = [copies.new_save_buffer((2, n, H, C), torch.bfloat16) for n in rows]
    copies.gather_into(dev_kv, buffer_runs(slots, BS, rows), bufs, layer=1)
    copies.wait_saved(copies.saved())
    assert torch.equal(_bits(torch.cat([b[1] for b in bufs])), _bits(frame_rows[row0:]))


@pytest.mark.parametrize("device", DEVICES)
def test_a_frame_too_short_is_refused_and_nothing_is_written(device):
    kv = torch.zeros(BLOCKS, H, BS, C, dtype=torch.bfloat16, device=_device(device))
    frame = memoryview(torch.ones(10, H, C, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    with pytest.raises(ValueError, match="chunk holds 10 tokens, the load needs 16"):
        _copies(device).load(kv, slot_runs(np.arange(16, 32), BS), frame, 0)
    assert not kv.any()


# (KV heads, C): a GQA layer's K|V per head, and an MLA latent (one "head" of 576: vLLM's MLA backends'
# [blocks, block size, 576] cache, which connectors get as [blocks, 1, block size, 576]).
SHAPES = {"gqa": (4, 2 * 8), "mla": (1, 576)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vllm_layouts_load_and_gather_per_head_without_touching_other_bytes(device, shape, layout):
    """The worker copies through a view of one head (``kv[:, j:j + 1]``) of one layer: on every
    layout vLLM allocates, exactly that head's slots change, in every layer sharing the allocation."""
    heads, ch = SHAPES[shape]
    layers, head, layer = 2, heads - 1, 1
    rng = np.random.default_rng(len(layout) * 7 + heads)
    slots = (rng.permutation(BLOCKS)[:3][:, None] * BS + np.arange(BS)).reshape(-1)[5:45]
    raw = torch.randn(layers * BLOCKS * heads * BS * ch).to(torch.bfloat16)
    frame_rows = torch.randn(len(slots), 1, ch).to(torch.bfloat16)
    frame = memoryview(frame_rows.view(torch.uint8).numpy().tobytes())
    expected = raw.clone()
    want = vllm_views(expected, layers, BLOCKS, heads, BS, ch, layout)[layer]
    for i, s in enumerate(slots):
        want[s // BS, head, s % BS] = frame_rows[i, 0]

    copies = _copies(device)
    dev_raw = raw.to(_device(device))
    kv = vllm_views(dev_raw, layers, BLOCKS, heads, BS, ch, layout)[layer]
    copies.load(kv[:, head:head + 1], slot_runs(slots, BS), frame, 0)
    copies.layer_loaded(layer)
    copies.before_layer(layer)
    assert torch.equal(_bits(dev_raw), _bits(expected))

    bufs = [copies.new_save_buffer((layers, n, 1, ch), torch.bfloat16) for n in (16, len(slots) - 16)]
    copies.gather_into(kv[:, head:head + 1], buffer_runs(slots, BS, [16, len(slots) - 16]), bufs, layer)
    copies.wait_saved(copies.saved())
    assert torch.equal(_bits(torch.cat([b[layer] for b in bufs])), _bits(frame_rows))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("row0, extra", [(0, 0), (3, 0), (0, 5), (7, 2)])
def test_places_put_a_frame_exactly_where_load_copies_it_or_are_refused(shape, layout, row0, extra):
    """``HostCopies.places``: writing a frame's bytes through its places (dropping the dropped
    ones, as a reader receiving into them does) leaves the cache exactly as ``load`` does, on
    every layout where a head's slots of a block are one contiguous range; elsewhere it refuses
    (the frame is copied).  vLLM's CPU cache (``LBHNC``, one head per frame) always has places."""
    heads, ch = SHAPES[shape]
    layers, head, layer = 2, heads - 1, 1
    rng = np.random.default_rng(len(layout) * 11 + heads + row0)
    slots = (rng.permutation(BLOCKS)[:3][:, None] * BS + np.arange(BS)).reshape(-1)[5:45]
    raw = torch.randn(layers * BLOCKS * heads * BS * ch).to(torch.bfloat16)
    frame = torch.randn(row0 + len(slots) + extra, 1, ch).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    copies, runs = HostCopies(BS), slot_runs(slots, BS)
    expected = raw.clone()
    copies.load(vllm_views(expected, layers, BLOCKS, heads, BS, ch, layout)[layer][:, head:head + 1], runs,
                memoryview(frame), row0)
    kv = vllm_views(raw, layers, BLOCKS, heads, BS, ch, layout)[layer][:, head:head + 1]
    segments = copies.places(kv, runs, len(frame), row0)
    if layout == "LBHNC":
        assert segments is not None
    if segments is None:
        return
    at = 0
    for segment in segments:
        if isinstance(segment, int):
            at += segment
        else:
            segment[:] = frame[at:at + segment.nbytes]
            at += segment.nbytes
    assert at == len(frame)
    assert torch.equal(_bits(raw), _bits(expected))
    assert copies.places(kv, runs, len(frame) - 1, row0) is None  # not whole rows
    short = (row0 + len(slots) - 1) * ch * 2
    assert copies.places(kv, runs, short, row0) is None  # rows missing
    assert BatchedCopies(BS, torch.device("cpu")).places(kv, runs, len(frame), row0) is None


def _write_through(segments: list, frame: bytes) -> None:
    """What a reader receiving ``frame`` into its places does: fill the views, skip the drops."""
    at = 0
    for segment in segments:
        if not isinstance(segment, int):
            segment[:] = frame[at:at + segment.nbytes]
        at += segment if isinstance(segment, int) else segment.nbytes


def test_places_of_every_layer_and_head_in_turn_land_where_load_copies_them(monkeypatch):
    """One ``HostCopies`` serves a worker's head views of every layer, frame after frame (it keeps
    a NumPy view of each tensor rather than making one per frame): each frame, in any order and
    again, lands where ``load`` copies it, never in another head's or layer's memory.  A caller
    that slices a fresh view for every frame, of one cache and then of another, gets each
    frame into its own cache, though Python hands the new view the freed one's id; so does a
    caller that makes fresh slot runs for every frame; and the views and runs kept stay bounded
    however many pass through."""
    from kvring.connector import copies as copies_module

    layers, heads, ch = 3, 2, 8
    slots = np.arange(3 * BS, 3 * BS + 40)
    runs = slot_runs(slots, BS)
    copies = HostCopies(BS)
    rng = np.random.default_rng(5)

    def frame() -> bytes:
        return torch.randn(len(slots), 1, ch).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()

    def head(raw: torch.Tensor, layer: int, h: int) -> torch.Tensor:
        return vllm_views(raw, layers, BLOCKS, heads, BS, ch, "LBHNC")[layer][:, h:h + 1]

    def cache() -> tuple[torch.Tensor, torch.Tensor]:
        raw = torch.randn(layers * BLOCKS * heads * BS * ch).to(torch.bfloat16)
        return raw, raw.clone()

    def mine_of(raw: torch.Tensor) -> list[list[torch.Tensor]]:
        return [[head(raw, layer, h) for h in range(heads)] for layer in range(layers)]

    # As the worker: its head views made once, every frame of a load through them.
    raw, expected = cache()
    mine = mine_of(raw)
    order = [(layer, h) for layer in range(layers) for h in range(heads)] * 2
    for k in rng.permutation(len(order)):
        layer, h = order[k]
        data = frame()
        copies.load(head(expected, layer, h), runs, memoryview(data), 0)
        _write_through(copies.places(mine[layer][h], runs, len(data), 0), data)
    assert torch.equal(_bits(raw), _bits(expected))

    # A fresh view for every frame, of two caches in turn: each view freed before the next.
    (a, a_expected), (b, b_expected) = cache(), cache()
    for k in range(12):
        for raw, expected in ((a, a_expected), (b, b_expected)):
            data = frame()
            copies.load(head(expected, k % layers, k % heads), runs, memoryview(data), 0)
            _write_through(copies.places(head(raw, k % layers, k % heads), runs, len(data), 0), data)
    assert torch.equal(_bits(a), _bits(a_expected)) and torch.equal(_bits(b), _bits(b_expected))

    # Fresh runs for every frame, of two slot sets in turn (their places are kept per runs list,
    # and a freed list's id comes back for the next one): each frame lands at its own slots.
    raw, expected = cache()
    other = np.arange(7 * BS + 3, 7 * BS + 43)
    mine = mine_of(raw)
    for k in range(12):
        data, fresh = frame(), slot_runs((slots, other)[k // 2 % 2], BS)
        copies.load(head(expected, k % layers, k % heads), fresh, memoryview(data), 0)
        _write_through(copies.places(mine[k % layers][k % heads], fresh, len(data), 0), data)
        del fresh
    assert torch.equal(_bits(raw), _bits(expected))

    monkeypatch.setattr(copies_module, "_VIEWS_MAX", 8)
    for k in range(20):
        assert copies.places(head(a, k % layers, k % heads), slot_runs(slots + k, BS), len(slots) * ch * 2, 0) is not None
        assert len(copies._views) <= 8 and len(copies._spans) <= 8
