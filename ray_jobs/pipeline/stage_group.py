"""The stage actors of one pipeline attempt: placed together, started, probed and removed together."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_jobs.core.checkpoint import TrainState, merge_named_optimizer_states, slice_state
from ray_jobs.driver.prepare import PreparedRun
from ray_jobs.errors import TrainingFailed
from ray_jobs.pipeline.cut import StageCut
from ray_jobs.pipeline.replicas import Grid
from ray_jobs.pipeline.stage import StageWorker
from ray_jobs.pipeline.transports import STAGE_FAILURES, TransportFailed, connect, resolve_transport

PROBE_TIMEOUT_S = 10.0  # how long a failed pipeline waits for its stages to answer "are you alive"
ECHO_PROBE_S = 2.0  # the same, after a stage's own error: is it a dead stage's echo?


class StartFailed(TrainingFailed):
    """An attempt's start failed (placement, a stage that died, a group that never formed):
    like a stage lost mid-run, it costs one of ``--max-failures``."""


class StageGroup:
    """One placement-group bundle and one ``StageWorker`` actor per stage, and the transport
    between them. A start that fails removes everything it created before raising."""

    def __init__(
        self,
        prepared: PreparedRun,
        scaling,
        cut: StageCut,
        reader=None,
        on_started: Callable[[list], None] | None = None,
    ) -> None:
        """``cut``: how the model is cut (``cut.cut_stages``), the same for every attempt;
        ``on_started``: called with the actors once they run, before they connect (tests' faults)."""
        self.scaling, self.cut, self.keys, self.reader = scaling, cut, cut.keys, reader
        self.group = placement_group(scaling.bundles, strategy=scaling.placement_strategy)
        self.actors: list = []
        self.nodes: list[str] = []
        self.transport = None
        try:
            self._start_all(prepared, on_started)
        except STAGE_FAILURES as error:
            reason = self.describe_failure(error)
            self.shutdown()
            raise StartFailed(f"{reason}, while the stages started") from error
        except BaseException:
            self.shutdown()
            raise

    def _start_all(self, prepared: PreparedRun, on_started: Callable[[list], None] | None) -> None:
        scaling, timeout = self.scaling, prepared.cfg.resource_timeout
        ready, _ = ray.wait([self.group.ready()], timeout=timeout)
        if not ready:
            raise StartFailed(
                f"the {scaling.num_actors} stage bundles {scaling.bundles[0]} were not placed "
                f"within --resource-timeout {timeout:g} s ({scaling.placement_strategy})"
            )
        requested = resolve_transport(
            scaling,
            _bundle_nodes(self.group),
            prepared.cfg.precision,
            prepared.cfg.grad_clip_norm is not None or bool(self.cut.shared) or scaling.data_parallel > 1,
        )
        device_transport = scaling.use_gpu and requested == "compiled"
        dataset = ray.put(prepared.dataset)
        # Rank order: replica by replica, stage by stage within each.
        self.actors = [
            self._start(
                rank,
                prepared,
                dataset,
                {k: prepared.initial_state[k] for k in self.keys[self.grid(rank).stage]},
                device_transport,
            )
            for rank in range(scaling.num_actors)
        ]
        self.nodes = self._get(
            [actor.node_id.remote() for actor in self.actors],
            "the stage actors' start",
            prepared.cfg.resource_timeout,
            "--resource-timeout",
        )
        if on_started is not None:
            on_started(self.actors)
        try:
            self.transport = connect(requested, self.actors, self.nodes, scaling, device_transport)
        except TransportFailed as error:
            raise StartFailed(f"{error} (stages on nodes {self.nodes})") from error

    def grid(self, rank: int) -> Grid:
        """The actor of ``rank``: its stage and replica, as messages name it."""
        scaling = self.scaling
        return Grid.at_rank(rank, scaling.num_stages, scaling.data_parallel, scaling.stage_sharding)

    def _start(self, rank: int, prepared: PreparedRun, dataset, initial_slice: dict, device_transport: bool):
        grid = self.grid(rank)
        bundle = self.scaling.bundle_index(grid.replica, grid.stage)
        options = dict(
            num_cpus=self.scaling.cpus_per_stage,
            num_gpus=self.scaling.gpus_each or 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle),
        )
        actor_cls = ray.remote(StageWorker).options(**options)
        return actor_cls.remote(
            grid.stage,
            self.scaling.num_stages,
            self.scaling.num_microbatches,
            asdict(prepared.cfg),
            dataset,
            initial_slice,
            max(1, int(self.scaling.cpus_per_stage)),
            self.scaling.use_gpu,
            device_transport,
            self.reader,
            prepared.model_factory,
            self.cut.unit_costs,
            grid,
        )

    def gather_state(self) -> tuple[dict, dict, list, dict | None]:
        """The unsplit model's weights and optimizer state from every stage's slice (the first
        replica's: the replicas hold the same), each actor's RNG state in rank order, and the fp16
        scaler's state (the stages keep one scale: stage 0's)."""
        # Sharded stages gather their weights together: every copy is asked (all but the first
        # answer without them); replicated ones are asked for their RNG alone.
        first = len(self.actors) if self.scaling.stage_sharding == "fsdp" else self.scaling.num_stages
        refs = [actor.state.remote() for actor in self.actors[:first]]
        answers = self._get(refs + [actor.rng.remote() for actor in self.actors[first:]], "gathering the stages' state")
        parts = answers[: self.scaling.num_stages]
        weights = {k: v for stage_weights, *_ in parts for k, v in stage_weights.items()}
        optimizer = merge_named_optimizer_states([optimizer for _, optimizer, *_ in parts])
        rngs = [rng for _, _, rng, _ in answers[:first]] + answers[first:]
        return weights, optimizer, rngs, parts[0][3]

    def take_timing(self) -> list[dict[str, float]]:
        """Each stage's timing: the first replica's (the others run the same schedule beside it).
        Every actor's is taken, so none accumulates."""
        timings = self._get([actor.take_timing.remote() for actor in self.actors], "the stages' timing")
        return timings[: self.scaling.num_stages]

    def take_grad_norms(self) -> list[float]:
        """``--grad-clip-norm``: each step's whole-model norm before clipping (every stage has it; stage 0's)."""
        return self._get([self.actors[0].take_grad_norms.remote()], "the stages' gradient norms")[0]

    def model_state_bytes(self) -> list[dict[str, int]]:
        """Each actor's parameters, gradients and optimizer state, in bytes, in rank order."""
        return self._get([actor.model_state_bytes.remote() for actor in self.actors], "the stages' model state")

    def comm_bytes_per_step(self) -> list[dict[str, float] | None]:
        """``--count-comm-bytes``: each actor's bytes per step by kind, in rank order."""
        return self._get([actor.comm_bytes_per_step.remote() for actor in self.actors], "the stages' byte counts")

    def peak_memory(self) -> list[dict[str, int | None]]:
        return self._get([actor.peak_memory.remote() for actor in self.actors], "the stages' peak memory")

    def restore(self, state: TrainState) -> None:
        """Send each stage its own slice of ``state``, never the whole."""
        num_actors = len(self.actors)
        self._get(
            [
                actor.restore.remote(slice_state(state, self.keys[self.grid(rank).stage], rank, num_actors))
                for rank, actor in enumerate(self.actors)
            ],
            "restoring the stages from the checkpoint",
        )

    def _get(self, refs: list, what: str, timeout_s: float | None = None, flag: str = "--batch-timeout-s") -> list:
        """Every stage's answer, or one line naming what did not come within ``timeout_s``, the
        value of ``flag`` (default ``--batch-timeout-s``: a stage that answers no call in that long
        is stuck)."""
        timeout_s = self.scaling.batch_timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            raise TrainingFailed(f"{what} did not finish within {flag} {timeout_s:g}") from None

    def describe_failure(self, error: Exception) -> str:
        """Name the dead stage by probing every actor at once: the error alone does not say
        which."""
        dead, silent = self._probe()
        if dead is not None:
            return dead
        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if silent:
            named = silent if self.scaling.data_parallel == 1 else [self.grid(index).name for index in silent]
            return f"stages {named} stopped answering ({cause})"
        return f"a stage failed ({cause})"

    def dead_stage(self) -> str | None:
        """The stage actor found dead within ``ECHO_PROBE_S``, named, or None. A stage's own error
        can be a dead peer's echo: its all-reduce or its FSDP gather fails with gloo's
        "Connection reset by peer" before Ray reports the peer's death. A dead actor's probe
        fails at once; the short wait is for stages blocked on the failed one, which never
        answer, so a stage's real error reaches the user in seconds, not ``PROBE_TIMEOUT_S``."""
        return self._probe(ECHO_PROBE_S)[0]

    def _probe(self, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[str | None, list[int]]:
        """Ask every actor at once whether it lives. A dead actor's probe fails at once; a live
        one may be blocked (in a receive from the dead stage, or behind its queued batches) and
        answer late or never, so silence alone does not make a stage the culprit. Returns the
        first dead stage's description and the silent stages' indices."""
        probes = {actor.node_id.remote(): index for index, actor in enumerate(self.actors)}
        waiting, deadline = list(probes), time.monotonic() + timeout_s
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            try:
                ray.get(ready[0])
            except Exception:  # the actor is gone
                index = probes[ready[0]]
                node = self.nodes[index] if index < len(self.nodes) else "(not started)"
                return f"{self.grid(index).name} actor on node {node} died", []
        return None, sorted(probes[ref] for ref in waiting)

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.close()
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.group)


def _bundle_nodes(group) -> list[str]:
    return list(placement_group_table(group)["bundles_to_node_id"].values())
