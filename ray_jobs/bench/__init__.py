"""raypar's benchmark, ``python -m ray_jobs.bench`` (``run.py``: running a suite, and the command line).

``suites.py`` the workloads and suites; ``cases/`` what is measured and how, one module per case;
``peer.py`` the plain ``torch.distributed`` peer; ``stats.py`` repetitions, ratios, noise, theory and
targets; ``report.py`` bench.md, one ``report_<case>.py`` per case's section (``report_tables.py``: the
table helpers they share); ``plots.py`` the PNGs.
"""
# Imports nothing: the peer's spawned processes import this package, and must not import Ray.
