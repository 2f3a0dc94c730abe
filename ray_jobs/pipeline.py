"""Model (pipeline) parallel: ``python -m ray_jobs.pipeline --num-stages S --num-microbatches M``.

The model is cut into S stages (``models.split_into_stages``), each a Ray actor with its own
GPU (or CPUs), placed with one placement-group bundle per stage. Each global batch is cut into
M micro-batches; activations flow forward and gradients back between the actors, never through
the driver, in the order a schedule (GPipe or 1F1B) gives: over torch.distributed send/recv
(``p2p``: one actor call per stage per few batches), a Ray Compiled Graph (``compiled``: nccl
channels between GPUs), or one actor call per op with object references (``actor_calls``).
"""
from __future__ import annotations

import logging
import sys
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field

import ray
import torch
from ray.dag import InputNode, MultiOutputNode
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelError, RayChannelTimeoutError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from models import build_model, split_into_stages
from ray_jobs import interrupts, storage
from ray_jobs.checkpoint import TrainState, latest_checkpoint, merge_named_optimizer_states, to_bytes
from ray_jobs.cli import entry_point
from ray_jobs.config import PLACEMENT_STRATEGIES, TrainConfig, flag_doc, require, require_choice, require_divisible
from ray_jobs.preflight import wait_for_bundles
from ray_jobs.runner import PreparedRun, finish, record_failure
from ray_jobs.schedules import BACKWARD, FORWARD, SCHEDULES, execution_order, replayed_bubble, typical_durations
from ray_jobs.stage import PeerLost, StageWorker
from ray_jobs.summary import TrainSummary
from ray_jobs.train_workers import TrainingFailed
from ray_jobs.training import epoch_order, global_batches, microbatches, non_finite_loss

EPOCH_PREFIX = "checkpoint_epoch_"
PLACEMENT_TIMEOUT_S = 120.0
PROBE_TIMEOUT_S = 10.0  # how long a failed pipeline waits for its stages to answer "are you alive"
# Actor calls (of --batches-per-call batches each) in flight at once; more only holds more
# activations, the overlap is the same.
MAX_INFLIGHT_CALLS = 2
TRANSPORTS = ("auto", "p2p", "compiled", "actor_calls")
# What a dead stage looks like to the driver, through any transport (p2p: a peer's send or
# receive fails before Ray reports the dead actor).
STAGE_FAILURES = (RayActorError, RayChannelError, PeerLost)


@dataclass
class PipelineScaling:
    """How the model is cut and where its stages run."""

    num_stages: int = field(default=2, metadata=flag_doc("pipeline stages, one Ray actor (and GPU) each"))
    num_microbatches: int = field(default=4, metadata=flag_doc("micro-batches per global batch"))
    schedule: str = field(default="1f1b", metadata=flag_doc("micro-batch schedule", choices=sorted(SCHEDULES)))
    use_gpu: bool = field(default=False, metadata=flag_doc("one GPU per stage (default: CPU)"))
    cpus_per_stage: float = field(default=1.0, metadata=flag_doc("CPUs per stage actor; also its torch threads"))
    placement_strategy: str = field(
        default="PACK", metadata=flag_doc("PACK keeps neighbouring stages on one node", choices=PLACEMENT_STRATEGIES)
    )
    transport: str = field(
        default="auto",
        metadata=flag_doc("p2p: torch.distributed (gloo) send/recv between the stages, one actor call per "
                      "stage per --batches-per-call batches, tensors through host memory; compiled: a Ray Compiled Graph (nccl "
                      "between GPUs); actor_calls: one actor call per op; auto: compiled for GPU stages on "
                      "one node, else p2p", choices=TRANSPORTS),
    )

    batch_timeout_s: float = field(
        default=600.0, metadata=flag_doc("fail the run when one global batch takes longer than this (s)")
    )
    batches_per_call: int = field(
        default=8,
        metadata=flag_doc("p2p: global batches per actor call; more removes the dispatch gap between batches, "
                          "fewer lets Ctrl-C and the batch timeout act sooner (every batch still has its "
                          "own loss and optimizer step)"),
    )

    def __post_init__(self) -> None:
        require(self.batch_timeout_s > 0, "batch_timeout_s", self.batch_timeout_s, "positive")
        require(self.batches_per_call >= 1, "batches_per_call", self.batches_per_call, "at least 1")
        require_choice(self.transport, TRANSPORTS, "transport")
        require(self.num_stages >= 1, "num_stages", self.num_stages, "at least 1")
        require(self.num_microbatches >= 1, "num_microbatches", self.num_microbatches, "at least 1")
        require(self.cpus_per_stage > 0, "cpus_per_stage", self.cpus_per_stage, "positive")
        require_choice(self.schedule, sorted(SCHEDULES), "schedule")
        require_choice(self.placement_strategy, PLACEMENT_STRATEGIES, "placement_strategy")

    def check(self, cfg: TrainConfig) -> None:
        """Checks that need both configs, run before Ray is touched."""
        require_divisible(cfg.batch_size, self.num_microbatches, "--num-microbatches")
        # Layer count does not depend on the data's widths, so any widths tell whether S fits.
        split_into_stages(build_model(cfg.model, 1, 1, **cfg.model_options), self.num_stages)

    @property
    def bundles(self) -> list[dict[str, float]]:
        bundle = {"CPU": self.cpus_per_stage, **({"GPU": 1.0} if self.use_gpu else {})}
        return [dict(bundle) for _ in range(self.num_stages)]


class Pipeline:
    """The stage actors of one attempt, in their own placement group."""

    def __init__(self, prepared: PreparedRun, scaling: PipelineScaling) -> None:
        self.scaling = scaling
        self.group = placement_group(scaling.bundles, strategy=scaling.placement_strategy)
        ready, _ = ray.wait([self.group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self.group)
            raise TrainingFailed(f"the {scaling.num_stages} stage bundles {scaling.bundles[0]} were not placed "
                                 f"within {PLACEMENT_TIMEOUT_S:.0f} s ({scaling.placement_strategy})")
        self.requested = resolve_transport(scaling, _bundle_nodes(self.group))
        dataset, initial = ray.put(prepared.dataset), ray.put(prepared.initial_state)
        self.actors = [self._start(index, prepared, dataset, initial) for index in range(scaling.num_stages)]
        self.nodes = ray.get([actor.node_id.remote() for actor in self.actors])
        self.order = execution_order(SCHEDULES[scaling.schedule](scaling.num_stages, scaling.num_microbatches))
        self.transport, self.compiled = self._connect()
        self.batch_seconds = 0.0  # running estimate of one batch's duration

    @property
    def device_transport(self) -> bool:
        return self.scaling.use_gpu and self.requested == "compiled"

    def _connect(self):
        """Set up the transport; returns its name and the compiled graph, if any."""
        if self.requested == "actor_calls":
            return "actor_calls", None
        if self.requested == "p2p":
            self._join_group()
            return "p2p_gloo", None
        if len(set(self.nodes)) > 1:
            # Measured on Ray 2.60 (local multi-node cluster): compiled-graph channels between
            # nodes never delivered and the run hung.
            warnings.warn("--transport compiled with stages on several nodes hung on Ray 2.60 here; "
                          "--transport p2p is the tested choice", stacklevel=2)
        try:
            graph = build_graph(self.actors, self.order, self.device_transport)
            return ("compiled_graph_nccl" if self.device_transport else "compiled_graph"), graph.experimental_compile()
        except Exception as error:  # Ray raises several types for graphs it cannot compile
            raise TrainingFailed(f"--transport compiled: the compiled graph failed to build: {error}") from error

    def _join_group(self) -> None:
        address = ray.get(self.actors[0].rendezvous_address.remote())
        timeout = self.scaling.batch_timeout_s
        joins = [actor.join_group.remote(address, self.scaling.schedule, timeout) for actor in self.actors]
        try:
            # Failing fast: a stage that cannot join must not leave the others waiting out the timeout.
            _get_failing_fast(joins, timeout)
        except GetTimeoutError:
            raise TrainingFailed(f"the stages' gloo group at {address} did not form within "
                                 f"--batch-timeout-s {timeout:g} (stages on nodes {self.nodes})") from None

    def _start(self, index: int, prepared: PreparedRun, dataset, initial):
        options = dict(
            num_cpus=self.scaling.cpus_per_stage,
            num_gpus=1 if self.scaling.use_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index),
        )
        actor_cls = ray.remote(StageWorker).options(**options)
        return actor_cls.remote(
            index, self.scaling.num_stages, self.scaling.num_microbatches, asdict(prepared.cfg), dataset, initial,
            max(1, int(self.scaling.cpus_per_stage)), self.scaling.use_gpu, self.device_transport,
        )

    def train_epoch(self, batches: list) -> list[float]:
        """Run every global batch through the schedule; returns each batch's loss.

        Batch k+1 is submitted before batch k finishes: each stage runs its ops in order, so
        its forward of batch k+1 still comes after its own optimizer step of batch k, and
        the result is the same as running the batches one by one, without the flush between.
        """
        size = self.scaling.batches_per_call if self.transport == "p2p_gloo" else 1
        pending: deque = deque()
        losses: list[float] = []
        for start in range(0, len(batches), size):
            interrupts.check()  # between calls: nothing is half-submitted
            chunk = batches[start:start + size]
            pending.append((self._submit(chunk), len(chunk), time.perf_counter()))
            if len(pending) > MAX_INFLIGHT_CALLS:
                losses += self._collect(*pending.popleft())
        while pending:
            losses += self._collect(*pending.popleft())
        return losses

    def _submit(self, chunk: list):
        """One actor call per stage for the chunk's batches (p2p), else its one batch."""
        if self.transport == "p2p_gloo":
            rows = torch.stack(chunk)
            return [actor.run_batches.remote(rows) for actor in self.actors]
        (batch,) = chunk
        rows = microbatches(batch, self.scaling.num_microbatches)
        if self.compiled is not None:
            return self.compiled.execute(*rows)
        last = self.scaling.num_stages - 1
        outputs = {}
        for stage, op in self.order:
            m = op.microbatch
            if op.kind == FORWARD:
                activation = outputs[(stage - 1, FORWARD, m)] if stage > 0 else None
                outputs[(stage, FORWARD, m)] = self.actors[stage].forward.remote(m, activation, rows[m])
            else:
                grad = outputs[(stage + 1, BACKWARD, m)] if stage < last else None
                outputs[(stage, BACKWARD, m)] = self.actors[stage].backward.remote(m, grad)
        return [actor.step.remote() for actor in self.actors]

    def _collect(self, handle, num_batches: int, submitted: float) -> list[float]:
        """The losses of one submitted call (the last stage computes them)."""
        if self.compiled is not None:
            # Waiting on a compiled graph's result busy-polls a whole core; sleep through most
            # of a batch's expected duration first so the stages keep the CPU.
            time.sleep(max(0.0, 0.8 * self.batch_seconds - (time.perf_counter() - submitted)))
        began = time.perf_counter()
        timeout = self.scaling.batch_timeout_s * num_batches
        try:
            if self.compiled is not None:
                losses = [ray.get(handle, timeout=timeout)[-1]]
            elif self.transport == "p2p_gloo":
                losses = _get_failing_fast(handle, timeout)[-1]
            else:
                losses = [_get_failing_fast(handle, timeout)[-1]]
        except (GetTimeoutError, RayChannelTimeoutError):
            raise TrainingFailed(
                f"a global batch did not finish within --batch-timeout-s {self.scaling.batch_timeout_s:g} "
                f"(a call of {num_batches} batch(es) waited {timeout:g} s; transport {self.transport}, "
                f"stages on nodes {self.nodes})"
            ) from None
        elapsed = (time.perf_counter() - max(began, submitted)) / num_batches
        self.batch_seconds = 0.5 * self.batch_seconds + 0.5 * elapsed
        return losses

    def gather_state(self) -> tuple[dict, dict]:
        parts = ray.get([actor.state.remote() for actor in self.actors])
        weights = {k: v for stage_weights, _ in parts for k, v in stage_weights.items()}
        return weights, merge_named_optimizer_states([optimizer for _, optimizer in parts])

    def take_timing(self) -> list[dict[str, float]]:
        return ray.get([actor.take_timing.remote() for actor in self.actors])

    def restore(self, state: TrainState) -> None:
        ray.get([actor.restore.remote(state) for actor in self.actors])

    def describe_failure(self, error: Exception) -> str:
        """Name the dead stage by probing every actor at once: the error alone does not say
        which. A dead actor's probe fails at once; a live one may be blocked (in a receive from
        the dead stage, or behind its queued batches) and answer late or never, so silence
        alone does not make a stage the culprit."""
        probes = {actor.node_id.remote(): index for index, actor in enumerate(self.actors)}
        waiting, deadline = list(probes), time.monotonic() + PROBE_TIMEOUT_S
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            try:
                ray.get(ready[0])
            except Exception:  # the actor is gone
                index = probes[ready[0]]
                return f"stage {index} actor on node {self.nodes[index]} died"
        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        silent = sorted(probes[ref] for ref in waiting)
        if silent:
            return f"stages {silent} stopped answering ({cause})"
        return f"a stage failed ({cause})"

    def shutdown(self) -> None:
        if self.compiled is not None:
            # Ray logs each step of a normal teardown at INFO; only problems are worth showing.
            logging.getLogger("ray.dag.compiled_dag_node").setLevel(logging.WARNING)
            self.compiled.teardown()
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.group)


def resolve_transport(scaling: PipelineScaling, nodes: list[str]) -> str:
    """``auto``: GPU stages on one node talk over nccl through a compiled graph (GPU to GPU);
    everything else uses p2p. p2p stays on gloo even between GPUs: nccl matches sends and
    receives by order, not tag, and a stage's interleaved sends and early-posted receives
    could then wait on each other; through host memory they cannot."""
    if scaling.transport != "auto":
        return scaling.transport
    return "compiled" if scaling.use_gpu and len(set(nodes)) == 1 else "p2p"


def _bundle_nodes(group) -> list[str]:
    return list(placement_group_table(group)["bundles_to_node_id"].values())


def _get_failing_fast(refs: list, timeout_s: float) -> list:
    """``ray.get`` of every ref, raising the first failure as soon as it happens: a stage
    blocked on a dead peer must not hide the dead stage's error until its own timeout."""
    deadline, waiting = time.monotonic() + timeout_s, list(refs)
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise GetTimeoutError(f"{len(waiting)} stage results still missing after {timeout_s:g} s")
        ray.get(ready)
    return ray.get(refs)


def build_graph(actors: list, order: list, device_transport: bool) -> MultiOutputNode:
    """The schedule as a Ray Compiled Graph: one node per op, bound in ``order`` (which each
    actor then executes in), with activations and gradients on direct actor-to-actor channels."""
    last = len(actors) - 1
    outputs, consumed = {}, set()
    with InputNode() as rows:
        for stage, op in order:
            m = op.microbatch
            if op.kind == FORWARD:
                source = (stage - 1, FORWARD, m) if stage > 0 else None
                node = actors[stage].forward.bind(m, outputs[source] if source else None, rows[m])
            else:
                source = (stage + 1, BACKWARD, m) if stage < last else (stage, FORWARD, m)
                node = actors[stage].backward.bind(m, outputs[source])
            consumed.add(source)
            sends_tensor = stage < last if op.kind == FORWARD else stage > 0
            if device_transport and sends_tensor:
                node = node.with_tensor_transport("nccl")
            outputs[(stage, op.kind, m)] = node
        # Every output must feed something, and every node needs an input: a stage's step
        # waits on its unconsumed outputs and on its last op.
        steps = []
        for stage in range(len(actors)):
            own = [key for key in outputs if key[0] == stage]
            waits = [key for key in own if key not in consumed or key == own[-1]]
            steps.append(actors[stage].step.bind(*[outputs[key] for key in waits]))
        return MultiOutputNode(steps)


def save_pipeline_checkpoint(run_dir: str, state: TrainState, num_to_keep: int) -> None:
    name = f"{EPOCH_PREFIX}{state.epochs_completed:06d}"
    storage.write_bytes(storage.join(run_dir, name, "checkpoint.pt"), to_bytes(state))
    kept = [n for n in storage.list_dir(run_dir) if n.startswith(EPOCH_PREFIX)]
    for old in kept[:-num_to_keep]:
        storage.delete_dir(storage.join(run_dir, old))


@dataclass
class Attempt:
    """Progress of one attempt; what survives a restart is only what was checkpointed."""

    state: TrainState
    resumed_from_epoch: int | None
    samples: int = 0
    epoch_seconds: list[float] = field(default_factory=list)
    epoch_timing: list[dict[str, float]] = field(default_factory=list)  # per epoch, summed over stages
    # per epoch: each stage's op durations and optimizer-step durations, in its own order
    epoch_durations: list[tuple[list[list[float]], list[list[float]]]] = field(default_factory=list)
    peak_alive: int = 0

    def add_epoch(self, seconds: float, timings: list[dict[str, float]]) -> None:
        summed: dict[str, float] = {}
        self.epoch_durations.append(([t.pop("op_seconds") for t in timings], [t.pop("step_seconds") for t in timings]))
        for timing in timings:
            self.peak_alive = max(self.peak_alive, timing.pop("peak_live_microbatches"))
            for key, value in timing.items():
                summed[key] = summed.get(key, 0.0) + value
        self.epoch_seconds.append(seconds)
        self.epoch_timing.append(summed)


def _train_epochs(pipeline: Pipeline, prepared: PreparedRun, attempt: Attempt, crash_at_epoch: int | None) -> None:
    cfg, state = prepared.cfg, attempt.state
    for epoch in range(state.epochs_completed, cfg.epochs):
        began = time.perf_counter()
        batches = global_batches(epoch_order(prepared.dataset.num_rows, cfg.seed, epoch, cfg.shuffle), cfg.batch_size)
        if crash_at_epoch == epoch and attempt.resumed_from_epoch is None:
            pipeline.actors[-1].crash.remote()
        losses = pipeline.train_epoch(batches)
        failure = non_finite_loss(losses, epoch)
        if failure:
            record_failure(prepared.run_dir, failure)
            raise TrainingFailed(failure)
        attempt.samples += len(batches) * cfg.batch_size
        attempt.add_epoch(time.perf_counter() - began, pipeline.take_timing())
        state.losses.append(sum(losses) / len(batches))
        state.epochs_completed = epoch + 1
        print(f"[raypar] epoch {epoch + 1}/{cfg.epochs}  loss {state.losses[-1]:.6f}", flush=True)
        if state.epochs_completed % cfg.checkpoint_every == 0 or state.epochs_completed == cfg.epochs:
            state.model, state.optimizer = pipeline.gather_state()
            save_pipeline_checkpoint(prepared.run_dir, state, cfg.num_checkpoints_to_keep)


def _start_attempt(pipeline: Pipeline, prepared: PreparedRun) -> Attempt:
    checkpoint = latest_checkpoint(prepared.run_dir)
    if checkpoint is None:
        return Attempt(TrainState(dict(prepared.initial_state), {}, 0, []), None)
    pipeline.restore(checkpoint)
    print(f"[raypar] resuming from the checkpoint after epoch {checkpoint.epochs_completed}", flush=True)
    return Attempt(checkpoint, checkpoint.epochs_completed)


def run(prepared: PreparedRun, scaling: PipelineScaling, crash_at_epoch: int | None = None) -> TrainSummary:
    """Train ``prepared`` on a pipeline of stage actors; Ray must be connected."""
    cfg = prepared.cfg
    scaling.check(cfg)
    if scaling.num_microbatches < scaling.num_stages:
        warnings.warn(f"--num-microbatches {scaling.num_microbatches} < --num-stages {scaling.num_stages}: "
                      "the pipeline can never fill, some stages always idle", stacklevel=2)
    wait_for_bundles(scaling.bundles, scaling.placement_strategy, f"--num-stages {scaling.num_stages}",
                     cfg.resource_timeout)
    for failures in range(cfg.max_failures + 1):
        pipeline = Pipeline(prepared, scaling)
        try:
            attempt = _start_attempt(pipeline, prepared)
            _train_epochs(pipeline, prepared, attempt, crash_at_epoch)
            return _finish(prepared, scaling, pipeline, attempt)
        except STAGE_FAILURES as error:
            reason = pipeline.describe_failure(error)
            if failures == cfg.max_failures:
                raise TrainingFailed(f"{reason}; --max-failures {cfg.max_failures} exhausted") from error
            print(f"[raypar] {reason}; restarting the pipeline from the latest checkpoint", flush=True)
        finally:
            pipeline.shutdown()
    raise AssertionError("unreachable")


def _finish(prepared: PreparedRun, scaling: PipelineScaling, pipeline: Pipeline, attempt: Attempt) -> TrainSummary:
    seconds = sum(attempt.epoch_seconds)
    total = {key: sum(epoch.get(key, 0.0) for epoch in attempt.epoch_timing) for key in STAGE_TIME_KEYS}
    schedules = SCHEDULES[scaling.schedule](scaling.num_stages, scaling.num_microbatches)
    extra = {
        "stage_nodes": pipeline.nodes,
        "transport": pipeline.transport,
        "schedule": scaling.schedule,
        "num_stages": scaling.num_stages,
        "num_microbatches": scaling.num_microbatches,
        "bubble_fraction": bubble_fraction(total, seconds, scaling.num_stages),
        "stage_time_fractions": _fractions(total, seconds * scaling.num_stages),
        "peak_live_microbatches": attempt.peak_alive,
        "epoch_seconds": attempt.epoch_seconds,
        "epoch_stage_time_fractions": [
            {**_fractions(timing, epoch_seconds * scaling.num_stages),
             "bubble": bubble_fraction(timing, epoch_seconds, scaling.num_stages),
             "schedule_bubble": replayed_bubble(schedules, *durations),
             "median_ops_bubble": replayed_bubble(schedules, *typical_durations(schedules, *durations)),
             "compute_by_stage": [sum(ops) / epoch_seconds for ops in durations[0]],
             "optimizer_by_stage": [sum(steps) / epoch_seconds for steps in durations[1]]}
            for timing, epoch_seconds, durations in zip(attempt.epoch_timing, attempt.epoch_seconds,
                                                        attempt.epoch_durations)
        ],
    }
    metrics = {
        "samples_per_second": attempt.samples / seconds if seconds else None,
        "resumed_from_epoch": attempt.resumed_from_epoch,
    }
    return finish(prepared, attempt.state, metrics, scaling.num_stages, {"scaling": asdict(scaling)}, extra)


STAGE_TIME_KEYS = ("compute_s", "optimizer_s", "receive_wait_s", "p2p_calls_s")


def bubble_fraction(timing: dict[str, float], seconds: float, num_stages: int) -> float | None:
    """Share of the stages' time (wall x S) that is neither forward/backward compute nor the
    optimizer step. The optimizer runs once per batch in every schedule, outside the fill and
    drain that the GPipe theory counts; waiting, transfers and dispatch are bubble."""
    if not seconds:
        return None
    return 1.0 - (timing.get("compute_s", 0.0) + timing.get("optimizer_s", 0.0)) / (seconds * num_stages)


def _fractions(timing: dict[str, float], stage_seconds: float) -> dict[str, float] | None:
    return {key.removesuffix("_s"): value / stage_seconds for key, value in timing.items()} if stage_seconds else None


def main(argv: list[str] | None = None) -> int:
    return entry_point("pipeline", PipelineScaling, run, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
