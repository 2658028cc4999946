"""Mooncake Store as kvring's peer in ``kvring bench data-plane`` -- optional.

Install it (the CPU build; its store library links libibverbs even for TCP)::

    apt-get install -y libibverbs1 && .venv/bin/python -P -m pip install mooncake-transfer-engine-non-cuda

Set-up, all on loopback, in a temporary directory removed at the end: ``mooncake_master`` (object
metadata and allocation); a separate ``mooncake.mooncake_store_service`` process that contributes
the memory segment holding the data (protocol tcp, P2P handshake, so no metadata server); and a
client in the bench's process that contributes no memory (``global_segment_size`` 0), so every
byte crosses loopback TCP between two processes, as with the other systems.  (The store service
also opens its REST port, on all interfaces: it has no option to bind it to loopback.)

Calls, all zero-copy from or into buffers registered with ``register_buffer``:

- PUT: ``batch_put_from`` (after an untimed ``batch_remove``: Mooncake answers success to a PUT of
  an existing key and keeps the old object, so without it nothing would be stored);
- GET whole: ``batch_get_into``;  GET 1 layer: ``get_into_ranges``, one byte range per key;
- GET stream: a get session (``batch_get_session_start``/``_end``) with one
  ``batch_get_into_multi_buffer_ranges`` per layer, Mooncake's layer-wise read path;
- existence: ``batch_is_exist``.

If any of it cannot run here, ``MooncakeStore`` raises ``Unavailable`` with the reason, which the
bench prints in one line before going on without Mooncake.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from kvring.bench.system import BenchError, Buffer, ChunkSpec, Range, System, terminate, wait_for_port
from kvring.local.cluster import free_port

INSTALL = "apt-get install libibverbs1; pip install mooncake-transfer-engine-non-cuda"
CLIENT_BUFFER = 16 << 20  # the client's own staging buffer; zero-copy calls do not use it


class Unavailable(Exception):
    """Mooncake cannot run here; the message says why."""


def _address(buf: Buffer) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Send file descriptor 2 (the C++ library's log) to ``path`` for the duration."""
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _log_level(level: str) -> Iterator[None]:
    """``MC_LOG_LEVEL`` (read as the library loads and sets up; its INFO lines are many) for the
    duration, unless the caller chose one."""
    saved = os.environ.get("MC_LOG_LEVEL")
    os.environ.setdefault("MC_LOG_LEVEL", level)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MC_LOG_LEVEL", None)


@contextlib.contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """Mooncake's client installs C signal handlers (SIGINT, SIGTERM, SIGHUP) that end the process
    at once; put Python's back, so Ctrl-C still unwinds the bench and stops every server."""
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)} if main else {}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


class MooncakeStore(System):
    key, label = "mooncake", "Mooncake"

    def __init__(self, segment_bytes: int, timeout: float = 30.0) -> None:
        with _log_level("ERROR"):
            try:
                import mooncake
                from mooncake.store import MooncakeDistributedStore
            except ImportError as exc:
                raise Unavailable(f"cannot import mooncake.store ({exc}); to include it: {INSTALL}") from None
            master = Path(mooncake.__file__).parent / "mooncake_master"
            if not os.access(master, os.X_OK):
                raise Unavailable(f"{master} is missing or not executable; reinstall: {INSTALL}")
            self.dir = Path(tempfile.mkdtemp(prefix="kvring-mooncake-"))
            self.procs: list[subprocess.Popen] = []
            self.store = None
            self.registered: list[int] = []  # payload addresses registered by ``attach``
            self.buf = np.empty(0, dtype=np.uint8)  # the registered receive buffer
            try:
                self._start(master, MooncakeDistributedStore, segment_bytes, timeout)
            except BaseException:
                self.close()
                raise

    def _start(self, master: Path, store_class: type, segment_bytes: int, timeout: float) -> None:
        rpc, metrics, rest = free_port(), free_port(), free_port()
        self._spawn("master", [str(master), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
                               f"--metrics_port={metrics}", "--metrics_host=127.0.0.1"], rpc, timeout)
        config = self.dir / "store.json"
        config.write_text(json.dumps({
            "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
            "device_name": "", "master_server_address": f"127.0.0.1:{rpc}",
            "global_segment_size": segment_bytes, "local_buffer_size": CLIENT_BUFFER}))
        # The service opens its REST port only once its segment is mounted: listening means ready.
        self._spawn("store", [sys.executable, "-P", "-m", "mooncake.mooncake_store_service", "--config",
                              str(config), "--port", str(rest), "--max-wait-time", str(timeout)], rest, timeout)
        with _keep_signal_handlers(), _stderr_to(self.dir / "client.log"):
            self.store = store_class()
            rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, CLIENT_BUFFER, "tcp", "", f"127.0.0.1:{rpc}")
        if rc != 0:
            raise Unavailable(f"the Mooncake client's setup returned {rc}: {_tail(self.dir / 'client.log')}")

    def _spawn(self, name: str, argv: list[str], port: int, timeout: float) -> None:
        log = self.dir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        try:
            wait_for_port(port, proc, f"Mooncake's {name}", timeout)
        except BenchError as exc:
            raise Unavailable(f"{exc}: {_tail(log)}") from None

    # ---- the System calls ---------------------------------------------------------------------

    def _register(self, address: int, nbytes: int) -> None:
        rc = self.store.register_buffer(address, nbytes)
        if rc != 0:
            raise BenchError(f"Mooncake register_buffer returned {rc}")

    def attach(self, spec: ChunkSpec, payloads: Sequence[Buffer]) -> None:
        for p in payloads:
            self._register(_address(p), memoryview(p).nbytes)
            self.registered.append(_address(p))
        need = len(payloads) * spec.nbytes
        if self.buf.nbytes < need:
            if self.buf.nbytes:
                self.store.unregister_buffer(self.buf.ctypes.data)
            self.buf = np.zeros(need, dtype=np.uint8)
            self._register(self.buf.ctypes.data, need)

    def detach(self) -> None:
        for address in self.registered:
            self.store.unregister_buffer(address)
        self.registered.clear()

    def scrub(self) -> None:
        self.buf.fill(0)

    def _views(self, got: Sequence[int], size: int, offset: int = 0) -> list[Buffer | None]:
        view = memoryview(self.buf)
        return [view[offset + i * size:offset + (i + 1) * size] if n == size else None for i, n in enumerate(got)]

    def put(self, keys: list[bytes], payloads: Sequence[Buffer], spec: ChunkSpec) -> bool:
        codes = self.store.batch_put_from([k.decode() for k in keys], [_address(p) for p in payloads],
                                          [memoryview(p).nbytes for p in payloads])
        if any(codes):
            raise BenchError(f"Mooncake batch_put_from returned {codes}")
        return True

    def get(self, keys: list[bytes], spec: ChunkSpec, layers: Range) -> list[Buffer | None]:
        names, base = [k.decode() for k in keys], self.buf.ctypes.data
        if layers is None:
            size = spec.nbytes
            got = self.store.batch_get_into(names, [base + i * size for i in range(len(keys))], [size] * len(keys))
        else:
            lo, hi = spec.span(layers)
            size = hi - lo
            got = [r[0] for r in self.store.get_into_ranges(
                [base], [names], [[[i * size] for i in range(len(keys))]], [[[lo]] * len(keys)],
                [[[size]] * len(keys)])[0]]
        return self._views(got, size)

    def stream(self, keys: list[bytes], spec: ChunkSpec) -> list[list[Buffer | None]]:
        names, base, lb, n = [k.decode() for k in keys], self.buf.ctypes.data, spec.layer_bytes, len(keys)
        started = self.store.batch_get_session_start(names)
        if any(started):
            raise BenchError(f"Mooncake batch_get_session_start returned {started}")
        try:
            out = []
            for layer in range(spec.layers):
                offset = layer * n * lb  # layer-major in the receive buffer
                got = self.store.batch_get_into_multi_buffer_ranges(
                    names, [[base + offset + i * lb] for i in range(n)], [[lb]] * n, [[layer * lb]] * n)
                out.append(self._views(got, lb, offset))
            return out
        finally:
            self.store.batch_get_session_end(names)

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [x == 1 for x in self.store.batch_is_exist([k.decode() for k in keys])]

    def clear(self, keys: list[bytes]) -> None:
        names = [k.decode() for k in keys]
        self.store.batch_remove(names, True)  # force: skip the read leases of the last GETs
        if any(x != 0 for x in self.store.batch_is_exist(names)):
            raise BenchError("Mooncake still has keys after batch_remove")

    def close(self) -> None:
        if self.store is not None:
            self.detach()
            if self.buf.nbytes:
                self.store.unregister_buffer(self.buf.ctypes.data)
            self.store.close()
            self.store = None
        for proc in reversed(self.procs):  # the store service first: it unmounts from the master
            terminate(proc)
        shutil.rmtree(self.dir, ignore_errors=True)
