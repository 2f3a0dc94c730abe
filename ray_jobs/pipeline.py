"""Model (pipeline) parallel: ``python -m ray_jobs.pipeline --num-stages S --num-microbatches M``.

The model is cut into S stages (``models.split_into_stages``), each a Ray actor with its own
GPU (or CPUs), placed with one placement-group bundle per stage. Each global batch is cut into
M micro-batches; activations flow forward and gradients back between the actors, never through
the driver, in the order a schedule (GPipe or 1F1B) gives: over torch.distributed send/recv
(``p2p``: one actor call per stage per few batches), a Ray Compiled Graph (``compiled``: nccl
channels between GPUs), or one actor call per op with object references (``actor_calls``).
"""
from __future__ import annotations

import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field

import torch
from ray.exceptions import RayTaskError

from models import build_model, is_user_model, split_into_stages
from ray_jobs import interrupts, storage
from ray_jobs.checkpoint import TrainState, checkpoint_name, latest_checkpoint, prune_checkpoints, write_checkpoint
from ray_jobs.cli import entry_point, exit_process
from ray_jobs.config import (
    PLACEMENT_STRATEGIES,
    TrainConfig,
    flag_doc,
    require,
    require_choice,
    require_divisible,
    require_gpu_for_fp16,
)
from ray_jobs.devices import gpu_sharing
from ray_jobs.errors import TrainingFailed, root_cause
from ray_jobs.pipeline_timing import PipelineTiming
from ray_jobs.preflight import Request, wait_for_bundles
from ray_jobs.runner import PreparedRun, finish, hold, record_failure
from ray_jobs.schedules import SCHEDULES
from ray_jobs.stage import StageCut, cut_stages, measured_unit_costs, stage_keys
from ray_jobs.stage_group import StageGroup, StartFailed
from ray_jobs.summary import TrainSummary
from ray_jobs.stream import epoch_indices, reader_stats, stream_reader
from ray_jobs.train_log import TrainLog
from ray_jobs.training import global_batches, make_model, non_finite_loss
from ray_jobs.transports import STAGE_FAILURES, TRANSPORTS, BatchTimeout
from ray_jobs.validation import Validation, is_best, progress, validate, write_best_model

# This module holds the flags, the attempts (retries from the latest checkpoint) and the epoch
# loop; the stage actor is stage.py, their placement and failure probing stage_group.py, the
# transports transports.py, the time accounting pipeline_timing.py.
# Actor calls (of --batches-per-call batches each) in flight at once; more only holds more
# activations, the overlap is the same.
MAX_INFLIGHT_CALLS = 2
STAGE_BALANCES = ("params", "time")  # what --stage-balance evens out between the stages


@dataclass
class PipelineScaling:
    """How the model is cut and where its stages run."""

    num_stages: int = field(default=2, metadata=flag_doc("pipeline stages, one Ray actor (and GPU) each", "pipeline"))
    num_microbatches: int = field(default=4, metadata=flag_doc("micro-batches per global batch", "pipeline"))
    schedule: str = field(default="1f1b", metadata=flag_doc("micro-batch schedule", "pipeline", choices=sorted(SCHEDULES)))
    use_gpu: bool = field(default=False, metadata=flag_doc("give each stage GPUs (--gpus-per-stage)", default_text="CPU"))
    gpus_per_stage: float = field(default=1.0, metadata=flag_doc(
        "GPUs per stage with --use-gpu; a fraction lets small stages share one GPU (then over p2p or actor_calls, "
        "not nccl)"))
    cpus_per_stage: float = field(default=1.0, metadata=flag_doc("CPUs per stage actor; also its torch threads"))
    placement_strategy: str = field(
        default="PACK", metadata=flag_doc("PACK keeps neighbouring stages on one node", choices=PLACEMENT_STRATEGIES)
    )
    transport: str = field(
        default="auto",
        metadata=flag_doc("p2p: torch.distributed (gloo) send/recv between the stages, one actor call per "
                      "stage per --batches-per-call batches, tensors through host memory; compiled: a Ray Compiled Graph (nccl "
                      "between GPUs); actor_calls: one actor call per op; auto: compiled for GPU stages on "
                      "one node, else p2p", "pipeline", choices=TRANSPORTS),
    )

    batch_timeout_s: float = field(
        default=600.0, metadata=flag_doc("fail the run when one global batch takes longer than this (s)", "pipeline")
    )
    stage_balance: str = field(default="params", metadata=flag_doc(
        "how the model is cut: params balances the stages' parameter counts; time times each layer's "
        "forward and backward on the driver's CPU over one micro-batch and balances that, for layers whose "
        "compute is out of proportion to their parameters (convolutions)", "pipeline", choices=STAGE_BALANCES))
    batches_per_call: int = field(
        default=8,
        metadata=flag_doc("p2p: global batches per actor call; more removes the dispatch gap between batches, "
                          "fewer lets Ctrl-C and the batch timeout act sooner (every batch still has its "
                          "own loss and optimizer step)", "pipeline"),
    )

    def __post_init__(self) -> None:
        require(self.batch_timeout_s > 0, "batch_timeout_s", self.batch_timeout_s, "positive")
        require(self.batches_per_call >= 1, "batches_per_call", self.batches_per_call, "at least 1")
        require_choice(self.transport, TRANSPORTS, "transport")
        require_choice(self.stage_balance, STAGE_BALANCES, "stage_balance")
        require(self.num_stages >= 1, "num_stages", self.num_stages, "at least 1")
        require(self.num_microbatches >= 1, "num_microbatches", self.num_microbatches, "at least 1")
        require(self.cpus_per_stage > 0, "cpus_per_stage", self.cpus_per_stage, "positive")
        require(self.gpus_per_stage > 0, "gpus_per_stage", self.gpus_per_stage, "positive")
        if self.gpus_per_stage != 1.0 and not self.use_gpu:
            raise ValueError("--gpus-per-stage needs --use-gpu")
        require_choice(self.schedule, sorted(SCHEDULES), "schedule")
        require_choice(self.placement_strategy, PLACEMENT_STRATEGIES, "placement_strategy")

    def check(self, cfg: TrainConfig) -> None:
        """Checks that need both configs, run before Ray is touched."""
        require_divisible(cfg.batch_size, self.num_microbatches, "--num-microbatches")
        require_gpu_for_fp16(cfg, self.use_gpu, "--use-gpu")
        if cfg.precision == "fp16" and self.transport not in ("auto", "p2p"):
            raise ValueError(f"--precision fp16 on the pipeline needs --transport p2p, not {self.transport}: its "
                             "stages skip an overflowing step together by agreeing over p2p's process group")
        shared = self.shared_gpus
        if shared and self.transport == "compiled":
            raise ValueError(f"--transport compiled cannot connect stages that share a GPU ({shared}; nccl "
                             "refuses two ranks on one device): use --transport p2p or actor_calls, or "
                             "--gpus-per-stage 1")
        # A registered model's layer count does not depend on the data's widths, so any widths tell
        # whether S fits; a user's model may need its real widths: it is cut once the data is read.
        if not is_user_model(cfg.model):
            split_into_stages(build_model(cfg.model, 1, 1, **cfg.model_options), self.num_stages)

    def check_model(self, prepared: PreparedRun) -> list[set[str]]:
        """Cut the model (on the meta device) with the data's widths: each stage's state_dict keys."""
        return stage_keys(prepared.cfg, prepared.dataset, self.num_stages, prepared.model_factory)

    def cut(self, prepared: PreparedRun) -> StageCut:
        """How the run's model is cut, by ``--stage-balance``; said on one line when measured."""
        cfg, dataset, factory = prepared.cfg, prepared.dataset, prepared.model_factory
        if self.stage_balance == "params":
            return cut_stages(cfg, dataset, self.num_stages, factory)
        seconds = measured_unit_costs(cfg, dataset, prepared.initial_state, self.num_microbatches,
                                      max(1, int(self.cpus_per_stage)), factory)
        cut = cut_stages(cfg, dataset, self.num_stages, factory, seconds)
        by_params = cut_stages(cfg, dataset, self.num_stages, factory)
        print(f"[raypar] --stage-balance time: stages of children {' | '.join(map(' '.join, cut.children))}; "
              f"measured {_stage_ms(cut, seconds)} ms per micro-batch and stage "
              f"(cut by parameters: {_stage_ms(by_params, seconds)})", flush=True)
        return cut

    @property
    def gpus_each(self) -> float | None:
        return self.gpus_per_stage if self.use_gpu else None

    @property
    def shared_gpus(self) -> str | None:
        """Why two stages may share a GPU (``devices.gpu_sharing``), or None."""
        return gpu_sharing(self.num_stages, self.gpus_each, what="--num-stages", flag="--gpus-per-stage")

    @property
    def bundles(self) -> list[dict[str, float]]:
        bundle = {"CPU": self.cpus_per_stage, **({"GPU": self.gpus_per_stage} if self.use_gpu else {})}
        return [dict(bundle) for _ in range(self.num_stages)]


def _stage_ms(cut: StageCut, unit_seconds: list[float]) -> str:
    bounds = [sum(cut.num_units[:k]) for k in range(len(cut.num_units) + 1)]
    return ", ".join(f"{1000 * sum(unit_seconds[a:b]):.2f}" for a, b in zip(bounds, bounds[1:]))


def train_epoch(stages: StageGroup, batches: list[torch.Tensor], batch_timeout_s: float) -> list[float]:
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
            chunk = batches[start:start + size]
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


def _train_epoch(stages: StageGroup, prepared: PreparedRun, attempt: Attempt, scaling: PipelineScaling,
                 faults: dict) -> None:
    """Epoch ``state.epochs_completed`` from step ``state.step``, in segments of
    ``--checkpoint-every-steps`` global batches with a checkpoint after each but the last."""
    cfg, state = prepared.cfg, attempt.state
    epoch, began = state.epochs_completed, time.perf_counter()
    batches = global_batches(epoch_indices(prepared.dataset, cfg.seed, epoch, cfg.shuffle), cfg.batch_size)
    losses, new = list(state.step_losses), 0
    for first, end in _segments(state.step, len(batches), cfg.checkpoint_every_steps):
        _inject(stages, attempt, faults, epoch, range(first, end))
        losses += train_epoch(stages, batches[first:end], scaling.batch_timeout_s)
        new += end - first
        failure = non_finite_loss(losses, epoch)
        if failure:
            record_failure(prepared.run_dir, failure)
            raise TrainingFailed(failure)
        if end < len(batches):
            state.step, state.step_losses = end, list(losses)
            _checkpoint(stages, prepared, state)
    seconds = time.perf_counter() - began
    attempt.timing.add_epoch(seconds, new * cfg.batch_size, stages.take_timing())
    state.losses.append(sum(losses) / len(batches))
    state.epochs_completed, state.step, state.step_losses = epoch + 1, 0, []
    validation = _validate(stages, prepared, state)
    print(f"[raypar] epoch {epoch + 1}/{cfg.epochs}  loss {state.losses[-1]:.6f}{progress(validation)}", flush=True)
    attempt.log.epoch(epoch, losses, state.losses[-1], validation, new * cfg.batch_size / seconds, cfg.lr)
    if state.epochs_completed % cfg.checkpoint_every == 0 or state.epochs_completed == cfg.epochs:
        _checkpoint(stages, prepared, state, gathered=validation is not None)


def _validate(stages: StageGroup, prepared: PreparedRun, state: TrainState) -> Validation | None:
    """``--val-data`` on the driver, with the stages' weights gathered into the whole model (as a
    checkpoint gathers them): the same chunks, so the same result, as the data-parallel workers."""
    if prepared.val_dataset is None:
        return None
    state.model, state.optimizer, state.rng, state.scaler = stages.gather_state()
    with torch.device("meta"):
        model = make_model(prepared.cfg, prepared.dataset, prepared.model_factory)
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


def _checkpoint(stages: StageGroup, prepared: PreparedRun, state: TrainState, gathered: bool = False) -> None:
    """``gathered``: ``state`` already holds the stages' state as of now."""
    if not gathered:
        state.model, state.optimizer, state.rng, state.scaler = stages.gather_state()
    write_checkpoint(storage.join(prepared.run_dir, checkpoint_name(state.epochs_completed, state.step)), state)
    prune_checkpoints(prepared.run_dir, prepared.cfg.num_checkpoints_to_keep)


def _inject(stages: StageGroup, attempt: Attempt, faults: dict, epoch: int, steps: range) -> None:
    """Tests' faults, in the last stage, in the first attempt: before the segment of
    ``crash_at_epoch`` / ``fail_at_epoch`` that holds step ``crash_at_step`` (default 0); or the
    driver waits at the start of each ``holds`` ``(epoch, path)`` it reaches by training (not by
    resuming there) until ``path`` exists."""
    for at, path in faults.get("holds", []):
        if at == epoch and attempt.resumed_from_epoch != epoch and steps.start == 0:
            hold(path)
    fault = {faults.get("crash_at_epoch"): "crash", faults.get("fail_at_epoch"): "fail_next_forward"}.get(epoch)
    if fault and attempt.resumed_from_epoch is None and faults.get("crash_at_step", 0) in steps:
        getattr(stages.actors[-1], fault).remote()


def _start_attempt(stages: StageGroup, prepared: PreparedRun, num_stages: int) -> Attempt:
    checkpoint = latest_checkpoint(prepared.run_dir)
    if checkpoint is None:
        return Attempt(TrainState(dict(prepared.initial_state), {}, 0, []), None, None, PipelineTiming(num_stages),
                       TrainLog(prepared.run_dir))
    stages.restore(checkpoint)
    at = f"epoch {checkpoint.epochs_completed}" + (f", step {checkpoint.step}" if checkpoint.step else "")
    print(f"[raypar] resuming from the checkpoint after {at}", flush=True)
    return Attempt(checkpoint, checkpoint.epochs_completed, checkpoint.step, PipelineTiming(num_stages),
                   TrainLog(prepared.run_dir))


def run(prepared: PreparedRun, scaling: PipelineScaling, crash_at_start: bool = False, **faults) -> TrainSummary:
    """Train ``prepared`` on a pipeline of stage actors; Ray must be connected.

    Each attempt, its start included (placement, stage actors, process group), ends in the
    latest checkpoint's state or a restart, up to ``--max-failures``; a stage's own error (not
    a lost stage) ends the run with that error, named by stage. Faults for tests, all in the last
    stage and the first attempt: ``crash_at_start`` (it dies while the stages start),
    ``crash_at_epoch=E`` (it dies in epoch E), ``fail_at_epoch=E`` (its forward raises in epoch E).
    """
    cfg = prepared.cfg
    scaling.check(cfg)
    if scaling.num_microbatches < scaling.num_stages:
        warnings.warn(f"--num-microbatches {scaling.num_microbatches} < --num-stages {scaling.num_stages}: "
                      "the pipeline can never fill, some stages always idle", stacklevel=2)
    request = Request("--num-stages", scaling.num_stages, {"CPU": "--cpus-per-stage", "GPU": "--gpus-per-stage"})
    wait_for_bundles(scaling.bundles, scaling.placement_strategy, request, cfg.resource_timeout)
    with stream_reader(prepared) as reader:
        return _attempts(prepared, scaling, reader, crash_at_start, faults)


def _attempts(prepared: PreparedRun, scaling: PipelineScaling, reader, crash_at_start: bool,
              faults: dict) -> TrainSummary:
    cfg = prepared.cfg
    cut = scaling.cut(prepared)
    for failures in range(cfg.max_failures + 1):
        stages = None
        try:
            stages = StageGroup(prepared, scaling, cut, reader, crash_on_start=crash_at_start and failures == 0)
            attempt = _start_attempt(stages, prepared, scaling.num_stages)
            while attempt.state.epochs_completed < cfg.epochs:
                _train_epoch(stages, prepared, attempt, scaling, faults)
            return _finish(prepared, scaling, stages, attempt, reader)
        except (StartFailed, *STAGE_FAILURES) as error:
            reason = str(error) if stages is None else stages.describe_failure(error)
            if failures == cfg.max_failures:
                raise TrainingFailed(f"{reason}; --max-failures {cfg.max_failures} exhausted") from error
            print(f"[raypar] {reason}; restarting the pipeline from the latest checkpoint", flush=True)
        except RayTaskError as error:
            raise TrainingFailed(root_cause(error)) from error
        finally:
            if stages is not None:
                stages.shutdown()
    raise AssertionError("unreachable")


def _finish(prepared: PreparedRun, scaling: PipelineScaling, stages: StageGroup, attempt: Attempt,
            reader) -> TrainSummary:
    extra = {
        "stage_nodes": stages.nodes,
        "stage_children": stages.cut.children,
        "transport": stages.transport.name,
        "schedule": scaling.schedule,
        "num_stages": scaling.num_stages,
        "num_microbatches": scaling.num_microbatches,
        **attempt.timing.report(scaling.schedule, scaling.num_stages, scaling.num_microbatches),
        **{f"stage_peak_{key}": [memory[key] for memory in stages.peak_memory()] for key in ("rss_bytes", "device_bytes")},
    }
    metrics = {"samples_per_second": attempt.timing.samples_per_second,
               "resumed_from_epoch": attempt.resumed_from_epoch,
               "resumed_from_step": attempt.resumed_from_step,
               "data_wait_fraction": attempt.timing.data_wait_fraction, **reader_stats(reader)}
    return finish(prepared, attempt.state, metrics, scaling.num_stages, {"scaling": asdict(scaling)}, extra)


def main(argv: list[str] | None = None) -> int:
    return entry_point("pipeline", PipelineScaling, run, argv, __doc__)


if __name__ == "__main__":
    exit_process(main())
