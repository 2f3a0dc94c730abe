"""raypar models: plain torch modules. Nothing here imports Ray or torch.distributed."""

from models.registry import (
    MODEL_OPTIONS,
    MODELS,
    NamedSequential,
    build_model,
    is_user_model,
    model_factory,
    not_reproducible_layers,
)
from models.split import split_into_stages, unit_names, unit_seconds

__all__ = [
    "MODELS",
    "MODEL_OPTIONS",
    "NamedSequential",
    "build_model",
    "is_user_model",
    "model_factory",
    "not_reproducible_layers",
    "split_into_stages",
    "unit_names",
    "unit_seconds",
]
