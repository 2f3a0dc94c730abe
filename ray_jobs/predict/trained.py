"""A finished run's model, read as data: ``summary.json``'s model record, checked field by field,
and built only from code the user chose to run.

A run directory is data anyone may hand over (a shared bucket, a colleague's run), and the record
names a callable and its arguments: ``build_model(**record)`` on an unchecked record is a call of
whatever it names (``subprocess:call`` with a shell command as ``in_features``). So every field is
type-checked before anything is imported or called, and a user's ``module:callable`` is imported
only when the user names it again with ``--model`` or passes ``--trust-model-code`` (as Hugging
Face's ``trust_remote_code``); registered models are raypar's own code and always built.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models import MODELS, build_model, is_user_model
from ray_jobs.core.evaluation import BEST_MODEL_FILE
from ray_jobs.core.pretrained import is_pretrained
from ray_jobs.data import storage
from ray_jobs.driver.prepare import ship_model_code

WEIGHTS = {"final": "model.pt", "best": BEST_MODEL_FILE}
TASKS = ("classification", "regression")
# What JSON gives for an option a registered or user model takes (hidden=64, act="relu", bias=True).
SCALARS = (int, float, bool, str, type(None))


@dataclass
class TrainedModel:
    """What an actor needs to rebuild a run's model: the summary's record and the weights' file."""

    record: dict[str, Any]
    """``summary.json``'s ``model``, checked by ``check_record``: ``build_model(**record)``."""
    task: str
    weights: storage.Location
    factory: Callable[..., nn.Module]

    def load(self, device: torch.device) -> nn.Module:
        model = build_model(**self.record, factory=self.factory)
        state = torch.load(io.BytesIO(storage.read_bytes(self.weights)), map_location="cpu", weights_only=True)
        model.load_state_dict(state)
        return model.to(device).eval()


def load_run(run_dir: str, checkpoint: str, model: str | None = None, trust_model_code: bool = False) -> TrainedModel:
    """The model of a finished run (``model.pt``, or ``best_model.pt`` for ``best``), checked by
    building it; ``model`` and ``trust_model_code`` are the flags that allow a user's code."""
    summary = read_summary(run_dir)
    record = check_record(summary.get("model"), run_dir)
    task = run_task(summary, run_dir)
    weights = storage.join(run_dir, WEIGHTS[checkpoint])
    if not storage.exists(weights):
        hint = " (the run had no --val-data)" if checkpoint == "best" else ""
        raise ValueError(f"--run-dir {run_dir} has no {WEIGHTS[checkpoint]}{hint}")
    check_allowed(record["name"], run_dir, model, trust_model_code)
    trained = TrainedModel(record, task, storage.locate(weights), ship_model_code(record["name"]))
    try:
        trained.load(torch.device("cpu"))
    except RuntimeError as error:  # load_state_dict: the weights are not this model's
        raise ValueError(
            f"--run-dir {run_dir}: {WEIGHTS[checkpoint]} does not fit its summary's model: "
            f"{str(error).splitlines()[-1].strip()}"
        ) from None
    return trained


def read_summary(run_dir: str) -> dict[str, Any]:
    summary_path = storage.join(run_dir, "summary.json")
    if not storage.exists(summary_path):
        raise ValueError(
            f"--run-dir {run_dir} has no summary.json: not a finished raypar run (train it first, "
            "or name its <storage-path>/<name> directory)"
        )
    try:
        summary = json.loads(storage.read_bytes(summary_path))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--run-dir {run_dir} summary.json is not JSON ({error})") from None
    if not isinstance(summary, dict):
        raise ValueError(f"--run-dir {run_dir} summary.json is a JSON {type(summary).__name__}, not an object")
    return summary


def check_record(record: Any, run_dir: str) -> dict[str, Any]:
    """``record`` when every field has the type ``build_model`` expects; else one line naming the field."""
    where = f"--run-dir {run_dir} summary.json"
    if not isinstance(record, dict):
        raise ValueError(f"{where}: model must be an object, got {_kind(record)}")
    if not isinstance(record.get("name"), str):
        raise ValueError(f"{where}: model.name must be a string, got {_kind(record.get('name'))}")
    for width in ("in_features", "out_features"):
        value = record.get(width)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: model.{width} must be a positive integer, got {_kind(value)}")
    for key, value in record.items():
        if key == "factory":  # build_model's own argument: the callable, never the record's to give
            raise ValueError(f"{where}: model.factory is not a model option")
        if not isinstance(value, SCALARS):
            raise ValueError(f"{where}: model.{key} must be a number, string, boolean or null, got {_kind(value)}")
    return record


def _kind(value: Any) -> str:
    """A value for an error line: scalars as they are, containers by type only (their content is
    the run directory's, and may be long or hostile)."""
    return repr(value)[:60] if isinstance(value, SCALARS) else f"a JSON {type(value).__name__}"


def run_task(summary: dict[str, Any], run_dir: str) -> str:
    """The run's task; summaries before ``task`` was recorded have it in their config."""
    config = summary.get("config") if isinstance(summary.get("config"), dict) else {}
    task = summary.get("task") or ("classification" if config.get("task") == "classification" else "regression")
    if task == "lm":
        raise ValueError(
            f"--run-dir {run_dir} is a language model's run: predict maps feature rows to targets; sample text "
            f"from it with python -m ray_jobs.generate {run_dir} --prompt TEXT"
        )
    if task not in TASKS:
        raise ValueError(f"--run-dir {run_dir} summary.json: task must be one of {', '.join(TASKS)}, got {_kind(task)}")
    return task


def check_allowed(name: str, run_dir: str, model: str | None, trust_model_code: bool) -> None:
    """Refuse, before anything is imported, a model whose code the user has not chosen to run."""
    if model is not None and model != name:
        raise ValueError(f"--model {model} does not match the run's model {name} (--run-dir {run_dir} summary.json)")
    if is_pretrained(name):
        return  # transformers' own classes, built from a config: no code of the run's runs
    if not is_user_model(name):
        if name not in MODELS:
            raise ValueError(
                f"--run-dir {run_dir} summary.json: model.name {name!r} is not a registered model "
                f"({', '.join(sorted(MODELS))}) nor module.path:callable"
            )
        return
    if model is None and not trust_model_code:
        raise ValueError(
            f"--run-dir {run_dir} was trained with your own model code {name}, which predict imports and "
            f"runs only when asked: add --model {name} (or --trust-model-code to run whatever a run names)"
        )
