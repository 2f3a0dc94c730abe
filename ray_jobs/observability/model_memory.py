"""What the model's state holds in one worker's memory: its parameters, their gradients and the
optimizer state, in bytes, counted from the tensors this process holds, not from RSS.

A sharded parameter (an FSDP2 ``DTensor``) counts its local shard only (``to_local()``), as does
its gradient and its optimizer state; each storage counts once (a tied weight, a view). Not
counted: what a wrapper allocates beside them (DDP's gradient buckets, another copy of the
gradients; FSDP's all-gathered weights, freed after each block), nor activations.
"""

from __future__ import annotations

import sys

import torch
from torch import nn


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, any other tensor itself. DTensor is looked up, not imported: a
    process that never imported it holds none, and importing it costs a DDP worker ~0.5 s of CPU
    at every start (torch.distributed.tensor's op registrations)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``{"parameters", "gradients", "optimizer", "total"}`` in bytes, this process's own."""
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for tensor in tensors:
            storage = _local(tensor).untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(model.parameters())
    held = {
        "parameters": size(params),
        "gradients": size(p.grad for p in params if p.grad is not None),
        "optimizer": size(
            value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)
        ),
    }
    return {**held, "total": sum(held.values())}
