"""The node's KV events: every chunk that names its vLLM blocks (``ChunkMeta.blocks``) is
announced when the store takes it (``BlockStored``) and when it goes — deleted, flushed or
evicted (``BlockRemoved``) — on the node's ``EventPublisher`` (``kvring.events``), under the
cluster's ``PoolIdentity``.  A node starts empty, so its first batch is ``AllBlocksCleared``:
a subscriber that followed this node's earlier incarnation forgets what it announced.

Chunks without blocks (written by clients that send none) are not announced; a copy that
repair or handoff moves keeps its blocks, so the node that receives it announces it too.
"""

from __future__ import annotations

from kvring.common.chunk import ChunkBlocks, ChunkMeta
from kvring.events.publisher import EventPublisher, PublisherSettings
from kvring.events.wire import AllBlocksCleared, Event, PoolIdentity


class NodeEvents:
    """A ``StoreWatcher`` publishing the store's changes; on the store's thread it only queues the
    chunk's blocks (the events are built on the publisher's thread), and never blocks."""

    def __init__(self, cluster: str, settings: PublisherSettings) -> None:
        self.identity = PoolIdentity(cluster)
        self.publisher = EventPublisher(settings, render=self._render)
        self.publisher.publish(AllBlocksCleared())

    def stored(self, key: bytes, meta: ChunkMeta) -> None:
        if meta.blocks is not None:
            self.blocks_changed(True, meta.blocks)

    def removed(self, key: bytes, meta: ChunkMeta) -> None:
        if meta.blocks is not None:
            self.blocks_changed(False, meta.blocks)

    def blocks_changed(self, stored: bool, blocks: ChunkBlocks) -> None:
        """Announce ``blocks`` as stored or removed (any thread)."""
        self.publisher.publish((stored, blocks))

    def _render(self, item: AllBlocksCleared | tuple[bool, ChunkBlocks]) -> Event:
        if isinstance(item, AllBlocksCleared):
            return item
        stored, blocks = item
        return self.identity.stored(blocks) if stored else self.identity.removed(blocks)

    def close(self) -> None:
        self.publisher.close()
