"""Where the model is cut into stages, decided once on the driver: by parameter count, or by
each layer's measured time (``--stage-balance time``); every stage built on the meta device,
so only shapes and names exist until a stage actor builds its own slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models import split_into_stages, unit_names, unit_seconds
from ray_jobs.core.config import TrainConfig
from ray_jobs.core.model_init import make_model, probe_input
from ray_jobs.core.step import autocast


def meta_stages(
    cfg: TrainConfig, dataset, num_stages: int, model_factory=None, unit_costs: list[float] | None = None
) -> list[torch.nn.Module]:
    """The model cut into stages on the meta device: shapes and names, no memory. ``unit_costs``:
    what the cut balances (``StageCut``), parameter counts when None."""
    with torch.device("meta"):
        model = make_model(cfg, dataset, model_factory)
    return split_into_stages(model, num_stages, unit_costs)


def stage_keys(
    cfg: TrainConfig, dataset, num_stages: int, model_factory=None, unit_costs: list[float] | None = None
) -> list[set[str]]:
    """Each stage's ``state_dict`` keys: what of a full state each stage is sent."""
    return [set(stage.state_dict()) for stage in meta_stages(cfg, dataset, num_stages, model_factory, unit_costs)]


@dataclass
class StageCut:
    """How a run's model is cut, decided once on the driver: every attempt's stages cut alike."""

    keys: list[set[str]]
    """Each stage's ``state_dict`` keys: what of a full state each stage is sent."""
    children: list[list[str]]
    """Each stage's top-level children, by name."""
    num_units: list[int]
    """How many units (``models.unit_names``) each stage holds."""
    unit_costs: list[float] | None
    """What the cut balances, one per unit (``models.unit_names``); None: parameter counts."""


def cut_stages(
    cfg: TrainConfig, dataset, num_stages: int, model_factory=None, unit_costs: list[float] | None = None
) -> StageCut:
    stages = meta_stages(cfg, dataset, num_stages, model_factory, unit_costs)
    return StageCut(
        [set(stage.state_dict()) for stage in stages],
        [list(dict(stage.named_children())) for stage in stages],
        [len(unit_names(stage)) for stage in stages],
        unit_costs,
    )


def measured_unit_costs(
    cfg: TrainConfig,
    dataset,
    initial_state: dict[str, torch.Tensor],
    num_microbatches: int,
    num_threads: int,
    model_factory=None,
) -> list[float]:
    """Each unit's forward and backward seconds over one micro-batch, on the driver's CPU with a
    stage's thread count (``--stage-balance time``), with the run's initial weights: the tensors
    the driver already holds, not a second model (only gradients are made, and dropped). Buffers
    are copied: a training-mode forward updates BatchNorm's running statistics."""
    with torch.device("meta"):
        model = make_model(cfg, dataset, model_factory)
    buffers = {name for name, _ in model.named_buffers()}
    model.load_state_dict(
        {key: value.clone() if key in buffers else value for key, value in initial_state.items()}, assign=True
    )
    with torch.random.fork_rng(devices=[]):  # the driver's own draws stay as without the measurement
        sample = probe_input(dataset, cfg.batch_size // num_microbatches)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        with autocast(cfg.precision, torch.device("cpu")):
            return unit_seconds(model, sample)
    finally:
        torch.set_num_threads(threads)


def boundary_shapes(stages: list[torch.nn.Module], dataset) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Per-row shape and dtype of each stage's output, from one probe row through the meta stages."""
    shapes, x = [], probe_input(dataset, 1, device="meta")
    with torch.no_grad():
        for stage in stages[:-1]:
            x = stage(x)
            shapes.append((tuple(x.shape[1:]), x.dtype))
    return shapes
