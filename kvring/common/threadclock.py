"""Where a thread's wall time went: on a CPU, or runnable and waiting for one.

A load's seconds alone cannot tell a slow loader from a starved one.  Linux keeps both figures
per thread in ``/proc/thread-self/schedstat`` (nanoseconds on a CPU, nanoseconds waiting on a run
queue, time slices); a ``ThreadClock`` read at the start and at the end of a load, on the thread
that loads, gives its share of each.  The rest of the wall time the thread was blocked: waiting
for a node's bytes, or for a lock.  The kernel brings a running thread's figures up to date at
its scheduler ticks, so each is good to a tick (4 or 10 ms): read a short load's figures with
that in mind.  Where the file is missing (not Linux), both read as ``None``.
"""

from __future__ import annotations

from typing import NamedTuple

SCHEDSTAT = "/proc/thread-self/schedstat"


class ThreadTimes(NamedTuple):
    """Seconds the calling thread spent on a CPU and runnable without one, since it started."""

    on_cpu: float
    waiting: float

    def __sub__(self, other: ThreadTimes) -> ThreadTimes:  # type: ignore[override]
        return ThreadTimes(self.on_cpu - other.on_cpu, self.waiting - other.waiting)


def thread_times() -> ThreadTimes | None:
    """The calling thread's times so far (``None`` where the kernel does not keep them)."""
    try:
        with open(SCHEDSTAT) as f:
            on_cpu, waiting, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return ThreadTimes(int(on_cpu) / 1e9, int(waiting) / 1e9)


class ThreadClock:
    """Started on a thread, read on the same thread: what it did since (``elapsed``)."""

    def __init__(self) -> None:
        self._start = thread_times()

    def elapsed(self) -> ThreadTimes | None:
        now = thread_times()
        return now - self._start if now is not None and self._start is not None else None
