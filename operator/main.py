"""``kvring operator``: the CacheCluster operator, kopf running the handlers of ``handlers``.

It runs ``--standalone`` (no kopf peering objects in the cluster): the chart deploys one replica,
and the Deployment's ``Recreate`` strategy keeps a second one from overlapping it.
"""

from __future__ import annotations

import logging

import kopf
import prometheus_client

from .config import OperatorConfig
from .handlers import register

logger = logging.getLogger(__name__)


def run(config: OperatorConfig, verbose: bool = False) -> None:
    """Serve CacheClusters until SIGINT/SIGTERM (blocks; the handlers run on kopf's event loop).

    Logging is kopf's (its format names the object each line is about); ``verbose`` is DEBUG.
    """
    kopf.configure(verbose=verbose)
    registry = kopf.OperatorRegistry()
    handlers = register(registry, config)
    if config.metrics_port:
        prometheus_client.start_http_server(config.metrics_port, registry=handlers.metrics.registry)
    where = ", ".join(config.namespaces) if config.namespaces else "all namespaces"
    logger.info("kvring operator: serving CacheClusters in %s (status every %ss)", where, config.status_interval)
    kopf.run(registry=registry, standalone=True, clusterwide=not config.namespaces,
             namespaces=list(config.namespaces), liveness_endpoint=config.liveness_endpoint)
