"""The cluster client (``ClusterClient``), the data plane's Python API; see ``cluster.py``."""

from .cluster import ClusterClient
from .meter import ReadMeter, Transfer
from .reads import Chunk, LayerBatch

__all__ = ["Chunk", "ClusterClient", "LayerBatch", "ReadMeter", "Transfer"]
