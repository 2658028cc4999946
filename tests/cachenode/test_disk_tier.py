"""The disk tier on its own, over real files in a temporary directory: what it writes, what a
restart rebuilds, and what a crash, a corrupt or foreign file, another node's directory, a full
budget and a stalled disk do to it.  (With real node processes: ``test_disk_node.py``.)"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time

import numpy as np
import pytest
from polling import wait_for

from kvring.cachenode.disk.identity import DiskIdentity, DiskInUse
from kvring.cachenode.disk.index import DiskIndex
from kvring.cachenode.disk.marks import MARKS_FILE, load_marks, save_marks
from kvring.cachenode.disk.records import DATA_SUFFIX, JOURNAL_SUFFIX, Stored, decode_blocks, segment_name
from kvring.cachenode.disk.tier import DiskConfig, DiskTier, ReadResult
from kvring.common.chunk import ChunkBlocks, ChunkItem

IDENTITY = DiskIdentity(cluster="c", node_id="node-0", contract='{"chunk_size": 256}')
rng = np.random.default_rng(7)


def _item(size: int = 64 << 10, namespace: str = "ns", blocks: bool = False) -> ChunkItem:
    """A chunk; with ``blocks``, naming one vLLM block and an anchor (both derived from its key)."""
    item = ChunkItem.of(os.urandom(16), rng.integers(0, 255, size, dtype=np.uint8), [4, size // 4], "uint8", 16,
                        namespace)
    if blocks:
        item = item.with_blocks(ChunkBlocks.of([int.from_bytes(item.key[:8], "little")], None, list(range(16)), 16))
        item = item.with_anchor(_anchor(item.key))
    return item


def _anchor(key: bytes) -> bytes:
    return b"anchor:" + key[:8]


def _told(into: list):
    """An ``on_gone`` that records ``(key, blocks)`` from the journal entry it is told, blocks
    None also where the entry lost the chunk's anchor (the tests then fail on those blocks)."""
    def on_gone(key: bytes, stored: Stored | None) -> None:
        whole = stored is not None and stored.anchor == _anchor(key)
        into.append((key, decode_blocks(stored.blocks) if whole else None))
    return on_gone


def _open(path, identity: DiskIdentity = IDENTITY, **kw) -> DiskTier:
    config = DiskConfig(str(path), capacity=kw.pop("capacity", 256 << 20), **kw)
    tier = DiskTier(config, identity, take=lambda n: np.empty(n, dtype=np.uint8))
    tier.open()
    return tier


def _settle(tier: DiskTier, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while tier.stats()["queued"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tier.stats()["queued"], "the writer did not empty its queue"


def _read(tier: DiskTier, key: bytes) -> ReadResult:
    done, out = threading.Event(), []
    tier.read(key, lambda result: (out.append(result), done.set()))
    assert done.wait(10)
    return out[0]


def _same(tier: DiskTier, item: ChunkItem) -> bool:
    result = _read(tier, item.key)
    return result.meta is not None and bytes(result.buf) == bytes(item.payload) and result.meta.checksums == \
        item.meta.checksums


def _flip(path, location, at: int) -> None:
    """Flip one byte of a record, ``at`` bytes into it."""
    with open(path / segment_name(location.segment, DATA_SUFFIX), "r+b") as f:
        f.seek(location.offset + at)
        byte = f.read(1)
        f.seek(location.offset + at)
        f.write(bytes([byte[0] ^ 0xFF]))


def _write(tier: DiskTier, items: list[ChunkItem]) -> None:
    for item in items:
        assert tier.write(item.key, item.meta, item.payload)
    _settle(tier)


def test_chunks_come_back_after_a_restart_deletes_and_flushes_do_not(tmp_path):
    items = [_item(namespace="a") for _ in range(10)] + [_item(namespace="b") for _ in range(10)]
    tier = _open(tmp_path)
    _write(tier, items)
    assert not tier.write(items[0].key, items[0].meta, items[0].payload)  # already there
    assert all(_same(tier, item) for item in items)
    tier.close()

    tier = _open(tmp_path)
    report = tier.stats()["rebuild"]
    assert report["chunks"] == 20 and report["bytes"] > 20 * (64 << 10) and not any(report["dropped"].values())
    assert all(_same(tier, item) for item in items)
    assert tier.delete(items[0].key) and not tier.delete(items[0].key)
    assert sorted(tier.delete_namespace("b")) == sorted(item.key for item in items[10:])
    assert items[1].key in tier
    assert _read(tier, items[0].key).missing == "gone"
    tier.close()

    tier = _open(tmp_path)  # the tombstones were journaled: nothing deleted comes back
    assert len(tier) == 9 and all(item.key in tier for item in items[1:10])
    assert not any(item.key in tier for item in items[10:]) and items[0].key not in tier
    assert tier.keys_after(b"", 100) == sorted(item.key for item in items[1:10])
    tier.close()


def test_what_a_crash_leaves_half_written_is_cut_and_the_rest_served(tmp_path):
    items = [_item() for _ in range(12)]
    tier = _open(tmp_path)
    _write(tier, items)
    number = tier._segment.number
    tier.close()
    data = tmp_path / segment_name(number, DATA_SUFFIX)
    journal = tmp_path / segment_name(number, JOURNAL_SUFFIX)
    with open(data, "ab") as f:  # a record written, its journal entry not (killed between the two)
        f.write(os.urandom(5000))
    with open(journal, "ab") as f:  # an entry torn in the middle of its append
        f.write(b"\x40\x00\x00\x00\x01\x02")
    tier = _open(tmp_path)
    dropped = tier.stats()["rebuild"]["dropped"]
    assert dropped["unjournaled_bytes"] == 5000 and dropped["torn_journal_bytes"] == 6
    assert all(_same(tier, item) for item in items)
    tier.close()

    # A data file cut short (a lost tail): the entries past its end are dropped, the rest served.
    os.truncate(data, os.path.getsize(data) - 10)
    tier = _open(tmp_path)
    assert tier.stats()["rebuild"]["dropped"]["entries_past_end"] == 1 and len(tier) == 11
    assert sum(_same(tier, item) for item in items) == 11
    tier.close()


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_corrupt_record_is_counted_dropped_told_as_gone_and_never_served(tmp_path, where):
    items = [_item(blocks=True) for _ in range(3)]
    tier = _open(tmp_path)
    gone = []
    tier.on_gone = _told(gone)
    _write(tier, items)
    location = tier.index.entries[items[1].key]
    _flip(tmp_path, location, location.length - 100 if where == "payload" else 30)
    assert _read(tier, items[1].key).missing == "corrupt"
    assert tier.stats()["corrupt"] == 1 and items[1].key not in tier
    # Its blocks, from its journal entry, as for an eviction (the node announces them removed).
    assert [(k, b.block_hashes) for k, b in gone] == [(items[1].key, [int.from_bytes(items[1].key[:8], "little")])]
    assert _read(tier, items[1].key).missing == "gone" and len(gone) == 1  # told once
    assert _same(tier, items[0]) and _same(tier, items[2])
    tier.close()
    tier = _open(tmp_path)  # dropped for good: the drop was journaled
    assert items[1].key not in tier and len(tier) == 2
    tier.close()


@pytest.mark.parametrize("other", [
    DiskIdentity(cluster="c", node_id="node-1", contract=IDENTITY.contract),
    DiskIdentity(cluster="other", node_id="node-0", contract=IDENTITY.contract),
    DiskIdentity(cluster="c", node_id="node-0", contract='{"chunk_size": 128}'),
], ids=["other-node", "other-cluster", "other-contract"])
def test_a_directory_written_under_another_identity_is_cleared_never_served(tmp_path, other, caplog):
    items = [_item() for _ in range(4)]
    tier = _open(tmp_path, identity=other)
    _write(tier, items)
    tier.close()
    (tmp_path / "notes.txt").write_text("someone else's file")
    with caplog.at_level(logging.WARNING, logger="kvring.cachenode.disk.identity"):
        tier = _open(tmp_path)
    assert "written under another identity" in caplog.text and "none of them is served" in caplog.text
    assert len(tier) == 0 and not any(item.key in tier for item in items)
    assert tier.stats()["rebuild"]["cleared"].startswith("written under another identity")
    assert (tmp_path / "notes.txt").read_text() == "someone else's file"  # not ours: left alone
    assert "not kvring's (notes.txt)" in caplog.text
    tier.close()


def test_segments_without_an_identity_are_cleared_and_a_second_process_is_refused(tmp_path):
    tier = _open(tmp_path)
    _write(tier, [_item() for _ in range(2)])
    with pytest.raises(DiskInUse, match="in use by another kvring node"):
        _open(tmp_path)
    tier.close()
    os.unlink(tmp_path / "kvring-disk.json")
    tier = _open(tmp_path)
    assert len(tier) == 0 and tier.stats()["rebuild"]["cleared"] == "segment files without an identity file"
    tier.close()


def test_past_its_budget_the_oldest_segments_go_first_and_their_blocks_are_told(tmp_path):
    evicted = []
    tier = DiskTier(DiskConfig(str(tmp_path), capacity=64 << 20, segment_bytes=16 << 20), IDENTITY,
                    take=lambda n: np.empty(n, dtype=np.uint8), on_gone=_told(evicted))
    tier.open()
    items = [_item(1 << 20, blocks=True) for _ in range(150)]
    _write(tier, items)
    stats = tier.stats()
    assert stats["used"] <= 64 << 20 and stats["evicted_segments"] >= 5
    held = [item.key in tier for item in items]
    assert not held[0] and all(held[-40:])  # oldest gone, newest kept
    assert held == sorted(held)  # first in, first out
    assert {k for k, _ in evicted} == {item.key for item, h in zip(items, held) if not h}
    assert all(b is not None and b.block_hashes == [int.from_bytes(k[:8], "little")] for k, b in evicted)
    assert all(_same(tier, item) for item in items[-40:])
    tier.close()


def _intact(tier: DiskTier, item: ChunkItem) -> bool:
    """``item`` is on disk, whole and unchanged, looked at the way the scrub does (which is not a
    read that earns it a second chance)."""
    location = tier.location(item.key)
    if location is None:
        return False
    meta, buf = tier.read_record(item.key, location)
    return bytes(buf) == bytes(item.payload) and meta.checksums == item.meta.checksums


def _blocks(tier: DiskTier, key: bytes) -> ChunkBlocks | None:
    """The vLLM blocks ``key``'s journal entry records."""
    done, out = threading.Event(), []
    tier.entry_of(tier.location(key), lambda stored: (out.append(decode_blocks(stored.blocks)), done.set()))
    assert done.wait(10)
    return out[0]


def _second_chance_tier(path, **kw) -> tuple[DiskTier, list]:
    """A 64 MiB tier of 16 MiB segments, fed 1 MiB chunks (15 a segment); ``on_gone``'s calls."""
    gone: list = []
    tier = DiskTier(DiskConfig(str(path), capacity=64 << 20, segment_bytes=16 << 20, **kw), IDENTITY,
                    take=lambda n: np.empty(n, dtype=np.uint8), on_gone=_told(gone))
    tier.open()
    return tier, gone


@pytest.mark.parametrize("copy", ["kernel", "through the process"])
def test_a_segment_carries_what_was_read_from_it_forward_once(tmp_path, monkeypatch, copy):
    """Past the budget the oldest segment goes, but the chunks read from it since they were
    written are copied to the newest segment first (journaled there: a restart keeps them), once:
    unread meanwhile, they go the next time round.  A chunk deleted after its read is not carried,
    and one deleted after it was carried does not come back.  Where the filesystem cannot copy in
    the kernel, the copy goes through the process, with the same result."""
    if copy != "kernel":
        def no_kernel_copy(*args):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", no_kernel_copy)
    tier, gone = _second_chance_tier(tmp_path)
    items = [_item(1 << 20, blocks=True) for _ in range(160)]
    _write(tier, items[:40])  # segments 1 (items 0-14), 2 (15-29), 3 (30-)
    for item in items[:4]:
        assert _same(tier, item)  # served: read from the first segment
    assert tier.delete(items[2].key)
    _write(tier, items[40:80])
    stats = tier.stats()
    assert stats["evicted_segments"] >= 1 and stats["used"] <= 64 << 20
    held = [item.key in tier for item in items[:15]]
    assert held == [True, True, False, True] + [False] * 11
    assert stats["carried"] == 3 and stats["carried_bytes"] == 3 * tier.location(items[0].key).length
    assert all(tier.location(items[i].key).segment > 1 and _intact(tier, items[i]) for i in (0, 1, 3))
    evicted = {item.key for item in items[:80] if item.key not in tier} - {items[2].key}  # (a delete is no eviction)
    assert {item.key for item in items[4:15]} <= evicted and {k for k, _ in gone} == evicted  # carried: never gone
    assert all(b is not None and b.block_hashes == [int.from_bytes(k[:8], "little")] for k, b in gone)
    tier.close()

    tier, gone = _second_chance_tier(tmp_path)  # a restart keeps what was carried, with its blocks
    assert all(_intact(tier, items[i]) for i in (0, 1, 3)) and items[2].key not in tier
    assert _blocks(tier, items[0].key).block_hashes == [int.from_bytes(items[0].key[:8], "little")]
    assert tier.delete(items[1].key)
    tier.close()

    tier, gone = _second_chance_tier(tmp_path)
    assert items[1].key not in tier and items[0].key in tier
    _write(tier, items[80:160])  # nobody reads them now: they go with their new segment
    assert not any(items[i].key in tier for i in range(4)) and tier.stats()["carried"] == 0
    assert {items[0].key, items[3].key} <= {k for k, b in gone if b is not None}  # told whole, carried or not
    tier.close()


@pytest.mark.parametrize("marks", ["kept", "damaged", "unreadable"])
def test_what_was_read_keeps_its_second_chance_over_a_graceful_stop(tmp_path, caplog, marks):
    """A graceful stop (a rolling upgrade) writes what was read from each segment; the next start
    takes it back, so the first eviction after it still carries what was read before it.  A
    damaged file, or one that cannot be read (a directory in its place), is ignored with a log
    line: the node starts, nothing is carried, nothing wrong.  A damaged file is removed at the
    start; a good one stays until a save replaces it (a crash right after the start keeps it)."""
    tier, _ = _second_chance_tier(tmp_path)
    items = [_item(1 << 20) for _ in range(80)]
    _write(tier, items[:40])
    assert all(_same(tier, item) for item in items[:3])  # read: marked
    tier.close()
    path = tmp_path / MARKS_FILE
    assert path.exists()
    if marks == "damaged":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    elif marks == "unreadable":
        path.unlink()
        path.mkdir()
    with caplog.at_level(logging.WARNING, logger="kvring.cachenode.disk.marks"):
        tier, _ = _second_chance_tier(tmp_path)
    assert path.is_dir() if marks == "unreadable" else path.exists() == (marks == "kept")
    _write(tier, items[40:])  # the first segment goes
    carried = 3 if marks == "kept" else 0
    assert tier.stats()["rebuild"]["read_marks"] == carried and tier.stats()["carried"] == carried
    assert [item.key in tier for item in items[:4]] == [marks == "kept"] * 3 + [False]
    assert all(_intact(tier, item) for item in items[:carried])
    assert ("damaged" in caplog.text) == (marks == "damaged")
    assert ("cannot be read" in caplog.text) == (marks == "unreadable")
    tier.close()


def test_the_writer_saves_the_read_marks_while_they_change_and_not_otherwise(tmp_path):
    """Every ``marks_interval`` the writer thread saves the marks if one was added since the last
    save (a crash keeps them); with nothing new it writes nothing.  What it saved is what a start
    takes back; with no marks left, a save removes the file."""
    tier, _ = _second_chance_tier(tmp_path, marks_interval=0.2)
    path = tmp_path / MARKS_FILE
    items = [_item(1 << 20) for _ in range(10)]
    _write(tier, items)
    time.sleep(0.5)
    assert not path.exists()  # nothing read: nothing to save
    assert _same(tier, items[0]) and _same(tier, items[1])
    wait_for(path.exists, 5, "the writer's save of two marks")
    saved = path.stat().st_mtime_ns
    assert _same(tier, items[0])  # read again: no new mark
    time.sleep(0.6)
    assert path.stat().st_mtime_ns == saved
    assert _same(tier, items[2])
    wait_for(lambda: path.stat().st_mtime_ns != saved, 5, "the save of the third mark")
    index = DiskIndex()
    for number, segment in tier.index.segments.items():
        index.segments[number] = type(segment)(number)
    index.entries.update(tier.index.entries)
    assert load_marks(str(tmp_path), index) == 3 and path.exists()  # a good file stays until replaced
    for segment in tier.index.segments.values():
        segment.read.clear()
    assert save_marks(str(tmp_path), tier.index) == 0 and not path.exists()
    tier.close()


def test_a_carry_that_fails_lets_the_rest_go_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    """The device fails while read chunks are being carried (EIO, not a filesystem that cannot
    copy in the kernel): the failure is counted, the segment goes as it would under fifo, what
    was copied before the failure is kept whole, and a restart finds no torn record."""
    tier, gone = _second_chance_tier(tmp_path)
    items = [_item(1 << 20) for _ in range(80)]
    _write(tier, items[:40])
    assert all(_same(tier, item) for item in items[:3])
    copy_file_range, calls = os.copy_file_range, []

    def failing_second_copy(*args):
        calls.append(args)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return copy_file_range(*args)

    monkeypatch.setattr(os, "copy_file_range", failing_second_copy)
    _write(tier, items[40:])
    stats = tier.stats()
    assert stats["carry_errors"] == 1 and stats["carried"] == 1 and stats["used"] <= 64 << 20
    assert [item.key in tier for item in items[:3]] == [True, False, False]
    assert _intact(tier, items[0]) and {items[1].key, items[2].key} <= {k for k, _ in gone}
    monkeypatch.undo()
    tier.close()

    tier, _ = _second_chance_tier(tmp_path)
    assert not any(tier.stats()["rebuild"]["dropped"].values())
    assert _intact(tier, items[0]) and all(_intact(tier, item) for item in items[40:] if item.key in tier)
    tier.close()


def test_a_read_that_finds_its_segment_gone_follows_the_chunk_carried_forward(tmp_path):
    """A GET looks a chunk up, then reads it on a reader thread; if the chunk's segment is evicted
    in between and the chunk carried forward, the read finds it where it went (the reader's
    lookup replayed here with the location it held) rather than answering a miss."""
    tier, _ = _second_chance_tier(tmp_path)
    items = [_item(1 << 20) for _ in range(80)]
    _write(tier, items[:40])
    assert _same(tier, items[0])
    held = tier.location(items[0].key)
    _write(tier, items[40:])
    assert tier.location(items[0].key).segment != held.segment and not os.path.exists(
        tmp_path / segment_name(held.segment, DATA_SUFFIX))
    done, out = threading.Event(), []
    tier._read(items[0].key, held, lambda result: (out.append(result), done.set()))
    assert done.wait(10) and out[0].meta is not None and bytes(out[0].buf) == bytes(items[0].payload)
    assert items[1].key not in tier  # evicted for good (never read): a miss
    tier._read(items[1].key, dataclasses.replace(held, offset=0), out.append)
    assert out[1].missing == "gone"
    tier.close()


def _open_deleted(path) -> list[str]:
    """This process's open files under ``path`` whose names are gone (unlinked, still open)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)) and target.endswith(" (deleted)"):
            out.append(target)
    return out


@pytest.mark.parametrize("end", ["served", "cancelled by close", "not kept open"])
def test_a_read_asked_for_before_its_segment_is_evicted_is_served_from_the_file_kept_open(tmp_path, caplog,
                                                                                          monkeypatch, end):
    """``read`` pins the chunk's segment as it looks the chunk up; evicted before the reader gets
    to it (one reader thread, busy with a held read), the segment's data file is kept open past
    its unlinking, the read is served whole from it, and the last pinned read closes it.  A read
    cancelled by ``close`` before it ran lets go of its pin too: no file is left open.  Where the
    evicting writer cannot open the file (out of descriptors), it says so, and the reads answer
    misses (recomputed), never other bytes."""
    tier, _ = _second_chance_tier(tmp_path, read_threads=1, eviction="fifo")
    if end == "not kept open":
        open_data = tier._open_data

        def no_descriptors_for_the_writer(number):
            if threading.current_thread().name == "kvring-disk-writer":
                raise OSError(errno.EMFILE, "Too many open files")
            return open_data(number)

        monkeypatch.setattr(tier, "_open_data", no_descriptors_for_the_writer)
    items = [_item(1 << 20) for _ in range(80)]
    _write(tier, items[:40])
    first = tier.location(items[0].key).segment
    release, started = threading.Event(), threading.Event()
    read_record = tier.read_record

    def held(key, location, take=None, fd=-1):
        if key == items[0].key:
            started.set()
            assert release.wait(30)
        return read_record(key, location, take, fd)

    tier.read_record = held
    out: dict[bytes, ReadResult] = {}
    done = threading.Event()
    for item in items[:2]:  # the first holds the only reader; the second waits behind it
        tier.read(item.key, lambda result, key=item.key: (out.__setitem__(key, result), len(out) == 2 and done.set()))
    assert started.wait(10)
    _write(tier, items[40:])
    assert items[0].key not in tier and items[1].key not in tier  # their segment went
    assert not os.path.exists(tmp_path / segment_name(first, DATA_SUFFIX))
    kept = end != "not kept open"
    assert tier.stats()["kept_for_reads"] == int(kept) and len(_open_deleted(tmp_path)) == int(kept)
    if end == "cancelled by close":
        tier.close()  # the second read never runs
    release.set()
    if end == "not kept open":
        assert done.wait(10) and all(out[item.key].missing == "gone" for item in items[:2])
        assert tier.stats()["read_gone"] == 2 and "cannot be kept open" in caplog.text
        tier.close()
    if end == "served":
        assert done.wait(10)
        for item in items[:2]:
            assert out[item.key].meta is not None and bytes(out[item.key].buf) == bytes(item.payload)
        assert tier.stats()["read_gone"] == 0
        tier.close()
    wait_for(lambda: not _open_deleted(tmp_path), 10, "the kept file closed")


def test_an_evicted_segment_carries_at_most_half_its_bytes_and_fifo_carries_none(tmp_path):
    """Every chunk of the oldest segment read: it carries the first half of its bytes (so each
    eviction frees at least the other half, and a tier where everything is read still cycles);
    with ``fifo`` it carries nothing."""
    for eviction, kept in (("second-chance", 7), ("fifo", 0)):
        path = tmp_path / eviction
        path.mkdir()
        tier, _ = _second_chance_tier(path, eviction=eviction)
        items = [_item(1 << 20) for _ in range(80)]
        _write(tier, items[:40])
        assert all(_same(tier, item) for item in items[:15])
        _write(tier, items[40:])
        stats = tier.stats()
        assert stats["eviction"] == eviction and stats["used"] <= 64 << 20
        assert [item.key in tier for item in items[:15]] == [True] * kept + [False] * (15 - kept)
        assert stats["carried"] == kept and all(_intact(tier, item) for item in items[:kept])
        tier.close()


def test_a_start_under_a_lowered_capacity_lets_the_oldest_segments_go_at_once(tmp_path):
    """A capacity lowered across a restart (the flag, or a CacheCluster's spec.disk.capacity) is
    kept from the start, not from the next write: the oldest segments go, the newest serve."""
    config = DiskConfig(str(tmp_path), capacity=96 << 20, segment_bytes=16 << 20)
    tier = DiskTier(config, IDENTITY, take=lambda n: np.empty(n, dtype=np.uint8))
    tier.open()
    items = [_item(1 << 20) for _ in range(80)]
    _write(tier, items)
    assert tier.stats()["used"] > 64 << 20
    tier.close()

    tier = DiskTier(DiskConfig(str(tmp_path), capacity=40 << 20, segment_bytes=16 << 20), IDENTITY,
                    take=lambda n: np.empty(n, dtype=np.uint8))
    tier.open()
    stats = tier.stats()
    assert stats["used"] <= 40 << 20 and stats["rebuild"]["dropped"]["over_capacity_bytes"] > 24 << 20
    assert stats["rebuild"]["chunks"] == 80 and stats["written"] == 0  # what it found; nothing written yet
    held = [item.key in tier for item in items]
    assert not held[0] and held[-1] and held == sorted(held)  # oldest gone, newest kept
    assert all(_same(tier, item) for item, h in zip(items, held) if h)
    assert not any(os.path.exists(tmp_path / segment_name(n, DATA_SUFFIX)) for n in range(1, 3))
    tier.close()

    tier = DiskTier(config, IDENTITY, take=lambda n: np.empty(n, dtype=np.uint8))  # back up: nothing returns
    tier.open()
    assert [item.key in tier for item in items] == held and not any(tier.stats()["rebuild"]["dropped"].values())
    tier.close()


def test_a_stalled_disk_bounds_its_queue_and_deletes_win_over_queued_writes(tmp_path):
    tier = _open(tmp_path, write_queue=1 << 20)
    tier.stall(1.0)
    items = [_item(256 << 10) for _ in range(8)]
    t0 = time.monotonic()
    accepted = [tier.write(item.key, item.meta, item.payload) for item in items]
    assert time.monotonic() - t0 < 0.5  # queueing never waits on the disk
    assert accepted[:4] == [True] * 4 and not any(accepted[5:])
    assert tier.stats()["write_skipped"] >= 3 and tier.stats()["stalled"]
    assert tier.delete(items[0].key)  # still queued: cancelled
    _settle(tier)
    assert items[0].key not in tier and all(items[i].key in tier for i in range(1, 4))
    tier.close()
    tier = _open(tmp_path)
    assert items[0].key not in tier and len(tier) == sum(accepted) - 1
    tier.close()


def test_the_scrub_finds_a_corrupt_record_nobody_reads_and_tells_it_gone(tmp_path):
    items = [_item(blocks=True) for _ in range(6)]
    tier = _open(tmp_path, scrub_rate=0)
    _write(tier, items)
    lengths = [tier.location(item.key).length for item in items]
    _flip(tmp_path, tier.location(items[2].key), lengths[2] - 100)
    tier.close()
    # Bit rot while the node was down: the first pass, at start, finds it without any GET.
    tier = _open(tmp_path, scrub_rate=64 << 20, scrub_interval=3600)
    gone = []
    tier.on_gone = _told(gone)
    deadline = time.monotonic() + 10
    while tier.stats()["scrub_passes"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = tier.stats()
    assert (stats["scrub_passes"], stats["scrubbed"], stats["corrupt"], stats["reads"]) == (1, 6, 1, 0)
    assert stats["scrubbed_bytes"] == sum(lengths)
    assert items[2].key not in tier
    assert [(k, b.block_hashes) for k, b in gone] == [(items[2].key, [int.from_bytes(items[2].key[:8], "little")])]
    assert all(_same(tier, item) for i, item in enumerate(items) if i != 2)
    # What is written and rots later waits for the next pass (an hour away): a GET finds it first.
    more = _item(blocks=True)
    _write(tier, [more])
    _flip(tmp_path, tier.location(more.key), 40)
    time.sleep(0.3)
    assert tier.stats()["scrub_passes"] == 1 and tier.stats()["corrupt"] == 1
    assert _read(tier, more.key).missing == "corrupt"
    tier.close()


def test_the_scrub_keeps_to_its_rate_and_skips_what_goes_meanwhile(tmp_path):
    items = [_item(256 << 10) for _ in range(24)]  # 6 MiB: about 3 s at 2 MiB/s
    tier = _open(tmp_path, scrub_rate=0)
    _write(tier, items)
    tier.close()
    rate = 2 << 20
    began = time.monotonic()
    tier = _open(tmp_path, scrub_rate=rate, scrub_interval=3600)
    time.sleep(0.5)
    for item in items[12:18]:  # in the middle of the pass, ahead of where the scrub is
        assert tier.delete(item.key)
    time.sleep(1.0)
    scrubbed = tier.stats()["scrubbed_bytes"]
    one = tier.location(items[0].key).length
    # Paced: no more than the rate allows since the start, and one record ahead.
    assert one <= scrubbed <= rate * (time.monotonic() - began) + one
    deadline = time.monotonic() + 20
    while tier.stats()["scrub_passes"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = tier.stats()
    # The pass read the 18 records left, not the 6 deleted after it began.
    assert (stats["scrub_passes"], stats["scrubbed"], stats["corrupt"], len(tier)) == (1, 18, 0, 18)
    closing = time.monotonic()
    tier.close()
    assert time.monotonic() - closing < 2  # the scrub stops within a record
