"""The admin API as ``kvring admin`` serves it (a real process over loopback, ``conftest.py``)
against a real etcd and real node processes.

One 3-node cluster is shared by the module's tests; each test uses keys of its own, and the
test that drains a node cancels the drain at its end.  Reads answer from a view the admin reads
about once a second, so a test that has just changed the cluster reads with ``fresh()``: it
waits for a view read after the change."""

from __future__ import annotations

import dataclasses

import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from polling import wait_for

from kvring.admin import AdminSettings
from kvring.cachenode.client import ClusterClient
from kvring.cachenode.store import ENTRY_OVERHEAD
from kvring.common.chunk import ChunkItem
from kvring.common.nodetoken import NodeToken
from kvring.connector.keys import KeyScope, KVLayout, request_keys
from kvring.connector.parts import STATE
from kvring.local.cluster import LocalCluster, free_port
from kvring.membership.settings import EtcdSettings

TOKEN = "test-token-0123456789abcdef"  # the token conftest's admin_server starts the admin with
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MEMORY = 64 << 20
LAYOUT = KVLayout(model="tiny-llama", config_fingerprint="abc123", kv_dtype="bfloat16", num_layers=2,
                  num_kv_heads=2, head_size=8, block_layout="BHNC", chunk_size=256)


@pytest.fixture(scope="module")
def cluster(etcd_server):
    c = LocalCluster(nodes=3, memory=MEMORY, etcd=etcd_server.endpoint, cluster="admin-api").start()
    yield c
    c.close()


@pytest.fixture(scope="module")
def api(cluster, admin_server):
    with admin_server(cluster).client() as client:
        yield client


def as_of(body: dict) -> float:
    """When the view behind an answer was read (unix seconds)."""
    return datetime.fromisoformat(body["view"]["as_of"]).timestamp()


def fresh(api: httpx.Client, path: str) -> dict:
    """``GET path`` answered from a view read after this call began: it shows every change made
    before the call."""
    since = time.time()
    return wait_for(lambda: (body := api.get(path).json()) and as_of(body) >= since and body, 10,
                    f"a view of {path} read after {since}")


@pytest.fixture(scope="module")
def client(cluster):
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as c:
        assert c.wait_for_nodes(3)
        yield c



def _put(client, keys, namespace: str = "") -> np.ndarray:
    data = np.arange(2 * 2 * 256 * 2 * 8, dtype=np.uint8)  # one layer-major chunk of LAYOUT, as bytes
    assert all(client.put_many([ChunkItem.of(k, data, [2, 256, 2, 16], "uint8", 256, namespace) for k in keys]))
    return data



def test_health_and_openapi_docs(api):
    assert api.get("/healthz").json() == {"status": "ok"}
    docs = api.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    paths = api.get("/openapi.json").json()["paths"]
    for path in ("/healthz", "/v1/cluster", "/v1/nodes", "/v1/keys/{key_hex}/owners", "/v1/lookup",
                 "/v1/nodes/{node_id}/drain", "/v1/namespaces/{namespace}", "/metrics"):
        assert path in paths, path


def test_cluster_contract_epoch_and_members(api, cluster):
    body = api.get("/v1/cluster").json()
    assert body["view"]["stale"] is False and body["view"]["stale_reason"] is None
    assert 0 <= body["view"]["age_s"] < 5 and abs(as_of(body) - time.time()) < 5
    assert body["cluster"] == cluster.cluster and body["etcd"] == [cluster.etcd]
    assert body["contract"] == {"hash_algorithm": "blake2b-128", "chunk_size": 256, "format_version": 2,
                                "vnodes": 1024, "replication": 1}
    assert body["nodes"] == 3 and body["nodes_on_ring"] == 3 and body["states"] == {"active": 3}
    assert body["ring_epoch"] > 0 and body["etcd_revision"] >= body["ring_epoch"]
    assert body["drain_requests"] == []


def test_nodes_capacity_usage_and_hit_counters(api, client):
    before = {n["node_id"]: n for n in fresh(api, "/v1/nodes")["nodes"]}
    keys = [os.urandom(16) for _ in range(30)]
    data = _put(client, keys)
    assert client.lookup(keys + [os.urandom(16) for _ in range(5)]) == [True] * 30 + [False] * 5
    nodes = fresh(api, "/v1/nodes")["nodes"]
    assert [n["node_id"] for n in nodes] == ["node-0", "node-1", "node-2"]
    for n in nodes:
        assert n["state"] == n["registered_state"] == "active" and n["on_ring"] and n["error"] is None
        assert n["capacity"] == MEMORY and n["data_addr"].startswith("tcp://")
        assert n["admin_addr"].startswith("http://") and n["drain"]["state"] == "active"
        assert n["events_addr"].startswith("tcp://") and n["events_replay_addr"].startswith("tcp://")
        assert n["kv_events"]["dropped_events"] == 0  # chunks without vLLM blocks: nothing to publish
    grew = lambda field: sum(n[field] - before[n["node_id"]][field] for n in nodes)  # noqa: E731
    assert grew("chunks") == 30 and grew("used") == 30 * (data.nbytes + ENTRY_OVERHEAD)  # bookkeeping is charged
    assert grew("hits") == 30 and grew("misses") == 5

    one = api.get("/v1/nodes/node-1").json()
    assert one["node_id"] == "node-1" and one["capacity"] == MEMORY and one["view"]["stale"] is False
    missing = api.get("/v1/nodes/node-9")
    assert missing.status_code == 404 and "no node 'node-9'" in missing.json()["detail"]
    assert "node-0, node-1, node-2" in missing.json()["detail"]


def test_key_owners_and_bad_keys(api, client):
    key = os.urandom(16)
    _put(client, [key])
    body = api.get(f"/v1/keys/{key.hex()}/owners").json()
    assert body["key"] == key.hex() and body["owners"] == client.owners(key)
    assert body["held_by"] == client.owners(key) and body["ring_epoch"] > 0 and not body["view"]["stale"]
    absent = os.urandom(16).hex()
    assert api.get(f"/v1/keys/{absent}/owners").json()["held_by"] == []
    bad = api.get("/v1/keys/not-hex/owners")
    assert bad.status_code == 422 and "not hex" in bad.json()["detail"]
    too_long = api.get(f"/v1/keys/{'ab' * 65}/owners")
    assert too_long.status_code == 422 and "1..64 bytes" in too_long.json()["detail"]


def _layout_body(tokens, salt=None, **extra):
    return {"token_ids": tokens, "layout": vars(LAYOUT), "cache_salt": salt, **extra}


def test_a_lookup_of_a_model_with_recurrent_state_ends_on_the_last_chunk_with_every_state_slice(api, client):
    """A model with recurrent state: a chunk counts as the end of the prefix only where every
    slice of its state is held (TP 2: two), as the connector's lookup counts it."""
    layout = KVLayout(**{**vars(LAYOUT), "windows": (STATE, 0), "state_format": "gdn|(3, 8):bfloat16|shards=2"})
    rng = np.random.default_rng(12)
    tokens = [int(t) for t in rng.integers(0, 32_000, size=4 * 256 + 9)]
    keys = request_keys(layout, tokens)
    parts = layout.parts(state_shards=2)
    attention = [p for p in parts.parts if not p.state]
    states = [p for p in parts.parts if p.state]
    assert len(states) == 2
    # Every chunk's attention parts; both slices of the state after chunk 1, one of them after chunk 3.
    _put(client, [p.key(k) for k in keys for p in attention] + [p.key(keys[1]) for p in states]
         + [states[0].key(keys[3])], layout.namespace())
    body = api.post("/v1/lookup", json={"token_ids": tokens, "state_shards": 2,
                                        "layout": {**vars(layout), "windows": list(layout.windows)}}).json()
    assert body["matched_chunks"] == 2 and body["matched_tokens"] == 512
    assert [c["parts"] for c in body["chunks"]] == [4] * 4
    assert [c["parts_held"] for c in body["chunks"]] == [2, 4, 2, 3]


def test_prefix_lookup_agrees_with_the_connectors_lookup(api, cluster, client):
    from kvring.connector.config import ConnectorConfig
    from kvring.connector.scheduler import SchedulerSide

    rng = np.random.default_rng(11)
    tokens = [int(t) for t in rng.integers(0, 32_000, size=5 * 256 + 37)]
    salt = "tenant-7"
    keys = request_keys(LAYOUT, tokens, KeyScope(cache_salt=salt))
    assert len(keys) == 5
    namespace = LAYOUT.namespace(KeyScope(cache_salt=salt))
    parts = LAYOUT.parts()
    # Chunks 0-2 and 4 whole, chunk 3 only its head-0 part: the prefix stops at chunk 3.
    _put(client, parts.keys(keys[:3] + keys[4:]) + [parts.parts[0].key(keys[3])], namespace)

    body = api.post("/v1/lookup", json=_layout_body(tokens, salt)).json()
    assert body["namespace"] == namespace and body["chunk_size"] == 256
    assert body["prompt_tokens"] == len(tokens) and body["chunks_total"] == 5
    assert [c["key"] for c in body["chunks"]] == [k.hex() for k in keys]
    assert body["matched_chunks"] == 3 and body["matched_tokens"] == 768
    assert [c["in_prefix"] for c in body["chunks"]] == [True, True, True, False, False]
    assert [c["parts_held"] for c in body["chunks"]] == [2, 2, 2, 1, 2] and {c["parts"] for c in body["chunks"]} == {2}
    for c in body["chunks"]:
        owners = list(dict.fromkeys(n for k in parts.keys([bytes.fromhex(c["key"])]) for n in client.owners(k)))
        assert c["owners"] == owners and set(c["held_by"]) <= set(owners) and c["held_by"]
    assert body["chunks"][3]["tokens"] == [768, 1024]

    # The connector's own scheduler-side lookup, on its own client, sees the same prefix.
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as own:
        sched = SchedulerSide(ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster), LAYOUT, own,
                              block_size=16, bytes_per_token=256)
        request = SimpleNamespace(request_id="r1", prompt_token_ids=tokens, cache_salt=salt, mm_features=None)
        sched.on_new_request(request)
        external = None
        for _ in range(500):  # the lookup answers on a later call
            external, _ = sched.get_num_new_matched_tokens(request, 0)
            if external is not None:
                break
            time.sleep(0.01)
        lookup = sched._lookups["r1"]
        sched.shutdown()
    assert [k.hex() for k in lookup.keys] == [c["key"] for c in body["chunks"]]
    assert lookup.hit_chunks == body["matched_chunks"] and external == body["matched_tokens"]

    # The namespace string given directly computes the same keys.
    direct = api.post("/v1/lookup", json={"token_ids": tokens, "namespace": namespace, "num_kv_heads": 2,
                                          "num_layers": 2}).json()
    assert direct["matched_chunks"] == 3 and [c["key"] for c in direct["chunks"]] == [k.hex() for k in keys]
    # Another tenant's salt shares nothing; nor does the same prompt without a salt.
    assert api.post("/v1/lookup", json=_layout_body(tokens, "tenant-8")).json()["matched_chunks"] == 0
    assert api.post("/v1/lookup", json=_layout_body(tokens)).json()["matched_chunks"] == 0
    # Under a LoRA adapter or another weights epoch the keys are the connector's for those: none stored.
    scoped = KeyScope(cache_salt=salt, adapter="content:0123", weights_epoch=2)
    under = api.post("/v1/lookup", json=_layout_body(tokens, salt, adapter="content:0123", weights_epoch=2)).json()
    assert under["namespace"] == LAYOUT.namespace(scoped) != namespace and under["matched_chunks"] == 0
    assert [c["key"] for c in under["chunks"]] == [k.hex() for k in request_keys(LAYOUT, tokens, scoped)]
    # A prompt shorter than one chunk has nothing to look up.
    short = api.post("/v1/lookup", json=_layout_body(tokens[:100], salt)).json()
    assert short["chunks_total"] == 0 and short["matched_tokens"] == 0


def test_a_hybrid_layouts_prefix_needs_its_windows_parts_only_where_the_window_reaches(api, cluster, client):
    from kvring.connector.config import ConnectorConfig
    from kvring.connector.scheduler import SchedulerSide

    hybrid = dataclasses.replace(LAYOUT, windows=(128, 0))  # layer 0 slides over 128 tokens
    tokens = [int(t) for t in np.random.default_rng(12).integers(0, 32_000, size=5 * 256 + 37)]
    keys, parts = request_keys(hybrid, tokens), hybrid.parts()
    full, window = [[p for p in parts.parts if p.window == w] for w in (0, 128)]
    # Every full-attention part; the window's parts of chunks 0, 2 and 3 only.
    _put(client, [p.key(k) for k in keys for p in full] + [p.key(keys[c]) for c in (0, 2, 3) for p in window])
    body = {"token_ids": tokens, "layout": {**vars(hybrid), "windows": [128, 0]}}

    def both() -> tuple[int, int]:
        """The admin's prefix and the connector's own scheduler-side lookup's."""
        admin = api.post("/v1/lookup", json=body).json()["matched_chunks"]
        with ClusterClient(cluster.etcd, cluster=cluster.cluster) as own:
            sched = SchedulerSide(ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster), hybrid, own,
                                  block_size=16, bytes_per_token=256)
            request = SimpleNamespace(request_id="r", prompt_token_ids=tokens, cache_salt=None, mm_features=None)
            sched.on_new_request(request)
            for _ in range(500):
                if sched.get_num_new_matched_tokens(request, 0)[0] is not None:
                    break
                time.sleep(0.01)
            sched.shutdown()
            return admin, sched._lookups["r"].hit_chunks

    # A load of all 5 chunks needs the window's part of chunk 4 only (tokens 1152-1279), missing.
    assert both() == (4, 4)
    _put(client, [p.key(keys[4]) for p in window])
    assert both() == (5, 5)  # chunk 1's window part is never needed: a window never reaches back there


@pytest.mark.parametrize("body, message", [
    ({"token_ids": [1, 2]}, "exactly one of 'namespace'"),
    ({"token_ids": [1], "namespace": "ns", "layout": vars(LAYOUT)}, "exactly one of 'namespace'"),
    ({"token_ids": [1], "namespace": "ns", "cache_salt": "s"}, "go with 'layout'"),
    ({"token_ids": [-1], "namespace": "ns"}, "greater than or equal to 0"),
    ({"token_ids": [2**32], "namespace": "ns"}, "less than 4294967296"),
    ({"token_ids": "1 2 3", "namespace": "ns"}, "valid list"),
    ({"token_ids": [1], "namespace": "ns", "surprise": 1}, "Extra inputs are not permitted"),
    ({"token_ids": [1], "namespace": "ns"}, "give 'num_kv_heads' and 'num_layers' too"),
    ({"token_ids": [1], "layout": vars(LAYOUT), "num_kv_heads": 2}, "go with 'namespace'"),
    ({"token_ids": [1], "layout": vars(LAYOUT), "stages": [[0, 1], [2, 2]]}, "'stages' must cut layers [0, 2)"),
    ({"token_ids": [1], "layout": vars(LAYOUT), "stages": [[0, 1]]}, "'stages' must cut layers [0, 2)"),
    ({"token_ids": [1], "layout": {**vars(LAYOUT), "num_layers": 0}}, "greater than or equal to 1"),
    ({"token_ids": [1], "layout": {**vars(LAYOUT), "chunk_size": 16}}, "cluster's chunk size is 256"),
    ({"token_ids": [1], "layout": {**vars(LAYOUT), "windows": [128]}}, "recurrent state) per layer (2)"),
    ({"token_ids": [1], "layout": {**vars(LAYOUT), "windows": [-1, 0]}}, "gives its 'state_format'"),
    ({"token_ids": [1], "layout": {**vars(LAYOUT), "state_format": "gdn"}}, "gives its 'state_format', and only it"),
    ({"token_ids": [1] * 300, "layout": vars(LAYOUT),
      "mm_spans": [{"offset": 290, "length": 20, "item_hash": "img"}]}, "ends past the prompt"),
])
def test_lookup_rejects_bad_bodies_clearly(api, body, message):
    resp = api.post("/v1/lookup", json=body)
    assert resp.status_code == 422
    assert message in str(resp.json()["detail"])


def test_mutating_endpoints_need_the_token_and_change_nothing_without_it(api, cluster, client):
    keys = [os.urandom(16) for _ in range(10)]
    _put(client, keys, "kvring/v1/guarded")
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": f"Basic {TOKEN}"}):
        for method, path in (("POST", "/v1/nodes/node-0/drain"), ("DELETE", "/v1/nodes/node-0/drain"),
                             ("DELETE", "/v1/namespaces/kvring/v1/guarded"), ("POST", "/v1/nodes/nope/drain")):
            resp = api.request(method, path, headers=headers)
            assert resp.status_code == 401, (method, path, headers)
            assert resp.headers["www-authenticate"] == "Bearer"
            assert "Authorization: Bearer <token>" in resp.json()["detail"]
    assert cluster.etcd_run(lambda e: e.drain_requests()) == set()
    assert api.get("/v1/cluster").json()["states"] == {"active": 3}
    assert all(client.lookup(keys))


def test_mutating_endpoints_are_off_without_a_configured_token(cluster, client, admin_server):
    keys = [os.urandom(16) for _ in range(5)]
    _put(client, keys, "kvring/v1/open")
    server = admin_server(cluster, token=None)
    with server.client() as open_api:
        for method, path in (("POST", "/v1/nodes/node-0/drain"), ("DELETE", "/v1/namespaces/kvring/v1/open")):
            resp = open_api.request(method, path, headers=AUTH)
            assert resp.status_code == 403 and "KVRING_ADMIN_TOKEN" in resp.json()["detail"]
        assert open_api.get("/v1/cluster").status_code == 200  # reading needs no token
    server.stop()
    assert cluster.etcd_run(lambda e: e.drain_requests()) == set()
    assert all(client.lookup(keys))
    with pytest.raises(ValueError, match="at least 16 characters"):
        AdminSettings(etcd=EtcdSettings.parse(cluster.etcd, cluster=cluster.cluster), token="short")


def test_without_the_node_token_what_asks_the_nodes_answers_503_and_changes_nothing(cluster, client, admin_server):
    """The nodes' admin ports require the cluster's node token: an admin started without it says so
    once at start, and lookups, key owners and flushes answer 503 naming the option."""
    keys = [os.urandom(16) for _ in range(5)]
    _put(client, keys, "kvring/v1/no-node-token")
    server = admin_server(cluster, node_token=False)
    with server.client() as api:
        for method, path, body in (("GET", f"/v1/keys/{keys[0].hex()}/owners", None),
                                   ("POST", "/v1/lookup", {"token_ids": list(range(300)), "namespace": "ns",
                                                           "num_kv_heads": 1, "num_layers": 1}),
                                   ("DELETE", "/v1/namespaces/kvring/v1/no-node-token", None)):
            resp = api.request(method, path, json=body, headers=AUTH)
            assert resp.status_code == 503, (path, resp.text)
            assert "--node-token-file" in resp.json()["detail"] and "\n" not in resp.text
        assert api.get("/v1/cluster").status_code == 200  # reads from the view need no node token
    server.stop()
    assert all(client.lookup(keys))
    assert server.log().count("warning: no node token") == 1
    with pytest.raises(ValueError, match="at least 32 printable ASCII"):
        NodeToken.fixed("short")


def test_a_wrong_node_token_is_refused_by_the_nodes_and_flushes_nothing(cluster, client, admin_server, tmp_path):
    keys = [os.urandom(16) for _ in range(10)]
    _put(client, keys, "kvring/v1/wrong-node-token")
    wrong = tmp_path / "wrong-token"
    wrong.write_text("f" * 64)
    server = admin_server(cluster, "--node-token-file", str(wrong), node_token=False)
    with server.client() as api:
        resp = api.delete("/v1/namespaces/kvring/v1/wrong-node-token", headers=AUTH)
        assert resp.status_code == 502 and resp.json()["deleted"] == 0
        assert set(resp.json()["failed"]) == {"node-0", "node-1", "node-2"}
        assert all("HTTP 401" in why for why in resp.json()["failed"].values())
        # Lookups count a node that refuses as holding nothing; the admin's log says why.
        assert api.get(f"/v1/keys/{keys[0].hex()}/owners").json()["held_by"] == []
    server.stop()
    assert all(client.lookup(keys))
    assert "this admin cannot ask node" in server.log() and "the node token the nodes run with" in server.log()


def test_flush_through_the_api_leaves_other_namespaces_alone(api, client):
    ns_a, ns_b = "kvring/v1/aaaa", "kvring/v1/bbbb"
    a, b, none = ([os.urandom(16) for _ in range(40)] for _ in range(3))
    _put(client, a, ns_a)
    _put(client, b, ns_b)
    _put(client, none)
    resp = api.delete(f"/v1/namespaces/{ns_a}", headers=AUTH)
    assert resp.status_code == 200
    body = resp.json()
    assert body["namespace"] == ns_a and body["deleted"] == 40 and body["failed"] == {}
    assert set(body["nodes"]) == {"node-0", "node-1", "node-2"} and sum(body["nodes"].values()) == 40
    assert not any(client.lookup(a)) and all(client.lookup(b)) and all(client.lookup(none))
    assert api.delete(f"/v1/namespaces/{ns_a}", headers=AUTH).json()["deleted"] == 0
    empty = api.delete("/v1/namespaces/", headers=AUTH)
    assert empty.status_code == 422 and "empty namespace" in empty.json()["detail"]
    assert all(client.lookup(none))


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_requests_and_gauge_the_cluster(api):
    api.get("/healthz")
    api.get("/v1/keys/zz/owners")
    fresh(api, "/v1/nodes")  # the chunks the tests before stored are in the view /metrics reads
    m = _samples(api.get("/metrics").text)
    req = "kvring_admin_requests_total"
    assert m[(req, (("method", "GET"), ("route", "/healthz"), ("status", "200")))] >= 1
    assert m[(req, (("method", "GET"), ("route", "/v1/keys/{key_hex}/owners"), ("status", "422")))] >= 1
    assert m[("kvring_admin_etcd_up", ())] == 1
    assert m[("kvring_cluster_nodes", (("state", "active"),))] == 3
    assert m[("kvring_cluster_nodes", (("state", "drained"),))] == 0
    assert m[("kvring_cluster_capacity_bytes", ())] == 3 * MEMORY
    per_node = sum(m[("kvring_cluster_node_chunks", (("node", f"node-{i}"),))] for i in range(3))
    assert per_node == m[("kvring_cluster_chunks", ())] > 0
    assert m[("kvring_cluster_node_up", (("node", "node-2"),))] == 1
    assert m[("kvring_cluster_ring_epoch", ())] > 0
    assert 0 <= m[("kvring_admin_view_age_seconds", ())] < 5


def test_drain_through_the_api(api, cluster, client):
    keys = [os.urandom(16) for _ in range(60)]
    _put(client, keys)
    assert api.post("/v1/nodes/nope/drain", headers=AUTH).status_code == 404
    resp = api.post("/v1/nodes/node-2/drain", headers=AUTH)
    assert resp.status_code == 202 and resp.json()["drain_requested"] is True
    node = wait_for(lambda: (n := api.get("/v1/nodes/node-2").json())["state"] == n["registered_state"] == "drained"
                    and n, 30, "node-2 drained")
    assert node["chunks"] == 0 and not node["on_ring"]
    assert node["drain"]["requested_by"] == ["etcd"] and node["drain"]["remaining"] == 0
    info = api.get("/v1/cluster").json()
    assert info["states"] == {"active": 2, "drained": 1} and info["nodes_on_ring"] == 2
    assert info["drain_requests"] == ["node-2"] and info["rebalancing"] == ["node-2"]  # it has left, not yet gone
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as fresh:
        assert all(c is not None for c in fresh.get(keys))
        key = keys[0]
        owners = api.get(f"/v1/keys/{key.hex()}/owners").json()["owners"]
        assert "node-2" not in owners and owners == fresh.owners(key)

    resp = api.delete("/v1/nodes/node-2/drain", headers=AUTH)
    assert resp.status_code == 200 and resp.json()["drain_requested"] is False
    info = wait_for(lambda: (i := api.get("/v1/cluster").json())["states"] == {"active": 3} and i, 10,
                    "node-2 active again")
    assert info["drain_requests"] == []


def test_unreachable_node_is_listed_not_an_error(cluster_factory, admin_server):
    small = cluster_factory(nodes=2, memory=16 << 20)
    small.nodes[1].kill()  # no goodbye: its record stays until the lease runs out
    with admin_server(small, "--node-timeout", "1.0").client() as api:
        nodes = {n["node_id"]: n for n in fresh(api, "/v1/nodes")["nodes"]}
        assert nodes["node-0"]["state"] == "active"
        gone = nodes["node-1"]
        assert gone["state"] == "unreachable" and gone["registered_state"] == "active"
        assert gone["used"] is None and gone["error"]
        m = _samples(api.get("/metrics").text)
        assert m[("kvring_cluster_nodes", (("state", "unreachable"),))] == 1
        assert m[("kvring_cluster_node_up", (("node", "node-1"),))] == 0


def test_etcd_down_is_a_clear_503(admin_server):
    """No view of the cluster was ever read: reads say so (503, Retry-After), as do writes."""
    server = admin_server(f"127.0.0.1:{free_port()}", cluster="x")
    with server.client() as api:
        assert api.get("/healthz").status_code == 200
        for method, path, body in (("GET", "/v1/cluster", None), ("GET", "/v1/nodes", None),
                                   ("GET", "/v1/nodes/node-0", None), ("GET", f"/v1/keys/{'ab' * 16}/owners", None),
                                   ("POST", "/v1/nodes/node-0/drain", None),
                                   ("POST", "/v1/lookup", {"token_ids": [1], "namespace": "ns", "num_kv_heads": 1,
                                                             "num_layers": 1})):
            resp = api.request(method, path, json=body, headers=AUTH)
            assert resp.status_code == 503, (path, resp.text)
            assert "etcd at 127.0.0.1:" in resp.json()["detail"] and "cannot be reached" in resp.json()["detail"]
            assert "\n" not in resp.text and resp.headers["retry-after"] == "1"
        assert _samples(api.get("/metrics").text)[("kvring_admin_etcd_up", ())] == 0
    assert "WARNING kvring.admin.view: reading the cluster view failed: etcd at 127.0.0.1:" in server.log()


def test_kvring_up_serves_the_admin_api():
    proc = subprocess.Popen([sys.executable, "-P", "-m", "kvring.cli", "up", "--nodes", "1", "--memory", "16MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "KVRING_ADMIN_TOKEN": TOKEN, "COLUMNS": "200"})
    try:
        lines = []
        while not lines or "Press Ctrl-C" not in lines[-1]:
            line = proc.stdout.readline()
            assert line, "kvring up exited early:\n" + "".join(lines)
            lines.append(line)
        text = "".join(lines)
        url = re.search(r"Admin API: (http://127\.0\.0\.1:\d+)", text).group(1)
        assert f"Bearer {TOKEN}" in text
        info = httpx.get(f"{url}/v1/cluster", timeout=10).json()
        assert info["nodes"] == 1 and info["view"]["stale"] is False
        resp = httpx.delete(f"{url}/v1/namespaces/kvring/v1/x", headers=AUTH, timeout=10)
        assert resp.status_code == 200 and resp.json()["deleted"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
