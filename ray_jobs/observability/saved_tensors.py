"""How many bytes of activations autograd holds for backward at its peak, read through
``torch.autograd.graph.saved_tensors_hooks``: what ``--grad-accum-steps`` lowers, on any device
(CPU has no allocator statistics to read it from).

Counted: the bytes of every tensor a forward saves for backward, from when it is saved until the
graph that holds it is freed; a tensor saved by several ops (a ReLU's output is also the next
Linear's input) counts once, a slice of the batch as its own rows (not the batch it views), and
parameters (which a Linear saves too) not at all. Not counted: the gradients of activations alive
during backward, and tensors autograd does not save.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch


class SavedTensorBytes:
    """Live and peak bytes of the tensors autograd holds for backward (see the module)."""

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self._live: dict[tuple[int, int], int] = {}  # (address, bytes) of a saved tensor -> its saves alive
        self.live_bytes = 0
        self.peak_bytes = 0

    def pack(self, tensor: torch.Tensor) -> object:
        if tensor.untyped_storage().data_ptr() in self._parameters:  # a weight, or a view of one
            return tensor
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if self._live.get(key, 0) == 0:
            self.live_bytes += key[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._live[key] = self._live.get(key, 0) + 1
        return _Saved(self, key, tensor)

    @staticmethod
    def unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: tuple[int, int]) -> None:
        self._live[key] -= 1
        if self._live[key] == 0:
            self.live_bytes -= key[1]
            del self._live[key]


class _Saved:
    """One saved tensor as the graph holds it: autograd drops it when it frees the graph (after
    backward), and with it its bytes from the count."""

    __slots__ = ("_counter", "_key", "tensor")

    def __init__(self, counter: SavedTensorBytes, key: tuple[int, int], tensor: torch.Tensor) -> None:
        self._counter, self._key, self.tensor = counter, key, tensor

    def __del__(self) -> None:
        self._counter._release(self._key)


@contextlib.contextmanager
def saved_tensor_bytes(parameters: Iterable[torch.Tensor]) -> Iterator[SavedTensorBytes]:
    """Count what every forward run inside holds for backward; ``.peak_bytes`` after it."""
    counter = SavedTensorBytes(parameters)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        yield counter
