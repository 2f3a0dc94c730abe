"""What a language model returns, read the same way wherever logits are needed (loss, evaluation, sampling)."""

from __future__ import annotations

import torch


def logits_of(output) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, the first element of a tuple, or the
    ``.logits`` of an output object (the Hugging Face convention)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"the model returned {type(output).__name__}; a language model must return logits (B, T, V): "
        "a tensor, a tuple whose first element is the logits, or an object with .logits"
    )
