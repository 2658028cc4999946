"""Cluster membership in etcd: ``settings`` (where), ``etcd`` (the reconnecting client and the
cluster-level operations), ``registrar`` (a node's record under a lease).  The only package that
imports ``aetcd``."""
