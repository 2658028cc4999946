"""Settings of ``kvring operator``, built once in ``main`` and passed to ``handlers.register``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    """How the operator runs; none of it is per CacheCluster (that is the spec's job)."""

    namespaces: tuple[str, ...] = ()  # namespaces (or kopf globs) to serve; empty: all namespaces
    status_interval: float = 10.0  # seconds between status observations of each CacheCluster
    etcd_timeout: float = 2.0  # seconds per etcd request (membership, drains, cleanup)
    stats_timeout: float = 1.0  # seconds for a node's admin /stats
    retry_delay: float = 5.0  # seconds before a handler that hit an unreachable API or etcd retries
    api_timeout: float = 30.0  # seconds a Kubernetes API request may take (a hung API server, a half-open connection)
    cleanup_retries: int = 12  # deletion gives up cleaning etcd after this many failed tries
    kubeconfig: str | None = None  # None: in-cluster service account, else $KUBECONFIG
    liveness_endpoint: str | None = None  # e.g. http://0.0.0.0:8081/healthz (kopf's probe server)
    own_namespace: str | None = None  # where the operator's pod runs (POD_NAMESPACE): the NetworkPolicies admit it
    metrics_port: int = 0  # serve Prometheus /metrics (``metrics.py``) on this port on all addresses; 0: off

    def __post_init__(self) -> None:
        for name in ("status_interval", "etcd_timeout", "stats_timeout", "retry_delay", "api_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be 0 (off) or a port number, got {self.metrics_port}")
        if self.cleanup_retries < 0:
            raise ValueError(f"cleanup_retries must be 0 or more, got {self.cleanup_retries}")
