"""kvring inside vLLM's metrics: the connector's counters, its periodic log line and ``/metrics``.

Both connector roles count into a ``Counters`` (thread-safe: the worker's load and save threads
count too).  vLLM collects each role's counts once per step (``get_kv_connector_stats``), sums
them across workers and steps (``KVRingStats.aggregate``), logs them every logging interval
(``KVRingStats.reduce``: "KV Transfer metrics: ...") and adds them to its Prometheus counters
(``KVRingPromMetrics.observe``), all named ``vllm:kvring_<counter>_total``, with vLLM's engine
labels, and failed blocks by ``reason``.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# name -> help text; every counter is exported as vllm:kvring_<name>_total.
COUNTERS: dict[str, str] = {
    "lookups": "Prefix lookups sent to the kvring cluster",
    "lookups_past_deadline": "Lookups not answered within lookup_deadline_ms (their requests recompute)",
    "lookup_errors": "Lookups that failed (no node, network error); their requests recompute",
    "queried_tokens": "Prompt tokens looked up in the kvring cluster",
    "hit_tokens": "Prompt tokens the kvring cluster held and vLLM was told to load",
    "loads_refused": "Loads not started because recomputing was predicted to be faster",
    "loads": "Loads from the kvring cluster (one per request, or per step in layerwise and bulk modes)",
    "loaded_bytes": "Bytes of KV loaded into vLLM's cache",
    "load_seconds": "Seconds spent loading (fetch, verify, copy into the paged cache)",
    "loads_abandoned": "Asynchronous loads abandoned past their deadline (their blocks recompute)",
    "saved_parts": "Chunk parts saved to the kvring cluster (one per KV head and pipeline stage a worker stores)",
    "saved_bytes": "Bytes of KV saved to the kvring cluster",
    "save_seconds": "Seconds spent saving (copy out, send, until every replica answered)",
    "failed_saves": "Chunk parts whose save failed (dropped; a later request recomputes their chunks)",
    "scheduler_hook_seconds": "Seconds the connector's hooks held vLLM's scheduler loop",
}
FAILED_BLOCKS = "failed_blocks"  # {reason: count}: blocks vLLM recomputes because a load failed
FAILURE_REASONS = ("missing", "unusable", "abandoned", "error")


class Counters:
    """What one connector role counted since vLLM last collected it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = _empty()

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                self._data[name] += value

    def failed(self, reason: str, blocks: int) -> None:
        if blocks:
            with self._lock:
                self._data[FAILED_BLOCKS][reason] = self._data[FAILED_BLOCKS].get(reason, 0) + blocks

    def take(self) -> KVRingStats | None:
        """The counts since the last call (``None`` when nothing happened), and start over."""
        with self._lock:
            data, self._data = self._data, _empty()
        stats = KVRingStats(data=data)
        return None if stats.is_empty() else stats


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
    data[FAILED_BLOCKS] = {}
    return data


class KVRingStats(KVConnectorStats):
    """Counters summed over workers and steps; ``data`` is plain (it crosses processes)."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)
        self.data.setdefault(FAILED_BLOCKS, {})

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVRingStats:
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        for reason, n in other.data.get(FAILED_BLOCKS, {}).items():
            self.data[FAILED_BLOCKS][reason] = self.data[FAILED_BLOCKS].get(reason, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            "kvring_lookups": d["lookups"],
            "kvring_hit_rate": round(d["hit_tokens"] / d["queried_tokens"], 4) if d["queried_tokens"] else 0.0,
            "kvring_hit_tokens": d["hit_tokens"], "kvring_queried_tokens": d["queried_tokens"],
            "kvring_lookups_past_deadline": d["lookups_past_deadline"],
            "kvring_loaded_MiB": round(d["loaded_bytes"] / 2**20, 2),
            "kvring_load_GBps": round(d["loaded_bytes"] / d["load_seconds"] / 1e9, 3) if d["load_seconds"] else 0.0,
            "kvring_saved_MiB": round(d["saved_bytes"] / 2**20, 2),
            "kvring_failed_blocks": sum(d[FAILED_BLOCKS].values()),
            "kvring_loads_refused": d["loads_refused"], "kvring_loads_abandoned": d["loads_abandoned"],
        }
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTERS) and not any(self.data[FAILED_BLOCKS].values())


class KVRingPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvring_*_total`` counters in vLLM's ``/metrics``, one series per engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[int, str], Any] = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(name=f"vllm:kvring_{name}", documentation=doc, labelnames=labelnames)
            for engine, values in per_engine_labelvalues.items():
                self._counters[engine, name] = metric.labels(*values)
        failed = self._counter_cls(name=f"vllm:kvring_{FAILED_BLOCKS}",
                                   documentation="KV blocks vLLM recomputes because kvring could not load them",
                                   labelnames=[*labelnames, "reason"])
        self._failed = {(engine, reason): failed.labels(*values, reason)
                        for engine, values in per_engine_labelvalues.items() for reason in FAILURE_REASONS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in COUNTERS:
            value = transfer_stats_data.get(name, 0)
            if value:
                self._counters[engine_idx, name].inc(value)
        for reason, n in transfer_stats_data.get(FAILED_BLOCKS, {}).items():
            counter = self._failed.get((engine_idx, reason))
            if counter is not None and n:
                counter.inc(n)
