"""Connector settings and chunk keys, on plain data (no vLLM needed for these parts)."""

from __future__ import annotations

import dataclasses

import pytest

from kvring.connector.config import ConnectorConfig
from kvring.connector.keys import KVLayout, MMSpan, request_keys

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
    assert set(request_keys(LAYOUT, tokens, cache_salt="tenant-a")).isdisjoint(keys)
    assert request_keys(LAYOUT, tokens, cache_salt="tenant-a") == request_keys(LAYOUT, tokens, cache_salt="tenant-a")
    for change in ({"kv_dtype": "float16"}, {"num_layers": 3}, {"tp_size": 2}, {"config_fingerprint": "abd"}):
        assert set(request_keys(dataclasses.replace(LAYOUT, **change), tokens)).isdisjoint(keys)


def test_multimodal_hashes_change_only_the_chunks_they_cover():
    tokens = [7] * 64  # placeholder tokens look alike
    a = request_keys(LAYOUT, tokens, mm_spans=[MMSpan(offset=20, length=10, item_hash="img-a")])
    b = request_keys(LAYOUT, tokens, mm_spans=[MMSpan(offset=20, length=10, item_hash="img-b")])
    plain = request_keys(LAYOUT, tokens)
    assert a[0] == b[0] == plain[0]  # chunk 0 is before the image
    assert a[1] != b[1] and a[1] != plain[1]
    assert a[2] != b[2]  # chained: everything after differs too
