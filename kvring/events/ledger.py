"""``PoolLedger``: what the whole pool holds, from its nodes' KV events, and the pool stream's
events for each change.

A router credits a worker for the run of blocks that chains from a prompt's first block by
parent hash; a pool whose chunks are spread over nodes is that worker's cache only when it is
announced as one.  The ledger keeps, per node, the blocks its events say it holds (a block held
twice by one node, e.g. by two chunk keys, counts twice), and for the pool:

- a block is *held* while at least one node holds it;
- a block is *published* (announced on the pool stream) while it is held and its parent is
  published, or it has none (a prompt's first block).  So every published block chains to a
  prompt's first block through published blocks, whatever nodes hold them: a chunk whose
  previous chunk is not (yet) in the pool waits, and is announced, with everything after it,
  when that chunk arrives;
- when a published block stops being held, it and every published block under it are
  announced removed (those still held wait for it to come back).

The pool stream's events carry the node events' fields (hashes as the saving vLLM computes
them, parent hash, token ids, block size, LoRA name, per-block extra keys) and ``medium`` of
the stream's choosing, and never ``locality`` or ``ownership``: the stream stands for one
worker, the pool, and its consumers treat it as any engine's own cache (Dynamo's indexer drops
events that carry either field).

Pure logic, no I/O, one thread: the relay (``relay.py``) owns it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvring.common.chunk import BlockHash

from .wire import AllBlocksCleared, BlockRemoved, BlockStored, Event

MAX_BLOCKS_PER_EVENT = 512  # a long chain is announced in events of at most this many blocks


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One block as a node's ``BlockStored`` named it."""

    parent: BlockHash | None
    tokens: tuple[int, ...]
    block_size: int
    lora_name: str | None
    extra_keys: Any  # this block's entry of the event's ``extra_keys`` (None: none)


def blocks_of(event: BlockStored) -> list[tuple[BlockHash, BlockInfo]]:
    """Each block of a node's ``BlockStored`` with what the pool stream needs to announce it."""
    out, parent, size = [], event.parent_block_hash, event.block_size
    extra = event.extra_keys or []
    for i, h in enumerate(event.block_hashes):
        tokens = tuple(event.token_ids[i * size:(i + 1) * size])
        if len(tokens) != size:
            break  # a malformed event (the nodes refuse these): announce only its whole blocks
        keys = extra[i] if i < len(extra) else None
        out.append((h, BlockInfo(parent, tokens, size, event.lora_name, keys)))
        parent = h
    return out


class NodeHoldings:
    """The blocks one node holds, as its events (applied in sequence) say."""

    def __init__(self) -> None:
        self.counts: Counter[BlockHash] = Counter()
        self.info: dict[BlockHash, BlockInfo] = {}

    def apply(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            for h, info in blocks_of(event):
                self.counts[h] += 1
                self.info[h] = info
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                if self.counts.get(h, 0) > 1:
                    self.counts[h] -= 1
                elif h in self.counts:  # a removal of a block never announced is ignored
                    del self.counts[h]
                    del self.info[h]
        elif isinstance(event, AllBlocksCleared):
            self.counts.clear()
            self.info.clear()


class PoolLedger:
    """The pool's blocks across nodes; every method returns the pool stream's events for the
    change it made (empty when the pool, as announced, did not change)."""

    def __init__(self, medium: str | None = "CPU") -> None:
        self.medium = medium
        self.nodes: dict[str, NodeHoldings] = {}
        self._holders: Counter[BlockHash] = Counter()  # nodes holding each block
        self._info: dict[BlockHash, BlockInfo] = {}
        self._children: dict[BlockHash, set[BlockHash]] = {}
        self._published: set[BlockHash] = set()

    # ---- what it holds ------------------------------------------------------------------------

    @property
    def published(self) -> frozenset[BlockHash]:
        return frozenset(self._published)

    @property
    def held(self) -> int:
        """Blocks some node holds (a length: safe to read from another thread)."""
        return len(self._holders)

    @property
    def published_count(self) -> int:
        """Blocks announced on the pool stream (likewise)."""
        return len(self._published)

    # ---- changes ------------------------------------------------------------------------------

    def apply(self, node: str, event: Event) -> list[Event]:
        """One event of ``node``'s stream, in its sequence."""
        holdings = self.nodes.setdefault(node, NodeHoldings())
        before = set(holdings.counts)
        holdings.apply(event)
        return self._node_changed(holdings, before)

    def replace(self, node: str, holdings: NodeHoldings) -> list[Event]:
        """``node`` holds exactly ``holdings`` now (rebuilt from its replay): announce the difference."""
        before = set(self.nodes[node].counts) if node in self.nodes else set()
        self.nodes[node] = holdings
        return self._node_changed(holdings, before)

    def drop(self, node: str) -> list[Event]:
        """``node`` left the pool (or came back empty): what only it held goes."""
        holdings = self.nodes.pop(node, None)
        if holdings is None:
            return []
        return self._node_changed(NodeHoldings(), set(holdings.counts))

    def snapshot(self) -> list[Event]:
        """``AllBlocksCleared`` then every published block, parents first: what a consumer that
        joins now (or lost track) applies to know the pool as it is."""
        roots = [h for h in self._published if self._info[h].parent not in self._published]
        return [AllBlocksCleared(), *self._announce(roots, again=True)]

    # ---- internals ----------------------------------------------------------------------------

    def _node_changed(self, holdings: NodeHoldings, before: set[BlockHash]) -> list[Event]:
        after = set(holdings.counts)
        gone = [h for h in before - after if self._release(h)]
        came = [h for h in after - before if self._hold(h, holdings.info[h])]
        events = self._unpublish(gone)
        events += self._announce([h for h in came if self._publishable(h)])
        return events

    def _hold(self, h: BlockHash, info: BlockInfo) -> bool:
        """One more node holds ``h``; whether the pool just started holding it."""
        self._holders[h] += 1
        if self._holders[h] > 1:
            return False
        self._info[h] = info
        self._children.setdefault(info.parent, set()).add(h)
        return True

    def _release(self, h: BlockHash) -> bool:
        """One node fewer holds ``h``; whether the pool just stopped holding it."""
        self._holders[h] -= 1
        if self._holders[h] > 0:
            return False
        del self._holders[h]
        return True

    def _publishable(self, h: BlockHash) -> bool:
        if h in self._published or h not in self._holders:
            return False
        parent = self._info[h].parent
        return parent is None or parent in self._published

    def _announce(self, roots: list[BlockHash], again: bool = False) -> list[Event]:
        """Publish each of ``roots`` and every held block under it, as runs that follow the chain,
        parents before children.  ``again`` (a snapshot): walk what is published already."""
        events: list[Event] = []
        stack = [h for h in reversed(roots) if again or h not in self._published]
        while stack:
            run = [stack.pop()]
            while True:
                self._published.add(run[-1])
                kids = [k for k in self._children.get(run[-1], ()) if self._follows(k, again)]
                if not kids:
                    break
                stack.extend(kids[1:])
                if len(run) == MAX_BLOCKS_PER_EVENT or not self._same_run(run[-1], kids[0]):
                    stack.append(kids[0])
                    break
                run.append(kids[0])
            events.append(self._stored(run))
        return events

    def _follows(self, h: BlockHash, again: bool) -> bool:
        return h in self._published if again else (h in self._holders and h not in self._published)

    def _same_run(self, a: BlockHash, b: BlockHash) -> bool:
        x, y = self._info[a], self._info[b]
        return x.block_size == y.block_size and x.lora_name == y.lora_name

    def _stored(self, run: list[BlockHash]) -> BlockStored:
        infos = [self._info[h] for h in run]
        extra = [i.extra_keys for i in infos]
        return BlockStored(block_hashes=list(run), parent_block_hash=infos[0].parent,
                           token_ids=[t for i in infos for t in i.tokens], block_size=infos[0].block_size,
                           lora_id=None, medium=self.medium, lora_name=infos[0].lora_name,
                           extra_keys=extra if any(e is not None for e in extra) else None)

    def _unpublish(self, gone: list[BlockHash]) -> list[Event]:
        """Blocks the pool stopped holding: forget them, and withdraw each published one with the
        published blocks under it."""
        removed: list[BlockHash] = []
        stack = [h for h in gone if h in self._published]
        while stack:
            h = stack.pop()
            if h not in self._published:
                continue
            self._published.discard(h)
            removed.append(h)
            stack.extend(k for k in self._children.get(h, ()) if k in self._published)
        for h in gone:
            info = self._info.pop(h)
            kids = self._children.get(info.parent)
            if kids is not None:
                kids.discard(h)
                if not kids:
                    del self._children[info.parent]
        return [BlockRemoved(block_hashes=removed, medium=self.medium)] if removed else []
