"""A node's check of its own data plane: PING through its advertised address, as a client would.

A node whose process is up but whose data loop is stuck (a hung handler, an address that no
longer routes to it) would stay on the ring and make every client time out
on it.  So every ``interval`` seconds the node PINGs itself at the data address its record
advertises; after ``failures`` misses in a row it reports itself ``unhealthy`` (off the ring,
``/readyz`` 503, the record kept so people see why), and the first PING answered again brings
it back to ``active``.

The PINGs go over one connection kept open (``probe.Pinger``), opened again through the
advertised address whenever it breaks or stays silent, and the server never sheds it
(``on_connect`` hands its local address to ``Server.keep_peer``).  A fresh connection per PING
would fail exactly when the node is busiest at its door -- out of descriptors (the check's own
socket is one too), or its accept queue full of a flood's connections -- and the node would
take itself off the ring while it serves every client it has.  What the check is for, a loop
that no longer answers, shows on the kept connection just the same; an address that stops
routing to the node breaks it or leaves it silent, and the next check opens a new one through
that address.

Threading contract: ``run`` is a coroutine on the registration thread's loop; ``on_change`` is
called there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvring.common.records import NodeRecord
from kvring.common.tls import ContextSource

from .probe import Pinger

logger = logging.getLogger(__name__)


class SelfCheck:
    def __init__(self, record: Callable[[], NodeRecord], on_change: Callable[[bool], None], interval: float = 5.0,
                 failures: int = 3, timeout: float = 2.0, tls: ContextSource | None = None,
                 on_connect: Callable[[str], None] | None = None) -> None:
        self.record = record
        self.tls = tls
        self.on_connect = on_connect  # gets the local "host:port" of each connection the check opens
        self._pinger: Pinger | None = None
        self.on_change = on_change  # called with False when the node goes unhealthy, True when it recovers
        self.interval = interval
        self.failures = failures
        self.timeout = timeout
        self.healthy = True
        self.missed = 0  # PINGs missed in a row

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.interval)
                await self.check_once()
        finally:
            if self._pinger is not None:
                self._pinger.close()

    async def check_once(self) -> None:
        record = self.record()
        if self._pinger is None or self._pinger.data_addr != record.data_addr:
            if self._pinger is not None:
                self._pinger.close()
            self._pinger = Pinger(record.data_addr, self.tls, self.on_connect)
        ok = await self._pinger.answers_as(record.node_id, self.timeout)
        self.missed = 0 if ok else self.missed + 1
        if self.healthy and self.missed >= self.failures:
            self.healthy = False
            logger.error("node %s: its data plane at %s did not answer %d checks in a row; leaving the ring "
                         "until it answers again", record.node_id, record.data_addr, self.missed)
            self.on_change(False)
        elif not self.healthy and ok:
            self.healthy = True
            logger.warning("node %s: its data plane answers again; back on the ring", record.node_id)
            self.on_change(True)
