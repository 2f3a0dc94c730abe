"""One pipeline stage: a Ray actor holding one slice of the model and its optimizer.

Forward keeps the micro-batch's input and output alive until its backward; the last stage
also computes the loss. Gradients accumulate over the micro-batches of a global batch and the
optimizer steps once per global batch, as in single-process training.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any

import ray
import torch
import torch.distributed as dist

from models import build_model, split_into_stages
from ray_jobs.checkpoint import TrainState, load_named_optimizer_state, named_optimizer_state
from ray_jobs.config import TrainConfig
from ray_jobs.data import Dataset
from ray_jobs.schedules import FORWARD, SCHEDULES
from ray_jobs.training import build_optimizer, loss_function


class StageWorker:
    def __init__(
        self,
        stage_index: int,
        num_stages: int,
        num_microbatches: int,
        train: dict[str, Any],
        dataset: Dataset,
        initial_state: dict[str, torch.Tensor],
        num_threads: int,
        use_gpu: bool,
        device_transport: bool = False,
    ) -> None:
        cfg = TrainConfig(**train)
        torch.set_num_threads(num_threads)
        self.device = torch.device("cuda" if use_gpu else "cpu")
        # With a GPU-to-GPU channel (compiled graph + nccl) tensors stay on the device;
        # otherwise they cross process boundaries as CPU tensors.
        self.device_transport = device_transport
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.num_microbatches = num_microbatches
        model = build_model(cfg.model, dataset.in_features, dataset.out_features, **cfg.model_options)
        model.load_state_dict(initial_state)
        stages = split_into_stages(model, num_stages)
        # What crosses each cut, per row: a receiver must know the shape before the bytes arrive.
        self.boundary_shapes = _boundary_shapes(stages, dataset.in_features)
        self.module = stages[stage_index].to(self.device)
        self.optimizer = build_optimizer(self.module.parameters(), cfg)
        self.loss_fn = loss_function(dataset.task)
        features, targets = dataset.tensors()
        self.features = features if self.is_first else None
        self.targets = targets if self.is_last else None
        self.alive: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.loss_sum = torch.zeros(())
        self.busy_seconds = 0.0
        self.peak_alive = 0

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def forward(self, microbatch: int, activation: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
        began = time.perf_counter()
        if self.is_first:
            x = self.features[rows].to(self.device)
        else:
            x = activation.to(self.device).requires_grad_()
        out = self.module(x)
        if self.is_last:
            loss = self.loss_fn(out, self.targets[rows].to(self.device))
            self.loss_sum += loss.detach().cpu()
            # Divide by num_microbatches so the accumulated gradient is the global-batch mean.
            out = loss / self.num_microbatches
        self.alive[microbatch] = (x, out)
        self.peak_alive = max(self.peak_alive, len(self.alive))
        self.busy_seconds += time.perf_counter() - began
        return None if self.is_last else self._send(out.detach())

    def backward(self, microbatch: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """``grad`` is the next stage's input gradient; the last stage ignores it (its own
        forward's output is passed only as a dependency in a compiled graph)."""
        began = time.perf_counter()
        x, out = self.alive.pop(microbatch)
        if self.is_last:
            out.backward()
        else:
            out.backward(grad.to(self.device))
        self.busy_seconds += time.perf_counter() - began
        return None if self.is_first else self._send(x.grad.detach())

    def _send(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.device_transport else tensor.cpu()

    def step(self, *_dependencies) -> float:
        """Apply the accumulated gradient; returns this batch's mean loss (last stage) or 0."""
        if self.alive:
            raise RuntimeError(f"step with micro-batches {sorted(self.alive)} still waiting for backward")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss, self.loss_sum = self.loss_sum.item() / self.num_microbatches, torch.zeros(())
        return loss

    # --- p2p transport: torch.distributed send/recv between the stage actors themselves ---

    def rendezvous_address(self) -> str:
        """A ``tcp://`` address on this actor's node for the stages' process group (stage 0 only)."""
        with socket.socket() as probe:
            # Bind to the node's own IP (never 0.0.0.0); the port is free for the few ms until
            # init_process_group binds it.
            ip = ray.util.get_node_ip_address()
            probe.bind((ip, 0))
            return f"tcp://{ip}:{probe.getsockname()[1]}"

    def join_group(self, address: str, schedule: str, timeout_s: float) -> None:
        """Join the stages' process group (gloo on CPU, nccl on GPU); ``timeout_s`` bounds every
        receive, so a stage whose peer died fails instead of waiting for ever."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=address, rank=self.stage_index, world_size=self.num_stages,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.ops = SCHEDULES[schedule](self.num_stages, self.num_microbatches)[self.stage_index]

    def run_batch(self, rows: list[torch.Tensor]) -> float:
        """One global batch: this stage's ops in schedule order, then the optimizer step.

        Receives block (they are the schedule's dependencies); sends are asynchronous and
        waited on only at the end, so no two stages can block sending to each other.
        """
        sends = []  # (work, tensor): the tensor must outlive its asynchronous send
        try:
            for op in self.ops:
                m, forward = op.microbatch, op.kind == FORWARD
                source, destination = (-1, 1) if forward else (1, -1)
                needs_input = not (self.is_first if forward else self.is_last)
                received = self._receive(self.stage_index + source, op, len(rows[m])) if needs_input else None
                out = self.forward(m, received, rows[m]) if forward else self.backward(m, received)
                if out is not None:
                    tag = _tag(op, self.num_microbatches)
                    sends.append((dist.isend(out, self.stage_index + destination, tag=tag), out))
            for work, _ in sends:
                work.wait()
        except dist.DistError as error:
            raise PeerLost(f"stage {self.stage_index}: {error}") from None
        return self.step()

    def _receive(self, peer: int, op, num_rows: int) -> torch.Tensor:
        cut = min(peer, self.stage_index)  # the boundary between stage `cut` and `cut + 1`
        shape, dtype = self.boundary_shapes[cut]
        buffer = torch.empty((num_rows, *shape), dtype=dtype, device=self._transport_device)
        dist.recv(buffer, peer, tag=_tag(op, self.num_microbatches))
        return buffer

    @property
    def _transport_device(self) -> torch.device:
        return self.device if self.device_transport else torch.device("cpu")

    def take_timing(self) -> tuple[float, int]:
        busy, peak, self.busy_seconds, self.peak_alive = self.busy_seconds, self.peak_alive, 0.0, 0
        return busy, peak

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        weights = {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
        return weights, named_optimizer_state(self.optimizer, dict(self.module.named_parameters()))

    def restore(self, state: TrainState) -> None:
        own = self.module.state_dict().keys()
        self.module.load_state_dict({k: v for k, v in state.model.items() if k in own})
        load_named_optimizer_state(self.optimizer, dict(self.module.named_parameters()), state.optimizer)

    def crash(self) -> None:
        """Fault injection for tests: the actor's process dies as if killed."""
        os._exit(1)


class PeerLost(RuntimeError):
    """A p2p send or receive failed: the peer stage died or timed out."""


def _tag(op, num_microbatches: int) -> int:
    # Forward and backward of one micro-batch cross the same pair of stages: distinct tags.
    return op.microbatch + (0 if op.kind == FORWARD else num_microbatches)


def _boundary_shapes(stages: list[torch.nn.Module], in_features: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Per-row shape and dtype of each stage's output, from one probe row through the (CPU) stages."""
    shapes, x = [], torch.zeros(1, in_features)
    with torch.no_grad():
        for stage in stages[:-1]:
            x = stage(x)
            shapes.append((tuple(x.shape[1:]), x.dtype))
    return shapes
