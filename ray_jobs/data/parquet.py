"""Parquet training data: reading and validating it with pyarrow, and writing synthetic or
re-grouped sets (what ``python -m ray_jobs.data`` runs).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ray_jobs.data.storage import resolve

if TYPE_CHECKING:
    import torch

TASKS = ("regression", "classification")
NUM_CLASSES_KEY = b"raypar.num_classes"
# A language model's data, as `python -m ray_jobs.data tokenize` writes it: one list<int> column of
# T+1 consecutive tokens per row (input tokens[:-1], target tokens[1:]), the vocabulary in the metadata.
TOKENS_COLUMN = "tokens"
VOCAB_SIZE_KEY = b"raypar.vocab_size"
TOKENIZER_KEY = b"raypar.tokenizer"
TOKENIZER_FILE = "tokenizer.json"  # the spec's file beside the data, and in an lm run's directory
# Row groups are what a stream reads and shuffles (--ingest stream): written no larger than this.
PARQUET_SUFFIX = ".parquet"  # what a directory of data is read for
ROW_GROUP_ROWS = 16384
CLASSES_FROM_LABELS = "the largest label + 1 (state --num-classes when a split may lack the top class)"


@dataclass
class Dataset:
    """All rows in memory: ``features`` float32 (n, D); ``targets`` float32 (n, K) or int64 (n,).
    A language model's (``task`` lm): ``features`` and ``targets`` int64 (n, T), the tokens and the
    same tokens one position on; ``num_classes`` is the vocabulary size V."""

    features: np.ndarray
    targets: np.ndarray
    task: str
    num_classes: int | None = None
    reason: str = ""
    """Why ``task`` (and the class count) were chosen, for the run's first lines."""
    file_bytes: int = 0
    """Parquet bytes read from storage to load it."""
    tokenizer: str | None = None
    """lm: the tokenizer's JSON spec from the files' ``raypar.tokenizer`` metadata (None: not stated)."""
    ingest = "memory"

    @property
    def num_rows(self) -> int:
        return len(self.features)

    @property
    def in_features(self) -> int:
        return self.num_classes if self.task == "lm" else self.features.shape[1]

    @property
    def out_features(self) -> int:
        return self.num_classes if self.task in ("classification", "lm") else self.targets.shape[1]

    @property
    def block_size(self) -> int | None:
        """A language model's context length T (tokens per input row); None for other tasks."""
        return self.features.shape[1] if self.task == "lm" else None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Features and targets as tensors sharing the arrays' memory (no copy)."""
        # Here, not at the top: the tokenizer's Ray Data workers read and write Parquet through
        # this module and need no torch (~0.9 s of each one's start).
        import torch

        with warnings.catch_warnings():
            # Object-store arrays are read-only and shared by a node's workers; training only
            # indexes them, never writes.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(self.features), torch.from_numpy(self.targets)


def _column(table: pa.Table, name: str, flag: str) -> pa.ChunkedArray:
    if name not in table.column_names:
        raise ValueError(f"column {name!r} ({flag}) is missing; the data has columns: {', '.join(table.column_names)}")
    column = table.column(name)
    if column.null_count:
        raise ValueError(f"column {name!r} has {column.null_count} null rows; every row needs a value")
    return column


def fixed_width(column: pa.ChunkedArray, name: str) -> np.ndarray:
    """A list-of-floats column as an (n, width) float32 array; ragged rows are an error."""
    if not (
        pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type)
    ):
        raise ValueError(f"column {name!r} must be a list of floats per row, got {column.type}")
    array = column.combine_chunks()
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
    else:
        lengths = np.asarray(array.value_lengths())
        width = int(lengths[0]) if len(lengths) else 0
        if len(lengths) and (lengths != width).any():
            bad = int(np.argmax(lengths != width))
            raise ValueError(
                f"column {name!r} is ragged: row 0 has {width} values, row {bad} has {int(lengths[bad])}; "
                "every row needs the same width"
            )
    if width == 0:
        raise ValueError(f"column {name!r} has empty lists; every row needs at least one value")
    values = array.flatten()
    if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
        raise ValueError(f"column {name!r} must hold numbers, got lists of {values.type}")
    matrix = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.float32).reshape(-1, width)
    finite = np.isfinite(matrix).all(axis=1)
    if not finite.all():
        bad = int(np.argmin(finite))
        raise ValueError(f"column {name!r} has NaN or infinite values (first at row {bad}); clean the data first")
    return matrix


def table_to_dataset(
    table: pa.Table,
    feature_column: str = "features",
    target_column: str = "target",
    task: str = "auto",
    num_classes: int | None = None,
    stored_classes: int | None = None,
) -> Dataset:
    """Validate a table and turn it into arrays; every problem is one ``ValueError`` line.

    ``task`` ``auto``: an integer target column is classification, floats are regression.
    ``stored_classes``: the files' ``raypar.num_classes`` (default: this table's metadata).
    """
    if table.num_rows == 0:
        raise ValueError("the dataset has no rows")
    tokens_column = language_model_column(table.schema, feature_column, task)
    if tokens_column is not None:
        return _language_model(table, tokens_column, task, num_classes)
    features = fixed_width(_column(table, feature_column, "--feature-column"), feature_column)
    target = _column(table, target_column, "--target-column")
    if stored_classes is None:
        stored = (table.schema.metadata or {}).get(NUM_CLASSES_KEY)
        stored_classes = int(stored) if stored else None
    kind = _target_kind(target.type)
    if kind is None:
        raise ValueError(
            f"column {target_column!r} must be a list of floats (regression) or integers (classification), "
            f"got {target.type}"
        )
    if task == "classification" and kind != "integer":
        raise ValueError(
            f"--task classification needs an integer column of class labels; column "
            f"{target_column!r} holds {target.type}"
        )
    if task == "classification" or (task == "auto" and kind == "integer"):
        return _classification(features, target, target_column, task, num_classes, stored_classes)
    if num_classes is not None:
        raise ValueError(
            f"--num-classes applies to classification; column {target_column!r} ({target.type}) "
            "is trained as regression"
        )
    if kind == "list":
        targets = fixed_width(target, target_column)
        reason = f"column {target_column!r} holds lists of numbers"
    else:  # one number per row: a target of width 1
        targets = fixed_width(
            pa.chunked_array([pa.FixedSizeListArray.from_arrays(target.combine_chunks().cast(pa.float32()), 1)]),
            target_column,
        )
        reason = (
            f"--task regression on the numbers of column {target_column!r}"
            if task == "regression"
            else f"column {target_column!r} holds floats"
        )
    return Dataset(features, targets, "regression", reason=reason)


def _target_kind(kind: pa.DataType) -> str | None:
    if pa.types.is_integer(kind):
        return "integer"
    if pa.types.is_floating(kind):
        return "float"
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return "list"
    return None


def _classification(
    features: np.ndarray,
    target: pa.ChunkedArray,
    name: str,
    task: str,
    num_classes: int | None,
    stored_classes: int | None,
) -> Dataset:
    labels = np.asarray(target.to_numpy(), dtype=np.int64)
    if labels.min() < 0:
        raise ValueError(f"column {name!r} has negative class labels; labels must be 0..K-1")
    if num_classes is not None and stored_classes is not None and num_classes != stored_classes:
        raise ValueError(
            f"--num-classes {num_classes} disagrees with the data's raypar.num_classes "
            f"{stored_classes}; drop the flag or fix the files' metadata"
        )
    if num_classes is not None:
        classes, source = num_classes, "--num-classes"
    elif stored_classes is not None:
        classes, source = stored_classes, "the files' raypar.num_classes"
    else:
        classes, source = int(labels.max()) + 1, CLASSES_FROM_LABELS
    if labels.max() >= classes:
        raise ValueError(f"column {name!r} has label {labels.max()} >= num_classes {classes} ({source})")
    why = "--task classification" if task == "classification" else f"column {name!r} holds integers"
    return Dataset(features, labels, "classification", classes, f"{why}; {classes} classes from {source}")


def language_model_column(schema: pa.Schema, feature_column: str, task: str) -> str | None:
    """The token column when the data is a language model's (``--task lm``, or ``auto`` on data
    with a list<int> ``tokens`` column and no ``--feature-column``), else None. The token column is
    ``tokens`` unless ``--feature-column`` names another."""
    column = feature_column if feature_column != "features" else TOKENS_COLUMN
    if task == "lm" or (task == "auto" and feature_column not in schema.names and _holds_token_lists(schema, column)):
        return column
    return None


def data_columns(schema: pa.Schema, feature_column: str, target_column: str, task: str) -> list[str]:
    """The columns training reads: the token column of a language model's data, else features and target."""
    tokens = language_model_column(schema, feature_column, task)
    return [tokens] if tokens is not None else [feature_column, target_column]


def _holds_token_lists(schema: pa.Schema, name: str) -> bool:
    if name not in schema.names:
        return False
    kind = schema.field(name).type
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    return is_list and pa.types.is_integer(kind.value_type)


def _language_model(table: pa.Table, name: str, task: str, vocab_size: int | None) -> Dataset:
    """Rows of T+1 token ids: input ``tokens[:-1]``, target ``tokens[1:]``; V from ``vocab_size``
    (``--vocab-size``), else the files' ``raypar.vocab_size``, else the largest id + 1."""
    if not _holds_token_lists(table.schema, name):
        what = (
            f"column {name!r} holds {table.schema.field(name).type}"
            if name in table.column_names
            else (f"the data has no column {name!r} (it has {', '.join(table.column_names)})")
        )
        raise ValueError(
            f"--task lm needs a list<int> column of token ids ({what}); make one with "
            "python -m ray_jobs.data tokenize, or name it with --feature-column"
        )
    column = _column(table, name, "--feature-column").combine_chunks()
    lengths = np.asarray(column.value_lengths()) if not pa.types.is_fixed_size_list(column.type) else None
    width = column.type.list_size if lengths is None else int(lengths[0])
    if lengths is not None and (lengths != width).any():
        bad = int(np.argmax(lengths != width))
        raise ValueError(
            f"column {name!r}: row 0 has {width} tokens, row {bad} has {int(lengths[bad])}; every row needs "
            "the same T+1 tokens (python -m ray_jobs.data tokenize writes them so)"
        )
    if width < 2:
        raise ValueError(f"column {name!r} has rows of {width} token(s); a row needs T+1 >= 2 (input and target)")
    tokens = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=np.int64).reshape(-1, width)
    stored = (table.schema.metadata or {}).get(VOCAB_SIZE_KEY)
    if vocab_size is not None:
        vocab, source = vocab_size, "--vocab-size"
    elif stored is not None:
        vocab, source = int(stored), "the data's raypar.vocab_size"
    else:
        vocab, source = int(tokens.max()) + 1, "the largest token id + 1"
    out_of_range = (tokens < 0) | (tokens >= vocab)
    if out_of_range.any():
        row = int(np.argmax(out_of_range.any(axis=1)))
        token = int(tokens[row][out_of_range[row]][0])
        raise ValueError(
            f"column {name!r} row {row} has token id {token}, outside the vocabulary 0..{vocab - 1} ({source})"
        )
    why = "--task lm" if task == "lm" else f"column {name!r} holds lists of token ids"
    reason = f"{why}; {width - 1} tokens per row, vocabulary {vocab} from {source}"
    tokenizer = (table.schema.metadata or {}).get(TOKENIZER_KEY)
    return Dataset(
        tokens[:, :-1], tokens[:, 1:], "lm", vocab, reason, tokenizer=tokenizer.decode() if tokenizer else None
    )


def read_dataset(
    path: str,
    feature_column: str = "features",
    target_column: str = "target",
    task: str = "auto",
    num_classes: int | None = None,
) -> Dataset:
    """Read a Parquet file or directory (local or URI) and validate it."""
    filesystem, fs_path = resolve(path)
    if filesystem.get_file_info(fs_path).type == pafs.FileType.NotFound:
        raise ValueError(f"--data {path}: no such file or directory")
    try:
        files = parquet_files(filesystem, fs_path)
        if not files:
            raise ValueError(f"--data {path}: no {PARQUET_SUFFIX} files in the directory")
        stored = stored_num_classes(filesystem, files)
        table = pq.read_table(files, filesystem=filesystem)  # the files listed, not the whole directory
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(f"--data {path}: not readable as Parquet ({str(error).splitlines()[0]})") from None
    dataset = table_to_dataset(table, feature_column, target_column, task, num_classes, stored)
    dataset.file_bytes = sum(info.size for info in filesystem.get_file_info(files))
    return dataset


def parquet_files(filesystem: pafs.FileSystem, path: str) -> list[str]:
    """A Parquet file, or a directory's ``*.parquet`` files in name order (hidden ``.``/``_`` names
    left out). Only that suffix: a directory also gathers leftovers (``.partial`` writes, notes,
    predictions written beside the data) that would otherwise be read as training rows."""
    if filesystem.get_file_info(path).type != pafs.FileType.Directory:
        return [path]
    infos = filesystem.get_file_info(pafs.FileSelector(path, recursive=True))
    return sorted(
        info.path
        for info in infos
        if info.type == pafs.FileType.File
        and info.base_name.endswith(PARQUET_SUFFIX)
        and not info.base_name.startswith((".", "_"))
    )


def stored_num_classes(filesystem: pafs.FileSystem, files: list[str]) -> int | None:
    """``raypar.num_classes`` as every file's metadata states it; files that disagree are an error."""
    stated = {}
    for file in files:
        value = (pq.read_schema(file, filesystem=filesystem).metadata or {}).get(NUM_CLASSES_KEY)
        if value is not None:
            stated[file] = int(value)
    if len(set(stated.values())) > 1:
        first, *_, other = sorted(stated.items(), key=lambda item: item[1])
        raise ValueError(
            f"the data's files disagree on raypar.num_classes: {first[0]} says {first[1]}, "
            f"{other[0]} says {other[1]}; give them one value, or state --num-classes"
        )
    return next(iter(stated.values()), None)


def synthesize(rows: int, in_features: int, out_features: int, task: str = "regression", seed: int = 0) -> pa.Table:
    """The tutorials' random inputs, with targets from a known linear map so there is something to learn."""
    if task not in TASKS:
        raise ValueError(f"--task {task!r} is unknown; valid: {', '.join(TASKS)}")
    for flag, value in (("rows", rows), ("in-features", in_features), ("out-features", out_features)):
        if value < 1:
            raise ValueError(f"--{flag} must be at least 1, got {value}")
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((rows, in_features), dtype=np.float32)
    weight = rng.standard_normal((in_features, out_features), dtype=np.float32) / np.sqrt(in_features)
    scores = features @ weight
    columns = {"features": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), in_features)}
    metadata = None
    if task == "regression":
        noisy = scores + 0.01 * rng.standard_normal(scores.shape, dtype=np.float32)
        columns["target"] = pa.FixedSizeListArray.from_arrays(pa.array(noisy.ravel()), out_features)
    else:
        columns["target"] = pa.array(scores.argmax(axis=1).astype(np.int64))
        metadata = {NUM_CLASSES_KEY: str(out_features).encode()}
    return pa.table(columns, metadata=metadata)


def write_table(table: pa.Table, path: str, row_group_rows: int = ROW_GROUP_ROWS) -> None:
    filesystem, fs_path = resolve(path)
    parent = fs_path.rsplit("/", 1)[0]
    if parent:
        filesystem.create_dir(parent, recursive=True)
    pq.write_table(table, fs_path, filesystem=filesystem, row_group_size=row_group_rows)


def reshard(source: str, out: str, row_group_rows: int) -> int:
    """Rewrite a Parquet file or directory with row groups of ``row_group_rows`` rows, a few at a
    time (never the whole data in memory); returns the rows written. Names and schema metadata
    are kept; a directory's files keep their names under ``out``."""
    if row_group_rows < 1:
        raise ValueError(f"--row-group-rows must be at least 1, got {row_group_rows}")
    filesystem, path = resolve(source)
    if filesystem.get_file_info(path).type == pafs.FileType.NotFound:
        raise ValueError(f"{source}: no such file or directory")
    out_fs, out_path = resolve(out)
    files = parquet_files(filesystem, path)
    total = 0
    for file in files:
        target = out_path if len(files) == 1 and file == path else f"{out_path}/{file[len(path) :].lstrip('/')}"
        out_fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        reader = pq.ParquetFile(file, filesystem=filesystem)
        with pq.ParquetWriter(target, reader.schema_arrow, filesystem=out_fs) as writer:
            pending: list[pa.RecordBatch] = []
            for batch in reader.iter_batches(batch_size=row_group_rows):
                pending.append(batch)
                while sum(len(b) for b in pending) >= row_group_rows:
                    table = pa.Table.from_batches(pending)
                    writer.write_table(table.slice(0, row_group_rows))
                    pending = table.slice(row_group_rows).to_batches()
            if pending:
                writer.write_table(pa.Table.from_batches(pending, reader.schema_arrow))
        total += reader.metadata.num_rows
    return total
