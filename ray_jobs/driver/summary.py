"""``summary.json``: the one result record every strategy writes into its run directory."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TrainSummary:
    strategy: str
    world_size: int
    epochs_completed: int
    losses: list[float]
    samples_per_second: float | None
    resumed_from_epoch: int | None
    model: dict[str, Any]
    config: dict[str, Any]
    run_dir: str
    worker_nodes: list[str] | None = None
    resumed_from_step: int | None = None
    """The step within ``resumed_from_epoch``'s epoch the run resumed at (0: an epoch's start)."""
    ingest: str = "memory"
    bytes_read: int | None = None
    """Parquet bytes read from storage by the run, all processes together (this attempt's)."""
    data_wait_fraction: float | None = None
    """Share of the training loop's time spent blocked until rows arrived from the stream's reader
    (world rank 0's; the stages' share of their time in a pipeline); 0 in memory."""
    precision: str = "fp32"
    """``--precision``: the autocast dtype of the forward and loss (weights stay float32)."""
    lr: dict[str, float] | None = None
    """The LR of the run's first optimizer step, its peak and its last (``--lr-schedule``)."""
    grad_norm: dict[str, float] | None = None
    """``--grad-clip-norm``: the largest and the last whole-model gradient norm before clipping (this attempt's)."""
    task: str | None = None
    """``regression``, ``classification`` or ``lm``, as the data decided it (``predict`` needs it)."""
    block_size: int | None = None
    """lm: the tokens per input row T, the context the model was trained on (``generate`` crops to it)."""
    tokens_per_second: float | None = None
    """lm: training tokens per second, all workers (stages) together."""
    tokens_per_second_per_worker: float | None = None
    """lm: ``tokens_per_second`` over the workers (a pipeline's: over its stages)."""
    mfu: float | None = None
    """lm on GPUs: model FLOPs utilisation, ``tokens_per_second x flops_per_token`` over the GPUs' peak."""
    flops_per_token: float | None = None
    """lm: training FLOPs per token as MFU counts them (``observability.throughput``)."""
    val_losses: list[float] | None = None
    """``--val-data``: the validation loss after each epoch (None without it)."""
    val_accuracy: list[float] | None = None
    """``--val-data``: the validation accuracy after each epoch (None for regression)."""
    val_perplexity: list[float] | None = None
    """``--val-data``, lm: exp of each epoch's validation loss (the mean token cross-entropy)."""
    best_epoch: int | None = None
    """``--val-data``: the 1-based epoch with the lowest validation loss, whose weights are best_model.pt."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        record = asdict(self)
        record.update(record.pop("extra"))
        if record["worker_nodes"] is None:
            record.pop("worker_nodes")
        return json.dumps(record, indent=2)

    def _resumed(self) -> str:
        if self.resumed_from_epoch is None:
            return "-"
        return (
            f"{self.resumed_from_epoch}, step {self.resumed_from_step}"
            if self.resumed_from_step
            else str(self.resumed_from_epoch)
        )

    def _validation_rows(self) -> list[tuple[str, str]]:
        if not self.val_losses:
            return []
        best = self.best_epoch
        accuracy = f", accuracy {self.val_accuracy[best - 1]:.4f}" if self.val_accuracy else ""
        if self.val_perplexity:
            accuracy = f", perplexity {self.val_perplexity[best - 1]:.3f}"
        return [("best validation", f"epoch {best}: loss {self.val_losses[best - 1]:.6f}{accuracy}")]

    def _token_rows(self) -> list[tuple[str, str]]:
        if self.tokens_per_second is None:
            return []
        rows = [("tokens/s", f"{self.tokens_per_second:,.0f} ({self.tokens_per_second_per_worker:,.0f} per worker)")]
        return rows + ([("MFU", f"{self.mfu:.1%}")] if self.mfu is not None else [])

    def table(self) -> str:
        """A short human-readable result table."""
        rows = [
            ("strategy", self.strategy),
            ("world size", self.world_size),
            ("epochs completed", self.epochs_completed),
            ("first / last loss", f"{self.losses[0]:.6f} / {self.losses[-1]:.6f}" if self.losses else "-"),
            *self._validation_rows(),
            ("samples/s", f"{self.samples_per_second:,.0f}" if self.samples_per_second else "-"),
            *self._token_rows(),
            ("precision", self.precision),
            ("resumed from epoch", self._resumed()),
            (
                "ingest",
                f"{self.ingest}, data wait {self.data_wait_fraction:.1%}"
                if self.data_wait_fraction is not None
                else self.ingest,
            ),
            ("nodes", len(set(self.worker_nodes or self.extra.get("stage_nodes", [])))),
            ("run directory", self.run_dir),
        ]
        width = max(len(label) for label, _ in rows)
        return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
