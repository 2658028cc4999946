"""`kvring bench disk`, part 1: GB/s of the disk tier beside the device's own sequential speed.

The device: a file of ``device_bytes`` in the filesystem of the disk directories, written then
read back sequentially in ``DEVICE_BLOCK`` pieces with direct I/O (``O_DIRECT``, from a
page-aligned ``mmap`` buffer), the write ending with ``fdatasync``.  Where the filesystem refuses
``O_DIRECT`` (``EINVAL``, e.g. tmpfs) it falls back to buffered I/O, synced with ``fdatasync`` and
dropped from the page cache (``POSIX_FADV_DONTNEED``) before the read, and ``direct`` says so.

The tier: one node process whose memory is far smaller than what a round stores, with a disk
tier (syncing, as a node does by default).  A round PUTs ``tier_bytes`` of chunks (``PUT``: until
every PUT is acknowledged, i.e. in memory and queued for the disk; ``PUT to disk``: until the
node's writer has written and synced every one of them), drops the segment files from the page
cache, then GETs every chunk back oldest first: by then each one is on disk only, so each GET
reads it from the device, checks it and promotes it (``GET from disk``; the node's ``reads``
counter says how many came from disk).  Every chunk read back is compared with what was PUT.
The write queue is set above a round's bytes so that no chunk is skipped by the disk.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvring.cachenode.disk.records import JOURNAL_SUFFIX, segment_number
from kvring.common.chunk import ChunkItem

DEVICE_BLOCK = 8 << 20
PROBE_FILE = "device-probe.bin"


class DiskBenchError(RuntimeError):
    """A measurement found wrong data or the node did not do what it was asked."""


def drop_page_cache(directory: str | Path, journals: bool = True) -> int:
    """Sync every segment file under ``directory`` (recursively) and drop it from the page cache,
    so that what follows reads it from the device; returns the files dropped."""
    dropped = 0
    for root, _, names in os.walk(directory):
        for name in names:
            if segment_number(name) is None or (not journals and name.endswith(JOURNAL_SUFFIX)):
                continue
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # evicted meanwhile
                continue
            try:
                os.fdatasync(fd)  # dirty pages are not dropped: write them first
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += 1
            finally:
                os.close(fd)
    return dropped


@dataclass(frozen=True)
class DeviceRound:
    write_gbps: float
    read_gbps: float
    direct: bool  # O_DIRECT taken; False: buffered + fdatasync + POSIX_FADV_DONTNEED


def device_round(directory: Path, nbytes: int, block: int = DEVICE_BLOCK) -> DeviceRound:
    """Write then read ``nbytes`` sequentially in ``directory`` (see the module doc)."""
    nbytes = max(block, nbytes // block * block)
    path = directory / PROBE_FILE
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
    buf.write(np.random.default_rng(0).bytes(block))
    try:
        direct = hasattr(os, "O_DIRECT")
        try:
            write_s = _write(path, buf, nbytes, direct)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not direct:
                raise
            direct = False
            write_s = _write(path, buf, nbytes, direct)
        read_s = _read(path, buf, nbytes, direct)
        return DeviceRound(nbytes / write_s / 1e9, nbytes / read_s / 1e9, direct)
    finally:
        buf.close()
        path.unlink(missing_ok=True)


def _open(path: Path, flags: int, direct: bool) -> int:
    return os.open(path, flags | os.O_CLOEXEC | (os.O_DIRECT if direct else 0), 0o600)


def _write(path: Path, buf: mmap.mmap, nbytes: int, direct: bool) -> float:
    fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
    try:
        t0 = time.perf_counter()
        for offset in range(0, nbytes, len(buf)):
            if os.pwrite(fd, buf, offset) != len(buf):
                raise OSError(errno.EIO, f"short write to {path}")
        os.fdatasync(fd)
        seconds = time.perf_counter() - t0
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return seconds
    finally:
        os.close(fd)


def _read(path: Path, buf: mmap.mmap, nbytes: int, direct: bool) -> float:
    fd = _open(path, os.O_RDONLY, direct)
    try:
        t0 = time.perf_counter()
        for offset in range(0, nbytes, len(buf)):
            if os.preadv(fd, [buf], offset) != len(buf):
                raise OSError(errno.EIO, f"short read from {path}")
        return time.perf_counter() - t0
    finally:
        os.close(fd)


# ---- the tier through a node ------------------------------------------------------------------

@dataclass(frozen=True)
class TierRound:
    put_gbps: float  # acknowledged (in memory, queued for the disk)
    put_disk_gbps: float  # until the node's writer has written and synced every chunk
    get_gbps: float  # GET of chunks on disk only: read, checked, promoted
    from_disk: int  # chunks the node read from disk in the GETs
    chunks: int
    write_skipped: int


def _payload(key: bytes, base: np.ndarray) -> np.ndarray:
    """A chunk's content: ``base`` with its key over the first bytes (no two chunks alike)."""
    out = base.copy()
    out[:len(key)] = np.frombuffer(key, np.uint8)
    return out


def chunk_key(tag: str, i: int) -> bytes:
    return hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest()


def _disk_stats(client, node: str) -> dict:
    return client.stats()[node]["disk"]


def _wait_written(client, node: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        disk = _disk_stats(client, node)
        if disk["queued"] == 0:
            return disk
        if time.monotonic() > deadline:
            raise DiskBenchError(f"the node's disk writer still had {disk['queued']} chunks queued after {timeout:.0f} s")
        time.sleep(0.005)


def tier_round(client, node: str, disk_dir: str, tag: str, chunks: int, chunk_bytes: int, layers: int,
               batch: int) -> TierRound:
    """One round through the node (see the module doc); the round's chunks are deleted at the end."""
    base = np.random.default_rng(len(tag)).integers(0, 256, chunk_bytes, dtype=np.uint8)
    shape = (layers, chunk_bytes // layers)
    keys = [chunk_key(tag, i) for i in range(chunks)]
    before = _disk_stats(client, node)
    put_s = 0.0
    t_first = None
    for start in range(0, chunks, batch):
        items = [ChunkItem.of(k, _payload(k, base), shape, "uint8", 256) for k in keys[start:start + batch]]
        t0 = time.perf_counter()
        t_first = t_first or t0
        stored = client.put_many(items)
        put_s += time.perf_counter() - t0
        if stored.count(0):
            raise DiskBenchError(f"{stored.count(0)} of {len(items)} PUTs were refused")
    written = _wait_written(client, node, timeout=600)
    put_disk_s = time.perf_counter() - t_first
    if written["written"] - before["written"] < chunks:
        raise DiskBenchError(f"only {written['written'] - before['written']} of {chunks} chunks reached the disk "
                             f"({written['write_skipped'] - before['write_skipped']} skipped)")
    drop_page_cache(disk_dir)
    get_s = 0.0
    for start in range(0, chunks, batch):
        want = keys[start:start + batch]
        t0 = time.perf_counter()
        got = client.get(want)
        get_s += time.perf_counter() - t0
        for key, chunk in zip(want, got):
            if chunk is None:
                raise DiskBenchError(f"chunk {key.hex()} was not served")
            if not np.array_equal(np.frombuffer(chunk.data, np.uint8), _payload(key, base)):
                raise DiskBenchError(f"chunk {key.hex()} came back with other bytes")
    after = _disk_stats(client, node)
    client.delete(keys)
    total = chunks * chunk_bytes
    return TierRound(total / put_s / 1e9, total / put_disk_s / 1e9, total / get_s / 1e9,
                     after["reads"] - before["reads"], chunks, after["write_skipped"] - before["write_skipped"])

