"""Prompts placed on the ring for tests with real engines: prompts whose parts a given node owns,
and a wait until every part of some prompts is stored.

Importable as ``placement`` from every test folder (like ``polling``).  A chunk key's namespace
names the model's directory, so where a prompt's parts land differs from run to run: tests that
stop a node pick prompts that have parts on it rather than assert it of fixed ones."""

from __future__ import annotations

import time

import numpy as np

from kvring.cachenode.client import ClusterClient
from kvring.connector.keys import KVLayout, request_keys


def prompts_on(client: ClusterClient, layout: KVLayout, node_id: str, rng: np.random.Generator, count: int,
               size: int) -> list[list[int]]:
    """``count`` random prompts of ``size`` tokens, each with a part whose primary owner is ``node_id``."""
    prompts: list[list[int]] = []
    while len(prompts) < count:
        p = rng.integers(10, 2000, size=size).tolist()
        if node_id in client.ring.primaries(layout.parts().keys(request_keys(layout, p))):
            prompts.append(p)
    return prompts


def wait_saved(client: ClusterClient, layout: KVLayout, prompts: list[list[int]], timeout: float = 120.0) -> None:
    """Until every part of every chunk of ``prompts`` is in the cluster (a save runs behind its step)."""
    keys = [k for p in prompts for k in layout.parts().keys(request_keys(layout, p))]
    deadline = time.monotonic() + timeout
    while not all(client.lookup(keys)):
        assert time.monotonic() < deadline, "the prompts' chunks were not all saved"
        time.sleep(0.2)
