"""Whether a node answers on its data port as the node it claims to be (a PING, asyncio)."""

from __future__ import annotations

import asyncio
import ssl

import msgspec

from kvring.common import protocol as P
from kvring.common.records import NodeRecord, split_data_addr

from .framing import MAGIC, PREFIX, pack

PROBE_TIMEOUT = 1.0  # how long a node holding our id has to answer PING


async def answers_as(record: NodeRecord, timeout: float = PROBE_TIMEOUT, tls: ssl.SSLContext | None = None) -> bool:
    """Whether the node at ``record``'s data address answers PING as ``record.node_id`` (over
    TLS with the cluster's credentials, if given)."""
    try:
        host, port = split_data_addr(record.data_addr)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=tls), timeout)
    except (OSError, TimeoutError, ValueError):
        return False
    try:
        writer.write(b"".join(pack(P.encode(P.Ping(rid=1)))))
        magic, header_len, count, _ = PREFIX.unpack(await asyncio.wait_for(reader.readexactly(PREFIX.size), timeout))
        if magic != MAGIC or count or header_len > 4096:
            return False
        reply = P.decode_reply(await asyncio.wait_for(reader.readexactly(header_len), timeout))
        return isinstance(reply, P.Pong) and reply.node_id == record.node_id
    except (OSError, TimeoutError, asyncio.IncompleteReadError, msgspec.DecodeError, msgspec.ValidationError):
        return False
    finally:
        writer.close()
