"""Small file I/O over local paths and pyarrow.fs URIs (s3://, gs://), used for run outputs."""
from __future__ import annotations

import os

import pyarrow.fs as pafs


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    return pafs.FileSystem.from_uri(uri)


def absolute(uri: str) -> str:
    """A storage path as Ray's RunConfig wants it: an absolute local path or an unchanged URI."""
    return uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def read_bytes(uri: str) -> bytes:
    filesystem, path = resolve(uri)
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        raise FileNotFoundError(uri)
    with filesystem.open_input_stream(path) as stream:
        return stream.read()


def write_bytes(uri: str, data: bytes) -> None:
    """Write via a temporary name and a move, so a crash never leaves a half-written file."""
    filesystem, path = resolve(uri)
    filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    partial = path + ".partial"
    with filesystem.open_output_stream(partial) as stream:
        stream.write(data)
    filesystem.move(partial, path)


def exists(uri: str) -> bool:
    filesystem, path = resolve(uri)
    return filesystem.get_file_info(path).type != pafs.FileType.NotFound


def check_writable(uri: str) -> None:
    """Fail before training, not after it, when the run directory cannot be written."""
    probe = join(uri, ".raypar-write-test")
    try:
        write_bytes(probe, b"ok")
        filesystem, path = resolve(probe)
        filesystem.delete_file(path)
    except OSError as error:
        raise ValueError(f"--storage-path {uri} is not writable ({str(error).splitlines()[0]})") from None


def list_dir(uri: str) -> list[str]:
    """Names directly under ``uri``; empty when it does not exist."""
    filesystem, path = resolve(uri)
    if filesystem.get_file_info(path).type != pafs.FileType.Directory:
        return []
    return sorted(info.base_name for info in filesystem.get_file_info(pafs.FileSelector(path)))


def delete_dir(uri: str) -> None:
    filesystem, path = resolve(uri)
    filesystem.delete_dir(path)


def delete_file(uri: str) -> None:
    """Delete a file if it exists."""
    filesystem, path = resolve(uri)
    if filesystem.get_file_info(path).type == pafs.FileType.File:
        filesystem.delete_file(path)
