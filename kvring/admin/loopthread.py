"""An asyncio event loop on a thread, for the admin's etcd and node I/O.

uvicorn serves the admin's HTTP on its event loop (the *serving loop*).  Nothing there waits on
etcd or on a node: that I/O runs on a ``LoopThread`` instead, so a slow etcd or node, or a burst
of work for them, never holds up ``/healthz`` or a read answered from memory.  A handler hands a
coroutine over with ``run()`` and awaits the answer without blocking; cancelling that await (a
timeout) cancels the coroutine on the thread.

A ``LoopThread`` either owns its loop and thread (the node queries') or borrows a loop that
lives as long as the process (the view's: the process's etcd loop, ``kvring.membership.loop``,
because gRPC keeps delivering to every loop that ever used it, so that one must never close).
``aclose`` cancels what was submitted through it and runs a cleanup coroutine there (closing
the clients it owns); it stops and closes the loop only if it owns it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LoopThread:
    """A loop on a daemon thread: a new one named ``name``, or ``loop`` (already running) borrowed."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.name = name
        self.loop = loop or asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True) if loop is None else None
        self._submitted: set[concurrent.futures.Future] = set()

    def start(self) -> None:
        if self._thread is not None:
            self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """From any thread: schedule ``coro`` on this loop."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._submitted.add(future)
        future.add_done_callback(self._submitted.discard)
        return future

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """From another event loop: run ``coro`` here and await its result (or exception).

        Cancelling the await (e.g. under ``asyncio.timeout``) cancels ``coro`` here too."""
        return await asyncio.wrap_future(self.submit(coro))

    def call_soon(self, fn: Callable[[], object]) -> None:
        """From any thread: call ``fn()`` on this loop (e.g. set an ``asyncio.Event`` of it)."""
        self.loop.call_soon_threadsafe(fn)

    async def aclose(self, cleanup: Coroutine[Any, Any, None] | None = None, timeout: float = 5.0) -> None:
        """From another event loop: cancel what was submitted here, run ``cleanup`` here, and, if
        this loop is our own, stop it and join its thread."""
        if self._thread is not None and not self._thread.is_alive():
            if cleanup is not None:
                cleanup.close()
            return
        for future in list(self._submitted):
            future.cancel()
        try:
            await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                self._shutdown(cleanup, owned=self._thread is not None), self.loop)), timeout)
        except Exception as exc:  # closing must go on: report, then stop the loop regardless
            logger.warning("thread %s did not shut down cleanly: %s: %s", self.name, type(exc).__name__, exc)
        if self._thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            await asyncio.to_thread(self._thread.join, timeout)
            if not self._thread.is_alive():
                self.loop.close()

    @staticmethod
    async def _shutdown(cleanup: Coroutine[Any, Any, None] | None, owned: bool) -> None:
        if owned:  # tasks that ours started (batches of node queries) go too
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if cleanup is not None:
            await cleanup
