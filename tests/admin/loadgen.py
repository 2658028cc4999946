"""A load generator for the admin API, run as a process of its own: ``python -P loadgen.py`` reads
a ``LoadPlan`` as JSON on stdin and writes one ``[kind, status, seconds]`` per measured request
as JSON on stdout.

Its own process so that what it measures is the server: the test process holds every collected
test module (vLLM and torch included, ~700k objects), and one full pass of its garbage
collector, or a fixture's background thread holding the GIL, would add its pause to every
request in flight.  Here the collector is off while requests run.

aiohttp rather than httpx: httpx's AsyncClient spends ~10 ms of CPU per request with 100
connections open, which would measure the client, not the server.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import sys
import time

import aiohttp


async def _fire(session: aiohttp.ClientSession, requests: list[dict], concurrency: int) -> list[list]:
    """Send ``requests`` with at most ``concurrency`` in flight; each one's kind, status and latency."""
    slots = asyncio.Semaphore(concurrency)

    async def one(request: dict) -> list:
        kw: dict = {"headers": request.get("headers", {})}
        if "json" in request:
            kw["json"] = request["json"]
        if "data_b64" in request:
            kw["data"] = base64.b64decode(request["data_b64"])
        async with slots:
            started = time.perf_counter()
            async with session.request(request["method"], request["path"], **kw) as resp:
                await resp.read()
                return [request["kind"], resp.status, time.perf_counter() - started]
    return list(await asyncio.gather(*(one(r) for r in requests)))


async def _load(plan: dict) -> list[list]:
    """The warm-up (which opens the connections), then the measured requests over the same ones."""
    concurrency = plan["concurrency"]
    async with aiohttp.ClientSession(plan["url"], connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        warmup = await _fire(session, plan["warmup"], concurrency)
        gc.collect()
        gc.disable()
        measured = await _fire(session, plan["measured"], concurrency)
        gc.enable()
    return [*warmup, *measured]


def main() -> None:
    plan = json.load(sys.stdin)
    json.dump(asyncio.run(_load(plan)), sys.stdout)


if __name__ == "__main__":
    main()
