"""DistributedDataParallel on Ray Train: one process per worker, each with its own model replica;
``TorchTrainer`` starts and places the workers and sets up the process group (gloo on CPU, nccl
on GPU); gradients are all-reduced. Runs on the driver; the workers run ``worker.py``.
"""

from __future__ import annotations

import functools

from torch import nn

from ray_jobs.core.config import WorkerScaling
from ray_jobs.core.model_init import warn_not_reproducible
from ray_jobs.data_parallel.trainer import run_workers
from ray_jobs.data_parallel.wrap import Replicas, wrap_ddp
from ray_jobs.driver.prepare import PreparedRun
from ray_jobs.driver.summary import TrainSummary
from ray_jobs.testing.faults import NO_FAULTS, Faults


def run(prepared: PreparedRun, scaling: WorkerScaling, faults: Faults = NO_FAULTS) -> TrainSummary:
    synced = (nn.modules.batchnorm._BatchNorm,) if scaling.sync_batchnorm else ()
    warn_not_reproducible(prepared.cfg, prepared.dataset, prepared.model_factory, "DDP", synced)
    wrap = Replicas(functools.partial(wrap_ddp, sync_batchnorm=scaling.sync_batchnorm))
    return run_workers(prepared, scaling, wrap, faults)
