"""``tokenize --ray``: the rows ``tokenize`` writes, with the reading, decoding and encoding spread
over a Ray cluster's CPUs as Ray Data tasks.

The input is cut into units, in input order: a text or JSON Lines file (gzipped or not), or one
row group of a Parquet file. A task reads its unit piece by piece with ``Corpus``'s own readers, so
a long text file is cut into the same pieces, and encodes them in batches; it hands back chunks of
ids with each piece's length and whether it ends a document. Ray Data keeps the units in order
(``preserve_order``), and this process routes the ids through the same ``Router`` and ``TokenRows``
as the single process: the rows, their order, the val split and the tokenizer come out identical.
What stays here is cheap beside encoding: routing, cutting rows, writing them.

The rows are written as shards of whole row groups under temporary names, and moved to their
names (``train/train-00000-of-00002.parquet``, ...) only once every split and the tokenizer are
written: a run that fails or is interrupted leaves no dataset a training run could read.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ray_jobs.data import storage
from ray_jobs.data.documents import Corpus, file_kind, file_size, is_gzip, parquet_file
from ray_jobs.data.tokenized import (
    SHARD_TOKENS,
    TOKENIZER_FILE,
    Job,
    Options,
    Router,
    TokenizeReport,
    text_batches,
)
from ray_jobs.data.tokenizer import tokenizer_from_json

SPLITS = ("train", "val")


def check_cluster_flags(shard_rows: int | None) -> None:
    if shard_rows is not None and shard_rows < 1:
        raise ValueError(f"--shard-rows must be at least 1, got {shard_rows}")


def units(files: list[str]) -> list[dict[str, Any]]:
    """The tasks' work, in input order: each file whole, a Parquet file a row group at a time."""
    found = []
    for path in files:
        if file_kind(path) == "parquet" and not is_gzip(path):
            metadata = parquet_file(path).metadata
            for group in range(metadata.num_row_groups):
                stored = sum(
                    metadata.row_group(group).column(c).total_compressed_size for c in range(metadata.num_columns)
                )
                found.append({"path": path, "row_group": group, "size": stored})
        else:
            found.append({"path": path, "row_group": -1, "size": file_size(path)})
    return found


def tokenize(
    inputs: list[str],
    output: str,
    block_size: int,
    *,
    shard_rows: int | None = None,
    progress_out: TextIO = sys.stderr,
    **options,
) -> TokenizeReport:
    """``tokenized.tokenize``'s rows on the Ray cluster this process joined, as shards under
    ``output``/train and ``output``/val, in shards of ``shard_rows``; ``options``: ``tokenized.Options``' fields."""
    check_cluster_flags(shard_rows)
    job = Job(inputs, output, block_size, Options(**options), progress_out)
    _check_free_cpus()
    names = list(SPLITS[: 2 if job.options.val_fraction else 1])
    with Shards(output, names, job.schema, shard_rows or max(1, SHARD_TOKENS // (block_size + 1))) as shards:
        router, rows = job.router(shards.writers, names)
        job.corpus.restart()
        job.progress.begin("tokenize --ray")
        for chunk in _encoded(units(job.corpus.files), job.tokenizer.to_json(), job.options.text_column):
            _route(chunk, router, job.corpus)
            job.progress.show(router.tokens)
        job.progress.done()
        job.close(rows)
        shards.commit(job.tokenizer.to_json().encode())
    for split, writer in zip(job.splits, shards.writers):
        split.shards = len(writer.partials)
    return job.report()


def _check_free_cpus() -> None:
    """Ray Data's tasks wait, silently and for ever, for a CPU nothing frees (a training job holding
    every one): refused in one line instead."""
    import ray

    if ray.cluster_resources().get("CPU", 0) < 1:
        raise ValueError("the Ray cluster has no CPU for tokenize --ray's tasks: add a node with CPUs")
    if ray.available_resources().get("CPU", 0) < 1:
        raise ValueError(
            "every CPU of the Ray cluster is held (a training job?): tokenize --ray's tasks would wait for "
            "one; run it when CPUs are free, or on a cluster with room"
        )


def _encoded(work: list[dict[str, Any]], tokenizer_json: str, text_column: str):
    """The units' chunks of ids, in the units' order, encoded as Ray Data tasks. A task whose
    process or node dies is run again (Ray Data's own retries); an error in the input is raised."""
    import ray
    from ray.data import DataContext

    previous = DataContext.get_current()
    context = copy.deepcopy(previous)
    context.execution_options.preserve_order = True  # the rows' order is the input's
    context.enable_progress_bars = False  # this command's own progress line says it
    context.print_on_execution_start = False
    # Ray Data reserves a share of the CPUs for each operator; with one map after the items it
    # held the tasks near one at a time (64 tasks on 2 CPUs: 5.3 s of wall for 4.7 s of work;
    # 3.4 s without the reservation).
    context.op_resource_reservation_enabled = False
    quiet = logging.getLogger("ray.data")
    level = quiet.level
    DataContext._set_current(context)
    # Its notes on progress bars and each execution's end, and a failed task's traceback: the
    # cause is this command's one error line.
    quiet.setLevel(logging.CRITICAL)
    try:
        dataset = ray.data.from_items(work, override_num_blocks=len(work)).map_batches(
            _encode_units,
            batch_size=1,
            fn_kwargs={"tokenizer_json": tokenizer_json, "text_column": text_column},
            num_cpus=1,
        )
        yield from dataset.iter_rows()
    except ray.exceptions.RayTaskError as error:
        if isinstance(error.cause, (ValueError, OSError)):  # the input's fault, said by the reader
            raise _as_raised(error.cause) from None
        raise
    finally:
        DataContext._set_current(previous)
        quiet.setLevel(level)


def _as_raised(cause: Exception) -> Exception:
    """The reader's error as it raised it: Ray Data appends its retry settings to the message
    (to the first argument when a string, else as one more)."""
    args = list(cause.args)
    if args and isinstance(args[0], str):
        args[0] = args[0].split("\n", 1)[0]
    elif args and isinstance(args[-1], str) and args[-1].startswith("Failed to apply"):
        args.pop()
    cause.args = tuple(args)
    return cause


def _route(chunk: dict[str, Any], router: Router, corpus: Corpus) -> None:
    """A chunk's pieces through the router, in order, and its unit's counts into the corpus's."""
    ids, offset = chunk["ids"], 0
    for length, ends_document in zip(chunk["lengths"], chunk["ends"]):
        router.add(ids[offset : offset + length], bool(ends_document))
        offset += length
    corpus.documents += int(chunk["documents"])
    corpus.skipped += int(chunk["skipped"])
    if chunk["replaced"]:
        corpus.replaced[chunk["path"]] = corpus.replaced.get(chunk["path"], 0) + int(chunk["replaced"])
    corpus.done_bytes += int(chunk["size"])  # a unit's last chunk carries its size


@functools.lru_cache(maxsize=4)
def _tokenizer(tokenizer_json: str):
    # A task holds one CPU: the bpe library's own threads (one per core by default) would crowd
    # the node's other tasks. Set in the task's worker process, before its first encode.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return tokenizer_from_json(tokenizer_json)


def _encode_units(batch: dict[str, np.ndarray], tokenizer_json: str, text_column: str) -> Iterator[dict[str, list]]:
    """The task: each unit of ``batch`` read a piece at a time (as ``Corpus`` reads it whole) and
    encoded in batches of ``BATCH_CHARS``; one output row per batch, the unit's counts on its last."""
    tokenizer = _tokenizer(tokenizer_json)
    for path, row_group, size in zip(batch["path"], batch["row_group"], batch["size"]):
        corpus = Corpus([str(path)], text_column)
        counted = (0, 0, 0)
        chunks = text_batches(corpus.file_pieces(str(path), None if row_group < 0 else int(row_group)))
        ahead: list | None = next(chunks, [])
        while ahead is not None:
            chunk, now = ahead, (corpus.documents, corpus.skipped, sum(corpus.replaced.values()))
            ahead = next(chunks, None)  # read on, so the last chunk knows it is the last
            ids = tokenizer.encode_batch([text for text, _ in chunk]) if chunk else []
            yield {
                "path": [str(path)],
                "ids": [np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32)],
                "lengths": [np.array([len(piece) for piece in ids], dtype=np.int64)],
                "ends": [np.array([ends for _, ends in chunk], dtype=bool)],
                "documents": [now[0] - counted[0]],
                "skipped": [now[1] - counted[1]],
                "replaced": [now[2] - counted[2]],
                "size": [int(size) if ahead is None else 0],
            }
            counted = now


class ShardWriter:
    """One split's rows as shards of whole row groups, each under a temporary name until
    ``Shards.commit``; what ``TokenRows`` writes to (a ``pq.ParquetWriter``'s two members)."""

    def __init__(self, filesystem: pafs.FileSystem, directory: str, name: str, schema: pa.Schema, rows: int) -> None:
        self.filesystem, self.directory, self.name = filesystem, directory, name
        self.schema, self.shard_rows = schema, rows
        self.partials: list[str] = []
        self._stream = self._writer = None
        self._rows = 0

    def write_table(self, table: pa.Table, row_group_size: int) -> None:
        if self._writer is None:
            self.partials.append(f"{self.directory}/{self.name}-{len(self.partials):05d}.parquet.partial")
            self._stream = self.filesystem.open_output_stream(self.partials[-1])
            self._writer, self._rows = pq.ParquetWriter(self._stream, self.schema), 0
        self._writer.write_table(table, row_group_size=row_group_size)
        self._rows += table.num_rows
        if self._rows >= self.shard_rows:
            self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._stream.close()
            self._stream = self._writer = None

    def finals(self) -> list[str]:
        """The shards' names, now their count is known."""
        count = len(self.partials)
        return [f"{self.directory}/{self.name}-{index:05d}-of-{count:05d}.parquet" for index in range(count)]


class Shards:
    """The splits' shard writers and the tokenizer, moved into place together by ``commit``; leaving
    the block without it (an error, an interrupt) removes every temporary file."""

    def __init__(self, output: str, names: list[str], schema: pa.Schema, shard_rows: int) -> None:
        self.filesystem, self.root = storage.resolve(output)
        self.writers = [ShardWriter(self.filesystem, f"{self.root}/{n}", n, schema, shard_rows) for n in names]
        self.committed = False
        self.created: list[str] = []

    def __enter__(self) -> Shards:
        for directory in [self.root] + [writer.directory for writer in self.writers]:
            if self.filesystem.get_file_info(directory).type == pafs.FileType.NotFound:
                self.created.append(directory)
        for writer in self.writers:
            self.filesystem.create_dir(writer.directory, recursive=True)
        return self

    def __exit__(self, *exc_info) -> None:
        for writer in self.writers:
            with contextlib.suppress(Exception):
                writer.close()
        if self.committed:
            return
        for partial in [p for writer in self.writers for p in writer.partials] + [self._tokenizer_partial]:
            with contextlib.suppress(OSError):
                self.filesystem.delete_file(partial)
        for directory in reversed(self.created):  # what this run made, now empty again
            with contextlib.suppress(OSError):
                if not self.filesystem.get_file_info(pafs.FileSelector(directory)):
                    self.filesystem.delete_dir(directory)

    @property
    def _tokenizer_partial(self) -> str:
        return f"{self.root}/{TOKENIZER_FILE}.partial"

    def commit(self, tokenizer: bytes) -> None:
        """Every shard closed, the tokenizer written, an earlier run's shards (and a val split this
        run has not) removed, then each file moved to its name."""
        for writer in self.writers:
            writer.close()
        with self.filesystem.open_output_stream(self._tokenizer_partial) as stream:
            stream.write(tokenizer)
        for name in SPLITS:
            self._remove_old_shards(f"{self.root}/{name}", name)
        for writer in self.writers:
            for partial, final in zip(writer.partials, writer.finals()):
                self.filesystem.move(partial, final)
        self.filesystem.move(self._tokenizer_partial, f"{self.root}/{TOKENIZER_FILE}")
        self.committed = True

    def _remove_old_shards(self, directory: str, name: str) -> None:
        found = self.filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
        for info in found:
            base = info.base_name
            if base.startswith(f"{name}-") and "-of-" in base and base.endswith(".parquet"):
                self.filesystem.delete_file(info.path)
