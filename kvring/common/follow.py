"""What a process reads from files and reads again as they change, without a restart: the
cluster's credentials (``tls.ClusterCredentials``) and the node token (``nodetoken.NodeToken``).

One rule for both.  The files are looked at no more often than every ``check_interval`` seconds
(``RELOAD_CHECK``) when what they hold is used, or at once with ``refresh``; one thread looks
while the others go on with what is loaded.  A look is a ``stat`` of each file through symlinks
(``stamp``), as Kubernetes swaps a Secret volume's link; only a changed stamp reads them.  New
content that cannot be taken leaves the last good content in use, and ``reload_error`` says why
(logged once per reason); ``reloads`` counts the new contents taken.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

RELOAD_CHECK = 1.0  # seconds between two looks at the files

FileStamp = tuple[int, int, int, int] | None  # (device, inode, mtime in ns, size); None: missing


def stamp(paths: Iterable[Path]) -> tuple[FileStamp, ...]:
    """Each file's identity, through symlinks; None for one that cannot be read."""
    out: list[FileStamp] = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            out.append(None)
            continue
        out.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


class Followed:
    """Content read from files and read again as they change (thread-safe).  A subclass says how
    in ``_reload`` (called under the lock): True if it took new content, False if nothing changed;
    it raises ``refusal`` to keep what it holds."""

    refusal: type[Exception] = ValueError
    kept = "keeping what was loaded before"  # the start of the warning when new content is refused

    def __init__(self, check_interval: float = RELOAD_CHECK) -> None:
        self.check_interval = check_interval
        self.reloads = 0  # new contents taken after the first
        self.reload_error: str | None = None  # why the files as they are now were not taken
        self._lock = threading.Lock()
        self._checked = time.monotonic()

    def refresh(self) -> bool:
        """Look at the files now; True if new content was taken."""
        with self._lock:
            return self._look()

    def _look_if_due(self) -> None:
        """Look if ``check_interval`` has passed since the last look, unless another thread is looking."""
        if time.monotonic() - self._checked >= self.check_interval and self._lock.acquire(blocking=False):
            try:
                self._look()
            finally:
                self._lock.release()

    def _look(self) -> bool:
        self._checked = time.monotonic()
        try:
            taken = self._reload()
        except self.refusal as exc:
            if str(exc) != self.reload_error:
                logger.warning("%s: %s", self.kept, exc)
            self.reload_error = str(exc)
            return False
        self.reload_error = None
        if taken:
            self.reloads += 1
        return taken

    def _reload(self) -> bool:
        raise NotImplementedError
