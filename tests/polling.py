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


def readyz(admin_addr: str) -> int:
    """The HTTP status of a node's ``/readyz``."""
    try:
        with urllib.request.urlopen(f"{admin_addr}/readyz", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
