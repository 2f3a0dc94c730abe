"""raypar's benchmark, ``python -m ray_jobs.bench`` (``run.py``: running a suite, and the command line).

``suites.py`` the workloads and suites; ``cases/`` what is measured and how, one module per case;
``peer.py`` the plain ``torch.distributed`` peer; ``stats.py`` repetitions, ratios, noise, theory and
targets; ``report.py`` bench.md; ``plots.py`` the PNGs.
"""
# Imports nothing: the peer's spawned processes import this package, and must not import Ray.
