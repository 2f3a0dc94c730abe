"""Streaming ingest: the driver reads metadata only, every strategy trains the single-process
reference's weights in order contract v2's order, and a resume mid-epoch ends the same."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_jobs.config import TrainConfig
from ray_jobs.data import main as data_main
from ray_jobs.data import synthesize, write_table
from ray_jobs.errors import TrainingFailed
from ray_jobs.pipeline import PipelineScaling
from ray_jobs.runner import prepare
from ray_jobs import stream
from ray_jobs.stream import StreamDataset
from tests.helpers import (assert_same_weights, block_rows, load_weights, plain_validation, reference_for,
                           run_strategy, tensors, with_, write_parts)

@pytest.fixture(scope="module")
def stream_data(tmp_path_factory) -> str:
    return write_parts(tmp_path_factory.mktemp("stream"))


@pytest.fixture
def cfg(stream_data, tmp_path) -> TrainConfig:
    # A 24-row window holds 2 to 5 row groups; global batches of 16 straddle windows.
    return TrainConfig(model="seed-mlp", hidden=8, data=stream_data, ingest="stream", shuffle_window_rows=24,
                       epochs=2, batch_size=16, seed=9, momentum=0.9, storage_path=str(tmp_path), name="run")


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
    read_metadata = stream._metadata
    assert prepare(with_(cfg, ingest="auto"), "ddp").dataset.ingest == "memory"
    assert "ingest: memory (the data is 0.0 MiB uncompressed, at most --memory-ingest-limit-mb 1024)" in \
        capsys.readouterr().out
    footers = []
    monkeypatch.setattr(stream, "_metadata", lambda filesystem, file: footers.append(file) or read_metadata(filesystem, file))
    assert prepare(with_(cfg, ingest="auto", memory_ingest_limit_mb=0.001, name="small"), "ddp").dataset.ingest == "stream"
    assert len(footers) == len(set(footers)) == 3  # each file's footer read once, for the size and the plan


def test_what_the_metadata_can_tell_is_found_before_training(tmp_path, cfg):
    write_table(pa.table({"features": [[1.0, 2.0]], "target": [[1.0]]}), str(tmp_path / "a.parquet"))
    write_table(pa.table({"features": [[1.0, 2.0]], "target": pa.array([1], pa.int64())}), str(tmp_path / "b.parquet"))
    with pytest.raises(ValueError, match=r"the files' schemas differ: .*a.parquet has .*b.parquet has"):
        prepare(with_(cfg, data=str(tmp_path)), "ddp")
    nulls = tmp_path / "nulls"
    nulls.mkdir()
    write_table(pa.table({"features": [[1.0]] * 4, "target": pa.array([0, None, 1, 1], pa.int64())}),
                str(nulls / "n.parquet"), row_group_rows=2)
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


@pytest.mark.ray
@pytest.mark.parametrize(("strategy", "options", "shuffle", "task"), [
    ("ddp", {"num_workers": 2}, True, "regression"),
    ("ddp", {"num_workers": 2}, False, "classification"),
    ("dp", {}, True, "regression"),
    ("pipeline", {"scaling": PipelineScaling(num_stages=2, num_microbatches=4, schedule="gpipe")}, True, "regression"),
    ("pipeline", {"scaling": PipelineScaling(num_stages=2, num_microbatches=2, schedule="1f1b")}, False, "regression"),
])
def test_streaming_trains_the_reference_weights(ray_cluster, cfg, tmp_path, strategy, options, shuffle, task):
    """The validation set streams too: 30 rows in row groups of 7, the same numbers as plain PyTorch."""
    val_data = str(tmp_path / "val.parquet")
    write_table(synthesize(30, 6, 4 if task == "classification" else 3, task, seed=4), val_data, row_group_rows=7)
    cfg = with_(cfg, shuffle=shuffle, val_data=val_data)
    if task == "classification":
        (tmp_path / "labels").mkdir()
        cfg = with_(cfg, data=write_parts(tmp_path / "labels", "classification"))
    summary = run_strategy(strategy, cfg, **options)
    expected_weights, expected_losses = reference_for(cfg)
    # as in memory: the gradient's summation order differs from one full-batch mean
    assert_same_weights(load_weights(summary.run_dir), expected_weights)
    assert summary.losses == pytest.approx(expected_losses, rel=1e-5)
    record = json.loads(open(f"{summary.run_dir}/summary.json").read())
    assert record["ingest"] == "stream" and record["resumed_from_step"] is None
    file_bytes = sum(f.stat().st_size for f in Path(cfg.data).glob("*.parquet"))
    assert 0 < record["bytes_read"] <= cfg.epochs * file_bytes  # each row group once per epoch
    assert 0 <= record["data_wait_fraction"] < 1
    val_x, val_y, _ = tensors(val_data)
    expected_val = [plain_validation(record["model"], reference_for(with_(cfg, epochs=epoch))[0], val_x, val_y)
                    for epoch in range(1, cfg.epochs + 1)]
    # float32 whole-set mean vs float64 chunk sums, of weights equal to float tolerance
    assert record["val_losses"] == pytest.approx([loss for loss, _ in expected_val], rel=1e-5)


@pytest.mark.ray
@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_a_kill_after_a_mid_epoch_checkpoint_resumes_at_that_step(ray_cluster, cfg, strategy):
    options = {"num_workers": 2} if strategy == "ddp" else {"scaling": PipelineScaling(num_stages=2)}
    cfg = with_(cfg, checkpoint_every_steps=2, max_failures=1)
    # 7 global batches an epoch: checkpoints after steps 2, 4 and 6; the kill comes after step 3.
    summary = run_strategy(strategy, cfg, crash_at_epoch=1, crash_at_step=3, **options)
    assert (summary.resumed_from_epoch, summary.resumed_from_step) == (1, 2)
    expected_weights, expected_losses = reference_for(cfg)
    assert_same_weights(load_weights(summary.run_dir), expected_weights)
    assert summary.losses == pytest.approx(expected_losses, rel=1e-5)


@pytest.mark.ray
def test_bad_rows_stop_the_run_at_their_window_naming_file_and_row_group(ray_cluster, cfg, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    write_parts(bad)
    table = pq.read_table(bad / "part-2.parquet")
    features = table.column("features").to_pylist()
    features[12][0] = float("nan")  # row group 2 of part-2
    write_table(table.set_column(0, "features", pa.array(features, table.schema.field("features").type)),
                str(bad / "part-2.parquet"), row_group_rows=5)
    with pytest.raises(TrainingFailed, match=r"part-2.parquet row group 2: column 'features' has NaN"):
        run_strategy("ddp", with_(cfg, data=str(bad), shuffle=False, checkpoint_every_steps=2), num_workers=2)
    assert list((tmp_path / "run").glob("checkpoint_epoch_000000_step_*"))  # the last good one is kept


def test_classes_come_from_the_row_groups_statistics_without_reading_the_labels(tmp_path, cfg):
    labels = pa.array([0, 2, 1, 5, 3, 1], pa.int64())  # no raypar.num_classes metadata: K from max 5
    write_table(pa.table({"features": [[1.0]] * 6, "target": labels}), str(tmp_path / "c.parquet"), row_group_rows=2)
    dataset = prepare(with_(cfg, data=str(tmp_path / "c.parquet"), batch_size=2), "ddp").dataset
    assert (dataset.task, dataset.num_classes, [b.label_max for b in dataset.blocks]) == ("classification", 6, [2, 5, 3])
