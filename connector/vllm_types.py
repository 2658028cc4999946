"""The vLLM base classes the worker side's plain-data modules subclass, with or without vLLM.

``metadata.py`` (``KVRingMetadata``) and ``stats.py`` (``KVRingStats``, ``KVRingPromMetrics``)
subclass three of vLLM's connector base classes.  Where vLLM is installed these are vLLM's own
classes, imported from vLLM, and nothing changes.  Where it is not installed at all -- the GPU test
machines, which carry PyTorch but no vLLM -- minimal stand-ins with the same fields and constructor
take their place, so that the worker side (``worker.py``, ``copies.py`` and what they import) can be
imported and tested against real CUDA caches there.  The stand-ins hold only what kvring's
subclasses use; they never replace an installed vLLM, and an installed vLLM that fails to import
fails here too.
"""

from __future__ import annotations

import importlib.util
from abc import ABC
from dataclasses import dataclass, field
from typing import Any

__all__ = ["VLLM_INSTALLED", "KVConnectorMetadata", "KVConnectorPromMetrics", "KVConnectorStats"]

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None

if VLLM_INSTALLED:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
else:
    from prometheus_client import Counter, Gauge, Histogram

    class KVConnectorMetadata(ABC):
        """Stand-in for vLLM's ``KVConnectorMetadata`` (scheduler side -> worker side, per step)."""

    @dataclass
    class KVConnectorStats:
        """Stand-in for vLLM's ``KVConnectorStats``: a ``data`` dict that crosses processes."""

        data: dict[str, Any] = field(default_factory=dict)

        def to_dict(self) -> dict[str, Any]:
            return self.data

    class KVConnectorPromMetrics:
        """Stand-in for vLLM's ``KVConnectorPromMetrics``: the metric classes to register with."""

        def __init__(self, vllm_config, metric_types: dict[type, type], labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._gauge_cls = metric_types[Gauge]
            self._counter_cls = metric_types[Counter]
            self._histogram_cls = metric_types[Histogram]
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues
