"""``TrainConfig``'s flags for what it reads: the data and its columns (``DataFlags``), and how it is
ingested, whole or streamed (``IngestFlags``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_jobs.core.flags import flag_doc

TASKS = ("auto", "regression", "classification", "lm")
INGESTS = ("auto", "memory", "stream")


@dataclass
class DataFlags:
    """The training data, its columns and its task (``--help`` section ``data``)."""

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

    @property
    def class_count(self) -> int | None:
        """What the data's class count must be: ``--vocab-size`` (lm) or ``--num-classes``."""
        return self.vocab_size if self.vocab_size is not None else self.num_classes


@dataclass
class IngestFlags:
    """Memory or streamed ingest (``--help`` section ``ingest``)."""

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
