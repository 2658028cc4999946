"""What the connector takes from one vLLM instance's configuration.

Its key layout (``KVLayout``: model, config and revision fingerprint, KV dtype and shape,
tensor-parallel layout), and whether its KV cache is one the connector can serve without
risking wrong KV.
"""

from __future__ import annotations

import hashlib

from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from .keys import KVLayout


def layout_from_vllm(vllm_config, chunk_size: int, tp_rank: int = 0, weights_version: str = "") -> KVLayout:
    """The KV-compatibility namespace of this vLLM instance."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    hf = getattr(model, "hf_config", None)
    identity = (hf.to_json_string() if hf is not None else model.model) + f"\nrevision={model.revision}"
    fingerprint = hashlib.blake2b(identity.encode(), digest_size=16).hexdigest()
    kv_dtype = vllm_config.cache_config.cache_dtype
    if kv_dtype == "auto":
        kv_dtype = str(model.dtype).removeprefix("torch.")
    return KVLayout(
        model=str(model.model), config_fingerprint=fingerprint, kv_dtype=str(kv_dtype),
        num_layers=model.get_num_layers(parallel), num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(), block_layout="BHNC", chunk_size=chunk_size,
        tp_size=parallel.tensor_parallel_size, tp_rank=tp_rank, weights_version=weights_version)


def check_kv_groups(kv_cache_config) -> None:
    """Refuse a model whose KV the connector cannot load correctly (``ValueError`` saying why).

    kvring stores every layer of a token range as one chunk and loads it into one block table.
    Models with several KV-cache groups (sliding-window next to full-attention layers, SSM
    state, ...) have a block table per group, and vLLM cannot take block-level load failures
    for them; MLA caches have another shape.  Serving such a model through the connector
    would risk wrong KV, so it is refused at start rather than run wrongly.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    problems = []
    if len(groups) > 1:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        problems.append(f"{len(groups)} KV-cache groups ({', '.join(kinds)}: e.g. sliding-window layers next to "
                        "full-attention ones), and kvring loads one block table per chunk")
    for g in groups:
        spec = g.kv_cache_spec
        if not isinstance(spec, FullAttentionSpec) or isinstance(spec, MLAAttentionSpec):
            problems.append(f"layers {g.layer_names[:2]}... use {type(spec).__name__}, kvring loads full-attention "
                            "KV only")
            break
    if problems:
        raise ValueError("KVRingConnector cannot serve this model without risking wrong KV: " + "; ".join(problems)
                         + ". Serve it without --kv-transfer-config (vLLM's hybrid KV manager stays on).")
