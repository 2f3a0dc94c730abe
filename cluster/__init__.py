"""Cluster configs (local, cloud, Kubernetes) and local-cluster tooling: ``python -m cluster.local``."""
