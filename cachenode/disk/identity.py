"""Whose a disk directory is: the identity file, the lock, and clearing what is not ours.

A node writes ``kvring-disk.json`` (the format, its cluster, its node id and the cluster's
contract) into its disk directory before its first chunk.  A node that starts on a directory
written under another identity -- another cluster, another contract (its keys would mean other
chunks), another node id (it would serve chunks it does not own) or another format -- clears the
segment files there and logs one line saying why; it never serves them.  A directory holding
segment files but no identity file is cleared the same way.  Files that are not ours (any other
name) are left alone and never read.

Two processes must not write one directory: the first holds an exclusive ``flock`` on
``kvring-disk.lock`` for its life, and a second is refused with a message naming the directory.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import asdict, dataclass

from kvring.common.errors import KVRingError

from .records import segment_number

logger = logging.getLogger(__name__)

FORMAT = 1
IDENTITY_FILE = "kvring-disk.json"
LOCK_FILE = "kvring-disk.lock"


class DiskError(KVRingError):
    """The disk directory cannot be used (the message says why, for the user)."""


class DiskInUse(DiskError):
    """Another process holds the disk directory."""


@dataclass(frozen=True)
class DiskIdentity:
    cluster: str
    node_id: str
    contract: str  # the cluster's ``Contract`` as JSON
    format: int = FORMAT

    def differences(self, other: DiskIdentity) -> list[str]:
        mine, theirs = asdict(self), asdict(other)
        return [f"{name} {theirs[name]!r} (this node: {mine[name]!r})" for name in mine if mine[name] != theirs[name]]


def lock_directory(directory: str) -> int:
    """Create ``directory`` if needed and take its lock; returns the lock's descriptor (keep it
    open for as long as the directory is in use).  ``DiskInUse`` if another process has it."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise DiskError(f"cannot use --disk-dir {directory}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DiskInUse(f"--disk-dir {directory} is in use by another kvring node; give each node a directory "
                        "of its own") from None
    return fd


def claim_directory(directory: str, identity: DiskIdentity) -> str:
    """Make ``directory`` this node's: keep its segments if it was written under ``identity``,
    otherwise clear them.  Returns why it was cleared ("" if it was not)."""
    path = os.path.join(directory, IDENTITY_FILE)
    segments = [name for name in os.listdir(directory) if segment_number(name) is not None]
    reason = ""
    try:
        with open(path, "rb") as f:
            recorded = DiskIdentity(**json.loads(f.read()))
        differences = identity.differences(recorded)
        if differences:
            reason = "written under another identity: " + ", ".join(differences)
    except FileNotFoundError:
        if segments:
            reason = "segment files without an identity file"
    except (ValueError, TypeError) as exc:
        reason = f"unreadable identity file ({exc})"
    if reason and segments:
        logger.warning("disk %s: clearing %d segment files, %s; none of them is served", directory,
                       len(segments), reason)
        for name in segments:
            os.unlink(os.path.join(directory, name))
    elif reason:
        logger.warning("disk %s: %s; starting it afresh", directory, reason)
    if reason or not os.path.exists(path):
        _write_atomically(path, json.dumps(asdict(identity), sort_keys=True).encode())
    foreign = [name for name in os.listdir(directory)
               if segment_number(name) is None and name not in (IDENTITY_FILE, LOCK_FILE, IDENTITY_FILE + ".tmp")]
    if foreign:
        logger.warning("disk %s: ignoring %d files that are not kvring's (%s)", directory, len(foreign),
                       ", ".join(sorted(foreign)[:5]))
    return reason


def _write_atomically(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
