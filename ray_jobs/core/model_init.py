"""The run's model and its starting weights: built from ``--model`` and the data's widths,
seeded, or loaded from ``--init-from``; and the one warning for layers a strategy cannot match.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models import build_model, is_user_model, not_reproducible_layers
from models.lm import logits_of
from ray_jobs.core.config import TrainConfig
from ray_jobs.core.pretrained import (
    PREFIX,
    NameMap,
    Weights,
    is_pretrained,
    load_pretrained,
    match_names,
    params_on_meta,
    read_source,
    tied_names,
)
from ray_jobs.data.parquet import Dataset

# Layers the not-reproducible warning names per reason, the rest counted: the first few say where to look,
# while all of a 24-layer GPT-2's 72 dropouts in one line buried the reason.
SHOWN_LAYERS = 3


def model_options(cfg: TrainConfig, dataset) -> dict[str, Any]:
    """The model's options: the flags', and for the built-in gpt on token data a ``block_size``
    defaulting to the data's context length T."""
    options = cfg.model_options
    if cfg.model == "gpt" and dataset.block_size is not None and "block_size" not in options:
        options["block_size"] = dataset.block_size
    return options


def probe_input(dataset, rows: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """A batch of ``rows`` inputs of the data's shape, for measuring or shaping a model: token ids
    (zeros) for a language model, standard normal features otherwise (drawn from the global RNG:
    callers that must not disturb it fork it)."""
    if dataset.task == "lm":
        return torch.zeros(rows, dataset.block_size, dtype=torch.int64, device=device)
    return torch.randn(rows, dataset.in_features, device=device)


def make_model(cfg: TrainConfig, dataset, factory: Callable[..., nn.Module] | None = None) -> nn.Module:
    """The run's model, freshly initialised; ``factory``: a user model's callable as the driver
    resolved it (workers that cannot import the user's module get it by value)."""
    return build_model(
        cfg.model, dataset.in_features, dataset.out_features, factory=factory, **model_options(cfg, dataset)
    )


def warn_not_reproducible(cfg: TrainConfig, dataset, factory, strategy: str, synced: tuple[type, ...] = ()) -> None:
    """One warning naming the layers with which ``strategy`` trains, but cannot reproduce the
    single-process weights (``synced``: layer types the strategy makes exact, SyncBatchNorm's)."""
    model = probe_model(cfg, dataset, factory)
    by_reason: dict[str, list[str]] = {}
    for layer, why, kind in not_reproducible_layers(model):
        if not issubclass(kind, synced):
            by_reason.setdefault(why, []).append(layer)
    if by_reason:
        found = "; ".join(_layers_that(why, layers) for why, layers in by_reason.items())
        warnings.warn(f"{strategy} trains this model but cannot match single-process weights: {found}", stacklevel=2)


def meta_model(cfg: TrainConfig, dataset, factory: Callable[..., nn.Module] | None = None) -> nn.Module | None:
    """The run's model with its parameters on the meta device (``params_on_meta``): built in no time
    and no memory; None for a model that refuses it (a user's function that loads weights itself,
    ``from_pretrained``, refuses a meta device and meta parameters alike)."""
    try:
        with params_on_meta():
            return make_model(cfg, dataset, factory)
    except ValueError:
        return None


def probe_model(cfg: TrainConfig, dataset, factory: Callable[..., nn.Module] | None = None) -> nn.Module:
    """The run's model to look at, not to run: on meta (``meta_model``), else built for real."""
    model = meta_model(cfg, dataset, factory)
    return make_model(cfg, dataset, factory) if model is None else model


@contextlib.contextmanager
def computed_buffers_kept(module: nn.Module) -> Iterator[None]:
    """Within, ``module.to_empty`` may run: the buffers ``module`` computed when built (a rotary
    ``inv_freq``, in no checkpoint; real under ``params_on_meta``) get their values back after."""
    buffers = {name: buffer.clone() for name, buffer in module.named_buffers() if not buffer.is_meta}
    yield
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])


def materialize(module: nn.Module, device: torch.device) -> nn.Module:
    """``module``, its parameters built on meta (``params_on_meta``), given memory on ``device`` to load
    weights into: its computed buffers keep their values (``computed_buffers_kept``), and tensors it
    ties (an embedding and its head) stay one, which ``to_empty`` alone would make two."""
    tied = tied_names(module)
    with computed_buffers_kept(module):
        module.to_empty(device=device)
    for alias, first in tied.items():
        parent, _, attribute = alias.rpartition(".")
        owner, _, name = first.rpartition(".")
        setattr(module.get_submodule(parent), attribute, getattr(module.get_submodule(owner), name))
    return module


def on_meta(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are on the meta device (built by ``meta_model``)."""
    return any(param.device.type == "meta" for param in model.parameters())


def _layers_that(why: str, layers: list[str]) -> str:
    """``layers`` and ``why`` for the warning: one layer by name, several as their count and the first few."""
    if len(layers) == 1:
        return f"{layers[0]} {why}"
    shown = ", ".join(layers[:SHOWN_LAYERS]) + (", …" if len(layers) > SHOWN_LAYERS else "")
    return f"{len(layers)} layers ({shown}): each {why}"


@dataclass(frozen=True)
class SafetensorsInit:
    """Starting weights left in their safetensors files, for workers that each read only their own
    slices (fsdp): the files' headers, and the model's names for their tensors."""

    weights: Weights
    names: NameMap


def initial_model(cfg: TrainConfig, dataset: Dataset, factory: Callable[..., nn.Module] | None = None) -> nn.Module:
    """The run's starting weights: ``--init-from`` if given, else a ``hf:`` checkpoint's, else
    ``manual_seed(seed)`` then build."""
    torch.manual_seed(cfg.seed)
    model = make_model(cfg, dataset, factory)
    if dataset.task == "lm":
        check_language_model(cfg, model, dataset)
    if loads_by_slice(cfg):
        load_pretrained(model, *weights_source(cfg))
    elif cfg.init_from is not None:
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


def initial_slices(cfg: TrainConfig, dataset: Dataset, factory: Callable[..., nn.Module]) -> SafetensorsInit:
    """A ``hf:`` checkpoint's (or a safetensors ``--init-from``'s) weights, checked against the model by
    their headers alone, for workers to read by slice: nothing of the weights is read here."""
    directory, files, what = weights_source(cfg)
    weights = read_source(directory, files, what)
    return SafetensorsInit(weights, match_names(probe_model(cfg, dataset, factory), weights, what))


def weights_source(cfg: TrainConfig) -> tuple[str, list[str] | None, str]:
    """Where safetensors starting weights are (``loads_by_slice``): directory, files (None: all the
    directory's), and the flag that named them, for errors."""
    if cfg.init_from is not None:
        return *safetensors_source(cfg.init_from), f"--init-from {cfg.init_from}"
    return cfg.model[len(PREFIX) :], None, f"--model {cfg.model}"


def loads_by_slice(cfg: TrainConfig) -> bool:
    """Whether the starting weights sit in safetensors files a sharded strategy can read by slice."""
    if cfg.init_from is not None:
        return is_safetensors(cfg.init_from)
    return is_pretrained(cfg.model)


def is_safetensors(path: str) -> bool:
    """A safetensors file, or a directory (a checkpoint's, a run's ``hf/``) holding them."""
    from ray_jobs.data import storage

    return path.endswith(".safetensors") or bool(storage.list_dir(path))


def safetensors_source(path: str) -> tuple[str, list[str] | None]:
    """``--init-from``'s directory and files: one file, or a directory's (None: its index's or all)."""
    if path.endswith(".safetensors"):
        directory, _, name = path.rpartition("/")
        return directory or ".", [name]
    return path, None


def check_language_model(cfg: TrainConfig, model: nn.Module, dataset) -> None:
    """A language model must map token ids (B, T) to logits (B, T, V): tried on a 2-row batch of
    zeros before any worker starts, so a wrong model fails in a second with what came back."""
    if not is_user_model(cfg.model) and cfg.model != "gpt":
        raise ValueError(
            f"--model {cfg.model} takes float features; the data is token ids (--task lm): use --model gpt, "
            "or your own language model as module.path:callable"
        )
    batch, length, vocab = 2, dataset.block_size, dataset.num_classes
    tokens = torch.zeros(batch, length, dtype=torch.int64)
    state = torch.random.get_rng_state()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = logits_of(model(tokens))
    except Exception as error:  # the user's model: its error, on one line
        first = str(error).splitlines()[0] if str(error) else ""
        raise ValueError(
            f"--model {cfg.model} on a ({batch}, {length}) batch of token ids raised {type(error).__name__}: {first}"
        ) from None
    finally:
        model.train(was_training)
        torch.random.set_rng_state(state)  # the check draws nothing the run would see
    # A model's vocabulary may be padded past the tokenizer's ids (a pretrained one's, nanoGPT's 50304):
    # ids it never sees as input, logits the loss still normalises over, as one process would.
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (batch, length) or logits.shape[2] < vocab:
        raise ValueError(
            f"--model {cfg.model} returned logits of shape {tuple(logits.shape)} for a ({batch}, {length}) batch "
            f"of token ids; a language model must return (batch, tokens, vocabulary) = ({batch}, {length}, at least "
            f"{vocab})"
        )


def load_state_dict_file(path: str) -> dict[str, torch.Tensor]:
    from ray_jobs.data.storage import read_bytes

    try:
        state = torch.load(io.BytesIO(read_bytes(path)), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"--init-from {path}: no such file") from None
    except Exception as error:  # torch raises several types for a file that is not a checkpoint
        raise ValueError(f"--init-from {path}: not a torch state_dict ({type(error).__name__})") from None
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        if state.get("sharded") and not state["model"]:
            raise ValueError(
                f"--init-from {path}: an fsdp checkpoint keeps its weights in shards beside it; start from the "
                "run's model.pt, or from its last checkpoint, which holds the full weights"
            )
        state = state["model"]  # a raypar training checkpoint: take its model weights
    if not isinstance(state, dict):
        raise ValueError(f"--init-from {path}: expected a state_dict, got {type(state).__name__}")
    return state
