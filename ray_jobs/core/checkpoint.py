"""The one checkpoint format every strategy writes and reads.

A checkpoint is a directory ``checkpoint_epoch_NNNNNN`` holding ``checkpoint.pt``: the full,
unsplit model ``state_dict`` (loadable by ``build_model`` with no key rewriting), the optimizer
state keyed by parameter *name* (so it does not depend on how a strategy wrapped or split the
model), the number of completed epochs, the per-epoch losses so far, and every world rank's (or
stage's) RNG state. The newest checkpoint is the one with the most completed work, read from
its directory's name: never from file times, which object stores keep in whole seconds and
copies reset.
"""

from __future__ import annotations

import pickle
import re
import sys
import time
import zipfile
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from ray_jobs.core.step import rank_seed
from ray_jobs.data import storage

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_PREFIX = "checkpoint_"
SHARDS_DIR = "shards"  # an fsdp checkpoint's torch.distributed.checkpoint files: one per rank, and .metadata
SHARDS_METADATA = ".metadata"  # what DCP wrote last, on rank 0: every shard file's name and extent
# An fsdp run's last checkpoint: its weights as each rank's slices (safetensors), which the driver
# consolidates (driver.export); rank r's file begins "shard-{r + 1:05d}-".
WEIGHTS_DIR = "weights"
# Reading a checkpoint after a storage error: attempts, and the wait before the next (times the attempt).
READ_ATTEMPTS, READ_RETRY_S = 3, 1.0
_WARNED: set[str] = set()  # checkpoints already said to be skipped, by this process
_NAMED = re.compile(r"checkpoint_epoch_(\d+)(?:_step_(\d+))?$")


@dataclass
class TrainState:
    model: dict[str, torch.Tensor]
    optimizer: dict
    epochs_completed: int
    losses: list[float] = field(default_factory=list)
    rng: list[dict[str, Any]] = field(default_factory=list)
    """Per world rank (or pipeline stage): ``rng_state()`` when the checkpoint was taken."""
    step: int = 0
    """Global batches already done in epoch ``epochs_completed`` (0: the epoch has not begun)."""
    step_losses: list[float] = field(default_factory=list)
    """The global-batch losses of those ``step`` batches, for the epoch's mean loss."""
    world_sizes: list[dict[str, int]] = field(default_factory=list)
    """Each attempt whose work this state holds: ``num_workers`` and the ``epoch``/``step`` it began at."""
    scaler: dict[str, Any] | None = None
    """``--precision fp16``: the gradient scaler's ``state_dict`` (scale, growth tracker), the same
    on every rank and stage; a resume without it would restart from the initial scale."""
    val_losses: list[float] = field(default_factory=list)
    """``--val-data``: the validation loss after each completed epoch (empty without it)."""
    val_accuracy: list[float | None] = field(default_factory=list)
    """``--val-data``: the validation accuracy after each completed epoch (None for regression)."""
    sharded: bool = False
    """The weights and optimizer state are in the checkpoint's ``shards/`` (fsdp:
    ``torch.distributed.checkpoint``, each rank's part written by that rank); ``model`` then holds
    nothing, and ``optimizer`` nothing."""
    weights_sliced: bool = False
    """A run's last fsdp checkpoint: its weights are also in ``weights/``, each rank's slices as
    safetensors, for the driver to consolidate into the run's outputs (``driver.export``)."""

    @property
    def progress(self) -> tuple[int, int]:
        return self.epochs_completed, self.step


def checkpoint_name(epochs_completed: int, step: int = 0) -> str:
    return f"checkpoint_epoch_{epochs_completed:06d}" + (f"_step_{step:06d}" if step else "")


def _progress_of(name: str) -> tuple[int, int] | None:
    match = _NAMED.match(name)
    return (int(match[1]), int(match[2] or 0)) if match else None


def rng_state() -> dict[str, Any]:
    """This process's RNG state: the CPU generator's, and every visible GPU's where CUDA is used."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def saved_rng(state: TrainState, index: int, count: int) -> dict[str, Any] | None:
    """World rank (or stage) ``index``'s saved RNG state, if ``state`` was taken with ``count`` of them."""
    return state.rng[index] if len(state.rng) == count else None


def resume_rng(saved: dict[str, Any] | None, seed: int, rank: int, epochs_completed: int) -> None:
    """This rank's RNG as the checkpoint left it; one taken with another rank count has no state
    for it: a fresh, still deterministic stream then."""
    if saved is not None:
        set_rng_state(saved)
    else:
        torch.manual_seed(rank_seed(seed, rank, epochs_completed))


def restore_scaler(scaler: torch.amp.GradScaler | None, state: TrainState) -> None:
    """A resumed fp16 run continues from the saved loss scale, not the initial one (a checkpoint
    without one, from before --precision, leaves the scaler as built)."""
    if scaler is not None and state.scaler is not None:
        scaler.load_state_dict(state.scaler)


def write_checkpoint(directory: storage.Target, state: TrainState) -> None:
    """Serialise ``state`` once, straight into ``checkpoint.pt`` (under a temporary name first: a
    crash never leaves a partial file). No copy of the tensors is made on the way."""
    shallow = {f.name: getattr(state, f.name) for f in fields(state)}
    storage.write(storage.join(directory, CHECKPOINT_FILE), lambda stream: torch.save(shallow, stream))


def read_checkpoint(directory: storage.Target) -> TrainState:
    filesystem, path = storage.resolve(storage.join(directory, CHECKPOINT_FILE))
    with filesystem.open_input_file(path) as file:
        raw = torch.load(file, map_location="cpu", weights_only=True)
    if isinstance(raw.get("rng"), torch.Tensor):  # written before every rank's state was kept
        raw["rng"] = [{"cpu": raw["rng"], "cuda": None}]
    return TrainState(**raw)


def latest_checkpoint(run_dir: storage.Target) -> TrainState | None:
    """The newest usable checkpoint under ``run_dir`` (``usable_checkpoints``), loaded; None if none.

    Reads the files, not Ray's registry: Ray 2.60 can upload a checkpoint and never register it
    (a crash within ~2 s of reporting it, or an interrupt before its registry snapshot is
    written), yet such a checkpoint is complete and exact.
    """
    for _, entry in usable_checkpoints(run_dir):
        if isinstance(entry, TrainState):
            return entry
        state = _load(storage.join(run_dir, entry))
        if state is not None:
            return state
    return None


def latest_progress(run_dir: storage.Target) -> tuple[int, int] | None:
    """(epochs, step) of the newest usable checkpoint, without loading its tensors; None if none."""
    found = usable_checkpoints(run_dir)
    return found[0][0] if found else None


def usable_checkpoints(run_dir: storage.Target) -> list[tuple[tuple[int, int], str | TrainState]]:
    """Every checkpoint a resume may use, newest first, as (progress, directory name): the one
    function that decides, for resume, the re-run check, the stream's first window and pruning.

    A checkpoint cut short while it was written (a crash mid-upload; a full disk) is skipped with
    a one-line warning naming it, told by its zip archive's central directory, which
    ``torch.save`` writes last (read from the file's tail: no tensor is loaded). An fsdp checkpoint
    whose ``shards/`` lacks a rank's file, or holds one shorter than its ``.metadata`` says, is
    skipped too: each rank's upload is its own, so ``checkpoint.pt`` can be whole while another
    rank's shard never arrived (``_shards_lack``). A storage error
    is not a bad checkpoint: it is retried, then raised. Directories an older raypar named by
    Ray's timestamps say nothing of their progress: they are loaded, and given as the state.
    """
    names = [name for name in storage.list_dir(run_dir) if name.startswith(CHECKPOINT_PREFIX)]
    found: list[tuple[tuple[int, int], str | TrainState]] = []
    for name in names:
        directory = storage.join(run_dir, name)
        if not storage.exists(storage.join(directory, CHECKPOINT_FILE)):
            continue
        progress = _progress_of(name)
        if progress is None:
            state = _read_whole(directory)
            if state is not None:
                found.append((state.progress, state))
        elif _whole(directory):
            found.append((progress, name))
    return sorted(found, key=lambda item: item[0], reverse=True)


# A zip archive ends with this record at least: a shorter file is cut short (and seeking back over
# the record's size from its end is an error on pyarrow's files, not a BadZipFile).
ZIP_END_RECORD_BYTES = 22


def _whole(directory: storage.Target) -> bool:
    filesystem, path = storage.resolve(storage.join(directory, CHECKPOINT_FILE))

    def central_directory() -> bool:
        with filesystem.open_input_file(path) as file:
            if file.size() < ZIP_END_RECORD_BYTES:  # an empty file (a full disk at its creation)
                return False
            try:
                zipfile.ZipFile(file)
            except zipfile.BadZipFile:
                return False
            return True

    if not _retrying(central_directory, directory):
        _warn_once(directory, "its checkpoint.pt is incomplete (cut short while it was written)")
        return False
    lacking = _retrying(lambda: _shards_lack(directory), directory)
    if lacking:
        _warn_once(directory, lacking)
        return False
    return True


def _shards_lack(directory: storage.Target) -> str | None:
    """What an fsdp checkpoint's ``shards/`` lacks against its DCP ``.metadata`` (every shard
    file it names, and the bytes each must hold), read without loading a tensor; None when whole
    or when the checkpoint has no shards."""
    shards = storage.join(directory, SHARDS_DIR)
    present = storage.file_sizes(shards)
    if not present:
        return None
    if SHARDS_METADATA not in present:
        return f"its {SHARDS_DIR}/{SHARDS_METADATA} is missing"
    try:
        metadata = pickle.loads(storage.read_bytes(storage.join(shards, SHARDS_METADATA)))
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError):
        return f"its {SHARDS_DIR}/{SHARDS_METADATA} does not load (cut short while it was written)"
    missing = [f"{SHARDS_DIR}/{name}" for name in sorted(needed) if name not in present]
    missing += _slices_lack(directory, sorted(needed))
    if missing:
        return f"its {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing (a rank's shard never arrived)"
    short = [f"{SHARDS_DIR}/{n} ({present[n]} of {needed[n]} bytes)" for n in sorted(needed) if present[n] < needed[n]]
    if short:
        return f"its {', '.join(short)} {'is' if len(short) == 1 else 'are'} truncated"
    return None


def _slices_lack(directory: storage.Target, shard_files: list[str]) -> list[str]:
    """The rank slice files a last checkpoint's ``weights/`` lacks: one per rank that wrote shards
    (``__{rank}_0.distcp``), when it has ``weights/`` at all."""
    present = storage.list_dir(storage.join(directory, WEIGHTS_DIR))
    if not present:
        return []
    ranks = [int(match[1]) for match in map(re.compile(r"__(\d+)_\d+\.distcp$").match, shard_files) if match]
    return [
        f"{WEIGHTS_DIR}/shard-{rank + 1:05d}-*.safetensors"
        for rank in ranks
        if not any(name.startswith(f"shard-{rank + 1:05d}-") for name in present)
    ]


def _read_whole(directory: storage.Target) -> TrainState | None:
    """A checkpoint whose progress only its content tells: loaded, or None (with a warning) if cut short."""
    return _load(directory) if _whole(directory) else None


def _load(directory: storage.Target) -> TrainState | None:
    """The checkpoint, or None (with a warning) when its whole archive holds what does not load."""
    try:
        return _retrying(lambda: read_checkpoint(directory), directory)
    except OSError:
        raise
    except Exception as error:  # torch raises several types for content it cannot read
        _warn_once(directory, f"it does not load ({type(error).__name__})")
        return None


def _retrying(read, directory: storage.Target):
    """``read()``, again after a storage error (an object store's transient failure), up to
    ``READ_ATTEMPTS`` times; then the error, naming the checkpoint."""
    for attempt in range(READ_ATTEMPTS):
        try:
            return read()
        except OSError as error:
            if attempt == READ_ATTEMPTS - 1:
                raise OSError(f"{storage.without_query(str(directory))}: checkpoint unreadable: {error}") from None
            time.sleep(READ_RETRY_S * (attempt + 1))
    raise AssertionError("unreachable")


def _warn_once(directory: storage.Target, why: str) -> None:
    where = storage.without_query(str(directory))
    if where not in _WARNED:
        _WARNED.add(where)
        print(f"[raypar] warning: skipping checkpoint {where}: {why}", file=sys.stderr, flush=True)


def require_whole(state: TrainState) -> None:
    """A strategy that reads the full weights from ``checkpoint.pt`` cannot resume an fsdp
    checkpoint, whose weights and optimizer state lie in its shards."""
    if state.sharded:
        raise ValueError(
            f"the checkpoint after epoch {state.epochs_completed}, step {state.step} was written by fsdp, its "
            "weights and optimizer state in shards: resume this run with python -m ray_jobs.fsdp"
        )


def slice_state(state: TrainState, keys: set[str], index: int, num_parts: int) -> TrainState:
    """Part ``index`` of ``num_parts`` of a full state: the weights and optimizer state under
    ``keys``, and that part's RNG state when the state was taken with as many parts."""
    require_whole(state)
    params = [
        {**group, "params": [name for name in group["params"] if name in keys]}
        for group in state.optimizer.get("param_groups", [])
    ]
    optimizer = {
        "state": {k: v for k, v in state.optimizer.get("state", {}).items() if k in keys},
        "param_groups": params,
    }
    saved = saved_rng(state, index, num_parts)
    return TrainState(
        {k: v for k, v in state.model.items() if k in keys},
        optimizer,
        state.epochs_completed,
        state.losses,
        [saved] if saved is not None else [],
        state.step,
        state.step_losses,
        scaler=state.scaler,
    )


def prune_checkpoints(run_dir: storage.Target, num_to_keep: int) -> None:
    """Delete all but the ``num_to_keep`` newest usable checkpoints named by progress: a newer one
    cut short never counts among them (the run fell back past it), so the checkpoint just
    written is kept."""
    named = [name for _, name in usable_checkpoints(run_dir) if isinstance(name, str)]
    for name in named[num_to_keep:]:
        storage.delete_dir(storage.join(run_dir, name))


def merge_named_optimizer_states(parts: list[dict]) -> dict:
    """One optimizer state from the per-stage states of a split model (one param group each)."""
    merged_group = {**parts[0]["param_groups"][0], "params": []}
    for part in parts:
        merged_group["params"] += [name for group in part["param_groups"] for name in group["params"]]
    return {"state": {k: v for part in parts for k, v in part["state"].items()}, "param_groups": [merged_group]}


def named_optimizer_state(optimizer: torch.optim.Optimizer, named_params: dict[str, nn.Parameter]) -> dict:
    """``optimizer.state_dict()`` with per-parameter state keyed by parameter name, not position."""
    names = {id(param): name for name, param in named_params.items()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    raw = optimizer.state_dict()
    return {
        "state": {ordered[index]: value for index, value in raw["state"].items()},
        "param_groups": [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [ordered[i] for i in group["params"]]}
            for group in raw["param_groups"]
        ],
    }


def load_named_optimizer_state(
    optimizer: torch.optim.Optimizer, named_params: dict[str, nn.Parameter], named_state: dict
) -> None:
    """Inverse of ``named_optimizer_state`` for this optimizer's parameters (a stage's subset is fine)."""
    names = {id(param): name for name, param in named_params.items()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    position = {name: index for index, name in enumerate(ordered)}
    groups = []
    for group, saved in zip(optimizer.param_groups, named_state["param_groups"]):
        hyper = {k: v for k, v in saved.items() if k != "params"}
        groups.append({**hyper, "params": [position[names[id(p)]] for p in group["params"]]})
    state = {position[name]: value for name, value in named_state["state"].items() if name in position}
    optimizer.load_state_dict({"state": state, "param_groups": groups})
