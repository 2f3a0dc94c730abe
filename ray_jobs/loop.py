"""The training loop every Ray Train worker runs, for DDP and DataParallel alike.

The strategy enters only through ``LoopConfig.wrap`` (how the model is wrapped) and through
which slice of each global batch this worker takes (its world rank).
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from models import build_model
from ray_jobs import storage
from ray_jobs.checkpoint import (
    TrainState,
    checkpoint_name,
    latest_checkpoint,
    load_named_optimizer_state,
    named_optimizer_state,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from ray_jobs.config import TrainConfig
from ray_jobs.data import Dataset
from ray_jobs.errors import Failure, describe
from ray_jobs.readings import cpu_times, peak_rss_bytes, steal_fraction
from ray_jobs.runner import record_failure
from ray_jobs.training import (
    build_optimizer,
    epoch_order,
    global_batches,
    loss_function,
    non_finite_loss,
    rank_seed,
    shard,
    train_step,
)


@dataclass
class LoopConfig:
    """Everything a worker needs; large values travel as object-store references."""

    train: dict[str, Any]
    dataset: ray.ObjectRef
    initial_state: ray.ObjectRef
    wrap: Callable[[nn.Module, torch.device], nn.Module]
    num_threads: int
    run_dir: storage.Location
    crash_at_epoch: int | None = None
    """Fault injection for tests: on a run not resumed from a checkpoint, the worker process
    exits hard during this epoch, after the previous epoch's checkpoint was registered."""
    fail_at_epoch: int | None = None
    """Fault injection for tests: the last world rank raises during this epoch."""


def train_loop_per_worker(raw: dict[str, Any]) -> None:
    loop = LoopConfig(**raw)
    cfg = TrainConfig(**loop.train)
    _quiet_report_logs()
    ctx = ray.train.get_context()
    torch.set_num_threads(loop.num_threads)
    dataset: Dataset = ray.get(loop.dataset)
    device = ray.train.torch.get_device()
    model = build_model(cfg.model, dataset.in_features, dataset.out_features, **cfg.model_options)
    model.load_state_dict(ray.get(loop.initial_state))
    model.to(device)
    optimizer = build_optimizer(model.parameters(), cfg)
    torch.manual_seed(rank_seed(cfg.seed, ctx.get_world_rank()))  # this rank's dropout draws
    start = _restore(loop.run_dir, model, optimizer, cfg.seed, ctx.get_world_rank(), ctx.get_world_size())
    worker = _Worker(loop, cfg, dataset, device, loop.wrap(model, device), optimizer, ctx)
    mine = (ray.get_runtime_context().get_node_id(), ctx.get_node_rank())
    nodes, node_ranks = (list(column) for column in zip(*_gather(mine, ctx.get_world_size())))
    losses = list(start.losses) if start else []
    first_epoch = start.epochs_completed if start else 0
    report = {"worker_nodes": nodes, "worker_node_ranks": node_ranks,
              "resumed_from_epoch": first_epoch if start else None}
    num_samples, epoch_seconds, epoch_steal = 0, [], []
    for epoch in range(first_epoch, cfg.epochs):
        began, cpu = time.perf_counter(), cpu_times()
        try:
            if loop.fail_at_epoch == epoch and worker.world_rank == worker.world_size - 1:
                raise RuntimeError("injected fault")
            step_losses = worker.run_epoch(epoch, crash=loop.crash_at_epoch == epoch and start is None)
        except Exception as error:  # only this rank knows where it failed: say so in the one line
            raise Failure(describe(error, f"world rank {worker.world_rank}")) from error
        failure = non_finite_loss(step_losses, epoch)
        if failure:
            # Ray keeps only checkpointed reports' metrics, so the reason travels as a file.
            if worker.world_rank == 0:
                record_failure(loop.run_dir, failure)
            return
        losses.append(sum(step_losses) / len(step_losses))
        epoch_seconds.append(time.perf_counter() - began)
        epoch_steal.append(steal_fraction(cpu, cpu_times()))
        num_samples += len(step_losses) * cfg.batch_size
        report.update(epoch=epoch, loss=losses[-1], epochs_completed=epoch + 1, epoch_seconds=list(epoch_seconds),
                      epoch_steal=list(epoch_steal), samples_per_second=num_samples / sum(epoch_seconds),
                      first_step_at=worker.first_step_at,
                      worker_peak_rss_bytes=_gather(peak_rss_bytes(), worker.world_size))
        if worker.world_rank == 0:
            print(f"[raypar] epoch {epoch + 1}/{cfg.epochs}  loss {losses[-1]:.6f}", flush=True)
        checkpoint = (epoch + 1) % cfg.checkpoint_every == 0 or epoch + 1 == cfg.epochs
        rngs = _gather(rng_state(), worker.world_size) if checkpoint else []  # a collective: all ranks
        _report(report, _train_state(model, optimizer, epoch + 1, losses, rngs)
                if checkpoint and worker.world_rank == 0 else None)


class _Worker:
    """This rank's view of the run: its shard of every global batch, on its device."""

    def __init__(self, loop: LoopConfig, cfg: TrainConfig, dataset: Dataset, device: torch.device,
                 model: nn.Module, optimizer: torch.optim.Optimizer, ctx) -> None:
        self.cfg, self.num_rows, self.device = cfg, dataset.num_rows, device
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_function(dataset.task)
        self.world_rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.features, self.targets = (tensor.to(device) for tensor in dataset.tensors())
        self.first_step_at: float | None = None  # wall clock, comparable with the driver's

    def run_epoch(self, epoch: int, crash: bool = False) -> list[float]:
        """Train one epoch; returns every step's global-batch loss, the same on every rank."""
        cfg = self.cfg
        batches = global_batches(epoch_order(self.num_rows, cfg.seed, epoch, cfg.shuffle), cfg.batch_size)
        step_losses = torch.zeros(len(batches), device=self.device)
        for step, batch in enumerate(batches):
            if self.first_step_at is None:
                self.first_step_at = time.time()
            rows = shard(batch, self.world_size, self.world_rank).to(self.device)
            step_losses[step] = train_step(self.model, self.optimizer, self.loss_fn, self.features[rows],
                                           self.targets[rows])
            if crash and self.world_rank == 0:
                _crash()
        # One collective per epoch: every rank sees the same global losses and so stops together.
        return _mean_over_workers(step_losses, self.world_size).cpu().tolist()


def _restore(run_dir: storage.Location, model: nn.Module, optimizer: torch.optim.Optimizer, seed: int,
             world_rank: int, world_size: int) -> TrainState | None:
    state = latest_checkpoint(run_dir)
    if state is None:
        return None
    model.load_state_dict(state.model)
    load_named_optimizer_state(optimizer, dict(model.named_parameters()), state.optimizer)
    if len(state.rng) == world_size:
        set_rng_state(state.rng[world_rank])
    else:  # taken with another worker count: a fresh, still deterministic stream
        torch.manual_seed(rank_seed(seed, world_rank, state.epochs_completed))
    return state


def _report(metrics: dict[str, Any], state: TrainState | None) -> None:
    """Every rank reports (it is a barrier); only world rank 0 attaches the checkpoint."""
    if state is None:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="raypar-ckpt-") as directory:
        write_checkpoint(directory, state)
        # Named by progress: resume and model.pt take the checkpoint with the most work done.
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory),
                         checkpoint_dir_name=checkpoint_name(state.epochs_completed, state.step))


def _train_state(model: nn.Module, optimizer: torch.optim.Optimizer, epochs: int, losses: list[float],
                 rngs: list[dict[str, Any]]) -> TrainState:
    # No copy: the checkpoint is written before the next step changes these tensors.
    weights = {key: value.detach().cpu() for key, value in model.state_dict().items()}
    return TrainState(weights, named_optimizer_state(optimizer, dict(model.named_parameters())), epochs, losses,
                      rngs)


def _mean_over_workers(value: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(value)
        value = value / world_size
    return value


def _gather(mine: Any, world_size: int) -> list[Any]:
    """Every world rank's ``mine``, in world-rank order (world rank 0 reports them)."""
    gathered = [mine] * world_size
    if world_size > 1:
        dist.all_gather_object(gathered, mine)
    return gathered


def _quiet_report_logs() -> None:
    """Ray Train logs every report (metrics and all) at INFO under a logger named by file path,
    which ``LoggingConfig`` does not reach; raypar's own one line per epoch is the progress."""
    from ray.train.v2._internal.execution import context

    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def _crash() -> None:
    os._exit(1)  # as abrupt as a SIGKILL: no cleanup, no report
