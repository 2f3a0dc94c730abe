"""The one seam where tests inject faults into a run: a process that dies, an error raised, a
run held at a point while the test kills a node.

Production code holds a ``Faults`` value (``NO_FAULTS`` unless a test passed one to a strategy's
``run``) and calls its hooks at fixed points of a run; each hook does nothing unless armed. A
pipeline stage actor has no ``Faults`` of its own: the driver's hook reaches into its process
through ``StageWorker.run_in_process`` and the ``stage_forward`` hook below.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

# How long a held run waits for the test to let it go, at most.
HOLD_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Faults:
    """What a test arms. Every fault acts in the first attempt only (a run not resumed from a
    checkpoint), so the restart it provokes runs clean."""

    crash_at_start: bool = False
    """The pipeline's last stage process dies while the stages start."""
    crash_at_epoch: int | None = None
    """The process dies during this epoch (data-parallel: world rank 0; pipeline: the last stage),
    after the previous epoch's checkpoint was registered."""
    crash_at_step: int = 0
    """With ``crash_at_epoch``: the global batch of that epoch after which it dies."""
    fail_at_epoch: int | None = None
    """An error is raised during this epoch (data-parallel: by the last world rank; pipeline: by
    the last stage's next forward), as a bug or a bad input would."""
    crash_in_upload: str | None = None
    """``--checkpoint-mode async``: world rank 0 dies in the background upload of the checkpoint of
    this directory name, before it reaches storage, while training goes on."""
    holds: tuple[tuple[int, str], ...] = ()
    """``(epoch, path)`` pairs: an attempt that reaches that epoch's start by training (not by
    resuming there), after the previous epoch's checkpoint, says so in ``<path>.waiting`` and
    waits until ``path`` exists."""

    # Ray Train workers.
    def worker_epoch_start(self, epoch: int, resuming_here: bool, world_rank: int, world_size: int) -> None:
        for at, path in self.holds:
            if at == epoch and not resuming_here:
                hold(path)
        if self.fail_at_epoch == epoch and world_rank == world_size - 1:
            raise RuntimeError("injected fault")

    def checkpoint_upload(self, name: str, world_rank: int, resumed: bool) -> None:
        """In a worker's background upload of checkpoint ``name``, before it reaches storage."""
        if world_rank == 0 and name == self.crash_in_upload and not resumed:
            _exit_now()

    def worker_step_done(self, epoch: int, step: int, resumed_run: bool, world_rank: int) -> None:
        """``step``: 1-based, the global batches of ``epoch`` done so far."""
        if self.crash_at_epoch == epoch and not resumed_run and world_rank == 0 and step - 1 == self.crash_at_step:
            _exit_now()

    # The pipeline's driver.
    def stages_started(self, actors: list, first_attempt: bool) -> None:
        if self.crash_at_start and first_attempt:
            actors[-1].run_in_process.remote(_exit_now)

    def pipeline_segment(self, actors: list, epoch: int, steps: range, resumed_from_epoch: int | None) -> None:
        """Before the segment ``steps`` of epoch ``epoch`` is submitted."""
        for at, path in self.holds:
            if at == epoch and resumed_from_epoch != epoch and steps.start == 0:
                hold(path)
        if resumed_from_epoch is not None or self.crash_at_step not in steps:
            return
        if self.crash_at_epoch == epoch:
            actors[-1].run_in_process.remote(_exit_now)
        elif self.fail_at_epoch == epoch:
            actors[-1].run_in_process.remote(functools.partial(_arm, "stage_forward", _raise))


NO_FAULTS = Faults()

# Per process: hooks armed by ``_arm``, each fired once.
_armed: dict[str, Callable[[], None]] = {}


def stage_forward() -> None:
    """Called by a pipeline stage before each forward."""
    action = _armed.pop("stage_forward", None)
    if action is not None:
        action()


def hold(path: str, timeout_s: float = HOLD_TIMEOUT_S) -> None:
    """Say so in ``<path>.waiting``, then wait until ``path`` exists (a test kills a node meanwhile)."""
    with open(f"{path}.waiting", "w"):
        pass
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.2)


def _arm(point: str, action: Callable[[], None]) -> None:
    _armed[point] = action


def _raise() -> None:
    raise RuntimeError("injected fault")


def _exit_now() -> None:
    os._exit(1)  # as abrupt as a SIGKILL: no cleanup, no report
