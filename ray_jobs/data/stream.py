"""Streaming ingest (``--ingest stream``): Parquet far larger than memory, read once per epoch.

The driver reads only metadata (schema, row-group sizes and statistics) into a ``StreamDataset``.
One ``WindowReader`` actor per run reads order contract v2's windows (``training.stream_windows``)
in turn, validates and permutes each, and puts it in the object store once; every worker or
stage on a node maps it from there (zero-copy numpy), so each row is read from storage once per
epoch for the whole cluster and decoded once. The reader prefetches the next window while the
current one is consumed, and drops its reference to windows behind: a process holds about two
windows of decoded rows, whatever the dataset's size.

Workers address rows by *stream index* ``epoch * num_rows + position``, the position in the
epoch's order: global batches and their slices are cut from it exactly as from ``epoch_order``
in memory, and a source turns indices into rows (``MemorySource``, ``StreamSource``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from ray_jobs.data.device_copy import data_device
from ray_jobs.data.order import epoch_order, stream_windows, window_permutation
from ray_jobs.data.parquet import Dataset, data_columns, parquet_files, stored_num_classes, table_to_dataset
from ray_jobs.data.storage import resolve
from ray_jobs.errors import Failure

# Windows whose object-store reference the reader keeps: the one being consumed, the one before
# (a global batch can straddle them) and the prefetched next.
CACHED_WINDOWS = 3
# How long a worker or stage waits for one window from the reader before the run fails in one
# line. A window is ~65k rows (--shuffle-window-rows), read in seconds even from a bucket: ten
# minutes of silence is a reader that is stuck or storage that does not answer, not a slow read.
READER_TIMEOUT_S = 600.0


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
    blocks, first_schema, total = [], None, 0
    columns = data_columns(footers.metadata[0].schema.to_arrow_schema(), feature_column, target_column, task)
    for file, metadata in zip(files, footers.metadata):
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
            total += group.total_byte_size
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
        total,
        window_rows,
        sample.block_size,
        sample.tokenizer,
    )


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


class WindowReader:
    """The run's one reader of the stream (a Ray actor with threads): each window is read once,
    put in the object store once, and prefetched while the one before is consumed."""

    def __init__(self, dataset: StreamDataset, seed: int, shuffle: bool, num_epochs: int) -> None:
        self.dataset, self.seed, self.shuffle, self.num_epochs = dataset, seed, shuffle, num_epochs
        self.pool = ThreadPoolExecutor(max_workers=1)  # one read at a time, in window order
        self.lock = threading.Lock()
        self.windows: dict[tuple[int, int], Future] = {}
        self.plans: dict[int, list[list[int]]] = {}
        self.bytes_read = 0

    def window(self, epoch: int, index: int) -> list:
        """``[ObjectRef]`` of window ``index`` of ``epoch``: ``(features, targets)`` in stream order.
        A list, so that Ray hands back the reference and every caller maps the one copy."""
        future = self._request(epoch, index)
        following = (epoch, index + 1) if index + 1 < len(self._plan(epoch)) else (epoch + 1, 0)
        if following[0] < self.num_epochs:
            self._request(*following)
        return [future.result()]

    def stats(self) -> dict[str, int]:
        return {"bytes_read": self.bytes_read}

    def _request(self, epoch: int, index: int) -> Future:
        with self.lock:
            if (epoch, index) not in self.windows:
                self.windows[(epoch, index)] = self.pool.submit(self._read, epoch, index)
                for old in sorted(self.windows)[:-CACHED_WINDOWS]:
                    del self.windows[old]  # workers that took it keep their own reference
            return self.windows[(epoch, index)]

    def _plan(self, epoch: int) -> list[list[int]]:
        """Epoch ``epoch``'s windows, computed once (every window request asks)."""
        with self.lock:
            if epoch not in self.plans:
                self.plans = {e: p for e, p in self.plans.items() if e >= epoch - 1}
                self.plans[epoch] = stream_windows(
                    self.dataset.block_rows, self.seed, epoch, self.shuffle, self.dataset.window_rows
                )
            return self.plans[epoch]

    def _read(self, epoch: int, index: int):
        """Decode the window's row groups one at a time, each scattered straight to its rows'
        places in the window's order: the reader holds one window and one row group, not more."""
        import ray

        blocks = [self.dataset.blocks[b] for b in self._plan(epoch)[index]]
        num_rows = sum(block.num_rows for block in blocks)
        permutation = window_permutation(num_rows, self.seed, epoch, index, self.shuffle)
        # where each row, listed in the window's block order, lands in the permuted window
        place = torch.argsort(permutation).numpy() if permutation is not None else np.arange(num_rows)
        features = targets = None
        start = 0
        for block in blocks:
            decoded = self._decode_block(block)
            if features is None:
                features = np.empty((num_rows, *decoded.features.shape[1:]), decoded.features.dtype)
                targets = np.empty((num_rows, *decoded.targets.shape[1:]), decoded.targets.dtype)
            rows = place[start : start + block.num_rows]
            features[rows], targets[rows] = decoded.features, decoded.targets
            start += block.num_rows
            self.bytes_read += block.compressed_bytes
        return ray.put((features, targets))

    def _decode_block(self, block: Block) -> Dataset:
        dataset = self.dataset
        try:
            decoded = decode_block(
                dataset.filesystem,
                block,
                dataset.feature_column,
                dataset.target_column,
                dataset.task,
                dataset.num_classes,
            )
        except ValueError as error:
            raise Failure(str(error)) from None
        if decoded.block_size != dataset.block_size:
            raise Failure(
                f"--data {block.file} row group {block.row_group}: rows of {decoded.block_size} + 1 tokens; the "
                f"data's first row group has {dataset.block_size} + 1"
            )
        if decoded.in_features != dataset.in_features or decoded.out_features != dataset.out_features:
            raise Failure(
                f"--data {block.file} row group {block.row_group}: {decoded.in_features} inputs and "
                f"{decoded.out_features} outputs; the data's first row group has "
                f"{dataset.in_features} and {dataset.out_features}"
            )
        return decoded


@contextlib.contextmanager
def stream_reader(prepared, resume_at: tuple[int, int] | None = None) -> Iterator:
    """The run's reader actor while the run lasts, for a streamed dataset (else None). It holds
    no CPU: Ray Train's workers may hold every CPU of the cluster, and reading must go on.
    ``resume_at``: the ``(epoch, step)`` the run resumes from (None: the start), whose window it
    reads first."""
    if not isinstance(prepared.dataset, StreamDataset):
        yield None
        return
    import ray

    cfg, dataset = prepared.cfg, prepared.dataset
    reader = start_reader(dataset, cfg.seed, cfg.shuffle, cfg.epochs)
    # Read the first window the run needs while Ray starts its workers (seconds), not after.
    epoch, step = resume_at or (0, 0)
    if epoch < cfg.epochs:
        reader.window.remote(epoch, window_at(dataset, cfg.seed, epoch, cfg.shuffle, step * cfg.batch_size))
    try:
        yield reader
    finally:
        ray.kill(reader)


def start_reader(dataset: StreamDataset, seed: int, shuffle: bool, num_epochs: int):
    """A ``WindowReader`` actor. Its threads wait for windows being read; one per worker or stage
    asking, and one more for the window asked ahead, is plenty at 64. It lives on the driver's
    node, as Ray Train's controller does: a worker node lost to preemption takes no more than its
    workers, which a retry (or an elastic run) replaces."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return (
        ray.remote(num_cpus=0, max_concurrency=64)(WindowReader)
        .options(scheduling_strategy=here)
        .remote(dataset, seed, shuffle, num_epochs)
    )


def window_at(dataset: StreamDataset, seed: int, epoch: int, shuffle: bool, position: int) -> int:
    """The window of epoch ``epoch`` that holds position ``position``: from the metadata alone."""
    return int(torch.searchsorted(window_starts(dataset, seed, epoch, shuffle), position, right=True)) - 1


def window_starts(dataset: StreamDataset, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """Each window's first position in epoch ``epoch``'s order, and the epoch's length last."""
    windows = stream_windows(dataset.block_rows, seed, epoch, shuffle, dataset.window_rows)
    sizes = [sum(dataset.block_rows[b] for b in window) for window in windows]
    return torch.tensor([0, *np.cumsum(sizes).tolist()], dtype=torch.int64)


def reader_stats(reader) -> dict[str, int]:
    """``bytes_read`` by the run's reader; nothing without one."""
    if reader is None:
        return {}
    import ray

    return ray.get(reader.stats.remote(), timeout=READER_TIMEOUT_S)


def epoch_indices(dataset, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """What a source takes for epoch ``epoch``, in order: row indices in memory (contract v1),
    stream indices when streaming (contract v2's order is applied by the reader)."""
    if isinstance(dataset, StreamDataset):
        return torch.arange(dataset.num_rows, dtype=torch.int64) + epoch * dataset.num_rows
    return epoch_order(dataset.num_rows, seed, epoch, shuffle)


class MemorySource:
    """Rows of a dataset held in memory (shared from the object store, or copied to the device
    once when they fit there), by row index."""

    wait_s = 0.0  # rows in memory are always there

    def __init__(self, dataset: Dataset, device: torch.device) -> None:
        self.device = data_device(dataset.features.nbytes + dataset.targets.nbytes, device)
        self.features, self.targets = (tensor.to(self.device) for tensor in dataset.tensors())

    def rows(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        indices = indices.to(self.device)
        return self.features[indices], self.targets[indices]


class StreamSource:
    """Rows of a streamed dataset, by stream index, from the reader's windows: the window being
    read from and the next (requested ahead) are mapped here, older ones released."""

    def __init__(self, dataset: StreamDataset, reader, seed: int, shuffle: bool) -> None:
        self.dataset, self.reader, self.seed, self.shuffle = dataset, reader, seed, shuffle
        self.epoch: int | None = None
        self.starts = torch.zeros(1, dtype=torch.int64)
        self.requested: dict[int, object] = {}
        self.mapped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.wait_s = 0.0  # blocked until a window arrived: the data wait

    def rows(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of a contiguous run of stream indices: every worker's slice of a global batch,
        and every micro-batch, is one (``epoch_indices`` counts up), so rows are window views."""
        first, last = int(indices[0]), int(indices[-1])
        if last - first != len(indices) - 1:
            raise ValueError(f"stream indices must be a contiguous run, got {len(indices)} from {first} to {last}")
        epoch = first // self.dataset.num_rows
        self._enter(epoch)
        start = first - epoch * self.dataset.num_rows
        return self._span(start, start + len(indices))

    def _span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``start`` to ``end`` (exclusive): one window's slice, or the pieces of two."""
        pieces = []
        while start < end:
            k = int(torch.searchsorted(self.starts, start, right=True)) - 1
            stop = min(end, int(self.starts[k + 1]))
            features, targets = self._window(k)
            offset = int(self.starts[k])
            pieces.append((features[start - offset : stop - offset], targets[start - offset : stop - offset]))
            start = stop
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat([f for f, _ in pieces]), torch.cat([t for _, t in pieces])

    def _enter(self, epoch: int) -> None:
        if epoch == self.epoch:
            return
        self.epoch, self.requested, self.mapped = epoch, {}, {}
        self.starts = window_starts(self.dataset, self.seed, epoch, self.shuffle)

    def _window(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if k not in self.mapped:
            import ray

            for wanted in (k, k + 1):  # ask for the next one now: it arrives while this is consumed
                if wanted < len(self.starts) - 1 and wanted not in self.requested:
                    self.requested[wanted] = self.reader.window.remote(self.epoch, wanted)
            began = time.perf_counter()
            try:
                [ref] = ray.get(self.requested[k], timeout=READER_TIMEOUT_S)
                self.mapped[k] = _as_tensors(ray.get(ref, timeout=READER_TIMEOUT_S))
            except ray.exceptions.GetTimeoutError:
                raise Failure(
                    f"the stream's reader did not deliver window {k} of epoch {self.epoch + 1} within "
                    f"{READER_TIMEOUT_S:g} s (--data on slow or unreachable storage?)"
                ) from None
            self.wait_s += time.perf_counter() - began
            for old in [w for w in self.mapped if w < k - 1]:
                del self.mapped[old], self.requested[old]
        return self.mapped[k]


def _as_tensors(arrays) -> tuple[torch.Tensor, torch.Tensor]:
    import warnings

    with warnings.catch_warnings():
        # Object-store arrays are read-only and shared by a node's processes; training only reads them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return tuple(torch.from_numpy(array) for array in arrays)


def open_source(dataset, reader, seed: int, shuffle: bool, device: torch.device):
    """Rows by the indices ``epoch_indices`` gives: streamed rows arrive on the CPU, rows in
    memory on ``device`` (where they were put once)."""
    if isinstance(dataset, StreamDataset):
        return StreamSource(dataset, reader, seed, shuffle)
    return MemorySource(dataset, device)
