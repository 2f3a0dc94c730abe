"""Batches onto the device: rows kept on the GPU when they fit, else each batch copied ahead of
the step that needs it from pinned host memory. Runs wherever a model trains (a Ray Train worker,
a stage actor); nothing here imports Ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# Rows held on a GPU may take at most this share of its free memory at the start: the rest is for
# the weights, their gradients, the optimizer state and the activations. Chosen, not measured (no
# GPU was lent when it was written): a model's share varies by orders of magnitude, so it errs
# toward copying each batch (cheap, pinned and one step ahead) over running out of memory.
DEVICE_DATA_SHARE = 0.5


def data_device(nbytes: int, device: torch.device) -> torch.device:
    """Where rows in memory are kept: on ``device`` when they fit its share of free memory (copied
    once), else on the host, each batch then copied from pinned memory as it is needed."""
    if device.type != "cuda":
        return device
    free, _ = torch.cuda.mem_get_info(device)
    return device if nbytes <= DEVICE_DATA_SHARE * free else torch.device("cpu")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: to a GPU from pinned memory, asynchronously (the caching host
    allocator keeps the pinned copy alive until the copy is done); on the CPU, as it is."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def prefetched(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` on ``device``, each copied one step ahead: on a GPU, batch k+1 is gathered,
    pinned and copied on a side stream while the GPU runs step k, so no step waits on a host copy.
    On the CPU it is a no-op: the batches as they come, none read ahead."""
    if device.type != "cuda":
        yield from ((features.to(device), targets.to(device)) for features, targets in batches)
        return
    copies = torch.cuda.Stream(device)
    pending = None
    for batch in batches:
        with torch.cuda.stream(copies):
            copied = tuple(to_device(tensor, device) for tensor in batch)
        if pending is not None:
            yield pending
        pending = _ready(copied, copies, device)
    if pending is not None:
        yield pending


def _ready(tensors: tuple[torch.Tensor, ...], copies: torch.cuda.Stream, device: torch.device):
    """Make the compute stream wait for ``copies`` before it uses ``tensors``, and tell the caching
    allocator they are used there (else their memory could be reused while the step reads them)."""
    compute = torch.cuda.current_stream(device)
    compute.wait_stream(copies)
    for tensor in tensors:
        tensor.record_stream(compute)
    return tensors
