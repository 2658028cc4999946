"""``KVRingConnector``: vLLM's ``KVConnectorBase_V1``, dispatching by role.

Use it with::

    --kv-transfer-config '{"kv_connector": "KVRingConnector",
                           "kv_connector_module_path": "kvring.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"etcd": "127.0.0.1:2379"}}'
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                               KVConnectorTransferResults, SupportsHMA)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .attach import connect
from .config import ConnectorConfig
from .instance import (KVGroups, check_chunk_blocks, check_kv_groups, check_parallel, check_state, chunk_parts,
                       layout_from_vllm, rank_shard, state_block_size_advice, worker_load_bytes)
from .metadata import KVRingMetadata
from .scheduler import SchedulerSide
from .stats import KVRingPromMetrics, KVRingStats
from .worker import WorkerSide

logger = logging.getLogger(__name__)


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


class KVRingConnector(KVConnectorBase_V1, SupportsHMA):
    # Hits are fetched over the network from the cluster's nodes (other machines' memory).
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_sources(self._kv_transfer_config.kv_connector_extra_config)
        if kv_cache_config is not None:
            check_kv_groups(kv_cache_config)
        check_parallel(vllm_config)
        groups = KVGroups.of(kv_cache_config, vllm_config.model_config.get_total_num_hidden_layers())
        check_state(vllm_config, groups)
        if groups.several and self.config.load_mode != "async":
            # vLLM takes failed loads of several KV-cache groups only as failed requests of async
            # loads (block ids are per group): loads run between steps.
            logger.info("KVRingConnector: several KV-cache groups: async loads (load_mode %r -> 'async')",
                        self.config.load_mode)
            self.config = dataclasses.replace(self.config, load_mode="async")
        _recompute_on_load_failure(self._kv_transfer_config)
        self.client, chunk = connect(self.config)
        block_size = vllm_config.cache_config.block_size
        check_chunk_blocks(chunk, block_size)
        if role == KVConnectorRole.SCHEDULER and (advice := state_block_size_advice(vllm_config, groups)):
            logger.warning("%s", advice)
        layout = layout_from_vllm(vllm_config, chunk, weights_version=self.config.weights_version, groups=groups)
        parts = chunk_parts(vllm_config, layout, groups)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.config, layout, self.client, block_size,
                                            worker_load_bytes(vllm_config, layout, groups), parts,
                                            state_group=groups.state.group if groups.state else None)
            self._worker = None
        else:
            self._scheduler = None
            self._worker = WorkerSide(self.config, self.client, chunk, block_size, rank_shard(vllm_config), groups,
                                      anchor=parts.anchor)
            self.client.reserve_buffers(self.config.receive_buffer_mb << 20)
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
        self._worker.wait_for_save(self._get_connector_metadata() if self.has_connector_metadata() else None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        idle = self.has_connector_metadata() and self._get_connector_metadata().idle
        _, loaded = self._worker.get_finished(finished_req_ids, idle=idle)
        # With several KV-cache groups a failed load fails its request (recomputed whole).
        return KVConnectorTransferResults(finished_recving=set(loaded or ()), failed_recving=self._worker.failed_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # ---- both sides: vLLM's metrics ---------------------------------------------------------

    def get_kv_connector_stats(self) -> KVRingStats | None:
        side = self._scheduler if self._scheduler is not None else self._worker
        return side.counters.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVRingStats:
        return KVRingStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVRingPromMetrics:
        return KVRingPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load / save_kv_layer run between layers: they cannot be captured in a
        # whole-model CUDA graph.  Bulk and async loads happen outside the forward, but saves
        # are layerwise in every mode.
        return True

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        self.client.close()

    # ---- scheduler side -------------------------------------------------------------------

    def on_new_request(self, request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVRingMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        # Saves copy blocks out during the forward, so nothing holds them once the request ends.
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def reset_cache(self) -> bool | None:
        if self._scheduler is None:
            return None
        return self._scheduler.reset_cache()
