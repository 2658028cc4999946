"""Whether a node answers on its data port as the node it claims to be (a PING, asyncio).

``answers_as`` opens a connection for one PING (the id probe at registration).  A ``Pinger``
keeps its connection open between PINGs (the node's self-check): a node out of descriptors, or
whose accept queue is full of a flood's connections, still answers on a connection it already
has, and the checking side needs no new descriptor either.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import msgspec

from kvring.common import protocol as P
from kvring.common.records import NodeRecord, split_data_addr
from kvring.common.tls import ContextSource

from .framing import MAGIC, PREFIX, pack

PROBE_TIMEOUT = 1.0  # how long a node holding our id has to answer PING


async def answers_as(record: NodeRecord, timeout: float = PROBE_TIMEOUT, tls: ContextSource | None = None) -> bool:
    """Whether the node at ``record``'s data address answers PING as ``record.node_id`` (over
    TLS with the cluster's credentials, if given), on a connection of its own."""
    pinger = Pinger(record.data_addr, tls)
    try:
        return await pinger.answers_as(record.node_id, timeout)
    finally:
        pinger.close()


class Pinger:
    """PINGs to one data address over a connection kept open between them (one coroutine at a
    time).  A connection that broke is opened again at once, through the address; one that
    stayed silent is closed (a late PONG must not answer the next PING), and the next PING
    opens another.  ``on_connect`` gets each new connection's local "host:port"."""

    def __init__(self, data_addr: str, tls: ContextSource | None = None,
                 on_connect: Callable[[str], None] | None = None) -> None:
        self.data_addr = data_addr
        self.tls = tls
        self.on_connect = on_connect
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._rids = itertools.count(1)

    async def answers_as(self, node_id: str, timeout: float) -> bool:
        """Whether PING is answered within ``timeout`` as ``node_id``."""
        kept = self._writer is not None
        if not kept and not await self._open(timeout):
            return False
        answered, broken = await self._ping(node_id, timeout)
        if answered:
            return True
        self.close()
        if kept and broken:  # the kept connection had gone: that says nothing of the node now
            if not await self._open(timeout):
                return False
            answered, _ = await self._ping(node_id, timeout)
            if not answered:
                self.close()
        return answered

    async def _open(self, timeout: float) -> bool:
        try:
            host, port = split_data_addr(self.data_addr)
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=self.tls() if self.tls else None), timeout)
        except (OSError, TimeoutError, ValueError):
            return False
        local = self._writer.get_extra_info("sockname")
        if self.on_connect is not None and local:
            self.on_connect(f"{local[0]}:{local[1]}")
        return True

    async def _ping(self, node_id: str, timeout: float) -> tuple[bool, bool]:
        """(answered as ``node_id``, the connection broke)."""
        rid = next(self._rids)
        try:
            self._writer.write(b"".join(pack(P.encode(P.Ping(rid=rid)))))
            magic, header_len, count, _ = PREFIX.unpack(
                await asyncio.wait_for(self._reader.readexactly(PREFIX.size), timeout))
            if magic != MAGIC or count or header_len > 4096:
                return False, False
            reply = P.decode_reply(await asyncio.wait_for(self._reader.readexactly(header_len), timeout))
            return isinstance(reply, P.Pong) and reply.rid == rid and reply.node_id == node_id, False
        except (ConnectionError, asyncio.IncompleteReadError):
            return False, True
        except (OSError, TimeoutError, msgspec.DecodeError, msgspec.ValidationError):
            return False, False

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
