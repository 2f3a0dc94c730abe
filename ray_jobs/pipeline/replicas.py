"""A stage actor's place in the pipeline's grid (``--data-parallel R`` x ``--num-stages S``).

Ranks run replica by replica, so a replica's S stages are neighbouring ranks of the one gloo
group the p2p transport forms. Two kinds of subgroup sit beside it:

- a stage's R copies (``replicas``): their gradients are averaged before every step, or, with
  ``--stage-sharding fsdp``, the stage is ``fully_shard``-ed over them (FSDP x PP);
- a replica's S stages (``pipeline``): the global norm of ``--grad-clip-norm`` is summed there.

With R = 1 there are no subgroups and nothing here communicates.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist
from torch import nn

from ray_jobs.core.checkpoint import load_named_optimizer_state, named_optimizer_state
from ray_jobs.core.shard_plan import precision_dtypes, shard_units

STAGE_SHARDINGS = ("none", "fsdp")  # --stage-sharding


class Grid:
    """One stage actor's coordinates, its subgroups, and what it does across its replicas."""

    def __init__(self, stage: int, num_stages: int, replica: int = 0, num_replicas: int = 1, sharding: str = "none"):
        self.stage, self.num_stages, self.replica, self.num_replicas = stage, num_stages, replica, num_replicas
        self.sharded = sharding == "fsdp"
        self.replicas: dist.ProcessGroup | None = None
        self.pipeline: dist.ProcessGroup | None = None  # None: the default group, every stage when R is 1
        self.backend = "gloo"

    @classmethod
    def at_rank(cls, rank: int, num_stages: int, num_replicas: int = 1, sharding: str = "none") -> Grid:
        """The actor of process-group rank ``rank`` (ranks run replica by replica)."""
        return cls(rank % num_stages, num_stages, rank // num_stages, num_replicas, sharding)

    @property
    def rank(self) -> int:
        return self.rank_of(self.stage)

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas

    @property
    def name(self) -> str:
        return f"stage {self.stage}" + (f" of replica {self.replica}" if self.num_replicas > 1 else "")

    def rank_of(self, stage: int) -> int:
        """The process-group rank of ``stage`` in this actor's replica."""
        return self.replica * self.num_stages + stage

    def join(self, timeout: datetime.timedelta, backend: str) -> None:
        """Form the subgroups, once the default group exists. Every rank creates every group, in
        one order, as ``new_group`` requires, and keeps the two it belongs to. ``backend``: the
        replicas' (nccl between GPU stages, whose gradients then stay on the device)."""
        if self.num_replicas == 1:
            return
        self.backend = backend
        for stage in range(self.num_stages):
            ranks = [r * self.num_stages + stage for r in range(self.num_replicas)]
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if stage == self.stage:
                self.replicas = group
        for replica in range(self.num_replicas):
            ranks = [replica * self.num_stages + s for s in range(self.num_stages)]
            group = dist.new_group(ranks, timeout=timeout)
            if replica == self.replica:
                self.pipeline = group

    def shard(self, module: nn.Module, precision: str, device: torch.device) -> None:
        """--stage-sharding fsdp: ``fully_shard`` each of the stage's units, then its root, over its
        R copies; each keeps 1/R of the stage's weights, gradients and optimizer state (build the
        optimizer after this). Not resharded after forward: every micro-batch's backward would
        gather the weights again (torchtitan's choice for pipelined FSDP)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = DeviceMesh.from_group(self.replicas, device.type)
        options = {
            "mesh": mesh,
            "reshard_after_forward": False,
            "mp_policy": MixedPrecisionPolicy(**precision_dtypes(precision)),
        }
        for name in shard_units(module):
            fully_shard(module.get_submodule(name), **options)
        fully_shard(module, **options)

    def plain_scalars(self):
        """Where a plain tensor may meet a sharded stage's gradients (DTensors): the clip's total."""
        if not self.sharded:
            return contextlib.nullcontext()
        from torch.distributed.tensor.experimental import implicit_replication

        return implicit_replication()

    def before_backward(self, module: nn.Module, last: bool) -> None:
        """Sharded: the micro-batches before a batch's last add to unsharded gradients with the
        weights left gathered; the last one's backward reduce-scatters the sum (its mean over
        the copies) once and reshards."""
        if self.sharded:
            module.set_requires_gradient_sync(last)
            module.set_reshard_after_backward(last)

    def average(self, module: nn.Module, loss_sum: torch.Tensor | None) -> torch.Tensor | None:
        """Average this stage's gradients over its copies (FSDP's reduce-scatter did that for a
        sharded stage), and the last stage's loss, in one all-reduce of one flat buffer. Each
        replica's gradients are its share's mean's, so their average over R equal shares is the
        whole global batch's, as one process computes it. A parameter no share reached keeps no
        gradient."""
        if self.num_replicas == 1:
            return loss_sum
        params = [] if self.sharded else [p for p in module.parameters() if p.grad is not None]
        device = next(iter(module.parameters())).device if self.backend == "nccl" else torch.device("cpu")
        parts = [p.grad.reshape(-1).to(device, torch.float32) for p in params]
        if loss_sum is not None:
            parts.append(loss_sum.reshape(1).to(device, torch.float32))
        if not parts:
            return loss_sum
        flat = torch.cat(parts)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.replicas)
        flat /= self.num_replicas
        offset = 0
        for param in params:
            size = param.grad.numel()
            param.grad.copy_(flat[offset : offset + size].view_as(param.grad))
            offset += size
        return None if loss_sum is None else flat[-1].to("cpu", loss_sum.dtype).clone()

    def state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The stage's whole weights and optimizer state (keyed by parameter name). Sharded, every
        copy must call this (it all-gathers); only the first replica's answer carries them."""
        if not self.sharded:
            weights = {k: v.detach().cpu() for k, v in module.state_dict().items()}
            return weights, named_optimizer_state(optimizer, dict(module.named_parameters()))
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        weights = {k: v.cpu() for k, v in get_model_state_dict(module, options=_full()).items()}
        optimizer_state = get_optimizer_state_dict(module, optimizer, options=_full())
        return (weights, optimizer_state) if self.replica == 0 else ({}, {})

    def restore(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, weights: dict, optimizer_state: dict
    ) -> None:
        """Load the stage's slice of a whole checkpoint; sharded, each copy keeps its part."""
        if not self.sharded:
            module.load_state_dict(weights)
            load_named_optimizer_state(optimizer, dict(module.named_parameters()), optimizer_state)
            return
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(module, weights, options=_full())
        if _holds_tensors(optimizer_state.get("state", {})):
            set_optimizer_state_dict(module, optimizer, optimizer_state, options=_full())
        # else plain SGD's: no tensor to shard, nothing a step reads (torch's loader refuses it)


def _full():
    """Whole (gathered) state dicts. FSDP's modules load only on a sharded stage: they cost a
    stage actor ~0.6 s of its start (torch.distributed.tensor), which most pipelines never use."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True)


def _holds_tensors(state: dict) -> bool:
    return any(isinstance(value, torch.Tensor) for per_param in state.values() for value in per_param.values())


def stage_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm of a stage's gradients, whole even when they are shards (an all-gather of the
    partial norms over the stage's copies)."""
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
