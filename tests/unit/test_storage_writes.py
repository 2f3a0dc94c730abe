"""Storage writes are whole or absent: a failed write leaves no temporary file and names its target."""

from __future__ import annotations

import errno

import pytest

from ray_jobs.data import storage
from ray_jobs.errors import os_error_line


def test_a_failed_write_leaves_nothing_and_names_the_target_and_the_cause(tmp_path):
    target = str(tmp_path / "run" / "model.pt")

    def full(stream):
        stream.write(b"half")
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    with pytest.raises(OSError) as raised:
        storage.write(target, full)
    assert os_error_line(raised.value) == f"{target}: No space left on device"
    assert list((tmp_path / "run").iterdir()) == []

    def interrupted(stream):
        stream.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        storage.write(target, interrupted)
    assert list((tmp_path / "run").iterdir()) == []


def test_files_written_together_land_together_or_not_at_all(tmp_path):
    targets = [str(tmp_path / "out" / name) for name in ("train.parquet", "val.parquet", "tokenizer.json")]

    def half(streams):
        streams[0].write(b"rows")
        streams[1].write(b"rows")
        raise ValueError("the text has 3 tokens")

    with pytest.raises(ValueError):
        storage.write_many(targets, half)
    assert list((tmp_path / "out").iterdir()) == []

    def full(streams):
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    with pytest.raises(OSError) as raised:
        storage.write_many(targets, full)
    assert os_error_line(raised.value) == f"{targets[0]}: No space left on device"
    assert list((tmp_path / "out").iterdir()) == []

    storage.write_many(targets, lambda streams: [stream.write(name.encode()) for stream, name in zip(streams, "abc")])
    assert [open(target).read() for target in targets] == ["a", "b", "c"]
