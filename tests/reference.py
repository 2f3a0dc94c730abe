"""Plain single-process PyTorch training: the reference every strategy must reproduce.

Written out by hand, without raypar's training helpers, so a bug shared by those helpers and
the strategies cannot hide in both sides of a comparison.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models import build_model


def reference_train(
    *,
    model: str,
    features: torch.Tensor,
    targets: torch.Tensor,
    out_features: int,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    shuffle: bool = True,
    optimizer: str = "sgd",
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    init_state: dict | None = None,
    epoch_orders=None,
    precision: str = "fp32",
    lr_schedule: str = "constant",
    warmup_steps: int = 0,
    min_lr: float = 0.0,
    grad_clip_norm: float | None = None,
    norms: list[float] | None = None,
    **model_options,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(seed)
    # A language model's rows are token ids (B, T) predicting the next ids (B, T): V in, V out.
    language_model = targets.dim() == 2 and targets.dtype == torch.int64
    net = build_model(model, out_features if language_model else features.shape[1], out_features, **model_options)
    if init_state is not None:
        net.load_state_dict(init_state)
    if optimizer == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    steps_per_epoch = len(features) // batch_size
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_at(s, epochs * steps_per_epoch, lr, lr_schedule, warmup_steps, min_lr) / lr
    )
    if language_model:

        def loss_fn(output, target):  # the mean over every token of the batch; a tuple's or .logits' first
            logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
            logits = output[0] if logits is None else logits
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    else:
        loss_fn = nn.CrossEntropyLoss() if targets.dtype == torch.int64 else nn.MSELoss()
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    n = len(features)
    losses = []
    for epoch in range(epochs):
        if epoch_orders is not None:  # a given order per epoch (the stream's contract v2)
            order = epoch_orders(epoch)
        elif shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        else:
            order = torch.arange(n)
        total, steps = 0.0, n // batch_size
        for step in range(steps):
            rows = order[step * batch_size : (step + 1) * batch_size]
            if autocast_dtype is not None:  # the forward and loss under autocast; weights and optimizer float32
                with torch.autocast("cpu", dtype=autocast_dtype):
                    loss = loss_fn(net(features[rows]), targets[rows])
            else:
                loss = loss_fn(net(features[rows]), targets[rows])
            opt.zero_grad()
            if scaler is None:
                loss.backward()
                if grad_clip_norm is not None:
                    _clip(net, grad_clip_norm, norms)
                opt.step()
            else:
                scaler.scale(loss).backward()
                if grad_clip_norm is not None:
                    scaler.unscale_(opt)
                    _clip(net, grad_clip_norm, norms)
                scaler.step(opt)
                scaler.update()
            scheduler.step()
            total += loss.item()
        losses.append(total / steps)
    return net.state_dict(), losses


def _clip(net: nn.Module, max_norm: float, norms: list[float] | None) -> None:
    """torch's own clip; ``norms`` (when given) gets each step's norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
    if norms is not None:
        norms.append(float(norm))


def lr_at(step: int, total: int, lr: float, schedule: str, warmup: int, min_lr: float) -> float:
    """nanoGPT's learning rate at optimizer step ``step`` of ``total``, written out again here."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))
    return lr - (lr - min_lr) * progress
