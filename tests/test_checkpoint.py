"""The checkpoint format and how resume picks a checkpoint: no Ray."""
from __future__ import annotations

import os
import time

import torch

from ray_jobs.checkpoint import TrainState, latest_checkpoint, save_checkpoint


def state(epochs: int) -> TrainState:
    return TrainState({"fc.weight": torch.full((2, 2), float(epochs))}, {"state": {}, "param_groups": []}, epochs, [1.0] * epochs)


def write(run_dir, name: str, epochs: int) -> str:
    directory = run_dir / name
    directory.mkdir(parents=True)
    path = save_checkpoint(state(epochs), str(directory))
    stamp = time.time() + epochs  # make file times strictly ordered, whatever the clock resolution
    os.utime(path, (stamp, stamp))
    return path


def test_latest_complete_checkpoint_wins(tmp_path):
    assert latest_checkpoint(str(tmp_path / "absent")) is None
    write(tmp_path, "checkpoint_a", 1)
    write(tmp_path, "checkpoint_b", 2)
    newest = write(tmp_path, "checkpoint_c", 3)
    (tmp_path / "checkpoint_manager_snapshot.json").write_text("{}")  # Ray's registry: not a checkpoint
    assert latest_checkpoint(str(tmp_path)).epochs_completed == 3
    # A checkpoint cut short mid-upload is never trusted: resume falls back to the one before.
    with open(newest, "r+b") as file:
        file.truncate(os.path.getsize(newest) // 2)
    restored = latest_checkpoint(str(tmp_path))
    assert restored.epochs_completed == 2 and torch.equal(restored.model["fc.weight"], torch.full((2, 2), 2.0))


def test_partial_file_is_not_a_checkpoint(tmp_path):
    (tmp_path / "checkpoint_x").mkdir()
    (tmp_path / "checkpoint_x" / "checkpoint.pt.partial").write_bytes(b"half")
    assert latest_checkpoint(str(tmp_path)) is None
