"""How FSDP2 (``fully_shard``) groups a model and casts it: shared by fsdp's workers and the
pipeline's sharded stages. Reads the model only; imports no torch.distributed (``core``'s rule),
so each caller builds its own ``MixedPrecisionPolicy`` from ``precision_dtypes``."""

from __future__ import annotations

import torch
from torch import nn


def shard_units(model: nn.Module) -> list[str]:
    """The modules that get a ``fully_shard`` group of their own, by name. A Hugging Face model's
    are its decoder layers (the classes it lists in ``_no_split_modules``, as Accelerate wraps
    them): its top-level children are the base model and the head. Any other model's are its
    top-level children with parameters, none of which another child also holds. Parameters are
    compared by identity, not by name, so a tied embedding and output head (GPT-2's) however named
    stay together, in the root's group, which takes every parameter no group took."""
    layers = set(getattr(model, "_no_split_modules", None) or ())
    if layers:
        found = [name for name, module in model.named_modules() if type(module).__name__ in layers]
        if found:
            return found
    holders: dict[int, int] = {}
    for child in model.children():
        for param in set(child.parameters()):
            holders[id(param)] = holders.get(id(param), 0) + 1
    return [
        name
        for name, child in model.named_children()
        if next(child.parameters(), None) is not None and all(holders[id(p)] == 1 for p in child.parameters())
    ]


def precision_dtypes(precision: str) -> dict[str, torch.dtype]:
    """``MixedPrecisionPolicy``'s arguments for ``--precision``. bf16: weights all-gathered and
    computed in bf16, gradients reduced in fp32 (the sharded weights, their gradients and the
    optimizer state stay fp32), the output fp32 for the loss; the train step's autocast still
    runs the loss as on one process. fp32: no cast."""
    if precision == "bf16":
        return {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": torch.float32}
    return {}
