"""The admin's questions to the nodes' admin ports: bounded, and off the serving loop.

- ``POST /v1/present`` (which keys a node holds; nothing is leased) for lookups and key owners;
- ``POST /v1/flush`` (delete one namespace) for flushes.

Both carry the cluster's node token (``AdminSettings.node_token``), which the nodes require for
them.  Without one configured, ``holders`` and ``flush`` raise ``NoNodeToken`` (503) at once
rather than ask nodes that would refuse; a node that refuses the token given (401 or 403) is
logged at WARNING once, until it accepts it again.

``NodeQueries`` sends them from the queries thread (a ``LoopThread`` named
``kvring-admin-queries``, through ``nodehttp``); each node call waits at most ``node_timeout``,
and a node that does not answer a presence query counts as holding nothing.  Presence queries
are batched per node (``_PresenceBatcher``): while requests to a node are in flight, the keys
other lookups ask meanwhile wait and go together in the next, so a burst of N lookups costs a
few requests per node instead of N (alone, a lookup waits for nothing).

A handler on the serving loop does its whole query inside ``slot(what)``: at most
``max_concurrent_queries`` run at once, and the query — waiting for its turn included — gets
``query_timeout`` seconds, after which it is cancelled and raises ``Busy`` (503).  A burst of
lookups therefore queues here, and ``/healthz`` or a read of the cached view never waits
behind it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

from kvring.common.errors import KVRingError, NodeUnavailable
from kvring.common.protocol import MAX_KEYS_PER_REQUEST
from kvring.common.records import NodeRecord

from .loopthread import LoopThread
from .nodehttp import NodeHTTPError, NodeTLSMismatch, request_json
from .settings import AdminSettings

logger = logging.getLogger(__name__)


class Busy(KVRingError):
    """A query to the nodes did not finish within ``query_timeout`` (slow nodes, or too many queries)."""


class NoNodeToken(KVRingError):
    """The admin has no node token, so the nodes would refuse its presence queries and flushes."""


class _PresenceBatcher:
    """Presence queries to one node, batched; lives on the queries thread only.

    ``ask(keys)`` queues the keys and returns a future of their flags.  At most
    ``MAX_IN_FLIGHT`` requests to the node run at once; each takes every key queued when it
    starts (deduplicated, up to ``MAX_KEYS_PER_REQUEST``).  A request that fails answers "not
    held" for all of its keys.  ``on_idle`` is called when nothing is queued or in flight.
    """

    MAX_IN_FLIGHT = 2

    def __init__(self, ask_node: Callable[[list[bytes]], Awaitable[list[bool]]], on_idle: Callable[[], None]) -> None:
        self._ask_node = ask_node
        self._on_idle = on_idle
        self._queued: deque[tuple[list[bytes], asyncio.Future[list[bool]]]] = deque()
        self._in_flight = 0

    def ask(self, keys: list[bytes]) -> asyncio.Future[list[bool]]:
        future = asyncio.get_running_loop().create_future()
        self._queued.append((keys, future))
        if self._in_flight < self.MAX_IN_FLIGHT:
            self._in_flight += 1
            asyncio.get_running_loop().create_task(self._send_while_queued())
        return future

    def _take(self) -> list[tuple[list[bytes], asyncio.Future[list[bool]]]]:
        """The queued questions (at least one) whose keys fit in one request together."""
        taken, total = [], 0
        while self._queued and (not taken or total + len(self._queued[0][0]) <= MAX_KEYS_PER_REQUEST):
            keys, future = self._queued.popleft()
            total += len(keys)
            if not future.done():  # its lookup may have been cancelled meanwhile
                taken.append((keys, future))
        return taken

    async def _send_while_queued(self) -> None:
        try:
            while self._queued:
                batch = self._take()
                unique = list(dict.fromkeys(k for keys, _ in batch for k in keys))
                try:
                    flags = dict(zip(unique, await self._ask_node(unique))) if unique else {}
                except Exception as exc:  # a bug: the lookups waiting on this batch fail, the next go on
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for keys, future in batch:
                    if not future.done():
                        future.set_result([flags[k] for k in keys])
        finally:
            self._in_flight -= 1
            if not self._in_flight and not self._queued:
                self._on_idle()


class NodeQueries:
    """Presence and flush queries to every member (see the module docstring).

    ``slot``, ``holders``, ``flush``, ``start`` and ``aclose`` are called on the serving loop;
    the coroutines starting with ``_`` run on the queries thread.
    """

    def __init__(self, settings: AdminSettings) -> None:
        self.settings = settings
        self.thread = LoopThread("kvring-admin-queries")
        self._slots = asyncio.Semaphore(settings.max_concurrent_queries)  # serving loop only
        self._in_flight = 0  # serving loop only
        self._batchers: dict[tuple[str, str], _PresenceBatcher] = {}  # queries thread only
        # Nodes this admin cannot ask (they refuse its node token, or their TLS and its credentials
        # disagree), warned about once; queries thread only.
        self._cannot_ask: set[str] = set()

    def start(self) -> None:
        self.thread.start()

    async def aclose(self) -> None:
        await self.thread.aclose()

    @asynccontextmanager
    async def slot(self, what: str) -> AsyncIterator[None]:
        """Bound the query ``what`` that runs inside: wait for one of the slots, and raise ``Busy``
        when waiting and running together take longer than ``query_timeout``."""
        limit = self.settings.query_timeout
        self._in_flight += 1
        try:
            async with asyncio.timeout(limit):
                async with self._slots:
                    yield
        except TimeoutError:
            raise Busy(f"the {what} did not finish within {limit:g}s ({self._in_flight} queries to the nodes in "
                       f"flight, {self.settings.max_concurrent_queries} at a time): the nodes answer slowly or "
                       "the admin is busy; retry shortly") from None
        finally:
            self._in_flight -= 1

    def _require_node_token(self, what: str) -> None:
        if self.settings.node_token is None:
            raise NoNodeToken(f"the {what} needs the nodes' admin ports, which require the cluster's node token, and "
                              "this admin has none: start `kvring admin` with --node-token-file PATH or "
                              "KVRING_NODE_TOKEN (`kvring up` prints the file; on Kubernetes it is the Secret "
                              "<cluster>-node-token, key token)")

    async def holders(self, members: Mapping[str, NodeRecord], keys: Sequence[bytes],
                      owners: Sequence[Sequence[str]], what: str = "lookup") -> list[list[str]]:
        """Which members hold each key now: of its ``owners`` (ring order) those that hold it
        first, then any other member that holds it (a previous owner, right after a ring change)."""
        self._require_node_token(what)
        if not keys:
            return []
        present = await self.thread.run(self._present_everywhere(list(members.values()), list(keys)))
        out = []
        for i, own in enumerate(owners):
            held = {n for n, answers in present.items() if answers[i]}
            out.append([n for n in own if n in held] + sorted(held - set(own)))
        return out

    async def flush(self, members: Mapping[str, NodeRecord], namespace: str) -> dict[str, int | str]:
        """Delete ``namespace`` on every member: chunks deleted per node, or why a node did not confirm."""
        self._require_node_token("flush")
        return await self.thread.run(self._flush_everywhere(list(members.values()), namespace))

    # ---- the queries thread -------------------------------------------------------------------

    async def _post(self, rec: NodeRecord, path: str, body: dict) -> dict:
        token = self.settings.node_token
        try:
            answer = await request_json(rec.admin_addr, "POST", path, body, timeout=self.settings.node_timeout,
                                        token=token.presented() if token else None, tls=self.settings.node_tls)
        except NodeHTTPError as exc:
            if rec.node_id not in self._cannot_ask and (exc.status in (401, 403) or isinstance(exc, NodeTLSMismatch)):
                self._cannot_ask.add(rec.node_id)
                fix = ("the cluster's credentials (--tls-dir) if and only if its nodes run TLS"
                       if isinstance(exc, NodeTLSMismatch) else "the node token the nodes run with")
                logger.warning("this admin cannot ask node %s (%s): its lookups count it as holding nothing and "
                               "flushes fail there; give `kvring admin` %s", rec.node_id, exc, fix)
            raise NodeUnavailable(f"node {rec.node_id}: {path}: {exc}") from None
        if rec.node_id in self._cannot_ask:
            self._cannot_ask.discard(rec.node_id)
            logger.info("node %s answers this admin again", rec.node_id)
        if not isinstance(answer, dict):
            raise NodeUnavailable(f"node {rec.node_id}: {path} answered a JSON {type(answer).__name__}, not an object")
        return answer

    async def _ask_node(self, rec: NodeRecord, keys: list[bytes]) -> list[bool]:
        """One ``/v1/present`` request (at most ``MAX_KEYS_PER_REQUEST`` keys); a node that does
        not answer, or answers nonsense, holds none of them."""
        try:
            answer = (await self._post(rec, "/v1/present", {"keys": [k.hex() for k in keys]}))["present"]
            if not isinstance(answer, list) or len(answer) != len(keys):
                raise NodeUnavailable(f"node {rec.node_id}: /v1/present answered {answer!r:.80} for {len(keys)} keys")
            return [p is True for p in answer]
        except (NodeUnavailable, KeyError) as exc:
            logger.debug("presence query: %s", exc)
            return [False] * len(keys)

    def _batcher(self, rec: NodeRecord) -> _PresenceBatcher:
        where = (rec.node_id, rec.admin_addr)
        if where not in self._batchers:
            self._batchers[where] = _PresenceBatcher(lambda keys: self._ask_node(rec, keys),
                                                     lambda: self._batchers.pop(where, None))
        return self._batchers[where]

    async def _present(self, rec: NodeRecord, keys: list[bytes]) -> list[bool]:
        parts = [keys[i:i + MAX_KEYS_PER_REQUEST] for i in range(0, len(keys), MAX_KEYS_PER_REQUEST)]
        batcher = self._batcher(rec)
        answers = await asyncio.gather(*(batcher.ask(part) for part in parts))
        return [flag for answer in answers for flag in answer]

    async def _present_everywhere(self, members: list[NodeRecord], keys: list[bytes]) -> dict[str, list[bool]]:
        answers = await asyncio.gather(*(self._present(rec, keys) for rec in members))
        return {rec.node_id: flags for rec, flags in zip(members, answers)}

    async def _flush_one(self, rec: NodeRecord, namespace: str) -> int | str:
        try:
            return int((await self._post(rec, "/v1/flush", {"namespace": namespace}))["deleted"])
        except (NodeUnavailable, KeyError, TypeError, ValueError) as exc:
            return str(exc)

    async def _flush_everywhere(self, members: list[NodeRecord], namespace: str) -> dict[str, int | str]:
        results = await asyncio.gather(*(self._flush_one(rec, namespace) for rec in members))
        return {rec.node_id: result for rec, result in zip(members, results)}
