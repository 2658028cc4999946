"""A background reader for tests that restart nodes under load: it reads random chunks until
stopped and checks every byte it gets.

Importable as ``chunk_reader`` from every test folder (``tests/`` holds the root conftest, which
pytest puts on ``sys.path``)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvring.cachenode.client import ClusterClient


@dataclass
class Reader:
    """Reads ``batch`` random chunks of ``count`` at a time (chunk ``i`` is ``key(i)`` holding
    ``payload(i)``): reads, misses and wrong bytes are counted, errors kept."""

    client: ClusterClient
    count: int
    key: Callable[[int], bytes]
    payload: Callable[[int], bytes]
    batch: int = 16
    reads: int = 0
    misses: int = 0
    wrong: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        rng = random.Random(7)
        while not self.stop.is_set():
            picks = rng.sample(range(self.count), self.batch)
            try:
                chunks = self.client.get([self.key(i) for i in picks])
            except Exception as exc:  # counted: a read error is a degraded answer, not wrong KV
                self.errors.append(repr(exc))
                time.sleep(0.05)
                continue
            for i, chunk in zip(picks, chunks):
                self.reads += 1
                if chunk is None:
                    self.misses += 1
                elif bytes(chunk.data) != self.payload(i):
                    self.wrong.append(i)
