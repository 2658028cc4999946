"""The Kubernetes operator for CacheCluster resources; see the operator issue."""
