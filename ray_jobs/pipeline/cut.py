"""Where the model is cut into stages, decided once on the driver: by parameter count, or by
each layer's measured time (``--stage-balance time``); every stage built on the meta device,
so only shapes and names exist until a stage actor builds its own slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models import NamedSequential, split_into_stages, unit_names, unit_seconds
from models.split import balanced_cuts, check_num_stages
from ray_jobs.core.config import TrainConfig
from ray_jobs.core.model_init import make_model, probe_input
from ray_jobs.core.pretrained import params_on_meta
from ray_jobs.core.step import autocast
from ray_jobs.pipeline import hf_stages


def meta_stages(
    cfg: TrainConfig,
    dataset,
    num_stages: int,
    model_factory=None,
    unit_costs: list[float] | None = None,
    real_buffers: bool = False,
) -> list[torch.nn.Module]:
    """The model cut into stages on the meta device: shapes and names, no memory. ``unit_costs``:
    what the cut balances (``StageCut``), parameter counts when None. ``real_buffers``: the
    buffers a model computes as it is built (a rotary embedding's ``inv_freq``, in no checkpoint)
    keep their values, for a stage that will run; a meta forward (``boundary_shapes``) needs them
    on meta too."""
    with params_on_meta() if real_buffers else torch.device("meta"):
        model = make_model(cfg, dataset, model_factory)
    return split_model(model, num_stages, cfg.model, unit_costs)


def split_model(
    model: torch.nn.Module, num_stages: int, name: str, unit_costs: list[float] | None = None
) -> list[torch.nn.Module]:
    """An ``nn.Sequential`` cut between its children (``models.split_into_stages``); a Hugging Face
    GPT-2 or Llama between its embeddings, decoder layers and head (``hf_stages``); ``name``: the
    ``--model`` a refusal names."""
    if hf_stages.family_of(model) is not None:
        costs = unit_costs if unit_costs is not None else hf_stages.unit_sizes(model)
        check_num_stages(num_stages, len(costs), "a deeper checkpoint")
        return hf_stages.split_hf(model, balanced_cuts(costs, num_stages))
    if hf_stages.is_hugging_face(model):
        raise hf_stages.refuse(model, name)
    return split_into_stages(model, num_stages, unit_costs)


def stage_units(stage: torch.nn.Module) -> list[list[str]]:
    """The units a stage holds, each as the names of its parts."""
    if isinstance(stage, hf_stages.HFStage):
        return [[label] for label in stage.unit_labels]
    return unit_names(stage)


@dataclass(frozen=True)
class SharedWeight:
    """One weight several stages hold (a tied embedding and head cut apart): its gradients are
    summed over them before a step, as one tensor's would be."""

    names: dict[int, str]
    """Each holding stage's name for it, by stage index, in stage order."""


def shared_weights(stages: list[torch.nn.Module]) -> list[SharedWeight]:
    """Every weight several stages hold, found by identity, in one order every stage computes
    alike (by its first holder and that holder's name): a weight's place in it is the tag its
    holders exchange gradients under, so they must agree on it, whatever each calls it."""
    held: dict[int, dict[int, str]] = {}
    for index, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            held.setdefault(id(param), {})[index] = name
    shared = [SharedWeight(names) for names in held.values() if len(names) > 1]
    return sorted(shared, key=lambda weight: next(iter(weight.names.items())))


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
    """Each stage's top-level children (a Hugging Face model's units), by name."""
    num_units: list[int]
    """How many units (``models.unit_names``) each stage holds."""
    unit_costs: list[float] | None
    """What the cut balances, one per unit (``models.unit_names``); None: parameter counts."""
    shared: list[str]
    """The names of the weights several stages hold (``shared_weights``), each stage's name."""


def cut_stages(
    cfg: TrainConfig, dataset, num_stages: int, model_factory=None, unit_costs: list[float] | None = None
) -> StageCut:
    stages = meta_stages(cfg, dataset, num_stages, model_factory, unit_costs)
    return StageCut(
        [set(stage.state_dict()) for stage in stages],
        [[name for unit in stage_units(stage) for name in unit] for stage in stages],
        [len(stage_units(stage)) for stage in stages],
        unit_costs,
        shared_names(stages),
    )


def shared_names(stages: list[torch.nn.Module]) -> list[str]:
    return sorted(name for weight in shared_weights(stages) for name in weight.names.values())


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
    with params_on_meta():
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
            return unit_seconds(_by_unit(model), sample)
    finally:
        torch.set_num_threads(threads)


def _by_unit(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as a sequence of its units, each one child, for ``unit_seconds``."""
    if hf_stages.family_of(model) is None:
        return model
    stages = hf_stages.split_hf(model, list(range(len(hf_stages.unit_labels(model)))))
    return NamedSequential(**{f"unit_{index}": stage for index, stage in enumerate(stages)})


def boundary_shapes(stages: list[torch.nn.Module], dataset) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Per-row shape and dtype of each stage's output, from one probe row through the meta stages."""
    shapes, x = [], probe_input(dataset, 1, device="meta")
    with torch.no_grad():
        for stage in stages[:-1]:
            x = stage(x)
            shapes.append((tuple(x.shape[1:]), x.dtype))
    return shapes
