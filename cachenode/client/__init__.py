"""The cluster client (``ClusterClient``), the data plane's Python API; see ``cluster.py``."""

from .cluster import AnchorsDropped, ClusterClient
from .meter import ReadMeter, Transfer
from .reads import Chunk, LayerBatch

__all__ = ["AnchorsDropped", "Chunk", "ClusterClient", "LayerBatch", "ReadMeter", "Transfer"]
