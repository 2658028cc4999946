"""Loads into and gathers out of a paged KV cache, against a per-token reference: runs of slots
in one block, unaligned ranges, an offset into the chunk frame, a frame too short, and (where a
GPU is present) the CUDA path with pinned staging and a side stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvring.connector.copies import CudaCopies, HostCopies, buffer_runs, slot_runs

BS, H, C, BLOCKS = 16, 2, 8, 40
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _copies(device: str) -> HostCopies:
    return HostCopies(BS) if device == "cpu" else CudaCopies(BS, torch.device(device))


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
    dev_kv = kv.to(device)
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
    kv = torch.zeros(BLOCKS, H, BS, C, dtype=torch.bfloat16, device=device)
    frame = memoryview(torch.ones(10, H, C, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    with pytest.raises(ValueError, match="chunk holds 10 tokens, the load needs 16"):
        _copies(device).load(kv, slot_runs(np.arange(16, 32), BS), frame, 0)
    assert not kv.any()
