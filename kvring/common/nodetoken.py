"""The cluster's node token: what a node's guarded admin endpoints require (flush, present, drain,
debug) as ``Authorization: Bearer``, and what its clients (the admin API, ``kvring drain``, the
preStop hook) send.

Given as text (``KVRING_NODE_TOKEN``), it is fixed for the life of the process.  Given as a file
(``--node-token-file``, or a mounted Secret), it follows the file: one token per line, looked at
again at most every ``RELOAD_CHECK`` seconds when a token is asked for.  A client sends the first
line; a node accepts any line.  So a token changes without a restart and without a request
refused, in the three steps credentials take (``tls.rotation_step``): add the new token as a
second line; once every holder has read it, make it the first (clients send it); once every
client sends it, drop the old one.  A file that cannot be read, is empty or holds a malformed
token is not taken: the tokens read last stay, and ``reload_error`` says why.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

from .follow import RELOAD_CHECK, Followed, stamp

logger = logging.getLogger(__name__)

MIN_NODE_TOKEN_CHARS = 32


class NodeTokenError(ValueError):
    """A token that cannot be one, or a token file that holds none."""


def check_token(token: str) -> None:
    """Raise ``NodeTokenError`` unless ``token`` can be a node token (it travels in an HTTP header)."""
    if len(token) < MIN_NODE_TOKEN_CHARS or not token.isascii() or not token.isprintable() or " " in token:
        raise NodeTokenError(f"the node token must be at least {MIN_NODE_TOKEN_CHARS} printable ASCII characters "
                             "without spaces (it travels in an HTTP header); generate one with "
                             "`openssl rand -hex 32`")


class NodeToken(Followed):
    """The node tokens of a process (thread-safe; a file followed as it changes, ``common.follow``):
    ``presented()`` for a client, ``accepts`` for a node.  Build one with ``fixed`` or
    ``from_file``."""

    refusal = NodeTokenError
    kept = "keeping the node tokens read before"

    def __init__(self, tokens: tuple[str, ...], file: Path | None = None, *,
                 check_interval: float = RELOAD_CHECK) -> None:
        if not tokens:
            raise NodeTokenError("no node token given")
        for token in tokens:
            check_token(token)
        super().__init__(check_interval)
        self.file = file
        self._tokens = tokens
        self._stamp = stamp((file,)) if file is not None else None

    def __repr__(self) -> str:  # never the tokens themselves
        return f"NodeToken(file={str(self.file) if self.file else None!r}, tokens={len(self._tokens)})"

    @classmethod
    def fixed(cls, text: str) -> NodeToken:
        """Tokens given as text (an environment variable), one per line, as in a file."""
        return cls(_lines(text))

    @classmethod
    def from_file(cls, path: str | Path, *, check_interval: float = RELOAD_CHECK) -> NodeToken:
        """The tokens in ``path``; ``NodeTokenError`` in one line if it holds none or a bad one."""
        path = Path(path)
        return cls(_read(path), path, check_interval=check_interval)

    @property
    def fingerprints(self) -> list[str]:
        """Each accepted token's fingerprint, in the file's order (the first 8 hex digits of its
        SHA-256: enough to tell which tokens a node holds, nothing to guess one from)."""
        return [token_fingerprint(token) for token in self._tokens]

    def presented(self) -> str:
        """The token a client sends: the file's first line."""
        return self._current()[0]

    def accepts(self, given: str) -> bool:
        """Whether ``given`` is one of the tokens (each compared in constant time)."""
        ok = False
        for token in self._current():
            ok |= hmac.compare_digest(given.encode(), token.encode())
        return ok

    def _current(self) -> tuple[str, ...]:
        if self.file is not None:
            self._look_if_due()
        return self._tokens

    def _reload(self) -> bool:
        if self.file is None:
            return False
        now = stamp((self.file,))
        if now == self._stamp:
            return False
        tokens = _read(self.file)
        self._stamp = now
        if tokens == self._tokens:
            return False
        self._tokens = tokens
        logger.info("node token file %s reloaded: %d token(s) accepted", self.file, len(tokens))
        return True


def token_fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:8]


def _lines(text: str) -> tuple[str, ...]:
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def _read(path: Path) -> tuple[str, ...]:
    try:
        tokens = _lines(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise NodeTokenError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not tokens:
        raise NodeTokenError(f"{path} is empty; it should hold the cluster's node token")
    for token in tokens:
        try:
            check_token(token)
        except NodeTokenError as exc:
            raise NodeTokenError(f"{path}: {exc}") from None
    return tokens
