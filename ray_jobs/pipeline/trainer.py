"""Model (pipeline) parallel: ``python -m ray_jobs.pipeline --num-stages S --num-microbatches M``.

The model is cut into S stages (``models.split_into_stages``), each a Ray actor with its own
GPU (or CPUs), placed with one placement-group bundle per stage. Each global batch is cut into
M micro-batches; activations flow forward and gradients back between the actors, never through
the driver, in the order a schedule (GPipe or 1F1B) gives: over torch.distributed send/recv
(``p2p``: one actor call per stage per few batches), a Ray Compiled Graph (``compiled``: nccl
channels between GPUs), or one actor call per op with object references (``actor_calls``).

``--data-parallel R`` runs R such pipelines side by side (DP x PP, R x S actors, over p2p): each
replica takes 1/R of every global batch, and each stage averages its gradients with its R-1
copies before the step, so every replica steps to the same weights, those of one process.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field

import torch
from ray.exceptions import RayTaskError

from ray_jobs.core.batches import global_batches
from ray_jobs.core.checkpoint import (
    TrainState,
    checkpoint_name,
    latest_checkpoint,
    latest_progress,
    prune_checkpoints,
    write_checkpoint,
)
from ray_jobs.core.evaluation import Validation, is_best, progress, validate, write_best_model
from ray_jobs.core.failure_record import record_failure
from ray_jobs.core.lr_schedule import lr_schedule
from ray_jobs.core.model_init import probe_model
from ray_jobs.core.step import non_finite_loss, norm_readings
from ray_jobs.data import storage
from ray_jobs.data.stream import epoch_indices, reader_stats, stream_reader
from ray_jobs.driver import interrupts
from ray_jobs.driver.entry import entry_point
from ray_jobs.driver.outputs import finish, finish_trained
from ray_jobs.driver.prepare import PreparedRun
from ray_jobs.driver.resources import wait_for_bundles
from ray_jobs.driver.summary import TrainSummary
from ray_jobs.errors import TrainingFailed, root_cause
from ray_jobs.observability.tensorboard import TrainLog
from ray_jobs.observability.throughput import throughput_text
from ray_jobs.pipeline.checkpoint_writer import CheckpointWriter, snapshot
from ray_jobs.pipeline.scaling import PipelineScaling
from ray_jobs.pipeline.stage_group import StageGroup, StartFailed
from ray_jobs.pipeline.timing import PipelineTiming
from ray_jobs.pipeline.transports import STAGE_FAILURES, BatchTimeout
from ray_jobs.testing.faults import NO_FAULTS, Faults

# This module holds the attempts (retries from the latest checkpoint) and the epoch loop, on the
# driver; the flags are scaling.py, the stage actor stage.py, their placement and failure probing
# stage_group.py, the transports transports.py, the time accounting timing.py.
# Actor calls (of --batches-per-call batches each) in flight at once; more only holds more
# activations, the overlap is the same.
MAX_INFLIGHT_CALLS = 2


def run_batches(stages: StageGroup, batches: list[torch.Tensor], batch_timeout_s: float) -> list[float]:
    """Run every global batch through the schedule; returns each batch's loss.

    Batch k+1 is submitted before batch k finishes: each stage runs its ops in order, so
    its forward of batch k+1 still comes after its own optimizer step of batch k, and
    the result is the same as running the batches one by one, without the flush between.
    """
    transport = stages.transport
    size = transport.batches_per_call
    pending: deque = deque()
    losses: list[float] = []

    def collect(handle, num_batches: int) -> list[float]:
        timeout = batch_timeout_s * num_batches
        try:
            return transport.collect(handle, timeout)
        except BatchTimeout:
            raise TrainingFailed(
                f"a global batch did not finish within --batch-timeout-s {batch_timeout_s:g} "
                f"(a call of {num_batches} batch(es) waited {timeout:g} s; transport {transport.name}, "
                f"stages on nodes {stages.nodes})"
            ) from None

    try:
        for start in range(0, len(batches), size):
            interrupts.check()  # between calls: nothing is half-submitted
            chunk = batches[start : start + size]
            pending.append((transport.submit(chunk), len(chunk)))
            if len(pending) > MAX_INFLIGHT_CALLS:
                losses += collect(*pending.popleft())
        while pending:
            losses += collect(*pending.popleft())
    except Exception:
        transport.discard([handle for handle, _ in pending])
        raise
    return losses


@dataclass
class Attempt:
    """Progress of one attempt; what survives a restart is only what was checkpointed."""

    state: TrainState
    resumed_from_epoch: int | None
    resumed_from_step: int | None
    timing: PipelineTiming
    log: TrainLog
    writer: CheckpointWriter
    """The run's checkpoint writes (one for every attempt: a restart waits for the last)."""
    grad_norms: list[float] = field(default_factory=list)
    """``--grad-clip-norm``: this attempt's whole-model norm before clipping, per step."""


def _epoch(
    stages: StageGroup, prepared: PreparedRun, attempt: Attempt, scaling: PipelineScaling, faults: Faults
) -> None:
    """Epoch ``state.epochs_completed`` from step ``state.step``, in segments of
    ``--checkpoint-every-steps`` global batches with a checkpoint after each but the last."""
    cfg, state = prepared.cfg, attempt.state
    epoch, began = state.epochs_completed, time.perf_counter()
    batches = global_batches(epoch_indices(prepared.dataset, cfg.seed, epoch, cfg.shuffle), cfg.batch_size)
    losses, new = list(state.step_losses), 0
    for first, end in _segments(state.step, len(batches), cfg.checkpoint_every_steps):
        faults.pipeline_segment(stages.actors, epoch, range(first, end), attempt.resumed_from_epoch)
        losses += run_batches(stages, batches[first:end], scaling.batch_timeout_s)
        new += end - first
        failure = non_finite_loss(losses, epoch)
        if failure:
            record_failure(prepared.run_dir, failure)
            raise TrainingFailed(failure)
        if end < len(batches):
            state.step, state.step_losses = end, list(losses)
            _checkpoint(stages, prepared, attempt)
    seconds = time.perf_counter() - began
    attempt.timing.add_epoch(seconds, new * cfg.batch_size, stages.take_timing())
    norms = stages.take_grad_norms() if cfg.grad_clip_norm is not None else None
    attempt.grad_norms += norms or []
    state.losses.append(sum(losses) / len(batches))
    state.epochs_completed, state.step, state.step_losses = epoch + 1, 0, []
    validation = _validate(stages, prepared, state)
    throughput = throughput_text(new * cfg.batch_size / seconds, prepared.dataset.block_size, scaling.num_actors)
    print(
        f"[raypar] epoch {epoch + 1}/{cfg.epochs}  loss {state.losses[-1]:.6f}{progress(validation)}{throughput}",
        flush=True,
    )
    step_lrs = lr_schedule(cfg, prepared.dataset.num_rows).epoch(epoch)
    attempt.log.epoch(
        epoch, losses, state.losses[-1], validation, new * cfg.batch_size / seconds, step_lrs[-1], step_lrs, norms
    )
    if state.epochs_completed % cfg.checkpoint_every == 0 or state.epochs_completed == cfg.epochs:
        _checkpoint(stages, prepared, attempt, gathered=validation is not None)


def _validate(stages: StageGroup, prepared: PreparedRun, state: TrainState) -> Validation | None:
    """``--val-data`` on the driver, with the stages' weights gathered into the whole model (as a
    checkpoint gathers them): the same chunks, so the same result, as the data-parallel workers."""
    if prepared.val_dataset is None:
        return None
    state.model, state.optimizer, state.rng, state.scaler = stages.gather_state()
    # On meta, bar the buffers a model computes as it is built (a rotary inv_freq, in no checkpoint).
    model = probe_model(prepared.cfg, prepared.dataset, prepared.model_factory)
    model.load_state_dict(state.model, assign=True)  # the gathered tensors themselves: no second copy
    result = validate(model, prepared.val_dataset, torch.device("cpu"))
    state.val_losses.append(result.loss)
    state.val_accuracy.append(result.accuracy)
    if is_best(state.val_losses):
        write_best_model(prepared.run_dir, lambda: state.model)
    return result


def _segments(first: int, total: int, every: int) -> list[tuple[int, int]]:
    cuts = [first] + [step for step in range(first + 1, total) if every and step % every == 0] + [total]
    return list(zip(cuts, cuts[1:]))


def _checkpoint(stages: StageGroup, prepared: PreparedRun, attempt: Attempt, gathered: bool = False) -> None:
    """Gather the stages' state and write it, at once or in the background (``--checkpoint-mode``);
    ``gathered``: ``attempt.state`` already holds the stages' state as of now."""
    began, state, cfg = time.perf_counter(), attempt.state, prepared.cfg
    if not gathered:
        state.model, state.optimizer, state.rng, state.scaler = stages.gather_state()
    name, saved = checkpoint_name(state.epochs_completed, state.step), snapshot(state)

    def write() -> None:
        write_checkpoint(storage.join(prepared.run_dir, name), saved)
        prune_checkpoints(prepared.run_dir, cfg.num_checkpoints_to_keep)

    attempt.writer.write(name, write, final=state.progress == (cfg.epochs, 0), began=began)


def _start_attempt(stages: StageGroup, prepared: PreparedRun, num_stages: int, writer: CheckpointWriter) -> Attempt:
    writer.wait()  # the last attempt's last checkpoint, whole before the resume looks
    checkpoint = latest_checkpoint(prepared.run_dir)
    if checkpoint is None:
        return Attempt(
            TrainState(dict(prepared.initial_state), {}, 0, []),
            None,
            None,
            PipelineTiming(num_stages),
            TrainLog(prepared.run_dir),
            writer,
        )
    stages.restore(checkpoint)
    at = f"epoch {checkpoint.epochs_completed}" + (f", step {checkpoint.step}" if checkpoint.step else "")
    print(f"[raypar] resuming from the checkpoint after {at}", flush=True)
    return Attempt(
        checkpoint,
        checkpoint.epochs_completed,
        checkpoint.step,
        PipelineTiming(num_stages),
        TrainLog(prepared.run_dir),
        writer,
    )


def run(prepared: PreparedRun, scaling: PipelineScaling, faults: Faults = NO_FAULTS) -> TrainSummary:
    """Train ``prepared`` on a pipeline of stage actors; Ray must be connected.

    Each attempt, its start included (placement, stage actors, process group), ends in the
    latest checkpoint's state or a restart, up to ``--max-failures``; a stage's own error (not
    a lost stage) ends the run with that error, named by stage. ``faults``: what a test arms.
    """
    cfg = prepared.cfg
    scaling.check(cfg)
    trained = finish_trained(prepared, {"scaling": asdict(scaling)}, scaling.num_actors)
    if trained is not None:
        return trained
    if scaling.num_microbatches < scaling.num_stages:
        warnings.warn(
            f"--num-microbatches {scaling.num_microbatches} < --num-stages {scaling.num_stages}: "
            "the pipeline can never fill, some stages always idle",
            stacklevel=2,
        )
    wait_for_bundles(scaling.bundles, scaling.placement_strategy, scaling.request, cfg.resource_timeout)
    with stream_reader(prepared, latest_progress(prepared.run_dir)) as reader:
        return _attempts(prepared, scaling, reader, faults)


def _attempts(prepared: PreparedRun, scaling: PipelineScaling, reader, faults: Faults = NO_FAULTS) -> TrainSummary:
    cut = scaling.cut(prepared)
    writer = CheckpointWriter(prepared.cfg.checkpoint_mode)
    try:
        return _attempts_writing(prepared, scaling, reader, faults, cut, writer)
    finally:
        writer.close()


def _attempts_writing(
    prepared: PreparedRun, scaling: PipelineScaling, reader, faults: Faults, cut, writer: CheckpointWriter
) -> TrainSummary:
    cfg = prepared.cfg
    for failures in range(cfg.max_failures + 1):
        stages = None
        try:
            stages = StageGroup(
                prepared,
                scaling,
                cut,
                reader,
                on_started=functools.partial(faults.stages_started, first_attempt=failures == 0),
            )
            attempt = _start_attempt(stages, prepared, scaling.num_stages, writer)
            while attempt.state.epochs_completed < cfg.epochs:
                _epoch(stages, prepared, attempt, scaling, faults)
            return _finish(prepared, scaling, stages, attempt, reader)
        except (StartFailed, *STAGE_FAILURES, RayTaskError) as error:
            reason = _lost_stage(stages, error)
            if reason is None:  # a stage's own error, with every stage alive: not one a restart mends
                raise TrainingFailed(root_cause(error)) from error
            if failures == cfg.max_failures:
                raise TrainingFailed(f"{reason}; --max-failures {cfg.max_failures} exhausted") from error
            print(f"[raypar] {reason}; restarting the pipeline from the latest checkpoint", flush=True)
        finally:
            if stages is not None:
                stages.shutdown()
    raise AssertionError("unreachable")


def _lost_stage(stages: StageGroup | None, error: Exception) -> str | None:
    """Why the attempt ended, when a restart can mend it (a stage lost); None for a stage's own
    error. A live stage's error (its all-reduce's or FSDP gather's gloo "Connection reset by
    peer") can reach the driver before the dead peer's does, so a ``RayTaskError`` counts as a
    lost stage when one is found dead."""
    if isinstance(error, RayTaskError) and not isinstance(error, STAGE_FAILURES):
        return None if stages is None else stages.dead_stage()
    return str(error) if stages is None else stages.describe_failure(error)


def _finish(
    prepared: PreparedRun, scaling: PipelineScaling, stages: StageGroup, attempt: Attempt, reader
) -> TrainSummary:
    extra = {
        "stage_nodes": stages.nodes,
        "stage_children": stages.cut.children,
        "transport": stages.transport.name,
        "schedule": scaling.schedule,
        "num_stages": scaling.num_stages,
        "data_parallel": scaling.data_parallel,
        "checkpoint_stall_s": list(attempt.writer.stalls_s),
        "stage_model_state_bytes": stages.model_state_bytes(),  # rank order: replica by replica
        "stage_comm_bytes_per_step": stages.comm_bytes_per_step() if prepared.cfg.count_comm_bytes else None,
        "num_microbatches": scaling.num_microbatches,
        **attempt.timing.report(scaling.schedule, scaling.num_stages, scaling.num_microbatches),
        **{
            f"stage_peak_{key}": [memory[key] for memory in stages.peak_memory()]
            for key in ("rss_bytes", "device_bytes")
        },
    }
    metrics = {
        "samples_per_second": attempt.timing.samples_per_second,
        "resumed_from_epoch": attempt.resumed_from_epoch,
        "resumed_from_step": attempt.resumed_from_step,
        "data_wait_fraction": attempt.timing.data_wait_fraction,
        "grad_norm": norm_readings(attempt.grad_norms),
        **reader_stats(reader),
    }
    return finish(prepared, attempt.state, metrics, scaling.num_actors, {"scaling": asdict(scaling)}, extra)


def main(argv: list[str] | None = None) -> int:
    return entry_point("pipeline", PipelineScaling, run, argv, __doc__)
