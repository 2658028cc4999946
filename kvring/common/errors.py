"""One exception family for kvring, and the data protocol's error codes.

Transport and etcd errors are mapped to these in one place each (the client's transport, the
membership package) and re-raised with ``from``, so callers never see socket or grpc errors.

``ErrorCode`` names every error a node may answer with; ``ERROR_TABLE`` is the one table from a
code to the exception a client raises for it and to whether another replica may be asked
instead (``RemoteError.retry_elsewhere``): the request was fine but this node could not serve
it.  A code a client does not know (a newer node) reads as ``internal``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class KVRingError(Exception):
    """Base class of every error kvring raises on purpose."""


class ProtocolError(KVRingError):
    """A message that does not follow the data protocol (malformed, wrong sizes, unknown op).

    ``code`` is the error reply's code and the node's error counter's label.
    """

    def __init__(self, message: str, code: ErrorCode | str = "bad_meta"):
        super().__init__(message)
        self.code = ErrorCode.parse(code)


class RemoteError(KVRingError):
    """A node answered a request with an error reply."""

    def __init__(self, code: ErrorCode | str, message: str, node: str = "?"):
        self.code = ErrorCode.parse(code)
        super().__init__(f"node {node}: {self.code}: {message}")
        self.node = node

    @property
    def retry_elsewhere(self) -> bool:
        """Whether another replica may serve the same request."""
        return ERROR_TABLE[self.code].retry_elsewhere


class RequestRefused(RemoteError):
    """The request itself is wrong (malformed, out of bounds): no node will serve it."""


class ChunkRejected(RemoteError):
    """A PUT's chunk was refused (sizes, checksum, dtype): the same bytes fail everywhere."""


class NodeBusy(RemoteError):
    """The node could not serve the request now (no space, its own fault)."""


class NodeUnavailable(KVRingError):
    """A node did not answer in time or is marked failed."""


class NoOwners(KVRingError):
    """The ring is empty: no active node is registered for this cluster."""


class ContractMismatch(KVRingError):
    """This process's cluster contract differs from the one recorded in etcd."""


class NodeIdTaken(KVRingError):
    """Another live node holds this node id in the cluster (registration is fenced)."""


class MembershipError(KVRingError):
    """etcd could not be reached or answered unexpectedly."""


class ErrorCode(enum.StrEnum):
    """What a node's ``Error`` reply says went wrong (the wire value is the string)."""

    BAD_HEADER = "bad_header"  # undecodable header, or a field of the wrong type
    UNKNOWN_OP = "unknown_op"  # an op this node does not know (older node, or garbage)
    VERSION = "version"  # another protocol version
    FRAME_COUNT = "frame_count"  # wrong number of payload frames for the op
    SIZE_MISMATCH = "size_mismatch"  # a payload whose size differs from its declared shape
    TOO_LARGE = "too_large"  # a chunk above the node's maximum
    BAD_META = "bad_meta"  # unsupported dtype, shape, token count
    BAD_KEY = "bad_key"  # a key of the wrong length
    CHECKSUM = "checksum"  # a layer whose checksum does not match
    NO_SPACE = "no_space"  # the store cannot make room
    BAD_RANGE = "bad_range"  # a layer range outside the stored chunks
    TOO_MANY_KEYS = "too_many_keys"  # more keys in one request than allowed
    DUPLICATE_KEYS = "duplicate_keys"  # a key listed twice in one GET
    REPLY_TOO_LARGE = "reply_too_large"  # the reply would exceed the per-request byte bound
    BAD_NAMESPACE = "bad_namespace"  # a Flush without a namespace
    INTERNAL = "internal"  # the node's own fault (a bug); logged there

    @classmethod
    def parse(cls, code: ErrorCode | str) -> ErrorCode:
        """The code of a wire string; an unknown string is ``INTERNAL``."""
        try:
            return cls(code)
        except ValueError:
            return cls.INTERNAL


@dataclass(frozen=True)
class ErrorKind:
    exception: type[RemoteError]
    retry_elsewhere: bool


ERROR_TABLE: dict[ErrorCode, ErrorKind] = {
    ErrorCode.BAD_HEADER: ErrorKind(RequestRefused, False),
    ErrorCode.UNKNOWN_OP: ErrorKind(RequestRefused, True),  # another node may be newer
    ErrorCode.VERSION: ErrorKind(RequestRefused, True),
    ErrorCode.FRAME_COUNT: ErrorKind(RequestRefused, False),
    ErrorCode.SIZE_MISMATCH: ErrorKind(ChunkRejected, False),
    ErrorCode.TOO_LARGE: ErrorKind(ChunkRejected, False),
    ErrorCode.BAD_META: ErrorKind(ChunkRejected, False),
    ErrorCode.BAD_KEY: ErrorKind(RequestRefused, False),
    ErrorCode.CHECKSUM: ErrorKind(ChunkRejected, False),
    ErrorCode.NO_SPACE: ErrorKind(NodeBusy, True),
    ErrorCode.BAD_RANGE: ErrorKind(RequestRefused, False),
    ErrorCode.TOO_MANY_KEYS: ErrorKind(RequestRefused, False),
    ErrorCode.DUPLICATE_KEYS: ErrorKind(RequestRefused, False),
    ErrorCode.REPLY_TOO_LARGE: ErrorKind(RequestRefused, False),
    ErrorCode.BAD_NAMESPACE: ErrorKind(RequestRefused, False),
    ErrorCode.INTERNAL: ErrorKind(NodeBusy, True),
}


def remote_error(code: ErrorCode | str, message: str, node: str = "?") -> RemoteError:
    """The exception a client raises for a node's ``Error`` reply (one table: ``ERROR_TABLE``)."""
    code = ErrorCode.parse(code)
    return ERROR_TABLE[code].exception(code, message, node)
