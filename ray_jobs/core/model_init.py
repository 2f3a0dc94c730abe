"""The run's model and its starting weights: built from ``--model`` and the data's widths,
seeded, or loaded from ``--init-from``; and the one warning for layers a strategy cannot match.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

import torch
from torch import nn

from models import build_model, not_reproducible_layers
from ray_jobs.core.config import TrainConfig
from ray_jobs.data.parquet import Dataset


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
        warnings.warn(
            f"{strategy} trains this model but cannot match single-process weights: {'; '.join(found)}", stacklevel=2
        )


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
    from ray_jobs.data.storage import read_bytes

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
