"""A finished run's outputs, the same for every strategy: ``model.pt`` (the unsplit
``state_dict``) and ``summary.json``, written by the driver into the run directory.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from ray_jobs.core.checkpoint import TrainState, latest_checkpoint, latest_progress
from ray_jobs.core.config import TrainConfig
from ray_jobs.core.evaluation import best_epoch, perplexity
from ray_jobs.core.lr_schedule import lr_schedule
from ray_jobs.core.model_init import model_options, probe_model
from ray_jobs.core.pretrained import (
    CONFIG_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    is_pretrained,
    safetensors_bytes,
    safetensors_files,
    tied_names,
    untied,
)
from ray_jobs.data import storage
from ray_jobs.data.parquet import TOKENIZER_FILE, Dataset
from ray_jobs.data.stream import StreamDataset
from ray_jobs.driver.export import write_sliced_weights
from ray_jobs.driver.prepare import PreparedRun
from ray_jobs.driver.summary import TrainSummary
from ray_jobs.observability.throughput import flops_per_token, lm_throughput, peak_tflops

HF_DIR = "hf"  # a hf: run's fine-tuned checkpoint, in the layout it came in


def model_record(cfg: TrainConfig, dataset: Dataset | StreamDataset) -> dict[str, Any]:
    """``summary.json``'s ``model``: the model (a registered name or ``module.path:callable``), the
    data's widths and the model's options, so ``models.build_model(**record)`` rebuilds ``model.pt``'s
    architecture from the summary alone."""
    return {
        "name": cfg.model,
        "in_features": dataset.in_features,
        "out_features": dataset.out_features,
        **model_options(cfg, dataset),
    }


def finish(
    prepared: PreparedRun,
    final: TrainState,
    metrics: dict[str, Any],
    world_size: int,
    extra_config: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> TrainSummary:
    """Write ``model.pt`` and ``summary.json`` into the run directory and return the summary."""
    cfg, dataset = prepared.cfg, prepared.dataset
    model = probe_model(cfg, dataset, prepared.model_factory)  # once: a user's from_pretrained builds for real
    exported = write_weights(prepared, final, model)
    summary = TrainSummary(
        strategy=prepared.strategy,
        world_size=world_size,
        epochs_completed=final.epochs_completed,
        losses=[float(loss) for loss in final.losses],
        samples_per_second=metrics.get("samples_per_second"),
        resumed_from_epoch=metrics.get("resumed_from_epoch"),
        model=model_record(cfg, dataset),
        config={**asdict(cfg), "name": prepared.name, **extra_config},
        run_dir=prepared.run_dir,
        worker_nodes=metrics.get("worker_nodes"),
        resumed_from_step=metrics.get("resumed_from_step"),
        ingest=dataset.ingest,
        bytes_read=metrics.get("bytes_read", dataset.file_bytes if dataset.ingest == "memory" else None),
        data_wait_fraction=metrics.get("data_wait_fraction"),
        precision=cfg.precision,
        lr=lr_schedule(cfg, dataset.num_rows).readings(),
        grad_norm=metrics.get("grad_norm"),
        task=dataset.task,
        block_size=dataset.block_size,
        **language_model_throughput(prepared, model, metrics, world_size),
        **validation_summary(prepared, final),
        extra={**(extra or {}), **exported},
    )
    if dataset.tokenizer is not None:  # what generate decodes with, beside the model it trained
        storage.write_bytes(storage.join(prepared.run_dir, TOKENIZER_FILE), dataset.tokenizer.encode())
    storage.write_bytes(storage.join(prepared.run_dir, "summary.json"), summary.to_json().encode())
    return summary


def write_weights(prepared: PreparedRun, final: TrainState, model: nn.Module) -> dict[str, Any]:
    """``model.pt``, ``model.safetensors`` and a ``hf:`` run's ``hf/``: from ``final``'s weights, or
    consolidated from the slices fsdp's ranks wrote (``driver.export``), whose size and peak
    memory it returns for the summary."""
    if not final.weights_sliced:
        storage.write(storage.join(prepared.run_dir, "model.pt"), lambda stream: torch.save(final.model, stream))
        write_safetensors(prepared, final.model, model)
        return {}
    cfg, factory = prepared.cfg, prepared.model_factory
    hf_files = (lambda dtype: hf_metadata(cfg, factory, dtype)) if is_pretrained(cfg.model) else None
    export = write_sliced_weights(prepared.run_dir, final, model, hf_files)
    return {"export_bytes": export.num_bytes, "export_peak_bytes": export.peak_bytes}


def write_safetensors(prepared: PreparedRun, state: dict[str, torch.Tensor], model: nn.Module) -> None:
    """``model.safetensors`` (the weights ``model.pt`` holds, a tied tensor once: ``model``, the run's
    ``probe_model``, says which are), and for a ``hf:`` model ``hf/``: its config, weights and
    tokenizer as ``from_pretrained`` reads them."""
    cfg = prepared.cfg
    weights = untied(state, tied_names(model))
    data = safetensors_bytes(weights)
    storage.write(storage.join(prepared.run_dir, WEIGHTS_FILE), lambda stream: stream.write(data))
    if is_pretrained(cfg.model):
        dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
        files = {**safetensors_files(weights), **hf_metadata(cfg, prepared.model_factory, dtype)}
        targets = [storage.join(prepared.run_dir, HF_DIR, name) for name in files]
        storage.write_many(targets, lambda streams: [out.write(data) for out, data in zip(streams, files.values())])


def hf_metadata(cfg: TrainConfig, factory, dtype: str) -> dict[str, bytes]:
    """A ``hf:`` run's ``config.json`` (the checkpoint's, with ``--model-option``s set, and the dtype
    the weights were trained and written in: a bf16 checkpoint comes back float32, and a loader
    that takes the config's word would cast it) and the checkpoint's tokenizer files."""
    config = {**factory.config, **cfg.model_options}
    config.update({key: dtype for key in ("dtype", "torch_dtype") if key in config})
    files = {CONFIG_FILE: json.dumps(config, indent=2).encode()}
    present = storage.list_dir(factory.directory)
    for name in TOKENIZER_FILES:
        if name in present:
            files[name] = storage.read_bytes(storage.join(factory.directory, name))
    return files


def language_model_throughput(
    prepared: PreparedRun, model: nn.Module, metrics: dict[str, Any], world_size: int
) -> dict[str, Any]:
    """lm: tokens/s (global and per worker), FLOPs per token (of ``model``, the run's ``probe_model``)
    and, on GPUs, MFU; else nothing."""
    cfg, dataset = prepared.cfg, prepared.dataset
    if dataset.task != "lm":
        return {}
    flops = flops_per_token(model, model_record(cfg, dataset), dataset.block_size)
    peak = (
        peak_tflops(metrics.get("device_name"), cfg.precision, cfg.peak_tflops) if metrics.get("device_name") else None
    )
    return {
        "flops_per_token": flops,
        **lm_throughput(metrics.get("samples_per_second"), dataset.block_size, world_size, flops, peak),
    }


def validation_summary(prepared: PreparedRun, final: TrainState) -> dict[str, Any]:
    if prepared.val_dataset is None:
        return {}
    classification = prepared.val_dataset.task == "classification"
    language_model = prepared.val_dataset.task == "lm"
    return {
        "val_losses": list(final.val_losses),
        "val_accuracy": list(final.val_accuracy) if classification else None,
        "val_perplexity": [perplexity(loss) for loss in final.val_losses] if language_model else None,
        "best_epoch": best_epoch(final.val_losses),
    }


def finish_trained(prepared: PreparedRun, extra_config: dict[str, Any], world_size: int) -> TrainSummary | None:
    """When the newest checkpoint already holds every epoch (the outputs beside it are an earlier,
    shorter run's: ``rerun`` did not call them complete), write its ``model.pt`` and
    ``summary.json`` without starting a worker or a stage; None when there is training left.
    ``world_size``: the strategy's, when the checkpoint does not record its attempts."""
    cfg = prepared.cfg
    if latest_progress(prepared.run_dir) != (cfg.epochs, 0):
        return None
    final = latest_checkpoint(prepared.run_dir)
    if final is None or final.progress != (cfg.epochs, 0):  # the newest was unreadable: train from what is
        return None
    print(
        f"[raypar] resuming from the checkpoint after epoch {cfg.epochs}: every epoch is trained; "
        "writing its model.pt and summary.json",
        flush=True,
    )
    if final.world_sizes:
        world_size = final.world_sizes[-1]["num_workers"]
    metrics = {"resumed_from_epoch": cfg.epochs, "resumed_from_step": 0}
    return finish(prepared, final, metrics, world_size, extra_config, {"world_sizes": final.world_sizes or None})
