"""Which vLLM KV caches the connector serves, on vLLM's own KV-cache spec records (no engine:
the engine-level refusal of a sliding-window model is in test_vllm_hybrid.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheGroupSpec, MambaSpec, MLAAttentionSpec,
                                        SlidingWindowSpec)

from kvring.connector.instance import check_kv_groups

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def _config(*specs) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"layers.{i}.attn"], spec)
                                            for i, spec in enumerate(specs)])


@pytest.mark.parametrize("spec", [FULL, MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                                          dtype=torch.bfloat16)], ids=["full", "mla"])
def test_one_full_attention_or_mla_group_is_served(spec):
    check_kv_groups(_config(spec))


SLIDING = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128)
MAMBA = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
HYBRID_FIX = "--disable-hybrid-kv-cache-manager"


@pytest.mark.parametrize("specs, why, fix", [
    ((FULL, SLIDING), ["2 KV-cache groups", "group 1 (SlidingWindowSpec: layers.1.attn)"], HYBRID_FIX),
    ((MLA, MLA), ["2 KV-cache groups", "group 0 (MLAAttentionSpec"], HYBRID_FIX),
    ((SLIDING,), ["group 0 (SlidingWindowSpec: layers.0.attn) is neither full-attention nor MLA"],
     "without --kv-transfer-config"),
    ((FULL, MAMBA), ["group 1 (MambaSpec: layers.1.attn)", "not attention KV"], "without --kv-transfer-config"),
], ids=["sliding-hybrid", "two-mla-groups", "sliding-only", "mamba"])
def test_caches_it_cannot_load_correctly_are_refused_naming_the_group_and_the_fix(specs, why, fix):
    with pytest.raises(ValueError, match="cannot serve this model without risking wrong KV") as err:
        check_kv_groups(_config(*specs))
    assert all(w in str(err.value) for w in why) and fix in str(err.value), str(err.value)
