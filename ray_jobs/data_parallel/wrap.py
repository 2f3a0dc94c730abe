"""How each data-parallel strategy wraps the unchanged model on a Ray Train worker.

Runs in the worker: the loop unpickles these with its config, so this module imports nothing
that runs only on the driver.
"""

from __future__ import annotations

import ray.train.torch
import torch
from torch import nn

from ray_jobs.core.step import autocast


def wrap_ddp(
    model: nn.Module, device: torch.device, precision: str = "fp32", sync_batchnorm: bool = False
) -> nn.Module:
    """Move to the worker's device and wrap in DDP (a no-op wrap for a single worker); autocast
    is the train step's (``precision``: every wrap takes it, DataParallel needs it)."""
    if sync_batchnorm:
        # Replaces each BatchNorm below the root, keeping its parameter and buffer tensors, so the
        # optimizer and the checkpoints (which hold the unwrapped model) see the same ones.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return ray.train.torch.prepare_model(model, move_to_device=device)


class ReplicaAutocast(nn.Module):
    """A replica's forward under the run's autocast. ``nn.DataParallel`` runs each replica on a
    thread of its own, which inherits only whether autocast is on, not its dtype (thread-local,
    float16 by default on CUDA, in torch 2.13): bf16 would silently become fp16 there."""

    def __init__(self, module: nn.Module, precision: str) -> None:
        super().__init__()
        self.module, self.precision = module, precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with autocast(self.precision, x.device):
            return self.module(x)


def wrap_dp(model: nn.Module, device: torch.device, precision: str = "fp32") -> nn.Module:
    """Wrap in ``nn.DataParallel`` when more than one GPU is visible; else the model as it is."""
    model = model.to(device)
    if torch.cuda.is_available() and torch.cuda.device_count() > 1:
        return nn.DataParallel(ReplicaAutocast(model, precision))
    return model
