"""The CUDA path's batching, checked on the CPU (``BatchedCopies``: the same staging, indices,
scatter and gather as ``CudaCopies``, without pinned memory, streams and events) and, where a GPU
is present, on CUDA: whole steps of several requests and chunks, a partial last chunk, offsets into
the frames, staging buffers reused across steps, a layer whose load failed (flushed by
``layer_loaded(-1)``), a load ordered before the forward's own writes, frames of several cache
storages in one flush, a staging buffer that fills up, layouts that are not rows of C, saves into
evenly spaced and scattered buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvring.connector import copies as copies_module
from kvring.connector.cache_layouts import LAYOUTS, vllm_views
from kvring.connector.copies import BatchedCopies, CudaCopies, _target, buffer_runs, slot_runs

BS, C, BLOCKS, CHUNK = 16, 8, 64, 32
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _copies(device: str) -> BatchedCopies:
    return BatchedCopies(BS, torch.device("cpu")) if device == "cpu" else CudaCopies(BS, torch.device(device))


def _views(raw: torch.Tensor, layers: int, heads: int, ch: int, layout: str) -> list[torch.Tensor]:
    return vllm_views(raw, layers, BLOCKS, heads, BS, ch, layout)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int16)


class Step:
    """One step's loads: requests of several chunks (the last partial), each part (head) of each
    chunk's layer a frame ``[rows, 1, C]``, written from ``row0`` on (a prefix already cached)."""

    def __init__(self, rng: np.random.Generator, layers: int, heads: int, ch: int, tokens: list[int],
                 row0: list[int]) -> None:
        free = rng.permutation(BLOCKS)
        self.chunks = []  # (slots of the chunk's written tokens, row0, tokens in the chunk)
        at = 0
        for n, r0 in zip(tokens, row0):
            blocks = free[at:at + -(-n // BS)]
            at += len(blocks)
            slots = (blocks[:, None] * BS + np.arange(BS)).reshape(-1)[:n]
            for c in range(0, n, CHUNK):
                rows = min(CHUNK, n - c)
                lo = r0 if c == 0 else 0
                self.chunks.append((slots[c + lo:c + rows], lo, rows))
        self.frames = [[[torch.randn(rows, 1, ch).to(torch.bfloat16) for _ in range(heads)]
                        for _, _, rows in self.chunks] for _ in range(layers)]
        self.runs = [slot_runs(slots, BS) for slots, _, _ in self.chunks]

    def expect(self, raw: torch.Tensor, layers: int, heads: int, ch: int, layout: str, skip=(),
               first: int = 0) -> torch.Tensor:
        """``raw`` with the step's layers ``first ..`` of ``layers`` written (but those in ``skip``)."""
        expected = raw.clone()
        views = _views(expected, layers, heads, ch, layout)
        for layer in range(layers):
            if layer + first in skip:
                continue
            for k, (slots, lo, _) in enumerate(self.chunks):
                for h in range(heads):
                    for i, s in enumerate(slots):
                        views[layer][s // BS, h, s % BS] = self.frames[first + layer][k][h][lo + i, 0]
        return expected

    def load(self, copies, views: list[torch.Tensor], heads: int, skip=(), flush_layers: bool = True) -> None:
        for layer, kv in enumerate(views):
            if layer in skip:
                continue
            for k, (_, lo, _) in enumerate(self.chunks):
                for h in range(heads):
                    frame = memoryview(self.frames[layer][k][h].view(torch.uint8).numpy().tobytes())
                    copies.load(kv[:, h:h + 1], self.runs[k], frame, lo)
            if flush_layers:
                copies.layer_loaded(layer)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_steps_of_several_requests_reuse_staging_and_match_a_per_token_reference(device, layout):
    layers, heads, ch = 3, 4, C
    rng = np.random.default_rng(len(layout))
    raw = torch.randn(layers * BLOCKS * heads * BS * ch).to(torch.bfloat16)
    dev_raw = raw.to(device)
    views = _views(dev_raw, layers, heads, ch, layout)
    assert all(_target(v[:, h:h + 1]) is not None for v in views for h in range(heads))  # the batched path
    copies = _copies(device)
    expected = raw
    # Two requests (the second with a cached prefix of 5 tokens and a partial last chunk), then a
    # second step into other blocks: the staging buffers of the first are reused.
    for tokens, row0 in (([64, 75], [0, 5]), ([40, 33, 7], [3, 0, 0])):
        step = Step(rng, layers, heads, ch, tokens, row0)
        copies.reset()
        step.load(copies, views, heads)
        for layer in range(layers):
            copies.before_layer(layer)
        expected = step.expect(expected, layers, heads, ch, layout)
        assert torch.equal(_bits(dev_raw), _bits(expected))
    assert copies._staging <= 2  # one buffer per layer in flight at most, reused across steps


def _staged(device: str, layers: int, heads: int, tokens: list[int], seed: int):
    """A random cache (on the CPU, and its copy on ``device``), its copier and one request's load
    of ``tokens`` staged into it without a layer's flush (as an async, hybrid or bulk job's):
    ``(raw, dev_raw, copies, step)``."""
    raw = torch.randn(layers * BLOCKS * heads * BS * C).to(torch.bfloat16)
    dev_raw = raw.to(device)
    copies = _copies(device)
    step = Step(np.random.default_rng(seed), layers, heads, C, tokens, [0])
    copies.reset()
    step.load(copies, _views(dev_raw, layers, heads, C, "LBNHC"), heads, flush_layers=False)
    return raw, dev_raw, copies, step


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_layer_is_flushed_by_the_end_of_the_load(device):
    """A layer missing a part gets no ``layer_loaded``: what it staged goes with the next flush,
    ``layer_loaded(-1)`` sends whatever is still staged, and ``before_layer`` of the failed layer
    waits for the whole load."""
    layers, heads = 3, 2
    raw, dev_raw, copies, step = _staged(device, layers, heads, [50], seed=7)
    assert not torch.equal(_bits(dev_raw), _bits(step.expect(raw, layers, heads, C, "LBNHC")))
    copies.layer_loaded(-1)
    for layer in range(layers):
        copies.before_layer(layer)
    copies.synchronize()
    assert torch.equal(_bits(dev_raw), _bits(step.expect(raw, layers, heads, C, "LBNHC")))


@pytest.mark.parametrize("device", DEVICES)
def test_a_loads_copies_land_before_what_the_forward_then_writes(device):
    """A load written before the forward (bulk, a full hit) reaches slots vLLM computes in the
    step: after ``order_before_forward`` on the compute thread, a write the forward makes into
    such a slot (on the compute stream) lands after every copy of the load, and stays."""
    layers, heads = 2, 2
    raw, dev_raw, copies, step = _staged(device, layers, heads, [CHUNK * 3], seed=9)
    copies.order_before_forward()
    last = int(step.chunks[-1][0][-1])  # the computed token's slot, in the load's last block
    computed = torch.full((heads, C), 7.0, dtype=torch.bfloat16)
    for kv in _views(dev_raw, layers, heads, C, "LBNHC"):
        kv[last // BS, :, last % BS] = computed.to(device)  # the forward's own write of its K/V
    copies.layer_loaded(-1)
    copies.synchronize()
    want = step.expect(raw, layers, heads, C, "LBNHC")
    for kv in _views(want, layers, heads, C, "LBNHC"):
        kv[last // BS, :, last % BS] = computed
    assert torch.equal(_bits(dev_raw), _bits(want))


@pytest.mark.parametrize("device", DEVICES)
def test_frames_of_separate_layer_tensors_in_one_flush_and_a_full_staging_buffer(device, monkeypatch):
    """Layers in tensors of their own (one kernel per storage in a flush), staging buffers too
    small for a layer (sent part by part, later ones larger), and staging on the copy threads."""
    monkeypatch.setattr(copies_module, "_COPY_BATCH", 1024)
    layers, heads = 4, 2
    rng = np.random.default_rng(3)
    raws = [torch.randn(BLOCKS * heads * BS * C).to(torch.bfloat16) for _ in range(layers)]
    dev_raws = [r.to(device) for r in raws]
    views = [_views(r, 1, heads, C, "LBNHC")[0] for r in dev_raws]
    copies = _copies(device)
    step = Step(rng, layers, heads, C, [CHUNK * 4, 21], [0, 0])
    big = Step(rng, layers, heads, C, [BLOCKS * BS // 2], [0])
    step.load(copies, views, heads, skip=(2,), flush_layers=False)
    copies.layer_loaded(-1)
    copies.synchronize()
    want = [step.expect(raws[layer], 1, heads, C, "LBNHC", skip=(2,), first=layer) for layer in range(layers)]
    for layer in range(layers):
        assert torch.equal(_bits(dev_raws[layer]), _bits(want[layer])), layer
    # Staging buffers of 3,000 bytes: a frame of 32 tokens x 16 bytes fits, a layer of 512 tokens
    # of 2 heads does not: sent in pieces.
    taken = []

    def small(self: BatchedCopies, nbytes: int) -> list:
        host = self._host(max(nbytes, 3000))
        taken.append(host.numel())
        return [host, host.numpy(), None]

    monkeypatch.setattr(BatchedCopies, "_take", small)
    copies._hint = 0
    big.load(copies, views, heads)
    copies.synchronize()
    for layer in range(layers):
        assert torch.equal(_bits(dev_raws[layer]), _bits(big.expect(want[layer], 1, heads, C, "LBNHC", first=layer)))
    assert len(taken) > layers and taken[1] > taken[0]  # pieces, in growing buffers


@pytest.mark.parametrize("device", DEVICES)
def test_a_layout_that_is_not_rows_of_c_takes_per_run_copies(device):
    """Channels strided (no vLLM layout is): the copies fall back to per-run copies, correctly."""
    heads = 2
    rng = np.random.default_rng(11)
    base = torch.randn(BLOCKS, heads, C, BS).to(torch.bfloat16).to(device)
    kv = base.transpose(2, 3)  # [B, H, N, C] with C strided
    assert _target(kv[:, :1]) is None
    raw_before = base.clone()
    step = Step(rng, 1, heads, C, [40], [2])
    copies = _copies(device)
    step.load(copies, [kv], heads)
    copies.synchronize()
    expected = raw_before.transpose(2, 3).clone()
    for k, (slots, lo, _) in enumerate(step.chunks):
        for h in range(heads):
            for i, s in enumerate(slots):
                expected[s // BS, h, s % BS] = step.frames[0][k][h][lo + i, 0]
    slots = np.concatenate([slots for slots, _, _ in step.chunks])
    assert torch.equal(_bits(kv), _bits(expected))
    bufs = [copies.new_save_buffer((1, len(slots), 1, C), torch.bfloat16)]
    copies.gather_into(kv[:, 1:2], buffer_runs(slots, BS, [len(slots)]), bufs, 0)
    copies.wait_saved(copies.saved())
    assert torch.equal(_bits(bufs[0][0]), _bits(expected[slots // BS, 1, slots % BS].unsqueeze(1)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["LBNHC", "BHLNC"])
@pytest.mark.parametrize("pitched", [True, False])
def test_saves_gather_every_part_and_chunk_into_evenly_spaced_buffers(device, layout, pitched, monkeypatch):
    """As ``save_kv_layer``: per layer and part one gather of that part's chunk buffers (the last
    partial); buffers of one part are evenly spaced in a slab, so a pitched copy fills them all
    (``pitched=False``: the device cannot do pitched copies, one copy per buffer); a buffer of
    another part allocated in between breaks the spacing."""
    if not pitched:
        monkeypatch.setattr(BatchedCopies, "_copy2d", lambda self, *a: False)
        monkeypatch.setattr(CudaCopies, "_copy2d", lambda self, *a: False)
    layers, heads = 3, 2
    rng = np.random.default_rng(5)
    raw = torch.randn(layers * BLOCKS * heads * BS * C).to(torch.bfloat16)
    views = _views(raw.to(device), layers, heads, C, layout)
    cpu_views = _views(raw, layers, heads, C, layout)
    blocks = rng.permutation(BLOCKS)[:6]
    start = 5
    slots = (blocks[:, None] * BS + np.arange(BS)).reshape(-1)[start:start + 3 * CHUNK - 9]
    rows = [CHUNK, CHUNK, len(slots) - 2 * CHUNK]
    copies = _copies(device)
    bufs = {h: [copies.new_save_buffer((layers, n, 1, C), torch.bfloat16) for n in rows] for h in range(heads)}
    stray = copies.new_save_buffer((layers, 3, 1, C), torch.bfloat16)  # another save's buffer
    bufs[heads] = [copies.new_save_buffer((layers, rows[0], 1, C), torch.bfloat16), stray,
                   copies.new_save_buffer((layers, rows[1], 1, C), torch.bfloat16)]
    runs = buffer_runs(slots, BS, rows)
    for step in range(2):  # the second step reuses the cached index
        for layer in range(layers):
            for h in range(heads):
                copies.gather_into(views[layer][:, h:h + 1], runs, bufs[h], layer)
        copies.wait_saved(copies.saved())
        for layer in range(layers):
            for h in range(heads):
                want = cpu_views[layer][slots // BS, h, slots % BS]
                got = torch.cat([b[layer, :, 0] for b in bufs[h]])
                assert torch.equal(_bits(got), _bits(want)), (step, layer, h)
    # Buffers that are not evenly spaced: copied one by one.
    copies.gather_into(views[1][:, :1], buffer_runs(slots[:2 * CHUNK], BS, rows[:1] * 2),
                       [bufs[heads][0], bufs[heads][2]], 1)
    copies.wait_saved(copies.saved())
    got = torch.cat([bufs[heads][0][1, :, 0], bufs[heads][2][1, :, 0]])
    assert torch.equal(_bits(got), _bits(cpu_views[1][slots[:2 * CHUNK] // BS, 0, slots[:2 * CHUNK] % BS]))
    # Chunk buffers of one part are evenly spaced (one pitched copy fills them).
    ptrs = [b.data_ptr() for b in bufs[0]]
    assert ptrs[1] - ptrs[0] == ptrs[2] - ptrs[1] or rows[2] != CHUNK


@pytest.mark.parametrize("device", DEVICES)
def test_an_abandoned_load_can_drop_what_it_staged(device):
    heads = 2
    rng = np.random.default_rng(13)
    raw = torch.randn(BLOCKS * heads * BS * C).to(torch.bfloat16)
    dev_raw = raw.to(device)
    views = _views(dev_raw, 1, heads, C, "LBNHC")
    copies = _copies(device)
    Step(rng, 1, heads, C, [60], [0]).load(copies, views, heads, flush_layers=False)
    copies.discard()
    copies.layer_loaded(-1)
    copies.synchronize()
    assert torch.equal(_bits(dev_raw), _bits(raw))
