"""One exception family for kvring's data plane.

Transport and etcd errors are mapped to these in one place (``client.py``, ``membership.py``)
and re-raised with ``from`` so callers never need to know about zmq or grpc exceptions.
"""


class KVRingError(Exception):
    """Base class of every error kvring raises on purpose."""


class ProtocolError(KVRingError):
    """A message that does not follow the data protocol (malformed, wrong sizes, unknown op).

    ``code`` is one of ``protocol.ERROR_CODES``: the error reply's code and the counter's label.
    """

    def __init__(self, message: str, code: str = "bad_meta"):
        super().__init__(message)
        self.code = code


class RemoteError(KVRingError):
    """A node answered a request with an error reply."""

    def __init__(self, code: str, message: str, node: str = "?"):
        super().__init__(f"node {node}: {code}: {message}")
        self.code = code
        self.node = node


class NodeUnavailable(KVRingError):
    """A node did not answer in time or is marked failed."""


class NoOwners(KVRingError):
    """The ring is empty: no active node is registered for this cluster."""


class ContractMismatch(KVRingError):
    """This process's cluster contract differs from the one recorded in etcd."""


class MembershipError(KVRingError):
    """etcd could not be reached or answered unexpectedly."""
