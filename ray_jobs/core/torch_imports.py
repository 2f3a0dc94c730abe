"""A training process's first imports, made with Python's cyclic garbage collector paused.

Importing torch and ``torch._dynamo`` builds ~450,000 Python objects, and the collector, run as
they accumulate (every 700 allocations, and over the oldest generation as it grows), walks them
again and again: ~0.4 of the ~2.3 CPU-seconds a fresh Ray actor spent on those imports and 300
small training steps, measured; in the test suite, 0.8 of each Ray Train worker's 4.7
(``docs/performance.md``). Every Ray Train worker and every pipeline stage pays it at its start,
and a run starts one per worker or stage, again on each restart.

``torch._dynamo`` is loaded here because every training process loads it anyway: torch's
``DistributedDataParallel`` constructor reads its settings, and each optimizer's first
``add_param_group`` is wrapped in ``torch._disable_dynamo``, which imports it.
"""

from __future__ import annotations

import gc
import sys


def load_torch_for_training() -> None:
    """Import torch and ``torch._dynamo`` with the collector paused, then freeze what is alive.

    ``gc.freeze`` moves every object alive into a generation the collector never walks: torch's
    modules, classes and registries live as long as the process, so later collections in the
    training loop skip them instead of walking them again. An object frozen is still freed by its
    reference count; what the freeze keeps is cyclic garbage made before it: ~9,000 objects the
    imports left, which a full collection would free for 0.3 CPU-seconds of every start.
    A process that already loaded ``torch._dynamo`` returns at once.
    """
    if "torch._dynamo" in sys.modules:
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
