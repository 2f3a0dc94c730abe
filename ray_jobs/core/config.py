"""Typed, validated configuration shared by every strategy: ``TrainConfig``, built from its flag groups
(``config_data``, ``config_model``, ``config_training``, ``config_run``), and ``WorkerScaling``, the
data-parallel strategies' placement; ``flags`` turns them into ``--flags``.

Each field's ``help`` metadata is both its documentation and its ``--flag`` help text, so the
dataclasses are the single source of truth for names, defaults and meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models import MODELS, is_user_model
from ray_jobs.core.config_data import INGESTS, TASKS, DataFlags, IngestFlags
from ray_jobs.core.config_model import RESERVED_OPTIONS, ModelFlags, parse_model_options, parse_option_value
from ray_jobs.core.config_run import CHECKPOINT_MODES, CheckpointFlags, PlacementFlags
from ray_jobs.core.config_training import OPTIMIZERS, PRECISIONS, TrainingFlags
from ray_jobs.core.flags import (
    ADDRESS_HELP,
    FLAG_GROUPS,
    add_flags,
    flag_doc,
    flag_group,
    from_args,
    require,
    require_choice,
    require_divisible,
)
from ray_jobs.core.lr_schedule import LR_SCHEDULES
from ray_jobs.data.cli import ArgumentParser

# What callers have always imported from here, wherever it now lives.
__all__ = [
    "ADDRESS_HELP",
    "FLAG_GROUPS",
    "INGESTS",
    "OPTIMIZERS",
    "PLACEMENT_STRATEGIES",
    "PRECISIONS",
    "RESERVED_OPTIONS",
    "TASKS",
    "ArgumentParser",
    "TrainConfig",
    "WorkerScaling",
    "add_flags",
    "flag_doc",
    "flag_group",
    "from_args",
    "parse_model_options",
    "parse_option_value",
    "require",
    "require_accumulation_fits",
    "require_choice",
    "require_divisible",
    "require_gpu_for_fp16",
]

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")


# A dataclass takes its bases' fields from the last base to the first, so listed backwards they keep the
# order of --help, repr and summary.json: data, model, training, checkpoints, ingest, placement.
@dataclass
class TrainConfig(PlacementFlags, IngestFlags, CheckpointFlags, TrainingFlags, ModelFlags, DataFlags):
    """What to train and how: identical for every strategy, so results are comparable."""

    # One check over every group's fields, in the order it has always run: a config with several bad flags
    # names the same one first.
    def __post_init__(self) -> None:
        if self.model not in MODELS and not is_user_model(self.model):
            raise ValueError(
                f"--model {self.model!r} is unknown; valid models: {', '.join(sorted(MODELS))}, "
                "or module.path:callable for your own"
            )
        self.model_option = list(self.model_option or [])  # argparse leaves an unrepeated flag None
        self.model_options  # noqa: B018 -- parses --model-option, raising its ValueError now
        require_choice(self.optimizer, OPTIMIZERS, "optimizer")
        require_choice(self.task, TASKS, "task")
        require_choice(self.ingest, INGESTS, "ingest")
        require_choice(self.precision, PRECISIONS, "precision")
        require(self.peak_tflops is None or self.peak_tflops > 0, "peak_tflops", self.peak_tflops, "positive")
        for flag in ("shuffle_window_rows", "memory_ingest_limit_mb"):
            require(getattr(self, flag) > 0, flag, getattr(self, flag), "positive")
        require(self.checkpoint_every_steps >= 0, "checkpoint_every_steps", self.checkpoint_every_steps, "zero or more")
        require_choice(self.checkpoint_mode, CHECKPOINT_MODES, "checkpoint_mode")
        if self.ingest == "stream" and self.data is None:
            raise ValueError("--ingest stream needs --data (the synthetic default is generated in memory)")
        require(self.num_classes is None or self.num_classes >= 2, "num_classes", self.num_classes, "at least 2")
        require(self.vocab_size is None or self.vocab_size >= 2, "vocab_size", self.vocab_size, "at least 2")
        if self.vocab_size is not None and self.task not in ("auto", "lm"):
            raise ValueError(f"--vocab-size applies to --task lm, not --task {self.task}")
        if self.vocab_size is not None and self.num_classes is not None:
            raise ValueError("--vocab-size is a language model's class count: give it or --num-classes, not both")
        require(self.dropout is None or 0 <= self.dropout < 1, "dropout", self.dropout, "in [0, 1)")
        for flag in ("epochs", "batch_size", "checkpoint_every", "num_checkpoints_to_keep"):
            require(getattr(self, flag) >= 1, flag, getattr(self, flag), "at least 1")
        for flag in ("hidden", "depth"):
            value = getattr(self, flag)
            require(value is None or value >= 1, flag, value, "at least 1")
        require(self.lr > 0, "lr", self.lr, "positive")
        require_choice(self.lr_schedule, LR_SCHEDULES, "lr_schedule")
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "zero or more")
        require(0 <= self.min_lr <= self.lr, "min_lr", self.min_lr, f"between 0 and --lr {self.lr:g}")
        require(
            self.grad_clip_norm is None or self.grad_clip_norm > 0, "grad_clip_norm", self.grad_clip_norm, "positive"
        )
        for flag in ("momentum", "weight_decay", "max_failures", "resource_timeout"):
            require(getattr(self, flag) >= 0, flag, getattr(self, flag), "zero or more")
        if self.optimizer != "sgd" and self.momentum:
            raise ValueError("--momentum applies to --optimizer sgd only")


@dataclass
class WorkerScaling:
    """How Ray Train places the workers of a data-parallel run (DDP or DataParallel)."""

    num_workers: int = field(default=2, metadata=flag_doc("training worker processes (one per GPU on GPU clusters)"))
    use_gpu: bool = field(
        default=False, metadata=flag_doc("give each worker GPUs and use nccl", default_text="CPU, gloo")
    )
    cpus_per_worker: float = field(
        default=1.0, metadata=flag_doc("CPUs reserved per worker; also its torch thread count")
    )
    gpus_per_worker: float | None = field(
        default=None, metadata=flag_doc("GPUs per worker, fractional allowed", default_text="1 with --use-gpu")
    )
    placement_strategy: str = field(
        default="PACK", metadata=flag_doc("how workers spread over nodes", choices=PLACEMENT_STRATEGIES)
    )
    min_workers: int | None = field(
        default=None,
        metadata=flag_doc(
            "elastic run (DDP): after losing workers or nodes, resume on as many workers as the cluster can "
            "place, at least this many, and grow back to --num-workers when nodes return; the global batch "
            "and the trained weights stay the same",
            default_text="--num-workers: not elastic",
        ),
    )
    resize_interval: float | None = field(
        default=None,
        metadata=flag_doc(
            "elastic run: seconds between the looks a healthy run takes for room to grow back; growing "
            "restarts the workers from the newest checkpoint, so work since it is redone",
            default_text="Ray Train's 60",
        ),
    )
    sync_batchnorm: bool = field(
        default=False,
        metadata=flag_doc(
            "convert the model's BatchNorm layers to SyncBatchNorm, which normalises over the global batch "
            "(CUDA only, so it needs --use-gpu)",
            "model",
        ),
    )

    def __post_init__(self) -> None:
        if self.sync_batchnorm and not self.use_gpu:
            raise ValueError(
                "--sync-batchnorm needs --use-gpu: SyncBatchNorm runs on CUDA only; on CPU each "
                "worker's BatchNorm normalises over its own shard of the batch"
            )
        require(self.num_workers >= 1, "num_workers", self.num_workers, "at least 1")
        if self.min_workers is not None:
            require(
                1 <= self.min_workers <= self.num_workers,
                "min_workers",
                self.min_workers,
                f"between 1 and --num-workers {self.num_workers}",
            )
        if self.resize_interval is not None:
            require(self.resize_interval > 0, "resize_interval", self.resize_interval, "positive")
            if not self.elastic:
                raise ValueError("--resize-interval applies to an elastic run: give --min-workers below --num-workers")
        require(self.cpus_per_worker > 0, "cpus_per_worker", self.cpus_per_worker, "positive")
        if self.gpus_per_worker is not None:
            require(self.gpus_per_worker > 0, "gpus_per_worker", self.gpus_per_worker, "positive")
            if not self.use_gpu:
                raise ValueError("--gpus-per-worker needs --use-gpu")
        require_choice(self.placement_strategy, PLACEMENT_STRATEGIES, "placement_strategy")

    def check(self, cfg: TrainConfig) -> None:
        """Checks that need both configs, run before Ray is touched. A batch that does not divide
        evenly is fine: ``training.shard_weight`` keeps its gradient the global-batch mean."""
        if cfg.batch_size < self.num_workers:
            raise ValueError(
                f"--batch-size {cfg.batch_size} is smaller than --num-workers {self.num_workers}: "
                "every worker needs at least one row of each global batch"
            )
        if self.elastic and cfg.max_failures < 1:
            raise ValueError(
                f"--min-workers {self.min_workers} needs --max-failures of at least 1: resuming on "
                "fewer workers after a loss is one of the run's retries"
            )
        require_gpu_for_fp16(cfg, self.use_gpu, "--use-gpu")
        for count in range(self.min_workers if self.elastic else self.num_workers, self.num_workers + 1):
            require_accumulation_fits(cfg, count)

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.num_workers

    @property
    def resources_per_worker(self) -> dict[str, float]:
        resources = {"CPU": self.cpus_per_worker}
        if self.use_gpu:
            resources["GPU"] = self.gpus_per_worker if self.gpus_per_worker is not None else 1.0
        return resources


def require_accumulation_fits(cfg: TrainConfig, num_workers: int) -> None:
    """``--grad-accum-steps`` cuts each worker's slice of the global batch into equal chunks."""
    steps, share = cfg.grad_accum_steps, cfg.batch_size // num_workers
    if steps > 1 and (cfg.batch_size % num_workers or share % steps):
        raise ValueError(
            f"--grad-accum-steps {steps} does not divide the per-worker batch (--batch-size {cfg.batch_size} over "
            f"{num_workers} worker(s)): give a --batch-size that is a multiple of {num_workers * steps}"
        )


def require_gpu_for_fp16(cfg: TrainConfig, on_gpu: bool, flag: str) -> None:
    """float16's narrow range needs a gradient scaler, a GPU recipe; bfloat16 has float32's range
    and runs on CPUs too."""
    if cfg.precision == "fp16" and not on_gpu:
        raise ValueError(f"--precision fp16 needs GPUs ({flag}); on CPUs use --precision bf16")
