"""A KV-event subscriber for tests, decoding with vLLM's own classes (``KVEventBatch``).

``EventTap(endpoints)`` subscribes to the PUB sockets given and collects every batch on a thread
of its own; ``replay(replay_endpoint, start)`` asks a ROUTER for the buffered batches from
``start`` on, as a subscriber that joins late does.
"""

from __future__ import annotations

import threading

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


class EventTap:
    def __init__(self, endpoints: list[str]) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVTIMEO, 100)
        for endpoint in endpoints:
            self._sub.connect(endpoint)
        self.batches: list[tuple[bytes, int, KVEventBatch]] = []  # (topic, seq, batch) as received
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                topic, seq, payload = self._sub.recv_multipart()
            except zmq.Again:
                continue
            self.batches.append((topic, int.from_bytes(seq, "big"), _decoder.decode(payload)))

    def events(self) -> list:
        return [e for _, _, batch in list(self.batches) for e in batch.events]

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self._ctx.destroy(linger=0)


def replay(endpoint: str, start: int = 0, timeout_ms: int = 5000) -> list[tuple[int, KVEventBatch]]:
    """Every batch a publisher still buffers from sequence ``start`` on, through its replay socket."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            _, _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return got
            got.append((int.from_bytes(seq, "big"), _decoder.decode(payload)))
    finally:
        ctx.destroy(linger=0)


def stored_hashes(events: list) -> list:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def removed_hashes(events: list) -> list:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def vllm_block_hashes(tokens: list[int], block_size: int, extra_keys=None) -> list[int]:
    """The hashes vLLM gives the whole blocks of ``tokens`` (its default sha256, as its events
    publish them), computed with vLLM's own functions."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    fn = get_hash_fn_by_name("sha256")
    kcu.init_none_hash(fn)
    hashes, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = kcu.hash_block_tokens(fn, parent, tokens[start:start + block_size], extra_keys)
        hashes.append(kcu.maybe_convert_block_hash(parent))
    return hashes


def credited(events) -> set:
    """What a consumer applying ``events`` in order ends up crediting."""
    held: set = set()
    for e in events:
        if isinstance(e, AllBlocksCleared):
            held.clear()
        elif isinstance(e, BlockStored):
            held.update(e.block_hashes)
        else:
            held.difference_update(e.block_hashes)
    return held
