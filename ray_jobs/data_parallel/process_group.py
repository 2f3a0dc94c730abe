"""Ray Train's torch process group, set up by a controller that never imports torch.

Ray Train's controller (a process of its own, started for every fit) unpickles the run's
``TorchConfig``, whose module imports torch at its top: ~1.0 CPU-second of every fit, measured,
for a process that only tells the workers where to meet. ``ProcessGroupConfig`` is that config
with a torch-free class. The workers still join through Ray Train's own functions (the same
environment variables, the same ``init_process_group``, the same shutdown), imported there, where
torch is loaded anyway.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
from ray.train.v2._internal.util import TrainingFramework

from ray_jobs.core.torch_imports import load_torch_for_training

logger = logging.getLogger(__name__)


@dataclass
class ProcessGroupConfig(BackendConfig):
    """``ray.train.torch.TorchConfig``'s fields, which ``TorchTrainer`` takes in its place.

    ``backend``: gloo or nccl; ``TorchTrainer`` fills it in (nccl when the workers use GPUs).
    ``timeout_s``: how long a collective waits before it fails.
    """

    backend: str | None = None
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return _TorchProcessGroup

    @property
    def train_func_context(self):
        # Read on the driver, where the training function is built, and run on the workers.
        from ray.train.torch.config import TorchConfigContextManager

        return TorchConfigContextManager

    @property
    def framework(self):
        return TrainingFramework.TORCH

    def to_dict(self) -> dict:
        # The workers meet through MASTER_ADDR and MASTER_PORT, TorchConfig's default ("env").
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class _TorchProcessGroup(Backend):
    """Ray Train's torch backend: the controller picks the address, each worker joins."""

    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        backend = backend_config.backend
        if backend is None:
            backend = "nccl" if worker_group.get_resources_per_worker().get("GPU", 0) > 0 else "gloo"
        address, port = worker_group.execute_single(0, get_address_and_port)
        world_size = len(worker_group)
        joins = [
            worker_group.execute_single_async(
                world_rank,
                _join,
                backend=backend,
                address=address,
                port=port,
                world_rank=world_rank,
                world_size=world_size,
                timeout_s=backend_config.timeout_s,
            )
            for world_rank in range(world_size)
        ]
        ray.get(joins)

    def on_shutdown(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        leaving = worker_group.execute_async(_leave, destroy_process_group=len(worker_group) > 1)
        timeout_s = int(
            os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        )
        try:
            ray.get(leaving, timeout=timeout_s)
        except GetTimeoutError:
            logger.warning(f"Torch process group shutdown timed out after {timeout_s} seconds")


def _join(backend: str, address: str, port: int, world_rank: int, world_size: int, timeout_s: int) -> None:
    """On a worker: what ``TorchConfig``'s backend has each worker do. It is the first of the
    worker's code to load torch, so it loads it as a training process should."""
    load_torch_for_training()
    from ray.train.torch import config

    os.environ["MASTER_ADDR"] = address
    os.environ["MASTER_PORT"] = str(port)
    config._set_torch_distributed_env_vars()
    config._setup_torch_process_group(
        backend=backend, world_rank=world_rank, world_size=world_size, init_method="env://", timeout_s=timeout_s
    )


def _leave(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)
