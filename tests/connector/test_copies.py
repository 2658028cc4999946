"""Scatter into and gather out of a paged KV cache: the whole-block fast path, the per-token
path, and (where a GPU is present) the CUDA path with pinned staging and a side stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvring.connector.copies import CudaCopies, HostCopies

BS, H, C, BLOCKS = 16, 2, 8, 40
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _reference_scatter(kv: torch.Tensor, slots: np.ndarray, src: torch.Tensor) -> None:
    for i, s in enumerate(slots):
        kv[s // BS, :, s % BS] = src[i]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lo, hi", [(0, 64), (16, 48), (3, 64), (0, 61), (5, 9)])
def test_scatter_and_gather_match_a_per_token_reference(device, lo, hi):
    rng = np.random.default_rng(lo * 100 + hi)
    blocks = rng.permutation(BLOCKS)[:4]
    slots = ((blocks[:, None] * BS + np.arange(BS)).reshape(-1))[lo:hi]
    kv = torch.randn(BLOCKS, H, BS, C).to(torch.bfloat16)
    src = torch.randn(len(slots), H, C).to(torch.bfloat16)
    expected = kv.clone()
    _reference_scatter(expected, slots, src)

    copies = HostCopies(BS) if device == "cpu" else CudaCopies(BS, torch.device(device))
    dev_kv = kv.to(device)
    staged = copies.stage(memoryview(src.view(torch.uint8).numpy().tobytes()))
    copies.scatter(dev_kv, slots, staged.view(torch.bfloat16).view(-1, H, C))
    copies.layer_loaded(0)
    copies.before_layer(0)
    assert torch.equal(dev_kv.cpu(), expected)

    # Gather the same slots back into two chunk buffers (the second partial), layer 1 of 2.
    split = len(slots) // 2 + 1
    bufs = [copies.new_save_buffer((2, n, H, C), torch.bfloat16) for n in (split, len(slots) - split)]
    copies.gather_into(dev_kv, slots, bufs, layer=1)
    copies.wait_saved(copies.saved())
    assert torch.equal(torch.cat([b[1] for b in bufs]), src)
