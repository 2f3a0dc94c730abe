"""``--activation-checkpointing``: recompute each top-level block's forward in backward instead of
keeping its activations, and the reading that tells what that saves (the bytes autograd holds).

Pure torch, used inside every strategy's process: a DDP or FSDP worker, a pipeline stage.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_activations(model: nn.Module) -> list[str]:
    """Run each top-level child that has parameters (the GPT's blocks, an MLP's Linears, a user
    model's children) under ``torch.utils.checkpoint``: non-reentrant, with the RNG state kept,
    so a recomputed dropout draws the masks its forward drew and the gradients are the ones
    without it. The child's ``forward`` is replaced on the instance, so parameter names,
    ``state_dict`` keys and the hooks a wrapper sets around ``__call__`` (FSDP's all-gather, DDP's)
    stay as they were. Returns the children's names."""
    names = []
    for name, child in model.named_children():
        if next(child.parameters(), None) is None:
            continue  # an activation or a dropout: nothing to save by recomputing it alone
        child.forward = functools.partial(checkpoint, child.forward, use_reentrant=False, preserve_rng_state=True)
        names.append(name)
    return names


class HeldForBackward:
    """The bytes autograd holds for backward when a forward ends, counted by storage as tensors are
    saved (``saved_tensors_hooks``), each storage once. Parameters are left out (they are held
    anyway). Inside a checkpointed child torch's own hooks take the saved tensors, so what such a
    child keeps is its input, kept for the recompute: every top-level child's tensor input is
    counted too (without checkpointing its first op saves that input anyway, so the count is the
    same). The recompute of one child in backward holds that child's activations again for a
    while; this reading does not include them. ``observability.saved_tensors`` (the accumulation
    bench's live count) sees neither what a checkpointed child saves nor the input it keeps, so
    it cannot compare a checkpointed model with a plain one."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.excluded = {param.untyped_storage().data_ptr() for param in model.parameters()}
        self.held: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self.held.values())

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.excluded:
            self.held[storage.data_ptr()] = storage.nbytes()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._add(tensor)
        return tensor

    def _inputs(self, _module: nn.Module, args: tuple) -> None:
        for arg in args:
            if isinstance(arg, torch.Tensor) and torch.is_grad_enabled():
                self._add(arg)

    @contextlib.contextmanager
    def counting(self):
        """Count during the forward inside (``held`` starts empty)."""
        self.held = {}
        handles = [child.register_forward_pre_hook(self._inputs) for child in self.model.children()]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                yield self
        finally:
            for handle in handles:
                handle.remove()
