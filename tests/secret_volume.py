"""What the kubelet does to a Secret's volume (its ``AtomicWriter``), for tests of processes that
follow their mounted credentials: the files are symlinks ``name -> ..data/name``, ``..data`` is a
symlink to a directory of this version's files, and a new version is written into a directory of
its own and swapped in with one rename of ``..data``.  A reader sees the old set or the new,
never a mix."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

_versions = itertools.count(1)


def publish(directory: Path, files: dict[str, bytes]) -> None:
    """Make ``files`` the volume's content in one swap; the links of keys ``files`` lacks are
    removed, as the kubelet does (plain files beside them are left alone)."""
    directory = Path(directory)
    version = directory / f"..version-{os.getpid()}-{next(_versions)}"
    version.mkdir()
    for name, data in files.items():
        (version / name).write_bytes(data)
        (version / name).chmod(0o600)
    tmp = directory / "..data_tmp"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(version.name)
    old = os.readlink(directory / "..data") if (directory / "..data").is_symlink() else None
    os.replace(tmp, directory / "..data")  # the swap
    for name in files:
        link = directory / name
        if not link.is_symlink():  # a plain file (before the first swap) becomes the volume's link
            staged = directory / f"..{name}.link"
            staged.symlink_to(Path("..data") / name)
            os.replace(staged, link)
    for entry in directory.iterdir():
        if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in files:
            entry.unlink()
    if old is not None:
        for stale in (directory / old).iterdir():
            stale.unlink()
        (directory / old).rmdir()


def read(directory: Path, names: tuple[str, ...]) -> dict[str, bytes]:
    return {name: (Path(directory) / name).read_bytes() for name in names}
