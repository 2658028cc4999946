"""The CacheCluster CRD's CEL rules, evaluated as the API server would (``crd_schema.rule_failures``:
cel-rust, no API server here): what may change on an existing cluster and what may not."""

from __future__ import annotations

import copy
import re

import pytest
from crd_schema import openapi_schema, rule_failures, validation_rules

DISK = {"size": "200Gi", "storageClassName": "local-nvme", "capacity": "150Gi", "scrubRate": "16Mi",
        "scrubIntervalSeconds": 86400}


def _cr(disk: dict | None = DISK) -> dict:
    spec = {"memoryPerNode": "4Gi", "replicas": 3, **({"disk": copy.deepcopy(disk)} if disk is not None else {})}
    return {"apiVersion": "kvring.io/v1alpha1", "kind": "CacheCluster", "metadata": {"name": "kv"}, "spec": spec}


def _with(**fields) -> dict:
    disk = {k: v for k, v in {**DISK, **fields}.items() if v is not None}
    return _cr(disk)


@pytest.mark.parametrize("new", [
    _cr(),  # unchanged
    _with(capacity="100Gi"), _with(capacity=None),  # the node's budget: a flag, rolled
    _with(scrubRate="0"), _with(scrubRate=None), _with(scrubIntervalSeconds=3600), _with(scrubIntervalSeconds=None),
    _with(eviction="fifo"),
], ids=["unchanged", "capacity", "capacity-unset", "scrub-off", "scrub-rate-unset", "scrub-interval",
        "scrub-interval-unset", "eviction"])
def test_a_disk_clusters_node_settings_may_change(new):
    assert rule_failures(new, old=_cr()) == []


@pytest.mark.parametrize("old,new", [
    (_cr(), _with(size="300Gi")),  # a claim template's size
    (_cr(), _with(size="204800Mi")),  # the same bytes spelled otherwise: refused too (strings compared)
    (_cr(), _with(storageClassName="other")),
    (_cr(), _with(storageClassName=None)),
    (_with(storageClassName=None), _cr()),
    (_cr(None), _cr()),  # a disk added
    (_cr(), _cr(None)),  # a disk removed
], ids=["size", "size-respelled", "class", "class-unset", "class-set", "disk-added", "disk-removed"])
def test_what_the_statefulsets_claim_template_holds_may_not_change(old, new):
    (message,) = rule_failures(new, old=old)
    assert message.startswith("spec.disk cannot be added or removed, nor its size or storageClassName changed")


def test_transition_rules_do_not_run_on_a_create():
    assert rule_failures(_cr()) == [] and rule_failures(_cr(None)) == []


def test_every_field_a_rule_names_is_in_the_schema():
    """The API server refuses a CRD whose rule names a field its schema lacks; cel-rust, given
    plain dicts, would not notice."""
    schema = openapi_schema()
    rules = validation_rules(schema)
    assert rules, "the CRD has CEL rules"
    for path, rule in rules:
        node = schema
        for name in path:
            node = node["properties"][name]
        for chain in re.findall(r"\b(?:self|oldSelf)((?:\.\w+)+)", rule["rule"]):
            sub = node
            for name in chain.strip(".").split("."):
                assert name in sub.get("properties", {}), f"{'.'.join(path)}: the rule names {chain}, not in the schema"
                sub = sub["properties"][name]
