"""Cut a sequential model into pipeline stages that, run in order, compute exactly ``model(x)``."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from models.named import NamedSequential


def _units(model: nn.Sequential) -> list[list[tuple[str, nn.Module]]]:
    """Group children so each unit starts at a module with parameters.

    Parameter-free modules (activations) stay with the layer before them, so no stage is
    an activation alone and the cut points are exactly the layer boundaries.
    """
    units: list[list[tuple[str, nn.Module]]] = []
    for name, child in model.named_children():
        has_params = any(True for _ in child.parameters())
        if has_params or not units:
            units.append([(name, child)])
        else:
            units[-1].append((name, child))
    return units


def _num_params(unit: list[tuple[str, nn.Module]]) -> int:
    return sum(p.numel() for _, child in unit for p in child.parameters())


def unit_names(model: nn.Sequential) -> list[list[str]]:
    """The children's names of each unit a stage boundary may fall between."""
    return [[name for name, _ in unit] for unit in _units(model)]


def unit_seconds(model: nn.Sequential, sample: torch.Tensor, repeats: int = 5) -> list[float]:
    """Median seconds of each unit's forward and backward over ``sample``, each unit fed the
    previous one's output, as its stage would be. For ``split_into_stages``'s ``unit_costs`` where
    compute is not in proportion to parameters (convolutions, wide activations)."""
    seconds, x = [], sample
    for unit in _units(model):
        module = nn.Sequential(*(child for _, child in unit))
        x = x.detach().requires_grad_(x.is_floating_point())
        samples = []
        for _ in range(repeats + 1):  # the first call allocates: not counted
            began = time.perf_counter()
            out = module(x)
            out.backward(torch.ones_like(out))
            samples.append(time.perf_counter() - began)
        module.zero_grad(set_to_none=True)
        seconds.append(statistics.median(samples[1:]))
        x = out
    return seconds


def balanced_cuts(weights: list[int], num_stages: int) -> list[int]:
    """Start index of each stage in a contiguous partition minimising the largest stage weight."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[s][i]: smallest possible max stage weight covering units[:i] with s stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], choice[s][i] = cost, j
    cuts, i = [], n
    for s in range(num_stages, 0, -1):
        i = choice[s][i]
        cuts.append(i)
    return cuts[::-1]


def check_num_stages(num_stages: int, num_units: int, deeper: str) -> None:
    """A cut into ``num_stages`` of a model of ``num_units`` units is possible; ``deeper``: what
    else the user could bring."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"--num-stages must be a positive integer, got {num_stages!r}")
    if num_stages > num_units:
        raise ValueError(
            f"--num-stages {num_stages} is more than the model's {num_units} layers; "
            f"use at most {num_units} stages or {deeper}"
        )


def split_into_stages(model: nn.Module, num_stages: int, unit_costs: list[float] | None = None) -> list[nn.Module]:
    """Split an ``nn.Sequential`` into ``num_stages`` sequential stages between its top-level
    children (each child may be any module, nested to any depth), balanced by parameter count, or
    by ``unit_costs`` (one per unit of ``unit_names``, e.g. ``unit_seconds``) when given.

    The stages share the model's modules and keep their child names, so the union of the
    stages' ``state_dict()`` is the model's ``state_dict()`` with no key rewriting.
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"the pipeline cuts a model between the children of an nn.Sequential; the model is a "
            f"{type(model).__name__}: return an nn.Sequential (its children may be any modules)"
        )
    units = _units(model)
    check_num_stages(num_stages, len(units), "a deeper model (--depth)")
    if unit_costs is not None and len(unit_costs) != len(units):
        raise ValueError(f"{len(unit_costs)} unit costs for a model of {len(units)} units")
    costs = unit_costs if unit_costs is not None else [_num_params(unit) for unit in units]
    starts = balanced_cuts(costs, num_stages) + [len(units)]
    return [
        NamedSequential(**{name: child for unit in units[starts[k] : starts[k + 1]] for name, child in unit})
        for k in range(num_stages)
    ]
