"""The training loop every Ray Train worker runs, for DDP, FSDP and DataParallel alike.

The strategy enters only through ``LoopConfig.wrap`` (how the model is wrapped, and how its
full state is read and restored: ``wrap.Replicas``, ``sharding.Shards``) and through which slice
of each global batch this worker takes (its world rank).
"""

from __future__ import annotations

import functools
import logging
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

from ray_jobs.core.activations import checkpoint_activations, compile_blocks
from ray_jobs.core.batches import global_batches, shard, shard_weight
from ray_jobs.core.checkpoint import (
    TrainState,
    checkpoint_name,
    latest_checkpoint,
    restore_scaler,
    resume_rng,
    rng_state,
    saved_rng,
)
from ray_jobs.core.config import TrainConfig
from ray_jobs.core.evaluation import Validation, combine, is_best, progress, write_best_model
from ray_jobs.core.failure_record import record_failure
from ray_jobs.core.lr_schedule import lr_schedule
from ray_jobs.core.model_init import SafetensorsInit, make_model, meta_model
from ray_jobs.core.shard_plan import shard_units
from ray_jobs.core.step import (
    build_optimizer,
    grad_scaler,
    loss_function,
    non_finite_loss,
    norm_readings,
    rank_seed,
    train_step,
)
from ray_jobs.data import storage
from ray_jobs.data.device_copy import prefetched
from ray_jobs.data.stream import epoch_indices, open_source
from ray_jobs.data_parallel.checkpointing import CheckpointSaver, report
from ray_jobs.data_parallel.wrap import Replicas
from ray_jobs.errors import described
from ray_jobs.observability.comm_bytes import CommBytes
from ray_jobs.observability.model_memory import model_state_bytes
from ray_jobs.observability.process_stats import cpu_times, peak_rss_bytes, reset_peak_rss, rss_bytes, steal_fraction
from ray_jobs.observability.throughput import throughput_text
from ray_jobs.testing.faults import NO_FAULTS, Faults


@dataclass
class LoopConfig:
    """Everything a worker needs; large values travel as object-store references."""

    train: dict[str, Any]
    dataset: ray.ObjectRef
    initial_state: ray.ObjectRef
    wrap: Replicas
    """How the strategy wraps the model, and reads and restores its state."""
    num_threads: int
    run_dir: storage.Location
    reader: Any = None
    """The stream's ``WindowReader`` actor (``--ingest stream``), else None."""
    model_factory: Callable[..., nn.Module] | None = None
    """``--model``'s callable as the driver resolved it (``PreparedRun.model_factory``)."""
    val_dataset: ray.ObjectRef | None = None
    """``--val-data`` (in memory, or a stream's metadata), else None."""
    faults: Faults = NO_FAULTS
    """What a test arms (``testing.faults``); none in a user's run."""


def train_loop_per_worker(raw: dict[str, Any]) -> None:
    loop = LoopConfig(**raw)
    cfg = TrainConfig(**loop.train)
    _quiet_report_logs()
    ctx = ray.train.get_context()
    torch.set_num_threads(loop.num_threads)
    dataset = ray.get(loop.dataset)
    device = ray.train.torch.get_device()
    # A first build on meta, dropped: the modules the model's code imports on first use (a Hugging Face
    # family's, ~150 MB) are loaded, so the start-up reading below is the weights' cost alone, for every
    # strategy alike (a model that refuses meta parameters is read with its code).
    meta_model(cfg, dataset, loop.model_factory)
    baseline = rss_bytes() if reset_peak_rss() else None
    model, wrapped = _build(loop, cfg, dataset, device)
    startup = peak_rss_bytes() - baseline if baseline is not None else None  # the model's start: its weights' cost
    optimizer = build_optimizer(model.parameters(), cfg)  # after the wrap: FSDP's are new (sharded) parameters
    scaler = grad_scaler(cfg.precision, device)
    torch.manual_seed(rank_seed(cfg.seed, ctx.get_world_rank()))  # this rank's dropout draws
    start = _restore(loop, model, optimizer, scaler, cfg.seed, ctx.get_world_rank(), ctx.get_world_size())
    if start is not None and ctx.get_world_rank() == 0:
        at = f"epoch {start.epochs_completed}" + (f", step {start.step}" if start.step else "")
        print(f"[raypar] resuming from the checkpoint after {at} on {ctx.get_world_size()} worker(s)", flush=True)
    worker = _Worker(loop, cfg, dataset, device, (model, wrapped), optimizer, scaler, ctx, start)
    worker.report["worker_startup_rss_bytes"] = _gather(startup, worker.world_size)
    for epoch in range(start.epochs_completed if start else 0, cfg.epochs):
        resuming = start is not None and epoch == start.epochs_completed
        first_step, done = (start.step, list(start.step_losses)) if resuming else (0, [])
        began, cpu = time.perf_counter(), cpu_times()
        with described(f"world rank {worker.world_rank}"):  # only this rank knows where it failed
            loop.faults.worker_epoch_start(epoch, resuming, worker.world_rank, worker.world_size)
            step_losses = worker.run_epoch(epoch, first_step, done)
        if step_losses is None:
            return  # a non-finite loss, recorded
        worker.end_epoch(epoch, done + step_losses, time.perf_counter() - began, steal_fraction(cpu, cpu_times()))


def _build(loop: LoopConfig, cfg: TrainConfig, dataset, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """The model with its starting weights, and as the strategy wraps it. Weights left in safetensors
    (``SafetensorsInit``, fsdp only) are read by slice into a model built on meta and sharded."""
    initial = ray.get(loop.initial_state)
    if isinstance(initial, SafetensorsInit):  # the driver checked that it builds on meta
        model = meta_model(cfg, dataset, loop.model_factory)
    else:
        model = make_model(cfg, dataset, loop.model_factory)
        model.load_state_dict(initial)
        model.to(device)
    if cfg.activation_checkpointing:
        checkpoint_activations(model)
    if cfg.compile:  # each group FSDP gathers (the same blocks for DDP), so its hooks stay outside the graph
        compile_blocks(model, [(name, model.get_submodule(name)) for name in shard_units(model)])
    if isinstance(initial, SafetensorsInit):
        return model, loop.wrap.wrap_from_slices(model, initial, device, cfg.precision)
    return model, loop.wrap.wrap(model, device, cfg.precision)


class _Worker:
    """This rank's view of the run: its shard of every global batch, on its device, and what it
    reports."""

    def __init__(
        self,
        loop: LoopConfig,
        cfg: TrainConfig,
        dataset,
        device: torch.device,
        models: tuple[nn.Module, nn.Module],
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        ctx,
        start: TrainState | None,
    ) -> None:
        self.loop, self.cfg, self.dataset, self.device = loop, cfg, dataset, device
        (self.model, self.wrapped), self.optimizer, self.scaler = models, optimizer, scaler
        self.no_sync = loop.wrap.no_sync(self.wrapped)  # --grad-accum-steps
        self.comm = CommBytes(cfg.count_comm_bytes)
        self.comm.hook_ddp(self.wrapped)
        self.loss_fn = loss_function(dataset.task)
        self.world_rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.source = open_source(dataset, loop.reader, cfg.seed, cfg.shuffle, device)
        self.first_step_at: float | None = None  # wall clock, comparable with the driver's
        self.resumed = start is not None
        self.schedule = lr_schedule(cfg, dataset.num_rows)
        self.grad_norms: list[torch.Tensor] = []  # --grad-clip-norm: each step's norm before clipping
        self.losses = list(start.losses) if start else []
        self.val = ray.get(loop.val_dataset) if loop.val_dataset is not None else None
        self.val_losses = list(start.val_losses) if start else []
        self.val_accuracy = list(start.val_accuracy) if start else []
        self.num_samples, self.epoch_seconds, self.epoch_steal = 0, [], []
        upload = functools.partial(loop.faults.checkpoint_upload, world_rank=self.world_rank, resumed=self.resumed)
        self.saver = CheckpointSaver(cfg.checkpoint_mode, upload)
        self.log = _train_log(loop.run_dir) if self.world_rank == 0 else None  # TensorBoard: world rank 0's
        mine = (ray.get_runtime_context().get_node_id(), ctx.get_node_rank())
        nodes, node_ranks = (list(column) for column in zip(*_gather(mine, self.world_size)))
        attempt = {
            "num_workers": self.world_size,
            "epoch": start.epochs_completed if start else 0,
            "step": start.step if start else 0,
        }
        self.report = {
            "worker_nodes": nodes,
            "worker_node_ranks": node_ranks,
            "resumed_from_epoch": start.epochs_completed if start else None,
            "resumed_from_step": start.step if start else None,
            "world_sizes": (list(start.world_sizes) if start else []) + [attempt],
        }

    def run_epoch(self, epoch: int, first_step: int, done: list[float]) -> list[float] | None:
        """Train epoch ``epoch`` from global batch ``first_step`` (``done``: the losses of the steps
        before it); returns the new steps' global-batch losses, the same on every rank, or None
        after a non-finite loss (recorded for the driver)."""
        cfg, every = self.cfg, self.cfg.checkpoint_every_steps
        batches = global_batches(epoch_indices(self.dataset, cfg.seed, epoch, cfg.shuffle), cfg.batch_size)
        step_losses = torch.zeros(len(batches) - first_step, device=self.device)
        weight = shard_weight(cfg.batch_size, self.world_size, self.world_rank)
        if self.first_step_at is None:
            self.first_step_at = time.time()
        mine = (self.source.rows(shard(batch, self.world_size, self.world_rank)) for batch in batches[first_step:])
        for index, (features, targets) in enumerate(prefetched(mine, self.device)):
            self.schedule.apply(self.optimizer, self.schedule.step_of(epoch, first_step + index))
            with self.comm.step():
                result = train_step(
                    self.wrapped,
                    self.optimizer,
                    self.loss_fn,
                    features,
                    targets,
                    weight,
                    precision=cfg.precision,
                    scaler=self.scaler,
                    clip_norm=cfg.grad_clip_norm,
                    accum_steps=cfg.grad_accum_steps,
                    no_sync=self.no_sync,
                )
            step_losses[index] = result.loss
            if result.grad_norm is not None:  # the same on every rank: the all-reduced gradients'
                self.grad_norms.append(result.grad_norm)
            step = first_step + index + 1
            self.loop.faults.worker_step_done(epoch, step, self.resumed, self.world_rank)
            if every and step % every == 0 and step < len(batches):
                so_far = done + _mean_over_workers(step_losses[: index + 1].clone(), self.world_size).cpu().tolist()
                self.checkpoint(epoch, step, so_far)
        # One collective per epoch: every rank sees the same global losses and so stops together.
        losses = _mean_over_workers(step_losses, self.world_size).cpu().tolist()
        failure = non_finite_loss(losses, epoch, first_step)
        if failure:
            # Ray keeps only checkpointed reports' metrics, so the reason travels as a file.
            if self.world_rank == 0:
                record_failure(self.loop.run_dir, failure)
            return None
        self.num_samples += len(losses) * cfg.batch_size
        self.epoch_samples, self.epoch_steps = len(losses) * cfg.batch_size, len(losses)
        return losses

    def end_epoch(self, epoch: int, step_losses: list[float], seconds: float, steal: float | None) -> None:
        cfg = self.cfg
        self.losses.append(sum(step_losses) / len(step_losses))
        validation = self.validate()
        self.epoch_seconds.append(seconds)
        self.epoch_steal.append(steal)
        self.report.update(
            epoch=epoch,
            loss=self.losses[-1],
            epochs_completed=epoch + 1,
            epoch_seconds=list(self.epoch_seconds),
            epoch_steal=list(self.epoch_steal),
            samples_per_second=self.num_samples / sum(self.epoch_seconds),
            data_wait_fraction=self.source.wait_s / sum(self.epoch_seconds),
            first_step_at=self.first_step_at,
            worker_peak_rss_bytes=_gather(peak_rss_bytes(), self.world_size),
            # after the epoch's last step: its gradients and the optimizer state are all there
            worker_model_state_bytes=_gather(model_state_bytes(self.model, self.optimizer), self.world_size),
            worker_comm_bytes_per_step=_gather(self.comm.per_step(), self.world_size) if self.comm.enabled else None,
            grad_norm=norm_readings(self.grad_norms),
            device_name=torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
        )
        if self.world_rank == 0:
            print(
                f"[raypar] epoch {epoch + 1}/{cfg.epochs}  loss {self.losses[-1]:.6f}{progress(validation)}"
                f"{throughput_text(self.epoch_samples / seconds, self.dataset.block_size, self.world_size)}",
                flush=True,
            )
        if self.log is not None:
            self.log.epoch(
                epoch,
                step_losses,
                self.losses[-1],
                validation,
                self.epoch_samples / seconds,
                self.optimizer.param_groups[0]["lr"],
                self.schedule.epoch(epoch),
                [float(norm) for norm in self.grad_norms[-self.epoch_steps :]] if self.grad_norms else None,
            )
        if (epoch + 1) % cfg.checkpoint_every == 0 or epoch + 1 == cfg.epochs:
            self.checkpoint(epoch + 1, 0, [])
        else:
            report(self.report)

    def validate(self) -> Validation | None:
        """``--val-data`` with the weights after this epoch: each rank takes its chunks, the chunks'
        sums are gathered, so every rank holds the same result (world rank 0 writes best_model.pt)."""
        if self.val is None:
            return None
        mine = self.loop.wrap.chunk_sums(self.model, self.val, self.world_rank, self.world_size, self.device)
        result = combine(
            {chunk: sums for part in _gather(mine, self.world_size) for chunk, sums in part.items()}, self.val
        )
        self.val_losses.append(result.loss)
        self.val_accuracy.append(result.accuracy)
        if is_best(self.val_losses):  # the same on every rank: a sharded model's weights gather collectively
            weights = self.loop.wrap.weights(self.model)
            if self.world_rank == 0:
                write_best_model(self.loop.run_dir, lambda: weights)
        return result

    def checkpoint(self, epochs_completed: int, step: int, step_losses: list[float]) -> None:
        """Report with a checkpoint (every rank calls it: the RNG states are gathered, a sharded
        model's state too, and a report is a barrier); world rank 0 writes ``checkpoint.pt``, and
        with a sharded model every rank writes its shards beside it; at once or in the background
        (``--checkpoint-mode``, ``checkpointing.CheckpointSaver``)."""
        began = time.perf_counter()
        rngs = _gather(rng_state(), self.world_size)
        final = (epochs_completed, step) == (self.cfg.epochs, 0)

        def state() -> TrainState:
            # No copy in sync mode: the checkpoint is written before the next step changes these tensors.
            weights, optimizer = self.loop.wrap.checkpoint_state(self.model, self.optimizer, final)
            return TrainState(
                weights,
                optimizer,
                epochs_completed,
                list(self.losses),
                rngs,
                step,
                step_losses,
                world_sizes=self.report["world_sizes"],
                scaler=self.scaler.state_dict() if self.scaler else None,
                val_losses=list(self.val_losses),
                val_accuracy=list(self.val_accuracy),
                sharded=self.loop.wrap.sharded,
                weights_sliced=self.loop.wrap.sharded and final,
            )

        def shards(directory: str, in_background: bool):
            return self.loop.wrap.write_shards(directory, self.model, self.optimizer, final, in_background)

        metrics = {**self.report, "step": step, "checkpoint_stall_s": list(self.saver.stalls_s)}
        self.saver.save(
            checkpoint_name(epochs_completed, step),
            metrics,
            state if self.world_rank == 0 else None,
            shards,
            final,
            began,
        )


def _restore(
    loop: LoopConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    seed: int,
    world_rank: int,
    world_size: int,
) -> TrainState | None:
    state = latest_checkpoint(loop.run_dir)
    if state is None:
        return None
    directory = storage.join(loop.run_dir, checkpoint_name(state.epochs_completed, state.step))
    loop.wrap.restore(directory, model, optimizer, state)
    restore_scaler(scaler, state)
    resume_rng(saved_rng(state, world_rank, world_size), seed, world_rank, state.epochs_completed)
    return state


def _mean_over_workers(value: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(value)
        value = value / world_size
    return value


def _train_log(run_dir: str):
    """World rank 0's TensorBoard writer, imported here: tensorboardX and its protobufs are ~0.2
    CPU-seconds of a worker's start that the other ranks, which write nothing, need not pay."""
    from ray_jobs.observability.tensorboard import TrainLog

    return TrainLog(run_dir)


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
