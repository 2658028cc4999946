"""Is etcd there?  One read against each endpoint, before a command builds anything on it.

A node or a client keeps retrying an etcd that is away (it may be starting, or restarting):
right for a pod, wrong for a person who mistyped ``--etcd``.  Commands that take ``--etcd``
from a person (``kvring up --etcd``, ``ring``, ``trace --etcd``, ``bench data-plane --etcd``,
``drain --etcd``) call ``check_reachable`` first and stop at once, with one line naming the
endpoint and why, instead of waiting or printing that the cluster is up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from kvring.common.errors import MembershipError

from .etcd import Etcd
from .loop import etcd_loop
from .settings import EtcdSettings


def why_unreachable(exc: BaseException, waited: float) -> str:
    """A short reason from the gRPC error under ``exc`` (refused, unknown host, no answer)."""
    text = ""
    while exc is not None:
        text += f" {exc}"
        exc = exc.__cause__ or exc.__context__
    low = text.lower()
    if "connection refused" in low:
        return "connection refused"
    if "unimplemented" in low or "http2 header with status" in low:
        return "something answers there, but not as etcd"
    if "domain name not found" in low or "name or service not known" in low or "dns" in low or "resolv" in low:
        return "unknown host name"
    if "timeout" in low or "deadline" in low or "did not answer" in low or not text.strip():
        return f"no answer within {waited:.1f} s"
    return " ".join(text.split())[:200]


def check_reachable(settings: EtcdSettings, timeout: float = 5.0) -> None:
    """Return once one of ``settings.endpoints`` answers a read within ``timeout`` seconds;
    otherwise raise ``MembershipError`` naming the endpoints and the reason."""

    async def one(endpoint: str) -> None:
        etcd = Etcd(dataclasses.replace(settings, endpoints=(endpoint,), timeout=timeout / 2))
        try:
            await asyncio.wait_for(etcd.read_contract(), timeout)
        finally:
            await etcd.close()

    reasons = []
    for endpoint in settings.endpoints:
        started = time.monotonic()
        future = asyncio.run_coroutine_threadsafe(one(endpoint), etcd_loop())
        try:
            future.result(timeout + 1)
            return
        except Exception as exc:  # noqa: BLE001 (every failure is a reason to report)
            future.cancel()
            reasons.append(f"{endpoint} ({why_unreachable(exc, time.monotonic() - started)})")
    raise MembershipError(f"cannot reach etcd at {', '.join(reasons)}: check that etcd runs there and that --etcd "
                          "names its client address (host:port)")
