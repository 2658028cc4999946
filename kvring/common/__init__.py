"""kvring's shared vocabulary: what every part of kvring says to every other, and nothing else.

Pure modules, importable anywhere (the operator, the admin API, the connector, the nodes): no
sockets, no etcd, no vLLM.  Each fact lives in one of them:

- ``types``: ``ChunkHash``, ``NodeId``, ``NodeState``.
- ``errors``: the ``KVRingError`` family and ``ErrorCode``, the data protocol's error codes,
  with the one table from code to exception.
- ``chunk``: ``ChunkMeta`` (shape, dtype, per-layer checksums), ``ChunkItem`` (one chunk to
  store).
- ``protocol``: the data protocol's typed messages and their framing.
- ``hashing`` and ``ring``: the key contract (chained chunk keys) and placement on the ring.
- ``contract``: the ``Contract`` a cluster's processes agree on, and the vLLM
  ``--kv-transfer-config`` that points an engine at a cluster.
- ``records``: ``NodeRecord``, a node's entry in the cluster's membership.
- ``units``: byte sizes as people write them.
"""
