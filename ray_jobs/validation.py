"""``--val-data``: the validation loss (and accuracy) after every epoch, the same for every strategy.

The set is cut into fixed chunks of ``CHUNK_ROWS`` rows whatever the worker count; each chunk's
loss sum (float64) is computed by one process, and the chunks' sums are added in chunk order. A
row's output therefore never depends on how many workers there are (a matmul's rounding can
depend on its batch size), and neither does the order of the additions: DDP with any worker
count, DataParallel and the pipeline's driver all get the same bits.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ray_jobs import storage
from ray_jobs.data import Dataset, read_dataset

# Rows per validation forward: fixed (see above); large enough that a forward's overhead is small,
# small enough that activations of a wide model stay modest.
CHUNK_ROWS = 512
BEST_MODEL_FILE = "best_model.pt"


@dataclass
class Validation:
    """The loss and accuracy (classification; else None) over the whole set after one epoch."""

    loss: float
    accuracy: float | None


def read_val_data(path: str, feature_column: str, target_column: str, train: Dataset) -> Dataset:
    """The validation set, in memory, read as the training set was (its task and classes); its widths
    must be the training set's."""
    try:
        val = read_dataset(path, feature_column, target_column, train.task, train.num_classes)
    except ValueError as error:
        message = str(error)
        raise ValueError(message.replace("--data", "--val-data", 1) if message.startswith("--data")
                         else f"--val-data {path}: {message}") from None
    if val.in_features != train.in_features:
        raise ValueError(f"--val-data {path} has {val.in_features} features per row, the training data "
                         f"{train.in_features}")
    if val.out_features != train.out_features:
        what = "classes" if train.task == "classification" else "target values per row"
        raise ValueError(f"--val-data {path} has {val.out_features} {what}, the training data {train.out_features}")
    return val


def chunk_sums(model: nn.Module, val: Dataset, chunks: range | list[int], device: torch.device
               ) -> dict[int, tuple[float, int]]:
    """``{chunk: (loss sum, correct rows)}`` for the given chunks of ``val`` (float64 loss sums)."""
    features, targets = val.tensors()
    loss_fn = nn.CrossEntropyLoss(reduction="none") if val.task == "classification" else nn.MSELoss(reduction="none")
    was_training = model.training
    model.eval()  # dropout off, BatchNorm's running statistics: the model a user would deploy
    sums = {}
    with torch.no_grad():
        for chunk in chunks:
            rows = slice(chunk * CHUNK_ROWS, (chunk + 1) * CHUNK_ROWS)
            x, y = features[rows].to(device), targets[rows].to(device)
            out = model(x)
            per_row = loss_fn(out, y)
            if per_row.dim() > 1:  # MSE: a row's loss is the mean over its target values
                per_row = per_row.mean(dim=1)
            correct = int((out.argmax(dim=1) == y).sum()) if val.task == "classification" else 0
            sums[chunk] = (float(per_row.double().sum()), correct)
    model.train(was_training)
    return sums


def num_chunks(val: Dataset) -> int:
    return math.ceil(val.num_rows / CHUNK_ROWS)


def my_chunks(val: Dataset, world_rank: int, world_size: int) -> range:
    """This rank's chunks: every ``world_size``-th, so the ranks' shares differ by one chunk at most."""
    return range(world_rank, num_chunks(val), world_size)


def combine(sums: dict[int, tuple[float, int]], val: Dataset) -> Validation:
    """Every chunk's sums, added in chunk order, over the whole set's rows."""
    if sorted(sums) != list(range(num_chunks(val))):
        raise RuntimeError(f"validation has chunks {sorted(sums)} of {num_chunks(val)}")
    loss = math.fsum(sums[chunk][0] for chunk in range(num_chunks(val))) / val.num_rows
    correct = sum(sums[chunk][1] for chunk in sums)
    return Validation(loss, correct / val.num_rows if val.task == "classification" else None)


def validate(model: nn.Module, val: Dataset, device: torch.device) -> Validation:
    """The whole set in one process (the pipeline's driver; the tests' single-process side)."""
    return combine(chunk_sums(model, val, range(num_chunks(val)), device), val)


def is_best(val_losses: list[float]) -> bool:
    """Whether the newest epoch has the lowest validation loss so far (the earliest wins a tie)."""
    return val_losses[-1] < min(val_losses[:-1], default=math.inf)


def best_epoch(val_losses: list[float]) -> int | None:
    """The 1-based epoch with the lowest validation loss (the earliest of equals), or None."""
    return min(range(len(val_losses)), key=lambda index: val_losses[index]) + 1 if val_losses else None


def write_best_model(run_dir: storage.Target, weights: Callable[[], dict[str, torch.Tensor]]) -> None:
    """``best_model.pt``: the full ``state_dict`` of the best epoch, as ``model.pt`` is of the last."""
    state = weights()
    storage.write(storage.join(run_dir, BEST_MODEL_FILE), lambda stream: torch.save(state, stream))


def progress(validation: Validation | None) -> str:
    """The epoch line's validation part."""
    if validation is None:
        return ""
    accuracy = f"  val accuracy {validation.accuracy:.4f}" if validation.accuracy is not None else ""
    return f"  val loss {validation.loss:.6f}{accuracy}"
