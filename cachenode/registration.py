"""A node's side of membership: its record in etcd under a lease, and its drain key.

The node id is fenced (see ``kvring.membership.registrar``): a record already holding it is
a running node if that node's data port answers PING under the id (``answers_as``); then this
node refuses to start, else it takes the record over.

It also publishes the node's repair report (``repair/<node-id>`` under the node's lease: the
handoff thread's last pass, ``RepairReport``) whenever it changes, and answers
``Drain.restart_marked`` (whether the operator marked this node restarting) with a fresh read
of ``restart/<node-id>``.

Threading contract: one daemon thread runs an asyncio loop with the ``Registrar`` (keeps the
record alive, re-registers after etcd outages), a watcher of the node's drain key (read once,
then watched; each change turned into ``Drain.request``/``cancel``), the repair report's
publisher and the node's ``SelfCheck`` of its data plane.  Other threads
call ``set_state``, ``leave`` and ``restart_marked``, which hand their work to that loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading

from kvring.common.contract import Contract
from kvring.common.errors import ContractMismatch, MembershipError, NodeIdTaken
from kvring.common.records import NodeRecord, RepairReport
from kvring.common.tls import ContextSource
from kvring.common.types import NodeState
from kvring.membership.etcd import Etcd
from kvring.membership.registrar import Registrar
from kvring.membership.settings import EtcdSettings

from .drain import Drain
from .probe import PROBE_TIMEOUT, answers_as
from .selfcheck import SelfCheck

logger = logging.getLogger(__name__)

REPORT_INTERVAL = 0.5  # seconds between looks at the handoff thread's repair progress


def repair_report(node_id: str, incarnation: str, progress) -> RepairReport:
    """The report of a ``repair.RepairProgress`` (read ``active`` first: see its threading note)."""
    running = progress.active
    return RepairReport(node_id=node_id, incarnation=incarnation, epoch=progress.last_epoch, running=running,
                        pending=progress.incomplete, missing=progress.missing if not running else 0,
                        copied=progress.copied if not running else 0, passes=progress.passes)


class Registration:
    def __init__(self, settings: EtcdSettings, record: NodeRecord, contract: Contract, ttl: int,
                 drain: Drain, drain_poll: float, self_check: SelfCheck | None = None,
                 tls: ContextSource | None = None) -> None:
        self.settings = settings
        self.self_check = self_check
        self.drain = drain
        self.drain_poll = drain_poll
        self.etcd = Etcd(settings)
        self.registrar = Registrar(self.etcd, record, contract, ttl=ttl, holder_alive=functools.partial(answers_as, tls=tls))
        self.node_id = record.node_id
        self.fatal: str | None = None  # a contract mismatch, or the node id held by another node: stop
        self._fatal_error: Exception | None = None
        self.on_fatal = lambda: None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        drain.restart_marked = self.restart_marked

    @property
    def registered(self) -> bool:
        return self.registrar.registered.is_set()

    def start(self) -> None:
        """Start the thread; returns after the first registration attempt.  Raises
        ``ContractMismatch`` or ``NodeIdTaken`` (the node must not serve)."""
        ready = threading.Event()
        threading.Thread(target=self._thread, args=(ready,), name="kvring-etcd", daemon=True).start()
        ready.wait(self.settings.timeout * 3 + PROBE_TIMEOUT * 3 + 1)
        if self.fatal:
            raise self._fatal_error

    def set_state(self, state: NodeState) -> None:
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if self._loop is not None and not on_loop:
            self._loop.call_soon_threadsafe(self.registrar.set_state, state)
        else:  # not started yet, or called from the loop (the record must change before it registers)
            self.registrar.set_state(state)

    def leave(self, drained: bool) -> None:
        """Revoke the lease (the node leaves the ring at once); after a completed drain that etcd
        asked for, also remove the request, so a pod coming back under this id starts active."""
        self._stopping.set()
        loop = self._loop
        if loop is None or not loop.is_running():
            return
        if drained:
            self._run(self.etcd.cancel_drain(self.node_id), "could not remove this node's drain request from etcd")
        self._run(self.registrar.deregister(), "could not revoke the etcd lease; it will expire by itself")

    def restart_marked(self, timeout: float | None = None) -> bool:
        """Whether the operator marked this node restarting (a fresh read of its marker in etcd);
        False when etcd cannot say in time: then the node drains, as it would without a marker."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return False
        fut = asyncio.run_coroutine_threadsafe(self.etcd.restart_requested(self.node_id), loop)
        try:
            return bool(fut.result(timeout=timeout or self.settings.call_timeout))
        except Exception as exc:
            fut.cancel()
            logger.warning("cannot read this node's restart marker from etcd (%s): draining as usual", exc)
            return False

    def _run(self, coro, failure: str) -> None:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            fut.result(timeout=2)
        except Exception:
            logger.warning("%s", failure)

    def _thread(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self._main(ready))

    async def _main(self, ready: threading.Event) -> None:
        try:  # a drain requested before (re)start holds: register as draining, not active
            if await self.etcd.drain_requested(self.node_id):
                self.drain.request("etcd")
        except MembershipError:
            pass
        try:
            await self.registrar.register_once()
            logger.info("node %s registered in etcd as %s", self.node_id, self.registrar.record.data_addr)
        except MembershipError as exc:
            logger.warning("etcd unreachable at start (%s); serving anyway, will register when it is back", exc)
        except (ContractMismatch, NodeIdTaken) as exc:
            self.fatal, self._fatal_error = str(exc), exc
            ready.set()
            return
        ready.set()
        watcher = asyncio.ensure_future(self._watch_drain_key(Etcd(self.settings)))
        reporter = asyncio.ensure_future(self._publish_repair())
        checker = asyncio.ensure_future(self.self_check.run()) if self.self_check is not None else None
        try:
            await self.registrar.run()
        except (ContractMismatch, NodeIdTaken) as exc:
            self.fatal, self._fatal_error = str(exc), exc
            logger.error("%s", exc)
            self.on_fatal()
        finally:
            watcher.cancel()
            reporter.cancel()
            if checker is not None:
                checker.cancel()

    async def _watch_drain_key(self, etcd: Etcd) -> None:
        """Follow this node's drain key in etcd: read it, then watch it (nothing sent while it
        does not change); after a broken watch, read it again ``drain_poll`` seconds later."""
        try:
            while True:
                try:
                    requested, revision = await etcd.drain_request(self.node_id)
                    self._drain_requested(requested)
                    async for change in etcd.changes(revision, key=etcd.drain_key(self.node_id)):
                        self._drain_requested(change.value is not None)
                except MembershipError:
                    pass  # keep the current state; the registrar logs etcd outages
                await asyncio.sleep(self.drain_poll)
        finally:
            await etcd.close()

    async def _publish_repair(self) -> None:
        """Write the repair report whenever it (or the lease it must live under) changes."""
        written: tuple[RepairReport, int] | None = None
        while not self._stopping.is_set():
            await asyncio.sleep(REPORT_INTERVAL)
            handoff, lease = self.drain.handoff, self.registrar.lease_id
            if handoff is None or lease is None:
                continue
            report = repair_report(self.node_id, self.registrar.record.incarnation, handoff.repair)
            if (report, lease) == written:
                continue
            try:
                await self.etcd.put_repair_report(report, lease)
                written = (report, lease)
            except MembershipError as exc:
                logger.debug("cannot publish the repair report yet: %s", exc)

    def _drain_requested(self, requested: bool) -> None:
        if self._stopping.is_set():
            return  # shutting down: the state no longer changes
        if requested:
            self.drain.request("etcd")
        else:
            self.drain.cancel("etcd")
