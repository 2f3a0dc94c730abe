"""The one checkpoint format every strategy writes and reads.

A checkpoint is a directory holding ``checkpoint.pt``: the full, unsplit model ``state_dict``
(loadable by ``build_model`` with no key rewriting), the optimizer state keyed by parameter
*name* (so it does not depend on how a strategy wrapped or split the model), the number of
completed epochs, the per-epoch losses so far, and torch's RNG state.
"""
from __future__ import annotations

import io
import os
from dataclasses import asdict, dataclass, field

import pyarrow.fs as pafs
import torch
from torch import nn

from ray_jobs import storage

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_PREFIX = "checkpoint_"


@dataclass
class TrainState:
    model: dict[str, torch.Tensor]
    optimizer: dict
    epochs_completed: int
    losses: list[float] = field(default_factory=list)
    rng: torch.Tensor = field(default_factory=torch.get_rng_state)


def to_bytes(state: TrainState) -> bytes:
    buffer = io.BytesIO()
    torch.save(asdict(state), buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> TrainState:
    return TrainState(**torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))


def save_checkpoint(state: TrainState, directory: str) -> str:
    """Write ``checkpoint.pt`` under a temporary name first: a crash never leaves a partial file."""
    path = os.path.join(directory, CHECKPOINT_FILE)
    with open(path + ".partial", "wb") as file:
        file.write(to_bytes(state))
    os.replace(path + ".partial", path)
    return path


def latest_checkpoint(run_dir: str) -> TrainState | None:
    """The newest checkpoint under ``run_dir`` that loads completely, or None.

    Reads the files, not Ray's registry: Ray 2.60 can upload a checkpoint and never register it
    (a crash within ~2 s of reporting it, or an interrupt before its registry snapshot is
    written), yet such a checkpoint is complete and exact. One cut short mid-upload fails to
    load and is skipped, so resume never trusts a half-written checkpoint.
    """
    filesystem, path = storage.resolve(run_dir)
    if filesystem.get_file_info(path).type != pafs.FileType.Directory:
        return None
    names = [info.base_name for info in filesystem.get_file_info(pafs.FileSelector(path))
             if info.type == pafs.FileType.Directory and info.base_name.startswith(CHECKPOINT_PREFIX)]
    files = filesystem.get_file_info([f"{path}/{name}/{CHECKPOINT_FILE}" for name in names])
    for info in sorted((f for f in files if f.type == pafs.FileType.File), key=lambda f: f.mtime, reverse=True):
        try:
            with filesystem.open_input_stream(info.path) as stream:
                return from_bytes(stream.read())
        except Exception:  # truncated or corrupt: torch raises several types
            continue
    return None


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
