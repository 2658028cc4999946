"""CacheCluster spec parsing: defaults shared with the CRD schema, and clear errors for bad specs.

The same examples are checked against the CRD's own schema (``crd_schema``): a spec the schema
refuses is refused by ``ClusterSpec.from_dict`` too (the operator may meet specs no API server
validated), and the schema's defaults, applied as the API server would, change nothing.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
from crd_schema import apply_defaults, load_crd, load_examples, openapi_schema, schema_errors

from kvring.operator import spec as spec_mod
from kvring.operator.spec import (
    ClusterSpec,
    DiskSpec,
    EtcdSpec,
    NetworkPolicySpec,
    PoolEventsSpec,
    SpecError,
    check_name,
    parse_bytes,
)

VALID = load_examples()
INVALID = load_examples("invalid")
REJECTED_BY_OPERATOR = load_examples("rejected-by-operator")


def test_constants_match_the_crd():
    crd = load_crd()
    assert crd["spec"]["group"] == spec_mod.GROUP
    assert crd["metadata"]["name"] == f"{spec_mod.PLURAL}.{spec_mod.GROUP}"
    assert crd["spec"]["names"]["kind"] == spec_mod.KIND
    assert crd["spec"]["names"]["shortNames"] == spec_mod.SHORT_NAMES
    assert [v["name"] for v in crd["spec"]["versions"]] == [spec_mod.VERSION]


def structural_problems(node: dict, path: str = "") -> list[str]:
    """What the API server would refuse in a CRD schema that is not structural (the rules of
    "Specifying a structural schema"): every field typed, unless int-or-string or
    preserve-unknown-fields; anyOf/allOf/oneOf/not only for value checks; additionalProperties
    never beside properties; list-map keys required."""
    problems = []
    int_or_string = node.get("x-kubernetes-int-or-string")
    if "type" not in node and not int_or_string and not node.get("x-kubernetes-preserve-unknown-fields"):
        problems.append(f"{path or '<root>'}: no type")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: both properties and additionalProperties")
    for key in ("anyOf", "allOf", "oneOf"):
        for sub in node.get(key, []):
            banned = {"description", "default", "additionalProperties", "nullable"} & set(sub)
            if "type" in sub and not int_or_string:
                banned.add("type")
            if banned:
                problems.append(f"{path}.{key}: {sorted(banned)} inside a logical junctor")
    if node.get("x-kubernetes-list-type") == "map":
        missing = set(node["x-kubernetes-list-map-keys"]) - set(node["items"].get("required", []))
        if missing:
            problems.append(f"{path}: list-map keys {sorted(missing)} not required")
    for name, sub in node.get("properties", {}).items():
        problems += structural_problems(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            problems += structural_problems(node[key], f"{path}[{key}]")
    return problems


def test_crd_schema_is_structural():
    schema = openapi_schema()
    assert structural_problems(schema) == []
    broken = copy.deepcopy(schema)
    del broken["properties"]["spec"]["properties"]["replicas"]["type"]
    broken["properties"]["spec"]["properties"]["nodeSelector"]["properties"] = {"a": {"type": "string"}}
    assert sorted(structural_problems(broken)) == [".spec.nodeSelector: both properties and additionalProperties",
                                                   ".spec.replicas: no type"]
    # metadata may only restrict name and generateName.
    assert set(schema["properties"]["metadata"]["properties"]) <= {"name", "generateName"}


def test_crd_subresources_and_columns():
    (version,) = load_crd()["spec"]["versions"]
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == ".status.readyReplicas" and columns["Desired"] == ".spec.replicas"
    assert columns["Epoch"] == ".status.epoch" and columns["Memory"] == ".spec.memoryPerNode"
    assert columns["Age"] == ".metadata.creationTimestamp"
    status = openapi_schema()["properties"]["status"]["properties"]
    assert status["conditions"]["items"]["properties"]["type"]["enum"] == ["Ready", "Degraded", "Rebalancing",
                                                                         "ConfigMismatch", "Progressing"]
    assert status["connector"]["type"] == "string"


def test_status_as_the_operator_writes_it_validates():
    cr = {"apiVersion": "kvring.io/v1alpha1", "kind": "CacheCluster", "metadata": {"name": "kv"},
          "spec": {"memoryPerNode": "1Gi"},
          "status": {"observedGeneration": 2, "replicas": 3, "readyReplicas": 3, "epoch": 812,
                     "selector": "app.kubernetes.io/name=kvring,app.kubernetes.io/instance=kv",
                     "nodes": [{"id": "kv-0", "state": "active", "ready": True, "usedBytes": 1024,
                                "capacityBytes": 1 << 30}],
                     "conditions": [{"type": "Ready", "status": "True", "reason": "AllNodesReady", "message": "3/3",
                                     "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 2}],
                     "connector": '{"kv_connector":"KVRingConnector"}'}}
    assert schema_errors(cr) == []
    cr["status"]["conditions"][0]["type"] = "Happy"
    assert any("'Happy' is not one of" in e for e in schema_errors(cr))


def test_every_schema_field_is_read():
    """A field added to the CRD but not to the reader would be silently refused as unknown."""
    properties = openapi_schema()["properties"]["spec"]["properties"]
    assert sorted(properties) == sorted(spec_mod._SPEC_KEYS)


def test_defaults():
    s = ClusterSpec.from_dict({"memoryPerNode": "1Gi"})
    assert (s.replicas, s.image, s.image_pull_policy) == (3, "kvring:0.1.0", "IfNotPresent")
    assert (s.memory_per_node, s.memory_per_node_raw) == (1 << 30, "1Gi")
    assert (s.chunk_size, s.vnodes, s.replication, s.policy, s.lease_ttl) == (256, 1024, 1, "lru", 10)
    assert (s.drain_timeout_seconds, s.data_port, s.admin_port, s.auth_secret) == (120, 5555, 8080, None)
    assert s.etcd == EtcdSpec(endpoints=(), managed=True, members=1, storage="1Gi", storage_class=None,
                              image="quay.io/coreos/etcd:v3.5.17")
    assert (s.resources, s.node_selector, s.tolerations, s.affinity, s.topology_spread) == ({}, {}, (), None, ())
    assert s.network_policy == NetworkPolicySpec(enabled=True, monitoring_namespace="monitoring", client_namespaces=())
    assert s.pool_events == PoolEventsSpec(enabled=True, port=5557, replay_port=5558, topic="", resources={
        "requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}})


@pytest.mark.parametrize("name", sorted(VALID))
def test_crd_defaults_are_the_spec_defaults(name):
    """Parsing the spec as stored (schema defaults applied by the API server) and as written agree."""
    raw = VALID[name]["spec"]
    stored = apply_defaults(openapi_schema()["properties"]["spec"], raw)
    assert stored != raw or name == "everything.yaml"  # the others leave something to a default
    assert ClusterSpec.from_dict(stored) == ClusterSpec.from_dict(raw)


def test_crd_defaults_validate_against_their_own_schema():
    """The API server refuses a CRD whose defaults do not validate; check ours the same way."""
    cr = {"apiVersion": "kvring.io/v1alpha1", "kind": "CacheCluster", "metadata": {"name": "x"},
          "spec": apply_defaults(openapi_schema()["properties"]["spec"], {"memoryPerNode": "1Gi"})}
    assert cr["spec"]["etcd"] == {"managed": {"members": 1, "storage": "1Gi", "image": "quay.io/coreos/etcd:v3.5.17"}}
    assert schema_errors(cr) == []


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_examples(name):
    cr = VALID[name]
    assert schema_errors(cr) == []
    check_name(cr["metadata"]["name"])
    assert isinstance(ClusterSpec.from_dict(cr["spec"]), ClusterSpec)


def test_everything_example_reads_every_field():
    s = ClusterSpec.from_dict(VALID["everything.yaml"]["spec"])
    defaults = ClusterSpec.from_dict({"memoryPerNode": "1Gi"})
    unchanged = [f.name for f in dataclasses.fields(ClusterSpec) if getattr(s, f.name) == getattr(defaults, f.name)]
    assert unchanged == []
    assert s.etcd == EtcdSpec(managed=True, members=3, storage="4Gi", image="quay.io/coreos/etcd:v3.5.17")
    assert s.resources == {"requests": {"cpu": "2", "ephemeral-storage": "1Gi"}, "limits": {"cpu": 4}}
    assert (s.data_port, s.admin_port, s.events_port, s.events_replay_port) == (7000, 7001, 7002, 7003)
    assert (s.policy, s.lease_ttl) == ("fifo", 15)
    assert s.disk == DiskSpec(size="500Gi", size_bytes=500 << 30, capacity=450 << 30, storage_class="local-nvme",
                              scrub_rate=32 << 20, scrub_interval_seconds=43200, eviction="fifo")
    assert s.network_policy == NetworkPolicySpec(enabled=True, monitoring_namespace="observability",
                                                 client_namespaces=("serving",))
    assert s.pool_events == PoolEventsSpec(enabled=True, port=7004, replay_port=7005, topic="kv", resources={
        "requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}})


def test_disk_capacity_defaults_to_ninety_percent_of_the_volume():
    s = ClusterSpec.from_dict(VALID["disk.yaml"]["spec"])
    assert s.disk == DiskSpec(size="200Gi", size_bytes=200 << 30, capacity=int((200 << 30) * 0.9),
                              storage_class="local-nvme")
    assert ClusterSpec.from_dict({"memoryPerNode": "1Gi"}).disk is None


def test_external_etcd_example():
    s = ClusterSpec.from_dict(VALID["external-etcd.yaml"]["spec"])
    assert not s.etcd.managed
    assert s.etcd.endpoints == ("etcd-0.etcd.infra.svc:2379", "etcd-1.etcd.infra.svc:2379",
                                "http://etcd-2.etcd.infra.svc:2379")


# What the schema says about each invalid example (a path and a fragment of its message) and
# what SpecError says: both must refuse it, each in its own words.
INVALID_EXPECTED = {
    "chunk-size-not-power-of-two.yaml": ("spec.chunkSize", "100 is not one of", "spec.chunkSize must be one of 16, 32"),
    "disk-without-size.yaml": ("spec.disk", "'size' is a required property", "spec.disk.size is required"),
    "etcd-both.yaml": ("spec.etcd", "has too many properties", "sets both endpoints and managed"),
    "etcd-endpoint-without-port.yaml": ("spec.etcd.endpoints.0", "does not match", "is not host:port"),
    "etcd-two-members.yaml": ("spec.etcd.managed.members", "2 is not one of", "members must be one of 1, 3"),
    "eviction-policy.yaml": ("spec.evictionPolicy", "'random' is not one of", "evictionPolicy must be one of lru, fifo"),
    "memory-missing.yaml": ("spec", "'memoryPerNode' is a required property", "spec.memoryPerNode is required"),
    "memory-not-a-quantity.yaml": ("spec.memoryPerNode", "does not match", "'four gigabytes' is not a byte quantity"),
    "name-too-long.yaml": ("metadata.name", "is too long", "at most 40 characters"),
    "negative-replicas.yaml": ("spec.replicas", "-1 is less than the minimum of 0", "replicas must be between 0 and 1000"),
    "port-out-of-range.yaml": ("spec.ports.data", "70000 is greater than the maximum", "ports.data must be between 1 and 65535"),
    "pull-policy.yaml": ("spec.imagePullPolicy", "'Sometimes' is not one of", "imagePullPolicy must be one of Always"),
    "replicas-not-integer.yaml": ("spec.replicas", "'three' is not of type 'integer'", "replicas must be an integer"),
    "resource-quantity.yaml": ("spec.resources.limits.cpu", "'two' does not match",
                               "spec.resources.limits.cpu 'two' is not a quantity"),
    "spread-without-key.yaml": ("spec.topologySpreadConstraints.0", "'topologyKey' is a required property",
                                "topologySpreadConstraints[0].topologyKey is required"),
    "toleration-operator.yaml": ("spec.tolerations.0.operator", "'Maybe' is not one of",
                                 "tolerations[0].operator must be one of Exists, Equal"),
    "tls-not-boolean.yaml": ("spec.tls", "'yes' is not of type 'boolean'", "spec.tls must be one of True, False"),
    "network-policy-namespace.yaml": ("spec.networkPolicy.monitoringNamespace", "does not match",
                                      "spec.networkPolicy.monitoringNamespace 'Prometheus' is not a namespace name"),
    "unknown-field.yaml": ("spec", "('replica' was unexpected)", "spec.replica is not a known field; did you mean replicas?"),
    "vnodes-zero.yaml": ("spec.virtualNodes", "0 is less than the minimum of 1", "virtualNodes must be between 1 and 65536"),
    "zero-replication.yaml": ("spec.replication", "0 is less than the minimum of 1", "replication must be between 1 and 16"),
}


def test_every_invalid_example_has_an_expectation():
    assert sorted(INVALID) == sorted(INVALID_EXPECTED)


@pytest.mark.parametrize("name", sorted(INVALID_EXPECTED))
def test_invalid_examples_are_refused_by_the_schema_and_the_operator(name):
    path, schema_says, operator_says = INVALID_EXPECTED[name]
    cr = INVALID[name]
    errors = schema_errors(cr)
    assert any(e.startswith(f"{path}: ") and schema_says in e for e in errors), errors
    with pytest.raises(SpecError) as info:
        check_name(cr["metadata"]["name"])
        ClusterSpec.from_dict(cr["spec"])
    assert operator_says in str(info.value)


REJECTED_EXPECTED = {
    "disk-capacity-above-size.yaml": "spec.disk.capacity 20Gi exceeds spec.disk.size 10Gi",
    "memory-below-minimum.yaml": "spec.memoryPerNode 16Mi is below the minimum of 64Mi; set at least 64Mi",
    "memory-in-resources.yaml": "spec.resources.limits.memory cannot be set: memory is derived from spec.memoryPerNode",
    "replication-above-replicas.yaml": "spec.replication 3 exceeds spec.replicas 2",
    "same-ports.yaml": "spec.ports.data and spec.ports.admin are both 8080; give them different ports",
}


@pytest.mark.parametrize("name", sorted(REJECTED_EXPECTED))
def test_specs_only_the_operator_can_refuse(name):
    """What the schema cannot express: valid for the API server, a SpecError for the operator."""
    assert sorted(REJECTED_BY_OPERATOR) == sorted(REJECTED_EXPECTED)
    cr = REJECTED_BY_OPERATOR[name]
    assert schema_errors(cr) == []
    with pytest.raises(SpecError, match="invalid CacheCluster spec") as info:
        ClusterSpec.from_dict(cr["spec"])
    assert REJECTED_EXPECTED[name] in str(info.value)
    assert len(info.value.problems) == 1


@pytest.mark.parametrize(("spec", "says"), [
    (None, "spec.memoryPerNode is required"),
    ([], "spec must be an object"),
    ({"memoryPerNode": 1073741824}, "1073741824 is not a byte quantity; write e.g. 4Gi"),
    ({"memoryPerNode": "1Gi", "replicas": True}, "spec.replicas must be an integer, got True"),
    ({"memoryPerNode": "1Gi", "chunkSize": 256.0}, "spec.chunkSize must be one of"),
    ({"memoryPerNode": "1Gi", "image": ""}, "spec.image must be a non-empty string"),
    ({"memoryPerNode": "1Gi", "leaseTtlSeconds": 1}, "spec.leaseTtlSeconds must be between 2 and 300"),
    ({"memoryPerNode": "1Gi", "drainTimeoutSeconds": 7200}, "spec.drainTimeoutSeconds must be between 0 and 3600"),
    ({"memoryPerNode": "1Gi", "etcd": {}}, "spec.etcd must set endpoints (an etcd you run) or managed"),
    ({"memoryPerNode": "1Gi", "etcd": {"endpoints": []}}, "spec.etcd.endpoints must be a non-empty list"),
    ({"memoryPerNode": "1Gi", "etcd": {"managed": {"storage": "big"}}}, "spec.etcd.managed.storage: 'big' is not"),
    ({"memoryPerNode": "1Gi", "etcd": {"managed": {"size": 3}}}, "spec.etcd.managed.size is not a known field"),
    ({"memoryPerNode": "1Gi", "nodeSelector": {"disk": 1}}, "spec.nodeSelector must map label names to string"),
    ({"memoryPerNode": "1Gi", "tolerations": "all"}, "spec.tolerations must be a list of objects"),
    ({"memoryPerNode": "1Gi", "affinity": []}, "spec.affinity must be an object"),
    ({"memoryPerNode": "1Gi", "resources": {"cpu": 1}}, "spec.resources.cpu is not a known field; known: requests, limits"),
    ({"memoryPerNode": "1Gi", "ports": 5555}, "spec.ports must be an object"),
    ({"memoryPerNode": "1Gi", "disk": "100Gi"}, "spec.disk must be an object such as {size: 100Gi}"),
    ({"memoryPerNode": "1Gi", "disk": {"size": "100Mi"}}, "spec.disk.size 100Mi is below the minimum of 1Gi"),
    ({"memoryPerNode": "1Gi", "disk": {"size": "1Gi", "storage": "x"}}, "spec.disk.storage is not a known field"),
    ({"memoryPerNode": "1Gi", "disk": {"size": "10Gi", "capacity": "lots"}}, "spec.disk.capacity: 'lots' is not"),
    ({"memoryPerNode": "1Gi", "disk": {"size": "10Gi", "scrubRate": "fast"}},
     "spec.disk.scrubRate: 'fast' is not a byte quantity"),
    ({"memoryPerNode": "1Gi", "disk": {"size": "10Gi", "scrubIntervalSeconds": 0}},
     "spec.disk.scrubIntervalSeconds must be between 1 and 2147483647, got 0"),
    ({"memoryPerNode": "1Gi", "disk": {"size": "10Gi", "eviction": "lru"}},
     "spec.disk.eviction must be one of second-chance, fifo; got 'lru'"),
])
def test_bad_specs_say_what_to_set(spec, says):
    with pytest.raises(SpecError) as info:
        ClusterSpec.from_dict(spec)
    assert says in str(info.value)


@pytest.mark.parametrize(("events", "says", "schema_refuses"), [
    ("on", "spec.poolEvents must be an object such as {enabled: false}, got 'on'", True),
    ({"enabled": "yes"}, "spec.poolEvents.enabled must be one of True, False; got 'yes'", True),
    ({"enable": False}, "spec.poolEvents.enable is not a known field; did you mean enabled?", True),
    ({"port": 0}, "spec.poolEvents.port must be between 1 and 65535, got 0", True),
    ({"replayPort": "5558"}, "spec.poolEvents.replayPort must be an integer, got '5558'", True),
    ({"port": 6000, "replayPort": 6000},
     "spec.poolEvents.port and spec.poolEvents.replayPort are both 6000; give them different ports", False),
    ({"replayPort": 5557}, "spec.poolEvents.port and spec.poolEvents.replayPort are both 5557", False),
    ({"topic": 7}, "spec.poolEvents.topic must be a string", True),
    ({"resources": {"limits": {"memory": "lots"}}}, "spec.poolEvents.resources.limits.memory 'lots' is not a quantity",
     True),
    ({"resources": {"memory": "1Gi"}}, "spec.poolEvents.resources.memory is not a known field", True),
    ({"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "512Mi"}}},
     ("spec.poolEvents.resources.requests.memory 1Gi exceeds spec.poolEvents.resources.limits.memory 512Mi; lower "
      "the request or raise the limit"), False),
])
def test_bad_pool_events_settings_say_what_to_set(events, says, schema_refuses):
    """One line each, saying what to set; the schema refuses what it can express, the operator the rest."""
    with pytest.raises(SpecError) as info:
        ClusterSpec.from_dict({"memoryPerNode": "1Gi", "poolEvents": events})
    assert says in str(info.value)
    assert len(info.value.problems) == 1 and "\n" not in info.value.problems[0]
    cr = {"apiVersion": "kvring.io/v1alpha1", "kind": "CacheCluster", "metadata": {"name": "kv"},
          "spec": {"memoryPerNode": "1Gi", "poolEvents": events}}
    assert bool(schema_errors(cr)) == schema_refuses, schema_errors(cr)


def test_pool_events_resources_are_taken_as_given_and_memory_may_be_set():
    s = ClusterSpec.from_dict({"memoryPerNode": "1Gi", "poolEvents": {"resources": {"limits": {"memory": "2Gi"}}}})
    assert s.pool_events.resources == {"limits": {"memory": "2Gi"}}  # not merged with the defaults
    assert ClusterSpec.from_dict({"memoryPerNode": "1Gi", "poolEvents": {"enabled": False}}).pool_events.enabled is False
    # The nodes' cpu request may not exceed its limit either (the API server would refuse the pods).
    with pytest.raises(SpecError, match="spec.resources.requests.cpu 2 exceeds spec.resources.limits.cpu 1500m"):
        ClusterSpec.from_dict({"memoryPerNode": "1Gi", "resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}})


def test_every_problem_is_listed_at_once():
    with pytest.raises(SpecError) as info:
        ClusterSpec.from_dict({"memoryPerNode": "1Mi", "replicas": -2, "chunkSize": 3, "evictionPolicy": "x"})
    assert len(info.value.problems) == 4
    assert str(info.value).count("\n  - ") == 4


def test_replication_may_exceed_replicas_when_scaled_to_zero():
    assert ClusterSpec.from_dict({"memoryPerNode": "1Gi", "replicas": 0, "replication": 2}).replicas == 0


def test_spec_is_frozen():
    s = ClusterSpec.from_dict({"memoryPerNode": "1Gi"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.replicas = 5  # type: ignore[misc]


@pytest.mark.parametrize(("text", "value"), [
    ("4Gi", 4 << 30), ("512Mi", 512 << 20), ("1.5Gi", 3 << 29), ("64Ki", 65536), ("1000", 1000),
    ("2G", 2 * 10**9), ("3k", 3000), ("1Ti", 1 << 40),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "4GB", "4gi", "-1Gi", "100m", "1e9", "Gi", 4096])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match="is not a byte quantity"):
        parse_bytes(text)


@pytest.mark.parametrize("name", ["kv", "kv-cache", "a" * 40, "a1"])
def test_good_names(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "KV", "1kv", "kv-", "kv_cache", "a" * 41, None])
def test_bad_names(name):
    with pytest.raises(SpecError, match="must be a DNS label of at most 40 characters"):
        check_name(name)
