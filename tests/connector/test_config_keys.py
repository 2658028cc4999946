"""Connector settings and chunk keys, on plain data (no vLLM needed for these parts)."""

from __future__ import annotations

import dataclasses

import pytest

from kvring.connector.adapters import AdapterIdentities
from kvring.connector.config import ConnectorConfig
from kvring.connector.keys import KeyScope, KVLayout, MMSpan, request_keys
from kvring.connector.request_inputs import embed_digests, read_request

LAYOUT = KVLayout(model="tiny-llama", config_fingerprint="abc", kv_dtype="bfloat16", num_layers=2,
                  num_kv_heads=2, head_size=32, block_layout="BHNC", chunk_size=16)


def test_config_from_extra_config_env_and_defaults():
    cfg = ConnectorConfig.from_sources({"etcd": "127.0.0.1:2379", "save_unfull_chunk": "false"},
                                       {"KVRING_LOAD_MODE": "bulk", "KVRING_ETCD": "ignored:1"})
    assert cfg.etcd == "127.0.0.1:2379" and cfg.load_mode == "bulk" and not cfg.save_unfull_chunk
    assert cfg.cluster == "default" and cfg.lookup_lease_ms == 30_000
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.timeout = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("extra, message", [
    ({}, "KVRING_ETCD"),
    ({"etcd": "h:1", "load_mode": "fast"}, "load_mode must be one of"),
    ({"etcd": "h:1", "timeout": "soon"}, "timeout must be a float"),
    ({"etcd": "h:1", "timeout": 0}, "timeout must be positive"),
    ({"etcd": "h:1", "save_decode_cache": "maybe"}, "save_decode_cache must be a bool"),
    ({"etcd": "h:1", "lookup_lease_ms": -1}, "lookup_lease_ms must be >= 0"),
    ({"etcd": "h:1", "etc": "typo"}, "unknown kv_connector_extra_config keys"),
    ({"etcd": "h:1", "load_mode": "later"}, "'layerwise', 'bulk', 'async'"),
    ({"etcd": "h:1", "lookup_deadline_ms": -5}, "lookup_deadline_ms must be >= 0"),
    ({"etcd": "h:1", "adapter_identity": "id"}, "adapter_identity must be one of"),
])
def test_bad_settings_say_what_to_set(extra, message):
    with pytest.raises(ValueError, match=message):
        ConnectorConfig.from_sources(extra, {})


def test_keys_depend_on_layout_and_salt_but_share_prefixes():
    tokens = list(range(100))
    keys = request_keys(LAYOUT, tokens)
    assert len(keys) == 6  # whole chunks only
    assert len(request_keys(LAYOUT, tokens, full_chunks_only=False)) == 7
    assert request_keys(LAYOUT, tokens[:40]) == keys[:2]
    tenant = KeyScope(cache_salt="tenant-a")
    assert set(request_keys(LAYOUT, tokens, tenant)).isdisjoint(keys)
    assert request_keys(LAYOUT, tokens, tenant) == request_keys(LAYOUT, tokens, KeyScope(cache_salt="tenant-a"))
    for change in ({"kv_dtype": "float16"}, {"num_layers": 3}, {"num_kv_heads": 4}, {"config_fingerprint": "abd"},
                   {"weights_version": "step-200"}):
        assert set(request_keys(dataclasses.replace(LAYOUT, **change), tokens)).isdisjoint(keys)


def test_multimodal_hashes_change_only_the_chunks_they_cover():
    tokens = [7] * 64  # placeholder tokens look alike
    a = request_keys(LAYOUT, tokens, mm_spans=[MMSpan(offset=20, length=10, item_hash="img-a")])
    b = request_keys(LAYOUT, tokens, mm_spans=[MMSpan(offset=20, length=10, item_hash="img-b")])
    plain = request_keys(LAYOUT, tokens)
    assert a[0] == b[0] == plain[0]  # chunk 0 is before the image
    assert a[1] != b[1] and a[1] != plain[1]
    assert a[2] != b[2]  # chained: everything after differs too


def test_every_input_that_changes_the_kv_changes_every_key():
    tokens = list(range(64))
    plain = request_keys(LAYOUT, tokens)
    # Keys without an adapter or a weights epoch are those of earlier versions (stored chunks stay usable).
    assert plain == request_keys(LAYOUT, tokens, KeyScope())
    assert LAYOUT.namespace() == LAYOUT.namespace(KeyScope(cache_salt=""))
    scopes = [KeyScope(adapter="content:aa"), KeyScope(adapter="content:bb"), KeyScope(weights_epoch=1),
              KeyScope(weights_epoch=2), KeyScope(cache_salt="t", adapter="content:aa")]
    keysets = [set(request_keys(LAYOUT, tokens, scope)) for scope in scopes]
    for i, keys in enumerate(keysets):
        assert keys.isdisjoint(plain)
        assert all(keys.isdisjoint(other) for other in keysets[i + 1:])
    # Deterministic: the same scope gives the same keys (no per-process seed).
    assert request_keys(LAYOUT, tokens, KeyScope(adapter="content:aa")) == request_keys(
        LAYOUT, tokens, KeyScope(adapter="content:aa"))


def test_prompt_embeddings_key_each_chunk_by_their_digest():
    import torch

    g = torch.Generator().manual_seed(0)
    e1 = torch.randn(48, 8, generator=g, dtype=torch.float32).to(torch.bfloat16)
    e2 = e1.clone()
    e2[40, 3] += 1  # differs in chunk 2 only
    tokens = [0] * 48  # embeddings prompts carry placeholder token ids
    d1, d2 = embed_digests(e1, None, 16), embed_digests(e2, None, 16)
    assert len(d1) == 3 and d1[:2] == d2[:2] and d1[2] != d2[2]
    k1, k2 = request_keys(LAYOUT, tokens, embed_digests=d1), request_keys(LAYOUT, tokens, embed_digests=d2)
    assert k1[:2] == k2[:2] and k1[2] != k2[2]
    assert set(k1).isdisjoint(request_keys(LAYOUT, tokens))  # never the keys of real token-id zeros
    # The same values in another dtype are other KV inputs; a token-id mask is part of the digest.
    assert embed_digests(e1.float(), None, 16)[0] != d1[0]
    assert embed_digests(e1, [True] * 8 + [False] * 40, 16)[0] != d1[0]


def _adapter(path, weights: bytes):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def test_adapter_identity_is_its_content_not_its_name_or_id(tmp_path):
    from types import SimpleNamespace

    ids = AdapterIdentities("content")
    a = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(_adapter(tmp_path / "a", b"w1")))
    a_copy = SimpleNamespace(lora_name="other-name", lora_int_id=7, lora_path=str(_adapter(tmp_path / "c", b"w1")))
    b = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(_adapter(tmp_path / "b", b"w2")))
    assert ids.identity(None) == ""
    assert ids.identity(a) == ids.identity(a_copy) != ids.identity(b)
    before = ids.identity(a)
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"w3")  # the adapter was updated in place
    assert ids.identity(a) != before
    with pytest.raises(OSError, match="not a readable directory"):
        ids.identity(SimpleNamespace(lora_name="gone", lora_int_id=2, lora_path=str(tmp_path / "missing")))
    named = AdapterIdentities("name")
    assert named.identity(a) == named.identity(b) == "name:a" != named.identity(a_copy)


def test_a_request_is_read_into_its_key_inputs(tmp_path):
    from types import SimpleNamespace

    import torch

    lora = SimpleNamespace(lora_name="x", lora_int_id=3, lora_path=str(_adapter(tmp_path / "x", b"w")))
    embeds = torch.ones(40, 8, dtype=torch.bfloat16)
    request = SimpleNamespace(request_id="r", prompt_token_ids=None, num_prompt_tokens=40, cache_salt="s",
                              lora_request=lora, prompt_embeds=embeds, mm_features=None)
    inputs = read_request(request, LAYOUT, AdapterIdentities(), weights_epoch=2)
    assert inputs.tokens == [0] * 40 and len(inputs.embed_digests) == 3
    assert inputs.scope == KeyScope(cache_salt="s", adapter=AdapterIdentities().identity(lora), weights_epoch=2)
    assert inputs.keys(LAYOUT) == request_keys(LAYOUT, [0] * 40, inputs.scope, embed_digests=inputs.embed_digests)
