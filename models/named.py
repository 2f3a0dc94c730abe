"""The one container every built-in model is: children by name, so the pipeline can cut between them."""

from __future__ import annotations

from torch import nn


class NamedSequential(nn.Sequential):
    """``nn.Sequential`` with named children, so state_dict keys read ``net1.weight`` not ``0.weight``."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)
