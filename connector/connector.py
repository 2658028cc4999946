"""``KVRingConnector``: vLLM's ``KVConnectorBase_V1``, dispatching by role.

Use it with::

    --kv-transfer-config '{"kv_connector": "KVRingConnector",
                           "kv_connector_module_path": "kvring.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"etcd": "127.0.0.1:2379"}}'
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvring.cachenode import ClusterClient, ContractMismatch
from kvring.cachenode.hashing import FORMAT_VERSION, HASH_ALGORITHM

from .config import ConnectorConfig
from .keys import KVLayout
from .metadata import KVRingMetadata
from .scheduler import SchedulerSide
from .worker import WorkerSide

logger = logging.getLogger(__name__)


def layout_from_vllm(vllm_config, chunk_size: int, tp_rank: int = 0) -> KVLayout:
    """The KV-compatibility namespace of this vLLM instance."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    hf = getattr(model, "hf_config", None)
    fingerprint = hashlib.blake2b((hf.to_json_string() if hf is not None else model.model).encode(),
                                  digest_size=16).hexdigest()
    kv_dtype = vllm_config.cache_config.cache_dtype
    if kv_dtype == "auto":
        kv_dtype = str(model.dtype).removeprefix("torch.")
    return KVLayout(
        model=str(model.model), config_fingerprint=fingerprint, kv_dtype=str(kv_dtype),
        num_layers=model.get_num_layers(parallel), num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(), block_layout="BHNC", chunk_size=chunk_size,
        tp_size=parallel.tensor_parallel_size, tp_rank=tp_rank)


def connect(config: ConnectorConfig) -> ClusterClient:
    """A cluster client whose hashing contract matches ours, or ``ContractMismatch``."""
    client = ClusterClient(config.etcd, cluster=config.cluster, timeout=config.timeout)
    c = client.contract
    diff = []
    if c.hash_algorithm != HASH_ALGORITHM:
        diff.append(f"hash_algorithm: this connector has {HASH_ALGORITHM!r}, the cluster has {c.hash_algorithm!r}")
    if c.format_version != FORMAT_VERSION:
        diff.append(f"format_version: this connector has {FORMAT_VERSION}, the cluster has {c.format_version}")
    if config.chunk_size is not None and config.chunk_size != c.chunk_size:
        diff.append(f"chunk_size: this connector has {config.chunk_size}, the cluster has {c.chunk_size}")
    if diff:
        client.close()
        raise ContractMismatch(f"KVRingConnector's contract differs from cluster {config.cluster!r}: "
                               + "; ".join(diff))
    return client


def _recompute_on_load_failure(kv_transfer_config) -> None:
    """A cache that cannot deliver a chunk is a miss: its blocks are recomputed, the request goes on.

    vLLM's default ``kv_load_failure_policy`` is ``"fail"`` (the request ends with an error when
    a connector reports blocks it could not load). For a cache that is never right, so the
    connector sets ``"recompute"`` (the scheduler reads it after creating its connector);
    ``kvring up`` and the CacheCluster status print it in the flag as well.
    """
    if getattr(kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
        logger.info("KVRingConnector: kv_load_failure_policy %r -> 'recompute' (a failed load is a cache "
                    "miss: vLLM recomputes those blocks instead of failing the request)",
                    kv_transfer_config.kv_load_failure_policy)
        kv_transfer_config.kv_load_failure_policy = "recompute"


class KVRingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_sources(self._kv_transfer_config.kv_connector_extra_config)
        _recompute_on_load_failure(self._kv_transfer_config)
        self.client = connect(self.config)
        chunk = self.client.contract.chunk_size
        block_size = vllm_config.cache_config.block_size
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.config, layout_from_vllm(vllm_config, chunk), self.client, block_size)
            self._worker = None
        else:
            self._scheduler = None
            self._worker = WorkerSide(self.config, self.client, chunk, block_size)
        logger.info("KVRingConnector (%s) on cluster %r, chunk %d tokens, %s loads", role.name, self.config.cluster,
                    chunk, self.config.load_mode)

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        try:
            self._worker.start_load_kv(meta)
        except Exception:
            logger.exception("kvring start_load_kv failed; this step's loads will be recomputed")
            self._worker.fail_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        try:
            self._worker.save_kv_layer(self._get_connector_metadata(), layer_name, kv_layer)
        except Exception:
            logger.exception("kvring save_kv_layer failed; this step's chunks are not saved")

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        self.client.close()

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVRingMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.request_finished(request)
        return False, None
