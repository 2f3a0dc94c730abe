"""A streamed dataset's plan: what its Parquet metadata says, and where each row falls. No Ray.

The driver reads only metadata (schema, row-group sizes and statistics) into a ``StreamDataset``,
checked before any Ray resource is asked for. Its unit is the ``Block``, one row group; order
contract v2 (``order.stream_windows``) groups blocks into windows, and ``window_starts`` turns
those into positions in an epoch's order. The reader actor, the workers and the stages each
compute the same windows from the same plan: a worker asks the reader for window k, never where a
row is (``stream`` holds the reader and the sources).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from ray_jobs.data.order import epoch_order, stream_windows
from ray_jobs.data.parquet import Dataset, data_columns, parquet_files, stored_num_classes, table_to_dataset
from ray_jobs.data.storage import resolve


@dataclass(frozen=True)
class Block:
    """One Parquet row group: the unit the stream reads and shuffles."""

    file: str
    row_group: int
    num_rows: int
    compressed_bytes: int
    label_max: int | None = None
    """The target column's largest value per the row group's statistics (None: not stated)."""


@dataclass
class StreamDataset:
    """What the metadata says of a dataset that is streamed, never loaded whole."""

    filesystem: pafs.FileSystem
    blocks: list[Block]
    feature_column: str
    target_column: str
    task: str
    in_features: int
    out_features: int
    num_classes: int | None
    reason: str
    uncompressed_bytes: int
    window_rows: int = 65536
    block_size: int | None = None
    """A language model's tokens per input row (T); None for other tasks."""
    tokenizer: str | None = None
    """lm: the tokenizer's JSON spec from the files' metadata."""
    ingest: str = field(default="stream", init=False)

    # Cached: a source asks for them on every batch, and a dataset may have many row groups.
    @functools.cached_property
    def num_rows(self) -> int:
        return sum(block.num_rows for block in self.blocks)

    @functools.cached_property
    def block_rows(self) -> list[int]:
        return [block.num_rows for block in self.blocks]

    @property
    def file_bytes(self) -> int:
        return sum(block.compressed_bytes for block in self.blocks)


@dataclass
class Footers:
    """A dataset's Parquet files, each with its footer: read once, for ``--ingest auto``'s size and
    the stream's plan (two requests per file on object storage)."""

    filesystem: pafs.FileSystem
    files: list[str]
    metadata: list[pq.FileMetaData]

    @property
    def uncompressed_bytes(self) -> int:
        """The data's decoded size from the metadata alone: what ``--ingest auto`` compares."""
        return sum(meta.row_group(i).total_byte_size for meta in self.metadata for i in range(meta.num_row_groups))


def read_footers(path: str) -> Footers:
    filesystem, fs_path = resolve(path)
    if filesystem.get_file_info(fs_path).type == pafs.FileType.NotFound:
        raise ValueError(f"--data {path}: no such file or directory")
    files = parquet_files(filesystem, fs_path)
    return Footers(filesystem, files, [_metadata(filesystem, file) for file in files])


def _metadata(filesystem: pafs.FileSystem, file: str) -> pq.FileMetaData:
    try:
        return pq.ParquetFile(file, filesystem=filesystem).metadata
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(f"--data {file}: not readable as Parquet ({str(error).splitlines()[0]})") from None


def plan_stream(
    path: str,
    feature_column: str,
    target_column: str,
    task: str,
    num_classes: int | None,
    window_rows: int,
    footers: Footers | None = None,
) -> StreamDataset:
    """Everything the metadata can tell, checked before any Ray resource is asked for; ``footers``:
    the files' footers when already read."""
    footers = footers or read_footers(path)
    filesystem, files = footers.filesystem, footers.files
    if not files:
        raise ValueError(f"--data {path}: no Parquet files")
    columns = data_columns(footers.metadata[0].schema.to_arrow_schema(), feature_column, target_column, task)
    blocks = _blocks(footers, columns, target_column)
    if not any(block.num_rows for block in blocks):
        raise ValueError("the dataset has no rows")
    # Widths, task and classes from the first row group with rows, decoded alone: the one data read.
    first = next(block for block in blocks if block.num_rows)
    sample = decode_block(filesystem, first, feature_column, target_column, task, num_classes)
    classes = _num_classes(filesystem, files, blocks, sample, num_classes)
    if classes != sample.num_classes:
        sample = decode_block(filesystem, first, feature_column, target_column, task, classes)
    largest = max(block.num_rows for block in blocks)
    if largest > window_rows:
        warnings.warn(
            f"--data: a row group of {largest} rows is larger than --shuffle-window-rows {window_rows}, so "
            "every window is one row group; raise the window, or rewrite the data with smaller row groups: "
            "python -m ray_jobs.data reshard --row-group-rows R",
            stacklevel=2,
        )
    return StreamDataset(
        filesystem,
        blocks,
        feature_column,
        target_column,
        sample.task,
        sample.in_features,
        sample.out_features,
        sample.num_classes,
        sample.reason,
        footers.uncompressed_bytes,
        window_rows,
        sample.block_size,
        sample.tokenizer,
    )


def _blocks(footers: Footers, columns: list[str], target_column: str) -> list[Block]:
    """Every file's row groups, once each file is found to hold the columns with the first's types."""
    blocks, first_schema = [], None
    for file, metadata in zip(footers.files, footers.metadata):
        schema = metadata.schema.to_arrow_schema()
        for column in columns:
            if column not in schema.names:
                raise ValueError(f"--data {file}: column {column!r} is missing; it has {', '.join(schema.names)}")
        mine = ", ".join(f"{column}: {schema.field(column).type}" for column in columns)
        if first_schema is None:
            first_schema = (file, mine)
        elif mine != first_schema[1]:
            raise ValueError(
                f"--data: the files' schemas differ: {first_schema[0]} has {first_schema[1]}; {file} has {mine}"
            )
        for index in range(metadata.num_row_groups):
            group = metadata.row_group(index)
            statistics = _target_statistics(file, index, group, target_column) if target_column in columns else None
            blocks.append(
                Block(
                    file,
                    index,
                    group.num_rows,
                    sum(group.column(c).total_compressed_size for c in range(group.num_columns)),
                    _label_max(statistics),
                )
            )
    return blocks


def _target_statistics(file: str, index: int, group, target_column: str):
    """A scalar target column's statistics in this row group (None for a list column, or none
    written); nulls they show are an error found before training."""
    statistics = next(
        (
            group.column(c).statistics
            for c in range(group.num_columns)
            if group.column(c).path_in_schema == target_column
        ),
        None,
    )
    if statistics is not None and statistics.has_null_count and statistics.null_count:
        raise ValueError(
            f"--data {file} row group {index}: column {target_column!r} has "
            f"{statistics.null_count} null rows; every row needs a value"
        )
    return statistics


def _label_max(statistics) -> int | None:
    if statistics is None or not statistics.has_min_max or not isinstance(statistics.max, int):
        return None
    return statistics.max


def _num_classes(filesystem, files: list[str], blocks: list[Block], sample: Dataset, stated: int | None) -> int | None:
    """K without reading the labels: the flag, the files' metadata, else the row groups' max statistics."""
    if sample.task != "classification" or stated is not None:
        return sample.num_classes
    stored = stored_num_classes(filesystem, files)
    if stored is not None:
        return stored
    unstated = next((block for block in blocks if block.label_max is None), None)
    if unstated is not None:
        raise ValueError(
            f"--data {unstated.file} row group {unstated.row_group} has no label statistics: state "
            "--num-classes (a stream cannot read every label first)"
        )
    return max(block.label_max for block in blocks) + 1


def decode_block(
    filesystem, block: Block, feature_column: str, target_column: str, task: str, num_classes: int | None
) -> Dataset:
    """One row group, read, validated and decoded; a problem names its file and row group."""
    try:
        file = pq.ParquetFile(block.file, filesystem=filesystem)
        columns = data_columns(file.schema_arrow, feature_column, target_column, task)
        table = file.read_row_group(block.row_group, columns=columns)
        return table_to_dataset(table, feature_column, target_column, task, num_classes)
    except (ValueError, pa.ArrowInvalid) as error:
        raise ValueError(f"--data {block.file} row group {block.row_group}: {error}") from None


def window_at(dataset: StreamDataset, seed: int, epoch: int, shuffle: bool, position: int) -> int:
    """The window of epoch ``epoch`` that holds position ``position``: from the metadata alone."""
    return int(torch.searchsorted(window_starts(dataset, seed, epoch, shuffle), position, right=True)) - 1


def window_starts(dataset: StreamDataset, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """Each window's first position in epoch ``epoch``'s order, and the epoch's length last."""
    windows = stream_windows(dataset.block_rows, seed, epoch, shuffle, dataset.window_rows)
    sizes = [sum(dataset.block_rows[b] for b in window) for window in windows]
    return torch.tensor([0, *np.cumsum(sizes).tolist()], dtype=torch.int64)


def epoch_indices(dataset, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """What a source takes for epoch ``epoch``, in order: row indices in memory (contract v1),
    stream indices when streaming (contract v2's order is applied by the reader)."""
    if isinstance(dataset, StreamDataset):
        return torch.arange(dataset.num_rows, dtype=torch.int64) + epoch * dataset.num_rows
    return epoch_order(dataset.num_rows, seed, epoch, shuffle)
