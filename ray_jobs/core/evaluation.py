"""``--val-data``: the validation loss (and accuracy) after every epoch, the same for every strategy.

The set is cut into fixed chunks of ``chunk_rows`` rows whatever the worker count; each chunk's
loss sum (float64) is computed by one process, and the chunks' sums are added in chunk order. A
row's output therefore never depends on how many workers there are (a matmul's rounding can
depend on its batch size), and neither does the order of the additions: DDP with any worker
count, DataParallel and the pipeline's driver all get the same bits.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.lm import logits_of
from ray_jobs.data import storage
from ray_jobs.data.parquet import Dataset, read_dataset
from ray_jobs.data.stream import Footers, StreamDataset, decode_block, plan_stream

# Rows per validation forward: fixed (see above); large enough that a forward's overhead is small,
# small enough that activations of a wide model stay modest.
CHUNK_ROWS = 512
BEST_MODEL_FILE = "best_model.pt"


@dataclass
class Validation:
    """The loss and accuracy (classification; else None) over the whole set after one epoch; a
    language model's loss is the mean over every token, and its perplexity ``exp(loss)``."""

    loss: float
    accuracy: float | None
    task: str = "regression"

    @property
    def perplexity(self) -> float | None:
        return perplexity(self.loss) if self.task == "lm" else None


def perplexity(loss: float) -> float:
    """exp of the mean token loss; inf rather than an OverflowError for a diverged model."""
    return math.exp(loss) if loss < 700 else math.inf


def read_val_data(
    path: str,
    feature_column: str,
    target_column: str,
    train: Dataset | StreamDataset,
    stream: bool = False,
    footers: Footers | None = None,
) -> Dataset | StreamDataset:
    """The validation set read as the training set was (its task and classes): whole in memory, or
    with ``stream`` its metadata only, its rows read chunk by chunk as validation needs them. Its
    widths must be the training set's."""
    try:
        if stream:  # read by row group, never by shuffle window: no window size applies
            val = plan_stream(
                path, feature_column, target_column, train.task, train.num_classes, window_rows=2**62, footers=footers
            )
        else:
            val = read_dataset(path, feature_column, target_column, train.task, train.num_classes)
    except ValueError as error:
        raise _as_val_data_error(error, path) from None
    if val.in_features != train.in_features:
        raise ValueError(
            f"--val-data {path} has {val.in_features} features per row, the training data {train.in_features}"
        )
    if val.out_features != train.out_features:
        what = {"classification": "classes", "lm": "token ids in its vocabulary"}.get(
            train.task, "target values per row"
        )
        raise ValueError(f"--val-data {path} has {val.out_features} {what}, the training data {train.out_features}")
    return val


def _as_val_data_error(error: ValueError, path: str) -> ValueError:
    message = str(error)
    return ValueError(
        message.replace("--data", "--val-data", 1) if message.startswith("--data") else f"--val-data {path}: {message}"
    )


class _StreamRows:
    """A streamed set's rows by position, read row group by row group; the group read last is
    kept, so a rank's consecutive chunks read each of its row groups once."""

    def __init__(self, val: StreamDataset) -> None:
        self.val, self.starts = val, list(itertools.accumulate(val.block_rows, initial=0))
        self.kept: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def __call__(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        index = bisect.bisect_right(self.starts, start) - 1
        while start < end:
            features, targets = self._group(index)
            take = min(end, self.starts[index + 1]) - start
            offset = start - self.starts[index]
            xs.append(features[offset : offset + take])
            ys.append(targets[offset : offset + take])
            start, index = start + take, index + 1
        return torch.cat(xs), torch.cat(ys)

    def _group(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kept is None or self.kept[0] != index:
            val = self.val
            try:
                group = decode_block(
                    val.filesystem, val.blocks[index], val.feature_column, val.target_column, val.task, val.num_classes
                )
            except ValueError as error:
                raise _as_val_data_error(error, val.blocks[index].file) from None
            self.kept = (index, group.tensors())
        return self.kept[1]


def _row_reader(val: Dataset | StreamDataset) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(val, StreamDataset):
        return _StreamRows(val)
    features, targets = val.tensors()
    return lambda start, end: (features[start:end], targets[start:end])


def chunk_sums(
    model: nn.Module, val: Dataset | StreamDataset, chunks: range | list[int], device: torch.device
) -> dict[int, tuple[float, int]]:
    """``{chunk: (loss sum, correct rows)}`` for the given chunks of ``val`` (float64 loss sums)."""
    rows_of = _row_reader(val)
    loss_fn = _row_loss(val.task)
    rows = chunk_rows(val)
    was_training = model.training
    model.eval()  # dropout off, BatchNorm's running statistics: the model a user would deploy
    sums = {}
    with torch.no_grad():
        for chunk in chunks:
            x, y = (tensor.to(device) for tensor in rows_of(chunk * rows, min((chunk + 1) * rows, val.num_rows)))
            out = model(x)
            per_row = loss_fn(out, y)
            if per_row.dim() > 1:  # MSE: a row's loss is the mean over its target values
                per_row = per_row.mean(dim=1)
            correct = int((out.argmax(dim=1) == y).sum()) if val.task == "classification" else 0
            sums[chunk] = (float(per_row.double().sum()), correct)
    model.train(was_training)
    return sums


def _row_loss(task: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Each row's loss, unreduced over rows (MSE and a language model's: still per value or token)."""
    if task == "lm":
        return lambda out, y: F.cross_entropy(logits_of(out).transpose(1, 2), y, reduction="none")
    return nn.CrossEntropyLoss(reduction="none") if task == "classification" else nn.MSELoss(reduction="none")


def chunk_rows(val: Dataset | StreamDataset) -> int:
    """Rows per validation forward: ``CHUNK_ROWS``, or for a language model as many rows as keep one
    chunk's logits (rows x T x V floats) near 256 MiB."""
    if val.task != "lm":
        return CHUNK_ROWS
    return max(1, min(CHUNK_ROWS, 2**26 // (val.block_size * val.num_classes)))


def num_chunks(val: Dataset | StreamDataset) -> int:
    return math.ceil(val.num_rows / chunk_rows(val))


def my_chunks(val: Dataset | StreamDataset, world_rank: int, world_size: int) -> range:
    """This rank's chunks: a contiguous run (so a streamed set's row groups are read about once),
    the ranks' shares differing by one chunk at most."""
    total = num_chunks(val)
    return range(world_rank * total // world_size, (world_rank + 1) * total // world_size)


def combine(sums: dict[int, tuple[float, int]], val: Dataset | StreamDataset) -> Validation:
    """Every chunk's sums, added in chunk order, over the whole set's rows."""
    if sorted(sums) != list(range(num_chunks(val))):
        raise RuntimeError(f"validation has chunks {sorted(sums)} of {num_chunks(val)}")
    loss = math.fsum(sums[chunk][0] for chunk in range(num_chunks(val))) / val.num_rows
    correct = sum(sums[chunk][1] for chunk in sums)
    return Validation(loss, correct / val.num_rows if val.task == "classification" else None, val.task)


def validate(model: nn.Module, val: Dataset | StreamDataset, device: torch.device) -> Validation:
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
    ppl = f"  val perplexity {validation.perplexity:.3f}" if validation.perplexity is not None else ""
    return f"  val loss {validation.loss:.6f}{accuracy}{ppl}"
