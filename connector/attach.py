"""Reaching the cluster from inside vLLM, without making vLLM wait on it.

A cache that is down must not take serving down with it.  A vLLM instance may start before its
cluster (one ``helm install`` of both), or while etcd is being restarted; a connector that
failed then would keep vLLM from serving at all.  So ``connect`` gives the cluster
``attach_wait_ms`` (10 s) to answer, and past that vLLM starts without it: the cluster client goes on
trying in the background (``ClusterClient(wait=False)``), every lookup is a miss and every save
is dropped (vLLM recomputes, as it would without kvring) until it reaches the cluster, and from
then on the instance loads and saves as usual.

The connector's keys depend on the chunk size, which is the cluster's (its contract), and it
must be known when vLLM starts.  ``ChunkSize`` settles it once: the cluster's when its contract
was read in time, else the ``chunk_size`` setting or the contract's default (logged).  A cluster
reached later whose chunk size differs, or whose hash algorithm or format version is not this
connector's, is a conflict: every read stays a miss and every write is dropped, with an error
naming the difference.  The same mismatch found at start is refused there, as a setting to fix.
"""

from __future__ import annotations

import logging
import threading

from kvring.cachenode.client import ClusterClient
from kvring.common.contract import Contract
from kvring.common.errors import ContractMismatch
from kvring.common.hashing import FORMAT_VERSION, HASH_ALGORITHM
from kvring.common.tls import ClusterCredentials

from .config import ConnectorConfig

logger = logging.getLogger(__name__)


class ChunkSize:
    """The chunk size this connector's keys use (see the module docstring), and the check of a
    cluster's contract against it (``ClusterClient``'s ``require``)."""

    def __init__(self, configured: int | None) -> None:
        self.value = configured
        self._lock = threading.Lock()  # the settling (vLLM's thread) against the check (the client's)

    def unsuitable(self, contract: Contract) -> list[str]:
        """What in ``contract`` this connector cannot work with."""
        diff = []
        if contract.hash_algorithm != HASH_ALGORITHM:
            diff.append(f"hash_algorithm: this connector has {HASH_ALGORITHM!r}, the cluster has "
                        f"{contract.hash_algorithm!r}")
        if contract.format_version != FORMAT_VERSION:
            diff.append(f"format_version: this connector has {FORMAT_VERSION}, the cluster has "
                        f"{contract.format_version}")
        with self._lock:
            if self.value is not None and self.value != contract.chunk_size:
                diff.append(f"chunk_size: this connector has {self.value}, the cluster has {contract.chunk_size}")
        return diff

    def settle(self, client: ClusterClient) -> int:
        """The chunk size, fixed from now on: the cluster's if its contract has been read."""
        with self._lock:
            if self.value is None:
                contract = client.contract
                self.value = contract.chunk_size if contract is not None else Contract().chunk_size
            return self.value


def connect(config: ConnectorConfig) -> tuple[ClusterClient, int]:
    """A cluster client and the chunk size to key by.  Raises ``ContractMismatch`` for a cluster
    reached within ``attach_wait_ms`` whose contract this connector cannot work with; a cluster
    not reached by then is reached in the background (the module docstring)."""
    wait = config.attach_wait_ms / 1000
    tls = ClusterCredentials.at(config.tls_dir) if config.tls_dir else None
    chunk = ChunkSize(config.chunk_size)
    client = ClusterClient(config.etcd, cluster=config.cluster, timeout=config.timeout, tls=tls, wait=False,
                           require=chunk.unsuitable)
    if client.membership.attached.wait(wait) and client.membership.conflict:
        client.close()
        raise ContractMismatch(f"KVRingConnector's contract differs from cluster {config.cluster!r}: "
                               f"{client.membership.conflict}")
    chunk_size = chunk.settle(client)
    if not client.attached:
        logger.warning("KVRingConnector: cluster %r at etcd %s not reached within %.0fs: vLLM serves without it "
                       "(every request recomputes) until it is, keying by chunk_size %d%s", config.cluster,
                       config.etcd, wait, chunk_size,
                       "" if config.chunk_size is not None else " (the default: set chunk_size to the cluster's)")
    return client, chunk_size
