"""One asyncio loop per process for the clients' etcd work, on a daemon thread.

gRPC's asyncio layer binds every event loop that ever used it to its process-wide completion
queue and keeps delivering to each of them; a loop closed while others go on makes every later
gRPC event log "Event loop is closed".  So the ``ClusterClient``s of a process (a benchmark's
fifty, a test's many, a vLLM worker's one) share this loop, which lives as long as the process:
each client runs its own tasks on it and cancels them, and closes its own etcd connection, when
it closes.  A forked child (vLLM's workers) gets a loop of its own on first use.
"""

from __future__ import annotations

import asyncio
import os
import threading

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pid = 0


def etcd_loop() -> asyncio.AbstractEventLoop:
    """The process's running etcd loop (started on first use)."""
    global _loop, _pid
    with _lock:
        if _loop is None or _pid != os.getpid():
            _loop, _pid = asyncio.new_event_loop(), os.getpid()
            threading.Thread(target=_loop.run_forever, name="kvring-etcd-clients", daemon=True).start()
        return _loop
