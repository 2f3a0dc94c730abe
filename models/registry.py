"""The model registry: plain torch modules, built by name with widths taken from the data."""
from __future__ import annotations

from collections.abc import Callable

from torch import nn


class NamedSequential(nn.Sequential):
    """``nn.Sequential`` with named children, so state_dict keys read ``net1.weight`` not ``0.weight``."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def seed_linear(in_features: int, out_features: int) -> nn.Module:
    """The DataParallel tutorial model: one ``nn.Linear`` named ``fc``."""
    return NamedSequential(fc=nn.Linear(in_features, out_features))


def seed_mlp(in_features: int, out_features: int, hidden: int = 10) -> nn.Module:
    """The DDP tutorial model: ``net1`` Linear, ReLU, ``net2`` Linear."""
    return NamedSequential(
        net1=nn.Linear(in_features, hidden), relu=nn.ReLU(), net2=nn.Linear(hidden, out_features)
    )


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
}
# Options each model accepts; anything else is a user error, not silently ignored.
MODEL_OPTIONS: dict[str, tuple[str, ...]] = {
    "seed-linear": (),
    "seed-mlp": ("hidden",),
    "seed-split": ("hidden",),
    "mlp": ("hidden", "depth", "dropout"),
}


def build_model(name: str, in_features: int, out_features: int, **options: float | None) -> nn.Module:
    """Build a registered model. Options set to ``None`` take the model's default.

    Raises ``ValueError`` naming the valid choices for an unknown name, an option the model
    does not take, or a non-positive width.
    """
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
    for label, value in [("in_features", in_features), ("out_features", out_features),
                         *((k, v) for k, v in given.items() if k != "dropout")]:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"model {name!r}: {label} must be a positive integer, got {value!r}")
    return MODELS[name](in_features, out_features, **given)
