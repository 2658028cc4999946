"""The Kubernetes operator for CacheCluster resources (``kvring operator``).

- ``spec``: the CacheCluster spec, validated once into frozen dataclasses (``ClusterSpec``).
- ``render`` (``render_nodes``, ``render_etcd``, ``naming``, ``contract``): pure functions from a
  spec to the child objects as plain dicts, and the connector settings vLLM needs.
- ``handlers``: the kopf handlers (create/resume/update, the status timer, the finalizer),
  registered by ``register(registry, config)`` on a registry passed in.
- ``status`` and ``scaling``: pure decisions behind them (status and conditions from
  observations; scale-in through node drains).
- ``kube``: create-or-patch of the children; ``config`` and ``main``: the command's settings and
  entry point.

Besides ``kvring.common`` the operator imports only ``kvring.membership`` (etcd); it never
imports the data plane or the connector, and ``kopf``/``kubernetes_asyncio`` are imported nowhere else.
"""
