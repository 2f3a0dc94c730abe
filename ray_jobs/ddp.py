"""DistributedDataParallel on Ray Train: ``python -m ray_jobs.ddp --num-workers N ...``.

Each worker is a process with its own model replica; ``TorchTrainer`` starts and places the
workers and sets up the process group (gloo on CPU, nccl on GPU); gradients are all-reduced.
"""
from __future__ import annotations

import functools

import ray.train.torch
import torch
from torch import nn

from ray_jobs.cli import entry_point, exit_process
from ray_jobs.config import WorkerScaling
from ray_jobs.runner import PreparedRun
from ray_jobs.summary import TrainSummary
from ray_jobs.train_workers import run_workers
from ray_jobs.training import warn_not_reproducible


def wrap_ddp(model: nn.Module, device: torch.device, precision: str = "fp32", sync_batchnorm: bool = False) -> nn.Module:
    """Move to the worker's device and wrap in DDP (a no-op wrap for a single worker); autocast
    is the train step's (``precision``: every wrap takes it, DataParallel needs it)."""
    if sync_batchnorm:
        # Replaces each BatchNorm below the root, keeping its parameter and buffer tensors, so the
        # optimizer and the checkpoints (which hold the unwrapped model) see the same ones.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return ray.train.torch.prepare_model(model, move_to_device=device)


def run(prepared: PreparedRun, scaling: WorkerScaling, **options) -> TrainSummary:
    synced = (nn.modules.batchnorm._BatchNorm,) if scaling.sync_batchnorm else ()
    warn_not_reproducible(prepared.cfg, prepared.dataset, prepared.model_factory, "DDP", synced)
    return run_workers(prepared, scaling, functools.partial(wrap_ddp, sync_batchnorm=scaling.sync_batchnorm),
                       **options)


def main(argv: list[str] | None = None) -> int:
    return entry_point("ddp", WorkerScaling, run, argv, __doc__)


if __name__ == "__main__":
    exit_process(main())
