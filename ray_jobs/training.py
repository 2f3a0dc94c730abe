"""The training contract every strategy keeps: batch order, loss, optimizer, initial weights, one step.

Nothing here knows how the batch is split; strategies only decide which rows of each global
batch a worker or stage sees, and how gradients are combined.
"""
from __future__ import annotations

import contextlib
import io
import math
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from models import build_model, not_reproducible_layers
from ray_jobs.config import TrainConfig
from ray_jobs.data import Dataset


def epoch_order(num_rows: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """Row order of one epoch: DistributedSampler's seeded permutation, or file order."""
    if not shuffle:
        return torch.arange(num_rows)
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))


def stream_windows(block_rows: Sequence[int], seed: int, epoch: int, shuffle: bool, window_rows: int) -> list[list[int]]:
    """Order contract v2 (``--ingest stream``): epoch ``epoch``'s shuffle windows, each a list of
    block indices (Parquet row groups, files in name order) in the window's order. Blocks are
    visited in ``randperm(num_blocks, seed + epoch)`` order (file order without shuffle), and a
    window closes as soon as it holds at least ``window_rows`` rows; the last may hold fewer."""
    if shuffle:
        visit = torch.randperm(len(block_rows), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        visit = list(range(len(block_rows)))
    windows, current, size = [], [], 0
    for block in visit:
        current.append(block)
        size += block_rows[block]
        if size >= window_rows:
            windows.append(current)
            current, size = [], 0
    return windows + [current] if current else windows


def window_permutation(num_rows: int, seed: int, epoch: int, window: int, shuffle: bool) -> torch.Tensor | None:
    """How window ``window`` of epoch ``epoch`` permutes its rows (listed in its block order);
    None without shuffle. The seed is apart from every epoch's block shuffle by 2**32 per window."""
    if not shuffle:
        return None
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch + (window + 1) * 2**32))


def stream_epoch_order(block_rows: Sequence[int], seed: int, epoch: int, shuffle: bool,
                       window_rows: int) -> torch.Tensor:
    """Order contract v2 as global row indices: the windows' permuted rows, concatenated. The
    stream never builds it (each window is permuted as it is read); the tests' reference does."""
    starts = [0]
    for rows in block_rows:
        starts.append(starts[-1] + rows)
    parts = []
    for index, window in enumerate(stream_windows(block_rows, seed, epoch, shuffle, window_rows)):
        rows = torch.cat([torch.arange(starts[block], starts[block + 1]) for block in window])
        permutation = window_permutation(len(rows), seed, epoch, index, shuffle)
        parts.append(rows if permutation is None else rows[permutation])
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def rank_seed(seed: int, rank: int, epoch: int = 0) -> int:
    """The seed of one worker's (or stage's) own RNG, which only what draws at random in the
    model (dropout) uses: distinct per rank, so ranks draw independent masks. A resume restores
    each rank's saved state; ``epoch`` reseeds only a resume onto another rank count."""
    return seed + (epoch << 24) + (rank << 48)


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


def loss_function(task: str) -> nn.Module:
    """Mean-reduced loss, so equal shards averaged by all-reduce give the global-batch mean."""
    return nn.CrossEntropyLoss() if task == "classification" else nn.MSELoss()


def build_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def check_batch_fits(cfg: TrainConfig, dataset: Dataset) -> None:
    if dataset.num_rows < cfg.batch_size:
        raise ValueError(
            f"the dataset has {dataset.num_rows} rows, fewer than one global batch (--batch-size {cfg.batch_size})"
        )


def make_model(cfg: TrainConfig, dataset, factory: Callable[..., nn.Module] | None = None) -> nn.Module:
    """The run's model, freshly initialised; ``factory``: a user model's callable as the driver
    resolved it (workers that cannot import the user's module get it by value)."""
    return build_model(cfg.model, dataset.in_features, dataset.out_features, factory=factory, **cfg.model_options)


def warn_not_reproducible(cfg: TrainConfig, dataset, factory, strategy: str, synced: tuple[type, ...] = ()) -> None:
    """One warning naming the layers with which ``strategy`` trains, but cannot reproduce the
    single-process weights (``synced``: layer types the strategy makes exact, SyncBatchNorm's)."""
    with torch.device("meta"):
        model = make_model(cfg, dataset, factory)
    found = [f"{layer} {why}" for layer, why, kind in not_reproducible_layers(model) if not issubclass(kind, synced)]
    if found:
        warnings.warn(f"{strategy} trains this model but cannot match single-process weights: "
                      f"{'; '.join(found)}", stacklevel=2)


def initial_model(cfg: TrainConfig, dataset: Dataset, factory: Callable[..., nn.Module] | None = None) -> nn.Module:
    """The run's starting weights: ``--init-from`` if given, else ``manual_seed(seed)`` then build."""
    torch.manual_seed(cfg.seed)
    model = make_model(cfg, dataset, factory)
    if cfg.init_from is not None:
        state = load_state_dict_file(cfg.init_from)
        try:
            model.load_state_dict(state)
        except RuntimeError as error:
            first = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
            raise ValueError(
                f"--init-from {cfg.init_from} does not match --model {cfg.model} with "
                f"{dataset.in_features} inputs and {dataset.out_features} outputs: {first}"
            ) from None
    return model


def load_state_dict_file(path: str) -> dict[str, torch.Tensor]:
    from ray_jobs.storage import read_bytes

    try:
        state = torch.load(io.BytesIO(read_bytes(path)), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"--init-from {path}: no such file") from None
    except Exception as error:  # torch raises several types for a file that is not a checkpoint
        raise ValueError(f"--init-from {path}: not a torch state_dict ({type(error).__name__})") from None
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]  # a raypar training checkpoint: take its model weights
    if not isinstance(state, dict):
        raise ValueError(f"--init-from {path}: expected a state_dict, got {type(state).__name__}")
    return state


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Where the forward and the loss run: in ``--precision``'s dtype under autocast, or as they
    are (fp32: no autocast at all, so fp32 runs are bit-identical to runs before the flag).
    Parameters stay float32, so their gradients and the optimizer state do too; DDP all-reduces
    those float32 gradients."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16's loss scaler (its small range would flush small gradients to zero); None otherwise.
    Its state (scale, growth tracker) belongs in the checkpoint."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module, x: torch.Tensor, y: torch.Tensor,
    weight: float = 1.0, *, precision: str = "fp32", scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """One optimizer step on one (shard of a) global batch; returns the detached loss, scaled by
    ``weight`` (``shard_weight``: an uneven slice's share of the global batch). With a ``scaler``
    (fp16), a step whose gradients overflowed is skipped and the scale lowered, as ``GradScaler``
    does: every DDP rank sees the same all-reduced gradients, so all skip together."""
    optimizer.zero_grad(set_to_none=True)
    with autocast(precision, x.device):
        loss = loss_fn(model(x), y)
    if weight != 1.0:  # skipped when even: the unscaled graph keeps results bit-identical to before
        loss = loss * weight
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return loss.detach()


def non_finite_loss(step_losses: list[float], epoch: int, first_step: int = 0) -> str | None:
    """The message for the first NaN/inf global-batch loss of an epoch (``step_losses`` start at
    global batch ``first_step``), or None."""
    for step, loss in enumerate(step_losses, start=first_step):
        if not math.isfinite(loss):
            return (
                f"loss became {loss} at epoch {epoch + 1}, step {step + 1}; lower --lr or check the data "
                "(the last good checkpoint is kept, model.pt is not written)"
            )
    return None
