"""The documents a tokenizing job reads: ``--input`` expanded to files, and each file read a piece
at a time, never whole, so a corpus larger than memory streams through.

A file's kind is its suffix (``.gz`` read through gzip): ``.parquet`` is a table with a text
column, each row one document; ``.jsonl``, ``.ndjson`` and ``.json`` are JSON Lines, each line an
object holding the text (C4 ships ``.json.gz`` in this form); anything else is one UTF-8 text
document. Bytes that are not UTF-8 become U+FFFD, one per bad byte, and are counted per file: a
corpus with a few stray bytes still tokenizes, and the report says where they were.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import io
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ray_jobs.data import storage

JSON_LINES = (".jsonl", ".ndjson", ".json")
PARQUET = ".parquet"
# A text file is handed on in pieces of about this many bytes, cut after a line end: a 10 GB file
# never sits in memory whole. BPE merges never span a cut; the byte tokenizer's ids are the same.
TEXT_PIECE_BYTES = 4 << 20
PARQUET_BATCH_ROWS = 1024
GLOB_CHARS = re.compile(r"[*?\[]")
# surrogateescape decodes each byte that is not UTF-8 to one of U+DC80..U+DCFF, which valid UTF-8
# never yields; JSON may spell any lone surrogate (\ud800): every one becomes U+FFFD and is counted.
SURROGATES = re.compile("[\ud800-\udfff]")


def input_files(patterns: list[str], exclude: str | None = None) -> list[str]:
    """Each ``--input`` as files, in order and once each: a file, a directory's files (recursively,
    in name order, hidden names skipped) or a glob (``**`` recursive). Files under ``exclude`` (the
    output directory) are left out, so a re-run does not read its own output."""
    excluded = os.path.realpath(exclude) + os.sep if exclude and "://" not in exclude else None
    files: dict[str, None] = {}
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if "://" in pattern:
            found = _stored_files(pattern)
        elif GLOB_CHARS.search(expanded):
            found = [path for path in sorted(glob.glob(expanded, recursive=True)) if os.path.isfile(path)]
        elif os.path.isdir(expanded):
            found = _walk(expanded)
        elif os.path.isfile(expanded):
            found = [expanded]
        else:
            raise ValueError(f"--input {pattern}: no such file or directory")
        found = [path for path in found if excluded is None or not os.path.realpath(path).startswith(excluded)]
        if not found:
            raise ValueError(f"--input {pattern}: no input files matched")
        files.update(dict.fromkeys(found))
    return list(files)


def _stored_files(uri: str) -> list[str]:
    """A URI's file, or the files under it (recursively, in name order, hidden names skipped), as
    URIs with its query; globs are for local paths."""
    filesystem, path = storage.resolve(uri)
    info = filesystem.get_file_info(path)
    if info.type == pafs.FileType.File:
        return [uri]
    if info.type != pafs.FileType.Directory:
        raise ValueError(f"--input {storage.without_query(uri)}: no such file or directory")
    base = path.rstrip("/") + "/"
    names = sorted(
        found.path[len(base) :]
        for found in filesystem.get_file_info(pafs.FileSelector(path, recursive=True))
        if found.type == pafs.FileType.File
    )
    return [storage.join(uri, name) for name in names if not any(part.startswith(".") for part in name.split("/"))]


def _walk(directory: str) -> list[str]:
    """A directory's files, but not what a folder of sources also holds and no one means as text:
    ``__pycache__`` folders, and binary files (a NUL byte in their first 8 KiB; Parquet and gzip are
    read for what they are). A file named on its own is always read."""
    found = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(name for name in dirs if not name.startswith(".") and name != "__pycache__")
        paths = (os.path.join(root, name) for name in sorted(names) if not name.startswith("."))
        found += [path for path in paths if not _binary(path)]
    return found


def _binary(path: str) -> bool:
    if path.lower().endswith((".gz", PARQUET)):
        return False
    with open(path, "rb") as file:
        return b"\0" in file.read(8192)


def file_kind(path: str) -> str:
    """``parquet``, ``jsonl`` or ``text``, from the name (a ``.gz`` suffix aside)."""
    name = storage.without_query(path).lower().removesuffix(".gz")
    if name.endswith(PARQUET):
        return "parquet"
    return "jsonl" if name.endswith(JSON_LINES) else "text"


@dataclass
class Corpus:
    """The input files and a text column name; read piece by piece, counting what it replaces.

    ``pieces()`` yields ``(text, ends_document)``: a document is one piece or several (a long text
    file). Each pass starts its counts afresh."""

    files: list[str]
    text_column: str = "text"
    total_bytes: int = 0
    done_bytes: int = 0
    """Bytes of the files (as stored) read so far in this pass: for progress."""
    documents: int = 0
    skipped: int = 0
    """Records whose text is null, left out."""
    replaced: dict[str, int] = field(default_factory=dict)
    """Per file, the bad bytes (and lone surrogates) replaced by U+FFFD."""

    def __post_init__(self) -> None:
        self.sizes = {path: file_size(path) for path in self.files}  # asked once: a request each on a bucket
        self.total_bytes = sum(self.sizes.values())

    def check(self) -> None:
        """Every Parquet file has a string text column: refused now, not after a BPE pass."""
        for path in self.files:
            if file_kind(path) == "parquet":
                _text_field(path, self.text_column)

    def pieces(self) -> Iterator[tuple[str, bool]]:
        self.restart()
        for path in self.files:
            yield from self.file_pieces(path)

    def restart(self) -> None:
        """A new pass: the counts from zero."""
        self.done_bytes, self.documents, self.skipped, self.replaced = 0, 0, 0, {}

    def file_pieces(self, path: str, row_group: int | None = None) -> Iterator[tuple[str, bool]]:
        """One file's pieces (of a Parquet file, ``row_group``'s alone), adding to the counts."""
        start = self.done_bytes  # each reader adds its own file's progress to this
        if row_group is not None:
            yield from self._parquet(path, [row_group])
            return
        reader = {"parquet": self._parquet, "jsonl": self._json_lines, "text": self._text}[file_kind(path)]
        yield from reader(path)
        self.done_bytes = start + self.sizes[path]

    def sample(self, limit: int) -> Iterator[str]:
        """About ``limit`` bytes of the text, the same every time: all of it when it is no larger;
        else from each file its first share of ``limit``, in proportion to its size (as stored),
        so every file has its say. Read a piece at a time, so the cut falls after a piece."""
        if self.total_bytes <= limit:
            yield from self.texts()
            return
        self.restart()
        for path in self.files:
            start, size = self.done_bytes, self.sizes[path]
            for text, _ in self.file_pieces(path):
                yield text
                if self.done_bytes - start >= limit * size / self.total_bytes:
                    break
            self.done_bytes = start + size

    def texts(self) -> Iterator[str]:
        return (text for text, _ in self.pieces())

    def _clean(self, text: str, path: str) -> str:
        text, count = SURROGATES.subn("\ufffd", text)
        if count:
            self.replaced[path] = self.replaced.get(path, 0) + count
        return text

    def _text(self, path: str) -> Iterator[tuple[str, bool]]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        carry, start = "", self.done_bytes
        with _open(path) as stream:
            while True:
                block = stream.read(TEXT_PIECE_BYTES)
                text = carry + decoder.decode(block, final=not block)
                if not block:
                    break
                cut = text.rfind("\n") + 1 or len(text)
                carry = text[cut:]
                if cut:
                    yield self._clean(text[:cut], path), False
                self.done_bytes = start + _position(stream)
        self.documents += 1
        yield self._clean(text, path), True

    def _json_lines(self, path: str) -> Iterator[tuple[str, bool]]:
        start = self.done_bytes
        with _open(path) as stream:
            for number, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                text = _record_text(line, f"{path}:{number}", self.text_column)
                self.done_bytes = start + _position(stream)
                if text is None:
                    self.skipped += 1
                    continue
                self.documents += 1
                yield self._clean(text, path), True

    def _parquet(self, path: str, row_groups: list[int] | None = None) -> Iterator[tuple[str, bool]]:
        source = parquet_file(path)
        total, done, start, size = source.metadata.num_rows, 0, self.done_bytes, self.sizes[path]
        _text_field(path, self.text_column, source.schema_arrow)
        if row_groups is not None:  # progress by these groups' rows, their share of the file
            total = sum(source.metadata.row_group(group).num_rows for group in row_groups)
            size = sum(source.metadata.row_group(group).total_byte_size for group in row_groups)
        batches = source.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[self.text_column], row_groups=row_groups)
        for batch in batches:
            done += batch.num_rows
            self.done_bytes = start + size * done // max(total, 1)
            for text in batch.column(0).to_pylist():
                if text is None:
                    self.skipped += 1
                    continue
                self.documents += 1
                yield text, True  # Arrow strings are valid UTF-8 already


def _open(path: str) -> BinaryIO:
    """A file's bytes as stored, ungzipped: a local file, or a URI's through pyarrow."""
    if "://" in path:
        filesystem, where = storage.resolve(path)
        # Seekable, as gzip wants; buffered, for the lines of JSON Lines (pyarrow's file has no readline).
        raw = io.BufferedReader(filesystem.open_input_file(where), buffer_size=1 << 20)
        return gzip.GzipFile(fileobj=raw, mode="rb") if is_gzip(path) else raw
    return gzip.open(path, "rb") if is_gzip(path) else open(path, "rb")


def is_gzip(path: str) -> bool:
    return storage.without_query(path).lower().endswith(".gz")


def file_size(path: str) -> int:
    """Bytes as stored, of a local file or a URI's."""
    if "://" not in path:
        return os.path.getsize(path)
    filesystem, where = storage.resolve(path)
    return filesystem.get_file_info(where).size


def parquet_file(path: str) -> pq.ParquetFile:
    if "://" not in path:
        return pq.ParquetFile(path)
    filesystem, where = storage.resolve(path)
    return pq.ParquetFile(filesystem.open_input_file(where))


def _position(stream: BinaryIO) -> int:
    """Bytes of the file as stored that were read: a gzip stream's compressed offset."""
    raw = getattr(stream, "fileobj", None)  # gzip.GzipFile
    return (raw or stream).tell()


def _record_text(line: bytes, where: str, column: str) -> str | None:
    try:
        record = json.loads(line.decode("utf-8", errors="surrogateescape"))
    except json.JSONDecodeError as error:
        raise ValueError(f"--input {where} is not JSON ({error.msg}, column {error.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"--input {where} is a JSON {type(record).__name__}, not an object with a {column!r} field")
    if column not in record:
        has = ", ".join(list(record)[:10]) or "none"
        raise ValueError(f"--input {where} has no {column!r} field (--text-column); its fields: {has}")
    text = record[column]
    if text is not None and not isinstance(text, str):
        raise ValueError(f"--input {where}: {column!r} is a JSON {type(text).__name__}, not a string")
    return text


def _text_field(path: str, column: str, schema: pa.Schema | None = None) -> None:
    try:
        schema = schema or parquet_file(path).schema_arrow
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(f"--input {path}: not readable as Parquet ({str(error).splitlines()[0]})") from None
    if column not in schema.names:
        raise ValueError(
            f"--input {path} has no column {column!r} (--text-column); its columns: {', '.join(schema.names)}"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise ValueError(f"--input {path}: column {column!r} is {kind}, not a string column")
