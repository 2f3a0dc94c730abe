"""Batch prediction: ``python -m ray_jobs.predict --run-dir runs/NAME --data new.parquet --out pred.parquet``.

Ray Data reads the input, a pool of ``--num-workers`` actors (each loads the run's model once, on
its GPU with ``--use-gpu``) appends the predictions, and one Parquet file is written with every
input column, in input order, plus ``prediction`` (regression: the outputs as a list of floats;
classification: the class index) and, for classification, ``probabilities`` (softmax).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from ray.exceptions import RayError

from ray_jobs.core.config import (
    ADDRESS_HELP,
    ArgumentParser,
    add_flags,
    flag_doc,
    flag_group,
    from_args,
    require,
    require_choice,
)
from ray_jobs.driver.connect import join, reachable
from ray_jobs.errors import root_cause
from ray_jobs.predict.inference import PredictFailed, check_input, check_output, predict
from ray_jobs.predict.trained import WEIGHTS, load_run


@dataclass
class PredictConfig:
    """What to predict with, on what, and where to put it."""

    run_dir: str | None = field(
        default=None,
        metadata=flag_doc(
            "a finished run's directory (<storage-path>/<name>), local or a URI", "data", "none: required"
        ),
    )
    data: str | None = field(
        default=None,
        metadata=flag_doc("Parquet file or directory to predict, local or a URI", "data", "none: required"),
    )
    out: str | None = field(
        default=None, metadata=flag_doc("the Parquet file to write, local or a URI", "data", "none: required")
    )
    feature_column: str = field(default="features", metadata=flag_doc("list<float> column of inputs", "data"))
    checkpoint: str = field(
        default="final",
        metadata=flag_doc(
            "final: model.pt; best: best_model.pt (a run with --val-data)", "model", choices=tuple(WEIGHTS)
        ),
    )
    model: str | None = field(
        default=None,
        metadata=flag_doc(
            "the run's own model code, module.path:callable as summary.json names it: predict imports and runs a "
            "user's model only when named here (or with --trust-model-code); a registered model needs nothing",
            "model",
            "none: registered models only",
        ),
    )
    trust_model_code: bool = field(
        default=False,
        metadata=flag_doc(
            "import and run whatever module.path:callable the run's summary.json names (its fields are still "
            "type-checked); only for run directories you trust as you trust code",
            "model",
        ),
    )
    batch_size: int = field(default=1024, metadata=flag_doc("rows per model call", "training"))
    num_workers: int = field(default=1, metadata=flag_doc("actors in the pool, each holding the model once"))
    use_gpu: bool = field(default=False, metadata=flag_doc("one GPU per actor", default_text="CPU"))
    stall_timeout_s: float = field(
        default=600.0,
        metadata=flag_doc(
            "fail when no rows move through the prediction pipeline for this long (s): actors that cannot start, "
            "reads that get no CPU"
        ),
    )

    def __post_init__(self) -> None:
        for flag in ("run_dir", "data", "out"):
            if getattr(self, flag) is None:
                raise ValueError(f"--{flag.replace('_', '-')} is required")
        require_choice(self.checkpoint, tuple(WEIGHTS), "checkpoint")
        require(self.batch_size >= 1, "batch_size", self.batch_size, "at least 1")
        require(self.num_workers >= 1, "num_workers", self.num_workers, "at least 1")
        require(self.stall_timeout_s > 0, "stall_timeout_s", self.stall_timeout_s, "positive")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m ray_jobs.predict", description=__doc__)
    add_flags(parser, PredictConfig, "placement")
    flag_group(parser, "placement").add_argument("--address", default=None, help=ADDRESS_HELP)
    args = parser.parse_args(argv)
    try:
        cfg = from_args(PredictConfig, args)
        target = reachable(args.address)  # a wrong address fails in seconds, before the model is read
        out = check_output(cfg.out, cfg.data)  # before any work: a bad --out used to fail after every prediction
        trained = load_run(cfg.run_dir, cfg.checkpoint, cfg.model, cfg.trust_model_code)
        filesystem, files = check_input(cfg.data, cfg.feature_column, trained.record["in_features"])
        join(target, args.address)
        rows = predict(
            trained,
            filesystem,
            files,
            out,
            feature_column=cfg.feature_column,
            batch_size=cfg.batch_size,
            num_workers=cfg.num_workers,
            use_gpu=cfg.use_gpu,
            stall_timeout_s=cfg.stall_timeout_s,
        )
    except RayError as error:  # before ValueError: Ray re-raises an actor's ValueError as one
        print(f"error: prediction failed: {root_cause(error)}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (PredictFailed, OSError) as error:  # OSError: reading --data or writing --out after the checks
        print(f"error: prediction failed: {_first_line(error)}", file=sys.stderr)
        return 1
    print(f"[raypar] wrote {rows:,} predictions ({trained.task}, {cfg.checkpoint} model) to {cfg.out}")
    return 0


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
