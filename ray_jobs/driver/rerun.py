"""What re-running a run's name may change: a run's settings are fixed at its first attempt.

The settings that decide the weights are stored in ``run.json`` when a run starts, and a re-run
of its name with any of them changed is refused with every difference named, before anything in
the run directory changes: an optimizer state restored over new flags would train with the old
ones while the summary recorded the new. ``--epochs`` may change to any count not below the
epochs completed. Operational flags (retries, timeouts, checkpoint cadence, placement, worker or
stage counts, which the training contract makes equivalent, ``--address``) are free.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any

from ray_jobs.core.checkpoint import CHECKPOINT_FILE, checkpoint_name, latest_progress
from ray_jobs.core.config import TrainConfig
from ray_jobs.data import storage

RUN_FILE = "run.json"
# TrainConfig's fields by what a re-run may do with them (a test checks every field is here).
FIXED = (
    "data",
    "feature_column",
    "target_column",
    "task",
    "num_classes",
    "vocab_size",
    "val_data",
    "model",
    "model_option",
    "hidden",
    "depth",
    "dropout",
    "init_from",
    "batch_size",
    "lr",
    "lr_schedule",
    "warmup_steps",
    "min_lr",
    "grad_clip_norm",
    "grad_accum_steps",
    "optimizer",
    "momentum",
    "weight_decay",
    "seed",
    "shuffle",
    "precision",
    # val_data: the validation history and best_model.pt must come from one set;
    # the two ingest modes visit rows in different orders (contracts v1 and v2)
    "ingest",
    "memory_ingest_limit_mb",
    "shuffle_window_rows",
)
GROWABLE = ("epochs",)
OPERATIONAL = (
    "checkpoint_every",
    "checkpoint_every_steps",
    "checkpoint_mode",  # when the bytes reach storage, not which
    "num_checkpoints_to_keep",
    "storage_path",
    "name",
    "max_failures",
    "resource_timeout",
    "activation_checkpointing",  # recomputes the same activations: the same weights
    "peak_tflops",
    "count_comm_bytes",  # counts the calls, changes none
    "compile",  # the same computation, to float tolerance
)


class AlreadyComplete(Exception):
    """A re-run of a finished run with its own settings: there is nothing to do."""


def fixed_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings that decide the weights, paths made absolute so the working directory does not matter."""
    settings = {name: getattr(cfg, name) for name in FIXED}
    for name in ("data", "val_data", "init_from"):
        if settings[name] is not None:
            settings[name] = storage.absolute(settings[name])
    return settings


def check_rerun(cfg: TrainConfig, name: str, run_dir: str) -> int:
    """Refuse a re-run of ``name`` whose settings differ from its first attempt's; returns the
    epochs already completed (0 for a new run). Writes nothing."""
    progress = latest_progress(run_dir)
    if progress is None:
        return 0
    record = storage.join(run_dir, RUN_FILE)
    if storage.exists(record):
        stored, now = _stored_settings(record), fixed_settings(cfg)
        changed = [key for key in FIXED if stored.get(key) != now[key]]
        if changed:
            differences = ", ".join(
                f"--{key.replace('_', '-')} {_value(stored.get(key))} -> {_value(now[key])}" for key in changed
            )
            raise ValueError(
                f"run {name!r} was started with other settings: {differences}. Re-run it with "
                f"its own, or train on from its weights under a new name: --init-from "
                f"{_weights(run_dir, progress[0])} --name NEW_NAME"
            )
    else:
        print(
            f"[raypar] run {name!r} has checkpoints but no {RUN_FILE} (an older raypar wrote it): its "
            "settings cannot be compared with these flags",
            file=sys.stderr,
            flush=True,
        )
    completed = progress[0]
    if cfg.epochs < completed:
        raise ValueError(
            f"--epochs {cfg.epochs} is fewer than the {completed} epochs run {name!r} has completed; "
            f"its model after {completed} epochs is {_weights(run_dir, completed)}"
        )
    if cfg.epochs == completed and progress[1] == 0 and _finished(run_dir, completed):
        raise AlreadyComplete(
            f"run {name!r} is already complete ({completed} of {cfg.epochs} epochs): "
            f"{storage.without_query(storage.join(run_dir, 'summary.json'))}; "
            "raise --epochs to train it further"
        )
    return completed


def record_settings(cfg: TrainConfig, strategy: str, run_dir: str) -> None:
    """Store the run's settings (a new run's, or a checked re-run's, whose only change can be --epochs)."""
    record = {"settings": fixed_settings(cfg), "epochs": cfg.epochs, "strategy": strategy, "config": asdict(cfg)}
    storage.write_bytes(storage.join(run_dir, RUN_FILE), json.dumps(record, indent=2).encode())


def _stored_settings(record: str) -> dict[str, Any]:
    try:
        stored = json.loads(storage.read_bytes(record))
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        stored = None
    if not isinstance(stored, dict) or not isinstance(stored.get("settings"), dict):
        raise ValueError(
            f"{storage.without_query(record)} is not a raypar run record (no settings): restore it, or "
            "start the run under a new --name"
        )
    return stored["settings"]


def _finished(run_dir: str, completed: int) -> bool:
    """Whether the run's outputs are those of its newest checkpoint, ``completed`` epochs: outputs an
    earlier, shorter run left (its ``--epochs`` raised since, then stopped) are not, and the re-run
    writes them anew from that checkpoint."""
    summary = storage.join(run_dir, "summary.json")
    if not (storage.exists(summary) and storage.exists(storage.join(run_dir, "model.pt"))):
        return False
    try:
        written = json.loads(storage.read_bytes(summary)).get("epochs_completed")
    except (ValueError, AttributeError):  # unreadable, or not an object: not this run's outputs
        return False
    return written == completed


def _weights(run_dir: str, completed: int) -> str:
    model = storage.join(run_dir, "model.pt")
    if not storage.exists(model):
        model = storage.join(run_dir, checkpoint_name(completed), CHECKPOINT_FILE)
    return storage.without_query(model)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "(unset)" if value is None else str(value)
