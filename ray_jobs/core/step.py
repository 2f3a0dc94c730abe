"""One optimizer step as every strategy takes it: the loss, the optimizer, the precision
(autocast, fp16's scaler), each rank's dropout seed, and the check for a non-finite loss.

Nothing here knows how the batch is split; strategies only decide which rows of each global
batch a worker or stage sees, and how gradients are combined.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.lm import logits_of
from ray_jobs.core.config import TrainConfig


def rank_seed(seed: int, rank: int, epoch: int = 0) -> int:
    """The seed of one worker's (or stage's) own RNG, which only what draws at random in the
    model (dropout) uses: distinct per rank, so ranks draw independent masks. A resume restores
    each rank's saved state; ``epoch`` reseeds only a resume onto another rank count."""
    return seed + (epoch << 24) + (rank << 48)


class TokenCrossEntropy(nn.Module):
    """A language model's loss: the mean cross-entropy over every (row, position) of the batch,
    ``F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))``. Every row holds T positions, so
    the mean over equal shards is the global batch's, as for the row losses."""

    def forward(self, output, target: torch.Tensor) -> torch.Tensor:
        logits = logits_of(output)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def loss_function(task: str) -> nn.Module:
    """Mean-reduced loss, so equal shards averaged by all-reduce give the global-batch mean."""
    if task == "lm":
        return TokenCrossEntropy()
    return nn.CrossEntropyLoss() if task == "classification" else nn.MSELoss()


def build_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``foreach``: one multi-tensor op per update term instead of a loop over the parameters, as
    torch already does on GPU. On CPU its weights are bit-identical to the loop's (AdamW and SGD,
    20 steps, measured), and the step takes 0.6x the time on FSDP's DTensor shards (the loop pays
    DTensor's dispatch per parameter per op; docs/performance.md)."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, foreach=True)


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


class StepResult(NamedTuple):
    loss: torch.Tensor
    """The detached loss of this (shard of a) global batch."""
    grad_norm: torch.Tensor | None
    """With ``clip_norm``: the whole model's gradient norm before clipping; else None."""


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    weight: float = 1.0,
    *,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    clip_norm: float | None = None,
    accum_steps: int = 1,
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> StepResult:
    """One optimizer step on one (shard of a) global batch; the loss is scaled by ``weight``
    (``shard_weight``: an uneven slice's share of the global batch). With a ``scaler`` (fp16), a
    step whose gradients overflowed is skipped and the scale lowered, as ``GradScaler`` does: every
    DDP rank sees the same all-reduced gradients, so all skip together. ``clip_norm``
    (``--grad-clip-norm``): ``clip_grad_norm_`` after backward, so over DDP's all-reduced
    gradients, the whole model's on every rank. ``accum_steps`` (``--grad-accum-steps``): the rows
    in that many equal consecutive chunks, one forward and backward each, their gradients summed
    (each chunk's mean loss divided by ``accum_steps``, so the sum is the whole shard's mean), with
    ``no_sync`` (DDP's) around every backward but the last: one all-reduce per optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    chunks = list(zip(torch.tensor_split(x, accum_steps), torch.tensor_split(y, accum_steps)))
    scale = weight / accum_steps
    total = torch.zeros((), device=x.device)
    for index, (xs, ys) in enumerate(chunks):
        with contextlib.nullcontext() if index == len(chunks) - 1 else no_sync():
            with autocast(precision, x.device):
                loss = loss_fn(model(xs), ys)
            if scale != 1.0:  # skipped when 1: the unscaled graph keeps results bit-identical to before
                loss = loss * scale
            (loss if scaler is None else scaler.scale(loss)).backward()
        total += loss.detach()
    norm = None
    if clip_norm is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)  # the norm of the true gradients, not the scaled ones
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm).detach()
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    return StepResult(total, norm)


def norm_readings(norms: list) -> dict[str, float] | None:
    """``--grad-clip-norm``: the largest and the last gradient norm before clipping, for the summary."""
    if not norms:
        return None
    values = [float(norm) for norm in norms]
    return {"max": max(values), "last": values[-1]}


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
