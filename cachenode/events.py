"""The node's KV events: every chunk that names its vLLM blocks (``ChunkMeta.blocks``) is
announced when the store takes it (``BlockStored``) and when it goes — deleted, flushed or
evicted (``BlockRemoved``) — on the node's ``EventPublisher`` (``kvring.events``), under the
cluster's ``PoolIdentity``.  A node starts empty, so its first batch is ``AllBlocksCleared``:
a subscriber that followed this node's earlier incarnation forgets what it announced.

Chunks without blocks (written by clients that send none) are not announced; a copy that
repair or handoff moves keeps its blocks, so the node that receives it announces it too.
"""

from __future__ import annotations

from kvring.common.chunk import ChunkMeta
from kvring.events.publisher import EventPublisher, PublisherSettings
from kvring.events.wire import AllBlocksCleared, PoolIdentity


class NodeEvents:
    """A ``StoreWatcher`` publishing the store's changes; runs on the store's thread, never blocks."""

    def __init__(self, cluster: str, settings: PublisherSettings) -> None:
        self.identity = PoolIdentity(cluster)
        self.publisher = EventPublisher(settings)
        self.publisher.publish(AllBlocksCleared())

    def stored(self, key: bytes, meta: ChunkMeta) -> None:
        if meta.blocks is not None:
            self.publisher.publish(self.identity.stored(meta.blocks))

    def removed(self, key: bytes, meta: ChunkMeta) -> None:
        if meta.blocks is not None:
            self.publisher.publish(self.identity.removed(meta.blocks))

    def close(self) -> None:
        self.publisher.close()
