"""Streaming ingest before Ray: the driver reads metadata only, picks the ingest mode by size, and
refuses what the metadata can tell is wrong; resharding keeps every row."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_jobs.core.config import TrainConfig
from ray_jobs.data import stream_plan
from ray_jobs.data.__main__ import main as data_main
from ray_jobs.data.parquet import write_table
from ray_jobs.data.stream_plan import StreamDataset
from ray_jobs.driver.prepare import prepare
from tests.helpers import (
    block_rows,
    with_,
)


@pytest.fixture
def cfg(stream_cfg) -> TrainConfig:
    return stream_cfg


def test_the_driver_reads_metadata_only(cfg, monkeypatch, capsys):
    def whole_read(*args, **kwargs):
        raise AssertionError("a whole-table read in stream mode")

    monkeypatch.setattr(pq, "read_table", whole_read)
    monkeypatch.setattr(pq.ParquetFile, "read", whole_read)
    dataset = prepare(cfg, "ddp").dataset
    assert isinstance(dataset, StreamDataset) and dataset.num_rows == 120
    assert dataset.block_rows == block_rows(cfg.data) == [7] * 5 + [5] + [16] * 3 + [8] + [5] * 4 + [4]
    assert "[raypar] ingest: stream (--ingest stream)" in capsys.readouterr().out


def test_auto_ingest_picks_by_uncompressed_size(cfg, capsys, monkeypatch):
    read_metadata = stream_plan._metadata
    assert prepare(with_(cfg, ingest="auto"), "ddp").dataset.ingest == "memory"
    assert (
        "ingest: memory (the data is 0.0 MiB uncompressed, at most --memory-ingest-limit-mb 1024)"
        in capsys.readouterr().out
    )
    footers = []
    monkeypatch.setattr(
        stream_plan, "_metadata", lambda filesystem, file: footers.append(file) or read_metadata(filesystem, file)
    )
    assert (
        prepare(with_(cfg, ingest="auto", memory_ingest_limit_mb=0.001, name="small"), "ddp").dataset.ingest == "stream"
    )
    assert len(footers) == len(set(footers)) == 3  # each file's footer read once, for the size and the plan


def test_what_the_metadata_can_tell_is_found_before_training(tmp_path, cfg):
    write_table(pa.table({"features": [[1.0, 2.0]], "target": [[1.0]]}), str(tmp_path / "a.parquet"))
    write_table(pa.table({"features": [[1.0, 2.0]], "target": pa.array([1], pa.int64())}), str(tmp_path / "b.parquet"))
    with pytest.raises(ValueError, match=r"the files' schemas differ: .*a.parquet has .*b.parquet has"):
        prepare(with_(cfg, data=str(tmp_path)), "ddp")
    nulls = tmp_path / "nulls"
    nulls.mkdir()
    write_table(
        pa.table({"features": [[1.0]] * 4, "target": pa.array([0, None, 1, 1], pa.int64())}),
        str(nulls / "n.parquet"),
        row_group_rows=2,
    )
    with pytest.raises(ValueError, match=r"n.parquet row group 0: column 'target' has 1 null rows"):
        prepare(with_(cfg, data=str(nulls), batch_size=2), "ddp")


def test_a_row_group_larger_than_the_window_warns_with_the_fix(cfg):
    with pytest.warns(UserWarning, match="python -m ray_jobs.data reshard --row-group-rows R"):
        prepare(with_(cfg, shuffle_window_rows=10), "ddp")


def test_reshard_rewrites_row_groups_and_keeps_the_rows(stream_data, tmp_path, capsys):
    assert data_main(["reshard", stream_data, "--out", str(tmp_path / "out"), "--row-group-rows", "10"]) == 0
    assert block_rows(str(tmp_path / "out")) == [10] * 4 + [10] * 5 + [6] + [10] * 2 + [4]
    assert pq.read_table(str(tmp_path / "out")).equals(pq.read_table(stream_data))
    out = str(tmp_path / "s.parquet")
    assert data_main(["synth", "--out", out, "--rows", "40000"]) == 0
    assert block_rows(out) == [16384, 16384, 7232]  # synth writes row groups of at most 16384 rows


def test_classes_come_from_the_row_groups_statistics_without_reading_the_labels(tmp_path, cfg):
    labels = pa.array([0, 2, 1, 5, 3, 1], pa.int64())  # no raypar.num_classes metadata: K from max 5
    write_table(pa.table({"features": [[1.0]] * 6, "target": labels}), str(tmp_path / "c.parquet"), row_group_rows=2)
    dataset = prepare(with_(cfg, data=str(tmp_path / "c.parquet"), batch_size=2), "ddp").dataset
    assert (dataset.task, dataset.num_classes, [b.label_max for b in dataset.blocks]) == (
        "classification",
        6,
        [2, 5, 3],
    )
