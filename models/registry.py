"""The model registry: plain torch modules, built by name with widths taken from the data.

A name is a registered model (``mlp``) or a user's ``module.path:callable``, imported from the
working directory or the Python path and called as ``callable(in_features, out_features, **options)``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from models.gpt import gpt
from models.named import NamedSequential


def seed_linear(in_features: int, out_features: int) -> nn.Module:
    """The DataParallel tutorial model: one ``nn.Linear`` named ``fc``."""
    return NamedSequential(fc=nn.Linear(in_features, out_features))


def seed_mlp(in_features: int, out_features: int, hidden: int = 10) -> nn.Module:
    """The DDP tutorial model: ``net1`` Linear, ReLU, ``net2`` Linear."""
    return NamedSequential(net1=nn.Linear(in_features, hidden), relu=nn.ReLU(), net2=nn.Linear(hidden, out_features))


def seed_split(in_features: int, out_features: int, hidden: int = 5) -> nn.Module:
    """The two-GPU model-parallel tutorial model: ``net1`` Linear, LeakyReLU, ``net2`` Linear."""
    return NamedSequential(
        net1=nn.Linear(in_features, hidden), relu=nn.LeakyReLU(), net2=nn.Linear(hidden, out_features)
    )


def mlp(in_features: int, out_features: int, hidden: int = 64, depth: int = 4, dropout: float = 0.0) -> nn.Module:
    """``depth`` Linear layers (``fc0`` .. ``fc{depth-1}``) of width ``hidden`` with ReLU between them,
    each ReLU followed by ``Dropout(dropout)`` when it is above 0."""
    if depth < 1:
        raise ValueError(f"--depth must be at least 1, got {depth}")
    widths = [in_features] + [hidden] * (depth - 1) + [out_features]
    children: dict[str, nn.Module] = {}
    for index in range(depth):
        children[f"fc{index}"] = nn.Linear(widths[index], widths[index + 1])
        if index < depth - 1:
            children[f"relu{index}"] = nn.ReLU()
            if dropout:
                children[f"dropout{index}"] = nn.Dropout(dropout)
    return NamedSequential(**children)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "seed-linear": seed_linear,
    "seed-mlp": seed_mlp,
    "seed-split": seed_split,
    "mlp": mlp,
    "gpt": gpt,
}
# Options each model accepts; anything else is a user error, not silently ignored.
MODEL_OPTIONS: dict[str, tuple[str, ...]] = {
    "seed-linear": (),
    "seed-mlp": ("hidden",),
    "seed-split": ("hidden",),
    "mlp": ("hidden", "depth", "dropout"),
    "gpt": ("n_layer", "n_head", "n_embd", "block_size", "dropout"),
}


def is_user_model(name: str) -> bool:
    return ":" in name


def model_factory(name: str) -> Callable[..., nn.Module]:
    """The callable that builds model ``name``: a registered one, or a user's ``module.path:callable``
    imported from the working directory or the Python path. Raises ``ValueError`` saying what is wrong."""
    if not is_user_model(name):
        if name not in MODELS:
            raise ValueError(
                f"unknown model {name!r}; valid models: {', '.join(sorted(MODELS))}, "
                "or module.path:callable for your own"
            )
        return MODELS[name]
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ValueError(f"--model {name!r} must be module.path:callable (e.g. my_models:build)")
    # ``python -m`` puts the working directory on the path, a console script does not: the
    # user's module is looked for there either way (after the path, so it shadows nothing).
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name + ".").startswith(error.name + "."):
            raise ValueError(
                f"--model {name}: no module {module_name!r} in the working directory ({os.getcwd()}) or on PYTHONPATH"
            ) from None
        raise ValueError(f"--model {name}: importing {module_name} failed: {error}") from None
    except Exception as error:  # the user's module raised while importing
        raise ValueError(f"--model {name}: importing {module_name} raised {type(error).__name__}: {error}") from None
    factory = getattr(module, attribute, None)
    if factory is None or not callable(factory):
        what = "has no" if factory is None else "has a non-callable"
        raise ValueError(
            f"--model {name}: module {module_name} ({module.__file__}) {what} {attribute!r}; "
            "name a function or class taking (in_features, out_features, **options)"
        )
    return factory


def build_model(
    name: str, in_features: int, out_features: int, factory: Callable[..., nn.Module] | None = None, **options: Any
) -> nn.Module:
    """Build model ``name`` (``factory``, when given, is its already resolved callable). Options set
    to ``None`` take the model's default.

    Raises ``ValueError`` naming the valid choices for an unknown name, an option the model
    does not take, a non-positive width, or a user callable that fails or returns no ``nn.Module``.
    """
    if is_user_model(name):
        return _build_user_model(
            name,
            factory or model_factory(name),
            in_features,
            out_features,
            {key: value for key, value in options.items() if value is not None},
        )
    return _build_registered(name, in_features, out_features, **options)


def _build_user_model(
    name: str, factory: Callable[..., nn.Module], in_features: int, out_features: int, options: dict[str, Any]
) -> nn.Module:
    call = ", ".join([str(in_features), str(out_features), *(f"{k}={v!r}" for k, v in options.items())])
    try:
        model = factory(in_features, out_features, **options)
    except Exception as error:  # the user's code: its error, on one line, names the call
        first = str(error).splitlines()[0] if str(error) else ""
        raise ValueError(f"--model {name}: calling it as ({call}) raised {type(error).__name__}: {first}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {name}: ({call}) returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _build_registered(name: str, in_features: int, out_features: int, **options: Any) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(sorted(MODELS))}")
    given = {key: value for key, value in options.items() if value is not None}
    unknown = sorted(set(given) - set(MODEL_OPTIONS[name]))
    if unknown:
        valid = ", ".join(f"--{opt}" for opt in MODEL_OPTIONS[name]) or "none"
        flags = ", ".join(f"--{opt}" for opt in unknown)
        raise ValueError(f"model {name!r} does not take {flags}; its options: {valid}")
    dropout = given.pop("dropout", 0.0)
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"model {name!r}: dropout must be in [0, 1), got {dropout!r}")
    if dropout:
        given["dropout"] = float(dropout)
    for label, value in [
        ("in_features", in_features),
        ("out_features", out_features),
        *((k, v) for k, v in given.items() if k != "dropout"),
    ]:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"model {name!r}: {label} must be a positive integer, got {value!r}")
    return MODELS[name](in_features, out_features, **given)


# Layers whose output depends on more than their own input row and the weights: with them, data
# parallelism cannot reproduce single-process training (each worker draws its own dropout masks,
# each normalises over its own shard of the batch).
NOT_REPRODUCIBLE = {
    nn.modules.dropout._DropoutNd: "draws a random mask on each worker",
    nn.modules.batchnorm._BatchNorm: "normalises over each worker's shard of the batch, not the global batch",
}


def not_reproducible_layers(model: nn.Module) -> list[tuple[str, str, type]]:
    """``(layer name and type, why, kind)`` for each layer data-parallel training cannot reproduce
    exactly; ``kind`` is the ``NOT_REPRODUCIBLE`` class it is."""
    found = []
    for name, module in model.named_modules():
        for kind, why in NOT_REPRODUCIBLE.items():
            harmless = isinstance(module, nn.SyncBatchNorm) or getattr(module, "p", None) == 0  # p: dropout's
            if isinstance(module, kind) and not harmless:
                found.append((f"{name or 'the model'} ({type(module).__name__})", why, kind))
    return found
