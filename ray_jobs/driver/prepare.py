"""Everything a run needs before Ray is asked for anything: a re-run's rules, the data (in
memory or as a stream's plan), the model and its initial weights, the run directory.

Checked here, in the user's process, so bad input costs a second and leaves nothing in the run
directory. ``PreparedRun`` is what every strategy is handed.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import torch
from torch import nn

from models import is_user_model, model_factory
from ray_jobs.core.batches import check_batch_fits
from ray_jobs.core.config import TrainConfig
from ray_jobs.core.evaluation import read_val_data
from ray_jobs.core.failure_record import FAILURE_FILE
from ray_jobs.core.lr_schedule import check_warmup
from ray_jobs.core.model_init import (
    SafetensorsInit,
    initial_model,
    initial_slices,
    loads_by_slice,
    meta_model,
)
from ray_jobs.core.pretrained import (
    WEIGHTS_FILE,
    is_pretrained,
    match_names,
    pretrained_factory,
    read_weights,
    safetensors_bytes,
    tied_names,
    untied,
)
from ray_jobs.data import storage
from ray_jobs.data.parquet import Dataset, read_dataset, synthesize, table_to_dataset
from ray_jobs.data.stream import Footers, StreamDataset, plan_stream, read_footers
from ray_jobs.driver.rerun import check_rerun, record_settings

# The default data when --data is not given: the DDP tutorial's shape (10 inputs, 5 outputs).
SYNTHETIC_ROWS, SYNTHETIC_IN, SYNTHETIC_OUT = 1024, 10, 5
MAX_RUN_NAME = 200
# An fsdp run's starting weights, written by the driver for the workers to read by slice.
INITIAL_WEIGHTS_DIR = "initial_weights"
RUN_NAME = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9._-]{{0,{MAX_RUN_NAME - 1}}}")


@dataclass
class PreparedRun:
    """A validated run, ready to hand to Ray."""

    cfg: TrainConfig
    strategy: str
    dataset: Dataset | StreamDataset
    initial_state: dict[str, torch.Tensor] | SafetensorsInit
    """The starting weights; for fsdp from safetensors, where to read each worker's slices."""
    name: str
    storage_path: str
    model_factory: Callable[..., nn.Module] | None = None
    """``--model``'s callable, resolved once here; workers and stages build the model with it."""
    val_dataset: Dataset | StreamDataset | None = None
    """``--val-data``: in memory, or a stream's metadata (``--ingest``)."""

    @property
    def run_dir(self) -> str:
        return storage.join(self.storage_path, self.name)


def load_data(cfg: TrainConfig) -> Dataset | StreamDataset:
    """The data, whole in memory or as a stream's metadata (``--ingest``); says which and why."""
    if cfg.data is None:
        table = synthesize(SYNTHETIC_ROWS, SYNTHETIC_IN, SYNTHETIC_OUT, "regression", cfg.seed)
        return table_to_dataset(table, task=cfg.task, num_classes=cfg.class_count)
    mode, why, footers = ingest_mode(cfg)
    print(f"[raypar] ingest: {mode} ({why})", flush=True)
    if mode == "stream":
        return plan_stream(
            cfg.data, cfg.feature_column, cfg.target_column, cfg.task, cfg.class_count, cfg.shuffle_window_rows, footers
        )
    return read_dataset(cfg.data, cfg.feature_column, cfg.target_column, cfg.task, cfg.class_count)


def load_val_data(cfg: TrainConfig, train: Dataset | StreamDataset) -> Dataset | StreamDataset:
    """``--val-data`` as ``--ingest`` decides for it (``auto``: by its own size); says which and why."""
    mode, why, footers = ingest_mode(cfg, cfg.val_data, "--val-data")
    print(f"[raypar] validation ingest: {mode} ({why})", flush=True)
    return read_val_data(
        cfg.val_data, cfg.feature_column, cfg.target_column, train, stream=mode == "stream", footers=footers
    )


def ingest_mode(cfg: TrainConfig, path: str | None = None, flag: str = "--data") -> tuple[str, str, Footers | None]:
    """Memory or stream, why, and the footers ``auto`` read to decide (for the stream's plan)."""
    if cfg.ingest != "auto":
        return cfg.ingest, f"--ingest {cfg.ingest}", None
    try:
        footers = read_footers(path or cfg.data)
    except ValueError as error:
        raise ValueError(str(error).replace("--data", flag, 1)) from None
    size, limit = footers.uncompressed_bytes, cfg.memory_ingest_limit_mb * 2**20
    relation = "at most" if size <= limit else "over"
    return (
        "memory" if size <= limit else "stream",
        f"the data is {size / 2**20:,.1f} MiB uncompressed, {relation} --memory-ingest-limit-mb "
        f"{cfg.memory_ingest_limit_mb:g}",
        footers,
    )


def prepare(cfg: TrainConfig, strategy: str, claim: Callable[[str, str], None] | None = None) -> PreparedRun:
    """Everything that can be checked without Ray: a re-run's settings, data, model, initial
    weights, storage. Raises ``AlreadyComplete`` for a finished run re-run with its settings.
    ``claim(run_dir, name)``: takes the run's lease (``lease.RunLease``), once every check passed
    and before anything is written into the run directory."""
    name = cfg.name or f"{strategy}-{datetime.now():%Y%m%d-%H%M%S}"
    check_run_name(name)
    storage_path = storage.absolute(cfg.storage_path)
    run_dir = storage.join(storage_path, name)
    storage.check_inside(run_dir, storage_path, "--name")
    check_rerun(cfg, name, run_dir)
    dataset = load_data(cfg)
    check_batch_fits(cfg, dataset)
    check_warmup(cfg, dataset.num_rows)
    val = None if cfg.val_data is None else load_val_data(cfg, dataset)
    factory = ship_model_code(cfg.model)
    initial = initial_weights(cfg, strategy, dataset, factory)
    if cfg.task == "auto":
        print(f"[raypar] task: {dataset.task} ({dataset.reason}; --task to choose)", flush=True)
    prepared = PreparedRun(cfg, strategy, dataset, initial, name, storage_path, factory, val)
    storage.check_writable(run_dir)
    if claim is not None:
        claim(run_dir, name)
    record_settings(cfg, strategy, run_dir)
    storage.delete_file(storage.join(run_dir, FAILURE_FILE))  # a past attempt's reason
    if strategy == "fsdp" and isinstance(initial, dict):
        prepared.initial_state = write_initial_weights(cfg, dataset, factory, initial, run_dir)
    return prepared


def write_initial_weights(
    cfg: TrainConfig, dataset, factory: Callable[..., nn.Module], state: dict[str, torch.Tensor], run_dir: str
) -> SafetensorsInit | dict[str, torch.Tensor]:
    """fsdp from a seeded init (or a ``.pt`` ``--init-from``): the weights written once, here, as
    ``initial_weights/model.safetensors``, for each worker to read its own slices of them, as it
    reads a pretrained checkpoint's; no worker builds or holds the whole model."""
    model = meta_model(cfg, dataset, factory)
    if model is None:  # a model that cannot be built on meta: each worker builds it, then loads it whole
        return state
    data = safetensors_bytes(untied(state, tied_names(model)))
    directory = storage.join(run_dir, INITIAL_WEIGHTS_DIR)
    storage.write(storage.join(directory, WEIGHTS_FILE), lambda stream: stream.write(data))
    weights = read_weights(directory, [WEIGHTS_FILE], f"{storage.without_query(str(directory))}")
    return SafetensorsInit(weights, match_names(model, weights, INITIAL_WEIGHTS_DIR))


def initial_weights(
    cfg: TrainConfig, strategy: str, dataset, factory: Callable[..., nn.Module]
) -> dict[str, torch.Tensor] | SafetensorsInit:
    """The starting ``state_dict``; for fsdp from safetensors (``hf:``, a safetensors ``--init-from``)
    only their headers, checked: each worker reads its own slices, and no process the whole model."""
    if strategy == "fsdp" and loads_by_slice(cfg):
        return initial_slices(cfg, dataset, factory)
    return initial_model(cfg, dataset, factory).state_dict()


def check_run_name(name: str) -> None:
    """A run name is one path component a user can type and a bucket can hold: the run directory
    it names must be inside ``--storage-path`` (``..`` or a separator would leave it), and a name
    that starts with ``-`` reads as a flag in every shell command that follows."""
    if not RUN_NAME.fullmatch(name):
        raise ValueError(
            f"--name {name!r} is not a run name: use letters, digits, '.', '_' and '-', starting with a "
            f"letter, digit or '_', at most {MAX_RUN_NAME} characters"
        )


def ship_model_code(name: str) -> Callable[..., nn.Module]:
    """``--model``'s callable. A user's module outside site-packages travels to the workers by value
    (cloudpickle), so they build the model even where they cannot import it: a cluster joined
    without ``--working-dir``, a test's temporary module. Workers that can import it do either way."""
    if is_pretrained(name):
        return pretrained_factory(name)
    factory = model_factory(name)
    if is_user_model(name):
        module = sys.modules[name.partition(":")[0]]
        # A built-in module has no __file__: it is importable everywhere, like an installed one.
        path = getattr(module, "__file__", None)
        installed = path is None or any(part in path for part in ("site-packages", "dist-packages"))
        if not installed:
            # imported here so that predict and generate, which load a run through this, start without Ray
            import ray.cloudpickle

            ray.cloudpickle.register_pickle_by_value(module)
    return factory
