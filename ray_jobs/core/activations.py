"""``--activation-checkpointing``: recompute each top-level block's forward in backward instead of
keeping its activations; ``--compile``: each block's forward compiled; and the one count of the
bytes autograd holds for backward, which tells what checkpointing and ``--grad-accum-steps`` save,
on any device (CPU has no allocator statistics).

Pure torch, used inside every strategy's process: a DDP or FSDP worker, a pipeline stage.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_activations(model: nn.Module, children: list[tuple[str, nn.Module]] | None = None) -> list[str]:
    """Run each top-level child that has parameters (the GPT's blocks, an MLP's Linears, a user
    model's children) under ``torch.utils.checkpoint``: non-reentrant, with the RNG state kept,
    so a recomputed dropout draws the masks its forward drew and the gradients are the ones
    without it. The child's ``forward`` is replaced on the instance, so parameter names,
    ``state_dict`` keys and the hooks a wrapper sets around ``__call__`` (FSDP's all-gather, DDP's)
    stay as they were. ``children``: the blocks to run so, by name, when not ``model``'s own (a
    Hugging Face pipeline stage's decoder layers). Returns the children's names."""
    return _replace_forwards(
        model,
        children,
        lambda forward: functools.partial(checkpoint, forward, use_reentrant=False, preserve_rng_state=True),
    )


def compile_blocks(model: nn.Module, children: list[tuple[str, nn.Module]] | None = None) -> list[str]:
    """``--compile``: each block's ``forward`` (``children``, by default ``model``'s top-level ones
    with parameters) replaced on the instance by its ``torch.compile``d self, as
    ``checkpoint_activations`` replaces it (call this after it, so the recompute is compiled too).
    A block, not the whole model: the hooks a wrapper sets around ``__call__`` (FSDP's all-gathers,
    DDP's) stay outside the graph, as torchtitan compiles each block, and parameter names and
    ``state_dict`` keys are unchanged, so checkpoints are eager's. Returns the blocks' names."""
    return _replace_forwards(model, children, torch.compile)


def _replace_forwards(
    model: nn.Module, children: list[tuple[str, nn.Module]] | None, wrap: Callable[[Callable], Callable]
) -> list[str]:
    """Each block's ``forward`` (``children``, else ``model``'s top-level ones) set on the instance
    to ``wrap`` of itself; a child without parameters (an activation, a dropout) is left alone:
    there is nothing to gain by wrapping it alone. Returns the blocks' names."""
    names = []
    for name, child in model.named_children() if children is None else children:
        if next(child.parameters(), None) is None:
            continue
        child.forward = wrap(child.forward)
        names.append(name)
    return names


class HeldForBackward:
    """Live and peak bytes of the tensors autograd holds for backward, read through
    ``saved_tensors_hooks`` while ``counting``.

    Counted: every tensor a forward saves, from when it is saved until the graph that holds it is
    freed (by backward); a tensor saved by several ops (a ReLU's output is the next Linear's input
    too) once; a slice of the batch as its own bytes, not the batch it views. A checkpointed child
    keeps only its input for the recompute, saved outside torch's own hooks, so that is what it
    counts for. Not counted: the model's parameters (held anyway), the gradients of activations
    alive during backward, and the activations a checkpointed child recomputes in backward."""

    def __init__(self, model: nn.Module) -> None:
        self._parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
        self._live: dict[tuple[int, int], int] = {}  # (address, bytes) of a saved tensor -> its saves alive
        self.live_bytes = 0
        self.peak_bytes = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[HeldForBackward]:
        """Count what every forward inside saves; ``peak_bytes``: the most held at once since it began."""
        self.peak_bytes = self.live_bytes
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield self

    def _pack(self, tensor: torch.Tensor) -> object:
        if tensor.untyped_storage().data_ptr() in self._parameters:  # a weight, or a view of one
            return tensor
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if self._live.get(key, 0) == 0:
            self.live_bytes += key[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._live[key] = self._live.get(key, 0) + 1
        return _Saved(self, key, tensor)

    def _release(self, key: tuple[int, int]) -> None:
        self._live[key] -= 1
        if self._live[key] == 0:
            self.live_bytes -= key[1]
            del self._live[key]


def _unpack(saved: object) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved


class _Saved:
    """One saved tensor as the graph holds it: autograd drops it when it frees the graph (after
    backward), and with it its bytes from the count."""

    __slots__ = ("_counter", "_key", "tensor")

    def __init__(self, counter: HeldForBackward, key: tuple[int, int], tensor: torch.Tensor) -> None:
        self._counter, self._key, self.tensor = counter, key, tensor

    def __del__(self) -> None:
        self._counter._release(self._key)
