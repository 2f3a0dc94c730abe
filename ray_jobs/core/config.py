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

from models import MODELS, is_user_model
from ray_jobs.core.lr_schedule import LR_SCHEDULES
from ray_jobs.data.cli import ArgumentParser as ArgumentParser  # where the entry points have always found it

OPTIMIZERS = ("sgd", "adamw")
TASKS = ("auto", "regression", "classification", "lm")
INGESTS = ("auto", "memory", "stream")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")
PRECISIONS = ("fp32", "bf16", "fp16")


# Every entry point's --address (the flag is not a dataclass field: resume ignores it).
ADDRESS_HELP = (
    "Ray cluster to join: host:port of its head, or auto for the one `ray start` runs on this machine "
    "(default: RAY_ADDRESS, else a new local Ray)"
)
# The --help sections, in this order; the README's flag reference uses the same ones.
FLAG_GROUPS = ("data", "model", "training", "pipeline", "placement", "checkpoints", "ingest")


def flag_doc(help_text: str, group: str | None = None, default_text: str | None = None, **extra: Any) -> dict[str, Any]:
    """A field's flag: its help, its --help section, and what a ``None`` default means."""
    return {"help": help_text, "group": group, "default_text": default_text, **extra}


@dataclass
class TrainConfig:
    """What to train and how: identical for every strategy, so results are comparable."""

    # data
    data: str | None = field(
        default=None,
        metadata=flag_doc(
            "Parquet file, or a directory of *.parquet files, local or a pyarrow.fs URI",
            "data",
            "synthetic: 1,024 rows, 10 -> 5",
        ),
    )
    feature_column: str = field(default="features", metadata=flag_doc("list<float> column of inputs", "data"))
    target_column: str = field(
        default="target",
        metadata=flag_doc("list<float> column (regression) or integer column (classification)", "data"),
    )
    task: str = field(
        default="auto",
        metadata=flag_doc(
            "auto: a list<int> tokens column is lm (next-token prediction), an integer target column "
            "classification, floats regression",
            "data",
            choices=TASKS,
        ),
    )
    num_classes: int | None = field(
        default=None,
        metadata=flag_doc(
            "classes K (labels 0..K-1)", "data", "the files' raypar.num_classes, else the largest label + 1"
        ),
    )
    vocab_size: int | None = field(
        default=None,
        metadata=flag_doc(
            "lm: the vocabulary size V (token ids 0..V-1)",
            "data",
            "the files' raypar.vocab_size, else the largest id + 1",
        ),
    )
    val_data: str | None = field(
        default=None,
        metadata=flag_doc(
            "validation Parquet (same columns; whole in memory or streamed chunk by chunk, as --ingest decides for "
            "it): its loss (and accuracy) after every epoch, and best_model.pt",
            "data",
            "none",
        ),
    )
    # model
    model: str = field(
        default="seed-mlp",
        metadata=flag_doc(
            f"a registered model ({', '.join(sorted(MODELS))}), or your own as module.path:callable, imported from "
            "the working directory or PYTHONPATH and called as callable(in_features, out_features, **options) to "
            "return an nn.Module",
            "model",
        ),
    )
    model_option: list[str] = field(
        default_factory=list,
        metadata=flag_doc(
            "KEY=VALUE passed to the model as an option (the value read as int, float, true/false, else a string); "
            "repeat for more",
            "model",
            "none",
            metavar="KEY=VALUE",
            action="append",
        ),
    )
    hidden: int | None = field(
        default=None,
        metadata=flag_doc(
            "hidden width (seed-mlp, seed-split, mlp); for any model, short for --model-option hidden=N",
            "model",
            "the model's: 10, 5, 64",
        ),
    )
    depth: int | None = field(default=None, metadata=flag_doc("number of Linear layers (mlp)", "model", "4"))
    dropout: float | None = field(
        default=None, metadata=flag_doc("dropout probability after each hidden layer (mlp)", "model", "0, none")
    )
    init_from: str | None = field(
        default=None,
        metadata=flag_doc(
            "initial weights: a full state_dict (.pt) of the unsplit model", "model", "built after manual_seed(--seed)"
        ),
    )
    # training
    epochs: int = field(default=3, metadata=flag_doc("passes over the data", "training"))
    batch_size: int = field(default=32, metadata=flag_doc("global batch size, split evenly across workers", "training"))
    lr: float = field(default=0.05, metadata=flag_doc("learning rate (the peak, with a schedule)", "training"))
    lr_schedule: str = field(
        default="constant",
        metadata=flag_doc(
            "the LR over the run's optimizer steps, after --warmup-steps: constant --lr, or cosine or linear "
            "decay from --lr to --min-lr (nanoGPT's formula; README: The training contract)",
            "training",
            choices=LR_SCHEDULES,
        ),
    )
    warmup_steps: int = field(
        default=0, metadata=flag_doc("optimizer steps of linear warmup to --lr: lr (s+1)/W at step s", "training")
    )
    min_lr: float = field(default=0.0, metadata=flag_doc("the LR that cosine and linear decay reach", "training"))
    grad_accum_steps: int = field(
        default=1,
        metadata=flag_doc(
            "each worker's share of a global batch in this many consecutive micro-steps, gradients summed: one "
            "optimizer step and one all-reduce per global batch, less activation memory (the pipeline "
            "accumulates over --num-microbatches instead)",
            "training",
        ),
    )
    grad_clip_norm: float | None = field(
        default=None,
        metadata=flag_doc(
            "clip the whole model's gradient norm (over every worker and stage) to this before each optimizer "
            "step, as clip_grad_norm_ does on one process",
            "training",
            "no clip",
        ),
    )
    optimizer: str = field(default="sgd", metadata=flag_doc("optimizer", "training", choices=OPTIMIZERS))
    momentum: float = field(default=0.0, metadata=flag_doc("SGD momentum", "training"))
    weight_decay: float = field(default=0.0, metadata=flag_doc("weight decay (sgd and adamw)", "training"))
    seed: int = field(default=0, metadata=flag_doc("seeds initial weights and the epoch shuffles", "training"))
    shuffle: bool = field(
        default=True, metadata=flag_doc("visit rows in file order instead of a seeded shuffle", "training", "shuffled")
    )
    precision: str = field(
        default="fp32",
        metadata=flag_doc(
            "autocast dtype of the forward and loss; weights, gradients and optimizer state stay float32 "
            "(fp16: GPUs only, with a gradient scaler)",
            "training",
            choices=PRECISIONS,
        ),
    )
    activation_checkpointing: bool = field(
        default=False,
        metadata=flag_doc(
            "recompute each top-level block's forward in backward instead of keeping its activations "
            "(torch.utils.checkpoint, non-reentrant, dropout's RNG kept): less activation memory, one more forward "
            "per block, the same weights (ddp, dp, fsdp, and each pipeline stage)",
            "training",
        ),
    )
    peak_tflops: float | None = field(
        default=None,
        metadata=flag_doc(
            "one GPU's peak TFLOPS at --precision, for a language model's MFU in the summary",
            "training",
            "the known GPUs' data-sheet figures; none on CPU",
        ),
    )
    # checkpoints
    checkpoint_every: int = field(
        default=1, metadata=flag_doc("checkpoint every N epochs (and always at the end)", "checkpoints")
    )
    num_checkpoints_to_keep: int = field(
        default=2, metadata=flag_doc("checkpoints kept in the run directory", "checkpoints")
    )
    storage_path: str = field(
        default="./runs", metadata=flag_doc("run storage: a local path or s3:// / gs:// URI", "checkpoints")
    )
    name: str | None = field(
        default=None, metadata=flag_doc("run name; re-running a name resumes it", "checkpoints", "strategy + timestamp")
    )
    checkpoint_every_steps: int = field(
        default=0,
        metadata=flag_doc(
            "also checkpoint every K global batches within an epoch (0: off); a resume restarts at that step",
            "checkpoints",
        ),
    )
    max_failures: int = field(
        default=0,
        metadata=flag_doc("worker-group restarts allowed, each resuming from the latest checkpoint", "checkpoints"),
    )
    # ingest
    ingest: str = field(
        default="auto",
        metadata=flag_doc(
            "memory: read the data whole, once; stream: read it window by window, never whole; auto: memory when "
            "the data's uncompressed size is at most --memory-ingest-limit-mb",
            "ingest",
            choices=INGESTS,
        ),
    )
    memory_ingest_limit_mb: float = field(
        default=1024.0, metadata=flag_doc("--ingest auto streams data larger than this, uncompressed (MiB)", "ingest")
    )
    shuffle_window_rows: int = field(
        default=65536,
        metadata=flag_doc(
            "stream: rows shuffled together; a window closes once its row groups hold this many", "ingest"
        ),
    )
    # placement
    resource_timeout: float = field(
        default=300.0,
        metadata=flag_doc(
            "seconds to wait for an autoscaling cluster to add the nodes a run needs "
            "(a fixed-size cluster that lacks them fails at once)",
            "placement",
        ),
    )

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

    @property
    def class_count(self) -> int | None:
        """What the data's class count must be: ``--vocab-size`` (lm) or ``--num-classes``."""
        return self.vocab_size if self.vocab_size is not None else self.num_classes

    @property
    def model_options(self) -> dict[str, Any]:
        """The model's keyword options: each --model-option, and the --hidden/--depth/--dropout given."""
        options = parse_model_options(self.model_option)
        for key in ("hidden", "depth", "dropout"):
            value = getattr(self, key)
            if value is not None:
                if key in options:
                    raise ValueError(f"--{key} and --model-option {key}=... both set {key}; give one")
                options[key] = value
        return options


# Keys of summary.json's model record and build_model's own arguments, beside the options.
RESERVED_OPTIONS = ("name", "in_features", "out_features", "factory")


def parse_model_options(pairs: list[str]) -> dict[str, Any]:
    """``["hidden=8", "norm=true", "act=gelu"]`` -> ``{"hidden": 8, "norm": True, "act": "gelu"}``."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, equals, text = pair.partition("=")
        if not equals or not key.isidentifier():
            raise ValueError(f"--model-option {pair!r} must be KEY=VALUE with KEY a Python name (e.g. hidden=64)")
        if key in RESERVED_OPTIONS:
            raise ValueError(
                f"--model-option {key}=... is not an option: the model is called with "
                "(in_features, out_features) from the data"
            )
        if key in options:
            raise ValueError(f"--model-option {key} is given twice")
        options[key] = parse_option_value(text)
    return options


def parse_option_value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


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


def require(ok: bool, flag: str, value: Any, what: str) -> None:
    if not ok:
        raise ValueError(f"--{flag.replace('_', '-')} must be {what}, got {value}")


def require_accumulation_fits(cfg: TrainConfig, num_workers: int) -> None:
    """``--grad-accum-steps`` cuts each worker's slice of the global batch into equal chunks."""
    steps, share = cfg.grad_accum_steps, cfg.batch_size // num_workers
    if steps > 1 and (cfg.batch_size % num_workers or share % steps):
        raise ValueError(
            f"--grad-accum-steps {steps} does not divide the per-worker batch (--batch-size {cfg.batch_size} over "
            f"{num_workers} worker(s)): give a --batch-size that is a multiple of {num_workers * steps}"
        )


def require_choice(value: str, choices: tuple[str, ...] | list[str], flag: str) -> None:
    if value not in choices:
        raise ValueError(f"--{flag.replace('_', '-')} {value!r} is unknown; valid: {', '.join(choices)}")


def require_gpu_for_fp16(cfg: TrainConfig, on_gpu: bool, flag: str) -> None:
    """float16's narrow range needs a gradient scaler, a GPU recipe; bfloat16 has float32's range
    and runs on CPUs too."""
    if cfg.precision == "fp16" and not on_gpu:
        raise ValueError(f"--precision fp16 needs GPUs ({flag}); on CPUs use --precision bf16")


def require_divisible(batch_size: int, parts: int, flag: str) -> None:
    """The global batch must split into equal parts, else the mean-loss gradient changes."""
    if batch_size % parts:
        raise ValueError(f"--batch-size {batch_size} is not divisible by {flag} {parts}")


Config = TypeVar("Config")


def add_flags(parser: argparse.ArgumentParser, cls: type, default_group: str = "placement") -> None:
    """Add one ``--flag`` per dataclass field, in the --help section its metadata names (else
    ``default_group``), each with its default; a bool defaulting to True becomes ``--no-flag``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        group = flag_group(parser, meta.pop("group") or default_group)
        default = f.default if f.default is not dataclasses.MISSING else None
        default_text = meta.pop("default_text")
        # choices go into the help text: a bad value then fails in __post_init__ with one line.
        choices = meta.pop("choices", None)
        meta["help"] += f"; one of {', '.join(choices)}" if choices else ""
        if meta.get("action") == "append":  # a repeatable flag; the dataclass turns None into []
            meta["help"] += f" (default: {default_text})"
            group.add_argument(flag, dest=f.name, default=None, **meta)
            continue
        if hints[f.name] is bool:
            shown = default_text or ("on" if default else "off")
            meta["help"] += f" (default: {shown})"
            if default:
                group.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", **meta)
            else:
                group.add_argument(flag, dest=f.name, action="store_true", **meta)
            continue
        scalar = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        meta["help"] += f" (default: {default_text if default is None else default})"
        group.add_argument(flag, dest=f.name, type=scalar, default=default, metavar=f.name.upper(), **meta)


def flag_group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The parser's section ``title``; all of ``FLAG_GROUPS`` are created at once, so --help
    lists them in that order whichever dataclass adds its flags first."""
    existing = {group.title: group for group in parser._action_groups}
    if title not in existing:
        for name in FLAG_GROUPS:
            if name not in existing:
                existing[name] = parser.add_argument_group(name)
    if title not in existing:
        raise ValueError(f"flag group {title!r} is not one of {', '.join(FLAG_GROUPS)}")
    return existing[title]


def from_args(cls: type[Config], args: argparse.Namespace) -> Config:
    """Build (and so validate) a config dataclass from parsed flags."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(args).items() if k in names})
