"""SIGHUP and SIGTERM end a run the way Ctrl-C does: by an exception that unwinds it.

Python's default for SIGHUP (the terminal closed) and SIGTERM is to end the process at once,
skipping every ``finally`` and ``with`` exit: the child processes (which run in sessions of
their own, so the terminal's SIGHUP never reaches them) and the temporary files would be left
behind.  Inside ``stop_on_signals()`` the first SIGHUP, SIGTERM or SIGINT raises in the main
thread instead (``Stopped`` for the first two, ``KeyboardInterrupt`` for SIGINT, as usual), so
the code that started the children stops them on its way out, exactly as on Ctrl-C or on an
error.  Later signals while it unwinds are ignored (a second Ctrl-C must not cut the cleanup
short; every stop is bounded: ``stop_process_group`` escalates to SIGKILL).  The handlers in
place before are restored when the outermost ``stop_on_signals()`` ends.

Signal handlers can only be installed from the main thread; elsewhere ``stop_on_signals()``
does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """The run was asked to stop by a signal (SIGHUP or SIGTERM); ``signum`` says which.

    A ``BaseException`` like ``KeyboardInterrupt``: ``except Exception`` never swallows it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process ended by this signal."""
        return 128 + self.signum

    def __str__(self) -> str:
        return f"stopped by {self.name}"


_depth = 0  # how many stop_on_signals() are open (only the outermost installs handlers)
_stopping = False


def _ignore_later(signum: int, _frame) -> None:
    logger.debug("%s while stopping: ignored", signal.Signals(signum).name)


def _stop(signum: int, _frame) -> None:
    global _stopping
    if _stopping:
        return
    _stopping = True
    for sig in SIGNALS:
        signal.signal(sig, _ignore_later)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within this block the first SIGHUP/SIGTERM/SIGINT raises (see the module doc)."""
    global _depth, _stopping
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS} if _depth == 0 else {}
    if _depth == 0:
        _stopping = False
        for sig in SIGNALS:
            signal.signal(sig, _stop)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            for sig, handler in saved.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            _stopping = False
