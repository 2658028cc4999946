"""kvring cache nodes and the cluster client.

The public Python API of the data plane is ``ClusterClient``; ``chained_hashes`` is the key
contract shared with the connector.
"""

from .chunk import ChunkMeta, array_meta, make_meta
from .client import Chunk, ClusterClient, LayerBatch
from .errors import (
    ContractMismatch, KVRingError, MembershipError, NodeUnavailable, NoOwners, ProtocolError, RemoteError,
)
from .hashing import ChunkHash, chained_hashes, namespace_hash
from .membership import Contract, EtcdSettings, NodeRecord
from .ring import HashRing

__all__ = [
    "Chunk", "ChunkHash", "ChunkMeta", "ClusterClient", "Contract", "ContractMismatch", "EtcdSettings",
    "HashRing", "KVRingError", "LayerBatch", "MembershipError", "NodeRecord", "NodeUnavailable", "NoOwners",
    "ProtocolError", "RemoteError", "array_meta", "chained_hashes", "make_meta", "namespace_hash",
]
