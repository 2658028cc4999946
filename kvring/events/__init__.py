"""KV events: vLLM's KV-event wire format, published by the cache nodes for KV-aware routers.

- ``wire``: the event records (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) and
  their batch, encoded exactly as vLLM 0.32 encodes them (``vllm/distributed/kv_events.py``),
  so a router that decodes vLLM's events decodes these with the same classes.
- ``publisher``: ``EventPublisher``, a ZMQ PUB socket (frames: topic, 8-byte big-endian
  sequence number, msgpack batch) with a ROUTER socket that replays the recent batches to a
  subscriber that joins late or missed some, as vLLM's ``ZmqEventPublisher`` does.
- ``ledger``: ``PoolLedger``, what the whole pool holds from its nodes' events, and the events of
  the pool as one cache (a prompt's blocks chained from its first block, whatever nodes hold them).
- ``relay``: ``PoolRelay``, which follows every node's events and replay socket and publishes the
  ledger's events as one stream (one worker identity, one sequence, replay, a snapshot for each
  new subscriber); ``cachenode/pool_events.py`` feeds it the cluster's membership.

No vLLM import here: the nodes run without it.
"""
