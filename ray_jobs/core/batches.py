"""How a global batch is cut: consecutive global batches of an epoch's order, a worker's
contiguous slice of one (and its weight when the slices are uneven), a pipeline's micro-batches.
"""

from __future__ import annotations

import torch

from ray_jobs.core.config import TrainConfig
from ray_jobs.data.parquet import Dataset


def global_batches(order: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Consecutive global batches of ``order``; a last partial batch is dropped."""
    num_batches = len(order) // batch_size
    return [order[i * batch_size : (i + 1) * batch_size] for i in range(num_batches)]


def shard(batch: torch.Tensor, num_shards: int, index: int) -> torch.Tensor:
    """The ``index``-th of ``num_shards`` contiguous slices of a global batch: equal when the
    batch divides evenly, else the first ``len(batch) % num_shards`` slices hold one row more."""
    base, extra = divmod(len(batch), num_shards)
    start = index * base + min(index, extra)
    return batch[start : start + base + (index < extra)]


def shard_weight(batch_size: int, num_shards: int, index: int) -> float:
    """What slice ``index``'s mean loss is scaled by, so that all-reduce's mean over the
    ``num_shards`` slices is the mean over the whole global batch: its share of the rows times
    ``num_shards``. Exactly 1.0 when the batch divides evenly."""
    base, extra = divmod(batch_size, num_shards)
    rows = base + (index < extra)
    return 1.0 if extra == 0 else rows * num_shards / batch_size


def microbatches(batch: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """A global batch's rows cut into its ``num_microbatches`` pipeline micro-batches, in order."""
    return [shard(batch, num_microbatches, m) for m in range(num_microbatches)]


def check_batch_fits(cfg: TrainConfig, dataset: Dataset) -> None:
    if dataset.num_rows < cfg.batch_size:
        raise ValueError(
            f"the dataset has {dataset.num_rows} rows, fewer than one global batch (--batch-size {cfg.batch_size})"
        )
