"""The node's READY line reaches its launcher whole."""

from __future__ import annotations

import io
import sys
import threading
import time

import pytest

from kvring.cachenode.node import say
from kvring.local.cluster import NodeProcess


class _Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_a_line_is_one_write_so_another_threads_log_record_cannot_land_inside_it(monkeypatch):
    """A launcher reads the node's stdout and stderr as one pipe. A line written in two writes
    (``print`` writes the text, then the newline) let a log record of another thread land between
    them, and the launcher read ``READY ... admin=...<log text>`` (seen as a failed restart in
    ``bench disk``). Every line must be one write, newline included, even with threads writing."""
    out = _Writes()
    monkeypatch.setattr(sys, "stdout", out)
    line = "READY node=node-0 data=tcp://127.0.0.1:1 admin=http://127.0.0.1:2"
    threads = [threading.Thread(target=say, args=(f"{line} #{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out.calls) == sorted(f"{line} #{i}\n" for i in range(8))
    assert sorted(out.getvalue().splitlines()) == sorted(f"{line} #{i}" for i in range(8))


class _Garbled(NodeProcess):
    """A stand-in process whose READY line lacks its addresses (a real node cannot be made to
    print one; what is tested is the launcher's side)."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import time; print('READY node=x oops', flush=True); time.sleep(600)"]


def test_a_launcher_that_cannot_read_ready_kills_the_node_instead_of_leaking_it():
    """A start that fails after the process was spawned (here a READY line without addresses)
    raises one clear error and leaves no process running: the restart that hit the garbled line
    above left its node running after the bench had gone."""
    node = _Garbled("node-x", 1 << 20, "127.0.0.1:1")
    with pytest.raises(RuntimeError, match="said READY without its addresses: READY node=x oops"):
        node.start(timeout=20)
    assert node.proc is not None and node.proc.poll() is not None  # exited, and reaped


class _Silent(NodeProcess):
    """A stand-in process that hangs before its first line (a node stuck at start)."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(600)"]


def test_a_node_silent_past_its_timeout_is_a_timeout_and_is_killed():
    """The launcher reads the pipe behind a poll: a node that prints nothing does not hang the
    caller past ``timeout`` (a blocking ``readline`` did), and it is killed."""
    node = _Silent("node-s", 1 << 20, "127.0.0.1:1")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="node-s not ready within 1.5s"):
        node.start(timeout=1.5)
    assert 1.5 <= time.monotonic() - t0 < 10
    assert node.proc is not None and node.proc.poll() is not None
