"""kvring inside vLLM's metrics: the connector's counters, its periodic log line and ``/metrics``.

Both connector roles count into a ``Counters`` (thread-safe: the worker's load and save threads
count too).  vLLM collects each role's counts once per step (``get_kv_connector_stats``), sums
them across workers and steps (``KVRingStats.aggregate``), logs them every logging interval
(``KVRingStats.reduce``: "KV Transfer metrics: ...") and adds them to its Prometheus counters
(``KVRingPromMetrics.observe``), all named ``vllm:kvring_<counter>_total``, with vLLM's engine
labels; failed blocks and refused loads also by ``reason``.

The worker's counts also carry its loads' ``transfers`` (one per node a load read from: bytes,
seconds, whether the node failed; ``kvring.cachenode.client.meter``), which the scheduler side's
admission learns from (``admission.py``); they are not metrics.
"""

from __future__ import annotations

import threading
from typing import Any

from kvring.cachenode.client import Transfer

from .admission import Refusal
from .vllm_types import KVConnectorPromMetrics, KVConnectorStats

# name -> help text; every counter is exported as vllm:kvring_<name>_total.
COUNTERS: dict[str, str] = {
    "lookups": "Prefix lookups sent to the kvring cluster",
    "lookups_past_deadline": "Lookups not answered within lookup_deadline_ms (their requests recompute)",
    "lookup_errors": "Lookups that failed (no node, network error); their requests recompute",
    "queried_tokens": "Prompt tokens looked up in the kvring cluster",
    "hit_tokens": "Prompt tokens the kvring cluster held and vLLM was told to load",
    "loads_admitted": "Loads admission let start (probes included)",
    "load_probes": "Loads admission would have refused but let start, to measure the cluster again",
    "loads": "Loads from the kvring cluster (one per request, or per step in layerwise and bulk modes)",
    "loaded_bytes": "Bytes of KV loaded into vLLM's cache",
    "landed_bytes": "Bytes of KV loaded by receiving them straight into vLLM's cache, not copied there from a "
                    "buffer (part of loaded_bytes)",
    "load_seconds": "Seconds spent loading (fetch, verify, copy into the paged cache)",
    "prefill_seconds_avoided": "Seconds the prompt tokens vLLM was told to load would have taken to compute, at "
                               "this instance's measured prefill speed (none counted until it has measured one)",
    "loads_abandoned": "Loads abandoned past their deadline (their blocks recompute)",
    "saved_parts": "Chunk parts saved to the kvring cluster (one per KV head and pipeline stage a worker stores)",
    "saved_bytes": "Bytes of KV saved to the kvring cluster",
    "save_seconds": "Seconds spent saving (copy out, send, until every replica answered)",
    "failed_saves": "Chunk parts whose save failed (dropped; a later request recomputes their chunks)",
    "node_failures": "Requests a cache node did not answer (timed out, unreachable; a load abandoned while it "
                     "still owed bytes): admission refuses loads from it until one succeeds again",
    "broken_chunks": "Chunks a lookup found with their anchor (the part that names their blocks to the pool's KV "
                     "events) but without another part a load needs",
    "broken_chunks_withdrawn": "Of those, chunks whose missing part no owner held withdraw_broken_after_ms later: "
                               "their anchor was deleted, so the pool's KV events stop crediting them",
    "broken_chunks_skipped": "Chunks found broken and not checked: too many already waited (they stay credited)",
    "scheduler_hook_seconds": "Seconds the connector's hooks held vLLM's scheduler loop",
}
# name -> (help text, its reasons): {reason: count}, exported with a ``reason`` label.
BY_REASON: dict[str, tuple[str, tuple[str, ...]]] = {
    "failed_blocks": ("KV blocks vLLM recomputes because kvring could not load them",
                      ("missing", "unusable", "abandoned", "error")),
    "loads_refused": ("Loads admission refused (their tokens recompute): predicted slower than recomputing, "
                      "or needing a cache node whose last transfer failed", tuple(Refusal)),
}
TRANSFERS = "transfers"
MAX_TRANSFERS = 1024  # a collection keeps the newest this many (admission needs only recent ones)


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
        self.by_reason("failed_blocks", reason, blocks)

    def by_reason(self, name: str, reason: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._data[name][reason] = self._data[name].get(reason, 0) + n

    def transfers(self, transfers: list[Transfer]) -> None:
        """What each node's share of a load cost (for admission), and its failures (a counter)."""
        if transfers:
            with self._lock:
                _keep_newest(self._data[TRANSFERS], [list(_astuple(t)) for t in transfers])
                self._data["node_failures"] += sum(not t.ok for t in transfers)

    def take(self) -> KVRingStats | None:
        """The counts since the last call (``None`` when nothing happened), and start over."""
        with self._lock:
            data, self._data = self._data, _empty()
        stats = KVRingStats(data=data)
        return None if stats.is_empty() else stats


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
    for name in BY_REASON:
        data[name] = {}
    data[TRANSFERS] = []
    return data


def _astuple(t: Transfer) -> tuple:
    return (t.node_id, t.nbytes, t.seconds, t.first_reply_s, t.hits, t.ok)


def transfers_of(data: dict[str, Any]) -> list[Transfer]:
    """The transfers in a collection's ``data`` (as ``Counters.transfers`` stored them)."""
    return [Transfer(*row) for row in data.get(TRANSFERS, ())]


def _keep_newest(rows: list, new: list) -> None:
    rows.extend(new)
    del rows[:-MAX_TRANSFERS]


class KVRingStats(KVConnectorStats):
    """Counters summed over workers and steps; ``data`` is plain (it crosses processes)."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)
        for name in BY_REASON:
            self.data.setdefault(name, {})
        self.data.setdefault(TRANSFERS, [])

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVRingStats:
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        for name in BY_REASON:
            mine = self.data[name]
            for reason, n in other.data.get(name, {}).items():
                mine[reason] = mine.get(reason, 0) + n
        _keep_newest(self.data[TRANSFERS], list(other.data.get(TRANSFERS, ())))
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
            "kvring_failed_blocks": sum(d["failed_blocks"].values()),
            "kvring_loads_admitted": d["loads_admitted"], "kvring_load_probes": d["load_probes"],
            "kvring_loads_abandoned": d["loads_abandoned"], "kvring_node_failures": d["node_failures"],
        }
        for reason in Refusal:
            out[f"kvring_loads_refused_{reason}"] = d["loads_refused"].get(reason, 0)
        return out

    def is_empty(self) -> bool:
        return (not any(self.data[name] for name in COUNTERS) and not self.data[TRANSFERS]
                and not any(any(self.data[name].values()) for name in BY_REASON))


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
        self._by_reason: dict[tuple[int, str, str], Any] = {}
        for name, (doc, reasons) in BY_REASON.items():
            metric = self._counter_cls(name=f"vllm:kvring_{name}", documentation=doc,
                                       labelnames=[*labelnames, "reason"])
            for engine, values in per_engine_labelvalues.items():
                for reason in reasons:
                    self._by_reason[engine, name, reason] = metric.labels(*values, reason)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in COUNTERS:
            value = transfer_stats_data.get(name, 0)
            if value:
                self._counters[engine_idx, name].inc(value)
        for name in BY_REASON:
            for reason, n in transfer_stats_data.get(name, {}).items():
                counter = self._by_reason.get((engine_idx, name, reason))
                if counter is not None and n:
                    counter.inc(n)
