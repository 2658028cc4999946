"""Which vLLM KV caches the connector serves, on vLLM's own KV-cache spec records (no engine:
the engine-level refusal of a sliding-window model is in test_vllm_hybrid.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowSpec

from kvring.connector.instance import check_kv_groups

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def _config(*specs) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"layers.{i}.attn"], spec)
                                            for i, spec in enumerate(specs)])


@pytest.mark.parametrize("spec", [FULL, MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                                          dtype=torch.bfloat16)], ids=["full", "mla"])
def test_one_full_attention_or_mla_group_is_served(spec):
    check_kv_groups(_config(spec))


@pytest.mark.parametrize("specs, why", [
    ((FULL, SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128)),
     "2 KV-cache groups"),
    ((SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128),),
     "use SlidingWindowSpec"),
    ((MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
      MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)), "2 KV-cache groups"),
])
def test_caches_it_cannot_load_correctly_are_refused_saying_why(specs, why):
    with pytest.raises(ValueError, match="cannot serve this model without risking wrong KV") as err:
        check_kv_groups(_config(*specs))
    assert why in str(err.value) and "without --kv-transfer-config" in str(err.value)
