"""The bytes a process hands to torch.distributed per optimizer step (``--count-comm-bytes``), by
kind of call: what the bench's communication model predicts, counted where the calls are made.

What is counted is the buffer each call is given, not the bytes a ring then moves over links: an
all-reduce its tensor, an all-gather its gathered output, a reduce-scatter its full input, a send
or receive its tensor. Counting runs only inside the steps a worker or stage brackets with
``CommBytes.step()``: the once-an-epoch loss average and the summary's object gathers are not a
step's traffic.

The Python calls (FSDP2's all-gathers and reduce-scatters, the pipeline's sends and replica
averages) are counted by wrapping ``torch.distributed``'s functions in this process. DDP's
all-reduces are made by its C++ reducer, so torch's default all-reduce communication hook makes
them through ``dist.all_reduce`` instead.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch.distributed's function -> (the kind it is counted as, the buffer counted: position, name)
_COUNTED = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "all_gather_single": ("all_gather", 0, "output_tensor"),  # FSDP2's: the gathered output
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),  # FSDP2's: the full input
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "broadcast": ("broadcast", 0, "tensor"),
    "send": ("send", 0, "tensor"),
    "isend": ("send", 0, "tensor"),
    "recv": ("recv", 0, "tensor"),
    "irecv": ("recv", 0, "tensor"),
}
KINDS = tuple(dict.fromkeys(kind for kind, _, _ in _COUNTED.values()))


class CommBytes:
    """This process's counts; ``enabled`` False makes every method free."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bytes: Counter[str] = Counter()
        self.steps = 0
        self._active = False
        if enabled:
            _install(self)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Count the calls made inside, as one optimizer step's."""
        if not self.enabled:
            yield
            return
        self._active = True
        try:
            yield
        finally:
            self._active = False
            self.steps += 1

    def add(self, kind: str, tensor: Any) -> None:
        if self._active and isinstance(tensor, torch.Tensor):
            self.bytes[kind] += tensor.numel() * tensor.element_size()

    def per_step(self) -> dict[str, float] | None:
        """Bytes per counted step by kind (every kind, zeros included), or None when not counting."""
        if not self.enabled:
            return None
        return {kind: self.bytes[kind] / max(self.steps, 1) for kind in KINDS}

    def hook_ddp(self, model: nn.Module) -> None:
        """Route a DDP model's bucket all-reduces through Python, where they are counted: torch's
        own default hook, which reduces the gradients as the C++ reducer does."""
        if self.enabled and isinstance(model, nn.parallel.DistributedDataParallel):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            model.register_comm_hook(None, allreduce_hook)


_counters: list[CommBytes] = []


def _install(counter: CommBytes) -> None:
    """Wrap torch.distributed's calls once per process; the newest counter counts (a worker
    process that trains again builds a new one)."""
    if not _counters:
        for name, (kind, position, keyword) in _COUNTED.items():
            setattr(dist, name, _counting(getattr(dist, name), kind, position, keyword))
    _counters[:] = [counter]


def _counting(call, kind: str, position: int, keyword: str):
    @functools.wraps(call)
    def counted(*args, **kwargs):
        _counters[0].add(kind, args[position] if len(args) > position else kwargs.get(keyword))
        return call(*args, **kwargs)

    return counted
