"""A run's temporary directory: one place for everything a command writes while it runs, removed
when the run ends, however it ends (normally, on an error, on Ctrl-C, SIGTERM or SIGHUP).

``kvring up``, ``kvring demo``, ``kvring trace`` and the benchmarks run inside
``run_directory(name)``, which

- creates ``$TMPDIR/kvring-<name>-XXXX`` (``$TMPDIR`` or the system's, e.g. /tmp);
- points this process's ``tempfile`` and the ``TMPDIR`` every child inherits at it, so what
  they create with ``tempfile`` lands inside: etcd's data directory and the cluster's
  credentials (``LocalEtcd``, ``LocalCluster``), the redis and Mooncake peers' directories,
  the demo's model and logs, and inside the vLLM engines the IPC sockets
  (``VLLM_RPC_BASE_PATH``, set here too), the ``vllm_dist_*`` rendezvous files and torch's
  inductor cache (``torchinductor_<user>``);
- turns SIGHUP and SIGTERM into an exception for as long as it lasts (``signals.py``), so the
  ``with``/``finally`` blocks that started child processes stop them on the way out;
- removes the directory at the end and puts ``TMPDIR``, ``VLLM_RPC_BASE_PATH`` and ``tempfile``
  back as they were.

Nested ``run_directory()`` blocks each get a directory inside the enclosing one.  The
environment is the process's: use it from the main thread of a command, not from threads that
run side by side.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .signals import stop_on_signals

# What points child processes at the run's directory (vLLM reads VLLM_RPC_BASE_PATH for its IPC
# sockets, which would otherwise follow tempfile.gettempdir() anyway).
REDIRECTED = ("TMPDIR", "VLLM_RPC_BASE_PATH")


@contextlib.contextmanager
def run_directory(name: str) -> Iterator[Path]:
    """The run's temporary directory (see the module doc); removed when the block ends."""
    with stop_on_signals():
        path = Path(tempfile.mkdtemp(prefix=f"kvring-{name}-"))
        saved_env = {var: os.environ.get(var) for var in REDIRECTED}
        saved_tempdir = tempfile.tempdir
        try:
            for var in REDIRECTED:
                os.environ[var] = str(path)
            tempfile.tempdir = str(path)
            yield path
        finally:
            tempfile.tempdir = saved_tempdir
            for var, value in saved_env.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
            shutil.rmtree(path, ignore_errors=True)
