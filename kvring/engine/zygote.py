"""A process that imports vLLM once and forks each engine instance from there.

Every ``kvring.engine.run`` instance is a fresh process, and most of its start is importing
torch and vLLM: some 15 s of a 2-core machine, where the engine itself then runs a test's prompts
in a few.  With ``$KVRING_ENGINE_ZYGOTE=1`` (the test suite sets it) ``Instance`` asks a zygote
instead: one process per driver, started at the first instance, that imports vLLM and this
package and then forks a child per instance.  The child is the instance as a spawned one would
be: a session of its own, its output in its log, the environment it was given (the zygote's own
is replaced, ``tempfile``'s cached directory forgotten), the same ``run.main``.  What it does not
repeat is the import, which happened before any engine, thread pool or vLLM setting was made (the
zygote builds nothing and reads no vLLM setting).  Processes vLLM starts itself (an engine core,
tensor- and pipeline-parallel workers) start as vLLM starts them.

The zygote is the driver's child and reads requests on its stdin, one JSON line each, answering
one line on its stdout; it ends when its stdin closes (the driver ended).  It reaps its children
and keeps their exit codes until asked:

- ``{"spawn": [spec, out], "log": path, "env": {...}}`` -> ``{"pid": N}``
- ``{"poll": N}`` -> ``{"code": int | null}`` (null: still running; a code is given once, and
  ``ForkedProcess`` keeps it)

``ForkedProcess`` is the driver's handle on a child, with the calls of ``subprocess.Popen`` that
``Instance`` and ``stop_process_group`` make (``pid``, ``poll``, ``wait``, ``returncode``).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

ZYGOTE_ENV = "KVRING_ENGINE_ZYGOTE"  # "1": instances fork from a zygote (``zygote_enabled``)
_POLL_INTERVAL = 0.05


class ZygoteError(RuntimeError):
    """The zygote could not start an instance (it exited, or answered otherwise than asked)."""


def zygote_enabled() -> bool:
    return os.environ.get(ZYGOTE_ENV) == "1"


class Zygote:
    """The driver's side: the zygote process and its request pipe (one request at a time)."""

    def __init__(self, env: dict[str, str]) -> None:
        self._lock = threading.Lock()
        self._errors = tempfile.TemporaryFile()  # its own output (vLLM's import warnings), for a failure's message
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "kvring.engine.zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._errors, env=env, text=True, bufsize=1)
        atexit.register(self.close)

    def _exited(self) -> ZygoteError:
        self._errors.seek(0)
        tail = self._errors.read()[-2000:].decode(errors="replace").strip()
        return ZygoteError(f"the engine zygote has exited (code {self.proc.wait()})" + (f": {tail}" if tail else ""))

    def ask(self, request: dict) -> dict:
        with self._lock:
            if self.proc.poll() is not None:
                raise self._exited()
            assert self.proc.stdin is not None and self.proc.stdout is not None
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")
                line = self.proc.stdout.readline()
            except (BrokenPipeError, ValueError):
                line = ""
            if not line:
                raise self._exited()
        answer = json.loads(line)
        if "error" in answer:
            raise ZygoteError(answer["error"])
        return answer

    def spawn(self, argv: list[str], log: str, env: dict[str, str]) -> ForkedProcess:
        return ForkedProcess(self, self.ask({"spawn": argv, "log": log, "env": env})["pid"])

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()  # the zygote's end: it exits at EOF
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._errors.close()


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote(env: dict[str, str]) -> Zygote:
    """This driver's zygote, started with ``env`` (the engines' preloads must be in it: a forked
    child keeps the libraries its parent loaded) on first use, and again if it has exited."""
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = Zygote(env)
        return _zygote


class ForkedProcess:
    """A child of the zygote, as far as a driver needs a ``subprocess.Popen`` of it."""

    def __init__(self, owner: Zygote, pid: int) -> None:
        self._owner = owner
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._owner.ask({"poll": self.pid})["code"]
            except ZygoteError:  # the zygote is gone, its children not (their own sessions): look
                self.returncode = None if _running(self.pid) else -9  # (its exit code went with the zygote)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"instance pid {self.pid}", timeout)
            time.sleep(_POLL_INTERVAL)
        return self.returncode


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---- the zygote itself --------------------------------------------------------------------------

def _child(argv: list[str], log: str, env: dict[str, str]) -> None:
    """In the forked child: become the instance, run it, exit (never returns)."""
    code = 1
    try:
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # read TMPDIR again
        from kvring.engine import run

        run.main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what an interpreter's exit runs (vLLM's engine shutdown, saves flushed)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(requests: IO[str], answers: IO[str]) -> None:
    """The zygote's loop (see the module docstring)."""
    codes: dict[int, int] = {}  # children reaped, until their code is asked for
    children: set[int] = set()  # children not reaped yet
    for line in requests:
        request = json.loads(line)
        try:
            if "spawn" in request:
                answers.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request["spawn"], request["log"], request["env"])
                children.add(pid)
                answer = {"pid": pid}
            elif "poll" in request:
                pid = request["poll"]
                if pid in children:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        children.discard(pid)
                        codes[pid] = os.waitstatus_to_exitcode(status)
                answer = {"code": None if pid in children else codes.pop(pid, -1)}  # -1: not a child
            else:
                answer = {"error": f"unknown request {sorted(request)}"}
        except OSError as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    import vllm  # noqa: F401  (the import every instance would repeat)
    from vllm import LLM, SamplingParams  # noqa: F401

    from kvring.engine import run  # noqa: F401

    serve(sys.stdin, sys.stdout)
