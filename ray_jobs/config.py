"""Typed, validated configuration shared by every strategy, and the CLI flags generated from it.

Each field's ``help`` metadata is both its documentation and its ``--flag`` help text, so the
dataclasses are the single source of truth for names, defaults and meaning.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from models import MODELS

OPTIMIZERS = ("sgd", "adamw")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")


def flag_doc(help_text: str, **extra: Any) -> dict[str, Any]:
    return {"help": help_text, **extra}


@dataclass
class TrainConfig:
    """What to train and how: identical for every strategy, so results are comparable."""

    model: str = field(default="seed-mlp", metadata=flag_doc("registry model name", choices=sorted(MODELS)))
    hidden: int | None = field(default=None, metadata=flag_doc("hidden width (seed-mlp, seed-split, mlp)"))
    depth: int | None = field(default=None, metadata=flag_doc("number of Linear layers (mlp)"))
    data: str | None = field(
        default=None,
        metadata=flag_doc("Parquet file or directory, local or a pyarrow.fs URI; default: synthetic data"),
    )
    feature_column: str = field(default="features", metadata=flag_doc("list<float> column of inputs"))
    target_column: str = field(
        default="target", metadata=flag_doc("list<float> column (regression) or integer column (classification)")
    )
    epochs: int = field(default=3, metadata=flag_doc("passes over the data"))
    batch_size: int = field(default=32, metadata=flag_doc("global batch size, split evenly across workers"))
    lr: float = field(default=0.05, metadata=flag_doc("learning rate"))
    optimizer: str = field(default="sgd", metadata=flag_doc("optimizer", choices=OPTIMIZERS))
    momentum: float = field(default=0.0, metadata=flag_doc("SGD momentum"))
    weight_decay: float = field(default=0.0, metadata=flag_doc("weight decay (sgd and adamw)"))
    seed: int = field(default=0, metadata=flag_doc("seeds initial weights and the epoch shuffles"))
    shuffle: bool = field(default=True, metadata=flag_doc("visit rows in file order instead of a seeded shuffle"))
    init_from: str | None = field(
        default=None, metadata=flag_doc("initial weights: a full state_dict (.pt) of the unsplit model")
    )
    checkpoint_every: int = field(default=1, metadata=flag_doc("checkpoint every N epochs (and always at the end)"))
    num_checkpoints_to_keep: int = field(default=2, metadata=flag_doc("checkpoints kept in the run directory"))
    storage_path: str = field(default="./runs", metadata=flag_doc("run storage: a local path or s3:// / gs:// URI"))
    name: str | None = field(
        default=None, metadata=flag_doc("run name; re-running a name resumes it (default: strategy + timestamp)")
    )
    max_failures: int = field(default=0, metadata=flag_doc("worker-group restarts allowed, each resuming from the latest checkpoint"))
    resource_timeout: float = field(
        default=300.0,
        metadata=flag_doc("seconds to wait for an autoscaling cluster to add the nodes a run needs "
                      "(a fixed-size cluster that lacks them fails at once)"),
    )

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"--model {self.model!r} is unknown; valid models: {', '.join(sorted(MODELS))}")
        require_choice(self.optimizer, OPTIMIZERS, "optimizer")
        for flag in ("epochs", "batch_size", "checkpoint_every", "num_checkpoints_to_keep"):
            require(getattr(self, flag) >= 1, flag, getattr(self, flag), "at least 1")
        for flag in ("hidden", "depth"):
            value = getattr(self, flag)
            require(value is None or value >= 1, flag, value, "at least 1")
        require(self.lr > 0, "lr", self.lr, "positive")
        for flag in ("momentum", "weight_decay", "max_failures", "resource_timeout"):
            require(getattr(self, flag) >= 0, flag, getattr(self, flag), "zero or more")
        if self.optimizer != "sgd" and self.momentum:
            raise ValueError("--momentum applies to --optimizer sgd only")

    @property
    def model_options(self) -> dict[str, int | None]:
        return {"hidden": self.hidden, "depth": self.depth}


@dataclass
class WorkerScaling:
    """How Ray Train places the workers of a data-parallel run (DDP or DataParallel)."""

    num_workers: int = field(default=2, metadata=flag_doc("training worker processes (one per GPU on GPU clusters)"))
    use_gpu: bool = field(default=False, metadata=flag_doc("give each worker GPUs and use nccl (default: CPU, gloo)"))
    cpus_per_worker: float = field(default=1.0, metadata=flag_doc("CPUs reserved per worker; also its torch thread count"))
    gpus_per_worker: float | None = field(
        default=None, metadata=flag_doc("GPUs per worker, fractional allowed (default 1 with --use-gpu)")
    )
    placement_strategy: str = field(
        default="PACK", metadata=flag_doc("how workers spread over nodes", choices=PLACEMENT_STRATEGIES)
    )

    def __post_init__(self) -> None:
        require(self.num_workers >= 1, "num_workers", self.num_workers, "at least 1")
        require(self.cpus_per_worker > 0, "cpus_per_worker", self.cpus_per_worker, "positive")
        if self.gpus_per_worker is not None:
            require(self.gpus_per_worker > 0, "gpus_per_worker", self.gpus_per_worker, "positive")
            if not self.use_gpu:
                raise ValueError("--gpus-per-worker needs --use-gpu")
        require_choice(self.placement_strategy, PLACEMENT_STRATEGIES, "placement_strategy")

    def check(self, cfg: TrainConfig) -> None:
        """Checks that need both configs, run before Ray is touched."""
        require_divisible(cfg.batch_size, self.num_workers, "--num-workers")

    @property
    def resources_per_worker(self) -> dict[str, float]:
        resources = {"CPU": self.cpus_per_worker}
        if self.use_gpu:
            resources["GPU"] = self.gpus_per_worker if self.gpus_per_worker is not None else 1.0
        return resources


def require(ok: bool, flag: str, value: Any, what: str) -> None:
    if not ok:
        raise ValueError(f"--{flag.replace('_', '-')} must be {what}, got {value}")


def require_choice(value: str, choices: tuple[str, ...] | list[str], flag: str) -> None:
    if value not in choices:
        raise ValueError(f"--{flag.replace('_', '-')} {value!r} is unknown; valid: {', '.join(choices)}")


def require_divisible(batch_size: int, parts: int, flag: str) -> None:
    """The global batch must split into equal parts, else the mean-loss gradient changes."""
    if batch_size % parts:
        raise ValueError(f"--batch-size {batch_size} is not divisible by {flag} {parts}")


Config = TypeVar("Config")


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line, without the usage block."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """Add one ``--flag`` per dataclass field; a bool defaulting to True becomes ``--no-flag``."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        meta = dict(f.metadata)
        if kind is bool:
            if f.default:
                group.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=meta["help"])
            else:
                group.add_argument(flag, dest=f.name, action="store_true", help=meta["help"])
            continue
        scalar = next(t for t in typing.get_args(kind) or (kind,) if t is not type(None))
        default = f.default if f.default is not dataclasses.MISSING else None
        # choices go into the help text: a bad value then fails in __post_init__ with one line.
        choices = meta.pop("choices", None)
        meta["help"] += f"; one of {', '.join(choices)}" if choices else ""
        meta["help"] += f" (default: {default})" if default is not None else ""
        group.add_argument(flag, dest=f.name, type=scalar, default=default, metavar=f.name.upper(), **meta)


def from_args(cls: type[Config], args: argparse.Namespace) -> Config:
    """Build (and so validate) a config dataclass from parsed flags."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(args).items() if k in names})
