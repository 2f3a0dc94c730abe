"""The pipeline driver's checkpoint writes (``--checkpoint-mode``): at once, or in a thread.

The stages' state reaches the driver as copies (Ray sends them), so in async mode the loop waits
only for that gather; ``checkpoint.pt`` is then written and the old checkpoints pruned in the
background, one write at a time: the next checkpoint, a restart and the run's end first wait for
the last. A failed write fails the run in one line naming the checkpoint. ``storage.write``
writes under a temporary name first, so a write cut short leaves no checkpoint a resume counts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ray_jobs.core.checkpoint import TrainState
from ray_jobs.errors import TrainingFailed, root_cause


def snapshot(state: TrainState) -> TrainState:
    """``state`` as of now: the loop appends to its lists and replaces its tensors' dicts after."""
    lists = ("losses", "step_losses", "val_losses", "val_accuracy", "rng", "world_sizes")
    return dataclasses.replace(state, **{name: list(getattr(state, name) or []) for name in lists})


class CheckpointWriter:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.stalls_s: list[float] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raypar-checkpoint")
        self._pending: tuple[str, Future] | None = None

    def write(self, name: str, write: Callable[[], None], final: bool, began: float) -> None:
        """Run ``write`` (of checkpoint ``name``) now, or, in async mode and for any checkpoint but
        the run's last, in the background; ``began``: when the loop stopped for it."""
        self.wait()
        if self.mode == "async" and not final:
            self._pending = (name, self._pool.submit(write))
        else:
            self._run(name, write)
        self.stalls_s.append(time.perf_counter() - began)

    def wait(self) -> None:
        """Until the background write is done; its failure, as the run's."""
        if self._pending is not None:
            name, future = self._pending
            self._pending = None
            self._run(name, future.result)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    @staticmethod
    def _run(name: str, call: Callable[[], object]) -> None:
        try:
            call()
        except TrainingFailed:
            raise
        except Exception as error:
            raise TrainingFailed(f"checkpoint {name}: its write failed: {root_cause(error)}") from error
