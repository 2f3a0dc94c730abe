"""Cluster configs (local, cloud, Kubernetes) and local-cluster tooling: ``python -m cluster.local``
(the command line), ``state`` (what ``up`` recorded), ``start`` (``up``, ``rejoin``), ``stop``
(``down``, ``preempt``), ``status``; ``make demo`` is ``demo``. All of it runs in the user's process."""
