"""An example of your own model for raypar (see README.md here for the commands).

raypar calls ``tower(in_features, out_features, **options)`` with the widths of the data and the
options of each ``--model-option key=value``. An ``nn.Sequential`` trains with every strategy,
the pipeline included (it is cut between the top-level children; a child may be any module).
"""

from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


def block(width: int, act: str) -> nn.Module:
    """One hidden layer and its activation, kept together as one child (one pipeline unit)."""
    return nn.Sequential(nn.Linear(width, width), ACTIVATIONS[act]())


def tower(in_features: int, out_features: int, hidden: int = 32, depth: int = 2, act: str = "relu") -> nn.Module:
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {', '.join(ACTIVATIONS)}, got {act!r}")
    return nn.Sequential(
        nn.Linear(in_features, hidden),
        ACTIVATIONS[act](),
        *(block(hidden, act) for _ in range(depth)),
        nn.Linear(hidden, out_features),
    )
