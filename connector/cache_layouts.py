"""The physical layouts vLLM 0.32 gives each layer's KV cache, as connectors see them.

A connector gets each layer as a ``[blocks, KV heads, block size, C]`` view, but vLLM lays the
allocation out in one of several stride orders of the logical ``[L, B, H, N, C]``, ``L`` being
the layers that share one allocation (``vllm/v1/kv_cache_layout.py``).  Its CUDA backends:
FlashAttention, Triton and the MLA backends take any and prefer LBNHC (NHD), FlashInfer on
Blackwell takes LBHNC or BLHNC (HND); ``VLLM_KV_CACHE_LAYOUT`` picks any of them.  Tests and
``kvring bench gpu`` build caches with these strides to exercise the copies on every one.
"""

from __future__ import annotations

import torch

LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def vllm_views(raw: torch.Tensor, layers: int, blocks: int, heads: int, bs: int, ch: int,
               layout: str) -> list[torch.Tensor]:
    """Per-layer ``[blocks, heads, bs, ch]`` views of the flat ``raw``, strided as vLLM's
    ``create_kv_cache_views`` lays them out for ``layout`` (without page padding);
    ``ValueError`` unless ``raw`` holds exactly that many elements."""
    shape = (layers, blocks, heads, bs, ch)
    strides, step = [0] * 5, 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim], step = step, step * shape[dim]
    if raw.numel() != step:
        raise ValueError(f"{raw.numel()} elements do not make {layers} layers of {shape[1:]}")
    full = raw.as_strided(shape, strides)
    return [full[i] for i in range(layers)]
