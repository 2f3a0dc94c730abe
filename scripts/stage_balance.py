"""How well does cutting pipeline stages by parameter count balance their compute?

For each model below, times every pipeline unit's forward + backward on this machine's CPU
(``models.unit_seconds``: median of repeated runs, one micro-batch), then reports the busiest stage's time over the mean
stage time for the cut raypar makes (``split_into_stages``: balanced by parameter count) and for
the best cut by the measured times. ``python scripts/stage_balance.py [--stages 2 4] [--batch 64]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import build_model, split_into_stages, unit_names, unit_seconds  # noqa: E402


def conv_front(in_features: int, out_features: int, channels: int = 32, hidden: int = 128) -> nn.Sequential:
    """Few parameters, much compute: 1-D convolutions over the feature vector, then an MLP head."""
    return nn.Sequential(
        nn.Unflatten(1, (1, in_features)),
        nn.Conv1d(1, channels, 5, padding=2),
        nn.ReLU(),
        nn.Conv1d(channels, channels, 5, padding=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(channels * in_features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, out_features),
    )


MODELS = {
    "mlp 256x8 (built-in)": (lambda i, o: build_model("mlp", i, o, hidden=256, depth=8), 64, 8),
    "examples tower 128x4, gelu": (lambda i, o: _example(i, o), 64, 8),
    "conv front + MLP head": (conv_front, 128, 8),
}


def _example(in_features: int, out_features: int) -> nn.Module:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from my_model import tower

    return tower(in_features, out_features, hidden=128, depth=4, act="gelu")


def imbalance(model: nn.Sequential, num_stages: int, seconds: list[float], costs: list[float] | None) -> float:
    """Busiest stage over the mean stage, in measured time, for the cut that balances ``costs``."""
    sizes = [len(unit_names(stage)) for stage in split_into_stages(model, num_stages, costs)]
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    stages = [sum(seconds[a:b]) for a, b in zip(bounds, bounds[1:])]
    return max(stages) / statistics.mean(stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=64, help="micro-batch rows")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # as one stage's CPU
    print("| model | units | stages | busiest / mean stage, cut by parameters | cut by measured time |")
    print("|---|---|---|---|---|")
    for name, (factory, in_features, out_features) in MODELS.items():
        model = factory(in_features, out_features)
        seconds = unit_seconds(model, torch.randn(args.batch, in_features), args.repeats)
        for num_stages in args.stages:
            if num_stages <= len(seconds):
                print(
                    f"| {name} | {len(seconds)} | {num_stages} | {imbalance(model, num_stages, seconds, None):.2f}x "
                    f"| {imbalance(model, num_stages, seconds, seconds):.2f}x |"
                )


if __name__ == "__main__":
    main()
