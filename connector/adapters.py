"""The identity of a LoRA adapter, as chunk keys use it (``KeyScope.adapter``).

vLLM's ``lora_int_id`` is assigned per process, so it cannot name an adapter across instances.
kvring names an adapter by one of:

- ``content`` (the default): a digest of the adapter's files (every regular file under its
  ``lora_path``, by relative name and bytes).  Two instances serving the same adapter files
  share chunks whatever they call the adapter; a changed file is a new identity.
- ``name``: the adapter's ``lora_name``, which the user controls; give each version its own
  name (``sql-v3``).  For adapters whose files the scheduler cannot read.

Digests are cached per path and file stamp (names, sizes, modification times), so an adapter's
files are read once per process, not once per request.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from .config import ADAPTER_IDENTITIES

_BLOCK = 1 << 20


class AdapterIdentities:
    """``lora_request`` -> identity string; thread-safe, digests cached by file stamp."""

    def __init__(self, mode: str = "content") -> None:
        if mode not in ADAPTER_IDENTITIES:
            raise ValueError(f"adapter_identity must be one of {ADAPTER_IDENTITIES}, got {mode!r}")
        self.mode = mode
        self._lock = threading.Lock()
        self._digests: dict[str, tuple[tuple, str]] = {}  # path -> (stamp, digest)

    def identity(self, lora_request) -> str:
        """The identity of ``lora_request`` ("" for none); ``OSError`` if its files cannot be read."""
        if lora_request is None:
            return ""
        if self.mode == "name":
            return "name:" + str(lora_request.lora_name)
        path = str(getattr(lora_request, "lora_path", "") or "")
        if not path:
            raise OSError(f"LoRA adapter {lora_request.lora_name!r} has no lora_path to identify it by")
        files = _files(Path(path))
        stamp = tuple((str(f.relative_to(path)), st.st_size, st.st_mtime_ns) for f, st in files)
        with self._lock:
            cached = self._digests.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        digest = "content:" + _digest(Path(path), [f for f, _ in files])
        with self._lock:
            self._digests[path] = (stamp, digest)
        return digest


def _files(root: Path) -> list[tuple[Path, os.stat_result]]:
    if not root.is_dir():
        raise OSError(f"LoRA adapter path {str(root)!r} is not a readable directory")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.is_file():
                found.append((p, p.stat()))
    if not found:
        raise OSError(f"LoRA adapter path {str(root)!r} holds no files")
    return found


def _digest(root: Path, files: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(_BLOCK):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()
