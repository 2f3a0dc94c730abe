"""The one seam where tests reach into a run (``faults``): crashes, raised errors and holds.

Its hooks run where they act (a Ray Train worker, the pipeline's driver, a stage actor) and do
nothing unless a test armed them; production code names no fault of its own.
"""
