"""One pipeline stage: a Ray actor holding one slice of the model and its optimizer.

Forward keeps the micro-batch's input and output alive until its backward; the last stage
also computes the loss. Gradients accumulate over the micro-batches of a global batch and the
optimizer steps once per global batch, as in single-process training.
"""
from __future__ import annotations

import os
import time
from typing import Any

import ray
import torch

from models import build_model, split_into_stages
from ray_jobs.checkpoint import TrainState, load_named_optimizer_state, named_optimizer_state
from ray_jobs.config import TrainConfig
from ray_jobs.data import Dataset
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
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.num_microbatches = num_microbatches
        model = build_model(cfg.model, dataset.in_features, dataset.out_features, **cfg.model_options)
        model.load_state_dict(initial_state)
        self.module = split_into_stages(model, num_stages)[stage_index].to(self.device)
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
