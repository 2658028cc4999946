"""kvring cache nodes and the cluster client.

Import what you need from its module (nothing is loaded here): ``kvring.cachenode.client``
(``ClusterClient``, the data plane's Python API), ``kvring.cachenode.node`` (one node),
``store``/``policy`` (the chunk store), ``handoff``.  The vocabulary they share with the rest of
kvring (messages, errors, chunk metadata, the key contract) is ``kvring.common``.
"""
