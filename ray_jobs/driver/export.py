"""An fsdp run's final weights, consolidated from the slices each rank wrote.

Each rank writes its own slices of the final weights as safetensors
(``HuggingFaceStorageWriter(save_distributed=True)``, ``data_parallel.sharding``), so no rank
gathers the model. The driver then checks that the slices cover every tensor, and consolidates
them with torch's own ``consolidate_safetensors_files``, which holds one tensor at a time, into
``model.safetensors`` and, for a ``hf:`` run, ``hf/``. ``model.pt`` is written from
``model.safetensors`` mapped from the disk, not read into this process's memory.
"""

from __future__ import annotations

import os
import tempfile
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ray_jobs.core.checkpoint import WEIGHTS_DIR, TrainState, checkpoint_name
from ray_jobs.core.pretrained import (
    DTYPES,
    INDEX_FILE,
    WEIGHTS_FILE,
    file_indices,
    mapped_tensors,
    read_weights,
    sharded_names,
    tied_names,
)
from ray_jobs.data import storage


@dataclass(frozen=True)
class Export:
    """What consolidating a run's final weights took."""

    num_bytes: int
    """The consolidated weights' size (a tied tensor once)."""
    peak_bytes: int
    """The most memory the consolidation held at once (``tracemalloc``: its buffers are Python's;
    an RSS reading in a long-lived driver hides them in pages freed before and reused)."""
    dtype: str
    """The weights' dtype, as ``config.json`` names it."""


def write_sliced_weights(
    run_dir: str, final: TrainState, model: nn.Module, hf_files: Callable[[str], dict[str, bytes]] | None = None
) -> Export:
    """``model.safetensors``, ``model.pt`` and, given ``hf_files`` (a ``hf:`` run's config and
    tokenizer files by name, for the weights' dtype), ``hf/``, from the slices in ``final``'s
    ``weights/``. ``model``: the run's ``probe_model``, for the names and shapes the slices must
    cover, and its tied names."""
    aliases = tied_names(model)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in aliases}
    source = storage.join(run_dir, checkpoint_name(final.epochs_completed, final.step), WEIGHTS_DIR)
    with storage.local_directory(source) as slices, tempfile.TemporaryDirectory(prefix="raypar-export-") as out:
        sizes, dtype = check_slices(slices, shapes)
        tracemalloc.start()
        try:
            single = consolidate(slices, os.path.join(out, "whole"), {name: 1 for name in shapes})[0]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        storage.upload(single, storage.join(run_dir, WEIGHTS_FILE))
        if hf_files is not None:
            write_hf(run_dir, slices, out, single, sizes, hf_files(dtype))
        mapped = mapped_tensors(single)
        weights = {name: mapped[aliases.get(name, name)] for name in model.state_dict()}
        storage.write(storage.join(run_dir, "model.pt"), lambda stream: torch.save(weights, stream))
    return Export(sum(sizes.values()), peak, dtype)


def check_slices(directory: str, shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, int], str]:
    """Each tensor's size in bytes and the weights' dtype, once the slice files in ``directory``
    are found to hold every element of every tensor of ``shapes``, and nothing else: a rank's
    file that never arrived would leave a tensor with holes, which consolidation fills with zeros."""
    held: dict[str, int] = {}
    dtypes: dict[str, str] = {}
    for file in sorted(name for name in os.listdir(directory) if name.endswith(".safetensors")):
        for name, info in read_weights(directory, [file], f"the final weights' slice {file}").tensors.items():
            held[name] = held.get(name, 0) + torch.Size(info.shape).numel()
            dtypes[name] = info.dtype
    unknown = sorted(set(held) - set(shapes))
    short = [name for name, shape in shapes.items() if held.get(name, 0) != torch.Size(shape).numel()]
    if unknown or short:
        what = f"{', '.join(short[:3])} incomplete" if short else f"{', '.join(unknown[:3])} not in the model"
        raise ValueError(
            f"the final checkpoint's {WEIGHTS_DIR}/ slices leave {what}: a rank's file is missing or stale"
        )
    sizes = {name: torch.Size(shape).numel() * DTYPES[dtypes[name]].itemsize for name, shape in shapes.items()}
    return sizes, str(DTYPES[dtypes[next(iter(shapes))]]).removeprefix("torch.")


def consolidate(slices: str, out: str, indices: dict[str, int]) -> list[str]:
    """The slices consolidated into files by ``indices`` (tensor name -> file 1..n), named as
    transformers names them (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``); their paths, the index's last."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    os.makedirs(out)
    consolidate_safetensors_files(slices, out, indices)
    count = max(indices.values())
    written = [os.path.join(out, f"model-{i:05d}-of-{count:05d}.safetensors") for i in range(1, count + 1)]
    if count == 1:  # one file: no index, and transformers' single-file name
        os.rename(written[0], os.path.join(out, WEIGHTS_FILE))
        os.remove(os.path.join(out, INDEX_FILE))
        return [os.path.join(out, WEIGHTS_FILE)]
    return [*(os.path.join(out, name) for name in sharded_names(count)), os.path.join(out, INDEX_FILE)]


def write_hf(
    run_dir: str, slices: str, out: str, single: str, sizes: dict[str, int], hf_files: dict[str, bytes]
) -> None:
    """``hf/``: the weights (the one file, or a second consolidation into parts past the size
    transformers splits at) and the config and tokenizer files."""
    indices = file_indices(sizes)
    files = [single] if max(indices.values()) == 1 else consolidate(slices, os.path.join(out, "hf"), indices)
    for path in files:
        storage.upload(path, storage.join(run_dir, "hf", os.path.basename(path)))
    for name, data in hf_files.items():
        storage.write_bytes(storage.join(run_dir, "hf", name), data)
