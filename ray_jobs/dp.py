"""The DataParallel baseline: ``python -m ray_jobs.dp --gpus G ...``.

One Ray Train worker holds every GPU of its node; ``nn.DataParallel`` scatters each batch over
them with threads in one process. Simple, single-node, and limited by the GIL and by
scatter/gather on GPU 0: kept as the baseline DDP is measured against.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ray_jobs.cli import entry_point, exit_process
from ray_jobs.config import TrainConfig, WorkerScaling, flag_doc, require, require_gpu_for_fp16
from ray_jobs.runner import PreparedRun
from ray_jobs.summary import TrainSummary
from ray_jobs.train_workers import run_workers
from ray_jobs.training import autocast


@dataclass
class DataParallelScaling:
    """The one worker of a DataParallel run."""

    gpus: int = field(default=0, metadata=flag_doc("GPUs the worker holds, all on one node (0: CPU)"))
    cpus_per_worker: float = field(default=1.0, metadata=flag_doc("CPUs reserved for the worker; also its torch threads"))

    def __post_init__(self) -> None:
        require(self.gpus >= 0, "gpus", self.gpus, "zero or more")
        require(self.cpus_per_worker > 0, "cpus_per_worker", self.cpus_per_worker, "positive")

    def check(self, cfg: TrainConfig) -> None:
        """One worker takes the whole global batch, so any batch size works."""
        require_gpu_for_fp16(cfg, self.gpus > 0, "--gpus")

    def workers(self) -> WorkerScaling:
        gpus = float(self.gpus) if self.gpus else None
        return WorkerScaling(1, self.gpus > 0, self.cpus_per_worker, gpus, "PACK")


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


def run(prepared: PreparedRun, scaling: DataParallelScaling, **options) -> TrainSummary:
    return run_workers(prepared, scaling.workers(), wrap_dp, **options)


def main(argv: list[str] | None = None) -> int:
    return entry_point("dp", DataParallelScaling, run, argv, __doc__)


if __name__ == "__main__":
    exit_process(main())
