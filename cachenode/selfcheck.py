"""A node's check of its own data plane: PING through its advertised address, as a client would.

A node whose process is up but whose data loop is stuck (a hung handler, a full accept queue,
an address that no longer routes to it) would stay on the ring and make every client time out
on it.  So every ``interval`` seconds the node PINGs itself at the data address its record
advertises; after ``failures`` misses in a row it reports itself ``unhealthy`` (off the ring,
``/readyz`` 503, the record kept so people see why), and the first PING answered again brings
it back to ``active``.

Threading contract: ``run`` is a coroutine on the registration thread's loop; ``on_change`` is
called there.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable

from kvring.common.records import NodeRecord

from .probe import answers_as

logger = logging.getLogger(__name__)


class SelfCheck:
    def __init__(self, record: Callable[[], NodeRecord], on_change: Callable[[bool], None], interval: float = 5.0,
                 failures: int = 3, timeout: float = 2.0, tls: ssl.SSLContext | None = None) -> None:
        self.record = record
        self.tls = tls
        self.on_change = on_change  # called with False when the node goes unhealthy, True when it recovers
        self.interval = interval
        self.failures = failures
        self.timeout = timeout
        self.healthy = True
        self.missed = 0  # PINGs missed in a row

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check_once()

    async def check_once(self) -> None:
        record = self.record()
        ok = await answers_as(record, self.timeout, self.tls)
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
