"""What a CacheCluster publishes: the connector settings for vLLM and the node contract.

Both go into the cluster's ConfigMap (``<name>-config``), which a vLLM Deployment can read as an
environment variable, and the connector settings also into ``status.connector``.  The hash of the
ConfigMap's data is stamped on the node pods, so a changed contract rolls them and the operator
can tell which pods run with an old one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvring.common.contract import transfer_config

from .naming import TLS_MOUNT, cluster_key, etcd_endpoints, node_token_secret
from .spec import ClusterSpec

CONFIG_HASH_ANNOTATION = "kvring.io/config-hash"
TRANSFER_CONFIG_KEY = "kv-transfer-config"
# Names the Secret holding this cluster's admin API token; the nodes do not use it, so changing
# it does not roll them (it is left out of the config hash).
ADMIN_SECRET_KEY = "admin-token-secret"
# Names the Secret holding the cluster's node token (always <name>-node-token), for an admin API
# deployment to read.  Left out of the config hash too: the nodes take the token from that Secret
# through their environment at start, and the pod template names the Secret already.
NODE_TOKEN_SECRET_KEY = "node-token-secret"
# Where a pod of this cluster's clients finds the mounted <name>-tls Secret ("" with tls off): the
# admin API's --tls-dir, with which it asks the nodes' admin ports over TLS.  Not hashed: the
# connector settings, which are, change with spec.tls already.
TLS_DIR_KEY = "tls-dir"
NOT_HASHED = frozenset({ADMIN_SECRET_KEY, NODE_TOKEN_SECRET_KEY, TLS_DIR_KEY})


def connector_config(name: str, namespace: str, spec: ClusterSpec) -> dict[str, Any]:
    """The exact ``--kv-transfer-config`` object a vLLM deployment needs to use this cluster."""
    tls = {"tls_dir": TLS_MOUNT} if spec.tls else {}  # where the chart's vLLM pods mount <name>-tls
    return transfer_config(",".join(etcd_endpoints(name, namespace, spec)), cluster_key(name, namespace),
                           chunk_size=spec.chunk_size, **tls)


def connector_json(name: str, namespace: str, spec: ClusterSpec) -> str:
    """``connector_config`` as the one-line JSON vLLM takes (``status.connector``)."""
    return json.dumps(connector_config(name, namespace, spec), separators=(",", ":"))


def config_data(name: str, namespace: str, spec: ClusterSpec) -> dict[str, str]:
    """The ConfigMap's data: connector settings, etcd, cluster name, hashing contract, the
    Secrets with the admin API token and the node token, and where the credentials are mounted
    (for an admin API deployment of this cluster to read)."""
    contract = {"chunk_size": spec.chunk_size, "vnodes": spec.vnodes, "replication": spec.replication}
    data = {
        TRANSFER_CONFIG_KEY: connector_json(name, namespace, spec),
        "etcd": ",".join(etcd_endpoints(name, namespace, spec)),
        "cluster": cluster_key(name, namespace),
        "contract.json": json.dumps(contract, sort_keys=True),
        NODE_TOKEN_SECRET_KEY: node_token_secret(name),
        TLS_DIR_KEY: TLS_MOUNT if spec.tls else "",
    }
    if spec.auth_secret:
        data[ADMIN_SECRET_KEY] = spec.auth_secret
    return data


def config_hash(data: dict[str, str]) -> str:
    """A short, stable digest of the ConfigMap data the nodes run with."""
    node_facing = {k: v for k, v in data.items() if k not in NOT_HASHED}
    return hashlib.sha256(json.dumps(node_facing, sort_keys=True).encode()).hexdigest()[:16]
