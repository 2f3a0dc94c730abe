"""Text to language-model training data: ``python -m ray_jobs.data tokenize`` (see ``tokenize``).

Documents are read a piece at a time (``documents``), encoded in batches, joined by end-of-text,
and cut into rows of ``T+1`` tokens that are written a row group at a time: memory holds a batch
of text and a row group of tokens, whatever the corpus's size. A BPE tokenizer is trained first,
in a pass of its own over the same text.

Row ``i`` of a split is ``stream[i*T : i*T+T+1]`` of that split's token stream: consecutive rows
share one token, so a row gives input ``tokens[:-1]`` and target ``tokens[1:]`` and every token
after the first is a target exactly once. The tail that does not fill a row is dropped (and
reported).
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ray_jobs.data import storage
from ray_jobs.data.documents import Corpus, input_files
from ray_jobs.data.parquet import ROW_GROUP_ROWS
from ray_jobs.data.tokenizer import (
    BYTE_VOCAB,
    KINDS,
    TOKENIZER_FILE,
    TOKENS_COLUMN,
    ByteTokenizer,
    Tokenizer,
    check_vocab_size,
    read_pretrained_tokenizer,
    schema_metadata,
    train_bpe,
)

TRAIN_FILE, VAL_FILE = "train.parquet", "val.parquet"
BPE_VOCAB = 4096  # --vocab-size for bpe when none is given: small enough for a few MB of text
# --bpe-sample-bytes: the text bpe learns its merges from, at most (a 10 GB corpus's merges are
# learned from 100 MB of it, spread over its files); a smaller corpus is read whole, as before.
BPE_SAMPLE_BYTES = 100_000_000
# --val-fraction holds out whole documents, or, of a longer one, whole spans of this many blocks:
# a corpus that is one long file (tinyshakespeare) still gets a held-out split spread through it.
SPAN_BLOCKS = 64
# Characters of text encoded per batch: the bpe library spreads a batch over every core.
# (stdlib *.py on 2 cores: 1 MiB batches encoded 1.3M bpe tokens in 2.7 s, one batch of it all in 1.6 s.)
BATCH_CHARS = 4 << 20
# A row group holds at most this many tokens (16 MiB of int32) at large block sizes.
ROW_GROUP_TOKENS = 1 << 22
# tokenize --ray: a shard holds whole row groups up to this many tokens (512 MiB of int32).
SHARD_TOKENS = 1 << 27
LARGE_INPUT_BYTES = 64 << 20  # progress lines on stderr for input this large even when it is not a terminal
PROGRESS_REDRAW_S, PROGRESS_LINE_S = 0.5, 10.0  # a terminal's line is redrawn this often; a log gets a line


@dataclass
class SplitReport:
    file: str
    """Its file, or (--ray) its shards' directory, under the output."""
    rows: int = 0
    tokens: int = 0
    """Tokens of this split's stream, end-of-text included."""
    dropped: int = 0
    """Tokens at the stream's end that did not fill a row."""
    shards: int = 0
    """--ray: the files its rows are in."""


@dataclass
class TokenizeReport:
    tokenizer: Tokenizer
    files: int
    input_bytes: int
    documents: int
    seconds: float
    splits: list[SplitReport]
    replaced: dict[str, int] = field(default_factory=dict)
    skipped: int = 0
    train_seconds: float = 0.0
    """Of ``seconds``, training the bpe tokenizer."""
    asked_vocab: int = 0
    """--vocab-size (bpe): the trained vocabulary is smaller when the text has fewer merges."""

    @property
    def tokens(self) -> int:
        return sum(split.tokens for split in self.splits)


def default_row_group_rows(block_size: int) -> int:
    """``ROW_GROUP_ROWS`` rows, fewer at large block sizes so a row group stays near 16 MiB."""
    return max(1, min(ROW_GROUP_ROWS, ROW_GROUP_TOKENS // (block_size + 1)))


class TokenRows:
    """One split's token stream, cut into rows of ``T+1`` as it arrives and written a row group at
    a time; the rows' last token stays pending as the next row's first."""

    def __init__(self, writer: pq.ParquetWriter, report: SplitReport, block_size: int, row_group_rows: int) -> None:
        self.writer, self.report, self.block_size, self.row_group_rows = writer, report, block_size, row_group_rows
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0

    def add(self, ids: np.ndarray) -> None:
        # A span is a view of its whole piece's ids (a 4 MiB text's): kept as it is, a held-out
        # span pinned its piece until the split's next row group (a 103 MB file: 910 MB resident).
        self.pending.append(ids.copy() if ids.base is not None else ids)
        self.pending_tokens += len(ids)
        self.report.tokens += len(ids)
        if self.pending_tokens >= self.row_group_rows * self.block_size + 1:
            self._write(self.row_group_rows)

    def close(self) -> None:
        """Write the full rows left; the tokens after them are dropped."""
        full = max(0, (self.pending_tokens - 1) // self.block_size)
        if full:
            self._write(full)
        self.report.dropped = self.pending_tokens - (1 if self.report.rows else 0)

    def _write(self, num_rows: int) -> None:
        stream, width = np.concatenate(self.pending), self.block_size + 1
        rows = np.lib.stride_tricks.sliding_window_view(stream[: num_rows * self.block_size + 1], width)
        offsets = pa.array(np.arange(0, num_rows * width + 1, width, dtype=np.int32))
        tokens = pa.ListArray.from_arrays(offsets, pa.array(rows[:: self.block_size].reshape(-1)))
        self.writer.write_table(pa.Table.from_arrays([tokens], schema=self.writer.schema), row_group_size=num_rows)
        self.report.rows += num_rows
        rest = stream[num_rows * self.block_size :].copy()  # the last row's last token starts the next row
        self.pending, self.pending_tokens = [rest], len(rest)


class Progress:
    """``tokenize: 42% of 1.2 GB, 3.4M tokens/s`` on stderr: redrawn on a terminal, a line every
    ``10 s`` otherwise, and only for large input when stderr is not a terminal."""

    def __init__(self, corpus: Corpus, out: TextIO = sys.stderr) -> None:
        self.corpus, self.out, self.tty = corpus, out, out.isatty()
        self.enabled = self.tty or corpus.total_bytes >= LARGE_INPUT_BYTES
        self.every_s = PROGRESS_REDRAW_S if self.tty else PROGRESS_LINE_S
        self.start = self.shown = time.monotonic()
        self.what = ""

    def begin(self, what: str) -> None:
        """A new phase: its lines say ``what``, its rate counts from now."""
        self.what, self.start = what, time.monotonic()

    def show(self, tokens: int | None = None, now: bool = False) -> None:
        """The phase's progress, at most every ``every_s`` unless ``now``."""
        time_s = time.monotonic()
        if not self.enabled or (time_s - self.shown < self.every_s and not now):
            return
        self.shown = time_s
        share = self.corpus.done_bytes / max(self.corpus.total_bytes, 1)
        line = f"{self.what}: {share:.0%} of {_size(self.corpus.total_bytes)}"
        if tokens is not None:  # encoding: its documents, rate and time left, by the bytes still to read
            seconds = max(time_s - self.start, 1e-9)
            line += f", {self.corpus.documents:,} documents, {tokens / seconds / 1e6:.2f}M tokens/s"
            if 0 < share < 1:
                line += f", ETA {_duration(seconds * (1 - share) / share)}"
        self.out.write(f"\r{line}\033[K" if self.tty else f"{line}\n")
        self.out.flush()

    def done(self) -> None:
        if self.enabled and self.tty:
            self.out.write("\r\033[K")
            self.out.flush()


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def _size(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    raise AssertionError("unreachable")


def check_flags(kind: str, vocab_size: int | None, block_size: int, val_fraction: float, row_group_rows: int) -> int:
    """The flags' own checks; returns the vocabulary size asked for."""
    if block_size < 1:
        raise ValueError(f"--block-size must be at least 1, got {block_size}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if row_group_rows < 1:
        raise ValueError(f"--row-group-rows must be at least 1, got {row_group_rows}")
    if kind not in KINDS:  # a pretrained tokenizer's file: its vocabulary is its own
        if vocab_size is not None:
            raise ValueError(f"--vocab-size is for a tokenizer raypar trains; --tokenizer {kind} has its own")
        return 0
    if kind == "byte":
        if vocab_size not in (None, BYTE_VOCAB):
            raise ValueError(
                f"--vocab-size {vocab_size}: the byte tokenizer's vocabulary is {BYTE_VOCAB} (256 bytes and "
                "end-of-text); for another size train one with --tokenizer bpe"
            )
        return BYTE_VOCAB
    vocab_size = BPE_VOCAB if vocab_size is None else vocab_size
    check_vocab_size(vocab_size)
    return vocab_size


@dataclass
class Options:
    """``tokenize``'s settings beside its inputs, output and block size (the command's flags)."""

    kind: str = "byte"
    vocab_size: int | None = None
    text_column: str = "text"
    val_fraction: float = 0.0
    seed: int = 0
    row_group_rows: int | None = None
    bpe_sample_bytes: int = BPE_SAMPLE_BYTES


class Job:
    """What both ways of tokenizing share: the checks, the corpus and its tokenizer (trained here
    for bpe), the splits' rows and router, and the report."""

    def __init__(self, inputs: list[str], output: str, block_size: int, options: Options, progress_out: TextIO):
        self.options, self.block_size = options, block_size
        self.row_group_rows = options.row_group_rows or default_row_group_rows(block_size)
        self.asked_vocab = check_flags(
            options.kind, options.vocab_size, block_size, options.val_fraction, self.row_group_rows
        )
        check_output(output)
        self.start = time.monotonic()
        self.corpus = Corpus(input_files(inputs, exclude=output), options.text_column)
        self.corpus.check()
        self.progress = Progress(self.corpus, progress_out)
        self.tokenizer = make_tokenizer(
            options.kind, self.asked_vocab, self.corpus, self.progress, options.bpe_sample_bytes
        )
        self.train_seconds = time.monotonic() - self.start if options.kind == "bpe" else 0.0
        self.schema = pa.schema(
            [pa.field(TOKENS_COLUMN, pa.list_(pa.int32()))], metadata=schema_metadata(self.tokenizer)
        )
        self.splits: list[SplitReport] = []

    def router(self, writers: list, names: list[str]) -> tuple[Router, list[TokenRows]]:
        """Each split's rows, written to its writer, and the router that feeds them."""
        self.splits = [SplitReport(name) for name in names]
        rows = [TokenRows(w, split, self.block_size, self.row_group_rows) for w, split in zip(writers, self.splits)]
        holdout = Holdout(self.options.val_fraction, self.options.seed)
        return Router(rows, holdout, self.block_size * SPAN_BLOCKS, self.tokenizer.eot_id), rows

    def close(self, rows: list[TokenRows]) -> None:
        """The rows left written, and the splits checked."""
        for split_rows in rows:
            split_rows.close()
        check_rows(self.splits, self.block_size, self.options.val_fraction)

    def report(self) -> TokenizeReport:
        return TokenizeReport(
            tokenizer=self.tokenizer,
            files=len(self.corpus.files),
            input_bytes=self.corpus.total_bytes,
            documents=self.corpus.documents,
            seconds=time.monotonic() - self.start,
            splits=self.splits,
            replaced=self.corpus.replaced,
            skipped=self.corpus.skipped,
            train_seconds=self.train_seconds,
            asked_vocab=self.asked_vocab,
        )


def tokenize(
    inputs: list[str], output: str, block_size: int, *, progress_out: TextIO = sys.stderr, **options
) -> TokenizeReport:
    """Tokenize ``inputs`` into ``output``/train.parquet (and val.parquet with ``val_fraction``) and
    ``output``/tokenizer.json, all three or none; ``ValueError`` for bad input, in one line.
    ``options``: ``Options``' fields.

    ``val_fraction`` holds out that share of whole documents (of a longer one, of its spans of
    ``SPAN_BLOCKS`` blocks): every ``1/f``-th in input order, from a starting point drawn from ``seed``
    (``Holdout``); the same input and seed give the same split. A bpe tokenizer learns its merges
    from ``bpe_sample_bytes`` of the text (``Corpus.sample``)."""
    job = Job(inputs, output, block_size, Options(**options), progress_out)
    names = [TRAIN_FILE, VAL_FILE] if job.options.val_fraction else [TRAIN_FILE]

    def write(streams: list) -> None:
        with contextlib.ExitStack() as stack:  # each writer closed (a failure's too) before its stream
            writers = [stack.enter_context(pq.ParquetWriter(stream, job.schema)) for stream in streams[:-1]]
            router, rows = job.router(writers, names)
            _encode(job.corpus, job.tokenizer, router, job.progress)
            job.close(rows)
        streams[-1].write(job.tokenizer.to_json().encode())

    storage.write_many([storage.join(output, name) for name in [*names, TOKENIZER_FILE]], write)
    if not job.options.val_fraction:  # a val split of an earlier run would no longer match this tokenizer
        storage.delete_file(storage.join(output, VAL_FILE))
    return job.report()


def check_output(output: str) -> None:
    filesystem, path = storage.resolve(output)
    if filesystem.get_file_info(path).type == pafs.FileType.File:
        raise ValueError(f"--output {output} is a file: name a directory to write train.parquet and tokenizer.json in")


def make_tokenizer(kind: str, vocab_size: int, corpus: Corpus, progress: Progress, sample_bytes: int) -> Tokenizer:
    """``--tokenizer``'s: bytes, a bpe trained on ``sample_bytes`` of the corpus, or a pretrained one."""
    if kind == "byte":
        return ByteTokenizer()
    if kind != "bpe":
        return read_pretrained_tokenizer(kind)
    if sample_bytes < 1:
        raise ValueError(f"--bpe-sample-bytes must be at least 1, got {sample_bytes}")
    return train_bpe(_training_texts(corpus, progress, sample_bytes), vocab_size)


def _training_texts(corpus: Corpus, progress: Progress, sample_bytes: int) -> Iterator[str]:
    progress.begin("training bpe: reading")
    for text in corpus.sample(sample_bytes):
        progress.show()
        yield text
    progress.begin("training bpe: learning the merges")  # the library's own work, after the reading
    progress.show(now=True)


class Holdout:
    """Which split each unit (a document, or a long one's span) goes to: systematic sampling, unit
    ``k`` held out when ``floor((k+1) f + phase)`` passes ``floor(k f + phase)``, the phase drawn
    from the seed. So ``n`` units hold out ``floor(n f + phase)`` of them, evenly spread, at least
    one once ``n f >= 1`` (independent draws held out none of 12 units one time in four at f = 0.1)."""

    def __init__(self, fraction: float, seed: int) -> None:
        self.fraction, self.phase, self.units = fraction, random.Random(seed).random(), 0

    def next_split(self) -> int:
        if not self.fraction:
            return 0
        k, self.units = self.units, self.units + 1
        return int(math.floor((k + 1) * self.fraction + self.phase) > math.floor(k * self.fraction + self.phase))


class Router:
    """Each piece's ids to its split, end-of-text after each document: a new document, or a long
    one's next span of ``span_tokens``, draws its split from ``holdout``. Pieces of one document may
    come in any sizes: the spans are cut from the document's ids as they arrive."""

    def __init__(self, rows: list[TokenRows], holdout: Holdout, span_tokens: int, eot_id: int) -> None:
        self.rows, self.holdout, self.span_tokens = rows, holdout, span_tokens
        self.eot = np.array([eot_id], dtype=np.int32)
        self.split, self.span_left, self.starts_document = 0, 0, True

    def add(self, ids: np.ndarray, ends_document: bool) -> None:
        while len(ids) or (ends_document and self.starts_document):  # an empty document still gets its end
            if self.starts_document or self.span_left == 0:  # a new document, or a long one's next span
                self.split, self.span_left, self.starts_document = self.holdout.next_split(), self.span_tokens, False
            taken = ids[: self.span_left]
            self.rows[self.split].add(taken)
            self.span_left -= len(taken)
            ids = ids[len(taken) :]
        if ends_document:
            self.rows[self.split].add(self.eot)  # with the document's last span
            self.starts_document = True

    @property
    def tokens(self) -> int:
        return sum(row.report.tokens for row in self.rows)


def _encode(corpus: Corpus, tokenizer: Tokenizer, router: Router, progress: Progress) -> None:
    """One pass: every piece encoded (in batches) and routed."""
    progress.begin("tokenize")
    for batch in text_batches(corpus.pieces()):
        for ids, (_, ends_document) in zip(tokenizer.encode_batch([text for text, _ in batch]), batch):
            router.add(ids, ends_document)
        progress.show(router.tokens)
    progress.done()


def text_batches(pieces: Iterator[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    batch, chars = [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[0])
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def check_rows(splits: list[SplitReport], block_size: int, val_fraction: float) -> None:
    train, block = splits[0], f"one block of {block_size + 1} (--block-size {block_size})"
    if not train.rows and not (val_fraction and splits[1].tokens):
        raise ValueError(
            f"the text has {train.tokens:,} tokens, fewer than {block}: give more text or a smaller --block-size"
        )
    if not train.rows:
        raise ValueError(
            f"the training split has {train.tokens:,} of the text's {train.tokens + splits[1].tokens:,} tokens, fewer "
            f"than {block} after --val-fraction {val_fraction}: give more text, a smaller --block-size or fraction"
        )
    if val_fraction and not splits[1].rows:
        raise ValueError(
            f"--val-fraction {val_fraction} held out {splits[1].tokens:,} tokens, fewer than {block}: "
            "give a larger fraction, more text or a smaller --block-size"
        )


def report_lines(report: TokenizeReport, output: str, block_size: int) -> list[str]:
    """The human summary of a finished job."""
    tokenizer, encoding_s = report.tokenizer, max(report.seconds - report.train_seconds, 1e-9)
    trained = f", bpe trained in {report.train_seconds:.1f} s" if tokenizer.kind == "bpe" else ""
    rate = report.tokens / encoding_s / 1e6
    short = ""
    if tokenizer.vocab_size < report.asked_vocab:
        short = f" (of --vocab-size {report.asked_vocab:,}: the text has no more merges)"
    lines = [
        f"[raypar] tokenized {report.documents:,} documents from {report.files:,} files ({_size(report.input_bytes)}) "
        f"in {report.seconds:.1f} s: {report.tokens:,} tokens, {rate:.2f}M tokens/s{trained}",
        f"  tokenizer: {tokenizer.kind}, vocabulary {tokenizer.vocab_size:,}{short} (end-of-text {tokenizer.eot_id}) "
        f"-> {storage.join(output, TOKENIZER_FILE)}",
    ]
    for split in report.splits:
        dropped = f"; its last {split.dropped:,}, less than a row, dropped" if split.dropped else ""
        shards = f" ({split.shards} shard{'s' if split.shards > 1 else ''})" if split.shards else ""
        lines.append(
            f"  {split.rows:,} rows of {block_size + 1} tokens ({split.tokens:,} tokens{dropped}) "
            f"-> {storage.join(output, split.file)}{shards}"
        )
    if report.replaced:
        worst = sorted(report.replaced.items(), key=lambda item: -item[1])[:3]
        named = ", ".join(f"{path} ({count:,})" for path, count in worst)
        more = f" and {len(report.replaced) - 3} more" if len(report.replaced) > 3 else ""
        lines.append(
            f"  replaced {sum(report.replaced.values()):,} bytes that are not UTF-8 with U+FFFD in "
            f"{len(report.replaced):,} files: {named}{more}"
        )
    if report.skipped:
        lines.append(f"  skipped {report.skipped:,} records whose text is null")
    return lines
