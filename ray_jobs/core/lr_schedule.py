"""The learning rate at every optimizer step: one formula (nanoGPT's) for every strategy.

The LR is a pure function of the optimizer step ``s`` (0-based, counted over the whole run in
optimizer steps: ``--epochs`` x global batches per epoch), so a resume continues the curve from
its checkpoint's position with no scheduler state to save. For a run of ``S`` steps and warmup
``W``: ``lr (s+1) / W`` while ``s < W``; after it, with ``p = (s - W) / max(1, S - W)``, cosine
``min_lr + (lr - min_lr) (1 + cos(pi p)) / 2``, linear ``lr + (min_lr - lr) p``, constant ``lr``.
In plain PyTorch: ``LambdaLR(optimizer, lambda s: lr_at(s, ...) / lr)``, stepped after each
``optimizer.step()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    total_steps: int = 1
    """Optimizer steps in the whole run (``S``)."""
    steps_per_epoch: int = 1
    """Global batches (optimizer steps) in one epoch."""

    def step_of(self, epoch: int, step: int) -> int:
        """The run's optimizer step ``s`` of global batch ``step`` of epoch ``epoch``."""
        return epoch * self.steps_per_epoch + step

    def epoch(self, epoch: int) -> list[float]:
        """The LR of each of epoch ``epoch``'s steps (the step log's)."""
        return [self.at(self.step_of(epoch, step)) for step in range(self.steps_per_epoch)]

    def at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        if self.schedule == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr + (self.min_lr - self.lr) * progress

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set step ``step``'s LR on every parameter group; returns it."""
        value = self.at(step)
        for group in optimizer.param_groups:
            group["lr"] = value
        return value

    def readings(self) -> dict[str, float]:
        """The LR of the run's first step, its peak and its last step, for the summary."""
        values = [self.at(step) for step in range(self.total_steps)]
        return {"first": values[0], "peak": max(values), "last": values[-1]}


def lr_schedule(cfg, num_rows: int) -> LRSchedule:
    """The run's schedule: ``cfg`` a ``TrainConfig``, ``num_rows`` its data's rows (a last partial
    global batch is dropped, so an epoch is ``num_rows // batch_size`` steps)."""
    steps = num_rows // cfg.batch_size
    return LRSchedule(cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr, cfg.epochs * steps, steps)


def check_warmup(cfg, num_rows: int) -> None:
    """A warmup longer than the run would never reach ``--lr``: refused, before Ray."""
    schedule = lr_schedule(cfg, num_rows)
    if cfg.warmup_steps > schedule.total_steps:
        raise ValueError(
            f"--warmup-steps {cfg.warmup_steps} is longer than the run's {schedule.total_steps} optimizer steps "
            f"(--epochs {cfg.epochs} x {schedule.steps_per_epoch} global batches): the LR would never reach "
            f"--lr {cfg.lr:g}"
        )
