"""One pipeline stage: a Ray actor holding one slice of the model and its optimizer.

Forward keeps the micro-batch's input and output alive until its backward; the last stage
also computes the loss. Gradients accumulate over the micro-batches of a global batch and the
optimizer steps once per global batch, as in single-process training.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import ray
import torch
import torch.distributed as dist

from ray_jobs.core.activations import checkpoint_activations, compile_blocks
from ray_jobs.core.batches import microbatches, shard
from ray_jobs.core.checkpoint import (
    TrainState,
    restore_scaler,
    resume_rng,
    rng_state,
)
from ray_jobs.core.config import TrainConfig
from ray_jobs.core.lr_schedule import lr_schedule
from ray_jobs.core.model_init import materialize
from ray_jobs.core.step import autocast, build_optimizer, grad_scaler, loss_function, rank_seed
from ray_jobs.core.torch_imports import load_torch_for_training
from ray_jobs.data.device_copy import to_device
from ray_jobs.data.stream import open_source
from ray_jobs.errors import PeerLost, described
from ray_jobs.observability.comm_bytes import CommBytes
from ray_jobs.observability.model_memory import model_state_bytes
from ray_jobs.observability.process_stats import peak_rss_bytes
from ray_jobs.pipeline.cut import boundary_shapes, meta_stages, shared_weights
from ray_jobs.pipeline.replicas import Grid, stage_norm
from ray_jobs.pipeline.schedules import FORWARD, SCHEDULES, peak_live_activations
from ray_jobs.testing import faults

# Receives posted ahead of need (p2p transport), at least; see ``receives_ahead``.
MIN_RECEIVES_AHEAD = 2
# Seconds in gloo's send, receive-post and send-wait calls: the p2p transport's own cost.
CALLS = "p2p_calls_s"


def _described(method):
    """Re-raise a stage's own error as one line naming the stage (CUDA OOM by name); a lost
    peer stays ``PeerLost``, which the driver answers with a restart."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with described(self.grid.name, passing=(PeerLost,)):
            return method(self, *args, **kwargs)

    return wrapper


class StageWorker:
    def __init__(
        self,
        stage_index: int,
        num_stages: int,
        num_microbatches: int,
        train: dict[str, Any],
        dataset,
        initial_slice: dict[str, torch.Tensor],
        num_threads: int,
        use_gpu: bool,
        device_transport: bool = False,
        reader=None,
        model_factory=None,
        unit_costs: list[float] | None = None,
        grid: Grid | None = None,
    ) -> None:
        """``grid``: this actor's replica and how the replicas share the stage (--data-parallel,
        --stage-sharding); None: the only replica."""
        # This module loaded torch already; the larger half, torch._dynamo, is still to come.
        load_torch_for_training()
        cfg = TrainConfig(**train)
        torch.set_num_threads(num_threads)
        self.device = torch.device("cuda" if use_gpu else "cpu")
        # With a GPU-to-GPU channel (compiled graph + nccl) tensors stay on the device;
        # otherwise they cross process boundaries as CPU tensors.
        self.device_transport = device_transport
        self.stage_index, self.num_stages, self.seed, self.precision = stage_index, num_stages, cfg.seed, cfg.precision
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.num_microbatches = num_microbatches
        self.grid = grid or Grid(stage_index, num_stages)
        self.cfg = cfg  # the optimizer is built again over a sharded stage's shards
        stages = meta_stages(cfg, dataset, num_stages, model_factory, unit_costs)
        # What crosses each cut, per row: a receiver must know the shape before the bytes arrive.
        self.boundary_shapes = boundary_shapes(stages, dataset)
        # A weight two stages hold (a tied embedding and head cut apart): its gradient is summed
        # over them before each step, under the tag its place in the one list gives.
        self.shared = [(tag, w) for tag, w in enumerate(shared_weights(stages)) if stage_index in w.names]
        # ... and the global norm counts it once, on its first holder.
        self.counted_elsewhere = {w.names[stage_index] for _, w in self.shared if min(w.names) != stage_index}
        # Only this stage's layers ever get memory: the whole model exists on the meta device.
        own = meta_stages(cfg, dataset, num_stages, model_factory, unit_costs, real_buffers=True)[stage_index]
        self.module = materialize(own, self.device)
        self.module.load_state_dict(initial_slice)
        blocks = getattr(self.module, "checkpoint_units", lambda: None)()  # or the stage's top-level children
        if cfg.activation_checkpointing:
            checkpoint_activations(self.module, blocks)
        if cfg.compile:
            compile_blocks(self.module, blocks)
        self.optimizer = build_optimizer(self.module.parameters(), cfg)
        # The LR of each optimizer step, counted over the run as the workers count it: a restore
        # sets where this stage's count resumes.
        self.schedule, self.optimizer_steps = lr_schedule(cfg, dataset.num_rows), 0
        self.clip_norm, self.grad_norms = cfg.grad_clip_norm, []
        self.scaler = grad_scaler(cfg.precision, self.device)
        if self.scaler is not None:
            # GradScaler makes its scale tensor on its first scale(); a stage before the last never
            # scales a loss, yet unscales its gradients by the same scale.
            self.scaler.scale(torch.zeros((), device=self.device))
        self.loss_fn = loss_function(dataset.task)
        # Rows by the driver's indices (row indices in memory, stream indices when streaming).
        self.source = open_source(dataset, reader, cfg.seed, cfg.shuffle, torch.device("cpu"))
        self.alive: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.loss_sum = torch.zeros(())
        self.timing = _new_timing()
        self.comm = CommBytes(cfg.count_comm_bytes)
        self.store: dist.TCPStore | None = None  # p2p: rank 0's, where the stages' group meets
        torch.manual_seed(rank_seed(cfg.seed, self.grid.rank))  # this actor's dropout draws

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    @_described
    def forward(self, microbatch: int, activation: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
        faults.stage_forward()
        x, target = self._inputs(rows, activation)
        began = time.perf_counter()
        with autocast(self.precision, self.device):  # the forward and the loss, as train_step
            out = self.module(x)
            loss = self.loss_fn(out, target) if self.is_last else None
        if self.is_last:
            self.loss_sum += loss.detach().cpu()
            # Divide by num_microbatches so the accumulated gradient is the global-batch mean.
            out = loss / self.num_microbatches
        self.alive[microbatch] = (x, out)
        self.timing["peak_live_microbatches"] = max(self.timing["peak_live_microbatches"], len(self.alive))
        self._record_op(began)
        return None if self.is_last else self._send(out.detach())

    @_described
    def backward(self, microbatch: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """``grad`` is the next stage's input gradient; the last stage ignores it (its own
        forward's output is passed only as a dependency in a compiled graph)."""
        began = time.perf_counter()
        x, out = self.alive.pop(microbatch)
        if self.is_last:
            (out if self.scaler is None else self.scaler.scale(out)).backward()
        else:
            out.backward(grad.to(self.device))
        self._record_op(began)
        return None if self.is_first else self._send(x.grad.detach())

    def _inputs(self, rows: torch.Tensor, activation: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This micro-batch's input (its rows' features on the first stage) and its targets (on
        the last); time blocked on the stream's reader is the stage's data wait."""
        features = targets = None
        if self.is_first or self.is_last:
            waited = self.source.wait_s
            features, targets = self.source.rows(rows)
            self.timing["data_wait_s"] += self.source.wait_s - waited
        x = to_device(features, self.device) if self.is_first else activation.to(self.device).requires_grad_()
        return x, to_device(targets, self.device) if self.is_last else None

    def _record_op(self, began: float) -> None:
        seconds = time.perf_counter() - began
        self.timing["compute_s"] += seconds
        self.timing["op_seconds"].append(seconds)

    def _send(self, tensor: torch.Tensor) -> torch.Tensor:
        """Through host memory as float32, the dtype the p2p receiver's buffer is allocated in:
        a bf16/fp16 activation is exact in float32, and the next stage's autocast casts it back
        to the same values (its gradient, cast back the same way, too); fp32 is not copied."""
        return tensor if self.device_transport else tensor.to("cpu", torch.float32)

    @_described
    def step(self, *_dependencies) -> float:
        """Apply the accumulated gradient; returns this batch's mean loss (last stage) or 0."""
        if self.alive:
            raise RuntimeError(f"step with micro-batches {sorted(self.alive)} still waiting for backward")
        began = time.perf_counter()
        self.schedule.apply(self.optimizer, self.optimizer_steps)
        self.optimizer_steps += 1  # a step fp16 skips still counts, as LambdaLR counts it
        averaged = self.grid.average(self.module, self.loss_sum if self.is_last else None)
        if averaged is not None:
            self.loss_sum = averaged
        self._sum_shared_grads()
        if self.clip_norm is not None:
            self._clip()
        if self.scaler is None:
            self.optimizer.step()
        else:
            self._scaled_step()
        self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - began
        self.timing["optimizer_s"] += seconds
        self.timing["step_seconds"].append(seconds)
        loss, self.loss_sum = self.loss_sum.item() / self.num_microbatches, torch.zeros(())
        return loss

    def _sum_shared_grads(self) -> None:
        """Each weight this stage shares with others: its gradient becomes the sum of every holder's,
        added in stage order on each, so the holders step alike, as the one tensor they stand for
        would (p2p's process group carries them)."""
        for tag, weight in self.shared:
            param = self.module.get_parameter(weight.names[self.stage_index])
            mine = torch.zeros_like(param, device="cpu") if param.grad is None else param.grad.to("cpu")
            tag = 2 * self.num_microbatches + tag  # after every micro-batch's forward and backward tags
            peers = [peer for peer in weight.names if peer != self.stage_index]
            sends = [self._gloo(CALLS, dist.isend, mine, self.grid.rank_of(peer), tag=tag) for peer in peers]
            grads = {self.stage_index: mine}
            for peer in peers:
                grads[peer] = torch.empty_like(mine)
                self._gloo(CALLS, dist.recv, grads[peer], self.grid.rank_of(peer), tag=tag)
            for work in sends:
                self._gloo(CALLS, work.wait)
            holders = list(weight.names)
            total = grads[holders[0]].clone()
            for holder in holders[1:]:
                total += grads[holder]
            param.grad = total.to(param.device)

    def _clip(self) -> None:
        """``clip_grad_norm_`` over the whole model, not this stage: each stage's squared norm is
        summed over the stages (p2p's process group), and every stage scales its gradients by the
        one coefficient that norm gives, as one process would. A shared weight counts once, on the
        first stage holding it."""
        counted = [param for name, param in self.module.named_parameters() if name not in self.counted_elsewhere]
        grads = [p.grad for p in counted if p.grad is not None]
        squared = stage_norm(grads).pow(2).reshape(1)
        if dist.is_initialized():  # this replica's stages: after the average, every replica's norm is one
            self._gloo(CALLS, dist.all_reduce, squared, op=dist.ReduceOp.SUM, group=self.grid.pipeline)
        total = squared.sqrt()[0]
        with self.grid.plain_scalars():
            torch.nn.utils.clip_grads_with_norm_(self.module.parameters(), self.clip_norm, total)
        self.grad_norms.append(float(total))

    def take_grad_norms(self) -> list[float]:
        """The whole model's gradient norm before clipping of each step since the last call."""
        norms, self.grad_norms = self.grad_norms, []
        return norms

    def _scaled_step(self) -> None:
        """fp16: skip the step on every stage, and lower every stage's scale, when any stage's
        gradients overflowed, as one GradScaler over the whole model would. Each stage's scaler
        sees only its own gradients (an overflow in a weight gradient upstream leaves the later
        stages' finite), so the stages share whether any overflowed over the p2p group."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        mine = overflowed(grads)
        anywhere = torch.tensor([float(mine)])
        if dist.is_initialized():
            self._gloo(CALLS, dist.all_reduce, anywhere, op=dist.ReduceOp.MAX)
        if anywhere.item() and not mine and grads:
            mark_overflow(grads)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    # --- p2p transport: torch.distributed send/recv between the stage actors themselves ---

    def rendezvous_address(self, timeout_s: float) -> str:
        """A ``tcp://`` address on this actor's node for the stages' process group (rank 0 only),
        its store already listening: bound to a port the system picks, on the node's own IP (never
        0.0.0.0). A port picked free and bound later can be taken in between by any connection
        the node opens (seen once under load: the group never formed)."""
        ip = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(
            ip, 0, self.grid.world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )  # fmt: skip
        return f"tcp://{ip}:{self.store.port}"

    @_described
    def join_group(self, address: str, schedule: str, timeout_s: float, replicas_backend: str = "gloo") -> None:
        """Join the stages' gloo process group, and the grid's subgroups (``replicas_backend``: the
        replicas'); ``timeout_s`` bounds every receive, so a stage whose peer died fails instead
        of waiting for ever."""
        timeout, grid = datetime.timedelta(seconds=timeout_s), self.grid
        # Every rank passes a store: torch prefixes the keys of a store it makes from an init_method.
        if self.store is None:  # a client of rank 0's
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            self.store = dist.TCPStore(host, int(port), grid.world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=self.store, rank=grid.rank, world_size=grid.world_size, timeout=timeout)
        grid.join(timeout, replicas_backend)
        if grid.sharded:
            grid.shard(self.module, self.precision, self.device)
            self.optimizer = build_optimizer(self.module.parameters(), self.cfg)  # over the shards
        self.ops = SCHEDULES[schedule](self.num_stages, self.num_microbatches)[self.stage_index]
        self.last_backward = max(i for i, op in enumerate(self.ops) if op.kind != FORWARD)
        self.receives_ahead = receives_ahead(self.ops)

    @_described
    def run_batches(self, batches: torch.Tensor) -> list[float]:
        """Several global batches in one actor call, one after another; returns each batch's
        loss. ``batches``: one global batch's row indices per row. A call per batch leaves a
        dispatch gap between batches (measured ~7 ms here) that every stage waits through;
        one tensor instead of a tensor per micro-batch because Ray pickles each tensor
        separately (measured: 64 of them took ~25 ms to submit)."""
        losses = []
        for batch in batches:
            with self.comm.step():  # --count-comm-bytes: a batch is one optimizer step
                rows = shard(batch, self.grid.num_replicas, self.grid.replica)
                losses.append(self.run_batch(microbatches(rows, self.num_microbatches)))
        return losses

    def run_batch(self, rows: list[torch.Tensor]) -> float:
        """One global batch: this stage's ops in schedule order, then the optimizer step.

        Sends are asynchronous and waited on only at the end, so no two stages can block
        sending to each other. Receives are posted ahead of need (``receives_ahead``): gloo
        moves a message only once its receive is posted, so a receive posted at the moment of
        need pays a round trip through both peers' I/O threads (which compete with compute for
        the CPU) on the pipeline's critical path. Time in gloo's send, receive-post and
        send-wait calls is recorded apart (``p2p_calls_s``): it is the transport's own cost.
        """
        sends = []  # (work, tensor): the tensor must outlive its asynchronous send
        receives = deque(op for op in self.ops if self._needs_input(op))
        posted: deque = deque()
        for index, op in enumerate(self.ops):
            m, forward = op.microbatch, op.kind == FORWARD
            if not forward:
                self.grid.before_backward(self.module, last=index == self.last_backward)
            received = None
            if self._needs_input(op):
                while receives and len(posted) < self.receives_ahead:
                    posted.append(self._post_receive(receives.popleft(), rows))
                received = self._wait_receive(op, *posted.popleft())
            out = self.forward(m, received, rows[m]) if forward else self.backward(m, received)
            if out is not None:
                peer = self.grid.rank_of(self.stage_index + (1 if forward else -1))
                sends.append((self._gloo(CALLS, dist.isend, out, peer, tag=_tag(op, self.num_microbatches)), out))
        for work, _ in sends:
            self._gloo(CALLS, work.wait)
        return self.step()

    def _gloo(self, timing_key: str, call, *args, **kwargs):
        """A send, receive or wait, its duration added to ``timing_key``; its failure means a
        peer died or timed out. gloo raises ``DistBackendError`` or a plain ``RuntimeError``
        (both seen), so only these calls are wrapped: a RuntimeError from compute is a bug,
        not a lost peer."""
        began = time.perf_counter()
        try:
            return call(*args, **kwargs)
        except RuntimeError as error:
            raise PeerLost(f"{self.grid.name}: {str(error).splitlines()[0] if str(error) else error!r}") from None
        finally:
            self.timing[timing_key] += time.perf_counter() - began

    def _needs_input(self, op) -> bool:
        return not self.is_first if op.kind == FORWARD else not self.is_last

    def _post_receive(self, op, rows: list[torch.Tensor]):
        peer = self.stage_index + (-1 if op.kind == FORWARD else 1)
        shape, dtype = self.boundary_shapes[min(peer, self.stage_index)]  # the cut between the two
        buffer = torch.empty((len(rows[op.microbatch]), *shape), dtype=dtype)  # gloo: host memory
        work = self._gloo(CALLS, dist.irecv, buffer, self.grid.rank_of(peer), tag=_tag(op, self.num_microbatches))
        return op, work, buffer

    def _wait_receive(self, op, posted_op, work, buffer: torch.Tensor) -> torch.Tensor:
        if posted_op != op:
            raise RuntimeError(f"stage {self.stage_index}: receive for {posted_op} posted, {op} needed")
        self._gloo("receive_wait_s", work.wait)
        return buffer

    def take_timing(self) -> dict[str, float]:
        """Seconds in forward/backward compute, in the optimizer, blocked on p2p receives, in
        the other p2p calls, the most micro-batches alive at once, and each op's and step's
        duration, since the last call."""
        timing, self.timing = self.timing, _new_timing()
        return timing

    def state(self) -> tuple[dict[str, torch.Tensor], dict, dict[str, Any], dict | None]:
        """This stage's weights, optimizer state, RNG state and fp16 scaler state (the same on every
        stage); Ray copies them out as it sends them."""
        weights, optimizer = self.grid.state(self.module, self.optimizer)
        return weights, optimizer, rng_state(), self.scaler.state_dict() if self.scaler else None

    @_described
    def restore(self, state: TrainState) -> None:
        """Restore this stage's slice of a checkpoint (``slice_state``)."""
        self.grid.restore(self.module, self.optimizer, state.model, state.optimizer)
        restore_scaler(self.scaler, state)
        resume_rng(state.rng[0] if state.rng else None, self.seed, self.grid.rank, state.epochs_completed)
        self.optimizer_steps = self.schedule.step_of(state.epochs_completed, state.step)

    def rng(self) -> dict[str, Any]:
        """This actor's RNG state alone: a replica's copy of a stage checkpoints nothing else."""
        return rng_state()

    def model_state_bytes(self) -> dict[str, int]:
        """What this actor holds of the model's state (a sharded stage: its shards)."""
        return model_state_bytes(self.module, self.optimizer)

    def comm_bytes_per_step(self) -> dict[str, float] | None:
        return self.comm.per_step()

    def peak_memory(self) -> dict[str, int | None]:
        """Peak resident memory of this stage's process, and its GPU's peak allocation."""
        device = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return {"rss_bytes": peak_rss_bytes(), "device_bytes": device}

    def run_in_process(self, function: Callable[[], None]) -> None:
        """Call ``function`` in this actor's process: the tests' fault seam (``testing.faults``)."""
        function()


def overflowed(grads: list[torch.Tensor]) -> bool:
    """Whether any of ``grads`` holds an inf or NaN (one device sync for all of them)."""
    return bool(grads) and not torch.stack([torch.isfinite(grad).all() for grad in grads]).all().item()


def mark_overflow(grads: list[torch.Tensor]) -> None:
    """Make this stage's GradScaler find the overflow another stage found: one inf in a gradient
    it is about to unscale. Its public step() then skips and its update() backs off, exactly as
    for an overflow of its own, so the stages' scales never drift apart."""
    grads[0].view(-1)[0] = float("inf")


def _new_timing() -> dict[str, float]:
    return {
        "compute_s": 0.0,
        "optimizer_s": 0.0,
        "receive_wait_s": 0.0,
        CALLS: 0.0,
        "data_wait_s": 0.0,
        "peak_live_microbatches": 0,
        "op_seconds": [],
        "step_seconds": [],
    }


def receives_ahead(ops: list) -> int:
    """How many receives a stage keeps posted ahead of need: as many micro-batches as its
    schedule keeps alive at once (GPipe: all M; 1F1B: at most S), and at least
    ``MIN_RECEIVES_AHEAD``, so the buffers waiting never outnumber the activations the schedule
    holds anyway. Measured (GPipe, S=2, M=8, 2 CPUs, four alternating runs a side): with 2
    ahead, each later post met messages already arriving, and the stages spent 3.0-6.0% of
    their time in gloo's calls; with every receive posted at the first need, 1.1-1.2%, and the
    bubble's median fell from 0.218 to 0.187. Samples/s stayed level (1,443 vs 1,451)."""
    return max(MIN_RECEIVES_AHEAD, peak_live_activations(ops))


def _tag(op, num_microbatches: int) -> int:
    # Forward and backward of one micro-batch cross the same pair of stages: distinct tags.
    return op.microbatch + (0 if op.kind == FORWARD else num_microbatches)
