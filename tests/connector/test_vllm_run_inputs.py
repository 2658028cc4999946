"""``kvring.engine.run``'s request inputs beyond token ids: LoRA adapters and prompt embeddings.

Without a connector: the point is that the inputs reach the real CPU engine and change what it
computes, so that connector tests built on them (an adapter's KV must never be served to the
base model or to another adapter; different embeddings must never share chunks) test something.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvring.engine.run import random_prompt_embeds, run_instance, write_random_lora, write_tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


def test_random_lora_is_a_peft_adapter_vllm_accepts(model, tmp_path):
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    path = write_random_lora(tmp_path / "lora", model, rank=4, seed=3, target_modules=("k_proj", "v_proj"))
    cfg = json.loads((model / "config.json").read_text())
    tensors = load_file(path / "adapter_model.safetensors")
    kv_width = cfg["num_key_value_heads"] * cfg["head_dim"]
    assert set(tensors) == {f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight"
                            for i in range(cfg["num_hidden_layers"]) for m in ("k_proj", "v_proj") for ab in "AB"}
    a = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert a.shape == (4, cfg["hidden_size"]) and b.shape == (kv_width, 4)
    assert (b @ a).std() > cfg["initializer_range"]  # larger than the base weights' own scale
    assert parse_fine_tuned_lora_name(next(iter(tensors)))[0].startswith("model.layers.")
    peft = PEFTHelper.from_local_dir(str(path), max_position_embeddings=None)
    assert (peft.r, peft.vllm_lora_scaling_factor, sorted(peft.target_modules)) == (4, 1.0, ["k_proj", "v_proj"])
    again = load_file(write_random_lora(tmp_path / "again", model, rank=4, seed=3,
                                        target_modules=("k_proj", "v_proj")) / "adapter_model.safetensors")
    assert all(torch.equal(tensors[k], again[k]) for k in tensors)  # the seed alone decides the weights

    embeds = random_prompt_embeds(model, seed=5, length=7)
    assert embeds.shape == (7, cfg["hidden_size"]) and embeds.dtype == torch.bfloat16
    assert torch.equal(embeds, random_prompt_embeds(model, seed=5, length=7))
    assert not torch.equal(embeds, random_prompt_embeds(model, seed=6, length=7))


def test_adapters_and_prompt_embeds_change_the_engines_outputs(model, tmp_path):
    """One engine: a prompt under no adapter and under two random ones; two embeddings of one length."""
    adapters = {name: str(write_random_lora(tmp_path / name, model, seed=seed)) for name, seed in (("a", 1), ("b", 2))}
    tokens = np.random.default_rng(0).integers(10, 2000, size=300).tolist()
    out = run_instance(tmp_path, "inputs", {
        "model": str(model), "max_model_len": 1024, "max_tokens": 8, "prompt_embeds": True,
        # ids deliberately not in the adapters' order: they are per-process handles only
        "lora": {"max_rank": 8, "adapters": adapters, "ids": {"a": 2, "b": 1}},
        "prompts": [{"tokens": tokens}, {"tokens": tokens, "lora": "a"}, {"tokens": tokens, "lora": "b"},
                    {"tokens": tokens, "lora": "a"},
                    {"embeds_seed": 1, "embeds_len": 200}, {"embeds_seed": 2, "embeds_len": 200},
                    {"embeds_seed": 1, "embeds_len": 200}, {"embeds_seed": 1, "embeds_len": 200, "lora": "b"}]})
    base, a, b, a_again, e1, e2, e1_again, e1_b = (r["tokens"] for r in out["results"])
    assert all(len(t) == 8 for t in (base, a, b, e1, e2, e1_b))
    assert base != a and base != b and a != b  # each adapter changes the model, and differently
    assert a_again == a  # greedy decoding under an adapter is deterministic
    assert e1 != e2 and e1_again == e1  # the embeddings are the input, not placeholder token ids
    assert e1_b != e1  # an adapter applies to embedding prompts as well
    assert all(r["cached"] == 0 for r in out["results"])  # no prefix caching, no connector
    assert out["keys"] == [] and out["layout"] is None
