"""What every process of a cluster must agree on, and how vLLM is pointed at a cluster.

``Contract``: the hashing and placement settings that make two processes compute the same keys
and the same owners.  The first process of a cluster records it in etcd; every later one
compares its own (``ContractMismatch`` names the difference).

``transfer_config``: the ``--kv-transfer-config`` object that makes a vLLM engine use kvring's
connector on a cluster -- built here only, for ``kvring up``, the operator's ConfigMap and
status, and the engines the demo and benchmarks run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from .hashing import DEFAULT_CHUNK_SIZE, FORMAT_VERSION, HASH_ALGORITHM
from .ring import DEFAULT_VNODES

CONNECTOR_CLASS = "KVRingConnector"
CONNECTOR_MODULE = "kvring.connector"


@dataclass(frozen=True)
class Contract:
    """What every process of a cluster must agree on to compute the same keys and owners."""

    hash_algorithm: str = HASH_ALGORITHM
    chunk_size: int = DEFAULT_CHUNK_SIZE
    format_version: int = FORMAT_VERSION
    vnodes: int = DEFAULT_VNODES
    replication: int = 1

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Contract:
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def differences(self, recorded: Contract) -> list[str]:
        return [
            f"{f.name}: this process has {getattr(self, f.name)!r}, the cluster has {getattr(recorded, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(recorded, f.name)
        ]


def transfer_config(etcd: str, cluster: str, **extra: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object that points vLLM at a cluster.

    ``kv_load_failure_policy: recompute``: a chunk that cannot be loaded is recomputed, never a
    failed request.  ``extra`` adds connector settings (``load_mode``, ``chunk_size``, ...).
    """
    return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"etcd": etcd, "cluster": cluster, **extra}}


def transfer_config_json(etcd: str, cluster: str, **extra: Any) -> str:
    """``transfer_config`` as the one-line JSON ``vllm serve --kv-transfer-config`` takes."""
    return json.dumps(transfer_config(etcd, cluster, **extra), separators=(",", ":"))
