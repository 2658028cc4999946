"""A thread's clock tells time on a CPU, time runnable without one, and time blocked apart.

Real threads and a real CPU hog: a thread that spins is on a CPU, one that sleeps is not, and
one that spins on the same CPU as another process's busy loop waits on the run queue for much
of its wall time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from kvring.common.threadclock import ThreadClock, ThreadTimes, thread_times

pytestmark = pytest.mark.skipif(thread_times() is None, reason="needs Linux's per-thread schedstat")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _on_thread(work) -> ThreadTimes:
    """``work()`` on a thread of its own, timed by a ``ThreadClock`` started and read there."""
    out: list[ThreadTimes | None] = []

    def run() -> None:
        clock = ThreadClock()
        work()
        out.append(clock.elapsed())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out[0] is not None
    return out[0]


def test_a_spinning_thread_is_on_a_cpu_and_a_sleeping_one_is_not():
    spun = _on_thread(lambda: _spin(0.3))
    slept = _on_thread(lambda: time.sleep(0.3))
    assert 0.15 < spun.on_cpu <= 0.35
    assert slept.on_cpu < 0.05 and slept.waiting < 0.05  # blocked: neither on a CPU nor runnable


def test_a_thread_sharing_its_cpu_with_a_busy_process_waits_for_it():
    cpu = min(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                           preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        time.sleep(0.2)  # the hog is spinning

        def pinned_spin() -> None:
            os.sched_setaffinity(0, {cpu})  # this thread only (Linux: pid 0 is the calling thread)
            _spin(0.6)

        shared = _on_thread(pinned_spin)
    finally:
        hog.kill()
        hog.wait()
    # Two runnable tasks on one CPU: each gets about half, and waits the other half.
    assert shared.waiting > 0.1 and shared.on_cpu < 0.55
    assert shared.on_cpu + shared.waiting <= 0.7
