"""Small file I/O over local paths and pyarrow.fs URIs (s3://, gs://), used for run outputs.

A URI may carry pyarrow's options as a query (``s3://bucket/runs?endpoint_override=host:9000&scheme=http``,
``?region=...``): path parts are joined before the query, which stays with the URI. A ``Location``
is a URI resolved once on the driver: its filesystem pickles with those options, so a Ray worker
reaches the same place whatever its own environment (``AWS_ENDPOINT_URL`` included).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Union

import pyarrow.fs as pafs


@dataclass(frozen=True)
class Location:
    """A place on a resolved filesystem."""

    filesystem: pafs.FileSystem
    path: str

    def __str__(self) -> str:
        return self.path


Target = Union[str, Location]


def locate(uri: str) -> Location:
    """Resolve ``uri`` now, on this process, into a ``Location`` to hand to other processes."""
    return Location(*resolve(uri))


def resolve(target: Target) -> tuple[pafs.FileSystem, str]:
    if isinstance(target, Location):
        return target.filesystem, target.path
    if "://" not in target:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(target))
    return pafs.FileSystem.from_uri(target)


def absolute(uri: str) -> str:
    """A storage path as an absolute local path or an unchanged URI."""
    return uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))


def join(base: Target, *parts: str) -> Target:
    """``base/part/...``; a URI's query stays at its end."""
    if isinstance(base, Location):
        return Location(base.filesystem, "/".join([base.path.rstrip("/"), *parts]))
    path, query = base.split("?", 1) if "://" in base and "?" in base else (base, None)
    joined = "/".join([path.rstrip("/"), *parts])
    return f"{joined}?{query}" if query is not None else joined


def check_inside(target: str, base: str, flag: str) -> None:
    """Refuse ``target`` unless it resolves to a place strictly inside ``base`` (symbolic links
    followed on local paths, ``.`` and ``..`` collapsed in URIs): a run never writes outside the
    storage path its user gave."""
    if "://" in base:
        scheme, inside = base.split("://", 1)[0], posixpath.normpath(without_query(target).split("://", 1)[1])
        outer = posixpath.normpath(without_query(base).split("://", 1)[1])
        ok = target.startswith(f"{scheme}://") and inside.startswith(outer.rstrip("/") + "/")
    else:
        outer = os.path.realpath(base)
        ok = os.path.realpath(target).startswith(outer.rstrip(os.sep) + os.sep)
    if not ok:
        raise ValueError(f"{flag}: {without_query(target)} is not inside the storage path {without_query(base)}")


def without_query(uri: str) -> str:
    """``uri`` as a user reads it, without pyarrow's options."""
    return uri.split("?", 1)[0]


def read_bytes(target: Target) -> bytes:
    filesystem, path = resolve(target)
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        raise FileNotFoundError(str(target))
    with filesystem.open_input_stream(path) as stream:
        return stream.read()


def read_range(target: Target, offset: int, length: int) -> bytes:
    """``length`` bytes from ``offset`` (fewer at the file's end): a file's header without the file."""
    filesystem, path = resolve(target)
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        raise FileNotFoundError(str(target))
    with filesystem.open_input_file(path) as stream:
        return stream.read_at(length, offset)


def write(target: Target, writer: Callable[[object], None]) -> None:
    """Call ``writer(stream)`` on a temporary name, then move it into place, so a crash never
    leaves a half-written file and a large object is serialised straight into the stream. A
    write that fails (no space left, no permission, a vanished directory) removes its temporary
    file and raises an ``OSError`` naming the target, in one line."""
    filesystem, path = resolve(target)
    partial = path + ".partial"
    try:
        filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with filesystem.open_output_stream(partial) as stream:
            writer(stream)
        filesystem.move(partial, path)
    except BaseException as error:  # the writer's own errors and an interrupt leave nothing either
        with contextlib.suppress(OSError):
            filesystem.delete_file(partial)
        if isinstance(error, OSError):
            raise OSError(error.errno, _os_reason(error), _shown(target)) from error
        raise


def write_many(targets: list[Target], writer: Callable[[list], None]) -> None:
    """``write`` for several files written together (a dataset's splits and its tokenizer): each is
    written under a temporary name, and only when ``writer(streams)`` returns are they moved into
    place, one after another; a failure removes every temporary file and raises as ``write`` does,
    naming the first target."""
    resolved = [resolve(target) for target in targets]
    partials = [(filesystem, path + ".partial") for filesystem, path in resolved]
    try:
        with contextlib.ExitStack() as stack:
            streams = []
            for filesystem, partial in partials:
                filesystem.create_dir(partial.rsplit("/", 1)[0], recursive=True)
                streams.append(stack.enter_context(filesystem.open_output_stream(partial)))
            writer(streams)
        for (filesystem, partial), (_, path) in zip(partials, resolved):
            filesystem.move(partial, path)
    except BaseException as error:  # the writer's own errors and an interrupt leave nothing either
        for filesystem, partial in partials:
            with contextlib.suppress(OSError):
                filesystem.delete_file(partial)
        if isinstance(error, OSError):
            raise OSError(error.errno, _os_reason(error), _shown(targets[0])) from error
        raise


def _os_reason(error: OSError) -> str:
    """What the system said, without pyarrow's wrapping: ``No space left on device``."""
    if error.errno:
        return os.strerror(error.errno)
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _shown(target: Target) -> str:
    return without_query(target) if isinstance(target, str) else f"{target.path}"


def write_bytes(target: Target, data: bytes) -> None:
    write(target, lambda stream: stream.write(data))


def exists(target: Target) -> bool:
    filesystem, path = resolve(target)
    return filesystem.get_file_info(path).type != pafs.FileType.NotFound


def check_writable(uri: str) -> None:
    """Fail before training, not after it, when the run directory cannot be written."""
    probe = join(uri, ".raypar-write-test")
    try:
        write_bytes(probe, b"ok")
        filesystem, path = resolve(probe)
        filesystem.delete_file(path)
    except OSError as error:
        raise ValueError(
            f"--storage-path {without_query(uri)} is not writable ({str(error).splitlines()[0]})"
        ) from None


def _entries(target: Target) -> list[pafs.FileInfo]:
    """What lies directly under ``target``; empty when it is not a directory."""
    filesystem, path = resolve(target)
    if filesystem.get_file_info(path).type != pafs.FileType.Directory:
        return []
    return filesystem.get_file_info(pafs.FileSelector(path))


def list_dir(target: Target) -> list[str]:
    """Names directly under ``target``; empty when it does not exist."""
    return sorted(info.base_name for info in _entries(target))


def file_sizes(target: Target) -> dict[str, int]:
    """The files directly under ``target`` and their sizes in bytes; empty when it does not exist."""
    return {info.base_name: info.size for info in _entries(target) if info.type == pafs.FileType.File}


def delete_dir(target: Target) -> None:
    filesystem, path = resolve(target)
    filesystem.delete_dir(path)


def delete_file(target: Target) -> None:
    """Delete a file if it exists."""
    filesystem, path = resolve(target)
    if filesystem.get_file_info(path).type == pafs.FileType.File:
        filesystem.delete_file(path)


@contextlib.contextmanager
def local_directory(target: Target) -> Iterator[str]:
    """``target`` as a local directory: itself on local storage, else a temporary copy."""
    filesystem, path = resolve(target)
    if isinstance(filesystem, pafs.LocalFileSystem):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="raypar-copy-") as local:
        pafs.copy_files(path, local, source_filesystem=filesystem, destination_filesystem=pafs.LocalFileSystem())
        yield local


def upload(path: str, target: Target) -> None:
    """A local file written to ``target`` (``write``: whole or not at all), streamed, never held."""
    with open(path, "rb") as source:
        write(target, lambda stream: shutil.copyfileobj(source, stream, 16 * 2**20))
