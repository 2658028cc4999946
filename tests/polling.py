"""Waiting on real processes in tests: a condition within a time bound, a node's readiness.

Importable as ``polling`` from every test folder (``tests/`` holds the root conftest, which
pytest puts on ``sys.path``)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "", interval: float = 0.05) -> Any:
    """``predicate()``'s first truthy value within ``timeout`` seconds; else an AssertionError
    naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}; last value: {last!r}")


def read_until(stream, marker: str, timeout: float = 60.0) -> str:
    """The lines of ``stream`` (a child's text stdout) up to and with the first that holds
    ``marker``; an AssertionError with what came if the stream ends first or the time runs out
    (checked between lines)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        assert line, f"the output ended before {marker!r}:\n" + "".join(lines)
        lines.append(line)
        if marker in line:
            return "".join(lines)
    raise AssertionError(f"no {marker!r} within {timeout}s:\n" + "".join(lines))


def readyz(admin_addr: str) -> int:
    """The HTTP status of a node's ``/readyz``."""
    try:
        with urllib.request.urlopen(f"{admin_addr}/readyz", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
