"""How each data-parallel strategy holds the unchanged model on a Ray Train worker: how it wraps
it, and how the worker reads and restores its full state.

Runs in the worker: the loop unpickles these with its config, so this module imports nothing
that runs only on the driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future

import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from ray_jobs.core.checkpoint import TrainState, load_named_optimizer_state, named_optimizer_state, require_whole
from ray_jobs.core.evaluation import chunk_sums, my_chunks
from ray_jobs.core.step import autocast


class Replicas:
    """DDP and DataParallel: every rank holds the whole model, so any rank's ``state_dict`` is
    the full one and a checkpoint is world rank 0's alone. The worker loop calls these methods;
    a sharded strategy (``sharding.Shards``) overrides them, so the loop never asks which
    strategy it runs."""

    def __init__(self, wrap: Callable[[nn.Module, torch.device, str], nn.Module]) -> None:
        self._wrap = wrap

    def wrap(self, model: nn.Module, device: torch.device, precision: str) -> nn.Module:
        """The model as the train step calls it (the unwrapped ``model`` keeps the parameters)."""
        return self._wrap(model, device, precision)

    def no_sync(self, wrapped: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
        """--grad-accum-steps: DDP all-reduces only the last micro-step's backward."""
        if isinstance(wrapped, nn.parallel.DistributedDataParallel):
            return wrapped.no_sync
        return contextlib.nullcontext

    def weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full ``state_dict`` on the CPU, on world rank 0 (every rank calls it; the others
        get ``{}`` and copy nothing off their GPU)."""
        if not _world_rank_0():
            return {}
        return {key: value.detach().cpu() for key, value in model.state_dict().items()}

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, final: bool) -> tuple[dict, dict]:
        """The weights and name-keyed optimizer state for ``checkpoint.pt``, on world rank 0
        (every rank calls it)."""
        if not _world_rank_0():
            return {}, {}
        return self.weights(model), named_optimizer_state(optimizer, dict(model.named_parameters()))

    sharded = False
    """Whether each rank writes its own part of a checkpoint (``write_shards``)."""

    def write_shards(
        self,
        directory: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        final: bool = False,
        in_background: bool = False,
    ) -> bool | Future:
        """Write this rank's part of the state into ``directory``; whether there was one, or, with
        ``in_background``, the future of the write (its state already copied off the model).
        ``final``: the run's last checkpoint."""
        return False

    def restore(self, directory, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState) -> None:
        """Load a checkpoint's weights and optimizer state (``directory``: where it lies)."""
        require_whole(state)
        model.load_state_dict(state.model)
        load_named_optimizer_state(optimizer, dict(model.named_parameters()), state.optimizer)

    def chunk_sums(self, model: nn.Module, val, world_rank: int, world_size: int, device: torch.device) -> dict:
        """--val-data: this rank's chunks' sums (``evaluation.chunk_sums``)."""
        return chunk_sums(model, val, my_chunks(val, world_rank, world_size), device)


def _world_rank_0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


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
