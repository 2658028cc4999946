"""Which vLLM KV caches the connector serves, on vLLM's own KV-cache spec records (no engine:
real engines serving sliding-window hybrids are in test_vllm_hybrid.py, MLA in test_vllm_mla.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheGroupSpec, MambaSpec,
                                        MLAAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec)

from kvring.connector.instance import (KVGroups, check_chunk_blocks, check_kv_groups, state_block_size_advice,
                                       state_format_of)
from kvring.connector.parts import STATE

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def _config(*specs) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"layers.{i}.attn"], spec)
                                            for i, spec in enumerate(specs)])


SLIDING = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128)
WIDE = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=1024)
MAMBA = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
MAMBA_ALIGN = MambaSpec(block_size=16, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32),
                        mamba_cache_mode="align")
MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
LOCAL = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                  attention_chunk_size=256)
SLIDING_MLA = SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                                   sliding_window=128)
FULL32 = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
HYBRID_FIX = "--disable-hybrid-kv-cache-manager"


@pytest.mark.parametrize("specs", [(FULL,), (MLA,), (SLIDING,), (FULL, SLIDING), (SLIDING, SLIDING, WIDE, FULL),
                                   (MAMBA_ALIGN, FULL)],
                         ids=["full", "mla", "sliding-only", "hybrid", "two-windows", "mamba-align"])
def test_full_attention_mla_and_sliding_window_groups_are_served(specs):
    check_kv_groups(_config(*specs))


def test_the_groups_give_each_layer_its_block_table_and_window():
    groups = KVGroups.of(_config(SLIDING, SLIDING, WIDE, FULL), num_layers=4)
    assert groups.several and groups.hybrid and groups.windows == (128, 128, 1024, 0)
    assert [groups.group_of(f"layers.{i}.attn") for i in range(4)] == [0, 1, 2, 3]
    one = KVGroups.of(_config(FULL), num_layers=1)
    assert not one.several and not one.hybrid and one.windows == ()


def test_a_recurrent_state_group_is_the_state_layers_and_their_bytes():
    """A Mamba-style group in align mode: its layers are ``STATE`` in the layout (no attention
    block table), and a state is its tensors' bytes one after another (3x8 bf16 + 2x4x4 fp32)."""
    groups = KVGroups.of(_config(MAMBA_ALIGN, FULL), num_layers=2)
    assert groups.windows == (STATE, 0) and groups.several
    assert groups.state.group == 0 and groups.state.layer_names == ("layers.0.attn",)
    assert groups.state.nbytes == 3 * 8 * 2 + 2 * 4 * 4 * 4
    assert "(3, 8):bfloat16;(2, 4, 4):float32" in groups.state.format
    assert [groups.group_of("layers.1.attn")] == [1] and "layers.0.attn" not in groups.layer_groups


@pytest.mark.parametrize("specs, why, fix", [
    ((MLA, MLA), ["group 0 (MLAAttentionSpec", "neither full-attention nor sliding-window"], HYBRID_FIX),
    ((FULL, LOCAL), ["group 1 (ChunkedLocalAttentionSpec: layers.1.attn)"], HYBRID_FIX),
    ((MLA, SLIDING_MLA), ["group 1 (SlidingWindowMLASpec"], HYBRID_FIX),
    ((FULL32, SLIDING), ["block sizes [16, 32]"], HYBRID_FIX),
    ((LOCAL,), ["group 0 (ChunkedLocalAttentionSpec: layers.0.attn) is neither full-attention nor sliding-window"],
     "without --kv-transfer-config"),
    ((FULL, MAMBA), ["group 1 (MambaSpec: layers.1.attn)", "'align' mode"], "--mamba-cache-mode align"),
    ((MAMBA_ALIGN, FULL, MAMBA_ALIGN), ["several recurrent-state groups"], "without --kv-transfer-config"),
], ids=["two-mla-groups", "chunked-local", "sliding-mla", "block-sizes", "local-only", "mamba-not-align",
        "two-mamba-groups"])
def test_caches_it_cannot_load_correctly_are_refused_naming_the_group_and_the_fix(specs, why, fix):
    with pytest.raises(ValueError, match="cannot serve this model without risking wrong KV") as err:
        check_kv_groups(_config(*specs))
    assert all(w in str(err.value) for w in why) and fix in str(err.value), str(err.value)


def test_chunks_of_part_blocks_are_refused():
    """A chunk must hold whole vLLM blocks: a load or save of part of a block would copy the wrong
    bytes on vLLM's CPU kernel (K transposed within a block)."""
    for chunk, block in ((256, 128), (256, 16), (512, 256), (128, 128)):
        check_chunk_blocks(chunk, block)
    with pytest.raises(ValueError, match="192 tokens, which is not a whole number of vLLM's 128-token blocks"):
        check_chunk_blocks(192, 128)


def test_the_state_format_names_the_slices_a_state_is_stored_in():
    """The key namespace of a model with recurrent state names its state's bytes and how many
    slices it is stored in, so instances of other TP sizes never read another's slices."""
    groups = KVGroups.of(_config(MAMBA_ALIGN, FULL), num_layers=2)
    formats = {tp: state_format_of(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp)), groups)
               for tp in (1, 2)}
    assert formats[1].endswith("|shards=1") and formats[2].endswith("|shards=2")
    assert groups.state.shards(4) == 4 and not groups.state.replicated
    assert state_format_of(None, KVGroups.of(_config(FULL), num_layers=1)) == ""


def test_a_model_with_state_started_without_its_block_size_is_told_to_give_it():
    """vLLM's scheduler in an engine core of its own ends prefill steps on the block size it was
    given: the connector names the size to give when the model has recurrent state."""
    groups = KVGroups.of(_config(MAMBA_ALIGN, FULL), num_layers=2)

    def config(given: bool) -> SimpleNamespace:
        return SimpleNamespace(cache_config=SimpleNamespace(block_size=256, user_specified_block_size=given))

    assert "start vLLM with --block-size 256" in state_block_size_advice(config(False), groups)
    assert state_block_size_advice(config(True), groups) is None
    assert state_block_size_advice(config(False), KVGroups.of(_config(FULL), num_layers=1)) is None
