"""The cluster client (``ClusterClient``), the data plane's Python API; see ``cluster.py``."""

from .cluster import ClusterClient
from .reads import Chunk, LayerBatch

__all__ = ["Chunk", "ClusterClient", "LayerBatch"]
