"""Streaming ingest (``--ingest stream``): Parquet far larger than memory, read once per epoch.

The driver plans the stream from metadata alone (``stream_plan``). One ``WindowReader`` actor
per run reads order contract v2's windows (``training.stream_windows``) in turn, validates and
permutes each, and puts it in the object store once; every worker or stage on a node maps it from
there (zero-copy numpy), so each row is read from storage once per epoch for the whole cluster and
decoded once. The reader prefetches the next window while the
current one is consumed, and drops its reference to windows behind: a process holds about two
windows of decoded rows, whatever the dataset's size.

Workers address rows by *stream index* ``epoch * num_rows + position``, the position in the
epoch's order: global batches and their slices are cut from it exactly as from ``epoch_order``
in memory, and a source turns indices into rows (``MemorySource``, ``StreamSource``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ray_jobs.data.device_copy import data_device
from ray_jobs.data.order import stream_windows, window_permutation
from ray_jobs.data.parquet import Dataset

# The plan is re-exported (see __all__): the driver, evaluation and the bench import it from here.
from ray_jobs.data.stream_plan import (
    Block,
    Footers,
    StreamDataset,
    decode_block,
    epoch_indices,
    plan_stream,
    read_footers,
    window_at,
    window_starts,
)
from ray_jobs.errors import Failure

# Windows whose object-store reference the reader keeps: the one being consumed, the one before
# (a global batch can straddle them) and the prefetched next.
CACHED_WINDOWS = 3
# How long a worker or stage waits for one window from the reader before the run fails in one
# line. A window is ~65k rows (--shuffle-window-rows), read in seconds even from a bucket: ten
# minutes of silence is a reader that is stuck or storage that does not answer, not a slow read.
READER_TIMEOUT_S = 600.0

__all__ = [
    "CACHED_WINDOWS",
    "READER_TIMEOUT_S",
    "Block",
    "Footers",
    "MemorySource",
    "StreamDataset",
    "StreamSource",
    "WindowReader",
    "decode_block",
    "epoch_indices",
    "open_source",
    "plan_stream",
    "read_footers",
    "reader_stats",
    "start_reader",
    "stream_reader",
    "window_at",
    "window_starts",
]


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


def reader_stats(reader) -> dict[str, int]:
    """``bytes_read`` by the run's reader; nothing without one."""
    if reader is None:
        return {}
    import ray

    return ray.get(reader.stats.remote(), timeout=READER_TIMEOUT_S)


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
