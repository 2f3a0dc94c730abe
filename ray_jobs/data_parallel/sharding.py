"""Fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``) on a Ray Train worker.

Every rank holds 1/N of each parameter, of its gradient and of the optimizer state; a group's
weights are all-gathered while the group before it computes (and again in backward) and freed
after, and its gradients are reduce-scattered. The model is unchanged: ``fully_shard`` goes on each top-level
child and on the root. Checkpoints are sharded with ``torch.distributed.checkpoint`` (each rank
writes its own part; a resume at any worker count reshards them). The run's final weights are
written the same way, each rank its slices as safetensors, and consolidated by the driver
(``driver.export``); ``best_model.pt`` is gathered on world rank 0 only, on the CPU.

Runs in the worker; imports nothing that runs only on the driver.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from collections.abc import Callable
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ray_jobs.core.checkpoint import SHARDS_DIR, WEIGHTS_DIR, TrainState
from ray_jobs.core.evaluation import chunk_sums, my_chunks, num_chunks
from ray_jobs.core.model_init import SafetensorsInit, computed_buffers_kept, on_meta
from ray_jobs.core.pretrained import DTYPES
from ray_jobs.core.shard_plan import precision_dtypes, shard_units
from ray_jobs.data import storage
from ray_jobs.data_parallel.wrap import Replicas

FULL = StateDictOptions(full_state_dict=True)
# Gathered on world rank 0 only, and onto its CPU: no rank ever holds the whole model on its device.
FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _once(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with a tied tensor under its first name only: its two names are two DTensors over
    one local shard, which safetensors refuses to write twice."""
    seen, once = set(), {}
    for name, tensor in state.items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        where = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if where not in seen or local.numel() == 0:
            seen.add(where)
            once[name] = tensor
    return once


def read_slices(state: dict[str, torch.Tensor], initial: SafetensorsInit, directory: str) -> None:
    """Fill each tensor of ``state`` (a sharded model's: DTensors, and plain buffers) with its rows
    of the safetensors files in ``directory``. A shard of dim 0 is one byte range of the file, read
    straight into the shard's memory: no whole tensor, no copy of the slice, no mapped file pages
    (DCP's ``HuggingFaceStorageReader`` holds each slice once more, mapped, while it copies)."""
    files: dict[str, object] = {}
    try:
        for name, target in state.items():
            if name not in initial.names.files:  # a tied name: filled through the tensor's first
                continue
            info = initial.weights.tensors[initial.names.files[name]]
            if info.file not in files:
                files[info.file] = _open_weights(directory, info.file)
            local, first_row = _rows_held(target)
            _read_rows(files[info.file], info, first_row, local)
    finally:
        for handle in files.values():
            handle.close()


def _open_weights(directory: str, name: str):
    """A safetensors file every fsdp worker opens itself: a path only the driver's node has is one
    line saying so, not a bare ``FileNotFoundError`` from one rank."""
    try:
        return open(os.path.join(directory, name), "rb")  # closed by read_slices, with the others
    except FileNotFoundError:
        raise ValueError(
            f"{os.path.join(directory, name)} is not on node {socket.gethostname()}: under fsdp every worker reads "
            "the starting weights itself, so they must be on a filesystem every node shares, or in a bucket"
        ) from None


def _rows_held(target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor this rank holds of ``target`` and the row of the whole at which it starts."""
    if not isinstance(target, DTensor):
        return target, 0
    local_shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    if any(offset[1:]) or tuple(local_shape[1:]) != tuple(target.shape[1:]):
        raise ValueError(f"a shard of {tuple(target.shape)} that is not whole rows ({target.placements})")
    return target.to_local(), (offset[0] if offset else 0)


def _read_rows(handle, info, first_row: int, local: torch.Tensor) -> None:
    """``local.shape[0]`` rows of ``info``'s tensor from ``first_row``, into ``local``."""
    dtype = DTYPES[info.dtype]
    row_bytes = math.prod(info.shape[1:]) * dtype.itemsize
    count = local.numel() * dtype.itemsize
    handle.seek(info.offset + first_row * row_bytes)
    if dtype == local.dtype and local.is_contiguous() and local.device.type == "cpu":
        into = local.reshape(-1).view(torch.uint8).numpy()
    else:  # another dtype or a GPU: through one buffer of the slice
        into = bytearray(count)
    if count and handle.readinto(into) != count:
        raise ValueError(f"{info.file} ends inside a tensor's rows: the file changed since its header was read")
    if isinstance(into, bytearray) and count:
        local.copy_(torch.frombuffer(into, dtype=dtype).view(local.shape))


def prefetch_neighbours(root: nn.Module, units: list[nn.Module], device: torch.device) -> None:
    """Each group's forward starts the next group's all-gather, and its backward the previous
    group's, so the gather runs while this group computes (``units`` in forward order; a wrong
    order costs memory, never correctness). On CPU an all-gather overlaps only when issued
    asynchronously (gloo's own thread): CUDA's FSDP2 streams do it there, so CPU alone is told to."""
    if device.type == "cpu":
        root._set_unshard_async_op(True)  # FSDP2's documented switch; torch keeps it private for now
    for before, after in zip(units, units[1:]):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])


class Shards(Replicas):
    """How FSDP holds the model; the worker loop calls it as it calls ``Replicas``."""

    def __init__(
        self, reshard_after_forward: bool = True, sync_batchnorm: bool = False, shard_group_size: int | None = None
    ) -> None:
        super().__init__(lambda model, device, precision: model)
        self.reshard_after_forward, self.sync_batchnorm = reshard_after_forward, sync_batchnorm
        self.shard_group_size = shard_group_size
        self._writes_group: dist.ProcessGroup | None = None  # --checkpoint-mode async's own, made at first use

    def wrap(self, model: nn.Module, device: torch.device, precision: str) -> nn.Module:
        """``fully_shard`` each ``shard_units`` child, then the root, over one mesh of every rank
        (``mesh``); the last group is not resharded after forward, and each group prefetches its
        neighbour's all-gather (``prefetch_neighbours``). The returned module is ``model`` itself,
        its parameters now DTensor shards: build the optimizer after this."""
        if device.type == "cuda":
            # Each rank's collectives on its own GPU: an FSDP2 run that left the current device
            # at cuda:0 hung in a barrier under TorchTrainer (ray-project/ray#57860).
            torch.cuda.set_device(device)
        if self.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if not on_meta(model):  # built on meta, it is materialised once sharded (``wrap_from_slices``)
            model.to(device)
        options = {
            "mesh": self.mesh(device),
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(**precision_dtypes(precision)),
        }
        units = [model.get_submodule(name) for name in shard_units(model)]
        for index, unit in enumerate(units):
            # The last group's backward follows its forward at once: gathering it again would be waste.
            kept = index == len(units) - 1 or not self.reshard_after_forward
            fully_shard(unit, **{**options, "reshard_after_forward": not kept})
        wrapped = fully_shard(model, **options)
        prefetch_neighbours(wrapped, units, device)
        return wrapped

    def mesh(self, device: torch.device):
        """Every rank in one dimension (FSDP); with ``shard_group_size`` K below the world size N, a
        2-D mesh ``(replicate, shard)`` of N/K groups of K consecutive ranks (HSDP): ``fully_shard``
        shards over a group and replicates across groups. A checkpoint's DTensors reshard onto any
        other layout (DCP), so a resume may change N or K."""
        size = dist.get_world_size()
        group = self.shard_group_size or size
        if size % group:  # an elastic attempt the driver's check did not foresee
            raise ValueError(f"--shard-group-size {group} does not divide this attempt's {size} workers")
        if group == size:
            return init_device_mesh(device.type, (size,))
        return init_device_mesh(device.type, (size // group, group), mesh_dim_names=("replicate", "shard"))

    def wrap_from_slices(
        self, model: nn.Module, initial: SafetensorsInit, device: torch.device, precision: str
    ) -> nn.Module:
        """``model`` built with its parameters on meta (``params_on_meta``), sharded, then each rank's
        own slices read from the safetensors files: no rank ever holds more than its shard of the
        weights, as torchtitan loads (build on meta, ``fully_shard``, ``to_empty``, load)."""
        with computed_buffers_kept(model):
            wrapped = self.wrap(model, device, precision)
            model.to_empty(device=device)
        with storage.local_directory(initial.weights.directory) as path:
            read_slices(get_model_state_dict(model), initial, path)
        return wrapped

    def no_sync(self, wrapped: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
        """--grad-accum-steps: no reduce-scatter on the micro-steps before the last; each rank
        sums its unsharded gradients meanwhile (more memory than a sharded sum, one collective)."""

        @contextlib.contextmanager
        def unsynced():
            wrapped.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                wrapped.set_requires_gradient_sync(True)

        return unsynced

    def weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full ``state_dict``, gathered onto world rank 0's CPU (a collective: every rank
        calls it; the others get ``{}``)."""
        return get_model_state_dict(model, options=FULL_ON_RANK0)

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, final: bool) -> tuple[dict, dict]:
        """``checkpoint.pt`` holds no tensors: they are in the shards (``write_shards``)."""
        return {}, {}

    sharded = True

    def write_shards(
        self,
        directory: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        final: bool = False,
        in_background: bool = False,
    ) -> bool | Future:
        """Every rank writes its own shards of the weights and the optimizer state (keyed by
        parameter name) into ``directory/shards``; world rank 0 also the ``.metadata``. The run's
        last checkpoint also gets ``weights/``: each rank's slices of the weights (a tied tensor
        once) as safetensors, which the driver consolidates into ``model.safetensors``, ``hf/``
        and ``model.pt`` without any process gathering the whole model. Ray Train uploads every
        rank's directory into the one checkpoint directory."""
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        writer = dcp.FileSystemWriter(os.path.join(directory, SHARDS_DIR))
        if in_background and not final:
            # Staged to host memory here; written in a thread over a gloo group of its own, whose
            # collectives never interleave with the training's.
            return dcp.async_save(state, storage_writer=writer, process_group=self._background_group())
        dcp.save(state, storage_writer=writer)
        if final:
            dcp.save(
                _once(model_state),
                storage_writer=HuggingFaceStorageWriter(os.path.join(directory, WEIGHTS_DIR), save_distributed=True),
            )
        return True

    def _background_group(self) -> dist.ProcessGroup:
        """The background writes' own group (made once, by every rank at its first async save)."""
        if self._writes_group is None:
            self._writes_group = dist.new_group(backend="gloo")
        return self._writes_group

    def restore(self, directory, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState) -> None:
        """Sharded checkpoints are read resharded to this worker count; a full one (another
        strategy's, or from before) is loaded by every rank, which keeps its own part."""
        if not state.sharded:
            set_model_state_dict(model, state.model, options=FULL)
            set_optimizer_state_dict(model, optimizer, state.optimizer, options=FULL)
            return
        model_state, optimizer_state = get_state_dict(model, optimizer)
        loaded = {"model": model_state, "optimizer": optimizer_state}
        with storage.local_directory(storage.join(directory, SHARDS_DIR)) as path:
            dcp.load(loaded, storage_reader=dcp.FileSystemReader(path))
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])

    def chunk_sums(self, model: nn.Module, val, world_rank: int, world_size: int, device: torch.device) -> dict:
        """This rank's chunks, then as many more forwards (of chunk 0, discarded) as the rank with
        the most chunks makes: each forward all-gathers weights, a collective every rank must join."""
        mine = my_chunks(val, world_rank, world_size)
        sums = chunk_sums(model, val, mine, device)
        for _ in range(math.ceil(num_chunks(val) / world_size) - len(mine)):
            chunk_sums(model, val, [0], device)
        return sums
