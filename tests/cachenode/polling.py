"""Waiting on real processes in tests: a condition within a time bound, a node's readiness."""

from __future__ import annotations

import time
import urllib.error
import urllib.request


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """``predicate()``'s first truthy value within ``timeout`` seconds, else an AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(interval)
    raise AssertionError(f"not within {timeout}s: {what}")


def readyz(admin_addr: str) -> int:
    """The HTTP status of a node's ``/readyz``."""
    try:
        with urllib.request.urlopen(f"{admin_addr}/readyz", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
